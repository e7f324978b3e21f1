"""The writer thread's batch encoder, as one loop over the records, written to be compiled.

`format.encode_batch_parts` builds a batch with C-level `map`s over columns; that is
the fastest plain CPython gets, and still about 7,000 machine instructions per
record, paid by the writer thread while it holds the GIL the event loop needs. This
module is the same encoder as explicit loops with C types in Cython's pure-Python
syntax. The package's normal install compiles it (setup.py; optional, so an install
without a C compiler still works), which brings a record to a few hundred
instructions, and where the CPU has the CRC-32C instruction (`_encode.pxd`) most of
those run with the GIL released (`_encode_without_gil`). Uncompiled it is a slow but
exact copy (`_encode_with_gil`): the tests run this source both ways and require the
bytes of `format.encode_batch_parts`, which stays the reference for the format.
`store.encode_records` uses this module only when COMPILED.
"""

import os
from array import array

import cython
from crc32c import crc32c as _crc

from .format import _PREFIX, _TAIL, MAGIC, MAX_BATCH_BYTES, _prefix_crcs

COMPILED = cython.compiled
# Compiled on a CPU with SSE 4.2, record checksums come from _encode.pxd's wrenmq_crc32c
# (the same CRC-32C without a Python call per record); otherwise from `crc32c`.
HW_CRC = bool(COMPILED and wrenmq_crc32c_available())  # noqa: F821 (declared in _encode.pxd)
WRITES = HW_CRC  # write_records is there (it writes from the same GIL-free stretch)
_OWN_PARTS = 2048  # average payload size from which payloads go to writev as they are
# (measured: 1 KiB gains nothing, 2 KiB and 4 KiB save 10-45% of the writer's CPU per record)


def _topic_client_crc(cache, topic, client):
    """The CRC-32C of a record's topic then client id (where its checksum starts), cached
    per (topic, client) pair."""
    key = (topic, client)
    crc = cache.get(key)
    if crc is None:
        crc = _crc(client, _crc(topic)) if len(client) else _crc(topic)
        cache[key] = crc
    return crc


def encode_records(base, recs: list):
    """Record tuples (timestamp, flags, topic, client, props, payload, packet id) for
    offsets base.. as one batch: (parts, first timestamp, max timestamp).

    `parts` is a list of bytes whose concatenation is the batch: the whole batch, or
    with large payloads everything before the payloads, each payload as it is, and the
    padding.
    """
    if HW_CRC:
        return _encode_without_gil(base, recs, None)
    return _encode_with_gil(base, recs)


def write_records(base, recs: list, prepare):
    """Encode the records as one batch and write it, in one stretch without the GIL.

    Only where WRITES (the compiled encoder, CRC-32C instruction): the checksums, the
    copies and the writev of the batch then need the GIL back once, not once for each
    (every time the writer thread takes the GIL back, the event loop waits for it).
    `prepare(size)` is called with the GIL once the batch's size is known, before
    anything is written, and returns the file descriptor to write to. Returns (size,
    first timestamp, max timestamp); raises OSError if the write fails (part of the
    batch may be in the file then).
    """
    if not WRITES:
        raise RuntimeError("write_records needs the compiled encoder with the CRC-32C instruction")
    return _encode_without_gil(base, recs, prepare)


@cython.boundscheck(False)
@cython.wraparound(False)
def _encode_without_gil(base, recs: list, prepare):
    """The compiled encoder where the CPU has the CRC-32C instruction.

    One pass with the GIL reads the record tuples into C columns (values, and the
    address and length of each bytes field: the tuples keep them alive, and bytes do not
    move); the checksums and every copy into the batch then run with the GIL released,
    so the event loop is not held up by the writer thread while it encodes a batch.
    With `prepare` (write_records) the writev of the batch runs in that stretch too.
    Only compiled (the uncompiled module runs `_encode_with_gil`).
    """
    n: cython.Py_ssize_t = len(recs)
    i: cython.Py_ssize_t
    j: cython.Py_ssize_t
    k: cython.Py_ssize_t
    ts: cython.longlong
    max_ts: cython.longlong
    rec: tuple
    topic: bytes
    client: bytes
    props: bytes
    payload: bytes
    crc: cython.uint
    e0: cython.Py_ssize_t = 0
    e1: cython.Py_ssize_t = 0
    e2: cython.Py_ssize_t = 0
    e3: cython.Py_ssize_t = 0

    ts_col = array("q", bytes(8 * n))
    crc_col = array("I", bytes(4 * n))
    off_col = array("I", bytes(16 * (n + 1)))  # the four offset columns, one after another
    pid_col = array("H", bytes(2 * n))
    flag_col = array("B", bytes(n))
    where = array("Q", bytes(32 * n))  # address of field k of record i at 4 * i + k
    size_of = array("I", bytes(16 * n))
    ts_v: cython.longlong[:] = ts_col
    crc_v: cython.uint[:] = crc_col
    off_v: cython.uint[:] = off_col
    pid_v: cython.ushort[:] = pid_col
    flag_v: cython.uchar[:] = flag_col
    where_v: cython.ulonglong[:] = where
    size_v: cython.uint[:] = size_of
    field: cython.p_char

    cache = _prefix_crcs
    if len(cache) > 65536:
        cache.clear()
    first_ts = max_ts = recs[0][0]
    last_topic = last_client = prefix = None
    for i in range(n):
        rec = recs[i]
        ts = rec[0]
        topic = rec[2]
        client = rec[3]
        props = rec[4]
        payload = rec[5]
        ts_v[i] = ts
        if ts > max_ts:
            max_ts = ts
        flag_v[i] = rec[1]
        pid_v[i] = rec[6]
        if topic is not last_topic or client is not last_client:
            prefix = _topic_client_crc(cache, topic, client)
            last_topic = topic
            last_client = client
        crc_v[i] = prefix
        j = 4 * i
        field = topic
        where_v[j] = cython.cast(cython.ulonglong, field)
        size_v[j] = len(topic)
        field = client
        where_v[j + 1] = cython.cast(cython.ulonglong, field)
        size_v[j + 1] = len(client)
        field = props
        where_v[j + 2] = cython.cast(cython.ulonglong, field)
        size_v[j + 2] = len(props)
        field = payload
        where_v[j + 3] = cython.cast(cython.ulonglong, field)
        size_v[j + 3] = len(payload)
        e0 += len(topic)
        e1 += len(client)
        e2 += len(props)
        e3 += len(payload)
        if e0 + e1 + e2 + e3 > MAX_BATCH_BYTES:
            raise ValueError("batch too large")
        off_v[i + 1] = e0
        off_v[(n + 1) + i + 1] = e1
        off_v[2 * (n + 1) + i + 1] = e2
        off_v[3 * (n + 1) + i + 1] = e3

    size: cython.Py_ssize_t = 48 + 8 * n + 4 * n + 16 * (n + 1) + 2 * n + n + e0 + e1 + e2 + e3
    pad: cython.Py_ssize_t = -size % 8
    length: cython.Py_ssize_t = size + pad - 8
    if length + 8 > MAX_BATCH_BYTES:
        raise ValueError("batch too large")
    own: cython.bint = e3 >= _OWN_PARTS * n  # large payloads stay where they are (writev)
    out_len: cython.Py_ssize_t = size - e3 if own else size + pad
    out = PyBytes_FromStringAndSize(cython.NULL, out_len)  # noqa: F821 (_encode.pxd)
    buf: cython.p_char = PyBytes_AS_STRING(out)  # noqa: F821
    header: bytes = _TAIL.pack(base, n, first_ts, max_ts, 0, 0)
    memcpy(buf + 12, cython.cast(cython.p_char, header), 36)  # noqa: F821
    fd: cython.int = -1
    if prepare is not None:
        fd = prepare(length + 8)
    # The writev's (address, length) pairs: the head, each payload (own) and the padding.
    iov_col = array("Q", bytes(16 * (n + 2)) if fd >= 0 else b"")
    iov_v: cython.ulonglong[:] = iov_col
    niov: cython.int = 0
    err: cython.int = 0
    pos: cython.Py_ssize_t = 48
    batch_crc: cython.uint = 0
    region: cython.uint = 0  # own: the CRC-32C of all payloads, one after another
    with cython.nogil:
        for i in range(n):
            j = 4 * i
            crc = crc_v[i]
            if size_v[j + 2]:
                crc = wrenmq_crc32c(crc, cython.cast(cython.p_char, where_v[j + 2]), size_v[j + 2])  # noqa: F821
            if own:
                # The payload is read once for its record's checksum and the batch's.
                crc_v[i] = wrenmq_crc32c_two(crc, cython.address(region),  # noqa: F821
                                             cython.cast(cython.p_char, where_v[j + 3]), size_v[j + 3])
            else:
                crc_v[i] = wrenmq_crc32c(crc, cython.cast(cython.p_char, where_v[j + 3]), size_v[j + 3])  # noqa: F821
        memcpy(buf + pos, cython.address(ts_v[0]), 8 * n)  # noqa: F821
        pos += 8 * n
        memcpy(buf + pos, cython.address(crc_v[0]), 4 * n)  # noqa: F821
        pos += 4 * n
        memcpy(buf + pos, cython.address(off_v[0]), 16 * (n + 1))  # noqa: F821
        pos += 16 * (n + 1)
        memcpy(buf + pos, cython.address(pid_v[0]), 2 * n)  # noqa: F821
        pos += 2 * n
        memcpy(buf + pos, cython.address(flag_v[0]), n)  # noqa: F821
        pos += n
        for k in range(3 if own else 4):
            for i in range(n):
                j = 4 * i + k
                memcpy(buf + pos, cython.cast(cython.p_char, where_v[j]), size_v[j])  # noqa: F821
                pos += size_v[j]
        if not own:
            memset(buf + pos, 0, pad)  # noqa: F821
        # The batch checksum here, in the same GIL-free stretch, wherever the batch is small
        # enough or written right here: each stretch ends with the writer thread taking
        # the GIL back from the event loop, a hand-over the loop pays for by waiting.
        if own or fd >= 0:
            batch_crc = wrenmq_crc32c(0, buf + 12, out_len - 12)  # noqa: F821
        if own:
            batch_crc = wrenmq_crc32c_combine(batch_crc, region, e3)  # noqa: F821
            if pad:
                batch_crc = wrenmq_crc32c(batch_crc, wrenmq_zeros(), pad)  # noqa: F821
        if fd >= 0:
            wrenmq_put_prefix(buf, length, batch_crc)  # noqa: F821
            iov_v[0] = cython.cast(cython.ulonglong, buf)
            iov_v[1] = out_len
            niov = 1
            if own:
                for i in range(n):
                    iov_v[2 * niov] = where_v[4 * i + 3]
                    iov_v[2 * niov + 1] = size_v[4 * i + 3]
                    niov += 1
                if pad:
                    iov_v[2 * niov] = cython.cast(cython.ulonglong, wrenmq_zeros())  # noqa: F821
                    iov_v[2 * niov + 1] = pad
                    niov += 1
            err = wrenmq_writev_all(fd, cython.address(iov_v[0]), niov)  # noqa: F821
    if fd >= 0:
        if err:
            raise OSError(err, os.strerror(err))
        return length + 8, first_ts, max_ts
    if not own:
        # The batch checksum over megabytes: crc32c's own loop is about three times
        # faster than wrenmq_crc32c's on long buffers, and releases the GIL for them itself.
        batch_crc = _crc(memoryview(out)[12:])
    parts = [out]
    if own:
        parts.extend([rec[5] for rec in recs])
        if pad:
            parts.append(b"\0" * pad)
    wrenmq_put_prefix(buf, length, batch_crc)  # noqa: F821
    return parts, first_ts, max_ts


@cython.boundscheck(False)
@cython.wraparound(False)
def _encode_with_gil(base, recs: list):
    """The encoder as one loop over the records with the GIL held and `crc32c` for every
    checksum: the uncompiled module, and the compiled one on a CPU without the CRC-32C
    instruction."""
    n: cython.Py_ssize_t = len(recs)
    i: cython.Py_ssize_t
    topic_end: cython.Py_ssize_t = 0
    client_end: cython.Py_ssize_t = 0
    props_end: cython.Py_ssize_t = 0
    payload_end: cython.Py_ssize_t = 0
    ts: cython.longlong
    max_ts: cython.longlong
    rec: tuple
    topic: bytes
    client: bytes
    props: bytes
    payload: bytes
    crc: cython.uint

    ts_col = array("q", bytes(8 * n))
    crc_col = array("I", bytes(4 * n))
    topic_off = array("I", bytes(4 * (n + 1)))
    client_off = array("I", bytes(4 * (n + 1)))
    props_off = array("I", bytes(4 * (n + 1)))
    payload_off = array("I", bytes(4 * (n + 1)))
    pid_col = array("H", bytes(2 * n))
    flag_col = array("B", bytes(n))
    ts_v: cython.longlong[:] = ts_col
    crc_v: cython.uint[:] = crc_col
    topic_v: cython.uint[:] = topic_off
    client_v: cython.uint[:] = client_off
    props_v: cython.uint[:] = props_off
    payload_v: cython.uint[:] = payload_off
    pid_v: cython.ushort[:] = pid_col
    flag_v: cython.uchar[:] = flag_col

    topics = [None] * n
    clients = [None] * n
    propss = [None] * n
    payloads = [None] * n
    cache = _prefix_crcs
    if len(cache) > 65536:
        cache.clear()
    first_ts = max_ts = recs[0][0]
    last_topic = last_client = prefix = None
    for i in range(n):
        rec = recs[i]
        ts = rec[0]
        topic = rec[2]
        client = rec[3]
        props = rec[4]
        payload = rec[5]
        ts_v[i] = ts
        if ts > max_ts:
            max_ts = ts
        flag_v[i] = rec[1]
        pid_v[i] = rec[6]
        if topic is not last_topic or client is not last_client:
            # Records come in runs from one publisher on one topic (one read's worth):
            # the same two objects as the record before need no key and no lookup.
            prefix = _topic_client_crc(cache, topic, client)
            last_topic = topic
            last_client = client
        crc = prefix
        if len(props):
            crc = _crc(props, crc)
        crc_v[i] = _crc(payload, crc)
        topic_end += len(topic)
        client_end += len(client)
        props_end += len(props)
        payload_end += len(payload)
        if topic_end + client_end + props_end + payload_end > MAX_BATCH_BYTES:
            raise ValueError("batch too large")
        topic_v[i + 1] = topic_end
        client_v[i + 1] = client_end
        props_v[i + 1] = props_end
        payload_v[i + 1] = payload_end
        topics[i] = topic
        clients[i] = client
        propss[i] = props
        payloads[i] = payload

    size: cython.Py_ssize_t = (48 + 8 * n + 4 * n + 16 * (n + 1) + 2 * n + n
                               + topic_end + client_end + props_end + payload_end)
    pad: cython.Py_ssize_t = -size % 8
    length: cython.Py_ssize_t = size + pad - 8
    if length + 8 > MAX_BATCH_BYTES:
        raise ValueError("batch too large")
    head = [_TAIL.pack(base, n, first_ts, max_ts, 0, 0), ts_col, crc_col, topic_off,
            client_off, props_off, payload_off, pid_col, flag_col, *topics, *clients, *propss]
    if payload_end < _OWN_PARTS * n:
        tail = b"".join([*head, *payloads, b"\0" * pad])
        prefix = _PREFIX.pack(MAGIC, length) + _crc(tail).to_bytes(4, "little")
        return [prefix, tail], first_ts, max_ts
    # Large payloads stay where they are: the batch is written as head + payloads with
    # writev (the kernel copies them without the GIL) instead of being joined into
    # a fresh buffer first, which for a batch of megabytes meant page faults by the
    # thousand with the GIL held. The batch checksum is extended payload by payload.
    joined = b"".join(head)
    crc = _crc(joined)
    for i in range(n):
        crc = _crc(payloads[i], crc)
    parts = [None, joined, *payloads]
    if pad:
        zeros = b"\0" * pad
        crc = _crc(zeros, crc)
        parts.append(zeros)
    parts[0] = _PREFIX.pack(MAGIC, length) + crc.to_bytes(4, "little")
    return parts, first_ts, max_ts
