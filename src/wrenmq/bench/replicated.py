"""What replication costs a QoS 1 publisher: one node, a 3-node cluster with replicas 1, and
the same with `replicas = 3, min_insync = 2`.

    python -m wrenmq.bench.replicated [--rounds 3] [--count 50000] [--size 64] [--fsync always]
                                      [--rate 500] [--seconds 5] [--setups "replicas 1,replicas 3"]

Starts an etcd and seven `wrenmq serve` (disk storage, `fsync` as given, the same for all):
a single node, and nodes a, b, c of two clusters, one with `replicas = 1` and one with
`replicas = 3, min_insync = 2` (each node's log a partition kept on the three: a PUBACK
only once two of them, the leader included, hold the record durably). On each setup the
publisher and the subscriber are clients of node a (of the single node), so the
clusters' rows differ from the single node's by what a cluster and its replication add
to a message, not by crossing a link (`bench.cluster` measures that).

Per round, setups in turn (the first of each round rotating):
- rate: mqload `pubsub --pubs 1 --subs 1 --topic-mode single --qos 1 --inflight 100`,
  `--count` messages of `--size` bytes; deliveries/s (first publish to last delivery), lost;
- latency: a QoS 1 publisher at `--rate` msg/s for `--seconds` (a subscriber on its
  topic), each PUBLISH's time to its PUBACK; p50 and p99 over the rounds' samples.
Prints per round and then the medians, and replicas 3 / single node and replicas 3 /
replicas 1 ratios of the rates. All of it (etcd, seven brokers, mqload) shares this
machine's cores: three nodes doing one message's work each is the figure, not what three
machines would do.
"""

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..ports import free_port, wait_port
from .cluster import Counter
from .harness import bench_setup

SETUPS = ("single node", "replicas 1", "replicas 3")
_CONNECT = bytes.fromhex("101000044d5154540402003c0004") + b"blat"  # 3.1.1, clean, keepalive 60, id "blat"


class PubackProbe:
    """A QoS 1 publisher at a fixed rate that times each PUBLISH to its PUBACK (raw 3.1.1)."""

    def __init__(self, port, topic=b"bench/lat"):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(_CONNECT)
        got = b""
        while len(got) < 4:
            got += self.sock.recv(4 - len(got))
        if got[0] != 0x20 or got[3] != 0:
            raise RuntimeError(f"CONNACK refused: {got.hex()}")
        self.topic = topic
        self.sent = {}  # packet id -> perf_counter_ns at send
        self.latencies = []  # ns
        self.acked = 0
        self.lock = threading.Lock()

    def _reader(self, want):
        buf = b""
        sock = self.sock
        sock.settimeout(30)
        while self.acked < want:
            data = sock.recv(65536)
            if not data:
                raise RuntimeError("the broker closed the probe's connection")
            now = time.perf_counter_ns()
            buf += data
            while len(buf) >= 4 and buf[0] == 0x40:
                pid = int.from_bytes(buf[2:4], "big")
                buf = buf[4:]
                with self.lock:
                    t = self.sent.pop(pid, None)
                if t is not None:
                    self.latencies.append(now - t)
                self.acked += 1
            if buf and buf[0] != 0x40:
                raise RuntimeError(f"unexpected packet 0x{buf[0]:02x} (a PUBACK expected)")

    def run(self, rate, seconds, size=64):
        n = int(rate * seconds)
        reader_error = []

        def read():
            try:
                self._reader(n)
            except Exception as e:  # (reported by run)
                reader_error.append(e)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        t = self.topic
        payload = b"x" * size
        body_len = 2 + len(t) + 2 + len(payload)
        head = bytes((0x32, body_len)) if body_len < 128 else bytes((0x32, (body_len & 0x7F) | 0x80, body_len >> 7))
        start = time.perf_counter()
        for i in range(n):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pid = i % 65535 + 1
            pkt = head + len(t).to_bytes(2, "big") + t + pid.to_bytes(2, "big") + payload
            with self.lock:
                self.sent[pid] = time.perf_counter_ns()
            self.sock.sendall(pkt)
        reader.join(60)
        if reader_error:
            raise reader_error[0]
        if self.acked < n:
            raise RuntimeError(f"{n - self.acked} of {n} PUBLISHes were not acknowledged")
        return self.latencies

    def close(self):
        try:
            self.sock.sendall(b"\xe0\x00")
        except OSError:
            pass
        self.sock.close()


def _pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _serve(exe, tmp, name, text):
    port = free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(text)
    log = open(tmp / f"{name}.log", "ab")
    proc = subprocess.Popen([exe, "serve", "--config", str(cfg), "--port", str(port), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    return proc, port, cfg


def _in_sync(exe, cfg, nodes):
    """Every partition of the cluster whose node `cfg` is led by its node, all replicas in sync."""
    cp = subprocess.run([exe, "cluster", "status", "--config", str(cfg), "--json"], capture_output=True, text=True,
                        timeout=30)
    if cp.returncode != 0:
        return False
    parts = json.loads(cp.stdout).get("partitions") or {}
    return set(parts) == set(nodes) and all(
        r["leader"] == p and len(r["isr"]) == len(nodes) and r["state"] == "serving" and r["accepting"]
        for p, r in parts.items())


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--count", type=int, default=50000, help="messages of each rate run")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--fsync", choices=("always", "interval", "never"), default="always")
    p.add_argument("--rate", type=float, default=500.0, help="msg/s of the latency probe")
    p.add_argument("--seconds", type=float, default=5.0, help="seconds of each latency probe")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--setups", default=",".join(SETUPS),
                   help="which setups to start and measure, comma-separated (default: all three)")
    args = p.parse_args(argv)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    if not setups or any(s not in SETUPS for s in setups):
        sys.exit(f"bench.replicated: --setups takes some of {', '.join(SETUPS)}")
    etcd = shutil.which("etcd")
    if not etcd:
        sys.exit("bench.replicated: etcd not found (Debian: apt install etcd-server; `make bench-cluster` installs it)")
    _, mqload, exe, _ = bench_setup()
    if not mqload or not exe:
        sys.exit("bench.replicated: mqload or wrenmq not found (make bench-deps builds mqload)")
    tmp = Path(tempfile.mkdtemp(prefix="wrenmq-bench-replicated-"))
    procs, counters = [], []
    try:
        cport, pport = free_port(), free_port()
        etcd_proc = subprocess.Popen(
            [etcd, "--data-dir", str(tmp / "etcd"), "--listen-client-urls", f"http://127.0.0.1:{cport}",
             "--advertise-client-urls", f"http://127.0.0.1:{cport}", "--listen-peer-urls", f"http://127.0.0.1:{pport}",
             "--initial-advertise-peer-urls", f"http://127.0.0.1:{pport}", "--initial-cluster",
             f"default=http://127.0.0.1:{pport}"], stdout=open(tmp / "etcd.log", "ab"), stderr=subprocess.STDOUT)
        procs.append(etcd_proc)
        wait_port(cport, etcd_proc, what="etcd")

        def storage(name):
            return (f"[storage]\ndata_dir = \"{tmp / ('data-' + name)}\"\nfsync = \"{args.fsync}\"\n"
                    "[sys]\ninterval = 0\n")

        def node(cluster, name, replicas):
            keys = {"enabled": True, "name": cluster, "node": name, "etcd": [f"127.0.0.1:{cport}"],
                    "port": free_port(), "replicas": replicas, "min_insync": 2 if replicas > 1 else 1}
            return storage(f"{cluster}-{name}") + "[cluster]\n" + "".join(
                f"{k} = {json.dumps(v)}\n" for k, v in keys.items())

        ports = {}
        if "single node" in setups:
            single, ports["single node"], _ = _serve(exe, tmp, "single", storage("single"))
            procs.append(single)
        for setup, cluster, replicas in (("replicas 1", "benchr1", 1), ("replicas 3", "benchr3", 3)):
            if setup not in setups:
                continue
            started = [_serve(exe, tmp, f"{cluster}-{n}", node(cluster, n, replicas)) for n in "abc"]
            procs += [s[0] for s in started]
            for (proc, port, _), n in zip(started, "abc"):
                wait_port(port, proc, timeout=90, what=f"{cluster} node {n}")
            ports[setup] = started[0][1]
            if replicas > 1:
                deadline = time.monotonic() + 90
                while not _in_sync(exe, started[0][2], "abc"):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{cluster}: the partitions were not in sync after 90 s")
                    time.sleep(1)
        for setup in setups:
            c = Counter(ports[setup], "bench/lat")
            counters.append(c)
        load = open("/proc/loadavg").read().split()[:3]
        print(f"bench.replicated: {args.rounds} round(s); QoS 1, 1 -> 1, {args.count} x {args.size} B; latency "
              f"probe {args.rate:g} msg/s x {args.seconds:g} s; fsync {args.fsync}; nproc {os.cpu_count()}; "
              f"load {' '.join(load)}", flush=True)
        runs = []
        order = list(setups)
        for r in range(args.rounds):
            for setup in order:
                port = ports[setup]
                cp = subprocess.run([mqload, "pubsub", "--port", str(port), "--pubs", "1", "--subs", "1",
                                     "--topic-mode", "single", "--qos", "1", "--inflight", "100", "--count",
                                     str(args.count), "--size", str(max(20, args.size)), "--timeout", "240"],
                                    capture_output=True, text=True, timeout=300)
                out = json.loads(cp.stdout.strip().splitlines()[-1])
                probe = PubackProbe(port)
                lat = probe.run(args.rate, args.seconds, args.size)
                probe.close()
                run = {"round": r, "setup": setup, "rate": out.get("deliveries_per_sec", 0.0),
                       "lost": out.get("lost"), "dup": out.get("dup_or_ooo"), "error": out.get("first_error"),
                       "p50_us": _pct(lat, 0.5) / 1000, "p99_us": _pct(lat, 0.99) / 1000, "latencies_ns": lat}
                runs.append(run)
                print(f"  round {r + 1} {setup:<12} {run['rate'] / 1000:7.2f}k msg/s, lost {run['lost']}, "
                      f"PUBACK p50 {run['p50_us'] / 1000:6.2f} ms, p99 {run['p99_us'] / 1000:6.2f} ms"
                      + (f"  ({run['error']})" if run["error"] else ""), flush=True)
            order = order[1:] + order[:1]
        medians = {}
        print("\nsetup          rate (median)   lost   PUBACK p50   p99 (all rounds' samples)")
        for setup in setups:
            mine = [x for x in runs if x["setup"] == setup]
            lat = [v for x in mine for v in x["latencies_ns"]]
            medians[setup] = m = statistics.median(x["rate"] for x in mine)
            print(f"{setup:<12} {m / 1000:10.2f}k   {sum(x['lost'] or 0 for x in mine):6d}   "
                  f"{_pct(lat, 0.5) / 1e6:7.2f} ms  {_pct(lat, 0.99) / 1e6:7.2f} ms")
        r3 = medians.get("replicas 3")
        ratios = [f"replicas 3 / {base}: {r3 / medians[base]:.2f}x" for base in ("single node", "replicas 1")
                  if r3 is not None and base in medians]
        if ratios:
            print(f"\n{'; '.join(ratios)} (target: >= 0.5x of the unreplicated QoS 1 rate)")
        print(f"load at the end: {' '.join(open('/proc/loadavg').read().split()[:3])}")
        if args.json:
            for x in runs:
                x.pop("latencies_ns")
            Path(args.json).write_text(json.dumps(runs, indent=1))
    finally:
        for c in counters:
            c.close()
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
