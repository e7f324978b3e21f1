"""What the commit log costs in broker CPU, at a fixed message rate.

    python -m wrenmq.bench.logcost [--repeat 3] [--duration 4] [--json OUT]

Throughput rows on a 2-core machine shared with the load generator vary by 15-40% from
run to run; the broker's CPU time for a fixed amount of work varies by a few percent.
For each row, wrenmq runs with the log off (`wrenmq-memory.toml`) and on
(`wrenmq-log.toml`, fsync every 100 ms), alternating, while mqload sends one publisher
-> one subscriber QoS 0 stream at a fixed rate; the broker's user + system CPU time
(/proc/<pid>/stat) is divided by the messages delivered. "off / on" is the share of the
log-off throughput the broker could reach with the log on if CPU were the only limit.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from .brokers import HOST, Wrenmq
from .harness import bench_setup

HERE = Path(__file__).parent
ROWS = [  # (label, payload bytes, messages per second)
    ("64 B", 64, 100_000),
    ("1 KiB", 1024, 50_000),
    ("4 KiB", 4096, 25_000),
]
CONFIGS = [("off", "wrenmq-memory.toml"), ("on", "wrenmq-log.toml")]


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(mqload, broker, size, rate, duration):
    broker.start()
    try:
        before = _cpu_seconds(broker.pid)
        cp = subprocess.run(
            [mqload, "pubsub", "--pubs", "1", "--subs", "1", "--topic-mode", "single",
             "--rate", str(rate), "--duration", str(duration), "--size", str(size),
             "--host", HOST, "--port", str(broker.port), "--timeout", "60"],
            capture_output=True, text=True, timeout=120)
        cpu = _cpu_seconds(broker.pid) - before
    finally:
        broker.stop()
    doc = next((json.loads(line) for line in reversed(cp.stdout.splitlines()) if line.startswith("{")),
               None)
    if doc is None or not doc.get("delivered"):
        raise RuntimeError(f"mqload gave no result: {cp.stderr[-300:]}")
    return {"cpu_s": cpu, "delivered": doc["delivered"], "lost": doc.get("lost", 0),
            "us_per_msg": cpu / doc["delivered"] * 1e6}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--duration", type=float, default=4.0, help="seconds per run")
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    root, mqload, wrenmq, log_dir = bench_setup()
    results = []
    print(f"{'row':<8} {'rate':>8} {'log off us/msg':>15} {'log on us/msg':>14} {'off / on':>9}  lost")
    for label, size, rate in ROWS:
        runs = {name: [] for name, _ in CONFIGS}
        for _ in range(a.repeat):
            for name, conf in CONFIGS:
                broker = Wrenmq(wrenmq, 18834, log_dir, root, config=str(HERE / conf))
                runs[name].append(run_once(mqload, broker, size, rate, a.duration))
        med = {name: statistics.median(r["us_per_msg"] for r in rs) for name, rs in runs.items()}
        lost = sum(r["lost"] for rs in runs.values() for r in rs)
        ratio = med["off"] / med["on"]
        results.append({"row": label, "size": size, "rate": rate, "us_per_msg": med,
                        "off_on_ratio": round(ratio, 3), "lost": lost, "runs": runs})
        print(f"{label:<8} {rate:>8} {med['off']:>15.2f} {med['on']:>14.2f} {ratio:>8.2f}x  {lost}",
              flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0 if all(r["lost"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
