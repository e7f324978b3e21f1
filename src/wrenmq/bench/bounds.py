"""What the memory bounds count against what the broker holds, and what a large retained
match costs other clients.

    python -m wrenmq.bench.bounds retained [--count 10000] [--levels 128] [--limit 3000000]
    python -m wrenmq.bench.bounds wills [--count 2000] [--payload 65535] [--mode memory]
    python -m wrenmq.bench.bounds stall [--count 20000] [--levels 63] [--filter '#'] [--rounds 5]

`retained`: a fresh `wrenmq serve` takes `--count` retained messages of `--payload` bytes on
topics of `--levels` levels that part at the first level (`<i>/x/x/...`; `--shape`), with
`[limits] max_retained_bytes = --limit` (0: no limit). Prints how many it kept, what
`$SYS/broker/retained messages/bytes` counts for them, and how much more the broker's RSS
grew than on a broker that took the same messages without retain, per message kept (and
again once a subscriber to '#' has been sent them).

`wills`: `--count` clients connect with a will of `--payload` bytes (a will delay and a
session expiry of an hour) and drop their sockets, so every will is held; the same again on
a second broker without wills. The difference in RSS, per will, against what
`$SYS/broker/wills/held bytes` counts per will.

`stall`: `--count` retained messages on topics of `--levels` levels; then, `--rounds` times,
one client SUBSCRIBEs to `--filter` (and reads all it is sent) while an unrelated client
connects, subscribes to a topic of its own and publishes one message to it: the time from
its TCP connect to that message's delivery, against the same on the idle broker. This is
the row `make bench` reports as part 5.

RSS figures are the broker's VmRSS (/proc), read after the clients are done and the broker
has answered a PINGREQ; each run starts a fresh broker.
"""

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..mqtt import constants as C
from ..mqtt.codec import Decoder, encode
from ..mqtt.packets import Connect, Pingreq, Publish, Suback, Subscribe, SubscribeTopic, Will
from .brokers import HOST, Mosquitto, Wrenmq, which
from .harness import bench_setup

PORT = 18834


class Client:
    """A blocking MQTT client on a plain socket (the broker under test is local)."""

    def __init__(self, port, cid, version=C.MQTT5, will=None, properties=None, clean=True):
        self.sock = socket.create_connection((HOST, port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.version = version
        self.decoder = Decoder(version)
        self.pending = []
        self.send(Connect(cid, version, clean, 600, will, properties=properties))
        ack = self.recv()
        if ack is None or ack.TYPE != C.CONNACK or ack.reason_code:
            raise RuntimeError(f"CONNECT of {cid} refused: {ack!r}")

    def send(self, pkt):
        self.sock.sendall(pkt if isinstance(pkt, (bytes, bytearray)) else encode(pkt, self.version))

    def recv(self):
        while not self.pending:
            data = self.sock.recv(1 << 16)
            if not data:
                return None
            self.pending.extend(self.decoder.feed(data))
        return self.pending.pop(0)

    def until(self, ptype):
        while True:
            p = self.recv()
            if p is None or p.TYPE == ptype:
                return p

    def ping(self):
        self.send(Pingreq())
        self.until(C.PINGRESP)

    def close(self):
        self.sock.close()


def rss(pid):
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def sys_values(port, prefix="$SYS/broker/#"):
    """The broker's $SYS values (it publishes them every second here), after one update."""
    time.sleep(1.2)
    c = Client(port, "bench-sys")
    c.send(Subscribe(1, [SubscribeTopic(prefix)]))
    c.sock.settimeout(0.5)
    out = {}
    try:
        while True:  # the retained messages the SUBSCRIBE matches, until they stop coming
            p = c.recv()
            if p is None:
                break
            if p.TYPE == C.PUBLISH:
                out[p.topic] = p.payload.decode()
    except socket.timeout:
        pass
    c.close()
    return out


def _broker(wrenmq, log_dir, root, text):
    cfg = Path(tempfile.mkdtemp(prefix="wrenmq-bounds-")) / "wrenmq.toml"
    cfg.write_text("[sys]\ninterval = 1\n" + text)
    b = Wrenmq(wrenmq, PORT, log_dir, root, config=str(cfg))
    b.start()
    return b


def deep_topic(i, levels, shape="parted"):
    """Topic `i` of `levels` levels: parted from the others at the first level (`<i>/x/...`),
    at the last (`x/.../x/<i>`), or in the middle."""
    if shape == "parted":
        return str(i) + "/x" * (levels - 1)
    if shape == "shared":
        return "x/" * (levels - 1) + str(i)
    half = levels // 2
    return "x/" * half + str(i) + "/x" * (levels - half - 1)


def count_retained(port, flt="#"):
    """How many retained messages a subscriber to `flt` gets (until a second passes
    without one)."""
    c = Client(port, "bench-counter")
    c.sock.settimeout(1.0)
    c.send(Subscribe(1, [SubscribeTopic(flt)]))
    n = 0
    try:
        while True:
            p = c.recv()
            if p is None:
                break
            if p.TYPE == C.PUBLISH and p.retain:
                n += 1
    except socket.timeout:
        pass
    c.close()
    return n


def _retained_run(a, wrenmq, log_dir, root, retain):
    """RSS growth from publishing the messages (retained or not), then once a subscriber to
    '#' has been sent what is retained; the $SYS figures; how many it got."""
    limit = f"max_retained_bytes = {a.limit}\n" if a.limit is not None else ""
    b = _broker(wrenmq, log_dir, root, f"[storage]\nmode = \"{a.mode}\"\n[limits]\n{limit}")
    try:
        pub = Client(b.port, "bench-retainer")
        pub.ping()
        before = rss(b.pid)
        payload = b"r" * a.payload
        for i in range(a.count):
            pub.send(Publish(deep_topic(i, a.levels, a.shape), payload, 0, retain))
        pub.ping()
        pub.close()
        v = sys_values(b.port, "$SYS/broker/retained messages/+")
        grown = rss(b.pid) - before
        kept = count_retained(b.port)
        grown_sent = rss(b.pid) - before
    finally:
        b.stop()
    return grown, grown_sent, v, kept


def retained(a, wrenmq, log_dir, root):
    # The same topics published without retain first: what they cost the broker anyway (the
    # router's cache of matches by topic, the allocator's high-water mark of the traffic)
    # is not the retained store's.
    base, base_sent, _, _ = _retained_run(a, wrenmq, log_dir, root, False)
    grown, grown_sent, v, kept = _retained_run(a, wrenmq, log_dir, root, True)
    counted = int(v["$SYS/broker/retained messages/bytes"])
    held, held_sent = grown - base, grown_sent - base_sent
    out = {"count": a.count, "levels": a.levels, "shape": a.shape, "payload": a.payload, "limit": a.limit,
           "mode": a.mode, "kept": kept, "refused": int(v["$SYS/broker/retained messages/refused"]),
           "counted_bytes": counted, "rss_growth": grown, "rss_growth_not_retained": base,
           "rss_per_kept": round(held / kept) if kept else None,
           "rss_per_kept_after_sent": round(held_sent / kept) if kept else None,
           "counted_per_kept": round(counted / kept) if kept else None,
           "rss_over_counted": round(held / counted, 2) if counted else None,
           "rss_over_counted_after_sent": round(held_sent / counted, 2) if counted else None}
    print(f"retained: {kept:,} of {a.count:,} kept ({out['refused']:,} refused), {a.levels} levels "
          f"({a.shape}), {a.payload} B payloads, max_retained_bytes {a.limit}: counted {counted:,} B "
          f"({out['counted_per_kept']} B each); RSS growth {grown / 2**20:.1f} MiB, "
          f"{base / 2**20:.1f} MiB for the same not retained: {out['rss_per_kept']} B each, "
          f"{out['rss_over_counted']}x the count; once a subscriber to '#' got them "
          f"{out['rss_per_kept_after_sent']} B each, {out['rss_over_counted_after_sent']}x")
    return out


def _will_properties(size):
    """Will properties: the delay, and user properties of about `size` bytes (pairs of a
    short name and a 100-byte value, as a device's metadata might be)."""
    props = {"will_delay_interval": 3600}
    if size:
        props["user_property"] = [(f"k{i}", "v" * 100) for i in range(max(1, size // 100))]
    return props


def _go_with_wills(port, count, payload, with_will, properties=0):
    stay = {"session_expiry_interval": 3600}
    props = _will_properties(properties)
    for i in range(count):
        will = Will(f"wills/{i:08d}", payload, 0, False, props) if with_will else None
        c = Client(port, f"bench-will-{i:08d}", will=will, properties=stay)
        c.close()  # no DISCONNECT: the will is due, after its delay


def wills(a, wrenmq, log_dir, root):
    payload = b"w" * a.payload
    runs = {}
    for with_will in (False, True):
        b = _broker(wrenmq, log_dir, root, f"[storage]\nmode = \"{a.mode}\"\n[limits]\nwill_memory = 0\n")
        try:
            probe = Client(b.port, "bench-probe")
            probe.ping()
            before = rss(b.pid)
            _go_with_wills(b.port, a.count, payload, with_will, a.properties)
            probe.ping()
            v = sys_values(b.port, "$SYS/broker/wills/+")
            after = rss(b.pid)
            probe.close()
        finally:
            b.stop()
        runs[with_will] = (after - before, int(v.get("$SYS/broker/wills/held bytes", 0)))
    grown = runs[True][0] - runs[False][0]
    counted = runs[True][1]
    out = {"count": a.count, "payload": a.payload, "properties": a.properties, "mode": a.mode,
           "counted_bytes": counted,
           "rss_growth_sessions_only": runs[False][0], "rss_growth_with_wills": runs[True][0],
           "rss_per_will": round(grown / a.count), "counted_per_will": round(counted / a.count),
           "rss_over_counted": round(grown / counted, 2) if counted else None}
    print(f"wills: {a.count:,} held, {a.payload:,} B payloads, {a.properties:,} B of user properties "
          f"({a.mode}): counted {counted:,} B "
          f"({out['counted_per_will']:,} B each); RSS growth {runs[True][0] / 2**20:.1f} MiB with wills, "
          f"{runs[False][0] / 2**20:.1f} MiB for the same sessions without: {out['rss_per_will']:,} B per "
          f"will; RSS / counted {out['rss_over_counted']}x")
    return out


def _plus_filter(levels):
    return "/".join(["+"] * (levels - 1) + ["#"])


def _connect_to_delivery(port, n):
    """Seconds from an unrelated client's TCP connect to the delivery of its own message."""
    t0 = time.perf_counter()
    c = Client(port, f"bench-unrelated-{n}")
    c.send(Subscribe(1, [SubscribeTopic(f"unrelated/{n}")]))
    c.until(C.SUBACK)
    c.send(Publish(f"unrelated/{n}", b"x", 0))
    c.until(C.PUBLISH)
    took = time.perf_counter() - t0
    c.close()
    return took


def _read_retained(c, want_bytes, done):
    """Read `want_bytes` (the SUBACK and the retained messages), decoding them only after
    the last: a thread that decoded as it read would hold this process's GIL against the
    unrelated client being timed."""
    chunks = []
    have = 0
    t0 = time.perf_counter()
    while have < want_bytes:
        data = c.sock.recv(1 << 20)
        if not data:
            break
        chunks.append(data)
        have += len(data)
    took = time.perf_counter() - t0
    got = sum(p.TYPE == C.PUBLISH and p.retain for p in c.decoder.feed(b"".join(chunks)))
    done.append((got, took))


def stall_measure(broker, a):
    """(idle connect-to-delivery times, times during the SUBSCRIBE, retained delivered per
    round, seconds the subscriber took to get them all)."""
    broker.start()
    try:
        pub = Client(broker.port, "bench-retainer")
        for i in range(a.count):
            pub.send(Publish(deep_topic(i, a.levels), b"r", 0, True))
        pub.ping()
        pub.close()
        flt = _plus_filter(a.levels) if a.filter == "plus" else a.filter
        want = len(encode(Suback(1, [0]), C.MQTT5)) + sum(
            len(encode(Publish(deep_topic(i, a.levels), b"r", 0, True), C.MQTT5)) for i in range(a.count))
        idle, busy, got, spans = [], [], [], []
        for r in range(a.rounds):
            idle.append(_connect_to_delivery(broker.port, f"idle-{r}"))
            sub = Client(broker.port, f"bench-subscriber-{r}")
            done = []
            reader = threading.Thread(target=_read_retained, args=(sub, want, done), daemon=True)
            sub.send(Subscribe(1, [SubscribeTopic(flt)]))
            reader.start()
            busy.append(_connect_to_delivery(broker.port, f"busy-{r}"))
            reader.join(120)
            got.append(done[0][0] if done else 0)
            spans.append(done[0][1] if done else None)
            sub.close()
            time.sleep(0.2)
    finally:
        broker.stop()
    return idle, busy, got, spans


def stall(a, wrenmq, log_dir, root, mosquitto=None):
    results = []
    cfg = Path(tempfile.mkdtemp(prefix="wrenmq-bounds-")) / "wrenmq.toml"
    cfg.write_text("[storage]\nmode = \"memory\"\n")
    brokers = [("wrenmq", Wrenmq(wrenmq, PORT, log_dir, root, config=str(cfg)))]
    if mosquitto:
        conf = Path(tempfile.mkdtemp()) / "mosquitto.conf"
        conf.write_text(f"listener {PORT + 1} {HOST}\nallow_anonymous true\nlog_dest none\n"
                        "max_queued_messages 0\n")
        brokers.append(("mosquitto", Mosquitto(mosquitto, conf, log_dir, root)))
    for name, broker in brokers:
        idle, busy, got, spans = stall_measure(broker, a)
        shown = "+/+/.../#" if a.filter == "plus" else a.filter
        r = {"broker": name, "count": a.count, "levels": a.levels, "filter": shown, "rounds": a.rounds,
             "idle_ms": [round(x * 1000, 1) for x in idle], "busy_ms": [round(x * 1000, 1) for x in busy],
             "idle_median_ms": round(statistics.median(idle) * 1000, 1),
             "busy_median_ms": round(statistics.median(busy) * 1000, 1),
             "busy_max_ms": round(max(busy) * 1000, 1),
             "retained_delivered": got,
             "subscriber_s": [round(x, 2) if x is not None else None for x in spans]}
        results.append(r)
        print(f"stall ({name}): connect-to-delivery of an unrelated client while a SUBSCRIBE to "
              f"{shown!r} matches {a.count:,} retained messages ({a.levels} levels): median "
              f"{r['busy_median_ms']} ms, max {r['busy_max_ms']} ms (idle broker: median "
              f"{r['idle_median_ms']} ms); retained delivered per round {got}, the subscriber's "
              f"time to get them {r['subscriber_s']} s")
    return results


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    r = sub.add_parser("retained", help="retained messages on deep topics: counted vs RSS")
    r.add_argument("--count", type=int, default=10_000)
    r.add_argument("--levels", type=int, default=128)
    r.add_argument("--shape", choices=("parted", "shared", "middle"), default="parted",
                   help="where the topics part: at the first level (default), the last, the middle")
    r.add_argument("--payload", type=int, default=1)
    r.add_argument("--limit", type=int, default=3_000_000, help="max_retained_bytes (0: none)")
    r.add_argument("--mode", choices=("memory", "disk"), default="memory")
    w = sub.add_parser("wills", help="wills held for their delay: counted vs RSS")
    w.add_argument("--count", type=int, default=2000)
    w.add_argument("--payload", type=int, default=65535)
    w.add_argument("--properties", type=int, default=0, help="bytes of user properties per will")
    w.add_argument("--mode", choices=("memory", "disk"), default="memory")
    s = sub.add_parser("stall", help="an unrelated client's connect-to-delivery during a large retained match")
    s.add_argument("--count", type=int, default=20_000)
    s.add_argument("--levels", type=int, default=63)
    s.add_argument("--filter", default="#", help="the subscriber's filter; 'plus' for +/+/.../# (all levels)")
    s.add_argument("--rounds", type=int, default=5)
    s.add_argument("--mosquitto", action="store_true", help="the same against Mosquitto")
    for x in (r, w, s):
        x.add_argument("--json", metavar="OUT")
    a = p.parse_args(argv)
    root, _, wrenmq, log_dir = bench_setup()
    if a.what == "retained":
        out = retained(a, wrenmq, log_dir, root)
    elif a.what == "wills":
        out = wills(a, wrenmq, log_dir, root)
    else:
        out = stall(a, wrenmq, log_dir, root, which("mosquitto") if a.mosquitto else None)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
