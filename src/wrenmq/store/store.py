"""The store: group commit of log records and state changes, on one writer thread.

The event loop appends records and state operations to the current *epoch*
(everything one loop turn produced). At the end of the turn the broker seals the
epoch and hands it to the writer thread, which encodes the batch, appends it to
the commit log, syncs according to `[storage] fsync`, applies the state
operations to SQLite in one transaction and reports back. Under
`fsync = "always"` the broker holds every byte that epoch produced for clients
until the report arrives, so no acknowledgement ever leaves before what it
acknowledges is on disk; the next epoch is processed meanwhile, so throughput
comes from batching, not from skipping the fsync.

Under `fsync = "interval"` the periodic fdatasync runs on a second thread (the
syncer): the writer hands it the segment and goes on writing. Done on the writer,
each sync would stop the log for as long as the device takes to take the last
interval's bytes (a fifth of the writer's time at 700 MB/s), and with the writer
stopped the loop would soon hold publishers back (`max_unwritten_bytes`).
"""

import collections
import logging
import os
import queue
import socket
import threading
import time
import uuid

from ..config import cluster_node_name
from ..mqtt.codec import decode_properties, encode_varint
from ._epoch import FIXED_SIZE, SEAL_BYTES, Epoch, EpochAppender, new_buffers, properties_block  # noqa: F401 (properties_block: re-exported)
from .format import FLAG_STATE, encode_batch_parts
from .lock import DataDirLock
from .log import CommitLog
from .reader import LogReader
from .state import META_SET, StateDB

try:  # the compiled batch encoder (setup.py builds it when a C compiler is there)
    from . import _encode
    # Only compiled; else format's reference encoder.
    _compiled_encode = _encode.encode_epochs if _encode.COMPILED else None
    # The compiled writer of epochs (without the GIL), or None: also the replicated store's.
    compiled_write = _encode.write_epochs if _encode.WRITES else None
except ImportError:  # not built, and Cython (which the source imports) not installed
    _compiled_encode = compiled_write = None

log = logging.getLogger("wrenmq.store")


def parse_properties_block(block):
    if not block:
        return {}
    data = encode_varint(len(block)) + block
    props, _ = decode_properties(data, 0, len(data), "P")
    return dict(props)


def encode_epochs(epochs, attrs=0, epoch=0):
    """The records of consecutive epochs as one log batch: (parts, first timestamp, max
    timestamp); the parts, concatenated, are the batch. `attrs`, `epoch`: the header's
    fields (format.py; replicated partitions).

    The compiled encoder of `_encode` when the install built it, else the column-wise
    reference encoder of `format` (the same bytes).
    """
    if _compiled_encode is not None:
        return _compiled_encode(epochs, attrs, epoch)
    cols = [[], [], [], [], [], [], []]
    for ep in epochs:
        for col, part in zip(cols, ep.columns()):
            col.extend(part)
    ts, flags, topics, clients, props, payloads, pids = cols
    data = encode_batch_parts(epochs[0].base, ts, flags, topics, clients, props, payloads, pids, attrs, epoch)
    return data, ts[0], max(ts)


# Records per batch at most, and bytes: the writer hands a batch's buffers back for reuse
# once it is written.
_BATCH_RECORDS = 2048
_BATCH_BYTES = 1 << 20
SEAL_DELAY = 0.02  # seconds a QoS 0-only epoch may keep growing before it is written
_THROUGH_EVERY = 1.0  # seconds log_through may lag while no state changes are written
_SYNCED = object()  # the syncer's wake-up of the writer: a sync finished
# How long the writer lets QoS 0-only epochs gather before it takes them (a durable
# epoch, a waiting loop or a close cuts it short).
GATHER = 0.002
_FLAGS_AT = 30  # where a record's flags are in its entry of an epoch's `fixed` (_epoch.FIXED)


class _Signal:
    """The loop's wake-up for the writer's gather wait: a lock held while the signal is
    unset, so setting and waiting are one C call each, the wait without the GIL.
    (`threading.Event` is Python code over a Condition: in a py-spy of a2 the writer held
    the GIL in Event.wait about as long as it did for a batch's index entries, and the
    loop waits for the GIL while the writer holds it.)"""

    __slots__ = ("_lock",)

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self):
        lock = self._lock
        if lock.locked():  # (set already, as it mostly is under QoS 1 traffic: no exception)
            try:
                lock.release()
            except RuntimeError:  # set meanwhile by another thread
                pass

    def wait(self, timeout):
        """Until set, or for `timeout` seconds; leaves it unset. True if it was set."""
        return self._lock.acquire(timeout=timeout)


def node_id_for(data_dir, configured, default=""):
    """The node's name: configured, else remembered in data_dir, else `default` (a
    cluster node's name) or the host name, remembered from then on."""
    path = os.path.join(data_dir, "node_id")
    if configured:
        return configured
    try:
        with open(path) as fh:
            name = fh.read().strip()
            if name:
                return name
    except FileNotFoundError:
        pass
    name = default or socket.gethostname() or "node0"
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in name)
    with open(path, "w") as fh:
        fh.write(name + "\n")
    return name


class Store(EpochAppender):
    """Persistence for one broker node; call `append`/`op`/`seal` from the event loop only.

    The per-message steps (`append`, `append_record`) and the epoch live in `_epoch`,
    which the install compiles. A replicated partition's store is `replicated.ReplicatedStore`.
    """

    replicated = False  # state changes travel in the log and are applied when committed
    _mark_limit_at_open = None  # CommitLog(mark_limit=): ReplicatedStore's marks wait for the HW

    def __init__(self, config, on_durable=None, on_error=None):
        self.config = config
        self.data_dir = os.path.abspath(config.storage.data_dir)
        os.makedirs(self.data_dir, exist_ok=True)
        # Before anything in the data dir is read or written: one writer per data dir.
        self.lock = DataDirLock(self.data_dir)
        try:
            self._open(config, on_durable, on_error)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, config, on_durable, on_error):
        """The rest of __init__, under the data dir's lock: the log, the state database."""
        st = config.storage
        lg = config.log
        # A cluster node's log partition is named after the node (on a new data dir), so the
        # logs of a cluster's nodes can be read together (pipeline: several data dirs).
        self.node_id = node_id_for(self.data_dir, config.broker.node_id,
                                   cluster_node_name(config) if config.cluster.enabled else "")
        self.fsync = st.fsync
        self.fsync_interval = st.fsync_interval_ms / 1000.0
        # Report every batch to the loop at once (under "always" a durable epoch's output
        # waits for its fsync, and the output of later turns waits behind it).
        self.report_every_batch = st.fsync == "always"
        # Seconds the writer lets QoS 0-only epochs gather (GATHER; tests lengthen it).
        self.gather = GATHER
        # Set by the loop while it holds output for the writer (any fsync mode): the writer
        # then reports each batch at once instead of every 20 ms.
        self.loop_holding = False
        self.log_dir = os.path.join(self.data_dir, "log", self.node_id)
        # The log exists even with [log] enabled = false: it then holds only the private
        # records that keep messages owed to persistent sessions across restarts.
        # With an fsync mode the log says how far it is durable (log.DURABLE_FILE): the
        # Spark source reads no further, so a crash of the machine never takes back a
        # record it read.
        self.log = CommitLog(self.log_dir, lg.segment_bytes, lg.index_interval_bytes, lg.direct_io,
                             durable_marks=st.fsync != "never", mark_limit=self._mark_limit_at_open)
        self._reader = None
        sync = {"always": "FULL", "interval": "NORMAL", "never": "OFF"}[st.fsync]
        self.db = StateDB(os.path.join(self.data_dir, "state.db"), sync)
        self.next_offset = self.log.end_offset if self.log is not None else 0
        self.on_durable = on_durable  # loop-side callback(epoch_id)
        self.on_pending = None  # loop-side callback when an empty epoch gets its first entry
        self.on_error = on_error
        self.loop = None
        self._last_id = 0
        self.durable_id = 0
        # Record buffers the writer handed back, for new epochs: as many pairs as full
        # epochs fit in max_unwritten_bytes (+4), so after a flood the pool keeps about
        # what the writer's backlog was allowed to hold (a pair of more than
        # _epoch.POOL_MAX_BYTES is never kept).
        self._pool = collections.deque(maxlen=st.max_unwritten_bytes // SEAL_BYTES + 4)
        self._epoch = Epoch(1, self.next_offset, self._pool)
        # Epochs whose messages may not be on disk yet, for in-process reads.
        self._tail = collections.deque()
        self._client_bytes = {}
        self._meta_at = {}  # key -> (epoch, index in its ops) of its last set_meta
        self.written_through = self.next_offset
        self._queue = queue.SimpleQueue()
        self._urgent = _Signal()  # set when something the loop waits on is queued
        # Record bytes handed to the writer (loop) and written by it (writer thread); each
        # counter has one writer, so their difference is read without a lock.
        self.sealed_bytes = 0
        self.written_bytes = 0
        self.max_unwritten = st.max_unwritten_bytes
        self._drained = None  # loop callback once unwritten bytes fall to _drain_at
        self._drain_at = None
        self.reader_waits = 0  # times publishers waited for the writer (the broker counts them)
        self.unwritten_peak = 0  # the most unwritten bytes the writer has found queued
        self._thread = None
        self._syncer = None  # thread of the interval fdatasyncs (fsync = "interval")
        self._sync_queue = queue.SimpleQueue()
        self._sync_busy = False  # a sync handed to the syncer has not finished
        self._sync_error = None
        self.syncs = 0  # fdatasyncs of the log that finished
        self.sealed_syncs = 0  # segments the log rolled away from that the syncer fsynced
        # Rolled segments queued for the syncer, at most 8 (each holds four descriptors);
        # past that the writer waits for it, as it would for the fsync itself.
        self._sealed_slots = threading.Semaphore(8)
        self.failed = None
        self.appended = 0
        self.bytes_appended = 0
        self.batches = 0  # batches written (appended / batches: records per group commit)
        self.wakes = 0  # times the writer woke and took epochs (each a few turns with the GIL)
        # Records deleted while persistent sessions still needed them (kept across restarts).
        meta = self.meta_at_open = self.db.meta()  # (read before the writer thread uses the database)
        self.lost_to_retention = int(meta.get("retention_lost", 0))
        # The log's identity, and the first offset this run writes: a cluster node that
        # received up to offset X of this log resumes from X + 1 (below `opened_at`:
        # offsets past it that a crash took before they were written are reused).
        self.log_id = meta.get("log_id")
        if not self.log_id:
            self.log_id = uuid.uuid4().hex
            self.db.apply([(META_SET, ("log_id", self.log_id))])
        self.opened_at = self.next_offset
        if st.fsync == "never":  # a segment the log rolls away from is the kernel's to write back
            self.log.sealed_sync = False
        # [storage] min_free_bytes: `disk_low` (set on the loop only, by `watch_disk`) while the
        # data directory's filesystem has less free; the broker then takes no new messages.
        # The writer looks each time it has written a quarter of what was left above the line
        # at the last look (so it looks more often as the line nears), the broker once a
        # second (space others take or free).
        self.min_free = st.min_free_bytes if hasattr(os, "statvfs") else 0  # (POSIX only)
        self.disk_low = False
        self.disk_free = -1  # free bytes at the last look
        self.on_disk = None  # loop-side callback(low) when disk_low changes
        self._disk_step = 1 << 20  # bytes the writer writes before it looks again
        self._disk_seen = 0  # bytes_appended when the writer last looked

    # --- lifecycle -------------------------------------------------------------

    def start(self, loop):
        self.loop = loop
        self._thread = threading.Thread(target=self._writer, name="wrenmq-store", daemon=True)
        self._thread.start()
        if self.fsync == "interval":
            self._syncer = threading.Thread(target=self._sync_loop, name="wrenmq-sync", daemon=True)
            self._syncer.start()
            # A segment the log rolls away from is fsynced by the syncer, not by the writer.
            self.log.sealed_sync = self._hand_sealed

    def close(self):
        """Seal what is pending, wait for the writer to finish it, close files."""
        if self._thread is not None:
            self.seal()
            self._queue.put(None)
            self._urgent.set()
            self._thread.join()
            self._thread = None
        if self._syncer is not None:
            self._sync_queue.put(None)
            self._syncer.join()
            self._syncer = None
            # What was handed to it is synced: the log's last sync (close) may mark all.
            self.log.sealed_sync = None
        if self.log is not None:
            self.log.close()
        if self._reader is not None:
            self._reader.close()
        self.db.close()
        self.lock.release()

    def announce_listeners(self, addresses):
        """Write where the broker's MQTT listeners are into the data dir's lock file
        ([(host, port)]), for tools that must tell this broker from others (replay)."""
        self.lock.announce(addresses)

    # --- the event loop side -----------------------------------------------------

    @property
    def pending(self):
        e = self._epoch
        return bool(e.count or e.ops)

    @property
    def seal_due(self):
        """True if the current epoch should go to the writer at the end of this loop turn.

        An epoch with acknowledged messages or durable state changes goes at once (under
        every fsync mode a kill -9 must not lose them once acknowledged). Otherwise (QoS 0
        only) it keeps growing for up to SEAL_DELAY, or until `append` seals it at
        _epoch.SEAL_RECORDS: each hand-over wakes the writer thread, and each wake-up costs the
        loop the GIL (a quarter of the broker's CPU at 100k QoS 0 msg/s).
        """
        return self._epoch.durable

    @property
    def must_hold(self):
        """True if output produced in this epoch must wait for the writer.

        Under every fsync mode: an epoch with an acknowledged message or a durable state
        change holds the turn's output until the writer has written it (and fsynced it,
        under "always"), so a PUBACK never leaves for a record a kill -9 could still lose.
        Under "interval" and "never" that is a hand-over to the writer thread, not a disk
        wait: the page cache survives the process.
        """
        return self._epoch.durable

    def seal(self):
        """Hand the current epoch to the writer (EpochAppender.seal); wake the writer at
        once if the epoch holds anything acknowledged or durable."""
        durable = self._epoch.durable
        eid = EpochAppender.seal(self)
        if durable:
            self._urgent.set()
        return eid

    def set_meta(self, key, value):
        """META_SET `key` with this epoch's records and state changes, not durable by itself;
        called again before the epoch is sealed, it replaces the value (the writer writes
        the last one only)."""
        e = self._epoch
        at = self._meta_at.get(key)
        if at is not None and at[0] is e:
            e.ops[at[1]] = (META_SET, (key, value))  # (not sealed: the writer has not seen it)
        else:
            self.op(META_SET, (key, value), False)
            self._meta_at[key] = (e, len(e.ops) - 1)

    @property
    def last_sealed(self):
        return self._last_id

    @property
    def epoch_id(self):
        """The epoch being filled: what is queued now is durable once `durable_id` reaches it."""
        return self._epoch.id

    @property
    def unwritten_bytes(self):
        """Bytes of sealed records the writer has not written yet."""
        return self.sealed_bytes - self.written_bytes

    @property
    def behind(self):
        """True if the writer is more than `max_unwritten_bytes` behind the loop."""
        return self.unwritten_bytes > self.max_unwritten

    def wait_drained(self, callback):
        """Have the loop call `callback` once the writer is down to half the limit.

        Returns False (and will not call) if it already is. Either thread may see the
        level first; `callback` must tolerate a spurious second call.
        """
        self._drained = callback
        self._drain_at = self.max_unwritten // 2
        if self.unwritten_bytes <= self._drain_at or self.failed is not None:
            self._drain_at = None
            return False
        self._urgent.set()
        return True

    def _written(self, eid, through):
        """Loop side of the writer's report."""
        self.durable_id = eid
        self.written_through = through
        tail = self._tail
        # Keep only epochs not yet readable from disk.
        while tail and tail[0] is not self._epoch and tail[0].end <= through:
            tail.popleft()
        if self.on_durable is not None:
            self.on_durable(eid)

    def _failed(self, exc):
        self.failed = exc
        if self._drain_at is not None:  # nothing will be written now: let the readers go
            self._drain_at = None
            self._drained()
        if self.on_error is not None:
            self.on_error(exc)

    # --- the writer thread -----------------------------------------------------

    def _writer(self):
        if self.config.log.enabled:
            # The pool's buffers are allocated and touched here, before the first message:
            # fresh buffers cost the loop a page fault per 4 KiB in the first flood after a
            # start, when the writer is slowest and its backlog largest (at a1, the first
            # run of a new broker: 268 faults per 1,000 messages, 44 with the pool filled
            # first). It is the memory max_unwritten_bytes allows the backlog.
            pool = self._pool
            while len(pool) < pool.maxlen:
                pool.appendleft(new_buffers())
        q = self._queue
        last_sync = time.monotonic()
        last_report = last_sync
        last_through = last_sync
        dirty = False
        stop = False
        unreported = None  # (epoch id, log end) written but not yet told to the loop
        awaited = False  # an epoch written since the last report holds output on the loop
        while not stop:
            timeout = None
            if self.fsync == "interval" and dirty and not self._sync_busy:
                timeout = max(0.0, self.fsync_interval - (time.monotonic() - last_sync))
            if unreported is not None:
                timeout = 0.02 if timeout is None else min(timeout, 0.02)
            try:
                e = q.get(timeout=timeout)
            except queue.Empty:
                e = False
            epochs = []
            batch_durable = False
            retention = None
            command = None
            while e is not False:
                if e is None:
                    stop = True
                    break
                if isinstance(e, tuple):
                    if e[0] == "retention":
                        retention = e[1]
                    elif e[0] != "wake":  # a replicated store's: run after the epochs queued before it
                        command = e
                        break
                elif e is not _SYNCED:
                    epochs.append(e)
                if len(epochs) >= 256:
                    break
                try:
                    e = q.get_nowait()
                except queue.Empty:
                    break
            if epochs:
                self.wakes += 1
            unwritten = self.unwritten_bytes
            if unwritten > self.unwritten_peak:
                self.unwritten_peak = unwritten
            try:
                if self._sync_error is not None:
                    raise self._sync_error
                through = None
                ops = []
                if self.replicated and epochs:
                    self._fill_state_records(epochs)
                # Consecutive epochs are contiguous in offsets: write them as few batches.
                held = []  # epochs whose records go into the next batch
                count = nbytes = 0
                for ep in epochs:
                    if ep.durable:
                        awaited = batch_durable = True
                    if ep.count:
                        held.append(ep)
                        count += ep.count
                        nbytes += ep.nbytes
                        if count >= _BATCH_RECORDS or nbytes >= _BATCH_BYTES:
                            self._append(held, count)
                            self._release(held)
                            held = []
                            count = nbytes = 0
                            dirty = True
                    through = ep.end
                    ops.extend(ep.ops)
                if held:
                    self._append(held, count)
                    self._release(held)
                    dirty = True
                held = None
                now = time.monotonic()
                if through is not None and not self.replicated and (
                        ops or stop or now - last_through >= _THROUGH_EVERY):
                    # Recovery rescans the log from here for what SQLite may not have seen.
                    # Every transaction with state changes moves it (so they never lag
                    # behind it); without any, only once a second: a transaction is
                    # several GIL hand-overs for the writer thread.
                    ops.append((META_SET, ("log_through", str(through))))
                    last_through = now
                if self.replicated and through is not None:
                    self._report_appended(through)  # (followers fetch it while this syncs)
                if dirty and (self.fsync == "always" or stop):
                    self.log.sync()
                    self.syncs += 1
                    last_sync = now
                    dirty = False
                elif dirty and self.fsync == "interval" and now - last_sync >= self.fsync_interval \
                        and not self._sync_busy:
                    # The syncer takes its own descriptor of the segment: the writer may
                    # roll to the next one (which fsyncs this one) while it syncs.
                    self._sync_busy = True
                    fd, durable = self.log.sync_handle()
                    self._sync_queue.put(((fd,), durable))
                    last_sync = now
                    dirty = False
                self.db.apply(ops)
                if self.replicated:
                    self._replicated_round(command, stop)
                if retention is not None:
                    self._retention(retention)
            except Exception as exc:  # disk full, I/O error: durability can no longer be promised
                log.critical("writing to %s failed: %s", self.data_dir, exc)
                if self.loop is not None:
                    self.loop.call_soon_threadsafe(self._failed, exc)
                return
            if epochs:
                unreported = (epochs[-1].id, through)
            # Tell the loop at once when it may be holding output for these epochs;
            # otherwise (QoS 0 only, fsync interval/never) at most every 20 ms: a wake-up
            # of the loop per loop turn would cost more than the writing.
            if unreported is not None and self.loop is not None and (
                    self.report_every_batch or awaited or self.loop_holding or stop
                    or time.monotonic() - last_report >= 0.02):
                try:
                    self.loop.call_soon_threadsafe(self._written, *unreported)
                except RuntimeError:  # loop closed during shutdown
                    pass
                unreported = None
                awaited = False
                last_report = time.monotonic()
            if epochs and not stop and not batch_durable and not self.loop_holding and self._drain_at is None:
                # It wrote QoS 0 records only, and nothing waits for it: let the next
                # epochs gather before taking them. Each time it wakes the writer takes the
                # GIL twice, and the loop pays for every hand-over. A durable epoch, a
                # waiting loop or a close cuts this short.
                self._urgent.wait(self.gather)

    def _hand_sealed(self, fds):
        """CommitLog.sealed_sync under "interval" (writer thread): queue a rolled segment's
        descriptors for the syncer, waiting while 8 are queued (a disk slower than the
        writer would otherwise pile them up, four open descriptors each)."""
        self._sealed_slots.acquire()
        self._sync_queue.put((fds, None))

    def _sync_loop(self):
        """The syncer thread: fdatasync each descriptor the writer hands over, then close it.

        A sync still running when the next interval is due delays that one (the writer
        asks again when this one reports); they never pile up. Each item is (descriptors,
        durable end): one of the active segment and the offset below which its sync makes
        the log durable (then written to the log's durable file), or, with None, the log
        and index descriptors of a segment the log rolled away from and one of the log's
        directory (CommitLog.sealed_sync): synced in the order handed over, so before any
        later sync of the next segment.
        """
        q = self._sync_queue
        while True:
            item = q.get()
            if item is None:
                return
            fds, durable = item
            sealed = durable is None
            try:
                for fd in fds:
                    (os.fsync if sealed else os.fdatasync)(fd)
                if sealed:
                    self.sealed_syncs += 1
                else:
                    self.syncs += 1
                    # (Segments rolled away from were handed over first: synced before it.)
                    self.log.mark_durable(durable)
            except OSError as exc:  # the writer raises it: durability can no longer be promised
                self._sync_error = exc
            finally:
                for fd in fds:
                    try:
                        os.close(fd)
                    except OSError:  # (nothing to lose: the sync's own outcome is what counts)
                        pass
                if sealed:
                    self._sealed_slots.release()
                else:
                    self._sync_busy = False
                # Wake the writer: it asks for the next interval's sync, or raises the error.
                self._queue.put(_SYNCED)

    def _release(self, epochs):
        """Writer side: these epochs are written (in the page cache, readable from the
        files). Free their payloads now, not when the loop hears of it, so the loop reuses
        that memory while it is warm; wake the loop if it waits for the writer."""
        n = 0
        for ep in epochs:
            n += ep.nbytes
            ep.release()
        self.written_bytes += n
        at = self._drain_at
        if at is not None and self.unwritten_bytes <= at:
            self._drain_at = None
            try:
                self.loop.call_soon_threadsafe(self._drained)
            except RuntimeError:  # loop closed during shutdown
                pass

    def _append(self, epochs, count):
        """The records of `epochs` (consecutive, `count` in all) as one batch in the log."""
        size = self._write_batch(epochs, count)
        self.appended += count
        self.batches += 1
        self.bytes_appended += size
        if self.min_free and self.bytes_appended - self._disk_seen >= self._disk_step:
            self._disk_seen = self.bytes_appended
            try:
                changed = self._disk_changes()
            except OSError:  # (not a failed write: the loop's look says what it is)
                changed = True
            if changed and self.loop is not None:
                self.loop.call_soon_threadsafe(self.watch_disk)

    def _write_batch(self, epochs, count):
        """Encode and write the batch; its size."""
        log = self.log
        base = epochs[0].base
        if compiled_write is not None and log.writes_through_cache:
            return log.append_epochs(base, count, epochs, compiled_write)
        data, first_ts, max_ts = encode_epochs(epochs)
        return log.append(data, base, count, first_ts, max_ts)

    # --- free space --------------------------------------------------------------

    def _disk_changes(self):
        """Whether `disk_low` should flip (any thread): below min_free it goes on, and off
        again only at `resume_free`, so it does not flap at the line."""
        st = os.statvfs(self.data_dir)
        free = self.disk_free = st.f_bavail * st.f_frsize
        self._disk_step = max((free - self.min_free) // 4, 1 << 20)
        if self.disk_low:
            return free >= self.resume_free
        return free < self.min_free

    @property
    def resume_free(self):
        """Free bytes at which a low disk is taken as freed: an eighth more than
        min_free_bytes, at most 64 MiB more."""
        return self.min_free + min(self.min_free // 8, 64 << 20)

    def watch_disk(self):
        """Look at the free space now (the loop); flip `disk_low` and call `on_disk` if it
        changed. Nothing with min_free_bytes = 0."""
        if not self.min_free:
            return
        try:
            changed = self._disk_changes()
        except OSError as exc:  # (the directory is gone: writing fails and says so)
            log.warning("cannot read the free space of %s: %s", self.data_dir, exc)
            return
        if changed:
            self.disk_low = not self.disk_low
            if self.on_disk is not None:
                self.on_disk(self.disk_low)

    # --- reading back ------------------------------------------------------------

    def read(self, start, limit):
        """Up to `limit` records (format.Record) with offset >= start, in order: `read_span`'s
        records."""
        return self.read_span(start, limit)[0]

    def read_span(self, start, limit):
        """Up to `limit` records (format.Record) with offset >= start, in order, and the
        offset a reader following the log goes on from.

        Offsets the writer has not written yet come from memory, the rest from the log
        files; private records included (the caller is the broker), state records
        (replicated) left out. Those are why the second value matters: a stretch of state
        records (a replicated log's session changes, any number of them, and the one that
        ends each epoch) yields no record, and the reader passes over it to there. Never
        past a record not returned: a read that stops short (retention, a damaged
        stretch, `unreadable_end`) says where it stopped. Runs on the loop while the
        writer may release epochs: each epoch's records are taken once.
        """
        out = []
        if start >= self.next_offset:
            return out, start
        for ep in list(self._tail):
            if len(out) >= limit:
                return out, start
            # The writer may release the epoch any time; these references stay, and only
            # the loop reuses released buffers.
            buffers = (ep.fixed, ep.var)
            if ep.released or buffers[0] is None:  # written: read from the files with whatever precedes
                continue
            base = ep.base
            n = ep.count
            if base + n <= start:
                continue
            if start < base:  # everything before an epoch still in memory is written
                start = self._read_disk(start, min(base, start + limit - len(out)), out)
                if start < base:  # (not all came, or the limit)
                    return out, start
            i = start - base
            if self.replicated:
                fixed = buffers[0]
                while i < n and len(out) < limit:
                    if not fixed[i * FIXED_SIZE + _FLAGS_AT] & FLAG_STATE:
                        out.append(ep.record(i, buffers))
                    i += 1
            else:
                while i < n and len(out) < limit:
                    out.append(ep.record(i, buffers))
                    i += 1
            start = base + i
        if len(out) < limit and start < self.next_offset:
            # After the last epoch still in memory, or no epoch is: on disk.
            start = self._read_disk(start, min(self.next_offset, start + limit - len(out)), out)
        return out, start

    def unreadable_end(self, offset):
        """Where the stretch of damaged records holding `offset` ends, if a `read` found
        them unreadable (and logged them): `read` never returns them, and a reader
        following the log goes on from there. None if the record at `offset` is not known
        to be damaged: a `read` from there that came back empty (retention deleting the
        records meanwhile) is to be tried again, not passed over."""
        reader = self._reader
        return reader.unreadable_end(offset) if reader is not None else None

    def _read_disk(self, start, end, out):
        """Append the records start..end-1 from the log files to `out`; return the offset
        after the last one read, below `end` if they did not all come (retention deleted
        them, or the files end early): the caller then returns only the contiguous run
        so far, so no record is ever skipped. (State records are read and left out.)"""
        if start >= end:
            return end
        if self.replicated:
            for rec in self._disk_reader().records(start, end, private=True, state=True):
                start = rec.offset + 1
                if not rec.state:
                    out.append(rec)
            return start
        n = len(out)
        for rec in self._disk_reader().records(start, end, private=True):
            out.append(rec)
        return out[-1].offset + 1 if len(out) > n else start

    def _disk_reader(self):
        if self._reader is None:
            self._reader = LogReader(self.log_dir)
        else:
            self._reader.refresh()
        return self._reader

    @property
    def start_offset(self):
        if self.log is None:
            return self.next_offset
        segs = self.log.segments
        return segs[0].base if segs else self.next_offset

    def request_retention(self, protect_from):
        """Ask the writer to apply [log] retention, keeping offsets >= protect_from if it can."""
        if self.log is not None and self._thread is not None:
            self._queue.put(("retention", protect_from))

    def _retention(self, protect_from):
        lg = self.config.log
        deleted, lost = self.log.enforce_retention(lg.retention_bytes, lg.retention_hours, protect_from,
                                                   lg.retention_hard_bytes)
        if lost:
            self.lost_to_retention += lost
            self.db.apply([(META_SET, ("retention_lost", str(self.lost_to_retention)))])
