"""Partition metadata rules (docs/REPLICATION.md, "Control plane"), as pure functions.

Each partition's record lives in etcd at `<prefix>partitions/<P>` as JSON
`{"leader", "incarnation", "epoch", "isr", "replicas"}` and changes only by a
transaction that compares the key's revision (and, where liveness matters, a node
key's create revision) and puts the new record: etcd orders the changes, and the epoch
only grows, so a stale leader is fenced by it (Kafka's controller-epoch fix, KAFKA-6082).
Nothing here talks to etcd: each function takes the record as read (with its
`mod_revision`) and returns a `Txn` (what to compare, what to put) or None when the rule
does not allow the change; the I/O layer runs it, and the simulator's fake etcd too.

`incarnation` is the create revision of the leader's node key when leadership was
granted (KIP-380's broker epoch): a node that restarts registers anew, with a higher
one, and so can tell a record that names the process it was (it must take the
partition again with a new epoch: its unflushed records died with that process, and
the old epoch's records on the followers may not match its log) from one that names
the process it is.

`live` arguments map each node whose key exists to that key's create revision.
"""

import json
from dataclasses import dataclass

PARTITIONS = "partitions/"
NODES = "nodes/"


class RecordError(ValueError):
    """A partition record in etcd that is not one (not JSON, missing or mistyped fields)."""


@dataclass(frozen=True)
class PartitionRecord:
    leader: str | None
    incarnation: int
    epoch: int
    isr: tuple
    replicas: tuple

    def to_json(self):
        return json.dumps({"leader": self.leader, "incarnation": self.incarnation, "epoch": self.epoch,
                           "isr": list(self.isr), "replicas": list(self.replicas)}).encode()

    @classmethod
    def from_json(cls, raw):
        try:
            d = json.loads(raw)
            leader = d["leader"]
            rec = cls(None if leader is None else str(leader), int(d["incarnation"]), int(d["epoch"]),
                      tuple(str(n) for n in d["isr"]), tuple(str(n) for n in d["replicas"]))
        except (ValueError, KeyError, TypeError) as e:
            raise RecordError(f"malformed partition record: {e}") from None
        if rec.epoch < 0 or not set(rec.isr) <= set(rec.replicas) or len(set(rec.replicas)) != len(rec.replicas):
            raise RecordError(f"inconsistent partition record {rec}")
        return rec

    def replace(self, **changes):
        fields = {"leader": self.leader, "incarnation": self.incarnation, "epoch": self.epoch,
                  "isr": self.isr, "replicas": self.replicas}
        fields.update(changes)
        return PartitionRecord(**fields)


@dataclass(frozen=True)
class Compare:
    """`key`'s `target` ("mod": mod_revision; "create": create_revision, 0 if the key
    does not exist) must equal `value`."""
    key: str
    target: str
    value: int


@dataclass(frozen=True)
class Txn:
    """If every compare holds, put `record` at `key`; else change nothing."""
    compares: tuple
    key: str
    record: PartitionRecord

    @property
    def value(self):
        return self.record.to_json()


def partition_key(prefix, partition):
    return f"{prefix}{PARTITIONS}{partition}"


def node_key(prefix, node):
    return f"{prefix}{NODES}{node}"


def create(prefix, partition, node, incarnation):
    """The first record of `partition`, by its node: leader of it alone at epoch 0."""
    key = partition_key(prefix, partition)
    return Txn((Compare(key, "create", 0),), key, PartitionRecord(node, incarnation, 0, (node,), (node,)))


def role(record, me, incarnation):
    """What node `me`, registered as `incarnation`, is for this partition: "lead" (the
    record names this process), "reclaim" (it names an earlier process of this node:
    take the partition again with a new epoch, `election`, or give it up, `leave_isr`),
    "follow" or "none"."""
    if record.leader == me:
        return "lead" if record.incarnation == incarnation else "reclaim"
    return "follow" if me in record.replicas else "none"


def election(prefix, partition, record, revision, candidate, incarnation, live, has_replica, min_insync=1):
    """`candidate` takes leadership: only a member of the ISR (never an unclean election:
    a replica outside it may lack acknowledged records), only with its replica on disk
    (a replacement node with an empty data directory holds nothing yet, whatever the
    ISR says), and only when the partition has no leader, or its leader's node key is
    gone (lease expired: it has stopped acknowledging), or the leader is the candidate's
    own earlier process. The new record has epoch + 1.

    The lost leader leaves the ISR (it rejoins after catching up) unless that would
    leave fewer than `min_insync` members: below that the HW cannot move without it
    anyway, and it holds every record committed so far (the HW counted it), so it stays
    eligible: if the new leader is lost too, the old one can take over (KIP-966's
    eligible leader replicas; without this an old leader cut from etcd and a new leader
    lost for good would leave no replica that may lead). A restarted leader stays (its
    fsynced log holds every record the HW counted it for)."""
    key = partition_key(prefix, partition)
    if candidate not in record.isr or live.get(candidate) != incarnation or not has_replica:
        return None
    compares = [Compare(key, "mod", revision)]
    isr = record.isr
    if record.leader is None:
        pass
    elif record.leader == candidate:
        if record.incarnation == incarnation:
            return None  # already this process's
        compares.append(Compare(node_key(prefix, candidate), "create", incarnation))
    elif record.leader not in live:
        compares.append(Compare(node_key(prefix, record.leader), "create", 0))
        without = tuple(n for n in isr if n != record.leader)
        if len(without) >= min_insync:
            isr = without
    else:
        return None
    return Txn(tuple(compares), key, record.replace(leader=candidate, incarnation=incarnation,
                                                    epoch=record.epoch + 1, isr=isr))


def leave_isr(prefix, partition, record, revision, me):
    """A replica that does not hold its data (its node was replaced by an empty one) takes
    itself out of the ISR before anything else, so it can never be elected on an empty
    log; named leader, it gives leadership up (no leader, epoch + 1: any ISR member may
    take it)."""
    key = partition_key(prefix, partition)
    if me not in record.isr and record.leader != me:
        return None
    isr = tuple(n for n in record.isr if n != me)
    if record.leader == me:
        new = record.replace(leader=None, incarnation=0, epoch=record.epoch + 1, isr=isr)
    else:
        new = record.replace(isr=isr)
    return Txn((Compare(key, "mod", revision),), key, new)


def _led_by(record, leader, incarnation, epoch):
    return record.leader == leader and record.incarnation == incarnation and record.epoch == epoch


def isr_change(prefix, partition, record, revision, leader, incarnation, epoch, isr):
    """The leader of `epoch` sets the ISR (a shrink or an expansion it decided)."""
    key = partition_key(prefix, partition)
    isr = tuple(isr)
    if not _led_by(record, leader, incarnation, epoch) or leader not in isr or not set(isr) <= set(record.replicas):
        return None
    return Txn((Compare(key, "mod", revision),), key, record.replace(isr=isr))


def replica_load(records):
    """node -> how many partitions it replicates, over `records` (an iterable of records)."""
    load = {}
    for rec in records:
        for n in rec.replicas:
            load[n] = load.get(n, 0) + 1
    return load


def grow_replicas(prefix, partition, record, revision, leader, incarnation, wanted, live, load):
    """The leader grows the replica list to `wanted` with live nodes that replicate the
    fewest partitions (ties by name). The new replicas start outside the ISR."""
    key = partition_key(prefix, partition)
    if not _led_by(record, leader, incarnation, record.epoch) or len(record.replicas) >= wanted:
        return None
    candidates = sorted((n for n in live if n not in record.replicas), key=lambda n: (load.get(n, 0), n))
    added = tuple(candidates[:wanted - len(record.replicas)])
    if not added:
        return None
    return Txn((Compare(key, "mod", revision),), key, record.replace(replicas=record.replicas + added))


def wants_handover(record, partition, live):
    """Whether the partition's own node (partitions are named after their node) should
    get its leadership back: it is alive, in the ISR, and not the leader."""
    return record.leader not in (None, partition) and partition in record.isr and partition in live


def handover(prefix, partition, record, revision, leader, incarnation, to, live):
    """The leader hands leadership to `to`, an ISR member that is alive (the preferred
    leader's return, after the leader stopped acknowledging and committed what it had):
    epoch + 1, ISR unchanged, granted to `to`'s current process. The caller must have
    seen that process caught up (`PartitionLeader.position(to)` at the log end, from the
    incarnation `live` names): a node replaced by an empty one is still in the ISR until
    it has taken itself out (`leave_isr`), and must not be handed anything before."""
    key = partition_key(prefix, partition)
    if not _led_by(record, leader, incarnation, record.epoch) or to not in record.isr or to not in live:
        return None
    return Txn((Compare(key, "mod", revision), Compare(node_key(prefix, to), "create", live[to])), key,
               record.replace(leader=to, incarnation=live[to], epoch=record.epoch + 1))


def reassign(prefix, partition, record, revision, lost, new, live):
    """Move a lost node's replica to node `new` (`wrenmq cluster reassign`): `lost` must be
    gone (no node key); it leaves the replicas and the ISR, `new` joins the replicas (and
    catches up before the leader adds it to the ISR). A lost leader leaves no leader
    (epoch + 1): an ISR member takes it."""
    key = partition_key(prefix, partition)
    if lost in live or lost not in record.replicas or new in record.replicas or new not in live:
        return None
    replicas = tuple(new if n == lost else n for n in record.replicas)
    isr = tuple(n for n in record.isr if n != lost)
    if record.leader == lost:
        new_rec = record.replace(leader=None, incarnation=0, epoch=record.epoch + 1, isr=isr, replicas=replicas)
    else:
        new_rec = record.replace(isr=isr, replicas=replicas)
    return Txn((Compare(key, "mod", revision), Compare(node_key(prefix, lost), "create", 0)), key, new_rec)
