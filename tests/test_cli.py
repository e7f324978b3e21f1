"""The `wrenmq` command line, run as users run it: a subprocess."""

import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import wrenmq
from conftest import WRENMQ, RawClient, free_port
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import (
    PINGREQ, PINGRESP, Connack, Connect, Disconnect, Publish, Suback, Subscribe, SubscribeTopic,
)

V311 = C.MQTT311
V5 = C.MQTT5


def run(*args, timeout=20):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout)


def wait_log(served, pattern, timeout=5.0):
    """Wait until the broker's log matches `pattern` (a regex); return the match."""
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, served.log)
        if m:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"log never matched {pattern!r}:\n{served.log}")
        time.sleep(0.02)


def connect(port, version=V5, client_id="cli-test"):
    c = RawClient(port, version)
    c.send(Connect(client_id, version))
    ack = c.recv()
    assert isinstance(ack, Connack) and ack.reason_code == 0, ack
    return c


def local_address(client):
    host, port = client.sock.getsockname()[:2]
    return f"{host}:{port}"


def can_connect(host, port):
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


# --- serve ---------------------------------------------------------------------

def test_serve_accepts_clients(serve_broker):
    b = serve_broker()
    sub = connect(b.port, V311, "sub")
    sub.send(Subscribe(1, [SubscribeTopic("cli/#", 1)]))
    assert sub.recv() == Suback(1, [1])
    pub = connect(b.port, V5, "pub")
    pub.send(Publish("cli/x", b"hello", qos=1, packet_id=1))
    assert pub.recv().packet_id == 1
    msg = sub.recv()
    assert (msg.topic, msg.payload) == ("cli/x", b"hello")
    pub.send(PINGREQ)
    assert pub.recv() == PINGRESP
    assert f"listening on 127.0.0.1:{b.port}" in b.log
    assert wrenmq.__version__ in b.log


def test_port_and_bind_override_the_config(serve_broker):
    # The config says 127.0.0.2:<other>; --bind/--port (given by the fixture) win.
    other = free_port()
    b = serve_broker(f'[[listener]]\nbind = "127.0.0.2"\nport = {other}\n', args=("--bind", "127.0.0.1"))
    assert can_connect("127.0.0.1", b.port)
    assert not can_connect("127.0.0.2", b.port)
    assert not can_connect("127.0.0.2", other)
    assert f"listening on 127.0.0.1:{b.port}" in b.log


def test_bind_all_interfaces(serve_broker):
    b = serve_broker(args=("--bind", "0.0.0.0"))
    assert can_connect("127.0.0.1", b.port)
    assert can_connect("127.0.0.2", b.port)  # any loopback address: bound to all
    assert f"listening on 0.0.0.0:{b.port}" in b.log


def test_default_bind_is_loopback_only(serve_broker):
    b = serve_broker()
    assert can_connect("127.0.0.1", b.port)
    assert not can_connect("127.0.0.2", b.port)


def test_log_lines_for_connect_and_disconnect(serve_broker):
    b = serve_broker()
    # Clean disconnect.
    c = connect(b.port, V5, "log-clean")
    addr = local_address(c)
    line = wait_log(b, r".*\blog-clean\b.*connected.*").group(0)
    assert addr in line and "v5.0" in line
    c.send(Disconnect())
    assert c.recv() is None
    line = wait_log(b, r".*\blog-clean\b.*disconnected.*").group(0)
    assert addr in line and "client disconnected" in line

    # Connection dropped without DISCONNECT.
    c = connect(b.port, V311, "log-dropped")
    addr = local_address(c)
    line = wait_log(b, r".*\blog-dropped\b.*connected.*").group(0)
    assert addr in line and "v3.1.1" in line
    c.close()
    line = wait_log(b, r".*\blog-dropped\b.*disconnected.*").group(0)
    assert addr in line and ("closed by client" in line or "connection lost" in line)

    # Closed by the broker for a protocol error: the reason is named.
    c = connect(b.port, V5, "log-bad")
    addr = local_address(c)
    c.send(b"\x30\x05\x00\x02a+\x00")  # wildcard in a topic name
    pkt = c.recv()
    assert isinstance(pkt, Disconnect) and pkt.reason_code == 0x90
    line = wait_log(b, r".*\blog-bad\b.*disconnected.*").group(0)
    assert addr in line and "Topic Name invalid" in line


def test_log_line_for_refused_connect(serve_broker):
    b = serve_broker("[auth]\nallow_anonymous = false\n")
    c = RawClient(b.port, V5)
    c.send(Connect("log-refused", V5))
    ack = c.recv()
    assert ack.reason_code == 0x87
    addr = local_address(c)
    line = wait_log(b, rf".*refused.*{re.escape(addr)}.*").group(0)
    assert "Not authorized" in line


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_shuts_down_cleanly(serve_broker, sig):
    b = serve_broker()
    v5 = connect(b.port, V5, "shut-v5")
    v311 = connect(b.port, V311, "shut-v311")
    silent = RawClient(b.port)  # connected, no CONNECT yet
    t0 = time.monotonic()
    b.proc.send_signal(sig)
    pkt = v5.recv(timeout=5)
    assert isinstance(pkt, Disconnect) and pkt.reason_code == 0x8B, pkt
    assert v5.recv(timeout=5) is None
    assert v311.recv(timeout=5) is None  # 3.1.1: just closed
    assert silent.recv(timeout=5) is None
    rc = b.proc.wait(5)
    assert rc == 0, b.log
    assert time.monotonic() - t0 < 5
    assert "shutting down" in b.log
    assert "Traceback" not in b.log
    assert not can_connect("127.0.0.1", b.port)


def test_sighup_keeps_serving(serve_broker):
    b = serve_broker()
    c = connect(b.port, V5, "hup")
    b.proc.send_signal(signal.SIGHUP)
    time.sleep(0.2)
    assert b.proc.poll() is None, b.log
    c.send(PINGREQ)
    assert c.recv() == PINGRESP
    connect(b.port, V311, "after-hup").close()


def test_sigterm_with_no_clients(serve_broker):
    b = serve_broker()
    assert b.stop(signal.SIGTERM, timeout=5) == 0
    assert "Traceback" not in b.log


def test_port_in_use_fails(serve_broker, tmp_path):
    b = serve_broker()
    cfg = tmp_path / "empty.toml"
    cfg.write_text("")
    r = run(WRENMQ, "serve", "--config", str(cfg), "--port", str(b.port))
    assert r.returncode == 1
    assert "cannot start" in r.stderr


def test_serve_bad_config_exits_2(tmp_path):
    cfg = tmp_path / "bad.toml"
    cfg.write_text("[limits]\nmax_packet_sise = 10\n")
    r = run(WRENMQ, "serve", "--config", str(cfg), "--port", str(free_port()))
    assert r.returncode == 2
    assert "max_packet_sise" in r.stderr and "unknown key" in r.stderr
    assert "Traceback" not in r.stderr


def test_serve_missing_config_exits_2(tmp_path):
    r = run(WRENMQ, "serve", "--config", str(tmp_path / "nope.toml"))
    assert r.returncode == 2
    assert "file not found" in r.stderr


def test_serve_bad_port_argument():
    r = run(WRENMQ, "serve", "--port", "eighty")
    assert r.returncode == 2
    assert "--port" in r.stderr


# --- other commands --------------------------------------------------------------

def test_version():
    r = run(WRENMQ, "--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"wrenmq {wrenmq.__version__}"


def test_python_m_wrenmq_version():
    r = run(sys.executable, "-m", "wrenmq", "--version")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"wrenmq {wrenmq.__version__}"


def test_no_command_prints_help_and_exits_2():
    r = run(WRENMQ)
    assert r.returncode == 2
    out = r.stdout + r.stderr
    assert "usage: wrenmq" in out
    assert "serve" in out


def test_help():
    r = run(WRENMQ, "--help")
    assert r.returncode == 0
    assert "usage: wrenmq" in r.stdout and "serve" in r.stdout
    r = run(WRENMQ, "serve", "--help")
    assert r.returncode == 0
    for opt in ("--config", "--bind", "--port", "--log-level"):
        assert opt in r.stdout


def test_serve_help_lists_the_log_levels():
    r = run(WRENMQ, "serve", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split()[r.stdout.split().index("--log-level"):])  # (argparse wraps lines)
    for level in ("debug", "info", "warning", "error", "critical"):
        assert level in text, r.stdout


def test_demo_help_says_what_each_option_is():
    r = run(WRENMQ, "demo", "--help")
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--devices N simulated devices" in text and "--seconds S how long" in text
    assert "--master URL Spark master" in text


def test_every_option_of_every_command_has_a_help_text():
    import argparse

    from wrenmq.cli import build_parser

    missing = []

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{path} {name}")
            elif not action.help:
                missing.append(f"{path} {'/'.join(action.option_strings) or action.dest}")

    walk(build_parser(), "wrenmq")
    assert missing == []


def test_unknown_command_exits_2():
    r = run(WRENMQ, "frobnicate")
    assert r.returncode == 2
    assert "invalid choice" in r.stderr


def test_config_check(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[[listener]]\nport = 1884\n[[listener]]\nport = 1885\n')
    r = run(WRENMQ, "config", "check", str(good))
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and "2 listener" in r.stdout

    bad = tmp_path / "bad.toml"
    bad.write_text("[limits]\nmax_packet_size = 'big'\n")
    r = run(WRENMQ, "config", "check", str(bad))
    assert r.returncode == 2
    assert "max_packet_size" in r.stderr
