"""Reading a partition: `LogReader`, read-only and lock-free.

`RawReader` reads batches as they are stored, without decoding them: what a replicated
partition's leader sends its followers, and the walk over batch headers with which a
replica finds its state records.

A reader is used in the broker, by `wrenmq log` and in Spark workers, often while a
writer (here or in another process) appends, truncates or deletes segments: it holds
nothing open between calls, learns what was appended on `refresh`, and a segment deleted
under it reads as gone, not damaged. It never trusts what it reads (scan.py): every
batch is checked against its CRC, a damaged batch is salvaged record by record and the
bad records are skipped, counted and logged once, never served; after bytes that hold
no readable batch it resumes at the next intact batch.
"""

import bisect
import logging
import os
from array import array
from typing import NamedTuple

from .files import read_durable
from .format import HEADER, HEADER_SIZE, Batch, CorruptBatch, read_prefix
from .index import INDEX_ENTRY, check_index
from .scan import Damage, Salvaged, first_timestamp, offset_ranges, walk
from .segment import Segment, list_segments, segment_name

log = logging.getLogger("wrenmq.store")


class _OffsetSet:
    """A set of offsets as sorted, disjoint [start, end) ranges."""

    def __init__(self):
        self.starts = []
        self.ends = []
        self.total = 0

    def add(self, a, b):
        """Add [a, b); return how many of its offsets were not in the set yet."""
        if a >= b:
            return 0
        i = bisect.bisect_left(self.ends, a)
        j = bisect.bisect_right(self.starts, b)
        covered = 0
        na, nb = a, b
        for k in range(i, j):
            covered += max(0, min(self.ends[k], b) - max(self.starts[k], a))
            na = min(na, self.starts[k])
            nb = max(nb, self.ends[k])
        self.starts[i:j] = [na]
        self.ends[i:j] = [nb]
        new = (b - a) - covered
        self.total += new
        return new

    def end_of(self, offset):
        """The end of the range holding `offset`, or None if it is not in the set."""
        i = bisect.bisect_right(self.starts, offset) - 1
        return self.ends[i] if i >= 0 and self.ends[i] > offset else None


class LogReader:
    """Reads one partition directory; safe to use while a writer (here or in another
    process) appends, truncates or deletes segments."""

    index_interval = 4096  # for the in-memory index a reader keeps of what it scanned

    def __init__(self, directory):
        self.dir = str(directory)
        self.segments = []
        self._lost = _OffsetSet()
        self._noted = set()
        self.refresh()

    @property
    def corrupt_records(self):
        """How many distinct offsets this reader found unreadable (skipped, never served)."""
        return self._lost.total

    def unreadable_end(self, offset):
        """The offset after the stretch of unreadable records (found, skipped and logged
        by a read) that holds `offset`; None if the record at `offset` is not known to be
        unreadable."""
        return self._lost.end_of(offset)

    # --- discovery ---------------------------------------------------------

    def refresh(self):
        """Pick up new segments and appended data, drop deleted segments."""
        known = {s.base: s for s in self.segments}
        segments = []
        bases = list_segments(self.dir)
        for base in bases:
            seg = known.get(base)
            if seg is None:
                seg = Segment(self.dir, base)
            try:
                size = os.path.getsize(seg.log_path)
                if size != seg.scanned:
                    self._describe(seg, size, base == bases[-1])
            except FileNotFoundError:
                continue
            segments.append(seg)
        self.segments = segments

    def _open(self, seg):
        # Each use opens its own descriptor: nothing stays open per segment (a log can
        # have thousands), and a segment deleted meanwhile stays readable until closed.
        return os.open(seg.log_path, os.O_RDONLY)

    def _describe(self, seg, size, last=False):
        """Learn a segment's extent (complete size, next offset, time range) from its files.

        `last`: the segment a writer appends to, whose end may be a write in progress or
        cut short."""
        if seg.scanned < 0 or size < seg.scanned or size < seg.size:
            # First look, or the file shrank (a recovering writer truncated it): start over.
            seg.forget()
            files = seg.read_index()
            # The log's size after the index was read: a writer appends a batch before its
            # index entry, so no entry can then point past it.
            size = max(size, os.path.getsize(seg.log_path))
            seg.index_ok = seg.load_index(size, files)
        fd = self._open(seg)
        try:
            if seg.scanned < 0 and seg.index_ok:
                loaded = len(seg.index_offsets)
                seg.max_ts = seg.time_ts[-1]
                seg.first_ts = first_timestamp(fd)
                if not self._extend(seg, fd, seg.last_indexed_pos, size, seg.index_offsets[-1], last, True):
                    # The last index entry does not lead to its batch: the index is stale.
                    seg.forget()
                    self._extend(seg, fd, 0, size, seg.base, last)
                elif len(seg.index_offsets) != loaded:
                    seg.index_ok = False  # batches the index files lack
            else:
                self._extend(seg, fd, seg.size, size, seg.next_offset, last)
        finally:
            os.close(fd)
        seg.scanned = size

    def _extend(self, seg, fd, start, size, expect, last, strict=False):
        """Walk [start, size) adding what is found to `seg`.

        With `strict`, return False if `start` does not hold the batch `expect` begins.
        """
        first = True
        for pos, item in walk(fd, start, size, expect, search_tail=not last):
            if strict and first and (isinstance(item, Damage) or item.base != expect):
                return False
            first = False
            if isinstance(item, Damage):
                continue  # a tail reaching `size` stays outside seg.size
            mts = item.max_ts
            if mts is not None:
                seg.max_ts = mts if seg.max_ts is None else max(seg.max_ts, mts)
            if seg.first_ts is None:
                seg.first_ts = item.first_ts
            seg.add_index_entry(item.base, pos, seg.max_ts if seg.max_ts is not None else 0,
                                self.index_interval)
            seg.next_offset = max(seg.next_offset, item.base + item.count)
            seg.size = pos + item.size
        return True

    def close(self):
        """Nothing is held open between calls; kept for symmetry with CommitLog."""

    @property
    def start_offset(self):
        return self.segments[0].base if self.segments else 0

    @property
    def end_offset(self):
        """The offset the next record written will get (as far as this reader knows)."""
        return self.segments[-1].next_offset if self.segments else 0

    @property
    def durable_mark(self):
        """The durable end the writer says now (read_durable): read when asked, not at
        each refresh (the broker's own readers never ask). It only grows, so any value
        read after the last refresh is durable as far as that refresh saw."""
        return read_durable(self.dir)

    @property
    def durable_end_offset(self):
        """The end of what is on disk for sure: `end_offset`, or less where the writer
        says (DURABLE_FILE) it has not fsynced the rest yet. Records past it can still be
        lost to a crash of the machine, and their offsets reused for other records."""
        end = self.end_offset
        mark = self.durable_mark
        return end if mark is None else max(min(end, mark), self.start_offset)

    # --- reading -------------------------------------------------------------

    def _segment_index(self, offset):
        bases = [s.base for s in self.segments]
        return max(0, bisect.bisect_right(bases, offset) - 1)

    def batches(self, start=0, end=None):
        """Yield CRC-checked Batch objects, or lists of salvaged Records, covering [start, end).

        Batches may begin before `start`; callers trim. Records that cannot be read are
        skipped, never served; they are counted in `corrupt_records` and logged once.
        """
        segs = self.segments
        if not segs:
            return
        expect = max(start, segs[0].base)
        for si in range(self._segment_index(expect), len(segs)):
            seg = segs[si]
            if end is not None and seg.base >= end:
                return
            seg_end = segs[si + 1].base if si + 1 < len(segs) else seg.next_offset
            if seg_end <= expect:
                continue
            if seg.base > expect:
                self._skipped(seg, None, expect, seg.base, end)
                expect = seg.base
            pos, at = seg.position_for(expect)
            try:
                fd = self._open(seg)
            except FileNotFoundError:  # deleted by retention meanwhile: gone, not damaged
                expect = max(expect, seg_end)
                continue
            try:
                damage = None
                for bpos, item in walk(fd, pos, seg.size, at, seg.next_index_position_after):
                    if isinstance(item, Damage):
                        damage = item
                        continue
                    first = item.base
                    nxt = first + item.count
                    out = item
                    if isinstance(item, Salvaged):
                        self._salvaged(seg, item, expect, end)
                        out = item.good
                    if nxt <= expect:
                        damage = None
                        continue
                    if first > expect:
                        self._skipped(seg, damage, expect, first, end)
                    elif first < expect and expect > start:
                        # Overlaps what was served already: never serve an offset twice.
                        recs = out.records() if isinstance(out, Batch) else out
                        out = [r for r in recs if r.offset >= expect]
                    damage = None
                    expect = nxt
                    if out:
                        yield out
                    if end is not None and nxt >= end:
                        return
                if expect < seg_end:
                    self._skipped(seg, damage, expect, seg_end, end)
                    expect = seg_end
            finally:
                os.close(fd)

    def _skipped(self, seg, damage, a, b, end):
        """Offsets [a, b) could not be read; count and log them (once)."""
        if end is not None:
            b = min(b, end)
        new = self._lost.add(a, b)
        if not new:
            return
        what = (f"{damage.end - damage.pos} unreadable bytes at position {damage.pos} ({damage.reason})"
                if damage is not None else "records missing")
        log.error("%s: %s; skipped offsets %s (%d record(s))", seg.log_path, what, offset_ranges(range(a, b)),
                  b - a)

    def _salvaged(self, seg, item, start, end):
        bad = [o for o in item.bad if o >= start and (end is None or o < end)]
        new = sum(self._lost.add(o, o + 1) for o in bad)
        key = (seg.base, item.pos)
        if new:
            log.error("%s: batch at position %d (offsets %d-%d): %s; skipped %d damaged record(s) "
                      "(offsets %s), kept %d", seg.log_path, item.pos, item.base, item.next_offset - 1,
                      item.reason, len(item.bad), offset_ranges(item.bad), len(item.good))
        elif not item.bad and key not in self._noted:
            self._noted.add(key)
            log.error("%s: batch at position %d (offsets %d-%d): %s, but every record checks out; "
                      "serving its %d records", seg.log_path, item.pos, item.base, item.next_offset - 1,
                      item.reason, len(item.good))

    def records(self, start=0, end=None, topic_filters=None, private=False, state=False):
        """Yield Record objects with start <= offset < end, optionally filtered by MQTT filters.

        Private records (kept only for a persistent session, see format.py) are part of
        the topic stream only for the broker itself (`private=True`); state records (the
        state changes of a replicated partition, private too) only with `state=True` as well.
        """
        match = topic_matcher(topic_filters)
        for b in self.batches(start, end):
            # (a batch holds hundreds of records: a read from its middle builds none before)
            recs = b.records(first=start - b.base) if isinstance(b, Batch) else b
            for r in recs:
                if r.offset < start:
                    continue
                if end is not None and r.offset >= end:
                    return
                if r.private and (not private or (r.state and not state)):
                    continue
                if match is None or match(r.topic):
                    yield r

    def offset_for_time(self, ts_us):
        """The first offset whose record has timestamp >= ts_us (end_offset if none)."""
        segs = self.segments
        for si, seg in enumerate(segs):
            if seg.max_ts is None or seg.max_ts < ts_us:
                continue
            seg_end = segs[si + 1].base if si + 1 < len(segs) else seg.next_offset
            for b in self.batches(seg.offset_for_time(ts_us), seg_end):
                if isinstance(b, Batch):
                    if b.max_ts < ts_us:
                        continue
                    b = b.records()
                for r in b:
                    if r.timestamp >= ts_us:
                        return r.offset
        return self.end_offset

    def stats(self):
        segs = self.segments
        total = sum(s.size for s in segs)
        first_ts = next((s.first_ts for s in segs if s.first_ts is not None), None)
        max_ts = max((s.max_ts for s in segs if s.max_ts is not None), default=None)
        return {
            "directory": self.dir,
            "segments": len(segs),
            "start_offset": self.start_offset,
            "end_offset": self.end_offset,
            "records": self.end_offset - self.start_offset,
            "bytes": total,
            "first_timestamp_us": first_ts,
            "last_timestamp_us": max_ts,
        }

    # --- verification ------------------------------------------------------------

    def verify(self):
        """Check every batch, record and index entry; return one line per problem (empty: healthy)."""
        problems = []
        prev = None  # next offset after the previous segment
        segs = list(self.segments)
        for si, seg in enumerate(segs):
            try:
                idx, tidx = seg.read_index()  # before the log's size: entries never run ahead of it
                size = os.path.getsize(seg.log_path)
                fd = self._open(seg)
            except FileNotFoundError:  # deleted by retention meanwhile
                continue
            path = seg.log_path
            if prev is not None and seg.base != prev:
                gap = (f" (offsets {offset_ranges(range(prev, seg.base))} missing)" if seg.base > prev
                       else " (overlap)")
                problems.append(f"{path}: starts at offset {seg.base}, but the segment before it ends "
                                f"at offset {prev - 1}{gap}")
            starts = {}
            expect = seg.base
            damage = None
            try:
                for pos, item in walk(fd, 0, size, seg.base, search_tail=si < len(segs) - 1):
                    if isinstance(item, Damage):
                        damage = item
                        continue
                    if damage is not None:
                        lost = (f"offsets {offset_ranges(range(expect, item.base))} lost" if item.base > expect
                                else "no offsets lost")
                        problems.append(f"{path}: {damage.end - damage.pos} unreadable bytes at position "
                                        f"{damage.pos} ({damage.reason}); {lost}")
                        damage = None
                    elif item.base != expect:
                        problems.append(f"{path}: batch at position {pos} starts at offset {item.base}, "
                                        f"expected {expect}")
                    if isinstance(item, Salvaged):
                        what = (f"damaged records: offsets {offset_ranges(item.bad)}" if item.bad
                                else "every record checks out")
                        problems.append(f"{path}: batch at position {pos} (offsets {item.base}-"
                                        f"{item.next_offset - 1}): {item.reason}; {what}")
                    starts[pos] = item.base
                    expect = max(expect, item.base + item.count)
                if damage is not None and os.path.getsize(path) == size:  # (grown: a write in progress)
                    fix = ("truncated when the broker next starts" if si == len(segs) - 1
                           else "the segment is sealed, so these bytes are lost")
                    problems.append(f"{path}: {size - damage.pos} bytes of torn or unreadable data at the end "
                                    f"(position {damage.pos}: {damage.reason}); {fix}")
            finally:
                os.close(fd)
            problems.extend(check_index(seg, idx, tidx, starts, size, si == len(segs) - 1))
            prev = expect
        return problems


def topic_matcher(filters):
    """A function telling whether a topic matches any of the MQTT topic `filters`
    (remembered per topic); None if there are no filters (everything matches)."""
    if not filters:
        return None
    # The store's one import from a layer above it: topic matching is MQTT's, and
    # store must import only wrenmq.mqtt below it. Imported here, not at the top, so
    # that a reader without filters (a Spark worker, `wrenmq log`) never loads the broker.
    from ..mqtt.topics import topic_matches

    filters = list(filters)
    cache = {}

    def match(topic):
        r = cache.get(topic)
        if r is None:
            r = cache[topic] = any(topic_matches(f, topic) for f in filters)
            if len(cache) > 100_000:
                cache.clear()
        return r

    return match


# --- batches as stored (replication) ---------------------------------------------------


class RawBatch(NamedTuple):
    """One batch as it is on disk: `count` records from offset `base`, written by the
    leader of `epoch` (the header's epoch field), `data` its bytes. The fields and their
    order are those of the replication frames' Batch, so `Batch(*raw)` makes one."""
    base: int
    epoch: int
    count: int
    data: bytes


class BatchHead(NamedTuple):
    """A batch's header fields and where it is: segment `segment` (its base offset),
    bytes [pos, pos + size) of its file."""
    base: int
    count: int
    attrs: int
    epoch: int
    segment: int
    pos: int
    size: int


class LogRangeError(LookupError):
    """The records asked for are not in the log: below its start (retention or a snapshot
    removed them), or missing from the files (damage)."""


_HEAD_READ = 64 << 10  # bytes read at a time while walking batch headers


class RawReader:
    """Reads a partition's batches as they are stored, without decoding their records:
    the leader's reads for its followers (`batches`) and the walk over batch headers
    that a replica applies its state records with (`heads`).

    Safe to use while a writer (in this process or another) appends: it reads only
    the offsets it is asked for, which the caller knows are written, and a batch that
    is not whole in the file ends the read. One per thread. It keeps where the last
    read ended, so a follower fetching on from there costs no index lookup; nothing
    is held open between calls. After a truncation of the log (a follower's), call
    `forget`.
    """

    def __init__(self, directory):
        self.dir = str(directory)
        self._bases = []
        self._index = {}  # segment base -> (offsets, positions, index file size)
        self._cursor = None  # (offset, segment base, position) where the last walk ended

    def forget(self):
        """Drop what is known of the files (the log was truncated or replaced)."""
        self._bases = []
        self._index.clear()
        self._cursor = None

    def batches(self, start, end, max_bytes):
        """The batches from the one holding offset `start` on, as RawBatch: whole batches
        only, none reaching past offset `end`, together at most `max_bytes` (but at least
        one). The bytes are exactly those on disk; their CRC is not checked here (the
        follower checks it). [] if `start` >= `end`. LogRangeError if `start` is below the
        log start or the files lack offsets from `start` on; CorruptBatch if bytes where a
        batch should be are not one."""
        heads = []
        total = 0
        for h in self.heads(start, end):
            if h.base + h.count > end or (heads and total + h.size > max_bytes):
                break
            heads.append(h)
            total += h.size
            if total >= max_bytes:
                break
        if heads:
            last = heads[-1]
            self._cursor = (last.base + last.count, last.segment, last.pos + last.size)
        out = []
        i = 0
        while i < len(heads):
            # One read per run of batches in one segment.
            j = i + 1
            while j < len(heads) and heads[j].segment == heads[i].segment:
                j += 1
            first, last = heads[i], heads[j - 1]
            data = self._pread(first.segment, first.pos, last.pos + last.size - first.pos)
            mv = memoryview(data)
            for h in heads[i:j]:
                at = h.pos - first.pos
                out.append(RawBatch(h.base, h.epoch, h.count, bytes(mv[at:at + h.size])))
            mv.release()
            i = j
        return out

    def read(self, head):
        """The bytes of the batch `head` (a BatchHead from `heads`)."""
        return self._pread(head.segment, head.pos, head.size)

    def heads(self, start, end):
        """Yield the BatchHead of every batch from the one holding offset `start` on, up to
        the one holding `end - 1`, as far as the files hold whole batches (a batch being
        written ends it). Errors as in `batches`."""
        if start >= end:
            return
        seg, pos = self._locate(start)
        expect = None
        first = True
        while True:
            path = os.path.join(self.dir, segment_name(seg) + ".log")
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # retention (or a truncation) deleted it meanwhile
                self.forget()
                raise LogRangeError(f"{path}: deleted while offset {start} on was read") from None
            try:
                size = os.fstat(fd).st_size
                buf = b""
                buf_pos = 0
                n = 0
                while pos < size:
                    rel = pos - buf_pos
                    if rel < 0 or len(buf) - rel < HEADER_SIZE:
                        # (After a large batch the next is likely large too: its header only.)
                        buf = os.pread(fd, HEADER_SIZE if n > _HEAD_READ else _HEAD_READ, pos)
                        buf_pos = pos
                        rel = 0
                        if len(buf) < HEADER_SIZE:
                            break
                    n = read_prefix(buf, rel)
                    if n is None:
                        if first and pos:  # an index entry that does not lead to a batch
                            self._index.pop(seg, None)
                            pos = 0
                            first = False
                            continue
                        raise CorruptBatch(f"{path}: no batch at position {pos}")
                    if pos + n > size:
                        break  # not whole yet
                    _, _, _, base, count, _, _, attrs, epoch = HEADER.unpack_from(buf, rel)
                    if first and base > start and pos:
                        self._index.pop(seg, None)  # a stale index entry: walk from the start
                        pos = 0
                        first = False
                        continue
                    first = False
                    if base + count <= start:
                        pos += n
                        continue
                    if base != (start if expect is None else expect) and not (expect is None and base < start):
                        raise LogRangeError(f"{path}: offsets {start if expect is None else expect}-"
                                            f"{base - 1} are missing (position {pos})")
                    if base >= end:
                        return
                    self._cursor = (base + count, seg, pos + n)
                    yield BatchHead(base, count, attrs, epoch, seg, pos, n)
                    expect = base + count
                    pos += n
                    if expect >= end:
                        return
            finally:
                os.close(fd)
            nxt = self._next_segment(seg)
            if nxt is None:
                return
            if expect is not None and nxt != expect or expect is None and nxt > start:
                raise LogRangeError(f"{self.dir}: segment {segment_name(nxt)} does not follow offset "
                                    f"{start if expect is None else expect - 1}")
            seg, pos = nxt, 0

    # --- internals ---------------------------------------------------------------

    def _pread(self, seg, pos, size):
        path = os.path.join(self.dir, segment_name(seg) + ".log")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.forget()
            raise LogRangeError(f"{path}: deleted while it was read") from None
        try:
            data = os.pread(fd, size, pos)
        finally:
            os.close(fd)
        if len(data) != size:
            raise LogRangeError(f"{path}: {size} bytes at position {pos} are not in the file")
        return data

    def _list(self):
        self._bases = list_segments(self.dir)
        known = set(self._bases)
        for base in [b for b in self._index if b not in known]:
            del self._index[base]
        return self._bases

    def _next_segment(self, seg):
        """The base of the segment after `seg`, listing the directory again if this reader
        knows none (the writer may have rolled to it since)."""
        for attempt in (0, 1):
            bases = self._bases if not attempt else self._list()
            i = bisect.bisect_right(bases, seg)
            if i < len(bases):
                return bases[i]
        return None

    def _locate(self, start):
        """(segment base, position) from which a walk reaches the batch holding `start`."""
        bases = self._bases or self._list()
        if not bases or start < bases[0]:
            bases = self._list()
            if not bases:
                raise LogRangeError(f"{self.dir}: no segments")
            if start < bases[0]:
                raise LogRangeError(f"offset {start} is below the log start {bases[0]}")
        seg = bases[bisect.bisect_right(bases, start) - 1]
        c = self._cursor
        if c is not None and c[0] == start and c[1] == seg:
            return seg, c[2]
        offsets, positions = self._entries(seg, start)
        i = bisect.bisect_right(offsets, start) - 1
        return seg, (positions[i] if i >= 0 else 0)

    def _entries(self, seg, start):
        """The index entries of segment `seg` (read from its index file, again if it grew
        and `start` is past the last entry known)."""
        path = os.path.join(self.dir, segment_name(seg) + ".index")
        got = self._index.get(seg)
        if got is not None and got[0] and start <= got[0][-1]:
            return got[0], got[1]
        try:
            if got is not None and os.path.getsize(path) == got[2]:
                return got[0], got[1]
            with open(path, "rb") as fh:
                raw = fh.read()
        except FileNotFoundError:
            raw = b""
        offsets = array("q")
        positions = array("q")
        for rel, pos in INDEX_ENTRY.iter_unpack(raw[:len(raw) - len(raw) % INDEX_ENTRY.size]):
            if positions and (pos <= positions[-1] or seg + rel <= offsets[-1]) or pos % 8:
                break  # (damaged from here: the walk from the last good entry still finds it)
            offsets.append(seg + rel)
            positions.append(pos)
        self._index[seg] = (offsets, positions, len(raw))
        return offsets, positions
