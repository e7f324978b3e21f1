"""`wrenmq config import`: Mosquitto configuration files in, wrenmq TOML out; each result
is accepted by `wrenmq config check` and started, and does what the Mosquitto file said."""

import os
import re
import shutil
import ssl
import subprocess
import time
from pathlib import Path

import pytest

from bridge_helpers import collect
from conftest import WRENMQ, free_port, paho_client, subscribe, wait_port
from mqtt_helpers import wait_for

DEBIAN_EXAMPLE = Path("/usr/share/doc/mosquitto/examples/mosquitto.conf")
DEBIAN_CONF = Path("/etc/mosquitto/mosquitto.conf")


def run(*args, timeout=30):
    return subprocess.run([WRENMQ, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def imported(src, dst):
    r = run("config", "import", src, "-o", dst)
    assert r.returncode == 0, r.stderr
    check = run("config", "check", dst)
    assert check.returncode == 0, check.stderr + Path(dst).read_text()
    return Path(dst).read_text()


@pytest.mark.skipif(not DEBIAN_EXAMPLE.exists(), reason="Debian's mosquitto package is not installed")
def test_debians_example_and_default_files(tmp_path, serve_broker):
    """Debian's example mosquitto.conf (every directive commented: Mosquitto's defaults) is
    a broker on localhost:1883 that takes anonymous clients there and keeps nothing on disk;
    Debian's /etc/mosquitto/mosquitto.conf keeps its pid file and persistence and lists what
    it cannot carry (log_dest); both pass the check and serve."""
    text = imported(DEBIAN_EXAMPLE, tmp_path / "example.toml")
    assert re.search(r'^\[\[listener\]\]\nport = 1883\nbind = "127.0.0.1"$', text, re.M), text
    assert 'mode = "memory"' in text and "allow_anonymous" not in text
    b = serve_broker(text)  # (--port: a free one instead of 1883)
    c = paho_client(b.port, version=4)
    subscribe(c, "t", 1)
    c.publish("t", b"x", 1)
    assert collect(c, lambda g: g, timeout=10)[0].payload == b"x"
    c.loop_stop()
    if DEBIAN_CONF.exists():
        text = imported(DEBIAN_CONF, tmp_path / "etc.toml")
        assert re.search(r"^#   /etc/mosquitto/mosquitto.conf:\d+: log_dest file \S+  -- wrenmq logs to stderr", text,
                         re.M), text
        assert 'pid_file = "/run/mosquitto/mosquitto.pid"' in text and 'data_dir = "/var/lib/mosquitto/"' in text
        pid = tmp_path / "wrenmq.pid"
        b = serve_broker(text.replace("/run/mosquitto/mosquitto.pid", str(pid)), args=("--data-dir", "etc-data"))
        assert pid.read_text().strip() == str(b.proc.pid)


MOSQUITTO_CONF = """# an edge broker: three listeners, files for users and ACLs, a bridge
allow_anonymous false
password_file {dir}/passwd
acl_file {dir}/acl

listener {plain} 127.0.0.1

listener {tls} 127.0.0.1
certfile {dir}/server.pem
keyfile {dir}/server.key
cafile {dir}/ca.pem
require_certificate true
use_identity_as_username true
tls_version tlsv1.2

listener {ws} 127.0.0.1
protocol websockets
http_dir /var/www

persistence true
persistence_location {dir}/data/
autosave_interval 1800
max_inflight_messages 40
max_queued_messages 5000
persistent_client_expiration 14d
sys_interval 1
log_type warning
log_dest syslog
max_conections 10

connection cloud
address 127.0.0.1:{remote}
remote_clientid edge-1
cleansession false
keepalive_interval 30
local_username bridge
notifications false
try_private true
restart_timeout 0.2 1
topic sensors/# out 1 "" site1/
topic cmd/# in 1 fromcloud/ site1/
topic $SYS/broker/load/# out 0
"""

ACL = """user alice
topic readwrite #
user dev1
topic write sensors/#
user bridge
topic write fromcloud/#
"""


def test_listeners_tls_websocket_auth_and_a_bridge(tmp_path, serve_broker, mosquitto):
    """A Mosquitto file with a plain, a TLS (client certificates, identity as user name) and a
    WebSocket listener, a password file written by mosquitto_passwd, an ACL file and a
    `connection` block: the import passes the check, lists what it leaves out (with file
    and line), and the broker it starts takes the same clients and bridges to a real Mosquitto."""
    import trustme

    ca = trustme.CA()
    for name, blob in (("ca.pem", ca.cert_pem), ("server.pem", ca.issue_cert("127.0.0.1").cert_chain_pems[0])):
        blob.write_to_path(str(tmp_path / name))
    server = ca.issue_cert("127.0.0.1")
    server.cert_chain_pems[0].write_to_path(str(tmp_path / "server.pem"))
    server.private_key_pem.write_to_path(str(tmp_path / "server.key"))
    dev = ca.issue_cert("dev1", common_name="dev1")
    dev.cert_chain_pems[0].write_to_path(str(tmp_path / "dev.pem"))
    dev.private_key_pem.write_to_path(str(tmp_path / "dev.key"))
    passwd = shutil.which("mosquitto_passwd")
    assert passwd, "mosquitto_passwd is not installed (make test-deps installs mosquitto)"
    subprocess.run([passwd, "-b", "-c", str(tmp_path / "passwd"), "alice", "alice-pw"], check=True)
    (tmp_path / "acl").write_text(ACL)
    remote = mosquitto()
    ports = {"plain": free_port(), "tls": free_port(), "ws": free_port()}
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(MOSQUITTO_CONF.format(dir=tmp_path, remote=remote.port, **ports))
    text = imported(conf, tmp_path / "wrenmq.toml")
    header = [ln for ln in text.splitlines() if ln.startswith("#")]
    lines = conf.read_text().splitlines()
    for directive in ("http_dir /var/www", "autosave_interval 1800", "log_dest syslog", "max_conections 10",
                      "try_private true", "topic $SYS/broker/load/# out 0"):
        line = lines.index(directive) + 1
        assert any(ln.startswith(f"#   {conf}:{line}: {directive}  -- ") for ln in header), (directive, header)
    assert sum("  -- " in ln for ln in header) == 6, header  # (nothing else left out)

    b = serve_broker(text)
    ports["plain"] = b.port  # (serve_broker's --port stands in for the first listener's)
    for port in ports.values():
        wait_port(port, proc=b.proc)
    # plain: anonymous refused (Mosquitto 2's default), the password file's user accepted
    r = subprocess.run(["mosquitto_pub", "-p", str(ports["plain"]), "-t", "x", "-m", "x", "-q", "1"],
                       capture_output=True, text=True, timeout=10)
    assert r.returncode != 0
    alice = paho_client(ports["plain"], version=4, username="alice", password="alice-pw")
    subscribe(alice, "fromcloud/#", 1)
    # WebSocket on /mqtt
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    ws = mqtt.Client(CallbackAPIVersion.VERSION2, transport="websockets", protocol=mqtt.MQTTv311)
    ws.ws_set_options(path="/mqtt")
    ws.username_pw_set("alice", "alice-pw")
    got_ws = []
    ws.on_message = lambda c, u, m: got_ws.append(m.payload)
    ws.connect("127.0.0.1", ports["ws"])
    ws.loop_start()
    assert wait_for(lambda: ws.is_connected(), timeout=10)
    ws.subscribe("sensors/#", 1)
    # TLS with a client certificate: its CN is the user name, which the ACL lets publish sensors/#
    app = paho_client(remote.port, client_id="cloud-app", version=4, clean=False)
    subscribe(app, "site1/#", 1)
    tls = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv311)
    tls.tls_set(ca_certs=str(tmp_path / "ca.pem"), certfile=str(tmp_path / "dev.pem"),
                keyfile=str(tmp_path / "dev.key"), tls_version=ssl.PROTOCOL_TLS_CLIENT)
    tls.connect("127.0.0.1", ports["tls"])
    tls.loop_start()
    assert wait_for(lambda: tls.is_connected(), timeout=10)
    time.sleep(0.3)  # (the WebSocket subscription)
    for i in range(5):
        tls.publish("sensors/t", b"%d" % i, 1).wait_for_publish(5)
    got = collect(app, lambda g: len(g) >= 5, timeout=20)
    assert [(m.topic, m.payload) for m in got] == [("site1/sensors/t", b"%d" % i) for i in range(5)]
    assert wait_for(lambda: len(got_ws) >= 5, timeout=10) and got_ws[:5] == [b"%d" % i for i in range(5)]
    # the bridge's way in, published here as its local_username (the ACL's user bridge)
    cloud = paho_client(remote.port, version=4)

    def probe():
        cloud.publish("site1/cmd/go", b"go", 1)
        return collect(alice, lambda g: g, timeout=0.3)
    got = wait_for(probe, timeout=20, interval=0.1)
    assert got and got[0].topic == "fromcloud/cmd/go", b.log
    assert os.path.isdir(tmp_path / "data" / "log")  # persistence_location became the data dir
    for c in (alice, ws, tls, app, cloud):
        c.loop_stop()
    remote.close()


def test_what_is_not_a_mosquitto_file_is_refused(tmp_path):
    toml = tmp_path / "wrenmq.toml"
    toml.write_text('[[listener]]\nport = 1883\n')
    r = run("config", "import", toml)
    assert r.returncode == 2 and "does not read as a Mosquitto configuration file" in r.stderr, r.stderr
    r = run("config", "import", tmp_path / "missing.conf")
    assert r.returncode == 2 and "cannot read" in r.stderr, r.stderr
