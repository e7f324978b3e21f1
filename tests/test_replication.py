"""The sans-IO replication core: frames, epoch history, leader, follower, control rules.

Unit tests, table-driven where the rule is a table (KIP-279's divergence cases, the
ISR's shrink and expansion, fencing). The whole machinery under faults is exercised by
the simulator (test_replication_sim.py).
"""

import itertools
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wrenmq.cluster import replication_control as RC
from wrenmq.cluster import replication_frames as F
from wrenmq.cluster.replication import (
    Append, BeginSnapshot, Fenced, HighWatermark, InstallSnapshot, PartitionFollower, PartitionLeader, ProposeIsr,
    RefreshMetadata, ReplicationError, SaveEpochs, Send, SendData, SendSnapshot, Truncate, WriteSnapshot,
)
from wrenmq.cluster.replication_epochs import LeaderEpochs, LeaderEpochsError

NO = F.NO_EPOCH

# ============================================================================ frames

FRAMES = [
    F.Hello("prod", b"s3cret", "a", "b", 42, 7),
    F.Hello("prod", None, "node-\u00e9", "b", 1, 0),
    F.Fetch("a", 3, 42, 9, 120, 2),
    F.Fetch("a", 0, 1, 1, 0, NO),
    F.Data("a", 3, 42, 9, 100, [F.Batch(120, 2, 3, b"abc"), F.Batch(123, 3, 1, b"")]),
    F.Data("a", 3, 42, 10, 100, []),
    F.Diverged("a", 5, 42, 11, 3, 77),
    F.Diverged("a", 5, 42, 11, NO, 0),
    F.Fenced("a", 8),
    F.Snapshot("a", 5, 42, 12, 100, 150, 10, 0, False, b"01234"),
    F.Snapshot("a", 5, 42, 12, 100, 150, 10, 5, True, b"56789"),
    F.Snapshot("a", 5, 42, 12, 0, 0, 0, 0, True, b""),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_frame_round_trip(frame):
    raw = F.encode(frame)
    back = F.decode_frame(raw)
    if isinstance(back, F.Data):
        back = back._replace(batches=[b._replace(data=bytes(b.data)) for b in back.batches])
    if isinstance(back, F.Snapshot):
        back = back._replace(data=bytes(back.data))
    assert back == frame


def test_fetch_bytes_are_the_documented_layout():
    # u32 length | u8 kind 2 | u16 1 "a" | u32 epoch 3 | u64 incarnation 42 | u64 seq 9
    # | u64 fetch offset 120 | u32 last fetched epoch (none: ff ff ff ff)
    expect = bytes.fromhex("00000024" "02" "0001" "61" "00000003" "000000000000002a" "0000000000000009"
                           "0000000000000078" "ffffffff")
    assert F.encode(F.Fetch("a", 3, 42, 9, 120, NO)) == expect


def test_data_bytes_are_the_documented_layout():
    # DATA, partition "p", epoch 2, incarnation 1, seq 5, hw 7, 1 batch: base 7, epoch 2,
    # count 2, 3 bytes "xyz"
    body = (bytes.fromhex("0001") + b"p" + struct.pack(">IQQQI", 2, 1, 5, 7, 1)
            + struct.pack(">QIII", 7, 2, 2, 3) + b"xyz")
    raw = struct.pack(">IB", len(body) + 1, F.DATA) + body
    assert F.encode(F.Data("p", 2, 1, 5, 7, [F.Batch(7, 2, 2, b"xyz")])) == raw


def _body(frame):
    return F.encode(frame)[5:]


BAD = [
    ("truncated fetch", F.FETCH, _body(F.Fetch("a", 1, 1, 1, 0, NO))[:-1]),
    ("bytes after fetch", F.FETCH, _body(F.Fetch("a", 1, 1, 1, 0, NO)) + b"\x00"),
    ("empty partition", F.FETCH, b"\x00\x00" + _body(F.Fetch("a", 1, 1, 1, 0, NO))[3:]),
    ("partition not utf-8", F.FETCH, b"\x00\x01\xff" + _body(F.Fetch("a", 1, 1, 1, 0, NO))[3:]),
    ("fetch without epoch", F.FETCH, _body(F.Fetch("a", 1, 1, 1, 0, NO))[:3] + b"\xff\xff\xff\xff"
     + _body(F.Fetch("a", 1, 1, 1, 0, NO))[7:]),
    ("offset past i63", F.FETCH, _body(F.Fetch("a", 1, 1, 1, 0, NO))[:23] + b"\xff" * 8
     + _body(F.Fetch("a", 1, 1, 1, 0, NO))[31:]),
    ("batches not contiguous", F.DATA, b"\x00\x01a" + struct.pack(">IQQQI", 2, 1, 1, 0, 2)
     + struct.pack(">QIII", 0, 1, 2, 0) + struct.pack(">QIII", 3, 1, 1, 0)),
    ("batch epoch above the frame's", F.DATA, b"\x00\x01a" + struct.pack(">IQQQI", 2, 1, 1, 0, 1)
     + struct.pack(">QIII", 0, 3, 1, 0)),
    ("batch epochs going back", F.DATA, b"\x00\x01a" + struct.pack(">IQQQI", 5, 1, 1, 0, 2)
     + struct.pack(">QIII", 0, 4, 1, 0) + struct.pack(">QIII", 1, 3, 1, 0)),
    ("empty batch", F.DATA, b"\x00\x01a" + struct.pack(">IQQQI", 2, 1, 1, 0, 1) + struct.pack(">QIII", 0, 1, 0, 0)),
    ("batch count past the body", F.DATA, b"\x00\x01a" + struct.pack(">IQQQI", 2, 1, 1, 0, 1000)),
    ("batch bytes past the body", F.DATA, b"\x00\x01a" + struct.pack(">IQQQI", 2, 1, 1, 0, 1)
     + struct.pack(">QIII", 0, 1, 1, 10) + b"abc"),
    ("snapshot chunk past its total", F.SNAPSHOT, b"\x00\x01a" + struct.pack(">IQQQQQQBI", 1, 1, 1, 0, 0, 4, 2, 0, 3)
     + b"xyz"),
    ("last chunk short of its total", F.SNAPSHOT, b"\x00\x01a" + struct.pack(">IQQQQQQBI", 1, 1, 1, 0, 0, 9, 0, 1, 3)
     + b"xyz"),
    ("snapshot applied below its log start", F.SNAPSHOT, b"\x00\x01a"
     + struct.pack(">IQQQQQQBI", 1, 1, 1, 10, 5, 0, 0, 1, 0)),
    ("hello of another version", F.HELLO, b"\x02" + _body(F.Hello("c", None, "a", "b", 1, 1))[1:]),
    ("hello secret flag 2", F.HELLO, b"\x01\x00\x01c\x02" + _body(F.Hello("c", None, "a", "b", 1, 1))[5:]),
    ("unknown kind", 99, b""),
]


@pytest.mark.parametrize("kind, body", [pytest.param(k, b, id=i) for i, k, b in BAD])
def test_malformed_frames_are_refused(kind, body):
    with pytest.raises(F.ReplicationFrameError):
        F.decode(kind, body)


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_truncation_of_a_frame_is_refused(frame):
    raw = F.encode(frame)
    kind, body = raw[4], raw[5:]
    for n in range(len(body)):
        with pytest.raises(F.ReplicationFrameError):
            F.decode(kind, body[:n])


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.sampled_from(sorted(F.KIND_NAMES)), st.binary(max_size=120))
def test_random_bodies_raise_nothing_but_frame_errors(kind, body):
    try:
        F.decode(kind, body)
    except F.ReplicationFrameError:
        pass


def test_encoders_refuse_what_the_format_cannot_carry():
    with pytest.raises(ValueError):
        F.encode(F.Fetch("", 1, 1, 1, 0, NO))
    with pytest.raises(ValueError):
        F.encode(F.Fetch("a" * (F.MAX_NAME_BYTES + 1), 1, 1, 1, 0, NO))
    with pytest.raises(ValueError):
        F.encode(F.Fetch("a", 1 << 32, 1, 1, 0, NO))
    with pytest.raises(ValueError):
        F.encode(F.Fetch("a", 1, 1, 1, -1, NO))
    with pytest.raises(ValueError):
        F.encode(F.Snapshot("a", 1, 1, 1, 0, 0, 3, 0, True, b"xy"))


def test_reader_cuts_a_stream_and_bounds_a_frame():
    raw = b"".join(F.encode(f) for f in FRAMES)
    reader = F.FrameReader(1 << 16)
    got = []
    for i in range(0, len(raw), 7):  # frames split across reads
        got += reader.feed(raw[i:i + 7])
    assert reader.buffered == 0
    assert [type(F.decode(k, b)) for k, b in got] == [type(f) for f in FRAMES]
    small = F.FrameReader(64)
    with pytest.raises(F.ReplicationFrameError):
        small.feed(F.encode(F.Data("a", 1, 1, 1, 0, [F.Batch(0, 1, 1, b"x" * 100)]))[:10])
    assert small.buffered == 0


# ============================================================================ epoch history

def test_assign_appends_new_epochs_and_drops_empty_ones():
    h = LeaderEpochs()
    assert h.assign(0, 0)
    assert not h.assign(0, 5)  # more records of the same epoch
    assert h.assign(2, 10)
    assert h.entries == [(0, 0), (2, 10)]
    assert h.assign(3, 10)  # epoch 2 got no record before epoch 3 began: it goes
    assert h.entries == [(0, 0), (3, 10)]
    assert h.assign(5, 10) and h.entries == [(0, 0), (5, 10)]


def test_assign_refuses_an_epoch_older_than_records_before_it():
    h = LeaderEpochs([(0, 0), (3, 10)])
    with pytest.raises(LeaderEpochsError):
        h.assign(2, 12)
    assert h.entries == [(0, 0), (3, 10)]


# KIP-279's OffsetsForLeaderEpoch over history [(1, 0), (3, 10), (4, 25)], log end 40.
END_OFFSET_CASES = [
    (4, (4, 40)),  # the latest epoch ends at the log end
    (3, (3, 25)),  # ends where the next one starts
    (2, (1, 10)),  # unknown epoch: the largest one below it, and where it ends
    (1, (1, 10)),
    (0, (0, 0)),  # older than the whole history: itself and the first start
    (7, (NO, -1)),  # newer than all
    (NO, (NO, -1)),
]


@pytest.mark.parametrize("epoch, answer", END_OFFSET_CASES)
def test_end_offset_for(epoch, answer):
    h = LeaderEpochs([(1, 0), (3, 10), (4, 25)])
    assert h.end_offset_for(epoch, 40) == answer


def test_epoch_at_and_truncation():
    h = LeaderEpochs([(1, 0), (3, 10), (4, 25)])
    assert [h.epoch_at(o) for o in (0, 9, 10, 24, 25, 99)] == [1, 1, 3, 3, 4, 4]
    assert LeaderEpochs([(2, 5)]).epoch_at(4) == NO
    assert h.copy().truncate_from_end(26) is False
    t = h.copy()
    assert t.truncate_from_end(25) and t.entries == [(1, 0), (3, 10)]
    assert t.truncate_from_end(3) and t.entries == [(1, 0)]
    s = h.copy()
    assert s.truncate_from_start(12) and s.entries == [(3, 12), (4, 25)]
    assert not s.truncate_from_start(12)
    assert s.truncate_from_start(30) and s.entries == [(4, 30)]


def test_epoch_history_text_round_trip_and_bad_text():
    h = LeaderEpochs([(1, 0), (3, 10), (4, 25)])
    assert LeaderEpochs.from_text(h.to_text()) == h
    assert LeaderEpochs.from_text(LeaderEpochs().to_text()) == LeaderEpochs()
    for bad in ("", "1 0\n", "wrenmq-leader-epochs 1\n1 x\n", "wrenmq-leader-epochs 1\n3 0\n2 5\n",
                "wrenmq-leader-epochs 1\n1 5\n2 4\n", "wrenmq-leader-epochs 1\n-1 0\n"):
        with pytest.raises(LeaderEpochsError):
            LeaderEpochs.from_text(bad)


# ============================================================================ helpers

def history_of(epochs_by_offset, log_start=0):
    """The LeaderEpochs of a log given the epoch of each record."""
    h = LeaderEpochs()
    for i, e in enumerate(epochs_by_offset):
        h.assign(e, log_start + i)
    return h


def leader(log, epoch, isr=("L", "F"), replicas=("L", "F", "G"), min_insync=2, hw=0, now=0, log_start=0,
           lag_ms=1000, heartbeat_ms=100, durable=None):
    """A started leader "L" whose log holds records of the epochs in `log`."""
    h = history_of(log, log_start)
    end = log_start + len(log)
    ld = PartitionLeader("P", "L", epoch, isr, replicas, min_insync, h, log_start=log_start, log_end=end,
                         durable_end=end if durable is None else durable, hw=hw, now=now, lag_ms=lag_ms,
                         heartbeat_ms=heartbeat_ms)
    ld.start()
    return ld


def follower(log, node="F", incarnation=1, hw=0, log_start=0, durable=None):
    h = history_of(log, log_start)
    end = log_start + len(log)
    return PartitionFollower("P", node, incarnation, h, log_start=log_start, log_end=end,
                             durable_end=end if durable is None else durable, hw=hw, fetch_timeout_ms=500)


def fetch_of(decisions):
    [send] = [d for d in decisions if isinstance(d, Send) and isinstance(d.frame, F.Fetch)]
    return send.frame


def fetch(ld, node, offset, lfe, now=0, epoch=None, incarnation=1, seq=1):
    return ld.on_fetch(node, F.Fetch("P", ld.epoch if epoch is None else epoch, incarnation, seq, offset, lfe), now)


def data_for(ld, d):
    """The DATA frame the I/O layer would send for SendData `d`, from a log of epochs `ld.log`."""
    batches = []
    o = d.start
    while o < d.end:
        e = ld.log[o]
        b = o
        while o < d.end and ld.log[o] == e:
            o += 1
        batches.append(F.Batch(b, e, o - b, b"x" * (o - b)))
    return F.Data("P", d.epoch, d.incarnation, d.seq, d.hw, batches)


# ============================================================================ divergence (KIP-101, KIP-279)

# (leader's log, follower's log, leader epoch, the truncations the follower makes, one per round)
DIVERGENCE = [
    ("prefix", [0, 0, 0, 1, 1], [0, 0, 0], 2, []),
    ("behind in the same epoch", [0, 0, 1, 1, 1, 1], [0, 0, 1], 2, []),
    ("empty follower", [0, 1, 1], [], 2, []),
    ("same logs", [0, 0, 1], [0, 0, 1], 2, []),
    # KIP-101 scenario 1: the follower has records of the last epoch the new leader never got
    ("extra records of a shared epoch", [0, 0, 0, 2], [0, 0, 0, 0, 0], 2, [3]),
    # KIP-101 scenario 2: an epoch only the follower has (a leader that crashed before
    # its records were fetched): truncate back to where the shared epoch ended
    ("an epoch only the follower has", [0, 0, 0, 0, 0, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1, 1], 2, [5]),
    # The follower lacks the leader's floor epoch: first an intermediate truncation to
    # the end of its own floor epoch, then the next fetch agrees (Kafka's
    # getOffsetTruncationState, KIP-279)
    ("follower lacks the leader's floor epoch", [0, 0, 0, 2, 2, 2, 4, 4, 4, 4],
     [0, 0, 0, 1, 1, 1, 1, 1, 3, 3, 3, 3], 4, [8, 3]),
    ("several epochs apart", [0] * 10 + [3] * 5, [0] * 4 + [1] * 3 + [2] * 5, 3, [4]),
    ("follower shorter, its last epoch unknown to the leader", [0, 0, 2, 2, 2], [0, 0, 1], 2, [2]),
]


@pytest.mark.parametrize("case", DIVERGENCE, ids=lambda c: c[0])
def test_follower_truncates_by_epoch_until_the_logs_agree(case):
    _, llog, flog, epoch, expect = case
    ld = leader(llog, epoch, isr=("L",), min_insync=1)
    ld.log = llog
    f = follower(flog)
    flog = list(flog)
    truncations = []
    out = f.leader_changed("L", epoch, now=0)
    for _ in range(10):
        req = fetch_of(out)
        replies = [r for r in ld.on_fetch("F", req, now=0) if isinstance(r, (Send, SendData))]
        if not replies:  # parked at the leader's log end: nothing to fetch
            break
        [reply] = replies
        if isinstance(reply, SendData):
            out = f.on_data("L", data_for(ld, reply), now=0)
            for d in out:
                if isinstance(d, Append):
                    for b in d.batches:
                        flog += [b.epoch] * b.count
            break
        assert isinstance(reply, Send) and isinstance(reply.frame, F.Diverged)
        out = f.on_diverged("L", reply.frame, now=0)
        for d in out:
            if isinstance(d, Truncate):
                truncations.append(d.offset)
                del flog[d.offset:]
        f.local_durable(f.log_end, now=0)
    else:
        raise AssertionError("the follower and the leader never agreed")
    assert truncations == expect
    assert flog == llog  # what the follower holds is the leader's log
    assert f.epochs.entries == history_of(llog).entries


# The leader's side of the check, over its log of epochs [0]*5 + [2]*5 (+ its epoch 3 from 10):
# (fetch offset, last fetched epoch) -> None (the follower's log is a prefix) or DIVERGED's
# (diverging epoch, end offset).
HISTORY_CHECK = [
    (5, 0, None),
    (3, 0, None),
    (7, 2, None),
    (10, 2, None),
    (6, 0, (0, 5)),  # epoch 0 ends at 5 here: the follower's 6th record is not ours
    (12, 2, (2, 10)),
    (6, 1, (0, 5)),  # epoch 1 never was here: where the epoch below it ended
    (0, NO, None),  # an empty log
    (10, NO, None),  # an empty log from 10 (after a snapshot)
    (11, NO, (NO, 10)),  # an empty log past this one's end
]


@pytest.mark.parametrize("offset, lfe, answer", HISTORY_CHECK)
def test_leader_history_check(offset, lfe, answer):
    ld = leader([0] * 5 + [2] * 5, 3)
    assert ld.check_history(F.Fetch("P", 3, 1, 1, offset, lfe)) == answer


def test_a_follower_never_truncates_by_its_high_watermark():
    # KIP-101: truncating to the HW on a leader change loses records the old leader
    # committed after the follower last heard its HW. Nothing is truncated until the
    # new leader says where the logs part.
    f = follower([0] * 10, hw=4)
    out = f.leader_changed("L", 1, now=0)
    assert not [d for d in out if isinstance(d, Truncate)]
    assert fetch_of(out).fetch_offset == 10 and fetch_of(out).last_fetched_epoch == 0


def test_a_truncation_below_the_high_watermark_is_refused():
    f = follower([0] * 10, hw=8)
    req = fetch_of(f.leader_changed("L", 1, now=0))
    with pytest.raises(ReplicationError):
        f.on_diverged("L", F.Diverged("P", 1, 1, req.seq, 0, 5), now=0)


def test_divergence_is_checked_again_after_every_epoch_change():
    # KAFKA-7164: a follower whose leader changed (here: the same node, a new epoch) while
    # a fetch was answered takes nothing from the old epoch's answer and fetches again,
    # checked against the new epoch's history.
    f = follower([0, 0, 0])
    first = fetch_of(f.leader_changed("L", 1, now=0))
    second = fetch_of(f.leader_changed("L", 2, now=1))
    assert second.epoch == 2 and second.seq != first.seq
    late = F.Data("P", 1, 1, first.seq, 3, [F.Batch(3, 1, 2, b"xx")])
    assert f.on_data("L", late, now=2) == [Send("L", F.Fenced("P", 2))]  # lower epoch: refused
    old_seq = F.Data("P", 2, 1, first.seq, 3, [F.Batch(3, 1, 2, b"xx")])
    assert f.on_data("L", old_seq, now=2) == []  # not the fetch in flight
    assert f.log_end == 3


def test_an_answer_to_a_replaced_followers_fetch_is_not_taken():
    # The node led the partition for a while and follows it again, with a new follower
    # object: the numbers come from the process's one counter, so the new follower's
    # first fetch is not mistaken for the old one's.
    seqs = itertools.count(1)
    old = PartitionFollower("P", "F", 1, history_of([0]), log_start=0, log_end=1, durable_end=1, hw=0,
                            fetch_timeout_ms=500, seqs=seqs)
    stale = fetch_of(old.leader_changed("L", 1, now=0))
    new = PartitionFollower("P", "F", 1, history_of([0, 0, 0]), log_start=0, log_end=3, durable_end=3, hw=0,
                            fetch_timeout_ms=500, seqs=seqs)
    req = fetch_of(new.leader_changed("L", 3, now=1))
    assert req.seq != stale.seq
    assert new.on_data("L", F.Data("P", 3, 1, stale.seq, 0, [F.Batch(1, 1, 1, b"x")]), now=2) == []
    assert new.log_end == 3


def test_a_duplicated_diverged_does_not_truncate_twice():
    ld = leader([0, 0, 0, 2, 2], 2, isr=("L",), min_insync=1)
    ld.log = [0, 0, 0, 2, 2]
    f = follower([0, 0, 0, 0, 0])
    req = fetch_of(f.leader_changed("L", 2, now=0))
    [div] = ld.on_fetch("F", req, now=0)
    out = f.on_diverged("L", div.frame, now=0)
    assert Truncate(3) in out
    again = fetch_of(out)
    [data] = [d for d in ld.on_fetch("F", again, now=0) if isinstance(d, SendData)]
    f.on_data("L", data_for(ld, data), now=0)
    assert f.log_end == 5
    assert f.on_diverged("L", div.frame, now=1) == []  # the same frame again: dropped
    assert f.log_end == 5


# ============================================================================ leader: HW and ISR

def test_hw_is_the_minimum_over_the_whole_isr_never_the_best_min_insync():
    ld = leader([0] * 10, 1, isr=("L", "F", "G"), replicas=("L", "F", "G"), min_insync=2)
    assert ld.hw == 0
    fetch(ld, "F", 10, 0)
    assert ld.hw == 0  # G has not fetched in this epoch: nothing is known of it
    out = fetch(ld, "G", 3, 0)
    assert HighWatermark(3) in out and ld.hw == 3  # not 10, which L and F hold
    fetch(ld, "G", 2, 0, seq=2)  # a delayed duplicate: positions only grow
    assert ld.hw == 3
    out = fetch(ld, "G", 10, 0, seq=3)
    assert HighWatermark(10) in out


def test_hw_counts_only_durable_records_of_the_leader():
    ld = leader([0] * 10, 1, isr=("L", "F"), min_insync=2, durable=4)
    fetch(ld, "F", 10, 0)
    assert ld.hw == 4
    assert ld.local_durable(10, now=1)[0] == HighWatermark(10)


def test_no_hw_with_fewer_than_min_insync_in_sync():
    ld = leader([0] * 10, 1, isr=("L",), replicas=("L", "F"), min_insync=2)
    assert not ld.accepting
    out = fetch(ld, "F", 10, 0)
    assert ld.hw == 0
    assert ProposeIsr(("L", "F"), 1) in out  # F reached HW and the epoch start: back in


def test_shrink_waits_for_etcd_before_the_hw_moves_on():
    ld = leader([0] * 10, 1, isr=("L", "F", "G"), replicas=("L", "F", "G"), min_insync=2, lag_ms=100)
    fetch(ld, "F", 10, 0)
    fetch(ld, "G", 4, 0)
    assert ld.hw == 4
    assert ld.tick(now=50) == []
    fetch(ld, "F", 10, 0, now=120, seq=2)
    out = ld.tick(now=150)  # G last caught up at 0
    assert out == [ProposeIsr(("L", "F"), 1)]
    fetch(ld, "F", 10, 0, now=160, seq=3)
    assert ld.hw == 4  # the HW does not pass G before etcd confirms
    assert ld.isr_changed(("L", "F"), 1, now=170)[0] == HighWatermark(10)
    assert ld.pending is None


def test_a_failed_shrink_leaves_the_isr_as_it_was():
    ld = leader([0] * 10, 1, isr=("L", "F", "G"), replicas=("L", "F", "G"), lag_ms=100)
    fetch(ld, "F", 10, 0)
    fetch(ld, "G", 4, 0)
    fetch(ld, "F", 10, 0, now=150, seq=2)
    assert ld.tick(now=150) == [ProposeIsr(("L", "F"), 1)]
    assert ld.isr_change_failed(now=160) == []
    assert ld.isr == ("L", "F", "G") and ld.hw == 4


SHRINK = [
    # (ISR, min_insync, lagging followers, the proposal: never below min_insync, keeping
    # the lagging members furthest along)
    (("L", "F", "G"), 2, {"G"}, ("L", "F")),
    (("L", "F", "G"), 2, {"F", "G"}, ("L", "F")),
    (("L", "F", "G"), 1, {"F", "G"}, ("L",)),
    (("L", "F"), 2, {"F"}, None),
    (("L", "F", "G"), 3, {"G"}, None),
]


@pytest.mark.parametrize("isr, min_insync, lagging, proposal", SHRINK)
def test_shrink_never_goes_below_min_insync(isr, min_insync, lagging, proposal):
    ld = leader([0] * 10, 1, isr=isr, replicas=("L", "F", "G"), min_insync=min_insync, lag_ms=100)
    fetch(ld, "F", 6, 0)
    fetch(ld, "G", 3, 0)
    for m in isr[1:]:
        if m not in lagging:
            fetch(ld, m, 10, 0, now=200, seq=5)
    out = ld.tick(now=200)
    assert out == ([] if proposal is None else [ProposeIsr(proposal, 1)])


def test_expansion_counts_the_newcomer_at_once():
    ld = leader([0] * 10, 1, isr=("L", "F"), replicas=("L", "F", "G"), min_insync=2)
    fetch(ld, "F", 10, 0)
    assert ld.hw == 10
    out = fetch(ld, "G", 10, 0)
    assert ProposeIsr(("L", "F", "G"), 1) in out
    ld.local_appended(15, now=1)
    ld.local_durable(15, now=1)
    fetch(ld, "F", 15, 1, seq=2)
    assert ld.hw == 10  # G, proposed, holds only 10: the HW waits for it already
    fetch(ld, "G", 15, 1, seq=2)
    assert ld.hw == 15
    assert ld.isr_changed(("L", "F", "G"), 1, now=1) == [] and ld.pending is None


def test_a_follower_at_a_stale_hw_below_the_epoch_start_is_not_added():
    # KAFKA-7128: a new leader's HW may lag the old leader's; a follower that reached only
    # that HW may lack records the old leader acknowledged.
    ld2 = leader([0] * 10, 2, isr=("L", "F"), replicas=("L", "F", "G"), hw=4)
    out = fetch(ld2, "G", 6, 0)
    assert not [d for d in out if isinstance(d, ProposeIsr)]  # at its HW 4+, below the epoch start 10
    fetch(ld2, "F", 10, 0)
    out = fetch(ld2, "G", 10, 0, seq=2)
    assert ProposeIsr(("L", "F", "G"), 2) in out


def test_positions_follow_the_latest_incarnation_of_a_node():
    ld = leader([0] * 10, 1, isr=("L", "F"), replicas=("L", "F"))
    fetch(ld, "F", 8, 0, incarnation=5)
    assert ld.position("F") == (5, 8)
    fetch(ld, "F", 0, NO, incarnation=9)  # the node was replaced by an empty one
    assert ld.position("F") == (9, 0)
    assert fetch(ld, "F", 10, 0, incarnation=5) == []  # from the process it replaced: ignored
    assert ld.position("F") == (9, 0)


# ============================================================================ leader: fencing, long poll, snapshot

def test_fencing():
    ld = leader([0] * 10, 3)
    assert fetch(ld, "F", 10, 0, epoch=2) == [Send("F", F.Fenced("P", 3))]  # lower: refused, told
    assert fetch(ld, "F", 10, 0, epoch=4) == [Fenced(4)]  # higher: this leader is stale
    assert ld.fenced_epoch == 4 and not ld.accepting
    assert fetch(ld, "F", 10, 0) == [] and ld.local_durable(10, 1) == [] and ld.tick(10_000) == []
    ld2 = leader([0] * 10, 3)
    assert ld2.isr_changed(("L", "F"), 2, now=0) == []  # a stale read
    assert ld2.isr_changed(("L", "F"), 5, now=0) == [Fenced(5)]
    ld3 = leader([0] * 10, 3)
    assert ld3.on_fenced("F", F.Fenced("P", 3), now=0) == []
    assert ld3.on_fenced("F", F.Fenced("P", 6), now=0) == [Fenced(6)]


def test_long_poll():
    ld = leader([0] * 10, 1, isr=("L", "F"), heartbeat_ms=100, durable=10)
    out = fetch(ld, "F", 10, 0, now=0, seq=7)
    assert HighWatermark(10) in out and not [d for d in out if isinstance(d, SendData)]  # parked
    assert ld.tick(now=50) == []
    assert ld.local_appended(12, now=60) == [SendData("F", 1, 7, 1, 10, 10, 12)]
    out = fetch(ld, "F", 12, 1, now=70, seq=8)  # lfe 1: the leader's own epoch
    assert ld.tick(now=169) == []
    assert ld.tick(now=170) == [SendData("F", 1, 8, 1, 10, 12, 12)]  # heartbeat: empty, with the HW


def test_a_parked_fetch_learns_a_new_hw_at_once():
    ld = leader([0] * 10, 1, isr=("L", "F", "G"), replicas=("L", "F", "G"), durable=10)
    fetch(ld, "F", 10, 0, seq=3)  # parked; G has not fetched: HW 0
    out = fetch(ld, "G", 10, 0)
    assert HighWatermark(10) in out and SendData("F", 1, 3, 1, 10, 10, 10) in out


def test_a_follower_below_the_log_start_gets_a_snapshot():
    ld = leader([0] * 5, 2, log_start=100, hw=100)
    assert fetch(ld, "F", 40, 0, seq=4) == [SendSnapshot("F", 1, 4, 2)]
    f = follower([0, 0], log_start=38, hw=38)
    req = fetch_of(f.leader_changed("L", 2, now=0))
    assert ld.on_fetch("F", req, now=0) == [SendSnapshot("F", 1, req.seq, 2)]
    chunks = [F.Snapshot("P", 2, 1, req.seq, 100, 103, 6, 0, False, b"abc"),
              F.Snapshot("P", 2, 1, req.seq, 100, 103, 6, 3, True, b"def")]
    assert f.on_snapshot("L", chunks[0], now=1) == [BeginSnapshot(100, 103, 6), WriteSnapshot(0, b"abc")]
    assert f.on_snapshot("L", chunks[0], now=1) == []  # a duplicate first chunk: the fetch is answered
    out = f.on_snapshot("L", chunks[1], now=2)
    assert out[:2] == [WriteSnapshot(3, b"def"), InstallSnapshot(100, 103)]
    assert SaveEpochs(LeaderEpochs().to_text()) in out
    after = fetch_of(out)
    assert (after.fetch_offset, after.last_fetched_epoch) == (100, NO) and f.hw == 103
    assert [d for d in ld.on_fetch("F", after, now=3) if isinstance(d, SendData)] == [
        SendData("F", 1, after.seq, 2, 100, 100, 105)]


def test_a_lost_snapshot_chunk_abandons_the_snapshot():
    f = follower([], log_start=0)
    req = fetch_of(f.leader_changed("L", 2, now=0))
    f.on_snapshot("L", F.Snapshot("P", 2, 1, req.seq, 100, 100, 9, 0, False, b"abc"), now=1)
    out = f.on_snapshot("L", F.Snapshot("P", 2, 1, req.seq, 100, 100, 9, 6, True, b"ghi"), now=2)
    assert not [d for d in out if isinstance(d, InstallSnapshot)]
    assert fetch_of(out).fetch_offset == 0  # asked again


# ============================================================================ follower

def test_follower_fetches_only_once_durable_and_learns_the_hw():
    f = follower([0, 0])
    req = fetch_of(f.leader_changed("L", 1, now=0))
    out = f.on_data("L", F.Data("P", 1, 1, req.seq, 3, [F.Batch(2, 1, 2, b"xy")]), now=1)
    assert [type(d) for d in out] == [SaveEpochs, Append, HighWatermark]  # no fetch before the fsync
    assert out[2] == HighWatermark(2)  # capped at what is durable here
    out = f.local_durable(4, now=2)
    assert out[0] == HighWatermark(3)
    nxt = fetch_of(out)
    assert (nxt.fetch_offset, nxt.last_fetched_epoch) == (4, 1)


def test_follower_refuses_lower_epochs_and_rereads_on_higher():
    f = follower([0])
    req = fetch_of(f.leader_changed("L", 3, now=0))
    assert f.leader_changed("X", 2, now=1) == []  # stale metadata
    assert f.leader == "L"
    assert f.on_data("Z", F.Data("P", 2, 1, req.seq, 0, []), now=1) == [Send("Z", F.Fenced("P", 3))]
    assert f.on_data("L", F.Data("P", 4, 1, req.seq, 0, []), now=1) == [RefreshMetadata(4)]
    assert f.on_fenced("L", F.Fenced("P", 5), now=1) == [RefreshMetadata(5)]
    assert f.on_fenced("L", F.Fenced("P", 1), now=1) == []


def test_follower_retries_a_fetch_that_got_no_answer():
    f = follower([0])
    first = fetch_of(f.leader_changed("L", 1, now=0))
    assert f.tick(now=499) == []
    again = fetch_of(f.tick(now=500))
    assert again.seq == first.seq + 1 and again.fetch_offset == first.fetch_offset


def test_data_that_does_not_follow_the_log_is_refused():
    f = follower([0, 0])
    req = fetch_of(f.leader_changed("L", 1, now=0))
    with pytest.raises(ReplicationError):
        f.on_data("L", F.Data("P", 1, 1, req.seq, 0, [F.Batch(5, 1, 1, b"x")]), now=1)


# ============================================================================ control

PFX = "/wrenmq/t/"


def rec(leader="a", inc=10, epoch=3, isr=("a", "b", "c"), replicas=("a", "b", "c")):
    return RC.PartitionRecord(leader, inc, epoch, tuple(isr), tuple(replicas))


def test_record_json_round_trip_and_refusals():
    r = rec()
    assert RC.PartitionRecord.from_json(r.to_json()) == r
    assert RC.PartitionRecord.from_json(rec(leader=None, inc=0).to_json()).leader is None
    for bad in (b"{", b"[]", b'{"leader": "a"}', rec(isr=("a", "z")).to_json(), rec(replicas=("a", "a")).to_json()):
        with pytest.raises(RC.RecordError):
            RC.PartitionRecord.from_json(bad)


ROLES = [
    (rec(), "a", 10, "lead"),
    (rec(), "a", 25, "reclaim"),  # names an earlier process of this node
    (rec(), "b", 11, "follow"),
    (rec(replicas=("a", "b", "c")), "d", 12, "none"),
]


@pytest.mark.parametrize("record, me, inc, role", ROLES)
def test_role(record, me, inc, role):
    assert RC.role(record, me, inc) == role


ELECTIONS = [
    # (record, candidate, its incarnation, live nodes, has replica, min_insync, new record or None)
    ("leader gone", rec(), "b", 11, {"b": 11, "c": 12}, True, 2, rec("b", 11, 4, ("b", "c"))),
    ("leader alive", rec(), "b", 11, {"a": 10, "b": 11}, True, 2, None),
    ("leader restarted: its new process decides", rec(), "b", 11, {"a": 30, "b": 11}, True, 2, None),
    ("not in the ISR: no unclean election", rec(isr=("a", "c")), "b", 11, {"b": 11}, True, 1, None),
    ("no replica on disk", rec(), "b", 11, {"b": 11}, False, 1, None),
    ("a stale process of the candidate", rec(), "b", 11, {"b": 20}, True, 1, None),
    ("no leader", rec(None, 0), "c", 12, {"c": 12}, True, 2, rec("c", 12, 4)),
    ("restarted leader takes it again", rec(), "a", 30, {"a": 30}, True, 2, rec("a", 30, 4)),
    ("the lost leader stays when the rest is below min_insync", rec(isr=("a", "b")), "b", 11, {"b": 11}, True, 2,
     rec("b", 11, 4, ("a", "b"))),
]


@pytest.mark.parametrize("case", ELECTIONS, ids=lambda c: c[0])
def test_election(case):
    _, record, cand, inc, live, has_replica, min_insync, expect = case
    txn = RC.election(PFX, "a", record, 77, cand, inc, live, has_replica, min_insync)
    if expect is None:
        assert txn is None
        return
    assert txn.record == expect and txn.key == "/wrenmq/t/partitions/a"
    assert RC.Compare("/wrenmq/t/partitions/a", "mod", 77) in txn.compares
    if record.leader not in (None, cand):
        assert RC.Compare("/wrenmq/t/nodes/a", "create", 0) in txn.compares  # its lease ran out
    if record.leader == cand:
        assert RC.Compare(f"/wrenmq/t/nodes/{cand}", "create", inc) in txn.compares


def test_a_replaced_node_leaves_the_isr_and_gives_up_leadership():
    t = RC.leave_isr(PFX, "a", rec(), 5, "b")
    assert t.record == rec(isr=("a", "c"))
    t = RC.leave_isr(PFX, "a", rec(), 5, "a")
    assert t.record == rec(None, 0, 4, ("b", "c"))
    assert RC.leave_isr(PFX, "a", rec(isr=("a", "c")), 5, "b") is None


def test_isr_change_only_by_the_leader_of_that_epoch_and_process():
    assert RC.isr_change(PFX, "a", rec(), 5, "a", 10, 3, ("a", "b")).record == rec(isr=("a", "b"))
    assert RC.isr_change(PFX, "a", rec(), 5, "a", 10, 2, ("a", "b")) is None  # an older epoch
    assert RC.isr_change(PFX, "a", rec(), 5, "a", 9, 3, ("a", "b")) is None  # an older process
    assert RC.isr_change(PFX, "a", rec(), 5, "b", 11, 3, ("a", "b")) is None
    assert RC.isr_change(PFX, "a", rec(), 5, "a", 10, 3, ("b", "c")) is None  # without the leader
    assert RC.isr_change(PFX, "a", rec(replicas=("a", "b", "c")), 5, "a", 10, 3, ("a", "d")) is None


def test_replicas_grow_with_the_least_loaded_live_nodes():
    r = rec(isr=("a",), replicas=("a",))
    load = RC.replica_load([r, rec(replicas=("b", "c", "d")), rec(replicas=("c", "d", "e"))])
    assert load == {"a": 1, "b": 1, "c": 2, "d": 2, "e": 1}
    t = RC.grow_replicas(PFX, "a", r, 5, "a", 10, 3, {"a": 10, "b": 11, "c": 12, "d": 13, "e": 14}, load)
    assert t.record.replicas == ("a", "b", "e") and t.record.isr == ("a",)
    assert RC.grow_replicas(PFX, "a", rec(), 5, "a", 10, 3, {"d": 1}, load) is None


def test_handover_and_reassign():
    r = rec(leader="b", inc=11)
    assert RC.wants_handover(r, "a", {"a": 30, "b": 11})
    assert not RC.wants_handover(r, "a", {"b": 11})
    assert not RC.wants_handover(rec(leader="b", inc=11, isr=("b", "c")), "a", {"a": 30})
    t = RC.handover(PFX, "a", r, 5, "b", 11, "a", {"a": 30, "b": 11})
    assert t.record == rec("a", 30, 4) and RC.Compare("/wrenmq/t/nodes/a", "create", 30) in t.compares
    t = RC.reassign(PFX, "a", rec(), 5, "a", "d", {"b": 11, "d": 14})
    assert t.record == rec(None, 0, 4, ("b", "c"), ("d", "b", "c"))
    assert RC.reassign(PFX, "a", rec(), 5, "a", "d", {"a": 10, "d": 14}) is None  # not lost
