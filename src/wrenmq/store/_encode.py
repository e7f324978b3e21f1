"""The writer thread's batch encoder: epochs' record buffers to one batch, written to be compiled.

The loop copies each record into its epoch's two buffers (`_epoch.Epoch`: fixed fields,
and topic, client id, properties and payload bytes). This module turns the records of
one or more consecutive epochs into one batch of the format (`format.py`): the
checksums, every copy and the writev run with the GIL released, and the writer takes
the GIL back once per batch (each time it does, the event loop may wait for it).

It needs compiling (setup.py; checksums with the CRC-32C instruction where the CPU has
it, a portable loop elsewhere: `_encode.pxd`); `store.encode_epochs` uses the reference
encoder, `format.encode_batch_parts`, where it is not, and the tests require this
module's bytes to be the reference's.
"""

import os
from array import array

import cython

from .format import HEADER_TAIL, MAGIC, MAX_BATCH_BYTES

COMPILED = cython.compiled
# Checksums with the CRC-32C instruction (else the portable loop of _encode.pxd).
HW_CRC = bool(COMPILED and wrenmq_crc_setup(1))  # noqa: F821 (declared in _encode.pxd)
# write_epochs hands writev 64-bit (address, length) pairs: 64-bit platforms.
WRITES = bool(COMPILED and wrenmq_iovec_is_two_words())  # noqa: F821
_OWN_PARTS = 2048  # average payload size from which payloads go to writev from the epochs' buffers
# (measured: 1 KiB gains nothing, 2 KiB and 4 KiB save 10-45% of the writer's CPU per record)


def encode_epochs(epochs: list, attrs=0, epoch=0):
    """The records of `epochs` (consecutive, offsets from epochs[0].base) as one batch:
    ([batch bytes], first timestamp, max timestamp). `attrs` and `epoch`: the header's
    fields of those names (format.py)."""
    if not COMPILED:
        raise RuntimeError("encode_epochs needs the compiled encoder")
    return _encode(epochs, None, attrs, epoch)


def write_epochs(epochs: list, prepare, attrs=0, epoch=0):
    """Encode the records of `epochs` as one batch and write it, in one stretch without the GIL.

    `prepare(size)` is called with the GIL once the batch's size is known, before
    anything is written, and returns the file descriptor to write to. Returns (size,
    first timestamp, max timestamp); raises OSError if the write fails (part of the
    batch may be in the file then). The epochs' buffers must not change meanwhile
    (sealed epochs do not).
    """
    if not WRITES:
        raise RuntimeError("write_epochs needs the compiled encoder on a 64-bit platform")
    return _encode(epochs, prepare, attrs, epoch)


def use_crc_instruction(allow):
    """Take checksums with the CRC-32C instruction if `allow` and the CPU has it, else with
    the portable loop; returns whether the instruction is used. For the tests, which check
    both ways on a machine that has it; call it while no batch is being encoded."""
    if not COMPILED:
        return False
    return bool(wrenmq_crc_setup(1 if allow else 0))  # noqa: F821


@cython.boundscheck(False)
@cython.wraparound(False)
def _encode(epochs: list, prepare, attrs, epoch):
    """One pass with the GIL over the epochs (a few per batch) gathers their buffers and
    sizes; then, without it, each record's fixed fields go to the columns, its checksum
    is taken in one pass over its bytes (the payload read once for its record's
    checksum and the running checksum of all payloads), its topic, client id and
    properties are copied, and its payload copied or (large payloads, with `prepare`)
    written from the epoch's buffer as it is."""
    ne: cython.Py_ssize_t = len(epochs)
    n: cython.Py_ssize_t = 0
    k: cython.Py_ssize_t
    j: cython.Py_ssize_t
    r: cython.Py_ssize_t
    e0: cython.Py_ssize_t = 0
    e1: cython.Py_ssize_t = 0
    e2: cython.Py_ssize_t = 0
    e3: cython.Py_ssize_t = 0
    first_ts: cython.longlong
    max_ts: cython.longlong
    ts: cython.longlong
    start: cython.longlong
    lr: cython.uint
    lp: cython.uint
    lt: cython.ushort
    lc: cython.ushort
    pid: cython.ushort
    flags: cython.uchar
    crc: cython.uint
    fixed: bytearray
    var: bytearray

    where = array("Q", bytes(16 * ne))  # each epoch's fixed and var buffer addresses
    counts = array("q", bytes(8 * ne))
    where_v: cython.ulonglong[:] = where
    count_v: cython.longlong[:] = counts
    first_ts = epochs[0].first_ts
    max_ts = first_ts
    for k in range(ne):
        ep = epochs[k]
        fixed = ep.fixed
        var = ep.var
        where_v[2 * k] = cython.cast(cython.ulonglong, PyByteArray_AS_STRING(fixed))  # noqa: F821 (_encode.pxd)
        where_v[2 * k + 1] = cython.cast(cython.ulonglong, PyByteArray_AS_STRING(var))  # noqa: F821
        count_v[k] = ep.count
        n += ep.count
        e0 += ep.topic_bytes
        e1 += ep.client_bytes
        e2 += ep.props_bytes
        e3 += ep.payload_bytes
        ts = ep.max_ts
        if ts > max_ts:
            max_ts = ts
        if e0 + e1 + e2 + e3 > MAX_BATCH_BYTES:
            raise ValueError("batch too large")

    size: cython.Py_ssize_t = 48 + 8 * n + 4 * n + 16 * (n + 1) + 2 * n + n + e0 + e1 + e2 + e3
    pad: cython.Py_ssize_t = -size % 8
    length: cython.Py_ssize_t = size + pad - 8
    if length + 8 > MAX_BATCH_BYTES:
        raise ValueError("batch too large")
    # Large payloads stay where they are and go to writev as they are (only when writing).
    own: cython.bint = prepare is not None and e3 >= _OWN_PARTS * n
    out_len: cython.Py_ssize_t = size - e3 if own else size + pad
    out = PyBytes_FromStringAndSize(cython.NULL, out_len)  # noqa: F821 (_encode.pxd)
    buf: cython.p_char = PyBytes_AS_STRING(out)  # noqa: F821
    magic: bytes = MAGIC
    memcpy(buf, cython.cast(cython.p_char, magic), 4)  # noqa: F821
    header: bytes = HEADER_TAIL.pack(epochs[0].base, n, first_ts, max_ts, attrs, epoch)
    memcpy(buf + 12, cython.cast(cython.p_char, header), 36)  # noqa: F821
    fd: cython.int = -1
    if prepare is not None:
        fd = prepare(length + 8)
    # The writev's (address, length) pairs: the head, each payload (own) and the padding.
    iov_col = array("Q", bytes(16 * (n + 2)) if own else bytes(32))
    iov_v: cython.ulonglong[:] = iov_col
    niov: cython.int = 0
    err: cython.int = 0
    region: cython.uint = 0  # the CRC-32C of all payloads, one after another
    op_len: cython.ulonglong = 0  # the payload length whose shift factor `op` holds
    op: cython.uint = 0
    batch_crc: cython.uint = 0
    # Where each column starts in the batch.
    ts_at: cython.p_char = buf + 48
    crc_at: cython.p_char = ts_at + 8 * n
    off_at: cython.p_char = crc_at + 4 * n  # four offset columns of n + 1 entries
    pid_at: cython.p_char = off_at + 16 * (n + 1)
    flag_at: cython.p_char = pid_at + 2 * n
    topic_at: cython.p_char = flag_at + n
    client_at: cython.p_char = topic_at + e0
    props_at: cython.p_char = client_at + e1
    payload_at: cython.p_char = props_at + e2
    f: cython.p_char
    v: cython.p_char
    rec: cython.p_char
    t0: cython.uint = 0
    t1: cython.uint = 0
    t2: cython.uint = 0
    t3: cython.uint = 0
    with cython.nogil:
        memset(off_at, 0, 4)  # noqa: F821
        memset(off_at + 4 * (n + 1), 0, 4)  # noqa: F821
        memset(off_at + 8 * (n + 1), 0, 4)  # noqa: F821
        memset(off_at + 12 * (n + 1), 0, 4)  # noqa: F821
        niov = 1
        r = 0
        for k in range(ne):
            f = cython.cast(cython.p_char, where_v[2 * k])
            v = cython.cast(cython.p_char, where_v[2 * k + 1])
            for j in range(count_v[k]):
                wrenmq_get_fixed(f, cython.address(ts), cython.address(start), cython.address(lr),  # noqa: F821
                                 cython.address(lp), cython.address(lt), cython.address(lc),
                                 cython.address(pid), cython.address(flags))
                f += 32
                rec = v + start
                crc = wrenmq_crc32c(0, rec, lt + lc + lr)  # noqa: F821
                crc = wrenmq_crc32c_payload(crc, cython.address(region), rec + lt + lc + lr, lp,  # noqa: F821
                                            cython.address(op_len), cython.address(op))
                memcpy(ts_at + 8 * r, cython.address(ts), 8)  # noqa: F821
                memcpy(crc_at + 4 * r, cython.address(crc), 4)  # noqa: F821
                memcpy(pid_at + 2 * r, cython.address(pid), 2)  # noqa: F821
                flag_at[r] = flags
                memcpy(topic_at + t0, rec, lt)  # noqa: F821
                memcpy(client_at + t1, rec + lt, lc)  # noqa: F821
                memcpy(props_at + t2, rec + lt + lc, lr)  # noqa: F821
                if own:
                    iov_v[2 * niov] = cython.cast(cython.ulonglong, rec + lt + lc + lr)
                    iov_v[2 * niov + 1] = lp
                    niov += 1
                else:
                    memcpy(payload_at + t3, rec + lt + lc + lr, lp)  # noqa: F821
                t0 += lt
                t1 += lc
                t2 += lr
                t3 += lp
                r += 1
                memcpy(off_at + 4 * r, cython.address(t0), 4)  # noqa: F821
                memcpy(off_at + 4 * (n + 1 + r), cython.address(t1), 4)  # noqa: F821
                memcpy(off_at + 4 * (2 * (n + 1) + r), cython.address(t2), 4)  # noqa: F821
                memcpy(off_at + 4 * (3 * (n + 1) + r), cython.address(t3), 4)  # noqa: F821
        # The batch checksum: the head's (everything before the payloads) combined with
        # the payloads' (crc32_combine for CRC-32C), so no payload is read twice.
        batch_crc = wrenmq_crc32c(0, buf + 12, size - e3 - 12)  # noqa: F821
        batch_crc = wrenmq_crc32c_combine(batch_crc, region, e3)  # noqa: F821
        if pad:
            batch_crc = wrenmq_crc32c(batch_crc, wrenmq_zeros(), pad)  # noqa: F821
            if not own:
                memset(buf + size, 0, pad)  # noqa: F821
        wrenmq_put_length_crc(buf, length, batch_crc)  # noqa: F821
        if fd >= 0:
            iov_v[0] = cython.cast(cython.ulonglong, buf)
            iov_v[1] = out_len
            if own and pad:
                iov_v[2 * niov] = cython.cast(cython.ulonglong, wrenmq_zeros())  # noqa: F821
                iov_v[2 * niov + 1] = pad
                niov += 1
            err = wrenmq_writev_all(fd, cython.address(iov_v[0]), niov)  # noqa: F821
    if fd >= 0:
        if err:
            raise OSError(err, os.strerror(err))
        return length + 8, first_ts, max_ts
    return [out], first_ts, max_ts
