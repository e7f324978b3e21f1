"""The replication core's decisions carried out by the stores: the I/O layer, in miniature.

The sans-IO leader and follower (cluster/replication.py) decide; here the test does what
the cluster's I/O layer will do with their decisions, against a real ReplicatedStore and
a real ReplicaLog (their writer threads, their files), with every frame encoded and
decoded on the way. No network: the frames go from one state machine to the other
in-process. It shows the storage API fits the decisions: Append, Truncate, SaveEpochs,
SendData, the snapshot steps, HighWatermark, and the local_appended / local_durable /
log_start_moved inputs.
"""

import asyncio
import sqlite3
import time

from wrenmq.cluster import replication as R
from wrenmq.cluster import replication_frames as F
from wrenmq.cluster.replication_epochs import LeaderEpochs
from wrenmq.config import load
from wrenmq.store import state as S
from wrenmq.store.format import encode_batch
from wrenmq.store.reader import LogReader
from wrenmq.store.replica import ReplicaLog, replica_dir
from wrenmq.store.replicated import ReplicatedStore

T0 = 1_750_000_000_000_000
TABLES = ("sessions", "subscriptions", "retained", "qos2_in", "outgoing", "meta")
CHUNK = 3000  # snapshot chunk and fetch size: several of each


def config(data_dir, extra=""):
    cfg = load(text=f"[storage]\nfsync = 'always'\n{extra}")
    cfg.storage.data_dir = str(data_dir)
    return cfg


def tables(path):
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in TABLES}
    finally:
        conn.close()


def now():
    return time.monotonic() * 1000


class Wiring:
    """Leader "a" (a ReplicatedStore) and follower "b" (a ReplicaLog) of partition "a",
    their state machines, and the decisions of each carried out in order."""

    def __init__(self, store, leader_sm, replica, follower_sm):
        self.store, self.leader, self.replica, self.follower = store, leader_sm, replica, follower_sm
        self.released = []
        store.on_durable = self.released.append
        store.on_appended = lambda end: self.lead(self.leader.local_appended(end, now()))
        store.on_local_durable = lambda end: self.lead(self.leader.local_durable(end, now()))
        store.on_log_start = lambda start: self.lead(self.leader.log_start_moved(start))
        replica.on_durable = lambda end: self.follow(self.follower.local_durable(end, now()))
        replica.on_log_start = lambda start: self.follow(self.follower.log_start_moved(start))
        self.reader = store.raw_reader()
        self.tasks = set()
        self.seen = set()  # kinds of decisions carried out

    def lead(self, decisions):
        for d in decisions:
            self.seen.add(type(d).__name__)
            if isinstance(d, R.Send):
                self.to_follower(d.frame)
            elif isinstance(d, R.SendData):
                raw = self.reader.batches(d.start, d.end, CHUNK) if d.start < d.end else []
                self.to_follower(F.Data("a", d.epoch, d.incarnation, d.seq, d.hw, [F.Batch(*b) for b in raw]))
            elif isinstance(d, R.SendSnapshot):
                task = asyncio.ensure_future(self.send_snapshot(d))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif isinstance(d, R.HighWatermark):
                self.store.commit(d.hw)
            elif isinstance(d, R.SaveEpochs):
                self.store.save_epochs(d.text)
            elif isinstance(d, R.ProposeIsr):
                pass  # (the ISR stays as it is here)
            else:
                raise AssertionError(f"leader decision {d}")

    async def send_snapshot(self, d):
        applied, data = await asyncio.wrap_future(self.store.snapshot())
        start = self.store.start_offset
        for at in range(0, len(data), CHUNK):
            self.to_follower(F.Snapshot("a", d.epoch, d.incarnation, d.seq, start, applied, len(data), at,
                                        at + CHUNK >= len(data), data[at:at + CHUNK]))

    def follow(self, decisions):
        for d in decisions:
            self.seen.add(type(d).__name__)
            if isinstance(d, R.Send):
                fetch = F.decode_frame(F.encode(d.frame))
                self.lead(self.leader.on_fetch("b", fetch, now()))
            elif isinstance(d, R.Append):
                self.replica.append(d.batches)
            elif isinstance(d, R.Truncate):
                self.replica.truncate(d.offset)
            elif isinstance(d, R.SaveEpochs):
                self.replica.save_epochs(d.text)
            elif isinstance(d, R.HighWatermark):
                self.replica.apply_through(d.hw)
            elif isinstance(d, R.BeginSnapshot):
                self.replica.begin_snapshot(d.total)
            elif isinstance(d, R.WriteSnapshot):
                self.replica.write_snapshot(d.offset, d.data)
            elif isinstance(d, R.InstallSnapshot):
                self.replica.install_snapshot(None, d.applied_through, d.log_start)
            else:
                raise AssertionError(f"follower decision {d}")

    def to_follower(self, frame):
        frame = F.decode_frame(F.encode(frame))
        handler = {F.Data: self.follower.on_data, F.Diverged: self.follower.on_diverged,
                   F.Snapshot: self.follower.on_snapshot, F.Fenced: self.follower.on_fenced}[type(frame)]
        self.follow(handler("a", frame, now()))

    async def settle(self, what, pred, timeout=30):
        deadline = time.monotonic() + timeout
        while not pred():
            assert time.monotonic() < deadline, f"timed out: {what}"
            self.lead(self.leader.tick(now()))
            self.follow(self.follower.tick(now()))
            await asyncio.sleep(0.005)


async def write_epoch(store, i):
    off = store.append_record(T0 + i, 1, False, b"t/%d" % i, "dev", b"", b"m%d" % i)
    store.op(S.SUB_UPSERT, ("dev", f"f/{i}", 1, 0, 0, 0, None, off))
    store.op(S.QOS2_IN_ADD, ("dev", i + 1))
    eid = store.seal()
    while store.local_durable_end < store.next_offset:
        await asyncio.sleep(0.002)
    return eid


def leader_of(store, epoch, epochs):
    sm = R.PartitionLeader("a", "a", epoch, ("a", "b"), ("a", "b"), 2, epochs, log_start=store.start_offset,
                           log_end=store.next_offset, durable_end=store.local_durable_end, hw=store.hw, now=now(),
                           lag_ms=60_000, heartbeat_ms=50)
    return sm


def follower_of(replica):
    text = replica.load_epochs()
    epochs = LeaderEpochs.from_text(text) if text else LeaderEpochs()
    epochs.truncate_from_end(replica.log_end)
    return R.PartitionFollower("a", "b", 1, epochs, log_start=replica.log_start, log_end=replica.log_end,
                               durable_end=replica.durable_end, hw=replica.applied_through, fetch_timeout_ms=2000)


def test_an_empty_follower_of_a_log_past_zero_catches_up_by_snapshot_and_fetches(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        extra = "[log]\nsegment_bytes = 4096\nretention_bytes = 6000\n"
        store = ReplicatedStore(config(tmp_path / "a", extra), leader_epoch=1)
        store.start(loop)
        epochs = LeaderEpochs()
        epochs.assign(1, 0)
        store.save_epochs(epochs.to_text())
        for i in range(40):
            await write_epoch(store, i)
        # Committed alone first (min_insync 1 then), and retention moved the log start.
        store.commit(store.next_offset)
        while store.applied_through < store.next_offset:
            await asyncio.sleep(0.002)
        store.request_retention(store.next_offset)
        while store.start_offset == 0:
            await asyncio.sleep(0.002)
        replica = ReplicaLog(replica_dir(tmp_path / "b", "a"), "a", config(tmp_path / "b", extra),
                             log_id=store.log_id)
        leader = leader_of(store, 1, LeaderEpochs.from_text(store.load_epochs()))
        follower = follower_of(replica)
        w = Wiring(store, leader, replica, follower)
        replica.start(loop)
        w.lead(leader.start())
        w.follow(follower.leader_changed("a", 1, now()))
        for i in range(40, 50):
            released = await write_epoch(store, i)
        await w.settle("the follower in sync", lambda: replica.applied_through == store.next_offset
                       and store.applied_through == store.next_offset and w.released[-1:] == [released])
        assert {"SendSnapshot", "BeginSnapshot", "WriteSnapshot", "InstallSnapshot", "Append", "SendData",
                "HighWatermark"} <= w.seen
        assert replica.log_start == store.start_offset > 0
        assert tables(replica.db_path) == tables(store.db.path)
        store.close()
        replica.close()

    asyncio.run(main())


def test_a_follower_truncates_the_tail_the_new_leader_never_had(tmp_path):
    async def main():
        loop = asyncio.get_running_loop()
        store = ReplicatedStore(config(tmp_path / "a"), leader_epoch=1)
        store.start(loop)
        epochs = LeaderEpochs()
        for i in range(6):
            await write_epoch(store, i)
        epochs.assign(1, 0)
        store.save_epochs(epochs.to_text())
        # The follower holds the same epoch-1 log, and more of it that the old leader
        # wrote but this leader (the one of epoch 2) never got.
        replica = ReplicaLog(replica_dir(tmp_path / "b", "a"), "a", config(tmp_path / "b"), log_id=store.log_id)
        replica.start(loop)
        end = store.next_offset
        replica.append(store.raw_reader().batches(0, end, 1 << 20))
        lost = encode_batch(end, [T0] * 3, [1] * 3, [b"lost"] * 3, [b"x"] * 3, [b""] * 3, [b"never acked"] * 3,
                            [0] * 3, 0, 1)
        replica.append([F.Batch(end, 1, 3, lost)])
        replica.save_epochs(epochs.to_text())
        await asyncio.wrap_future(replica.flush())
        assert replica.log_end == end + 3
        begins = store.set_leader_epoch(2)
        leader = leader_of(store, 2, LeaderEpochs.from_text(store.load_epochs()))
        follower = follower_of(replica)
        w = Wiring(store, leader, replica, follower)
        w.lead(leader.start())
        w.follow(follower.leader_changed("a", 2, now()))
        for i in range(6, 10):
            released = await write_epoch(store, i)
        await w.settle("the follower in sync", lambda: replica.applied_through == store.next_offset
                       and w.released[-1:] == [released])
        assert {"Truncate", "SaveEpochs", "Append", "HighWatermark"} <= w.seen
        await asyncio.wrap_future(replica.flush())
        store.close()
        replica.close()
        recs = list(LogReader(replica.log_dir).records())
        assert b"never acked" not in {r.payload for r in recs}
        assert [(r.offset, r.payload) for r in recs] == [(r.offset, r.payload) for r in
                                                          LogReader(store.log_dir).records()]
        assert replica.load_epochs() == store.load_epochs() == f"wrenmq-leader-epochs 1\n1 0\n2 {begins}\n"
        assert tables(replica.db_path) == tables(store.db.path)

    asyncio.run(main())
