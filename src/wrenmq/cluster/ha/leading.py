"""A partition this process leads: its ReplicatedStore, its PartitionLeader, and the
broker that runs on them.

The leader's store is a `ReplicatedStore` on the partition's files (the node's data dir
for its own partition, `replicas/<P>/` for one it took over). Its writer reports each
write (`on_appended`: followers may fetch it) and each local sync (`on_local_durable`);
the leader state machine turns the followers' fetches into the high watermark, and the
store releases the broker's held output (PUBACK, PUBREC, deliveries...) once the HW has
passed what it waits for (`commit`). A commit happens only while this process's lease
surely holds (Control.lease_ok): a leader that cannot tell stops acknowledging.

The broker starts once everything the log held when this leadership began is committed
(`hw >= epoch_start`) and its state records applied: its sessions, retained messages
and marks are then exactly what any earlier leader may have acknowledged. For the
node's own partition that broker is the node's (with its listeners); for a partition
taken over from a lost node it is a broker for that node, hosted in this process
(hosting.py). It stops when the leadership ends: fenced (a higher epoch, the lease in
doubt: its clients are told to use another server, and what it held is dropped), or
handed back to the partition's own node (a clean stop, everything committed first).
"""

import asyncio
import logging
import time

from ...mqtt import constants as C
from ...store.format import CorruptBatch
from ...store.reader import LogRangeError
from ...store.replicated import ReplicatedStore, write_epochs_file
from .. import replication as R
from .. import replication_frames as RF
from .following import load_epochs
from .wire import DATA_BYTES, SNAPSHOT_CHUNK, read_batches

log = logging.getLogger("wrenmq.cluster.ha")

_generations = iter(range(1, 1 << 62))


def _now():
    return time.monotonic() * 1000


class Leading:
    """Leads `partition` at the epoch of `record` for the manager, with its files in the
    data dir of `config` (a Config whose storage.data_dir is the partition's directory)."""

    def __init__(self, manager, partition, record, config):
        self.manager = manager
        self.partition = partition
        self.epoch = record.epoch
        self.config = config
        cfg = manager.cluster_cfg
        self.store = store = ReplicatedStore(config, leader_epoch=record.epoch, on_appended=self._appended,
                                             on_local_durable=self._local_durable, on_log_start=self._log_start)
        self.generation = next(_generations)
        self.core = R.PartitionLeader(
            partition, manager.node, record.epoch, record.isr, record.replicas, cfg.min_insync,
            load_epochs(store.load_epochs(), store.next_offset), log_start=store.start_offset,
            log_end=store.next_offset, durable_end=store.local_durable_end, hw=store.hw, now=_now(),
            lag_ms=cfg.replica_lag_ms, heartbeat_ms=cfg.replica_heartbeat_ms)
        self.links = {}  # follower -> the ServeLink its last fetch came on
        self.fetched_at = {}  # follower -> monotonic time of its last fetch in this epoch
        self.broker = None
        self.state = "waiting"  # "starting", "serving", "handing" (stopped for a handover), "stopped"
        self.store_open = True  # (closed by the broker's stop, or by close())
        self.store_running = False
        self.fenced = False
        self.accepting = None  # what the broker's router was last told
        self.handing_since = None
        self.task = None
        self.stopped = asyncio.get_running_loop().create_future()
        log.info("cluster: partition %s: leading epoch %d (log %d-%d, committed to %d, in sync %s)", partition,
                 record.epoch, store.start_offset, store.next_offset, self.core.hw, ",".join(record.isr))
        self.do(self.core.start())

    # --- the store's callbacks (on the loop) ------------------------------------------------

    def _appended(self, end):
        if not self.fenced:
            self.do(self.core.local_appended(end, _now()))

    def _local_durable(self, end):
        if not self.fenced:
            self.do(self.core.local_durable(end, _now()))

    def _log_start(self, start):
        if not self.fenced:
            self.do(self.core.log_start_moved(start))

    # --- decisions ------------------------------------------------------------------------------

    def do(self, decisions):
        for d in decisions:
            kind = type(d)
            if kind is R.SendData:
                self._send_data(d)
            elif kind is R.Send:
                link = self.links.get(d.to)
                if link is not None:
                    link.send(d.frame)
            elif kind is R.HighWatermark:
                self._commit(d.hw)
            elif kind is R.ProposeIsr:
                self.manager.propose_isr(self, d)
            elif kind is R.SaveEpochs:
                if self.store_running:
                    self.store.save_epochs(d.text)
                else:
                    write_epochs_file(self.store.log_dir, d.text)
            elif kind is R.SendSnapshot:
                self._send_snapshot(d)
            elif kind is R.Fenced:
                self.fence(f"a follower knows epoch {d.epoch}")
                self.manager.refresh_metadata()
            else:
                raise AssertionError(f"a leader's decision {d}")
        if self.state == "waiting" and not self.fenced and self.core.hw >= self.core.epoch_start:
            self.manager.ready_to_serve(self)
        elif self.state == "serving":
            self.check_accepting()

    def _commit(self, hw):
        if self.fenced:
            return
        if not self.manager.control.lease_ok():
            self.fence("this process's etcd lease may have run out")
            return
        if self.store_running:
            self.store.commit(hw)

    def fetched(self, link, fetch):
        follower = link.hello.follower
        self.links[follower] = link
        self.fetched_at[follower] = time.monotonic()
        self.do(self.core.on_fetch(follower, fetch, _now()))

    def _send_data(self, d):
        link = self.links.get(d.follower)
        if link is None or not link.open:
            return
        if d.start >= d.end:
            link.send(RF.Data(self.partition, d.epoch, d.incarnation, d.seq, d.hw, []))
            return
        raw = self.store.recent_batches(d.start, d.end, DATA_BYTES)
        if raw is not None:  # (a follower at the log end: what the writer just wrote)
            self._send_batches(link, d, raw)
            return
        fut = self.manager.reads.submit(read_batches, self.store.log_dir, self.generation, d.start, d.end, DATA_BYTES)
        asyncio.wrap_future(fut).add_done_callback(lambda f: self._data_read(f, link, d))

    def _data_read(self, fut, link, d):
        try:
            raw = fut.result()
        except (LogRangeError, CorruptBatch, OSError) as e:
            log.warning("cluster: partition %s: reading offsets %d-%d for %s failed: %s", self.partition, d.start,
                        d.end, d.follower, e)
            return
        self._send_batches(link, d, raw)

    def _send_batches(self, link, d, raw):
        if link.open and not self.fenced:
            link.send(RF.Data(self.partition, d.epoch, d.incarnation, d.seq, d.hw,
                              [RF.Batch(b.base, b.epoch, b.count, b.data) for b in raw]))

    def _send_snapshot(self, d):
        link = self.links.get(d.follower)
        if link is None or not self.store_running:
            return  # (the follower asks again; a leader whose broker runs has a writer to take it)
        log.info("cluster: partition %s: sending %s a state snapshot (its fetch is below the log start %d)",
                 self.partition, d.follower, self.store.start_offset)
        fut = asyncio.wrap_future(self.store.snapshot())
        fut.add_done_callback(lambda f: self._snapshot_taken(f, link, d))

    def _snapshot_taken(self, fut, link, d):
        try:
            applied, data = fut.result()
        except Exception as e:
            log.warning("cluster: partition %s: the state snapshot failed: %s", self.partition, e)
            return
        start = self.store.start_offset
        if not link.open or self.fenced or applied < start:
            return
        total = len(data)
        at = 0
        while True:
            chunk = data[at:at + SNAPSHOT_CHUNK]
            last = at + len(chunk) >= total
            link.send(RF.Snapshot(self.partition, d.epoch, d.incarnation, d.seq, start, applied, total, at, last,
                                  bytes(chunk)))
            at += len(chunk)
            if last:
                return

    # --- in sync, for the refusal of QoS 1/2 PUBLISHes --------------------------------------

    def insync_now(self):
        """Replicas of the in-sync set (the leader included) that are in sync now: the leader,
        and each other member whose fetches came within replica_lag_ms. (The in-sync set in
        etcd never shrinks below min_insync, so a member lost keeps its place there.)"""
        lag = self.manager.cluster_cfg.replica_lag_ms / 1000
        now = time.monotonic()
        fetched = self.fetched_at
        return sum(1 for m in self.core.isr
                   if m == self.manager.node or now - fetched.get(m, float("-inf")) <= lag)

    def check_accepting(self):
        """Tell the broker's router whether QoS 1/2 PUBLISHes may be logged now."""
        ok = (not self.fenced and self.core.accepting
              and self.insync_now() >= self.manager.cluster_cfg.min_insync)
        broker = self.broker
        if broker is not None and self.state == "serving" and ok != self.accepting:
            self.accepting = ok
            if not ok:
                log.warning("cluster: partition %s: fewer than min_insync (%d) replicas in sync (%s of %s): "
                            "refusing QoS 1/2 PUBLISHes", self.partition, self.manager.cluster_cfg.min_insync,
                            self.insync_now(), ",".join(self.core.isr))
            else:
                log.info("cluster: partition %s: enough replicas in sync again: taking QoS 1/2 PUBLISHes",
                         self.partition)
            broker.router.set_insync_low(not ok)

    def tick(self):
        if not self.fenced:
            self.do(self.core.tick(_now()))
            self.check_accepting()

    # --- the broker -----------------------------------------------------------------------------

    async def start_broker(self, broker):
        """Start `broker` (made for this partition) on the store: once everything the log held
        at the start of this epoch is committed, its state applied first."""
        self.state = "starting"
        store = self.store
        store.apply_through(self.core.hw)
        broker.store = store
        try:
            await broker.start()
        except BaseException:
            self.state = "stopped"
            self.store_open = False  # (a failed start closes the store)
            self._done()
            raise
        self.broker = broker
        self.store_running = True
        if self.fenced:
            await self._stop_broker(discard=True)
            return
        self.state = "serving"
        self.accepting = None
        self.check_accepting()
        if self.manager.control.lease_ok():
            store.commit(self.core.hw)
        log.info("cluster: partition %s: serving (epoch %d, log %d-%d)", self.partition, self.epoch,
                 store.start_offset, store.next_offset)

    def fence(self, why):
        """Stop acknowledging now (no commit from here on), then stop the broker: its clients
        are told to use another server, and the output it held is dropped."""
        if self.fenced:
            return
        self.fenced = True
        self.core.fenced(self.epoch + 1)
        log.warning("cluster: partition %s: no longer leading epoch %d (%s)", self.partition, self.epoch, why)
        if self.task is None or self.task.done():
            self.task = asyncio.get_running_loop().create_task(self._stop_broker(discard=True))

    def hand_over(self):
        """Stop the broker cleanly (its output released as it commits), keep serving fetches
        until the new leader has everything: then the manager runs the handover."""
        if self.task is None and not self.fenced:
            self.state = "handing"
            self.handing_since = time.monotonic()
            self.task = asyncio.get_running_loop().create_task(self._stop_broker(discard=False))

    async def _stop_broker(self, discard):
        while self.state == "starting":
            await asyncio.sleep(0.05)
        broker = self.broker
        if broker is not None and self.store_running:
            cluster = broker.cluster
            if discard and cluster is not None and cluster.gate is not None:
                cluster.gate.discard()
            # A clean stop goes on committing while the broker stops (what it holds, for its
            # clients and for the other nodes, goes out as the HW passes it).
            await broker.stop(C.USE_ANOTHER_SERVER if discard else C.SERVER_SHUTTING_DOWN, discard_held=discard)
            self.store_running = False
            self.store_open = False
            self.broker = None
        if discard or self.state != "handing":
            self.close()

    def close(self):
        """Done with the partition's files (they become a follower's, or nobody's)."""
        if self.store_open:
            self.store_open = False
            if self.broker is None:
                self.store.close()
        self.state = "stopped"
        self._done()

    def _done(self):
        if not self.stopped.done():
            self.stopped.set_result(None)

    def figures(self):
        core = self.core
        replicas = {}
        for m in core.replicas:
            pos = core.durable_end if m == self.manager.node else (core.position(m) or (None, None))[1]
            replicas[m] = {"end": pos, "lag": None if pos is None else max(0, core.log_end - pos)}
        return {"leader": self.manager.node, "epoch": self.epoch, "hw": core.hw, "log_start": core.log_start,
                "log_end": core.log_end, "isr": list(core.isr), "replicas": replicas, "state": self.state,
                "in_sync_now": self.insync_now(), "accepting": bool(self.accepting)}
