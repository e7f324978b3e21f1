"""The commit log's writer: `CommitLog` appends to a partition, rolls segments, syncs, retains.

A partition is a directory of segments (segment.py) holding record batches (format.py),
with sparse offset and time indexes per segment (index.py) and, kept by a writer that
fsyncs, the durable mark (files.DURABLE_FILE). `CommitLog` is a `LogReader` (reader.py)
that also writes: it opens the partition through recovery (recovery.py: a torn or
corrupt tail truncated and reported, stale or missing indexes rebuilt), then appends,
rolls to a new segment at `segment_bytes`, syncs and deletes old segments for retention.
A replicated partition's log is also cut back (`truncate`: a follower whose tail the
leader never had) or emptied to start at an offset (`reset`: after a state snapshot).
Append and sync from one thread only.
"""

import bisect
import errno
import logging
import mmap
import os
import threading
import time

from .files import DURABLE_FILE, durable_bytes, fallocate, fsync_dir, write_parts
from .reader import LogReader
from .recovery import recover, recover_active, remove_orphans, sync_past_mark
from .scan import Damage, walk
from .segment import Segment, segment_name

log = logging.getLogger("wrenmq.store")

# Index entries are appended to the index files in runs of this many (and before every sync,
# roll and close): one write per batch was two more GIL hand-overs per batch for the writer
# thread. Readers walk the log past the last entry in the files, so they only lag.
_INDEX_WRITE_EVERY = 16
_BLOCK = 4096  # O_DIRECT writes: whole blocks of this size, at multiples of it, from aligned memory
# The active segment's next bytes are allocated ahead of the writes, this much at a time,
# with fallocate(FALLOC_FL_KEEP_SIZE): the file's size (what readers see) does not change,
# and the writes land in blocks the filesystem already gave it. Growing a file block by
# block cost the writer about a quarter more CPU on ext4 (delayed allocation per page).
# What a segment did not use is given back when it is sealed or closed; a kill leaves at
# most this much allocated past its end.
_RESERVE_AHEAD = 16 << 20


class CommitLog(LogReader):
    """The writer side of a partition. Append and sync from one thread only.

    With `direct_io` (where the filesystem allows O_DIRECT) the whole 4 KiB blocks of
    each append go to the device from an aligned buffer of the log's own, and only the
    partial block at the end is written through the page cache: a buffered write copies
    every byte into page-cache pages, which cost the broker ~2 us of CPU per KiB on a VM
    whose memory is new to it, O_DIRECT ~0.06. The file's bytes,
    size and durability (`sync`) are the same either way.
    """

    def __init__(self, directory, segment_bytes=64 << 20, index_interval_bytes=4096, direct_io=False,
                 durable_marks=False, mark_limit=None):
        os.makedirs(directory, exist_ok=True)
        self.segment_bytes = segment_bytes
        self.index_interval = index_interval_bytes
        self.truncated_bytes = 0
        self._wfd = None
        self._ifd = None
        self._tfd = None
        self._index_pending = []  # (index, time index) entries not in the files yet
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        self._dfd = None  # the active segment opened with O_DIRECT
        self._partial = b""  # the active segment's bytes after its last whole block
        self._stage = None  # page-aligned buffer for O_DIRECT writes
        # Where the active segment's allocated blocks end (_RESERVE_AHEAD); None: not done here.
        self._reserved = None
        self.preallocate = fallocate is not None
        # How a segment the log rolls away from is made durable, with the directory that
        # gains the next one. None: fsynced here, before the next segment gets a byte. A
        # callable: handed duplicates of its log and index descriptors and one of the
        # directory, which it must fsync in that order and close (the store's syncer thread
        # under fsync = "interval": the 64 MiB of a roll took the writer 17-37 ms to fsync,
        # long enough for a2's flood to fill the unwritten limit and stop the loop; Kafka
        # flushes a rolled segment in the background too). False: not at all (fsync =
        # "never").
        self.sealed_sync = None
        self._durable_fd = None  # DURABLE_FILE, written after each sync (durable_marks)
        self._durable_failed = False
        # A replicated partition's mark says no more than its high watermark (`limit_marks`):
        # a reader (the Spark source) must not take a record that a failover could still
        # take back. None: not limited. `_synced`: the end the syncs made durable.
        # Without syncs to mark (fsync = "never") a limited mark is kept all the same, and
        # follows the writes: "durable" is "written" there, but readers still stop at the HW.
        self.mark_limit = mark_limit
        self._marks_follow_writes = mark_limit is not None and not durable_marks
        self._synced = 0
        self._mark_lock = threading.Lock()
        remove_orphans(str(directory))
        super().__init__(directory)
        self._recover()
        self._open_durable(durable_marks or mark_limit is not None)

    # --- opening and the durable mark -------------------------------------------

    def _recover(self):
        if not self.segments:
            self._open_segment(0)
            return
        self.truncated_bytes += recover(self.dir, self.segments, self.index_interval)
        self._open_files(self.segments[-1])

    def _open_durable(self, on):
        """Start keeping DURABLE_FILE (after making what recovery found durable), or, off,
        remove one a run that fsynced left: it would hold readers back for good."""
        path = os.path.join(self.dir, DURABLE_FILE)
        if not on:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            return
        end = self.end_offset
        sync_past_mark(self.dir, self.segments, end)
        self._durable_fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        self.mark_durable(end)

    def mark_durable(self, offset):
        """Every record below `offset` is on disk: say so in DURABLE_FILE (from the thread
        whose sync made it so). A failed write only holds readers back: logged once."""
        if self._durable_fd is None:
            return
        if self.mark_limit is not None:
            self._mark_limited(offset)
            return
        self._write_mark(offset)

    def limit_marks(self, limit):
        """From now on DURABLE_FILE says at most `limit` (a replicated partition's high
        watermark; raised as it moves)."""
        self.mark_limit = limit
        if self._durable_fd is not None:
            self._mark_limited(self.end_offset if self._marks_follow_writes else None)

    def _mark_limited(self, synced):
        # (The syncer thread marks while the writer raises the limit: one at a time, so a
        # lower value never lands after a higher one.)
        with self._mark_lock:
            if synced is not None and synced > self._synced:
                self._synced = synced
            self._write_mark(min(self._synced, self.mark_limit))

    def _write_mark(self, offset):
        try:
            os.pwrite(self._durable_fd, durable_bytes(offset), 0)
        except OSError as e:
            if not self._durable_failed:
                self._durable_failed = True
                log.error("%s: cannot write %s (%s); readers that wait for durable records "
                          "(the Spark source) see no new ones", self.dir, DURABLE_FILE, e)

    def _open_files(self, seg):
        self._close_files()
        self._wfd = os.open(seg.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._reserved = seg.size if self.preallocate else None
        self._ifd = os.open(seg.index_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._tfd = os.open(seg.time_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if self.direct_io:
            try:
                self._dfd = os.open(seg.log_path, os.O_WRONLY | os.O_DIRECT)
            except OSError as e:  # tmpfs and some others: EINVAL
                self._stop_direct(e)
            start = seg.size - seg.size % _BLOCK
            self._partial = b""
            if self._dfd is not None and seg.size > start:
                fd = os.open(seg.log_path, os.O_RDONLY)
                try:
                    self._partial = os.pread(fd, seg.size - start, start)
                finally:
                    os.close(fd)

    def _close_files(self):
        for fd in (self._wfd, self._ifd, self._tfd, self._dfd):
            if fd is not None:
                os.close(fd)
        self._wfd = self._ifd = self._tfd = self._dfd = None

    def _open_segment(self, base, sync_dir=True):
        seg = Segment(self.dir, base)
        for path in (seg.log_path, seg.index_path, seg.time_path):
            with open(path, "wb"):
                pass
        seg.scanned = 0
        seg.index_ok = True
        self.segments.append(seg)
        self._open_files(seg)
        if sync_dir:
            fsync_dir(self.dir)
        return seg

    def append(self, data, base, count, first_ts, max_ts):
        """Write one encoded batch at the end of the log.

        `data`: the batch's bytes (`format.encode_batch`), or its parts as a tuple or
        list (`format.encode_batch_parts`, `_encode.encode_epochs`), written with writev.
        Returns the batch's size.
        """
        parts = data if isinstance(data, (tuple, list)) else (data,)
        size = sum(map(len, parts))
        seg = self._place(base, size)
        pos = seg.size
        try:
            if self._dfd is not None and len(self._partial) + size >= _BLOCK:
                self._write_direct(pos, parts, size)
            else:
                write_parts(self._wfd, parts)
                if self._dfd is not None:
                    self._partial += b"".join(parts)
        except OSError:
            self._take_back(pos)
            raise
        self._appended(seg, base, count, pos, size, first_ts, max_ts)
        return size

    def _place(self, base, size):
        """The segment a batch of `size` bytes starting at offset `base` goes to: the
        active one, or a new one if it would grow past segment_bytes."""
        seg = self.segments[-1]
        if base != seg.next_offset:
            raise ValueError(f"batch base {base} does not follow the log end {seg.next_offset}")
        if seg.size and seg.size + size > self.segment_bytes:
            self._roll(base)
            seg = self.segments[-1]
        if self._reserved is not None and seg.size + size > self._reserved:
            self._reserve(seg, size)
        return seg

    def _reserve(self, seg, size):
        """Allocate the active segment's blocks for the next `size` bytes and _RESERVE_AHEAD
        more (not past segment_bytes unless this batch is). A filesystem that cannot (or a
        full disk) only turns this off: the write itself says whether there is room."""
        end = max(min(seg.size + size + _RESERVE_AHEAD, self.segment_bytes), seg.size + size)
        try:
            fallocate(self._wfd, self._reserved, end - self._reserved)
        except OSError as e:
            self.preallocate = False
            self._reserved = None
            log.info("%s: not allocating segments ahead of the writes here (%s)", self.dir, e.strerror or e)
            return
        self._reserved = end

    def _give_back(self, seg):
        """Free the blocks allocated past the segment's end (its size is what was written).
        Only space: a failure here loses nothing, and is left to the next write or sync."""
        if self._reserved is not None and self._reserved > seg.size and self._wfd is not None:
            try:
                os.ftruncate(self._wfd, seg.size)
            except OSError as e:
                log.warning("%s: could not give back the space allocated past its end: %s", seg.log_path, e)
        self._reserved = None

    @property
    def writes_through_cache(self):
        """True if appends go through the page cache only (no O_DIRECT), so a batch can be
        written by `append_epochs`."""
        return self._dfd is None

    def append_epochs(self, base, count, epochs, write_epochs):
        """Encode and write the `count` records of `epochs` (store epochs, offsets from
        `base`) as one batch with `write_epochs` (`_encode.write_epochs`, which writes the
        batch itself between its checksums, without the GIL). Returns the batch's size."""
        at = []

        def prepare(size):
            at.append(self._place(base, size).size)
            return self._wfd

        try:
            size, first_ts, max_ts = write_epochs(epochs, prepare)
        except OSError:
            if at:
                self._take_back(at[0])
            raise
        self._appended(self.segments[-1], base, count, at[0], size, first_ts, max_ts)
        return size

    def _take_back(self, pos):
        """After a failed write (disk full, an I/O error): cut a partial batch back off so
        later appends (and their index entries) still land where the segment says it ends."""
        try:
            os.ftruncate(self._wfd, pos)
        except OSError:
            pass
        if self._reserved is not None:
            self._reserved = pos  # (the truncate freed the blocks past it)

    def _appended(self, seg, base, count, pos, size, first_ts, max_ts):
        """A batch of `count` records is in `seg` at `pos`: its index entry and extent."""
        running = max_ts if seg.max_ts is None or max_ts > seg.max_ts else seg.max_ts
        e = seg.add_index_entry(base, pos, running, self.index_interval)
        if e:
            self._index_pending.append(e)
            if len(self._index_pending) >= _INDEX_WRITE_EVERY:
                self._write_index_pending()
        if seg.first_ts is None:
            seg.first_ts = first_ts
        seg.max_ts = running
        seg.next_offset = base + count
        seg.size = seg.scanned = pos + size

    def _write_direct(self, pos, parts, size):
        """Write `parts` at `pos`: the whole blocks from the start of pos's block (the
        partial block's bytes again, then the new ones) with O_DIRECT, the rest appended
        through the page cache. O_DIRECT first writes back and drops any cached copy of
        the range, so readers never see stale bytes."""
        partial = self._partial
        total = len(partial) + size
        whole = total - total % _BLOCK
        if self._stage is None or len(self._stage) < whole:
            if self._stage is not None:
                self._stage.close()
            self._stage = mmap.mmap(-1, max(whole, 2 << 20))  # page-aligned, as O_DIRECT needs
        view = memoryview(self._stage)
        try:
            view[:len(partial)] = partial
            at = len(partial)
            after = []  # what follows the last whole block
            for p in parts:
                end = at + len(p)
                if end <= whole:
                    view[at:end] = p
                elif at >= whole:
                    after.append(p)
                else:
                    cut = whole - at
                    view[at:whole] = memoryview(p)[:cut]
                    after.append(memoryview(p)[cut:])
                at = end
            rest = b"".join(after)
            block_start = pos - len(partial)
            try:
                written = os.pwrite(self._dfd, view[:whole], block_start)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self._stop_direct(e)  # the filesystem refused this alignment after all
                write_parts(self._wfd, parts)
                return
        finally:
            view.release()
        if written != whole:
            raise OSError(errno.EIO, f"short O_DIRECT write ({written} of {whole} bytes)")
        if rest:
            write_parts(self._wfd, (rest,))
        self._partial = rest

    def _stop_direct(self, why):
        """Write through the page cache from now on."""
        log.info("%s: no O_DIRECT here (%s); the log is written through the page cache", self.dir, why)
        if self._dfd is not None:
            os.close(self._dfd)
            self._dfd = None
        self.direct_io = False

    def _write_index_pending(self):
        """Append the index entries held back since the last write to the index files."""
        pending = self._index_pending
        if pending:
            os.write(self._ifd, b"".join([e[0] for e in pending]))
            os.write(self._tfd, b"".join([e[1] for e in pending]))
            pending.clear()

    def sync(self):
        if self._wfd is not None:
            self._write_index_pending()
            end = self.end_offset
            os.fdatasync(self._wfd)
            if not self.sealed_sync:  # (else a rolled segment may still wait for the syncer, which marks)
                self.mark_durable(end)

    def sync_handle(self):
        """For an fdatasync on another thread: a new descriptor of the active segment (that
        thread closes it; it stays valid when the log rolls to the next segment) and the
        offset below which that sync makes the log durable (for `mark_durable` after it;
        segments rolled away from before must have been synced first)."""
        self._write_index_pending()
        return os.dup(self._wfd), self.end_offset

    def _roll(self, base):
        seg = self.segments[-1]
        self._give_back(seg)
        self._write_index_pending()
        fds = (self._wfd, self._ifd, self._tfd)
        handed = None
        if self.sealed_sync is None:
            for fd in fds:
                os.fsync(fd)
        elif self.sealed_sync:
            handed = tuple(os.dup(fd) for fd in fds)
        seg.sealed = True
        # The directory (the new segment's entry) is synced where the old segment is: here,
        # or by the one handed them (on a VM its fsync made the writer wait 8 ms a roll).
        self._open_segment(base, sync_dir=self.sealed_sync is None)
        if handed is not None:
            try:
                dfd = os.open(self.dir, os.O_RDONLY)
            except OSError:
                dfd = None
            self.sealed_sync(handed if dfd is None else handed + (dfd,))

    def close(self):
        if self._wfd is not None:
            self._give_back(self.segments[-1])
            self.sync()
        self._close_files()
        if self._stage is not None:
            self._stage.close()
            self._stage = None
        if self._durable_fd is not None:
            os.close(self._durable_fd)
            self._durable_fd = None
        super().close()

    # --- retention -----------------------------------------------------------

    def enforce_retention(self, retention_bytes=0, retention_hours=0.0, protect_from=None,
                          hard_bytes=0, now_us=None, keep_from=None):
        """Delete whole sealed segments past the limits.

        A segment holding an offset >= `protect_from` (still needed by a persistent
        session) is kept unless the log exceeds `hard_bytes`, which is a size limit of
        its own. One holding an offset >= `keep_from` is always kept (a replicated
        partition: records whose state changes are not applied yet). Returns (segments
        deleted, records deleted that were still needed).
        """
        if now_us is None:
            now_us = int(time.time() * 1e6)
        total = sum(s.size for s in self.segments)
        deleted = lost = 0
        cutoff = now_us - int(retention_hours * 3600e6) if retention_hours else None
        while len(self.segments) > 1:
            seg = self.segments[0]
            over_hard = bool(hard_bytes) and total > hard_bytes
            too_big = (retention_bytes and total > retention_bytes) or over_hard
            too_old = cutoff is not None and seg.max_ts is not None and seg.max_ts < cutoff
            if not (too_big or too_old) or (keep_from is not None and seg.next_offset > keep_from):
                break
            needed = protect_from is not None and seg.next_offset > protect_from
            if needed and not over_hard:
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

    # --- truncation ---------------------------------------------------------------

    def truncate(self, offset):
        """Remove the records from `offset` on (Kafka's truncateTo): the segments above it
        go whole, the one holding it is cut where the batch holding it begins, its index
        rebuilt, and DURABLE_FILE moved back. Returns the end offset the log has then:
        `offset`, or less if it is not a batch boundary (the whole batch holding it goes).
        Nothing if the log ends at or before `offset`. ValueError below the log start
        (`reset` empties a log)."""
        end = None
        for end in self.truncate_steps(offset):
            pass
        return end

    def truncate_steps(self, offset):
        """`truncate` one step at a time: a generator that yields None after each step a
        crash (or a kill) could stop it after, and the new end offset last. Each step
        leaves a log that opens as a prefix of the one before: the durable mark goes back
        first, then the segments above `offset` one by one from the last, then the cut."""
        end = self.end_offset
        if offset < self.start_offset:
            raise ValueError(f"cannot truncate to offset {offset}, below the log start {self.start_offset}")
        if offset >= end:
            yield end
            return
        self._write_index_pending()
        holding = self.segments[bisect.bisect_right([s.base for s in self.segments], offset) - 1]
        cut, new_end = self._cut_point(holding, offset)
        self._lower_mark(new_end)
        yield None
        while len(self.segments) > 1 and self.segments[-1].base >= new_end:
            self._close_files()
            self._unlink(self.segments.pop())
            yield None
        seg = self.segments[-1]
        self._close_files()
        if seg is not holding:
            cut = seg.size  # (the segment holding the offset began there: it went whole)
        if cut < seg.size:
            with open(seg.log_path, "r+b") as fh:
                fh.truncate(cut)
                os.fsync(fh.fileno())
            yield None
            # The index files keep the entries below the cut (written whole, atomically),
            # so the rebuild below finds them matching, then the extent is walked again.
            n = bisect.bisect_left(seg.index_positions, cut)
            for arr in (seg.index_offsets, seg.index_positions, seg.time_ts, seg.time_offsets):
                del arr[n:]
            seg.last_indexed_pos = seg.index_positions[-1] if n else -1
            seg.write_index()
            recover_active(seg, self.index_interval)
        seg.sealed = False
        self._open_files(seg)
        fsync_dir(self.dir)
        log.info("%s: truncated to offset %d (was %d)", self.dir, seg.next_offset, end)
        yield seg.next_offset

    def reset(self, start):
        """Empty the log; the next record gets offset `start` (Kafka's
        truncateFullyAndStartAt: a replica that installed a state snapshot). A crash
        midway leaves a prefix of the old log, or an empty one."""
        self._write_index_pending()
        self._lower_mark(min(start, self.end_offset))
        self._close_files()
        while self.segments:
            self._unlink(self.segments.pop())
        fsync_dir(self.dir)
        self._open_segment(start)
        if self._durable_fd is not None:
            self._synced = start
            self._write_mark(start if self.mark_limit is None else min(start, self.mark_limit))
        log.info("%s: emptied; the log starts at offset %d", self.dir, start)

    def _lower_mark(self, offset):
        """DURABLE_FILE says no more than `offset`, on disk before anything is removed (readers
        must not take what goes for durable, nor recovery its removal for a loss)."""
        if self._durable_fd is None:
            return
        with self._mark_lock:
            self._synced = min(self._synced, offset)
            mark = self.durable_mark
            if mark is None or mark > offset:
                self._write_mark(offset)
            os.fsync(self._durable_fd)

    def _cut_point(self, seg, offset):
        """(position, offset) in `seg` where the first batch not wholly below `offset`
        begins (damage counts as such a batch); (its size, its end) if there is none."""
        pos, at = seg.position_for(offset)
        fd = os.open(seg.log_path, os.O_RDONLY)
        try:
            for p, item in walk(fd, pos, seg.size, at, search_tail=False):
                if isinstance(item, Damage):
                    return p, at
                if item.base + item.count > offset:
                    return p, min(item.base, offset)
                at = item.base + item.count
        finally:
            os.close(fd)
        return seg.size, seg.next_offset

    def _unlink(self, seg):
        """Remove a segment's files, the log first (index files without it are orphans,
        which opening removes)."""
        for path in (seg.log_path, seg.index_path, seg.time_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    def _delete(self, seg):
        self.segments.pop(0)
        for path in (seg.log_path, seg.index_path, seg.time_path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        log.info("retention: deleted segment %s (offsets %d-%d, %d bytes)",
                 segment_name(seg.base), seg.base, seg.next_offset - 1, seg.size)


__all__ = ["CommitLog"]
