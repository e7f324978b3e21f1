"""A replicated partition's storage: the leader's ReplicatedStore and a follower's ReplicaLog.

Real files, the stores' real writer threads and real asyncio loops; the replication
layer between them is played by the test, which carries batches from the leader's raw
reads to the follower and tells both the high watermark. A child process holding a
replicated store is killed with SIGKILL. No mocks.
"""

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from log_helpers import T0
from wrenmq.config import load
from wrenmq.store import state as S
from wrenmq.store.files import read_durable
from wrenmq.store.format import ATTR_STATE, encode_batch
from wrenmq.store.reader import LogReader, RawBatch
from wrenmq.store.replica import INSTALL_MARK, SNAPSHOT_TMP, ReplicaError, ReplicaLog, replica_dir
from wrenmq.store.replicated import ReplicatedStore
from wrenmq.store.store import Store

TABLES = ("sessions", "subscriptions", "retained", "qos2_in", "outgoing", "meta")


def config(data_dir, fsync="always", extra=""):
    cfg = load(text=f"[storage]\nfsync = '{fsync}'\n{extra}")
    cfg.storage.data_dir = str(data_dir)
    return cfg


def tables(db):
    """Every table's rows, read through a connection of its own (the store's writer thread
    may use the store's at the same time)."""
    conn = sqlite3.connect(f"file:{db.path}?mode=ro", uri=True)
    try:
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in TABLES}
    finally:
        conn.close()


async def until(pred, timeout=30.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def epoch_ops(i):
    """State operations of the i-th epoch: every kind of statement and parameter."""
    cid = f"dev-{i % 3}"
    ops = [
        (S.SESSION_UPSERT, (cid, 5, 3600 * i, None if i % 2 else "user", b"\x30will%d" % i, i, i * 10)),
        (S.SUB_UPSERT, (cid, f"fleet/{i}/#", i % 3, 0, 1, 0, i or None, 100 + i)),
        (S.RETAINED_SET, (f"r/{i % 4}", 1, b"\x00\xff" * (i + 1), b"", cid, 1.75e9 + i / 7, None)),
        (S.QOS2_IN_ADD, (cid, 1000 + i)),
        (S.OUT_SET, (cid, 50 + i, i, 2, 0, 0)),
    ]
    if i % 3 == 2:
        ops += [(S.SUB_DELETE, (f"dev-{(i - 1) % 3}", f"fleet/{i - 1}/#")), (S.QOS2_IN_DELETE, (cid, 999 + i)),
                (S.RETAINED_DELETE, ("r/0",)), (S.META_SET, ("marks", f"{{\"n\": {i}}}"))]
    return ops


async def write_epoch(store, i, records=3, qos=1):
    """One loop turn's worth: records, state operations, sealed, written on its own."""
    offsets = [store.append_record(T0 + i * 1000 + k, qos, False, b"fleet/%d/t" % i, f"dev-{i % 3}", b"",
                                   b"payload %d.%d" % (i, k)) for k in range(records)]
    for sql, params in epoch_ops(i):
        store.op(sql, params)
    eid = store.seal()
    await until(lambda: store.local_durable_end == store.next_offset, what="the epoch written")
    return eid, offsets, store.next_offset


async def replicate(leader, replica, reader, max_bytes=1500):
    """The replication layer's part: fetch from the replica's end until it has all the
    leader wrote; returns the batches carried."""
    carried = []
    while replica.log_end < leader.appended_end:
        batches = await asyncio.to_thread(reader.batches, replica.log_end, leader.appended_end, max_bytes)
        assert batches
        replica.append(batches)
        carried += batches
    await until(lambda: replica.durable_end == leader.appended_end, what="the replica durable")
    return carried


async def applied(replica, hw):
    replica.apply_through(hw)
    await asyncio.wrap_future(replica.flush())
    await until(lambda: replica.applied_through >= hw, what="the replica applied")


async def committed(leader, hw):
    leader.commit(hw)
    await until(lambda: leader.applied_through >= hw, what="the leader applied")


@pytest.mark.parametrize("fsync", ["always", "never"])
def test_the_replica_state_equals_the_leaders_after_both_apply_through_the_same_hw(tmp_path, fsync):
    async def main():
        loop = asyncio.get_running_loop()
        leader = ReplicatedStore(config(tmp_path / "a", fsync, extra="[log]\nsegment_bytes = 4096\n"),
                                 leader_epoch=2)
        leader.start(loop)
        ends = []
        for i in range(12):
            ends.append((await write_epoch(leader, i))[2])
        assert len(leader.log.segments) >= 2
        rdir = replica_dir(tmp_path / "b", leader.node_id)
        # (The same segment size: the replica rolls where the leader did.)
        replica = ReplicaLog(rdir, leader.node_id,
                             config(tmp_path / "b", fsync, extra="[log]\nsegment_bytes = 4096\n"), log_id=leader.log_id)
        replica.start(loop)
        carried = await replicate(leader, replica, leader.raw_reader())
        assert all(b.epoch == 2 for b in carried)
        # Nothing is applied before the HW says so, on either side.
        first = tables(leader.db)
        assert first["subscriptions"] == [] and tables(replica.db)["subscriptions"] == []
        # Nor does a reader of the files (the Spark source) get past what is committed,
        # whether the writes are fsynced or not.
        assert read_durable(leader.log_dir) == read_durable(replica.log_dir) == 0
        for hw in (ends[4], ends[11]):
            await committed(leader, hw)
            await applied(replica, hw)
            assert tables(replica.db) == tables(leader.db)
            assert replica.applied_through == leader.applied_through == hw
            assert read_durable(leader.log_dir) == read_durable(replica.log_dir) == hw
            assert LogReader(leader.log_dir).durable_end_offset == LogReader(replica.log_dir).durable_end_offset == hw
        state = tables(leader.db)
        assert {r[1] for r in state["subscriptions"]} == {f"fleet/{i}/#" for i in range(12) if i % 3 != 1}
        assert dict(state["meta"])["applied_through"] == str(ends[11])
        assert dict(state["meta"])["marks"] == '{"n": 11}'
        leader.close()
        replica.close()
        # The replica's log is the leader's, byte for byte, segment for segment.
        lead_dir, rep_dir = leader.log_dir, os.path.join(rdir, "log", leader.node_id)
        names = sorted(n for n in os.listdir(lead_dir) if n.endswith(".log"))
        for name in names:
            with open(os.path.join(lead_dir, name), "rb") as a, open(os.path.join(rep_dir, name), "rb") as b:
                assert a.read() == b.read(), name
        assert LogReader(rep_dir).verify() == []

    asyncio.run(main())


@pytest.mark.parametrize("fsync", ["always", "interval", "never"])
def test_output_is_released_in_order_only_once_the_hw_passes_it(tmp_path, fsync):
    async def main():
        released, appended, durable = [], [], []
        leader = ReplicatedStore(config(tmp_path, fsync), on_durable=released.append, on_appended=appended.append,
                                 on_local_durable=durable.append)
        leader.start(asyncio.get_running_loop())
        epochs = [await write_epoch(leader, i) for i in range(4)]
        ends = [e[2] for e in epochs]
        ids = [e[0] for e in epochs]
        # (Each durable as soon as written under "interval" and "never", once fsynced under "always".)
        assert appended == ends and durable == ends
        await asyncio.sleep(0.05)
        assert released == [] and leader.durable_id == 0  # written and fsynced, not committed
        leader.commit(ends[0] - 1)
        assert released == []
        leader.commit(ends[0])
        assert released == [ids[0]]
        leader.commit(ends[2] + 1)  # (inside the fourth: the third and the second go)
        assert released == [ids[0], ids[2]] and leader.durable_id == ids[2]
        leader.commit(ends[2] + 1)  # the same HW again: nothing more
        leader.commit(ends[3])
        assert released == ids[:1] + ids[2:]
        # An HW ahead of the local disk releases nothing until the epoch is durable here.
        leader.commit(ends[3] + 1000)
        at_release = []
        leader.on_durable = lambda eid: at_release.append((eid, leader.local_durable_end))
        leader.append_record(T0, 1, False, b"t", "c", b"", b"x")
        eid = leader.seal()
        assert at_release == []
        await until(lambda: at_release, what="the release")
        assert at_release == [(eid, ends[3] + 1)]
        leader.close()

    asyncio.run(main())


@pytest.mark.parametrize("fsync,segment_bytes", [("always", 1 << 20), ("interval", 1 << 20), ("never", 1 << 20),
                                                  ("always", 4096)])
def test_the_batches_just_written_are_on_the_loop_as_the_log_holds_them(tmp_path, fsync, segment_bytes):
    """A follower fetching at the leader's log end is answered from the batches the writer
    read back (recent_batches), not after a read in another thread: each written batch is
    there, byte for byte the log's, from the moment the loop hears it was written (also
    across segments: 4096-byte ones roll every few epochs here)."""
    async def main():
        seen = []
        leader = ReplicatedStore(config(tmp_path, fsync, f"[log]\nsegment_bytes = {segment_bytes}\n"),
                                 on_appended=lambda end: seen.append((end, leader.recent_batches(start, end, 1 << 20))))
        leader.start(asyncio.get_running_loop())
        reader = leader.raw_reader()
        start = leader.next_offset
        for i in range(12):
            start = leader.next_offset
            await write_epoch(leader, i, records=4)
        if segment_bytes == 4096:
            assert len(os.listdir(leader.log_dir)) > 6  # (segments rolled: .log, .index, .timeindex each)
        ends = [end for end, _ in seen]
        assert ends and ends[-1] == leader.appended_end
        for end, held in seen:
            assert held is not None, f"nothing held on the loop when the log was written up to {end}"
        held = leader.recent_batches(0, leader.appended_end, 1 << 20)
        assert held == reader.batches(0, leader.appended_end, 1 << 20)
        assert sum(b.count for b in held) == leader.appended_end
        # At most `max_bytes` (but one batch at least), none past `end`; a start inside a
        # batch or past the end is not held (the caller reads the log then).
        assert leader.recent_batches(0, leader.appended_end, 1) == held[:1]
        assert leader.recent_batches(0, held[1].base, 1 << 20) == held[:1]
        assert leader.recent_batches(held[1].base, leader.appended_end, 1 << 20) == held[1:]
        assert leader.recent_batches(1, leader.appended_end, 1 << 20) is None
        assert leader.recent_batches(leader.appended_end, leader.appended_end + 5, 1 << 20) is None
        leader.close()

    asyncio.run(main())


def test_a_commit_applies_exactly_the_state_records_below_it_among_batches_without_any(tmp_path):
    """Most epochs of a QoS 1 flood carry no state change: the writer knows which batches it
    wrote hold state records and moves past the others without reading their headers. At
    every HW, before and after a batch with state records, exactly the changes below it
    are applied; and a store opened again (headers it did not write) still applies them."""
    async def main():
        leader = ReplicatedStore(config(tmp_path))
        leader.start(asyncio.get_running_loop())
        ends, with_state = [], []
        for i in range(9):
            if i % 4 == 1:
                ends.append((await write_epoch(leader, i))[2])
                with_state.append(i)
            else:
                leader.append_record(T0 + i, 1, False, b"t", "c", b"", b"plain %d" % i)
                leader.seal()
                await until(lambda: leader.local_durable_end == leader.next_offset, what="the epoch written")
                ends.append(leader.next_offset)
        assert with_state == [1, 5]
        for k, hw in enumerate(ends[:5]):
            await committed(leader, hw)
            assert leader.applied_through == hw
            subs = {r[1] for r in tables(leader.db)["subscriptions"]}
            assert subs == {f"fleet/{i}/#" for i in with_state if i <= k}, (k, hw)
        leader.close()

        # Opened again, the log's batches are not this writer's: the state record above the
        # applied offset (epoch 5's) is found in the headers when the HW passes it.
        again = ReplicatedStore(config(tmp_path))
        again.start(asyncio.get_running_loop())
        assert again.applied_through == ends[4]
        await committed(again, ends[-1])
        assert {r[1] for r in tables(again.db)["subscriptions"]} == {"fleet/1/#", "fleet/5/#"}
        again.close()

    asyncio.run(main())


def test_the_brokers_reads_leave_state_records_out(tmp_path):
    async def main():
        leader = ReplicatedStore(config(tmp_path, fsync="never"))
        offsets = []
        for i in range(3):
            offsets += [leader.append_record(T0, 1, False, b"t/%d" % i, "c", b"", b"m%d.%d" % (i, k))
                        for k in range(2)]
            leader.op(S.QOS2_IN_ADD, ("c", i))
            leader.seal()
        states = [offsets[1] + 1, offsets[3] + 1, offsets[5] + 1]
        assert offsets == [0, 1, 3, 4, 6, 7] and states == [2, 5, 8]
        # From memory (the writer has not started), then from the files.
        for phase in ("memory", "files"):
            assert [r.offset for r in leader.read(0, 100)] == offsets, phase
            # A read that starts at a state record goes on with the next records: callers
            # (catch-up, replay) continue from the last offset they got plus one.
            assert [r.offset for r in leader.read(2, 100)] == offsets[2:], phase
            assert [r.offset for r in leader.read(5, 3)] == [6, 7], phase
            assert leader.read(8, 10) == [], phase
            # A limit counts the offsets looked at, state records included, where they come
            # from the files; `read_span` says where a reader following the log goes on
            # from: past the state records it looked at, never past a record not returned.
            assert [r.offset for r in leader.read(5, 1)] == ([6] if phase == "memory" else []), phase
            spans = {(0, 100): (offsets, 9), (5, 3): ([6, 7], 9 if phase == "memory" else 8), (8, 10): ([], 9), (9, 10): ([], 9),
                     (0, 2): ([0, 1], 2), (2, 1): (([3], 4) if phase == "memory" else ([], 3))}
            for (start, limit), (want, after) in spans.items():
                recs, got_after = leader.read_span(start, limit)
                assert ([r.offset for r in recs], got_after) == (want, after), (phase, start, limit)
            if phase == "memory":
                leader.start(asyncio.get_running_loop())
                await until(lambda: leader.written_through == 9)
                await asyncio.sleep(0)  # (the written epochs leave the store's tail)
                assert not leader._tail
        leader.close()
        r = LogReader(leader.log_dir)
        assert [x.offset for x in r.records()] == offsets
        assert [x.offset for x in r.records(private=True, state=True)] == list(range(9))
        assert [(x.offset, x.private, x.state) for x in r.records(private=True, state=True) if x.state] == \
            [(o, True, True) for o in states]

    asyncio.run(main())


CHILD = r"""
import asyncio, sys, time
from wrenmq.config import load
from wrenmq.store import state as S
from wrenmq.store.replicated import ReplicatedStore

async def main(data_dir):
    cfg = load(text="[storage]\nfsync = 'always'\n")
    cfg.storage.data_dir = data_dir
    st = ReplicatedStore(cfg)
    st.start(asyncio.get_running_loop())
    ends = []
    i = 0
    while True:  # until killed
        off = st.append_record(1_000_000 + i, 1, False, b"t", "c", b"", b"m%d" % i)
        st.op(S.SUB_UPSERT, ("c", "f/%d" % i, 1, 0, 0, 0, None, off))
        st.seal()
        while st.local_durable_end < st.next_offset:
            await asyncio.sleep(0.001)
        ends.append(st.next_offset)
        if i % 5 == 4 and len(ends) > 6:
            hw = ends[-6]  # the last five epochs stay uncommitted
            st.commit(hw)
            while st.applied_through < hw:
                await asyncio.sleep(0.001)
            print("applied", hw, flush=True)
        i += 1

asyncio.run(main(sys.argv[1]))
"""


def test_state_above_the_hw_is_not_applied_when_the_store_is_killed(tmp_path):
    """A process holding a replicated store commits an HW now and then and is killed with
    SIGKILL while it writes: its state database holds exactly the state records below the
    last HW it applied, whatever the log holds past it; those are applied when the caller
    says they are committed."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    reported = []
    try:
        for line in proc.stdout:
            reported.append(int(line.split()[1]))
            if len(reported) >= 8:
                break
        time.sleep(0.02)  # (killed mid-way through whatever comes next)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(reported) >= 8

    async def main():
        st = ReplicatedStore(config(tmp_path))
        applied = st.applied_through
        end = st.next_offset
        assert applied >= reported[-1] and applied < end - 5  # (five epochs of two records uncommitted)
        subs = st.db.conn.execute("SELECT since FROM subscriptions").fetchall()
        # Epoch i: a record at offset 2i, its state record at 2i + 1.
        assert sorted(s for (s,) in subs) == list(range(0, applied - 1, 2))
        assert st.apply_through(end) == end
        subs = st.db.conn.execute("SELECT since FROM subscriptions").fetchall()
        assert sorted(s for (s,) in subs) == list(range(0, end - 1, 2))
        assert st.db.meta()["applied_through"] == str(end)
        st.close()

    asyncio.run(main())


def test_apply_through_at_open_and_a_store_that_was_not_replicated(tmp_path):
    async def main():
        # A data dir a broker used without replication: everything in its database counts
        # as applied (its changes were applied as they were written).
        plain = Store(config(tmp_path))
        plain.start(asyncio.get_running_loop())
        plain.append_record(T0, 1, False, b"t", "c", b"", b"x")
        plain.op(S.QOS2_IN_ADD, ("c", 1))
        plain.seal()
        plain.close()
        # Not replicated: no state record, header fields 0, the operation applied at once.
        (b,) = list(LogReader(plain.log_dir).batches())
        assert (b.count, b.attrs, b.epoch) == (1, 0, 0)
        st = ReplicatedStore(config(tmp_path), leader_epoch=4)
        assert st.applied_through == st.hw == 1
        st.start(asyncio.get_running_loop())
        st.append_record(T0, 1, False, b"t", "c", b"", b"y")
        st.op(S.QOS2_IN_ADD, ("c", 2))
        st.seal()
        await until(lambda: st.local_durable_end == 3)
        st.close()
        st = ReplicatedStore(config(tmp_path), apply_through=3)
        assert st.applied_through == 3
        assert st.db.conn.execute("SELECT packet_id FROM qos2_in").fetchall() == [(1,), (2,)]
        st.close()
        batches = list(LogReader(st.log_dir).batches())
        assert [(x.base, x.count, x.attrs, x.epoch) for x in batches] == [(0, 1, 0, 0), (1, 2, ATTR_STATE, 4)]

    asyncio.run(main())


def test_the_meta_a_broker_reads_at_start_is_the_one_applied_at_a_takeover(tmp_path):
    """A follower applies state records only up to the HW it knew; a new leader applies the
    rest when it takes over (`apply_through`, before its broker starts). The META values
    the broker reads at start (the cluster's marks in the other nodes' logs, with which
    they resume their replays to it) are those of that apply: a mark the follower had
    applied would be older than the QoS 2 deliveries the sessions now hold in flight, and
    the other nodes would replay those messages to them once more."""
    def mark(offset):
        return json.dumps({"c": ["log-of-c", offset, "run-of-c"]})

    async def main():
        st = ReplicatedStore(config(tmp_path))
        st.start(asyncio.get_running_loop())
        st.append_record(T0, 2, False, b"fleet/1", "dev-1", b"", b"one")
        st.set_meta("cluster_applied", mark(558))
        st.seal()
        await until(lambda: st.local_durable_end == st.next_offset, what="the first epoch written")
        await committed(st, st.next_offset)
        st.append_record(T0 + 1000, 2, False, b"fleet/1", "dev-1", b"", b"two")
        st.op(S.OUT_SET, ("dev-1", 2, 238, 2, 0, 0))
        st.set_meta("cluster_applied", mark(571))
        st.seal()
        await until(lambda: st.local_durable_end == st.next_offset, what="the second epoch written")
        end = st.next_offset
        st.close()  # (the second epoch's state not applied: the HW did not pass it)

        taking_over = ReplicatedStore(config(tmp_path))
        assert json.loads(taking_over.meta_at_open["cluster_applied"])["c"][1] == 558
        assert taking_over.apply_through(end) == end
        assert json.loads(taking_over.meta_at_open["cluster_applied"])["c"][1] == 571
        assert taking_over.db.conn.execute("SELECT packet_id FROM outgoing").fetchall() == [(238,)]
        taking_over.close()

    asyncio.run(main())


def test_leader_epochs_go_into_batch_headers_and_the_history_is_saved(tmp_path):
    async def main():
        st = ReplicatedStore(config(tmp_path), leader_epoch=3)
        st.start(asyncio.get_running_loop())
        await write_epoch(st, 0)
        assert st.load_epochs() is None
        begins = st.set_leader_epoch(5)
        st.save_epochs("wrenmq-leader-epochs 1\n3 0\n5 %d\n" % begins)
        await write_epoch(st, 1)
        await asyncio.wrap_future(st.snapshot())  # (runs after what was queued before it)
        assert st.load_epochs() == "wrenmq-leader-epochs 1\n3 0\n5 %d\n" % begins
        got = st.raw_reader().batches(0, st.appended_end, 1 << 20)
        assert [(b.base, b.epoch) for b in got] == [(0, 3), (begins, 5)]
        st.close()

    asyncio.run(main())


def _bad_batches(leader_batches):
    good = leader_batches[0]
    flipped = bytearray(good.data)
    flipped[-9] ^= 1
    return [
        ([good._replace(data=bytes(flipped))], "damaged"),
        ([good._replace(count=good.count + 1)], "came as count"),
        ([good._replace(epoch=good.epoch + 1)], "came as count"),
        ([good._replace(data=good.data + b"\0" * 8)], "bytes, given"),
        (leader_batches[1:2], "does not follow the log end 0"),
        ([good, leader_batches[2]], "does not follow the log end"),
        ([good, good], "does not follow the log end"),
    ]


def test_the_replica_appends_only_the_leaders_batches_at_its_end(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        leader = ReplicatedStore(config(tmp_path / "a"), leader_epoch=1)
        leader.start(loop)
        for i in range(3):
            await write_epoch(leader, i)
        batches = leader.raw_reader().batches(0, leader.appended_end, 1)
        while batches[-1].base + batches[-1].count < leader.appended_end:
            last = batches[-1]
            batches += leader.raw_reader().batches(last.base + last.count, leader.appended_end, 1)
        assert len(batches) == 3
        replica = ReplicaLog(tmp_path / "r", "a", config(tmp_path / "b"))
        replica.start(loop)
        for bad, why in _bad_batches(batches):
            with pytest.raises(ReplicaError, match=why):
                replica.append(bad)
            assert replica.log_end == 0
        await asyncio.wrap_future(replica.flush())
        assert replica.log.end_offset == 0 and replica.durable_end == 0
        replica.append(batches)
        await until(lambda: replica.durable_end == leader.appended_end)
        leader.close()
        replica.close()

    asyncio.run(main())


def _batch(base, n, epoch, tag):
    return encode_batch(base, [T0] * n, [1] * n, [b"t"] * n, [b"c"] * n, [b""] * n,
                        [b"%s %d" % (tag, base + k) for k in range(n)], [0] * n, 0, epoch)


@pytest.mark.parametrize("fsync", ["always", "interval", "never"])
def test_truncation_then_a_new_leaders_batches(tmp_path, fsync):
    async def main():
        durable = []
        replica = ReplicaLog(tmp_path, "a", config(tmp_path, fsync), on_durable=durable.append)
        replica.start(asyncio.get_running_loop())
        old = [RawBatch(b, 1, 4, _batch(b, 4, 1, b"old")) for b in range(0, 20, 4)]
        replica.append(old)
        replica.save_epochs("wrenmq-leader-epochs 1\n1 0\n")
        await until(lambda: replica.durable_end == 20)
        assert durable == [20]
        replica.apply_through(8)
        with pytest.raises(ReplicaError, match="applied through 8"):
            replica.truncate(4)
        replica.truncate(12)  # (the new leader's epoch 2 begins at 12)
        replica.save_epochs("wrenmq-leader-epochs 1\n1 0\n")
        new = [RawBatch(b, 2, 4, _batch(b, 4, 2, b"new")) for b in range(12, 24, 4)]
        replica.append(new)
        replica.save_epochs("wrenmq-leader-epochs 1\n1 0\n2 12\n")
        await until(lambda: replica.durable_end == 24)
        await asyncio.wrap_future(replica.flush())
        assert durable == [20, 24]
        replica.close()
        got = [(r.offset, r.payload) for r in LogReader(replica.log_dir).records()]
        assert got == [(o, b"old %d" % o) for o in range(12)] + [(o, b"new %d" % o) for o in range(12, 24)]
        again = ReplicaLog(tmp_path, "a", config(tmp_path, fsync))
        assert (again.log_start, again.log_end, again.durable_end, again.applied_through) == (0, 24, 24, 8)
        assert again.load_epochs() == "wrenmq-leader-epochs 1\n1 0\n2 12\n"
        with pytest.raises(ReplicaError, match="below the log start|applied through"):
            again.truncate(7)
        again.close()

    asyncio.run(main())


def test_a_replica_dir_is_a_data_dir_a_broker_store_opens(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        leader = ReplicatedStore(config(tmp_path / "a"))
        leader.start(loop)
        for i in range(4):
            await write_epoch(leader, i)
        rdir = replica_dir(tmp_path / "b", leader.node_id)
        replica = ReplicaLog(rdir, leader.node_id, config(tmp_path / "b"), log_id=leader.log_id)
        replica.start(loop)
        await replicate(leader, replica, leader.raw_reader())
        end = leader.appended_end
        await committed(leader, end)
        await applied(replica, end)
        want = tables(leader.db)
        records = [(r.offset, r.payload) for r in leader.read(0, 1000)]
        leader.close()
        replica.close()
        with pytest.raises(ReplicaError, match="holds partition"):
            ReplicaLog(rdir, "other", config(tmp_path / "b"))
        with pytest.raises(ReplicaError, match="copy of log"):
            ReplicaLog(rdir, leader.node_id, config(tmp_path / "b"), log_id="0" * 32)
        # The failover: a broker's store started on the replica, as that node.
        hosted = ReplicatedStore(config(rdir), apply_through=end)
        assert (hosted.node_id, hosted.log_id, hosted.next_offset) == (leader.node_id, leader.log_id, end)
        assert tables(hosted.db) == want
        assert [(r.offset, r.payload) for r in hosted.read(0, 1000)] == records
        hosted.close()

    asyncio.run(main())


def test_snapshot_for_an_empty_follower_when_the_leaders_log_starts_past_zero(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        starts = []
        leader = ReplicatedStore(config(tmp_path / "a", extra="[log]\nsegment_bytes = 4096\nretention_bytes = 8192\n"),
                                 on_log_start=starts.append)
        leader.start(loop)
        for i in range(20):
            end = (await write_epoch(leader, i))[2]
        leader.request_retention(end)
        await asyncio.sleep(0.2)
        assert starts == []  # nothing is applied yet: retention keeps it all
        await committed(leader, end - 8)  # (the last two epochs stay uncommitted)
        leader.request_retention(end)
        await until(lambda: starts, what="retention")
        log_start = leader.log.start_offset
        assert 0 < log_start <= leader.applied_through and starts[-1] == log_start
        # The follower starts empty: below the leader's log start, so the state first.
        applied_at, data = await asyncio.wrap_future(leader.snapshot())
        assert applied_at == leader.applied_through
        for chunked in (False, True):
            rdir = tmp_path / f"r{int(chunked)}"
            replica = ReplicaLog(rdir, leader.node_id, config(rdir), log_id=leader.log_id)
            replica.start(loop)
            if chunked:
                replica.begin_snapshot(len(data))
                for at in range(0, len(data), 1000):
                    replica.write_snapshot(at, data[at:at + 1000])
                replica.install_snapshot(None, applied_at, log_start)
            else:
                replica.install_snapshot(data, applied_at, log_start)
            assert (replica.log_start, replica.log_end) == (log_start, log_start)
            await asyncio.wrap_future(replica.flush())
            assert replica.applied_through == applied_at and replica.durable_end == log_start
            # Then the log from the leader's start: the records below `applied_at` are not
            # applied again, the ones above are when the HW passes them.
            await replicate(leader, replica, leader.raw_reader())
            await committed(leader, end)
            await applied(replica, end)
            assert tables(replica.db) == tables(leader.db)
            replica.close()
            assert LogReader(os.path.join(rdir, "log", leader.node_id)).start_offset == log_start
        leader.close()

    asyncio.run(main())


def test_a_snapshot_install_a_crash_interrupted_completes_when_the_replica_opens(tmp_path):
    """The install's steps: the snapshot in a temporary file (fsynced), the install mark,
    the database replaced, the log emptied, the mark removed. A crash after the mark leaves
    what the next open completes; one before it, the old replica as it was."""
    async def main():
        leader = ReplicatedStore(config(tmp_path / "a"))
        leader.start(asyncio.get_running_loop())
        for i in range(3):
            end = (await write_epoch(leader, i))[2]
        await committed(leader, end)
        applied_at, data = await asyncio.wrap_future(leader.snapshot())
        want = tables(leader.db)
        leader.close()
        return applied_at, data, want

    applied_at, data, want = asyncio.run(main())
    for crash in ("before the mark", "after the mark", "after the database"):
        d = tmp_path / crash.replace(" ", "-")
        replica = ReplicaLog(d, "a", config(d))
        replica.log.append(_batch(0, 4, 1, b"old"), 0, 4, T0, T0)
        replica.close()
        with open(d / SNAPSHOT_TMP, "wb") as fh:
            fh.write(data)
        if crash != "before the mark":
            with open(d / INSTALL_MARK, "w") as fh:
                fh.write(f"{applied_at} {applied_at}\n")
        if crash == "after the database":
            os.replace(d / SNAPSHOT_TMP, d / "state.db")
        replica = ReplicaLog(d, "a", config(d))
        if crash == "before the mark":
            assert (replica.log_start, replica.log_end, replica.applied_through) == (0, 4, 0)
            assert not os.path.exists(d / SNAPSHOT_TMP)
        else:
            assert (replica.log_start, replica.log_end, replica.applied_through) == (applied_at,) * 3
            assert tables(replica.db)["subscriptions"] == want["subscriptions"]
            assert not os.path.exists(d / INSTALL_MARK) and not os.path.exists(d / SNAPSHOT_TMP)
        replica.close()


def test_a_snapshot_that_is_not_a_database_changes_nothing(tmp_path):
    async def main():
        errors = []
        replica = ReplicaLog(tmp_path, "a", config(tmp_path), on_error=errors.append)
        replica.start(asyncio.get_running_loop())
        replica.append([RawBatch(0, 1, 4, _batch(0, 4, 1, b"old"))])
        replica.install_snapshot(b"not a database" * 100, 10, 10)
        await until(lambda: errors, what="the error")
        assert "not a database" in str(errors[0])
        replica.close()
        again = ReplicaLog(tmp_path, "a", config(tmp_path))
        assert (again.log_start, again.log_end) == (0, 4)
        again.close()

    asyncio.run(main())


def test_state_records_are_the_last_record_of_their_epoch(tmp_path):
    async def main():
        st = ReplicatedStore(config(tmp_path))
        st.start(asyncio.get_running_loop())
        st.op(S.QOS2_IN_ADD, ("c", 7))  # an epoch of state operations only
        st.seal()
        await write_epoch(st, 1, records=2)
        st.close()
        recs = list(LogReader(st.log_dir).records(private=True, state=True))
        assert [(r.offset, r.state) for r in recs] == [(0, True), (1, False), (2, False), (3, True)]
        found = [o for b in LogReader(st.log_dir).batches() for o, _ in b.state_records()]
        assert found == [0, 3]
        assert S.decode_ops(recs[0].payload) == [(S.QOS2_IN_ADD, ("c", 7))]
        assert S.decode_ops(recs[3].payload) == epoch_ops(1)

    asyncio.run(main())
