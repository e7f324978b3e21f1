"""`wrenmq top` in a real terminal (tmux) and `wrenmq bench` against wrenmq and Mosquitto."""

import json
import os
import re
import shutil
import subprocess
import threading
import time
import uuid

import pytest

from admin_helpers import PASSWORDS, AdminBroker
from conftest import WRENMQ, free_port, paho_client, wait_port
from mqtt_helpers import wait_for

TMUX = shutil.which("tmux")
MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)


@pytest.fixture(scope="module")
def admin(tmp_path_factory):
    b = AdminBroker(tmp_path_factory.mktemp("tools"))
    yield b
    b.stop()


@pytest.fixture
def mosquitto(tmp_path):
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (make test installs it)")
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\npersistence false\nsys_interval 1\n"
                    + ("user root\n" if os.geteuid() == 0 else ""))
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port, proc=proc, what="mosquitto")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


class Tmux:
    """A tmux server of the test's own (-L), one window of a fixed size."""

    def __init__(self):
        self.sock = f"wrenmq-test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.run("new-session", "-d", "-s", "t", "-x", "170", "-y", "30")

    def run(self, *args):
        return subprocess.run([TMUX, "-L", self.sock, *args], capture_output=True, text=True, timeout=20,
                              check=True).stdout

    def keys(self, *keys):
        self.run("send-keys", "-t", "t", *keys)

    def screen(self):
        return self.run("capture-pane", "-p", "-t", "t")

    def close(self):
        subprocess.run([TMUX, "-L", self.sock, "kill-server"], capture_output=True, timeout=20)


def figure(screen, label):
    """The number at the end of the `label` line of top's screen (its sparkline rows)."""
    for line in screen.splitlines():
        if line.startswith(label):
            m = re.search(r"(\d[\d.]*)(k|M)?\s*$", line)
            if m:
                return float(m.group(1)) * {"k": 1e3, "M": 1e6}.get(m.group(2), 1)
    return None


@pytest.mark.skipif(TMUX is None, reason="tmux is not installed (make test installs it)")
def test_top_in_a_terminal_shows_rates_that_move_with_the_load(admin):
    tmux = Tmux()
    stop = threading.Event()
    pub = paho_client(admin.port, client_id="top-load")
    try:
        tmux.keys(f"{WRENMQ} top --admin http://127.0.0.1:{admin.admin_port} --user ops --password "
                  f"{PASSWORDS['ops']}", "Enter")
        first = wait_for(lambda: (lambda s: s if "msgs in/s " in s and figure(s, "msgs in/s ") is not None
                                  else None)(tmux.screen()), timeout=15)
        assert first, tmux.screen()
        assert "wrenmq top - http://127.0.0.1:" in first
        idle = figure(first, "msgs in/s ")

        def load():
            while not stop.is_set():
                pub.publish("top/load", b"x" * 64)
                time.sleep(0.005)

        threading.Thread(target=load, daemon=True).start()
        busy = wait_for(lambda: (lambda s: s if (figure(s, "msgs in/s ") or 0) > max(idle, 20) else None)(
            tmux.screen()), timeout=15)
        assert busy, tmux.screen()
        # The node's row: its clients column counts the publisher.
        row = [ln for ln in busy.splitlines() if re.match(r"^\S+\s+\d+\s+\d+\s", ln)]
        assert row and int(row[0].split()[1]) >= 1
        # Redrawn in place: the screen holds one table, not a scroll of them.
        assert busy.count("wrenmq top - ") == 1
        stop.set()
        calm = wait_for(lambda: (lambda s: s if figure(s, "msgs in/s ") == 0 else None)(tmux.screen()), timeout=15)
        assert calm, tmux.screen()
        tmux.keys("C-c")
    finally:
        stop.set()
        pub.disconnect()
        pub.loop_stop()
        tmux.close()


def test_top_once_from_sys_topics_of_mosquitto(mosquitto):
    out = subprocess.run([WRENMQ, "top", "--broker", f"127.0.0.1:{mosquitto}", "--once"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"mqtt://127.0.0.1:{mosquitto} ($SYS)" in out.stdout
    row = [ln for ln in out.stdout.splitlines() if ln.startswith(f"127.0.0.1:{mosquitto}")]
    assert row and int(row[0].split()[1]) >= 1  # (top itself is connected)


def bench(port, *args):
    out = subprocess.run([WRENMQ, "bench", "--port", str(port), "--json", *args],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


@pytest.mark.parametrize("qos", [0, 1, 2])
def test_bench_against_wrenmq_counts_every_delivery(admin, qos):
    r, progress = bench(admin.port, "--clients", "6", "--interval", "0.05", "--duration", "2", "--qos", str(qos))
    assert r["sent"] >= 200 and r["fanout_mean"] == 1.0
    assert r["expected"] == r["sent"] and r["received"] == r["expected"] and r["lost"] == 0
    assert 0 < r["latency_ms"]["p50"] <= r["latency_ms"]["p99"] <= r["latency_ms"]["max"]
    assert "sent" in progress and "received" in progress  # the progress lines


def test_bench_fanout_is_set_by_the_subscriptions(admin):
    # Every client on bench/#: each message goes to all 5.
    r, _ = bench(admin.port, "--clients", "5", "--interval", "0.1", "--duration", "1.5",
                 "--subscribe", "fan/#", "--prefix", "fan")
    assert r["fanout_mean"] == 5.0 and r["expected"] == 5 * r["sent"] and r["received"] == r["expected"]
    # Three topics, one subscriber each for clients 0-2 ({i} is the client's number mod 3).
    r, _ = bench(admin.port, "--clients", "6", "--topics", "3", "--interval", "0.1", "--duration", "1.5",
                 "--prefix", "tri")
    assert r["fanout_mean"] == 2.0 and r["received"] == r["expected"] == 2 * r["sent"]


def test_bench_against_mosquitto(mosquitto):
    r, _ = bench(mosquitto, "--clients", "8", "--interval", "0.05", "--duration", "2", "--qos", "1",
                 "--subscribe", "bench/+", "--topics", "4")
    assert r["fanout_mean"] == 8.0 and r["received"] == r["expected"] == 8 * r["sent"] and r["lost"] == 0


def test_bench_says_when_the_client_is_the_limit(admin):
    r, _ = bench(admin.port, "--clients", "20", "--interval", "0.000001", "--duration", "1")
    assert not r["errors"] and r["duration"] >= 1.0, r
    assert r["client_limited"] is True and r["sent_per_sec"] < r["target_msgs_per_sec"], r
    out = subprocess.run([WRENMQ, "bench", "--port", str(admin.port), "--clients", "20", "--interval", "0.000001",
                          "--duration", "1"], capture_output=True, text=True, timeout=60)
    assert "could not keep the pace" in out.stdout


def test_bench_refuses_nonsense_and_reports_a_broker_that_is_not_there():
    out = subprocess.run([WRENMQ, "bench", "--clients", "0"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "must be positive" in out.stderr
    out = subprocess.run([WRENMQ, "bench", "--port", str(free_port()), "--duration", "1"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "failed" in out.stderr
