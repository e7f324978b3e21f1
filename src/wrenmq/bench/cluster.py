"""What crossing nodes costs: the same load through one node, and from node to node.

    python -m wrenmq.bench.cluster [--rounds 5] [--pubs 4] [--count 25000] [--sizes 64,1024]
                                   [--storage memory|disk]

Starts an etcd (Debian's etcd-server) and three `wrenmq serve` (memory storage, or
with `--storage disk` each its own data dir and commit log, fsync interval: a link
that falls behind then replays from the log instead of dropping): a single node,
and nodes a and b of one cluster. Per round and payload size, mqload's
`pub` sends QoS 0 messages to `bench/<i>` and one subscriber (`bench/#`, QoS 0) counts
what arrives: `one node` publishes and subscribes on the single node; `two nodes`
publishes on b and subscribes on a, so every message crosses the link. The two run
back to back, the first of the pair alternating. Prints deliveries/s (messages that
reached the subscriber, over the time from its first to its last) and loss per side,
medians and their ratio.

All of it shares this machine's cores (the brokers, mqload, the subscriber): the
figure is what forwarding costs here, not what two machines would do.
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
from .harness import bench_setup

_CONNECT = bytes.fromhex("101000044d5154540402003c0004") + b"bsub"  # 3.1.1, clean, keepalive 60, id "bsub"


class Counter:
    """A QoS 0 subscriber that only counts PUBLISH packets (walking fixed headers)."""

    def __init__(self, port, flt="bench/#"):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(_CONNECT)
        f = flt.encode()
        body = b"\x00\x01" + len(f).to_bytes(2, "big") + f + b"\x00"
        self.sock.sendall(bytes((0x82, len(body))) + body)
        self.count = 0
        self.probes = 0
        self.first = self.last = None
        self._buf = b""
        self._stop = False
        got = b""
        while len(got) < 9:  # CONNACK (4) + SUBACK (5)
            got += self.sock.recv(64)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        sock = self.sock
        sock.settimeout(0.2)
        buf = b""
        while not self._stop:
            try:
                data = sock.recv(1 << 20)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            buf = buf + data if buf else data
            pos = 0
            end = len(buf)
            n = 0
            while end - pos >= 2:
                first = buf[pos]
                i = pos + 1
                length = 0
                mult = 1
                while i < end:
                    b = buf[i]
                    length += (b & 0x7F) * mult
                    i += 1
                    if b < 0x80:
                        break
                    mult *= 128
                else:
                    break
                if i + length > end:
                    break
                if first >> 4 == 3:
                    if buf[i + 2:i + 2 + 11] == b"bench/probe":  # (topic after its length)
                        self.probes += 1
                    else:
                        n += 1
                pos = i + length
            buf = buf[pos:]
            if n:
                now = time.perf_counter()
                if self.first is None:
                    self.first = now
                self.last = now
                self.count += n

    def reset(self):
        self.count = 0
        self.first = self.last = None

    def close(self):
        self._stop = True
        self.thread.join(2)
        self.sock.close()


def _probe_until_seen(port, counter, timeout=10.0):
    """Publish bench/probe on `port` until the counter sees one: the route is in place."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(bytes.fromhex("101000044d5154540402003c0004") + b"bprb")
        s.recv(4)
        t = b"bench/probe"
        pkt = bytes((0x30, 2 + len(t) + 1)) + len(t).to_bytes(2, "big") + t + b"x"
        deadline = time.monotonic() + timeout
        seen = counter.probes
        while counter.probes == seen:
            if time.monotonic() > deadline:
                raise TimeoutError("the subscription never reached the publishing node")
            s.sendall(pkt)
            time.sleep(0.05)
    time.sleep(0.3)


def _serve(exe, tmp, name, cfg_text):
    port = free_port()
    cfg = tmp / f"{name}.toml"
    cfg.write_text(cfg_text)
    log = open(tmp / f"{name}.log", "ab")
    proc = subprocess.Popen([exe, "serve", "--config", str(cfg), "--port", str(port), "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
    wait_port(port, proc, what=name)
    return proc, port


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--pubs", type=int, default=4)
    p.add_argument("--count", type=int, default=25000, help="messages per publisher")
    p.add_argument("--sizes", default="64,1024")
    p.add_argument("--storage", choices=("memory", "disk"), default="memory")
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args(argv)
    etcd = shutil.which("etcd")
    if not etcd:
        sys.exit("bench.cluster: etcd not found (Debian: apt install etcd-server; `make bench-deps` installs it)")
    _, mqload, exe, _ = bench_setup()
    if not mqload or not exe:
        sys.exit("bench.cluster: mqload or wrenmq not found (make bench-deps builds mqload)")
    tmp = Path(tempfile.mkdtemp(prefix="wrenmq-bench-cluster-"))
    procs = []
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
            if args.storage == "memory":
                return "[storage]\nmode = \"memory\"\n[sys]\ninterval = 0\n"
            return f"[storage]\ndata_dir = \"{tmp / ('data-' + name)}\"\nfsync = \"interval\"\n[sys]\ninterval = 0\n"

        def node(name):
            return storage(name) + (f"[cluster]\nenabled = true\nname = \"bench\"\nnode = \"{name}\"\n"
                           f"etcd = [\"127.0.0.1:{cport}\"]\nport = {free_port()}\n")

        single, sport = _serve(exe, tmp, "single", storage("single"))
        a, aport = _serve(exe, tmp, "a", node("a"))
        b, bport = _serve(exe, tmp, "b", node("b"))
        procs += [single, a, b]
        sides = {"one node": (sport, sport), "two nodes": (aport, bport)}
        counters = {}
        for side, (sub_port, pub_port) in sides.items():
            counters[side] = Counter(sub_port)
            _probe_until_seen(pub_port, counters[side])
        runs = []
        sizes = [int(x) for x in args.sizes.split(",")]
        expected = args.pubs * args.count
        order = list(sides)
        print(f"bench.cluster: {args.rounds} round(s) x {len(sizes)} size(s); {args.pubs} publisher(s) x "
              f"{args.count} QoS 0 messages; storage {args.storage}; nproc {os.cpu_count()}", flush=True)
        for r in range(args.rounds):
            for size in sizes:
                for side in order:
                    sub_port, pub_port = sides[side]
                    c = counters[side]
                    c.reset()
                    subprocess.run([mqload, "pub", "--port", str(pub_port), "--clients", str(args.pubs),
                                    "--count", str(args.count), "--size", str(size), "--qos", "0"],
                                   capture_output=True, check=True, timeout=300)
                    deadline = time.monotonic() + 10
                    while c.count < expected and time.monotonic() < deadline:
                        last = c.count
                        time.sleep(0.5)
                        if c.count == last and c.count:
                            break
                    rate = c.count / (c.last - c.first) if c.count > 1 and c.last > c.first else 0.0
                    runs.append({"round": r, "size": size, "side": side, "rate": rate,
                                 "lost": expected - c.count})
                    print(f"  round {r + 1} {size:>5} B {side:<9} {rate / 1000:8.1f}k msg/s delivered, "
                          f"lost {expected - c.count}", flush=True)
                order.reverse()
        print("\nsize   one node (median)   two nodes (median)   two / one   lost one | two")
        for size in sizes:
            one = [x["rate"] for x in runs if x["size"] == size and x["side"] == "one node"]
            two = [x["rate"] for x in runs if x["size"] == size and x["side"] == "two nodes"]
            lost = [sum(x["lost"] for x in runs if x["size"] == size and x["side"] == s) for s in sides]
            m1, m2 = statistics.median(one), statistics.median(two)
            print(f"{size:>5}  {m1 / 1000:10.1f}k         {m2 / 1000:10.1f}k           {m2 / m1:6.2f}x   "
                  f"{lost[0]} | {lost[1]}")
        if args.json:
            Path(args.json).write_text(json.dumps(runs, indent=1))
        for c in counters.values():
            c.close()
    finally:
        for proc in reversed(procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
