"""The commit log and the broker's state on disk.

Each module is one concern; import what you use from the module that holds it:

    format.py    the record batch: layout, format versions, encoder, `Batch`, `Record`
    segment.py   a segment's files and names, `Segment` (extent and index entries)
    index.py     the sparse offset and time index files
    scan.py      walking a segment file: checked batches, salvage, `Damage`
    reader.py    `LogReader`: read-only, lock-free reading of a partition
    recovery.py  what a writer checks and puts right when it opens a partition
    log.py       `CommitLog`: the writer (append, roll, sync, retention)
    files.py     durable file writes and the durable-mark file
    state.py     `StateDB`: sessions, subscriptions, retained messages (SQLite)
    store.py     `Store`: the group commit that writes both, and its writer thread
    replicated.py  `ReplicatedStore`: a replicated partition's leader (state in the log,
                 applied and released at the high watermark)
    replica.py   `ReplicaLog`: a follower's copy of a replicated partition
    lock.py      `DataDirLock`: one writer per data dir (readers never take it)
    _epoch.py    the loop's per-message steps into the current epoch (compiled at install)
    _encode.py   the writer's batch encoder, without the GIL (compiled at install)
    arrow.py     the log as Arrow RecordBatches (needs the `pipeline` extra)
    cli.py       `wrenmq log stats|tail|verify`
"""
