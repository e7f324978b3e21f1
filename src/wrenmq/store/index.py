"""The sparse index files of a segment: their entries, how they are read, written and checked.

    <base>.index      (u32 offset - base, u32 position) per ~index_interval bytes of log
    <base>.timeindex  (i64 max timestamp so far, u32 offset - base, u32 0), one per index entry

The time index entry of a batch holds the largest timestamp of that batch and of every
batch before it in the segment, so "the first record with timestamp >= t" is found
exactly even when clocks step back. Both files are only a shortcut: a missing, stale or
half-written index is rebuilt from the log, never trusted over it (`parse_index` refuses
one that does not fit the log, `check_index` says what is wrong with one).

In memory a segment (segment.Segment) keeps the entries as four arrays: offsets and
positions, timestamps and their offsets.
"""

import struct
from array import array

INDEX_ENTRY = struct.Struct("<II")
TIME_ENTRY = struct.Struct("<qII")


def parse_index(base, raw, traw, log_size):
    """The entries of a segment's (index, time index) file contents as arrays (offsets,
    positions, timestamps, time offsets), or None if a file is missing (None), empty,
    half-written or inconsistent with itself, the other file or a log of `log_size` bytes."""
    if not raw or traw is None or len(raw) % INDEX_ENTRY.size or len(traw) % TIME_ENTRY.size:
        return None
    if len(traw) // TIME_ENTRY.size != len(raw) // INDEX_ENTRY.size:
        return None
    offs = array("q")
    poss = array("q")
    for rel, pos in INDEX_ENTRY.iter_unpack(raw):
        if poss and (pos <= poss[-1] or base + rel <= offs[-1]):
            return None
        if pos >= log_size or pos % 8:
            return None
        offs.append(base + rel)
        poss.append(pos)
    if poss[0] != 0 or offs[0] != base:
        return None
    tts = array("q")
    toffs = array("q")
    for i, (ts, rel, _) in enumerate(TIME_ENTRY.iter_unpack(traw)):
        if (tts and ts < tts[-1]) or base + rel != offs[i]:
            return None
        tts.append(ts)
        toffs.append(base + rel)
    return offs, poss, tts, toffs


def entry_bytes(base, offset, pos, ts):
    """One entry of each file (index, time index) for the batch of `offset` at `pos`."""
    return INDEX_ENTRY.pack(offset - base, pos), TIME_ENTRY.pack(ts, offset - base, 0)


def index_bytes(base, offsets, positions, time_ts, time_offsets):
    """The whole (index, time index) files for these entries."""
    idx = b"".join(INDEX_ENTRY.pack(o - base, p) for o, p in zip(offsets, positions))
    tidx = b"".join(TIME_ENTRY.pack(t, o - base, 0) for t, o in zip(time_ts, time_offsets))
    return idx, tidx


def entries_behind(want, have):
    """How many entries the files `have` (index, time index) lack at their end when they
    should be `want`, if that is all that is wrong with them; else None. Entries are
    written behind the log, so a writer that died leaves the last ones out."""
    if None in have or len(have[0]) % INDEX_ENTRY.size:
        return None
    if len(have[1]) != len(have[0]) // INDEX_ENTRY.size * TIME_ENTRY.size:
        return None
    if not (want[0].startswith(have[0]) and want[1].startswith(have[1])):
        return None
    return (len(want[0]) - len(have[0])) // INDEX_ENTRY.size


def check_index(seg, idx, tidx, starts, size, last):
    """What is wrong with segment `seg`'s index files (contents `idx`, `tidx`; None if
    missing), one line each, given `starts` ({position: base offset} of its batches) and
    its log's `size`. `last`: the segment written to now, whose entries may lag."""
    problems = []
    base = seg.base
    n = None
    if idx is None:
        problems.append(f"{seg.index_path}: missing (rebuilt when the broker next starts)")
    else:
        if len(idx) % INDEX_ENTRY.size:
            problems.append(f"{seg.index_path}: {len(idx)} bytes, not a whole number of "
                            f"{INDEX_ENTRY.size}-byte entries (half-written)")
        entries = list(INDEX_ENTRY.iter_unpack(idx[:len(idx) - len(idx) % INDEX_ENTRY.size]))
        n = len(entries)
        if not entries and starts and not last:
            # (The last segment's entries are written behind it: it may be written to now.)
            problems.append(f"{seg.index_path}: empty although the log holds batches")
        bad = []
        prev_pos = -1
        for k, (rel, pos) in enumerate(entries):
            if pos >= size:
                bad.append(f"entry {k} (offset {base + rel}) points at position {pos}, past the end of the "
                           f"log ({size} bytes)")
            elif starts.get(pos) != base + rel:
                bad.append(f"entry {k} (offset {base + rel}) points at position {pos}, which is not the "
                           f"start of the batch holding that offset")
            elif pos <= prev_pos:
                bad.append(f"entry {k} is out of order")
            prev_pos = max(prev_pos, pos)
        if bad:
            more = f" (and {len(bad) - 1} more bad entries)" if len(bad) > 1 else ""
            problems.append(f"{seg.index_path}: stale or damaged: {bad[0]}{more}")
    if tidx is None:
        problems.append(f"{seg.time_path}: missing (rebuilt when the broker next starts)")
    else:
        if len(tidx) % TIME_ENTRY.size:
            problems.append(f"{seg.time_path}: {len(tidx)} bytes, not a whole number of "
                            f"{TIME_ENTRY.size}-byte entries (half-written)")
        tentries = list(TIME_ENTRY.iter_unpack(tidx[:len(tidx) - len(tidx) % TIME_ENTRY.size]))
        if n is not None and len(tentries) != n:
            problems.append(f"{seg.time_path}: {len(tentries)} entries, but the offset index has {n}")
        elif n is not None:
            off = [base + rel for rel, _ in INDEX_ENTRY.iter_unpack(idx[:8 * n])]
            wrong = [k for k, (_, rel, _) in enumerate(tentries) if base + rel != off[k]]
            if wrong:
                problems.append(f"{seg.time_path}: entry {wrong[0]} names offset "
                                f"{base + tentries[wrong[0]][1]}, the offset index {off[wrong[0]]}")
        dec = [k for k in range(1, len(tentries)) if tentries[k][0] < tentries[k - 1][0]]
        if dec:
            problems.append(f"{seg.time_path}: timestamps decrease at entry {dec[0]}")
    return problems
