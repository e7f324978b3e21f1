"""Reading a cluster's commit log over the network (the source's `wrenmq://` form; no pyspark).

    .load("wrenmq://node-a:8081,node-b:8081")      any one node's admin listener is enough

The nodes serve their log on their admin listeners (admin/logread.py): the list of partitions
with the nodes that serve each, the first offset at or after a time, and a range of records
as an Arrow IPC stream in the source's schema. This module is the client of those: the
driver lists partitions and offsets (`NetReaders`, the network twin of `common.Readers`);
each Spark task reads one planned range (`read_range`) straight from a node that serves it.

A range is read exactly once whatever fails on the way: every server of a partition has the
same record at the same offset, and no server serves past its durable end, so when a read
breaks off (a node killed, a connection cut, a server behind: 416) it resumes at the offset
after the last row it passed on, on the next server of the partition, the list of servers
asked again of the cluster when all of them failed, until `retryTimeoutMs` passes with no
progress. A range counts as read only when its stream ended with the server's end marker.
Wrong credentials (401, 403) fail at once.

HTTP is the standard library's `http.client` (one connection per request: a range is one long
response); TLS with the system's CAs or `cafile`.
"""

import base64
import http.client
import json
import logging
import random
import ssl
import time
import urllib.parse

log = logging.getLogger("wrenmq.pipeline")

SCHEME = "wrenmq://"
END_KEY = b"wrenmq.end"  # (admin/logread.py) the metadata of the batch that ends a complete range
THROUGH_KEY = b"wrenmq.through"  # ... of an empty batch: every record before it was sent
PARTITIONS = "/api/v1/log/partitions"
DEFAULT_REQUEST_TIMEOUT = 30.0  # seconds a request may wait for the next bytes
DEFAULT_RETRY_TIMEOUT = 120.0  # seconds a read keeps trying without progress before it fails


def is_network_path(path):
    """Whether a source path names brokers (`wrenmq://...`, or http(s):// admin URLs)."""
    p = str(path or "").strip().lower()
    return p.startswith(SCHEME) or p.startswith("http://") or p.startswith("https://")


class NetError(Exception):
    """A request that did not give what was asked (a status, a cut stream, a socket error)."""

    def __init__(self, message, status=None, offsets=None):
        super().__init__(message)
        self.status = status
        self.offsets = offsets  # (start, durable end) the server said it holds (410, 416)


class AccessRefused(NetError):
    """401 or 403 (the credentials are wrong or may not read), or a TLS certificate that
    does not verify: asking again, or another server, will not differ."""


class Net:
    """Where the cluster is and how to talk to it; small and picklable (shipped to the tasks)."""

    def __init__(self, seeds, username=None, password=None, token=None, cafile=None, tls=None,
                 request_timeout=DEFAULT_REQUEST_TIMEOUT, retry_timeout=DEFAULT_RETRY_TIMEOUT, compression=None):
        self.username = username
        self.password = password
        self.token = token
        self.cafile = cafile
        self.tls = bool(cafile) if tls is None else tls
        self.seeds = parse_seeds(seeds, self.tls)
        self.request_timeout = request_timeout
        self.retry_timeout = retry_timeout
        self.compression = compression
        self._context = None

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_context"] = None
        return state

    def __repr__(self):  # (no credentials in logs)
        return f"Net({', '.join(self.seeds)})"

    def headers(self):
        h = {"User-Agent": "wrenmq-spark-source"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        elif self.username is not None:
            cred = f"{self.username}:{self.password or ''}".encode()
            h["Authorization"] = "Basic " + base64.b64encode(cred).decode()
        return h

    def context(self):
        if self._context is None:
            self._context = ssl.create_default_context(cafile=self.cafile or None)
        return self._context

    def open(self, url, target, timeout=None):
        """An answered request (http.client.HTTPResponse, status 200), or NetError."""
        u = urllib.parse.urlsplit(url)
        timeout = timeout or self.request_timeout
        if u.scheme == "https":
            conn = http.client.HTTPSConnection(u.hostname, u.port or 443, timeout=timeout, context=self.context())
        elif u.scheme == "http":
            conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=timeout)
        else:
            raise NetError(f"{url}: not an http(s) URL")
        try:
            conn.request("GET", target, headers=self.headers())
            r = conn.getresponse()
        except ssl.SSLCertVerificationError as e:
            conn.close()  # (the certificate will not change by asking again)
            raise AccessRefused(f"{url}: {_why(e)}") from None
        except (OSError, http.client.HTTPException) as e:
            conn.close()
            hint = ""
            if u.scheme == "http" and isinstance(e, (http.client.RemoteDisconnected, ConnectionResetError)):
                hint = " (an HTTPS listener? give cafile / --cafile, or https://HOST:PORT)"
            raise NetError(f"{url}: {_why(e)}{hint}") from None
        if r.status == 200:
            r.conn = conn  # (closed with the response)
            return r
        try:
            body = r.read(64 * 1024)
        except (OSError, http.client.HTTPException):
            body = b""
        finally:
            conn.close()
        try:
            message = json.loads(body).get("error") or body.decode(errors="replace")
        except (ValueError, AttributeError):
            message = body.decode(errors="replace")[:300]
        offsets = None
        held = r.headers.get("X-Wrenmq-Offsets")
        if held:
            a, _, b = held.partition("-")
            offsets = (int(a), int(b))
        cls = AccessRefused if r.status in (401, 403) else NetError
        raise cls(f"{url}{target.split('?')[0]}: {r.status} {message}".strip(), r.status, offsets)

    def get_json(self, url, target, timeout=None):
        r = self.open(url, target, timeout)
        try:
            return json.loads(r.read())
        except (OSError, http.client.HTTPException, ValueError) as e:
            raise NetError(f"{url}: {_why(e)}") from None
        finally:
            r.conn.close()


def _why(e):
    if isinstance(e, ssl.SSLCertVerificationError):
        return f"TLS: {e.verify_message} (give the listener's CA with cafile / --cafile)"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def parse_seeds(spec, tls=False):
    """'wrenmq://a:8081,b:8081' (or 'a:8081,...', or http(s)://... URLs) -> base URLs."""
    if isinstance(spec, (list, tuple)):
        spec = ",".join(spec)
    text = str(spec or "").strip()
    if text.lower().startswith(SCHEME):
        text = text[len(SCHEME):]
    out = []
    for item in text.split(","):
        item = item.strip().rstrip("/")
        if not item:
            continue
        if "://" not in item:
            item = f"{'https' if tls else 'http'}://{item}"
        u = urllib.parse.urlsplit(item)
        if u.scheme not in ("http", "https") or not u.hostname or u.path not in ("", "/"):
            raise ValueError(f"wrenmq source: {item!r} is not HOST:PORT of an admin listener")
        try:
            u.port  # noqa: B018 (validates it)
        except ValueError:
            raise ValueError(f"wrenmq source: {item!r}: the port is not a number") from None
        out.append(f"{u.scheme}://{u.netloc}")
    if not out:
        raise ValueError("wrenmq source: give the brokers' admin listeners: wrenmq://HOST:PORT[,HOST:PORT...]")
    return tuple(dict.fromkeys(out))


# --- the driver side: the listing ---------------------------------------------------------------------

class NetPartitionView:
    """One partition as the listing shows it, with what `common.Readers`' LogReaders offer
    the source's driver (start_offset, durable_end_offset, offset_for_time)."""

    def __init__(self, name, servers, net):
        self.name = name
        self.servers = servers  # [{"node", "admin", "start_offset", "end_offset", ...}], preferred first
        self.net = net
        self.start_offset = min(s["start_offset"] for s in servers)
        self.durable_end_offset = max(s["end_offset"] for s in servers)
        self.end_offset = self.durable_end_offset

    @property
    def urls(self):
        return tuple(s["admin"] for s in self.servers)

    def offset_for_time(self, ts_us):
        errors = []
        target = f"{PARTITIONS}/{urllib.parse.quote(self.name, safe='')}/offset?timestamp={int(ts_us)}"
        for url in self.urls:
            try:
                return int(self.net.get_json(url, target)["offset"])
            except AccessRefused:
                raise
            except (NetError, KeyError, TypeError, ValueError) as e:
                errors.append(str(e))
        raise NetError(f"wrenmq source: no server of partition {self.name!r} answered: {'; '.join(errors)}")

    def close(self):
        pass


def list_partitions(net, urls=None, retry_for=0.0, unreachable=None):
    """{partition: servers} as the first node that answers lists them; `urls` are asked in
    order (the seeds by default). Keeps asking for `retry_for` seconds while none answers.
    The nodes the answering node could not reach are put in `unreachable` (a dict)."""
    deadline = time.monotonic() + retry_for
    delay = 0.2
    while True:
        errors = []
        for url in urls or net.seeds:
            try:
                data = net.get_json(url, PARTITIONS)
            except AccessRefused:
                raise
            except NetError as e:
                errors.append(str(e))
                continue
            out = {}
            for p in data.get("partitions", ()):
                if p.get("servers"):
                    out[p["partition"]] = p["servers"]
            if unreachable is not None:
                unreachable.update(data.get("unreachable") or {})
            return out
        if time.monotonic() >= deadline:
            raise NetError("wrenmq source: no node of the cluster answered: " + "; ".join(errors))
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


class NetReaders:
    """The network twin of `common.Readers` (driver only): `refresh()` lists the cluster's
    partitions that a node serves now. Partitions seen before keep their last known servers
    in `servers` (for planning a range a checkpoint already holds), and every admin URL seen
    is asked next time if the seeds do not answer. With `retry` (a streaming query) a
    listing that no node answers is asked again for `retryTimeoutMs`, else it fails at once."""

    def __init__(self, net, retry=True):
        self.net = net
        self.retry_for = net.retry_timeout if retry else 0.0
        self.readers = {}
        self.servers = {}  # partition -> its server URLs, as last listed
        self.known = list(net.seeds)
        self.unreachable = frozenset()

    def refresh(self):
        down = {}
        listing = list_partitions(self.net, self.known, self.retry_for, down)
        if frozenset(down) != self.unreachable:  # (said when it changes, not at every trigger)
            self.unreachable = frozenset(down)
            if down:
                log.warning("wrenmq source: node(s) not answering: %s; the partitions only they serve wait",
                            ", ".join(f"{n} ({why})" for n, why in sorted(down.items())))
            else:
                log.warning("wrenmq source: every node answers again")
        self.readers = {name: NetPartitionView(name, servers, self.net) for name, servers in sorted(listing.items())}
        for name, view in self.readers.items():
            self.servers[name] = view.urls
            for url in view.urls:
                if url not in self.known:
                    self.known.append(url)
        return self.readers

    def close(self):
        self.readers.clear()


# --- the task side: one range ----------------------------------------------------------------------------

def _records_target(partition, start, end, topics, net):
    q = {"start": str(start), "end": str(end)}
    if topics:
        q["topics"] = json.dumps(list(topics))
    if net.compression:
        q["compression"] = net.compression
    return f"{PARTITIONS}/{urllib.parse.quote(partition, safe='')}/records?{urllib.parse.urlencode(q)}"


def fetch_range(net, url, partition, start, end, topics=None):
    """Yield (RecordBatch or None, next offset) of one request for [start, end) of
    `partition` at `url` (None: no rows, the server's progress only); NetError unless the
    stream ends with the server's end marker for `end`."""
    import pyarrow as pa

    r = net.open(url, _records_target(partition, start, end, topics, net))
    try:
        try:
            reader = pa.ipc.open_stream(r)
            while True:
                try:
                    rb, meta = reader.read_next_batch_with_custom_metadata()
                except StopIteration:
                    raise NetError(f"{url}: the records of {partition!r} {start}-{end} ended without their end "
                                   "marker (cut off)") from None
                if meta is not None and meta.get(END_KEY) is not None:
                    if int(meta.get(END_KEY)) != end:
                        raise NetError(f"{url}: the end marker says {meta.get(END_KEY)!r}, {end} was asked")
                    return
                if rb.num_rows:
                    yield rb, rb.column(0)[rb.num_rows - 1].as_py() + 1
                elif meta is not None and meta.get(THROUGH_KEY) is not None:
                    yield None, int(meta.get(THROUGH_KEY))
        except (OSError, http.client.HTTPException, pa.ArrowException) as e:
            raise NetError(f"{url}: reading the records of {partition!r} {start}-{end}: {_why(e)}") from None
    finally:
        r.close()
        r.conn.close()


def read_range(net, partition, urls, start, end, topics=None, fail_on_data_loss=True):
    """Yield the records [start, end) of `partition` as RecordBatches, each offset once,
    from whichever of its servers (`urls`, preferred first) can give them (see the module
    docstring: resume after the last row passed on, other servers, rediscovery)."""
    pos = start
    urls = list(urls)
    errors = []
    last_progress = time.monotonic()
    delay = 0.2
    while pos < end:
        gone = []
        for url in urls:
            try:
                for rb, pos in fetch_range(net, url, partition, pos, end, topics):
                    last_progress = time.monotonic()
                    if rb is not None:
                        yield rb
                return
            except AccessRefused:
                raise
            except NetError as e:
                errors.append(str(e))
                if e.status == 410 and e.offsets:
                    gone.append(e.offsets[0])
                log.warning("wrenmq source: %s; trying the partition's next server", e)
        if gone and len(gone) == len(urls):
            first = min(gone)
            msg = (f"wrenmq source: records {pos}-{min(end, first) - 1} of partition {partition!r} were deleted "
                   "by retention before they were read")
            if fail_on_data_loss:
                raise RuntimeError(msg + " (set failOnDataLoss=false to go on)")
            log.warning("%s; skipping them", msg)
            pos = first
            continue
        if time.monotonic() - last_progress > net.retry_timeout:
            raise RuntimeError(f"wrenmq source: partition {partition!r} offsets {pos}-{end - 1}: no server could "
                               f"serve them for {net.retry_timeout:g} s: " + "; ".join(errors[-4:]))
        time.sleep(delay * (0.5 + random.random()))
        delay = min(delay * 2, 5.0)
        urls = _rediscover(net, partition, urls)


def _rediscover(net, partition, urls):
    """The partition's servers as the cluster lists them now (a node that took it over
    appears), else the same ones again."""
    try:
        listing = list_partitions(net, list(dict.fromkeys([*urls, *net.seeds])))
    except AccessRefused:
        raise
    except NetError:
        return urls
    servers = listing.get(partition)
    return [s["admin"] for s in servers] if servers else urls

