"""Fault tests of a cluster: real etcd, real `wrenmq serve` nodes, and a network the test controls.

- `EtcdCluster(tmp, size=3)`: etcd members on loopback ports forming one cluster (size 1: a
  single server); kill, stop and restart a member, ask its health.
- `Cluster(tmp, etcd, nodes="abc")`: `wrenmq serve` nodes with disk storage, each with its own
  ports and data dir, extra [cluster] keys and TOML per node (`replicas`, `min_insync` when
  replication lands); per node: kill -9, restart on its data dir, wipe (the data dir deleted:
  the node lost for good, started again empty under its name), SIGSTOP/SIGCONT, clean stop.
- `Network`: every node reaches the other nodes' link ports, and every etcd member, only
  through TCP relays on 127.0.0.1 that this process runs, so a test can cut a node from the
  others while etcd stays reachable, or from etcd while the links stay up, and heal it.

Why relays rather than network namespaces: they need no privileges, leave nothing behind in
the kernel when a test dies, run in parallel with other tests on random ports, and cut
exactly one kind of traffic (links, or etcd) while the clients' MQTT connections and the
test's own view of etcd stay direct. A relay in front of a node's link port learns which
node connects from the link's first frame (HELLO), so the links must be plain TCP (no
[cluster] tls). A cut is either "stall" (nothing passes, connections stay open and new ones
are accepted and held, as in a partition where packets are dropped: the nodes must notice
by silence) or "reset" (connections are reset and new ones refused, as when a host is
unreachable).

The load and its check: chaos_workload.py (clients that keep going across faults) and
chaos_checker.py (what was acknowledged against what was delivered), both re-exported here;
`under_load(cluster, fault)` runs the standard load through a fault and returns the Report.
A test of the replicated cluster reads:

    etcd = EtcdCluster(tmp_path / "etcd")                       # 3 members (a module fixture)
    cl = Cluster(tmp_path / "cl", etcd, cluster_options={"replicas": 3, "min_insync": 2}).start()
    def kill_a_five_times():
        for _ in range(5):
            cl["a"].kill(); cl["a"].restart(wait=False); cl.wait_stable()
    report = under_load(cl, kill_a_five_times, failover="any")
    assert report.ok and report.lost == report.duplicates == 0, report.summary()

and for the other faults: `cl["a"].wipe()` (lost for good), `cl["a"].pause()` ...
`cl["a"].resume()` (a zombie), `cl.partition("a")` / `cl.cut_from_etcd("a")` ... `cl.heal()`,
`etcd.kill(0)` ... `etcd.restart(0)`.
"""

import base64
import json
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

from chaos_checker import Report, check, expected_retained, retained_errors  # noqa: F401 (re-exported)
from chaos_workload import Publisher, Subscriber, Workload, retained_state  # noqa: F401 (re-exported)
from mqtt_helpers import wait_for
from wrenmq.cluster import frames as F
from wrenmq.cluster import replication_frames as RF
from wrenmq.ports import free_port, wait_port

ETCD = shutil.which("etcd")
WRENMQ = str(Path(sys.executable).with_name("wrenmq"))
_SECRET = "harness-secret"


def _http(url, body=None, timeout=2.0):
    """GET (or POST `body` as JSON) over loopback HTTP: the decoded JSON answer, or None
    if the server does not answer."""
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=timeout) as r:
            return json.loads(r.read())
    except (OSError, ValueError, urllib.error.URLError):
        return None


def _b64(s):
    return base64.b64encode(s.encode() if isinstance(s, str) else s).decode()


def _prefix_end(prefix):
    """The etcd range end of every key starting with `prefix`."""
    b = bytearray(prefix.encode())
    b[-1] += 1
    return bytes(b)


# --- etcd ----------------------------------------------------------------------------------------


class EtcdMember:
    """One etcd process of an EtcdCluster, on its own client and peer ports and data dir."""

    def __init__(self, tmp, name, cluster_token):
        self.name = name
        self.client_port = free_port()
        self.peer_port = free_port()
        self.dir = tmp / name
        self.token = cluster_token
        self.log_path = tmp / f"{name}.log"
        self.proc = None

    @property
    def endpoint(self):
        return f"127.0.0.1:{self.client_port}"

    @property
    def peer_url(self):
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self, initial_cluster):
        assert ETCD, "etcd is not installed (make test installs Debian's etcd-server)"
        url = f"http://{self.endpoint}"
        with open(self.log_path, "ab") as log:
            # (--initial-* are read only when the data dir is new: a restart rejoins as it was)
            self.proc = subprocess.Popen(
                [ETCD, "--name", self.name, "--data-dir", str(self.dir),
                 "--listen-client-urls", url, "--advertise-client-urls", url,
                 "--listen-peer-urls", self.peer_url, "--initial-advertise-peer-urls", self.peer_url,
                 "--initial-cluster", initial_cluster, "--initial-cluster-token", self.token,
                 "--initial-cluster-state", "new",
                 "--heartbeat-interval", "100", "--election-timeout", "1000"],
                stdout=log, stderr=subprocess.STDOUT)

    @property
    def running(self):
        return self.proc is not None and self.proc.poll() is None

    def healthy(self):
        """True if this member answers and sees a leader with a quorum (etcd's /health)."""
        got = _http(f"http://{self.endpoint}/health", timeout=1.0)
        return bool(got) and str(got.get("health")) == "true"

    def local_get(self, key):
        """The value of `key` as this member holds it (a serializable read: no leader, no
        quorum), or None."""
        got = _http(f"http://{self.endpoint}/v3/kv/range", {"key": _b64(key), "serializable": True})
        kvs = (got or {}).get("kvs")
        return base64.b64decode(kvs[0].get("value", "")).decode() if kvs else None

    def signal(self, sig):
        if self.running:
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(10)


class EtcdCluster:
    """`size` etcd members on loopback forming one cluster (one member: a plain server).

    `endpoints`: every member's "127.0.0.1:port"; `endpoint`: the first. The test's own reads
    and writes (`get_prefix`, `keys`, `put`) go to any healthy member over etcd's JSON gateway.
    """

    def __init__(self, tmp, size=3, start=True):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        token = f"harness-{uuid.uuid4().hex[:8]}"
        self.members = [EtcdMember(self.tmp, f"e{i + 1}", token) for i in range(size)]
        self.initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        if start:
            self.start()

    @property
    def endpoints(self):
        return [m.endpoint for m in self.members]

    @property
    def endpoint(self):
        return self.members[0].endpoint

    def start(self, timeout=30):
        for m in self.members:
            if not m.running:
                m.start(self.initial)
        self.wait_healthy(timeout=timeout)

    def member(self, which):
        return self.members[which] if isinstance(which, int) else next(m for m in self.members if m.name == which)

    def kill(self, which):
        """SIGKILL one member (the others keep a quorum if there are three)."""
        self.member(which).signal(signal.SIGKILL)

    def stop(self, which=None):
        """Stop one member cleanly, or all of them."""
        for m in ([self.member(which)] if which is not None else self.members):
            m.signal(signal.SIGTERM)

    def restart(self, which, timeout=30):
        """Start a stopped or killed member again on its data dir; wait until it is healthy."""
        m = self.member(which)
        assert not m.running, f"etcd member {m.name} is running"
        m.start(self.initial)
        assert wait_for(m.healthy, timeout, 0.1), f"etcd member {m.name} did not come back healthy"

    def health(self):
        """{member name: healthy}."""
        return {m.name: m.running and m.healthy() for m in self.members}

    def wait_healthy(self, members=None, timeout=30):
        names = members or [m.name for m in self.members]
        ok = wait_for(lambda: all(self.member(n).healthy() for n in names), timeout, 0.1)
        assert ok, f"etcd members not healthy: {self.health()}"

    def _call(self, path, body):
        for m in self.members:
            if m.running:
                got = _http(f"http://{m.endpoint}/v3/{path}", body)
                if got is not None and "error" not in got:
                    return got
        raise ConnectionError("no etcd member answers")

    def get_prefix(self, prefix):
        """{key: value} of every key under `prefix` (strings), read through a quorum."""
        got = self._call("kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", "")).decode()
                for kv in got.get("kvs", [])}

    def keys(self, prefix):
        return sorted(self.get_prefix(prefix))

    def entries(self, prefix):
        """{key: (value, create revision, lease id)} of every key under `prefix`, read
        through a quorum: a key deleted and put again since an earlier read has another
        create revision, one put on another lease another lease id."""
        got = self._call("kv/range", {"key": _b64(prefix), "range_end": _b64(_prefix_end(prefix))})
        return {base64.b64decode(kv["key"]).decode(): (base64.b64decode(kv.get("value", "")).decode(),
                                                       int(kv.get("create_revision", 0)), int(kv.get("lease", 0)))
                for kv in got.get("kvs", [])}

    def put(self, key, value):
        self._call("kv/put", {"key": _b64(key), "value": _b64(value)})

    def close(self):
        for m in self.members:
            if m.running:
                m.signal(signal.SIGKILL)


# --- the network between nodes, and between nodes and etcd -------------------------------------


def _abort(sock):
    """Close with a TCP reset (SO_LINGER 0), waking a thread blocked on the socket."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def _peer_closed(sock):
    """True if `sock`'s peer has closed it (without reading what is waiting)."""
    try:
        r, _, _ = select.select([sock], [], [], 0)
        return bool(r) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def hello_sender(head):
    """The node that opened a link, from the bytes it sent first: its name once the HELLO
    frame is complete, None while it is not, ValueError if it is not a HELLO. (With
    `replicas` > 1 a follower's replication connection comes to the same port: its HELLO is
    replication_frames', binary, where a link's is JSON.)"""
    if len(head) < 5:
        return None
    frames = F.FrameReader(8192).feed(head)
    if not frames:
        return None
    kind, body = frames[0]
    if kind != F.HELLO:
        raise ValueError(f"first frame of kind {kind}, not HELLO")
    if body[:1] != b"{":
        return RF.decode_hello(body).follower
    return F.decode_hello(body)[1]


class _Pair:
    """One relayed connection: the socket accepted from `src` and the one to the target."""

    def __init__(self, src, dst, down):
        self.src, self.dst, self.down, self.up = src, dst, down, None
        self.closed = False

    def close(self, reset=False):
        if self.closed:
            return
        self.closed = True
        for s in (self.down, self.up):
            if s is None:
                continue
            if reset:
                _abort(s)
            else:
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                s.close()


class Network:
    """TCP relays on 127.0.0.1 between named parties (node names, and "etcd"), and the cuts
    between them. `relay(target_port, dst, src)` listens on a new port and hands each
    connection on to `target_port`; `src` None means "learn it from the link's HELLO".
    `cut(x, y, mode)` separates x and y both ways; `heal()` ends cuts."""

    ETCD = "etcd"

    def __init__(self):
        self._cuts = {}  # frozenset({x, y}) -> "stall" | "reset"
        self._pairs = set()
        self._listeners = []
        self._changed = threading.Condition()
        self._closed = False

    def relay(self, target_port, dst, src=None):
        listener = socket.create_server(("127.0.0.1", 0))
        self._listeners.append(listener)
        threading.Thread(target=self._accept, args=(listener, target_port, dst, src), daemon=True,
                         name=f"relay-{src or '?'}-{dst}").start()
        return listener.getsockname()[1]

    def cut(self, x, y, mode="stall"):
        assert mode in ("stall", "reset"), mode
        with self._changed:
            self._cuts[frozenset((x, y))] = mode
            doomed = [p for p in self._pairs if frozenset((p.src, p.dst)) == frozenset((x, y))]
            self._changed.notify_all()
        if mode == "reset":
            for p in doomed:
                p.close(reset=True)

    def heal(self, x=None, y=None):
        """End the cut between x and y, every cut of x (y None), or every cut (both None)."""
        with self._changed:
            for key in list(self._cuts):
                if x is None or (x in key and (y is None or y in key)):
                    del self._cuts[key]
            self._changed.notify_all()

    def blocked(self, x, y):
        """The cut between x and y ("stall" or "reset"), or None."""
        return self._cuts.get(frozenset((x, y)))

    @property
    def cuts(self):
        return dict(self._cuts)

    def _wait_open(self, pair, watch):
        """Block while `pair` is stalled by a cut, watching `watch` for its peer's close.
        False if the pair is (or must be) closed."""
        while True:
            with self._changed:
                mode = self.blocked(pair.src, pair.dst)
                if pair.closed or self._closed:
                    return False
                if mode is None:
                    return True
                if mode == "reset":
                    break
                self._changed.wait(0.2)
            if watch is not None and _peer_closed(watch):
                break
        pair.close(reset=True)
        return False

    def _accept(self, listener, target_port, dst, src):
        while not self._closed:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock, target_port, dst, src), daemon=True).start()

    def _serve(self, sock, target_port, dst, src):
        head = b""
        if src is None:  # a link: its HELLO names the node that opened it
            sock.settimeout(10)
            try:
                while src is None:
                    data = sock.recv(4096)
                    if not data:
                        raise ValueError("closed before its HELLO")
                    head += data
                    src = hello_sender(head)
            except (OSError, ValueError):
                _abort(sock)
                return
            sock.settimeout(None)
        pair = _Pair(src, dst, sock)
        with self._changed:
            if self._closed:
                _abort(sock)
                return
            self._pairs.add(pair)
        try:
            if not self._wait_open(pair, sock):
                return
            try:
                pair.up = socket.create_connection(("127.0.0.1", target_port), timeout=5)
                pair.up.settimeout(None)
                if head:
                    pair.up.sendall(head)
            except OSError:  # (the target is down: refused, as it would be without a relay)
                pair.close(reset=True)
                return
            t = threading.Thread(target=self._pump, args=(pair, pair.up, pair.down), daemon=True)
            t.start()
            self._pump(pair, pair.down, pair.up)
            t.join()
        finally:
            with self._changed:
                self._pairs.discard(pair)

    def _pump(self, pair, src, dst):
        """Hand on what `src` sends to `dst`; while a cut stalls the pair nothing is read (the
        sender's buffers fill, as over a link that drops everything)."""
        while True:
            if not self._wait_open(pair, None):
                return
            try:
                r, _, _ = select.select([src], [], [], 0.2)
                if not r:
                    continue
                data = src.recv(65536)
            except (OSError, ValueError):
                data = b""
            if not data:
                pair.close()
                return
            if not self._wait_open(pair, None):  # (cut while it read: held until healed)
                return
            try:
                dst.sendall(data)
            except OSError:
                pair.close()
                return

    def close(self):
        with self._changed:
            self._closed = True
            pairs = list(self._pairs)
            self._changed.notify_all()
        for listener in self._listeners:
            listener.close()
        for p in pairs:
            p.close(reset=True)


# --- wrenmq nodes --------------------------------------------------------------------------------


def _toml_value(v):
    return json.dumps(v)  # (strings, numbers, booleans and lists of them are the same in TOML)


def _metrics(text):
    """{name: value} of a Prometheus text page (labels kept in the name)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


class Node:
    """One `wrenmq serve` process of a Cluster. Its MQTT and metrics ports, its data dir
    and its name stay the same across kills and restarts; the other nodes reach its link,
    and it reaches etcd, through the cluster's Network."""

    def __init__(self, cluster, name, index):
        self.cluster = cluster
        self.name = name
        self.port = free_port()  # MQTT
        self.metrics_port = free_port()
        self.admin_port = free_port()  # the admin API, read-only without credentials (loopback)
        self.link_port = free_port()
        net = cluster.net
        self.link_relay = net.relay(self.link_port, dst=name)  # what the other nodes connect to
        members = cluster.etcd.endpoints
        # Each node lists the members starting from a different one: losing one member
        # costs some nodes their first choice, not all of them.
        order = members[index % len(members):] + members[:index % len(members)]
        self.etcd_relays = [net.relay(int(ep.rsplit(":", 1)[1]), dst=Network.ETCD, src=name) for ep in order]
        self.data_dir = cluster.tmp / f"data-{name}"
        self.config_path = cluster.tmp / f"{name}.toml"
        self.log_path = cluster.tmp / f"{name}.log"
        self.proc = None
        self.paused = False
        self.starts = 0

    def config_text(self):
        c = self.cluster
        keys = {"enabled": True, "name": c.name, "node": self.name, "port": self.link_port,
                "advertise": f"127.0.0.1:{self.link_relay}", "secret": _SECRET, "lease_ttl": c.lease_ttl,
                "etcd_timeout": c.etcd_timeout, "etcd": [f"127.0.0.1:{p}" for p in self.etcd_relays],
                **c.cluster_options, **c.node_options.get(self.name, {}).get("cluster", {})}
        return (f"[[listener]]\nbind = \"127.0.0.1\"\nport = {self.port}\n"
                f"[[listener]]\ntype = \"metrics\"\nbind = \"127.0.0.1\"\nport = {self.metrics_port}\n"
                f"[[listener]]\ntype = \"admin\"\nbind = \"127.0.0.1\"\nport = {self.admin_port}\n"
                f"anonymous = \"read\"\n"
                f"[storage]\ndata_dir = {_toml_value(str(self.data_dir))}\nfsync = {_toml_value(c.fsync)}\n"
                f"[sys]\ninterval = 0.5\n"
                f"[logging]\nlevel = \"info\"\n"
                f"[cluster]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in keys.items())
                + c.extra_toml + c.node_options.get(self.name, {}).get("toml", ""))

    @property
    def running(self):
        return self.proc is not None and self.proc.poll() is None

    @property
    def alive(self):
        """Running and not stopped by SIGSTOP."""
        return self.running and not self.paused

    def start(self, wait=True):
        assert not self.running, f"node {self.name} is running"
        self.config_path.write_text(self.config_text())
        self.starts += 1
        with open(self.log_path, "ab") as log:
            log.write(f"--- harness: start {self.starts} of node {self.name} at {time.time():.3f}\n".encode())
            log.flush()
            self.proc = subprocess.Popen([WRENMQ, "serve", "--config", str(self.config_path)],
                                         stdout=log, stderr=subprocess.STDOUT, cwd=self.cluster.tmp)
        self.paused = False
        if wait:
            self.wait_serving()

    def wait_serving(self):
        """Until its MQTT port accepts connections (it has joined: the listeners open after)."""
        wait_port(self.port, proc=self.proc, timeout=self.cluster.lease_ttl + 30, what=f"node {self.name}")

    def kill(self):
        """kill -9."""
        if self.running:
            self.proc.kill()
            self.proc.wait(10)
        self.paused = False

    def restart(self, wait=True):
        """Start again on its data dir (after kill or stop)."""
        self.kill()
        self.start(wait)

    def wipe(self, wait=True):
        """The node lost for good: kill -9, its data dir deleted, and an empty node started
        under its name (on the same ports)."""
        self.kill()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start(wait)

    def pause(self):
        """SIGSTOP: a zombie that keeps its sockets open and answers nothing."""
        self.proc.send_signal(signal.SIGSTOP)
        self.paused = True

    def resume(self):
        self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def stop(self, timeout=15):
        """A clean stop (SIGTERM): it leaves the cluster at once."""
        if self.running:
            if self.paused:
                self.resume()
            self.proc.terminate()
            self.proc.wait(timeout)

    def metrics(self):
        """{metric: value} from its metrics listener, or {} if it does not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=2) as r:
                return _metrics(r.read().decode())
        except OSError:
            return {}

    def sessions(self, prefix=""):
        """The sessions this node holds (its own, not the cluster's) whose client id starts
        with `prefix`: the admin API's items ({"client_id", "connected", ...})."""
        items, cursor = [], None
        while True:
            query = urllib.parse.urlencode({"local": "true", "prefix": prefix, "limit": 1000,
                                            **({"cursor": cursor} if cursor else {})})
            got = _http(f"http://127.0.0.1:{self.admin_port}/api/v1/clients?{query}", timeout=5.0)
            if got is None:
                raise ConnectionError(f"node {self.name}'s admin API does not answer")
            items += got["items"]
            cursor = got.get("next")
            if not cursor:
                return items

    @property
    def log(self):
        return self.log_path.read_text(errors="replace")


class Cluster:
    """`wrenmq serve` nodes through one EtcdCluster, their links and etcd reached through a
    Network. Nodes have disk storage (fsync `fsync`), `lease_ttl`, and `cluster_options`
    ({key: value} in every node's [cluster]) and `extra_toml` (appended to every node's
    file); `node_options` = {name: {"cluster": {...}, "toml": "..."}} for one node."""

    def __init__(self, tmp, etcd, nodes="abc", *, lease_ttl=3, etcd_timeout=2.0, fsync="always",
                 cluster_options=None, extra_toml="", node_options=None, name=None):
        self.tmp = Path(tmp)
        self.tmp.mkdir(parents=True, exist_ok=True)
        self.etcd = etcd
        self.name = name or f"h-{uuid.uuid4().hex[:8]}"
        self.prefix = f"/wrenmq/{self.name}/"
        self.lease_ttl = lease_ttl
        self.etcd_timeout = etcd_timeout
        self.fsync = fsync
        self.cluster_options = dict(cluster_options or {})
        self.extra_toml = extra_toml
        self.node_options = dict(node_options or {})
        self.net = Network()
        self.nodes = {n: Node(self, n, i) for i, n in enumerate(nodes)}

    def __getitem__(self, name):
        return self.nodes[name]

    def start(self, timeout=60):
        for node in self.nodes.values():
            node.start(wait=False)
        for node in self.nodes.values():
            node.wait_serving()
        self.wait_stable(timeout)
        return self

    @property
    def addresses(self):
        """{node name: MQTT port} (the same across restarts)."""
        return {n: node.port for n, node in self.nodes.items()}

    # --- faults -----------------------------------------------------------------------------

    def partition(self, node, others=None, mode="stall"):
        """Cut `node`'s links to `others` (every other node by default); etcd stays reachable."""
        for other in others or [n for n in self.nodes if n != node]:
            self.net.cut(node, other, mode)

    def cut_from_etcd(self, node, mode="stall"):
        """Cut `node` from every etcd member; its links to the other nodes stay up."""
        self.net.cut(node, Network.ETCD, mode)

    def heal(self, node=None):
        self.net.heal(node)

    # --- what the cluster says --------------------------------------------------------------

    def registered(self):
        """The nodes registered in etcd now."""
        return {k[len(self.prefix) + len("nodes/"):] for k in self.etcd.keys(f"{self.prefix}nodes/")}

    def link_view(self, name):
        """{other node: link state} as node `name` last wrote it to etcd (cluster status)."""
        raw = self.etcd.get_prefix(f"{self.prefix}links/{name}").get(f"{self.prefix}links/{name}")
        return {n: p["state"] for n, p in json.loads(raw)["peers"].items()} if raw else {}

    def client_owners(self):
        """{client id: node} from etcd's `clients/` keys."""
        start = len(self.prefix) + len("clients/")
        return {k[start:]: v for k, v in self.etcd.get_prefix(f"{self.prefix}clients/").items()}

    def stable(self):
        """True when every running node is registered, reaches etcd, and has its links to
        every other running node up (and etcd lists no node that is not running)."""
        live = {n for n, node in self.nodes.items() if node.alive}
        try:
            if self.registered() != live:
                return False
        except ConnectionError:
            return False
        for n in live:
            m = self.nodes[n].metrics()
            if (m.get("wrenmq_cluster_etcd_connected") != 1 or m.get("wrenmq_cluster_nodes") != len(live)
                    or m.get("wrenmq_cluster_links_up") != len(live) - 1):
                return False
        return True

    def wait_stable(self, timeout=60):
        ok = wait_for(self.stable, timeout, interval=0.25)
        assert ok, f"cluster {self.name} not stable after {timeout} s: {self.describe()}"

    def describe(self):
        """A line per node: running or not, and its view (for failure messages and logs)."""
        lines = []
        try:
            reg = sorted(self.registered())
        except ConnectionError:
            reg = "etcd unreachable"
        for n, node in self.nodes.items():
            m = node.metrics() if node.alive else {}
            lines.append(f"{n}: {'paused' if node.paused else 'running' if node.running else 'down'}, "
                         f"etcd {m.get('wrenmq_cluster_etcd_connected')}, nodes {m.get('wrenmq_cluster_nodes')}, "
                         f"links up {m.get('wrenmq_cluster_links_up')}")
        return f"registered {reg}; " + "; ".join(lines) + f"; cuts {list(map(sorted, self.net.cuts))}"

    def ownership(self, clients, prefix=""):
        """What breaks "one owner per client id" for the client ids starting with `prefix`:
        each client id held by one live node only (its own list of sessions, connected or
        not, from its admin API), and for each of `clients` ({client id: the node it is
        connected to now}), that node, holding it as connected, and etcd's `clients/` key
        naming it. {"bad": how many, "problems": [...]}; call it with the cluster whole."""
        held = {}  # client id -> [(node, connected)]
        for n, node in self.nodes.items():
            if node.alive:
                for item in node.sessions(prefix):
                    held.setdefault(item["client_id"], []).append((n, item["connected"]))
        owners = self.client_owners()
        problems = [f"{cid}: held by {sorted(h)}" for cid, h in sorted(held.items()) if len(h) > 1]
        for cid, node in sorted(clients.items()):
            if held.get(cid) != [(node, True)] and len(held.get(cid, ())) <= 1:
                problems.append(f"{cid}: connected to node {node}, held as {held.get(cid)}")
            if owners.get(cid) != node:
                problems.append(f"{cid}: connected to node {node}, etcd names {owners.get(cid)}")
        return {"bad": len(problems), "problems": problems}

    def watch_membership(self, period=0.25):
        """A started MembershipWatch of this cluster (`.stop()` returns what it saw)."""
        return MembershipWatch(self, period).start()

    def close(self):
        for node in self.nodes.values():
            if node.running:
                if node.paused:
                    node.resume()
                node.kill()
        self.net.close()


class MembershipWatch:
    """Which nodes etcd lists, sampled every `period` seconds on a thread while a fault runs:
    a node that leaves the cluster (its registration gone: its lease ran out, or it stopped)
    is what a failover starts from, so the chaos table counts them."""

    def __init__(self, cluster, period=0.25):
        self.cluster, self.period = cluster, period
        self.events = []  # (time.time(), node, "left" | "back")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="membership")

    def start(self):
        self._thread.start()
        return self

    def _run(self):
        last, stopping = None, False
        while not stopping:
            stopping = self._stop.is_set()  # (one more look once asked to stop: the last change)
            try:
                now = self.cluster.registered()
            except ConnectionError:  # (no etcd member answers the test: nothing to learn)
                now = last
            if last is not None and now is not None:
                t = time.time()
                self.events += [(t, n, "left") for n in sorted(last - now)]
                self.events += [(t, n, "back") for n in sorted(now - last)]
            last = now
            self._stop.wait(self.period)

    def stop(self):
        """{"left": departures, "absent": the longest time a node was away (s), "events"}."""
        self._stop.set()
        self._thread.join(10)
        away, longest = {}, 0.0
        for t, n, what in self.events:
            if what == "left":
                away[n] = t
            elif n in away:
                longest = max(longest, t - away.pop(n))
        end = time.time()
        longest = max([longest, *(end - t for t in away.values())])
        return {"left": sum(1 for _, _, what in self.events if what == "left"), "absent": longest,
                "events": list(self.events)}


# --- a fault under load, checked --------------------------------------------------------------------


def settled(read, wrong, timeout):
    """`read()`, again every half second for up to `timeout` seconds while `wrong(value)`:
    the last value read (what propagates after an acknowledgement is given the time to)."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if not wrong(value) or time.monotonic() >= deadline:
            return value
        time.sleep(0.5)


def finish(cluster, workload, drain=60.0, settle=60.0, propagation=10.0):
    """End `workload`'s publishing, wait for the acknowledgements and the deliveries, read
    every live node's retained messages and the ownership figures: the checker's Report.
    Call it with the cluster whole again (`wait_stable`)."""
    workload.stop_publishing()
    pending = workload.drain(drain)
    workload.settle(quiet=3.0, timeout=settle)
    pubs, subs = workload.snapshot()
    # The last retained changes and the client registrations reach the other nodes and
    # etcd a moment after their acknowledgement: read again (for up to `propagation` s)
    # while they are not what they must end as.
    want = expected_retained(pubs)
    retained = {n: settled(lambda: retained_state(node.port, workload.prefix), lambda v: retained_errors(v, want),
                           propagation)
                for n, node in cluster.nodes.items() if node.alive}
    clients = workload.connected()
    ownership = settled(lambda: cluster.ownership(clients, workload.client_prefix), lambda o: o["bad"], propagation)
    report = check(pubs, subs, retained, ownership, workload.stopped_at)
    report.pending = pending
    report.clients = (pubs, subs)  # (what each client saw: chaos.py --keep saves it)
    for cid, seen in workload.anomalies().items():
        report.protocol_errors += len(seen)
        report.details.append(f"{cid}: {len(seen)} packet(s) no broker should send, e.g. {seen[0]}")
    return report


def under_load(cluster, fault, *, rate=10.0, failover="home", before=2.0, after=2.0, recover=60.0,
               repair=None, workload=None):
    """The standard Workload (or `workload`, not started) over `cluster` through `fault()`:
    `before` seconds of load, then `fault()` (it injects the fault and ends it), then until
    the cluster is whole again and `after` seconds more: the checker's Report, with the
    recovery time and how many times a node left the cluster meanwhile. If the cluster is
    not whole `recover` seconds after the fault, `repair()` is called (without it, an
    AssertionError) and the report says it did not recover."""
    w = workload or Workload(cluster.addresses, rate=rate, failover=failover)
    w.start()
    watch = cluster.watch_membership()
    try:
        time.sleep(before)
        began = time.time()
        fault()
        ended = time.monotonic()
        recovery = time.monotonic() - ended if wait_for(cluster.stable, recover, 0.25) else None
        if recovery is None:
            state = cluster.describe()
            if repair is None:
                raise AssertionError(f"cluster not whole {recover} s after the fault: {state}")
            repair()
        members = watch.stop()
        time.sleep(after)
        report = finish(cluster, w)
        report.recovery, report.nodes_left = recovery, members["left"]
        if recovery is None:
            report.details.append(f"not whole {recover} s after the fault: {state}")
        for t, n, what in members["events"]:
            report.details.append(f"node {n} {'left the cluster' if what == 'left' else 'back'} "
                                  f"{t - began:.1f} s after the fault began")
        return report
    finally:
        watch.stop()
        w.close()


def link_certificates(tmp_path):
    """[cluster] TLS settings of nodes one CA signed, and the files of a rogue node's (another CA)."""
    import trustme

    files = {}
    for name, issuer in (("good", trustme.CA()), ("rogue", trustme.CA())):
        cert = issuer.issue_cert("127.0.0.1")
        files[name] = (tmp_path / f"{name}.pem", tmp_path / f"{name}-ca.pem")
        cert.private_key_and_cert_chain_pem.write_to_path(str(files[name][0]))
        issuer.cert_pem.write_to_path(str(files[name][1]))
    return {"tls": True, "certfile": str(files["good"][0]), "cafile": str(files["good"][1])}, files
