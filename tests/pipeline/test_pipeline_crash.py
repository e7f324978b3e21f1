"""Exactly once through a crash: `wrenmq pipeline archive` killed with SIGKILL (driver, JVM and
Python workers: the whole process group) in the middle of a micro-batch, then restarted from
its checkpoint, leaves a lake in which pyarrow, pandas and DuckDB count every log record
exactly once: no duplicate, no gap.

The broker keeps taking messages from a paho publisher while the job runs. A fault-injection
pause (WRENMQ_PIPELINE_TEST_STAGE_DELAY) holds every batch for a moment after Spark has written
its files to staging and before the batch is committed, so the kill lands mid-batch for sure.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from .pipeline_helpers import duckdb_counts, lake_offsets, wait_for  # noqa: E402

WRENMQ = str(Path(sys.executable).with_name("wrenmq"))


def _staged_files(staging):
    out = []
    for d, _, fs in os.walk(staging):
        if "_temporary" not in d:
            out += [os.path.join(d, f) for f in fs if f.endswith(".parquet")]
    return out


def _published_batches(out):
    import json

    mdir = os.path.join(out, "_wrenmq", "manifests")
    n = 0
    for name in os.listdir(mdir) if os.path.isdir(mdir) else ():
        if name.endswith(".json"):
            try:
                with open(os.path.join(mdir, name)) as fh:
                    n += json.load(fh).get("state") == "published"
            except ValueError:
                pass
    return n


def _group_alive(pgid):
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


@pytest.mark.timeout(400)
def test_archive_killed_mid_batch_restarts_with_no_duplicate_and_no_gap(spark, serve_broker, clients, tmp_path):
    import pandas as pd
    import pyarrow.dataset as ds

    from wrenmq.pipeline import jobs
    from wrenmq.store.reader import LogReader

    b = serve_broker()
    data = tmp_path / "data"
    out = tmp_path / "lake"
    staging = tmp_path / ".lake.wrenmq-staging"
    pub = clients(b.port)
    for i in range(3000):
        info = pub.publish(f"crash/{i % 5}/v", str(i).encode(), qos=1)
    info.wait_for_publish(30)
    stop = threading.Event()
    sent = [3000]

    def publisher():
        i = 3000
        while not stop.is_set():
            pub.publish(f"crash/{i % 5}/v", str(i).encode(), qos=1).wait_for_publish(10)
            i += 1
            sent[0] = i
            time.sleep(0.002)

    t = threading.Thread(target=publisher, daemon=True)
    t.start()
    cmd = [WRENMQ, "pipeline", "archive", "--data-dir", str(data), "--output", str(out), "--master", "local[2]",
           "--quiet"]
    log_path = tmp_path / "pipeline.log"
    t_start = time.monotonic()
    env = dict(os.environ, WRENMQ_PIPELINE_TEST_STAGE_DELAY="1.5")
    with open(log_path, "ab") as lf:
        p = subprocess.Popen(cmd + ["--continuous", "--trigger", "0 seconds", "--max-records-per-trigger", "1000"], stdout=lf, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
    try:
        ok = wait_for(lambda: p.poll() is None and _published_batches(out) >= 1 and _staged_files(staging),
                      timeout=240, interval=0.05)
        assert ok, f"the job did not get going:\n{log_path.read_text()[-3000:]}"
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # driver, JVM and Python workers at once
        p.wait(30)
    assert wait_for(lambda: not _group_alive(p.pid), 15)
    t_kill = time.monotonic()
    # mid-batch: files staged, not published; the lake holds whole batches only, no duplicate
    assert _staged_files(staging)
    mid = lake_offsets(str(out))
    assert len(mid) == len(set(mid)) and mid
    mid_offsets = sorted(o for _, o in mid)
    assert mid_offsets == list(range(len(mid_offsets)))
    assert duckdb_counts(out) in (None, (len(mid), len(mid)))
    stop.set()
    t.join(15)
    # restart from the checkpoint and run to the end of the log (in this process's Spark:
    # the same job code the CLI runs, without a second JVM start)
    assert jobs.run("archive", jobs.JobOptions(data_dir=str(data), output=str(out), quiet=True), spark=spark) == 0
    print(f"first run {t_kill - t_start:.1f} s, restart {time.monotonic() - t_kill:.1f} s")
    node = os.listdir(data / "log")[0]
    reader = LogReader(data / "log" / node)
    end = reader.end_offset
    reader.close()
    assert end >= sent[0] - 1 and end > 3000
    got = lake_offsets(str(out))
    assert sorted(o for _, o in got) == list(range(end))  # every record exactly once
    assert {n for n, _ in got} == {node}
    assert ds.dataset(str(out), format="parquet", partitioning="hive").count_rows() == end
    assert len(pd.read_parquet(str(out))) == end
    assert duckdb_counts(out) in (None, (end, end))
    assert not _staged_files(staging)
