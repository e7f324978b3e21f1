"""The `wrenmq` Spark source against `spark.read.parquet` of the same rows, in one run.

    python -m wrenmq.bench.pipeline_bench [--records 1000000] [--payload 64] [--repeat 3]

Writes a log of N records with the store's own CommitLog (topics of ~20 bytes, JSON-ish
payloads, one record in 10 with MQTT 5 properties, group commits of 200 records), copies the
same rows to Parquet with Spark (snappy, as `archive` writes them), then times full scans of
every column through Spark's `noop` sink: the log via `spark.read.format("wrenmq")` and the
Parquet copy via `spark.read.parquet`, alternating, best of --repeat. Also times the source's
`read()` alone (log -> Arrow batches in Spark's schema, in this process, no Spark).
"""

import argparse
import json
import os
import shutil
import tempfile
import time


def build_log(data_dir, n, payload_size, per_batch=200, node="bench"):
    from ..store.format import encode_batch
    from ..store.log import CommitLog
    from ..mqtt.codec import encode_properties

    enc = encode_properties({"content_type": "application/json", "user_property": [("site", "a")]})
    props = enc[1:]
    log = CommitLog(os.path.join(data_dir, "log", node))
    t0 = int(time.time() * 1e6) - n * 1000
    pad = "x" * max(0, payload_size - 40)
    base = 0
    while base < n:
        k = min(per_batch, n - base)
        idx = range(base, base + k)
        ts = [t0 + i * 1000 for i in idx]
        topics = [f"site-{i % 7}/dev{i % 1000:04d}/t".encode() for i in idx]
        clients = [f"dev{i % 1000:04d}".encode() for i in idx]
        pr = [props if i % 10 == 0 else b"" for i in idx]
        pl = [f'{{"seq": {i}, "v": {i % 97}, "p": "{pad}"}}'.encode() for i in idx]
        data = encode_batch(base, ts, [1] * k, topics, clients, pr, pl)
        log.append(data, base, k, ts[0], ts[-1])
        base += k
    log.sync()
    size = sum(s.size for s in log.segments)
    log.close()
    return size


def seconds(fn):
    """How long `fn()` took, in seconds."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def python_read_rate(data_dir, n):
    from ..pipeline.common import list_partitions, log_root
    from ..pipeline.source import LogPartition, read_partition

    (node, d), = list_partitions(log_root(data_dir)).items()
    rows = 0
    t = time.perf_counter()
    for rb in read_partition(LogPartition(node, d, 0, n), None):
        rows += rb.num_rows
    dt = time.perf_counter() - t
    assert rows == n, rows
    return n / dt


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m wrenmq.bench.pipeline_bench", description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=1_000_000)
    p.add_argument("--payload", type=int, default=64, help="approximate payload bytes")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--master", default="local[*]")
    p.add_argument("--max-records-per-partition", type=int, default=None,
                   help="source option (default: the source's default)")
    p.add_argument("--dir", help="work dir (default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    a = p.parse_args(argv)

    work = a.dir or tempfile.mkdtemp(prefix="wrenmq-pipeline-bench-")
    data = os.path.join(work, "data")
    pq_dir = os.path.join(work, "parquet")
    shutil.rmtree(data, ignore_errors=True)
    shutil.rmtree(pq_dir, ignore_errors=True)
    try:
        t = time.perf_counter()
        log_bytes = build_log(data, a.records, a.payload)
        print(f"log: {a.records:,} records, {log_bytes / 1e6:.1f} MB ({log_bytes / a.records:.0f} B/record), "
              f"written in {time.perf_counter() - t:.1f} s")
        py_rate = max(python_read_rate(data, a.records) for _ in range(2))
        print(f"read() alone (log -> Spark-schema Arrow batches, one process): {py_rate:,.0f} rows/s")

        from ..pipeline.spark import session
        spark = session(a.master, app_name="wrenmq-pipeline-bench")
        reader = spark.read.format("wrenmq")
        if a.max_records_per_partition:
            reader = reader.option("maxRecordsPerPartition", str(a.max_records_per_partition))
        src = reader.load(data)
        t = time.perf_counter()
        src.write.mode("overwrite").parquet(pq_dir)
        pq_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(pq_dir) for f in fs
                       if f.endswith(".parquet"))
        print(f"parquet copy: {pq_bytes / 1e6:.1f} MB, written in {time.perf_counter() - t:.1f} s")
        pq = spark.read.parquet(pq_dir)
        assert pq.count() == a.records and src.count() == a.records
        wren_times, pq_times = [], []
        for _ in range(a.repeat):
            wren_times.append(seconds(lambda: src.write.format("noop").mode("overwrite").save()))
            pq_times.append(seconds(lambda: pq.write.format("noop").mode("overwrite").save()))
        wren, par = a.records / min(wren_times), a.records / min(pq_times)
        parts = src.rdd.getNumPartitions()
        spark.stop()
        result = {"records": a.records, "log_bytes": log_bytes, "parquet_bytes": pq_bytes,
                  "master": a.master, "cores": os.cpu_count(), "source_partitions": parts,
                  "read_alone_rows_per_s": round(py_rate), "wrenmq_rows_per_s": round(wren),
                  "parquet_rows_per_s": round(par), "ratio": round(wren / par, 3),
                  "wrenmq_seconds": [round(x, 3) for x in wren_times],
                  "parquet_seconds": [round(x, 3) for x in pq_times]}
        print(f"spark.read.format('wrenmq'): {wren:,.0f} rows/s (best of {a.repeat}: "
              f"{min(wren_times):.2f} s, {parts} partitions)")
        print(f"spark.read.parquet:          {par:,.0f} rows/s (best of {a.repeat}: {min(pq_times):.2f} s)")
        print(f"ratio wrenmq / parquet: {wren / par:.2f}x")
        if a.json:
            print(json.dumps(result))
        return result
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
