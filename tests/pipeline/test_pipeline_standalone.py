"""A pipeline job on a Spark cluster given by its master URL, not local[*].

A real standalone master and worker (the `spark-class` launcher pyspark ships), bound to
127.0.0.1; the job is the `wrenmq pipeline` command a user runs, with `--master spark://...`;
its tasks run in the worker's executor, a JVM and Python workers of their own.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from wrenmq.ports import free_port  # noqa: E402

from .pipeline_helpers import lake_offsets, wait_for  # noqa: E402

WRENMQ = str(Path(sys.executable).with_name("wrenmq"))


class StandaloneSpark:
    """A standalone master and one worker (1 core, 1 GiB) as subprocesses, logs in `tmp`."""

    def __init__(self, tmp):
        import pyspark

        home = os.path.dirname(pyspark.__file__)
        self.launcher = os.path.join(home, "bin", "spark-class")
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.work = tmp / "spark-worker"
        self.env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1",
                        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
                        SPARK_WORKER_DIR=str(self.work))
        self.logs = {}
        self.procs = []
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", "0")
        assert wait_for(lambda: "elected leader" in self.log("master"), 60, 0.2), self.log("master")[-3000:]
        self._start("worker", "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                    "--cores", "1", "--memory", "1g", "--webui-port", "0", self.url)
        assert wait_for(lambda: "Successfully registered with master" in self.log("worker"), 60, 0.2), \
            self.log("worker")[-3000:]

    def _start(self, name, cls, *args):
        path = self.logs[name] = self.work.parent / f"spark-{name}.log"
        with open(path, "wb") as out:
            self.procs.append(subprocess.Popen([self.launcher, cls, *args], stdout=out, stderr=subprocess.STDOUT,
                                               env=self.env, start_new_session=True))

    def log(self, name):
        return self.logs[name].read_text(errors="replace")

    def stop(self):
        for p in reversed(self.procs):
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


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
