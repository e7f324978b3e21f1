"""`wrenmq pipeline ...` as users run it: an explicit replay target, and option errors that
stop a job before Spark starts."""

import json
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("pyspark")

from .pipeline_helpers import subscribe, telemetry, write_log  # noqa: E402

WRENMQ = str(Path(sys.executable).with_name("wrenmq"))


def pipeline(*args, cwd=None, timeout=300):
    t0 = time.monotonic()
    r = subprocess.run([WRENMQ, "pipeline", *args], capture_output=True, text=True, timeout=timeout, cwd=cwd)
    r.seconds = time.monotonic() - t0
    return r


def received(client, timeout=2.0):
    got = []
    while True:
        try:
            got.append(client.messages.get(timeout=timeout))
        except queue.Empty:
            return got


def log_end(data):
    r = subprocess.run([WRENMQ, "log", "stats", "--data-dir", str(data), "--json"], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["partitions"][0]["end_offset"]


def test_replay_needs_a_target_and_refuses_the_logs_own_broker_under_the_same_topics(
        serve_broker, tmp_path, clients):
    b = serve_broker()  # its data dir: tmp_path / "data"
    data = tmp_path / "data"
    pub = clients(b.port)
    for i in range(3):
        pub.publish(f"plant/{i}", b"%d" % i, qos=1).wait_for_publish(5)
    watcher = clients(b.port)
    subscribe(watcher, "#", qos=1)
    end = log_end(data)

    # No --broker: a usage error, nothing published anywhere.
    r = pipeline("replay", "--data-dir", str(data), "--quiet")
    assert r.returncode == 2 and "usage:" in r.stderr and "--broker" in r.stderr, r.stderr
    # Into the broker that owns the log, under the original topics: refused, by any name of it.
    for target in (f"127.0.0.1:{b.port}", f"localhost:{b.port}"):
        r = pipeline("replay", "--data-dir", str(data), "--broker", target, "--quiet")
        assert r.returncode == 2, r.stdout + r.stderr
        assert "owns the log" in r.stderr and f"pid {b.proc.pid}" in r.stderr and "--prefix" in r.stderr
        assert "Traceback" not in r.stderr
    assert received(watcher) == [] and log_end(data) == end

    # Under a prefix: replayed.
    r = pipeline("replay", "--data-dir", str(data), "--broker", f"127.0.0.1:{b.port}", "--prefix", "again/",
                 "--topics", "plant/#", "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted((m.topic, m.payload) for m in received(watcher)) == [
        (f"again/plant/{i}", b"%d" % i) for i in range(3)]
    # Asked for in so many words: under the same topics.
    r = pipeline("replay", "--data-dir", str(data), "--broker", f"127.0.0.1:{b.port}", "--same-topics",
                 "--topics", "plant/#", "--to-offset", "1", "--quiet")
    assert r.returncode == 0, r.stderr
    assert [(m.topic, m.payload) for m in received(watcher)] == [("plant/0", b"0")]

    # Another broker is not the owner: no prefix needed.
    other_dir = tmp_path / "other"
    other = serve_broker(args=("--data-dir", str(other_dir)))
    there = clients(other.port)
    subscribe(there, "plant/#", qos=1)
    r = pipeline("replay", "--data-dir", str(data), "--broker", f"127.0.0.1:{other.port}", "--to-offset", "3",
                 "--quiet")
    assert r.returncode == 0, r.stderr
    assert sorted(m.topic for m in received(there)) == [f"plant/{i}" for i in range(3)]


def test_archive_option_errors_fail_before_spark_starts(java, tmp_path):
    """A data dir without a log, bad --starting-offsets and other option errors: exit 2 with
    one line naming the option, at once, leaving no output or checkpoint folder. Set
    against a run of the same command on a real log, which starts Spark."""
    data = tmp_path / "data"
    data.mkdir()
    write_log(str(data), "n1", telemetry(50))
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [
        (["--data-dir", str(tmp_path / "no" / "such" / "dir")], "--data-dir"),
        (["--data-dir", str(empty)], "no commit log"),
        (["--data-dir", str(data), "--starting-offsets", "yesterday"], "--starting-offsets"),
        (["--data-dir", str(data), "--starting-offsets", '{"n2": 5}'], "no log partition 'n2'"),
        (["--data-dir", str(data), "--starting-timestamp", "last tuesday"], "--starting-timestamp"),
        (["--data-dir", str(data), "--topics", "a/#/b"], "--topics"),
        (["--data-dir", str(data), "--continuous", "--trigger", "5s"], "--trigger"),
        (["--data-dir", str(data), "--max-records-per-trigger", "0"], "--max-records-per-trigger"),
    ]
    slowest = 0.0
    for i, (args, expected) in enumerate(cases):
        out = tmp_path / f"lake{i}"
        r = pipeline("archive", *args, "--output", str(out), "--quiet", cwd=tmp_path)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("wrenmq pipeline archive: ") and expected in lines[0], \
            (args, r.stderr)
        assert not out.exists(), args  # no checkpoint, no output folder
        slowest = max(slowest, r.seconds)
    assert not (tmp_path / "lake").exists()

    # The same command on a real log starts Spark and archives it.
    out = tmp_path / "lake-ok"
    r = pipeline("archive", "--data-dir", str(data), "--output", str(out), "--quiet", "--master", "local[1]",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert os.path.isdir(out / "_wrenmq" / "checkpoint")
    assert slowest * 3 < r.seconds, (slowest, r.seconds)


def test_demo_keeps_the_results_whose_paths_it_prints(java, tmp_path):
    """`wrenmq demo` (what `make demo` runs) names a Parquet file of its archive: the file is
    there once the demo is over, in the folder it says it keeps."""
    import re

    import pyarrow.parquet as pq

    env = dict(os.environ, TMPDIR=str(tmp_path), COLUMNS="1000")  # (its default folder; no wrapped paths)
    r = subprocess.run([WRENMQ, "demo", "--devices", "4", "--seconds", "8", "--interval", "0.5", "--master",
                        "local[1]"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    example = re.search(r"Parquet files, e\.g\. (\S+\.parquet)", r.stdout)
    kept = re.search(r"the results stay in (\S+)", r.stdout)
    assert example and kept, r.stdout
    assert os.path.isabs(example.group(1)) and example.group(1).startswith(kept.group(1) + os.sep)
    assert pq.read_table(example.group(1)).num_rows > 0
    assert kept.group(1).startswith(str(tmp_path))


def test_brokers_option_errors_fail_before_spark_starts_and_replay_reads_over_the_network(
        tmp_path, serve_broker, clients):
    """`--brokers` (a running node's admin listener) is checked as `--data-dir` is: one
    request, exit 2 with one line naming what is wrong, nothing left behind; `replay` reads
    the same log over the network (no Spark), its MQTT 5 properties kept."""
    from admin_helpers import PASSWORDS, AdminBroker
    from wrenmq.ports import free_port

    (tmp_path / "node").mkdir()
    node = AdminBroker(tmp_path / "node")
    try:
        pub = clients(node.port, version=5)
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
        p = Properties(PacketTypes.PUBLISH)
        p.ContentType = "text/plain"
        for i in range(6):
            pub.publish(f"net/{i % 2}", b"%d" % i, qos=1, properties=p).wait_for_publish(5)
        (partition,) = os.listdir(tmp_path / "node" / "data" / "log")
        admin = f"127.0.0.1:{node.admin_port}"
        viewer = ["--user", "viewer", "--password", PASSWORDS["viewer"]]
        cases = [
            (["--brokers", "127.0.0.1"], "--brokers"),
            (["--brokers", f"127.0.0.1:{free_port()}"], "no node of the cluster answered"),
            (["--brokers", admin], "401"),
            (["--brokers", admin, "--user", "viewer", "--password", "wrong"], "401"),
            (["--brokers", admin, *viewer, "--starting-offsets", '{"elsewhere": 5}'],
             "no log partition 'elsewhere'"),
            (["--brokers", admin, *viewer, "--cafile", str(tmp_path / "none.pem")], "--cafile"),
            (["--brokers", admin, "--user", "viewer", "--token", "t"], "not both"),
        ]
        for i, (args, expected) in enumerate(cases):
            out = tmp_path / f"lake{i}"
            r = pipeline("archive", *args, "--output", str(out), "--quiet", cwd=tmp_path)
            lines = r.stderr.strip().splitlines()
            assert r.returncode == 2 and len(lines) == 1 and expected in lines[0], (args, r.stderr)
            assert r.seconds < 20 and not out.exists(), args
        r = pipeline("archive", "--brokers", admin, "--data-dir", str(tmp_path), cwd=tmp_path)
        assert r.returncode == 2 and "--data-dir or --brokers, not both" in r.stderr

        # replay from the network: a cluster's log cannot tell its own broker, so the
        # original topics need --same-topics.
        other = serve_broker()
        there = clients(other.port)
        subscribe(there, "net/#", qos=1)
        r = pipeline("replay", "--brokers", admin, *viewer, "--broker", f"127.0.0.1:{other.port}", "--quiet")
        assert r.returncode == 2 and "--same-topics" in r.stderr, r.stderr
        r = pipeline("replay", "--brokers", admin, *viewer, "--broker", f"127.0.0.1:{other.port}", "--same-topics",
                     "--topics", "net/1", "--from-offset", "2", "--quiet")
        assert r.returncode == 0, r.stderr
        got = received(there)
        assert [(m.topic, m.payload) for m in got] == [("net/1", b"3"), ("net/1", b"5")]
        ups = dict(got[0].properties.UserProperty)
        assert got[0].properties.ContentType == "text/plain" and ups["wrenmq-replay-of"] == f"{partition}:3"
    finally:
        node.stop()
