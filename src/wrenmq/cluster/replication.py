"""Partition replication, sans-IO: the leader's and the follower's state machines.

With `[cluster] replicas = R`, each node's commit log is a partition kept on R nodes: a
leader, which appends, and followers, which fetch its batches and append them verbatim
at the same offsets (docs/REPLICATION.md). This module decides; it reads no clock, socket or
file. Its inputs are frames (`replication_frames`), local log events and the time, as
arguments; its outputs are lists of decision objects that the I/O layer carries out in
order: send a frame, read a range of the log and send it, append, truncate, persist the
epoch history, run an etcd transaction, release output up to the high watermark.

The rules, and where they come from:

- A record is committed, and the broker may acknowledge it, once every member of the
  in-sync set (ISR), leader included, holds it durably, and only while the ISR has at
  least `min_insync` members: the high watermark (HW) is the minimum of their durable
  ends, never the `min_insync`-th best one (a lagging ISR member may be the next leader).
- The ISR changes only through etcd transactions; until one is confirmed the HW is
  computed over the union of the old and the proposed set (Kafka's "maximal ISR",
  KIP-497): a shrink does not let the HW pass the member being dropped, an expansion
  counts the member being added.
- A follower rejoins the ISR only once it has reached both the HW and the start of the
  leader's current epoch: a new leader's HW can lag the old leader's, and a follower
  admitted at that stale HW could lack records the old leader acknowledged (KAFKA-7128).
- Followers truncate by leader epoch, never by HW (KIP-101, KIP-279): every FETCH
  carries the epoch of the follower's last record and the leader checks it against its
  own epoch history before the fetch counts or gets data; a mismatch is answered with
  DIVERGED and the follower truncates to where the two histories part, re-checked on
  every fetch and so after every epoch change (KAFKA-7164).
- Every frame carries the sender's leader epoch; a lower one is refused (FENCED), a
  higher one fences a leader at once and makes a follower re-read the partition's
  record (KAFKA-6082: fencing by a number that only grows).

Offsets: a log holds records [log_start, log_end); "durable end" is the end of what is
fsynced; the HW is an end too (records below it are committed).
"""

import itertools
from dataclasses import dataclass

from . import replication_frames as frames
from .replication_epochs import LeaderEpochsError
from .replication_frames import NO_EPOCH


class ReplicationError(RuntimeError):
    """A peer broke the protocol in a way no correct peer can (data that does not follow
    the log, a truncation below the high watermark): the I/O layer drops the connection,
    logs it and refetches; nothing is appended or truncated."""


# --------------------------------------------------------------------------- decisions

@dataclass(frozen=True, slots=True)
class Send:
    """Send `frame` (a replication_frames object) to node `to`."""
    to: str
    frame: object


@dataclass(frozen=True, slots=True)
class SendData:
    """Read the log from `start` (below `end`, the log end when decided; as much as one
    frame may carry, at least one batch) and send it to `follower` as DATA answering its
    fetch (`incarnation`, `seq`), with `epoch` and `hw`. `start == end`: an empty DATA."""
    follower: str
    incarnation: int
    seq: int
    epoch: int
    hw: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class SendSnapshot:
    """The follower's fetch offset is below this log's start: send it the state database
    as SNAPSHOT chunks (consistent with the offset it is applied through, which must not
    be below the log start), answering its fetch (`incarnation`, `seq`)."""
    follower: str
    incarnation: int
    seq: int
    epoch: int


@dataclass(frozen=True, slots=True)
class ProposeIsr:
    """Run the etcd transaction that sets the partition's ISR to `isr` (compared on the
    record's revision; `replication_control.isr_change`), then report the outcome with
    `isr_changed` or `isr_change_failed`."""
    isr: tuple
    epoch: int


@dataclass(frozen=True, slots=True)
class HighWatermark:
    """Records below `hw` are committed: release the output held for them (leader), apply
    the state records below it (every replica)."""
    hw: int


@dataclass(frozen=True, slots=True)
class Fenced:
    """This leader saw `epoch`, higher than its own: it has stopped (acknowledges nothing
    more); re-read the partition's record and follow."""
    epoch: int


@dataclass(frozen=True, slots=True)
class RefreshMetadata:
    """A frame carried `epoch`, higher than this follower knows: re-read the partition's
    record (then `leader_changed`)."""
    epoch: int


@dataclass(frozen=True, slots=True)
class SaveEpochs:
    """Persist the epoch history (`text`, atomically). Comes before the Append that needs
    it and after the Truncate that shortened it, so a crash never leaves durable records
    whose epoch the history does not know."""
    text: str


@dataclass(frozen=True, slots=True)
class Append:
    """Append these batches (replication_frames.Batch) at the log end, as they are."""
    batches: list


@dataclass(frozen=True, slots=True)
class Truncate:
    """Remove the records from `offset` on (the log then ends at `offset`)."""
    offset: int


@dataclass(frozen=True, slots=True)
class BeginSnapshot:
    """A state snapshot (`total` bytes, applied through `applied_through`) is coming for a
    log that will start at `log_start`: start a new temporary file (dropping any earlier
    partial one)."""
    log_start: int
    applied_through: int
    total: int


@dataclass(frozen=True, slots=True)
class WriteSnapshot:
    """Write `data` at `offset` of the snapshot being received."""
    offset: int
    data: bytes


@dataclass(frozen=True, slots=True)
class InstallSnapshot:
    """The snapshot is complete: make it the state database (applied through
    `applied_through`) and replace the log by an empty one starting at `log_start`."""
    log_start: int
    applied_through: int


# --------------------------------------------------------------------------- leader

class PartitionLeader:
    """The leader of one partition for one epoch (a new object per epoch: positions
    learned in an earlier epoch mean nothing in this one).

    Inputs: `start()` once, then `local_appended`, `local_durable`, `log_start_moved`,
    `on_fetch`, `on_fenced`, `tick`, `isr_changed`, `isr_change_failed`, `fenced`. Each returns a list
    of decisions. `hw` only grows; `fenced_epoch` is set once it has stopped.

    Follower positions: each FETCH that passes the epoch check reports the follower's
    durable end. Positions are kept per follower incarnation (the etcd registration
    revision of its node, KIP-380's broker epoch): a later incarnation replaces what an
    earlier one said (a node replaced by an empty one starts from nothing), an earlier
    one is ignored, and within one incarnation a position only grows, so a FETCH that the
    network duplicated or delayed cannot move it back or forward wrongly."""

    def __init__(self, partition, node, epoch, isr, replicas, min_insync, epochs, *, log_start, log_end,
                 durable_end, hw, now, lag_ms, heartbeat_ms):
        self.partition = partition
        self.node = node
        self.epoch = epoch
        self.isr = tuple(isr)
        self.replicas = tuple(replicas)
        self.min_insync = min_insync
        self.epochs = epochs
        self.log_start = log_start
        self.log_end = log_end
        self.durable_end = min(durable_end, log_end)
        self.hw = min(hw, self.durable_end)
        self.epoch_start = log_end
        self.lag_ms = lag_ms
        self.heartbeat_ms = heartbeat_ms
        self.fenced_epoch = None
        self.pending = None  # ISR proposed to etcd, not yet confirmed or refused
        self._positions = {}  # follower -> [incarnation, durable end]
        self._caught_up = {m: now for m in self.isr}  # follower -> last time it was caught up
        self._last_fetch = {}  # follower -> (time, log end) at its previous fetch
        self._parked = {}  # follower -> [incarnation, seq, fetch offset, deadline, hw sent]

    # -- inputs ------------------------------------------------------------------

    def start(self):
        """Take the epoch: its records begin at the log end (KIP-279: the epoch is assigned
        when leadership starts, so a follower asking about the previous epoch learns where
        it ended even before this leader appends anything)."""
        if self.epochs.assign(self.epoch, self.log_end):
            return [SaveEpochs(self.epochs.to_text())]
        return []

    @property
    def accepting(self):
        """Whether a QoS 1/2 PUBLISH may be logged now: not fenced and enough replicas in
        sync (docs/REPLICATION.md: refused before it is logged otherwise)."""
        return self.fenced_epoch is None and len(self.isr) >= self.min_insync

    def local_appended(self, end, now):
        """The leader's own log now ends at `end`: answer the fetches parked at the end."""
        if self.fenced_epoch is not None or end <= self.log_end:
            return []
        self.log_end = end
        out = []
        for follower, p in list(self._parked.items()):
            if p[2] < end:
                del self._parked[follower]
                out.append(SendData(follower, p[0], p[1], self.epoch, self.hw, p[2], end))
        return out

    def local_durable(self, end, now):
        """The leader's own log is durable up to `end`."""
        if self.fenced_epoch is not None:
            return []
        self.durable_end = max(self.durable_end, min(end, self.log_end))
        out = []
        self._advance_hw(out)
        return out

    def log_start_moved(self, start):
        """Retention removed the records below `start` (never past the HW's applied state)."""
        self.log_start = start
        if self.epochs.truncate_from_start(start):
            return [SaveEpochs(self.epochs.to_text())]
        return []

    def on_fetch(self, follower, fetch, now):
        """A FETCH from `follower` (the node its connection's HELLO named)."""
        if self.fenced_epoch is not None:
            return []
        if fetch.epoch < self.epoch:
            return [Send(follower, frames.Fenced(self.partition, self.epoch))]
        if fetch.epoch > self.epoch:
            return self._fence(fetch.epoch)
        if follower == self.node or follower not in self.replicas:
            return []  # not (yet) a replica here: `isr_changed` brings the replica list
        pos = self._positions.get(follower)
        if pos is not None and fetch.incarnation < pos[0]:
            return []  # from a process of that node that has since been replaced
        if fetch.fetch_offset < self.log_start:
            return [SendSnapshot(follower, fetch.incarnation, fetch.seq, self.epoch)]
        diverged = self.check_history(fetch)
        if diverged is not None:
            return [Send(follower, frames.Diverged(self.partition, self.epoch, fetch.incarnation, fetch.seq,
                                                   *diverged))]
        out = []
        self._parked.pop(follower, None)  # an earlier fetch of its, answered or given up on
        self._record_position(follower, fetch.incarnation, fetch.fetch_offset, now)
        self._advance_hw(out)
        self._maybe_expand(follower, out)
        if fetch.fetch_offset < self.log_end:
            out.append(SendData(follower, fetch.incarnation, fetch.seq, self.epoch, self.hw,
                                fetch.fetch_offset, self.log_end))
        else:  # long poll: answered when data comes, the HW moves or the heartbeat is due
            self._parked[follower] = [fetch.incarnation, fetch.seq, fetch.fetch_offset,
                                      now + self.heartbeat_ms, self.hw]
        return out

    def tick(self, now):
        """Heartbeats for long polls that are due; ISR shrink for followers that have not
        been caught up for `lag_ms`."""
        if self.fenced_epoch is not None:
            return []
        out = []
        for follower, p in list(self._parked.items()):
            if p[3] <= now:
                del self._parked[follower]
                out.append(SendData(follower, p[0], p[1], self.epoch, self.hw, p[2], p[2]))
        if self.pending is None:
            lagging = [m for m in self.isr if m != self.node and now - self._caught_up.get(m, now) > self.lag_ms]
            if lagging:
                proposal = self._shrunk(lagging)
                if proposal != self.isr:
                    self.pending = proposal
                    out.append(ProposeIsr(proposal, self.epoch))
        return out

    def isr_changed(self, isr, epoch, now, replicas=None):
        """etcd holds this ISR (and replica list) for the partition now: a transaction of this
        leader succeeded, or another change was read (a replaced node leaving the ISR). A
        proposal stays pending until this ISR is the proposed one or `isr_change_failed`
        says it can no longer be: until then it may still be applied."""
        if self.fenced_epoch is not None:
            return []
        if epoch > self.epoch:
            return self._fence(epoch)
        if epoch < self.epoch:
            return []  # a stale read
        isr = tuple(isr)
        for m in isr:
            if m not in self.isr:
                self._caught_up[m] = now
        self.isr = isr
        if replicas is not None:
            self.replicas = tuple(replicas)
        if self.pending is not None and set(self.pending) == set(isr):
            self.pending = None
        out = []
        self._advance_hw(out)
        return out

    def isr_change_failed(self, now):
        """The proposed ISR change can no longer be applied (its transaction failed, or the
        record moved past the revision it compared): back to the confirmed ISR."""
        if self.fenced_epoch is not None or self.pending is None:
            return []
        self.pending = None
        out = []
        self._advance_hw(out)
        return out

    def on_fenced(self, sender, fenced, now):
        """A FENCED frame: a follower knows a higher epoch (this node is a stale leader)."""
        if self.fenced_epoch is None and fenced.epoch > self.epoch:
            return self._fence(fenced.epoch)
        return []

    def position(self, follower):
        """(incarnation, durable end) the follower last reported in this epoch, or None."""
        pos = self._positions.get(follower)
        return None if pos is None else tuple(pos)

    def fenced(self, epoch):
        """The I/O layer learned that this leadership is over (a higher epoch in etcd, its
        lease ran out, leadership handed over): acknowledge nothing more."""
        if self.fenced_epoch is None:
            self.fenced_epoch = epoch
            self._parked.clear()
        return []

    # -- internals -----------------------------------------------------------------

    def _fence(self, epoch):
        self.fenced(epoch)
        return [Fenced(epoch)]

    def check_history(self, fetch):
        """None if the follower's log up to its fetch offset is a prefix of this one, else
        (diverging epoch, end offset) for DIVERGED. The check is KIP-595's fetch-time form of
        KIP-279: the follower's last record has epoch `last_fetched_epoch`; if this history
        has that epoch and it reaches the fetch offset, that record is this log's record at
        the same offset (one leader per epoch wrote both), and so is everything before it."""
        lfe = fetch.last_fetched_epoch
        if lfe == NO_EPOCH:  # an empty log starting at its fetch offset holds nothing to check
            if fetch.fetch_offset <= self.log_end:
                return None
            return NO_EPOCH, self.log_end
        epoch, end = self.epochs.end_offset_for(lfe, self.log_end)
        if epoch == NO_EPOCH:
            return NO_EPOCH, self.log_start
        if epoch < lfe or end < fetch.fetch_offset:
            return epoch, end
        return None

    def _record_position(self, follower, incarnation, offset, now):
        pos = self._positions.get(follower)
        if pos is None or incarnation > pos[0]:
            self._positions[follower] = [incarnation, offset]
            self._last_fetch.pop(follower, None)
        elif offset > pos[1]:
            pos[1] = offset
        # Caught up: at the log end now, or at least where the log ended at its previous
        # fetch (a follower that keeps up under steady load is always a little behind;
        # Kafka's Replica.updateFetchState does the same).
        prev = self._last_fetch.get(follower)
        if offset >= self.log_end:
            self._caught_up[follower] = now
        elif prev is not None and offset >= prev[1]:
            self._caught_up[follower] = max(self._caught_up.get(follower, prev[0]), prev[0])
        self._last_fetch[follower] = (now, self.log_end)

    def _position(self, member):
        if member == self.node:
            return self.durable_end
        pos = self._positions.get(member)
        return None if pos is None else pos[1]

    def hw_members(self):
        """The replicas the HW is the minimum over: the confirmed ISR, and while a change is
        proposed, the proposed members too (an expansion counts the newcomer at once; a
        shrink drops nobody before etcd confirms it)."""
        members = list(self.isr)
        if self.pending is not None:
            members += [m for m in self.pending if m not in members]
        if self.node not in members:
            members.append(self.node)
        return members

    def compute_hw(self):
        """The HW the ISR allows now: the minimum of the members' durable ends (`hw_members`),
        or None while fewer than `min_insync` are in sync or a member has not fetched yet."""
        if len(self.isr) < self.min_insync:
            return None
        low = None
        for m in self.hw_members():
            p = self._position(m)
            if p is None:
                return None  # a member that has not fetched in this epoch yet
            if low is None or p < low:
                low = p
        return low

    def _advance_hw(self, out):
        hw = self.compute_hw()
        if hw is None or hw <= self.hw:
            return
        self.hw = hw
        out.append(HighWatermark(hw))
        # Parked followers learn the new HW now rather than at the next heartbeat: they
        # apply state up to it, and a new leader is ready to serve only once its HW
        # reaches its log end.
        for follower, p in list(self._parked.items()):
            if p[4] < hw:
                del self._parked[follower]
                out.append(SendData(follower, p[0], p[1], self.epoch, hw, p[2], p[2]))

    def may_rejoin(self, position):
        """Whether a follower durable up to `position` may join the ISR: it holds everything
        below the HW, and everything this leader had when its epoch began (the HW of a new
        leader can lag the old leader's: a follower that reached only that stale HW could
        lack records the old leader acknowledged, KAFKA-7128)."""
        return position >= self.hw and position >= self.epoch_start

    def _maybe_expand(self, follower, out):
        if follower in self.isr or self.pending is not None:
            return
        p = self._position(follower)
        if p is not None and self.may_rejoin(p):
            self.pending = self.isr + (follower,)
            out.append(ProposeIsr(self.pending, self.epoch))

    def _shrunk(self, lagging):
        """The ISR without the lagging followers, but never below `min_insync` members:
        below it the HW cannot move anyway, and a dropped replica could no longer be
        elected although it holds everything below the HW (what KIP-966's eligible
        leader replicas keep). The lagging members kept are those furthest along."""
        keep = [m for m in self.isr if m not in lagging]
        if len(keep) < self.min_insync:
            def furthest(m):
                p = self._position(m)
                return (1, 0, m) if p is None else (0, -p, m)

            ranked = sorted(lagging, key=furthest)
            keep += ranked[:self.min_insync - len(keep)]
        return tuple(m for m in self.isr if m in keep)


# --------------------------------------------------------------------------- follower

class PartitionFollower:
    """A follower of one partition, for as long as this node follows it (across leader
    changes: `leader_changed`).

    Inputs: `leader_changed`, `on_data`, `on_diverged`, `on_fenced`, `on_snapshot`,
    `local_durable`, `log_start_moved`, `tick`; each returns a list of decisions.

    It has one FETCH outstanding at a time and sends the next only once its log is
    durable up to the fetch offset (the offset is the acknowledgement the leader counts).
    Only the answer to the outstanding fetch is taken (same `incarnation` and `seq`);
    anything else is a duplicate or arrived late and is dropped. So a sequence number
    must not come twice in one incarnation, even from a follower object that replaced
    this one (the node led the partition for a while, then followed again): `seqs` is
    an iterator of numbers shared by every follower of the node's process
    (`itertools.count(1)`); without it each follower counts on its own. `hw` is the highest
    high watermark known and held locally (never above the durable end): state is
    applied up to it."""

    def __init__(self, partition, node, incarnation, epochs, *, log_start, log_end, durable_end, hw,
                 fetch_timeout_ms, seqs=None):
        self.partition = partition
        self.node = node
        self.incarnation = incarnation
        self.epochs = epochs
        self.log_start = log_start
        self.log_end = log_end
        self.durable_end = min(durable_end, log_end)
        self.hw = hw
        self.leader_hw = hw
        self.fetch_timeout_ms = fetch_timeout_ms
        self.leader = None
        self.epoch = NO_EPOCH
        self._seqs = itertools.count(1) if seqs is None else seqs
        self._waiting = None  # (seq, fetch offset, time sent) of the fetch in flight
        self._snapshot = None  # [seq, log start, applied through, total, received, last time]

    @property
    def last_fetched_epoch(self):
        """The epoch of the last record held (NO_EPOCH for an empty log)."""
        if self.log_end <= self.log_start:
            return NO_EPOCH
        return self.epochs.epoch_at(self.log_end - 1)

    def leader_changed(self, leader, epoch, now):
        """The partition's record names `leader` (None: no leader) at `epoch`. A lower epoch
        than known is a stale read and refused. Any change drops the fetch in flight: the
        next fetch is checked against the new leader's history."""
        if epoch < self.epoch or (epoch == self.epoch and leader == self.leader):
            return []
        self.leader = leader
        self.epoch = epoch
        self._waiting = None
        self._snapshot = None
        if leader is None or leader == self.node:
            return []
        return self._fetch(now)

    def on_data(self, sender, data, now):
        out = self._check_reply(sender, data)
        if out is not None:
            return out
        self._waiting = None
        out = []
        batches = data.batches
        if batches:
            if batches[0].base != self.log_end:
                raise ReplicationError(f"{sender} sent data at {batches[0].base} for a fetch at {self.log_end}")
            changed = False
            try:
                for b in batches:
                    changed |= self.epochs.assign(b.epoch, b.base)
            except LeaderEpochsError as e:
                raise ReplicationError(f"{sender} sent {e}") from None
            if changed:
                out.append(SaveEpochs(self.epochs.to_text()))
            out.append(Append(batches))
            last = batches[-1]
            self.log_end = last.base + last.count
        if data.hw > self.leader_hw:
            self.leader_hw = data.hw
        self._update_hw(out)
        out += self._fetch(now)
        return out

    def on_diverged(self, sender, div, now):
        """Truncate where this log and the leader's part (KIP-279), then fetch again; the
        next fetch is checked again, until the histories agree."""
        out = self._check_reply(sender, div)
        if out is not None:
            return out
        self._waiting = None
        target = self.truncation_point(div.diverging_epoch, div.end_offset)
        if target < self.hw or target < self.log_start:
            raise ReplicationError(f"{sender} would have this replica truncate to {target}, below its "
                                   f"high watermark {self.hw} or log start {self.log_start}")
        out = []
        if target < self.log_end:
            out.append(Truncate(target))
            self.log_end = target
            self.durable_end = min(self.durable_end, target)
            if self.epochs.truncate_from_end(target):
                out.append(SaveEpochs(self.epochs.to_text()))
        out += self._fetch(now)
        return out

    def truncation_point(self, diverging_epoch, end_offset):
        """Where to truncate when the leader says its history has `diverging_epoch` (the
        largest epoch at most our last fetched one) ending at `end_offset`. If this log
        has that epoch too, both agree up to the smaller end; if not, the records of this
        log from the end of its own floor of that epoch on are in epochs the leader never
        had, and the next fetch checks again (Kafka's getOffsetTruncationState)."""
        if diverging_epoch == NO_EPOCH:
            return min(end_offset, self.log_end)
        epoch, end = self.epochs.end_offset_for(diverging_epoch, self.log_end)
        if epoch == NO_EPOCH:
            return self.log_start
        if epoch == diverging_epoch:
            return min(end, end_offset, self.log_end)
        return min(end, self.log_end)

    def on_fenced(self, sender, fenced, now):
        if fenced.epoch > self.epoch:
            return [RefreshMetadata(fenced.epoch)]
        return []

    def on_snapshot(self, sender, snap, now):
        """A chunk of the leader's state database; chunks come in order on one connection,
        and a gap (a lost chunk) abandons the snapshot: the fetch is retried."""
        if snap.chunk_offset == 0:
            out = self._check_reply(sender, snap)
            if out is not None:
                return out
            self._waiting = None
            self._snapshot = [snap.seq, snap.log_start, snap.applied_through, snap.total, 0, now]
            out = [BeginSnapshot(snap.log_start, snap.applied_through, snap.total)]
        else:
            s = self._snapshot
            if (s is None or snap.epoch != self.epoch or sender != self.leader
                    or snap.incarnation != self.incarnation or s[:4] != [snap.seq, snap.log_start,
                                                                        snap.applied_through, snap.total]):
                return []
            if snap.chunk_offset != s[4]:
                if snap.chunk_offset > s[4]:
                    self._snapshot = None
                    return self._fetch(now)
                return []  # a duplicate
            out = []
        s = self._snapshot
        if snap.data:
            out.append(WriteSnapshot(snap.chunk_offset, snap.data))
        s[4] += len(snap.data)
        s[5] = now
        if snap.last:
            self._snapshot = None
            out.append(InstallSnapshot(snap.log_start, snap.applied_through))
            self.log_start = self.log_end = self.durable_end = snap.log_start
            if self.epochs.clear():
                out.append(SaveEpochs(self.epochs.to_text()))
            self.hw = max(self.hw, snap.applied_through)
            self.leader_hw = max(self.leader_hw, snap.applied_through)
            out += self._fetch(now)
        return out

    def local_durable(self, end, now):
        """The log is durable up to `end` (the log as it is now: an fsync that began before
        a truncation reports no more than the truncation left)."""
        end = min(end, self.log_end)
        if end <= self.durable_end:
            return []
        self.durable_end = end
        out = []
        self._update_hw(out)
        out += self._fetch(now)
        return out

    def log_start_moved(self, start):
        self.log_start = start
        if self.epochs.truncate_from_start(start):
            return [SaveEpochs(self.epochs.to_text())]
        return []

    def tick(self, now):
        """Retry a fetch (or a snapshot) whose answer has not come in `fetch_timeout_ms`:
        a frame was lost, or the leader is gone (then the record will change)."""
        w = self._waiting
        if w is not None and now - w[2] >= self.fetch_timeout_ms:
            self._waiting = None
        s = self._snapshot
        if s is not None and now - s[5] >= self.fetch_timeout_ms:
            self._snapshot = None
        return self._fetch(now)

    # -- internals -----------------------------------------------------------------

    def _check_reply(self, sender, frame):
        """None if `frame` answers the fetch in flight; else what to do instead."""
        if frame.epoch < self.epoch:
            return [Send(sender, frames.Fenced(self.partition, self.epoch))]
        if frame.epoch > self.epoch:
            return [RefreshMetadata(frame.epoch)]
        w = self._waiting
        if sender != self.leader or w is None or frame.seq != w[0] or frame.incarnation != self.incarnation:
            return []
        return None

    def _update_hw(self, out):
        hw = min(self.leader_hw, self.durable_end)
        if hw > self.hw:
            self.hw = hw
            out.append(HighWatermark(hw))

    def _fetch(self, now):
        if (self.leader is None or self.leader == self.node or self._waiting is not None
                or self._snapshot is not None or self.durable_end < self.log_end):
            return []
        seq = next(self._seqs)
        self._waiting = (seq, self.log_end, now)
        return [Send(self.leader, frames.Fetch(self.partition, self.epoch, self.incarnation, seq, self.log_end,
                                        self.last_fetched_epoch))]
