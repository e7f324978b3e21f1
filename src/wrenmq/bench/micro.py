"""CPU cost of the publish path, measured in-process without sockets.

    python -m wrenmq.bench.micro [--storage memory|interval|always] [--size 1024] [--subs 0]

Feeds pre-encoded PUBLISH packets into real `Connection` objects (the transport
only collects what would be written) on a real event loop, with the real router and,
unless `--storage memory`, the real store and its writer thread. Prints the process
CPU time per message (all threads) and the event loop thread's alone, the best of
several rounds. Wall-clock throughput on a shared 2-core machine varies by tens of
percent; this number varies by a few, which is what profiling and before/after
comparisons need (but in a phase when the host is busy, even CPU time per message
rose 1.8x here: compare sides run in the same minutes).
"""

import argparse
import asyncio
import os
import tempfile
import time

from ..config import load
from ..mqtt import constants as C
from ..mqtt.codec import encode
from ..mqtt.packets import Connect, Publish, Subscribe, SubscribeTopic


class _Transport:
    """Stands in for a socket: counts bytes written, never blocks."""

    def __init__(self):
        self.written = 0
        self.closing = False

    def write(self, data):
        self.written += len(data)

    def writelines(self, parts):
        for p in parts:
            self.write(p)

    def is_closing(self):
        return self.closing

    def close(self):
        self.closing = True

    def can_write_eof(self):
        return False  # no half-close: a connection's close (Connection._shut) just closes

    def abort(self):
        self.closing = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass

    def set_write_buffer_limits(self, high=None, low=None):
        pass

    def get_write_buffer_size(self):
        return 0

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default


async def _run(args):
    from ..assemble import Broker
    from ..broker.connection import Connection

    tmp = tempfile.mkdtemp(prefix="wrenmq-micro-")
    text = "[[listener]]\nport = 0\n[sys]\ninterval = 0\n"
    if args.storage == "memory":
        text += '[storage]\nmode = "memory"\n'
    else:
        text += f'[storage]\ndata_dir = "{tmp}"\nfsync = "{args.storage}"\n'
    broker = Broker(load(text=text))
    await broker.start()
    version = C.MQTT5 if args.mqtt5 else C.MQTT311
    listener = broker.config.listener[0]

    def connect(cid):
        conn = Connection(broker, listener, sniff=True)  # as on a plain TCP listener
        conn.connection_made(_Transport())
        conn.data_received(encode(Connect(cid, version, True, 60), version))
        return conn

    subs = []
    for i in range(args.subs):
        s = connect(f"sub-{i}")
        s.data_received(encode(Subscribe(1, [SubscribeTopic("bench/#", args.qos)]), version))
        subs.append(s)
    pubs = [connect(f"pub-{i}") for i in range(args.clients)]
    payload = os.urandom(args.size)
    chunks = []
    for i, _ in enumerate(pubs):
        pkt = b"".join(encode(Publish(f"bench/{i}", payload, args.qos, False, False,
                                      (n % 65535) + 1 if args.qos else None), version)
                       for n in range(args.batch))
        chunks.append(pkt)
    await asyncio.sleep(0.05)
    results = []
    for _ in range(args.rounds):
        t0 = time.process_time()
        l0 = time.thread_time()  # this coroutine runs on the event loop's thread
        w0 = time.perf_counter()
        for _ in range(args.count // (args.batch * len(pubs))):
            for conn, chunk in zip(pubs, chunks):
                conn.data_received(chunk)
            await asyncio.sleep(0)  # one loop turn: flush, seal the epoch
        store = broker.store
        if store is not None:
            while store.durable_id < store.last_sealed:
                await asyncio.sleep(0.001)
        cpu = time.process_time() - t0
        loop_cpu = time.thread_time() - l0
        wall = time.perf_counter() - w0
        n = (args.count // (args.batch * len(pubs))) * args.batch * len(pubs)
        results.append((cpu / n * 1e6, n / wall, loop_cpu / n * 1e6))
    await broker.stop()
    best = min(results)
    print(f"storage={args.storage} size={args.size} qos={args.qos} subs={args.subs} "
          f"mqtt={'5' if args.mqtt5 else '3.1.1'}: {best[0]:.2f} us CPU/msg "
          f"(rounds: {', '.join(f'{r[0]:.2f}' for r in results)}), {best[1]:,.0f} msg/s wall; "
          f"event loop thread {min(r[2] for r in results):.2f} us CPU/msg")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--storage", choices=["memory", "interval", "always", "never"], default="memory")
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--qos", type=int, default=0)
    p.add_argument("--subs", type=int, default=0)
    p.add_argument("--clients", type=int, default=25)
    p.add_argument("--batch", type=int, default=40, help="packets per data_received call")
    p.add_argument("--count", type=int, default=100_000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mqtt5", action="store_true")
    args = p.parse_args(argv)
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_run(args))


if __name__ == "__main__":
    main()
