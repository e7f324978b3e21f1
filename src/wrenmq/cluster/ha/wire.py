"""Replication connections: a follower's to its leader, and the leader's side of them.

A follower opens one TCP connection per partition it follows to the leader's link port
(the process's: port.py), says HELLO (the cluster, the secret, the partition, who it is,
its incarnation) and then sends FETCHes; the leader answers DATA, DIVERGED, FENCED or
SNAPSHOT chunks (replication_frames). What a frame means is decided by the state
machines (replication.py) through the manager; here bytes are cut into frames and
frames written.

A follower waiting at the log end is answered with the batches the leader's store writer
read back as it wrote them (ReplicatedStore.recent_batches, leading.py), at once; the
leader reads anything older (`read_batches`) in a thread of its own pool, a `RawReader`
per thread and log, never on the event loop. The follower appends and syncs on its
ReplicaLog's writer thread.
"""

import asyncio
import concurrent.futures
import hmac
import logging
import threading

from .. import RETRY
from .. import replication_frames as RF
from ...store.reader import RawReader

log = logging.getLogger("wrenmq.cluster.ha")

_HELLO_BYTES = 8192  # the largest frame before a connection has said who it is
# Frames from a peer that presented the cluster's secret (or certificate): a DATA frame
# holds whole batches, and one batch holds whole epochs of the leader's loop (a turn of
# many publishers can make one of many MiB), so the bound is generous.
MAX_FRAME = 1 << 30
DATA_BYTES = 1 << 20  # what one DATA frame carries (at least one batch)
SNAPSHOT_CHUNK = 1 << 20

_local = threading.local()


def read_batches(log_dir, generation, start, end, max_bytes):
    """The batches of the log in `log_dir` from `start` (below `end`), as stored; runs in a
    reader thread, with that thread's RawReader of the log (a new one for a new
    `generation`: the log was truncated or replaced since)."""
    readers = getattr(_local, "readers", None)
    if readers is None:
        readers = _local.readers = {}
    held = readers.get(log_dir)
    if held is None or held[0] != generation:
        held = readers[log_dir] = (generation, RawReader(log_dir))
    return held[1].batches(start, end, max_bytes)


def reader_pool():
    return concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="wrenmq-replica-read")


# --- the leader's side ------------------------------------------------------------------------


class ServeLink(asyncio.Protocol):
    """A follower's connection as the leader sees it: after HELLO, FETCHes (and FENCED)
    handed to `manager.fetched` / `manager.fenced_by`; `send` writes frames."""

    def __init__(self, manager):
        self.manager = manager
        self.transport = None
        self.reader = RF.FrameReader(_HELLO_BYTES)
        self.hello = None  # replication_frames.Hello once it came

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        manager = self.manager
        try:
            for kind, body in self.reader.feed(data):
                frame = RF.decode(kind, body)
                if self.hello is None:
                    if kind != RF.HELLO:
                        raise RF.ReplicationFrameError("the first frame is not HELLO")
                    self._hello(frame)
                elif kind == RF.FETCH:
                    if frame.partition != self.hello.partition:
                        raise RF.ReplicationFrameError(f"a FETCH for {frame.partition} on the connection of "
                                                       f"{self.hello.partition}")
                    manager.fetched(self, frame)
                elif kind == RF.FENCED:
                    manager.fenced_by(self, frame)
                else:
                    raise RF.ReplicationFrameError(f"unexpected {RF.KIND_NAMES.get(kind, kind)}")
        except RF.ReplicationFrameError as e:
            who = self.hello.follower if self.hello is not None else self.transport.get_extra_info("peername")
            log.warning("cluster: closing the replication connection from %s: %s", who, e)
            self.transport.abort()

    def _hello(self, hello):
        manager = self.manager
        secret = manager.secret.encode()
        if hello.cluster != manager.cluster_name or not hmac.compare_digest(hello.secret or b"", secret):
            raise RF.ReplicationFrameError(f"HELLO from {hello.follower!r} of cluster {hello.cluster!r}: wrong "
                                           "cluster or secret")
        self.hello = hello
        self.reader.max_frame = MAX_FRAME
        manager.serve_link_up(self)

    def send(self, frame):
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(RF.encode(frame))

    def send_bytes(self, data):
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(data)

    @property
    def open(self):
        return self.transport is not None and not self.transport.is_closing()

    def close(self):
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc):
        if self.hello is not None:
            self.manager.serve_link_lost(self)


# --- the follower's side --------------------------------------------------------------------


class _FetchProtocol(asyncio.Protocol):
    def __init__(self, link):
        self.link = link
        self.transport = None
        self.reader = RF.FrameReader(MAX_FRAME)
        self.closed = asyncio.get_running_loop().create_future()

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data):
        link = self.link
        try:
            for kind, body in self.reader.feed(data):
                if kind not in (RF.DATA, RF.DIVERGED, RF.FENCED, RF.SNAPSHOT):
                    raise RF.ReplicationFrameError(f"unexpected {RF.KIND_NAMES.get(kind, kind)}")
                link.received(RF.decode(kind, body))
                if self.transport.is_closing():
                    return
        except RF.ReplicationFrameError as e:
            log.warning("cluster: closing the replication connection to %s for %s: %s", link.leader,
                        link.partition, e)
            self.transport.abort()

    def connection_lost(self, exc):
        if not self.closed.done():
            self.closed.set_result(exc)


class FetchLink:
    """This process's connection to the leader `leader` (at `address`) of `partition`:
    connected (and again after a failure) until `close`. Frames the follower sends while it
    is not connected wait: the last FETCH is sent once it is (and again after a
    reconnection, the answer to the one in flight being lost with the connection)."""

    def __init__(self, manager, partition, leader, address, incarnation, epoch):
        self.manager = manager
        self.partition = partition
        self.leader = leader
        self.address = address
        self.incarnation = incarnation
        self.epoch = epoch
        self.protocol = None
        self.last_fetch = None
        self.closing = False
        self.task = asyncio.get_running_loop().create_task(self._run())

    def send(self, frame):
        if isinstance(frame, RF.Fetch):
            self.last_fetch = frame
        p = self.protocol
        if p is not None and not p.transport.is_closing():
            p.transport.write(RF.encode(frame))

    def received(self, frame):
        self.manager.follower_frame(self, frame)

    @property
    def connected(self):
        p = self.protocol
        return p is not None and not p.transport.is_closing()

    async def _run(self):
        host, _, port = self.address.rpartition(":")
        loop = asyncio.get_running_loop()
        attempt = 0
        manager = self.manager
        while not self.closing:
            try:
                _, proto = await loop.create_connection(lambda: _FetchProtocol(self), host, int(port),
                                                        **manager.client_tls(host))
            except (OSError, ValueError) as e:
                if attempt == 3:
                    log.warning("cluster: cannot reach node %s at %s for partition %s (%s); retrying",
                                self.leader, self.address, self.partition, e)
                await asyncio.sleep(RETRY[min(attempt, len(RETRY) - 1)])
                attempt += 1
                continue
            attempt = 0
            t = proto.transport
            hello = RF.Hello(manager.cluster_name, manager.secret.encode(), self.partition, manager.node,
                             self.incarnation, max(self.epoch, 0))
            t.write(RF.encode(hello))
            if self.last_fetch is not None:
                t.write(RF.encode(self.last_fetch))
            self.protocol = proto
            exc = await proto.closed
            self.protocol = None
            if not self.closing:
                log.info("cluster: replication connection to %s for %s lost (%s); reconnecting", self.leader,
                         self.partition, exc or "closed")
                await asyncio.sleep(RETRY[0])

    def close(self):
        self.closing = True
        self.task.cancel()
        p = self.protocol
        if p is not None:
            p.transport.abort()
