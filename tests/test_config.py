"""TOML configuration: defaults, a full file, one-line errors, and the real CLI."""

import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import wrenmq
from wrenmq.config import ConfigError, load

WRENMQ = str(Path(sys.executable).with_name("wrenmq"))


def write(tmp_path, text, name="wrenmq.toml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults():
    cfg = load()
    assert [(lst.bind, lst.port) for lst in cfg.listener] == [("127.0.0.1", 1883)]
    assert cfg.listener[0].loopback_only
    assert cfg.broker.maximum_qos == 2
    assert cfg.broker.retain_available is True
    assert cfg.broker.queue_qos0_messages is False
    assert cfg.limits.max_packet_size == 1048576
    assert cfg.limits.receive_maximum == 1024
    assert cfg.limits.connect_timeout == 10.0
    assert cfg.auth.allow_anonymous is None  # not set: decided per listener
    assert cfg.sys.interval == 10.0
    assert cfg.logging.level == "info"


@pytest.mark.parametrize("text", ["", "# nothing here\n", "[broker]\n", "[limits]\n[auth]\n"])
def test_empty_file_gives_defaults(tmp_path, text):
    path = write(tmp_path, text)
    cfg = load(path)
    assert [(lst.bind, lst.port) for lst in cfg.listener] == [("127.0.0.1", 1883)]
    assert cfg.limits == load().limits
    assert cfg.source == str(path)


def test_default_listener_lists_are_not_shared():
    a, b = load(), load()
    a.listener[0].port = 1
    assert b.listener[0].port == 1883


FULL = """\
[[listener]]
bind = "0.0.0.0"
port = 1884
name = "public"

[[listener]]
bind = "::1"
port = 0

[broker]
node_id = "node-a"
maximum_qos = 1
retain_available = false
wildcard_subscriptions = false
shared_subscriptions = false
subscription_identifiers = false
queue_qos0_messages = true

[limits]
max_keepalive = 600
max_packet_size = 65536
receive_maximum = 10
max_inflight = 20
max_queued_messages = 0
max_connections = 0
topic_alias_maximum = 0
max_session_expiry = 86400
max_message_expiry = 3600
connect_timeout = 2      # an integer is fine for a float key
max_topic_levels = 16
write_buffer_high = 4096

[auth]
allow_anonymous = false
password_file = "/etc/wrenmq/passwd"
acl_file = "acl.conf"

[sys]
interval = 0.5

[logging]
level = "debug"
"""


def test_full_file(tmp_path):
    path = write(tmp_path, FULL)
    cfg = load(path)
    assert cfg.source == str(path)
    assert [(lst.bind, lst.port, lst.name) for lst in cfg.listener] == [
        ("0.0.0.0", 1884, "public"), ("::1", 0, "")]
    assert not cfg.listener[0].loopback_only and cfg.listener[1].loopback_only
    b = cfg.broker
    assert (b.node_id, b.maximum_qos, b.retain_available, b.wildcard_subscriptions,
            b.shared_subscriptions, b.subscription_identifiers, b.queue_qos0_messages) == (
        "node-a", 1, False, False, False, False, True)
    lim = cfg.limits
    assert (lim.max_keepalive, lim.max_packet_size, lim.receive_maximum, lim.max_inflight,
            lim.max_queued_messages, lim.max_connections, lim.topic_alias_maximum,
            lim.max_session_expiry, lim.max_message_expiry, lim.max_topic_levels,
            lim.write_buffer_high) == (600, 65536, 10, 20, 0, 0, 0, 86400, 3600, 16, 4096)
    assert lim.connect_timeout == 2.0 and type(lim.connect_timeout) is float
    assert (cfg.auth.allow_anonymous, cfg.auth.password_file, cfg.auth.acl_file) == (
        False, "/etc/wrenmq/passwd", "acl.conf")
    assert cfg.sys.interval == 0.5
    assert cfg.logging.level == "debug"
    assert load(text=FULL).limits == lim


@pytest.mark.parametrize("text", [
    "[[listener]]\nport = 0\n[[listener]]\nport = 65535\n",
    "[broker]\nmaximum_qos = 0\n",
    "[limits]\nmax_packet_size = 64\nmax_queued_messages = 10000000\n",
    "[limits]\nmax_session_expiry = 4294967295\nmax_message_expiry = 0\n",
    "[limits]\nconnect_timeout = 0.1\n",
    "[limits]\nconnect_timeout = 3600\n",
    "[sys]\ninterval = 0\n",
])
def test_boundary_values_accepted(tmp_path, text):
    load(write(tmp_path, text))


# (id, file text, dotted key, what the message must say was expected)
ERRORS = [
    ("unknown-top-level-key", "foo = 1\n", "foo", "unknown key"),
    ("unknown-top-level-table", "[brokr]\nmaximum_qos = 1\n", "brokr", "unknown key"),
    ("source-is-not-a-key", 'source = "x"\n', "source", "unknown key"),
    ("unknown-key-in-broker", "[broker]\nmaximum_qoss = 1\n", "broker.maximum_qoss",
     "unknown key"),
    ("unknown-key-in-limits", "[limits]\nmax_packet = 1\n", "limits.max_packet", "unknown key"),
    ("unknown-key-in-listener", "[[listener]]\nprot = 1883\n", "listener[0].prot",
     "unknown key"),
    ("unknown-key-in-second-listener", "[[listener]]\nport = 1\n[[listener]]\nbnd = \"x\"\n",
     "listener[1].bnd", "unknown key"),
    ("nested-table-in-section", "[broker.extra]\nx = 1\n", "broker.extra", "unknown key"),
    ("string-for-int", '[limits]\nmax_packet_size = "1MB"\n', "limits.max_packet_size",
     "expected an integer"),
    ("string-for-int-port", '[[listener]]\nport = "1883"\n', "listener[0].port",
     "expected an integer"),
    ("float-for-int", "[limits]\nreceive_maximum = 10.5\n", "limits.receive_maximum",
     "expected an integer"),
    ("integral-float-for-int", "[[listener]]\nport = 1883.0\n", "listener[0].port",
     "expected an integer"),
    ("bool-for-int", "[limits]\nmax_inflight = true\n", "limits.max_inflight",
     "expected an integer"),
    ("int-for-bool", "[broker]\nretain_available = 1\n", "broker.retain_available",
     "expected true or false"),
    ("string-for-bool", '[auth]\nallow_anonymous = "yes"\n', "auth.allow_anonymous",
     "expected true or false"),
    ("string-for-float", '[sys]\ninterval = "10s"\n', "sys.interval", "expected a number"),
    ("bool-for-float", "[limits]\nconnect_timeout = false\n", "limits.connect_timeout",
     "expected a number"),
    ("int-for-string", "[auth]\npassword_file = 5\n", "auth.password_file", "expected a string"),
    ("bool-for-string", "[[listener]]\nbind = true\n", "listener[0].bind", "expected a string"),
    ("array-for-int", "[limits]\nmax_inflight = [1]\n", "limits.max_inflight",
     "expected an integer"),
    ("port-too-large", "[[listener]]\nport = 70000\n", "listener[0].port", "<= 65535"),
    ("port-negative", "[[listener]]\nport = -1\n", "listener[0].port", ">= 0"),
    ("maximum-qos-3", "[broker]\nmaximum_qos = 3\n", "broker.maximum_qos", "<= 2"),
    ("receive-maximum-0", "[limits]\nreceive_maximum = 0\n", "limits.receive_maximum", ">= 1"),
    ("max-packet-size-too-small", "[limits]\nmax_packet_size = 10\n", "limits.max_packet_size",
     ">= 64"),
    ("session-expiry-too-large", "[limits]\nmax_session_expiry = 4294967296\n",
     "limits.max_session_expiry", "<= 4294967295"),
    ("connect-timeout-0", "[limits]\nconnect_timeout = 0\n", "limits.connect_timeout",
     ">= 0.1"),
    ("connect-timeout-inf", "[limits]\nconnect_timeout = inf\n", "limits.connect_timeout",
     "<= 3600"),
    ("connect-timeout-nan", "[limits]\nconnect_timeout = nan\n", "limits.connect_timeout",
     "expected"),
    ("sys-interval-negative", "[sys]\ninterval = -1\n", "sys.interval", ">= 0"),
    ("sys-interval-nan", "[sys]\ninterval = nan\n", "sys.interval", "expected"),
    ("bad-log-level", '[logging]\nlevel = "verbose"\n', "logging.level",
     "expected one of debug, info, warning, error, critical"),
    ("log-level-not-a-string", "[logging]\nlevel = 10\n", "logging.level", "expected a string"),
    ("listener-as-table", "[listener]\nport = 1884\n", "listener",
     "expected an array of tables ([[listener]])"),
    ("listener-as-int", "listener = 5\n", "listener", "expected an array of tables"),
    ("listener-array-of-ints", "listener = [1, 2]\n", "listener", "expected an array of tables"),
    ("section-as-value", "broker = 5\n", "broker", "expected a table ([broker])"),
    ("section-as-array", "[[limits]]\nmax_inflight = 1\n", "limits", "expected a table"),
    ("duplicate-listener", "[[listener]]\nport = 1884\n[[listener]]\nport = 1884\n",
     "listener[1]", "duplicate listener 127.0.0.1:1884"),
    ("cluster-node-slash", '[cluster]\nnode = "a/b"\n', "cluster.node", "no '/'"),
    ("cluster-empty-name", '[cluster]\nname = ""\n', "cluster.name", "must not be empty"),
    ("cluster-etcd-no-port", '[cluster]\netcd = ["localhost"]\n', "cluster.etcd", "expected host:port"),
    ("cluster-etcd-empty", "[cluster]\netcd = []\n", "cluster.etcd", "at least one endpoint"),
    ("cluster-advertise-needed", '[cluster]\nenabled = true\nbind = "0.0.0.0"\n', "cluster.advertise",
     "required when bind is '0.0.0.0'"),
    ("cluster-bad-advertise", '[cluster]\nadvertise = "host"\n', "cluster.advertise", "expected host:port"),
    ("cluster-lease-too-short", "[cluster]\nlease_ttl = 1\n", "cluster.lease_ttl", ">= 2"),
    ("cluster-tls-no-cert", "[cluster]\ntls = true\n", "cluster.certfile", "required when tls = true"),
    ("cluster-cert-without-tls", '[cluster]\ncafile = "ca.pem"\n', "cluster.cafile", "only used with tls = true"),
    ("cluster-tls-missing-file", '[cluster]\ntls = true\ncertfile = "/nonexistent.pem"\ncafile = "/nonexistent.pem"\n',
     "cluster.certfile", "file not found"),
    ("cluster-etcd-ca-without-tls", '[cluster]\netcd_cafile = "ca.pem"\n', "cluster.etcd_cafile",
     "only used with etcd_tls = true"),
    ("cluster-etcd-tls-missing-file", '[cluster]\netcd_tls = true\netcd_cafile = "/nonexistent.pem"\n',
     "cluster.etcd_cafile", "file not found"),
    ("cluster-etcd-key-without-cert", '[cluster]\netcd_tls = true\netcd_keyfile = "/etc/hostname"\n',
     "cluster.etcd_keyfile", "needs etcd_certfile"),
    ("cluster-min-insync-over-replicas", "[cluster]\nreplicas = 2\nmin_insync = 3\n", "cluster.min_insync",
     "3 is more than replicas (2)"),
    ("cluster-replicas-without-cluster", '[storage]\nmode = "disk"\n[cluster]\nreplicas = 3\n', "cluster.replicas",
     "3 needs a cluster"),
    ("cluster-replicas-in-memory", '[storage]\nmode = "memory"\n[cluster]\nenabled = true\nreplicas = 3\n',
     "cluster.replicas", 'needs [storage] mode = "disk"'),
    ("cluster-fetch-timeout-under-heartbeat", '[storage]\nmode = "disk"\n[cluster]\nenabled = true\nreplicas = 3\n'
     "replica_heartbeat_ms = 500\nreplica_fetch_timeout_ms = 500\n", "cluster.replica_fetch_timeout_ms",
     "must be more than replica_heartbeat_ms"),
]


@pytest.mark.parametrize("text, key, expected", [pytest.param(*e[1:], id=e[0]) for e in ERRORS])
def test_config_errors(tmp_path, text, key, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path)
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith(f"{path}: {key}: "), msg
    assert expected in msg, msg


@pytest.mark.parametrize("text, key, expected", [
    pytest.param(*e[1:], id=e[0]) for e in ERRORS
    if e[0] in ("unknown-key-in-listener", "float-for-int", "bad-log-level", "listener-as-table",
                "duplicate-listener")
])
def test_config_errors_from_text(text, key, expected):
    with pytest.raises(ConfigError) as info:
        load(text=text)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"<string>: {key}: ") and expected in msg, msg


def test_unknown_key_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, "[logging]\nlevl = \"debug\"\n"))
    assert "known here: backup_count, file, format, level, max_bytes" in str(info.value)


@pytest.mark.parametrize("text", ["[broker\n", "port = \n", "a = 1\na = 2\n", "x = 'unterminated\n"])
def test_invalid_toml_is_one_line_with_the_path(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and "TOML" in msg, msg


def test_missing_file(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load(path)
    assert str(info.value) == f"{path}: file not found"


# --------------------------------------------------------------------------- the CLI

def run(*args, timeout=30):
    return subprocess.run([WRENMQ, *args], capture_output=True, text=True, timeout=timeout)


def test_cli_version():
    r = run("--version")
    assert r.returncode == 0
    assert r.stdout.strip() == f"wrenmq {wrenmq.__version__}"


def test_cli_config_check_ok(tmp_path):
    # `config check` also reads the password and ACL files the configuration names.
    (tmp_path / "passwd").write_text("")
    (tmp_path / "acl.conf").write_text("")
    path = write(tmp_path, FULL.replace("/etc/wrenmq/passwd", str(tmp_path / "passwd"))
                 .replace('"acl.conf"', f'"{tmp_path / "acl.conf"}"'))
    r = run("config", "check", str(path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"{path}: OK (2 listener(s))"
    assert r.stderr == ""


@pytest.mark.parametrize("text, key, expected", [
    pytest.param(*e[1:], id=e[0]) for e in ERRORS
    if e[0] in ("unknown-key-in-broker", "int-for-bool", "listener-as-table", "port-too-large")
])
def test_cli_config_check_bad(tmp_path, text, key, expected):
    path = write(tmp_path, text)
    r = run("config", "check", str(path))
    assert r.returncode == 2
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"wrenmq: {path}: {key}: ") and expected in lines[0], lines[0]


def test_cli_config_check_missing_file(tmp_path):
    r = run("config", "check", str(tmp_path / "missing.toml"))
    assert r.returncode == 2
    assert r.stderr.splitlines() == [f"wrenmq: {tmp_path / 'missing.toml'}: file not found"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port):
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_cli_serve_refuses_bad_config(tmp_path):
    port = free_port()
    # the listener itself is fine: only the typo further down must stop the broker
    path = write(tmp_path, f'[[listener]]\nbind = "127.0.0.1"\nport = {port}\n'
                           "[limits]\nmax_inflight = 10\nreceive_maximun = 5\n")
    check = run("config", "check", str(path))
    r = run("serve", "--config", str(path))
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"wrenmq: {path}: limits.receive_maximun: unknown key"), lines[0]
    assert lines == check.stderr.splitlines()
    assert not listening(port)


def test_cli_serve_missing_config(tmp_path):
    port = free_port()
    r = run("serve", "--config", str(tmp_path / "missing.toml"), "--port", str(port))
    assert r.returncode != 0
    assert r.stderr.splitlines() == [f"wrenmq: {tmp_path / 'missing.toml'}: file not found"]
    assert not listening(port)


MOSQUITTO_CONF = """\
# A Mosquitto 2 configuration, as found on an edge gateway
pid_file /run/mosquitto/mosquitto.pid
persistence true
persistence_location /var/lib/mosquitto/

listener 1883
allow_anonymous true
password_file /etc/mosquitto/passwd

# to the cloud
connection cloud
address cloud.example.com:8883
topic sensors/# out 1
"""


def test_cli_serve_recognises_a_mosquitto_file_and_says_where_its_settings_go(tmp_path):
    path = tmp_path / "mosquitto.conf"
    path.write_text(MOSQUITTO_CONF)
    port = free_port()
    r = run("serve", "--config", str(path), "--port", str(port))
    assert r.returncode == 2
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    msg = lines[0]
    assert msg.startswith(f"wrenmq: {path}: this is a Mosquitto configuration file ("), msg
    for directive in ("pid_file", "persistence", "listener", "allow_anonymous", "password_file", "connection"):
        assert directive in msg
    assert "docs/CONFIG.md" in msg and "Coming from Mosquitto" in msg
    assert f"Convert it with `wrenmq config import {path}`" in msg
    assert "Expected '='" not in msg
    assert not listening(port)
    assert run("config", "check", str(path)).stderr == r.stderr
    # The table the message points to is in docs/CONFIG.md, with every directive found.
    doc = (Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md").read_text()
    table = doc.split("## Coming from Mosquitto", 1)[1]
    for directive in ("listener", "allow_anonymous", "persistence", "password_file", "connection"):
        assert f"| `{directive}` |" in table


@pytest.mark.parametrize("text", [
    "[[listener]]\nport 1883\n",  # TOML with a typo, not Mosquitto: a table header
    "listen 1883\nallow_anonymus true\n",  # not Mosquitto's directives either
    "a = 1\nb = 2\nlistener 1883\n",  # mostly TOML
])
def test_a_broken_toml_file_is_not_taken_for_a_mosquitto_one(tmp_path, text):
    with pytest.raises(ConfigError) as info:
        load(write(tmp_path, text))
    assert "not valid TOML" in str(info.value) and "Mosquitto" not in str(info.value)


def test_mosquitto_directives_are_recognised_as_mosquitto_writes_them():
    from wrenmq.mosquitto_config import mosquitto_directives

    assert mosquitto_directives(MOSQUITTO_CONF) == [
        "pid_file", "persistence", "persistence_location", "listener", "allow_anonymous", "password_file",
        "connection", "address", "topic"]
    assert mosquitto_directives("listener 8883 0.0.0.0\ncertfile /x.pem  # TLS\nplugin_opt_x 1\n") == [
        "listener", "certfile", "plugin_opt_x"]
    assert mosquitto_directives("# comments only\n") == []


def test_config_md_is_generated_from_the_code():
    """docs/CONFIG.md is `wrenmq config docs`: a key added or changed here shows there."""
    from pathlib import Path

    from wrenmq.config_docs import config_markdown
    doc = Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md"
    assert doc.read_text() == config_markdown(), "run: wrenmq config docs > docs/CONFIG.md"


def test_example_config_serves_what_it_says(serve_broker):
    """examples/wrenmq.toml, as a user would start it (its fixed ports swapped for free
    ones): MQTT with publishes to devices/# recorded in the log, and the metrics port."""
    import re
    import urllib.request

    from conftest import free_port, wait_port
    example = (Path(__file__).resolve().parent.parent / "examples" / "wrenmq.toml").read_text()
    ws_port, metrics_port = free_port(), free_port()
    text = example.replace("port = 9001", f"port = {ws_port}").replace("port = 9234", f"port = {metrics_port}")
    b = serve_broker(text)
    wait_port(ws_port, proc=b.proc)
    wait_port(metrics_port, proc=b.proc)
    sub = subprocess.Popen(["mosquitto_sub", "-p", str(b.port), "-t", "devices/#", "-C", "1", "-W", "10"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.2)  # (retained: a subscription that comes later still gets it)
    subprocess.run(["mosquitto_pub", "-p", str(b.port), "-t", "devices/d1/temp", "-m", "21.5", "-q", "1", "-r"],
                   check=True, timeout=10)
    assert sub.communicate(timeout=15)[0].strip() == "21.5"
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    assert re.search(r"^wrenmq_log_appended_records_total [1-9]", text, re.M), text
    assert re.search(r"^wrenmq_publish_received_total 1$", text, re.M), text


def test_example_config_tls_block_is_valid_once_uncommented(tmp_path):
    """The commented TLS listener of examples/wrenmq.toml, uncommented with real files."""
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert("127.0.0.1")
    files = {}
    for name, blob in (("server.crt", leaf.cert_chain_pems[0]), ("server.key", leaf.private_key_pem),
                       ("devices-ca.crt", ca.cert_pem)):
        blob.write_to_path(str(tmp_path / name))
        files[f"/etc/wrenmq/{name}"] = str(tmp_path / name)
    example = (Path(__file__).resolve().parent.parent / "examples" / "wrenmq.toml").read_text()
    block = example.split("# [[listener]]\n", 1)[1].split("\n\n", 1)[0]
    lines = ["[[listener]]"]
    for line in block.splitlines():
        line = line.removeprefix("# ")
        if "crlfile" in line:
            continue  # (a CRL of our own would need signing; the key is covered in test_transports)
        for old, new in files.items():
            line = line.replace(old, new)
        lines.append(line)
    cfg = load(text="\n".join(lines) + "\n")
    (lst,) = cfg.listener
    assert lst.tls and lst.require_certificate and lst.use_identity_as_username and lst.port == 8883
