"""One broker per data dir: a second `wrenmq serve` on it is refused, readers are not."""

import json
import subprocess

import pytest

from conftest import WRENMQ, ServedBroker, free_port, paho_client
from wrenmq.config import load
from wrenmq.store.lock import DataDirInUse
from wrenmq.store.store import Store


def publish(port, topic, payload):
    c = paho_client(port)
    try:
        c.publish(topic, payload, qos=1).wait_for_publish(5)
    finally:
        c.disconnect()
        c.loop_stop()


def tail(data):
    r = subprocess.run([WRENMQ, "log", "tail", "--data-dir", str(data), "--format", "json"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return [json.loads(line)["payload"] for line in r.stdout.splitlines()]


def test_a_second_broker_on_a_data_dir_is_refused_until_the_first_is_gone(tmp_path):
    data = tmp_path / "data"
    first = ServedBroker(tmp_path, "", ("--data-dir", str(data)))
    try:
        publish(first.port, "lock/1", b"one")
        # Another port, the same data dir: refused, naming the process that has it and the dir.
        r = subprocess.run([WRENMQ, "serve", "--port", str(free_port()), "--data-dir", str(data)],
                           capture_output=True, text=True, timeout=30, cwd=tmp_path)
        assert r.returncode != 0
        assert f"pid {first.proc.pid}" in r.stderr and str(data) in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
        assert "log on at offset" not in r.stderr  # refused before it opened anything
        # The first serves on, and the log's readers read it while it runs.
        publish(first.port, "lock/2", b"two")
        assert tail(data) == ["one", "two"]
        # kill -9: the kernel releases the lock with the process; a new broker starts on
        # the data dir and has what the first one logged.
        first.kill()
        second = ServedBroker(tmp_path, "", ("--data-dir", str(data)))
        try:
            owner = json.loads((data / "wrenmq.lock").read_text())
            assert owner["pid"] == second.proc.pid
            assert owner["listeners"] == [["127.0.0.1", second.port]]
            publish(second.port, "lock/3", b"three")
            assert tail(data) == ["one", "two", "three"]
        finally:
            assert second.stop() == 0
    finally:
        if first.proc.poll() is None:
            first.kill()


def test_a_data_dir_is_opened_once_in_one_process_too(tmp_path):
    """An embedding program (or a test) that opens a data dir twice is refused as well: the
    lock is on the open file, not the process."""
    import os

    cfg = load(text="[storage]\nfsync = 'never'\n")
    cfg.storage.data_dir = str(tmp_path)
    first = Store(cfg)
    try:
        with pytest.raises(DataDirInUse) as e:
            Store(cfg)
        assert f"pid {os.getpid()}" in str(e.value) and str(tmp_path) in str(e.value)
    finally:
        first.close()
    assert (tmp_path / "wrenmq.lock").read_text() == ""  # nobody has it
    Store(cfg).close()
