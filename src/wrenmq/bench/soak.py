"""Soak: minutes of client churn, and whether the broker's memory settles or keeps growing.

    python -m wrenmq.bench.soak [--minutes 5] [--devices 24] [--brokers wrenmq,mosquitto]

Each broker in turn (fresh, wrenmq with its log on disk, fsync every 100 ms) gets the same
churn from `--devices` threads of paho clients, half MQTT 5 and half 3.1.1. A device
connects under one of ten client ids of its own, with a clean or a persistent session
(30 s expiry) and sometimes a will; subscribes to one to three filters (wildcards, a shared
subscription, its own topic); publishes 100 messages (QoS 0/1/2, some retained or clearing
a retained topic, some on a topic never used before, which the router's match cache must
not keep for ever; MQTT 5 ones with expiry and user properties); then leaves, with a
DISCONNECT or by dropping the socket (its will goes out). Offline persistent sessions
collect what their filters match until they expire.

What it prints, every `--every` seconds: the broker's RSS, its open files, the messages
published and received so far, and what the broker says it holds for sessions (queued or
in flight: `$SYS/broker/store/messages/count` and `/bytes`, as of its last $SYS update).
At the end: RSS at a quarter, half and the end of the run, and the growth over the second
half (MiB per minute): a broker that holds nothing past the churn's steady state grows by
about zero there. Then `--settle` seconds with no clients (past the sessions' expiry): what
the broker gives back once what it held is gone. docs/BENCHMARKS.md ("Soak") has
readings.
"""

import argparse
import os
import random
import sys
import threading
import time
import uuid
from pathlib import Path

from .brokers import BrokerError, Mosquitto, Wrenmq, which
from .harness import WRENMQ_PORT, bench_setup

IDS_PER_DEVICE = 10
MESSAGES_PER_VISIT = 100


def rss_mib(pid):
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def open_files(pid):
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


class Counters:
    def __init__(self):
        self.lock = threading.Lock()
        self.published = self.received = self.visits = self.errors = 0
        self.first_error = None

    def add(self, **kw):
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)


def device(n, port, deadline, counters, rng):
    """One device thread: visits until the deadline."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    v5 = n % 2 == 0
    while time.monotonic() < deadline:
        cid = f"soak-{n}-{rng.randrange(IDS_PER_DEVICE)}"
        persistent = rng.random() < 0.5
        proto = mqtt.MQTTv5 if v5 else mqtt.MQTTv311
        c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=proto,
                        clean_session=None if v5 else not persistent)
        got = [0]

        def on_message(client, userdata, msg):
            got[0] += 1

        c.on_message = on_message
        if rng.random() < 0.3:
            wp = None
            if v5:
                wp = Properties(PacketTypes.WILLMESSAGE)
                wp.WillDelayInterval = rng.choice((0, 1))
            c.will_set(f"soak/will/{cid}", b"gone", qos=1, properties=wp)
        cp = None
        if v5:
            cp = Properties(PacketTypes.CONNECT)
            cp.SessionExpiryInterval = 30 if persistent else 0
        try:
            if v5:
                c.connect("127.0.0.1", port, keepalive=30, clean_start=not persistent, properties=cp)
            else:
                c.connect("127.0.0.1", port, keepalive=30)
            c.loop_start()
            filters = rng.sample(["soak/t/+/x", "soak/#", f"$share/g{n % 3}/soak/t/#", f"soak/u/{cid}/#",
                                  "soak/t/1/#"], rng.randint(1, 3))
            for f in filters:
                c.subscribe(f, qos=rng.randint(0, 2))
            infos = []
            for i in range(MESSAGES_PER_VISIT):
                r = rng.random()
                props = None
                if v5 and rng.random() < 0.2:
                    props = Properties(PacketTypes.PUBLISH)
                    props.MessageExpiryInterval = 5
                    props.UserProperty = [("seq", str(i))]
                if r < 0.2:  # a topic nobody used before (and no one will again)
                    infos.append(c.publish(f"soak/u/{uuid.uuid4().hex}/z", b"x" * 64, qos=0, properties=props))
                elif r < 0.3:  # retained, on a bounded set of topics; some clear it
                    payload = b"" if rng.random() < 0.2 else b"r" * rng.randint(1, 256)
                    infos.append(c.publish(f"soak/t/{rng.randrange(500)}/x", payload, qos=1, retain=True,
                                           properties=props))
                else:
                    infos.append(c.publish(f"soak/t/{rng.randrange(500)}/x", os.urandom(rng.randint(8, 512)),
                                           qos=rng.randint(0, 2), properties=props))
            for info in infos:
                info.wait_for_publish(10)
            time.sleep(rng.random() * 0.2)
            if rng.random() < 0.3:
                c.loop_stop()
                c.socket().close()  # dropped, not disconnected: the will goes out
            else:
                c.disconnect()
                c.loop_stop()
            counters.add(published=len(infos), received=got[0], visits=1)
        except Exception as e:  # a broker that failed shows in the errors column
            counters.add(errors=1)
            if counters.first_error is None:
                counters.first_error = f"{cid}: {type(e).__name__}: {e}"
            try:
                c.loop_stop()
            except Exception:
                pass
            time.sleep(0.2)


QUEUED_TOPICS = ("$SYS/broker/store/messages/count", "$SYS/broker/store/messages/bytes")


def monitor(port, queued):
    """A client that keeps the broker's last $SYS figures of what it holds for sessions
    (queued or in flight: both brokers publish them); None until they first arrive."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    c = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="soak-monitor")

    def on_message(client, userdata, msg):
        try:
            queued[QUEUED_TOPICS.index(msg.topic)] = int(msg.payload)
        except ValueError:
            pass

    c.on_message = on_message
    c.connect("127.0.0.1", port)
    for t in QUEUED_TOPICS:
        c.subscribe(t)
    c.loop_start()
    return c


def soak(broker, minutes, devices, every, seed, settle=0.0):
    broker.start()
    pid = broker.pid
    queued = [None, None]
    mon = monitor(broker.port, queued)
    counters = Counters()
    deadline = time.monotonic() + minutes * 60
    rng = random.Random(seed)
    threads = [threading.Thread(target=device, args=(n, broker.port, deadline, counters,
                                                    random.Random(rng.random())), daemon=True)
               for n in range(devices)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    print(f"{broker.name}: pid {pid}")
    print(f"{'t (s)':>6} {'RSS MiB':>8} {'files':>6} {'visits':>7} {'published':>10} {'received':>10} "
          f"{'errors':>6} {'queued':>8} {'queued MiB':>10}")
    quiet_from = None
    try:
        while True:
            if quiet_from is None and not any(t.is_alive() for t in threads):
                quiet_from = time.monotonic()
                print(f"churn over; {settle:.0f} s with no clients but the monitor", flush=True)
            if quiet_from is not None and time.monotonic() - quiet_from >= settle:
                break
            time.sleep(every)
            if not broker.alive():
                print(f"{broker.name} exited (log {broker.log_path})")
                return None
            s = (time.monotonic() - t0, rss_mib(pid), open_files(pid), counters.visits, counters.published,
                 counters.received, counters.errors, queued[0], queued[1], quiet_from is not None)
            samples.append(s)
            qn = "?" if s[7] is None else f"{s[7]:d}"
            qb = "?" if s[8] is None else f"{s[8] / 2**20:.1f}"
            print(f"{s[0]:6.0f} {s[1]:8.1f} {s[2]:6d} {s[3]:7d} {s[4]:10d} {s[5]:10d} {s[6]:6d} {qn:>8} {qb:>10}",
                  flush=True)
    finally:
        mon.loop_stop()
        broker.stop()
    if counters.first_error is not None:
        print(f"{broker.name}: {counters.errors} visits failed; the first: {counters.first_error}")
    return samples


def summary(name, samples):
    quiet = [s for s in samples or () if s[9]]
    samples = [s for s in samples or () if not s[9]]
    if len(samples) < 4:
        return f"{name}: too few samples"
    end_t = samples[-1][0]
    at = lambda frac: min(samples, key=lambda s: abs(s[0] - frac * end_t))  # noqa: E731
    q, h, e = at(0.25), at(0.5), samples[-1]
    second = [s for s in samples if s[0] >= h[0]]
    n = len(second)
    mt = sum(s[0] for s in second) / n
    mr = sum(s[1] for s in second) / n
    var = sum((s[0] - mt) ** 2 for s in second) or 1.0
    slope = sum((s[0] - mt) * (s[1] - mr) for s in second) / var * 60
    return (f"{name}: RSS {q[1]:.1f} MiB at {q[0]:.0f} s, {h[1]:.1f} at {h[0]:.0f} s, {e[1]:.1f} at the end "
            f"({e[0]:.0f} s); second half {slope:+.2f} MiB/min; {e[3]} visits, {e[4]} published, "
            f"{e[5]} received, {e[6]} errors; {'?' if e[7] is None else e[7]} messages held for sessions"
            + ("" if not quiet else
               f"; {quiet[-1][0] - e[0]:.0f} s after the churn: RSS {quiet[-1][1]:.1f} MiB, "
               f"{'?' if quiet[-1][7] is None else quiet[-1][7]} held"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--devices", type=int, default=24)
    p.add_argument("--every", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--brokers", default="wrenmq,mosquitto")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds to keep sampling once the churn is over (the sessions' expiry is 30 s)")
    p.add_argument("--config", help="wrenmq's config file (default: wrenmq-log.toml beside this module)")
    a = p.parse_args(argv)
    root, _mqload, wrenmq, log_dir = bench_setup()
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    for name in a.brokers.split(","):
        if name == "wrenmq":
            b = Wrenmq(wrenmq, WRENMQ_PORT + 7, log_dir, root, config=a.config or os.path.join(here, "wrenmq-log.toml"))
        elif name == "mosquitto":
            if not which("mosquitto"):
                print("soak: mosquitto not found (make bench-deps installs it)", file=sys.stderr)
                continue
            b = Mosquitto(which("mosquitto"), Path(here, "mosquitto.conf"), log_dir, root)
        else:
            p.error(f"unknown broker {name!r}")
        b.name = f"{name}-soak"
        try:
            out.append((name, soak(b, a.minutes, a.devices, a.every, a.seed, a.settle)))
        except BrokerError as e:
            print(f"soak: {e}", file=sys.stderr)
            return 1
    print()
    for name, samples in out:
        print(summary(name, samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
