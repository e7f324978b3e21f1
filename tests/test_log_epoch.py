"""The log's per-message steps (store/_epoch.py): compiled and from source, the same records.

`Store.append`, `Store.append_record` and `TopicLog.record` live in `_epoch`, which
the install compiles (its types are in `_epoch.pxd`). Here a real Store takes the same
appends once with the compiled module and once with the Python source
(WRENMQ_PURE_PYTHON=1, in a child process), reads them back from memory before the
writer has them and from the log files after it wrote them, and both runs must print
the expected records.
"""

import json
import os
import subprocess
import sys

import wrenmq.store._epoch as epoch
from wrenmq._compiled import compiled
from wrenmq.store.store import Store

SCENARIO = r"""
import asyncio, json, sys, time
from wrenmq.broker.message import Message
from wrenmq.config import load
from wrenmq.store import _epoch, store
from wrenmq.store.reader import LogReader

def rows(records):
    return [[r.offset, r.timestamp, r.qos, r.retain, r.topic, r.client_id, r.properties.hex(),
             r.payload.hex(), r.packet_id, r.private] for r in records]

async def main(data_dir):
    cfg = load(text="[storage]\nfsync = 'never'\n")
    cfg.storage.data_dir = data_dir
    st = store.Store(cfg)
    pending = []
    st.on_pending = lambda: pending.append(st.next_offset - 1)  # the offset being appended
    offsets = []
    for i in range(2 * _epoch.SEAL_RECORDS + 7):  # QoS 0 epochs seal themselves when full
        qos = (0, 0, 0, 1, 2)[i % 5]
        if i % 3 == 2 and i % 7 and i % 11:  # not retained, not private: the router's call
            at = st.next_offset
            # A packet id comes along at QoS 1 and 2; the record keeps the QoS 2 one only.
            assert st.topic_log(b"t/%d" % (i % 4)).record(
                1_000_000 + i, qos, b"dev-%d" % (i % 2), b"p%d" % i, i % 65536 if qos else None) is None
            offsets.append(at)
        elif i % 3:
            offsets.append(st.append_record(1_000_000 + i, qos, i % 7 == 0, b"t/%d" % (i % 4),
                                            "dev-%d" % (i % 2), b"", b"p%d" % i,
                                            i % 65536 if qos == 2 else 0, i % 11 == 0))
        else:
            m = Message("m/%d" % (i % 3), b"x" * (i % 50), qos, i % 2 == 0,
                        {"content_type": "a/b"} if i % 6 == 0 else {}, None, "dev-%d" % (i % 2),
                        None, None, False, 2.5 + i)
            offsets.append(st.append(m, 7 if qos == 2 else 0))
            assert m.offset == offsets[-1]
        if i % 500 == 499:
            st.seal()
    durable = st.seal_due
    memory = rows(st.read(0, 100_000))
    st.start(asyncio.get_running_loop())
    # Wait without giving the loop a turn: the writer has written and released the sealed
    # epochs, but the loop has not heard of it, so they are still in the store's tail and
    # must be read from the files (the last, unsealed epoch still from memory).
    while st.written_bytes < st.sealed_bytes:
        time.sleep(0.005)
    released = sum(1 for ep in st._tail if ep.released)
    n = len(offsets)
    mixed = [rows(st.read(start, limit)) for start, limit in
             [(0, 100_000), (0, 10), (499, 3), (1000, 600), (n - 5, 10), (n, 5)]]
    st.close()
    disk = rows(LogReader(st.log_dir).records(0, 100_000, private=True))
    print(json.dumps({"offsets": offsets, "pending": pending, "durable": durable,
                      "memory": memory, "disk": disk, "released": released, "mixed": mixed, "compiled": _epoch.__file__.endswith(".so")}))

asyncio.run(main(sys.argv[1]))
"""


def _run(tmp_path, name, pure):
    env = dict(os.environ)
    env.pop("WRENMQ_PURE_PYTHON", None)
    if pure:
        env["WRENMQ_PURE_PYTHON"] = "1"
    out = subprocess.run([sys.executable, "-c", SCENARIO, str(tmp_path / name)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def test_the_install_compiled_it_and_store_uses_it():
    assert compiled(epoch), f"store/_epoch.py was not compiled by the install: {epoch.__file__}"
    assert Store.append_record is epoch.EpochAppender.append_record


def test_compiled_and_source_append_the_same_records(tmp_path):
    built = _run(tmp_path, "built", pure=False)
    source = _run(tmp_path, "source", pure=True)
    assert built["compiled"] and not source["compiled"]
    n = 2 * epoch.SEAL_RECORDS + 7
    assert built["offsets"] == list(range(n))
    assert built["durable"] is True  # the last epoch holds QoS 1/2 records
    # The broker is told once per epoch that something is pending: at 0, after every seal.
    assert built["pending"][0] == 0 and len(built["pending"]) >= n // 500
    assert len(built["memory"]) == n and built["memory"] == built["disk"]
    # Read while the writer had released what it wrote: from the files and memory, the same.
    assert built["released"] >= 2
    mem = built["memory"]
    assert built["mixed"] == [mem, mem[:10], mem[499:502], mem[1000:1600], mem[n - 5:], []]
    by_offset = {r[0]: r for r in built["disk"]}
    # Spot checks against what was appended (the flags and the two paths).
    r = by_offset[1]  # append_record: QoS 0, not retained, not private
    assert r[1:] == [1_000_001, 0, False, "t/1", "dev-1", "", b"p1".hex(), 0, False]
    r = by_offset[2]  # TopicLog.record: QoS 0
    assert r[1:] == [1_000_002, 0, False, "t/2", "dev-0", "", b"p2".hex(), 0, False]
    r = by_offset[8]  # TopicLog.record: QoS 1, its packet id not kept
    assert r[1:] == [1_000_008, 1, False, "t/0", "dev-0", "", b"p8".hex(), 0, False]
    r = by_offset[29]  # TopicLog.record: QoS 2 keeps the packet id
    assert r[1:] == [1_000_029, 2, False, "t/1", "dev-1", "", b"p29".hex(), 29, False]
    r = by_offset[44]  # append_record: i % 11 == 0 -> private; QoS 2 keeps the packet id
    assert r[2] == 2 and r[8] == 44 and r[9] is True
    r = by_offset[14]  # append_record: i % 7 == 0 -> retained
    assert r[3] is True and r[9] is False
    r = by_offset[18]  # append (a Message): QoS 1, retained, properties stored
    assert r[1:6] == [20_500_000, 1, True, "m/0", "dev-0"] and r[6] != "" and r[7] == (b"x" * 18).hex()
    r = by_offset[9]  # append: QoS 2 with the publisher's packet id
    assert r[2] == 2 and r[8] == 7 and r[6] == ""
    for key in ("offsets", "durable", "memory", "disk", "mixed"):
        assert built[key] == source[key], key
    assert built["pending"] == source["pending"]


def test_written_epochs_buffers_are_reused_and_the_pool_is_bounded(tmp_path):
    """The writer hands each written epoch's buffers back; the loop's next epochs take them
    (no new memory per epoch in a steady flow), and the pool keeps no more pairs than
    max_unwritten_bytes holds epochs (+4), however long the flood."""
    import asyncio
    import time

    from wrenmq.config import load

    async def main():
        cfg = load(text="[storage]\nfsync = 'never'\nmax_unwritten_bytes = 1048576\n")
        cfg.storage.data_dir = str(tmp_path)
        st = Store(cfg)
        st.start(asyncio.get_running_loop())
        payload = b"p" * 4096
        made = {}  # every var buffer an epoch ever filled (kept alive: ids stay unique)
        n = 0
        for burst in range(40):  # 40 x 512 KiB: about 80 epochs' worth
            for _ in range(128):
                st.append_record(1_000 + n, 0, False, b"fleet/1", "dev-1", b"", payload)
                n += 1
                made[id(st._epoch.var)] = st._epoch.var
            st.seal()
            while st.written_bytes < st.sealed_bytes:  # the writer keeps up between bursts
                time.sleep(0.002)
            await asyncio.sleep(0)
        pooled = len(st._pool)
        st.close()
        return n, made, pooled, st._pool.maxlen

    n, made, pooled, maxlen = asyncio.run(main())
    assert maxlen == 1048576 // epoch.SEAL_BYTES + 4
    assert 1 <= pooled <= maxlen
    # About 80 epochs were filled from a handful of buffers.
    assert len(made) <= maxlen, len(made)
    assert n == 40 * 128


def test_the_writer_gathers_qos0_epochs_and_a_durable_one_cuts_the_gather_short(tmp_path):
    """After a batch of QoS 0 records only, the writer waits up to `Store.gather` (GATHER)
    for more epochs before it takes them (fewer GIL hand-overs in a flood). A durable
    epoch (a QoS 1 record here: the loop may be holding its PUBACK) ends that wait at
    once, and so does close. The gather is set to 30 s here, so a wait nothing cut short
    would show."""
    import asyncio
    import time

    from wrenmq.config import load

    async def main():
        cfg = load(text="[storage]\nfsync = 'never'\n")
        cfg.storage.data_dir = str(tmp_path)
        st = Store(cfg)
        st.gather = 30.0
        st.start(asyncio.get_running_loop())

        def written(n, timeout):
            deadline = time.monotonic() + timeout
            while st.appended < n and time.monotonic() < deadline:
                time.sleep(0.002)
            return st.appended

        st.append_record(1_000, 0, False, b"fleet/1", "dev-1", b"", b"first")
        st.seal()
        first = written(1, 10)  # the writer was idle: at once; now it gathers
        st.append_record(2_000, 0, False, b"fleet/1", "dev-1", b"", b"second")
        st.seal()
        gathering = written(2, 0.5)  # QoS 0 only: it waits for the gather
        st.append_record(3_000, 1, False, b"fleet/1", "dev-1", b"", b"third")
        st.seal()
        woken = written(3, 10)  # durable: the gather ends now
        st.append_record(4_000, 0, False, b"fleet/1", "dev-1", b"", b"fourth")
        st.seal()
        written(4, 0.2)  # (the writer is gathering again)
        t0 = time.monotonic()
        st.close()
        return first, gathering, woken, time.monotonic() - t0, st.appended

    first, gathering, woken, closing, appended = asyncio.run(main())
    assert (first, gathering, woken) == (1, 1, 3)
    assert closing < 10, closing
    assert appended == 4
