"""`wrenmq top`: a running broker's rates, connections and drops in the terminal, in place.

Two ways to watch:

- `--admin URL` (an admin listener): its live figures (`/api/v1/events`), one sample a
  second; in a cluster every node's listener is read (their addresses come from
  `/api/v1/nodes`), a row each, with the cluster's totals.
- `--broker HOST:PORT` (any MQTT broker, Mosquitto too): its `$SYS/#` topics, which
  change every `[sys] interval` (10 s by default): rates are the differences between two
  updates.

The screen is redrawn every `--interval` seconds (ANSI: cursor home, clear); `--once`
prints one table when the figures have come and exits (for scripts). Ctrl-C quits.
"""

import argparse
import base64
import http.client
import json
import os
import ssl
import sys
import threading
import time
import urllib.parse

BLOCKS = " ▁▂▃▄▅▆▇█"
SPARK = 60


def add_parser(sub):
    p = sub.add_parser("top", help="a live terminal view of a running broker (rates, connections, drops)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--admin", metavar="URL", help="an admin listener, e.g. http://127.0.0.1:8081")
    src.add_argument("--broker", metavar="HOST:PORT", help="an MQTT listener: read its $SYS topics")
    p.add_argument("--user", "-u", help="user name (admin: HTTP Basic; broker: MQTT login)")
    p.add_argument("--password", "-P", help="its password (or WRENMQ_PASSWORD)")
    p.add_argument("--token", help="an admin API token (or WRENMQ_TOKEN)")
    p.add_argument("--cafile", help="CA certificate(s) to verify an https:// admin listener with")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between redraws (default 1)")
    p.add_argument("--once", action="store_true", help="print the figures once and exit")
    p.set_defaults(func=main)


# --- formatting ----------------------------------------------------------------------------


def num(v):
    if v is None:
        return "-"
    a = abs(v)
    if a >= 1e9:
        return f"{v / 1e9:.1f}G"
    if a >= 1e6:
        return f"{v / 1e6:.1f}M"
    if a >= 1e4:
        return f"{v / 1e3:.1f}k"
    if isinstance(v, float) and a < 100:
        return f"{v:.1f}"
    return f"{int(round(v))}"


def size(v):
    if v is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024


def spark(values):
    if not values:
        return ""
    top = max(values) or 1
    return "".join(BLOCKS[min(8, int(round(v / top * 8)))] for v in values[-SPARK:])


COLUMNS = (("node", 18, None), ("clients", 8, "connected"), ("sessions", 9, "sessions"),
           ("msgs in/s", 10, "r:msgs_in"), ("msgs out/s", 11, "r:msgs_out"),
           ("bytes in/s", 11, "b:bytes_in"), ("bytes out/s", 12, "b:bytes_out"),
           ("dropped/s", 10, "r:dropped"), ("refused", 8, "refused"), ("log records", 12, "log"))


def render(title, rows, history, note=""):
    """The screen's text: a line per node, the totals, sparklines of the totals' rates."""
    out = [f"wrenmq top - {title} - {time.strftime('%H:%M:%S')}   (Ctrl-C quits)", ""]
    out.append(" ".join(f"{name:>{w}}" if i else f"{name:<{w}}" for i, (name, w, _) in enumerate(COLUMNS)))
    total = {}
    for row in rows:
        cells = []
        for i, (_, w, key) in enumerate(COLUMNS):
            if key is None:
                cells.append(f"{row['node'][:w]:<{w}}")
                continue
            value = _value(row, key)
            if value is not None:
                total[key] = total.get(key, 0) + value
            cells.append(f"{(size(value) + '/s' if key.startswith('b:') and value is not None else num(value)):>{w}}")
        out.append(" ".join(cells))
    if len(rows) > 1:
        cells = [f"{'cluster':<{COLUMNS[0][1]}}"]
        for _, w, key in COLUMNS[1:]:
            v = total.get(key)
            cells.append(f"{(size(v) + '/s' if key.startswith('b:') and v is not None else num(v)):>{w}}")
        out.append(" ".join(cells))
    if not rows:
        out.append("(waiting for figures...)")
    out.append("")
    for label, key in (("msgs in/s ", "msgs_in"), ("msgs out/s", "msgs_out"), ("dropped/s ", "dropped")):
        values = history.get(key, [])
        latest = values[-1] if values else None
        out.append(f"{label} {spark(values):<{SPARK}} {num(latest)}")
    if note:
        out += ["", note]
    return "\n".join(out)


def _value(row, key):
    if key.startswith("r:") or key.startswith("b:"):
        return row.get("rates", {}).get(key[2:])
    if key == "log":
        f = row.get("figures", {})
        if "log_end_offset" in f:
            return f["log_end_offset"] - f.get("log_start_offset", 0)
        return None
    return row.get("figures", {}).get(key)


# --- sources ---------------------------------------------------------------------------------


class AdminSource:
    """The live figures of every node's admin listener, each read by a thread of its own."""

    def __init__(self, url, headers, context):
        self.url = url.rstrip("/")
        self.headers = headers
        self.context = context
        self.latest = {}  # node -> sample
        self.error = None
        self.lock = threading.Lock()

    def _conn(self, url, timeout=10):
        u = urllib.parse.urlsplit(url)
        if u.scheme == "https":
            return http.client.HTTPSConnection(u.hostname, u.port or 443, timeout=timeout, context=self.context)
        return http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)

    def get(self, url, path):
        conn = self._conn(url)
        try:
            conn.request("GET", path, headers=self.headers)
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise OSError(f"{url}{path}: {resp.status} {body.decode(errors='replace').strip()[:200]}")
            return json.loads(body)
        finally:
            conn.close()

    def start(self):
        nodes = self.get(self.url, "/api/v1/nodes")["nodes"]
        urls = [self.url]
        for n in nodes:
            if not n.get("self") and n.get("admin"):
                urls.append(n["admin"])
        for url in urls:
            threading.Thread(target=self._follow, args=(url,), daemon=True).start()

    def _follow(self, url):
        while True:
            try:
                conn = self._conn(url, timeout=30)
                conn.request("GET", "/api/v1/events", headers=dict(self.headers, Accept="text/event-stream"))
                resp = conn.getresponse()
                if resp.status != 200:
                    raise OSError(f"{url}: {resp.status} {resp.read().decode(errors='replace').strip()[:200]}")
                event = None
                while True:
                    line = resp.readline()
                    if not line:
                        break
                    line = line.decode().rstrip("\r\n")
                    if line.startswith("event:"):
                        event = line[6:].strip()
                    elif line.startswith("data:") and event in ("history", "sample"):
                        data = json.loads(line[5:])
                        sample = data[-1] if event == "history" and data else data
                        if sample:
                            with self.lock:
                                self.latest[sample["node"]] = sample
                                self.error = None
            except (OSError, ValueError, http.client.HTTPException) as e:
                with self.lock:
                    self.error = f"{url}: {e}"
            time.sleep(1)

    def rows(self):
        with self.lock:
            return [self.latest[n] for n in sorted(self.latest)], self.error


class SysSource:
    """A broker's $SYS topics over MQTT, turned into the admin feed's figures and rates."""

    COUNTERS = {"msgs_in": "$SYS/broker/messages/received", "msgs_out": "$SYS/broker/messages/sent",
                "bytes_in": "$SYS/broker/bytes/received", "bytes_out": "$SYS/broker/bytes/sent",
                "dropped": "$SYS/broker/publish/messages/dropped"}

    # Until two updates of a counter have been seen: the broker's own 1-minute averages.
    LOADS = {"msgs_in": "$SYS/broker/load/messages/received/1min",
             "msgs_out": "$SYS/broker/load/messages/sent/1min",
             "bytes_in": "$SYS/broker/load/bytes/received/1min",
             "bytes_out": "$SYS/broker/load/bytes/sent/1min",
             "dropped": "$SYS/broker/load/publish/dropped/1min"}

    def __init__(self, host, port, user, password):
        self.host, self.port, self.user, self.password = host, port, user, password
        self.measured = set()
        self.values = {}
        self.changed = {}  # topic -> monotonic time of its last change
        self.prev = {}  # counter -> (time, value) before its last change
        self.rates = {}
        self.error = None
        self.lock = threading.Lock()

    def start(self):
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self):
        import asyncio
        from .client import MqttClient

        async def follow():
            while True:
                try:
                    client = await MqttClient.connect(self.host, self.port, f"wrenmq-top-{os.getpid()}",
                                                      username=self.user, password=self.password,
                                                      on_message=self._message)
                    await client.subscribe(["$SYS/#"])
                    with self.lock:
                        self.error = None
                    await client.closed
                    raise OSError("connection closed")
                except Exception as e:
                    with self.lock:
                        self.error = f"{self.host}:{self.port}: {e}"
                await asyncio.sleep(1)

        asyncio.run(follow())

    def _message(self, topic, payload):
        text = payload.decode(errors="replace").split(" ")[0]
        try:
            value = float(text) if "." in text else int(text)
        except ValueError:
            value = payload.decode(errors="replace")
        now = time.monotonic()
        with self.lock:
            old = self.values.get(topic)
            self.values[topic] = value
            for name, t in self.COUNTERS.items():
                if t == topic and isinstance(value, (int, float)):
                    # The first value is a retained one of unknown age: a rate needs two
                    # that arrived while watching ($SYS sends every value each interval).
                    then = self.changed.get(topic)
                    if then is not None and now > then and isinstance(old, (int, float)):
                        self.rates[name] = max(0.0, (value - old) / (now - then))
                        self.measured.add(name)
                    if old is not None:
                        self.changed[topic] = now
                elif topic == self.LOADS.get(name) and name not in self.measured and isinstance(value, (int, float)):
                    self.rates[name] = value / 60.0  # the broker's 1-minute average, per minute

    def rows(self):
        with self.lock:
            v = self.values
            if not v:
                return [], self.error
            figures = {"connected": v.get("$SYS/broker/clients/connected"),
                       "sessions": v.get("$SYS/broker/clients/total"),
                       "refused": v.get("$SYS/broker/connections/refused")}
            if "$SYS/broker/log/end_offset" in v:
                figures["log_end_offset"] = v["$SYS/broker/log/end_offset"]
                figures["log_start_offset"] = v.get("$SYS/broker/log/start_offset", 0)
            node = v.get("$SYS/broker/cluster/node") or f"{self.host}:{self.port}"
            return [{"node": str(node), "figures": figures, "rates": dict(self.rates)}], self.error


# --- main ----------------------------------------------------------------------------------------


def main(args):
    password = args.password if args.password is not None else os.environ.get("WRENMQ_PASSWORD")
    token = args.token or os.environ.get("WRENMQ_TOKEN")
    if args.broker:
        host, _, port = args.broker.rpartition(":")
        if not host or not port.isdigit():
            print("wrenmq: --broker: expected HOST:PORT", file=sys.stderr)
            return 2
        source = SysSource(host, int(port), args.user, password)
        title = f"mqtt://{args.broker} ($SYS)"
        note = "Rates from $SYS: they move once per [sys] interval of the broker (the broker's 1-minute " \
               "averages until two updates have come)."
    else:
        url = args.admin or "http://127.0.0.1:8081"
        headers = {}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        elif args.user:
            cred = base64.b64encode(f"{args.user}:{password or ''}".encode()).decode()
            headers["Authorization"] = f"Basic {cred}"
        context = ssl.create_default_context(cafile=args.cafile) if args.cafile else None
        source = AdminSource(url, headers, context)
        title = url
        note = ""
    try:
        source.start()
    except (OSError, ValueError, http.client.HTTPException) as e:
        print(f"wrenmq: cannot read {title}: {e}", file=sys.stderr)
        return 1
    history = {"msgs_in": [], "msgs_out": [], "dropped": []}
    tty = sys.stdout.isatty() and not args.once
    if tty:
        sys.stdout.write("\x1b[?25l")  # hide the cursor
    started = time.monotonic()
    try:
        while True:
            rows, error = source.rows()
            if rows:
                for key in history:
                    history[key].append(sum(r.get("rates", {}).get(key, 0) for r in rows))
                    del history[key][:-SPARK]
            text = render(title, rows, history, error or note)
            if args.once:
                # ($SYS: once two updates have come, so the figures are of now, not retained ones)
                if rows and (not args.broker or source.measured or time.monotonic() - started > 25):
                    print(text)
                    return 0
                if time.monotonic() - started > 30:
                    print(text)
                    print(f"wrenmq: no figures from {title} within 30 s", file=sys.stderr)
                    return 1
            else:
                sys.stdout.write("\x1b[H\x1b[2J" + text.replace("\n", "\x1b[K\n") + "\x1b[K\n")
                sys.stdout.flush()
            time.sleep(args.interval if rows or not args.once else 0.2)
    except KeyboardInterrupt:
        return 0
    finally:
        if tty:
            sys.stdout.write("\x1b[?25h\n")
            sys.stdout.flush()
