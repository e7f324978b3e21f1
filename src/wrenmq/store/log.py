"""The commit log: append-only segment files with sparse offset and time indexes.

A partition is a directory of segments named by their base offset, Kafka style:

    00000000000000000000.log        record batches (see format.py)
    00000000000000000000.index      (u32 relative offset, u32 position) per ~4 KiB of log
    00000000000000000000.timeindex  (i64 max timestamp so far, u32 relative offset, u32 0)

`LogReader` reads a partition (in the broker, the CLI or a Spark worker) and
never trusts what it reads: every batch is checked against its CRC, a damaged
batch is salvaged record by record and the bad records are skipped and
reported, never served. `CommitLog` adds the writer side: recovery on open
(a torn or corrupt tail is truncated and reported, stale or missing indexes
rebuilt), appends, segment rolling, syncing and retention.
"""

import bisect
import logging
import os
import re
import struct
import time
from array import array

from .format import Batch, BadRecord, CorruptBatch, Record, read_prefix

log = logging.getLogger("wrenmq.store")

_SEGMENT_RE = re.compile(r"^(\d{20})\.log$")
_INDEX_ENTRY = struct.Struct("<II")
_TIME_ENTRY = struct.Struct("<qII")
_READ_CHUNK = 1 << 20


def segment_name(base):
    return f"{base:020d}"


class Segment:
    """One segment's files and what is known about them."""

    __slots__ = ("dir", "base", "size", "next_offset", "first_ts", "max_ts", "index_offsets",
                 "index_positions", "time_ts", "time_offsets", "last_indexed_pos", "sealed")

    def __init__(self, directory, base):
        self.dir = directory
        self.base = base
        self.size = 0
        self.next_offset = base
        self.first_ts = None
        self.max_ts = None
        self.index_offsets = array("q")  # absolute offsets of indexed batches
        self.index_positions = array("q")
        self.time_ts = array("q")
        self.time_offsets = array("q")
        self.last_indexed_pos = -1
        self.sealed = False

    @property
    def log_path(self):
        return os.path.join(self.dir, segment_name(self.base) + ".log")

    @property
    def index_path(self):
        return os.path.join(self.dir, segment_name(self.base) + ".index")

    @property
    def time_path(self):
        return os.path.join(self.dir, segment_name(self.base) + ".timeindex")

    def load_index(self, log_size):
        """Read the index files; return False if missing or inconsistent with the log."""
        try:
            with open(self.index_path, "rb") as fh:
                raw = fh.read()
            with open(self.time_path, "rb") as fh:
                traw = fh.read()
        except FileNotFoundError:
            return False
        if not raw or len(raw) % _INDEX_ENTRY.size or len(traw) % _TIME_ENTRY.size:
            return False
        offs = array("q")
        poss = array("q")
        for rel, pos in _INDEX_ENTRY.iter_unpack(raw):
            if poss and (pos <= poss[-1] or self.base + rel <= offs[-1]):
                return False
            if pos >= log_size:
                return False
            offs.append(self.base + rel)
            poss.append(pos)
        if poss[0] != 0 or offs[0] != self.base:
            return False
        tts = array("q")
        toffs = array("q")
        for ts, rel, _ in _TIME_ENTRY.iter_unpack(traw):
            if toffs and (ts < tts[-1] or self.base + rel < toffs[-1]):
                return False
            tts.append(ts)
            toffs.append(self.base + rel)
        self.index_offsets, self.index_positions = offs, poss
        self.time_ts, self.time_offsets = tts, toffs
        self.last_indexed_pos = poss[-1]
        return True

    def reset_index(self):
        self.index_offsets = array("q")
        self.index_positions = array("q")
        self.time_ts = array("q")
        self.time_offsets = array("q")
        self.last_indexed_pos = -1

    def add_index_entry(self, batch_base, pos, max_ts, interval):
        """Record an index entry for a batch at `pos` if due; return the entry bytes written."""
        if self.last_indexed_pos >= 0 and pos - self.last_indexed_pos < interval:
            return None
        self.index_offsets.append(batch_base)
        self.index_positions.append(pos)
        self.last_indexed_pos = pos
        ts = max_ts if not self.time_ts or max_ts > self.time_ts[-1] else self.time_ts[-1]
        self.time_ts.append(ts)
        self.time_offsets.append(batch_base)
        return (_INDEX_ENTRY.pack(batch_base - self.base, pos),
                _TIME_ENTRY.pack(ts, batch_base - self.base, 0))

    def position_for(self, offset):
        """Position of the last indexed batch starting at or before `offset`."""
        i = bisect.bisect_right(self.index_offsets, offset) - 1
        return self.index_positions[i] if i >= 0 else 0

    def position_for_time(self, ts):
        """Position of an indexed batch before the first one whose max timestamp reaches ts."""
        i = bisect.bisect_left(self.time_ts, ts) - 1
        if i < 0:
            return 0
        off = self.time_offsets[i]
        return self.position_for(off)

    def next_index_position_after(self, pos):
        i = bisect.bisect_right(self.index_positions, pos)
        return self.index_positions[i] if i < len(self.index_positions) else None


def _list_segments(directory):
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    bases = sorted(int(m.group(1)) for m in map(_SEGMENT_RE.match, names) if m)
    return bases


def scan_batches(fd, start, end, verify=True):
    """Yield (pos, Batch | CorruptBatch) for the batches in [start, end) of an open file.

    Stops at the first position that is not a batch start (returning there) or at a
    batch that runs past `end`. Reads in 1 MiB chunks.
    """
    pos = start
    buf = b""
    buf_pos = start
    while pos < end:
        rel = pos - buf_pos
        if len(buf) - rel < 8:
            buf = os.pread(fd, max(_READ_CHUNK, 8), pos)
            buf_pos = pos
            rel = 0
            if len(buf) < 8:
                return
        size = read_prefix(buf, rel)
        if size is None:
            yield pos, CorruptBatch(f"no batch header at position {pos}")
            return
        if pos + size > end:
            return
        if len(buf) - rel < size:
            buf = os.pread(fd, max(_READ_CHUNK, size), pos)
            buf_pos = pos
            rel = 0
            if len(buf) < size:
                return
        try:
            if rel == 0 and size == len(buf):
                batch = Batch(buf, 0, verify)
            else:
                batch = Batch(buf[rel:rel + size], 0, verify)
        except CorruptBatch as e:
            e.size = size
            yield pos, e
        else:
            yield pos, batch
        pos += size


class LogReader:
    """Reads one partition directory; safe to use while a writer appends."""

    def __init__(self, directory):
        self.dir = str(directory)
        self.segments = []
        self.corrupt_records = 0
        self._fds = {}
        self.refresh()

    # --- discovery ---------------------------------------------------------

    def refresh(self):
        """Pick up new segments and drop deleted ones (another process may be writing)."""
        known = {s.base: s for s in self.segments}
        segments = []
        for base in _list_segments(self.dir):
            seg = known.get(base)
            if seg is None:
                seg = Segment(self.dir, base)
            try:
                size = os.path.getsize(seg.log_path)
            except FileNotFoundError:
                continue
            if size != seg.size or seg.next_offset == seg.base:
                self._describe(seg, size)
            segments.append(seg)
        for base in set(known) - {s.base for s in segments}:
            fd = self._fds.pop(base, None)
            if fd is not None:
                os.close(fd)
        self.segments = segments

    def _describe(self, seg, size):
        """Learn a segment's complete size, next offset and time range from its files."""
        if seg.last_indexed_pos < 0 or seg.last_indexed_pos >= size:
            if not seg.load_index(size):
                seg.reset_index()
        fd = self._fd(seg)
        start = seg.last_indexed_pos if seg.last_indexed_pos >= 0 else 0
        if seg.first_ts is None:
            for _, b in scan_batches(fd, 0, size, verify=False):
                if isinstance(b, Batch):
                    seg.first_ts = b.first_ts
                break
        pos = start
        for pos, b in scan_batches(fd, start, size, verify=False):
            if isinstance(b, CorruptBatch):
                break
            seg.next_offset = b.next_offset
            seg.max_ts = b.max_ts if seg.max_ts is None else max(seg.max_ts, b.max_ts)
            pos += b.size
        seg.size = max(pos, seg.size) if pos <= size else seg.size

    def _fd(self, seg):
        fd = self._fds.get(seg.base)
        if fd is None:
            fd = self._fds[seg.base] = os.open(seg.log_path, os.O_RDONLY)
        return fd

    def close(self):
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    @property
    def start_offset(self):
        return self.segments[0].base if self.segments else 0

    @property
    def end_offset(self):
        """The offset the next record written will get (as far as this reader knows)."""
        return self.segments[-1].next_offset if self.segments else 0

    # --- reading -------------------------------------------------------------

    def _segment_index(self, offset):
        bases = [s.base for s in self.segments]
        return max(0, bisect.bisect_right(bases, offset) - 1)

    def batches(self, start=0, end=None):
        """Yield Batch objects (CRC-checked) or lists of salvaged Records, covering [start, end).

        Batches may begin before `start`; callers trim. Damaged records are skipped,
        counted in `corrupt_records` and logged.
        """
        if not self.segments:
            return
        for si in range(self._segment_index(start), len(self.segments)):
            seg = self.segments[si]
            if end is not None and seg.base >= end:
                return
            if seg.next_offset <= start:
                continue
            fd = self._fd(seg)
            pos = seg.position_for(start) if start > seg.base else 0
            limit = seg.size
            while pos < limit:
                resume = None
                for bpos, b in scan_batches(fd, pos, limit):
                    if isinstance(b, Batch):
                        if b.next_offset > start:
                            yield b
                        if end is not None and b.next_offset >= end:
                            return
                        continue
                    resume = self._damaged(seg, fd, bpos, b)
                    if isinstance(resume, tuple):
                        salvaged, resume = resume
                        if salvaged:
                            yield salvaged
                    break
                else:
                    break
                if resume is None:
                    break
                pos = resume

    def _damaged(self, seg, fd, pos, err):
        """Handle a bad batch at `pos`: salvage what checks out; return where to go on."""
        size = getattr(err, "size", None)
        if size is not None:
            raw = os.pread(fd, size, pos)
            try:
                batch = Batch(raw, 0, verify=False)
                good = []
                bad = []
                for r in batch.records(check_records=True):
                    (bad if isinstance(r, BadRecord) else good).append(r)
                if bad:
                    self.corrupt_records += len(bad)
                    log.error("%s: batch at position %d failed its CRC; skipped %d damaged record(s) "
                              "(offsets %s), kept %d", seg.log_path, pos, len(bad),
                              _ranges([r.offset for r in bad]), len(good))
                else:
                    log.error("%s: batch at position %d failed its CRC but every record checks out; "
                              "serving its %d records", seg.log_path, pos, len(good))
                return good, pos + size
            except CorruptBatch:
                pass
        nxt = seg.next_index_position_after(pos)
        log.error("%s: unreadable batch at position %d (%s); skipping to %s", seg.log_path, pos, err,
                  f"position {nxt}" if nxt is not None else "the end of the segment")
        self.corrupt_records += 1
        return nxt

    def records(self, start=0, end=None, topic_filters=None):
        """Yield Record objects with start <= offset < end, optionally filtered by MQTT filters."""
        match = _matcher(topic_filters)
        for b in self.batches(start, end):
            recs = b.records() if isinstance(b, Batch) else b
            for r in recs:
                if r.offset < start:
                    continue
                if end is not None and r.offset >= end:
                    return
                if match is None or match(r.topic):
                    yield r

    def offset_for_time(self, ts_us):
        """The first offset whose record has timestamp >= ts_us (end_offset if none)."""
        for seg in self.segments:
            if seg.max_ts is not None and seg.max_ts < ts_us:
                continue
            fd = self._fd(seg)
            pos = seg.position_for_time(ts_us)
            for _, b in scan_batches(fd, pos, seg.size):
                if not isinstance(b, Batch) or b.max_ts < ts_us:
                    continue
                for r in b.records():
                    if r.timestamp >= ts_us:
                        return r.offset
        return self.end_offset

    def stats(self):
        segs = self.segments
        total = sum(s.size for s in segs)
        first_ts = segs[0].first_ts if segs else None
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

    def verify(self):
        """Check every batch and record; return a list of problem descriptions (empty: healthy)."""
        problems = []
        expected = None
        for seg in self.segments:
            fd = self._fd(seg)
            if expected is not None and seg.base != expected:
                problems.append(f"{seg.log_path}: starts at offset {seg.base}, expected {expected}")
            pos = 0
            size = os.path.getsize(seg.log_path)
            while pos < size:
                advanced = False
                for bpos, b in scan_batches(fd, pos, size):
                    if isinstance(b, Batch):
                        pos = bpos + b.size
                        advanced = True
                        continue
                    sz = getattr(b, "size", None)
                    desc = f"{seg.log_path}: position {bpos}: {b}"
                    if sz is not None:
                        try:
                            batch = Batch(os.pread(fd, sz, bpos), 0, verify=False)
                            bad = [r.offset for r in batch.records(check_records=True) if isinstance(r, BadRecord)]
                            desc += f"; damaged records: {_ranges(bad) if bad else 'none (header only)'}"
                        except CorruptBatch as e2:
                            desc += f"; {e2}"
                        pos = bpos + sz
                    else:
                        nxt = seg.next_index_position_after(bpos)
                        pos = nxt if nxt is not None else size
                        desc += f"; {size - bpos if nxt is None else nxt - bpos} bytes unreadable"
                    problems.append(desc)
                    advanced = True
                    break
                else:
                    if pos < size:
                        problems.append(f"{seg.log_path}: {size - pos} bytes of incomplete batch at the end")
                    break
                if not advanced:
                    break
            expected = seg.next_offset
        return problems


def _ranges(offsets):
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


def _matcher(filters):
    if not filters:
        return None
    from ..broker.topics import topic_matches

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


class CommitLog(LogReader):
    """The writer side of a partition. Append and sync from one thread only."""

    def __init__(self, directory, segment_bytes=64 << 20, index_interval_bytes=4096):
        os.makedirs(directory, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.index_interval = index_interval_bytes
        self.truncated_bytes = 0
        self._wfd = None
        self._ifd = None
        self._tfd = None
        super().__init__(directory)
        self._recover()

    # --- recovery -----------------------------------------------------------

    def _recover(self):
        if not self.segments:
            self._open_segment(0)
            return
        for seg in self.segments[:-1]:
            seg.sealed = True
            self._check_sealed(seg)
        self._recover_active(self.segments[-1])

    def _rebuild_index(self, seg, upto):
        """Rewrite a segment's index files from its batches in [0, upto)."""
        seg.reset_index()
        fd = self._fd(seg)
        idx = []
        tidx = []
        for pos, b in scan_batches(fd, 0, upto, verify=False):
            if not isinstance(b, Batch):
                break
            e = seg.add_index_entry(b.base, pos, b.max_ts, self.index_interval)
            if e:
                idx.append(e[0])
                tidx.append(e[1])
        _write_atomic(seg.index_path, b"".join(idx))
        _write_atomic(seg.time_path, b"".join(tidx))

    def _check_sealed(self, seg):
        if seg.last_indexed_pos < 0:
            log.warning("%s: index missing or inconsistent; rebuilding it", seg.log_path)
            self._rebuild_index(seg, seg.size)

    def _recover_active(self, seg):
        size = os.path.getsize(seg.log_path)
        index_ok = seg.load_index(size)
        if not index_ok:
            if size:
                log.warning("%s: index missing or inconsistent; rebuilding it", seg.log_path)
            seg.reset_index()
        fd = self._fd(seg)
        start = seg.last_indexed_pos if seg.last_indexed_pos >= 0 else 0
        good_end = start
        next_offset = seg.base
        max_ts = seg.max_ts
        # Verify the tail from the last indexed batch with full CRC checks.
        for pos, b in scan_batches(fd, start, size):
            if not isinstance(b, Batch):
                break
            good_end = pos + b.size
            next_offset = b.next_offset
            max_ts = b.max_ts if max_ts is None else max(max_ts, b.max_ts)
        if start and good_end == start:
            # Even the indexed batch is bad: start over from the beginning.
            seg.reset_index()
            good_end = 0
            next_offset = seg.base
            for pos, b in scan_batches(fd, 0, size):
                if not isinstance(b, Batch):
                    break
                good_end = pos + b.size
                next_offset = b.next_offset
        if good_end < size:
            lost = size - good_end
            self.truncated_bytes += lost
            log.warning("%s: truncating %d bytes of torn or corrupt data at position %d "
                        "(records from offset %d on were never acknowledged as durable)",
                        seg.log_path, lost, good_end, next_offset)
            with open(seg.log_path, "r+b") as fh:
                fh.truncate(good_end)
                os.fsync(fh.fileno())
        seg.size = good_end
        seg.next_offset = next_offset
        seg.max_ts = max_ts
        if seg.index_positions and seg.index_positions[-1] >= good_end:
            index_ok = False
        if not index_ok or seg.last_indexed_pos < 0 or good_end > start:
            self._rebuild_index(seg, good_end)
        self._open_files(seg)

    # --- writing -------------------------------------------------------------

    def _open_files(self, seg):
        self._close_files()
        self._wfd = os.open(seg.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._ifd = os.open(seg.index_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._tfd = os.open(seg.time_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _close_files(self):
        for fd in (self._wfd, self._ifd, self._tfd):
            if fd is not None:
                os.close(fd)
        self._wfd = self._ifd = self._tfd = None

    def _open_segment(self, base):
        seg = Segment(self.dir, base)
        for path in (seg.log_path, seg.index_path, seg.time_path):
            with open(path, "wb"):
                pass
        self.segments.append(seg)
        self._open_files(seg)
        _fsync_dir(self.dir)
        return seg

    def append(self, data, base, count, first_ts, max_ts):
        """Write one encoded batch (from `format.encode_batch`) at the end of the log."""
        seg = self.segments[-1]
        if base != seg.next_offset:
            raise ValueError(f"batch base {base} does not follow the log end {seg.next_offset}")
        if seg.size and seg.size + len(data) > self.segment_bytes:
            self._roll(base)
            seg = self.segments[-1]
        pos = seg.size
        view = memoryview(data)
        while view:
            n = os.write(self._wfd, view)
            view = view[n:]
        e = seg.add_index_entry(base, pos, max_ts, self.index_interval)
        if e:
            os.write(self._ifd, e[0])
            os.write(self._tfd, e[1])
        if seg.first_ts is None:
            seg.first_ts = first_ts
        seg.max_ts = max_ts if seg.max_ts is None else max(seg.max_ts, max_ts)
        seg.next_offset = base + count
        seg.size = pos + len(data)

    def sync(self):
        if self._wfd is not None:
            os.fdatasync(self._wfd)

    def _roll(self, base):
        seg = self.segments[-1]
        os.fsync(self._wfd)
        os.fsync(self._ifd)
        os.fsync(self._tfd)
        seg.sealed = True
        self._open_segment(base)

    def close(self):
        if self._wfd is not None:
            self.sync()
        self._close_files()
        super().close()

    # --- retention -----------------------------------------------------------

    def enforce_retention(self, retention_bytes=0, retention_hours=0.0, protect_from=None,
                          hard_bytes=0, now_us=None):
        """Delete whole sealed segments past the limits.

        A segment holding an offset >= `protect_from` (still needed by a persistent
        session) is kept unless the log exceeds `hard_bytes`. Returns
        (segments deleted, records deleted that were still needed).
        """
        if now_us is None:
            now_us = int(time.time() * 1e6)
        total = sum(s.size for s in self.segments)
        deleted = lost = 0
        cutoff = now_us - int(retention_hours * 3600e6) if retention_hours else None
        while len(self.segments) > 1:
            seg = self.segments[0]
            too_big = retention_bytes and total > retention_bytes
            too_old = cutoff is not None and seg.max_ts is not None and seg.max_ts < cutoff
            if not (too_big or too_old):
                break
            needed = protect_from is not None and seg.next_offset > protect_from
            if needed and not (hard_bytes and total > hard_bytes):
                break
            if needed:
                n = seg.next_offset - max(seg.base, protect_from)
                lost += n
                log.error("%s: deleted although persistent sessions still needed %d of its records "
                          "(log over its hard limit of %d bytes)", seg.log_path, n, hard_bytes)
            self._delete(seg)
            total -= seg.size
            deleted += 1
        return deleted, lost

    def _delete(self, seg):
        self.segments.pop(0)
        fd = self._fds.pop(seg.base, None)
        if fd is not None:
            os.close(fd)
        for path in (seg.log_path, seg.index_path, seg.time_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        log.info("retention: deleted segment %s (offsets %d-%d, %d bytes)",
                 segment_name(seg.base), seg.base, seg.next_offset - 1, seg.size)


def _write_atomic(path, data):
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


__all__ = ["CommitLog", "LogReader", "Record", "Segment"]
