"""The log as Arrow: RecordBatches built over the batch bytes, no Python object per record.

Needs pyarrow and numpy (the `pipeline` extra); the broker imports it only when its admin
listener is asked for records (admin/logread.py). Topic filters are evaluated once per
distinct topic of a batch (dictionary encoding), so filtering stays vectorised too.

`read_source` gives a range of a partition as the pipeline source's rows (SOURCE_SCHEMA,
Spark's Arrow form): the Spark workers call it on a log they can open, the admin listener
to serve the range over HTTP.
"""

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .format import Batch
from .reader import topic_matcher

SCHEMA = pa.schema([
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("topic", pa.string(), nullable=False),
    pa.field("qos", pa.int32(), nullable=False),
    pa.field("retain", pa.bool_(), nullable=False),
    pa.field("client_id", pa.string(), nullable=False),
    pa.field("payload", pa.binary(), nullable=False),
    pa.field("properties", pa.binary(), nullable=False),  # raw MQTT 5 property block
])


def batch_to_arrow(batch):
    """One log batch (format.Batch) as a pyarrow.RecordBatch with SCHEMA, zero copy."""
    n = batch.count
    raw = batch.buf
    buf = pa.py_buffer(raw)
    cols = batch.columns()

    def piece(name):
        s, e = cols[name]
        return buf.slice(s, e - s)

    def binary(kind, name):
        return pa.Array.from_buffers(kind, n, [None, piece(name + "_off"), piece(name)])

    s, _ = cols["flags"]
    flags = np.frombuffer(raw, dtype=np.uint8, count=n, offset=s)
    rb = pa.RecordBatch.from_arrays([
        pa.array(np.arange(batch.base, batch.base + n, dtype=np.int64)),
        pa.Array.from_buffers(pa.timestamp("us", tz="UTC"), n, [None, piece("timestamps")]),
        binary(pa.string(), "topic"),
        pa.array((flags & 3).astype(np.int32)),
        pa.array((flags & 4) != 0),
        binary(pa.string(), "client"),
        binary(pa.binary(), "payload"),
        binary(pa.binary(), "props"),
    ], schema=SCHEMA)
    private = flags & 8
    if private.any():  # kept for a persistent session, not part of the topic stream
        rb = rb.filter(pa.array(private == 0))
    return rb


def records_to_arrow(records):
    """Salvaged records (a list of format.Record) as a RecordBatch; the slow path."""
    records = [r for r in records if not r.private]
    return pa.RecordBatch.from_arrays([
        pa.array([r.offset for r in records], pa.int64()),
        pa.array([r.timestamp for r in records], pa.timestamp("us", tz="UTC")),
        pa.array([r.topic for r in records], pa.string()),
        pa.array([r.qos for r in records], pa.int32()),
        pa.array([r.retain for r in records], pa.bool_()),
        pa.array([r.client_id for r in records], pa.string()),
        pa.array([r.payload for r in records], pa.binary()),
        pa.array([r.properties for r in records], pa.binary()),
    ], schema=SCHEMA)


def filter_topics(rb, match):
    """Keep the rows whose topic `match(topic)` accepts; one call per distinct topic."""
    enc = rb.column(2).dictionary_encode()
    keep = pa.array([bool(match(t)) for t in enc.dictionary.to_pylist()], pa.bool_())
    if keep.true_count == len(keep):
        return rb
    if not keep.true_count:
        return rb.slice(0, 0)
    return rb.filter(pc.take(keep, enc.indices))


def read_arrow(reader, start=0, end=None, topic_filters=None, max_rows=None):
    """Yield RecordBatches of `reader`'s records with start <= offset < end.

    At most `max_rows` rows in total when given. Rows come in offset order.
    """
    match = topic_matcher(topic_filters)
    left = max_rows
    for b in reader.batches(start, end):
        rb = batch_to_arrow(b) if isinstance(b, Batch) else records_to_arrow(b)
        base = rb.column(0)[0].as_py() if rb.num_rows else start
        if base < start:
            # By offset, not position: private records may already be filtered out.
            rb = rb.filter(pc.greater_equal(rb.column(0), start))
        if end is not None and rb.num_rows and rb.column(0)[rb.num_rows - 1].as_py() >= end:
            rb = rb.filter(pc.less(rb.column(0), end))
        if match is not None and rb.num_rows:
            rb = filter_topics(rb, match)
        if left is not None:
            if rb.num_rows >= left:
                if left:
                    yield rb.slice(0, left)
                return
            left -= rb.num_rows
        if rb.num_rows:
            yield rb


# --- the pipeline source's rows ------------------------------------------------------------------

# The rows of the `wrenmq` Spark source (pipeline/source.py), in the exact Arrow form Spark
# expects from a Python data source (TIMESTAMP as µs UTC, INT as int32): what `read()`
# yields and what the admin listener serves as Arrow IPC (admin/logread.py). Defined here,
# not derived from pyspark, so the broker can serve it without Spark installed; a test
# checks it against pyspark's own conversion of the source's schema.
USER_PROPERTY_TYPE = pa.struct([pa.field("key", pa.string()), pa.field("value", pa.string())])
PROPERTIES_TYPE = pa.struct([
    pa.field("payload_format_indicator", pa.int32()),
    pa.field("message_expiry_interval", pa.int64()),
    pa.field("content_type", pa.string()),
    pa.field("response_topic", pa.string()),
    pa.field("correlation_data", pa.binary()),
    pa.field("user_properties", pa.list_(pa.field("element", USER_PROPERTY_TYPE))),
])
SOURCE_SCHEMA = pa.schema([
    pa.field("offset", pa.int64(), nullable=False),
    pa.field("node", pa.string(), nullable=False),
    pa.field("timestamp", pa.timestamp("us", tz="UTC"), nullable=False),
    pa.field("topic", pa.string(), nullable=False),
    pa.field("qos", pa.int32(), nullable=False),
    pa.field("retain", pa.bool_(), nullable=False),
    pa.field("client_id", pa.string(), nullable=False),
    pa.field("payload", pa.binary(), nullable=False),
    pa.field("properties", PROPERTIES_TYPE, nullable=True),  # null when the message had none
])
COALESCE_ROWS = 131072
COALESCE_BYTES = 32 << 20
_PLAIN_PROPS = ("payload_format_indicator", "message_expiry_interval", "content_type",
                "response_topic", "correlation_data")

log = logging.getLogger("wrenmq.store")


def _decode_block(block):
    from .store import parse_properties_block

    if not block:
        return None
    try:
        props = parse_properties_block(block)
    except Exception as e:  # a malformed block: never fail a read for it
        log.warning("cannot decode an MQTT 5 property block (%s); properties set to null", e)
        return None
    row = {k: props.get(k) for k in _PLAIN_PROPS}
    ups = props.get("user_property")
    row["user_properties"] = [{"key": k, "value": v} for k, v in ups] if ups else None
    return row


def _data_bytes(col):
    """Bytes of value data in a binary array (its offsets buffer, read at the two ends)."""
    offs = np.frombuffer(col.buffers()[1], dtype=np.int32)
    return int(offs[col.offset + len(col)] - offs[col.offset])


def properties_column(col, arrow_type=PROPERTIES_TYPE):
    """Raw MQTT 5 property blocks (binary array) -> the `properties` struct array.

    Null where a row has no properties (checked without a loop); otherwise each distinct
    block is decoded once (dictionary encoding) and the struct rows are gathered by index.
    """
    n = len(col)
    if n == 0 or _data_bytes(col) == 0:
        return pa.nulls(n, arrow_type)
    enc = col.dictionary_encode()
    values = [_decode_block(b) for b in enc.dictionary.to_pylist()]
    return pc.take(pa.array(values, type=arrow_type), enc.indices)


def to_source_batch(rb, node):
    """A RecordBatch of SCHEMA (+ the partition's node) as SOURCE_SCHEMA."""
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
        properties_column(cols[7]),
    ], schema=SOURCE_SCHEMA)


def coalesced(batches, rows=COALESCE_ROWS, size_limit=COALESCE_BYTES):
    """Merge the log's small group-commit batches into RecordBatches of `rows` rows at most
    (and about `size_limit` bytes at most, far from the 2 GiB limit of 32-bit binary
    offsets); all but the last have `rows` rows unless the byte limit cut them first."""
    pending = []
    count = size = 0
    for rb in batches:
        pending.append(rb)
        count += rb.num_rows
        size += rb.get_total_buffer_size()  # O(columns); nbytes walks the slices
        if count < rows and size < size_limit:
            continue
        merged = _concat(pending)
        at = 0
        while merged.num_rows - at >= rows:
            yield merged.slice(at, rows)
            at += rows
        rest = merged.num_rows - at
        if rest and size >= size_limit:
            yield merged.slice(at, rest)
            rest = 0
        pending = [merged.slice(at, rest)] if rest else []
        count = rest
        size = merged.get_total_buffer_size() * rest // merged.num_rows if rest else 0
    if pending:
        yield _concat(pending)


def _concat(batches):
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
    for rb in batches:
        if rb.num_rows and rb.column(0)[0].as_py() < start:
            rb = rb.filter(pc.greater_equal(rb.column(0), start))
        if rb.num_rows:
            yield rb


def read_source(reader, node, start, end, topic_filters=None, rows=COALESCE_ROWS):
    """Yield the records start <= offset < end of `reader` (partition `node`) as
    SOURCE_SCHEMA RecordBatches of about `rows` rows, in offset order; topic filters
    applied once per distinct topic, private records left out. The caller keeps `start`
    within the log (retention) and `end` within what it may read (the durable end)."""
    if start >= end:
        return
    aligned = _batch_start(reader, start, end)
    batches = read_arrow(reader, aligned, end, topic_filters)
    if aligned < start:
        batches = _from_offset(batches, start)
    for rb in coalesced(batches, rows):
        yield to_source_batch(rb, node)
