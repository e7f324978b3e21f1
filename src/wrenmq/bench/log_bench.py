"""Commit log throughput: appends (with and without fsync per batch) and reads.

    python -m wrenmq.bench.log_bench [--dir DIR] [--seconds 2] [--trials 3] [--json]

Append: what the store's writer thread does per group commit, timed together:
build the batch from per-record columns (`format.encode_batch_parts`), append it
to a `CommitLog` (64 MiB segments, 4 KiB index interval: the defaults) and, in
the fsync rows, `fdatasync` after every batch (`[storage] fsync = "always"`).
Records are realistic broker traffic: 100 topics, 10 client ids, no properties,
random (incompressible) payloads of the given size. Each case runs `--trials`
times in a fresh directory, for `--seconds` or `--max-records`, whichever comes
first; the best trial counts (the machine may be shared). Without fsync the
numbers are the cost of getting the data into the page cache; a sustained rate
above the disk's write bandwidth is throttled by the kernel's writeback.

Read: a full scan of the logs just written (so from the page cache) through
`LogReader.records()` (one Python object per record) and `arrow.read_arrow()`
(pyarrow RecordBatches over the batch bytes), with and without a topic filter.

The directory defaults to a temporary one under the current directory, so the
numbers are for the disk the data would live on (not a tmpfs /tmp).
"""

import argparse
import json
import os
import platform
import random
import shutil
import tempfile
import time

from ..store import format as fmt
from ..store.log import CommitLog
from ..store.reader import LogReader

_MB = 1_000_000


def _encoder():
    parts = getattr(fmt, "encode_batch_parts", None)
    return parts if parts is not None else fmt.encode_batch


def append_case(directory, payload_size, batch, fsync, seconds, max_records):
    rng = random.Random(payload_size * 1000 + batch)
    payloads = [rng.randbytes(payload_size) for _ in range(257)]
    topics = [f"bench/sensor/{i}/value".encode() for i in range(100)]
    clients = [f"bench-client-{i}".encode() for i in range(10)]
    encode = _encoder()
    log = CommitLog(directory)
    n = written = 0
    encode_s = 0.0
    flags = [1] * batch
    props = [b""] * batch
    pids = [0] * batch
    start = time.perf_counter()
    cpu = time.process_time()
    deadline = start + seconds
    while True:
        t0 = time.perf_counter()
        now = int(time.time() * 1_000_000)
        ts = [now] * batch
        data = encode(n, ts, flags, [topics[(n + i) % 100] for i in range(batch)],
                      [clients[(n + i) % 10] for i in range(batch)], props,
                      [payloads[(n + i) % 257] for i in range(batch)], pids)
        encode_s += time.perf_counter() - t0
        log.append(data, n, batch, now, now)
        if fsync:
            log.sync()
        n += batch
        written += sum(map(len, data)) if isinstance(data, tuple) else len(data)
        if n >= max_records or time.perf_counter() >= deadline:
            break
    elapsed = time.perf_counter() - start
    cpu = time.process_time() - cpu
    log.close()
    return {
        "payload_bytes": payload_size, "batch_records": batch, "fsync": fsync,
        "records": n, "batches": n // batch, "log_bytes": written, "seconds": elapsed,
        "records_per_s": n / elapsed, "log_mb_per_s": written / elapsed / _MB,
        "payload_mb_per_s": n * payload_size / elapsed / _MB,
        "us_per_batch": elapsed / (n / batch) * 1e6, "encode_share": encode_s / elapsed,
        "cpu_share": cpu / elapsed,
    }


def _timed(fn, repeat):
    best = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        n = fn()
        dt = time.perf_counter() - t0
        best = dt if best is None or dt < best else best
    return n, best


def read_cases(directory, payload_size, repeat):
    from ..store.arrow import read_arrow

    reader = LogReader(directory)
    total = reader.end_offset - reader.start_offset
    size = sum(s.size for s in reader.segments)
    flt = ["bench/sensor/7/+"]
    out = []

    def records_all():
        n = 0
        for _ in reader.records():
            n += 1
        return n

    def records_filtered():
        return sum(1 for _ in reader.records(topic_filters=flt))

    def arrow_all():
        return sum(rb.num_rows for rb in read_arrow(reader))

    def arrow_filtered():
        return sum(rb.num_rows for rb in read_arrow(reader, topic_filters=flt))

    for name, fn in (("records()", records_all), ("read_arrow()", arrow_all),
                     ("records(topic_filters)", records_filtered),
                     ("read_arrow(topic_filters)", arrow_filtered)):
        fn()  # warm the page cache
        n, secs = _timed(fn, repeat)
        out.append({"reader": name, "payload_bytes": payload_size, "records_scanned": total,
                    "records_returned": n, "seconds": secs, "records_per_s": total / secs,
                    "mb_per_s": size / secs / _MB})
    reader.close()
    return out


def _markdown(appends, reads):
    lines = ["| payload | records/batch | fsync per batch | records/s | log MB/s | payload MB/s "
             "| µs/batch | encode share |",
             "|---:|---:|:---:|---:|---:|---:|---:|---:|"]
    for a in appends:
        lines.append(f"| {a['payload_bytes']} B | {a['batch_records']} | {'yes' if a['fsync'] else 'no'} "
                     f"| {a['records_per_s']:,.0f} | {a['log_mb_per_s']:.1f} | {a['payload_mb_per_s']:.1f} "
                     f"| {a['us_per_batch']:,.0f} | {a['encode_share']:.0%} |")
    lines += ["", "| reader | payload | records scanned | returned | records/s (scanned) | MB/s |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in reads:
        lines.append(f"| `{r['reader']}` | {r['payload_bytes']} B | {r['records_scanned']:,} "
                     f"| {r['records_returned']:,} | {r['records_per_s']:,.0f} | {r['mb_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m wrenmq.bench.log_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", help="where to write (default: a temporary directory under .)")
    ap.add_argument("--seconds", type=float, default=2.0, help="time per append trial (default 2)")
    ap.add_argument("--max-records", type=int, default=500_000, help="records per append trial at most")
    ap.add_argument("--trials", type=int, default=3, help="append trials per case; the best counts")
    ap.add_argument("--repeat", type=int, default=3, help="read passes per case; the best counts")
    ap.add_argument("--json", action="store_true", help="print JSON instead of Markdown")
    args = ap.parse_args(argv)
    root = tempfile.mkdtemp(prefix="log-bench-", dir=args.dir or ".")
    try:
        appends = []
        reads = []
        for payload in (100, 1024):
            for batch in (50, 500):
                for fsync in (False, True):
                    d = os.path.join(root, f"p{payload}-b{batch}-{'sync' if fsync else 'nosync'}")
                    best = None
                    for _ in range(max(1, args.trials)):
                        shutil.rmtree(d, ignore_errors=True)
                        r = append_case(d, payload, batch, fsync, args.seconds, args.max_records)
                        if best is None or r["records_per_s"] > best["records_per_s"]:
                            best = r
                    appends.append(best)
                    if fsync or batch != 500:
                        shutil.rmtree(d, ignore_errors=True)
            reads += read_cases(os.path.join(root, f"p{payload}-b500-nosync"), payload, args.repeat)
        info = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
                "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs",
                "appends": appends, "reads": reads}
        if args.json:
            print(json.dumps(info, indent=2))
        else:
            print(f"{info['date']}, Python {info['python']}, {info['machine']}\n")
            print(_markdown(appends, reads))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
