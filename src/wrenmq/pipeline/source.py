"""`wrenmq` as a Spark data source: the commit log for `spark.read` and `spark.readStream`.

    spark.dataSource.register(WrenDataSource)        # wrenmq.pipeline.spark.session() does it
    df = spark.read.format("wrenmq").load("/var/lib/wrenmq")
    stream = (spark.readStream.format("wrenmq").option("topics", "sensors/#")
              .option("maxRecordsPerTrigger", 100000).load("/var/lib/wrenmq"))

Every subdirectory of `<data dir>/log/` is one *log partition* (a broker node's log, named by
its node id); offsets are dense per partition. An offset of the source is a JSON object
`{"<node>": <next offset>, ...}` with its keys in sorted order (Spark compares offsets as
serialized JSON), so a checkpointed query goes on where it stopped, also after nodes are added.

Driver-side state (open `LogReader`s, the availableNow target) lives in the reader objects;
`read()` runs on pickled copies in the Python workers and is stateless: it opens the partition,
reads the planned offset range with `wrenmq.store.arrow.read_arrow` (Arrow arrays over the log's
bytes, topic filters applied per distinct topic) and yields pyarrow RecordBatches in Spark's
exact Arrow schema. The only per-row Python work is decoding the MQTT 5 property blocks of the
rows that have one, once per distinct block.

Options (case-insensitive), in the style of Spark's Kafka source:

    path                    the broker's data dir (holds log/<node>/); or the log/ dir itself;
                            or several, comma separated: a cluster's nodes, read together
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
"""

import logging
import os

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.types import (ArrayType, BinaryType, BooleanType, IntegerType, LongType, StringType,
                               StructField, StructType, TimestampType)

from .common import Options, Readers, check_loss, resolve, sorted_offsets, starting_offsets

try:  # pyspark >= 4.2
    from pyspark.sql.streaming.datasource import (ReadAllAvailable, ReadMaxRows,
                                                  SupportsTriggerAvailableNow)
except ImportError:  # pragma: no cover - older pyspark: no admission control
    ReadAllAvailable = ReadMaxRows = None

    class SupportsTriggerAvailableNow:  # type: ignore[no-redef]
        pass

log = logging.getLogger("wrenmq.pipeline")

FORMAT = "wrenmq"
COALESCE_ROWS = int(os.environ.get("WRENMQ_COALESCE_ROWS", "131072"))
COALESCE_BYTES = 32 << 20

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
_PLAIN_PROPS = ("payload_format_indicator", "message_expiry_interval", "content_type",
                "response_topic", "correlation_data")


class LogPartition(InputPartition):
    """Records [start, end) of one log partition."""

    def __init__(self, node, directory, start, end):
        self.node = node
        self.directory = directory
        self.start = start
        self.end = end

    def __repr__(self):
        return f"LogPartition({self.node!r}, {self.start}, {self.end})"


def split_ranges(node, directory, start, end, max_records):
    out = []
    s = start
    while s < end:
        e = min(end, s + max_records) if max_records else end
        out.append(LogPartition(node, directory, s, e))
        s = e
    return out


# --- the worker side: log -> Arrow in Spark's schema ------------------------------------------------

_ARROW = {}


def spark_arrow_schema():
    """The Arrow schema Spark expects from read() (computed by pyspark itself, cached)."""
    s = _ARROW.get("schema")
    if s is None:
        from pyspark.sql.pandas.types import to_arrow_schema
        s = _ARROW["schema"] = to_arrow_schema(SCHEMA, timezone="UTC")
    return s


def _decode_block(block):
    from wrenmq.store.store import parse_properties_block

    if not block:
        return None
    try:
        props = parse_properties_block(block)
    except Exception as e:  # a malformed block: never fail the job for it
        log.warning("cannot decode an MQTT 5 property block (%s); properties set to null", e)
        return None
    row = {k: props.get(k) for k in _PLAIN_PROPS}
    ups = props.get("user_property")
    row["user_properties"] = [{"key": k, "value": v} for k, v in ups] if ups else None
    return row


def _data_bytes(col):
    """Bytes of value data in a binary array (its offsets buffer, read at the two ends)."""
    import numpy as np

    offs = np.frombuffer(col.buffers()[1], dtype=np.int32)
    return int(offs[col.offset + len(col)] - offs[col.offset])


def properties_column(col, arrow_type):
    """Raw MQTT 5 property blocks (binary array) -> the `properties` struct array.

    Null where a row has no properties (checked without a loop); otherwise each distinct
    block is decoded once (dictionary encoding) and the struct rows are gathered by index.
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    n = len(col)
    if n == 0 or _data_bytes(col) == 0:
        return pa.nulls(n, arrow_type)
    enc = col.dictionary_encode()
    values = [_decode_block(b) for b in enc.dictionary.to_pylist()]
    return pc.take(pa.array(values, type=arrow_type), enc.indices)


def to_spark_batch(rb, node):
    """A `wrenmq.store.arrow` RecordBatch (+ the partition's node) in Spark's Arrow schema."""
    import pyarrow as pa

    schema = spark_arrow_schema()
    n = rb.num_rows
    cols = rb.columns
    return pa.RecordBatch.from_arrays([
        cols[0],                                          # offset
        pa.repeat(pa.scalar(node, pa.string()), n),       # node
        cols[1],                                          # timestamp
        cols[2],                                          # topic
        cols[3],                                          # qos
        cols[4],                                          # retain
        cols[5],                                          # client_id
        cols[6],                                          # payload
        properties_column(cols[7], schema.field("properties").type),
    ], schema=schema)


def _coalesced(batches):
    """Merge the log's small group-commit batches into RecordBatches of ~COALESCE_ROWS rows
    (at most ~COALESCE_BYTES, far from the 2 GiB limit of 32-bit binary offsets)."""
    import pyarrow as pa

    pending = []
    rows = size = 0
    for rb in batches:
        if not pending and rb.num_rows >= COALESCE_ROWS:
            yield rb
            continue
        pending.append(rb)
        rows += rb.num_rows
        size += rb.get_total_buffer_size()  # O(columns); nbytes walks the slices
        if rows >= COALESCE_ROWS or size >= COALESCE_BYTES:
            yield _concat(pa, pending)
            pending = []
            rows = size = 0
    if pending:
        yield _concat(pa, pending)


def _concat(pa, batches):
    if len(batches) == 1:
        return batches[0]
    return pa.Table.from_batches(batches).combine_chunks().to_batches()[0]


def _batch_start(reader, start, end):
    """The first offset of the log batch holding `start`.

    `read_arrow` trims a batch that begins before `start` by row position, which is wrong
    when the batch holds private records (filtered out before the trim); asking it for the
    whole batch and trimming by offset here stays correct either way.
    """
    for b in reader.batches(start, end):
        base = getattr(b, "base", None)
        if base is None:
            recs = list(getattr(b, "good", b) or ())
            base = recs[0].offset if recs else start
        return min(start, base)
    return start


def _from_offset(batches, start):
    import pyarrow.compute as pc

    for rb in batches:
        if rb.num_rows and rb.column(0)[0].as_py() < start:
            rb = rb.filter(pc.greater_equal(rb.column(0), start))
        if rb.num_rows:
            yield rb


def read_partition(part, topics, fail_on_data_loss=True):
    """Yield Spark-schema RecordBatches of one planned LogPartition (runs in the workers)."""
    from wrenmq.store.arrow import read_arrow
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
        aligned = _batch_start(reader, start, part.end)
        batches = read_arrow(reader, aligned, part.end, topics)
        if aligned < start:
            batches = _from_offset(batches, start)
        for rb in _coalesced(batches):
            yield to_spark_batch(rb, part.node)
        if reader.corrupt_records:
            log.error("wrenmq source: %d damaged record(s) in partition %r offsets %d-%d were skipped",
                      reader.corrupt_records, part.node, start, part.end - 1)
    finally:
        reader.close()


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


class WrenBatchReader(DataSourceReader):
    def __init__(self, opts):
        self.opts = opts

    def partitions(self):
        opts = self.opts
        readers = Readers(opts.root)
        try:
            parts = []
            for node, r in readers.refresh().items():
                if opts.starting_ts is not None:
                    start = r.offset_for_time(opts.starting_ts)
                else:
                    start = resolve(opts.starting, node, r, "earliest")
                if opts.ending_ts is not None:
                    end = r.offset_for_time(opts.ending_ts)
                else:
                    end = resolve(opts.ending, node, r, "latest")
                end = min(end, r.durable_end_offset)
                start = check_loss(node, start, r, opts.fail_on_data_loss and isinstance(opts.starting, dict))
                parts.extend(split_ranges(node, readers.dirs[node], start, end, opts.max_per_partition))
        finally:
            readers.close()
        # Spark needs at least one partition; an empty range reads nothing.
        return parts or [LogPartition("", "", 0, 0)]

    def read(self, partition):
        if partition.end <= partition.start:
            return iter(())
        return read_partition(partition, self.opts.topics, self.opts.fail_on_data_loss)


class WrenStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, opts):
        self.opts = opts
        self._readers = Readers(opts.root)
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
            elif e > s and opts.fail_on_data_loss:
                raise RuntimeError(f"wrenmq source: log partition {node!r} disappeared")
            d = self._readers.dirs.get(node) or os.path.join(_first(opts.root), node)
            parts.extend(split_ranges(node, d, s, e, opts.max_per_partition))
        return parts

    def read(self, partition):
        return read_partition(partition, self.opts.topics, self.opts.fail_on_data_loss)

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
