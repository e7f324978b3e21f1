"""A deterministic simulator of wrenmq's partition replication (issue 33, docs/REPLICATION.md).

Nodes run the real sans-IO core (`wrenmq.cluster.replication`, `replication_control`,
`replication_frames`: every frame is encoded and decoded) inside a small I/O layer
(`replication_sim_node.py`), on top of fakes driven by one seeded RNG and one clock:

- a network with per-message delay, loss, duplication, stragglers (a message that
  arrives hundreds of ms after those sent with it) and the reordering all that makes,
  and cuts between any two nodes or between a node and etcd; MQTT between a client and
  a node is one TCP connection (in order, never twice, closed when leadership moves);
- a disk per node (appended vs fsynced: a crash keeps the fsynced batches and some of
  the others, whole; a permanent loss keeps nothing);
- a linearizable etcd: keys with create and mod revisions, transactions with compares
  (applied when they arrive, after a random raft-and-fsync time), leases that expire
  when not refreshed and take their keys with them;
- MQTT publishers per partition (QoS 1 and QoS 2, packet ids reused, resends after
  failover), acknowledged exactly when the leader's high watermark passes the record.

Faults, in random order and overlapping: crash and restart, permanent loss and an empty
replacement (only while every partition keeps another ISR member with its replica: the
promise is about losing one node), pause past the lease (a zombie that resumes with
stale state), a node cut from the other nodes but not etcd and the reverse, random
splits, lossy and slow periods, retention that makes followers need a snapshot, and
ambushes: a crash, pause, loss or cut of a leader a few ms after its ISR grew or shrank
or it was elected.

Invariants, checked as the run goes and at its end (`Oracle`): no acknowledged record
lost (every one in the final leader's log at the offset it was acknowledged at); every
record below any leader's or follower's HW is committed, and committed records never
change (each replica holds them below its HW, so it is a prefix of the leader's log up
to there; a leader never appends where one is); nothing applied is truncated; at most
one leader (one process) acknowledges per epoch, and only while etcd still names it
leader at that epoch; a leader's HW never decreases within an epoch, nor passes its own
durable end; QoS 2 exactly once (at most one committed message per QoS 2 message,
exactly one for an acknowledged one); the core refuses no frame (a ReplicationError is
a failure); and, after the faults heal, every partition has a serving leader and every
publisher got every answer.

    python tests/replication_sim.py --seed N [--trace]   replay one seed (the failure's story)
    python tests/replication_sim.py --seeds N [--start S]   run many, print seeds/s
    python tests/replication_sim.py --bug NAME --seeds N    a known bug in the core: which seed catches it
"""

import argparse
import heapq
import random
import sys
import time
from collections import deque
from dataclasses import dataclass, fields

from replication_sim_node import PREFIX, Publisher, SimNode
from wrenmq.cluster import replication as R
from wrenmq.cluster import replication_control as RC
from wrenmq.cluster import replication_epochs as E
from wrenmq.cluster import replication_frames as F


def _short(frame):
    if type(frame) is F.Data:
        return frame._replace(batches=[(b.base, b.epoch, b.count) for b in frame.batches])
    if type(frame) is F.Snapshot:
        return frame._replace(data=len(frame.data))
    return frame


class Violation(AssertionError):
    """An invariant broke (or the core raised): the run stops."""


class Core:
    """The classes and rules the simulated nodes run: the real ones, or a test's buggy
    subclasses (to show that the simulator catches a bug)."""
    Leader = R.PartitionLeader
    Follower = R.PartitionFollower
    election = staticmethod(RC.election)


@dataclass
class Params:
    nodes: int = 3
    replicas: int = 3
    min_insync: int = 2
    ttl: float = 500.0  # etcd lease, ms
    keepalive: float = 100.0
    poll: float = 50.0  # how often a node reads the partition records
    tick: float = 20.0
    lag_ms: float = 300.0
    heartbeat: float = 100.0
    fetch_timeout: float = 250.0
    rpc_timeout: float = 150.0
    fsync_ms: float = 6.0
    etcd_ms: float = 10.0  # etcd's own time to apply a request, at most
    max_records: int = 16  # per DATA frame
    inflight: int = 2  # per publisher
    retry_ms: float = 120.0
    client_refresh: float = 250.0
    publish_from: float = 300.0
    faults_from: float = 700.0
    faults_until: float = 5500.0
    heal_at: float = 6000.0
    end_at: float = 8500.0
    strict_core: int = 1  # a ReplicationError (the core refusing a peer's frame) fails the run
    min_faults: int = 3
    max_faults: int = 10


FAULT_KINDS = ("crash", "lose", "pause", "isolate", "etcd_cut", "split", "lossy", "slow", "retention", "ambush")
FAULT_WEIGHTS = (3, 2, 3, 2, 2, 1, 2, 1, 2, 4)
# An ambush waits for a partition record to change that way, then strikes its leader
# within a few ms: the moments where a wrong rule would show (an ISR just grown, just
# shrunk, a leader just elected).
AMBUSH_EVENTS = ("grow", "shrink", "elect")
AMBUSH_ACTIONS = ("crash", "pause", "lose", "isolate", "etcd_cut")


def make_schedule(rng, p, names):
    faults = []
    for _ in range(rng.randint(p.min_faults, p.max_faults)):
        t = round(rng.uniform(p.faults_from, p.faults_until), 1)
        kind = rng.choices(FAULT_KINDS, FAULT_WEIGHTS)[0]
        # Half the node faults hit the leader of a partition (named when the fault comes).
        target = f"leader of {rng.choice(names)}" if rng.random() < 0.5 else rng.choice(names)
        if kind == "ambush":
            target = f"{rng.choice(AMBUSH_EVENTS)} {rng.choice(AMBUSH_ACTIONS)} {round(rng.uniform(0, 25), 1)}"
            dur = rng.uniform(1.2, 3.0) * p.ttl
        elif kind == "pause":
            dur = rng.uniform(1.2, 4.0) * p.ttl if rng.random() < 0.8 else rng.uniform(0.1, 0.8) * p.ttl
        elif kind in ("lossy",):
            dur = rng.uniform(200, 1500)
            target = round(rng.uniform(0.05, 0.4), 2)
        else:
            dur = rng.uniform(100, 2000)
        faults.append((t, kind, target, round(dur, 1)))
    faults.sort()
    return faults


class Oracle:
    """What was committed and acknowledged, and the checks on it."""

    def __init__(self, world):
        self.world = world
        self.committed = {}  # partition -> {offset: (epoch, payload)}
        self.acks = []  # (partition, offset, publisher, message id, qos)
        self.ack_leader = {}  # (partition, epoch) -> (node, run)
        self.hws = {}  # (node, run, partition, epoch) -> hw

    def fail(self, what):
        raise Violation(what)

    def _commit(self, node, p, rep, start, end, who):
        c = self.committed.setdefault(p, {})
        for o in range(max(start, rep.log_start), min(end, rep.end)):
            r = rep.record(o)
            prev = c.get(o)
            if prev is None:
                c[o] = r
            elif prev != r:
                self.fail(f"{who} {node.name} has {r} at committed offset {p}@{o}, committed was {prev}")

    def leader_hw(self, node, p, epoch, hw, rep, registered):
        key = (node.name, node.run, p, epoch)
        if hw < self.hws.get(key, -1):
            self.fail(f"leader {node.name} of {p} epoch {epoch}: HW went from {self.hws[key]} down to {hw}")
        self.hws[key] = hw
        if hw > rep.durable:
            self.fail(f"leader {node.name} of {p}: HW {hw} past its own durable end {rep.durable}")
        self._commit(node, p, rep, registered, hw, "leader")

    def follower_hw(self, node, p, hw, rep):
        self._commit(node, p, rep, rep.applied, hw, "follower")

    def appended(self, node, p, rep, start):
        """A leader appended from `start`: never where a record is committed (it would be a
        leader that lacks a committed record)."""
        c = self.committed.get(p)
        if not c:
            return
        for o in range(start, rep.end):
            prev = c.get(o)
            if prev is not None and prev != rep.record(o):
                self.fail(f"{node.name} appended {rep.record(o)} at committed offset {p}@{o}, committed was {prev}")

    def truncating(self, node, p, rep, offset):
        if offset < rep.applied:
            self.fail(f"{node.name} truncates {p} to {offset}, below the state it applied ({rep.applied})")

    def acknowledged(self, node, p, epoch, publisher, reply):
        kind, pid, msg_id, offset, qos = reply
        rec = self.world.etcd.record(p)
        if rec.epoch != epoch or rec.leader != node.name or rec.incarnation != node.incarnation:
            self.fail(f"{node.name} acknowledged {kind} {msg_id} as leader of {p} epoch {epoch}, "
                      f"but etcd has {rec}")
        who = self.ack_leader.setdefault((p, epoch), (node.name, node.run))
        if who != (node.name, node.run):
            self.fail(f"two leaders acknowledged in {p} epoch {epoch}: {who} and {(node.name, node.run)}")
        r = self.committed.get(p, {}).get(offset)
        if r is None or r[1].split(b"|")[2] != str(msg_id).encode():
            self.fail(f"{node.name} acknowledged {msg_id} at {p}@{offset}, which holds committed {r}")
        self.acks.append((p, offset, publisher, msg_id, qos))

    def final(self):
        w = self.world
        for p in w.names:
            rec = w.etcd.record(p)
            node = w.nodes.get(rec.leader) if rec.leader else None
            lr = node.leaders.get(p) if node is not None and node.up else None
            if lr is None or lr.epoch != rec.epoch or not lr.serving or lr.core.hw != lr.core.log_end:
                self.fail(f"liveness: {p} has no serving leader after the faults healed: etcd {rec}, "
                          f"leader role {lr and (lr.epoch, lr.serving, lr.core.hw, lr.core.log_end)}")
            rep = node.disk[p]
            for q in rec.isr:
                other = w.nodes[q].disk.get(p)
                if other is None:
                    self.fail(f"ISR member {q} of {p} has no replica")
                for o in range(max(rep.log_start, other.log_start), min(lr.core.hw, other.end)):
                    if other.record(o) != rep.record(o):
                        self.fail(f"ISR member {q} of {p} differs from leader {node.name} at {o} below the HW")
        qos2 = {}
        for p, c in self.committed.items():
            for o, (_, payload, _) in c.items():
                f = payload.split(b"|")
                if f[0] == b"m" and f[3] == b"2":
                    qos2.setdefault(int(f[2]), []).append((p, o))
        for msg_id, where in qos2.items():
            if len(where) > 1:
                self.fail(f"QoS 2 message {msg_id} committed {len(where)} times: {sorted(where)}")
        for p, offset, publisher, msg_id, qos in self.acks:
            rep = w.nodes[w.etcd.record(p).leader].disk[p]
            if offset >= rep.log_start and (offset >= rep.end
                                            or rep.record(offset)[1].split(b"|")[2] != str(msg_id).encode()):
                self.fail(f"acknowledged message {msg_id} lost: not at {p}@{offset} in the final leader's log")
        for pub in w.publishers:
            if pub.inflight:
                self.fail(f"liveness: {pub.name} still waits for {pub.inflight} after the faults healed")


class FakeEtcd:
    """Linearizable: every request is applied whole at the moment it arrives."""

    def __init__(self, world):
        self.world = world
        self.rev = 0
        self.kv = {}  # key -> [value, create revision, mod revision, lease]
        self.leases = {}  # id -> [ttl, expires at]
        self.next_lease = 1

    def grant(self, ttl):
        lid = self.next_lease
        self.next_lease += 1
        self.leases[lid] = [ttl, self.world.now + ttl]
        self.world.at(self.world.now + ttl, self._expire, lid)
        return lid

    def keepalive(self, lid):
        lease = self.leases.get(lid)
        if lease is None:
            return False
        lease[1] = self.world.now + lease[0]
        self.world.at(lease[1], self._expire, lid)
        return True

    def _expire(self, lid):
        lease = self.leases.get(lid)
        if lease is None or lease[1] > self.world.now:
            return
        del self.leases[lid]
        gone = [k for k, v in self.kv.items() if v[3] == lid]
        if gone:
            self.rev += 1
            for k in gone:
                del self.kv[k]
            self.world.trace(None, "etcd expired", keys=gone)

    def register(self, key, lid):
        if key in self.kv or lid not in self.leases:
            return False, self.rev
        self.rev += 1
        self.kv[key] = [None, self.rev, self.rev, lid]
        return True, self.rev

    def txn(self, txn):
        for c in txn.compares:
            e = self.kv.get(c.key)
            actual = 0 if e is None else (e[1] if c.target == "create" else e[2])
            if actual != c.value:
                return False, self.rev
        self.rev += 1
        old = self.kv.get(txn.key)
        self.kv[txn.key] = [txn.record, old[1] if old else self.rev, self.rev, None]
        self.world.trace(None, "etcd put", key=txn.key[len(PREFIX):], record=txn.record)
        if old is not None:
            self.world.record_changed(old[0], txn.record)
        return True, self.rev

    def read(self):
        records = {}
        live = {}
        cut = len(PREFIX)
        for k, v in self.kv.items():
            if k.startswith(RC.PARTITIONS, cut):
                records[k[cut + len(RC.PARTITIONS):]] = (v[0], v[2])
            else:
                live[k[cut + len(RC.NODES):]] = v[1]
        return self.rev, records, live

    def record(self, p):
        e = self.kv.get(RC.partition_key(PREFIX, p))
        return None if e is None else e[0]


class World:
    def __init__(self, seed, params=None, core=Core, trace=False):
        self.seed = seed
        self.p = params or Params()
        self.core = core
        self.rng = random.Random(seed)
        self.now = 0.0
        self._q = []
        self._seq = 0
        self.verbose = trace
        self.story = deque(maxlen=80)
        self.events = 0
        self.core_errors = 0
        self.counts = {}  # what the trace said, how many times
        self.names = [chr(ord("a") + i) for i in range(self.p.nodes)]
        self.etcd = FakeEtcd(self)
        self.oracle = Oracle(self)
        self.nodes = {n: SimNode(self, n) for n in self.names}
        self.publishers = [Publisher(self, f"p{i}", n) for i, n in enumerate(self.names)]
        self.endpoints = {**self.nodes, **{pub.name: pub for pub in self.publishers}}
        self.cut = {}  # (a, b) -> count of faults cutting a from b
        self.fifo = {}  # (client, node) or (node, client) -> time of the last delivery
        self.etcd_cut = {}
        self.loss = 0.0
        self.slow = 0
        self.publishing = False
        self.healed = False
        self.lost = set()  # nodes whose disk is gone, until their replacement is in sync again
        self.schedule = make_schedule(self.rng, self.p, self.names)
        self.applied_faults = []
        self.ambushes = []  # [event, action, delay, duration] armed

    # ------------------------------------------------------------------ events

    def at(self, t, fn, *args):
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, None, 0, fn, args))

    def at_node(self, t, node, fn, *args, run=None):
        """An event of `node`'s process (dropped if that process died; held while paused).
        run=-1: of the node whatever process runs it then (a frame in flight)."""
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, node, node.run if run is None else run, fn, args))

    def trace(self, node, what, **kw):
        self.counts[what] = self.counts.get(what, 0) + 1
        line = f"{self.now:8.1f} {node.name if node else '-':>2} {what} " + " ".join(
            f"{k}={v}" for k, v in kw.items())
        self.story.append(line)
        if self.verbose:
            print(line)

    def run(self):
        for i, n in enumerate(self.names):
            self.at(i * 3.0, self.nodes[n].start)
        for pub in self.publishers:
            self.at(self.p.publish_from, pub.tick)
        self.at(self.p.publish_from, self._set_publishing, True)
        for f in self.schedule:
            self.at(f[0], self._fault, f)
        self.at(self.p.heal_at, self._heal)
        q = self._q
        end = self.p.end_at
        pop = heapq.heappop
        while q and q[0][0] <= end:
            t, _, node, run, fn, args = pop(q)
            self.now = t
            self.events += 1
            if node is not None:
                if not node.up or (run >= 0 and run != node.run):
                    continue
                if node.paused:
                    node.buffer.append((fn, args))
                    continue
            try:
                fn(*args)
            except Violation:
                raise
            except (R.ReplicationError, E.LeaderEpochsError) as e:
                if self.p.strict_core:
                    raise Violation(f"the core refused at {self.now:.1f}: {type(e).__name__}: {e}") from e
                # As the I/O layer would: drop that frame (the connection), go on.
                self.core_errors += 1
                self.trace(node, "core refused", error=e)
        self.now = end
        self.oracle.final()

    def _set_publishing(self, on):
        self.publishing = on

    # ------------------------------------------------------------------ network

    def send(self, src, dst, payload):
        if self.cut.get((src, dst)) or (self.loss and self.rng.random() < self.loss):
            return
        target = self.endpoints.get(dst)
        if target is None:
            return
        if type(payload) is tuple:
            # MQTT between a client and a node: one TCP connection, so in order and never
            # twice (a connection to a node that lost leadership is closed: `_client`).
            t = self.fifo[(src, dst)] = max(self.now + self._delay(), self.fifo.get((src, dst), 0.0))
            if isinstance(target, SimNode):
                self.at_node(t, target, self._arrive, src, target, payload, run=-1)
            else:
                self.at(t, target.on_message, src, payload)
            return
        copies = 2 if self.rng.random() < 0.03 else 1
        for _ in range(copies):
            t = self.now + self._delay()
            self.at_node(t, target, self._arrive, src, target, payload, run=-1)

    def _arrive(self, src, node, payload):
        if not self.cut.get((src, node.name)):
            if self.verbose:
                self.trace(node, "<-", src=src, msg=payload if type(payload) is tuple else [
                    _short(F.decode_frame(raw)) for raw in payload])
            node.on_message(src, payload)

    def _delay(self):
        d = self.rng.uniform(0.3, 5.0)
        if self.slow:
            d += self.rng.expovariate(1 / 60.0)
        if self.rng.random() < 0.02:  # a straggler: arrives long after those sent with it
            d += self.rng.uniform(50, 600)
        return d

    def etcd_call(self, node, op, args, done):
        """A request to etcd; applied whole when it gets there (after the network and etcd's
        own raft round and fsync), answered over the network."""
        if self.etcd_cut.get(node.name):
            return
        t = self.now + self._delay() + self.rng.uniform(0.2, self.p.etcd_ms)
        self.at(t, self._etcd_arrive, node, node.run, op, args, done)

    def _etcd_arrive(self, node, run, op, args, done):
        if self.etcd_cut.get(node.name):
            return
        res = getattr(self.etcd, op)(*args)
        self.at_node(self.now + self._delay(), node, self._etcd_reply, node, done, res, run=run)

    def _etcd_reply(self, node, done, res):
        if not self.etcd_cut.get(node.name):
            done(res)

    # ------------------------------------------------------------------ faults

    def _target(self, spec):
        if spec.startswith("leader of "):
            rec = self.etcd.record(spec[10:])
            return rec.leader if rec is not None else None
        return spec

    def _cut(self, pairs, delta):
        if self.healed:
            return
        for pair in pairs:
            self.cut[pair] = self.cut.get(pair, 0) + delta

    def record_changed(self, old, new):
        if not self.ambushes or self.healed:
            return
        if new.epoch > old.epoch:
            event = "elect"
        elif len(new.isr) > len(old.isr):
            event = "grow"
        elif len(new.isr) < len(old.isr):
            event = "shrink"
        else:
            return
        for a in self.ambushes:
            if a[0] == event and new.leader is not None:
                self.ambushes.remove(a)
                self.at(self.now + a[2], self._spring, a, new.leader)
                return

    def _spring(self, ambush, name):
        event, action, delay, dur = ambush
        node = self.nodes[name]
        did = None
        if node.up and not node.paused and not self.healed:
            did = self._node_fault(action, node, dur, self.now + dur)
        self.applied_faults.append((round(self.now, 1), "ambush sprung", f"{event} {action}", dur, did))
        if did:
            self.trace(None, "FAULT", fault=f"(ambush after {event}) {did}", ms=dur)

    def _fault(self, f):
        t, kind, spec, dur = f
        end = self.now + dur
        did = None
        if kind == "ambush":
            event, action, delay = spec.split(" ")
            self.ambushes.append([event, action, float(delay), dur])
            did = f"armed: {spec}"
        elif kind == "lossy":
            self.loss = spec
            self.at(end, self._set_loss, 0.0)
            did = f"loss {spec}"
        elif kind == "slow":
            self.slow += 1
            self.at(end, self._unslow)
            did = "slow network"
        elif kind == "split":
            side = [n for n in self.names if self.rng.random() < 0.5]
            if side and len(side) < len(self.names):
                pairs = [(a, b) for a in side for b in self.names if b not in side]
                pairs += [(b, a) for a, b in pairs]
                self._cut(pairs, 1)
                self.at(end, self._cut, pairs, -1)
                did = f"split {side}"
        else:
            name = self._target(spec)
            node = self.nodes.get(name)
            if node is not None and node.up and not node.paused:
                did = self._node_fault(kind, node, dur, end)
        self.applied_faults.append((round(self.now, 1), kind, spec, dur, did))
        if did:
            self.trace(None, "FAULT", fault=did, ms=dur)

    def _node_fault(self, kind, node, dur, end):
        name = node.name
        if kind == "crash":
            node.crash()
            self.at(end, node.start)
            return f"crash {name}"
        if kind == "lose":
            if not self._may_lose(name):
                return None
            node.lose()
            self.lost.add(name)
            self.at(end, node.start)
            return f"lose {name} for good"
        if kind == "pause":
            node.paused = True
            self.at(end, self._resume, node)
            return f"pause {name}"
        if kind == "isolate":
            pairs = [(name, b) for b in self.names if b != name] + [(b, name) for b in self.names if b != name]
            self._cut(pairs, 1)
            self.at(end, self._cut, pairs, -1)
            return f"isolate {name} from the nodes"
        if kind == "etcd_cut":
            self.etcd_cut[name] = self.etcd_cut.get(name, 0) + 1
            self.at(end, self._etcd_uncut, name)
            return f"cut {name} from etcd"
        if kind == "retention":
            parts = [p for p, r in node.disk.items() if r.applied > r.log_start]
            if parts:
                p = self.rng.choice(parts)
                rep = node.disk[p]
                node.trim(p, self.rng.randint(rep.log_start + 1, rep.applied))
                return f"retention on {name}/{p}"
        return None

    def _may_lose(self, name):
        """Only one node's data is lost at a time (the promise): not while the replacement of
        an earlier loss has not yet rejoined the ISR of every partition it replicates, and
        only if every partition keeps an ISR member other than this node that holds its
        replica."""
        for n in list(self.lost):
            back = self.nodes[n].up and all(n in r.isr for r in map(self.etcd.record, self.names)
                                            if r is not None and n in r.replicas)
            if back:
                self.lost.discard(n)
        if self.lost - {name}:
            return False
        for p in self.names:
            rec = self.etcd.record(p)
            if rec is None:
                return False
            if not any(m != name and p in self.nodes[m].disk for m in rec.isr):
                return False
        return True

    def _resume(self, node):
        if node.paused:
            node.paused = False
            buf, node.buffer = node.buffer, []
            for fn, args in buf:
                self.at_node(self.now, node, fn, *args, run=-1)

    def _set_loss(self, v):
        self.loss = v

    def _unslow(self):
        self.slow = max(0, self.slow - 1)

    def _etcd_uncut(self, name):
        if not self.healed:
            self.etcd_cut[name] -= 1

    def _heal(self):
        self.trace(None, "HEAL")
        self.healed = True
        self.ambushes.clear()
        self.publishing = False
        self.cut.clear()
        self.etcd_cut.clear()
        self.loss = 0.0
        self.slow = 0
        for node in self.nodes.values():
            self._resume(node)
            node.start()


def run_seed(seed, params=None, core=Core, trace=False):
    """Run one seed; returns the World (raises Violation with the story on failure)."""
    w = World(seed, params, core, trace)
    try:
        w.run()
    except Violation as e:
        raise Violation(f"seed {seed}: {e}\n{describe(w)}") from None
    return w


def describe(w):
    lines = [f"replay: .venv/bin/python tests/replication_sim.py --seed {w.seed} --trace",
             "faults (time, kind, target, ms, what happened):"]
    lines += [f"  {f}" for f in w.applied_faults]
    pending = [f for f in w.schedule if f[0] > w.now]
    if pending:
        lines.append(f"  (not reached: {pending})")
    lines.append("last events:")
    lines += [f"  {line}" for line in list(w.story)[-40:]]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, help="run this seed alone")
    ap.add_argument("--seeds", type=int, default=100, help="how many seeds to run")
    ap.add_argument("--start", type=int, default=0, help="the first seed")
    ap.add_argument("--trace", action="store_true", help="print every event of the run")
    ap.add_argument("--bug", help="run with this known bug in the core (replication_sim_bugs.BUGS) until a seed "
                                  "catches it")
    for f in fields(Params):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    a = ap.parse_args(argv)
    params = Params(**{f.name: getattr(a, f.name) for f in fields(Params)})
    seeds = [a.seed] if a.seed is not None else range(a.start, a.start + a.seeds)
    t0 = time.perf_counter()
    if a.bug:
        import replication_sim_bugs

        if a.bug not in replication_sim_bugs.BUGS:
            ap.error(f"--bug: one of {', '.join(map(repr, replication_sim_bugs.BUGS))}")
        seed, what = replication_sim_bugs.first_catch(a.bug, seeds, params)
        print(f"{a.bug}: " + (f"caught by {what}" if seed is not None else f"no seed of {len(seeds)} caught it")
              + f" ({time.perf_counter() - t0:.1f} s)")
        return 0 if seed is not None else 1
    failed = 0
    events = acks = 0
    for seed in seeds:
        try:
            w = run_seed(seed, params, trace=a.trace)
            events += w.events
            acks += len(w.oracle.acks)
            if a.seed is not None:
                print(f"seed {seed}: {w.events} events, {len(w.oracle.acks)} acknowledged, "
                      f"{sum(1 for f in w.applied_faults if f[4])} faults, {w.counts.get('leads', 0)} leaderships")
        except Violation as e:
            failed += 1
            print(e, file=sys.stderr)
            print(file=sys.stderr)
    dt = time.perf_counter() - t0
    n = len(seeds)
    print(f"{n} seeds, {failed} failed, {dt:.1f} s ({n / dt:.1f} seeds/s; {events / max(dt, 1e-9):,.0f} events/s; "
          f"{acks / max(n - failed, 1):.0f} acknowledged per run)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
