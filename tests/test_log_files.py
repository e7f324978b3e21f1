"""[logging] file, rotation by size, reopen on SIGHUP, JSON lines (logfiles.py), with
`wrenmq serve` in a subprocess and real clients."""

import json
import os
import signal
import time

from conftest import paho_client


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def connect_and_leave(port, client_id):
    c = paho_client(port, client_id=client_id)
    c.disconnect()
    c.loop_stop()


def test_json_lines_rotated_by_size(serve_broker, tmp_path):
    path = tmp_path / "broker.log"
    b = serve_broker(f"""
[storage]
mode = "memory"
[logging]
file = "{path}"
format = "json"
max_bytes = 3000
backup_count = 2
""")
    for i in range(25):
        connect_and_leave(b.port, f"rot-{i}")
    assert wait_for(lambda: "rot-24" in path.read_text())
    assert os.path.exists(f"{path}.1") and os.path.exists(f"{path}.2")
    assert not os.path.exists(f"{path}.3")  # backup_count
    lines = []
    for p in (f"{path}.2", f"{path}.1", path):
        assert os.path.getsize(p) <= 3000
        lines += [json.loads(line) for line in open(p).read().splitlines()]
    connected = [r for r in lines if r.get("event") == "client.connected"]
    assert connected, lines[:5]
    last = connected[-1]
    assert last["client_id"] == "rot-24"
    assert last["address"].startswith("127.0.0.1:")
    assert last["level"] == "info" and last["logger"] == "wrenmq.router"
    assert last["ts"].endswith("Z") and "rot-24" in last["msg"]
    gone = [r for r in lines if r.get("event") == "client.disconnected" and r["client_id"] == "rot-24"]
    assert gone and gone[0]["reason"] == "client disconnected"
    assert b.log == ""  # nothing on stderr: the file has it all


def test_sighup_reopens_the_file_logrotate_moved(serve_broker, tmp_path):
    path = tmp_path / "broker.log"
    b = serve_broker(f"""
[storage]
mode = "memory"
[logging]
file = "{path}"
""")
    connect_and_leave(b.port, "before-rotate")
    assert wait_for(lambda: "before-rotate" in path.read_text())
    os.rename(path, f"{path}.old")  # what logrotate does, then its postrotate: kill -HUP
    connect_and_leave(b.port, "while-moved")
    b.proc.send_signal(signal.SIGHUP)
    assert wait_for(lambda: path.exists() and "reopened" in path.read_text())
    connect_and_leave(b.port, "after-rotate")
    assert wait_for(lambda: "after-rotate" in path.read_text())
    old = open(f"{path}.old").read()
    assert "before-rotate" in old and "while-moved" in old and "after-rotate" not in old
    assert "before-rotate" not in path.read_text()
    assert " INFO " in path.read_text()  # the text format


def test_a_log_file_that_cannot_be_opened_stops_the_start(tmp_path):
    import subprocess

    from conftest import WRENMQ
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'[logging]\nfile = "{tmp_path}/no/such/dir/broker.log"\n')
    r = subprocess.run([WRENMQ, "serve", "--config", str(cfg), "--port", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2
    assert "logging.file: cannot open" in r.stderr and "No such file or directory" in r.stderr
