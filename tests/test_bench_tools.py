"""The benchmark's in-process tool keeps running against the broker as it is.

`python -m wrenmq.bench.micro` drives real Connection objects, the real router and (log
on) the real store and writer thread through a stand-in transport. It rotted once
unnoticed: the connection began asking the transport for its write buffer size, and
the stand-in had no such method. This runs it briefly; no timing is checked here
(speed lives in `make bench`).
"""

import re
import subprocess
import sys

import pytest


@pytest.mark.parametrize("storage", ["memory", "interval"])
def test_micro_runs_and_reports_cpu_per_message(storage):
    cp = subprocess.run([sys.executable, "-m", "wrenmq.bench.micro", "--storage", storage,
                         "--count", "3000", "--rounds", "1", "--size", "256"],
                        capture_output=True, text=True, timeout=120)
    assert cp.returncode == 0, cp.stderr[-2000:]
    m = re.search(rf"storage={storage} size=256 .*: ([0-9.]+) us CPU/msg .* msg/s wall; "
                  r"event loop thread ([0-9.]+) us CPU/msg", cp.stdout)
    assert m, cp.stdout
    assert float(m.group(1)) > 0 and float(m.group(2)) > 0


def test_log_ratio_interval_brackets_the_ratio_and_narrows_with_runs():
    from wrenmq.bench.logrows import ratio_interval

    off = [100, 110, 90, 105, 95, 120, 80, 100, 102]
    on = [x * 0.8 for x in off]
    assert ratio_interval(off, on) == ratio_interval(off, on)  # reproducible from the numbers
    lo, hi = ratio_interval(off, on)
    assert lo <= 0.8 <= hi and hi - lo < 0.5
    # Equal figures: no spread at all. More runs of the same spread: a narrower interval.
    assert ratio_interval([100] * 5, [80] * 5) == (0.8, 0.8)
    lo9, hi9 = ratio_interval(off * 9, on * 9)
    assert hi9 - lo9 < hi - lo and lo9 <= 0.8 <= hi9


def test_soak_runs_against_the_broker_and_sums_up_its_memory():
    # A few seconds of the churn `make soak` runs for minutes, on a real wrenmq: the tool
    # still drives the broker (no client errors), samples it once the churn is over, and
    # prints its summary line.
    cp = subprocess.run([sys.executable, "-m", "wrenmq.bench.soak", "--brokers", "wrenmq", "--minutes", "0.1",
                         "--every", "1", "--devices", "4", "--settle", "2"], capture_output=True, text=True,
                        timeout=120)
    assert cp.returncode == 0, cp.stdout[-2000:] + cp.stderr[-2000:]
    m = re.search(r"^wrenmq: RSS .* second half [-+][0-9.]+ MiB/min; (\d+) visits, (\d+) published, "
                  r"(\d+) received, (\d+) errors; .* messages held for sessions; "
                  r"\d+ s after the churn: RSS [0-9.]+ MiB, (?:\d+|\?) held$", cp.stdout, re.M)
    assert m, cp.stdout
    visits, published, received, errors = map(int, m.groups())
    assert visits > 0 and published == visits * 100 and received > 0 and errors == 0
