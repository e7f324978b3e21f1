"""Opening a partition for writing: what the writer checks and puts right first.

The model is Kafka's LogLoader. A writer that died (a kill, a crash of the machine, a full disk)
can leave a torn or corrupt tail on the segment it wrote last, index files that lag
the log, lack entries or do not fit it, index files whose segment retention had just
deleted, and temporary files. Before the first append `CommitLog` (log.py) removes the
leftovers, truncates the tail (those records were never acknowledged as durable),
keeps and reports damage followed by intact batches, rewrites the indexes that need it
and fsyncs what a kill may have left unsynced. The segment reader (reader.py) has
already walked every segment whose index it could not trust.
"""

import logging
import os

from .files import fsync_dir, read_durable
from .format import Batch
from .index import entries_behind
from .scan import Damage, Salvaged, offset_ranges, walk
from .segment import INDEX_FILE, SEGMENT_FILE, Segment

log = logging.getLogger("wrenmq.store")


def recover(directory, segments, index_interval):
    """Make the partition's `segments` (as a reader found them) fit to append to: the
    sealed ones get the index files they lack, the last one loses a torn or corrupt tail
    (`recover_active`). Returns the bytes truncated."""
    rebuilt = False
    for seg in segments[:-1]:
        seg.sealed = True
        if not seg.index_ok:
            # The reader walked the whole segment, so the entries in memory are complete.
            log.warning("%s: index missing or inconsistent; rebuilding it", seg.log_path)
            seg.write_index()
            rebuilt = True
    truncated, rewritten = recover_active(segments[-1], index_interval)
    if rebuilt or rewritten:
        fsync_dir(directory)
    return truncated


def recover_active(seg, index_interval):
    """Check every batch of the segment written last; truncate a torn or corrupt tail.

    The tail is everything after the last batch whose CRC checks out. Damage
    followed by intact batches is not a tail: it is kept (readers skip it) and
    reported, so acknowledged records after it are never thrown away. Returns (bytes
    truncated, whether the index files were rewritten).
    """
    size = os.path.getsize(seg.log_path)
    fresh = Segment(seg.dir, seg.base)
    good = (0, seg.base, None, None, 0)  # state after the last intact batch
    expect = seg.base
    damaged = []
    fd = os.open(seg.log_path, os.O_RDONLY)
    try:
        for pos, item in walk(fd, 0, size, seg.base, search_tail=False):
            if isinstance(item, Damage):
                damaged.append((pos, item, expect))
                continue
            if item.base > expect or isinstance(item, Salvaged):
                damaged.append((pos, item, expect))
            mts = item.max_ts
            if mts is not None:
                fresh.max_ts = mts if fresh.max_ts is None else max(fresh.max_ts, mts)
            if fresh.first_ts is None:
                fresh.first_ts = item.first_ts
            fresh.add_index_entry(item.base, pos, fresh.max_ts if fresh.max_ts is not None else 0,
                                  index_interval)
            expect = fresh.next_offset = max(fresh.next_offset, item.base + item.count)
            fresh.size = pos + item.size
            if isinstance(item, Batch):
                good = (fresh.size, fresh.next_offset, fresh.first_ts, fresh.max_ts,
                        len(fresh.index_offsets))
    finally:
        os.close(fd)
    good_end, next_offset, first_ts, max_ts, n_entries = good
    for pos, item, exp in damaged:
        if pos >= good_end:
            continue
        if isinstance(item, Salvaged):
            log.error("%s: batch at position %d (offsets %d-%d): %s; damaged records: %s; kept "
                      "(readers skip the damaged records)", seg.log_path, item.pos, item.base,
                      item.next_offset - 1, item.reason, offset_ranges(item.bad) or "none")
        elif isinstance(item, Damage):
            log.error("%s: %d unreadable bytes at position %d (%s), followed by intact batches; "
                      "kept (readers skip them)", seg.log_path, item.end - item.pos, item.pos,
                      item.reason)
        else:
            log.error("%s: offsets %s missing before position %d", seg.log_path,
                      offset_ranges(range(exp, item.base)), pos)
    if good_end < size:
        lost = size - good_end
        log.warning("%s: truncating %d bytes of torn or corrupt data at position %d "
                    "(records from offset %d on were never acknowledged as durable)",
                    seg.log_path, lost, good_end, next_offset)
        with open(seg.log_path, "r+b") as fh:
            fh.truncate(good_end)
            os.fsync(fh.fileno())
        del fresh.index_offsets[n_entries:]
        del fresh.index_positions[n_entries:]
        del fresh.time_ts[n_entries:]
        del fresh.time_offsets[n_entries:]
        fresh.last_indexed_pos = fresh.index_positions[-1] if n_entries else -1
    seg.size = good_end
    seg.next_offset = next_offset
    seg.first_ts = first_ts
    seg.max_ts = max_ts
    seg.index_offsets, seg.index_positions = fresh.index_offsets, fresh.index_positions
    seg.time_ts, seg.time_offsets = fresh.time_ts, fresh.time_offsets
    seg.last_indexed_pos = fresh.last_indexed_pos
    seg.scanned = good_end
    rebuilt = False
    want, have = list(seg.index_bytes()), seg.read_index()
    if want != have:
        behind = entries_behind(want, have)
        if behind is not None:
            # The writer appends entries to the files in runs, behind the log: after a
            # kill the last ones are simply not there yet.
            log.info("%s: completing the index (%d entries behind the log)", seg.log_path, behind)
        elif good_end or have != [b"", b""]:
            log.warning("%s: index missing, stale or inconsistent; rebuilding it", seg.log_path)
        seg.write_index()
        rebuilt = True
    seg.index_ok = True
    return size - good_end, rebuilt


def sync_past_mark(directory, segments, end):
    """Before a writer that keeps the durable mark (files.DURABLE_FILE) writes it again:
    fsync every segment holding records past the mark on disk (a kill -9 can leave what
    it wrote unsynced), and report records lost although the mark said they were durable."""
    mark = read_durable(directory) or 0
    if mark > end:
        log.error("%s: the log ends at offset %d, below the %d it had on disk: records %d-%d were "
                  "lost after they were durable (a reader may have read them)",
                  directory, end, mark, end, mark - 1)
    for seg in segments:
        if seg.next_offset > mark and seg.size:
            fd = os.open(seg.log_path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def remove_orphans(directory):
    """Index files whose segment is gone (a crash during retention) and leftover temp files."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    logs = {m.group(1) for m in map(SEGMENT_FILE.match, names) if m}
    for name in names:
        m = INDEX_FILE.match(name)
        if m and (name.endswith(".tmp") or m.group(1) not in logs):
            try:
                os.unlink(os.path.join(directory, name))
            except OSError:
                pass
