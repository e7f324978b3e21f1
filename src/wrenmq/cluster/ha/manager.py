"""The process-level manager of the partitions: `Partitions`.

With `[cluster] replicas` > 1 `wrenmq serve` runs this instead of a broker (assemble.py).
It binds the node's link port (port.py), joins etcd for the partitions' records
(control.py: the key of this process gives its incarnation), and keeps one `Leading`
per partition this process leads (its own, and any it took over) and one `Following`
per partition it follows. From every change of the records, and on a tick, it works
out what this process is for each partition (`replication_control.role`) and does what
the rules say, in order: creates its own partition's record, takes a partition whose
leader's key is gone (only an in-sync follower may: `election`), takes its own back
after a restart (`reclaim`), gives up what it holds no replica of (`leave_isr`, before
anything is created), grows a partition's replicas to `replicas`, and hands a partition
back to its own node once that node is in sync again (`handover`, after the hosted
broker stopped cleanly and everything was committed).

The node's own broker runs only while this process leads the node's partition: after a
failover the node follows its own partition (on its own data dir) until it is in sync,
and starts its broker once the leadership is handed back.
"""

import asyncio
import itertools
import logging
import os
import shutil
import time

from .. import ClusterError
from .. import replication_control as RC
from .. import replication_frames as RF
from ...config import cluster_node_name
from ...store.replica import ReplicaError
from ...store.replicated import ReplicatedStore
from ..extension import ClusterExtension
from ..links import tls_contexts
from .control import Control
from .following import Following
from .hosting import hosted_broker, hosted_config, partition_dir
from .leading import Leading
from .port import LinkPort
from .services import NodeServices
from .wire import FetchLink, ServeLink, reader_pool

log = logging.getLogger("wrenmq.cluster.ha")

_TICK = 0.1  # seconds between ticks of the state machines
_DUTIES_EVERY = 1.0  # seconds between looks at every partition (growth, handovers, status)
_HANDOVER_GIVE_UP = 15.0  # seconds a handover may wait for its new leader to catch up
_STOP_COMMIT_WAIT = 5.0  # seconds a clean stop waits for its last records to be committed


class Partitions:
    """This process's part in the replicated partitions (module docstring). `start`,
    `stop`, `reload`, `serve_forever` and `failed` as a Broker has them;
    `make_own_broker(config, cluster)` builds the node's own broker (the assembly's) with
    `cluster`, the cluster extension to add."""

    def __init__(self, config, make_own_broker):
        self.config = config
        self.cluster_cfg = config.cluster
        self.cluster_name = config.cluster.name
        self.secret = config.cluster.secret
        self.node = cluster_node_name(config)
        self.make_own_broker = make_own_broker
        self.loop = None
        self.port = None
        self.tls_server = self.tls_client = None  # [cluster] tls: links.tls_contexts
        self.control = None
        self.advertise = None
        self.leaders = {}  # partition -> Leading
        self.followers = {}  # partition -> Following
        self.busy = {}  # partition -> a transition under way (a leadership ending)
        self.txns = {}  # partition -> [Txn, revision it compared, time sent, purpose, extra puts]
        self.isr_pending = {}  # partition -> (Txn, revision) of a leader's ISR proposal in flight
        self.handover_not_before = {}  # partition -> monotonic time
        self.fetch_seqs = itertools.count(1)  # one counter for every follower of this process
        self.reads = None
        self.serving = set()  # ServeLinks open
        self.failed = None
        self.stopping = False
        self._stopped = None
        self._ticker = None
        self._reconcile_due = False
        self._last_duties = 0.0
        self._status_sent = {}

    # --- lifecycle ---------------------------------------------------------------------

    @property
    def own(self):
        """The node's own broker while it runs (None otherwise)."""
        lead = self.leaders.get(self.node)
        return lead.broker if lead is not None else None

    async def start(self):
        """Bind the link port, join etcd; the own broker starts once this node leads its
        partition (at once on a new cluster). Raises ClusterError if etcd cannot be joined."""
        self.loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        cfg = self.cluster_cfg
        self.reads = reader_pool()
        if cfg.tls:
            self.tls_server, self.tls_client = tls_contexts(cfg)
        self.port = LinkPort(cfg, lambda: ServeLink(self), self.tls_server, self.config.limits.connect_timeout)
        port = await self.port.listen()
        self.advertise = cfg.advertise or f"{cfg.bind}:{port}"
        self.control = Control(cfg, self.node, self.advertise, self._changed, self._new_incarnation)
        try:
            await self.control.start()
        except BaseException:
            self.port.close()
            self.reads.shutdown(wait=False)
            raise
        self._ticker = self.loop.create_task(self._tick_loop())
        log.info("cluster %s: node %s takes part in the partitions (replicas %d, min_insync %d); link port %s",
                 self.cluster_name, self.node, cfg.replicas, cfg.min_insync, self.advertise)
        return self

    async def serve_forever(self):
        await self._stopped.wait()

    def fail(self, exc):
        """Something this process cannot go on without failed (its own broker's start)."""
        if self.failed is None:
            self.failed = exc
            log.critical("stopping: %s", exc)
            self._stopped.set()

    async def stop(self):
        """Stop cleanly: each broker stops (clients told the server is shutting down), what
        they wrote last is committed (up to a few seconds), then the lease is revoked: the
        in-sync followers take the partitions over at once."""
        if self.stopping:
            return
        self.stopping = True
        if self._ticker is not None:
            self._ticker.cancel()
        for lead in list(self.leaders.values()):
            lead.hand_over()
        for lead in list(self.leaders.values()):
            if lead.task is not None:
                try:
                    await lead.task
                except Exception:
                    log.exception("stopping partition %s's broker failed", lead.partition)
        deadline = time.monotonic() + _STOP_COMMIT_WAIT
        while time.monotonic() < deadline and any(
                not lead.fenced and lead.core.hw < lead.core.log_end for lead in self.leaders.values()):
            await asyncio.sleep(0.05)
        for lead in list(self.leaders.values()):
            lead.close()
        self.leaders.clear()
        for f in list(self.followers.values()):
            f.close()
        self.followers.clear()
        await self.control.stop()
        self.port.close()
        for link in list(self.serving):
            link.close()
        self.reads.shutdown(wait=False)
        self._stopped.set()
        log.info("cluster: node %s left the partitions", self.node)

    def reload(self):
        """SIGHUP: the own broker's hooks reload (a hosted broker has none)."""
        own = self.own
        if own is not None:
            own.hooks.reload()

    # --- etcd's view --------------------------------------------------------------------------

    def _changed(self):
        if not self._reconcile_due and self.loop is not None:
            self._reconcile_due = True
            self.loop.call_soon(self._reconcile_soon)

    def _reconcile_soon(self):
        self._reconcile_due = False
        self.reconcile()

    def _new_incarnation(self):
        """This process registered anew (its lease ran out): what it led, it leads no more
        (a new election decides), and its followers fetch under the new incarnation."""
        for lead in list(self.leaders.values()):
            lead.fence("this process's etcd lease ran out")
        for p, f in list(self.followers.items()):
            f.close()
            del self.followers[p]
        self._changed()

    def refresh_metadata(self):
        if self.control is not None and not self.stopping:
            self.loop.create_task(self.control.refresh())

    # --- what this process is for each partition ----------------------------------------------

    def reconcile(self):
        control = self.control
        if self.stopping or self.failed is not None or not control.lease_ok():
            return
        me = self.node
        records = control.records
        if me not in records and me not in self.txns and me not in self.leaders and me not in self.busy:
            self._create_own()
        for p in list(records):
            try:
                self._reconcile(p)
            except Exception:
                log.exception("cluster: partition %s: acting on its record failed", p)
        for p in [p for p in self.followers if p not in records]:
            self.followers.pop(p).close()

    def _reconcile(self, p):
        if p in self.busy:
            return
        control = self.control
        rec, mod = control.records[p]
        me = self.node
        role = RC.role(rec, me, control.incarnation)
        lead = self.leaders.get(p)
        if lead is not None and (role != "lead" or lead.epoch != rec.epoch or lead.state == "stopped"):
            self._end_leading(p, lead, "the partition's record moved on" if role != "lead" else "stopped")
            return
        now = time.monotonic() * 1000
        if role == "lead":
            if lead is None:
                if not self._has_replica(p):
                    self._txn(p, "leave", RC.leave_isr(control.prefix, p, rec, mod, me))
                    return
                self._become_leader(p, rec)
                return
            pending = self.isr_pending.get(p)
            if pending is not None and pending[1] != mod:
                del self.isr_pending[p]
                if set(rec.isr) != set(pending[0].record.isr):
                    lead.do(lead.core.isr_change_failed(now))
            lead.do(lead.core.isr_changed(rec.isr, rec.epoch, now, rec.replicas))
            self._leader_duties(p, lead, rec, mod)
        elif role == "reclaim":
            if self._has_replica(p) and me in rec.isr:
                self._txn(p, "reclaim", RC.election(control.prefix, p, rec, mod, me, control.incarnation,
                                                    control.live, True, self.cluster_cfg.min_insync))
            else:
                self._txn(p, "leave", RC.leave_isr(control.prefix, p, rec, mod, me))
        elif role == "follow":
            f = self.followers.get(p)
            if f is None:
                if not self._has_replica(p) and (me in rec.isr or rec.leader == me):
                    # An empty replacement: out of the in-sync set before anything is created,
                    # so it can never be elected on an empty log.
                    self._txn(p, "leave", RC.leave_isr(control.prefix, p, rec, mod, me))
                    return
                f = self._follow(p)
                if f is None:
                    return
            f.leader_changed(rec.leader, rec.epoch)
            if rec.leader is None or rec.leader not in control.live:
                self._txn(p, "elect", RC.election(control.prefix, p, rec, mod, me, control.incarnation,
                                                  control.live, True, self.cluster_cfg.min_insync))
        else:
            f = self.followers.pop(p, None)
            if f is not None:
                log.info("cluster: partition %s: this node is no longer one of its replicas", p)
                f.close()

    def _has_replica(self, p):
        if p == self.node:
            return os.path.isdir(os.path.join(os.path.abspath(self.config.storage.data_dir), "log", p))
        return os.path.isdir(partition_dir(self.config, p, self.node))

    def _create_own(self):
        """This node's partition has no record yet: create it, led by this node alone at
        epoch 0 (its followers are added as other nodes take part), with its log's id."""
        store = ReplicatedStore(self.config)
        log_id = store.log_id
        store.close()
        control = self.control
        txn = RC.create(control.prefix, self.node, self.node, control.incarnation)
        self._txn(self.node, "create", txn, ((control.log_key(self.node), log_id.encode()),))

    def _follow(self, p):
        directory = partition_dir(self.config, p, self.node)
        log_id = self.control.logs.get(p)
        try:
            f = Following(self, p, directory, log_id)
        except ReplicaError as e:
            if p == self.node:
                log.critical("cluster: partition %s: this node's data dir cannot follow it: %s", p, e)
                return None
            aside = f"{directory}.old-{int(time.time())}"
            log.warning("cluster: partition %s: the replica here is not one of it (%s); moved to %s", p, e, aside)
            shutil.move(directory, aside)
            return None
        except OSError as e:  # (its lock held: a leadership of it still closing)
            log.warning("cluster: partition %s: cannot open the replica: %s", p, e)
            return None
        self.followers[p] = f
        log.info("cluster: partition %s: following (log %d-%d, committed to %d)", p, f.replica.log_start,
                 f.replica.log_end, f.hw)
        return f

    def _become_leader(self, p, rec):
        f = self.followers.pop(p, None)
        if f is not None:
            f.close()
        config = self.config if p == self.node else hosted_config(self.config, p, partition_dir(self.config, p,
                                                                                                 self.node))
        try:
            lead = Leading(self, p, rec, config)
        except Exception as e:
            log.error("cluster: partition %s: cannot open its store to lead it: %s", p, e)
            return
        self.leaders[p] = lead

    def _end_leading(self, p, lead, why):
        lead.fence(why)

        async def ended():
            try:
                await lead.stopped
            finally:
                if self.leaders.get(p) is lead:
                    del self.leaders[p]
                self.busy.pop(p, None)
                self.isr_pending.pop(p, None)
                self._changed()

        self.busy[p] = self.loop.create_task(ended())

    # --- a leader's duties --------------------------------------------------------------------

    def ready_to_serve(self, lead):
        """`lead`'s HW passed everything its log held when it took over: start its broker."""
        if lead.task is not None or lead.state != "waiting" or self.stopping:
            return
        lead.state = "starting"
        p = lead.partition
        own = p == self.node
        cluster = ClusterExtension(lead.config.cluster, NodeServices(self, p, self.port if own else None))
        broker = self.make_own_broker(self.config, cluster) if own else hosted_broker(lead.config, cluster)
        lead.task = self.loop.create_task(self._start_broker(lead, broker, own))

    async def _start_broker(self, lead, broker, own):
        try:
            await lead.start_broker(broker)
        except Exception as e:
            if own:
                self.fail(e if isinstance(e, ClusterError) else ClusterError(f"the node's broker did not start: "
                                                                            f"{type(e).__name__}: {e}"))
            else:
                log.error("cluster: partition %s: its hosted broker did not start (%s: %s)", lead.partition,
                          type(e).__name__, e)
            return
        finally:
            if lead.state != "handing":
                lead.task = None
        if not own:
            log.info("cluster: node %s's broker hosted here (partition %s taken over)", lead.partition,
                     lead.partition)

    def propose_isr(self, lead, d):
        p = lead.partition
        now = time.monotonic() * 1000
        held = self.control.records.get(p)
        if held is None:
            lead.do(lead.core.isr_change_failed(now))
            return
        rec, mod = held
        control = self.control
        txn = RC.isr_change(control.prefix, p, rec, mod, self.node, control.incarnation, d.epoch, d.isr)
        if txn is None or p in self.txns or p in self.isr_pending or lead.state == "handing":
            lead.do(lead.core.isr_change_failed(now))
            return
        log.info("cluster: partition %s: in-sync set %s -> %s", p, ",".join(rec.isr), ",".join(d.isr))
        self.isr_pending[p] = (txn, mod)
        self._txn(p, "isr", txn)

    def _leader_duties(self, p, lead, rec, mod):
        control = self.control
        if rec.epoch != lead.epoch or p in self.txns or lead.fenced or not control.lease_ok():
            return
        cfg = self.cluster_cfg
        if len(rec.replicas) < cfg.replicas and lead.state != "handing":
            load = RC.replica_load(r for r, _ in control.records.values())
            txn = RC.grow_replicas(control.prefix, p, rec, mod, self.node, control.incarnation, cfg.replicas,
                                   control.live, load)
            if txn is not None:
                log.info("cluster: partition %s: replicas %s -> %s", p, ",".join(rec.replicas),
                         ",".join(txn.record.replicas))
                self._txn(p, "grow", txn)
                return
        if p == self.node or self.stopping:
            return
        core = lead.core
        pos = core.position(p)
        caught_up = pos is not None and pos[0] == control.live.get(p)
        if lead.state == "serving" and RC.wants_handover(rec, p, control.live) and p not in self.isr_pending \
                and time.monotonic() >= self.handover_not_before.get(p, 0) and caught_up and pos[1] >= core.hw:
            log.info("cluster: partition %s: its node is back and in sync: stopping its broker here to hand it "
                     "back", p)
            lead.hand_over()
            return
        if lead.state == "handing" and lead.broker is None and lead.task is not None and lead.task.done():
            if core.hw >= core.log_end and caught_up and pos[1] >= core.log_end:
                self._txn(p, "handover", RC.handover(control.prefix, p, rec, mod, self.node, control.incarnation, p,
                                                     control.live))
            elif time.monotonic() - lead.handing_since > _HANDOVER_GIVE_UP or p not in control.live:
                log.warning("cluster: partition %s: its node did not catch up; leading it here again", p)
                self.handover_not_before[p] = time.monotonic() + 2 * _HANDOVER_GIVE_UP
                lead.fence("the handover was given up")

    # --- etcd transactions ----------------------------------------------------------------------

    def _txn(self, p, purpose, txn, extra=()):
        if txn is None or p in self.txns:
            return
        held = self.control.records.get(p)
        t = self.txns[p] = [txn, held[1] if held is not None else 0, time.monotonic(), purpose, extra]
        self.loop.create_task(self._send_txn(p, t))

    async def _send_txn(self, p, t):
        txn, _, _, purpose, extra = t
        try:
            ok, revision = await self.control.transaction(txn, extra)
        except Exception as e:
            # Whether it applied is not known: it stays pending (the tick sends it again while
            # the record has not moved, or forgets it once it has).
            log.warning("cluster: partition %s: the %s transaction failed (%s: %s)", p, purpose,
                        type(e).__name__, e)
            return
        if self.txns.get(p) is t:
            del self.txns[p]
        if ok:
            rec = txn.record
            log.info("cluster: partition %s: %s: leader %s, epoch %d, in sync %s, replicas %s", p, purpose,
                     rec.leader, rec.epoch, ",".join(rec.isr), ",".join(rec.replicas))
        else:
            log.info("cluster: partition %s: the %s transaction found the record changed", p, purpose)
            await self.control.refresh()
        self._changed()

    def _txn_timeouts(self):
        now = time.monotonic()
        timeout = self.cluster_cfg.etcd_timeout + 1
        for p, t in list(self.txns.items()):
            if now - t[2] <= timeout:
                continue
            held = self.control.records.get(p)
            if t[3] in ("isr", "handover") and held is not None and held[1] == t[1]:
                t[2] = now  # the same compare: it applies at most once
                self.loop.create_task(self._send_txn(p, t))
            else:
                del self.txns[p]
                self._changed()

    # --- replication connections --------------------------------------------------------------

    def serve_link_up(self, link):
        self.serving.add(link)

    def serve_link_lost(self, link):
        self.serving.discard(link)

    def fetched(self, link, fetch):
        lead = self.leaders.get(fetch.partition)
        if lead is not None and not lead.fenced:
            lead.fetched(link, fetch)  # (its state machine answers a lower epoch FENCED, fences on a higher)
            return
        held = self.control.records.get(fetch.partition) if self.control is not None else None
        if held is not None and held[0].epoch > fetch.epoch:
            link.send(RF.Fenced(fetch.partition, held[0].epoch))

    def fenced_by(self, link, frame):
        lead = self.leaders.get(frame.partition)
        if lead is not None:
            lead.do(lead.core.on_fenced(link.hello.follower, frame, time.monotonic() * 1000))

    def fetch_link(self, partition, leader, address, epoch):
        return FetchLink(self, partition, leader, address, self.control.incarnation, epoch)

    def follower_frame(self, link, frame):
        f = self.followers.get(link.partition)
        if f is not None:
            f.received(link, frame)

    def client_tls(self, host):
        """create_connection's TLS arguments for a fetch link to `host` ([cluster] tls)."""
        if self.tls_client is None:
            return {}
        return {"ssl": self.tls_client, "server_hostname": host,
                "ssl_handshake_timeout": self.config.limits.connect_timeout}

    def replica_failed(self, p):
        f = self.followers.pop(p, None)
        if f is not None:
            f.closed = True

    # --- the tick ------------------------------------------------------------------------------

    async def _tick_loop(self):
        while True:
            await asyncio.sleep(_TICK)
            try:
                self._tick()
            except Exception:
                log.exception("cluster: the partitions' tick failed")

    def _tick(self):
        control = self.control
        if self.leaders and not control.lease_ok():
            for lead in list(self.leaders.values()):
                lead.fence("this process's etcd lease may have run out")
        for lead in list(self.leaders.values()):
            lead.tick()
        for f in list(self.followers.values()):
            f.tick()
        self._txn_timeouts()
        now = time.monotonic()
        if now - self._last_duties >= _DUTIES_EVERY:
            self._last_duties = now
            self.reconcile()
            self._write_status()

    def _write_status(self):
        for p, lead in self.leaders.items():
            if lead.fenced:
                continue
            figures = lead.figures()
            if self._status_sent.get(p) != figures:
                self._status_sent[p] = figures
                self.loop.create_task(self.control.put_status(p, figures))

    # --- for readers of the log ----------------------------------------------------------------

    def log_copies(self):
        """{partition: log directory} of the partitions this process leads or follows
        (NodeServices.log_copies)."""
        out = {p: f.replica.log_dir for p, f in self.followers.items() if not f.closed}
        for p, lead in self.leaders.items():
            out[p] = lead.store.log_dir
        return out

    def partition_members(self, partition):
        held = self.control.records.get(partition) if self.control is not None else None
        if held is None:
            return None, ()
        return held[0].leader, tuple(held[0].isr)

    # --- figures --------------------------------------------------------------------------------

    def sys_values(self, partition, broker):
        """$SYS/broker/cluster/partitions/...: the partitions this process leads and follows,
        as the broker of `partition` publishes them."""
        values = {}
        base = "$SYS/broker/cluster/partitions/"
        for p, lead in self.leaders.items():
            core = lead.core
            values[f"{base}{p}/leader"] = self.node
            values[f"{base}{p}/epoch"] = core.epoch
            values[f"{base}{p}/hw"] = core.hw
            values[f"{base}{p}/log_end"] = core.log_end
            values[f"{base}{p}/in_sync"] = ",".join(core.isr)
            for m in core.replicas:
                if m != self.node:
                    pos = core.position(m)
                    values[f"{base}{p}/lag/{m}"] = core.log_end - pos[1] if pos is not None else -1
        for p, f in self.followers.items():
            values[f"{base}{p}/leader"] = f.core.leader or ""
            values[f"{base}{p}/epoch"] = f.core.epoch
            values[f"{base}{p}/hw"] = f.core.hw
            values[f"{base}{p}/log_end"] = f.replica.log_end
        values["$SYS/broker/cluster/partitions/led"] = sum(1 for lead in self.leaders.values() if not lead.fenced)
        values["$SYS/broker/cluster/partitions/followed"] = len(self.followers)
        values["$SYS/broker/publish/messages/refused_insync"] = broker.router.stats.refused_insync
        return values
