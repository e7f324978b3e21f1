"""The compiled batch encoder (store/_encode.py) writes exactly the bytes of the reference.

`format.encode_batch_parts` defines the batch format; `_encode.encode_records` is the
writer thread's loop over the same records, compiled by the package's install. The
same source is also run uncompiled here, so the Python file stays the one truth of
what the extension does.
"""

import errno
import importlib.util
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import wrenmq.store._encode as compiled
from wrenmq.store import store
from wrenmq.store.format import Batch, encode_batch_parts, read_prefix


def _interpreted():
    spec = importlib.util.spec_from_file_location("wrenmq.store._encode_source",
                                                  compiled.__file__.rsplit("/", 1)[0] + "/_encode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


INTERPRETED = _interpreted()

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


def _encoded(mod, base, recs):
    """The batch `mod` encodes, joined (it may come as several parts)."""
    parts, first, last = mod.encode_records(base, recs)
    return b"".join(parts), first, last


def test_the_install_compiled_it():
    # make test installs a C compiler first; without one the install falls back to
    # the interpreted encoder, and this says so.
    assert compiled.COMPILED, "store/_encode.py was not compiled by the install (no C compiler?)"
    assert store._compiled_encode is compiled.encode_records
    assert not INTERPRETED.COMPILED and not INTERPRETED.HW_CRC
    # Record checksums come from the SSE 4.2 instruction wherever the CPU has it (this
    # machine does); the tests below then check them against the crc32c library's.
    with open("/proc/cpuinfo") as fh:
        assert compiled.HW_CRC == (" sse4_2" in fh.read())


@settings(max_examples=300, deadline=None)
@given(base=st.integers(0, 2**40), recs=st.lists(_rec, min_size=1, max_size=40))
def test_same_bytes_as_the_reference(base, recs):
    want = _reference(base, recs)
    assert _encoded(compiled, base, recs) == want
    assert _encoded(INTERPRETED, base, recs) == want


def test_round_trip_through_the_reader():
    recs = [(1_700_000_000_000_000 + i, (i % 3) | (i % 2) << 2, b"fleet/%d" % (i % 5), b"dev-%d" % (i % 3),
             b"\x01\x01" if i % 4 == 0 else b"", bytes([i % 256]) * (i % 700), i) for i in range(500)]
    data, first, last = _encoded(compiled, 1000, recs)
    assert read_prefix(data) == len(data)
    batch = Batch(data)
    got = list(batch.records(check_records=True))
    assert [r.offset for r in got] == list(range(1000, 1500))
    assert [r.payload for r in got] == [r[5] for r in recs]
    assert [r.topic for r in got] == [r[2].decode() for r in recs]
    assert (first, last) == (recs[0][0], recs[-1][0])


def test_large_payloads_are_parts_of_their_own():
    """From 2 KiB a record on average, payloads are not joined into the batch: each is a
    part of the writev as it is (no copy with the GIL held), and the batch reads back the
    same."""
    recs = [(1_700_000_000_000_000 + i, i % 3, b"fleet/%d" % (i % 5), b"dev-1", b"",
             bytes([i % 256]) * (2048 + 3 * i), i) for i in range(300)]
    parts, first, last = compiled.encode_records(7, recs)
    assert len(parts) >= 2 + len(recs)
    assert all(any(p is r[5] for p in parts) for r in recs)
    data = b"".join(parts)
    assert (data, first, last) == _reference(7, recs)
    got = list(Batch(data).records(check_records=True))
    assert [r.payload for r in got] == [r[5] for r in recs]
    assert b"".join(INTERPRETED.encode_records(7, recs)[0]) == data


def test_too_large_a_batch_is_refused():
    big = b"x" * (1 << 20)
    recs = [(1, 0, b"t", b"c", b"", big, 0)] * 1100  # 1.1 GiB of payload > MAX_BATCH_BYTES
    with pytest.raises(ValueError):
        compiled.encode_records(0, recs)


def test_parts_beyond_iov_max_are_written_in_order(tmp_path, monkeypatch):
    """A batch of more parts than one writev takes goes out in runs, in order."""
    from wrenmq.store import log as commit_log

    monkeypatch.setattr(commit_log, "_IOV_MAX", 16)
    recs = [(1_700_000_000_000_000 + i, 0, b"fleet/1", b"dev-1", b"", bytes([i % 256]) * 2100, 0)
            for i in range(100)]
    parts, _, _ = compiled.encode_records(0, recs)
    assert len(parts) > 16
    path = tmp_path / "batch"
    fd = commit_log.os.open(path, commit_log.os.O_WRONLY | commit_log.os.O_CREAT)
    try:
        commit_log._write_parts(fd, parts)
    finally:
        commit_log.os.close(fd)
    assert path.read_bytes() == b"".join(parts)


@pytest.mark.parametrize("size", [300, 2100])
def test_write_records_writes_the_reference_bytes(tmp_path, size):
    """write_records (the writer's path: checksums, copies and writev in one stretch
    without the GIL) puts the reference's bytes in the file, small payloads joined or
    large ones as parts of their own, beyond IOV_MAX parts too; `prepare` gets the
    batch's size before anything is written."""
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

        assert compiled.write_records(11, recs, prepare) == (len(want), first, last)
    finally:
        os.close(fd)
    assert sizes == [(len(want), 6)]
    assert path.read_bytes() == b"before" + want


def test_write_records_raises_what_the_write_met(tmp_path):
    recs = [(1, 0, b"t", b"c", b"", b"x" * 100, 0)]
    fd = os.open(tmp_path / "ro", os.O_RDONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError) as e:
            compiled.write_records(0, recs, lambda n: fd)
    finally:
        os.close(fd)
    assert e.value.errno == errno.EBADF
