"""A replicated partition's store: state changes travel in the log and apply when committed.

With `[cluster] replicas` > 1 a node's commit log is a partition kept on several nodes
(docs/REPLICATION.md), and a record counts only once the high watermark (HW: the end of
what every in-sync replica holds durably) has passed it. Two things change in the store
then, and `ReplicatedStore` is a `Store` that does them:

- The state operations of each sealed epoch (SQLite statements and parameters,
  `state.py`) become one state record at the end of the epoch's records (format.py),
  so every replica applies the same changes at the same offsets. The writer thread
  does not apply them as it writes: it applies the state records below the HW once
  it is told the HW (`commit`), and records the offset applied through
  (META `applied_through`). A state database therefore never holds a change that a
  truncation of an uncommitted tail could take back; after a crash the state records
  above that offset wait until the caller knows they are committed (`apply_through`).
- The broker's held output is released when an epoch's records are committed, not when
  they are on the local disk: the writer reports local writes (`on_appended`: readable,
  the replication layer answers fetches with them) and local durability
  (`on_local_durable`), and `on_durable(epoch id)` comes only for epochs that end at or
  below both the HW and the local durable end.
- The writer reads back each batch it wrote (from the page cache, before it syncs) and
  hands the bytes to the loop with the report, which keeps the last RECENT_BYTES of them
  (`recent_batches`): a follower waiting at the log end is answered from memory at once,
  not after a read in another thread (two thread hand-overs: a tenth to a sixth of a
  replicated record's way to its acknowledgement on a loaded machine, docs/BENCHMARKS.md).

"Durable" for replication means what the broker's acknowledgements mean without it:
fsynced under `[storage] fsync = "always"`, written (in the page cache, which outlives a
killed process) under "interval" and "never".

The functions here that read and apply state records and snapshot the state database
are shared with a follower's copy of a partition (replica.py).
"""

import collections
import concurrent.futures
import functools
import logging
import os
import sqlite3
import time

from ._epoch import FIXED, FIXED_SIZE
from .files import fsync_dir, write_atomic
from .format import ATTR_STATE, STATE_FLAGS, Batch, CorruptBatch
from .reader import RawBatch, RawReader
from .state import META_SET, decode_ops, encode_ops
from .store import Store, compiled_write, encode_epochs

log = logging.getLogger("wrenmq.store")

EPOCHS_FILE = "leader-epochs"  # the leader-epoch history, next to the partition's segments
_META_EVERY = 1.0  # seconds applied_through may lag in the database while no state record applies
_MAX_ENDS = 4096  # (epoch id, end) pairs kept for the release at the HW (then the last is replaced)
# Bytes of the batches last written that the loop keeps for followers fetching at the log
# end (`recent_batches`); one read-back by the writer carries at most this much.
RECENT_BYTES = 2 << 20
_MAX_READ_BACK = 16  # read-backs waiting for the loop; past it, followers read from the log
_WAKE = ("wake",)


# --- shared with replica.py ------------------------------------------------------------

def applied_meta(offset):
    """The META operations saying the database holds every state change below `offset`.
    (`log_through` too: a broker's restart looks for what its database may lack from
    there on, persistence.py.)"""
    value = str(offset)
    return [(META_SET, ("applied_through", value)), (META_SET, ("log_through", value))]


def apply_committed(reader, db, applied, hw, write_meta=False):
    """Apply to `db` the state records at offsets [applied, hw) of the log `reader` (a
    RawReader) reads, in offset order, in one transaction with `applied_meta`. Returns
    (offset applied through: `hw`, or less where the log ends before it; whether the
    transaction ran). Without `write_meta` a stretch without state records runs none:
    the offset moves on in memory only, and a restart walks that stretch again to find
    nothing. Only batch headers are read, and the batches that say they hold state
    records (their CRC checked)."""
    heads = []
    covered = applied
    if hw > applied:
        for h in reader.heads(applied, hw):
            covered = h.base + h.count
            if h.attrs & ATTR_STATE:
                heads.append(h)
    through = min(hw, covered) if covered > applied else applied
    if not heads and not write_meta:
        return through, False

    def operations():
        for h in heads:
            batch = Batch(reader.read(h))
            if batch.base != h.base:
                raise CorruptBatch(f"batch at offset {h.base} changed while it was read")
            for _, payload in batch.state_records(applied, through):
                yield decode_ops(payload)
        yield applied_meta(through)

    db.apply_all(operations())
    return through, True


def state_snapshot(db):
    """The state database as the bytes of a database file, taken with SQLite's backup API
    (consistent: the caller is the only writer)."""
    mem = sqlite3.connect(":memory:")
    try:
        db.conn.backup(mem)
        return mem.serialize()
    finally:
        mem.close()


def read_epochs_file(log_dir):
    """The leader-epoch history kept next to the segments (its text), None if there is none."""
    try:
        with open(os.path.join(log_dir, EPOCHS_FILE), encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return None


def write_epochs_file(log_dir, text):
    """Replace the leader-epoch history atomically and durably (a crash leaves the old text
    or the new; the directory entry is synced)."""
    write_atomic(os.path.join(log_dir, EPOCHS_FILE), text.encode("utf-8"))
    fsync_dir(log_dir)


def has_state_record(ep):
    """Whether the epoch's last record is a state record (writer thread, before release)."""
    return bool(ep.count) and FIXED.unpack_from(ep.fixed, (ep.count - 1) * FIXED_SIZE)[7] == STATE_FLAGS


def fill_state_record(ep, payload):
    """Writer thread: give the epoch's state record (its last, added empty when the loop
    sealed it, so its bytes begin at the end of the epoch's) its payload."""
    at = (ep.count - 1) * FIXED_SIZE
    ts, start, lr, lp, lt, lc, pid, flags = FIXED.unpack_from(ep.fixed, at)
    if flags != STATE_FLAGS or start + lr + lp + lt + lc != ep.var_used:
        raise AssertionError("the epoch's last record is not its empty state record")
    var = ep.var
    end = start + len(payload)
    if len(var) < end:
        var.extend(bytes(end - len(var)))
    var[start:end] = payload
    FIXED.pack_into(ep.fixed, at, ts, start, lr, len(payload), lt, lc, pid, flags)
    ep.var_used = end
    ep.payload_bytes += len(payload)


# --- the leader's store ----------------------------------------------------------------

class ReplicatedStore(Store):
    """The store of a partition this node leads, with `[cluster] replicas` > 1.

    Everything `Store` does, with these differences (module docstring): state operations
    go into the log as state records and are applied when committed; `on_durable(eid)`
    waits for the HW. From the event loop: `commit(hw)`, `set_leader_epoch`,
    `save_epochs`, `snapshot`, `raw_reader`, `recent_batches`; before `start`:
    `apply_through`. The
    callbacks `on_appended(end)`, `on_local_durable(end)` and `on_log_start(start)` run
    on the loop.
    """

    replicated = True
    _mark_limit_at_open = 0  # (DURABLE_FILE says no more than what is committed: raised below)

    def __init__(self, config, on_durable=None, on_error=None, *, leader_epoch=0, apply_through=None,
                 on_appended=None, on_local_durable=None, on_log_start=None):
        # Read by the writer for each batch's header; changed in order by set_leader_epoch.
        self.leader_epoch = leader_epoch
        self.on_appended = on_appended
        self.on_local_durable = on_local_durable
        self.on_log_start = on_log_start
        self._apply_at_open = apply_through
        super().__init__(config, on_durable, on_error)

    def _open(self, config, on_durable, on_error):
        super()._open(config, on_durable, on_error)
        applied = self.meta_at_open.get("applied_through")
        if applied is None:
            # New, or a data dir whose broker was not replicated: its database holds every
            # change of its log (they were applied as they were written).
            applied = self.next_offset
            self.db.apply(applied_meta(applied))
        # Writer-owned (and before start, the caller's): the offset the database is applied through.
        self.applied_through = int(applied)
        self._meta_through = self.applied_through  # what META says
        self._meta_time = time.monotonic()
        self._commit_hw = self.applied_through  # the HW the loop last told the writer
        self._heads = RawReader(self.log_dir)  # the writer's walk over batch headers
        # Writer-owned: the batches written since the last report (segment, position, size,
        # base, count, epoch), a descriptor of the segment they were read back from, the end
        # the last report gave.
        self._wrote = []
        self._back_seg = None
        self._back_fd = None
        self._reported_end = self.next_offset
        # Writer-owned: (base, end) of the batches with state records it wrote from offset
        # _known_from on (below it, the log's headers say: `_apply` walks them).
        self._state_batches = collections.deque()
        self._known_from = self.next_offset
        # (end, batches) read back and not yet handed over: the writer appends, the loop
        # takes them with the next `_written` report (fsync "interval" and "never", where
        # that report comes right after the write when anything waits for it).
        self._read_backs = collections.deque()
        # Loop-owned: the HW known, what the writer reported, epochs waiting for the HW.
        self.hw = self.applied_through
        self.appended_end = self.local_durable_end = self.next_offset
        self._ends = collections.deque()  # (epoch id, end offset) per writer report
        self._recent = collections.deque()  # RawBatch: the last ones written, contiguous
        self._recent_bytes = 0
        self.log.limit_marks(self.applied_through)
        if self._apply_at_open is not None:
            self.apply_through(self._apply_at_open)

    # --- the event loop side ---------------------------------------------------------

    def seal(self):
        """Hand the current epoch to the writer; its state operations, if any, get the
        offset after its records now (the writer encodes them into that record)."""
        e = self._epoch
        if e.ops:
            if not e.count:
                self._tail.append(e)
            e.add(int(time.time() * 1_000_000), STATE_FLAGS, b"", b"", b"", b"", 0)
            self.next_offset += 1
        return Store.seal(self)

    def commit(self, hw):
        """Records below `hw` are committed (the replication layer's HighWatermark): the
        writer applies their state records, and the output of epochs ending at or below
        it (and locally durable) is released (`on_durable`)."""
        if hw <= self.hw:
            return
        self.hw = hw
        self._commit_hw = hw
        self._queue.put(_WAKE)
        self._release_committed()

    def set_leader_epoch(self, epoch):
        """Batches written from now on carry leader epoch `epoch`. Seals the current epoch
        first; returns the offset the new epoch's records begin at."""
        self.seal()
        self._queue.put(("leader_epoch", epoch))
        return self.next_offset

    def save_epochs(self, text):
        """Persist the leader-epoch history (`SaveEpochs`), in order with the writes queued
        before it, atomically."""
        self._queue.put(("save_epochs", text))

    def load_epochs(self):
        """The leader-epoch history's text as saved, None if there is none."""
        return read_epochs_file(self.log_dir)

    def snapshot(self):
        """A concurrent.futures.Future of (applied_through, the state database's bytes),
        taken by the writer after what is queued now, consistent with that offset."""
        fut = concurrent.futures.Future()
        self._queue.put(("snapshot", fut))
        self._urgent.set()
        return fut

    def raw_reader(self):
        """A reader of this log's batches as stored (reader.RawReader: `batches(start, end,
        max_bytes)` for a follower's fetch), for one thread; read below `appended_end` only."""
        return RawReader(self.log_dir)

    def apply_through(self, offset):
        """Apply the state records below `offset` now (before `start`: a broker restoring its
        state after a crash, or a new leader whose whole log is committed). Returns the
        offset applied through."""
        if self._thread is not None:
            raise RuntimeError("apply_through() is for before start(); commit() after")
        self._apply(min(offset, self.log.end_offset), True)
        # What the broker reads from META at start (the cluster's marks in the other nodes'
        # logs, the bridges' cursors) is what the records just applied say: a mark as
        # the follower had applied it would be older than the deliveries the sessions now
        # hold, and the other nodes would replay those messages to them again.
        self.meta_at_open = self.db.meta()
        if self.applied_through > self.hw:
            self.hw = self._commit_hw = self.applied_through
        return self.applied_through

    def recent_batches(self, start, end, max_bytes):
        """The batches from offset `start` (a batch's base) on, none reaching past `end`, at
        most `max_bytes` together (at least one), from those the writer read back last; None
        if they do not hold the batch at `start` (read the log then: `raw_reader`)."""
        recent = self._recent
        if not recent or start < recent[0].base or start >= recent[-1].base + recent[-1].count:
            return None
        i = len(recent) - 1
        while recent[i].base > start:
            i -= 1
        if recent[i].base != start:
            return None
        out = []
        total = 0
        n = len(recent)
        while i < n:
            b = recent[i]
            if b.base + b.count > end or (out and total + len(b.data) > max_bytes):
                break
            out.append(b)
            total += len(b.data)
            if total >= max_bytes:
                break
            i += 1
        return out or None

    def _keep_recent(self, batches):
        recent = self._recent
        if recent and recent[-1].base + recent[-1].count != batches[0].base:
            recent.clear()  # (a read-back fell short: the batches kept no longer lead on)
            self._recent_bytes = 0
        n = self._recent_bytes
        for b in batches:
            recent.append(b)
            n += len(b.data)
        while n > RECENT_BYTES and len(recent) > 1:
            n -= len(recent.popleft().data)
        self._recent_bytes = n

    def _appended(self, end, batches=None):
        """Loop: the log is written (readable) up to `end`; `batches`: those written since
        the last report, as the writer read them back (None if it could not)."""
        if batches:
            self._keep_recent(batches)
        if end > self.appended_end:
            self.appended_end = end
            if self.on_appended is not None:
                self.on_appended(end)

    def _written(self, eid, through):
        """Loop side of the writer's report: epochs up to `eid` are locally durable up to
        `through` (not yet released: that waits for the HW)."""
        self.written_through = through
        tail = self._tail
        while tail and tail[0] is not self._epoch and tail[0].end <= through:
            tail.popleft()
        read_backs = self._read_backs
        while read_backs:
            self._appended(*read_backs.popleft())
        self._appended(through)
        if through > self.local_durable_end:
            self.local_durable_end = through
            if self.on_local_durable is not None:
                self.on_local_durable(through)
        ends = self._ends
        if len(ends) >= _MAX_ENDS:
            # Bounded while the HW stands still: the newest entry stands for both (its
            # epochs are released a little later, never earlier).
            ends[-1] = (eid, through)
        else:
            ends.append((eid, through))
        self._release_committed()

    def _release_committed(self):
        limit = min(self.hw, self.local_durable_end)
        ends = self._ends
        eid = 0
        while ends and ends[0][1] <= limit:
            eid = ends.popleft()[0]
        if eid:
            self.durable_id = eid
            if self.on_durable is not None:
                self.on_durable(eid)

    def _log_start_moved(self, start):
        if self.on_log_start is not None:
            self.on_log_start(start)

    # --- the writer thread -----------------------------------------------------------

    def _fill_state_records(self, epochs):
        for ep in epochs:
            if ep.ops:
                payload = encode_ops(ep.ops)
                fill_state_record(ep, payload)
                ep.ops = []  # (in the record now; not applied as they are written)
                self.written_bytes -= len(payload)  # (sealed without them; _release counts them)

    def _write_batch(self, epochs, count):
        attrs = ATTR_STATE if any(map(has_state_record, epochs)) else 0
        log_ = self.log
        base = epochs[0].base
        if compiled_write is not None and log_.writes_through_cache:
            write = functools.partial(compiled_write, attrs=attrs, epoch=self.leader_epoch)
            size = log_.append_epochs(base, count, epochs, write)
        else:
            data, first_ts, max_ts = encode_epochs(epochs, attrs, self.leader_epoch)
            size = log_.append(data, base, count, first_ts, max_ts)
        seg = log_.segments[-1]
        self._wrote.append((seg, seg.size - size, size, base, count, self.leader_epoch))
        if attrs:
            bases = self._state_batches
            if len(bases) >= _MAX_ENDS:  # (the HW stands still: walk the headers from here on)
                bases.clear()
                self._known_from = base + count
            else:
                bases.append((base, base + count))
        return size

    def _read_back(self):
        """The batches written since the last report, as RawBatch, read back in one pread
        per segment (each a GIL hand-over while the loop may be busy); None if they are
        more than RECENT_BYTES or the file does not hold them."""
        wrote, self._wrote = self._wrote, []
        if not wrote or sum(w[2] for w in wrote) > RECENT_BYTES:
            return None
        out = []
        i = 0
        while i < len(wrote):
            seg, first, _, _, _, _ = wrote[i]
            j = i + 1
            while j < len(wrote) and wrote[j][0] is seg and wrote[j][1] == wrote[j - 1][1] + wrote[j - 1][2]:
                j += 1
            total = wrote[j - 1][1] + wrote[j - 1][2] - first
            if self._back_seg is not seg:
                if self._back_fd is not None:
                    os.close(self._back_fd)
                    self._back_fd = None
                self._back_fd = os.open(seg.log_path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                self._back_seg = seg
            data = os.pread(self._back_fd, total, first)
            if len(data) != total:
                return None
            if j == i + 1:
                _, _, _, base, count, epoch = wrote[i]
                out.append(RawBatch(base, epoch, count, data))
            else:
                mv = memoryview(data)
                for _, pos, size, base, count, epoch in wrote[i:j]:
                    out.append(RawBatch(base, epoch, count, bytes(mv[pos - first:pos - first + size])))
                mv.release()
            i = j
        return out

    def close(self):
        super().close()
        if self._back_fd is not None:
            os.close(self._back_fd)
            self._back_fd = None

    def _report_appended(self, through):
        """The log is written up to `through`: read back the batches written since the last
        report while they are in the page cache (a follower at the log end gets them from
        memory: `recent_batches`) and tell the loop: at once under fsync "always" (followers
        fetch them while this syncs), else with the `_written` report that follows (which
        comes at once when anything waits for these records, and a QoS 0 flood's do not
        wake the loop once per round)."""
        if through <= self._reported_end:
            self._wrote.clear()
            return
        self._reported_end = through
        batches = None
        if len(self._read_backs) < _MAX_READ_BACK:
            try:
                batches = self._read_back()
            except OSError as e:
                log.debug("reading back the batches up to offset %d failed (%s): followers read them from the "
                          "log", through, e)
        self._wrote.clear()
        if self.fsync != "always":
            self._read_backs.append((through, batches))
        elif self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._appended, through, batches)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _replicated_round(self, command, stop):
        """After each round of writes: apply what the HW allows, then run `command`."""
        hw = min(self._commit_hw, self.log.end_offset)
        due = stop or time.monotonic() - self._meta_time >= _META_EVERY
        if hw > self.applied_through or (due and self._meta_through != self.applied_through):
            self._apply(hw, due)
        if command is not None:
            self._run(command)

    def _apply(self, hw, write_meta):
        applied = self.applied_through
        if not write_meta and hw > applied >= self._known_from:
            # Every batch from _known_from on was written by this writer, which knows those
            # with state records: with none below `hw` there is nothing to apply, and the
            # walk over the batch headers (system calls, each a GIL hand-over while the loop
            # releases the output of this very HW) is skipped.
            bases = self._state_batches
            while bases and bases[0][1] <= applied:
                bases.popleft()
            if not bases or bases[0][0] >= hw:
                self.applied_through = hw
                self.log.limit_marks(hw)
                return
        self.applied_through, wrote = apply_committed(self._heads, self.db, self.applied_through, hw,
                                                      write_meta)
        if wrote:
            self._meta_through = self.applied_through
            self._meta_time = time.monotonic()
        self.log.limit_marks(self.applied_through)

    def _run(self, command):
        kind = command[0]
        if kind == "leader_epoch":
            self.leader_epoch = command[1]
        elif kind == "save_epochs":
            write_epochs_file(self.log_dir, command[1])
        elif kind == "snapshot":
            fut = command[1]
            if not fut.set_running_or_notify_cancel():
                return
            try:
                self.db.apply(applied_meta(self.applied_through))
                self._meta_through = self.applied_through
                fut.set_result((self.applied_through, state_snapshot(self.db)))
            except Exception as exc:  # (the snapshot failed, not the store)
                fut.set_exception(exc)

    def _retention(self, protect_from):
        """[log] retention, never past the records whose state is not applied yet (a
        follower far behind then needs the state database instead: a snapshot)."""
        lg = self.config.log
        start = self.log.start_offset
        deleted, lost = self.log.enforce_retention(lg.retention_bytes, lg.retention_hours, protect_from,
                                                   lg.retention_hard_bytes, keep_from=self.applied_through)
        if lost:
            self.lost_to_retention += lost
            self.db.apply([(META_SET, ("retention_lost", str(self.lost_to_retention)))])
        if deleted and self.log.start_offset != start and self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self._log_start_moved, self.log.start_offset)
            except RuntimeError:
                pass
