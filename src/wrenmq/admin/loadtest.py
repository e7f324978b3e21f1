"""`wrenmq bench`: a load-test client with fan-out control, for any MQTT broker.

    wrenmq bench --clients 50 --interval 0.1 --subscribe 'bench/#' --qos 1 --size 256 --duration 30

N clients connect. Each publishes one message every `--interval` seconds (their sends
spread evenly over the interval), message m of client i to topic `<prefix>/<(i + m) % T>`
(T = `--topics`, N by default): every client's messages are spread evenly over the topics.
Each client subscribes to every `--subscribe` filter, in which `{i}` is its number modulo T
(the default, `<prefix>/{i}`, gives every topic one subscriber: fan-out 1; `<prefix>/#`
gives every message to every client: fan-out N). The fan-out of each topic (how many
clients' filters match it) is counted before the run, so the deliveries expected are
known and loss is measured, not guessed.

Every payload starts with its send time (this process's clock): the latency of each
delivery is taken on arrival. A line of progress shows each second; at the end: messages
sent and received per second, deliveries expected and lost, latency percentiles.

The client is one Python process on one core: it cannot outrun a broker written in C, and
at some rate it measures itself. The run says so when it could not keep the pace it was
asked for. For heavier load, `--mqload PATH` runs the same shape with mqload (a Rust
generator, shared/tools/mqload) instead: `pubsub --pubs N --subs N --rate 1/interval`.
"""

import argparse
import asyncio
import json
import random
import shutil
import struct
import subprocess
import sys
import time

from ..mqtt.topics import topic_matches
from ..mqtt import constants as C
from .client import ClientError, MqttClient

STAMP = struct.Struct(">dII")  # send time (perf_counter), client number, message number
RESERVOIR = 200_000  # latencies kept for the percentiles (a uniform sample beyond)


def add_parser(sub):
    p = sub.add_parser("bench", help="load-test a broker: N clients, a rate, fan-out by subscriptions",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="the broker's address (127.0.0.1)")
    p.add_argument("--port", type=int, default=1883, help="the broker's MQTT port (1883)")
    p.add_argument("--clients", "-n", type=int, default=10, help="clients, each publishing and subscribing (10)")
    p.add_argument("--interval", type=float, default=0.1, help="seconds between one client's messages (0.1)")
    p.add_argument("--subscribe", "-s", action="append", metavar="FILTER",
                   help="filter every client subscribes to; {i} = its number mod --topics "
                        "(default: <prefix>/{i}, fan-out 1); repeatable")
    p.add_argument("--topics", type=int, help="topics the messages are spread over (default: --clients)")
    p.add_argument("--qos", type=int, choices=(0, 1, 2), default=0, help="QoS of the messages and subscriptions (0)")
    p.add_argument("--size", type=int, default=64, help=f"payload bytes (at least {STAMP.size}; 64)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of publishing (10)")
    p.add_argument("--prefix", default="bench", help="topic prefix and client id prefix (bench)")
    p.add_argument("--mqtt5", action="store_true", help="speak MQTT 5.0 (default 3.1.1)")
    p.add_argument("--user", "-u", help="MQTT user name")
    p.add_argument("--password", "-P", help="MQTT password")
    p.add_argument("--window", type=int, default=100, help="QoS 1/2 messages a client leaves unacknowledged (100)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON line at the end")
    p.add_argument("--mqload", metavar="PATH", nargs="?", const="",
                   help="run the load with mqload instead (PATH, or found in .bench/mqload or on PATH)")
    p.set_defaults(func=main)


def fanouts(topics, filters_of):
    """How many clients' filters match each topic."""
    out = []
    for topic in topics:
        out.append(sum(1 for filters in filters_of if any(topic_matches(f, topic) for f in filters)))
    return out


def percentile(sorted_values, q):
    if not sorted_values:
        return None
    k = min(len(sorted_values) - 1, max(0, int(round(q * (len(sorted_values) - 1)))))
    return sorted_values[k]


class Run:
    def __init__(self, args):
        self.args = args
        n = args.clients
        self.n_topics = args.topics or n
        self.topics = [f"{args.prefix}/{k}" for k in range(self.n_topics)]
        patterns = args.subscribe or [args.prefix + "/{i}"]
        self.filters_of = [[p.replace("{i}", str(i % self.n_topics)) for p in patterns] for i in range(n)]
        self.fanout = fanouts(self.topics, self.filters_of)
        self.sent = 0
        self.expected = 0
        self.received = 0
        self.latencies = []
        self.seen_latencies = 0
        self.clients = []
        self.errors = []
        self.started = None
        self.stopped = None  # publishing over
        self.last_rx = None

    def on_message(self, topic, payload):
        now = self.last_rx = time.perf_counter()
        self.received += 1
        if len(payload) >= STAMP.size:
            lat = now - STAMP.unpack_from(payload)[0]
            self.seen_latencies += 1
            if len(self.latencies) < RESERVOIR:
                self.latencies.append(lat)
            else:
                j = random.randrange(self.seen_latencies)
                if j < RESERVOIR:
                    self.latencies[j] = lat

    async def connect_all(self):
        a = self.args
        version = C.MQTT5 if a.mqtt5 else C.MQTT311
        sem = asyncio.Semaphore(50)

        async def one(i):
            async with sem:
                c = await MqttClient.connect(a.host, a.port, f"{a.prefix}-{i}", version, a.user, a.password,
                                             on_message=self.on_message, window=a.window)
                await c.subscribe(self.filters_of[i], a.qos)
                return c

        self.clients = await asyncio.gather(*(one(i) for i in range(a.clients)))

    async def publisher(self, i, client, stop_at):
        a = self.args
        pad = b"x" * max(0, a.size - STAMP.size)
        t0 = self.started + a.interval * i / a.clients
        m = 0
        T = self.n_topics
        while True:
            due = t0 + m * a.interval
            now = time.perf_counter()
            if due >= stop_at or now >= stop_at:
                return  # (at --duration: a client behind its pace does not make up the rest)
            delay = due - now
            if delay > 0:
                await asyncio.sleep(delay)
            k = (i + m) % T
            await client.publish(self.topics[k], STAMP.pack(time.perf_counter(), i, m) + pad, a.qos)
            self.sent += 1
            self.expected += self.fanout[k]
            m += 1

    def progress(self, final=False):
        elapsed = max(1e-9, (self.stopped or time.perf_counter()) - self.started)
        lost = self.expected - self.received
        line = (f"{elapsed:6.1f}s  sent {self.sent:>9,} ({self.sent / elapsed:>9,.0f}/s)  "
                f"received {self.received:>9,} ({self.received / elapsed:>9,.0f}/s)  "
                f"{'lost' if final else 'in flight'} {max(0, lost):>7,}")
        return line

    async def run(self):
        a = self.args
        await self.connect_all()
        self.started = time.perf_counter()
        stop_at = self.started + a.duration
        tasks = [asyncio.ensure_future(self.publisher(i, c, stop_at)) for i, c in enumerate(self.clients)]
        ticker = asyncio.ensure_future(self._ticker())
        publishing = asyncio.gather(*tasks)
        lost = asyncio.get_running_loop().create_future()
        for c in self.clients:
            c.closed.add_done_callback(lambda f: lost.done() or lost.set_result(None))
        await asyncio.wait([publishing, lost], return_when=asyncio.FIRST_COMPLETED, timeout=a.duration + 60)
        for c in self.clients:
            if c.closed.done():
                self.errors.append(str(c.closed.result() or f"{c.client_id}: connection lost"))
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                self.errors.append(str(t.exception()))
            t.cancel()
        publishing.cancel()
        self.stopped = time.perf_counter()
        # What is still on its way: wait until it has all come, or nothing came for 2 s.
        last, quiet_since = self.received, time.perf_counter()
        while self.received < self.expected and time.perf_counter() - quiet_since < 2.0:
            await asyncio.sleep(0.05)
            if self.received != last:
                last, quiet_since = self.received, time.perf_counter()
        if a.qos:
            await asyncio.gather(*(c.drained(2.0) for c in self.clients))
        ticker.cancel()
        for c in self.clients:
            c.close()
        return self.report()

    async def _ticker(self):
        tty = sys.stderr.isatty()
        while True:
            await asyncio.sleep(1.0)
            line = self.progress()
            sys.stderr.write(("\r" + line) if tty else (line + "\n"))
            sys.stderr.flush()

    def report(self):
        a = self.args
        elapsed = max(1e-9, self.stopped - self.started)
        rx_elapsed = max(elapsed, (self.last_rx or self.stopped) - self.started)
        lat = sorted(self.latencies)
        target = a.clients / a.interval
        out = {
            "clients": a.clients, "topics": self.n_topics, "qos": a.qos, "size": a.size,
            "interval": a.interval, "duration": round(elapsed, 3),
            "fanout_mean": round(sum(self.fanout) / len(self.fanout), 3) if self.fanout else 0,
            "target_msgs_per_sec": round(target, 1),
            "sent": self.sent, "sent_per_sec": round(self.sent / elapsed, 1),
            "expected": self.expected, "received": self.received,
            "received_per_sec": round(self.received / rx_elapsed, 1),
            "lost": max(0, self.expected - self.received),
            "extra": max(0, self.received - self.expected),
            "latency_ms": {name: round(percentile(lat, q) * 1000, 3) if lat else None
                           for name, q in (("p50", .5), ("p90", .9), ("p99", .99), ("p999", .999),
                                           ("max", 1.0))},
            "errors": self.errors[:10],
        }
        out["client_limited"] = out["sent_per_sec"] < 0.9 * target
        return out


def print_report(r):
    lat = r["latency_ms"]
    print()
    print(f"clients {r['clients']}, topics {r['topics']}, mean fan-out {r['fanout_mean']}, QoS {r['qos']}, "
          f"{r['size']} B payloads, for {r['duration']} s")
    print(f"sent      {r['sent']:>10,}   {r['sent_per_sec']:>10,.0f} msg/s   (asked: {r['target_msgs_per_sec']:,.0f}/s)")
    print(f"received  {r['received']:>10,}   {r['received_per_sec']:>10,.0f} msg/s   "
          f"(expected {r['expected']:,}: lost {r['lost']:,}{', extra ' + format(r['extra'], ',') if r['extra'] else ''})")
    if lat["p50"] is not None:
        print(f"latency   p50 {lat['p50']:.2f} ms   p90 {lat['p90']:.2f} ms   p99 {lat['p99']:.2f} ms   "
              f"p99.9 {lat['p999']:.2f} ms   max {lat['max']:.2f} ms")
    for e in r["errors"]:
        print(f"error: {e}")
    if r["client_limited"]:
        print("note: this client could not keep the pace asked of it: here it, one Python process, is the "
              "limit, not the broker (use --mqload, or run several wrenmq bench processes).")


def find_mqload(path):
    from pathlib import Path

    if path:
        return path
    for base in (Path.cwd(), Path(__file__).resolve().parents[3]):
        p = base / ".bench" / "mqload" / "release" / "mqload"
        if p.is_file():
            return str(p)
    return shutil.which("mqload")


def run_mqload(args):
    binary = find_mqload(args.mqload)
    if binary is None:
        print("wrenmq: mqload not found (build it with `make bench-deps`, or give --mqload PATH)", file=sys.stderr)
        return 2
    filters = args.subscribe or [f"{args.prefix}/#"]
    if len(filters) != 1 or "{i}" in filters[0]:
        print("wrenmq: with --mqload every subscriber has the same one filter (no {i})", file=sys.stderr)
        return 2
    argv = [binary, "pubsub", "--host", args.host, "--port", str(args.port), "--pubs", str(args.clients),
            "--subs", str(args.clients), "--rate", str(max(1, round(1 / args.interval))),
            "--duration", str(args.duration), "--size", str(max(20, args.size)), "--qos", str(min(args.qos, 1)),
            "--topic-mode", "per-pub", "--topic-prefix", args.prefix, "--sub-topic", filters[0]]
    if args.mqtt5:
        argv.append("--mqtt5")
    if args.qos == 2:
        print("note: mqload publishes at QoS 0 or 1: this run uses QoS 1", file=sys.stderr)
    print("running: " + " ".join(argv), file=sys.stderr)
    proc = subprocess.run(argv, capture_output=True, text=True)
    line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if args.json:
        print(line)
    else:
        try:
            print(json.dumps(json.loads(line), indent=1))
        except ValueError:
            print(proc.stdout + proc.stderr)
    return proc.returncode


def main(args):
    if args.clients < 1 or args.interval <= 0 or args.duration <= 0 or (args.topics is not None and args.topics < 1):
        print("wrenmq: --clients, --interval, --duration and --topics must be positive", file=sys.stderr)
        return 2
    if args.size < STAMP.size:
        print(f"wrenmq: --size must be at least {STAMP.size} (the send time stamp)", file=sys.stderr)
        return 2
    if args.mqload is not None:
        return run_mqload(args)
    run = Run(args)
    try:
        result = asyncio.run(run.run())
    except (OSError, ClientError, asyncio.TimeoutError) as e:
        print(f"\nwrenmq: bench against {args.host}:{args.port} failed: {e or type(e).__name__}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 1 if result["errors"] else 0
