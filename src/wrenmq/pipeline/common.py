"""Options, offsets and log discovery shared by the source, the jobs and replay (no pyspark)."""

import datetime as _dt
import json
import logging
import os

log = logging.getLogger("wrenmq.pipeline")

DEFAULT_MAX_RECORDS_PER_PARTITION = 250_000


def log_root(path):
    """The directory whose subdirectories are the log partitions; for several data dirs
    given as one comma-separated string (a cluster's nodes, each with its own log
    partition), a tuple of them (`list_partitions` and `Readers` take either)."""
    path = str(path)
    if "," in path and not os.path.exists(path):
        return tuple(_log_root(p.strip()) for p in path.split(",") if p.strip())
    return _log_root(path)


def _log_root(path):
    path = os.path.abspath(os.path.expanduser(str(path)))
    sub = os.path.join(path, "log")
    if os.path.isdir(sub) or not _looks_like_log_root(path):
        return sub
    return path


def _looks_like_log_root(path):
    try:
        for name in os.listdir(path):
            d = os.path.join(path, name)
            if os.path.isdir(d) and any(f.endswith(".log") for f in os.listdir(d)):
                return True
    except OSError:
        pass
    return False


class OptionError(ValueError):
    """A job's option that cannot work, found before anything starts (Spark takes 10-20 s
    to start; a typo must not cost that, nor leave a checkpoint behind)."""


def data_dir_specs(path):
    """The data dirs (or log dirs) of a --data-dir value: one, or several comma separated."""
    path = str(path)
    if "," in path and not os.path.exists(path):
        return [p.strip() for p in path.split(",") if p.strip()]
    return [path]


def check_log(path):
    """{node: partition dir} of the log(s) `path` names (list_partitions); OptionError
    unless each data dir it names holds a commit log."""
    for spec in data_dir_specs(path):
        root = _log_root(spec)
        if not list_partitions(root):
            where = "does not exist" if not os.path.exists(spec) else f"has no {root}/<node>/"
            raise OptionError(f"--data-dir {spec}: no commit log there ({spec} {where}); give the broker's "
                              f"[storage] data_dir (its log is <data dir>/log/<node>/, made when it first starts)")
    try:
        return list_partitions(log_root(path))
    except ValueError as e:
        raise OptionError(str(e)) from None


def list_partitions(root):
    """{node: partition directory} of the log partitions under `root` (or each of a tuple
    of roots), sorted by node. A node found under two roots is an error: its offsets
    would mean two different records."""
    if isinstance(root, (tuple, list)):
        out = {}
        for r in root:
            for node, d in list_partitions(r).items():
                if node in out:
                    raise ValueError(f"wrenmq source: log partition {node!r} is in both {out[node]} and {d} "
                                     "(give each broker its own [broker] node_id)")
                out[node] = d
        return {n: out[n] for n in sorted(out)}
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return {}
    return {n: os.path.join(root, n) for n in names
            if not n.startswith(".") and os.path.isdir(os.path.join(root, n))}


def sorted_offsets(d):
    """Offsets as Spark wants them: a dict whose keys are in sorted order (it compares JSON)."""
    return {k: int(d[k]) for k in sorted(d)}


def parse_time_us(value):
    """Milliseconds since the epoch (int or digits) or an ISO 8601 string -> microseconds."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        return int(value * 1000)
    s = str(value).strip()
    try:
        return int(float(s) * 1000)
    except ValueError:
        pass
    t = _dt.datetime.fromisoformat(s.replace("Z", "+00:00"))
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.timezone.utc)
    return int(t.timestamp() * 1_000_000)


def _parse_bool(v, default):
    if v is None:
        return default
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def _parse_int(v, name):
    if v is None or str(v).strip() == "":
        return None
    try:
        n = int(str(v).strip())
    except ValueError:
        raise ValueError(f"wrenmq source: option {name} must be an integer, got {v!r}") from None
    if n <= 0:
        raise ValueError(f"wrenmq source: option {name} must be > 0, got {n}")
    return n


def parse_topics(v):
    if v is None:
        return None
    s = str(v).strip()
    if not s:
        return None
    if s.startswith("["):
        topics = [str(t) for t in json.loads(s)]
    else:
        topics = [t.strip() for t in s.split(",") if t.strip()]
    return topics or None


def parse_offsets_spec(v, name):
    """'earliest' | 'latest' | {node: int} -> str or dict."""
    if v is None:
        return None
    if isinstance(v, dict):
        return {str(k): int(x) for k, x in v.items()}
    s = str(v).strip()
    if s.lower() in ("earliest", "latest"):
        return s.lower()
    try:
        d = json.loads(s)
    except ValueError:
        raise ValueError(f"wrenmq source: {name} must be earliest, latest or a JSON object "
                         f"{{\"node\": offset}}, got {s!r}") from None
    if not isinstance(d, dict):
        raise ValueError(f"wrenmq source: {name} must be a JSON object {{\"node\": offset}}")
    return {str(k): int(x) for k, x in d.items()}


def _parse_seconds_ms(v, name, default):
    n = _parse_int(v, name)
    return default if n is None else n / 1000.0


class Options:
    """The parsed options; small and picklable (shipped to the workers).

    `path` is data dirs (`root`: where the log partitions are), or `wrenmq://HOST:PORT,...`,
    the admin listeners of a cluster's nodes (`net`: netlog.Net, with the credentials and
    TLS options)."""

    def __init__(self, options):
        from .netlog import DEFAULT_REQUEST_TIMEOUT, DEFAULT_RETRY_TIMEOUT, Net, is_network_path

        o = {str(k).lower(): v for k, v in dict(options).items()}
        path = o.get("path")
        if not path:
            raise ValueError("wrenmq source: give the broker's data dir (.load(DIR) or option path), "
                             "or its admin listener: .load(\"wrenmq://HOST:PORT\")")
        self.path = str(path)
        self.root = self.net = None
        if is_network_path(self.path):
            compression = (o.get("compression") or "").strip().lower() or None
            if compression not in (None, "none", "lz4", "zstd"):
                raise ValueError(f"wrenmq source: option compression must be none, lz4 or zstd, got {compression!r}")
            tls = o.get("tls")
            self.net = Net(self.path, username=o.get("username"), password=o.get("password"), token=o.get("token"),
                           cafile=o.get("cafile"), tls=None if tls is None else _parse_bool(tls, False),
                           request_timeout=_parse_seconds_ms(o.get("requesttimeoutms"), "requestTimeoutMs",
                                                             DEFAULT_REQUEST_TIMEOUT),
                           retry_timeout=_parse_seconds_ms(o.get("retrytimeoutms"), "retryTimeoutMs",
                                                           DEFAULT_RETRY_TIMEOUT),
                           compression=None if compression == "none" else compression)
        else:
            self.root = log_root(path)
        self.topics = parse_topics(o.get("topics"))
        self.starting = parse_offsets_spec(o.get("startingoffsets"), "startingOffsets") or "earliest"
        self.starting_ts = parse_time_us(o.get("startingtimestamp"))
        self.ending = parse_offsets_spec(o.get("endingoffsets"), "endingOffsets") or "latest"
        self.ending_ts = parse_time_us(o.get("endingtimestamp"))
        self.max_per_trigger = _parse_int(o.get("maxrecordspertrigger"), "maxRecordsPerTrigger")
        self.max_per_partition = (_parse_int(o.get("maxrecordsperpartition"), "maxRecordsPerPartition")
                                  or DEFAULT_MAX_RECORDS_PER_PARTITION)
        self.fail_on_data_loss = _parse_bool(o.get("failondataloss"), True)


def resolve(spec, node, reader, default):
    """One partition's offset for an offsets spec ('earliest', 'latest' or a dict).
    'latest' is the log's durable end: the source never reads a record that a crash of
    the broker's machine could still take back (LogReader.durable_end_offset)."""
    if isinstance(spec, dict):
        v = spec.get(node)
        if v is None:
            spec = default
        elif v == -2:
            return reader.start_offset
        elif v == -1:
            return reader.durable_end_offset
        else:
            return v
    return reader.start_offset if spec == "earliest" else reader.durable_end_offset


def open_readers(opts, retry=False):
    """The driver's view of the log partitions: `Readers` over data dirs, or
    `netlog.NetReaders` over a cluster's admin listeners (the same interface; `retry`: a
    listing no node answers is asked again for a while, as a streaming query wants)."""
    if opts.net is not None:
        from .netlog import NetReaders
        return NetReaders(opts.net, retry)
    return Readers(opts.root)


def time_offset(reader, ts_us):
    """The first offset at or after `ts_us` among the records the source may read (the
    durable ones); the durable end if there is none (as the admin listener answers)."""
    return min(reader.offset_for_time(ts_us), reader.durable_end_offset)


class Readers:
    """Open LogReaders of the partitions on disk (driver only; dropped when pickled)."""

    def __init__(self, root):
        self.root = root
        self.readers = {}
        self.dirs = {}  # node -> its partition directory

    def refresh(self):
        from wrenmq.store.reader import LogReader

        dirs = self.dirs = list_partitions(self.root)
        for node in list(self.readers):
            if node not in dirs:
                self.readers.pop(node).close()
        for node, d in dirs.items():
            r = self.readers.get(node)
            if r is None:
                self.readers[node] = LogReader(d)
            else:
                r.refresh()
        return self.readers

    def close(self):
        for r in self.readers.values():
            r.close()
        self.readers.clear()


def starting_offsets(opts, readers):
    out = {}
    for node, r in readers.items():
        if opts.starting_ts is not None:
            out[node] = time_offset(r, opts.starting_ts)
        else:
            out[node] = resolve(opts.starting, node, r, "earliest")
    return sorted_offsets(out)


def check_loss(node, start, reader, fail):
    """Clamp `start` to the log start; a gap there is data loss unless start was 0."""
    if start >= reader.start_offset:
        return start
    if start > 0 and fail:
        raise RuntimeError(f"wrenmq source: offsets {start}-{reader.start_offset - 1} of partition "
                           f"{node!r} were deleted by retention before they were read "
                           "(set failOnDataLoss=false to go on)")
    if start > 0:
        log.warning("wrenmq source: offsets %d-%d of partition %r were deleted by retention; skipping",
                    start, reader.start_offset - 1, node)
    return reader.start_offset


