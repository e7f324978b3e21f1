"""HTTP services the auth and webhook tests start: real servers on 127.0.0.1 threads.

- `AuthService`: EMQX's HTTP authentication contract, answering by user name
  (allow with rules, deny, ignore, 204, slow, superuser, expiring, broken JSON).
- `JwksService`: a JSON Web Key Set at /jwks.json.
- `WebhookReceiver`: counts the events POSTed to it and fails on purpose when told.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from wrenmq.ports import free_port


class _Server:
    def __init__(self, handler_cls):
        self.port = free_port()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", self.port), handler_cls)
        self.httpd.daemon_threads = True
        self.httpd.service = self
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real service does

    def log_message(self, *args):
        pass

    def _reply(self, code, body=None, content_type="application/json"):
        data = b"" if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        self.send_response(code)
        if code != 204:
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
        try:
            self.end_headers()
            if data and code != 204:
                self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the broker gave up waiting (the slow answers)

    def _read_json(self):
        n = int(self.headers.get("Content-Length", 0))
        return json.loads(self.rfile.read(n))


class _AuthHandler(_Handler):
    def do_POST(self):
        svc = self.server.service
        body = self._read_json()
        with svc.lock:
            svc.requests.append(body)
        user = body.get("username")
        answer = svc.answers.get(user, {"result": "ignore"})
        if callable(answer):
            answer = answer(body)
        if answer == "slow":
            time.sleep(svc.slow_seconds)
            answer = {"result": "allow"}
        if answer == 204:
            self._reply(204)
        elif answer == 500:
            self._reply(500, b"oops", "text/plain")
        elif answer == "not json":
            self._reply(200, b"allow", "text/plain")
        else:
            self._reply(200, answer)


class AuthService(_Server):
    """Answers by user name (`answers`: user -> JSON dict, 204, 500, "slow", "not json"
    or a function of the request body); others get {"result": "ignore"}."""

    def __init__(self, answers=None, slow_seconds=3.0):
        self.answers = dict(answers or {})
        self.slow_seconds = slow_seconds
        self.requests = []
        self.lock = threading.Lock()
        super().__init__(_AuthHandler)

    def count(self, user):
        with self.lock:
            return sum(1 for r in self.requests if r.get("username") == user)


class _JwksHandler(_Handler):
    def do_GET(self):
        svc = self.server.service
        svc.fetches += 1
        if self.path != "/jwks.json":
            self._reply(404, {"error": "not found"})
            return
        self._reply(200, {"keys": svc.keys})


class JwksService(_Server):
    def __init__(self, keys):
        self.keys = list(keys)
        self.fetches = 0
        super().__init__(_JwksHandler)


class _HookHandler(_Handler):
    def do_POST(self):
        svc = self.server.service
        body = self._read_json()
        with svc.lock:
            svc.posts += 1
            if svc.failing:
                svc.failed_posts += 1
                fail = True
            else:
                fail = False
                svc.events.extend(body)
        if fail:
            self._reply(503, {"error": "failing on purpose"})
        else:
            self._reply(200, {"ok": True})


class WebhookReceiver(_Server):
    def __init__(self):
        self.events = []
        self.posts = 0
        self.failed_posts = 0
        self.failing = False
        self.lock = threading.RLock()
        super().__init__(_HookHandler)

    def of(self, action):
        with self.lock:
            return [e for e in self.events if e.get("action") == action]

    def wait(self, pred, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if pred(self):
                    return True
            time.sleep(0.05)
        return False
