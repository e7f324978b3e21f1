"""A replica's leader-epoch history (KIP-101's leader-epoch checkpoint), sans-IO.

Every batch carries the epoch of the leader that wrote it; the history says where each
epoch's records begin. It is what lets a follower and a leader find where their logs
part without trusting a high watermark (KIP-101, KIP-279): `replication.py` uses it on
both sides, the I/O layer persists it next to the log's segments.
"""

from .replication_frames import NO_EPOCH

EPOCHS_HEADER = "wrenmq-leader-epochs 1"
MAX_EPOCH_ENTRIES = 100_000  # an epoch history file longer than this is refused as corrupt


class LeaderEpochsError(ValueError):
    """An epoch history that is not one: unreadable text, or epochs that go backwards."""


class LeaderEpochs:
    """The (epoch, start offset) history of one replica's log: the records of `epoch` begin
    at `start` and end where the next entry begins (the last entry: at the log end).
    Kafka's leader-epoch-checkpoint (KIP-101). Epochs strictly increase, starts never
    decrease, and an epoch that got no record before the next one began is dropped, so
    `end_offset_for` answers for the epochs that hold records (and the leader's current
    one, assigned when it took over, KIP-279).

    The I/O layer persists `to_text()` atomically (write a temporary file, fsync, rename)
    whenever a decision says so (`SaveEpochs`), and on start reads it with `from_text`
    and `truncate_from_end(log end)`: a crash may leave entries past what survived of
    the log."""

    __slots__ = ("_entries",)

    def __init__(self, entries=()):
        self._entries = []
        for epoch, start in entries:
            self._check_next(epoch, start)
            self._entries.append((epoch, start))

    def _check_next(self, epoch, start):
        if epoch < 0 or start < 0:
            raise LeaderEpochsError(f"negative epoch or offset ({epoch}, {start})")
        if self._entries:
            last_epoch, last_start = self._entries[-1]
            if epoch <= last_epoch or start < last_start:
                raise LeaderEpochsError(f"entry ({epoch}, {start}) after ({last_epoch}, {last_start})")

    @property
    def entries(self):
        return list(self._entries)

    @property
    def latest_epoch(self):
        return self._entries[-1][0] if self._entries else NO_EPOCH

    def __len__(self):
        return len(self._entries)

    def __eq__(self, other):
        return isinstance(other, LeaderEpochs) and self._entries == other._entries

    def __repr__(self):
        return f"LeaderEpochs({self._entries})"

    def assign(self, epoch, start):
        """Records that the records of `epoch` begin at `start` (a leader taking over at its
        log end; a follower appending a batch). Entries that begin at or after `start`
        belong to epochs that got no records before this one and go, as in Kafka's
        LeaderEpochFileCache.assign. Returns whether the history changed.
        LeaderEpochsError if records of a later epoch already lie before `start`."""
        if epoch < 0 or start < 0:
            raise LeaderEpochsError(f"negative epoch or offset ({epoch}, {start})")
        entries = self._entries
        changed = False
        while entries and entries[-1][1] >= start:
            if entries[-1] == (epoch, start):
                return changed
            entries.pop()
            changed = True
        if entries:
            last_epoch = entries[-1][0]
            if last_epoch == epoch:
                return changed
            if last_epoch > epoch:
                raise LeaderEpochsError(f"records of epoch {epoch} at {start} after records of epoch {last_epoch}")
        entries.append((epoch, start))
        return True

    def epoch_at(self, offset):
        """The epoch of the record at `offset` (NO_EPOCH if the history starts later)."""
        found = NO_EPOCH
        for epoch, start in self._entries:
            if start > offset:
                break
            found = epoch
        return found

    def end_offset_for(self, epoch, log_end):
        """(epoch, end offset): KIP-279's OffsetsForLeaderEpoch answer for `epoch`. The end is
        where the next higher epoch starts (`log_end` for the latest epoch); the epoch
        answered is the largest one in the history that is at most `epoch`. For an epoch
        older than the whole history: `epoch` and the first entry's start (the records
        before it are gone, and the asker must not keep any of its own from there).
        (NO_EPOCH, -1) if the history is empty, `epoch` is NO_EPOCH or newer than all."""
        entries = self._entries
        if epoch == NO_EPOCH or not entries or epoch > entries[-1][0]:
            return NO_EPOCH, -1
        if epoch == entries[-1][0]:
            return epoch, log_end
        floor = None
        for i, (e, start) in enumerate(entries):
            if e > epoch:
                return (epoch, start) if floor is None else (floor, start)
            floor = e
        raise AssertionError("unreachable: the latest epoch is larger")

    def truncate_from_end(self, end):
        """The log was truncated to `end`: drop the entries that begin at or after it."""
        entries = self._entries
        changed = False
        while entries and entries[-1][1] >= end:
            entries.pop()
            changed = True
        return changed

    def truncate_from_start(self, start):
        """The log now starts at `start` (retention, or a snapshot): entries that begin
        before it collapse into one that begins at `start`."""
        entries = self._entries
        keep = 0
        while keep < len(entries) and entries[keep][1] <= start:
            keep += 1
        if keep == 0 or (keep == 1 and entries[0][1] == start):
            return False
        epoch = entries[keep - 1][0]
        self._entries = [(epoch, start)] + entries[keep:]
        return True

    def clear(self):
        changed = bool(self._entries)
        self._entries = []
        return changed

    def copy(self):
        c = LeaderEpochs()
        c._entries = list(self._entries)
        return c

    def to_text(self):
        return "\n".join([EPOCHS_HEADER] + [f"{e} {s}" for e, s in self._entries]) + "\n"

    @classmethod
    def from_text(cls, text):
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        if not lines or lines[0] != EPOCHS_HEADER:
            raise LeaderEpochsError("not an epoch history (no header line)")
        if len(lines) - 1 > MAX_EPOCH_ENTRIES:
            raise LeaderEpochsError(f"{len(lines) - 1} entries (at most {MAX_EPOCH_ENTRIES})")
        entries = []
        for n, line in enumerate(lines[1:], 2):
            parts = line.split(" ")
            if len(parts) != 2 or not all(p.isdigit() for p in parts):
                raise LeaderEpochsError(f"line {n}: {line[:40]!r} is not 'epoch start'")
            entries.append((int(parts[0]), int(parts[1])))
        return cls(entries)
