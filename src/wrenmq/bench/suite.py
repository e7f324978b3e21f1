"""`make bench`: every comparison the project tracks, in one run.

    python -m wrenmq.bench.suite [--quick] [--repeat N] [--markdown FILE]

1. wrenmq (commit log off) vs Mosquitto: every mqload row, MQTT 3.1.1 and 5.0.
2. The commit log on (fsync every 100 ms) against off: the QoS 0 rows, both brokers
   up, alternating run by run (logrows.py); then what the log costs in broker CPU per
   message at a fixed rate (logcost.py).
3. Durability: the seed workload at QoS 1 with fsync "always" and "never", and Mosquitto
   (which cannot make that promise).
4. Hostile load: a well-behaved pair's latency while thousands of connections say
   nothing and flooders publish at ten times their limit (hostile.py).
5. A large retained match: an unrelated client's connect-to-delivery while a SUBSCRIBE
   matches 20,000 retained messages on 63-level topics (bounds.py stall).

`--quick` runs part 1 once (under two minutes on 2 cores). Each part's brokers
alternate run by run; tables give min / median / max and ratios of medians.
"""

import argparse
import datetime as dt
import json
import os
import sys
import tempfile
from pathlib import Path

from . import bounds, harness, hostile, logcost, logrows

HERE = Path(__file__).parent


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
    p.add_argument("--log-rounds", type=int, default=logrows.ROUNDS,
                   help=f"rounds of part 2, log off vs on (default {logrows.ROUNDS})")
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

    # Log off and log on: two brokers up at once, alternating run by run (logrows.py).
    print(f"\n### 2. commit log off vs on ({a.log_rounds} rounds; on = fsync interval 100 ms)\n",
          flush=True)
    ljson = tempfile.mktemp(suffix=".json")
    rcs.append(logrows.main(["--rounds", str(a.log_rounds), "--json", ljson]))
    if os.path.exists(ljson):
        doc = json.loads(Path(ljson).read_text())
        lines.append(f"\nCommit log on / off (wrenmq, both up, {a.log_rounds} rounds alternating run "
                     f"by run, medians; 'pairs' = median of each back-to-back pair's ratio):")
        for r in doc["rows"]:
            lo, hi = r["ratio_interval"]
            lines.append(f"  {r['row']:<4} {r['metric']:<22} off {r['off_median']:>10,.0f}  "
                         f"on {r['on_median']:>10,.0f}  on/off {r['ratio']:.2f}x ({lo:.2f}-{hi:.2f}x, "
                         f"90% bootstrap)  pairs {r['pair_ratio_median']:.2f}x")
        for line in doc["problems"]:
            lines.append(f"  problem: {line}")

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

    print("\n### 5. a large retained match\n", flush=True)
    sjson = tempfile.mktemp(suffix=".json")
    rcs.append(bounds.main(["stall", "--mosquitto", "--json", sjson]))
    if os.path.exists(sjson):
        for r in json.loads(Path(sjson).read_text()):
            lines.append(f"\nRetained match ({r['broker']}): an unrelated client's connect-to-delivery while a "
                         f"SUBSCRIBE to {r['filter']!r} matches {r['count']:,} retained messages "
                         f"({r['levels']} levels): median {r['busy_median_ms']} ms, max {r['busy_max_ms']} ms "
                         f"(idle: {r['idle_median_ms']} ms)")
    summary = "\n".join(lines)
    print("\n" + summary)
    if a.markdown:
        Path(a.markdown).write_text("```\n" + summary + "\n```\n")
    return max(rcs)


if __name__ == "__main__":
    sys.exit(main())
