"""Hostile load: does one well-behaved pair keep its latency while others attack?

    python -m wrenmq.bench.hostile [--silent 5000] [--flooders 5] [--only wrenmq]

For each broker: measure a publisher -> subscriber pair at a fixed rate (mqload
`pubsub --rate`), first on a quiet broker, then while (a) thousands of TCP
connections are open and say nothing and (b) flooders publish at ten times their
per-client rate limit. Prints p50/p99 quiet vs hostile and their ratio (the target:
hostile p99 within 2x of quiet p99), as medians of `--repeat` rounds (a p99 of 4000
samples on a shared 2-core machine moves by tens of percent from round to round). wrenmq runs with `[limits] publish_rate` set
(src/wrenmq/bench/wrenmq-hostile.toml); Mosquitto has no per-client rate limit, so
its row shows what an unlimited flood does.
"""

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .brokers import HOST, Mosquitto, Wrenmq, which
from .harness import bench_setup

RATE_LIMIT = 500  # publish_rate in wrenmq-hostile.toml
# The well-behaved pair stays under the limit; 4000 samples give a stable p99.
PAIR = ["pubsub", "--pubs", "1", "--subs", "1", "--topic-mode", "single", "--rate", "400",
        "--duration", "10", "--size", "64", "--topic-prefix", "pair"]


def _pair(mqload, port, pid):
    cp = subprocess.run([mqload, *PAIR, "--host", HOST, "--port", str(port), "--broker-pid", str(pid),
                         "--timeout", "60"], capture_output=True, text=True, timeout=120)
    for line in reversed(cp.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"mqload gave no result: {cp.stderr[-300:]}")


def _silent(port, n, hold, opened):
    socks = []
    for _ in range(n):
        try:
            s = socket.create_connection((HOST, port), timeout=5)
            socks.append(s)
        except OSError:
            break
    opened.append(len(socks))
    time.sleep(hold)
    for s in socks:
        s.close()


def _hostile_pair(broker, mqload, silent, flooders):
    """The pair's latency while `silent` connections idle and `flooders` flood."""
    opened = []
    t = threading.Thread(target=_silent, args=(broker.port, silent, 18, opened), daemon=True)
    t.start()
    while not opened and t.is_alive():
        time.sleep(0.1)
    flood = subprocess.Popen(
        [mqload, "pubsub", "--pubs", str(flooders), "--subs", "1", "--rate", str(10 * RATE_LIMIT),
         "--duration", "13", "--size", "256", "--topic-prefix", "flood", "--host", HOST,
         "--port", str(broker.port), "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(1.5)  # let the flood reach its rate limit
    hostile = _pair(mqload, broker.port, broker.pid)
    flood.wait(60)
    t.join(30)
    return hostile, opened[0] if opened else 0


def measure(name, broker, mqload, silent, flooders, repeat=1):
    """`repeat` rounds of (quiet pair, hostile pair) on one broker; p99s are medians."""
    broker.start()
    try:
        rounds = []
        for _ in range(repeat):
            quiet = _pair(mqload, broker.port, broker.pid)
            hostile, opened = _hostile_pair(broker, mqload, silent, flooders)
            rounds.append((quiet, hostile, opened))
    finally:
        broker.stop()

    def med(phase, key):
        return statistics.median(r[phase]["latency_us"][key] for r in rounds)

    return {"broker": name, "silent_connections": min(r[2] for r in rounds),
            "flooders": flooders, "flood_rate_per_client": 10 * RATE_LIMIT, "rounds": repeat,
            "quiet": {"p50": med(0, "p50"), "p99": med(0, "p99")},
            "hostile": {"p50": med(1, "p50"), "p99": med(1, "p99")},
            "round_ratios": [round(h["latency_us"]["p99"] / q["latency_us"]["p99"], 2)
                             for q, h, _ in rounds],
            "hostile_lost": sum(r[1].get("lost") or 0 for r in rounds),
            "quiet_lost": sum(r[0].get("lost") or 0 for r in rounds)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--silent", type=int, default=5000, help="idle connections (default 5000)")
    p.add_argument("--flooders", type=int, default=5, help="clients publishing at 10x their limit")
    p.add_argument("--repeat", type=int, default=3,
                   help="rounds of quiet + hostile per broker; p99s are medians (default 3)")
    p.add_argument("--only", choices=["wrenmq", "mosquitto"])
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    root, mqload, wrenmq, log_dir = bench_setup()
    here = Path(__file__).parent
    results = []
    if a.only in (None, "wrenmq"):
        w = Wrenmq(wrenmq, 18832, log_dir, root, config=str(here / "wrenmq-hostile.toml"))
        results.append(measure("wrenmq", w, mqload, a.silent, a.flooders, a.repeat))
    if a.only in (None, "mosquitto") and which("mosquitto"):
        conf = Path(tempfile.mkdtemp()) / "mosquitto.conf"
        conf.write_text("listener 18833 127.0.0.1\nallow_anonymous true\nmax_connections -1\n"
                        "log_dest none\n")
        m = Mosquitto(which("mosquitto"), conf, log_dir, root)
        results.append(measure("mosquitto", m, mqload, a.silent, a.flooders, a.repeat))
    for r in results:
        q, h = r["quiet"], r["hostile"]
        r["p99_ratio"] = round(h["p99"] / q["p99"], 2) if q.get("p99") else None
        print(f"{r['broker']:<10} quiet p50 {q['p50']:.0f} us p99 {q['p99']:.0f} us | hostile "
              f"({r['silent_connections']} silent, {r['flooders']} x {r['flood_rate_per_client']}/s) "
              f"p50 {h['p50']:.0f} us p99 {h['p99']:.0f} us, lost {r['hostile_lost']} | p99 ratio "
              f"{r['p99_ratio']}x (medians of {r['rounds']} rounds; per round {r['round_ratios']})")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
