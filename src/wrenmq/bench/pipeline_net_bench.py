"""The `wrenmq` Spark source over the network against its filesystem form and Parquet, in one run.

    python -m wrenmq.bench.pipeline_net_bench [--records 1000000] [--payload 64] [--repeat 3]

Writes a log of N records with the store's own CommitLog (as pipeline_bench does), starts
`wrenmq serve` on that data dir with an admin listener (loopback, anonymous read), copies the
rows to Parquet with Spark, then times full scans of every column through Spark's `noop`
sink, in turn, best of --repeat: `spark.read.format("wrenmq").load("wrenmq://127.0.0.1:PORT")`
(every task fetches its range from the broker as an Arrow IPC stream over HTTP), the same
source on the data dir, and `spark.read.parquet` of the same rows. Both source forms use the
same input partitions (maxRecordsPerPartition). Also times one process reading the whole log
both ways without Spark (`read_range` over HTTP, `read_partition` from the files).

The broker, the Spark JVM and its Python workers share this machine's cores, as they would
on one host; on a cluster the broker's work (reading, Arrow, HTTP) and the executors' are on
different machines.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from .pipeline_bench import build_log, seconds


def _serve(work, data_dir, node):
    from ..ports import free_port

    port, admin = free_port(), free_port()
    cfg = os.path.join(work, "wrenmq.toml")
    with open(cfg, "w") as fh:
        fh.write(f'[broker]\nnode_id = "{node}"\n[[listener]]\nbind = "127.0.0.1"\nport = {port}\n'
                 f'[[listener]]\ntype = "admin"\nbind = "127.0.0.1"\nport = {admin}\nanonymous = "read"\n'
                 f'[storage]\ndata_dir = "{data_dir}"\n')
    log = open(os.path.join(work, "wrenmq.log"), "wb")
    proc = subprocess.Popen([sys.executable, "-m", "wrenmq", "serve", "--config", cfg], stdout=log,
                            stderr=subprocess.STDOUT)
    return proc, log, f"http://127.0.0.1:{admin}"


def _wait_listing(net, n, proc, timeout=60):
    from ..pipeline.netlog import NetError, list_partitions

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"wrenmq serve exited with {proc.returncode}")
        try:
            listing = list_partitions(net)
            if listing and max(s["end_offset"] for s in next(iter(listing.values()))) >= n:
                return listing
        except NetError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the broker's admin listener did not list the log")
        time.sleep(0.3)


def read_alone(data_dir, url, node, n):
    """(files rows/s, network rows/s) of one process reading the log, no Spark."""
    from ..pipeline.netlog import Net, read_range
    from ..pipeline.source import LogPartition, read_partition

    def files():
        rows = sum(rb.num_rows for rb in read_partition(LogPartition(node, os.path.join(data_dir, "log", node), 0, n),
                                                        None))
        assert rows == n, rows

    def network():
        rows = sum(rb.num_rows for rb in read_range(Net(url), node, [url], 0, n))
        assert rows == n, rows

    return n / min(seconds(files) for _ in range(2)), n / min(seconds(network) for _ in range(2))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m wrenmq.bench.pipeline_net_bench", description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--payload", type=int, default=64, help="approximate payload bytes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--master", default="local[*]")
    p.add_argument("--max-records-per-partition", type=int, default=None,
                   help="source option, both forms (default: the source's default)")
    p.add_argument("--compression", choices=("none", "lz4", "zstd"), default=None,
                   help="Arrow IPC compression over the wire (source option; default none)")
    p.add_argument("--dir", help="work dir (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)

    from ..pipeline.netlog import Net

    node = "bench"
    work = a.dir or tempfile.mkdtemp(prefix="wrenmq-pipeline-net-bench-")
    data = os.path.join(work, "data")
    pq_dir = os.path.join(work, "parquet")
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(pq_dir, ignore_errors=True)
    proc = log = spark = None
    try:
        t = time.perf_counter()
        log_bytes = build_log(data, a.records, a.payload, node=node)
        print(f"log: {a.records:,} records, {log_bytes / 1e6:.1f} MB ({log_bytes / a.records:.0f} B/record), "
              f"written in {time.perf_counter() - t:.1f} s")
        proc, log, url = _serve(work, data, node)
        _wait_listing(Net(url), a.records, proc)
        files_alone, net_alone = read_alone(data, url, node, a.records)
        print(f"one process, no Spark: files {files_alone:,.0f} rows/s, network {net_alone:,.0f} rows/s "
              f"({net_alone / files_alone:.2f}x)")

        from ..pipeline.spark import session
        spark = session(a.master, app_name="wrenmq-pipeline-net-bench")
        opts = {}
        if a.max_records_per_partition:
            opts["maxRecordsPerPartition"] = str(a.max_records_per_partition)
        net_opts = dict(opts, compression=a.compression) if a.compression else opts
        net_df = spark.read.format("wrenmq").options(**net_opts).load("wrenmq://" + url.split("://", 1)[1])
        fs_df = spark.read.format("wrenmq").options(**opts).load(data)
        t = time.perf_counter()
        fs_df.write.mode("overwrite").parquet(pq_dir)
        print(f"parquet copy written in {time.perf_counter() - t:.1f} s")
        pq = spark.read.parquet(pq_dir)
        assert pq.count() == a.records and fs_df.count() == a.records and net_df.count() == a.records
        times = {"network": [], "files": [], "parquet": []}
        for _ in range(a.repeat):
            for name, df in (("network", net_df), ("files", fs_df), ("parquet", pq)):
                times[name].append(seconds(lambda: df.write.format("noop").mode("overwrite").save()))
        rates = {k: a.records / min(v) for k, v in times.items()}
        parts = net_df.rdd.getNumPartitions()
        result = {"records": a.records, "log_bytes": log_bytes, "master": a.master, "cores": os.cpu_count(),
                  "source_partitions": parts, "compression": a.compression or "none",
                  "alone_files_rows_per_s": round(files_alone), "alone_network_rows_per_s": round(net_alone),
                  **{f"{k}_rows_per_s": round(v) for k, v in rates.items()},
                  "network_vs_files": round(rates["network"] / rates["files"], 3),
                  "network_vs_parquet": round(rates["network"] / rates["parquet"], 3),
                  **{f"{k}_seconds": [round(x, 3) for x in v] for k, v in times.items()}}
        print(f"spark.read.format('wrenmq') over the network: {rates['network']:,.0f} rows/s "
              f"(best of {a.repeat}: {min(times['network']):.2f} s, {parts} partitions)")
        print(f"spark.read.format('wrenmq') from the files:   {rates['files']:,.0f} rows/s "
              f"(best of {a.repeat}: {min(times['files']):.2f} s)")
        print(f"spark.read.parquet:                           {rates['parquet']:,.0f} rows/s "
              f"(best of {a.repeat}: {min(times['parquet']):.2f} s)")
        print(f"network / files: {result['network_vs_files']:.2f}x; network / parquet: "
              f"{result['network_vs_parquet']:.2f}x")
        if a.json:
            print(json.dumps(result))
        return result
    finally:
        if spark is not None:
            spark.stop()
        if proc is not None:
            proc.terminate()
            proc.wait(30)
            log.close()
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
