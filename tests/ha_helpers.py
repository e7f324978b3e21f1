"""Real `wrenmq serve` nodes with `[cluster] replicas` > 1 over a real etcd, for the HA tests.

`HACluster(tmp, etcd, nodes="abc", replicas=3, min_insync=2)` writes each node's file
(disk storage, fsync always, a metrics listener, with `admin=True` an admin listener,
short leases) and starts, kills, restarts, wipes, pauses and resumes its processes; `records()` and `status()` read the
partitions' records and their leaders' figures from etcd; `log_records(node, partition)`
reads a partition's copy on a node's disk.
"""

import json
import shutil
import signal
import subprocess
import time
from pathlib import Path

from conftest import WRENMQ, free_port
from mqtt_helpers import uid, wait_for
from wrenmq.ports import wait_port
from wrenmq.store.reader import LogReader

ETCD = shutil.which("etcd")
ETCDCTL = shutil.which("etcdctl")


class Etcd:
    """A single-member etcd server on free loopback ports."""

    def __init__(self, tmp):
        self.port = free_port()
        self.peer = free_port()
        self.dir = Path(tmp)
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = open(self.dir / "etcd.log", "ab")
        assert ETCD, "etcd is not installed (make test installs Debian's etcd-server)"
        url = f"http://{self.endpoint}"
        self.proc = subprocess.Popen(
            [ETCD, "--data-dir", str(self.dir / "data"), "--name", "t", "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", f"http://127.0.0.1:{self.peer}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{self.peer}",
             "--initial-cluster", f"t=http://127.0.0.1:{self.peer}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        ok = wait_for(lambda: self.ctl("endpoint", "health", check=False).returncode == 0, timeout=20, interval=0.1)
        assert ok, "etcd did not become healthy"

    def ctl(self, *args, check=True):
        return subprocess.run([ETCDCTL, "--endpoints", self.endpoint, *args], capture_output=True, text=True,
                              check=check, env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"})

    def get_prefix(self, prefix):
        """{key: value} under `prefix`."""
        out = self.ctl("get", "--prefix", prefix, "-w", "json").stdout
        kvs = json.loads(out).get("kvs", [])
        import base64
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv["value"]).decode() for kv in kvs}

    def close(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.log.close()


class Node:
    def __init__(self, cluster, name):
        self.cluster = cluster
        self.name = name
        self.port = free_port()
        self.metrics_port = free_port()
        self.admin_port = free_port() if cluster.admin else None
        self.link_port = free_port()
        self.data_dir = cluster.tmp / f"data-{name}"
        self.config_path = cluster.tmp / f"{name}.toml"
        self.log_path = cluster.tmp / f"{name}.log"
        self.proc = None
        self.paused = False

    def config_text(self):
        c = self.cluster
        keys = {"enabled": True, "name": c.name, "node": self.name, "etcd": [c.etcd.endpoint], "port": self.link_port,
                "secret": "ha-secret", "lease_ttl": c.lease_ttl, "etcd_timeout": 2.0, "replicas": c.replicas,
                "min_insync": c.min_insync, "replica_lag_ms": c.lag_ms, "replica_heartbeat_ms": 200,
                "replica_fetch_timeout_ms": 1500, **c.extra}
        admin = "" if self.admin_port is None else (
            f"[[listener]]\ntype = \"admin\"\nbind = \"127.0.0.1\"\nport = {self.admin_port}\nanonymous = \"read\"\n")
        return (f"[[listener]]\nbind = \"127.0.0.1\"\nport = {self.port}\n{admin}"
                f"[[listener]]\ntype = \"metrics\"\nbind = \"127.0.0.1\"\nport = {self.metrics_port}\n"
                f"[storage]\ndata_dir = {json.dumps(str(self.data_dir))}\nfsync = \"always\"\n"
                f"[sys]\ninterval = 0.5\n[logging]\nlevel = \"info\"\n{c.toml}"
                "[cluster]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in keys.items()))

    @property
    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def start(self, wait=True):
        assert not self.running
        self.config_path.write_text(self.config_text())
        with open(self.log_path, "ab") as log:
            log.write(f"--- start at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([WRENMQ, "serve", "--config", str(self.config_path)], stdout=log,
                                         stderr=subprocess.STDOUT, cwd=self.cluster.tmp)
        self.paused = False
        if wait:
            self.wait_serving()
        return self

    def wait_serving(self, timeout=None):
        wait_port(self.port, proc=self.proc, timeout=timeout or self.cluster.lease_ttl + 40, what=f"node {self.name}")

    def serving(self):
        import socket
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def kill(self):
        if self.running:
            if self.paused:
                self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(10)
        self.paused = False

    def stop(self, timeout=20):
        if self.running:
            self.proc.terminate()
            self.proc.wait(timeout)

    def wipe(self):
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def pause(self):
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    @property
    def log(self):
        return self.log_path.read_text(errors="replace")

    def partition_dir(self, partition):
        return self.data_dir if partition == self.name else self.data_dir / "replicas" / partition

    def log_records(self, partition):
        """(offset, topic, payload) of `partition`'s records on this node's disk (state records
        left out)."""
        d = self.partition_dir(partition) / "log" / partition
        return [(r.offset, r.topic, bytes(r.payload)) for r in LogReader(d).records()]


class HACluster:
    def __init__(self, tmp, etcd, nodes="abc", replicas=3, min_insync=2, lease_ttl=3, lag_ms=2000, toml="",
                 admin=False, **extra):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.etcd = etcd
        self.name = uid("ha")
        self.prefix = f"/wrenmq/{self.name}/ha/"
        self.replicas = replicas
        self.min_insync = min_insync
        self.lease_ttl = lease_ttl
        self.lag_ms = lag_ms
        self.toml = toml
        self.extra = extra
        self.admin = admin  # each node with an admin listener (`admin_port`) anyone may read
        self.nodes = {n: Node(self, n) for n in nodes}

    def __getitem__(self, name):
        return self.nodes[name]

    def start(self, timeout=60):
        for node in self.nodes.values():
            node.start(wait=False)
        for node in self.nodes.values():
            node.wait_serving()
        self.wait_in_sync(timeout)
        return self

    def records(self):
        """{partition: record} as etcd has them."""
        start = len(self.prefix) + len("partitions/")
        return {k[start:]: json.loads(v) for k, v in self.etcd.get_prefix(f"{self.prefix}partitions/").items()}

    def status(self):
        start = len(self.prefix) + len("status/")
        return {k[start:]: json.loads(v) for k, v in self.etcd.get_prefix(f"{self.prefix}status/").items()}

    def in_sync(self, nodes=None):
        """Every partition of `nodes` (default: all) led by its own node with every replica
        in its in-sync set."""
        nodes = nodes or list(self.nodes)
        recs = self.records()
        status = self.status()
        for n in nodes:
            r = recs.get(n)
            if r is None or r["leader"] != n or len(r["replicas"]) < self.replicas or \
                    set(r["isr"]) != set(r["replicas"]):
                return False
            s = status.get(n)
            if s is None or s["epoch"] != r["epoch"] or s["state"] != "serving" or not s["accepting"]:
                return False
        return True

    def wait_in_sync(self, timeout=60, nodes=None):
        ok = wait_for(lambda: self.in_sync(nodes), timeout, interval=0.25)
        assert ok, f"partitions not in sync after {timeout} s: {self.records()}"

    def close(self):
        for node in self.nodes.values():
            node.kill()
