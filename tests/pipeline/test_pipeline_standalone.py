"""A pipeline job on a Spark cluster given by its master URL, not local[*].

A real standalone master and worker (the `spark-class` launcher pyspark ships), bound to
127.0.0.1; the job is the `wrenmq pipeline` command a user runs, with `--master spark://...`;
its tasks run in the worker's executor, a JVM and Python workers of their own.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from .pipeline_helpers import StandaloneSpark, lake_offsets  # noqa: E402

WRENMQ = str(Path(sys.executable).with_name("wrenmq"))


def test_archive_runs_on_a_standalone_cluster_by_its_master_url(java, serve_broker, clients, tmp_path):
    b = serve_broker()
    pub = clients(b.port)
    for i in range(20):
        pub.publish(f"plant/{i % 4}/temp", str(20 + i).encode(), qos=1).wait_for_publish(5)
    pub.disconnect()
    assert b.stop() == 0
    cluster = StandaloneSpark(tmp_path)
    try:
        out = tmp_path / "lake"
        cmd = [WRENMQ, "pipeline", "archive", "--data-dir", str(tmp_path / "data"), "--output", str(out),
               "--master", cluster.url, "--quiet"]
        # (executors must reach the driver: on one machine, at 127.0.0.1)
        run = subprocess.run(cmd, env=dict(os.environ, SPARK_LOCAL_IP="127.0.0.1"), capture_output=True,
                             timeout=300)
        assert run.returncode == 0, run.stdout.decode()[-3000:] + run.stderr.decode()[-3000:]
        assert sorted(o for _, o in lake_offsets(str(out))) == list(range(20))
        # The tasks ran in the worker's executor: the application has a directory there.
        apps = [d for d in cluster.work.iterdir() if d.name.startswith("app-")]
        assert len(apps) == 1 and any(apps[0].iterdir()), cluster.log("worker")[-3000:]
        assert "Registered app wrenmq-archive" in cluster.log("master")
    finally:
        cluster.stop()
