"""Parquet output that is exactly once for every reader, not only for Spark.

Spark's own file sink is exactly once only for Spark (its `_spark_metadata` log names the
committed files); a batch killed mid-write leaves files that pyarrow, DuckDB or pandas count.
`AtomicParquetSink` is used from `foreachBatch` instead. Each micro-batch

1. is written by Spark under `<parent>/.<output name>.wrenmq-staging/<batch id>/`, a hidden
   sibling of the output on the same filesystem, where no reader of the output looks;
2. is committed by writing `<output>/_wrenmq/manifests/<batch id>.json` atomically (write to a
   temporary name, fsync, rename): the list of staged files and their final names, which are
   a function of the batch id only (`<partition dirs>/part-<batch id>-<n>.parquet`);
3. is published by renaming each file into place, then the manifest is marked published.

A crash before step 2 leaves only staging files (removed on the next start; Spark re-runs the
batch). A crash during step 3 is rolled forward on the next start from the manifest. When
Spark re-runs a batch id (it does after a crash between our publish and its own commit), the
files get the same names and replace the earlier ones: a batch is never counted twice.
Readers that list the folder while step 3 runs may see part of the batch, never a duplicate.

`mode="replace"` keeps one table file (`<output>/<table>.parquet`) that each batch replaces
atomically (the device shadow).
"""

import json
import logging
import os
import shutil
import time

log = logging.getLogger("wrenmq.pipeline")

META_DIR = "_wrenmq"
KEEP_MANIFESTS = 200


def _fsync_path(path, directory=False):
    try:
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_json_atomic(path, obj):
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, sort_keys=True)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    _fsync_path(os.path.dirname(path), directory=True)


def _local_path(path):
    """A local filesystem path from a path or a file: URI (the atomic sink needs rename(2))."""
    p = str(path)
    if p.startswith("file://"):
        p = p[len("file://"):]
    elif "://" in p:
        raise ValueError(f"the atomic Parquet sink needs a local or mounted (POSIX) path, not {p}")
    return os.path.abspath(os.path.expanduser(p))


class AtomicParquetSink:
    def __init__(self, output, partition_by=(), mode="append", table="table", sort_by=()):
        if mode not in ("append", "replace"):
            raise ValueError(mode)
        self.output = _local_path(output)
        self.partition_by = list(partition_by)
        self.sort_by = list(sort_by)
        self.mode = mode
        self.table = table
        self.meta = os.path.join(self.output, META_DIR)
        # Staging is a hidden sibling of the output (same filesystem, so publishing is a rename),
        # outside it so that no glob over the output (DuckDB's **/*.parquet) finds staged files.
        parent, base = os.path.split(self.output.rstrip(os.sep))
        self.staging = os.path.join(parent, f".{base}.wrenmq-staging")
        self.manifests = os.path.join(self.meta, "manifests")
        os.makedirs(self.staging, exist_ok=True)
        os.makedirs(self.manifests, exist_ok=True)
        self.recover()

    # --- recovery ---------------------------------------------------------------------------

    def _manifest_path(self, batch_id):
        return os.path.join(self.manifests, f"{batch_id:020d}.json")

    def _read_manifest(self, batch_id):
        try:
            with open(self._manifest_path(batch_id)) as fh:
                return json.load(fh)
        except (FileNotFoundError, ValueError):
            return None

    def recover(self):
        """Roll committed-but-unpublished batches forward; drop uncommitted staging."""
        rolled = 0
        for name in sorted(os.listdir(self.manifests)):
            if name.endswith(".json"):
                with open(os.path.join(self.manifests, name)) as fh:
                    try:
                        m = json.load(fh)
                    except ValueError:
                        continue
                if m.get("state") != "published":
                    self._publish(m)
                    rolled += 1
            elif ".tmp-" in name:
                os.unlink(os.path.join(self.manifests, name))
        for name in os.listdir(self.staging):
            shutil.rmtree(os.path.join(self.staging, name), ignore_errors=True)
        if rolled:
            log.warning("%s: rolled %d committed batch(es) forward after a crash", self.output, rolled)
        return rolled

    # --- writing ------------------------------------------------------------------------------

    def write_batch(self, df, batch_id):
        """Write one micro-batch DataFrame (foreachBatch); returns the number of files published."""
        stage = os.path.join(self.staging, f"{batch_id:020d}")
        shutil.rmtree(stage, ignore_errors=True)
        w = df
        if self.mode == "replace":
            w = w.coalesce(1)
        elif self.partition_by:
            w = w.repartition(*self.partition_by)  # one file per partition directory
        else:
            w = w.coalesce(1)
        if self.sort_by:
            w = w.sortWithinPartitions(*self.sort_by)
        writer = w.write.mode("overwrite")
        if self.partition_by and self.mode == "append":
            writer = writer.partitionBy(*self.partition_by)
        writer.parquet("file://" + stage)
        return self.commit_staged(stage, batch_id)

    def write_arrow(self, table, batch_id):
        """Write a pyarrow Table as one batch (the driver-side path; `replace` tables)."""
        import pyarrow.parquet as pq

        stage = os.path.join(self.staging, f"{batch_id:020d}")
        shutil.rmtree(stage, ignore_errors=True)
        os.makedirs(stage)
        pq.write_table(table, os.path.join(stage, "part-00000.parquet"), compression="snappy")
        return self.commit_staged(stage, batch_id)

    def commit_staged(self, stage, batch_id):
        files = []
        for dirpath, dirnames, filenames in os.walk(stage):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, stage)
            for fn in sorted(f for f in filenames if f.endswith(".parquet")):
                files.append((rel_dir, fn))
        moves = []
        counters = {}
        for rel_dir, fn in files:
            src = os.path.join(stage, rel_dir, fn)
            _fsync_path(src)
            if self.mode == "replace":
                dst = f"{self.table}.parquet"
            else:
                k = counters.get(rel_dir, 0)
                counters[rel_dir] = k + 1
                d = "" if rel_dir == "." else rel_dir
                dst = os.path.join(d, f"part-{batch_id:012d}-{k:05d}.parquet")
            moves.append([os.path.relpath(src, self.output), dst])
        previous = self._read_manifest(batch_id)
        manifest = {"batch_id": batch_id, "state": "committed", "files": moves, "time": time.time(),
                    "replaces": [d for _, d in previous["files"]] if previous else []}
        write_json_atomic(self._manifest_path(batch_id), manifest)  # the commit point
        self._publish(manifest)
        shutil.rmtree(stage, ignore_errors=True)
        self._prune()
        return len(moves)

    def _publish(self, manifest):
        dirs = set()
        new = set()
        for src, dst in manifest["files"]:
            s = os.path.join(self.output, src)
            d = os.path.join(self.output, dst)
            new.add(dst)
            if os.path.exists(s):
                os.makedirs(os.path.dirname(d), exist_ok=True)
                os.replace(s, d)
                dirs.add(os.path.dirname(d))
        # A re-run of a batch id that produced other files than before: drop the leftovers.
        for dst in manifest.get("replaces", ()):
            if dst not in new:
                try:
                    os.unlink(os.path.join(self.output, dst))
                except FileNotFoundError:
                    pass
        for d in dirs:
            _fsync_path(d, directory=True)
        manifest["state"] = "published"
        write_json_atomic(self._manifest_path(manifest["batch_id"]), manifest)

    def _prune(self):
        names = sorted(n for n in os.listdir(self.manifests) if n.endswith(".json"))
        for n in names[:-KEEP_MANIFESTS]:
            try:
                os.unlink(os.path.join(self.manifests, n))
            except FileNotFoundError:
                pass
