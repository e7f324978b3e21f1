"""What the commit log gives replication: state records, batches read as stored, truncation.

Real files in temporary directories, a real writer thread where one writes while
another reads; no mocks. The stores built on these (the leader's ReplicatedStore, a
follower's ReplicaLog) are tested in test_store_replication.py.
"""

import os
import random
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from log_helpers import T0, encode, make_records
from wrenmq.store import state as S
from wrenmq.store.arrow import read_arrow
from wrenmq.store.files import read_durable
from wrenmq.store.format import (ATTR_STATE, HEADER, STATE_FLAGS, Batch, CorruptBatch, Record, encode_batch,
                                 encode_batch_parts)
from wrenmq.store.log import CommitLog
from wrenmq.store.reader import LogRangeError, LogReader, RawReader

# --- state records: the encoding of state operations ------------------------------------

OPS = [
    (S.SESSION_UPSERT, ("dev-1", 5, 3600, "user", b"\x30\x05will", 10, 42)),
    (S.SESSION_UPSERT, ("dev-2", 4, 0, None, None, 0, None)),
    (S.SESSION_OFFLINE, (1.75e9 + 0.123456, 7200, None, 17, "dev-1")),
    (S.SUB_UPSERT, ("dev-1", "$share/g/a/+", 2, 1, 0, 2, 268435455, 99)),
    (S.RETAINED_SET, ("r/\u00e9t\u00e9", 1, b"\x00\xff" * 300, b"\x26\x00\x01k\x00\x01v", "dev-1", 1.5, None)),
    (S.QOS2_IN_ADD, ("dev-1", 65535)),
    (S.OUT_SET, ("dev-1", 2**62, 0, 2, -1, 1)),
    (S.OUT_DELETE_QOS1, ()),
    (S.META_SET, ("marks", "{}")),
    (S.SESSION_DELETE, ("",)),
]


def test_state_operations_round_trip():
    data = S.encode_ops(OPS)
    assert data[0] == S.STATE_VERSION
    ops = S.decode_ops(data)
    assert ops == OPS
    # The statements come back as the table's own objects (StateDB groups runs by identity).
    assert all(sql is S.STATEMENTS[S.STATEMENT_IDS[sql]] for sql, _ in ops)
    assert S.decode_ops(S.encode_ops([])) == []


_param = st.one_of(st.none(), st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=False), st.text(max_size=40),
                   st.binary(max_size=40))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(S.STATEMENTS) - 1), st.data()), max_size=8))
def test_state_operations_round_trip_any_parameters(picks):
    ops = []
    for sid, data in picks:
        params = tuple(data.draw(_param) for _ in range(S.PARAM_COUNTS[sid]))
        ops.append((S.STATEMENTS[sid], params))
    assert S.decode_ops(S.encode_ops(ops)) == ops


def test_bools_are_ints_in_a_state_record():
    assert S.decode_ops(S.encode_ops([(S.QOS2_IN_ADD, ("c", True))])) == [(S.QOS2_IN_ADD, ("c", 1))]


@pytest.mark.parametrize("ops, why", [
    ([("DROP TABLE sessions", ())], "not a state statement"),
    ([(S.SESSION_DELETE, ())], "takes 1 parameters, not 0"),
    ([(S.SESSION_DELETE, ("a", "b"))], "takes 1 parameters, not 2"),
    ([(S.SESSION_DELETE, (["a"],))], "parameter of type list"),
    ([(S.SESSION_DELETE, (object(),))], "parameter of type object"),
    ([(S.QOS2_IN_ADD, ("c", 2**63))], "does not fit 64 bits"),
])
def test_operations_a_state_record_cannot_hold_are_refused(ops, why):
    with pytest.raises(S.StateRecordError, match=why):
        S.encode_ops(ops)


def test_bytes_that_are_not_a_state_record_are_refused():
    good = S.encode_ops(OPS)
    bad = [
        (b"", "unknown version"),
        (b"\x02" + good[1:], "unknown version"),
        (b"\x01\xff", "unknown statement id 255"),
        (bytes([1, len(S.STATEMENTS)]), f"unknown statement id {len(S.STATEMENTS)}"),
        (b"\x01" + bytes([S.STATEMENT_IDS[S.SESSION_DELETE]]) + b"\x09", "unknown parameter tag 9"),
        (b"\x01" + bytes([S.STATEMENT_IDS[S.SESSION_DELETE]]) + b"\x03\xff\x00\x00\x00ab", "runs past the end"),
        (b"\x01" + bytes([S.STATEMENT_IDS[S.SESSION_DELETE]]) + b"\x03\x02\x00\x00\x00\xff\xfe", "not UTF-8"),
        (b"\x01" + bytes([S.STATEMENT_IDS[S.QOS2_IN_ADD]]) + b"\x03\x01\x00\x00\x00a\x01\x00", "ends in the middle"),
    ]
    for data, why in bad:
        with pytest.raises(S.StateRecordError, match=why):
            S.decode_ops(data)
    for cut in range(1, len(good)):  # every proper prefix: an error, never a wrong operation
        try:
            ops = S.decode_ops(good[:cut])
        except S.StateRecordError:
            continue
        assert ops == OPS[:len(ops)]  # (a cut between two operations)


# --- the format: state records in a batch -------------------------------------------------


def _with_state(base, n, payload, epoch=0):
    """A batch of n message records and a state record after them."""
    recs = make_records(random.Random(base), base, n, T0)
    ts = [r.timestamp for r in recs] + [T0]
    flags = [r.qos | (4 if r.retain else 0) for r in recs] + [STATE_FLAGS]
    topics = [r.topic.encode() for r in recs] + [b""]
    clients = [r.client_id.encode() for r in recs] + [b""]
    props = [r.properties for r in recs] + [b""]
    payloads = [r.payload for r in recs] + [payload]
    pids = [r.packet_id for r in recs] + [0]
    return recs, encode_batch(base, ts, flags, topics, clients, props, payloads, pids, ATTR_STATE, epoch)


def test_a_batch_carries_its_attrs_and_leader_epoch_and_finds_its_state_records():
    payload = S.encode_ops(OPS)
    recs, data = _with_state(100, 5, payload, epoch=7)
    b = Batch(data)
    assert (b.attrs, b.epoch) == (ATTR_STATE, 7)
    assert HEADER.unpack_from(data)[7:] == (ATTR_STATE, 7)
    assert b.state_records() == [(105, payload)]
    assert b.state_records(106) == [] and b.state_records(0, 105) == []
    got = list(b.records())
    assert got[:5] == recs
    assert (got[5].private, got[5].state, got[5].qos, got[5].topic) == (True, True, 0, "")
    # Salvage (a damaged batch checked record by record) takes a state record's flags as sound.
    assert [r.offset for r in b.records(check_records=True)] == list(range(100, 106))
    # Not replicated: attrs and epoch are 0, as the format always had them.
    plain = Batch(encode(recs))
    assert (plain.attrs, plain.epoch) == (0, 0) and plain.state_records() == []


def test_readers_of_the_topic_stream_skip_state_records(tmp_path):
    payload = S.encode_ops(OPS)
    recs, data = _with_state(0, 6, payload)
    log = CommitLog(tmp_path)
    b = Batch(data)
    log.append(data, 0, b.count, b.first_ts, b.max_ts)
    log.close()
    r = LogReader(tmp_path)
    assert [x.offset for x in r.records()] == [x.offset for x in recs if not x.private]
    assert [x.offset for x in r.records(private=True)] == list(range(6))  # the broker's: still not state
    assert [x.offset for x in r.records(private=True, state=True)] == list(range(7))
    rows = [o for rb in read_arrow(LogReader(tmp_path)) for o in rb.column(0).to_pylist()]
    assert rows == [x.offset for x in recs if not x.private]
    assert r.verify() == []


def test_the_compiled_encoder_writes_attrs_and_epoch_as_the_reference_does():
    import wrenmq.store._encode as compiled
    import wrenmq.store._epoch as epoch

    e = epoch.Epoch(1, 40)
    e.add(T0, 1, b"t/1", b"dev", b"", b"payload", 0)
    e.add(T0 + 5, STATE_FLAGS, b"", b"", b"", S.encode_ops(OPS[:3]), 0)
    parts, first, last = compiled.encode_epochs([e], ATTR_STATE, 9)
    ref = encode_batch_parts(40, [T0, T0 + 5], [1, STATE_FLAGS], [b"t/1", b""], [b"dev", b""], [b"", b""],
                             [b"payload", S.encode_ops(OPS[:3])], [0, 0], ATTR_STATE, 9)
    assert b"".join(parts) == b"".join(ref)
    assert (first, last) == (T0, T0 + 5)
    assert Batch(b"".join(parts)).epoch == 9


# --- batches as stored: RawReader -----------------------------------------------------------


def _fill(directory, n_batches, seed=1, segment_bytes=1 << 20, epoch=0, durable_marks=False):
    """A log of n_batches batches (1-6 records each) written by CommitLog; returns the
    list of (base, count, bytes) as written."""
    rng = random.Random(seed)
    log = CommitLog(directory, segment_bytes=segment_bytes, index_interval_bytes=256, durable_marks=durable_marks)
    out = []
    base = 0
    for i in range(n_batches):
        recs = make_records(rng, base, rng.randint(1, 6), T0 + i * 10)
        data = encode_batch(base, [r.timestamp for r in recs], [r.qos for r in recs],
                            [r.topic.encode() for r in recs], [r.client_id.encode() for r in recs],
                            [r.properties for r in recs], [r.payload for r in recs],
                            [r.packet_id for r in recs], 0, epoch + i // 10)
        log.append(data, base, len(recs), recs[0].timestamp, max(r.timestamp for r in recs))
        out.append((base, len(recs), data))
        base += len(recs)
    return log, out


def test_raw_batches_are_the_bytes_on_disk_from_the_batch_holding_start(tmp_path):
    log, written = _fill(tmp_path, 60, segment_bytes=4096)
    assert len(log.segments) > 3
    end = log.end_offset
    r = RawReader(tmp_path)
    for start in [0, 1, written[7][0], written[7][0] + 1, written[30][0], end - 1]:
        got = r.batches(start, end, 1 << 30)
        i = next(k for k, (b, c, _) in enumerate(written) if b <= start < b + c)
        assert [(g.base, g.count, g.data) for g in got] == written[i:]
        assert [g.epoch for g in got] == [k // 10 for k in range(i, len(written))]
    assert r.batches(end, end, 100) == []
    assert r.batches(end, end + 10, 100) == []  # (nothing written there yet)
    # max_bytes: whole batches up to it, at least one; never past `end`.
    got = r.batches(0, end, 1)
    assert [(g.base, g.data) for g in got] == [(written[0][0], written[0][2])]
    size = sum(len(d) for _, _, d in written[:5])
    got = r.batches(0, end, size)
    assert [g.base for g in got] == [b for b, _, _ in written[:5]]
    got = r.batches(0, end, size + 1)
    assert [g.base for g in got] == [b for b, _, _ in written[:5]]
    got = r.batches(0, written[9][0] + 1, 1 << 30)  # the batch holding end - 1 reaches past end
    assert [g.base for g in got] == [b for b, _, _ in written[:9]]
    # A follower fetching on from where the last read ended, through every segment roll.
    r2 = RawReader(tmp_path)
    at = 0
    seen = []
    while at < end:
        got = r2.batches(at, end, 700)
        assert got
        seen.extend((g.base, g.count, g.data) for g in got)
        at = got[-1].base + got[-1].count
    assert seen == written
    log.close()


def test_raw_reads_below_the_log_start_or_over_missing_offsets_fail(tmp_path):
    log, written = _fill(tmp_path, 60, segment_bytes=4096)
    log.enforce_retention(retention_bytes=8000)
    start = log.start_offset
    assert start > 0
    r = RawReader(tmp_path)
    with pytest.raises(LogRangeError, match="below the log start"):
        r.batches(start - 1, log.end_offset, 1 << 20)
    assert r.batches(start, log.end_offset, 1 << 20)[0].base == start
    log.close()
    # Bytes where a batch should be that are not one: an error, not a short answer.
    seg = sorted(n for n in os.listdir(tmp_path) if n.endswith(".log"))[-1]
    with open(tmp_path / seg, "r+b") as fh:
        fh.seek(0)
        fh.write(b"XXXXXXXX")
    r = RawReader(tmp_path)
    with pytest.raises(CorruptBatch):
        r.batches(int(seg[:20]), int(seg[:20]) + 1, 1 << 20)


def test_raw_reads_while_a_writer_appends_see_only_whole_batches(tmp_path):
    """A reader thread reading up to the end the writer has announced, while the writer
    thread appends: it never sees a partial batch or a byte that differs."""
    log = CommitLog(tmp_path, segment_bytes=16384, index_interval_bytes=512)
    written = {}
    announced = [0]
    done = threading.Event()
    errors = []

    def writer():
        rng = random.Random(5)
        base = 0
        try:
            for i in range(400):
                recs = make_records(rng, base, rng.randint(1, 4), T0 + i)
                data = encode(recs)
                log.append(data, base, len(recs), recs[0].timestamp, max(r.timestamp for r in recs))
                written[base] = data
                base += len(recs)
                announced[0] = base  # (what on_appended would say)
        except Exception as e:  # pragma: no cover - shown by the assertion below
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=writer)
    t.start()
    r = RawReader(tmp_path)
    at = 0
    reads = 0
    while not (done.is_set() and at >= announced[0]):
        end = announced[0]
        for b in r.batches(at, end, 2000):
            assert b.base == at and written[b.base] == b.data
            at = b.base + b.count
        reads += 1
    t.join()
    assert not errors
    assert at == log.end_offset and reads > 1
    log.close()


# --- truncation ---------------------------------------------------------------------------


def _offsets(directory):
    return [(r.offset, r.payload) for r in LogReader(directory).records(private=True)]


@pytest.mark.parametrize("where", ["segment boundary", "mid-segment", "log start", "inside a batch",
                                   "the last batch", "the end"])
def test_truncate(tmp_path, where):
    log, written = _fill(tmp_path, 60, segment_bytes=4096, durable_marks=True)
    log.sync()
    bases = [s.base for s in log.segments]
    before = _offsets(tmp_path)
    batch_starts = [b for b, _, _ in written]
    offset, expect = {
        "segment boundary": (bases[2], bases[2]),
        "mid-segment": (batch_starts[batch_starts.index(bases[2]) + 2], None),
        "log start": (0, 0),
        "inside a batch": (written[20][0] + 1, written[20][0]) if written[20][1] > 1 else (written[21][0] + 1,
                                                                                         written[21][0]),
        "the last batch": (batch_starts[-1], batch_starts[-1]),
        "the end": (log.end_offset, log.end_offset),
    }[where]
    expect = offset if expect is None else expect
    assert log.truncate(offset) == expect == log.end_offset
    assert log.segments[-1].next_offset == expect
    assert read_durable(tmp_path) == expect  # the durable mark moved back
    assert _offsets(tmp_path) == [x for x in before if x[0] < expect]
    assert LogReader(tmp_path).verify() == []
    # Appending goes on at the new end, and a reopen finds the same log, its indexes sound.
    recs = make_records(random.Random(9), expect, 3, T0 + 10**6)
    data = encode(recs)
    log.append(data, expect, 3, recs[0].timestamp, recs[-1].timestamp)
    log.close()
    again = CommitLog(tmp_path, segment_bytes=4096, index_interval_bytes=256)
    assert again.end_offset == expect + 3
    assert _offsets(tmp_path) == [x for x in before if x[0] < expect] + [(r.offset, r.payload) for r in recs]
    assert LogReader(tmp_path).verify() == []
    again.close()


def test_truncate_below_the_log_start_is_refused(tmp_path):
    log, _ = _fill(tmp_path, 60, segment_bytes=4096)
    log.enforce_retention(retention_bytes=8000)
    with pytest.raises(ValueError, match="below the log start"):
        log.truncate(log.start_offset - 1)
    log.close()


def test_a_truncation_stopped_at_any_step_leaves_a_log_that_opens_as_a_prefix(tmp_path):
    """A kill in the middle of a truncation: the log left behind opens (recovery puts its
    index right), holds a prefix of what it held, at least everything below the offset,
    and the truncation done again completes it."""
    src = tmp_path / "src"
    log, written = _fill(src, 60, segment_bytes=4096)
    second = log.segments[1].base
    log.close()
    before = _offsets(src)
    target = min(b for b, _, _ in written if b > second)  # the second batch of the second segment
    steps = sum(1 for _ in _steps_of(src, tmp_path / "count", target))
    assert steps >= 4
    for stop_after in range(steps):
        d = tmp_path / f"crash{stop_after}"
        _copy(src, d)
        log = CommitLog(d, segment_bytes=4096, index_interval_bytes=256, durable_marks=True)
        gen = log.truncate_steps(target)
        for _ in range(stop_after + 1):
            next(gen)
        # Killed here: nothing closed, nothing more written. Open the directory afresh.
        reopened = CommitLog(d, segment_bytes=4096, index_interval_bytes=256, durable_marks=True)
        got = _offsets(d)
        assert got == before[:len(got)] and len(got) >= target, stop_after
        assert LogReader(d).verify() == []
        assert reopened.truncate(target) == target
        assert _offsets(d) == before[:target]
        reopened.close()


def _copy(src, dst):
    os.makedirs(dst)
    for name in os.listdir(src):
        with open(os.path.join(src, name), "rb") as a, open(os.path.join(dst, name), "wb") as b:
            b.write(a.read())


def _steps_of(src, scratch, target):
    _copy(src, scratch)
    return CommitLog(scratch, segment_bytes=4096, index_interval_bytes=256, durable_marks=True).truncate_steps(target)


def test_reset_empties_the_log_to_start_at_an_offset(tmp_path):
    log, written = _fill(tmp_path, 30, segment_bytes=4096)
    log = CommitLog(tmp_path, segment_bytes=4096, durable_marks=True)
    log.reset(5000)
    assert (log.start_offset, log.end_offset) == (5000, 5000)
    assert read_durable(tmp_path) == 5000
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith(".log")) == [f"{5000:020d}.log"]
    recs = make_records(random.Random(2), 5000, 2, T0)
    log.append(encode(recs), 5000, 2, T0, recs[-1].timestamp)
    log.close()
    assert _offsets(tmp_path) == [(r.offset, r.payload) for r in recs]
    assert CommitLog(tmp_path).start_offset == 5000


def test_retention_keeps_what_keep_from_needs_even_over_the_hard_limit(tmp_path):
    log, written = _fill(tmp_path, 60, segment_bytes=4096)
    keep = log.segments[2].base + 1
    deleted, _ = log.enforce_retention(retention_bytes=1, hard_bytes=1, keep_from=keep)
    assert deleted == 2 and log.start_offset == log.segments[0].base <= keep
    log.close()


def test_durable_marks_say_no_more_than_the_limit(tmp_path):
    log = CommitLog(tmp_path, durable_marks=True, mark_limit=0)
    recs = make_records(random.Random(1), 0, 5, T0)
    log.append(encode(recs), 0, 5, T0, recs[-1].timestamp)
    log.sync()
    assert read_durable(tmp_path) == 0
    log.limit_marks(3)
    assert read_durable(tmp_path) == 3
    log.limit_marks(10)
    assert read_durable(tmp_path) == 5  # (no further than the syncs made durable)
    assert LogReader(tmp_path).durable_end_offset == 5
    log.close()
    # Not limited (every store that is not replicated): the mark follows the syncs.
    plain = tmp_path / "plain"
    log = CommitLog(plain, durable_marks=True)
    log.append(encode(recs), 0, 5, T0, recs[-1].timestamp)
    log.sync()
    assert read_durable(plain) == 5
    log.close()


def test_truncate_keeps_index_entries_below_the_cut(tmp_path):
    log, written = _fill(tmp_path, 40, segment_bytes=1 << 20)
    log.sync()
    seg = log.segments[-1]
    entries = list(zip(seg.index_offsets, seg.index_positions))
    assert len(entries) > 4
    cut = entries[3][0]
    log.truncate(cut)
    assert list(zip(seg.index_offsets, seg.index_positions)) == entries[:3]
    with open(seg.index_path, "rb") as fh:
        raw = fh.read()
    assert [struct.unpack_from("<II", raw, 8 * i) for i in range(len(raw) // 8)] == \
        [(o - seg.base, p) for o, p in entries[:3]]
    log.close()


def test_record_equality_includes_the_state_flag():
    a = Record(1, T0, 0, False, "", "", b"", b"x", 0, True, False)
    b = Record(1, T0, 0, False, "", "", b"", b"x", 0, True, True)
    assert a != b
