"""The loop side of the store: the epoch being filled and the steps run per logged message.

`Store.append` and `Store.append_record` run once for every message the log records,
on the event loop. Interpreted they cost about 2,000 machine instructions each
(callgrind, 2026-11-25), a quarter of what routing a 1 KiB QoS 0 message costs. This
module holds them and the epoch they fill, as plain Python that `_epoch.pxd` gives C
types when the install compiles it (setup.py; optional): the calls then stay Python
calls, their bodies become C. Uncompiled it is the same code, only slower; `store.Store`
is a subclass of `EpochAppender` either way.
"""

try:
    import cython
    COMPILED = cython.compiled
except ImportError:  # Cython is only needed to build; the source runs without it
    COMPILED = False

from ..mqtt.codec import encode_properties
from .format import Record

_EMPTY = b""
# A QoS 0-only epoch goes to the writer mid-turn (append) at this many records or payload
# bytes: the writer frees the payloads once they are written, and a small epoch lets the
# loop reuse that memory while it is still mapped and in cache instead of growing its heap
# (a first touch of a page costs ~2 us on the 2-core VM, more than routing a message).
SEAL_RECORDS = 2048
SEAL_BYTES = 256 * 1024
RECORD_OVERHEAD = 128  # bytes a record holds besides its payload (tuple, topic, ...), roughly
# The same as C values for `_add` (declared in _epoch.pxd; a compiled module's C globals are
# not visible from Python, so the names above stay for readers of the module).
_seal_records = SEAL_RECORDS
_seal_bytes = SEAL_BYTES
_record_overhead = RECORD_OVERHEAD
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


class Epoch:
    """What one loop turn produced: log records (offsets base..) and state operations.

    A record is a tuple (timestamp us, flags, topic, client id, properties, payload,
    packet id) with bytes fields, built on the event loop; the writer thread encodes
    the epoch's records as one batch, then `release`s them: from then on they are read
    from the log files.
    """

    def __init__(self, eid, base):
        self.id = eid
        self.base = base
        self.recs = []
        self.ops = []
        self.durable = False
        self.nbytes = 0  # memory the records hold: payloads + RECORD_OVERHEAD each
        self.count = 0  # len(recs), kept once the records are released

    def release(self):
        """Drop the records (writer thread, once they are written); `count` keeps their number."""
        self.count = len(self.recs)
        self.recs = None

    @property
    def end(self):
        """One past the epoch's last offset."""
        recs = self.recs
        return self.base + (len(recs) if recs is not None else self.count)


def as_record(offset, rec):
    """An epoch's record tuple as a format.Record (reads of what may not be on disk yet)."""
    ts, flags, topic, client, props, payload, pid = rec
    return Record(offset, ts, flags & 3, bool(flags & 4), topic.decode(), client.decode(),
                  props, payload, pid, bool(flags & 8))


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

    def _add(self, ts_us, qos, retain, topic_b, client_id, props_b, payload, packet_id, private):
        """The record tuple into the current epoch. Compiled it is a C call (`_epoch.pxd`):
        `append` reaches it without a Python call, and the arguments arrive as C values."""
        off: cython.longlong = self.next_offset  # noqa: F821 (annotations: never evaluated)
        flags: cython.int = qos  # noqa: F821
        self.next_offset = off + 1
        e = self._epoch
        recs = e.recs
        if not recs:
            if not e.ops and self.on_pending is not None:
                self.on_pending()
            self._tail.append(e)
        client_b = self._client_bytes.get(client_id)
        if client_b is None:
            if len(self._client_bytes) > 100_000:
                self._client_bytes.clear()
            client_b = self._client_bytes[client_id] = client_id.encode()
        if retain:
            flags |= 4
        if private:
            flags |= 8
        rec = (ts_us, flags, topic_b, client_b, props_b, payload, packet_id)
        if _compiled:
            # Only ints and bytes: it can be in no cycle. Untracked, the cycle collector does
            # not walk the records an epoch holds (they outlive the young generation).
            PyObject_GC_UnTrack(rec)  # noqa: F821 (declared in _epoch.pxd)
        recs.append(rec)
        e.nbytes += len(payload) + _record_overhead
        if qos:
            e.durable = True
        elif (len(recs) >= _seal_records or e.nbytes >= _seal_bytes) and not e.durable:
            self.seal()
        return off

    def op(self, statement, params, durable=True):
        """Queue a state change for this epoch; `durable` ones hold output until committed."""
        e = self._epoch
        if not e.recs and not e.ops and self.on_pending is not None:
            self.on_pending()
        e.ops.append((statement, params))
        if durable:
            e.durable = True

    def seal(self):
        """Hand the current epoch to the writer; return its id (0 if it was empty)."""
        e = self._epoch
        if not e.recs and not e.ops:
            return 0
        self._last_id = e.id
        self._epoch = Epoch(e.id + 1, self.next_offset)
        self.sealed_bytes += e.nbytes
        self._queue.put(e)
        return e.id
