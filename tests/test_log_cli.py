"""`wrenmq log stats|tail|verify`, run as users run them, on a log a real broker wrote."""

import datetime as dt
import json
import queue
import shutil
import signal
import subprocess
import threading
import time

import pytest

from conftest import WRENMQ, ServedBroker, paho_client
from wrenmq.store.format import Batch
from wrenmq.store.reader import LogReader

N_TEXT = 20  # "cli/a/<i>" text messages, then the special ones below


def run(*args, timeout=30):
    return subprocess.run([WRENMQ, "log", *args], capture_output=True, text=True, timeout=timeout)


def publish_all(port, msgs):
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    c = paho_client(port, client_id="cli-pub", version=5)
    try:
        for topic, payload, qos, retain, user in msgs:
            props = None
            if user:
                props = Properties(PacketTypes.PUBLISH)
                props.UserProperty = [user]
            info = c.publish(topic, payload, qos=qos, retain=retain, properties=props)
            if qos:
                info.wait_for_publish(5)
        # QoS 0 messages are logged in order with the rest; a last QoS 1 fences them.
        c.publish("cli/fence", b"fence", qos=1).wait_for_publish(5)
    finally:
        c.disconnect()
        c.loop_stop()


MESSAGES = [(f"cli/a/{i}", f"hello {i}".encode(), 1, False, None) for i in range(N_TEXT)] + [
    ("cli/bin", bytes(range(256)) * 2, 2, False, None),
    ("cli/empty", b"", 0, False, None),
    ("cli/retained", b"kept", 1, True, ("k", "v")),
    ("other/x", b"not cli", 0, False, None),
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data directory written by a real broker (started, published to, stopped)."""
    tmp = tmp_path_factory.mktemp("logcli")
    data = tmp / "data"
    b = ServedBroker(tmp, "", ("--data-dir", str(data)))
    try:
        publish_all(b.port, MESSAGES)
    finally:
        assert b.stop() == 0
    return data


@pytest.fixture(scope="module")
def dump(data_dir):
    r = run("tail", "--data-dir", str(data_dir), "--from", "0", "--format", "json")
    assert r.returncode == 0, r.stderr
    return [json.loads(line) for line in r.stdout.splitlines()]


def node_dir(data):
    (d,) = (data / "log").iterdir()
    return d


def test_stats(data_dir, dump):
    n = len(MESSAGES) + 1
    r = run("stats", "--data-dir", str(data_dir))
    assert r.returncode == 0, r.stderr
    node = node_dir(data_dir).name
    assert f"partition {node}" in r.stdout
    assert f"offsets     0-{n - 1} ({n} records)" in r.stdout
    assert "segments    1" in r.stdout
    assert f"{dump[0]['timestamp']} .. {dump[-1]['timestamp']}" in r.stdout

    r = run("stats", "--data-dir", str(data_dir), "--json")
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    (p,) = st["partitions"]
    assert p["partition"] == node
    assert (p["segments"], p["start_offset"], p["end_offset"], p["records"]) == (1, 0, n, n)
    assert p["bytes"] == sum(f.stat().st_size for f in node_dir(data_dir).glob("*.log"))
    assert p["first_timestamp"] == dump[0]["timestamp"] and p["last_timestamp"] == dump[-1]["timestamp"]
    for key in ("first_timestamp", "last_timestamp"):
        assert p[key].endswith("Z")
        parsed = dt.datetime.fromisoformat(p[key].replace("Z", "+00:00"))
        assert int(parsed.timestamp() * 1e6) == p[key + "_us"]


def test_tail_json_has_every_field(dump):
    assert [d["offset"] for d in dump] == list(range(len(MESSAGES) + 1))
    assert [(d["topic"], d["qos"], d["retain"]) for d in dump[:-1]] == \
        [(t, q, r) for t, _, q, r, _ in MESSAGES]
    assert all(d["client_id"] == "cli-pub" for d in dump)
    for d, (topic, payload, *_rest) in zip(dump, MESSAGES):
        if d["payload_encoding"] == "utf-8":
            assert d["payload"].encode() == payload
        else:
            import base64
            assert base64.b64decode(d["payload"]) == payload
        assert d["payload_bytes"] == len(payload)
    by_topic = {d["topic"]: d for d in dump}
    assert by_topic["cli/bin"]["payload_encoding"] == "base64"
    assert by_topic["cli/bin"].get("packet_id", 0) > 0  # QoS 2 keeps the publisher's packet id
    assert by_topic["cli/retained"]["properties"] == {"user_property": [["k", "v"]]}
    stamps = [d["timestamp_us"] for d in dump]
    assert stamps == sorted(stamps)


def test_tail_text(data_dir, dump):
    r = run("tail", "--data-dir", str(data_dir))  # the last 10 records
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [int(line.split()[0]) for line in lines] == [d["offset"] for d in dump[-10:]]
    by_topic = {line.split()[2]: line for line in lines}
    assert by_topic["cli/bin"].split()[3:] == ["qos=2", "client=cli-pub",
                                               "hex:" + bytes(range(32)).hex() + "...", "(512", "bytes)"]
    assert by_topic["cli/empty"].endswith("qos=0  client=cli-pub  (empty)")
    assert by_topic["cli/retained"].endswith("qos=1 retain  client=cli-pub  kept")
    assert by_topic["other/x"].endswith("not cli")
    assert all(line.split()[1] == d["timestamp"] for line, d in zip(lines, dump[-10:]))

    r = run("tail", "--data-dir", str(data_dir), "--from", "3", "--limit", "2")
    assert r.stdout.splitlines() == [f"{i}  {dump[i]['timestamp']}  cli/a/{i}  qos=1  client=cli-pub  hello {i}"
                                     for i in (3, 4)]
    r = run("tail", "--data-dir", str(data_dir), "--from", "-2")
    assert [int(line.split()[0]) for line in r.stdout.splitlines()] == [dump[-2]["offset"], dump[-1]["offset"]]


def test_tail_topic_filters(data_dir, dump):
    def offsets(*args):
        r = run("tail", "--data-dir", str(data_dir), "--format", "json", *args)
        assert r.returncode == 0, r.stderr
        return [json.loads(line)["offset"] for line in r.stdout.splitlines()]

    assert offsets("--from", "0", "--topic", "cli/a/+") == list(range(N_TEXT))
    assert offsets("--from", "0", "--topic", "other/#", "--topic", "cli/empty") == \
        [d["offset"] for d in dump if d["topic"] in ("other/x", "cli/empty")]
    # The last N records that match, not the matches among the last N records.
    assert offsets("--topic", "cli/a/#", "--limit", "3") == [N_TEXT - 3, N_TEXT - 2, N_TEXT - 1]
    assert offsets("--topic", "nothing/#") == []


def test_tail_since(data_dir, dump):
    def offsets(since):
        r = run("tail", "--data-dir", str(data_dir), "--format", "json", "--since", since)
        assert r.returncode == 0, r.stderr
        return [json.loads(line)["offset"] for line in r.stdout.splitlines()]

    for j, k in enumerate((0, 5, len(dump) - 1)):
        ts = dump[k]["timestamp_us"]
        want = [d["offset"] for d in dump if d["offset"] >= min(x["offset"] for x in dump if x["timestamp_us"] >= ts)]
        t = dt.datetime.fromtimestamp(ts / 1e6, dt.timezone.utc)
        # ISO with Z, with another zone's offset, and without a zone (UTC): the same instant.
        iso = [dump[k]["timestamp"], t.astimezone(dt.timezone(dt.timedelta(hours=2))).isoformat(),
               t.replace(tzinfo=None).isoformat()][j]
        assert offsets(iso) == want, iso
    assert offsets(iso_after(dump[-1]["timestamp_us"])) == []
    assert offsets("2h") == [d["offset"] for d in dump]
    assert offsets("0s") == []
    r = run("tail", "--data-dir", str(data_dir), "--since", "yesterday-ish")
    assert r.returncode == 2 and "--since" in r.stderr


def iso_after(ts_us):
    return dt.datetime.fromtimestamp((ts_us + 1) / 1e6, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def test_verify_healthy(data_dir):
    r = run("verify", "--data-dir", str(data_dir))
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"partition {node_dir(data_dir).name}: OK" in r.stdout


@pytest.fixture
def damaged(data_dir, tmp_path):
    copy = tmp_path / "data"
    shutil.copytree(data_dir, copy)
    return copy


def test_verify_and_tail_on_a_flipped_byte(damaged, dump):
    node = node_dir(damaged)
    seg = sorted(node.glob("*.log"))[0]
    raw = bytearray(seg.read_bytes())
    # The batch holding "cli/a/7": flip a byte of its payload.
    target = 7
    pos = 0
    while True:
        b = Batch(bytes(raw), pos)
        if b.base <= target < b.next_offset:
            break
        pos += b.size
    i = target - b.base
    start = b.columns()["payload"][0] + b._array("payload_off", "I")[i]
    raw[start] ^= 0x20
    seg.write_bytes(bytes(raw))
    r = run("verify", "--data-dir", str(damaged))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{seg}: batch at position {pos} ")
    assert lines[0].endswith(f"damaged records: offsets {target}")
    r = run("tail", "--data-dir", str(damaged), "--from", "0", "--format", "json")
    assert r.returncode == 0
    assert [json.loads(line)["offset"] for line in r.stdout.splitlines()] == \
        [d["offset"] for d in dump if d["offset"] != target]
    assert f"offsets {target}" in r.stderr  # reported, never served


def test_verify_torn_tail_and_missing_index(damaged):
    node = node_dir(damaged)
    seg = sorted(node.glob("*.log"))[-1]
    with open(seg, "ab") as fh:
        fh.write(seg.read_bytes()[:30])
    seg.with_suffix(".index").unlink()
    r = run("verify", "--data-dir", str(damaged))
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"{seg}: 30 bytes of torn or unreadable data at the end")
    assert lines[1] == f"{seg.with_suffix('.index')}: missing (rebuilt when the broker next starts)"


def test_usage_errors(data_dir, tmp_path):
    r = run("stats", "--data-dir", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "no commit log" in r.stderr
    r = run("verify", "--data-dir", str(tmp_path / "nowhere"))
    assert r.returncode == 2
    # Two partitions: tail must be told which.
    two = tmp_path / "two"
    shutil.copytree(data_dir, two)
    node = node_dir(data_dir).name
    shutil.copytree(two / "log" / node, two / "log" / "zz-other")
    r = run("tail", "--data-dir", str(two))
    assert r.returncode == 2 and "--partition" in r.stderr and node in r.stderr
    r = run("tail", "--data-dir", str(two), "--partition", "zz-other", "--from", "0", "-n", "1")
    assert r.returncode == 0 and r.stdout.startswith("0  ")
    r = run("tail", "--data-dir", str(two), "--partition", "nope")
    assert r.returncode == 2
    r = run("stats", "--data-dir", str(two), "--json")
    assert [p["partition"] for p in json.loads(r.stdout)["partitions"]] == [node, "zz-other"]
    r = subprocess.run([WRENMQ, "log"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "stats" in r.stdout


def _line_queue(proc):
    """Lines of proc's stdout, read on a thread (so a silent process cannot hang the test)."""
    q = queue.Queue()

    def pump():
        for line in proc.stdout:
            q.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _read_lines(q, n, timeout=10.0):
    out = []
    deadline = time.monotonic() + timeout
    while len(out) < n:
        try:
            out.append(json.loads(q.get(timeout=max(0.01, deadline - time.monotonic()))))
        except queue.Empty:
            break
    return out


def test_tail_follow(damaged, dump):
    """--follow prints new records as a running broker logs them, until Ctrl-C."""
    b = ServedBroker(damaged.parent, "", ("--data-dir", str(damaged)))
    proc = subprocess.Popen([WRENMQ, "log", "tail", "--data-dir", str(damaged), "--follow", "--format", "json",
                             "--topic", "cli/#", "--interval", "0.05"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = _line_queue(proc)
    try:
        first = _read_lines(lines, 10)
        cli = [d for d in dump if d["topic"].startswith("cli/")]
        assert [d["offset"] for d in first] == [d["offset"] for d in cli[-10:]]
        publish_all(b.port, [("cli/live", b"live %d" % i, 1, False, None) for i in range(3)]
                    + [("elsewhere", b"x", 1, False, None)])
        new = _read_lines(lines, 4)
        assert [(d["topic"], d["payload"]) for d in new] == \
            [("cli/live", f"live {i}") for i in range(3)] + [("cli/fence", "fence")]
        assert new[0]["offset"] == dump[-1]["offset"] + 1
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        b.stop()
    # With --limit, following ends by itself.
    r = run("tail", "--data-dir", str(damaged), "--follow", "--from", "0", "--limit", "2", timeout=10)
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 2


@pytest.mark.parametrize("n", [1, 3, 0])
def test_tail_follow_with_n_prints_the_last_n_then_follows(damaged, dump, n):
    """`-f -n N` as tail does it: the last N records, then every record logged after them
    (not N records in all, then an exit)."""
    b = ServedBroker(damaged.parent, "", ("--data-dir", str(damaged)))
    proc = subprocess.Popen([WRENMQ, "log", "tail", "--data-dir", str(damaged), "-f", "-n", str(n), "--format",
                             "json", "--interval", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = _line_queue(proc)
    try:
        first = _read_lines(lines, n, timeout=10) if n else []
        assert [d["offset"] for d in first] == [d["offset"] for d in dump[len(dump) - n:]]
        assert _read_lines(lines, 1, timeout=0.5) == []  # nothing more until something is logged
        assert proc.poll() is None  # still following
        publish_all(b.port, [("cli/after", b"after", 1, False, None)])
        new = _read_lines(lines, 2)
        if n == 0:
            # Nothing tells when `-n 0` has found the log's end (a loaded machine can take
            # longer to start it than to log a record): publish until it prints, then check
            # it printed only records logged after the dump, each once, in order.
            rounds = 1
            while not new and rounds < 50:
                publish_all(b.port, [("cli/after", b"after", 1, False, None)])
                rounds += 1
                new = _read_lines(lines, 2, timeout=0.5)
            new += _read_lines(lines, 2 * rounds, timeout=2)
            offsets = [d["offset"] for d in new]
            assert new and offsets[0] > dump[-1]["offset"], offsets
            assert offsets == list(range(offsets[0], offsets[0] + len(offsets))), offsets
            assert offsets[-1] == dump[-1]["offset"] + 2 * rounds, (offsets, rounds)
            assert {d["topic"] for d in new} <= {"cli/after", "cli/fence"}
        else:
            assert [(d["offset"], d["topic"], d["payload"]) for d in new] == \
                [(dump[-1]["offset"] + 1, "cli/after", "after"), (dump[-1]["offset"] + 2, "cli/fence", "fence")]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        b.stop()


def test_log_written_by_the_broker_reads_back_through_the_api(data_dir, dump):
    reader = LogReader(node_dir(data_dir))
    recs = list(reader.records())
    assert [(r.offset, r.topic) for r in recs] == [(d["offset"], d["topic"]) for d in dump]
    assert [r.payload for r in recs[:len(MESSAGES)]] == [m[1] for m in MESSAGES]
    assert reader.verify() == []
