"""Reading a byte range of a segment file into batches, and saying what is damaged.

The scanners never trust what they read: every batch is checked against its CRC, a
batch whose CRC fails but whose structure holds is salvaged record by record (the
records that check out, and the offsets that do not), and after bytes that hold no
readable batch the walk resumes at the next intact batch, found by its magic and CRC
(at the latest the next index entry). The reader, recovery and `verify` all walk with
`walk`; they differ in what they do with the damage it reports.
"""

import os
import struct

from .format import (HEADER, HEADER_SIZE, MAGIC, MAGIC_STEM, MAGIC_V1, MAX_BATCH_BYTES, Batch, BadRecord,
                     CorruptBatch, read_prefix)

READ_CHUNK = 1 << 20  # bytes read at a time while walking or searching


class Salvaged:
    """A batch whose CRC failed but whose structure held, checked record by record."""

    __slots__ = ("pos", "size", "base", "count", "good", "bad", "reason")

    def __init__(self, pos, size, base, count, good, bad, reason):
        self.pos = pos
        self.size = size
        self.base = base
        self.count = count
        self.good = good  # Records that check out
        self.bad = bad  # offsets of those that do not
        self.reason = reason

    @property
    def next_offset(self):
        return self.base + self.count

    @property
    def first_ts(self):
        return self.good[0].timestamp if self.good else None

    @property
    def max_ts(self):
        return max((r.timestamp for r in self.good), default=None)


class Damage:
    """Bytes [pos, end) of a segment file that hold no readable batch."""

    __slots__ = ("pos", "end", "reason")

    def __init__(self, pos, end, reason):
        self.pos = pos
        self.end = end
        self.reason = reason

    def __repr__(self):
        return f"Damage({self.pos}-{self.end}: {self.reason})"


def salvage(buf, rel, pos, size, expect):
    """What can be saved of the batch at buf[rel:rel+size] whose CRC failed.

    A Salvaged, a Damage covering the batch (its base offset cannot be trusted), or
    None if its structure does not hold (then where the next batch starts is unknown).
    """
    try:
        b = Batch(buf, rel, verify=False)
        true_size = b.data_size()
        if true_size > size:  # pragma: no cover - columns() refuses this
            return None
        if expect is not None and b.base != expect:
            return Damage(pos, pos + true_size, f"batch CRC mismatch and its base offset {b.base} "
                                                f"does not follow offset {expect - 1}")
        good = []
        bad = []
        for r in b.records(check_records=True):
            if isinstance(r, BadRecord):
                bad.append(r.offset)
            else:
                good.append(r)
    except CorruptBatch:
        return None
    reason = "batch CRC mismatch"
    if true_size != size:
        reason += f" (its length field says {size} bytes, its columns {true_size})"
    return Salvaged(pos, true_size, b.base, b.count, good, bad, reason)


def find_batch(fd, start, limit, end, expect=None):
    """The first 8-aligned position in [start, limit) where an intact batch begins.

    Intact: a magic of any version (format.py), a sane length within `end`, a good CRC and (if `expect` is given)
    a base offset >= expect. None if there is none.
    """
    pos = start + (-start % 8)
    while pos < limit:
        n = min(READ_CHUNK, limit - pos)
        chunk = os.pread(fd, n + 8, pos)
        if not chunk:
            return None
        i = chunk.find(MAGIC_STEM)
        while 0 <= i < n:
            if not i % 8:
                cand = pos + i
                head = chunk if len(chunk) - i >= 8 else os.pread(fd, 8, cand)
                size = read_prefix(head, i if head is chunk else 0)
                if size is not None and cand + size <= end:
                    data = os.pread(fd, size, cand)
                    if len(data) == size:
                        try:
                            b = Batch(data, 0)
                        except CorruptBatch:
                            pass
                        else:
                            if expect is None or b.base >= expect:
                                return cand
            i = chunk.find(MAGIC_STEM, i + 1)
        pos += n
    return None


def _repair_length(fd, pos, end):
    """The batch at `pos` if only its length field is damaged (its columns give its true
    size and its CRC checks out over that size), else None."""
    head = os.pread(fd, HEADER_SIZE, pos)
    if len(head) < HEADER_SIZE or head[:4] not in (MAGIC, MAGIC_V1):
        return None
    n = HEADER.unpack_from(head)[4]
    fixed = HEADER_SIZE + 8 * n + 4 * n + 16 * (n + 1) + 2 * n + n
    if fixed > min(end - pos, MAX_BATCH_BYTES):
        return None
    cols = os.pread(fd, fixed, pos)
    if len(cols) < fixed:
        return None
    # The data lengths: the last entry of each of the four offsets columns.
    lens = [struct.unpack_from("<I", cols, HEADER_SIZE + 12 * n + 4 * (n + 1) * k + 4 * n)[0] for k in range(4)]
    true = fixed + sum(lens)
    true += -true % 8
    if true > end - pos or true > MAX_BATCH_BYTES:
        return None
    data = bytearray(os.pread(fd, true, pos))
    if len(data) < true:
        return None
    struct.pack_into("<I", data, 4, true - 8)
    try:
        return Batch(bytes(data), 0)
    except CorruptBatch:
        return None


def walk(fd, pos, end, expect=None, bound=None, search_tail=True):
    """Yield (position, item) for what lies in [pos, end) of an open segment file.

    item is a CRC-checked `Batch`, a `Salvaged` batch (its CRC failed but its
    structure held: the records that check out and the offsets that do not; or
    only its length field was damaged) or a `Damage` (bytes holding no readable
    batch). After damage the walk resumes at the next intact batch with a base >=
    the expected offset, searched up to `bound(pos)` (a known batch start such as
    the next index entry; the walk resumes there if nothing is found before) or
    else up to `end`. A Damage reaching `end` is a torn tail (or a batch still being
    written). `expect` is the base offset the first batch should have, if known.

    Without `search_tail`, a batch whose header is sound but which runs past `end`
    is taken for a write cut short (a torn tail) and nothing after it is searched:
    its partial payload could hold bytes that look like a batch.
    """
    buf = b""
    buf_pos = pos
    while pos < end:
        rel = pos - buf_pos
        if rel < 0 or len(buf) - rel < HEADER_SIZE:
            buf = os.pread(fd, min(READ_CHUNK, end - pos), pos)
            buf_pos = pos
            rel = 0
        size = read_prefix(buf, rel)
        torn = False
        if size is None:
            reason = "no batch header" if len(buf) - rel >= 8 else "incomplete batch header"
        elif pos + size > end:
            reason = f"batch of {size} bytes runs past the end of the data"
            torn = True
        else:
            if len(buf) - rel < size:
                buf = os.pread(fd, min(max(READ_CHUNK, size), end - pos), pos)
                buf_pos = pos
                rel = 0
            if len(buf) < size:
                reason = "the file ends inside the batch"
            else:
                try:
                    b = Batch(buf, rel)
                except CorruptBatch as e:
                    item = salvage(buf, rel, pos, size, expect)
                    if isinstance(item, Salvaged):
                        yield pos, item
                        expect = item.next_offset
                        pos += item.size
                        continue
                    if isinstance(item, Damage):
                        yield pos, item
                        pos = item.end
                        continue
                    reason = f"{e}; its structure is damaged too"
                else:
                    if expect is not None and b.base < expect:
                        # Intact, but its offsets go backwards: a stale copy, not the log.
                        yield pos, Damage(pos, pos + size, f"an intact batch of offsets {b.base}-"
                                                           f"{b.base + b.count - 1} where offset {expect} "
                                                           f"should follow (a stale copy)")
                        pos += size
                        continue
                    yield pos, b
                    expect = b.base + b.count
                    pos += size
                    continue
        if buf[rel:rel + 4] in (MAGIC, MAGIC_V1):
            b = _repair_length(fd, pos, end)
            if b is not None and (expect is None or b.base >= expect):
                yield pos, Salvaged(pos, b.size, b.base, b.count, list(b.records()), [],
                                    f"its length field is damaged (the batch is {b.size} bytes "
                                    f"and checks out)")
                expect = b.base + b.count
                pos += b.size
                buf = b""
                continue
            if torn and not search_tail:
                yield pos, Damage(pos, end, reason)
                return
        limit = end
        if bound is not None:
            nb = bound(pos)
            if nb is not None and nb < limit:
                limit = nb
        nxt = find_batch(fd, pos + 8, limit, end, expect)
        if nxt is None:
            nxt = limit
        yield pos, Damage(pos, nxt, reason)
        pos = nxt
        buf = b""


def first_timestamp(fd):
    """The first timestamp of a segment's first batch (its CRC checked if it can be)."""
    head = os.pread(fd, HEADER_SIZE, 0)
    n = read_prefix(head)
    if n is None or len(head) < HEADER_SIZE:
        return None
    try:
        return Batch(os.pread(fd, n, 0), 0).first_ts
    except CorruptBatch:
        return HEADER.unpack_from(head)[5]


def offset_ranges(offsets):
    """Offsets as runs, for messages: [1, 2, 3, 7] -> "1-3,7"."""
    offsets = list(offsets)
    if not offsets:
        return ""
    out = []
    start = prev = offsets[0]
    for o in offsets[1:]:
        if o == prev + 1:
            prev = o
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = o
    out.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(out)
