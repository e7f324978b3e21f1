"""A follower's copy of a replicated partition: `ReplicaLog`.

A node keeps each partition it follows in `<data_dir>/replicas/<partition>/`, laid out
as a data dir of its own so that a broker can later be started on it unchanged (the
failover of docs/REPLICATION.md):

    log/<partition>/      the segments, the leader's batches byte for byte at the same
                          offsets, and `leader-epochs` (the leader-epoch history)
    state.db              the state database, applied through META `applied_through`
                          from the state records the log carries (replicated.py)
    node_id               the partition's name (the node the broker would be)
    wrenmq.lock           the data dir's lock, held while the replica is open

The replica has a writer thread of its own, which does everything that touches the
files in the order it was asked: append, sync per `[storage] fsync` (and report the
durable end), truncate, apply committed state records, save the epoch history, install
a snapshot. The caller (the replication layer, on its event loop) gets the outcome
through callbacks: on the loop given to `start`, or on the writer thread without one.
"""

import concurrent.futures
import logging
import os
import queue
import sqlite3
import threading
import time

from .files import fsync_dir, write_atomic
from .format import Batch, CorruptBatch
from .lock import DataDirLock
from .log import CommitLog
from .reader import RawReader
from .replicated import apply_committed, applied_meta, read_epochs_file, write_epochs_file
from .state import META_SET, StateDB

log = logging.getLogger("wrenmq.store")

REPLICAS_DIR = "replicas"
SNAPSHOT_TMP = "state.db.snapshot"  # a state snapshot being received, next to state.db
INSTALL_MARK = "snapshot-install"  # "<log start> <applied through>": an install under way
_META_EVERY = 1.0


class ReplicaError(RuntimeError):
    """A request the replica refuses (nothing was changed): batches that are not the
    leader's bytes or do not follow the log, a truncation below the applied state, a
    replica of another partition or log."""


def replica_dir(data_dir, partition):
    """Where a node keeps its copy of `partition`."""
    return os.path.join(os.path.abspath(data_dir), REPLICAS_DIR, partition)


class ReplicaLog:
    """The copy of partition `partition` in `directory` (see the module docstring).

    Call the methods from one thread (the replication layer's event loop); `start(loop)`
    starts the writer. `append`, `truncate`, `apply_through`, `save_epochs`, the snapshot
    methods and `request_retention` queue work for the writer, in order, and return at
    once; what they refuse they raise at once (ReplicaError, nothing queued).

    Callbacks (on `loop`, or on the writer thread if `start` got none):
    `on_durable(end)`: the log is durable up to `end` (after appends; fsynced under
    fsync = "always", written under the others), never past what a truncation left;
    `on_applied(offset)`: the state database is applied through `offset`;
    `on_log_start(start)`: the log now starts at `start` (retention, a snapshot);
    `on_error(exc)`: the writer failed (a disk error): it has stopped.
    """

    def __init__(self, directory, partition, config, *, log_id=None, on_durable=None, on_applied=None,
                 on_log_start=None, on_error=None):
        self.dir = os.path.abspath(directory)
        self.partition = partition
        self.config = config
        self.on_durable = on_durable
        self.on_applied = on_applied
        self.on_log_start = on_log_start
        self.on_error = on_error
        os.makedirs(self.dir, exist_ok=True)
        self.lock = DataDirLock(self.dir)
        try:
            self._open(log_id)
        except BaseException:
            self.lock.release()
            raise

    def _open(self, log_id):
        st = self.config.storage
        lg = self.config.log
        path = os.path.join(self.dir, "node_id")
        try:
            with open(path) as fh:
                name = fh.read().strip()
        except FileNotFoundError:
            name = None
        if name and name != self.partition:
            raise ReplicaError(f"{self.dir} holds partition {name}, not {self.partition}")
        if not name:
            write_atomic(path, (self.partition + "\n").encode())
        self.fsync = st.fsync
        self.fsync_interval = st.fsync_interval_ms / 1000.0
        self.log_dir = os.path.join(self.dir, "log", self.partition)
        os.makedirs(self.log_dir, exist_ok=True)
        self.db_path = os.path.join(self.dir, "state.db")
        self._sync_mode = {"always": "FULL", "interval": "NORMAL", "never": "OFF"}[st.fsync]
        install = self._read_install_mark()
        if install is None:
            self._remove(os.path.join(self.dir, SNAPSHOT_TMP))  # a snapshot never completed
        elif os.path.exists(os.path.join(self.dir, SNAPSHOT_TMP)):
            self._replace_db()  # a crash came before the database was replaced
        self.log = CommitLog(self.log_dir, lg.segment_bytes, lg.index_interval_bytes, lg.direct_io,
                             durable_marks=st.fsync != "never", mark_limit=0)
        self.db = StateDB(self.db_path, self._sync_mode)
        if install is not None:
            self._finish_install(*install)
        meta = self.db.meta()
        applied = meta.get("applied_through")
        if applied is None:
            # New (empty), or a data dir of a broker that was not replicated: its database
            # holds every change of its log.
            applied = self.log.end_offset
            self.db.apply(applied_meta(applied))
        self._applied = int(applied)
        self._meta_through = self._applied
        self._meta_time = time.monotonic()
        self.log.limit_marks(self._applied)
        stored = meta.get("log_id")
        if log_id is not None and stored is not None and stored != log_id:
            raise ReplicaError(f"{self.dir} is a copy of log {stored}, not of the leader's log {log_id}")
        if log_id is not None and stored is None:
            self.db.apply([(META_SET, ("log_id", log_id))])
        self.log_id = log_id or stored
        # The caller's view (what it asked for), and the writer's (what is done).
        self._end = self.log.end_offset
        self._start = self.log.start_offset
        self._apply_wanted = self._applied
        self._written = self._durable = self._end
        self._heads = RawReader(self.log_dir)
        self._queue = queue.SimpleQueue()
        self._thread = None
        self.loop = None
        self.failed = None
        self._snapshot_fd = None

    # --- lifecycle ---------------------------------------------------------------------

    def start(self, loop=None):
        self.loop = loop
        self._thread = threading.Thread(target=self._writer, name=f"wrenmq-replica-{self.partition}",
                                        daemon=True)
        self._thread.start()

    def close(self):
        """Finish what is queued, write META applied_through, close the files."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._snapshot_fd is not None:
            os.close(self._snapshot_fd)
            self._snapshot_fd = None
        self.log.close()
        self.db.close()
        self.lock.release()

    # --- what the caller sees ----------------------------------------------------------

    @property
    def log_start(self):
        return self._start

    @property
    def log_end(self):
        """The end the log has once everything queued is written."""
        return self._end

    @property
    def durable_end(self):
        """The end of what the writer has made durable (and not truncated since)."""
        return self._durable

    @property
    def applied_through(self):
        """The offset the state database is applied through (the writer's)."""
        return self._applied

    # --- requests ----------------------------------------------------------------------

    def append(self, batches):
        """Append `batches` (replication_frames.Batch or reader.RawBatch: base, epoch, count,
        data) at the log end, byte for byte. Each must be one whole batch whose CRC checks
        out, whose header says the same base, count and epoch, and whose base is where the
        log (with the appends queued before) ends: else ReplicaError, and nothing of the
        call is appended."""
        self._check_running()
        expect = self._end
        items = []
        for b in batches:
            try:
                batch = Batch(b.data)
            except CorruptBatch as e:
                raise ReplicaError(f"the batch at offset {b.base} is damaged: {e}") from None
            if batch.size != len(b.data):
                raise ReplicaError(f"the batch at offset {b.base} is {batch.size} bytes, given {len(b.data)}")
            if (batch.base, batch.count, batch.epoch) != (b.base, b.count, b.epoch):
                raise ReplicaError(f"the batch at offset {b.base} says base {batch.base}, count {batch.count}, "
                                   f"epoch {batch.epoch}; it came as count {b.count}, epoch {b.epoch}")
            if batch.base != expect:
                raise ReplicaError(f"the batch at offset {batch.base} does not follow the log end {expect}")
            if batch.count < 1:
                raise ReplicaError(f"the batch at offset {batch.base} holds no records")
            items.append((b.data, batch.base, batch.count, batch.first_ts, batch.max_ts))
            expect = batch.base + batch.count
        if items:
            self._end = expect
            self._queue.put(("append", items))

    def truncate(self, offset):
        """Remove the records from `offset` on, and the leader-epoch history's entries from
        there (the caller saves the shortened history after: `save_epochs`). ReplicaError
        below the state applied or asked to be applied (the caller guarantees it never asks)
        or below the log start."""
        self._check_running()
        if offset < max(self._apply_wanted, self._applied):
            raise ReplicaError(f"cannot truncate to offset {offset}: the state is applied through "
                               f"{max(self._apply_wanted, self._applied)}")
        if offset < self._start:
            raise ReplicaError(f"cannot truncate to offset {offset}, below the log start {self._start}")
        if offset < self._end:
            self._end = offset
            self._queue.put(("truncate", offset))

    def apply_through(self, hw):
        """Records below `hw` are committed: apply their state records (writer thread)."""
        if hw > self._apply_wanted:
            self._apply_wanted = hw
            self._queue.put(("apply",))

    def save_epochs(self, text):
        """Persist the leader-epoch history (`SaveEpochs`), after what is queued before it."""
        self._check_running()
        self._queue.put(("save_epochs", text))

    def load_epochs(self):
        """The leader-epoch history's text as saved, None if there is none."""
        return read_epochs_file(self.log_dir)

    def begin_snapshot(self, total):
        """A state snapshot of `total` bytes is coming (`BeginSnapshot`): a new temporary file."""
        self._check_running()
        self._queue.put(("snap_begin", total))

    def write_snapshot(self, offset, data):
        """Bytes of the snapshot being received, at `offset` (`WriteSnapshot`)."""
        self._check_running()
        self._queue.put(("snap_write", offset, data))

    def install_snapshot(self, data, applied_through, log_start):
        """Make a state snapshot the state database and empty the log to start at
        `log_start` (`InstallSnapshot`). `data`: the database's bytes, or None for what
        begin/write_snapshot received. Crash-safe: an install a crash interrupts is
        completed when the replica next opens."""
        self._check_running()
        if applied_through < log_start:
            raise ReplicaError(f"a snapshot applied through {applied_through} cannot start a log at {log_start}")
        self._end = self._start = log_start
        self._apply_wanted = max(self._apply_wanted, applied_through)
        self._queue.put(("snap_install", data, applied_through, log_start))

    def request_retention(self):
        """Apply [log] retention (never past the applied state)."""
        self._check_running()
        self._queue.put(("retention",))

    def flush(self):
        """A concurrent.futures.Future done once everything queued before is done."""
        fut = concurrent.futures.Future()
        if self.failed is not None:
            fut.set_exception(ReplicaError(f"the replica's writer failed: {self.failed}"))
        else:
            self._queue.put(("flush", fut))
        return fut

    def _check_running(self):
        if self.failed is not None:
            raise ReplicaError(f"the replica's writer failed: {self.failed}")

    # --- the writer thread ---------------------------------------------------------------

    def _report(self, callback, value):
        if callback is None:
            return
        if self.loop is None:
            callback(value)
            return
        try:
            self.loop.call_soon_threadsafe(callback, value)
        except RuntimeError:  # loop closed during shutdown
            pass

    def _writer(self):
        q = self._queue
        dirty = False  # appended since the last fsync
        last_sync = time.monotonic()
        stop = False
        while not stop:
            timeout = None
            if dirty and self.fsync == "interval":
                timeout = max(0.0, self.fsync_interval - (time.monotonic() - last_sync))
            try:
                item = q.get(timeout=timeout)
            except queue.Empty:
                item = ("apply",)
            try:
                taken = 0
                while True:
                    taken += 1
                    if item is None:
                        stop = True
                        break
                    kind = item[0]
                    if kind == "append":
                        for args in item[1]:
                            self.log.append(*args)
                        self._written = self.log.end_offset
                        dirty = True
                    elif kind != "apply":
                        if dirty:
                            dirty, last_sync = self._settle(dirty, last_sync, True)
                        self._command(item)
                    if taken >= 64:  # (then sync and report: a long queue does not wait for it)
                        break
                    try:
                        item = q.get_nowait()
                    except queue.Empty:
                        break
                dirty, last_sync = self._settle(dirty, last_sync, stop)
                self._apply(stop)
            except Exception as exc:  # a disk error: nothing more can be promised
                log.critical("replica %s in %s failed: %s", self.partition, self.dir, exc)
                self.failed = exc
                self._report(self.on_error, exc)
                self._fail_waiting(exc)
                return

    def _fail_waiting(self, exc):
        """The writer stopped: what waits on it hears so (flush futures), the rest is dropped."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None and item[0] == "flush":
                item[1].set_exception(ReplicaError(f"the replica's writer failed: {exc}"))

    def _settle(self, dirty, last_sync, force):
        """After appends: sync per [storage] fsync, report the durable end."""
        now = time.monotonic()
        if dirty and (self.fsync == "always" or (force and self.fsync != "never")
                      or (self.fsync == "interval" and now - last_sync >= self.fsync_interval)):
            self.log.sync()
            last_sync = now
            dirty = False
        elif dirty and self.fsync == "never":
            dirty = False
        # Durable for replication: fsynced under "always", written under the others.
        end = self._written
        if end > self._durable:
            self._durable = end
            self._report(self.on_durable, end)
        return dirty, last_sync

    def _apply(self, stop):
        hw = min(self._apply_wanted, self.log.end_offset)
        due = stop or time.monotonic() - self._meta_time >= _META_EVERY
        if hw > self._applied or (due and self._meta_through != self._applied):
            before = self._applied
            self._applied, wrote = apply_committed(self._heads, self.db, self._applied, hw, due)
            if wrote:
                self._meta_through = self._applied
                self._meta_time = time.monotonic()
            self.log.limit_marks(self._applied)
            if self._applied > before:
                self._report(self.on_applied, self._applied)

    def _command(self, item):
        kind = item[0]
        if kind == "truncate":
            offset = item[1]
            if offset < self._applied:
                raise ReplicaError(f"truncation to {offset} below the state applied through {self._applied}")
            end = self.log.truncate(offset)
            self._heads.forget()
            if end != offset:
                raise ReplicaError(f"offset {offset} is inside a batch; the log was truncated to {end}")
            self._written = end
            self._durable = min(self._durable, end)
        elif kind == "save_epochs":
            write_epochs_file(self.log_dir, item[1])
        elif kind == "snap_begin":
            self._snapshot_open()
        elif kind == "snap_write":
            if self._snapshot_fd is None:
                self._snapshot_open()
            data = item[2]
            at = item[1]
            while data:
                n = os.pwrite(self._snapshot_fd, data, at)
                data = data[n:]
                at += n
        elif kind == "snap_install":
            self._install(*item[1:])
        elif kind == "retention":
            lg = self.config.log
            start = self.log.start_offset
            self.log.enforce_retention(lg.retention_bytes, lg.retention_hours, None, lg.retention_hard_bytes,
                                       keep_from=self._applied)
            if self.log.start_offset != start:
                self._heads.forget()
                self._start = self.log.start_offset
                self._report(self.on_log_start, self._start)
        elif kind == "flush":
            item[1].set_result(None)

    # --- snapshots -------------------------------------------------------------------------

    def _snapshot_open(self):
        if self._snapshot_fd is not None:
            os.close(self._snapshot_fd)
        self._snapshot_fd = os.open(os.path.join(self.dir, SNAPSHOT_TMP),
                                    os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)

    def _install(self, data, applied, log_start):
        """Steps, each leaving what the next open completes: the snapshot in its temporary
        file, fsynced; the install mark; the database replaced; the log emptied; the mark
        removed."""
        if data is not None:
            self._snapshot_open()
            view = memoryview(data)
            while view:
                view = view[os.write(self._snapshot_fd, view):]
        if self._snapshot_fd is None:
            raise ReplicaError("no snapshot was received to install")
        os.fsync(self._snapshot_fd)
        os.close(self._snapshot_fd)
        self._snapshot_fd = None
        self._check_snapshot(os.path.join(self.dir, SNAPSHOT_TMP))
        write_atomic(os.path.join(self.dir, INSTALL_MARK), f"{log_start} {applied}\n".encode())
        fsync_dir(self.dir)
        self.db.close()
        self._replace_db()
        self.db = StateDB(self.db_path, self._sync_mode)
        self._finish_install(log_start, applied)
        self._applied = self._meta_through = applied
        self._written = self._durable = log_start
        self._heads.forget()
        self.log.limit_marks(applied)
        self._report(self.on_log_start, log_start)
        self._report(self.on_applied, applied)

    @staticmethod
    def _check_snapshot(path):
        """ReplicaError (and nothing changed) unless `path` is a sound SQLite database."""
        try:
            conn = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
            try:
                ok = conn.execute("PRAGMA quick_check").fetchone()[0] == "ok"
            finally:
                conn.close()
        except sqlite3.DatabaseError as e:
            raise ReplicaError(f"the state snapshot received is not a database: {e}") from None
        if not ok:
            raise ReplicaError("the state snapshot received is not a sound database")

    def _replace_db(self):
        """The received snapshot becomes state.db (the old database is closed; its WAL, which
        must not be applied to the new one, goes first)."""
        for suffix in ("-wal", "-shm"):
            self._remove(self.db_path + suffix)
        os.replace(os.path.join(self.dir, SNAPSHOT_TMP), self.db_path)
        fsync_dir(self.dir)

    def _finish_install(self, log_start, applied):
        self.db.apply(applied_meta(applied))
        self.log.reset(log_start)
        self._remove(os.path.join(self.dir, INSTALL_MARK))
        fsync_dir(self.dir)
        log.info("replica %s: state snapshot installed (applied through %d), log from offset %d",
                 self.partition, applied, log_start)

    def _read_install_mark(self):
        try:
            with open(os.path.join(self.dir, INSTALL_MARK)) as fh:
                start, applied = fh.read().split()
            return int(start), int(applied)
        except FileNotFoundError:
            return None
        except ValueError:  # (written atomically: not torn; anything else is not ours)
            raise ReplicaError(f"{os.path.join(self.dir, INSTALL_MARK)} is unreadable") from None

    @staticmethod
    def _remove(path):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
