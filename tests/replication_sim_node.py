"""The simulator's node: the I/O layer around the real replication core (replication_sim.py).

A `SimNode` plays what the broker and cluster code will do around
`wrenmq.cluster.replication`: a log per partition replica on a fake disk (appended vs
fsynced; a crash loses what was not fsynced, or some of it), the epoch history file,
the replicated QoS 2 state applied up to the high watermark, an etcd lease and node key,
a polled view of the partition records, and the rules of `replication_control` run
through the fake etcd. Client publishes are held until the high watermark passes them
(docs/REPLICATION.md: output is released at HW) and only while the node's lease is valid.

Records are short byte strings: `m|pub|msg|qos` (a message), `r|pub|pid|msg|offset` (the
inbound QoS 2 packet id received: state) and `x|pub|pid` (released: state). A log keeps
its batches: what one client request logged is one batch (a message and its state record
together), a crash keeps or loses whole batches (the store's recovery drops a torn one by
its checksum), and DATA carries whole batches, as the real leader sends its batch bytes.
"""

import itertools
import json

from wrenmq.cluster import replication_control as RC
from wrenmq.cluster import replication_epochs as E
from wrenmq.cluster import replication_frames as F

PREFIX = "/wrenmq/sim/"
SNAPSHOT_CHUNK = 64


class Replica:
    """One partition's replica on a node's disk (survives a crash, not a permanent loss)."""

    __slots__ = ("log_start", "records", "durable", "epochs_text", "state", "applied", "fsyncing", "fsync_low")

    def __init__(self, log_start=0):
        self.log_start = log_start
        self.records = []  # (epoch, payload, last of its batch) for offsets log_start, log_start + 1, ...
        self.durable = log_start
        self.epochs_text = E.LeaderEpochs().to_text()
        self.state = {}  # (publisher, packet id) -> (message id, offset): applied through `applied`
        self.applied = log_start
        self.fsyncing = None  # the log end an fsync in flight covers
        self.fsync_low = None  # the lowest truncation since that fsync began

    @property
    def end(self):
        return self.log_start + len(self.records)

    def record(self, offset):
        return self.records[offset - self.log_start]


def apply_record(state, payload):
    """Apply one record to the QoS 2 state (message records change nothing)."""
    kind = payload[:1]
    if kind == b"r":
        _, pub, pid, msg, off = payload.split(b"|")
        state[(pub.decode(), int(pid))] = (int(msg), int(off))
    elif kind == b"x":
        _, pub, pid = payload.split(b"|")
        state.pop((pub.decode(), int(pid)), None)


class LeaderRole:
    """What the node keeps beside a PartitionLeader: whether it serves clients yet, the
    output held for the HW, the live QoS 2 state (applied state plus what is logged)."""

    def __init__(self, core, epoch, hw):
        self.core = core
        self.epoch = epoch
        self.serving = False
        self.held = []  # [end the HW must reach, publisher, reply]
        self.live = None
        self.registered = hw  # the oracle knows the records below this as committed
        self.isr_txn = None  # [Txn, base revision, time sent]
        self.handing = None  # time a handover to the partition's own node began
        self.handover_sent = False
        self.handover_not_before = 0


class SimNode:
    def __init__(self, world, name):
        self.world = world
        self.name = name
        self.disk = {}
        self.up = False
        self.paused = False
        self.buffer = []
        self.run = 0
        self._reset()

    def _reset(self):
        self.lease = None
        self.joining = None  # time the lease grant or the registration in flight was sent
        self.valid_until = -1.0
        self.incarnation = None
        self.keepalive_sent = None
        self.next_keepalive = 0.0
        self.poll_sent = None
        self.next_poll = 0.0
        self.view = {}  # partition -> (record, mod revision)
        self.live = {}
        self.live_rev = 0
        self.epochs = {}
        self.leaders = {}
        self.followers = {}
        self.txns = {}  # partition -> [Txn, base revision, time sent, purpose]
        self.snapshots_in = {}
        self.fetch_seqs = itertools.count(1)  # one counter for all the followers of this process

    # ------------------------------------------------------------------ lifecycle

    def start(self):
        if self.up:
            return
        w = self.world
        self.up = True
        self.paused = False
        self.buffer = []
        self.run += 1
        self._reset()
        for p, rep in self.disk.items():
            ep = E.LeaderEpochs.from_text(rep.epochs_text)
            if ep.truncate_from_end(rep.end):
                rep.epochs_text = ep.to_text()
            self.epochs[p] = ep
        w.trace(self, "start", disk={p: (r.log_start, r.end) for p, r in self.disk.items()})
        self._join()
        w.at_node(w.now + w.p.tick, self, self.tick)

    def _join(self):
        """Take a lease (then claim the node name), again if a request was lost."""
        w = self.world
        self.joining = w.now
        if self.lease is None:
            sent = w.now
            w.etcd_call(self, "grant", (w.p.ttl,), lambda lease: self._granted(lease, sent))
        else:
            self._register()

    def crash(self):
        """kill -9: the process state goes; of each log, the fsynced part survives and some
        of what was not (the page cache may have written it)."""
        rng = self.world.rng
        self.up = False
        self.run += 1
        for rep in self.disk.values():
            keep = rep.durable - rep.log_start
            cuts = [i + 1 for i in range(keep, len(rep.records)) if rep.records[i][2]]
            if cuts:
                keep = rng.choice([keep] + cuts)
            del rep.records[keep:]
            rep.durable = rep.end
            rep.fsyncing = rep.fsync_low = None
        self.world.trace(self, "crash")

    def lose(self):
        """The machine is gone for good: the replacement starts with an empty disk."""
        self.up = False
        self.run += 1
        self.disk = {}
        self.world.trace(self, "lost")

    def _granted(self, lease, sent):
        """The lease is valid until `sent` (when it was asked for) + TTL by this node's clock,
        at the latest: etcd started counting when the request got there."""
        if self.lease is None:
            self.lease = lease
            self.valid_until = sent + self.world.p.ttl
            self.next_keepalive = self.world.now + self.world.p.keepalive
            self._register()

    def _register(self):
        w = self.world
        self.joining = w.now

        def done(res):
            ok, rev = res
            if self.incarnation is not None:
                return
            if ok:
                self.incarnation = rev
                w.trace(self, "registered", incarnation=rev)
                self._poll()
            else:  # the name is still held by an earlier process's lease: wait for it to run out
                self.world.at_node(w.now + 50, self, self._retry_register)

        w.etcd_call(self, "register", (RC.node_key(PREFIX, self.name), self.lease), done)

    def _retry_register(self):
        if self.incarnation is None and self.lease is not None:
            self._keepalive()
            self._register()

    def lease_ok(self):
        return self.incarnation is not None and self.world.now < self.valid_until

    def tick(self):
        w = self.world
        now = w.now
        w.at_node(now + w.p.tick, self, self.tick)
        if self.incarnation is not None and not self.lease_ok() and self.leaders:
            self._drop_leaders("lease ran out")
        if self.incarnation is None and now - self.joining > w.p.rpc_timeout:
            self._join()
        if self.lease is not None and now >= self.next_keepalive and (
                self.keepalive_sent is None or now - self.keepalive_sent > w.p.rpc_timeout):
            self._keepalive()
        if self.incarnation is not None and now >= self.next_poll and (
                self.poll_sent is None or now - self.poll_sent > w.p.rpc_timeout):
            self._poll()
        for p, lr in list(self.leaders.items()):
            if self.leaders.get(p) is lr:
                self.do(p, lr.core.tick(now))
        for p, f in list(self.followers.items()):
            if self.followers.get(p) is f:
                self.do(p, f.tick(now))
        for p, t in list(self.txns.items()):
            if now - t[2] > w.p.rpc_timeout:
                if t[3] in ("isr", "handover") and p in self.leaders and self.view.get(p, (None, -1))[1] == t[1]:
                    # Until the record moves, the change may or may not have been made: this
                    # leader stays where it is (HW over both ISRs; acknowledging nothing while
                    # handing over) and sends it again (the same compare: applies at most once).
                    t[2] = now
                    self._send_txn(p, t)
                else:
                    del self.txns[p]
        if self.lease_ok():
            for p in list(self.leaders):
                self._leader_duties(p)

    def _keepalive(self):
        w = self.world
        sent = self.keepalive_sent = w.now
        self.next_keepalive = w.now + w.p.keepalive
        lease = self.lease

        def done(ok):
            if lease != self.lease:
                return
            self.keepalive_sent = None
            if ok:
                self.valid_until = max(self.valid_until, sent + w.p.ttl)
            else:  # etcd dropped the lease (and the node key): join again as a new incarnation
                w.trace(self, "lease expired")
                self._drop_leaders("lease expired")
                for p in list(self.followers):
                    del self.followers[p]
                self.incarnation = None
                self.lease = None
                self._join()

        w.etcd_call(self, "keepalive", (lease,), done)

    def _poll(self):
        w = self.world
        self.poll_sent = w.now
        self.next_poll = w.now + w.p.poll
        w.etcd_call(self, "read", (), self._polled)

    def _polled(self, res):
        self.poll_sent = None
        rev, records, live = res
        if rev > self.live_rev:
            self.live_rev = rev
            self.live = live
        for p, (rec, mod) in records.items():
            self._view_update(p, rec, mod)
        self.reconcile()

    def _view_update(self, p, rec, mod):
        cur = self.view.get(p)
        if cur is not None and cur[1] >= mod:
            return
        self.view[p] = (rec, mod)
        t = self.txns.get(p)
        lr = self.leaders.get(p)
        if t is not None and t[1] != mod:
            del self.txns[p]
            if t[3] == "handover" and lr is not None and rec.leader == self.name and rec.epoch == lr.epoch:
                lr.handing = None  # it did not happen (the record moved on without it)
                lr.handover_not_before = self.world.now + 10 * self.world.p.heartbeat
        if lr is not None and lr.isr_txn is not None and lr.isr_txn[1] != mod:
            txn = lr.isr_txn[0]
            lr.isr_txn = None
            if not (rec.leader == self.name and rec.epoch == lr.epoch and set(rec.isr) == set(txn.record.isr)):
                self.do(p, lr.core.isr_change_failed(self.world.now))

    # ------------------------------------------------------------------ roles

    def reconcile(self):
        if not self.lease_ok() or not self.up:
            return
        if self.name not in self.view and self.name not in self.txns:
            # This node's own partition has no record yet: create it, led by this node alone
            # (the leader then grows the replicas).
            self.disk.setdefault(self.name, Replica())
            self.epochs.setdefault(self.name, E.LeaderEpochs())
            t = self.txns[self.name] = [RC.create(PREFIX, self.name, self.name, self.incarnation), 0,
                                        self.world.now, "create"]
            self._send_txn(self.name, t)
        for p in list(self.view):
            self._reconcile(p)

    def _reconcile(self, p):
        w = self.world
        now = w.now
        rec, mod = self.view[p]
        rep = self.disk.get(p)
        role = RC.role(rec, self.name, self.incarnation)
        lr = self.leaders.get(p)
        if lr is not None and (role != "lead" or lr.epoch != rec.epoch):
            lr.core.fenced(rec.epoch)
            del self.leaders[p]
            w.trace(self, "leadership over", partition=p, epoch=lr.epoch)
            lr = None
        if role == "lead":
            if rep is None:
                self._txn(p, "leave", RC.leave_isr(PREFIX, p, rec, mod, self.name))
                return
            if lr is None:
                self._become_leader(p, rec)
            else:
                self.do(p, lr.core.isr_changed(rec.isr, rec.epoch, now, rec.replicas))
        elif role == "reclaim":
            if rep is not None and self.name in rec.isr:
                self._txn(p, "reclaim", w.core.election(PREFIX, p, rec, mod, self.name, self.incarnation,
                                                        self.live, True, w.p.min_insync))
            else:
                self._txn(p, "leave", RC.leave_isr(PREFIX, p, rec, mod, self.name))
        elif role == "follow":
            if rep is None:
                if self.name in rec.isr:
                    self._txn(p, "leave", RC.leave_isr(PREFIX, p, rec, mod, self.name))
                    return
                rep = self.disk[p] = Replica()
                self.epochs[p] = E.LeaderEpochs()
            f = self.followers.get(p)
            if f is None:
                f = self.followers[p] = w.core.Follower(
                    p, self.name, self.incarnation, self.epochs[p], log_start=rep.log_start, log_end=rep.end,
                    durable_end=rep.durable, hw=rep.applied, fetch_timeout_ms=w.p.fetch_timeout,
                    seqs=self.fetch_seqs)
            self.do(p, f.leader_changed(rec.leader, rec.epoch, now))
            if rec.leader is None or rec.leader not in self.live:
                self._txn(p, "elect", w.core.election(PREFIX, p, rec, mod, self.name, self.incarnation,
                                                      self.live, True, w.p.min_insync))
        else:
            self.followers.pop(p, None)

    def _become_leader(self, p, rec):
        w = self.world
        rep = self.disk[p]
        f = self.followers.pop(p, None)
        hw = max(rep.applied, f.hw if f is not None else 0)
        core = w.core.Leader(p, self.name, rec.epoch, rec.isr, rec.replicas, w.p.min_insync, self.epochs[p],
                             log_start=rep.log_start, log_end=rep.end, durable_end=rep.durable, hw=hw, now=w.now,
                             lag_ms=w.p.lag_ms, heartbeat_ms=w.p.heartbeat)
        lr = self.leaders[p] = LeaderRole(core, rec.epoch, core.hw)
        w.trace(self, "leads", partition=p, epoch=rec.epoch, isr=rec.isr, log=(rep.log_start, rep.end), hw=core.hw)
        self.do(p, core.start())
        self._maybe_serve(p, lr)

    def _drop_leaders(self, why):
        for p, lr in list(self.leaders.items()):
            lr.core.fenced(lr.epoch + 1)
            self.world.trace(self, "fenced", partition=p, epoch=lr.epoch, why=why)
        self.leaders.clear()

    def _leader_duties(self, p):
        w = self.world
        lr = self.leaders[p]
        rec, mod = self.view[p]
        if rec.epoch != lr.epoch or p in self.txns:
            return
        if len(rec.replicas) < w.p.replicas:
            load = RC.replica_load(r for r, _ in self.view.values())
            txn = RC.grow_replicas(PREFIX, p, rec, mod, self.name, self.incarnation, w.p.replicas, self.live, load)
            if txn is not None:
                self._txn(p, "grow", txn)
                return
        if lr.handing is None:
            if RC.wants_handover(rec, p, self.live) and w.now >= lr.handover_not_before and lr.isr_txn is None:
                lr.handing = w.now
                lr.handover_sent = False
            return
        core = lr.core
        pos = core.position(p)
        if lr.handover_sent:
            return
        if (core.hw == core.log_end and pos is not None and pos[0] == self.live.get(p) and pos[1] >= core.log_end):
            txn = RC.handover(PREFIX, p, rec, mod, self.name, self.incarnation, p, self.live)
            if txn is not None:
                lr.handover_sent = True
                w.trace(self, "hands over", partition=p, to=p, epoch=rec.epoch + 1)
                self._txn(p, "handover", txn)
                return
        if w.now - lr.handing > 4 * w.p.heartbeat:
            lr.handing = None
            lr.handover_not_before = w.now + 10 * w.p.heartbeat

    def _txn(self, p, purpose, txn):
        if txn is None or p in self.txns:
            return
        t = self.txns[p] = [txn, self.view[p][1], self.world.now, purpose]
        self._send_txn(p, t)

    def _send_txn(self, p, t):
        txn = t[0]

        def done(res):
            ok, rev = res
            if self.txns.get(p) is t:
                del self.txns[p]
            if ok:
                self.world.trace(self, "txn", partition=p, purpose=t[3], record=txn.record)
                self._view_update(p, txn.record, rev)
                self.reconcile()
            else:
                lr = self.leaders.get(p)
                if lr is not None and t[3] == "handover":
                    lr.handing = None
                    lr.handover_not_before = self.world.now + 10 * self.world.p.heartbeat
                self._poll()

        self.world.etcd_call(self, "txn", (txn,), done)

    # ------------------------------------------------------------------ decisions

    def do(self, p, decisions):
        for d in decisions:
            getattr(self, "_d_" + type(d).__name__)(p, d)

    def _d_Send(self, p, d):
        self.world.send(self.name, d.to, [F.encode(d.frame)])

    def _d_SendData(self, p, d):
        rep = self.disk[p]
        if d.start < rep.log_start:
            return  # retention moved past it since: the follower's retry gets a snapshot
        end = min(d.end, rep.end)
        limit = d.start + self.world.p.max_records
        batches = []
        o = d.start
        while o < end and (not batches or o < limit):  # whole batches, at least one
            b = o
            payloads = []
            while True:
                r = rep.record(o)
                payloads.append(r[1])
                o += 1
                if r[2]:
                    break
            batches.append(F.Batch(b, r[0], o - b, b"\n".join(payloads)))
        self.world.send(self.name, d.follower, [F.encode(F.Data(p, d.epoch, d.incarnation, d.seq, d.hw, batches))])

    def _d_SendSnapshot(self, p, d):
        rep = self.disk[p]
        if rep.applied < rep.log_start:
            return
        state = json.dumps(sorted([k[0], k[1], v[0], v[1]] for k, v in rep.state.items())).encode()
        chunks = [state[i:i + SNAPSHOT_CHUNK] for i in range(0, len(state), SNAPSHOT_CHUNK)] or [b""]
        frames = []
        pos = 0
        for i, c in enumerate(chunks):
            frames.append(F.encode(F.Snapshot(p, d.epoch, d.incarnation, d.seq, rep.log_start, rep.applied,
                                              len(state), pos, i == len(chunks) - 1, c)))
            pos += len(c)
        self.world.send(self.name, d.follower, frames)  # one stream: the chunks arrive in order

    def _d_ProposeIsr(self, p, d):
        lr = self.leaders.get(p)
        if lr is None:
            return
        rec, mod = self.view[p]
        txn = RC.isr_change(PREFIX, p, rec, mod, self.name, self.incarnation, d.epoch, d.isr)
        if txn is None or p in self.txns or lr.isr_txn is not None or lr.handing is not None:
            self.do(p, lr.core.isr_change_failed(self.world.now))
            return
        lr.isr_txn = [txn, mod, self.world.now]
        self.world.trace(self, "proposes isr", partition=p, isr=d.isr)
        self._txn(p, "isr", txn)

    def _d_HighWatermark(self, p, d):
        w = self.world
        rep = self.disk[p]
        lr = self.leaders.get(p)
        if lr is not None:
            w.oracle.leader_hw(self, p, lr.epoch, d.hw, rep, lr.registered)
            lr.registered = max(lr.registered, d.hw)
        else:
            w.oracle.follower_hw(self, p, d.hw, rep)
        self._apply(p, d.hw)
        if lr is not None:
            self._maybe_serve(p, lr)
            self._release(p, lr)

    def _d_Fenced(self, p, d):
        lr = self.leaders.pop(p, None)
        if lr is not None:
            self.world.trace(self, "fenced", partition=p, epoch=lr.epoch, by=d.epoch)
        self._poll()

    def _d_RefreshMetadata(self, p, d):
        self._poll()

    def _d_SaveEpochs(self, p, d):
        self.disk[p].epochs_text = d.text

    def _d_Append(self, p, d):
        # A follower may hold records that are not committed (from a leader that has since
        # lost its leadership) where other records are committed now: it truncates them by
        # epoch later. What it holds below its HW is checked (Oracle.follower_hw).
        rep = self.disk[p]
        for b in d.batches:
            payloads = bytes(b.data).split(b"\n")
            if len(payloads) != b.count:
                self.world.oracle.fail(f"{self.name}/{p}: a batch of {b.count} records holds {len(payloads)}")
            last = len(payloads) - 1
            rep.records.extend((b.epoch, x, i == last) for i, x in enumerate(payloads))
        self._fsync(p, rep)

    def _d_Truncate(self, p, d):
        rep = self.disk[p]
        self.world.oracle.truncating(self, p, rep, d.offset)
        self.world.trace(self, "truncates", partition=p, to=d.offset, end=rep.end)
        del rep.records[d.offset - rep.log_start:]
        rep.durable = min(rep.durable, d.offset)
        if rep.fsyncing is not None:
            rep.fsync_low = d.offset if rep.fsync_low is None else min(rep.fsync_low, d.offset)

    def _d_BeginSnapshot(self, p, d):
        self.snapshots_in[p] = bytearray()

    def _d_WriteSnapshot(self, p, d):
        buf = self.snapshots_in.get(p)
        if buf is not None and d.offset == len(buf):
            buf += d.data

    def _d_InstallSnapshot(self, p, d):
        buf = self.snapshots_in.pop(p, b"[]")
        rep = self.disk[p]
        self.world.trace(self, "installs snapshot", partition=p, log_start=d.log_start, applied=d.applied_through)
        rep.state = {(pub, pid): (msg, off) for pub, pid, msg, off in json.loads(bytes(buf))}
        rep.log_start = rep.durable = d.log_start
        rep.applied = d.applied_through
        rep.records = []
        if rep.fsyncing is not None:
            rep.fsync_low = d.log_start

    # ------------------------------------------------------------------ disk

    def _fsync(self, p, rep):
        if rep.fsyncing is not None or rep.durable >= rep.end:
            return
        w = self.world
        rep.fsyncing = rep.end
        rep.fsync_low = None
        w.at_node(w.now + w.rng.uniform(0.5, w.p.fsync_ms), self, self._fsynced, p, rep)

    def _fsynced(self, p, rep):
        if self.disk.get(p) is not rep or rep.fsyncing is None:
            return
        end = rep.fsyncing if rep.fsync_low is None else min(rep.fsyncing, rep.fsync_low)
        rep.fsyncing = rep.fsync_low = None
        if end > rep.durable:
            rep.durable = min(end, rep.end)
            role = self.leaders.get(p) or self.followers.get(p)
            if role is not None:
                core = role.core if isinstance(role, LeaderRole) else role
                self.do(p, core.local_durable(rep.durable, self.world.now))
        self._fsync(p, rep)

    def _apply(self, p, hw):
        rep = self.disk[p]
        while rep.applied < hw:
            apply_record(rep.state, rep.record(rep.applied)[1])
            rep.applied += 1

    def trim(self, p, start):
        """Retention: the records below `start` go (never past the applied state)."""
        rep = self.disk[p]
        start = min(start, rep.applied)
        while start > rep.log_start and not rep.record(start - 1)[2]:
            start -= 1  # retention deletes whole segments, so whole batches
        if start <= rep.log_start:
            return
        del rep.records[:start - rep.log_start]
        rep.log_start = start
        self.world.trace(self, "retention", partition=p, log_start=start)
        lr = self.leaders.get(p)
        f = self.followers.get(p)
        if lr is not None:
            self.do(p, lr.core.log_start_moved(start))
        elif f is not None:
            self.do(p, f.log_start_moved(start))
        else:
            ep = self.epochs.get(p)
            if ep is not None and ep.truncate_from_start(start):
                rep.epochs_text = ep.to_text()

    # ------------------------------------------------------------------ messages

    def on_message(self, src, payload):
        if type(payload) is tuple:
            self._client(src, payload)
            return
        now = self.world.now
        for raw in payload:
            frame = F.decode_frame(raw)
            p = frame.partition
            t = type(frame)
            if t is F.Fetch:
                lr = self.leaders.get(p)
                if lr is not None:
                    self.do(p, lr.core.on_fetch(src, frame, now))
                elif p in self.view and self.view[p][0].epoch > frame.epoch:
                    self.world.send(self.name, src, [F.encode(F.Fenced(p, self.view[p][0].epoch))])
                continue
            f = self.followers.get(p)
            if f is not None:
                if t is F.Data:
                    self.do(p, f.on_data(src, frame, now))
                elif t is F.Diverged:
                    self.do(p, f.on_diverged(src, frame, now))
                elif t is F.Snapshot:
                    self.do(p, f.on_snapshot(src, frame, now))
                elif t is F.Fenced:
                    self.do(p, f.on_fenced(src, frame, now))
            elif t is F.Fenced and p in self.leaders:
                self.do(p, self.leaders[p].core.on_fenced(src, frame, now))

    def _maybe_serve(self, p, lr):
        """A new leader serves clients once everything in its log is committed (its HW
        reached the log end it took over with) and applied: its QoS 2 state is then the
        state of every record any earlier leader may have acknowledged."""
        core = lr.core
        if lr.serving or core.hw < core.epoch_start:
            return
        self._apply(p, core.hw)
        lr.live = dict(self.disk[p].state)
        lr.serving = True

    def _client(self, src, msg):
        kind, pub, pid, msg_id, qos, p, epoch = msg
        lr = self.leaders.get(p)
        if (lr is None or lr.epoch != epoch or not lr.serving or not self.lease_ok() or lr.handing is not None
                or not lr.core.accepting or lr.core.fenced_epoch is not None):
            return
        rep = self.disk[p]
        live = lr.live
        key = (pub, pid)
        if kind == "pub" and qos == 1:
            off = rep.end
            self._append_own(p, lr, [f"m|{pub}|{msg_id}|1".encode()])
            lr.held.append([rep.end, src, ("puback", pid, msg_id, off, 1)])
        elif kind == "pub":
            if key in live:
                mid, off = live[key]
            else:
                off = rep.end
                mid = msg_id
                self._append_own(p, lr, [f"m|{pub}|{msg_id}|2".encode(), f"r|{pub}|{pid}|{msg_id}|{off}".encode()])
                live[key] = (msg_id, off)
            lr.held.append([rep.end, src, ("pubrec", pid, mid, off, 2)])
        else:
            if key in live:
                self._append_own(p, lr, [f"x|{pub}|{pid}".encode()])
                del live[key]
            lr.held.append([rep.end, src, ("pubcomp", pid, msg_id, -1, 2)])
        self._release(p, lr)

    def _append_own(self, p, lr, payloads):
        rep = self.disk[p]
        start = rep.end
        last = len(payloads) - 1
        rep.records.extend((lr.epoch, x, i == last) for i, x in enumerate(payloads))
        self.world.oracle.appended(self, p, rep, start)
        self.do(p, lr.core.local_appended(rep.end, self.world.now))
        self._fsync(p, rep)

    def _release(self, p, lr):
        """Send the replies whose records the HW has passed, while this node may still speak
        for the partition (lease valid, not fenced, not handing over)."""
        if not lr.held or not self.lease_ok() or lr.handing is not None or lr.core.fenced_epoch is not None:
            return
        hw = lr.core.hw
        keep = []
        for h in lr.held:
            if h[0] <= hw:
                reply = h[2]
                if reply[0] != "pubcomp":
                    self.world.oracle.acknowledged(self, p, lr.epoch, h[1], reply)
                self.world.send(self.name, h[1], reply)
            else:
                keep.append(h)
        lr.held = keep


class Publisher:
    """An MQTT publisher of one partition's node: QoS 1 and QoS 2 messages, at most
    `inflight` at a time, packet ids reused after completion, everything unanswered sent
    again (QoS 2: the same packet id, as DUP) to whichever node it believes leads."""

    def __init__(self, world, name, partition):
        self.world = world
        self.name = name
        self.partition = partition
        self.inflight = {}  # packet id -> [message id, qos, stage "pub" | "rel", time sent]
        self.next_msg = 0
        self.leader = None
        self.leader_read = -1e9
        self.sent = 0

    def tick(self):
        w = self.world
        now = w.now
        w.at(now + w.rng.uniform(10, 40), self.tick)
        if w.publishing and len(self.inflight) < w.p.inflight and w.rng.random() < 0.5:
            pid = next(i for i in range(1, w.p.inflight + 1) if i not in self.inflight)
            self.next_msg += 1
            msg_id = self.next_msg + 1_000_000 * int(self.name[1:])
            self.inflight[pid] = [msg_id, 1 if w.rng.random() < 0.3 else 2, "pub", now]
            self.sent += 1
            self._send(pid)
        for pid, m in self.inflight.items():
            if now - m[3] > w.p.retry_ms:
                self._send(pid)

    def _send(self, pid):
        w = self.world
        m = self.inflight[pid]
        m[3] = w.now
        if w.now - self.leader_read > w.p.client_refresh or w.rng.random() < 0.2:
            rec = w.etcd.record(self.partition)
            self.leader = (rec.leader, rec.epoch) if rec is not None and rec.leader is not None else None
            self.leader_read = w.now
        if self.leader is not None:
            # The epoch stands for the connection: one made to a node while it led that epoch.
            w.send(self.name, self.leader[0], ("pub" if m[2] == "pub" else "rel", self.name, pid, m[0], m[1],
                                               self.partition, self.leader[1]))

    def on_message(self, src, reply):
        kind, pid, msg_id, offset, qos = reply
        m = self.inflight.get(pid)
        if m is None or m[0] != msg_id:
            return
        if kind == "puback" or kind == "pubcomp":
            if (kind == "puback") == (m[1] == 1) and (kind == "puback" or m[2] == "rel"):
                del self.inflight[pid]
        elif kind == "pubrec" and m[2] == "pub":
            m[2] = "rel"
            self._send(pid)
