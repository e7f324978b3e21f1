"""A segment of the commit log: its files, their names, and what is known about its contents.

A partition is a directory of segments named by their base offset, Kafka style:

    00000000000000000000.log        record batches (format.py)
    00000000000000000000.index      the sparse offset index (index.py)
    00000000000000000000.timeindex  the sparse time index (index.py)

A `Segment` holds a segment's extent (complete size, next offset, time range) and its
index entries in memory; the reader learns them by walking the file (reader.py), the
writer by appending (log.py), recovery by checking (recovery.py).
"""

import bisect
import os
import re
from array import array

from .files import write_atomic
from .index import entry_bytes, index_bytes, parse_index

SEGMENT_FILE = re.compile(r"^(\d{20})\.log$")
# A segment's index files, and the temporary files they are written through (files.write_atomic).
INDEX_FILE = re.compile(r"^(\d{20})\.(?:index|timeindex)(?:\.tmp)?$")


def segment_name(base):
    return f"{base:020d}"


class Segment:
    """One segment's files and what is known about them."""

    __slots__ = ("dir", "base", "size", "next_offset", "first_ts", "max_ts", "index_offsets",
                 "index_positions", "time_ts", "time_offsets", "last_indexed_pos", "sealed",
                 "scanned", "index_ok")

    def __init__(self, directory, base):
        self.dir = directory
        self.base = base
        self.sealed = False
        self.forget()

    def forget(self):
        """Drop everything learned about the segment's contents."""
        self.size = 0  # bytes of complete batches (readable or not) from the start of the file
        self.next_offset = self.base
        self.first_ts = None
        self.max_ts = None
        self.scanned = -1  # file size when last described; -1: never
        self.index_ok = False  # the index files on disk matched what was found
        self.reset_index()

    @property
    def log_path(self):
        return os.path.join(self.dir, segment_name(self.base) + ".log")

    @property
    def index_path(self):
        return os.path.join(self.dir, segment_name(self.base) + ".index")

    @property
    def time_path(self):
        return os.path.join(self.dir, segment_name(self.base) + ".timeindex")

    def read_index(self):
        """The raw (index, timeindex) file contents; None for a missing file."""
        out = []
        for path in (self.index_path, self.time_path):
            try:
                with open(path, "rb") as fh:
                    out.append(fh.read())
            except FileNotFoundError:
                out.append(None)
        return out

    def load_index(self, log_size, files=None):
        """Read the index files (or take `files`, as from read_index); return False if
        missing or inconsistent with the log."""
        raw, traw = files if files is not None else self.read_index()
        entries = parse_index(self.base, raw, traw, log_size)
        if entries is None:
            return False
        self.index_offsets, self.index_positions, self.time_ts, self.time_offsets = entries
        self.last_indexed_pos = self.index_positions[-1]
        return True

    def write_index(self):
        """Replace the index files with the entries in memory."""
        idx, tidx = self.index_bytes()
        write_atomic(self.index_path, idx)
        write_atomic(self.time_path, tidx)
        self.index_ok = True

    def reset_index(self):
        self.index_offsets = array("q")
        self.index_positions = array("q")
        self.time_ts = array("q")
        self.time_offsets = array("q")
        self.last_indexed_pos = -1

    def add_index_entry(self, batch_base, pos, max_ts, interval):
        """Record an index entry for a batch at `pos` if due; return the entry bytes written.

        `max_ts`: the largest timestamp of this batch and of every batch before it.
        """
        if self.last_indexed_pos >= 0 and pos - self.last_indexed_pos < interval:
            return None
        self.index_offsets.append(batch_base)
        self.index_positions.append(pos)
        self.last_indexed_pos = pos
        ts = max_ts if not self.time_ts or max_ts > self.time_ts[-1] else self.time_ts[-1]
        self.time_ts.append(ts)
        self.time_offsets.append(batch_base)
        return entry_bytes(self.base, batch_base, pos, ts)

    def index_bytes(self):
        """The index and time index files as they should be for the entries in memory."""
        return index_bytes(self.base, self.index_offsets, self.index_positions, self.time_ts,
                           self.time_offsets)

    def position_for(self, offset):
        """(position, offset) of the last indexed batch starting at or before `offset`."""
        i = bisect.bisect_right(self.index_offsets, offset) - 1
        if i < 0:
            return 0, self.base
        return self.index_positions[i], self.index_offsets[i]

    def offset_for_time(self, ts):
        """An offset at or before this segment's first record with timestamp >= ts."""
        i = bisect.bisect_left(self.time_ts, ts) - 1
        return self.time_offsets[i] if i >= 0 else self.base

    def next_index_position_after(self, pos):
        i = bisect.bisect_right(self.index_positions, pos)
        return self.index_positions[i] if i < len(self.index_positions) else None


def list_segments(directory):
    """The base offsets of the segments in `directory`, in order."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for m in map(SEGMENT_FILE.match, names) if m)

