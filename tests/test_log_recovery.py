"""Corruption and recovery of the commit log: torn tails, flipped bytes, bad and missing indexes.

Every test damages real segment files the way disks and crashes do, then checks
that the writer recovers (truncating only a real tail, rebuilding indexes) and
that readers skip exactly the damaged records, count them and never serve them.
"""

import logging
import re
import struct
import subprocess
import time

import pyarrow as pa
import pytest

from conftest import WRENMQ, get_messages, paho_client, subscribe
from log_helpers import Built, as_v1, crc32_checksums, rewrite_as_v1
from wrenmq.store.arrow import SCHEMA, read_arrow
from wrenmq.store.format import BadRecord, Batch, CorruptBatch
from wrenmq.store.log import CommitLog
from wrenmq.store.reader import LogReader


@pytest.fixture
def built(tmp_path):
    b = Built(tmp_path / "p", segment_bytes=8192, index_interval=1024, seed=7)
    b.fill(90)
    b.close()
    return b


def _flip(path, pos, mask=0x5A):
    with open(path, "r+b") as fh:
        fh.seek(pos)
        byte = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([byte ^ mask]))


def _payload_pos(path, batch_pos, index):
    """File position of the first payload byte of record `index` of the batch at `batch_pos`."""
    data = path.read_bytes()
    b = Batch(data, batch_pos)
    start = b.columns()["payload"][0]
    off = b._array("payload_off", "I")
    assert off[index + 1] > off[index], "pick a record with a payload"
    return start + off[index]


def _warnings(caplog):
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def _files(directory, *suffixes):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix in suffixes}


def _sealed_middle_batch(built):
    """(segment base, batch) of a batch in the middle of a sealed segment, not indexed."""
    bases = built.segment_bases()
    seg = bases[1]
    reader = LogReader(built.dir)
    indexed = set(next(s for s in reader.segments if s.base == seg).index_positions)
    inside = [b for b in built.batches_in(seg)[1:-1] if b[1] not in indexed]
    return seg, inside[len(inside) // 2]


# --- torn and garbage tails ------------------------------------------------------------------


@pytest.mark.parametrize("cut", ["middle", "header", "one-byte"])
def test_truncated_last_segment_is_cut_back_to_the_last_whole_batch(built, caplog, cut):
    seg, pos, base, count, size = built.batches[-1]
    path = built.seg_path(seg)
    keep = {"middle": size // 2, "header": 20, "one-byte": 1}[cut]
    with open(path, "r+b") as fh:
        fh.truncate(pos + keep)
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        log = CommitLog(built.dir, 8192, 1024)
    assert f"truncating {keep} bytes of torn or corrupt data at position {pos}" in _warnings(caplog)
    assert log.truncated_bytes == keep
    assert path.stat().st_size == pos
    assert log.end_offset == base
    assert list(log.records()) == built.records[:base]
    # Offsets continue from there.
    built.log = log
    built.records = built.records[:base]
    new = built.append(4)
    assert new[0].offset == base
    log.close()
    reader = LogReader(built.dir)
    assert list(reader.records()) == built.records
    assert reader.verify() == [] and reader.corrupt_records == 0


@pytest.mark.parametrize("junk", ["garbage", "zeros", "stale-batch", "crc-failed-last-batch"])
def test_junk_after_the_last_batch_is_truncated(built, caplog, junk):
    seg, pos, base, count, size = built.batches[-1]
    path = built.seg_path(seg)
    data = path.read_bytes()
    before = len(data)
    if junk == "crc-failed-last-batch":
        _flip(path, _payload_pos(path, pos, count - 1) if any(r.payload for r in built.records[base:])
              else pos + 60)
        added, cut_at = size, pos
    else:
        extra = {"garbage": bytes(range(256)) * 3 + b"WRN1",
                 "zeros": bytes(4096),
                 "stale-batch": data[:built.batches_in(seg)[0][4]]}[junk]  # an intact old batch
        with open(path, "ab") as fh:
            fh.write(extra)
        added, cut_at = len(extra), before
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        log = CommitLog(built.dir, 8192, 1024)
    assert re.search(rf"truncating {added} bytes .* at position {cut_at}\b", _warnings(caplog))
    assert path.stat().st_size == cut_at
    kept = built.records if cut_at == before else built.records[:base]
    assert list(log.records()) == kept and log.end_offset == len(kept)
    log.close()
    assert LogReader(built.dir).verify() == []


def test_whole_active_segment_of_garbage(built, caplog):
    last = built.segment_bases()[-1]
    path = built.seg_path(last)
    size = path.stat().st_size
    path.write_bytes(b"\xff" * size)
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        log = CommitLog(built.dir, 8192, 1024)
    assert f"truncating {size} bytes" in _warnings(caplog)
    assert log.end_offset == last and path.stat().st_size == 0
    assert list(log.records()) == built.records[:last]
    log.close()


# --- flipped bytes inside the log -------------------------------------------------------------


def _check_skips_exactly(built, reader, bad_offsets, caplog):
    expected = [r for r in built.records if r.offset not in bad_offsets]
    with caplog.at_level(logging.ERROR, "wrenmq.store"):
        got = list(reader.records())
    assert got == expected, "served records must be exactly the undamaged ones"
    assert reader.corrupt_records == len(bad_offsets)
    # Counted once, however often the damage is read over.
    assert list(reader.records(min(bad_offsets) - 1)) == [r for r in expected if r.offset >= min(bad_offsets) - 1]
    assert reader.corrupt_records == len(bad_offsets)
    # Arrow readers skip the same records.
    table = pa.Table.from_batches(list(read_arrow(reader)), schema=SCHEMA)
    assert table.column("offset").to_pylist() == [r.offset for r in expected]
    assert table.column("payload").to_pylist() == [r.payload for r in expected]
    return _warnings(caplog)


def test_flipped_payload_byte_in_a_sealed_segment(built, caplog):
    seg, (_, pos, base, count, size) = _sealed_middle_batch(built)
    path = built.seg_path(seg)
    k = next(i for i in range(count) if built.records[base + i].payload)
    _flip(path, _payload_pos(path, pos, k))
    bad = {base + k}
    logged = _check_skips_exactly(built, LogReader(built.dir), bad, caplog)
    assert f"{path}: batch at position {pos}" in logged and f"offsets {base + k}" in logged
    problems = LogReader(built.dir).verify()
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}: batch at position {pos} (offsets {base}-{base + count - 1}):")
    assert problems[0].endswith(f"damaged records: offsets {base + k}")
    # The writer does not touch a sealed segment's data.
    log = CommitLog(built.dir, 8192, 1024)
    assert log.truncated_bytes == 0 and log.end_offset == len(built.records)
    log.close()


def test_flipped_bytes_in_the_active_segment_before_intact_batches_are_kept(tmp_path, caplog):
    """A damaged batch followed by intact ones is not a torn tail: truncating would throw away
    acknowledged records. It is reported, and readers skip the damaged records."""
    built = Built(tmp_path / "p", segment_bytes=1 << 20, index_interval=1024, seed=8)
    built.fill(40)
    built.close()
    last = built.segment_bases()[-1]
    batches = built.batches_in(last)
    assert len(batches) >= 4
    _, pos, base, count, size = batches[len(batches) // 2]
    path = built.seg_path(last)
    k = next(i for i in range(count) if built.records[base + i].payload)
    _flip(path, _payload_pos(path, pos, k))
    size_before = path.stat().st_size
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        log = CommitLog(built.dir, 1 << 20, 1024)
    assert path.stat().st_size == size_before and log.truncated_bytes == 0
    assert f"batch at position {pos}" in _warnings(caplog) and "truncating" not in _warnings(caplog)
    assert log.end_offset == len(built.records)
    built.log = log
    built.append(3)
    log.close()
    caplog.clear()
    _check_skips_exactly(built, LogReader(built.dir), {base + k}, caplog)


@pytest.mark.parametrize("how", ["not-a-multiple-of-8", "past-the-end", "shorter"])
def test_damaged_length_field_is_repaired_from_the_columns(built, caplog, how):
    """Only the length field is wrong: the columns say how long the batch is and its CRC
    checks out over that length, so nothing is lost; verify still names the damage."""
    seg, (_, pos, base, count, size) = _sealed_middle_batch(built)
    path = built.seg_path(seg)
    length = {"not-a-multiple-of-8": size - 8 + 3, "past-the-end": size + 64 * 1024, "shorter": 40}[how]
    with open(path, "r+b") as fh:
        fh.seek(pos + 4)
        fh.write(struct.pack("<I", length))
    reader = LogReader(built.dir)
    with caplog.at_level(logging.ERROR, "wrenmq.store"):
        assert list(reader.records()) == built.records
    assert reader.corrupt_records == 0
    assert f"{path}: batch at position {pos}" in _warnings(caplog) and "length field" in _warnings(caplog)
    table = pa.Table.from_batches(list(read_arrow(reader)), schema=SCHEMA)
    assert table.column("offset").to_pylist() == [r.offset for r in built.records]
    problems = reader.verify()
    assert len(problems) == 1
    assert problems[0].startswith(f"{path}: batch at position {pos} (offsets {base}-{base + count - 1}): "
                                  f"its length field is damaged")


@pytest.mark.parametrize("how", ["bad-magic", "bad-magic-and-length"])
def test_unreadable_batch_header_skips_to_the_next_batch(built, caplog, how):
    seg, (_, pos, base, count, size) = _sealed_middle_batch(built)
    path = built.seg_path(seg)
    with open(path, "r+b") as fh:
        fh.seek(pos)
        fh.write(b"WRN9" + (struct.pack("<I", 12345) if how == "bad-magic-and-length" else b""))
    bad = set(range(base, base + count))
    reader = LogReader(built.dir)
    logged = _check_skips_exactly(built, reader, bad, caplog)
    assert f"{path}: " in logged and f"at position {pos}" in logged
    problems = reader.verify()
    assert len(problems) == 1 and problems[0].startswith(f"{path}: ")
    lost = f"{base}-{base + count - 1}" if count > 1 else f"{base}"
    assert f"at position {pos}" in problems[0] and f"offsets {lost} lost" in problems[0]


def test_torn_batch_in_the_active_segment_is_not_searched_for_batches(tmp_path, caplog):
    """The payload of a batch cut short may hold bytes that look like batches (a client can
    publish anything): recovery must take the whole rest for the torn tail, never a
    "batch" found inside it."""
    built = Built(tmp_path / "p", segment_bytes=1 << 20, index_interval=1024, seed=9)
    built.fill(5)
    seg, pos, base, count, size = built.batches[-1]
    from log_helpers import encode
    from wrenmq.store.format import Record
    forged = encode([Record(base + 1000, built.ts, 1, True, "forged/topic", "spoofed-client", b"", b"evil", 0)])
    # A real batch whose payload carries complete forged batches, 8-byte aligned in the file:
    # with one record, the payload starts 48 + 8 + 4 + 4 * 8 + 2 + 1 + len("t") + len("c") = 97
    # bytes into the batch.
    pad = -97 % 8
    carrier = encode([Record(base + count, built.ts, 0, False, "t", "c", b"", b"\0" * pad + forged * 3, 0)])
    assert carrier.index(forged) == 97 + pad
    built.close()
    path = built.seg_path(seg)
    with open(path, "ab") as fh:
        fh.write(carrier[:len(carrier) - 16])  # cut short: the forged batches are all there
    assert path.read_bytes().count(b"WRN2") > len(built.batches) + 1
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        log = CommitLog(built.dir, 1 << 20, 1024)
    assert f"truncating {len(carrier) - 16} bytes" in _warnings(caplog)
    assert log.end_offset == base + count
    assert all(r.topic != "forged/topic" for r in log.records())
    log.close()


def test_unreadable_stretch_resumes_at_the_next_index_entry(built, caplog):
    """When nothing intact is left before the next index entry, the reader resumes there."""
    seg = built.segment_bases()[1]
    path = built.seg_path(seg)
    reader = LogReader(built.dir)
    s = next(x for x in reader.segments if x.base == seg)
    assert len(s.index_positions) >= 3
    p1, p2 = s.index_positions[1], s.index_positions[2]
    o1, o2 = s.index_offsets[1], s.index_offsets[2]
    with open(path, "r+b") as fh:  # wipe everything from one index entry to the next
        fh.seek(p1)
        fh.write(b"\xee" * (p2 - p1))
    reader = LogReader(built.dir)
    _check_skips_exactly(built, reader, set(range(o1, o2)), caplog)
    assert any(f"{p2 - p1} unreadable bytes at position {p1}" in p for p in reader.verify())


@pytest.mark.parametrize("field", ["base", "count", "timestamp", "flags"])
def test_damage_outside_the_record_crcs_never_serves_wrong_records(built, caplog, field):
    seg, (_, pos, base, count, size) = _sealed_middle_batch(built)
    path = built.seg_path(seg)
    cols = Batch(path.read_bytes(), pos).columns()
    if field == "base":
        _flip(path, pos + 12, 0x01)  # offsets would be wrong: the whole batch is unreadable
        bad = set(range(base, base + count))
    elif field == "count":
        _flip(path, pos + 20, 0x02)
        bad = set(range(base, base + count))
    elif field == "timestamp":
        _flip(path, cols["timestamps"][0] + 8 * (count - 1) + 6, 0x08)
        bad = {base + count - 1}
    else:
        _flip(path, cols["flags"][0], 0x10)  # a bit that is never set
        bad = {base}
    _check_skips_exactly(built, LogReader(built.dir), bad, caplog)
    assert LogReader(built.dir).verify() != []


# --- indexes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["sealed", "active", "all"])
@pytest.mark.parametrize("damage", ["missing", "half-written", "stale", "garbage"])
def test_bad_indexes_are_rebuilt_equal_to_the_original(built, caplog, which, damage):
    original = _files(built.dir, ".index", ".timeindex")
    bases = built.segment_bases()
    targets = {"sealed": bases[1:2], "active": bases[-1:], "all": bases}[which]
    for b in targets:
        for ext, entry in (("index", 8), ("timeindex", 16)):
            p = built.seg_path(b, ext)
            raw = p.read_bytes()
            if damage == "missing":
                p.unlink()
            elif damage == "half-written":
                p.write_bytes(raw[:len(raw) - entry // 2])
            elif damage == "stale":  # entries for batches past the end of the log
                size = built.seg_path(b).stat().st_size
                extra = (struct.pack("<II", 10_000, size + 64) if ext == "index"
                         else struct.pack("<qII", 2**60, 10_000, 0))
                p.write_bytes(raw + extra)
            else:
                p.write_bytes(bytes(len(raw)))
    # Readers cope without them (and without writing anything)...
    reader = LogReader(built.dir)
    assert list(reader.records()) == built.records and reader.corrupt_records == 0
    assert [r.offset for r in reader.records(500, 520)] == list(range(500, 520))
    assert reader.offset_for_time(built.records[300].timestamp) <= 300
    problems = reader.verify()
    assert problems and all(".index" in p or ".timeindex" in p for p in problems)
    # ... and the writer rebuilds them, identical to what appends wrote.
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        log = CommitLog(built.dir, 8192, 1024)
    assert "rebuilding" in _warnings(caplog)
    assert _files(built.dir, ".index", ".timeindex") == original
    assert log.truncated_bytes == 0 and list(log.records()) == built.records
    log.close()
    assert LogReader(built.dir).verify() == []


def test_index_left_stale_by_a_torn_tail(built, caplog):
    """The index names the last batch, but the crash cut that batch short."""
    built.log = CommitLog(built.dir, 8192, 1)  # an index entry for every batch
    built.append(2)
    built.close()
    seg, pos, base, count, size = built.batches[-1]
    with open(built.seg_path(seg), "r+b") as fh:
        fh.truncate(pos + size - 8)
    assert len(built.seg_path(seg, "index").read_bytes()) // 8 >= 2
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        log = CommitLog(built.dir, 8192, 1)
    assert f"truncating {size - 8} bytes" in _warnings(caplog)
    assert log.end_offset == base
    log.close()
    reader = LogReader(built.dir)
    assert reader.verify() == [] and list(reader.records()) == built.records[:base]


def test_orphan_index_and_temp_files_are_removed(built):
    (built.dir / "00000000000099999999.index").write_bytes(b"x" * 8)
    (built.dir / "00000000000099999999.timeindex").write_bytes(b"x" * 16)
    (built.dir / f"{built.segment_bases()[0]:020d}.index.tmp").write_bytes(b"half")
    CommitLog(built.dir, 8192, 1024).close()
    assert not list(built.dir.glob("*99999999*")) and not list(built.dir.glob("*.tmp"))


# --- the broker ------------------------------------------------------------------------------


def test_broker_starts_on_a_torn_tail_and_reports_it(tmp_path, serve_broker):
    data = tmp_path / "data"
    b = serve_broker(args=("--data-dir", str(data)))
    pub = paho_client(b.port, version=5)
    for i in range(5):
        pub.publish("torn/t", b"before-%d" % i, qos=1).wait_for_publish(5)
    pub.disconnect()
    pub.loop_stop()
    assert b.stop() == 0
    (node,) = (data / "log").iterdir()
    seg = sorted(node.glob("*.log"))[-1]
    whole = seg.read_bytes()
    first = Batch(whole)
    with open(seg, "ab") as fh:
        fh.write(whole[:first.size][:first.size // 2])  # half a batch: a write cut short
    torn = first.size // 2

    b2 = serve_broker(args=("--data-dir", str(data)))
    deadline = time.monotonic() + 5
    while f"truncating {torn} bytes" not in b2.log and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"truncating {torn} bytes" in b2.log, b2.log
    sub = paho_client(b2.port, version=5)
    subscribe(sub, "torn/#", 1)
    pub = paho_client(b2.port, version=5)
    pub.publish("torn/t", b"after", qos=1).wait_for_publish(5)
    got = get_messages(sub, 1)
    assert [m.payload for m in got] == [b"after"]
    for c in (sub, pub):
        c.disconnect()
        c.loop_stop()
    assert b2.stop() == 0
    reader = LogReader(node)
    recs = [r.payload for r in reader.records(topic_filters=["torn/#"])]
    assert recs == [b"before-%d" % i for i in range(5)] + [b"after"]
    assert reader.verify() == []


# --- older format versions --------------------------------------------------------------------


def _rewrite(built, batches, convert):
    for seg, pos, base, count, size in batches:
        path = built.seg_path(seg)
        raw = path.read_bytes()
        new = convert(raw[pos:pos + size])
        assert len(new) == size
        path.write_bytes(raw[:pos] + new + raw[pos + size:])


def _magics(built):
    return [built.seg_path(seg).read_bytes()[pos:pos + 4] for seg, pos, *_ in built.batches]


@pytest.mark.parametrize("crc32", [True, False], ids=["WRN1-crc32", "WRN1-crc32c"])
def test_an_older_log_stays_readable_and_takes_new_batches_after_an_upgrade(built, tmp_path, caplog, crc32):
    """Users' disks hold WRN1 logs with CRC-32 checksums and WRN1 logs with CRC-32C ones: both
    must neither read as corrupt (records, Arrow, verify, `wrenmq log verify`) nor be cut off
    as a corrupt tail by the next start; the upgraded writer appends WRN2 batches after them
    and the log reads whole."""
    rewrite_as_v1(built.dir, crc32)
    old = len(built.batches)
    reader = LogReader(built.dir)
    assert list(reader.records()) == built.records and reader.corrupt_records == 0
    assert reader.verify() == []
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        built.log = CommitLog(built.dir, 8192, 1024)
    assert built.log.truncated_bytes == 0 and "truncating" not in _warnings(caplog)
    built.fill(30)  # (past the last WRN1 segment: WRN2 after WRN1 in one segment, then WRN2 only)
    built.close()
    assert _magics(built) == [b"WRN1"] * old + [b"WRN2"] * (len(built.batches) - old)
    assert built.batches[old][0] == built.batches[old - 1][0] and built.batches[-1][0] > built.batches[old][0]
    reader = LogReader(built.dir)
    assert list(reader.records()) == built.records and reader.corrupt_records == 0
    assert reader.verify() == []
    table = pa.Table.from_batches(list(read_arrow(reader)), schema=SCHEMA)
    assert table.column("offset").to_pylist() == [r.offset for r in built.records]
    assert table.column("payload").to_pylist() == [r.payload for r in built.records]
    (tmp_path / "data" / "log").mkdir(parents=True)
    (tmp_path / "data" / "log" / "node").symlink_to(built.dir)
    r = subprocess.run([WRENMQ, "log", "verify", "--data-dir", str(tmp_path / "data")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and f"{len(built.records)} records" in r.stdout, r.stdout + r.stderr
    # Salvage works on old batches too: one damaged record, the others served.
    seg, (_, pos, base, count, size) = _sealed_middle_batch(built)
    assert _magics(built)[built.batches.index((seg, pos, base, count, size))] == b"WRN1"
    path = built.seg_path(seg)
    k = next(i for i in range(count) if built.records[base + i].payload)
    _flip(path, _payload_pos(path, pos, k))
    _check_skips_exactly(built, LogReader(built.dir), {base + k}, caplog)
    # Its header damaged too: readers find the next old batch by its magic and read on there.
    with open(path, "r+b") as fh:
        fh.seek(pos)
        fh.write(b"WRN9")
    _check_skips_exactly(built, LogReader(built.dir), set(range(base, base + count)), caplog)


def test_a_new_batch_with_crc32_checksums_is_corrupt(built, caplog):
    """CRC-32 checksums are accepted in WRN1 batches only: a WRN2 batch whose checksums are
    CRC-32 (damage that happens to fit them, or bytes someone forged) is not read. Its
    records are skipped and reported, `verify` names them, and at the end of the log the
    next start truncates it as a corrupt tail."""
    seg, batch = _sealed_middle_batch(built)
    _, pos, base, count, size = batch
    raw = built.seg_path(seg).read_bytes()
    converted = crc32_checksums(bytearray(raw[pos:pos + size]))
    assert converted[:4] == b"WRN2"
    with pytest.raises(CorruptBatch):
        Batch(bytes(converted))
    assert all(isinstance(r, BadRecord) for r in Batch(bytes(converted), verify=False).records(check_records=True))
    assert Batch(as_v1(raw[pos:pos + size], crc32=True)).count == count  # (the same checksums in WRN1)
    _rewrite(built, [batch], lambda data: bytes(converted))
    path = built.seg_path(seg)
    logged = _check_skips_exactly(built, LogReader(built.dir), set(range(base, base + count)), caplog)
    assert f"{path}: batch at position {pos}" in logged
    problems = LogReader(built.dir).verify()
    assert len(problems) == 1 and f"{path}: batch at position {pos}" in problems[0]
    # The last batch of the log: a corrupt tail.
    last = built.batches[-1]
    _rewrite(built, [last], lambda data: bytes(crc32_checksums(bytearray(data))))
    caplog.clear()
    with caplog.at_level(logging.WARNING, "wrenmq.store"):
        log = CommitLog(built.dir, 8192, 1024)
    assert log.truncated_bytes == last[4] and log.end_offset == last[2]
    assert f"truncating {last[4]} bytes of torn or corrupt data at position {last[1]}" in _warnings(caplog)
    log.close()


def test_index_entries_written_behind_are_completed_quietly(tmp_path, caplog):
    """The active segment's index entries reach the files in runs (_INDEX_WRITE_EVERY), so a
    writer that dies leaves them behind the log. That is no damage: `verify` does not call
    it one, and the next writer completes the index without a warning, equal to the index
    of a log closed cleanly."""
    clean = Built(tmp_path / "clean", segment_bytes=1 << 20, index_interval=64, seed=3)
    killed = Built(tmp_path / "killed", segment_bytes=1 << 20, index_interval=64, seed=3)
    for b in (clean, killed):
        b.fill(5)  # fewer entries than one run: none in the files yet
    clean.close()
    killed.log._close_files()  # dies: its descriptors go, what it held back is never written
    assert killed.seg_path(0, "index").read_bytes() == b""
    assert LogReader(killed.dir).verify() == []
    with caplog.at_level(logging.INFO, "wrenmq.store"):
        log = CommitLog(killed.dir, 1 << 20, 64)
    assert _warnings(caplog) == ""
    assert "completing the index (5 entries behind the log)" in caplog.text
    assert _files(killed.dir, ".index", ".timeindex") == _files(clean.dir, ".index", ".timeindex")
    assert list(log.records()) == clean.records
    log.close()
