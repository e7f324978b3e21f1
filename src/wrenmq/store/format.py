"""The on-disk record batch: columnar, checksummed, readable without a Python object per record.

One batch holds the records of one group commit. Layout (little-endian):

    0   magic      4s  b"WRN2" (the format version, see below)
    4   length     u32 bytes after this field (the batch is 8 + length bytes, a multiple of 8)
    8   crc        u32 CRC-32C of bytes [12, 8 + length)
    12  base       i64 offset of the first record (offsets are dense: base + i)
    20  count      u32 number of records N
    24  first_ts   i64 timestamp of the first record, microseconds since the epoch
    32  max_ts     i64 largest timestamp in the batch
    40  attrs      u32 bit 0 (ATTR_STATE): the batch holds state records; other bits 0
    44  epoch      u32 the leader epoch of the replica that wrote the batch (replicated
                   partitions, see below); 0 in a log that is not replicated
    48  timestamps         i64[N]
        record_crc         u32[N]  CRC-32C of topic + client_id + properties + payload
        topic_offsets      u32[N+1]  (Arrow-style offsets into the topic data)
        client_offsets     u32[N+1]
        property_offsets   u32[N+1]  (raw MQTT 5 property block, without its length prefix)
        payload_offsets    u32[N+1]
        packet_ids         u16[N]  the publisher's packet id of a QoS 2 message, else 0
        flags              u8[N]   bits 0-1 QoS, bit 2 retain, bit 3 private (kept only
                                   because a persistent session is owed it; readers of the
                                   topic stream skip it), bit 4 state (always with bit 3,
                                   QoS 0, no retain: flags = 24; see below)
        topic data, client data, property data, payload data, zero padding to 8

The batch CRC makes the normal read one C call over the bytes; the record CRCs
let a damaged batch be salvaged record by record and let `wrenmq log verify`
name the exact offsets that are bad. The offsets columns are Arrow's binary
layout, so a reader builds Arrow arrays over the batch bytes without copying.
Checksums are CRC-32C (Castagnoli, as in Kafka's record batches), computed with
the hardware instruction by `crc32c`.

Format versions, told apart by the magic (the layout above is the same in both):

    WRN2  checksums are CRC-32C. What this version writes; a reader takes nothing
          else for a WRN2 batch's checksums.
    WRN1  the first version. Its checksums are CRC-32 (zlib) in logs written by the
          first releases and CRC-32C in logs written after the switch to CRC-32C,
          which kept the magic; both kinds are on users' disks, so a WRN1 batch (and
          each of its records) checks out if either checksum matches.

State records (replicated partitions, `[cluster] replicas` > 1): the broker's state
changes of one group commit (`state.py`: SQLite statements and their parameters) travel
in the log with its messages, as one record at the end of the commit's records, so that
every replica applies the same changes at the same offsets (store/replicated.py). Its
flags are private + state (24), its topic, client id and properties are empty, and its
payload is `state.encode_ops`' encoding: a version byte (1), then per operation a u8
statement id (the statement's index in `state.STATEMENTS`, a table that only grows) and
its parameters, each a tag byte and a value: 0 None, 1 int (i64), 2 float (f64), 3 str
(u32 length + UTF-8), 4 bytes (u32 length + bytes), all little-endian. A batch holding
one sets ATTR_STATE in its header, so a replica finds them by reading batch headers.
Every reader of the topic stream skips them as private; the broker's own reads
(`Store.read`) leave them out too.

A log can hold both: a writer appends WRN2 batches after the WRN1 ones an older
version left, and every reader (the scanners, `LogReader`, recovery, `wrenmq log`,
Arrow and the Spark source) reads each batch by its own magic. A new version gets a
new magic beginning with `MAGIC_STEM`, which is what the scanners search for.
"""

import struct
import sys
import zlib
from array import array
from itertools import accumulate

# crc32c(data, value=0): keeps the GIL for buffers under 32 KiB, where releasing it
# costs more than the checksum (google-crc32c released it on every call: two GIL
# hand-overs per logged record between the writer thread and the event loop).
from crc32c import crc32c as _crc

MAGIC = b"WRN2"  # the version written
MAGIC_V1 = b"WRN1"  # read only: CRC-32 or CRC-32C checksums
MAGIC_STEM = b"WRN"  # how every version's magic begins (what a search for batches looks for)
HEADER = struct.Struct("<4sIIqIqqII")
HEADER_SIZE = HEADER.size  # 48
HEADER_TAIL = struct.Struct("<qIqqII")  # the header after magic, length and crc
_PREFIX = struct.Struct("<4sI")
MAX_BATCH_BYTES = 1 << 30
ATTRS_AT = 40  # where the header's attrs and leader epoch (u32 each) are
EPOCH_AT = 44
ATTR_STATE = 1  # attrs: the batch holds state records
FLAG_PRIVATE = 8
FLAG_STATE = 16
STATE_FLAGS = FLAG_PRIVATE | FLAG_STATE  # the flags of a state record

if sys.byteorder != "little":  # pragma: no cover - every platform we ship on is little-endian
    raise ImportError("wrenmq's log format code assumes a little-endian machine")


_prefix_crcs = {}  # (topic, client) -> CRC-32C of topic + client: most records repeat them


def _record_crcs(topics, clients, props, payloads):
    """record_crc of every record.

    The topic + client prefix is computed once per distinct pair, and the per-record
    work runs in C (`map` over the CRC function): no interpreted loop per record.
    """
    cache = _prefix_crcs
    pairs = list(zip(topics, clients))
    missing = set(pairs).difference(cache)
    if missing:
        if len(cache) + len(missing) > 65536:
            cache.clear()
            missing = set(pairs)
        for t, c in missing:
            cache[(t, c)] = _crc(c, _crc(t)) if c else _crc(t)
    prefix = map(cache.__getitem__, pairs)
    if any(props):
        prefix = [_crc(r, crc) if r else crc for crc, r in zip(prefix, props)]
    return map(_crc, payloads, prefix)


def record_crc(topic, client, props, payload):
    """CRC-32C of one record's variable fields, in column order."""
    crc = _crc(topic)
    if client:
        crc = _crc(client, crc)
    if props:
        crc = _crc(props, crc)
    return _crc(payload, crc)


def legacy_record_crc(topic, client, props, payload):
    """The CRC-32 (zlib) record checksum of the first WRN1 logs."""
    crc32 = zlib.crc32
    return crc32(payload, crc32(props, crc32(client, crc32(topic))))


class CorruptBatch(Exception):
    """A batch whose bytes do not check out; `recoverable` if its structure is intact."""


def encode_batch_parts(base, timestamps, flags, topics, clients, props, payloads, packet_ids=None, attrs=0,
                       epoch=0):
    """Serialize one batch as (12-byte prefix, rest): write both with one `os.writev`.

    `attrs` and `epoch` go to the header's fields of those names (ATTR_STATE; the leader
    epoch of a replicated partition).

    The record data is copied once (one join) and checksummed in one pass over the
    joined bytes; only the per-record CRCs are computed record by record.
    """
    n = len(timestamps)
    crcs = array("I", _record_crcs(topics, clients, props, payloads))
    # Offsets columns; the last offset of each is that column's data size.
    offsets = [array("I", accumulate(map(len, column), initial=0)) if any(column) else None
               for column in (topics, clients, props, payloads)]
    cols = [
        array("q", timestamps).tobytes(),
        crcs.tobytes(),
        *(o.tobytes() if o is not None else bytes(4 * (n + 1)) for o in offsets),
        array("H", packet_ids).tobytes() if packet_ids is not None else bytes(2 * n),
        bytes(flags),
    ]
    size = HEADER_SIZE + sum(map(len, cols)) + sum(o[-1] for o in offsets if o is not None)
    pad = -size % 8
    length = size + pad - 8
    if length + 8 > MAX_BATCH_BYTES:
        raise ValueError("batch too large")
    tail = b"".join([HEADER_TAIL.pack(base, n, timestamps[0], max(timestamps), attrs, epoch), *cols,
                     *topics, *clients, *props, *payloads, b"\0" * pad])
    return _PREFIX.pack(MAGIC, length) + struct.pack("<I", _crc(tail)), tail


def encode_batch(base, timestamps, flags, topics, clients, props, payloads, packet_ids=None, attrs=0, epoch=0):
    """Serialize one batch from per-record columns (lists of ints / bytes) into bytes."""
    prefix, tail = encode_batch_parts(base, timestamps, flags, topics, clients, props, payloads,
                                      packet_ids, attrs, epoch)
    return prefix + tail


def read_prefix(buf, pos=0):
    """(total batch size, or None if the bytes at pos are not a batch start)."""
    if len(buf) - pos < 8:
        return None
    magic, length = _PREFIX.unpack_from(buf, pos)
    if magic != MAGIC and magic != MAGIC_V1:
        return None
    if length < HEADER_SIZE - 8 or length + 8 > MAX_BATCH_BYTES or length % 8:
        return None
    return length + 8


class Batch:
    """A view over one batch's bytes; columns are read lazily."""

    __slots__ = ("buf", "pos", "size", "base", "count", "first_ts", "max_ts", "attrs", "epoch", "v1", "_cols")

    def __init__(self, buf, pos=0, verify=True):
        size = read_prefix(buf, pos)
        if size is None:
            raise CorruptBatch("no batch header")
        if pos + size > len(buf):
            raise CorruptBatch("batch runs past the end of the data")
        magic, _, crc, base, count, first_ts, max_ts, attrs, epoch = HEADER.unpack_from(buf, pos)
        self.buf = buf
        self.pos = pos
        self.size = size
        self.base = base
        self.count = count
        self.first_ts = first_ts
        self.max_ts = max_ts
        self.attrs = attrs
        self.epoch = epoch
        self.v1 = magic == MAGIC_V1  # (its checksums may be CRC-32)
        self._cols = None
        if verify:
            with memoryview(buf) as mv:  # (no copy of the batch for its checksum)
                data = mv[pos + 12:pos + size]
                bad = _crc(data) != crc and not (self.v1 and zlib.crc32(data) == crc)
                data.release()
            if bad:
                raise CorruptBatch(f"batch at offset {base}: CRC mismatch")

    @property
    def next_offset(self):
        return self.base + self.count

    def columns(self):
        """Positions of each column: dict name -> (start, end) in `buf`."""
        cols = self._cols
        if cols is not None:
            return cols
        n = self.count
        p = self.pos + HEADER_SIZE
        end = self.pos + self.size
        cols = {}
        for name, width in (("timestamps", 8 * n), ("crc", 4 * n), ("topic_off", 4 * (n + 1)),
                            ("client_off", 4 * (n + 1)), ("props_off", 4 * (n + 1)),
                            ("payload_off", 4 * (n + 1)), ("packet_ids", 2 * n), ("flags", n)):
            cols[name] = (p, p + width)
            p += width
        if p > end:
            raise CorruptBatch(f"batch at offset {self.base}: columns run past the batch")
        for name in ("topic", "client", "props", "payload"):
            s, e = cols[name + "_off"]
            offs = memoryview(self.buf)[s:e].cast("B").cast("I")
            length = offs[n]
            if offs[0] != 0 or p + length > end:
                raise CorruptBatch(f"batch at offset {self.base}: bad {name} offsets")
            cols[name] = (p, p + length)
            p += length
        self._cols = cols
        return cols

    def data_size(self):
        """The batch size its columns imply (header + columns + data, padded to 8).

        Equals `size` for a sound batch; differs when the header's length field is damaged.
        """
        end = self.columns()["payload"][1] - self.pos
        return end + (-end % 8)

    def _array(self, name, code):
        s, e = self.columns()[name]
        return memoryview(self.buf)[s:e].cast("B").cast(code)

    def records(self, check_records=False, first=0):
        """Yield Record objects (the per-record path: CLI, broker catch-up, salvage), from
        the batch's record `first` on (the ones before it are not built).

        With `check_records` (salvaging a batch whose CRC failed) a record is yielded
        only if its CRC checks out and the fields its CRC does not cover look sound
        (flags, a timestamp within the batch's range); otherwise a BadRecord stands in.
        """
        buf = self.buf
        cols = self.columns()
        ts = self._array("timestamps", "q")
        crcs = self._array("crc", "I")
        flags = self._array("flags", "B")
        pids = self._array("packet_ids", "H")
        to, co, po, yo = (self._array(k, "I") for k in ("topic_off", "client_off", "props_off", "payload_off"))
        tb, cb, pb, yb = (cols[k][0] for k in ("topic", "client", "props", "payload"))
        mv = memoryview(buf)
        if check_records:
            # The record CRC covers topic, client id, properties and payload only; the
            # timestamp and flags of a record in a damaged batch must at least be plausible
            # (records of one batch come from one group commit, so their times are close).
            hi = self.max_ts
            lo = self.first_ts - max(0, hi - self.first_ts) - 1_000_000
            v1 = self.v1
        for i in range(max(0, first), self.count):
            topic = bytes(mv[tb + to[i]:tb + to[i + 1]])
            client = bytes(mv[cb + co[i]:cb + co[i + 1]])
            props = bytes(mv[pb + po[i]:pb + po[i + 1]])
            payload = bytes(mv[yb + yo[i]:yb + yo[i + 1]])
            f = flags[i]
            if check_records and (
                    (record_crc(topic, client, props, payload) != crcs[i]
                     and not (v1 and legacy_record_crc(topic, client, props, payload) == crcs[i]))
                    or (f & ~15 and f != STATE_FLAGS) or f & 3 == 3 or not lo <= ts[i] <= hi
                    or (i == 0 and ts[0] != self.first_ts)
                    or to[i] > to[i + 1] or co[i] > co[i + 1] or po[i] > po[i + 1] or yo[i] > yo[i + 1]):
                yield BadRecord(self.base + i)
                continue
            yield Record(self.base + i, ts[i], f & 3, bool(f & 4), topic.decode("utf-8", "replace"),
                         client.decode("utf-8", "replace"), props, payload, pids[i], bool(f & 8),
                         bool(f & 16))

    def state_records(self, start=0, end=None):
        """(offset, payload) of the batch's state records with start <= offset < end,
        found in the flags column without building a record (flags = STATE_FLAGS only
        there: other records use bits 0-3)."""
        cols = self.columns()
        fs, fe = cols["flags"]
        buf = self.buf
        yo = self._array("payload_off", "I")
        yb = cols["payload"][0]
        out = []
        mark = bytes((STATE_FLAGS,))
        i = buf.find(mark, fs, fe)
        while i >= 0:
            k = i - fs
            off = self.base + k
            if off >= start and (end is None or off < end):
                out.append((off, bytes(buf[yb + yo[k]:yb + yo[k + 1]])))
            i = buf.find(mark, i + 1, fe)
        return out

    def topics(self):
        """The topic of every record (decoded), for matching without touching payloads."""
        cols = self.columns()
        to = self._array("topic_off", "I")
        tb = cols["topic"][0]
        mv = memoryview(self.buf)
        return [bytes(mv[tb + to[i]:tb + to[i + 1]]).decode("utf-8", "replace") for i in range(self.count)]


class Record:
    __slots__ = ("offset", "timestamp", "qos", "retain", "topic", "client_id", "properties", "payload",
                 "packet_id", "private", "state")

    def __init__(self, offset, timestamp, qos, retain, topic, client_id, properties, payload, packet_id=0,
                 private=False, state=False):
        self.offset = offset
        self.timestamp = timestamp  # microseconds since the epoch
        self.qos = qos
        self.retain = retain
        self.topic = topic
        self.client_id = client_id
        self.properties = properties  # raw MQTT 5 property block (no length prefix)
        self.payload = payload
        self.packet_id = packet_id
        self.private = private  # not part of the topic stream (see the flags column)
        self.state = state  # a state record (replicated partitions; private too)

    def __repr__(self):
        return (f"Record(offset={self.offset}, timestamp={self.timestamp}, topic={self.topic!r}, "
                f"qos={self.qos}, retain={self.retain}, client_id={self.client_id!r}, "
                f"payload={self.payload[:40]!r})")

    def __eq__(self, other):
        if not isinstance(other, Record):
            return NotImplemented
        return all(getattr(self, s) == getattr(other, s) for s in self.__slots__)

    __hash__ = None


class BadRecord:
    """Stands in for a record whose CRC failed during salvage."""

    __slots__ = ("offset",)

    def __init__(self, offset):
        self.offset = offset

    def __repr__(self):
        return f"BadRecord(offset={self.offset})"
