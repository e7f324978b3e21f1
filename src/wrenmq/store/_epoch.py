# cython: binding=False
"""The loop side of the store: the epoch being filled and the steps run per logged message.

`Store.append` and `Store.append_record` run once for every message the log records,
on the event loop. Interpreted they cost about 2,000 machine instructions each, a
quarter of what routing a 1 KiB QoS 0 message costs. This
module holds them and the epoch they fill, as plain Python that `_epoch.pxd` gives C
types when the install compiles it (setup.py; optional): the calls then stay Python
calls, their bodies become C. Uncompiled it is the same code, only slower; `store.Store`
is a subclass of `EpochAppender` either way.

An epoch keeps its records in two byte buffers, not as a Python object per record: the
loop copies each record's fields in, and the payload object is freed right after
routing, as with the log off. The writer thread then checksums and writes the buffers
without the GIL and hands them back for reuse: a tuple and a payload object per record
would have it hold the GIL for about 150 ns per 4 KiB record to free them, while the
event loop waits for it.
"""

import struct

try:
    import cython
    COMPILED = cython.compiled
except ImportError:  # Cython is only needed to build; the source runs without it
    COMPILED = False

from ..mqtt.codec import encode_properties
from .format import Record

_EMPTY = b""
# A QoS 0-only epoch goes to the writer mid-turn (append) at this many records or bytes:
# the writer hands its buffers back once they are written, and a small epoch lets the loop
# reuse them while they are still in cache.
SEAL_RECORDS = 2048
SEAL_BYTES = 256 * 1024
# One record's fixed fields in `Epoch.fixed` (little-endian): timestamp (us), start of the
# record's bytes in `Epoch.var`, properties length, payload length, topic length, client id
# length, packet id, flags (bits 0-1 QoS, 2 retain, 3 private), one byte of padding. The
# record's bytes in `var` are topic, client id, properties, payload: the order of the
# format's columns, so its checksum is one pass over them.
FIXED = struct.Struct("<qqIIHHHBx")
FIXED_SIZE = 32
POOL_MAX_BYTES = 2 << 20  # a var buffer grown larger (a huge epoch) is not kept for reuse
# A new pair of buffers: room for the bytes of a full QoS 0 epoch (it is sealed once past
# SEAL_BYTES, so with one more record of up to 16 KiB) and for 512 records' fixed fields
# (an epoch of smaller records grows it, once: the pair is reused afterwards).
_FIRST_VAR = SEAL_BYTES + 16 * 1024
_FIRST_FIXED = 512 * FIXED_SIZE
# The same as C values (declared in _epoch.pxd; a compiled module's C globals are not
# visible from Python, so the names above stay for readers of the module).
_seal_records = SEAL_RECORDS
_seal_bytes = SEAL_BYTES
_fixed_size = FIXED_SIZE
_compiled = COMPILED


def properties_block(msg):
    """A message's MQTT 5 properties as stored: the property bytes without the length prefix."""
    if not msg.properties:
        return _EMPTY
    enc = encode_properties(msg.properties)
    # Skip the variable byte integer length prefix.
    i = 0
    while enc[i] & 0x80:
        i += 1
    return enc[i + 1:]


def new_buffers():
    """A (fixed, var) pair for an epoch, its pages touched (zeroed) now."""
    return bytearray(_FIRST_FIXED), bytearray(_FIRST_VAR)


class Epoch:
    """What one loop turn produced: log records (offsets base..) and state operations.

    The records are `count` entries of FIXED in `fixed` and their bytes in `var`, filled
    on the event loop by `add`. Once sealed an epoch does not change; the writer thread
    encodes the records of one or more epochs as one batch, then `release`s them: from
    then on they are read from the log files and the buffers go back to `pool` (a
    bounded deque), whose most recent pair the loop's next new epoch takes: memory
    already mapped and likely still in cache, where a fresh buffer costs a page fault
    per 4 KiB on first touch.
    """

    def __init__(self, eid, base, pool=None):
        self.id = eid
        self.base = base
        self.ops = []
        self.durable = False
        self.count = 0
        self.var_used = 0
        # Column totals and timestamps of the records, for the batch header.
        self.topic_bytes = self.client_bytes = self.props_bytes = self.payload_bytes = 0
        self.first_ts = self.max_ts = 0
        self.pool = pool
        self.fixed = self.var = None
        self.released = False

    def add(self, ts, flags, topic, client, props, payload, pid):
        """Copy one record in (the event loop; the epoch is not sealed yet)."""
        i: cython.Py_ssize_t = self.count  # noqa: F821 (annotations: never evaluated)
        lt: cython.Py_ssize_t = len(topic)  # noqa: F821
        lc: cython.Py_ssize_t = len(client)  # noqa: F821
        lr: cython.Py_ssize_t = len(props)  # noqa: F821
        lp: cython.Py_ssize_t = len(payload)  # noqa: F821
        start: cython.Py_ssize_t = self.var_used  # noqa: F821
        end: cython.Py_ssize_t = start + lt + lc + lr + lp  # noqa: F821
        if lt > 0xFFFF or lc > 0xFFFF:  # (MQTT's own limit: the fixed fields hold 16 bits)
            raise ValueError("topic or client id longer than 65535 bytes")
        if self.fixed is None:
            self._take_buffers()
        fixed = self.fixed
        var = self.var
        if len(fixed) < (i + 1) * _fixed_size:
            fixed.extend(bytes(len(fixed)))
        if len(var) < end:
            var.extend(bytes(max(end - len(var), len(var))))
        if _compiled:
            _put_record(var, fixed, i, start, ts, flags, topic, client, props, payload, pid)  # noqa: F821 (_epoch.pxd)
        else:
            p = start
            var[p:p + lt] = topic
            p += lt
            var[p:p + lc] = client
            p += lc
            var[p:p + lr] = props
            p += lr
            var[p:p + lp] = payload
            FIXED.pack_into(fixed, i * FIXED_SIZE, ts, start, lr, lp, lt, lc, pid, flags)
        if i == 0:
            self.first_ts = self.max_ts = ts
        elif ts > self.max_ts:
            self.max_ts = ts
        self.count = i + 1
        self.var_used = end
        self.topic_bytes += lt
        self.client_bytes += lc
        self.props_bytes += lr
        self.payload_bytes += lp

    def _take_buffers(self):
        pool = self.pool
        if pool:
            self.fixed, self.var = pool.pop()  # (only the loop takes from the pool)
        else:
            self.fixed, self.var = new_buffers()

    def release(self):
        """Writer thread, once the records are written: they are read from the files from now
        on; the buffers go back to the pool for the loop's next epochs."""
        fixed = self.fixed
        var = self.var
        self.released = True
        self.fixed = self.var = None
        pool = self.pool
        if var is not None and pool is not None and len(var) <= POOL_MAX_BYTES:
            pool.append((fixed, var))  # (a bounded deque: the oldest buffers drop out)

    @property
    def nbytes(self):
        """Memory the records hold: their bytes and fixed fields."""
        return self.var_used + self.count * FIXED_SIZE

    @property
    def end(self):
        """One past the epoch's last offset."""
        return self.base + self.count

    def record(self, i, buffers=None):
        """Record `i` of the epoch as a format.Record (reads of what may not be on disk yet).

        `buffers`: (fixed, var) taken before the writer could release them (`Store.read`).
        """
        fixed, var = buffers if buffers is not None else (self.fixed, self.var)
        ts, start, lr, lp, lt, lc, pid, flags = FIXED.unpack_from(fixed, i * FIXED_SIZE)
        p = start + lt + lc
        return Record(self.base + i, ts, flags & 3, bool(flags & 4), var[start:start + lt].decode(),
                      var[start + lt:p].decode(), bytes(var[p:p + lr]),
                      bytes(var[p + lr:p + lr + lp]), pid, bool(flags & 8))

    def columns(self, buffers=None):
        """The records as the format's columns: (timestamps, flags, topics, clients,
        properties, payloads, packet ids), lists (the reference encoder's input)."""
        fixed, var = buffers if buffers is not None else (self.fixed, self.var)
        cols = ([], [], [], [], [], [], [])
        ts_c, flag_c, topic_c, client_c, props_c, payload_c, pid_c = cols
        mv = memoryview(var)
        for ts, start, lr, lp, lt, lc, pid, flags in FIXED.iter_unpack(fixed[:self.count * FIXED_SIZE]):
            ts_c.append(ts)
            flag_c.append(flags)
            pid_c.append(pid)
            p = start
            topic_c.append(bytes(mv[p:p + lt]))
            p += lt
            client_c.append(bytes(mv[p:p + lc]))
            p += lc
            props_c.append(bytes(mv[p:p + lr]))
            p += lr
            payload_c.append(bytes(mv[p:p + lp]))
        mv.release()
        return cols


class EpochAppender:
    """Offsets and the current epoch; `store.Store` sets the fields in its __init__.

    Call from the event loop only.
    """

    def append(self, msg, packet_id=0, topic_b=None, private=False):
        """Give `msg` the next offset and put it in the current epoch.

        `packet_id` is the publisher's id of a QoS 2 message: recovery uses it to
        recognise a resend of a message that reached the log just before a crash.
        `private`: the topic is not recorded for readers, but a persistent session is
        owed the message, and the log is where owed messages survive a restart.
        `topic_b`: the topic's UTF-8 bytes, if the caller has them.
        """
        ts: cython.double = msg.timestamp  # noqa: F821 (an annotation: never evaluated)
        off = self._add(int(ts * 1_000_000), msg.qos, msg.retain, topic_b or msg.topic_bytes,
                        msg.client_id, properties_block(msg) if msg.properties else _EMPTY,
                        msg.payload, packet_id, private)
        msg.offset = off
        return off

    def append_record(self, ts_us, qos, retain, topic_b, client_id, props_b, payload, packet_id=0,
                      private=False):
        """Append one record from its fields (no Message needed); return its offset."""
        return self._add(ts_us, qos, retain, topic_b, client_id, props_b, payload, packet_id, private)

    def topic_log(self, topic_b):
        """The router's handle on a topic the log records (`TopicLog`), for its match cache."""
        return TopicLog(self, topic_b)

    def _add(self, ts_us, qos, retain, topic_b, client_id, props_b, payload, packet_id, private):
        """The record into the current epoch. Compiled it is a C call (`_epoch.pxd`):
        `append` reaches it without a Python call, and the arguments arrive as C values."""
        off: cython.longlong = self.next_offset  # noqa: F821 (annotations: never evaluated)
        flags: cython.int = qos  # noqa: F821
        self.next_offset = off + 1
        e = self._epoch
        if not e.count:
            if not e.ops and self.on_pending is not None:
                self.on_pending()
            self._tail.append(e)
        if type(client_id) is bytes:  # (TopicLog.record: the session's UTF-8 client id)
            client_b = client_id
        else:
            client_b = self._client_bytes.get(client_id)
            if client_b is None:
                if len(self._client_bytes) > 100_000:
                    self._client_bytes.clear()
                client_b = self._client_bytes[client_id] = client_id.encode()
        if retain:
            flags |= 4
        if private:
            flags |= 8
        if type(payload) is not bytes:  # (a hook's transform may hand over a bytearray)
            payload = bytes(payload)
        e.add(ts_us, flags, topic_b, client_b, props_b, payload, packet_id)
        if qos:
            e.durable = True
        elif (e.count >= _seal_records or e.var_used + e.count * _fixed_size >= _seal_bytes) \
                and not e.durable:
            self.seal()
        return off

    def op(self, statement, params, durable=True):
        """Queue a state change for this epoch; `durable` ones hold output until committed."""
        e = self._epoch
        if not e.count and not e.ops and self.on_pending is not None:
            self.on_pending()
        e.ops.append((statement, params))
        if durable:
            e.durable = True

    def seal(self):
        """Hand the current epoch to the writer; return its id (0 if it was empty)."""
        e = self._epoch
        if not e.count and not e.ops:
            return 0
        self._last_id = e.id
        self._epoch = Epoch(e.id + 1, self.next_offset, self._pool)
        self.sealed_bytes += e.nbytes
        self._queue.put(e)
        return e.id


class TopicLog:
    """A topic the log records, as the router's match cache holds it (one per topic).

    `topic`: its UTF-8 bytes, which every record of it reuses. The router calls `record`
    on the object it already holds, with five positional arguments: a bound method of
    the store kept on the router cost the event loop a method lookup through the
    router's instance dictionary per message, and the topic one more argument
    (callgrind).
    """

    def __init__(self, store, topic):
        self._store = store
        self.topic = topic

    def record(self, ts_us, qos, client_b, payload, packet_id, /):
        """Log a received PUBLISH without properties that nobody receives (no Message is
        built), not retained, not private. `client_b`: the publisher's client id as UTF-8
        bytes (`Session.client_b`). `packet_id`: the packet's (None at QoS 0), kept for
        QoS 2 only. Returns nothing."""
        self._store._add(ts_us, qos, False, self.topic, client_b, _EMPTY, payload,
                         packet_id if qos == 2 else 0, False)


def _put_record(var, fixed, i, start, ts, flags, topic, client, props, payload, pid):
    """Compiled only (`add` runs this source's slice assignments otherwise): the record's
    bytes and fixed fields copied in with memcpy."""
    v: cython.p_char = PyByteArray_AS_STRING(var) + start  # noqa: F821 (_epoch.pxd)
    f: cython.p_char = PyByteArray_AS_STRING(fixed) + i * _fixed_size  # noqa: F821
    lt: cython.uint = len(topic)  # noqa: F821
    lc: cython.uint = len(client)  # noqa: F821
    lr: cython.uint = len(props)  # noqa: F821
    lp: cython.uint = len(payload)  # noqa: F821
    memcpy(v, PyBytes_AS_STRING(topic), lt)  # noqa: F821
    v += lt
    memcpy(v, PyBytes_AS_STRING(client), lc)  # noqa: F821
    v += lc
    memcpy(v, PyBytes_AS_STRING(props), lr)  # noqa: F821
    v += lr
    memcpy(v, PyBytes_AS_STRING(payload), lp)  # noqa: F821
    wrenmq_put_fixed(f, ts, start, lr, lp, lt, lc, pid, flags)  # noqa: F821
