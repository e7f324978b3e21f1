"""TLS for the ports the broker accepts on: server contexts and a handshake it runs itself.

The socket is accepted plain and a `TLSAcceptor` runs the handshake with
`loop.start_tls()`. That way the handshake's outcome is ours to see: with
`create_server(ssl=...)` both asyncio and uvloop drop handshake errors silently (they are
OSErrors, logged only in debug mode), so a plain MQTT client on a TLS port would leave no
trace. The acceptor logs why a handshake failed (plain MQTT, TLS too old, certificate
refused, timeout), reads its port's *current* `SSLContext` for every handshake (SIGHUP
swaps in a new one: existing connections keep theirs), and hands the TLS transport to the
protocol that serves the connection. The MQTT, WebSocket (wss), metrics and admin
listeners and the cluster's link port all accept through it (`accept_tls`).
"""

import asyncio
import logging
import re
import ssl

from . import ListenerError
from .front import HTTP_METHODS, TLS_HANDSHAKE, Front, peer_name

log = logging.getLogger("wrenmq.listeners")

# OpenSSL reasons for "what arrived is not TLS at all" (plain MQTT, HTTP, ...).
_NOT_TLS = {"WRONG_VERSION_NUMBER", "HTTP_REQUEST", "HTTPS_PROXY_REQUEST", "UNKNOWN_PROTOCOL",
            "PACKET_LENGTH_TOO_LONG", "RECORD_LAYER_FAILURE", "BAD_PACKET_LENGTH"}
# ... for "TLS, but a version we refuse".
_OLD_TLS = {"UNSUPPORTED_PROTOCOL", "VERSION_TOO_LOW", "NO_PROTOCOLS_AVAILABLE",
            "TLSV1_ALERT_PROTOCOL_VERSION", "WRONG_SSL_VERSION"}
# ... for "the client certificate was missing or not trusted".
_BAD_CLIENT_CERT = {"PEER_DID_NOT_RETURN_A_CERTIFICATE", "CERTIFICATE_VERIFY_FAILED",
                    "NO_CERTIFICATE_RETURNED"}


def ssl_message(exc):
    """An SSLError's text without the "(_ssl.c:1234)" tail."""
    return re.sub(r"\s*\(_ssl\.c:\d+\)$", "", str(exc))


def build_ssl_context(cfg, where="listener"):
    """The server SSLContext of a `[[listener]]` with tls = true (TLS 1.2 or newer): `cfg`
    has certfile, keyfile, cafile, crlfile, require_certificate and min_tls_version.
    ListenerError names the key (`where`.certfile, ...) whose file cannot be used."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3 if cfg.min_tls_version == "1.3" else ssl.TLSVersion.TLSv1_2
    ctx.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION
    try:
        ctx.load_cert_chain(cfg.certfile, cfg.keyfile or None)
    except (OSError, ValueError) as e:
        keys = "certfile/keyfile" if cfg.keyfile else "certfile"
        raise ListenerError(f"{where}.{keys}: cannot load {cfg.certfile}"
                            f"{' / ' + cfg.keyfile if cfg.keyfile else ''}: {ssl_message(e)}") from None
    if cfg.cafile:
        try:
            ctx.load_verify_locations(cafile=cfg.cafile)
        except (OSError, ValueError) as e:
            raise ListenerError(f"{where}.cafile: cannot load {cfg.cafile}: {ssl_message(e)}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED if cfg.require_certificate else ssl.CERT_OPTIONAL
        if cfg.crlfile:
            try:
                ctx.load_verify_locations(cafile=cfg.crlfile)
            except (OSError, ValueError) as e:
                raise ListenerError(f"{where}.crlfile: cannot load {cfg.crlfile}: {ssl_message(e)}") from None
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


class TLSPort:
    """What a `TLSAcceptor` needs of the port it accepts on.

    - `label`: names the port in log lines;
    - `ssl_context`: the server context, read at each handshake (a reload replaces it);
    - `handshake_timeout`: seconds a handshake may take;
    - `min_tls_version`: named when a client's TLS is too old;
    - `spawn(coro)`: runs the handshake as a task its owner cancels when it stops.

    The listeners have these as attributes of their own; the cluster's link port is one
    of these as it is.
    """

    def __init__(self, label, ssl_context, handshake_timeout, spawn, min_tls_version="1.2"):
        self.label = label
        self.ssl_context = ssl_context
        self.handshake_timeout = handshake_timeout
        self.spawn = spawn
        self.min_tls_version = min_tls_version


# TLSAcceptor phases
_RAW, _HANDSHAKE, _OPEN, _DONE = range(4)


class TLSAcceptor(Front):
    """Run the TLS handshake of an accepted socket, log its failure, hand it over.

    The inner protocol gets `connection_made` with the TLS transport once the handshake
    is over; if it fails, `inner.abandoned()` is called instead (when the inner protocol
    has one: it gets neither connection_made nor connection_lost). `handshake_over()`, if
    given, is called once when the handshake ends either way, before the inner protocol
    is connected: for a count of handshakes in progress that its caller keeps.

    uvloop starts reading a new connection right after `connection_made` even if the
    protocol paused it there, so the first bytes (usually the whole ClientHello) may
    reach this protocol before `start_tls()` has put its SSL protocol in place. They
    are sniffed (a first byte other than 0x16 is not TLS: logged, closed) and then fed
    to the SSL protocol through its BufferedProtocol interface before it starts the
    handshake. Between the end of the handshake and the moment the inner protocol is
    connected, decrypted data is held and replayed in order.
    """

    def __init__(self, inner, port, handshake_over=None):
        super().__init__(inner, port)
        self.peer = "?"
        self.phase = _RAW
        self.early = []
        self.held = []
        self.eof = False
        self.lost = False
        self.lost_exc = None
        self.handshake_over = handshake_over

    def _over(self):
        over = self.handshake_over
        if over is not None:
            self.handshake_over = None
            over()

    def connection_made(self, transport):
        self.transport = transport
        self.peer = peer_name(transport)
        transport.pause_reading()
        self.port.spawn(self._handshake())

    async def _handshake(self):
        try:
            await self._run_handshake()
        finally:
            self._over()
            if self.phase != _OPEN:
                # The inner protocol never saw the connection: one that counts itself
                # (a WebSocket or metrics connection, a cluster link) uncounts now.
                abandoned = getattr(self.inner, "abandoned", None)
                if abandoned is not None:
                    abandoned()

    async def _run_handshake(self):
        port = self.port
        raw = self.transport
        loop = asyncio.get_running_loop()
        early = b"".join(self.early)
        self.early = None
        if self.lost or raw.is_closing():
            self.phase = _DONE
            return
        if early and early[0] != TLS_HANDSHAKE:
            self._not_tls(early)
            return
        self.phase = _HANDSHAKE
        if early:
            # start_tls() sets its SSL protocol on the transport right away and calls its
            # connection_made() (which starts the handshake) in a callback it schedules
            # after this one: _feed puts the bytes into its incoming buffer first.
            loop.call_soon(self._feed, early)
        try:
            tls = await loop.start_tls(raw, self, port.ssl_context, server_side=True,
                                       ssl_handshake_timeout=port.handshake_timeout)
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
        self._over()  # (a Connection counts itself from here on)
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
                          self.port.label, self.peer)
            self.transport.abort()

    def _not_tls(self, first):
        what = "an MQTT CONNECT" if first[0] == 0x10 else \
            "an HTTP request" if first[:4] in HTTP_METHODS else f"a first byte 0x{first[0]:02x}"
        log.warning("%s sent %s, not a TLS ClientHello, to TLS listener %s; closing (plain client "
                    "on a TLS port? connect with TLS, or use a listener without tls)",
                    self.peer, what, self.port.label)
        self.phase = _DONE
        self.transport.abort()

    def _failed(self, exc, got_bytes):
        port = self.port
        if isinstance(exc, ssl.SSLError):
            reason = exc.reason or ""
            msg = ssl_message(exc)
            if reason in _NOT_TLS:
                log.warning("%s did not start a TLS handshake on TLS listener %s (plain client on a "
                            "TLS port?): %s", self.peer, port.label, msg)
            elif reason in _OLD_TLS:
                log.info("TLS handshake failed with %s on listener %s: the client's TLS version is "
                         "too old (the minimum is TLS %s): %s", self.peer, port.label,
                         port.min_tls_version, msg)
            elif reason in _BAD_CLIENT_CERT:
                log.info("TLS handshake failed with %s on listener %s: client certificate missing "
                         "or not trusted: %s", self.peer, port.label, msg)
            else:
                log.info("TLS handshake failed with %s on listener %s: %s", self.peer, port.label, msg)
        elif isinstance(exc, (ConnectionAbortedError, TimeoutError)):
            log.info("TLS handshake with %s on listener %s timed out after %gs", self.peer, port.label,
                     port.handshake_timeout)
        elif isinstance(exc, (ConnectionResetError, BrokenPipeError, EOFError)) and not got_bytes:
            log.debug("%s closed the connection before a TLS handshake on listener %s", self.peer, port.label)
        else:
            log.info("TLS handshake failed with %s on listener %s: %r", self.peer, port.label, exc)

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


def accept_tls(inner, port, handshake_over=None):
    """The protocol for a socket accepted on `port` (a `TLSPort`, or a listener with its
    attributes): `inner` behind the TLS handshake, run and logged by a `TLSAcceptor`."""
    return TLSAcceptor(inner, port, handshake_over)
