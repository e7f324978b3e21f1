"""`make bench`: every comparison the project tracks, in one run.

    python -m wrenmq.bench.suite [--quick] [--repeat N] [--markdown FILE]

1. wrenmq (commit log off) vs Mosquitto: every mqload row, MQTT 3.1.1 and 5.0.
2. The commit log on (fsync every 100 ms) against off: the QoS 0 rows, the two
   alternating round by round; then what the log costs in broker CPU per message at
   a fixed rate (logcost.py).
3. Durability: the seed workload at QoS 1 with fsync "always" and "never", and Mosquitto
   (which cannot make that promise).
4. Hostile load: a well-behaved pair's latency while thousands of connections say
   nothing and flooders publish at ten times their limit (hostile.py).

`--quick` runs part 1 once (under two minutes on 2 cores). Each part's brokers
alternate run by run; tables give min / median / max and ratios of medians.
"""

import argparse
import datetime as dt
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from . import harness, hostile, logcost

HERE = Path(__file__).parent
LOG_ROWS = ["a1", "a2", "b0", "c", "d"]


def _harness(args, label):
    out = tempfile.mktemp(suffix=".json", prefix="wrenmq-bench-")
    print(f"\n### {label}\n", flush=True)
    rc = harness.main(args + ["--json", out])
    data = json.loads(Path(out).read_text()) if os.path.exists(out) else None
    return rc, data


def _medians(doc, broker="wrenmq"):
    out = {}
    for row in (doc or {}).get("summary", []):
        med = (row.get(broker) or {}).get("median")
        out[(row["scenario"], row["metric"])] = med
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="part 1 only, one run per row")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--markdown", metavar="FILE", help="also write the summary as Markdown to FILE")
    a = p.parse_args(argv)
    rep = ["--repeat", "1" if a.quick else str(a.repeat)]
    if a.quick:
        rep.append("--quick")
    lines = [f"wrenmq benchmark suite, {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, "
             f"{os.cpu_count()} CPUs, command: python -m wrenmq.bench.suite {' '.join(argv or sys.argv[1:])}"]
    rcs = []

    rc, _ = _harness(rep + ["--wrenmq-config", str(HERE / "wrenmq-memory.toml")],
                            "1. wrenmq (log off) vs Mosquitto")
    rcs.append(rc)
    if a.quick:
        return max(rcs)

    # Log off and log on alternate row set by row set (one run of each row per round):
    # this VM's speed drifts by 15-40% over minutes, so comparing the log-on runs with
    # part 1's log-off runs, taken earlier, measured the drift as much as the log.
    rounds = a.repeat
    runs = {"off": {}, "on": {}}
    for i in range(rounds):
        for side, cfg in (("off", "wrenmq-memory.toml"), ("on", "wrenmq-log.toml")):
            rc, doc = _harness(["--repeat", "1", "--scenarios", ",".join(LOG_ROWS), "--only", "wrenmq",
                                "--wrenmq-config", str(HERE / cfg)],
                               f"2. commit log {side} (round {i + 1} of {rounds}; on = fsync interval 100 ms)")
            rcs.append(rc)
            for key, v in _medians(doc).items():
                if v:
                    runs[side].setdefault(key, []).append(v)
    lines.append(f"\nCommit log on / off (wrenmq, {rounds} alternating rounds, medians):")
    for key, ons in runs["on"].items():
        offs = runs["off"].get(key)
        if offs:
            off_m, on_m = statistics.median(offs), statistics.median(ons)
            lines.append(f"  {key[0]:<4} {key[1]:<22} off {off_m:>10,.0f}  on {on_m:>10,.0f}  "
                         f"on/off {on_m / off_m:.2f}x")

    print("\n### 2b. commit log cost in broker CPU at a fixed rate\n", flush=True)
    cjson = tempfile.mktemp(suffix=".json")
    rcs.append(logcost.main(["--repeat", str(a.repeat), "--json", cjson]))
    if os.path.exists(cjson):
        lines.append("\nCommit log cost (broker CPU per delivered message, QoS 0, 1 -> 1, fixed rate):")
        for r in json.loads(Path(cjson).read_text()):
            us = r["us_per_msg"]
            lines.append(f"  {r['row']:<6} at {r['rate']:>7,}/s  off {us['off']:.2f} us  on {us['on']:.2f} us  "
                         f"off/on {r['off_on_ratio']:.2f}x")

    rc, dur_doc = _harness(rep + ["--scenarios", "q1", "--wrenmq-config", str(HERE / "wrenmq-durable.toml")],
                           "3a. durability: QoS 1, fsync always, vs Mosquitto")
    rcs.append(rc)
    rc, nosync_doc = _harness(rep + ["--scenarios", "q1", "--only", "wrenmq",
                                     "--wrenmq-config", str(HERE / "wrenmq-nosync.toml")],
                              "3b. durability baseline: QoS 1, fsync never")
    rcs.append(rc)
    always = _medians(dur_doc).get(("q1", "routed_msgs_per_sec"))
    never = _medians(nosync_doc).get(("q1", "routed_msgs_per_sec"))
    mosq = _medians(dur_doc, "mosquitto").get(("q1", "routed_msgs_per_sec"))
    if always and never:
        lines.append(f"\nDurability (q1, routed msg/s): fsync always {always:,.0f}, never {never:,.0f}, "
                     f"Mosquitto {mosq or 0:,.0f}; always/never {always / never:.2f}x"
                     + (f", always/Mosquitto {always / mosq:.2f}x" if mosq else ""))

    print("\n### 4. hostile load\n", flush=True)
    hjson = tempfile.mktemp(suffix=".json")
    rcs.append(hostile.main(["--json", hjson]))
    if os.path.exists(hjson):
        for r in json.loads(Path(hjson).read_text()):
            lines.append(f"\nHostile ({r['broker']}): quiet p99 {r['quiet']['p99']:.0f} us, hostile p99 "
                         f"{r['hostile']['p99']:.0f} us ({r['silent_connections']} silent connections, "
                         f"{r['flooders']} flooders at {r['flood_rate_per_client']}/s): {r['p99_ratio']}x")
    summary = "\n".join(lines)
    print("\n" + summary)
    if a.markdown:
        Path(a.markdown).write_text("```\n" + summary + "\n```\n")
    return max(rcs)


if __name__ == "__main__":
    sys.exit(main())
