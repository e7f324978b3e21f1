"""The QoS 0 rows with the commit log off and on: both brokers up, alternating run by run.

    python -m wrenmq.bench.logrows [--rounds 9] [--scenarios a1,a2,b0,c,d] [--json OUT]

Two wrenmq brokers run side by side, one with the log off (`wrenmq-memory.toml`) and
one with it on (`wrenmq-log.toml`, fsync every 100 ms). Every round starts both afresh
(new data directories) and runs each row once on each, the two back to back, the first
of the pair swapping from row to row and round to round. The ratio is that of the two
sides' medians, printed with a 90% bootstrap interval (`ratio_interval`); each pair's
own ratio is kept too (its median is printed).

Why: this VM's speed drifts by 15-40% within minutes (docs/BENCHMARKS.md). Rounds that
ran all rows on one broker and then on the other, half a minute apart, measured that
drift as much as the log: three of them left a row's ratio anywhere between 0.54x and
0.80x. Why fresh every round: brokers kept for all rounds wrote 1.3 GB, and in some
quarter hours this VM's disk then held the writer back until a2 fell to 0.4x (with
fsync "never" as well).
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from .brokers import BrokerError, Wrenmq
from .harness import WRENMQ_PORT, bench_setup, run_mqload
from .scenarios import SCENARIOS

HERE = Path(__file__).parent
ROWS = ["a1", "a2", "b0", "c", "d"]
ROUNDS = 9
SIDES = [("off", "wrenmq-memory.toml", WRENMQ_PORT + 5), ("on", "wrenmq-log.toml", WRENMQ_PORT + 6)]


def ratio_interval(off, on, level=0.9, resamples=2000, seed=1):
    """A bootstrap interval of median(on) / median(off): how far the printed ratio may be
    from the one more rounds would give, on a machine whose speed drifts from run to run.

    Each side's runs are resampled with replacement (`resamples` times, fixed seed so a
    report can be reproduced from its numbers); returns the (1 - level) / 2 and
    (1 + level) / 2 quantiles of the resampled ratios.
    """
    rng = random.Random(seed)
    med = statistics.median
    ratios = sorted(med(rng.choices(on, k=len(on))) / med(rng.choices(off, k=len(off)))
                    for _ in range(resamples))
    lo = ratios[int((1 - level) / 2 * (resamples - 1))]
    hi = ratios[int((1 + level) / 2 * (resamples - 1))]
    return lo, hi


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--scenarios", default=",".join(ROWS), help="comma-separated row ids")
    p.add_argument("--pause", type=float, default=0.3, help="seconds between runs")
    p.add_argument("--run-timeout", type=float, default=120.0)
    p.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    ids = [s for s in a.scenarios.split(",") if s]
    unknown = [s for s in ids if s not in SCENARIOS]
    if unknown or a.rounds < 1:
        p.error(f"unknown rows {unknown}" if unknown else "--rounds must be >= 1")
    root, mqload, wrenmq, log_dir = bench_setup()
    if not mqload or not wrenmq:
        print("logrows: mqload or wrenmq not found (run `make bench`)", file=sys.stderr)
        return 2
    brokers = {name: Wrenmq(wrenmq, port, log_dir, root, config=str(HERE / conf))
               for name, conf, port in SIDES}
    values = {sid: {name: [] for name in brokers} for sid in ids}
    problems = []
    try:
        for name, b in brokers.items():
            b.name = f"wrenmq-log-{name}"  # (its log file under .bench/logs)
        for rnd in range(a.rounds):
            for b in brokers.values():  # fresh brokers and data directories every round
                b.stop()
                b.start()
            for si, sid in enumerate(ids):
                metric = SCENARIOS[sid].metrics[0]
                order = list(brokers) if (rnd + si) % 2 == 0 else list(brokers)[::-1]
                for name in order:
                    b = brokers[name]
                    if not b.alive():
                        b.start()
                    run = run_mqload(mqload, sid, b, rnd, a.run_timeout)
                    v = metric.get(run.result) if run.clean else None
                    if v is None:
                        problems.append(f"{sid} {name} round {rnd + 1}: {run.problem() or 'no figure'}")
                    else:
                        values[sid][name].append(v)
                    lost = (run.result or {}).get("lost") or 0
                    if lost:
                        problems.append(f"{sid} {name} round {rnd + 1}: {lost} lost")
                    time.sleep(a.pause)
            print(f"logrows: round {rnd + 1} of {a.rounds} done", file=sys.stderr, flush=True)
    except BrokerError as e:
        problems.append(f"broker: {e}")
    finally:
        for b in brokers.values():
            b.stop()
    results = []
    print(f"{'row':<5} {'metric':<20} {'off (median)':>13} {'on (median)':>12} {'on/off':>7} "
          f"{'90% interval':>13} {'pairs':>6}  off min-max / on min-max")
    for sid in ids:
        off, on = values[sid]["off"], values[sid]["on"]
        if not off or not on:
            continue
        pairs = [y / x for x, y in zip(off, on)]
        lo, hi = ratio_interval(off, on)
        r = {"row": sid, "metric": SCENARIOS[sid].metrics[0].key, "off": off, "on": on,
             "off_median": statistics.median(off), "on_median": statistics.median(on),
             "ratio": statistics.median(on) / statistics.median(off), "ratio_interval": [lo, hi],
             "pair_ratio_median": statistics.median(pairs)}
        results.append(r)
        print(f"{sid:<5} {r['metric']:<20} {r['off_median']:>13,.0f} {r['on_median']:>12,.0f} "
              f"{r['ratio']:>6.2f}x {lo:>5.2f}-{hi:.2f}x {r['pair_ratio_median']:>5.2f}x  "
              f"{min(off):,.0f}-{max(off):,.0f} / {min(on):,.0f}-{max(on):,.0f}", flush=True)
    for line in problems:
        print(f"problem: {line}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": a.rounds, "rows": results, "problems": problems},
                                           indent=1) + "\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
