"""The replication connection's wire format (sans-IO): frames to bytes and back.

A follower opens one TCP connection per partition it follows to the leader's link port
and sends HELLO, then FETCHes; the leader answers each FETCH with DATA, DIVERGED,
FENCED or a run of SNAPSHOT chunks (docs/REPLICATION.md, "Data plane"). Like the node links
(`frames.py`), a frame is `u32 length | u8 kind | body`, the length counting kind and
body, big-endian. Strings are `u16 n | n bytes of UTF-8`; epochs are u32 (the leader
epoch travels in the reserved u32 of every log batch header), with 0xFFFFFFFF meaning
"none" (`NO_EPOCH`, -1 here); offsets are u64.

Every frame after HELLO names its partition and carries the sender's epoch: a receiver
that knows a higher epoch refuses the frame and answers FENCED, one that sees a higher
epoch re-reads the partition's record in etcd (KAFKA-6082: a number that only grows
fences whoever is stale). The replies to a FETCH echo the follower's `incarnation`
and `seq`, so a follower takes only the answer to the fetch it is waiting for: a
duplicated or late DIVERGED applied twice would truncate records fetched since.

Batch bytes are carried as they are, opaque: DATA holds a list of
`Batch(base, epoch, count, data)`, contiguous (each batch starts where the one before
ends) with epochs that never decrease and never exceed the frame's epoch.

Every decoder checks lengths, counts and ranges and raises `ReplicationFrameError`
(a ValueError) on anything malformed; the I/O layer closes that connection.
"""

import struct
from typing import NamedTuple

HELLO = 1
FETCH = 2
DATA = 3
DIVERGED = 4
FENCED = 5
SNAPSHOT = 6

KIND_NAMES = {HELLO: "HELLO", FETCH: "FETCH", DATA: "DATA", DIVERGED: "DIVERGED", FENCED: "FENCED",
              SNAPSHOT: "SNAPSHOT"}

VERSION = 1  # HELLO's first byte: the format of the frames that follow
NO_EPOCH = -1  # "no epoch" (an empty log's last fetched epoch), 0xFFFFFFFF on the wire
MAX_EPOCH = 0xFFFFFFFE
MAX_OFFSET = (1 << 63) - 1  # offsets are the log's i64, never negative on the wire
MAX_NAME_BYTES = 1024  # cluster, partition and node names
MAX_SECRET_BYTES = 4096
MAX_BATCHES = 1 << 20  # batches in one DATA frame (the frame's size bounds it first)

_HEAD = struct.Struct(">IB")  # length, kind
_U8 = struct.Struct(">B")
_U16 = struct.Struct(">H")
_U32 = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_EPOCH = _U32
_FETCH = struct.Struct(">IQQQI")  # epoch, incarnation, seq, fetch offset, last fetched epoch
_DATA = struct.Struct(">IQQQI")  # epoch, incarnation, seq, hw, batch count
_BATCH = struct.Struct(">QIII")  # base, epoch, count, length
_DIVERGED = struct.Struct(">IQQIQ")  # epoch, incarnation, seq, diverging epoch, end offset
_SNAPSHOT = struct.Struct(">IQQQQQQBI")  # epoch, incarnation, seq, log start, applied through,
#                                           total, chunk offset, last, length
_HELLO_TAIL = struct.Struct(">QI")  # incarnation, epoch


class ReplicationFrameError(ValueError):
    """Bytes that are not a replication frame of this format: close the connection."""


class Hello(NamedTuple):
    """First frame of a follower's connection: who it is, for which partition. `secret` is
    None when the connection is TLS (the certificate says who the follower is).
    `incarnation` grows with every registration of the follower's node in etcd (KIP-380's
    broker epoch): the leader orders the positions reported by one node's processes by it."""
    cluster: str
    secret: bytes | None
    partition: str
    follower: str
    incarnation: int
    epoch: int


class Fetch(NamedTuple):
    """Follower -> leader: "send me the log from `fetch_offset`". Sent only once the
    follower's log is durable up to `fetch_offset`, so it doubles as the acknowledgement
    the leader's high watermark counts. `last_fetched_epoch` is the epoch of the record
    just before `fetch_offset` (NO_EPOCH for an empty log): the leader checks it against
    its own epoch history (KIP-279, KIP-595's fetch-time validation)."""
    partition: str
    epoch: int
    incarnation: int
    seq: int
    fetch_offset: int
    last_fetched_epoch: int


class Batch(NamedTuple):
    """One log batch as stored: `count` records from offset `base`, written by the leader
    of `epoch`; `data` is the batch's bytes, not looked into here."""
    base: int
    epoch: int
    count: int
    data: bytes


class Data(NamedTuple):
    """Leader -> follower: the answer to FETCH `seq`: the batches from the fetch offset on
    (none: a long poll that timed out, carrying the high watermark) and the leader's `hw`."""
    partition: str
    epoch: int
    incarnation: int
    seq: int
    hw: int
    batches: list


class Diverged(NamedTuple):
    """Leader -> follower: the follower's last fetched epoch is not in the leader's history
    as far as its fetch offset: in the leader's log, the largest epoch at most that one is
    `diverging_epoch` and it ends at `end_offset` (KIP-279's OffsetsForLeaderEpoch answer)."""
    partition: str
    epoch: int
    incarnation: int
    seq: int
    diverging_epoch: int
    end_offset: int


class Fenced(NamedTuple):
    """The receiver of a frame with a lower epoch tells its sender the current one."""
    partition: str
    epoch: int


class Snapshot(NamedTuple):
    """Leader -> follower, a chunk of the leader's state database, consistent with its log
    applied through `applied_through`, for a follower whose fetch offset is below the
    leader's `log_start`: after the last chunk the follower's log is empty from
    `log_start` and it fetches from there. `total` bytes in all, this chunk at `chunk_offset`."""
    partition: str
    epoch: int
    incarnation: int
    seq: int
    log_start: int
    applied_through: int
    total: int
    chunk_offset: int
    last: bool
    data: bytes


# --------------------------------------------------------------------------- encode

def _name(text, what):
    raw = text.encode()
    if not raw or len(raw) > MAX_NAME_BYTES:
        raise ValueError(f"{what} must be 1 to {MAX_NAME_BYTES} bytes of UTF-8")
    return _U16.pack(len(raw)) + raw


def _wire_epoch(epoch):
    if epoch == NO_EPOCH:
        return 0xFFFFFFFF
    if not 0 <= epoch <= MAX_EPOCH:
        raise ValueError(f"epoch {epoch} out of range")
    return epoch


def _check_offset(value, what):
    if not 0 <= value <= MAX_OFFSET:
        raise ValueError(f"{what} {value} out of range")
    return value


def _frame(kind, *parts):
    n = 1 + sum(map(len, parts))
    return b"".join((_HEAD.pack(n, kind), *parts))


def encode_hello(hello):
    secret = hello.secret
    if secret is None:
        sec = b"\x00"
    else:
        if len(secret) > MAX_SECRET_BYTES:
            raise ValueError(f"secret longer than {MAX_SECRET_BYTES} bytes")
        sec = b"\x01" + _U16.pack(len(secret)) + bytes(secret)
    return _frame(HELLO, _U8.pack(VERSION), _name(hello.cluster, "cluster"), sec,
                  _name(hello.partition, "partition"), _name(hello.follower, "follower"),
                  _HELLO_TAIL.pack(hello.incarnation, _wire_epoch(hello.epoch)))


def encode_fetch(f):
    return _frame(FETCH, _name(f.partition, "partition"),
                  _FETCH.pack(_wire_epoch(f.epoch), f.incarnation, f.seq,
                              _check_offset(f.fetch_offset, "fetch offset"), _wire_epoch(f.last_fetched_epoch)))


def encode_data(d):
    """DATA frame; the batches' bytes are joined in once (no per-batch copy beforehand)."""
    parts = [b"", _name(d.partition, "partition"),
             _DATA.pack(_wire_epoch(d.epoch), d.incarnation, d.seq, _check_offset(d.hw, "hw"), len(d.batches))]
    for b in d.batches:
        parts.append(_BATCH.pack(_check_offset(b.base, "batch base"), _wire_epoch(b.epoch), b.count, len(b.data)))
        parts.append(b.data)
    parts[0] = _HEAD.pack(1 + sum(map(len, parts)), DATA)
    return b"".join(parts)


def encode_diverged(d):
    return _frame(DIVERGED, _name(d.partition, "partition"),
                  _DIVERGED.pack(_wire_epoch(d.epoch), d.incarnation, d.seq, _wire_epoch(d.diverging_epoch),
                                 _check_offset(d.end_offset, "end offset")))


def encode_fenced(f):
    return _frame(FENCED, _name(f.partition, "partition"), _EPOCH.pack(_wire_epoch(f.epoch)))


def encode_snapshot(s):
    if s.chunk_offset + len(s.data) > s.total or (s.last and s.chunk_offset + len(s.data) != s.total):
        raise ValueError("snapshot chunk outside its total")
    return _frame(SNAPSHOT, _name(s.partition, "partition"),
                  _SNAPSHOT.pack(_wire_epoch(s.epoch), s.incarnation, s.seq,
                                 _check_offset(s.log_start, "log start"),
                                 _check_offset(s.applied_through, "applied through"),
                                 _check_offset(s.total, "total"), s.chunk_offset, 1 if s.last else 0, len(s.data)),
                  s.data)


_ENCODERS = {Hello: encode_hello, Fetch: encode_fetch, Data: encode_data, Diverged: encode_diverged,
             Fenced: encode_fenced, Snapshot: encode_snapshot}


def encode(frame):
    """The bytes of any frame object of this module."""
    return _ENCODERS[type(frame)](frame)


# --------------------------------------------------------------------------- decode

class _Cursor:
    """Reads a body left to right; every read checks that the bytes are there."""

    __slots__ = ("body", "pos", "kind")

    def __init__(self, body, kind):
        self.body = body
        self.pos = 0
        self.kind = kind

    def fail(self, why):
        raise ReplicationFrameError(f"malformed {KIND_NAMES.get(self.kind, self.kind)}: {why}")

    def take(self, n):
        end = self.pos + n
        if end > len(self.body):
            self.fail("truncated")
        chunk = self.body[self.pos:end]
        self.pos = end
        return chunk

    def unpack(self, st):
        if self.pos + st.size > len(self.body):
            self.fail("truncated")
        values = st.unpack_from(self.body, self.pos)
        self.pos += st.size
        return values

    def name(self, what, limit=MAX_NAME_BYTES):
        (n,) = self.unpack(_U16)
        if n == 0 or n > limit:
            self.fail(f"{what} of {n} bytes")
        try:
            return bytes(self.take(n)).decode()
        except UnicodeDecodeError:
            self.fail(f"{what} is not UTF-8")

    def end(self):
        if self.pos != len(self.body):
            self.fail(f"{len(self.body) - self.pos} bytes after the frame's fields")

    def epoch(self, raw, what, allow_none=False):
        if raw == 0xFFFFFFFF:
            if allow_none:
                return NO_EPOCH
            self.fail(f"{what} missing")
        return raw

    def offset(self, raw, what):
        if raw > MAX_OFFSET:
            self.fail(f"{what} {raw} out of range")
        return raw


def decode_hello(body):
    c = _Cursor(body, HELLO)
    (version,) = c.unpack(_U8)
    if version != VERSION:
        c.fail(f"version {version} (this node speaks {VERSION})")
    cluster = c.name("cluster")
    (has_secret,) = c.unpack(_U8)
    if has_secret > 1:
        c.fail("secret flag")
    secret = None
    if has_secret:
        (n,) = c.unpack(_U16)
        if n > MAX_SECRET_BYTES:
            c.fail(f"secret of {n} bytes")
        secret = bytes(c.take(n))
    partition = c.name("partition")
    follower = c.name("follower")
    incarnation, epoch = c.unpack(_HELLO_TAIL)
    c.end()
    return Hello(cluster, secret, partition, follower, incarnation, c.epoch(epoch, "epoch"))


def decode_fetch(body):
    c = _Cursor(body, FETCH)
    partition = c.name("partition")
    epoch, incarnation, seq, offset, lfe = c.unpack(_FETCH)
    c.end()
    return Fetch(partition, c.epoch(epoch, "epoch"), incarnation, seq, c.offset(offset, "fetch offset"),
                 c.epoch(lfe, "last fetched epoch", True))


def decode_data(body):
    """DATA; the batches' bytes are slices of `body` (views if it is a memoryview)."""
    c = _Cursor(body, DATA)
    partition = c.name("partition")
    epoch, incarnation, seq, hw, n = c.unpack(_DATA)
    epoch = c.epoch(epoch, "epoch")
    hw = c.offset(hw, "hw")
    if n > MAX_BATCHES or n * _BATCH.size > len(body) - c.pos:
        c.fail(f"{n} batches in {len(body)} bytes")
    batches = []
    prev_end = prev_epoch = None
    for _ in range(n):
        base, b_epoch, count, length = c.unpack(_BATCH)
        base = c.offset(base, "batch base")
        b_epoch = c.epoch(b_epoch, "batch epoch")
        if count == 0:
            c.fail("an empty batch")
        if prev_end is not None and base != prev_end:
            c.fail(f"batch at {base} does not follow the one ending at {prev_end}")
        if b_epoch > epoch or (prev_epoch is not None and b_epoch < prev_epoch):
            c.fail(f"batch epoch {b_epoch} after {prev_epoch} in a frame of epoch {epoch}")
        if base + count > MAX_OFFSET:
            c.fail("batch past the largest offset")
        batches.append(Batch(base, b_epoch, count, c.take(length)))
        prev_end = base + count
        prev_epoch = b_epoch
    c.end()
    return Data(partition, epoch, incarnation, seq, hw, batches)


def decode_diverged(body):
    c = _Cursor(body, DIVERGED)
    partition = c.name("partition")
    epoch, incarnation, seq, div_epoch, end = c.unpack(_DIVERGED)
    c.end()
    return Diverged(partition, c.epoch(epoch, "epoch"), incarnation, seq,
                    c.epoch(div_epoch, "diverging epoch", True), c.offset(end, "end offset"))


def decode_fenced(body):
    c = _Cursor(body, FENCED)
    partition = c.name("partition")
    (epoch,) = c.unpack(_EPOCH)
    c.end()
    return Fenced(partition, c.epoch(epoch, "epoch"))


def decode_snapshot(body):
    c = _Cursor(body, SNAPSHOT)
    partition = c.name("partition")
    epoch, incarnation, seq, log_start, applied, total, chunk_offset, last, n = c.unpack(_SNAPSHOT)
    data = c.take(n)
    c.end()
    log_start = c.offset(log_start, "log start")
    applied = c.offset(applied, "applied through")
    total = c.offset(total, "total")
    if last > 1:
        c.fail("last flag")
    if chunk_offset > total or n > total - chunk_offset or (last and chunk_offset + n != total):
        c.fail(f"chunk of {n} bytes at {chunk_offset} of {total}")
    if applied < log_start:
        c.fail(f"state applied through {applied}, below the log start {log_start}")
    return Snapshot(partition, c.epoch(epoch, "epoch"), incarnation, seq, log_start, applied, total,
                    chunk_offset, bool(last), data)


_DECODERS = {HELLO: decode_hello, FETCH: decode_fetch, DATA: decode_data, DIVERGED: decode_diverged,
             FENCED: decode_fenced, SNAPSHOT: decode_snapshot}


def decode(kind, body):
    """The frame object of a (kind, body) pair cut by `FrameReader`."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise ReplicationFrameError(f"unknown frame kind {kind}")
    return decoder(body)


def decode_frame(data):
    """The one frame that `data` holds exactly (tests and the simulator)."""
    if len(data) < _HEAD.size:
        raise ReplicationFrameError("shorter than a frame header")
    n, kind = _HEAD.unpack_from(data, 0)
    if n != len(data) - 4:
        raise ReplicationFrameError(f"frame length {n} for {len(data) - 4} bytes")
    return decode(kind, memoryview(data)[_HEAD.size:])


class FrameReader:
    """Cuts a byte stream into (kind, body) pairs, each frame at most `max_frame` bytes
    (kind and body): a peer cannot make it buffer more than one frame of that size."""

    __slots__ = ("max_frame", "_buf")

    def __init__(self, max_frame):
        self.max_frame = max_frame
        self._buf = b""

    def feed(self, data):
        data = self._buf + bytes(data) if self._buf else bytes(data)
        out = []
        pos = 0
        end = len(data)
        while end - pos >= _HEAD.size:
            n, kind = _HEAD.unpack_from(data, pos)
            if n < 1 or n > self.max_frame:
                self._buf = b""
                raise ReplicationFrameError(f"frame of {n} bytes (at most {self.max_frame})")
            if end - pos - 4 < n:
                break
            out.append((kind, data[pos + _HEAD.size:pos + 4 + n]))
            pos += 4 + n
        self._buf = data[pos:]
        return out

    @property
    def buffered(self):
        return len(self._buf)
