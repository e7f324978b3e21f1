"""The log as Arrow: RecordBatches built over the batch bytes, no Python object per record.

Needs pyarrow and numpy (the `pipeline` extra); the broker itself never imports this.
Topic filters are evaluated once per distinct topic of a batch (dictionary
encoding), so filtering stays vectorised too.
"""

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
