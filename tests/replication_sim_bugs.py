"""Known replication bugs, each put into the real core by overriding one method or one
rule: the simulator must catch them (test_replication_sim.py), which shows it has teeth.

    .venv/bin/python tests/replication_sim.py --bug "truncate by HW instead of by epoch" --seeds 300

runs seeds until one catches the bug, and says which seed and what invariant broke.
"""

import replication_sim as S
from wrenmq.cluster import replication as R
from wrenmq.cluster import replication_control as RC
from wrenmq.cluster.replication_frames import NO_EPOCH


class TruncateByHighWatermark(R.PartitionFollower):
    """Kafka before KIP-101: on a leader change, truncate to the high watermark and fetch
    from there with no epoch to check."""

    def leader_changed(self, leader, epoch, now):
        out = []
        if epoch > self.epoch and leader not in (None, self.node) and self.hw < self.log_end:
            target = max(self.hw, self.log_start)
            out.append(R.Truncate(target))
            self.log_end = target
            self.durable_end = min(self.durable_end, target)
            if self.epochs.truncate_from_end(target):
                out.append(R.SaveEpochs(self.epochs.to_text()))
        return out + super().leader_changed(leader, epoch, now)

    @property
    def last_fetched_epoch(self):
        return NO_EPOCH


class HwOverMinInsync(R.PartitionLeader):
    """The HW where the leader and the best min_insync - 1 followers of the ISR hold the
    records: enough copies, but not on every replica that may be elected."""

    def compute_hw(self):
        if len(self.isr) < self.min_insync:
            return None
        ends = sorted((self.position(m)[1] for m in self.hw_members()
                       if m != self.node and self.position(m) is not None), reverse=True)
        if len(ends) < self.min_insync - 1:
            return None
        return min([self.durable_end] + ends[:self.min_insync - 1])


class LeaderAcceptsLowerEpoch(R.PartitionLeader):
    """A FETCH of an older epoch is served and counted as if it were of this one."""

    def on_fetch(self, follower, fetch, now):
        if fetch.epoch < self.epoch:
            fetch = fetch._replace(epoch=self.epoch)
        return super().on_fetch(follower, fetch, now)


class LeaderTrustsLowerEpoch(R.PartitionLeader):
    """A FETCH of an older epoch is served and counted without the history check: a
    leader of the days before fetches carried the follower's last epoch (KIP-320, KIP-595's
    fetch-time form of KIP-279), where the epoch comparison was the only guard."""

    trusting = False

    def on_fetch(self, follower, fetch, now):
        self.trusting = fetch.epoch < self.epoch
        if self.trusting:
            fetch = fetch._replace(epoch=self.epoch)
        return super().on_fetch(follower, fetch, now)

    def check_history(self, fetch):
        return None if self.trusting else super().check_history(fetch)


class FollowerAcceptsLowerEpoch(R.PartitionFollower):
    """Metadata of an older epoch (a stale read) makes the follower follow that epoch's
    leader again."""

    def leader_changed(self, leader, epoch, now):
        if epoch < self.epoch:
            self.epoch = NO_EPOCH
        return super().leader_changed(leader, epoch, now)


def unclean_election(prefix, partition, record, revision, candidate, incarnation, live, has_replica,
                     min_insync=1):
    """Any replica may take leadership, in the ISR or not."""
    if candidate in record.replicas and candidate not in record.isr:
        record = record.replace(isr=record.isr + (candidate,))
    return RC.election(prefix, partition, record, revision, candidate, incarnation, live, has_replica,
                       min_insync)


def election_keeping_the_epoch(prefix, partition, record, revision, candidate, incarnation, live, has_replica,
                               min_insync=1):
    """A new leader takes over at the old leader's epoch instead of a higher one."""
    txn = RC.election(prefix, partition, record, revision, candidate, incarnation, live, has_replica, min_insync)
    return txn if txn is None else RC.Txn(txn.compares, txn.key, txn.record.replace(epoch=record.epoch))


class HwOnProposedShrink(R.PartitionLeader):
    """The HW moves on the smaller ISR as soon as the shrink is proposed, before etcd
    confirms it."""

    def hw_members(self):
        members = list(self.pending if self.pending is not None else self.isr)
        return members if self.node in members else members + [self.node]


class RejoinAtStaleHw(R.PartitionLeader):
    """A follower rejoins the ISR at the HW alone, even below the leader's epoch start
    (KAFKA-7128)."""

    def may_rejoin(self, position):
        return position >= self.hw


class NewcomerNotCounted(R.PartitionLeader):
    """An expansion counts the newcomer only once etcd confirms it."""

    def hw_members(self):
        members = list(self.isr)
        return members if self.node in members else members + [self.node]


def core(**kw):
    return type("BuggyCore", (S.Core,), kw)


BUGS = {
    "truncate by HW instead of by epoch": core(Follower=TruncateByHighWatermark),
    "HW from min_insync members instead of the whole ISR": core(Leader=HwOverMinInsync),
    "a leader that accepts a lower epoch": core(Leader=LeaderAcceptsLowerEpoch),
    "a leader that trusts a lower epoch": core(Leader=LeaderTrustsLowerEpoch),
    "a follower that accepts a lower epoch": core(Follower=FollowerAcceptsLowerEpoch),
    "election of a non-ISR replica": core(election=staticmethod(unclean_election)),
    "a new leader that keeps the old epoch": core(election=staticmethod(election_keeping_the_epoch)),
    "HW moved on a shrunk ISR before etcd confirms": core(Leader=HwOnProposedShrink),
    "a follower rejoins at a stale HW (KAFKA-7128)": core(Leader=RejoinAtStaleHw),
    "an expansion counted only once confirmed": core(Leader=NewcomerNotCounted),
}


# Caught within make test's seeds (300). Of the others, measured over 2,000 seeds:
# - "a follower rejoins at a stale HW (KAFKA-7128)": seed 600; "an expansion counted only
#   once confirmed": seed 932; "a leader that trusts a lower epoch": seed 928 (narrow
#   windows: make sim finds them);
# - "a leader that accepts a lower epoch": none. The epoch comparison on FETCH is not
#   what keeps the data here: every fetch is also checked against the leader's epoch
#   history, positions are kept per follower incarnation, and an answer must echo its
#   fetch's number (unique in the process). It found one hole with the check out: fetch
#   numbers restarted with each follower object (seed 1554, fixed);
# - "a follower that accepts a lower epoch": none: the node reads etcd in revision order,
#   so no older record reaches leader_changed, and a frame of an older epoch answers no
#   fetch in flight.
CAUGHT_IN_TEST = (
    "truncate by HW instead of by epoch",
    "HW from min_insync members instead of the whole ISR",
    "election of a non-ISR replica",
    "a new leader that keeps the old epoch",
    "HW moved on a shrunk ISR before etcd confirms",
)


def first_catch(name, seeds, params=None):
    """(seed, the first line of what broke) of the first seed that catches bug `name`,
    or (None, None)."""
    for seed in seeds:
        try:
            S.run_seed(seed, params, core=BUGS[name])
        except S.Violation as e:
            return seed, str(e).split("\n")[0]
    return None, None
