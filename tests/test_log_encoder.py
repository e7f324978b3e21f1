"""The compiled batch encoder (store/_encode.py) writes exactly the bytes of the reference.

`format.encode_batch_parts` defines the batch format from columns of records;
`_encode.encode_epochs` and `write_epochs` are the writer thread's encoder over the
record buffers of store epochs (`_epoch.Epoch`), compiled by the package's install.
The epochs here are filled by the compiled `_epoch` and by its Python source, and a
batch may span several of them, as the writer's do.
"""

import contextlib
import errno
import importlib.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wrenmq.store._encode as compiled
import wrenmq.store._epoch as epoch
from wrenmq._compiled import compiled as is_compiled
from wrenmq.store import store
from wrenmq.store.format import Batch, encode_batch_parts, read_prefix


def _source(name):
    spec = importlib.util.spec_from_file_location(f"wrenmq.store.{name}_source",
                                                  os.path.join(os.path.dirname(epoch.__file__), name + ".py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


EPOCH_SOURCE = _source("_epoch")
ENCODE_SOURCE = _source("_encode")

_rec = st.tuples(
    st.integers(0, 2**62),  # timestamp, microseconds
    st.integers(0, 15),  # flags: QoS, retain, private
    st.sampled_from([b"a", b"sensors/1/temp", b"\xc3\xa9t\xc3\xa9/x", b"t" * 300]),  # topic
    st.sampled_from([b"", b"dev-1", b"dev-2"]),  # client id
    st.one_of(st.just(b""), st.binary(min_size=1, max_size=30)),  # properties
    st.one_of(st.binary(max_size=300), st.binary(min_size=2000, max_size=6000)),  # payload
    st.integers(0, 65535),  # packet id
)


def _reference(base, recs):
    ts, flags, topics, clients, props, payloads, pids = zip(*recs)
    return b"".join(encode_batch_parts(base, ts, flags, topics, clients, props, payloads, pids)), ts[0], max(ts)


def _epochs(mod, base, recs, cuts=()):
    """`recs` (record tuples) in epochs of `mod`'s Epoch, cut before the given indexes."""
    out = []
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(recs))), len(recs)]
    for lo, hi in zip(bounds, bounds[1:]):
        e = mod.Epoch(len(out) + 1, base + lo)
        for rec in recs[lo:hi]:
            e.add(*rec)
        out.append(e)
    return out


def _encoded(epochs):
    parts, first, last = compiled.encode_epochs(epochs)
    return b"".join(parts), first, last


def test_the_install_compiled_it():
    # make test installs a C compiler first; without one the install falls back to
    # the reference encoder, and this says so.
    assert compiled.COMPILED, "store/_encode.py was not compiled by the install (no C compiler?)"
    assert is_compiled(epoch)
    assert store._compiled_encode is compiled.encode_epochs
    assert not ENCODE_SOURCE.COMPILED and not ENCODE_SOURCE.HW_CRC
    with pytest.raises(RuntimeError):
        ENCODE_SOURCE.encode_epochs(_epochs(EPOCH_SOURCE, 0, [(1, 0, b"t", b"", b"", b"x", 0)]))
    # Checksums come from the CRC-32C instruction where the CPU has it (this machine
    # does), else from the portable loop (test below); the tests check them against the
    # crc32c library's.
    with open("/proc/cpuinfo") as fh:
        assert compiled.HW_CRC == (" sse4_2" in fh.read())
    assert compiled.WRITES


@contextlib.contextmanager
def _portable_crc():
    """The compiled encoder with its portable CRC-32C loop (what a CPU without the
    instruction runs, an ARM gateway say)."""
    assert compiled.use_crc_instruction(False) is False
    try:
        yield
    finally:
        assert compiled.use_crc_instruction(True) == compiled.HW_CRC


@settings(max_examples=150, deadline=None)
@given(base=st.integers(0, 2**40), recs=st.lists(_rec, min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 39), max_size=3))
def test_the_portable_checksum_gives_the_same_bytes(base, recs, cuts):
    with _portable_crc():
        got = _encoded(_epochs(epoch, base, recs, cuts))
    assert got == _reference(base, recs)


def test_the_portable_checksum_writes_the_same_bytes(tmp_path):
    recs = [(1_700_000_000_000_000 + i, i % 3, b"fleet/%d" % (i % 5), b"dev-1", b"",
             bytes([i % 251]) * (2100 + i % 13), i) for i in range(300)]
    want, first, last = _reference(5, recs)
    fd = os.open(tmp_path / "batch", os.O_WRONLY | os.O_CREAT)
    try:
        with _portable_crc():
            got = compiled.write_epochs(_epochs(epoch, 5, recs, [150]), lambda n: fd)
    finally:
        os.close(fd)
    assert got == (len(want), first, last)
    assert (tmp_path / "batch").read_bytes() == want


@settings(max_examples=300, deadline=None)
@given(base=st.integers(0, 2**40), recs=st.lists(_rec, min_size=1, max_size=40),
       cuts=st.lists(st.integers(1, 39), max_size=3))
def test_same_bytes_as_the_reference(base, recs, cuts):
    want = _reference(base, recs)
    assert _encoded(_epochs(epoch, base, recs, cuts)) == want
    assert _encoded(_epochs(EPOCH_SOURCE, base, recs, cuts)) == want
    # The store's path without the compiled encoder: the epochs' columns, then the reference.
    cols = [[], [], [], [], [], [], []]
    for e in _epochs(EPOCH_SOURCE, base, recs, cuts):
        for col, part in zip(cols, e.columns()):
            col.extend(part)
    assert list(zip(*cols)) == [tuple(r) for r in recs]
    # And each record read back from an epoch still in memory (Store.read).
    eps = _epochs(epoch, base, recs, cuts)
    got = [e.record(i) for e in eps for i in range(e.count)]
    assert [(r.offset, r.timestamp, r.payload, r.properties, r.packet_id) for r in got] == \
        [(base + i, r[0], r[5], r[4], r[6]) for i, r in enumerate(recs)]


def test_round_trip_through_the_reader():
    recs = [(1_700_000_000_000_000 + i, (i % 3) | (i % 2) << 2, b"fleet/%d" % (i % 5), b"dev-%d" % (i % 3),
             b"\x01\x01" if i % 4 == 0 else b"", bytes([i % 256]) * (i % 700), i) for i in range(500)]
    data, first, last = _encoded(_epochs(epoch, 1000, recs, [100, 101, 333]))
    assert read_prefix(data) == len(data)
    batch = Batch(data)
    got = list(batch.records(check_records=True))
    assert [r.offset for r in got] == list(range(1000, 1500))
    assert [r.payload for r in got] == [r[5] for r in recs]
    assert [r.topic for r in got] == [r[2].decode() for r in recs]
    assert (first, last) == (recs[0][0], recs[-1][0])


def test_too_large_a_batch_is_refused():
    big = b"x" * (1 << 20)
    recs = [(1, 0, b"t", b"c", b"", big, 0)] * 1100  # 1.1 GiB of payload > MAX_BATCH_BYTES
    eps = _epochs(epoch, 0, recs, range(100, 1100, 100))
    with pytest.raises(ValueError):
        compiled.encode_epochs(eps)


def test_parts_beyond_iov_max_are_written_in_order(tmp_path, monkeypatch):
    """A batch of more parts than one writev takes (the log's own writes) goes out in runs,
    in order."""
    from wrenmq.store import files

    monkeypatch.setattr(files, "IOV_MAX", 16)
    parts = [bytes([i % 256]) * (100 + i) for i in range(100)]
    path = tmp_path / "batch"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        files.write_parts(fd, parts)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"".join(parts)


@pytest.mark.parametrize("size", [300, 2100])
def test_write_epochs_writes_the_reference_bytes(tmp_path, size):
    """write_epochs (the writer's path: checksums, copies and writev in one stretch
    without the GIL) puts the reference's bytes in the file, small payloads copied into
    the batch or large ones written from the epochs' buffers as they are, beyond IOV_MAX
    parts too; `prepare` gets the batch's size before anything is written."""
    assert compiled.WRITES == compiled.HW_CRC and compiled.WRITES
    recs = [(1_700_000_000_000_000 + i, i % 3, b"fleet/%d" % (i % 5), b"dev-1", b"\x01\x01" if i % 7 == 0 else b"",
             bytes([i % 256]) * (size + i % 9), i) for i in range(1500)]
    want, first, last = _reference(11, recs)
    path = tmp_path / "batch"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    sizes = []
    try:
        os.write(fd, b"before")

        def prepare(n):
            sizes.append((n, path.stat().st_size))
            return fd

        eps = _epochs(epoch, 11, recs, [1, 700, 701, 1400])
        assert compiled.write_epochs(eps, prepare) == (len(want), first, last)
    finally:
        os.close(fd)
    assert sizes == [(len(want), 6)]
    assert path.read_bytes() == b"before" + want


def test_write_epochs_raises_what_the_write_met(tmp_path):
    eps = _epochs(epoch, 0, [(1, 0, b"t", b"c", b"", b"x" * 100, 0)])
    fd = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError) as e:
            compiled.write_epochs(eps, lambda n: fd)
    finally:
        os.close(fd)
    assert e.value.errno == errno.EBADF


def test_a_topic_or_client_id_past_16_bits_is_refused():
    """MQTT caps both at 65535 bytes, and the epoch's fixed fields hold 16 bits: a longer
    one is refused instead of being recorded with a wrong length."""
    for mod in (epoch, EPOCH_SOURCE):
        e = mod.Epoch(1, 0)
        e.add(1, 0, b"t" * 65535, b"c" * 65535, b"", b"x", 0)
        with pytest.raises(ValueError):
            e.add(1, 0, b"t" * 65536, b"c", b"", b"x", 0)
        with pytest.raises(ValueError):
            e.add(1, 0, b"t", b"c" * 65536, b"", b"x", 0)
        assert e.count == 1 and e.record(0).topic == "t" * 65535
