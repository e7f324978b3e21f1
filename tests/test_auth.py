"""Authentication: Mosquitto password files ($6$/$7$), `wrenmq passwd`, the anonymous policy,
the failed-login delay, custom hooks behind the file, and reload (SIGHUP / `wrenmq reload`).

Interop both ways with Debian's mosquitto 2.0: files written by `mosquitto_passwd` verify
here, files written by `wrenmq passwd` are accepted by the `mosquitto` broker, and
`mosquitto_pub -u/-P` logs in to wrenmq.
"""

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import WRENMQ, RawClient, free_port, paho_client, wait_port
from wrenmq.auth.passwords import PasswordFile, PasswordFileError, hash_password, parse_hash
from wrenmq.broker.hooks import Hook
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import PINGREQ, PINGRESP, Connack, Connect

V311 = C.MQTT311
V5 = C.MQTT5


def _which(cmd):
    found = shutil.which(cmd)
    if found:
        return found
    for d in ("/usr/sbin", "/usr/local/sbin", "/sbin"):
        if os.access(f"{d}/{cmd}", os.X_OK):
            return f"{d}/{cmd}"
    return None


MOSQUITTO = _which("mosquitto")
MOSQUITTO_PASSWD = _which("mosquitto_passwd")
MOSQUITTO_PUB = _which("mosquitto_pub")
needs_mosquitto = pytest.mark.skipif(not (MOSQUITTO and MOSQUITTO_PASSWD and MOSQUITTO_PUB),
                                     reason="Debian's mosquitto / mosquitto-clients not installed")


def run(*args, input=None, timeout=20, **kw):
    return subprocess.run(args, input=input, capture_output=True, text=True, timeout=timeout, **kw)


def wrenmq_passwd(*args, input=None):
    # A new session: no controlling terminal, so the prompts read stdin (like a pipe in a shell).
    return run(WRENMQ, "passwd", *args, input=input, start_new_session=True)


def connack(port, version=V5, username=None, password=None, client_id="c"):
    """The CONNACK reason code a CONNECT gets (the connection is then closed)."""
    c = RawClient(port, version)
    try:
        c.send(Connect(client_id, version, username=username, password=password))
        ack = c.recv()
        assert isinstance(ack, Connack), ack
        return ack.reason_code
    finally:
        c.close()


def auth_config(password_file="", extra="", delay=0.1):
    text = f"[auth]\nfailed_login_delay = {delay}\n"
    if password_file:
        text += f'password_file = "{password_file}"\n'
    return text + extra


@pytest.fixture
def pwfile(tmp_path):
    path = tmp_path / "passwd"
    r = wrenmq_passwd("-c", "-b", str(path), "alice", "alice-pw")
    assert r.returncode == 0, r.stderr
    r = wrenmq_passwd("-b", str(path), "bob", "bob-pw")
    assert r.returncode == 0, r.stderr
    return path


# --- the file format ---------------------------------------------------------------------

def test_hash_written_like_mosquitto_passwd():
    h = hash_password("secret", salt=bytes(range(12)))
    assert re.fullmatch(r"\$7\$101\$[A-Za-z0-9+/]{16}\$[A-Za-z0-9+/]{86}==", h), h
    e = parse_hash(h)
    assert (e.kind, e.iterations, e.salt) == (7, 101, bytes(range(12)))
    assert e.verify(b"secret") and e.verify("secret")
    assert not e.verify(b"Secret") and not e.verify(b"") and not e.verify(None)


@needs_mosquitto
@pytest.mark.parametrize("algo,prefix", [("sha512-pbkdf2", "$7$101$"), ("sha512", "$6$")])
def test_file_from_mosquitto_passwd_verifies(tmp_path, algo, prefix):
    path = tmp_path / "pw"
    r = run(MOSQUITTO_PASSWD, "-H", algo, "-c", "-b", str(path), "carol", "c-pw ünï")
    assert r.returncode == 0, r.stderr
    r = run(MOSQUITTO_PASSWD, "-H", algo, "-b", str(path), "dave", "d:pw$")
    assert r.returncode == 0, r.stderr
    assert path.read_text().split(":", 1)[1].startswith(prefix)
    pf = PasswordFile.load(path)
    assert sorted(pf.users) == ["carol", "dave"]
    assert pf.get("carol").verify("c-pw ünï".encode())
    assert pf.get("dave").verify(b"d:pw$")
    assert not pf.get("carol").verify(b"d:pw$")
    assert pf.get("nobody") is None


@pytest.mark.parametrize("text,where", [
    ("alice\n", ":1: expected user:hash"),
    ("alice:secret\n", ":1: user 'alice': not a $6$ or $7$ hash"),
    ("# c\n\nalice:$5$abc$def\n", ":3: user 'alice': unknown hash type $5$"),
    ("alice:$7$0$AAAAAAAAAAAAAAAA$" + "A" * 86 + "==\n", ":1: user 'alice': bad iteration count"),
    ("alice:$7$101$AAAAAAAAAAAAAAAA$QUJD\n", ":1: user 'alice': hash is not 64 bytes"),
    ("alice:$6$!!$" + "A" * 86 + "==\n", ":1: user 'alice': salt is not valid base64"),
    (":$6$AAAA$" + "A" * 86 + "==\n", ":1: empty user name"),
    ("a:{h}\nb:{h}\na:{h}\n", ":3: user 'a' appears twice"),
])
def test_bad_password_file_names_file_and_line(tmp_path, text, where):
    path = tmp_path / "pw"
    path.write_text(text.replace("{h}", hash_password("x")))
    with pytest.raises(PasswordFileError) as e:
        PasswordFile.load(path)
    assert str(e.value).startswith(f"{path}{where}"), str(e.value)


def test_comments_and_blank_lines_ignored(tmp_path):
    path = tmp_path / "pw"
    path.write_text(f"# users\n\n  \nalice:{hash_password('a')}\r\n bob : {hash_password('b')} \n")
    pf = PasswordFile.load(path)
    assert pf.get("alice").verify(b"a") and pf.get("bob").verify(b"b")


# --- wrenmq passwd -----------------------------------------------------------------------

def test_passwd_create_update_delete(tmp_path):
    path = tmp_path / "pw"
    r = wrenmq_passwd("-b", str(path), "alice", "x")
    assert r.returncode == 1 and "Unable to open password file" in r.stderr  # no -c: must exist
    assert wrenmq_passwd("-c", "-b", str(path), "alice", "a1").returncode == 0
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    path.write_text("# our users\n" + path.read_text())
    assert wrenmq_passwd("-b", str(path), "bob", "b1").returncode == 0
    assert wrenmq_passwd("-b", str(path), "alice", "a2").returncode == 0  # update in place
    lines = path.read_text().splitlines()
    assert lines[0] == "# our users" and [ln.split(":")[0] for ln in lines[1:]] == ["alice", "bob"]
    pf = PasswordFile.load(path)
    assert pf.get("alice").verify(b"a2") and not pf.get("alice").verify(b"a1")
    assert pf.get("bob").verify(b"b1")

    r = wrenmq_passwd("-D", str(path), "nobody")
    assert r.returncode == 1 and "User nobody not found" in r.stderr
    assert wrenmq_passwd("-D", str(path), "alice").returncode == 0
    assert sorted(PasswordFile.load(path).users) == ["bob"]

    assert wrenmq_passwd("-c", "-b", str(path), "carol", "c").returncode == 0  # -c overwrites
    assert sorted(PasswordFile.load(path).users) == ["carol"]


@pytest.mark.parametrize("args,message", [
    (("-c", "-D", "F", "u"), "-c and -D cannot be used together"),
    (("-b", "-D", "F", "u", "p"), "-b and -D cannot be used together"),
    (("-c", "-b", "F", "a:b", "p"), "must not contain the ':' character"),
    (("-c", "-b", "F", "a\tb", "p"), "must not contain control characters"),
    (("-c", "F", "u", "p"), "needs -b"),
    (("-c", "-b", "F", "u"), "-b needs the password"),
])
def test_passwd_usage_errors(tmp_path, args, message):
    args = [str(tmp_path / "pw") if a == "F" else a for a in args]
    r = wrenmq_passwd(*args)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert not (tmp_path / "pw").exists()


def test_passwd_prompts_twice(tmp_path):
    path = tmp_path / "pw"
    r = wrenmq_passwd("-c", str(path), "alice", input="s3cret\ns3cret\n")
    assert r.returncode == 0, r.stderr
    assert "Password: " in r.stderr and "Reenter password: " in r.stderr
    assert "s3cret" not in r.stdout + r.stderr
    assert PasswordFile.load(path).get("alice").verify(b"s3cret")
    r = wrenmq_passwd(str(path), "alice", input="one\ntwo\n")
    assert r.returncode == 1 and "Passwords do not match" in r.stderr
    r = wrenmq_passwd(str(path), "alice", input="\n\n")
    assert r.returncode == 1 and "Empty password" in r.stderr
    assert PasswordFile.load(path).get("alice").verify(b"s3cret")  # unchanged


@needs_mosquitto
def test_mosquitto_accepts_file_from_wrenmq_passwd(tmp_path, pwfile):
    """Debian's mosquitto broker with a password file written by `wrenmq passwd`."""
    port = free_port()
    conf = tmp_path / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {pwfile}\n"
                    "persistence false\n"
                    # As root mosquitto would switch to the mosquitto user, who may not read
                    # our private (0600) file in pytest's private tmp dir.
                    + ("user root\n" if os.geteuid() == 0 else ""))
    proc = subprocess.Popen([MOSQUITTO, "-c", str(conf)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    try:
        wait_port(port, proc=proc)
        base = [MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(port), "-t", "t", "-m", "x"]
        for version in ("mqttv311", "mqttv5"):
            ok = run(*base, "-V", version, "-u", "alice", "-P", "alice-pw")
            assert ok.returncode == 0, ok.stderr
            bad = run(*base, "-V", version, "-u", "alice", "-P", "bob-pw")
            assert bad.returncode != 0 and "authori" in bad.stderr.lower(), bad.stderr
    finally:
        proc.terminate()
        proc.wait(10)


# --- logging in ------------------------------------------------------------------------

@pytest.mark.parametrize("version", [V311, V5])
def test_password_check(make_broker, pwfile, version):
    b = make_broker(auth_config(pwfile))
    bad_credentials = 4 if version == V311 else 0x86
    not_authorized = 5 if version == V311 else 0x87
    assert connack(b.port, version, "alice", b"alice-pw") == 0
    assert connack(b.port, version, "bob", b"bob-pw") == 0
    assert connack(b.port, version, "alice", b"bob-pw") == bad_credentials
    assert connack(b.port, version, "alice", None) == bad_credentials
    assert connack(b.port, version, "mallory", b"alice-pw") == bad_credentials
    assert connack(b.port, version) == not_authorized  # a password file, allow_anonymous not set
    b2 = make_broker(auth_config(pwfile, "allow_anonymous = false\n"))
    assert connack(b2.port, version) == not_authorized
    assert connack(b2.port, version, "alice", b"alice-pw") == 0
    assert b.broker.auth.logins_failed == 3


@needs_mosquitto
def test_mosquitto_pub_logs_in(make_broker, pwfile):
    b = make_broker(auth_config(pwfile, "allow_anonymous = false\n"))
    base = [MOSQUITTO_PUB, "-h", "127.0.0.1", "-p", str(b.port), "-t", "t", "-m", "x"]
    for version in ("mqttv311", "mqttv5"):
        ok = run(*base, "-V", version, "-u", "bob", "-P", "bob-pw")
        assert ok.returncode == 0, ok.stderr
        bad = run(*base, "-V", version, "-u", "bob", "-P", "nope")
        assert bad.returncode != 0
        anon = run(*base, "-V", version)
        assert anon.returncode != 0 and "not authori" in anon.stderr.lower(), anon.stderr


@needs_mosquitto
def test_broker_uses_file_from_mosquitto_passwd(make_broker, tmp_path):
    path = tmp_path / "pw"
    assert run(MOSQUITTO_PASSWD, "-c", "-b", str(path), "carol", "c-pw").returncode == 0
    assert run(MOSQUITTO_PASSWD, "-H", "sha512", "-b", str(path), "dave", "d-pw").returncode == 0
    b = make_broker(auth_config(path))
    c = paho_client(b.port, username="carol", password="c-pw")
    assert c.connack[0] == 0
    c.disconnect()
    c.loop_stop()
    assert connack(b.port, V311, "dave", b"d-pw") == 0
    assert connack(b.port, V311, "dave", b"c-pw") == 4


def test_failed_login_delay_does_not_hold_others(make_broker, pwfile):
    b = make_broker(auth_config(pwfile, "allow_anonymous = true\n", delay=1.0))
    connected = RawClient(b.port, V5)
    connected.send(Connect("already", V5, username="alice", password=b"alice-pw"))
    assert connected.recv().reason_code == 0

    result = {}

    def bad_login():
        t0 = time.monotonic()
        result["rc"] = connack(b.port, V5, "alice", b"wrong", client_id="bad")
        result["t"] = time.monotonic() - t0

    t = threading.Thread(target=bad_login)
    t.start()
    time.sleep(0.1)  # the bad CONNECT is in, waiting out its delay
    t0 = time.monotonic()
    assert connack(b.port, V5, "bob", b"bob-pw", client_id="good") == 0
    assert connack(b.port, V5, client_id="anon") == 0
    connected.send(PINGREQ)
    assert connected.recv() == PINGRESP
    others = time.monotonic() - t0
    assert "rc" not in result  # still waiting
    t.join(5)
    assert result["rc"] == 0x86
    assert result["t"] >= 0.9, result
    assert others < 0.5, f"other clients took {others:.2f}s while a failed login was delayed"
    # Unknown users wait just as long (no hint whether the name exists).
    t0 = time.monotonic()
    assert connack(b.port, V311, "nobody", b"x") == 4
    assert time.monotonic() - t0 >= 0.9
    connected.close()


def test_many_failed_logins_at_once(make_broker, pwfile):
    """50 bad logins in parallel: all refused after about one delay, not 50 of them."""
    b = make_broker(auth_config(pwfile, delay=0.5))
    clients = []
    t0 = time.monotonic()
    for i in range(50):
        c = RawClient(b.port, V311)
        c.send(Connect(f"b{i}", V311, username="alice", password=b"guess%d" % i))
        clients.append(c)
    assert connack(b.port, V311, "alice", b"alice-pw") == 0
    assert time.monotonic() - t0 < 0.5
    for c in clients:
        assert c.recv(timeout=5).reason_code == 4
        c.close()
    assert time.monotonic() - t0 < 2.5


# --- anonymous access by listener ------------------------------------------------------

PUBLIC = '[[listener]]\nbind = "0.0.0.0"\nport = 0\nname = "public"\n'


@pytest.mark.parametrize("setting,loopback,public", [
    ("", 0, 0x87),                          # not set: only loopback listeners
    ("allow_anonymous = true\n", 0, 0),
    ("allow_anonymous = false\n", 0x87, 0x87),
])
def test_anonymous_by_listener(make_broker, setting, loopback, public):
    b = make_broker(PUBLIC + "[auth]\n" + setting)
    public_port = b.broker.addresses[1][1]
    assert connack(b.port, V5) == loopback
    assert connack(public_port, V5) == public
    assert connack(public_port, V311) == (5 if public else 0)
    # Without a password file a user name is not checked: it is let in where anonymous is.
    assert connack(public_port, V5, "someone", b"pw") == public


def test_password_users_on_public_listener(make_broker, pwfile):
    b = make_broker(PUBLIC + auth_config(pwfile))
    public_port = b.broker.addresses[1][1]
    assert connack(public_port, V5, "alice", b"alice-pw") == 0
    assert connack(public_port, V5, "alice", b"bad") == 0x86
    assert connack(public_port, V5) == 0x87
    assert connack(b.port, V5, "alice", b"alice-pw") == 0


@pytest.mark.parametrize("setting,anonymous", [
    ("", "refused"),  # as Mosquitto: a password file means clients log in, on loopback too
    ("allow_anonymous = true\n", "accepted"),
    ("allow_anonymous = false\n", "refused"),
])
def test_password_file_refuses_anonymous_unless_allowed(make_broker, pwfile, caplog, setting, anonymous):
    """With a password file and allow_anonymous not set, anonymous clients are refused on
    every listener, loopback ones included (their publishes would otherwise be accepted
    and, with an ACL that names only users, dropped without a word)."""
    caplog.set_level(logging.INFO, "wrenmq.auth")
    b = make_broker(PUBLIC + auth_config(pwfile, setting))
    public_port = b.broker.addresses[1][1]
    for port in (b.port, public_port):
        expected = {V5: 0, V311: 0} if anonymous == "accepted" else {V5: 0x87, V311: 5}
        assert connack(port, V5) == expected[V5]
        assert connack(port, V311) == expected[V311]
        assert connack(port, V311, "alice", b"alice-pw") == 0
    if not setting:
        assert "allow_anonymous = true allows it" in caplog.text


def test_anonymous_setting_documented():
    from wrenmq.config import load
    assert load(text="").auth.allow_anonymous is None
    assert load(text="[auth]\nallow_anonymous = false\n").auth.allow_anonymous is False
    docs = (Path(__file__).resolve().parent.parent / "docs" / "CONFIG.md").read_text()
    assert "loopback" in docs and "failed_login_delay" in docs and "pid_file" in docs


# --- custom hooks behind the file ------------------------------------------------------

class Tokens(Hook):
    def __init__(self):
        self.asked = []

    async def authenticate(self, client, connect):
        self.asked.append(connect.username)
        if connect.username == "svc":
            return connect.password == b"token-1"
        if connect.username == "banned":
            return C.BANNED
        return None


def test_custom_hook_decides_what_the_file_does_not(make_broker, pwfile):
    hook = Tokens()
    b = make_broker(PUBLIC + auth_config(pwfile), hooks=[hook])
    public_port = b.broker.addresses[1][1]
    assert connack(public_port, V5, "svc", b"token-1") == 0
    assert connack(public_port, V5, "svc", b"token-2") == 0x86
    assert connack(public_port, V5, "banned", b"x") == C.BANNED
    assert connack(public_port, V5, "alice", b"alice-pw") == 0  # the file decides alice
    assert connack(public_port, V5, "alice", b"token-1") == 0x86
    assert connack(public_port, V5, "stranger", b"x") == 0x86  # nobody knows them
    assert connack(public_port, V5) == 0x87
    assert "alice" not in hook.asked and "stranger" in hook.asked


# --- startup and reload --------------------------------------------------------------------

def test_bad_file_stops_startup(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text(f"alice:{hash_password('a')}\nbob:plain\n")
    cfg = tmp_path / "w.toml"
    cfg.write_text(f'[auth]\npassword_file = "{pw}"\n[storage]\nmode = "memory"\n')
    r = run(WRENMQ, "config", "check", str(cfg))
    assert r.returncode == 2 and f"{pw}:2: user 'bob'" in r.stderr, r.stderr
    r = run(WRENMQ, "serve", "--config", str(cfg), "--port", str(free_port()))
    assert r.returncode == 2 and f"{pw}:2: user 'bob'" in r.stderr, r.stderr
    cfg.write_text(f'[auth]\npassword_file = "{tmp_path / "missing"}"\n')
    r = run(WRENMQ, "config", "check", str(cfg))
    assert r.returncode == 2 and "cannot read password file" in r.stderr


def wait_log(served, pattern, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        m = re.search(pattern, served.log)
        if m:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"log never matched {pattern!r}:\n{served.log}")
        time.sleep(0.02)


def test_reload_passwords_with_sighup(serve_broker, tmp_path, pwfile):
    pid_file = tmp_path / "wrenmq.pid"
    cfg = (f'[broker]\npid_file = "{pid_file}"\n' + auth_config(pwfile, "allow_anonymous = false\n")
           + '[storage]\nmode = "memory"\n')
    b = serve_broker(cfg)
    assert pid_file.read_text().strip() == str(b.proc.pid)
    config_path = tmp_path / f"wrenmq-{b.port}.toml"

    alice = RawClient(b.port, V5)
    alice.send(Connect("alice-1", V5, username="alice", password=b"alice-pw"))
    assert alice.recv().reason_code == 0
    assert connack(b.port, V5, "carol", b"carol-pw") == 0x86

    # Add carol and remove alice; reload through the pid file named in the config.
    assert wrenmq_passwd("-b", str(pwfile), "carol", "carol-pw").returncode == 0
    assert wrenmq_passwd("-D", str(pwfile), "alice").returncode == 0
    r = run(WRENMQ, "reload", "--config", str(config_path))
    assert r.returncode == 0, r.stderr
    wait_log(b, r"reloaded auth files: 2 user\(s\)")
    assert connack(b.port, V5, "carol", b"carol-pw") == 0
    assert connack(b.port, V5, "alice", b"alice-pw") == 0x86
    alice.send(PINGREQ)  # an open connection is not dropped by a reload
    assert alice.recv() == PINGRESP

    # A broken file: the old users stay, the log says why.
    good = pwfile.read_text()
    pwfile.write_text(good + "dave:notahash\n")
    r = run(WRENMQ, "reload", "--pid", str(b.proc.pid))
    assert r.returncode == 0, r.stderr
    wait_log(b, rf"reload failed, keeping the previous password and ACL files: {re.escape(str(pwfile))}:3: "
                r"user 'dave'")
    assert connack(b.port, V5, "carol", b"carol-pw") == 0
    assert connack(b.port, V5, "bob", b"bob-pw") == 0
    pwfile.unlink()
    b.proc.send_signal(signal.SIGHUP)
    wait_log(b, r"reload failed.*cannot read password file")
    assert connack(b.port, V5, "bob", b"bob-pw") == 0
    assert connack(b.port, V5) == 0x87  # never "open"
    alice.send(PINGREQ)
    assert alice.recv() == PINGRESP
    alice.close()
    assert b.stop() == 0
    assert not pid_file.exists()


def test_a_second_broker_does_not_take_a_running_brokers_pid_file(serve_broker, tmp_path):
    pid_file = tmp_path / "wrenmq.pid"
    cfg = f'[broker]\npid_file = "{pid_file}"\n[storage]\nmode = "memory"\n'
    first = serve_broker(cfg)
    assert pid_file.read_text().strip() == str(first.proc.pid)
    # Started by mistake with the same configuration: it stops before it listens.
    port = free_port()
    second = run(WRENMQ, "serve", "--config", str(tmp_path / f"wrenmq-{first.port}.toml"),
                 "--port", str(port), timeout=30)
    assert second.returncode == 1
    assert f"cannot write pid file {pid_file}: it names wrenmq process {first.proc.pid}" in second.stderr
    assert pid_file.read_text().strip() == str(first.proc.pid)
    assert first.stop() == 0 and not pid_file.exists()
    # A file left behind by a process that is gone (or is not wrenmq) is taken over.
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        pid_file.write_text(f"{sleeper.pid}\n")
        again = serve_broker(cfg)
        assert pid_file.read_text().strip() == str(again.proc.pid)
        assert again.stop() == 0 and not pid_file.exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_reload_command_errors(tmp_path):
    r = run(WRENMQ, "reload")
    assert r.returncode == 2 and "--pid" in r.stderr
    r = run(WRENMQ, "reload", "--pid-file", str(tmp_path / "none.pid"))
    assert r.returncode == 1 and "cannot read" in r.stderr
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        r = run(WRENMQ, "reload", "--pid", str(sleeper.pid))
        assert r.returncode == 1 and "is not wrenmq" in r.stderr
        assert sleeper.poll() is None  # not signalled
    finally:
        sleeper.kill()
        sleeper.wait()
    cfg = tmp_path / "w.toml"
    cfg.write_text("[broker]\n")
    r = run(WRENMQ, "reload", "--config", str(cfg))
    assert r.returncode == 2 and "pid_file" in r.stderr


# --- the example ---------------------------------------------------------------------------

def test_custom_auth_hook_example():
    """examples/custom_auth_hook.py: embedded broker, tokens from the environment."""
    example = Path(__file__).resolve().parent.parent / "examples" / "custom_auth_hook.py"
    port = free_port()
    env = dict(os.environ, WRENMQ_TOKENS="sensors=t0k3n-1:sensors,alerts=t0k3n-2:alerts")
    proc = subprocess.Popen([sys.executable, str(example), "--port", str(port)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_port(port, proc=proc)
        assert connack(port, V5, "sensors", b"t0k3n-1") == 0
        assert connack(port, V5, "sensors", b"t0k3n-2") == 0x86
        assert connack(port, V311, "alerts", b"nope") == 4
        assert connack(port, V5) == 0x87  # allow_anonymous = false in its config
        assert connack(port, V5, "stranger", b"x") == 0x87  # no password file, not a service
        c = paho_client(port, username="sensors", password="t0k3n-1")
        try:
            c.publish("alerts/fire", b"x", qos=1)
            assert c.acks.get(timeout=5)[2] == C.NOT_AUTHORIZED
            c.publish("sensors/kitchen", b"21.5", qos=1)
            assert c.acks.get(timeout=5)[2] == C.NO_MATCHING_SUBSCRIBERS
            c.subscribe("alerts/#", 1)
            assert [int(x.value) for x in c.acks.get(timeout=5)[2]] == [C.NOT_AUTHORIZED]
            c.subscribe("sensors/+", 1)
            assert [int(x.value) for x in c.acks.get(timeout=5)[2]] == [1]
        finally:
            c.disconnect()
            c.loop_stop()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
        assert proc.returncode == 0, out
        assert "token auth on 127.0.0.1" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
