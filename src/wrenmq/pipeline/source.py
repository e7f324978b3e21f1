"""`wrenmq` as a Spark data source: the commit log for `spark.read` and `spark.readStream`.

    spark.dataSource.register(WrenDataSource)        # wrenmq.pipeline.spark.session() does it
    df = spark.read.format("wrenmq").load("/var/lib/wrenmq")
    df = spark.read.format("wrenmq").option("username", "spark").option("password", pw)
         .load("wrenmq://node-a:8081,node-b:8081")           # a running cluster, over the network
    stream = (spark.readStream.format("wrenmq").option("topics", "sensors/#")
              .option("maxRecordsPerTrigger", 100000).load("/var/lib/wrenmq"))

Every subdirectory of `<data dir>/log/` is one *log partition* (a broker node's log, named by
its node id); offsets are dense per partition. An offset of the source is a JSON object
`{"<node>": <next offset>, ...}` with its keys in sorted order (Spark compares offsets as
serialized JSON), so a checkpointed query goes on where it stopped, also after nodes are added.

With `wrenmq://HOST:PORT,...` the partitions are those the cluster's nodes serve on their
admin listeners (any one node lists them all, admin/logread.py), and each task reads its
offset range over HTTP from a node that serves it (netlog.py): no executor opens a file of
the log. Offsets, options, schema and checkpoints are the same in both forms.

Driver-side state (open `LogReader`s or the cluster's listing, the availableNow target) lives
in the reader objects; `read()` runs on pickled copies in the Python workers and is stateless:
it reads the planned offset range with `wrenmq.store.arrow.read_source` (Arrow arrays over the
log's bytes, topic filters applied per distinct topic), or receives the same rows as an Arrow
IPC stream, and yields pyarrow RecordBatches in Spark's exact Arrow schema. The only per-row
Python work is decoding the MQTT 5 property blocks of the rows that have one, once per
distinct block (on the node, over the network).

Options (case-insensitive), in the style of Spark's Kafka source:

    path                    the broker's data dir (holds log/<node>/); or the log/ dir itself;
                            or several, comma separated: a cluster's nodes, read together;
                            or wrenmq://HOST:PORT[,HOST:PORT...]: nodes' admin listeners
    topics                  MQTT filters, comma separated (or a JSON list); pushed down
    startingOffsets         earliest (default) | latest | {"node": offset, ...}  (-2 earliest, -1 latest)
    startingTimestamp       start at the first record with timestamp >= this (ms since the epoch,
                            or ISO 8601); overrides startingOffsets
    endingOffsets           batch only: latest (default) | {"node": offset, ...} (exclusive)
    endingTimestamp         batch only: stop before the first record with timestamp >= this
    maxRecordsPerTrigger    streaming: at most this many log records per micro-batch
    maxRecordsPerPartition  split a partition's range into Spark partitions of at most this many
                            records (default 250000)
    failOnDataLoss          true (default): fail when planned records were deleted by retention
  over the network only:
    username, password      HTTP Basic: a user of the admin listener (readonly_users is enough)
    token                   or an API token (wrenmq admin token add NAME --read-only)
    cafile                  CA certificate(s) of an HTTPS listener (implies tls)
    tls                     true: https:// with the system's CAs (default: true if cafile is given)
    requestTimeoutMs        a request's socket timeout (default 30000)
    retryTimeoutMs          how long a read keeps trying a partition's servers without progress
                            (default 120000)
    compression             Arrow IPC buffer compression over the wire: none (default), lz4, zstd
"""

import logging
import os

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import (ArrayType, BinaryType, BooleanType, IntegerType, LongType, StringType,
                               StructField, StructType, TimestampType)

from wrenmq.store import arrow as arrow_rows

from .common import Options, check_loss, open_readers, resolve, sorted_offsets, starting_offsets, time_offset
from .netlog import read_range

try:  # pyspark >= 4.2
    from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadMaxRows,
                                                  SupportsTriggerAvailableNow)
except ImportError:  # pragma: no cover - older pyspark: no admission control
    ReadAllAvailable = ReadMaxRows = None

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass

log = logging.getLogger("wrenmq.pipeline")

FORMAT = "wrenmq"
COALESCE_ROWS = int(os.environ.get("WRENMQ_COALESCE_ROWS", str(arrow_rows.COALESCE_ROWS)))

USER_PROPERTY_TYPE = StructType([StructField("key", StringType()), StructField("value", StringType())])
PROPERTIES_TYPE = StructType([
    StructField("payload_format_indicator", IntegerType()),
    StructField("message_expiry_interval", LongType()),
    StructField("content_type", StringType()),
    StructField("response_topic", StringType()),
    StructField("correlation_data", BinaryType()),
    StructField("user_properties", ArrayType(USER_PROPERTY_TYPE)),
])
SCHEMA = StructType([
    StructField("offset", LongType(), False),
    StructField("node", StringType(), False),
    StructField("timestamp", TimestampType(), False),
    StructField("topic", StringType(), False),
    StructField("qos", IntegerType(), False),
    StructField("retain", BooleanType(), False),
    StructField("client_id", StringType(), False),
    StructField("payload", BinaryType(), False),
    StructField("properties", PROPERTIES_TYPE, True),  # null when the message had none
])

# The rows as Arrow: store.arrow builds them (the admin listener serves the same over HTTP).
properties_column = arrow_rows.properties_column
to_spark_batch = arrow_rows.to_source_batch


class LogPartition(InputPartition):
    """Records [start, end) of one log partition, read from its directory."""

    def __init__(self, node, directory, start, end):
        self.node = node
        self.directory = directory
        self.start = start
        self.end = end

    def __repr__(self):
        return f"LogPartition({self.node!r}, {self.start}, {self.end})"


class NetPartition(InputPartition):
    """Records [start, end) of one log partition, read over HTTP from one of `urls` (the
    admin listeners of the nodes that serve it, preferred first)."""

    def __init__(self, node, urls, start, end):
        self.node = node
        self.urls = tuple(urls)
        self.start = start
        self.end = end

    def __repr__(self):
        return f"NetPartition({self.node!r}, {self.start}, {self.end}, {', '.join(self.urls)})"


def split_ranges(node, where, start, end, max_records, net=False):
    """[start, end) of a partition as input partitions of at most `max_records` records;
    `where` is its directory, or with `net` the URLs that serve it."""
    out = []
    s = start
    while s < end:
        e = min(end, s + max_records) if max_records else end
        out.append(NetPartition(node, where, s, e) if net else LogPartition(node, where, s, e))
        s = e
    return out


# --- the worker side: log -> Arrow in Spark's schema ------------------------------------------------

_ARROW = {}


def spark_arrow_schema():
    """The Arrow schema Spark expects from read() (computed by pyspark itself, cached);
    store.arrow.SOURCE_SCHEMA is the same, built without pyspark."""
    s = _ARROW.get("schema")
    if s is None:
        from pyspark.sql.pandas.types import to_arrow_schema
        s = _ARROW["schema"] = to_arrow_schema(SCHEMA, timezone="UTC")
    return s


def read_partition(part, topics, fail_on_data_loss=True):
    """Yield Spark-schema RecordBatches of one planned LogPartition (runs in the workers)."""
    from wrenmq.store.reader import LogReader

    if not os.path.isdir(part.directory):
        if fail_on_data_loss:
            raise FileNotFoundError(f"wrenmq source: log partition {part.directory} is gone "
                                    f"(planned offsets {part.start}-{part.end})")
        return
    reader = LogReader(part.directory)
    try:
        start = part.start
        if start < reader.start_offset:
            msg = (f"wrenmq source: records {start}-{min(part.end, reader.start_offset) - 1} of "
                   f"partition {part.node!r} were deleted by retention before they were read")
            if fail_on_data_loss:
                raise RuntimeError(msg + " (set failOnDataLoss=false to go on)")
            log.warning("%s; skipping them", msg)
            start = reader.start_offset
        if start >= part.end:
            return
        yield from arrow_rows.read_source(reader, part.node, start, part.end, topics, COALESCE_ROWS)
        if reader.corrupt_records:
            log.error("wrenmq source: %d damaged record(s) in partition %r offsets %d-%d were skipped",
                      reader.corrupt_records, part.node, start, part.end - 1)
    finally:
        reader.close()


def read_any(part, opts):
    """The rows of a planned partition, from its directory or over the network."""
    if part.end <= part.start:
        return iter(())
    if isinstance(part, NetPartition):
        return read_range(opts.net, part.node, part.urls, part.start, part.end, opts.topics, opts.fail_on_data_loss)
    return read_partition(part, opts.topics, opts.fail_on_data_loss)


# --- the driver side ---------------------------------------------------------------------------------

class WrenDataSource(DataSource):
    """The `wrenmq` format."""

    @classmethod
    def name(cls):
        return FORMAT

    def schema(self):
        return SCHEMA

    def reader(self, schema):
        return WrenBatchReader(Options(self.options))

    def streamReader(self, schema):
        return WrenStreamReader(Options(self.options))


def _plan(opts, readers, node, start, end):
    """The input partitions of [start, end) of `node`: its directory, or the URLs that
    serve it (those last listed, or any node known when it is not listed now: the read
    then waits for a server to come back, see netlog.read_range)."""
    if opts.net is not None:
        urls = readers.servers.get(node) or tuple(readers.known)
        return split_ranges(node, urls, start, end, opts.max_per_partition, net=True)
    where = readers.dirs.get(node) or os.path.join(_first(opts.root), node)
    return split_ranges(node, where, start, end, opts.max_per_partition)


class WrenBatchReader(DataSourceReader):
    def __init__(self, opts):
        self.opts = opts

    def partitions(self):
        opts = self.opts
        readers = open_readers(opts)
        try:
            parts = []
            for node, r in readers.refresh().items():
                if opts.starting_ts is not None:
                    start = time_offset(r, opts.starting_ts)
                else:
                    start = resolve(opts.starting, node, r, "earliest")
                if opts.ending_ts is not None:
                    end = time_offset(r, opts.ending_ts)
                else:
                    end = resolve(opts.ending, node, r, "latest")
                end = min(end, r.durable_end_offset)
                start = check_loss(node, start, r, opts.fail_on_data_loss and isinstance(opts.starting, dict))
                parts.extend(_plan(opts, readers, node, start, end))
        finally:
            readers.close()
        # Spark needs at least one partition; an empty range reads nothing.
        return parts or [LogPartition("", "", 0, 0)]

    def read(self, partition):
        return read_any(partition, self.opts)


class WrenStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts):
        self.opts = opts
        self._readers = open_readers(opts, retry=True)
        self._target = None  # availableNow: the log ends when the query started

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_readers"] = None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)

    def _ends(self):
        return {node: r.durable_end_offset for node, r in self._readers.refresh().items()}

    def initialOffset(self):
        return starting_offsets(self.opts, self._readers.refresh())

    def getDefaultReadLimit(self):
        if self.opts.max_per_trigger and ReadMaxRows is not None:
            return ReadMaxRows(self.opts.max_per_trigger)
        return ReadAllAvailable() if ReadAllAvailable is not None else None

    def prepareForTriggerAvailableNow(self):
        self._target = self._ends()

    def reportLatestOffset(self):
        return sorted_offsets(self._ends())

    def latestOffset(self, start=None, limit=None):
        ends = self._ends()
        if self._target is not None:
            ends = {n: min(e, self._target[n]) for n, e in ends.items() if n in self._target}
        start = start or {}
        out = dict(start)
        for node, e in ends.items():
            out[node] = max(e, start.get(node, 0))
        max_rows = getattr(limit, "max_rows", None)
        if max_rows is None and limit is None and self.opts.max_per_trigger:
            max_rows = self.opts.max_per_trigger  # pyspark < 4.2 calls latestOffset() bare
        if max_rows is not None:
            out = cap_offsets(start, out, max_rows, self._readers.readers)
        return sorted_offsets(out)

    def partitions(self, start, end):
        opts = self.opts
        readers = self._readers.refresh()
        parts = []
        for node in sorted(end):
            e = end[node]
            s = start.get(node, 0)
            r = readers.get(node)
            if r is not None:
                s = check_loss(node, s, r, opts.fail_on_data_loss)
            elif e > s and opts.fail_on_data_loss and opts.net is None:
                # (over the network a partition not listed now is one whose nodes do not
                # answer: its range is planned all the same, and read when one is back)
                raise RuntimeError(f"wrenmq source: log partition {node!r} disappeared")
            parts.extend(_plan(opts, self._readers, node, s, e))
        return parts

    def read(self, partition):
        return read_any(partition, self.opts)

    def commit(self, end):
        pass

    def stop(self):
        if self._readers is not None:
            self._readers.close()


def _first(root):
    return root[0] if isinstance(root, tuple) else root


def cap_offsets(start, end, max_rows, readers=None):
    """Admission control: move `end` back so at most `max_rows` records lie between start and end.

    The budget is shared among the partitions in proportion to their backlog (as Spark's Kafka
    source does), the rest handed out in node order; every partition with a backlog moves on
    as long as the budget allows.
    """
    backlog = {}
    for node, e in end.items():
        s = start.get(node, 0)
        if readers and node in readers:
            s = max(s, readers[node].start_offset)
        if e > s:
            backlog[node] = (s, e - s)
    total = sum(b for _, b in backlog.values())
    if total <= max_rows:
        return end
    out = dict(end)
    give = {n: (max_rows * b) // total for n, (_, b) in backlog.items()}
    left = max_rows - sum(give.values())
    for n in sorted(backlog):
        if left <= 0:
            break
        extra = min(left, backlog[n][1] - give[n])
        give[n] += extra
        left -= extra
    for n, (s, _) in backlog.items():
        out[n] = s + give[n]
    return out
