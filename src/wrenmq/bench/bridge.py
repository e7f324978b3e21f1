"""Bridge throughput: wrenmq's bridge and Mosquitto's own, to the same local Mosquitto.

    python -m wrenmq.bench.bridge [--rounds 3] [--pubs 4] [--count 25000] [--sizes 64,1024]

One Mosquitto is the remote. Per round and payload size, three edges are started fresh
in turn (the first of the three rotating each round), each bridging `bench/#` out to the
remote at QoS 1 with MQTT 5 and a window of 256 messages:

- wrenmq, `fsync = "always"` (its default: a publisher's PUBACK leaves once the record is
  on disk), the bridge sending from the commit log;
- wrenmq, `fsync = "interval"` (PUBACK once written, fsync every 100 ms);
- Mosquitto 2.0 (Debian's), `persistence false`, its bridge queueing in memory
  (max_queued_messages 0: no limit, so it does not drop).

mqload's `pub` sends QoS 1 messages (in flight 100 per publisher) to the edge while one
subscriber on the remote (QoS 0) counts what arrives; the figure is messages through
the bridge per second at the remote, from the first to the last, and what never came.
Everything shares this machine's cores.
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
import time
from pathlib import Path

from ..ports import free_port, wait_port
from .brokers import which
from .cluster import Counter
from .harness import bench_setup

WINDOW = 256

_REMOTE = """listener {port} 127.0.0.1
allow_anonymous true
persistence false
max_inflight_messages {window}
max_queued_messages 0
"""

_MOSQUITTO_EDGE = _REMOTE + """
connection remote
address 127.0.0.1:{remote}
bridge_protocol_version mqttv50
cleansession true
topic bench/# out 1
"""

_WRENMQ_EDGE = """[storage]
data_dir = "{data}"
fsync = "{fsync}"
[sys]
interval = 0
[[bridge]]
name = "remote"
address = "127.0.0.1:{remote}"
clean_start = true
max_inflight = {window}
[[bridge.topic]]
pattern = "bench/#"
qos = 1
"""

EDGES = ("wrenmq fsync always", "wrenmq fsync interval", "mosquitto")


def _probe_until_seen(port, counter, timeout=20.0):
    """Publish bench/probe to the edge until the remote's counter sees one: the bridge is up."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(bytes.fromhex("101000044d5154540402003c0004") + b"bprb")
                s.recv(4)
                t = b"bench/probe"
                pkt = bytes((0x30, 2 + len(t) + 1)) + len(t).to_bytes(2, "big") + t + b"x"
                seen = counter.probes
                while counter.probes == seen:
                    if time.monotonic() > deadline:
                        raise TimeoutError("nothing came through the bridge")
                    s.sendall(pkt)
                    time.sleep(0.05)
            time.sleep(0.3)
            return
        except ConnectionError:
            time.sleep(0.1)


def _start(argv, log, cwd, port, what):
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)
    wait_port(port, proc, what=what)
    return proc


def _stop(proc):
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pubs", type=int, default=4)
    # (20,000 messages in all went through in under a second: readings varied by 2x)
    p.add_argument("--count", type=int, default=25000, help="messages per publisher")
    p.add_argument("--sizes", default="64,1024")
    p.add_argument("--json", help="write the runs here")
    args = p.parse_args(argv)
    mosquitto = which("mosquitto")
    if not mosquitto:
        sys.exit("bench.bridge: mosquitto not found (Debian: apt install mosquitto; `make bench-deps` installs it)")
    _, mqload, exe, _ = bench_setup()
    if not mqload or not exe:
        sys.exit("bench.bridge: mqload or wrenmq not found (make bench-deps builds mqload)")
    tmp = Path(tempfile.mkdtemp(prefix="wrenmq-bench-bridge-"))
    root_user = "user root\n" if os.geteuid() == 0 else ""
    procs = []
    try:
        rport = free_port()
        rconf = tmp / "remote.conf"
        rconf.write_text(_REMOTE.format(port=rport, window=WINDOW) + root_user)
        remote = _start([mosquitto, "-c", str(rconf)], open(tmp / "remote.log", "ab"), tmp, rport, "the remote")
        procs.append(remote)
        counter = Counter(rport)
        sizes = [int(x) for x in args.sizes.split(",")]
        expected = args.pubs * args.count
        runs = []
        print(f"bench.bridge: {args.rounds} round(s) x {len(sizes)} size(s); {args.pubs} publisher(s) x "
              f"{args.count} QoS 1 messages to the edge, bridged at QoS 1 (MQTT 5, window {WINDOW}) to a "
              f"local Mosquitto; nproc {os.cpu_count()}", flush=True)
        n = 0
        for r in range(args.rounds):
            order = EDGES[r % 3:] + EDGES[:r % 3]
            for size in sizes:
                for edge in order:
                    n += 1
                    port = free_port()
                    log = open(tmp / f"edge-{n}.log", "ab")
                    if edge == "mosquitto":
                        conf = tmp / f"edge-{n}.conf"
                        conf.write_text(_MOSQUITTO_EDGE.format(port=port, window=WINDOW, remote=rport) + root_user)
                        argv = [mosquitto, "-c", str(conf)]
                    else:
                        conf = tmp / f"edge-{n}.toml"
                        conf.write_text(_WRENMQ_EDGE.format(data=tmp / f"data-{n}", fsync=edge.split()[-1],
                                                            remote=rport, window=WINDOW))
                        argv = [exe, "serve", "--config", str(conf), "--port", str(port), "--log-level", "warning"]
                    proc = _start(argv, log, tmp, port, edge)
                    try:
                        _probe_until_seen(port, counter)
                        counter.reset()
                        subprocess.run([mqload, "pub", "--port", str(port), "--clients", str(args.pubs),
                                        "--count", str(args.count), "--size", str(size), "--qos", "1",
                                        "--inflight", "100"], capture_output=True, check=True, timeout=600)
                        deadline = time.monotonic() + 120
                        while counter.count < expected and time.monotonic() < deadline:
                            last = counter.count
                            time.sleep(2.0)
                            if counter.count == last:
                                break
                    finally:
                        _stop(proc)
                        log.close()
                    c = counter
                    rate = c.count / (c.last - c.first) if c.count > 1 and c.last > c.first else 0.0
                    runs.append({"round": r, "size": size, "edge": edge, "rate": rate,
                                 "lost": expected - c.count})
                    print(f"  round {r + 1} {size:>5} B {edge:<22} {rate / 1000:8.1f}k msg/s through the bridge, "
                          f"lost {expected - c.count}", flush=True)
        heads = "  ".join(f"{e + ' (median)':>31}" for e in EDGES)
        print(f"\nsize   {heads}   wrenmq / mosquitto   lost")
        for size in sizes:
            med = {e: statistics.median([x["rate"] for x in runs if x["size"] == size and x["edge"] == e])
                   for e in EDGES}
            lost = " | ".join(str(sum(x["lost"] for x in runs if x["size"] == size and x["edge"] == e)) for e in EDGES)
            ratios = " | ".join(f"{med[e] / med['mosquitto']:.2f}x" if med["mosquitto"] else "-" for e in EDGES[:2])
            print(f"{size:>5}  " + "  ".join(f"{med[e] / 1000:30.1f}k" for e in EDGES) + f"   {ratios}   {lost}")
        if args.json:
            Path(args.json).write_text(json.dumps(runs, indent=1))
        counter.close()
    finally:
        for proc in reversed(procs):
            _stop(proc)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
