"""Helpers of the admin listener's tests: a served broker with an admin listener, HTTP calls."""

import base64
import http.client
import json
import subprocess

from conftest import WRENMQ, ServedBroker, free_port, wait_port

PASSWORDS = {"ops": "ops-secret", "viewer": "viewer-secret", "device": "device-secret"}


def make_password_file(path):
    from wrenmq.auth.passwords import hash_password

    path.write_text("".join(f"{u}:{hash_password(p)}\n" for u, p in PASSWORDS.items()))
    return path


def make_token(token_file, name, read_only=False):
    """A token made by the CLI users run (`wrenmq admin token add`)."""
    args = [WRENMQ, "admin", "token", "add", name, "--file", str(token_file)]
    if read_only:
        args.append("--read-only")
    out = subprocess.run(args, capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip()


class AdminBroker:
    """`wrenmq serve` with an MQTT listener (its `port`) and an admin listener (`admin_port`)."""

    def __init__(self, tmp_path, extra="", admin_keys=None, delay=0.3, storage='fsync = "never"'):
        self.tmp = tmp_path
        self.admin_port = free_port()
        self.pwfile = make_password_file(tmp_path / "passwords")
        self.token_file = tmp_path / "tokens"
        self.token_file.write_text("")
        keys = admin_keys if admin_keys is not None else (
            'users = ["ops"]\nreadonly_users = ["viewer"]\n'
            f'token_file = "{self.token_file}"\n')
        self.config = (
            "[[listener]]\nport = 0\n"
            f'[[listener]]\ntype = "admin"\nport = {self.admin_port}\n{keys}'
            f'[auth]\npassword_file = "{self.pwfile}"\nfailed_login_delay = {delay}\nallow_anonymous = true\n'
            f'[storage]\ndata_dir = "{tmp_path / "data"}"\n{storage}\n'
            "[sys]\ninterval = 1\n" + extra)
        self.served = ServedBroker(tmp_path, self.config)
        self.port = self.served.port
        wait_port(self.admin_port, proc=self.served.proc)

    def restart(self):
        self.served.stop()
        self.served.start()
        wait_port(self.admin_port, proc=self.served.proc)

    def stop(self):
        self.served.stop()

    def call(self, method, path, auth=("ops", PASSWORDS["ops"]), body=None, headers=None, token=None,
             timeout=20):
        return call(self.admin_port, method, path, auth, body, headers, token, timeout)


def basic(user, password):
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def call(port, method, path, auth=None, body=None, headers=None, token=None, timeout=20):
    """(status, headers, JSON or text) of one request over a real socket."""
    h = dict(headers or {})
    if token is not None:
        h["Authorization"] = f"Bearer {token}"
    elif auth is not None and "Authorization" not in h:
        h["Authorization"] = basic(*auth)
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        h.setdefault("Content-Type", "application/json")
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=data, headers=h)
        r = conn.getresponse()
        raw = r.read()
        ctype = r.headers.get("Content-Type", "")
        parsed = json.loads(raw) if raw and ctype.startswith("application/json") else raw.decode(errors="replace")
        return r.status, r.headers, parsed
    finally:
        conn.close()
