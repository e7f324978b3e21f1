"""The commit log for readers over HTTP: what the Spark source reads a cluster by.

    GET /api/v1/log/partitions                                  partitions and who serves each
    GET /api/v1/log/partitions/{partition}/offset?timestamp=US  the first offset at or after a time
    GET /api/v1/log/partitions/{partition}/records?start=S&end=E[&topics=F,...]
                                                                offsets [S, E) as an Arrow IPC stream

The listing is "partitions, each with the nodes that can serve it" (`servers`), so that a
partition kept on several nodes lists each of them, and a reader that loses one goes on with
another: every server of a partition holds the same record at the same offset. A node serves
the partitions `served_partitions` names: its own log and, with `[cluster] replicas` > 1,
every partition its process holds a copy of (followed, or led for a lost node by a hosted
broker). Asked without `local=true` it also asks the other nodes (peers.py) and merges their
lists, so any one node is enough to discover the cluster; each partition's servers come
leader first, then the in-sync replicas, then any other copy (`role`), as the answering
node knows the partitions' records: readers try them in that order.

Nothing here reads past a partition's durable end (`LogReader.durable_end_offset`): the
listing's `end_offset` is it, a time is looked up among durable records only, and a range
that ends past it is refused (416), so a reader never gets a record that a crash of the
node's machine could take back (and whose offset it could then give to another record).
For a replicated partition that end is also never past the high watermark its holder
knows (the leader's and the replicas' marks are capped there: `CommitLog.limit_marks`), so
no server gives a record that a failover could truncate, and every server's records up to
its end are the same.

Records are the pipeline source's rows (`store.arrow.SOURCE_SCHEMA`, Spark's Arrow form) as
an Arrow IPC stream, one message per chunk of the HTTP response. The stream ends with an
empty batch whose custom metadata says `wrenmq.end` (the range's end), so a reader tells a
complete range from a cut one whatever the transport did; along a long scan that finds few
rows, empty batches saying `wrenmq.through` tell it how far the read has got. The reading runs in the listener's
thread pool (`stream_from_thread`), one batch at a time and never ahead of the socket, so the
event loop's message path never waits for the disk; at most MAX_STREAMS ranges are served at
once (503 with Retry-After past that). Each partition keeps a few `LogReader`s between
requests (a reader learns a log's segments once, then only what was appended).
"""

import asyncio
import json
import logging
import threading

from .api import bool_param, failure
from .http import HttpError, Response, json_response, stream_from_thread
from .peers import NO_ADMIN, Peers

log = logging.getLogger("wrenmq.admin")

ARROW_STREAM = "application/vnd.apache.arrow.stream"
END_KEY = b"wrenmq.end"  # custom metadata of the empty batch that ends a complete range
THROUGH_KEY = b"wrenmq.through"  # ... of an empty batch: offsets before it are all sent
SCAN_STEP = 1 << 20  # offsets read at a time (see _ipc_stream)
MAX_STREAMS = 16  # ranges served at once by one listener (each holds a batch or two in memory)
MAX_ROWS = 131072  # rows per IPC batch at most (and the default)
IDLE_READERS = 4  # LogReaders kept per partition between requests
_COMPRESSIONS = ("none", "lz4", "zstd")


def register(routes, admin):
    api = LogRead(admin)
    routes.add("GET", "/api/v1/log/partitions", api.partitions,
               summary="The log's partitions in the cluster, with their offsets and the nodes serving each")
    routes.add("GET", "/api/v1/log/partitions/{partition}/offset", api.offset,
               summary="The first durable offset of a partition at or after ?timestamp= (µs since the epoch)")
    routes.add("GET", "/api/v1/log/partitions/{partition}/records", api.records,
               summary="Records [start, end) of a partition as an Arrow IPC stream (the Spark source's rows)")


def served_partitions(broker):
    """{partition: log directory} of the partitions this node serves to readers: its own
    log, and with replication every partition its process holds a copy of (the followed
    ones in `<data dir>/replicas/<partition>/log/<partition>`, a hosted broker's on the
    same files), none read past its high watermark (module docstring). Call it on the
    event loop: the replication layer changes what it holds there."""
    out = {}
    services = _services(broker)
    if services is not None:
        out.update(services.log_copies())
    store = broker.store
    if store is not None and store.log is not None:
        out[store.node_id] = store.log_dir
    return out


def _services(broker):
    cluster = broker.cluster
    return getattr(cluster, "services", None) if cluster is not None else None


def server_order(broker, partition):
    """The sort key of a partition's servers in the listing: its leader first, then its
    in-sync replicas, then any other copy (each by node name). Without replication the
    partition's own node is its leader."""
    services = _services(broker)
    leader, isr = services.partition_members(partition) if services is not None else (None, ())
    if leader is None:
        leader = partition

    def key(server):
        node = server["node"]
        return (0 if node == leader else 1 if node in isr else 2, node)

    def role(server):
        return ("leader", "in_sync", "replica")[key(server)[0]]

    return key, role


class ReaderPool:
    """Idle LogReaders of one partition, each used by one thread at a time."""

    def __init__(self, directory):
        self.directory = directory
        self.idle = []
        self.lock = threading.Lock()

    def take(self):
        from ..store.reader import LogReader

        with self.lock:
            reader = self.idle.pop() if self.idle else None
        if reader is None:
            return LogReader(self.directory)
        reader.refresh()
        return reader

    def give(self, reader):
        with self.lock:
            if len(self.idle) < IDLE_READERS:
                self.idle.append(reader)


def _int(query, name, default=None, lo=0):
    text = query.get(name)
    if text is None or text == "":
        if default is None:
            raise HttpError(400, f"{name}: required (an integer)")
        return default
    try:
        value = int(text)
    except ValueError:
        raise HttpError(400, f"{name}: expected an integer, got {text[:40]!r}") from None
    if value < lo:
        raise HttpError(400, f"{name}: expected >= {lo}, got {value}")
    return value


def _topics(query):
    from ..mqtt.topics import TopicError, validate_topic_filter

    text = (query.get("topics") or "").strip()
    if not text:
        return None
    try:
        filters = [str(t) for t in json.loads(text)] if text.startswith("[") else \
            [t.strip() for t in text.split(",") if t.strip()]
        for f in filters:
            validate_topic_filter(f)
    except (ValueError, TypeError, TopicError) as e:
        raise HttpError(400, f"topics: {e}") from None
    return filters or None


def describe(reader):
    """One partition as a reader may read it from this node (durable offsets only)."""
    st = reader.stats()
    return {"start_offset": reader.start_offset, "end_offset": reader.durable_end_offset,
            "first_timestamp_us": st["first_timestamp_us"], "last_timestamp_us": st["last_timestamp_us"]}


class _Counted:
    """An async stream that gives back its slot of LogRead.streams exactly once, when it
    ends, fails or is closed (also if it was never iterated: http.py closes it then)."""

    def __init__(self, owner, stream, gen, executor):
        self.owner = owner
        self.stream = stream
        self.gen = gen
        self.executor = executor
        self.done = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return await self.stream.__anext__()
        except BaseException:
            self._release()
            raise

    async def aclose(self):
        try:
            await self.stream.aclose()
            # (a stream never iterated never ran its generator's close: do it here)
            await asyncio.get_running_loop().run_in_executor(self.executor, self.gen.close)
        finally:
            self._release()

    def _release(self):
        if not self.done:
            self.done = True
            self.owner.streams -= 1


class LogRead:
    def __init__(self, admin):
        self.admin = admin
        self.broker = admin.broker
        self.pools = {}  # directory -> ReaderPool
        self.streams = 0  # ranges being served now
        self.peers = Peers(admin)

    def _pool(self, partition):
        directory = served_partitions(self.broker).get(partition)
        if directory is None:
            raise HttpError(404, f"partition {partition[:200]!r} is not served by node {self.admin.node!r} "
                                 "(GET /api/v1/log/partitions lists the nodes that serve each)")
        pool = self.pools.get(directory)
        if pool is None:
            pool = self.pools[directory] = ReaderPool(directory)
        return pool

    async def _in_thread(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.admin.executor, fn, *args)

    # --- the listing ---

    def _local(self, pools):
        out = []
        for partition, pool in sorted(pools.items()):
            try:
                reader = pool.take()
            except OSError as e:  # (a replica moved aside, or not made yet, as it was listed)
                log.info("log read: partition %r in %s cannot be read now: %s", partition, pool.directory, e)
                continue
            try:
                out.append((partition, describe(reader)))
            finally:
                pool.give(reader)
        return out

    async def partitions(self, request):
        me = {"node": self.admin.node, "admin": self.admin.listener.url}
        parts = {}
        pools = {p: self._pool(p) for p in served_partitions(self.broker)}
        for partition, d in await self._in_thread(self._local, pools):
            parts.setdefault(partition, []).append({**me, **d})
        out = {"node": self.admin.node, "partitions": []}
        if self.peers.active and not bool_param(request.query, "local"):
            answers = await self.peers.ask_all(request, "GET", request.path)
            for node, (status, data) in sorted(answers.items()):
                if status == 200 and isinstance(data, dict):
                    for p in data.get("partitions", ()):
                        parts.setdefault(p["partition"], []).extend(p["servers"])
                else:
                    out.setdefault("unreachable", {})[node] = failure(status, data)
            for node in self._hosted_elsewhere(answers, parts):
                del out["unreachable"][node]
            if not out.get("unreachable", True):
                del out["unreachable"]
        for partition in sorted(parts):
            key, role = server_order(self.broker, partition)
            servers = sorted(parts[partition], key=key)
            for s in servers:
                s["role"] = role(s)
            out["partitions"].append({
                "partition": partition,
                "start_offset": min(s["start_offset"] for s in servers),
                "end_offset": max(s["end_offset"] for s in servers),
                "servers": servers,
            })
        return json_response(out)

    @staticmethod
    def _hosted_elsewhere(answers, parts):
        """The peers with no admin listener of their own whose partition a node serves: a
        lost node's broker hosted by a survivor (cluster/ha/hosting.py), not a node down."""
        return [n for n, (status, data) in answers.items()
                if status is None and data == NO_ADMIN and n in parts]

    # --- one partition ---

    async def offset(self, request):
        ts = _int(request.query, "timestamp", lo=-(1 << 62))
        pool = self._pool(request.params["partition"])

        def find():
            reader = pool.take()
            try:
                # Among durable records only: past them, the answer is the durable end.
                return {"partition": request.params["partition"], "timestamp": ts,
                        "offset": min(reader.offset_for_time(ts), reader.durable_end_offset)}
            finally:
                pool.give(reader)

        return json_response(await self._in_thread(find))

    async def records(self, request):
        q = request.query
        partition = request.params["partition"]
        start = _int(q, "start")
        end = _int(q, "end")
        if end < start:
            raise HttpError(400, f"end ({end}) is before start ({start})")
        topics = _topics(q)
        rows = _int(q, "rows", MAX_ROWS, 1)
        compression = (q.get("compression") or "none").lower()
        if compression not in _COMPRESSIONS:
            raise HttpError(400, f"compression: one of {', '.join(_COMPRESSIONS)}")
        pool = self._pool(partition)
        if self.streams >= MAX_STREAMS:
            raise HttpError(503, f"{MAX_STREAMS} log ranges are being read from this node; try again",
                            [("Retry-After", "1")])
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise HttpError(501, "this node cannot serve records: pyarrow is not installed "
                                 "(pip install 'wrenmq[pipeline]')") from None
        reader = await self._in_thread(_open_range, pool, partition, start, end)
        gen = _ipc_stream(pool, reader, partition, start, end, topics, min(rows, MAX_ROWS), compression)
        self.streams += 1
        stream = _Counted(self, stream_from_thread(gen, self.admin.executor), gen, self.admin.executor)
        return Response(200, content_type=ARROW_STREAM, stream=stream,
                        headers=[("X-Wrenmq-Partition", partition), ("X-Wrenmq-Range", f"{start}-{end}")])


def _open_range(pool, partition, start, end):
    """A reader of `partition` for [start, end), or HttpError: 410 when retention deleted
    part of the range, 416 when it reaches past what this node holds durably."""
    reader = pool.take()
    first, durable = reader.start_offset, reader.durable_end_offset
    if end > durable:
        pool.give(reader)
        raise HttpError(416, f"partition {partition!r}: offsets up to {end} asked, this node holds "
                             f"{first}-{durable} durably", [("X-Wrenmq-Offsets", f"{first}-{durable}")])
    if start < first and end > start:
        pool.give(reader)
        raise HttpError(410, f"partition {partition!r}: offsets {start}-{min(end, first) - 1} were deleted "
                             f"by retention (the log starts at {first})",
                        [("X-Wrenmq-Offsets", f"{first}-{durable}")])
    return reader


class _Chunks:
    """The file an IPC writer writes to: what it wrote since the last `take`."""

    closed = False

    def __init__(self):
        self.parts = []

    def write(self, data):
        self.parts.append(bytes(data))
        return len(data)

    def flush(self):
        pass

    def take(self):
        out = b"".join(self.parts)
        self.parts = []
        return out


def _ipc_stream(pool, reader, partition, start, end, topics, rows, compression):
    """The range as Arrow IPC bytes, one chunk per batch (runs in the listener's threads).

    The range is read SCAN_STEP offsets at a time; a step that gave no row (a topic filter
    that matches little) still sends an empty batch saying how far the read got
    (`wrenmq.through`), so the reader's socket never idles through a long scan and a
    resumed read does not scan the same offsets again."""
    import pyarrow as pa

    from ..store.arrow import SOURCE_SCHEMA, read_source

    sink = _Chunks()
    options = pa.ipc.IpcWriteOptions(compression=None if compression == "none" else compression)
    empty = pa.RecordBatch.from_pylist([], schema=SOURCE_SCHEMA)
    step = max(SCAN_STEP, rows)
    try:
        with pa.ipc.new_stream(sink, SOURCE_SCHEMA, options=options) as writer:
            yield sink.take()
            a = start
            while a < end:
                b = min(end, a + step)
                wrote = False
                for rb in read_source(reader, partition, a, b, topics, rows):
                    writer.write_batch(rb)
                    wrote = True
                    yield sink.take()
                if not wrote and b < end:
                    writer.write_batch(empty, custom_metadata={THROUGH_KEY: str(b).encode()})
                    yield sink.take()
                a = b
            if reader.corrupt_records:
                log.error("log read: %d damaged record(s) in partition %r offsets %d-%d were skipped",
                          reader.corrupt_records, partition, start, end - 1)
            writer.write_batch(empty, custom_metadata={END_KEY: str(end).encode()})
        yield sink.take()
    finally:
        pool.give(reader)
