"""Building commit logs with known contents, for the log tests (real files, no mocks)."""

import os
import random
import struct
import zlib

from wrenmq.store.format import HEADER, Batch, Record, encode_batch, legacy_record_crc, read_prefix
from wrenmq.store.log import CommitLog

T0 = 1_750_000_000_000_000  # microseconds
TOPICS = ["a/b", "a/c", "a/b/c", "x", "x/y/z", "sensors/1/temp", "sensors/2/temp", "$share-ish/t"]


def batch_crc_algo(data):
    """The CRC function the format uses (found from a batch's own header)."""
    crc = HEADER.unpack_from(data)[2]
    if zlib.crc32(data[12:]) == crc:
        return zlib.crc32
    import crc32c

    assert crc32c.crc32c(bytes(data[12:])) == crc, "batch CRC is neither CRC-32 nor CRC-32C"
    return lambda b: crc32c.crc32c(bytes(b))


def crc32_checksums(data):
    """Rewrite the record and batch checksums of the batch `data` (a bytearray) as CRC-32
    (zlib); returns it."""
    b = Batch(bytes(data), verify=False)
    crc_at = b.columns()["crc"][0]
    for i, r in enumerate(b.records()):
        struct.pack_into("<I", data, crc_at + 4 * i, legacy_record_crc(r.topic.encode(), r.client_id.encode(),
                                                                       r.properties, r.payload))
    struct.pack_into("<I", data, 8, zlib.crc32(bytes(data[12:])))
    return data


def as_v1(data, crc32):
    """The batch `data` as an older wrenmq wrote it: magic WRN1, with CRC-32 (zlib) checksums
    everywhere (`crc32`: the first releases) or CRC-32C ones (the releases after the switch
    to CRC-32C, which kept the magic)."""
    data = bytearray(data)
    data[:4] = b"WRN1"
    if crc32:
        crc32_checksums(data)
    return bytes(data)


def rewrite_as_v1(directory, crc32):
    """Every batch of the log in `directory` (whole, undamaged) as `as_v1` makes it."""
    for name in sorted(os.listdir(directory)):
        if not name.endswith(".log"):
            continue
        path = os.path.join(directory, name)
        with open(path, "rb") as fh:
            data = fh.read()
        out = []
        pos = 0
        while pos < len(data):
            size = read_prefix(data, pos)
            assert size is not None, f"{path}: no batch at position {pos}"
            out.append(as_v1(data[pos:pos + size], crc32))
            pos += size
        with open(path, "wb") as fh:
            fh.write(b"".join(out))


def make_records(rng, base, n, ts, *, empty=False):
    """n random Records with offsets base.., timestamps from ts (mostly rising)."""
    out = []
    for i in range(n):
        topic = rng.choice(TOPICS)
        payload = b"" if empty or rng.random() < 0.1 else rng.randbytes(rng.randint(1, 120))
        props = b"" if empty or rng.random() < 0.6 else b"\x26\x00\x01k\x00\x01v"  # user property k=v
        out.append(Record(base + i, ts + i * rng.randint(0, 3), rng.randint(0, 2), rng.random() < 0.2,
                          topic, f"client-{rng.randint(0, 5)}", props, payload,
                          rng.randint(1, 65535) if rng.random() < 0.3 else 0))
    return out


def encode(records):
    return encode_batch(records[0].offset, [r.timestamp for r in records],
                        [r.qos | (4 if r.retain else 0) for r in records],
                        [r.topic.encode() for r in records], [r.client_id.encode() for r in records],
                        [r.properties for r in records], [r.payload for r in records],
                        [r.packet_id for r in records])


class Built:
    """A log written batch by batch, remembering where every batch went."""

    def __init__(self, directory, segment_bytes=8192, index_interval=512, seed=1):
        self.dir = directory
        self.segment_bytes = segment_bytes
        self.index_interval = index_interval
        self.rng = random.Random(seed)
        self.records = []
        self.batches = []  # (segment base, position, base offset, count, size)
        self.ts = T0
        self.log = self.open()

    def open(self):
        return CommitLog(self.dir, self.segment_bytes, self.index_interval)

    def append(self, n=None, ts=None, empty=False):
        log = self.log
        base = log.end_offset
        n = n if n is not None else self.rng.randint(1, 12)
        if ts is not None:
            self.ts = ts
        recs = make_records(self.rng, base, n, self.ts, empty=empty)
        self.ts = max(r.timestamp for r in recs) + self.rng.randint(1, 2000)
        data = encode(recs)
        log.append(data, base, n, recs[0].timestamp, max(r.timestamp for r in recs))
        seg = log.segments[-1]
        self.batches.append((seg.base, seg.size - len(data), base, n, len(data)))
        self.records.extend(recs)
        return recs

    def fill(self, batches, **kw):
        for _ in range(batches):
            self.append(**kw)
        return self

    def close(self):
        self.log.close()

    def seg_path(self, base, ext="log"):
        return self.dir / f"{base:020d}.{ext}"

    def segment_bases(self):
        return sorted(int(p.name[:20]) for p in self.dir.glob("*.log"))

    def batches_in(self, seg_base):
        return [b for b in self.batches if b[0] == seg_base]
