"""The commit log's format and its segmented log: round trips, CRCs, Arrow, offsets, time, retention.

Real files in temporary directories; no mocks.
"""

import os
import random
import struct

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from log_helpers import T0, Built, batch_crc_algo, encode, make_records
from wrenmq.mqtt.topics import topic_matches
from wrenmq.store.arrow import SCHEMA, batch_to_arrow, read_arrow, records_to_arrow
from wrenmq.store.format import HEADER, BadRecord, Batch, CorruptBatch, Record, read_prefix
from wrenmq.store.log import CommitLog
from wrenmq.store.reader import LogReader

# --- the batch format ----------------------------------------------------------------------

_text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
_record = st.tuples(
    st.integers(0, 4 * 10**15),  # timestamp (microseconds: up to the year 2096)
    st.integers(0, 2),  # qos
    st.booleans(),  # retain
    _text.filter(bool),  # topic
    _text,  # client id
    st.binary(max_size=24),  # properties (raw)
    st.binary(max_size=200),  # payload
    st.integers(0, 65535),  # packet id
)


def _records(base, rows):
    return [Record(base + i, ts, q, r, t, c, p, y, pid) for i, (ts, q, r, t, c, p, y, pid) in enumerate(rows)]


def _table(batches):
    return pa.Table.from_batches(list(batches), schema=SCHEMA)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(base=st.integers(0, 2**40), rows=st.lists(_record, min_size=1, max_size=20))
def test_batch_round_trip_and_arrow_equal_per_record(base, rows):
    recs = _records(base, rows)
    data = encode(recs)
    assert len(data) % 8 == 0
    assert read_prefix(data) == len(data)
    magic, length, _, hbase, count, first_ts, max_ts, attrs, _ = HEADER.unpack_from(data)
    assert (magic, length + 8, hbase, count) == (b"WRN2", len(data), base, len(recs))
    assert first_ts == recs[0].timestamp and max_ts == max(r.timestamp for r in recs) and attrs == 0
    b = Batch(data)
    assert (b.base, b.count, b.next_offset, b.size) == (base, len(recs), base + len(recs), len(data))
    assert b.data_size() == len(data)
    assert list(b.records()) == recs
    if all(r.timestamp >= recs[0].timestamp - 1_000_000 for r in recs):
        # (Salvage also wants the timestamps of one batch close together, as a group commit's are.)
        assert list(b.records(check_records=True)) == recs
    assert b.topics() == [r.topic for r in recs]
    # Arrow over the batch bytes equals the per-record path, every column, exactly.
    fast = batch_to_arrow(b)
    slow = records_to_arrow(recs)
    assert fast.schema == slow.schema == SCHEMA
    assert fast.equals(slow)
    assert fast.to_pydict() == slow.to_pydict()
    assert fast.column("payload").to_pylist() == [r.payload for r in recs]
    assert fast.column("properties").to_pylist() == [r.properties for r in recs]
    # ... also for a batch in the middle of a larger buffer (how the reader holds them).
    shifted = Batch(b"\0" * 64 + data + b"\0" * 8, 64)
    assert list(shifted.records()) == recs
    assert batch_to_arrow(shifted).equals(slow)


def test_empty_payloads_and_properties_round_trip():
    recs = [Record(7 + i, T0 + i, i % 3, bool(i % 2), f"t/{i}", "" if i % 2 else "c", b"", b"", 0)
            for i in range(9)]
    b = Batch(encode(recs))
    assert list(b.records()) == recs
    rb = batch_to_arrow(b)
    assert rb.equals(records_to_arrow(recs))
    assert rb.column("payload").to_pylist() == [b""] * 9
    assert rb.column("client_id").to_pylist() == ["c", "", "c", "", "c", "", "c", "", "c"]


def test_record_crc_covers_each_record_and_is_checked():
    rng = random.Random(3)
    recs = [Record(100 + i, T0 + i, 1, False, f"t/{i}", f"c{i}", b"\x01\x00\x00\x00\x07" if i % 2 else b"",
                   rng.randbytes(50), 0) for i in range(6)]
    data = bytearray(encode(recs))
    crc = batch_crc_algo(data)
    b = Batch(bytes(data))
    crcs = b._array("crc", "I")
    for i, r in enumerate(recs):
        assert crcs[i] == crc(r.topic.encode() + r.client_id.encode() + r.properties + r.payload)
    # One flipped payload byte: the batch CRC fails, only that record fails its own.
    s, _ = b.columns()["payload"]
    data[s + 3 * 50 + 10] ^= 0x40
    with pytest.raises(CorruptBatch):
        Batch(bytes(data))
    out = list(Batch(bytes(data), verify=False).records(check_records=True))
    assert [type(r) for r in out] == [Record] * 3 + [BadRecord] + [Record] * 2
    assert out[3].offset == 103
    assert [r for r in out if isinstance(r, Record)] == recs[:3] + recs[4:]


@pytest.mark.parametrize("field", ["timestamp", "flags-qos3", "flags-bit7", "first_ts"])
def test_salvage_refuses_records_whose_uncovered_fields_look_damaged(field):
    """Timestamps and flags are outside the record CRC; in a damaged batch they must look sound."""
    recs = [Record(i, T0 + i, 1, False, "t", "c", b"", b"p%d" % i, 0) for i in range(5)]
    data = bytearray(encode(recs))
    cols = Batch(bytes(data)).columns()
    if field == "timestamp":
        data[cols["timestamps"][0] + 8 * 2 + 6] ^= 0x10  # record 2: far in the future
        bad = 2
    elif field == "flags-qos3":
        data[cols["flags"][0] + 1] |= 3
        bad = 1
    elif field == "flags-bit7":
        data[cols["flags"][0] + 4] |= 0x80
        bad = 4
    else:
        struct.pack_into("<q", data, 24, T0 - 5)
        bad = 0
    out = list(Batch(bytes(data), verify=False).records(check_records=True))
    assert [i for i, r in enumerate(out) if isinstance(r, BadRecord)] == [bad]


def test_batch_sizes_are_multiples_of_8():
    for n in range(1, 40):
        recs = [Record(i, T0, 0, False, "t" * (i % 5 + 1), "c" * (i % 3), b"", b"x" * (i * 7 % 13), 0)
                for i in range(n)]
        data = encode(recs)
        assert len(data) % 8 == 0 and read_prefix(data) == len(data)


def test_header_damage_is_detected():
    data = encode([Record(0, T0, 0, False, "t", "c", b"", b"payload", 0)])
    assert read_prefix(b"XRN1" + data[4:]) is None
    assert read_prefix(data[:4] + struct.pack("<I", 41) + data[8:]) is None  # not a multiple of 8
    with pytest.raises(CorruptBatch):
        Batch(data[:-8])  # runs past the end of the data
    with pytest.raises(CorruptBatch):
        Batch(data[:12] + struct.pack("<q", 1) + data[20:])  # base changed: CRC


# --- the log -----------------------------------------------------------------------------------


@pytest.fixture
def built(tmp_path):
    b = Built(tmp_path / "p", segment_bytes=8192, index_interval=512, seed=11)
    # Timestamps mostly rise; twice the clock steps back (by 5 s) to keep offset_for_time honest.
    b.fill(60)
    b.append(ts=b.ts - 5_000_000)
    b.fill(60)
    b.append(ts=b.ts - 5_000_000)
    b.fill(30)
    yield b
    b.close()


def test_append_across_segments_and_read_ranges(built):
    log = built.log
    expected = built.records
    n = len(expected)
    assert len(log.segments) >= 5, "small segment_bytes must roll several segments"
    assert built.segment_bases() == [s.base for s in log.segments]
    for s in log.segments:
        assert os.path.getsize(s.log_path) <= 8192 and os.path.getsize(s.log_path) == s.size
    reader = LogReader(built.dir)
    for src in (log, reader):
        assert list(src.records()) == expected
        assert (src.start_offset, src.end_offset) == (0, n)
        rng = random.Random(5)
        for _ in range(60):
            a = rng.randint(0, n)
            e = rng.choice([None, rng.randint(a, n + 3)])
            assert list(src.records(a, e)) == expected[a:e], (a, e)
        # Batch boundaries and segment boundaries exactly.
        for seg in src.segments:
            assert list(src.records(seg.base, seg.base + 1)) == expected[seg.base:seg.base + 1]
            assert list(src.records(seg.base - 1, seg.base + 1)) == expected[max(0, seg.base - 1):seg.base + 1]
        assert list(src.records(n, None)) == []
        assert list(src.records(n + 10, None)) == []
        assert src.corrupt_records == 0
    assert reader.verify() == []


def test_topic_filters_on_records(built):
    reader = LogReader(built.dir)
    for filters in (["a/#"], ["+/b", "x"], ["sensors/+/temp"], ["#"], ["nothing/here"]):
        got = list(reader.records(topic_filters=filters))
        assert got == [r for r in built.records if any(topic_matches(f, r.topic) for f in filters)]


def test_offset_for_time_is_exact(built):
    expected = built.records
    reader = LogReader(built.dir)

    def first_at_or_after(t):
        return next((r.offset for r in expected if r.timestamp >= t), len(expected))

    times = [r.timestamp for r in expected]
    rng = random.Random(9)
    probes = {min(times) - 1, min(times), max(times), max(times) + 1, 0}
    probes |= {t + d for t in rng.sample(times, 80) for d in (-1, 0, 1)}
    probes |= {rng.randint(min(times), max(times)) for _ in range(80)}
    for src in (built.log, reader):
        for t in sorted(probes):
            assert src.offset_for_time(t) == first_at_or_after(t), t


def test_stats(built):
    expected = built.records
    for src in (built.log, LogReader(built.dir)):
        st = src.stats()
        assert st["segments"] == len(built.segment_bases())
        assert (st["start_offset"], st["end_offset"], st["records"]) == (0, len(expected), len(expected))
        assert st["bytes"] == sum(p.stat().st_size for p in built.dir.glob("*.log"))
        assert st["first_timestamp_us"] == expected[0].timestamp
        assert st["last_timestamp_us"] == max(r.timestamp for r in expected)


def test_reopen_continues_offsets_and_indexes_match_a_rebuild(built):
    n = len(built.records)
    built.close()
    index_files = {p.name: p.read_bytes() for p in built.dir.iterdir() if p.suffix in (".index", ".timeindex")}
    built.log = built.open()
    assert built.log.end_offset == n and built.log.truncated_bytes == 0
    # What append wrote is exactly what recovery would rebuild.
    assert {p.name: p.read_bytes() for p in built.dir.iterdir() if p.suffix in (".index", ".timeindex")} \
        == index_files
    recs = built.append(5)
    assert recs[0].offset == n
    with pytest.raises(ValueError):
        built.log.append(encode(recs), n, 5, T0, T0)  # not at the log end
    assert list(built.log.records()) == built.records
    built.close()
    built.log = built.open()
    assert built.log.end_offset == n + 5
    assert list(LogReader(built.dir).records(n)) == recs


def test_reader_follows_a_writer(tmp_path):
    b = Built(tmp_path / "p", segment_bytes=4096, index_interval=256, seed=2)
    reader = LogReader(b.dir)
    assert list(reader.records()) == [] and reader.end_offset == 0
    for round_ in range(6):
        b.fill(8)
        reader.refresh()
        assert reader.end_offset == len(b.records)
        assert list(reader.records()) == b.records
    assert len(reader.segments) > 2
    b.close()


def test_durable_end_follows_the_writers_syncs(tmp_path):
    # A writer with durable marks says how far its log is on disk; a reader's durable end
    # stops there, and where it cannot read the mark, at the log's start.
    rng = random.Random(7)
    log = CommitLog(tmp_path / "p", durable_marks=True)
    reader = LogReader(tmp_path / "p")
    assert reader.durable_end_offset == 0
    recs = make_records(rng, 0, 10, T0)
    log.append(encode(recs), 0, 10, recs[0].timestamp, max(r.timestamp for r in recs))
    reader.refresh()
    assert (reader.end_offset, reader.durable_end_offset) == (10, 0)
    log.sync()
    reader.refresh()
    assert reader.durable_end_offset == 10
    mark = tmp_path / "p" / "durable"
    good = mark.read_bytes()
    mark.write_bytes(good[:8] + b"\0\0\0\0")  # torn
    reader.refresh()
    assert reader.durable_end_offset == 0
    mark.write_bytes(good)
    log.close()
    # Reopened: new records are durable once synced (close syncs).
    log = CommitLog(tmp_path / "p", durable_marks=True)
    more = make_records(rng, 10, 5, T0 + 10)
    log.append(encode(more), 10, 5, more[0].timestamp, max(r.timestamp for r in more))
    reader.refresh()
    assert (reader.end_offset, reader.durable_end_offset) == (15, 10)
    log.close()
    log = CommitLog(tmp_path / "p", durable_marks=True)
    reader.refresh()
    assert reader.durable_end_offset == 15
    log.close()
    # Without marks (fsync = "never") the file goes: a stale one would hold readers back.
    CommitLog(tmp_path / "p").close()
    reader.refresh()
    assert not mark.exists() and reader.durable_mark is None and reader.durable_end_offset == 15
    reader.close()


def test_empty_log(tmp_path):
    log = CommitLog(tmp_path / "p")
    assert (log.start_offset, log.end_offset) == (0, 0)
    assert list(log.records()) == [] and log.offset_for_time(0) == 0
    assert log.stats()["records"] == 0 and log.stats()["first_timestamp_us"] is None
    assert log.verify() == []
    log.close()
    assert LogReader(tmp_path / "nothing").stats()["segments"] == 0


# --- Arrow ---------------------------------------------------------------------------------


def test_read_arrow_equals_records(built):
    reader = LogReader(built.dir)
    n = len(built.records)
    rng = random.Random(4)
    cases = [(0, None, None), (0, n, ["a/#"]), (n, None, None)]
    cases += [(rng.randint(0, n), None, None) for _ in range(10)]
    cases += [(a, rng.randint(a, n), rng.choice([None, ["x/#"], ["+/b", "sensors/+/temp"]]))
              for a in (rng.randint(0, n) for _ in range(20))]
    for a, e, f in cases:
        fast = _table(read_arrow(reader, a, e, f))
        slow = _table([records_to_arrow(list(reader.records(a, e, f)))])
        assert fast.equals(slow), (a, e, f)
        # Filter pushdown equals filtering afterwards.
        if f:
            everything = _table(read_arrow(reader, a, e)).to_pylist()
            assert fast.to_pylist() == [row for row in everything
                                        if any(topic_matches(x, row["topic"]) for x in f)]
    for limit in (0, 1, 7, n, n + 5):
        got = _table(read_arrow(reader, 3, None, None, max_rows=limit))
        assert got.column("offset").to_pylist() == list(range(3, min(n, 3 + limit)))


# --- retention ---------------------------------------------------------------------------------


def _sizes(log):
    return [s.size for s in log.segments]


def test_retention_by_bytes_deletes_whole_oldest_segments(built):
    log = built.log
    before = list(log.segments)
    sizes = _sizes(log)
    limit = sum(sizes) // 2
    deleted, lost = log.enforce_retention(retention_bytes=limit)
    assert lost == 0 and deleted >= 1
    assert log.segments == before[deleted:]
    assert sum(_sizes(log)) <= limit < sum(sizes[deleted - 1:])  # not one segment more than needed
    for s in before[:deleted]:
        assert not os.path.exists(s.log_path) and not os.path.exists(s.index_path)
    reader = LogReader(built.dir)
    start = log.segments[0].base
    assert reader.start_offset == start
    assert list(reader.records()) == built.records[start:]
    assert list(reader.records(0, start + 3)) == built.records[start:start + 3]
    assert reader.corrupt_records == 0  # retention is not corruption
    assert reader.verify() == []
    # Never the active segment, however small the limit.
    log.enforce_retention(retention_bytes=1)
    assert log.segments == before[-1:]
    assert list(log.records()) == built.records[before[-1].base:]


def test_retention_by_age(built):
    log = built.log
    segs = list(log.segments)
    cutoff = segs[2].max_ts + 1  # segments 0..2 are entirely older than this
    assert segs[3].max_ts >= cutoff
    deleted, lost = log.enforce_retention(retention_hours=1.0, now_us=cutoff + 3600 * 10**6)
    assert (deleted, lost) == (3, 0)
    assert log.segments == segs[3:]
    # Everything old, but the active segment stays.
    assert log.enforce_retention(retention_hours=1.0, now_us=10**18)[0] == len(segs) - 4
    assert log.segments == segs[-1:]


def test_retention_keeps_segments_still_needed_unless_hard_limit(built):
    log = built.log
    segs = list(log.segments)
    protect = segs[3].base + 1  # a session still needs offsets from inside segment 3
    assert log.enforce_retention(retention_bytes=1, protect_from=protect) == (3, 0)
    assert log.segments == segs[3:]
    assert log.enforce_retention(retention_bytes=1, protect_from=protect) == (0, 0)
    # Over the hard limit the needed segments go too, and the loss is counted exactly.
    total = sum(_sizes(log))
    hard = total - segs[3].size - segs[4].size + 1
    deleted, lost = log.enforce_retention(retention_bytes=1, protect_from=protect, hard_bytes=hard)
    assert deleted == 2
    assert lost == (segs[3].next_offset - protect) + (segs[4].next_offset - segs[4].base)
    assert log.segments == segs[5:]
    assert sum(_sizes(log)) <= hard


def test_hard_limit_alone_is_a_size_limit(built):
    log = built.log
    segs = list(log.segments)
    hard = sum(_sizes(log)) - segs[0].size - 1
    deleted, lost = log.enforce_retention(protect_from=0, hard_bytes=hard)
    assert deleted == 2 and lost == segs[2].base
    assert log.enforce_retention(protect_from=0, hard_bytes=10**12) == (0, 0)


def _o_direct_works(directory):
    """Whether this filesystem takes O_DIRECT opens (tmpfs does not)."""
    path = os.path.join(directory, "probe")
    open(path, "wb").close()
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(path)


def test_direct_io_writes_the_same_files_as_buffered(tmp_path):
    """[log] direct_io writes the whole blocks of an append with O_DIRECT and the partial
    last block through the page cache. Appends of every size (inside one block, across
    blocks, many blocks, across segment rolls, after a reopen that must read the partial
    block back) leave byte-identical files to a buffered log's, readable while written."""
    rng = random.Random(7)
    sizes = [1, 3, 60, 500, 4000, 5000, 9000, 20000, 70000] * 4
    rng.shuffle(sizes)
    logs = {name: CommitLog(tmp_path / name, segment_bytes=256 << 10, direct_io=(name == "direct"))
            for name in ("direct", "buffered")}
    direct_ok = _o_direct_works(str(tmp_path))
    assert logs["direct"].direct_io == direct_ok  # used where the filesystem allows it
    assert (logs["direct"]._dfd is not None) == direct_ok
    offset = 0
    written = []
    for round_ in range(2):
        for size in sizes:
            recs = make_records(rng, offset, rng.randint(1, 4), T0 + offset)
            for r in recs:
                r.payload = rng.randbytes(size)
            data = encode(recs)
            for log in logs.values():
                log.append(data, offset, len(recs), recs[0].timestamp, recs[-1].timestamp)
            offset += len(recs)
            written.extend(recs)
        reader = LogReader(tmp_path / "direct")  # while the writer has the files open
        assert list(reader.records()) == written
        reader.close()
        for name in list(logs):  # reopen: the partial block comes back from the file
            logs[name].close()
            logs[name] = CommitLog(tmp_path / name, segment_bytes=256 << 10,
                                   direct_io=(name == "direct"))
    assert len(logs["direct"].segments) > 3
    for a, b in zip(logs["direct"].segments, logs["buffered"].segments, strict=True):
        for path_a, path_b in ((a.log_path, b.log_path), (a.index_path, b.index_path),
                               (a.time_path, b.time_path)):
            with open(path_a, "rb") as fa, open(path_b, "rb") as fb:
                assert fa.read() == fb.read(), path_a
    for log in logs.values():
        assert list(log.records()) == written and log.verify() == []
        log.close()


def test_active_segment_is_allocated_ahead_and_gives_it_back_when_sealed_or_closed(tmp_path):
    """The log allocates its active segment's next blocks ahead of the writes
    (fallocate, keeping the size): readers see only what was written, and a sealed or
    closed segment holds no blocks past its end."""
    from wrenmq.store import log as logmod

    seg_bytes = 64 << 20
    built = Built(tmp_path / "p", segment_bytes=seg_bytes)
    assert built.log.preallocate, "this filesystem should allow fallocate"

    def allocated(base):
        return os.stat(built.seg_path(base)).st_blocks * 512

    built.fill(20)
    first = built.segment_bases()[0]
    size = built.log.segments[-1].size
    assert os.path.getsize(built.seg_path(first)) == size
    assert allocated(first) >= logmod._RESERVE_AHEAD > size
    assert [r.offset for r in LogReader(built.dir).records()] == [r.offset for r in built.records]
    built.close()
    assert allocated(first) < size + 8192
    # Reopened, it allocates ahead again; rolled to a new segment, the old one gives it back.
    built.log = built.open()
    built.append()
    assert allocated(first) >= built.log.segments[-1].size + logmod._RESERVE_AHEAD
    built.log.segment_bytes = built.log.segments[-1].size + 1  # (the next batch rolls)
    built.append()
    assert len(built.segment_bases()) == 2
    assert allocated(first) < os.path.getsize(built.seg_path(first)) + 8192
    built.close()
    assert [r.offset for r in LogReader(built.dir).records()] == [r.offset for r in built.records]


def test_store_tells_damaged_records_from_a_read_to_try_again(tmp_path):
    """A read over records the log cannot serve comes back without them (its reader logs
    them), and the store then says where the damaged stretch ends, so readers that follow
    the log (bridges, catch-up, cluster replay) pass over exactly that stretch; of records
    not known to be damaged it says nothing, so an empty read there is tried again, never
    taken as a stretch to skip."""
    from wrenmq.config import load
    from wrenmq.store.store import Store

    directory = tmp_path / "data" / "log" / "n1"
    log = CommitLog(directory, segment_bytes=4096)
    records = []
    for base in range(0, 200, 20):  # several segments: the damage is not the active one's tail
        batch = [Record(base + i, T0 + base + i, 1, False, "s/1", "dev", b"", b"p%d" % (base + i), 0)
                 for i in range(20)]
        log.append(encode(batch), base, 20, batch[0].timestamp, batch[-1].timestamp)
        records.extend(batch)
    log.close()
    assert len(log.segments) >= 3
    first = log.segments[0]
    with open(first.log_path, "r+b") as fh:  # the segment's first batch: offsets 0..19
        size = read_prefix(fh.read(64))
        fh.seek(0)
        fh.write(b"\xff" * size)

    cfg = load(text=f'[broker]\nnode_id = "n1"\n[storage]\ndata_dir = "{tmp_path / "data"}"\n')
    st = Store(cfg)
    try:
        assert st.next_offset == 200
        assert st.unreadable_end(5) is None  # (nothing read yet: not known)
        assert st.read(0, 10) == []
        assert st.unreadable_end(0) == 10 and st.unreadable_end(9) == 10  # as far as that read went
        assert st.read(10, 500)[0].offset == 20
        assert st.unreadable_end(15) == 20
        assert st.unreadable_end(20) is None and st.unreadable_end(199) is None
        assert [r.payload for r in st.read(20, 500)] == [r.payload for r in records[20:]]
    finally:
        st.close()
