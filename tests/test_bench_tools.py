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
