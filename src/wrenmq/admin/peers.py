"""Asking the other nodes of a cluster: every node's API answers for the whole cluster.

Each node tells etcd where its admin listener is (`Cluster.advertise_info("admin", url)`,
done by listener.py); a request that concerns the whole cluster (clients, subscriptions,
the log's partitions, bans, one client wherever it is) is answered by this node and by
asking the same of the others' admin listeners, with `local=true` (so they answer for
themselves only) and the caller's own credentials (the nodes share a password file and a
token file, as they share their MQTT users). A node that does not answer within
`TIMEOUT` is named in the answer's `unreachable` and the rest is answered.

The HTTP client is h11 over asyncio streams, one short connection per request.
"""

import asyncio
import json
import ssl
import time
import urllib.parse

import h11

TIMEOUT = 5.0
NO_ADMIN = "no admin listener known"  # (the reason given for a node that told etcd of none)
MAX_ANSWER = 64 * 1024 * 1024
_URLS_FOR = 2.0  # seconds the nodes' addresses, read from etcd, are reused


async def fetch(url, method, target, headers=(), body=None, timeout=TIMEOUT, context=None):
    """(status, parsed JSON or None) of one request to `url` (an admin listener)."""
    u = urllib.parse.urlsplit(url)
    tls = u.scheme == "https"
    reader, writer = await asyncio.wait_for(asyncio.open_connection(
        u.hostname, u.port or (443 if tls else 80), ssl=(context or ssl.create_default_context()) if tls else None),
        timeout)
    try:
        conn = h11.Connection(h11.CLIENT)
        hdrs = [("Host", u.netloc), ("Connection", "close"), *headers]
        if body is not None:
            hdrs += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
        out = conn.send(h11.Request(method=method, target=target, headers=hdrs))
        if body:
            out += conn.send(h11.Data(data=body))
        out += conn.send(h11.EndOfMessage())
        writer.write(out)
        status, chunks, size = None, [], 0
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                left = deadline - asyncio.get_running_loop().time()
                conn.receive_data(await asyncio.wait_for(reader.read(65536), max(0.01, left)))
            elif isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                size += len(event.data)
                if size > MAX_ANSWER:
                    raise OSError("answer too large")
                chunks.append(event.data)
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        raw = b"".join(chunks)
        return status, (json.loads(raw) if raw else None)
    finally:
        writer.close()


class Peers:
    """The other nodes' admin listeners, as one node's API asks them."""

    def __init__(self, admin):
        self.admin = admin
        self._urls = None  # ({node: url}, when read)
        cfg = admin.cfg
        self.context = ssl.create_default_context(cafile=cfg.cafile) if cfg.tls and cfg.cafile else None

    @property
    def active(self):
        cluster = self.admin.broker.cluster
        return cluster is not None and bool(cluster.peers)

    async def urls(self):
        cached = self._urls
        if cached is not None and time.monotonic() - cached[1] < _URLS_FOR:
            return cached[0]
        try:
            urls = await self.admin.listener.peer_admins()
        except Exception:
            urls = cached[0] if cached is not None else {}
        self._urls = (urls, time.monotonic())
        return urls

    async def ask_all(self, request, method, path, params=None, body=None):
        """{node: (status, data)} of the same request to every other node, `local=true`
        added; a node that failed has (None, "reason")."""
        urls = await self.urls()
        cluster = self.admin.broker.cluster
        names = list(cluster.peers) if cluster is not None else []
        query = dict(params if params is not None else request.query)
        query["local"] = "true"
        target = path + "?" + urllib.parse.urlencode(query)
        headers = []
        auth = request.headers.get("authorization")
        if auth is not None:
            headers.append(("Authorization", auth))
        data = json.dumps(body).encode() if body is not None else None

        async def one(name):
            url = urls.get(name)
            if url is None:
                return name, (None, NO_ADMIN)
            try:
                return name, await fetch(url, method, target, headers, data, context=self.context)
            except (OSError, asyncio.TimeoutError, ValueError, h11.ProtocolError) as e:
                return name, (None, f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)

        return dict(await asyncio.gather(*(one(n) for n in names)))
