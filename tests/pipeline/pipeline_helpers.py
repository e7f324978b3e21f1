"""Helpers for the pipeline tests: logs written with the real store code, readers of the lake."""

import json
import os
import signal
import subprocess
import time

from wrenmq.mqtt.codec import encode_properties
from wrenmq.ports import free_port
from wrenmq.store.format import encode_batch
from wrenmq.store.log import CommitLog

T0 = 1_700_000_000_000_000  # 2023-11-14T22:13:20Z, in microseconds


def props_block(props):
    """MQTT 5 properties as the log stores them (no length prefix)."""
    enc = encode_properties(props)
    i = 0
    while enc[i] & 0x80:
        i += 1
    return enc[i + 1:]


def write_log(data_dir, node, records, per_batch=100, segment_bytes=64 << 20):
    """Append records to <data_dir>/log/<node> with the store's CommitLog.

    `records`: iterable of dicts with topic, payload and optional ts (µs), client_id, qos,
    retain, props (bytes), private (a record kept only for a persistent session: flag bit 3). Returns the offsets [first, end).
    """
    log = CommitLog(os.path.join(data_dir, "log", node), segment_bytes=segment_bytes)
    first = base = log.end_offset
    batch = []

    def flush():
        nonlocal base
        if not batch:
            return
        ts = [r.get("ts", T0) for r in batch]
        data = encode_batch(base, ts, [r.get("qos", 0) | (4 if r.get("retain") else 0) | (8 if r.get("private") else 0)
                                       for r in batch],
                            [r["topic"].encode() for r in batch],
                            [r.get("client_id", "c").encode() for r in batch],
                            [r.get("props", b"") for r in batch],
                            [r["payload"] if isinstance(r["payload"], bytes) else r["payload"].encode()
                             for r in batch])
        log.append(data, base, len(batch), ts[0], max(ts))
        base += len(batch)
        batch.clear()

    for r in records:
        batch.append(r)
        if len(batch) >= per_batch:
            flush()
    flush()
    log.sync()
    log.close()
    return first, base


def telemetry(n, start=0, t0=T0, step_us=1000, devices=10, sites=("a", "b")):
    """n JSON telemetry records: topic <site>/dev<k>/t, one client per device."""
    out = []
    for i in range(start, start + n):
        k = i % devices
        site = sites[k % len(sites)]
        out.append({"topic": f"{site}/dev{k}/t", "client_id": f"dev{k}", "ts": t0 + i * step_us,
                    "payload": json.dumps({"value": i % 7, "seq": i}), "qos": 1})
    return out


def lake_offsets(path, columns=("node", "offset")):
    """(node, offset) pairs of a Parquet folder as pyarrow.dataset sees it."""
    import pyarrow.dataset as ds

    t = ds.dataset(path, format="parquet", partitioning="hive").to_table(columns=list(columns))
    return list(zip(*(t.column(c).to_pylist() for c in columns)))


def wait_for(pred, timeout=30.0, interval=0.1):
    deadline = time.monotonic() + timeout
    while True:
        r = pred()
        if r or time.monotonic() >= deadline:
            return r
        time.sleep(interval)


def subscribe(client, topic, qos=1, timeout=5.0):
    """Subscribe a `clients` fixture client and wait for the SUBACK."""
    client.subscribe(topic, qos)
    kind, _mid, rcs, _props = client.acks.get(timeout=timeout)
    assert kind == "suback"
    return rcs


def duckdb_counts(path):
    """(rows, distinct (node, offset)) of a hive-partitioned Parquet folder, as DuckDB counts
    them with a recursive glob; None without duckdb. Run in a subprocess: duckdb 2.0's
    bindings report leaked objects at interpreter exit, noise in the test output."""
    import subprocess
    import sys

    script = (
        "import sys, duckdb\n"
        "with duckdb.connect() as con:\n"
        "    r = con.execute(\"SELECT count(*), count(DISTINCT (node, \\\"offset\\\")) FROM read_parquet('\" + sys.argv[1]\n"
        "                    + \"/**/*.parquet', hive_partitioning=true)\").fetchone()\n"
        "print(r[0], r[1])\n")
    p = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=60)
    if p.returncode != 0 and "No module named 'duckdb'" in p.stderr:
        return None
    assert p.returncode == 0, p.stderr
    a, b = p.stdout.split()[:2]
    return int(a), int(b)


class StandaloneSpark:
    """A standalone master and `workers` workers (`cores` cores and `memory` each) as
    subprocesses of pyspark's own launcher (`spark-class`), all on 127.0.0.1, logs in `tmp`."""

    def __init__(self, tmp, workers=1, cores=1, memory="1g"):
        import pyspark

        home = os.path.dirname(pyspark.__file__)
        self.launcher = os.path.join(home, "bin", "spark-class")
        self.port = free_port()
        self.url = f"spark://127.0.0.1:{self.port}"
        self.work = tmp / "spark-worker"
        self.works = [self.work] + [tmp / f"spark-worker-{i}" for i in range(1, workers)]
        self.env = dict(os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1",
                        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
                        SPARK_WORKER_DIR=str(self.work))
        self.logs = {}
        self.procs = []
        self._start("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                    "--port", str(self.port), "--webui-port", "0")
        assert wait_for(lambda: "elected leader" in self.log("master"), 60, 0.2), self.log("master")[-3000:]
        names = ["worker"] + [f"worker-{i}" for i in range(1, workers)]
        for name, work in zip(names, self.works):
            self._start(name, "org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1", "--cores", str(cores),
                        "--memory", memory, "--webui-port", "0", "--work-dir", str(work), self.url)
        for name in names:
            assert wait_for(lambda: "Successfully registered with master" in self.log(name), 60, 0.2), \
                self.log(name)[-3000:]

    def _start(self, name, cls, *args):
        path = self.logs[name] = self.work.parent / f"spark-{name}.log"
        with open(path, "wb") as out:
            self.procs.append(subprocess.Popen([self.launcher, cls, *args], stdout=out, stderr=subprocess.STDOUT,
                                               env=self.env, start_new_session=True))

    def apps(self):
        """The application directories the workers made (one per app that ran executors there)."""
        return [d for w in self.works if w.exists() for d in w.iterdir() if d.name.startswith("app-")]

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
