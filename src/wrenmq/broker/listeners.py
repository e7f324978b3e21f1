"""Listeners: how bytes reach a `Connection` - TCP, TLS, WebSocket and Unix sockets.

One `Listener` per `[[listener]]` table. Every kind ends in the same `Connection`
protocol; what differs is what sits in front of it:

- plain TCP (`type = "mqtt"`): nothing; the `Connection` looks at the first bytes when
  they are not a CONNECT. A TLS ClientHello (first byte 0x16) or an HTTP request on a
  plain MQTT port gets a clear log line and the connection is closed, instead of a
  confusing "protocol error" (or a client waiting for a handshake that never comes).
  Plain WebSocket listeners keep a `_PlainSniffer` in front of websockets for the same
  ClientHello check.
- TLS (`tls = true`): the socket is accepted plain and a `_TLSAcceptor` runs the
  handshake with `loop.start_tls()`. That way the handshake's outcome is ours to see:
  with `create_server(ssl=...)` both asyncio and uvloop drop handshake errors
  silently (they are OSErrors, logged only in debug mode), so a plain MQTT client on
  a TLS port would leave no trace. The acceptor logs why a handshake failed (plain
  MQTT, TLS too old, certificate refused, timeout), reads the listener's *current*
  `SSLContext` for every handshake (SIGHUP swaps in a new one: existing connections
  keep theirs), and hands the TLS transport to the `Connection`.
- WebSocket (`type = "ws"`): the `websockets` library speaks HTTP/WebSocket;
  `WebSocketTransport` adapts one WebSocket connection to the asyncio Transport the
  `Connection` expects (binary frames both ways, flow control both ways). For wss the
  same `_TLSAcceptor` sits under websockets (through its `create_connection` hook).
- Unix domain socket (`type = "unix"`): plain MQTT on a socket file whose mode is set
  before the first client can connect.
- Metrics (`type = "metrics"`): no MQTT; `websockets` parses the HTTP request (with its
  limits and timeout) and every request gets a plain HTTP answer, never an upgrade:
  the $SYS figures in Prometheus's text format at `path` (metrics.py), 404 elsewhere.
"""

import asyncio
import errno
import hashlib
import hmac
import http
import logging
import os
import re
import socket
import ssl
import stat
import time
import urllib.parse
import weakref

from ..mqtt import constants as C
from ..net.proxied import ProxyReader
from .connection import _HTTP_METHODS, _TLS_HANDSHAKE, Connection
from .hooks import ClientInfo, Hook

log = logging.getLogger("wrenmq.listeners")

DEFAULT_WS_PATH = "/mqtt"
DEFAULT_METRICS_PATH = "/metrics"
# Also answered by a metrics listener, without credentials: a probe (Kubernetes liveness
# and readiness) that the broker's event loop answers, with what stops it taking messages.
HEALTH_PATH = "/health"
# Connections a metrics listener holds at once. Prometheus scrapes over one; the bound
# keeps what a flood of idle connections (each kept up to the 5 s request timeout) holds.
METRICS_MAX_OPEN = 64
WS_SUBPROTOCOLS = ("mqtt", "mqttv3.1")

# OpenSSL reasons for "what arrived is not TLS at all" (plain MQTT, HTTP, ...).
_NOT_TLS = {"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "UNKNOWN_PROTOCOL",
            "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "BAD_PACKET_LENGTH"}
# ... for "TLS, but a version we refuse".
_OLD_TLS = {"UNSUPPORTED_PROTOCOL", "VERSION_TOO_LOW", "NO_PROTOCOLS_AVAILABLE",
            "TLSV1_ALERT_PROTOCOL_VERSION", "WRONG_SSL_VERSION"}
# ... for "the client certificate was missing or not trusted".
_BAD_CLIENT_CERT = {"PEER_DID_NOT_RETURN_A_CERTIFICATE", "CERTIFICATE_VERIFY_FAILED",
                    "NO_CERTIFICATE_RETURNED"}


class ListenerError(OSError):
    """A listener cannot start (bad certificate, socket path in use, ...)."""


def _peer(transport):
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer) if peer else "?"


def _ssl_message(exc):
    return re.sub(r"\s*\(_ssl\.c:\d+\)$", "", str(exc))


# --- TLS -----------------------------------------------------------------------


def build_ssl_context(cfg, where="listener"):
    """The server SSLContext of a `[[listener]]` with tls = true (TLS 1.2 or newer)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3 if cfg.min_tls_version == "1.3" else ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION
    try:
        ctx.load_cert_chain(cfg.certfile, cfg.keyfile or None)
    except (OSError, ValueError) as e:
        keys = "certfile/keyfile" if cfg.keyfile else "certfile"
        raise ListenerError(f"{where}.{keys}: cannot load {cfg.certfile}"
                            f"{' / ' + cfg.keyfile if cfg.keyfile else ''}: {_ssl_message(e)}") from None
    if cfg.cafile:
        try:
            ctx.load_verify_locations(cafile=cfg.cafile)
        except (OSError, ValueError) as e:
            raise ListenerError(f"{where}.cafile: cannot load {cfg.cafile}: {_ssl_message(e)}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_certificate else ssl.CERT_OPTIONAL
        if cfg.crlfile:
            try:
                ctx.load_verify_locations(cafile=cfg.crlfile)
            except (OSError, ValueError) as e:
                raise ListenerError(f"{where}.crlfile: cannot load {cfg.crlfile}: {_ssl_message(e)}") from None
            ctx.verify_flags |= ssl.VERIFY_CRL_CHECK_LEAF
    return ctx


def cert_common_name(cert):
    """The first commonName in the subject of a `getpeercert()` dict, or None."""
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return value
    return None


class CertClientInfo(ClientInfo):
    """`ClientInfo` on TLS listeners with a CA: hooks also see the client certificate.

    `peercert` is the verified certificate as `ssl.SSLSocket.getpeercert()` returns it
    (None without one); `cert_identity` is its CN when the listener has
    `use_identity_as_username`, else None. With it, the user name is the CN and the
    CONNECT's password is dropped: the verified certificate is the credential (as in
    Mosquitto), so a password check should not apply to such a client.
    """

    __slots__ = ("peercert", "cert_identity")

    def __init__(self, client_id, username, address, version, listener, peercert, cert_identity):
        super().__init__(client_id, username, address, version, listener)
        self.peercert = peercert
        self.cert_identity = cert_identity


class CertConnection(Connection):
    """A Connection on a TLS listener that verifies client certificates."""

    __slots__ = ("cert_identity",)

    def __init__(self, broker, listener, name=None):
        super().__init__(broker, listener, name)
        self.cert_identity = None

    def _peercert(self):
        t = self.transport
        return t.get_extra_info("peercert") if t is not None else None

    def _client_info(self, pkt):
        return CertClientInfo(pkt.client_id, pkt.username, self.address, pkt.version,
                              self.listener_name, self._peercert(), self.cert_identity)

    def _authenticate(self, pkt):
        if self.listener.use_identity_as_username:
            cn = cert_common_name(self._peercert())
            if cn is None:
                log.info("refusing %s: its client certificate has no CN to use as user name", self.address)
                self.refuse(pkt.version, C.NOT_AUTHORIZED)
                return
            self.cert_identity = cn
            pkt.username = cn
            pkt.password = None
        super()._authenticate(pkt)


class _Refused(asyncio.Protocol):
    """Stands in for a connection refused as it is accepted (a listener's bound): closes it
    at once, counted and logged as the broker counts refused MQTT connections."""

    def __init__(self, broker, listener_name, why):
        self.broker = broker
        self.listener_name = listener_name
        self.why = why
        self.address = None

    def connection_made(self, transport):
        peer = transport.get_extra_info("peername")
        self.address = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else str(peer)
        self.broker.refused(self, self.why)
        transport.abort()


def _counted(base, uncount):
    """A subclass of websockets' ServerConnection `base` counted from its accept by its
    listener's factory: `uncount()` runs once, at the first of `uncount`, its close, or
    `abandoned` (_TLSAcceptor: its TLS handshake failed, so it gets no connection_lost)."""

    class Counted(base):
        counted = True

        def uncount(self):
            if self.counted:
                self.counted = False
                uncount()

        def connection_lost(self, exc):
            self.uncount()
            super().connection_lost(exc)

        abandoned = uncount

    return Counted


class _Wrapper(asyncio.Protocol):
    """Base of the protocols that stand in front of the real one for a while."""

    def __init__(self, inner, listener):
        self.inner = inner
        self.listener = listener
        self.transport = None

    def __getattr__(self, name):
        # websockets looks at `connection.protocol` of what its create_connection returned.
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)


class _PlainSniffer(_Wrapper):
    """Look at the first bytes on a plain WebSocket listener, then get out of the way."""

    def connection_made(self, transport):
        self.transport = transport
        self.inner.connection_made(transport)

    def data_received(self, data):
        t = self.transport
        lst = self.listener
        if data[0] == _TLS_HANDSHAKE:
            log.warning("%s sent a TLS ClientHello to plain %s listener %s; closing (connect without "
                        "TLS, or use a listener with tls = true)", _peer(t), lst.kind, lst.label)
            t.abort()
            return
        inner = self.inner
        t.set_protocol(inner)  # from now on the transport talks to the inner protocol directly
        inner.data_received(data)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc):
        self.inner.connection_lost(exc)

    def pause_writing(self):
        self.inner.pause_writing()

    def resume_writing(self):
        self.inner.resume_writing()


# _TLSAcceptor phases
_RAW, _HANDSHAKE, _OPEN, _DONE = range(4)


class _TLSAcceptor(_Wrapper):
    """Run the TLS handshake of an accepted socket, log its failure, hand it over.

    uvloop starts reading a new connection right after `connection_made` even if the
    protocol paused it there, so the first bytes (usually the whole ClientHello) may
    reach this protocol before `start_tls()` has put its SSL protocol in place. They
    are sniffed (a first byte other than 0x16 is not TLS: logged, closed) and then fed
    to the SSL protocol through its BufferedProtocol interface before it starts the
    handshake. Between the end of the handshake and the moment the inner protocol is
    connected, decrypted data is held and replayed in order.
    """

    def __init__(self, inner, listener):
        super().__init__(inner, listener)
        self.peer = "?"
        self.phase = _RAW
        self.early = []
        self.held = []
        self.eof = False
        self.lost = False
        self.lost_exc = None
        # An MQTT connection counts in the broker's handshakes until its Connection counts
        # itself (ws and metrics connections are counted by their own listener's factory).
        self.counted = listener.cfg.type == "mqtt"
        if self.counted:
            listener.broker.handshakes += 1

    def _uncount(self):
        if self.counted:
            self.counted = False
            self.listener.broker.handshakes -= 1

    def connection_made(self, transport):
        self.transport = transport
        self.peer = _peer(transport)
        transport.pause_reading()
        self.listener.broker.spawn(self._handshake())

    async def _handshake(self):
        try:
            await self._run_handshake()
        finally:
            self._uncount()
            if self.phase != _OPEN:
                # The inner protocol never saw the connection: a WebSocket or metrics one
                # that counts itself uncounts now (it gets no connection_lost).
                abandoned = getattr(self.inner, "abandoned", None)
                if abandoned is not None:
                    abandoned()

    async def _run_handshake(self):
        lst = self.listener
        raw = self.transport
        loop = lst.loop
        early = b"".join(self.early)
        self.early = None
        if self.lost or raw.is_closing():
            self.phase = _DONE
            return
        if early and early[0] != _TLS_HANDSHAKE:
            self._not_tls(early)
            return
        self.phase = _HANDSHAKE
        if early:
            # start_tls() sets its SSL protocol on the transport right away and calls its
            # connection_made() (which starts the handshake) in a callback it schedules
            # after this one: _feed puts the bytes into its incoming buffer first.
            loop.call_soon(self._feed, early)
        try:
            tls = await loop.start_tls(raw, self, lst.ssl_context, server_side=True,
                                       ssl_handshake_timeout=lst.broker.config.limits.connect_timeout)
        except asyncio.CancelledError:
            self.phase = _DONE
            raw.abort()
            raise
        except Exception as e:
            self.phase = _DONE
            self._failed(e, bool(early))
            raw.abort()
            return
        inner = self.inner
        self.phase = _OPEN
        tls.set_protocol(inner)
        self._uncount()  # the Connection counts itself from here on
        inner.connection_made(tls)
        held, self.held = self.held, []
        for data in held:
            inner.data_received(data)
        if self.eof and not inner.eof_received():
            tls.close()
        if self.lost:
            inner.connection_lost(self.lost_exc)

    def _feed(self, data):
        proto = self.transport.get_protocol()
        if proto is self:
            return
        view = memoryview(data)
        try:
            while view:
                buf = proto.get_buffer(len(view))
                n = min(len(buf), len(view))
                buf[:n] = view[:n]
                proto.buffer_updated(n)
                view = view[n:]
        except Exception:
            log.exception("TLS listener %s: could not pass the first bytes of %s to TLS",
                          self.listener.label, self.peer)
            self.transport.abort()

    def _not_tls(self, first):
        lst = self.listener
        what = "an MQTT CONNECT" if first[0] == 0x10 else \
            "an HTTP request" if first[:4] in _HTTP_METHODS else f"a first byte 0x{first[0]:02x}"
        log.warning("%s sent %s, not a TLS ClientHello, to TLS listener %s; closing (plain client "
                    "on a TLS port? connect with TLS, or use a listener without tls)",
                    self.peer, what, lst.label)
        self.phase = _DONE
        self.transport.abort()

    def _failed(self, exc, got_bytes):
        lst = self.listener
        if isinstance(exc, ssl.SSLError):
            reason = exc.reason or ""
            msg = _ssl_message(exc)
            if reason in _NOT_TLS:
                log.warning("%s did not start a TLS handshake on TLS listener %s (plain client on a "
                            "TLS port?): %s", self.peer, lst.label, msg)
            elif reason in _OLD_TLS:
                log.info("TLS handshake failed with %s on listener %s: the client's TLS version is "
                         "too old (the minimum is TLS %s): %s", self.peer, lst.label,
                         lst.cfg.min_tls_version, msg)
            elif reason in _BAD_CLIENT_CERT:
                log.info("TLS handshake failed with %s on listener %s: client certificate missing "
                         "or not trusted: %s", self.peer, lst.label, msg)
            else:
                log.info("TLS handshake failed with %s on listener %s: %s", self.peer, lst.label, msg)
        elif isinstance(exc, (ConnectionAbortedError, TimeoutError)):
            log.info("TLS handshake with %s on listener %s timed out after %gs", self.peer, lst.label,
                     lst.broker.config.limits.connect_timeout)
        elif isinstance(exc, (ConnectionResetError, BrokenPipeError, EOFError)) and not got_bytes:
            log.debug("%s closed the connection before a TLS handshake on listener %s", self.peer, lst.label)
        else:
            log.info("TLS handshake failed with %s on listener %s: %r", self.peer, lst.label, exc)

    # Callbacks from the raw transport (phase _RAW) or from the SSL protocol (later).

    def data_received(self, data):
        phase = self.phase
        if phase == _RAW:
            self.early.append(data)
        elif phase == _HANDSHAKE:
            self.held.append(data)
        elif phase == _OPEN:
            self.inner.data_received(data)

    def eof_received(self):
        if self.phase == _OPEN:
            return self.inner.eof_received()
        self.eof = True
        return True

    def connection_lost(self, exc):
        if self.phase == _OPEN and not self.lost:
            self.lost = True
            self.inner.connection_lost(exc)
            return
        self.lost = True
        self.lost_exc = exc

    def pause_writing(self):
        if self.phase == _OPEN:
            self.inner.pause_writing()

    def resume_writing(self):
        if self.phase == _OPEN:
            self.inner.resume_writing()


def accept_tls(inner, port):
    """`inner` (a protocol) behind the TLS handshake of an accepted socket, for a port that
    is not a Listener (the cluster's link port): its handshake is run and logged as a TLS
    listener's is (_TLSAcceptor), and `inner.connection_made` comes once it is over, with
    the TLS transport; a failed one calls `inner.abandoned()` instead. `port` has what a
    Listener gives the acceptor: `broker`, `loop`, `ssl_context`, `label` and a `cfg` with
    `type` (not "mqtt": the broker's handshake count is for MQTT listeners) and
    `min_tls_version`."""
    return _TLSAcceptor(inner, port)


# --- WebSocket -------------------------------------------------------------------


class WebSocketTransport(asyncio.Transport):
    """One WebSocket connection as the asyncio Transport a `Connection` expects.

    - write(): bytes are queued and a writer task sends them as one binary frame per
      batch (MQTT allows any split of packets over frames). Flow control: the bytes not
      yet handed to websockets count against the write buffer limits, and since
      `websockets.send()` waits while the socket's own buffer is over its limit, a slow
      reader makes that count grow: over `high` the protocol gets pause_writing(),
      under `low` resume_writing(), as with a TCP transport.
    - pause_reading(): no more frames are taken from websockets; its queue fills and it
      stops reading the socket (TCP backpressure on the client).
    - close(): queued bytes are sent, then the closing handshake (websockets half-closes
      TCP after it); frames that arrive meanwhile still reach the protocol, which drops
      them. abort(): the TCP connection is dropped. The protocol's connection_lost()
      comes once, at the end.
    """

    def __init__(self, ws, protocol, listener):
        super().__init__()
        self._ws = ws
        self._protocol = protocol
        self._listener = listener
        self._loop = asyncio.get_running_loop()
        self._out = []
        self._size = 0  # bytes queued or being sent, not yet accepted by websockets
        self._high = 65536
        self._low = 16384
        self._write_paused = False
        self._can_read = asyncio.Event()
        self._can_read.set()
        self._wake = asyncio.Event()
        self._closing = False
        self._aborted = False
        self._close_code = 1000
        self._close_reason = ""
        self._writer = None

    # -- Transport API --

    def get_extra_info(self, name, default=None):
        ws = self._ws
        if name == "peername":
            return getattr(ws, "proxied_peer", None) or ws.remote_address
        if name == "sockname":
            return ws.local_address
        if name == "websocket":
            return ws
        t = ws.transport
        return t.get_extra_info(name, default) if t is not None else default

    def is_closing(self):
        return self._closing

    def set_protocol(self, protocol):
        self._protocol = protocol

    def get_protocol(self):
        return self._protocol

    def is_reading(self):
        return self._can_read.is_set()

    def pause_reading(self):
        self._can_read.clear()

    def resume_reading(self):
        self._can_read.set()

    def set_write_buffer_limits(self, high=None, low=None):
        if high is None:
            high = 65536 if low is None else 4 * low
        if low is None:
            low = high // 4
        if not high >= low >= 0:
            raise ValueError(f"high ({high!r}) must be >= low ({low!r}) must be >= 0")
        self._high, self._low = high, low

    def get_write_buffer_limits(self):
        return (self._low, self._high)

    def get_write_buffer_size(self):
        t = self._ws.transport
        return self._size + (t.get_write_buffer_size() if t is not None else 0)

    def write(self, data):
        if self._closing or not data:
            return
        self._out.append(bytes(data))
        self._size += len(data)
        self._wake.set()
        if not self._write_paused and self._size > self._high:
            self._write_paused = True
            self._protocol.pause_writing()

    def writelines(self, list_of_data):
        for data in list_of_data:
            self.write(data)

    def can_write_eof(self):
        return False

    def write_eof(self):
        raise NotImplementedError("MQTT over WebSocket has no half-close")

    def close(self):
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._can_read.set()  # let the reader see the end of the connection

    def abort(self):
        if self._aborted:
            return
        self._closing = True
        self._aborted = True
        self._out.clear()
        self._can_read.set()
        self._wake.set()
        t = self._ws.transport
        if t is not None:
            t.abort()

    # -- the two loops --

    async def run(self):
        """Serve the connection until it closes (this is the websockets handler)."""
        from websockets.exceptions import ConnectionClosed, ConnectionClosedOK

        ws = self._ws
        proto = self._protocol
        exc = None
        self._writer = self._loop.create_task(self._write_loop())
        try:
            proto.connection_made(self)
            while True:
                if not self._can_read.is_set() and not await self._wait_resume():
                    break
                msg = await ws.recv()
                if not self._can_read.is_set() and not await self._wait_resume():
                    break  # paused while that frame was awaited, and closed since
                if self._closing:
                    # Closing: drain frames until websockets says it is over; a closed
                    # Connection drops them, counted against its bound (Connection._shut).
                    if not isinstance(msg, str):
                        proto.data_received(msg)
                    continue
                if isinstance(msg, str):
                    log.info("%s sent a text frame on WebSocket listener %s; MQTT needs binary frames, "
                             "closing", _peer(self), self._listener.label)
                    self._close_code, self._close_reason = 1003, "MQTT needs binary frames"
                    self.close()
                    continue
                proto.data_received(msg)
        except ConnectionClosedOK:
            pass
        except ConnectionClosed as e:
            exc = None if self._aborted else ConnectionResetError(str(e))
        except asyncio.CancelledError:
            self.abort()
            raise
        except Exception:
            log.exception("WebSocket connection from %s failed", _peer(self))
            self.abort()
        finally:
            self._closing = True
            self._out.clear()
            writer = self._writer
            if writer is not None and not writer.done():
                writer.cancel()
            proto.connection_lost(exc)

    async def _wait_resume(self):
        """Wait until reading resumes: True; or until the connection is gone: False."""
        resumed = asyncio.ensure_future(self._can_read.wait())
        closed = asyncio.ensure_future(self._ws.wait_closed())
        try:
            await asyncio.wait((resumed, closed), return_when=asyncio.FIRST_COMPLETED)
        finally:
            resumed.cancel()
            closed.cancel()
        return self._can_read.is_set()

    async def _write_loop(self):
        from websockets.exceptions import ConnectionClosed

        ws = self._ws
        out = self._out
        try:
            while True:
                while not out:
                    if self._closing:
                        if not self._aborted:
                            await ws.close(self._close_code, self._close_reason)
                        return
                    self._wake.clear()
                    await self._wake.wait()
                data = out[0] if len(out) == 1 else b"".join(out)
                out.clear()
                await ws.send(data)  # one binary frame; waits while the socket buffer is full
                self._size -= len(data)
                if self._write_paused and self._size <= self._low:
                    self._write_paused = False
                    self._protocol.resume_writing()
        except ConnectionClosed:
            pass
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("WebSocket writer for %s failed", _peer(self))
            self.abort()


class _QuietLogger(logging.LoggerAdapter):
    """websockets logs every connection opened and closed at INFO: make that DEBUG
    (the broker logs clients itself); warnings and errors pass unchanged."""

    def log(self, level, msg, *args, **kwargs):
        super().log(logging.DEBUG if level == logging.INFO else level, msg, *args, **kwargs)


def _select_subprotocol(connection, offered):
    for name in WS_SUBPROTOCOLS:
        if name in offered:
            return name
    if not offered:
        return None  # lenient, like Mosquitto: a client that names no subprotocol is served
    from websockets.exceptions import NegotiationError
    raise NegotiationError(f"unsupported subprotocol {', '.join(offered)}; expected mqtt")


# --- listeners -------------------------------------------------------------------


class Listener:
    """One `[[listener]]`: its server(s) and, with tls, its current SSLContext."""

    def __init__(self, broker, cfg, index):
        self.broker = broker
        self.cfg = cfg
        self.index = index
        self.where = f"listener[{index}]"
        self.loop = None
        self.server = None
        self.address = None  # (host, port); (path, None) for unix sockets
        self.ssl_context = None
        self._unix_id = None
        self._ws_opening = weakref.WeakSet()  # websockets connections, for close()
        self.open_requests = 0  # metrics: its open connections
        self._metrics_logins = {}  # metrics users: user -> (password file entry, sha256 of the password)
        self._conn_name = cfg.label  # Connection.listener_name, built once per listener

    @property
    def label(self):
        cfg = self.cfg
        if not cfg.name and cfg.type != "unix" and self.address is not None:
            return f"{self.address[0]}:{self.address[1]}"  # the real port, also with port = 0
        return cfg.label

    @property
    def kind(self):
        cfg = self.cfg
        if cfg.type == "metrics":
            return "metrics (HTTPS)" if cfg.tls else "metrics (HTTP)"
        if cfg.type == "ws":
            return "WebSocket (wss)" if cfg.tls else "WebSocket"
        if cfg.type == "unix":
            return "Unix socket"
        return "MQTT/TLS" if cfg.tls else "MQTT"

    @property
    def tls(self):
        return self.cfg.tls

    def _connection(self):
        cfg = self.cfg
        if cfg.tls and cfg.cafile:
            return CertConnection(self.broker, self.cfg, self._conn_name)
        return Connection(self.broker, self.cfg, self._conn_name)

    def _accept_mqtt(self):
        """The protocol of a connection accepted on an MQTT (or MQTT/TLS) listener. One still
        in its TLS handshake counts against max_connections, as one waiting for its CONNECT
        does (Connection.connection_made refuses those past the limit)."""
        cfg = self.cfg
        if (cfg.tls or cfg.proxy_protocol) and self._at_connection_limit():
            return _Refused(self.broker, self._conn_name, "max_connections reached")
        conn = self._connection()
        front = self._front(conn)
        if not cfg.proxy_protocol:
            return front

        def given(host, port):
            conn.address = f"{host}:{port}"
            if front is not conn:
                front.peer = conn.address  # the TLS acceptor's log lines
        return self._behind_proxy(front, given, count=not cfg.tls)

    def _behind_proxy(self, front, given, count):
        """`front` behind a ProxyReader ([[listener]] proxy_protocol): `given(host, port)`
        gets the client's address from the header (unless the proxy gave none: its own
        health checks). With `count`, the reader counts in the broker's handshakes until
        it hands over (for protocols that do not count themselves from the accept)."""
        broker = self.broker
        on_done = None
        if count:
            broker.handshakes += 1

            def on_done():
                broker.handshakes -= 1

        def on_header(header):
            if header.source is not None:
                given(*header.source)

        reader = ProxyReader(front, broker.config.limits.connect_timeout, on_header,
                             self._proxy_refused, on_done)
        return reader

    def _proxy_refused(self, reader, why):
        reader.listener_name = self._conn_name
        self.broker.refused(reader, why)

    def _at_connection_limit(self):
        broker = self.broker
        limit = broker.config.limits.max_connections
        return bool(limit) and len(broker.connections) + broker.handshakes >= limit

    def _front(self, inner):
        if self.cfg.tls:
            return _TLSAcceptor(inner, self)
        if self.cfg.type == "mqtt":
            return inner  # the Connection sniffs its own first bytes (Connection._foreign)
        return _PlainSniffer(inner, self)

    async def start(self):
        self.loop = asyncio.get_running_loop()
        cfg = self.cfg
        if cfg.tls:
            self.ssl_context = build_ssl_context(cfg, self.where)
        if cfg.type == "unix":
            await self._start_unix()
        elif cfg.type == "ws":
            await self._start_ws()
        elif cfg.type == "metrics":
            await self._start_metrics()
        else:
            self.server = await self.loop.create_server(self._accept_mqtt, cfg.bind, cfg.port,
                                                        backlog=4096, reuse_address=True)
        if cfg.type != "unix":
            socks = self.server.sockets
            addr = socks[0].getsockname()
            self.address = (addr[0], addr[1])
            extra = ""
            if cfg.type == "ws":
                extra = f" ({'wss' if cfg.tls else 'ws'}, path {cfg.path or DEFAULT_WS_PATH})"
            elif cfg.type == "metrics":
                extra = f" (Prometheus metrics over {'HTTPS' if cfg.tls else 'HTTP'}, path " \
                        f"{cfg.path or DEFAULT_METRICS_PATH})"
            elif cfg.tls:
                extra = " (TLS)"
            for sock in socks:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    a = sock.getsockname()
                    log.info("listening on %s:%d%s", a[0], a[1], extra)
        return self

    async def _start_ws(self):
        try:
            from websockets.asyncio.server import ServerConnection, serve
        except ImportError:  # pragma: no cover - it is a dependency
            raise ListenerError(f"{self.where}.type: \"ws\" needs the websockets package") from None
        cfg = self.cfg
        limits = self.broker.config.limits
        path = cfg.path or DEFAULT_WS_PATH

        broker = self.broker

        def handshake_over():
            broker.handshakes -= 1

        # Counted in the broker's handshakes until its handshake ends (_ws_session) or it closes.
        WsConnection = _counted(ServerConnection, handshake_over)

        def create_connection(*args, **kwargs):
            # A connection in its handshake counts against max_connections, as an MQTT
            # connection does before its CONNECT: else a flood of idle handshakes (each
            # kept up to connect_timeout) would hold memory past the limit.
            if self._at_connection_limit():
                return _Refused(self.broker, self._conn_name, "max_connections reached")
            conn = WsConnection(*args, **kwargs)
            self.broker.handshakes += 1
            self._ws_opening.add(conn)
            if cfg.proxy_protocol:
                def given(host, port):
                    conn.proxied_peer = (host, port)
                return self._behind_proxy(self._front(conn), given, count=False)
            return self._front(conn)

        origins = frozenset(o.rstrip("/") for o in cfg.origins)

        def process_request(connection, request):
            if urllib.parse.urlsplit(request.path).path != path:
                log.info("WebSocket listener %s: %s asked for %s, not %s: 404", self.label,
                         _peer(connection.transport), request.path[:200], path)
                return connection.respond(http.HTTPStatus.NOT_FOUND, "Not Found\n")
            if origins:
                origin = request.headers.get("Origin")
                if origin is not None and origin not in origins:
                    log.info("WebSocket listener %s: %s came from origin %s, not an allowed one: 403",
                             self.label, _peer(connection.transport), origin[:200])
                    return connection.respond(http.HTTPStatus.FORBIDDEN, "Forbidden origin\n")
            return None

        def process_response(connection, request, response):
            if response.status_code not in (101, 403, 404):
                exc = connection.protocol.handshake_exc
                log.info("WebSocket listener %s: handshake with %s refused (%d): %s", self.label,
                         _peer(connection.transport), response.status_code, exc or response.reason_phrase)
            return None

        self.server = await serve(
            self._ws_session, cfg.bind, cfg.port,
            subprotocols=list(WS_SUBPROTOCOLS), select_subprotocol=_select_subprotocol,
            process_request=process_request, process_response=process_response,
            create_connection=create_connection, compression=None, server_header=None,
            open_timeout=limits.connect_timeout, ping_interval=None, close_timeout=5,
            max_size=limits.max_packet_size + 65536, max_queue=4,
            logger=_QuietLogger(logging.getLogger("wrenmq.websockets"), {}), backlog=4096,
            reuse_address=True)

    async def _start_metrics(self):
        from websockets.asyncio.server import ServerConnection, basic_auth, serve

        from .metrics import CONTENT_TYPE, render

        path = self.cfg.path or DEFAULT_METRICS_PATH
        sys_topics = self.broker.sys_topics
        # `users`: HTTP Basic authentication against the broker's password file (the one
        # SIGHUP reloads), as websockets' basic_auth asks it.
        login = basic_auth(realm="wrenmq metrics", check_credentials=self._metrics_login) \
            if self.cfg.users else None

        def request_over():
            self.open_requests -= 1

        MetricsConnection = _counted(ServerConnection, request_over)  # (in open_requests until closed)

        def create_connection(*args, **kwargs):
            if self.open_requests >= METRICS_MAX_OPEN:
                return _Refused(self.broker, self._conn_name, f"{METRICS_MAX_OPEN} metrics requests open")
            self.open_requests += 1
            return self._front(MetricsConnection(*args, **kwargs))

        def answer(connection, request, code, body, content_type):
            """`body` as `content_type`; to HEAD, the GET's headers (its Content-Length too)."""
            response = connection.respond(code, body)
            del response.headers["Content-Type"]
            response.headers["Content-Type"] = content_type
            if request.method == "HEAD":
                response.body = b""
            return response

        async def process_request(connection, request):
            asked = urllib.parse.urlsplit(request.path).path
            if asked == HEALTH_PATH and asked != path and request.method in ("GET", "HEAD"):
                return answer(connection, request, *self._health(), "application/json")
            if asked != path:
                return connection.respond(http.HTTPStatus.NOT_FOUND, "Not Found\n")
            if login is not None:
                refused = await login(connection, request)
                if refused is not None:
                    return refused
            if request.method not in ("GET", "HEAD"):
                response = connection.respond(http.HTTPStatus.METHOD_NOT_ALLOWED, "Method Not Allowed\n")
                response.headers["Allow"] = "GET, HEAD"
                return response
            return answer(connection, request, http.HTTPStatus.OK, render(sys_topics), CONTENT_TYPE)

        async def never(ws):  # (every request is answered by process_request)
            await ws.close()

        self.server = await serve(
            never, self.cfg.bind, self.cfg.port, process_request=process_request,
            create_connection=create_connection, server_header=None, open_timeout=5,
            close_timeout=1, logger=_QuietLogger(logging.getLogger("wrenmq.metrics"), {}),
            backlog=128, reuse_address=True)

    def _health(self):
        """GET /health, as (status code, JSON body): metrics.health."""
        from .metrics import health
        return health(self.broker)

    async def _metrics_login(self, user, password):
        """A metrics listener's `users` check: a listed user whose password the password
        file confirms. Hashing runs in a thread; a refusal waits [auth] failed_login_delay,
        as an MQTT login's does. A confirmed password is remembered until the file's entry
        for the user changes (a reload), so a scrape every few seconds hashes once."""
        auth = self.broker.auth
        entry = auth.passwords.get(user) if user in self.cfg.users and auth.passwords is not None else None
        token = hashlib.sha256(password.encode(errors="surrogateescape")).digest()
        known = self._metrics_logins.get(user)
        if entry is not None and known is not None and known[0] is entry and hmac.compare_digest(known[1], token):
            return True
        started = time.monotonic()
        if entry is not None and await asyncio.get_running_loop().run_in_executor(None, entry.verify, password):
            self._metrics_logins[user] = (entry, token)
            return True
        log.warning("%s (metrics): refused a request from user %r (%s)", self.where, user,
                    "wrong password" if entry is not None else "not one of its users, or not in the password file")
        await asyncio.sleep(max(0.0, auth.delay - (time.monotonic() - started)))
        return False

    async def _ws_session(self, ws):
        ws.uncount()  # its handshake is over: from now on the Connection counts itself
        await WebSocketTransport(ws, self._connection(), self).run()

    async def _start_unix(self):
        cfg = self.cfg
        path = cfg.path
        _clear_stale_socket(path, self.where)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Before listen(): nobody can connect while the mode is still the umask's.
            os.chmod(path, int(cfg.mode, 8))
            st = os.stat(path)
            self._unix_id = (st.st_dev, st.st_ino)

            def factory():
                conn = Connection(self.broker, self.cfg)
                conn.address = f"unix:{path}"
                return conn

            self.server = await self.loop.create_unix_server(factory, sock=sock, backlog=4096)
        except OSError as e:
            sock.close()
            raise ListenerError(f"{self.where}.path: cannot listen on {path}: {e.strerror or e}") from None
        self.address = (path, None)
        log.info("listening on unix:%s (mode %s)", path, cfg.mode)

    def reload_tls(self):
        """Re-read certfile/keyfile/cafile; new handshakes use them. False (and the old
        certificate stays) if they cannot be loaded."""
        if not self.cfg.tls:
            return True
        try:
            ctx = build_ssl_context(self.cfg, self.where)
        except ListenerError as e:
            log.error("TLS reload failed, listener %s keeps its previous certificate: %s", self.label, e)
            return False
        self.ssl_context = ctx
        log.info("listener %s: TLS certificate reloaded from %s", self.label, self.cfg.certfile)
        return True

    def close(self):
        server = self.server
        if server is None:
            return
        if self.cfg.type == "ws":
            server.close(close_connections=False)  # the broker closes its connections itself
            # ... but not those still in their HTTP handshake: do not wait open_timeout for them.
            from websockets.protocol import State
            for conn in list(self._ws_opening):
                t = getattr(conn, "transport", None)
                if conn.protocol.state is State.CONNECTING and t is not None:
                    t.abort()
            self._ws_opening.clear()
        else:
            server.close()
        if self._unix_id is not None:
            path = self.cfg.path
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == self._unix_id:
                    os.unlink(path)
            except OSError:
                pass
            self._unix_id = None

    async def wait_closed(self):
        if self.server is not None:
            await self.server.wait_closed()


def _clear_stale_socket(path, where):
    """Remove a socket file left by a previous run; refuse if it is in use or not a socket."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ListenerError(f"{where}.path: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError as e:
        if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise ListenerError(f"{where}.path: cannot check {path}: {e.strerror or e}") from None
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        return
    finally:
        probe.close()
    raise ListenerError(f"{where}.path: {path} is in use by another process")


async def open_listener(broker, cfg, index):
    """Start listening for one `[[listener]]`; returns the `Listener`."""
    return await Listener(broker, cfg, index).start()


class TLSReloadHook(Hook):
    """Reload TLS certificates when the broker reloads (SIGHUP)."""

    def __init__(self, broker):
        self.broker = broker

    def on_reload(self):
        self.broker.reload_tls()
