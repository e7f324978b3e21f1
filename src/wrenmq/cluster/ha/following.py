"""A partition this process follows: its ReplicaLog, its PartitionFollower, and the
decisions of the one carried out on the other.

The follower keeps the partition in `<data dir>/replicas/<P>/` (or, for the node's own
partition while another node leads it, in the data dir itself: the same layout), fetches
from the leader over a FetchLink (wire.py), appends and syncs on the replica's writer
thread, and applies the state records the high watermark has passed. It is the state
(files and positions) a failover starts from: a follower in the in-sync set may take the
partition over (manager.py) and start a broker on these files (leading.py).
"""

import logging
import time

from .. import replication as R
from .. import replication_frames as RF
from ..replication_epochs import LeaderEpochs, LeaderEpochsError
from ...store.replica import ReplicaError, ReplicaLog

log = logging.getLogger("wrenmq.cluster.ha")


def _now():
    return time.monotonic() * 1000


def load_epochs(text, log_end):
    """The leader-epoch history saved next to a log, without entries past its end (a crash
    may leave some: SaveEpochs comes before the Append that needs it)."""
    try:
        epochs = LeaderEpochs.from_text(text) if text else LeaderEpochs()
    except LeaderEpochsError as e:
        log.warning("cluster: an unreadable leader-epoch history (%s): starting from none", e)
        epochs = LeaderEpochs()
    epochs.truncate_from_end(log_end)
    return epochs


class Following:
    """Follows `partition` in `directory` for the manager (which gives it the leader's
    changes and the frames that come from it, and calls `tick`)."""

    def __init__(self, manager, partition, directory, log_id):
        self.manager = manager
        self.partition = partition
        self.directory = directory
        cfg = manager.cluster_cfg
        self.replica = ReplicaLog(directory, partition, manager.config, log_id=log_id,
                                  on_durable=self._durable, on_log_start=self._log_start, on_error=self._failed)
        rep = self.replica
        self.core = R.PartitionFollower(
            partition, manager.node, manager.control.incarnation, load_epochs(rep.load_epochs(), rep.log_end),
            log_start=rep.log_start, log_end=rep.log_end, durable_end=rep.durable_end, hw=rep.applied_through,
            fetch_timeout_ms=cfg.replica_fetch_timeout_ms, seqs=manager.fetch_seqs)
        self.link = None  # FetchLink to the leader
        self.closed = False
        rep.start(manager.loop)

    @property
    def hw(self):
        return self.core.hw

    def leader_changed(self, leader, epoch):
        """The partition's record names `leader` at `epoch`: (re)connect to it, fetch."""
        manager = self.manager
        link = self.link
        if link is not None and (link.leader != leader or leader is None
                                 or link.address != manager.control.addresses.get(leader)):
            link.close()
            self.link = link = None
        if leader is not None and leader != manager.node and link is None:
            address = manager.control.addresses.get(leader)
            if address is not None:
                self.link = manager.fetch_link(self.partition, leader, address, epoch)
        self.do(self.core.leader_changed(leader, epoch, _now()))

    def tick(self):
        if not self.closed:
            self.do(self.core.tick(_now()))

    def received(self, link, frame):
        """A frame from the leader over `link`."""
        if self.closed or link is not self.link:
            return
        core = self.core
        now = _now()
        try:
            kind = type(frame)
            if kind is RF.Data:
                out = core.on_data(link.leader, frame, now)
            elif kind is RF.Diverged:
                out = core.on_diverged(link.leader, frame, now)
            elif kind is RF.Snapshot:
                out = core.on_snapshot(link.leader, frame, now)
            else:
                out = core.on_fenced(link.leader, frame, now)
            self.do(out)
        except (R.ReplicationError, ReplicaError) as e:
            log.warning("cluster: partition %s: %s; fetching again", self.partition, e)
            link.close()
            self.link = None
            address = self.manager.control.addresses.get(link.leader)
            if address is not None:
                self.link = self.manager.fetch_link(self.partition, link.leader, address, core.epoch)

    def do(self, decisions):
        rep = self.replica
        for d in decisions:
            kind = type(d)
            if kind is R.Send:
                if self.link is not None:
                    self.link.send(d.frame)
            elif kind is R.Append:
                rep.append(d.batches)
            elif kind is R.HighWatermark:
                rep.apply_through(d.hw)
            elif kind is R.SaveEpochs:
                rep.save_epochs(d.text)
            elif kind is R.Truncate:
                log.info("cluster: partition %s: truncating this replica to offset %d (the leader's history "
                         "parts from it there)", self.partition, d.offset)
                rep.truncate(d.offset)
            elif kind is R.BeginSnapshot:
                log.info("cluster: partition %s: receiving a state snapshot (%d bytes) for a log from offset %d",
                         self.partition, d.total, d.log_start)
                rep.begin_snapshot(d.total)
            elif kind is R.WriteSnapshot:
                rep.write_snapshot(d.offset, d.data)
            elif kind is R.InstallSnapshot:
                rep.install_snapshot(None, d.applied_through, d.log_start)
            elif kind is R.RefreshMetadata:
                self.manager.refresh_metadata()
            else:
                raise AssertionError(f"a follower's decision {d}")

    # --- the replica's callbacks (on the loop) --------------------------------------------

    def _durable(self, end):
        if not self.closed:
            self.do(self.core.local_durable(end, _now()))

    def _log_start(self, start):
        if not self.closed:
            self.do(self.core.log_start_moved(start))

    def _failed(self, exc):
        log.critical("cluster: partition %s: this replica's disk failed (%s): it stops following", self.partition,
                     exc)
        self.manager.replica_failed(self.partition)

    def figures(self):
        rep = self.replica
        return {"log_start": rep.log_start, "log_end": rep.log_end, "durable": rep.durable_end,
                "hw": self.core.hw, "leader": self.core.leader, "epoch": self.core.epoch}

    def close(self):
        """Stop fetching; finish what the replica's writer was asked, close its files."""
        if self.closed:
            return
        self.closed = True
        if self.link is not None:
            self.link.close()
            self.link = None
        self.replica.close()
