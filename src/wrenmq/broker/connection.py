"""The connection: an asyncio Protocol that moves bytes between a socket and the router.

It decodes what arrives (many packets per `data_received`), hands packets to
the router, buffers what the router sends until the end of the loop turn (one
write per connection per turn), keeps time (connect timeout, keepalive) and
applies flow control (a client that does not read is paused, not buffered
without bound). MQTT semantics live in the router; CONNECT authentication,
which may await a hook, is the one step handled here.

A read that holds valid packets and then a bad one has the valid ones handled, in
order, before the connection closes with the bad one's reason. Closing is graceful
(`_shut`): the client must be able to read the last packet (a DISCONNECT with its
reason, a refusing CONNACK) even while it is still sending.
"""

import asyncio
import logging
import socket
from time import monotonic

from ..mqtt import constants as C
from ..mqtt.codec import ConnectRefused, Decoder, MQTTError, PacketTooLarge, encode
from ..mqtt.packets import Auth, Connack, Disconnect
from ..net.front import HTTP_METHODS, TLS_HANDSHAKE
from . import states
from .hooks import ClientInfo
from .states import AUTH, CLOSED, NEW, OPEN

log = logging.getLogger("wrenmq.connection")

# Why reading is paused (a bit each; reading resumes when none is left).
_P_WRITE, _P_AUTH, _P_RATE, _P_CLOSE, _P_TURN = 1, 2, 4, 8, 16
_CLAIMING, _CLAIMED = 1, 2  # Connection._claim: a CONNECT's session being taken over, taken
# Bytes a connection reads before it lets the others have a loop turn (Broker.yield_turn):
# a pause/resume pair (two epoll_ctl at most) per 256 KiB costs nothing measurable.
READ_TURN_BYTES = 256 * 1024
# After its last packet a connection reads and drops what the client still sends, until
# the client closes its side, for at most this long and at most max_packet_size (or the
# size of the oversize packet that closed it) plus LINGER_EXTRA_BYTES: the rest of the
# packet the client may be in the middle of, and a few more. Then it is aborted.
LINGER_SECONDS = 2.0
LINGER_EXTRA_BYTES = 64 * 1024


class Connection(asyncio.Protocol):
    __slots__ = (
        "broker", "router", "listener", "listener_name", "transport", "decoder", "session",
        "version", "_out", "congested", "closing", "address", "keepalive", "_watch", "_last_rx",
        "_pending", "clean_disconnect", "state", "_auth_method", "_connect", "_reason",
        "close_pending", "_paused", "_bucket", "_backlog", "_backed", "_room", "_high",
        "_stopped", "_sniff", "_rx_turn", "_error", "_wrote", "_lingering", "_discarded",
        "bytes_in", "bytes_out", "packets_in", "_claim", "__weakref__",
    )

    def __init__(self, broker, listener, name=None, sniff=False):
        self.broker = broker
        self.router = broker.router
        self.listener = listener
        self.listener_name = name or listener.label
        self.transport = None
        self.decoder = Decoder(max_packet_size=broker.config.limits.max_packet_size)
        self.session = None
        self.version = C.MQTT311
        self._out = []
        self.congested = False
        self.closing = False
        self.address = "?"
        self.keepalive = 0
        self._watch = None  # tick of broker.watch() that will call deadline()
        self._last_rx = 0.0
        self._pending = None  # data that arrived while CONNECT was being authenticated
        self.clean_disconnect = False
        self.state = NEW  # states.py: what the client may send, how it moves on
        self._auth_method = None
        self._connect = None
        self._claim = None  # _CLAIMING while the cluster takes the session over, then _CLAIMED
        self._reason = None
        self.close_pending = False  # close once held output has been written
        self._paused = 0
        self._bucket = None  # [message tokens, byte tokens, last refill] when rates are limited
        self._backlog = None  # packets held back by the rate limit
        # Flow control per delivery: `_backed` bytes were queued by send() this loop turn;
        # `_room` is what write_buffer_high left free when the transport was last written.
        # Going past it writes the turn's output at once (_overflow), and if the transport
        # is then over the limit the connection is congested (QoS 0 to it is dropped,
        # QoS 1/2 wait in its queue): one turn cannot pile a burst onto a client that
        # does not read. The transport's pause_writing() keeps it congested after that.
        high = broker.config.limits.write_buffer_high
        self._high = high
        self._room = high
        self._backed = 0
        self._stopped = False  # the transport called pause_writing
        # `sniff` (a plain TCP listener's connections): look at the stream's first bytes
        # when they are not an MQTT CONNECT; a TLS ClientHello or an HTTP request gets a
        # log line that says so.
        self._sniff = sniff
        self._rx_turn = 0  # bytes read since this connection last yielded its turn
        # The protocol error that ends this connection; a decoder's may wait for the packets
        # decoded before it (they are handled first, then it closes).
        self._error = None
        self._wrote = False  # anything written yet (a connection that was not sent a byte ends at once)
        self._lingering = False  # closed on our side, dropping the client's input (_shut)
        self._discarded = 0  # bytes dropped while lingering
        # What the admin API shows per client, counted per read and per write (where the
        # broker's own totals are counted), never per message.
        self.bytes_in = 0
        self.bytes_out = 0
        self.packets_in = 0

    # --- asyncio callbacks -------------------------------------------------

    def connection_made(self, transport):
        self.transport = transport
        broker = self.broker
        peer = transport.get_extra_info("peername")
        if self.address != "?":
            pass  # given by the listener: a PROXY protocol header's, a Unix socket's path
        elif isinstance(peer, tuple) and len(peer) >= 2:
            self.address = f"{peer[0]}:{peer[1]}"
        elif peer:
            self.address = str(peer)
        conns = broker.connections
        conns.add(self)
        limits = broker.config.limits
        if limits.max_connections and len(conns) + broker.handshakes > limits.max_connections:
            broker.refused(self, "max_connections reached")
            self.closing = True
            transport.abort()
            return
        if limits.connection_rate and not broker.admit(self.listener_name):
            broker.refused(self, "connection_rate exceeded")
            self.closing = True
            transport.abort()
            return
        if limits.publish_rate or limits.publish_byte_rate:
            self._bucket = [limits.publish_rate, limits.publish_byte_rate, monotonic()]
        transport.set_write_buffer_limits(high=limits.write_buffer_high)
        broker.expect_connect(self)

    def data_received(self, data):
        if self.closing:
            if self._lingering:
                self._discard(len(data))
            return
        self._last_rx = monotonic()
        n = len(data)
        self.router.stats.bytes_received += n
        self.bytes_in += n
        self._rx_turn += n
        if self._rx_turn >= READ_TURN_BYTES:
            self._rx_turn = 0
            self._pause(_P_TURN)
            self.broker.yield_turn(self)
        if self.state != OPEN:
            self._before_open(data)
            return
        if self._bucket is not None:
            self._metered(data)
            return
        try:
            packets = self.decoder.feed(data)
        except MQTTError as e:
            if e.packets:
                self._dispatch(e.packets)
            if not self.closing:
                self.protocol_error(e)
            return
        self._dispatch(packets)

    def _dispatch(self, packets):
        self.packets_in += len(packets)
        router = self.router
        router.arrived()
        handlers = router.handlers
        session = self.session
        try:
            for pkt in packets:
                handler = handlers[pkt.TYPE]
                if handler is None:
                    self._on_auth_packet(pkt)
                else:
                    handler(session, pkt)
                if self.closing:
                    break
        except MQTTError as e:
            self.protocol_error(e)

    def _metered(self, data):
        """Input of a client under publish_rate / publish_byte_rate (token buckets with one
        second of burst): decode and dispatch only what its tokens allow; the rest waits
        (undecoded in the decoder, or decoded in the backlog) while its socket is not read.
        """
        bucket = self._bucket
        limits = self.broker.config.limits
        now = monotonic()
        elapsed = now - bucket[2]
        bucket[2] = now
        mrate = limits.publish_rate
        brate = limits.publish_byte_rate
        if mrate:
            bucket[0] = min(mrate, bucket[0] + elapsed * mrate)
        if brate:
            bucket[1] = min(brate, bucket[1] + elapsed * brate)
        packets = self._backlog or []
        self._backlog = None
        if (data or self.decoder.has_rest) and self._error is None:
            budget = (int(bucket[0]) if mrate else 256) - len(packets)
            try:
                packets += self.decoder.feed(data, limit=max(budget, 0))
            except MQTTError as e:
                # The packets before the bad one go through the buckets as any others;
                # the error closes the connection once they are all handled.
                packets += e.packets
                self._error = e
        n = len(packets)
        i = 0
        while i < n:
            pkt = packets[i]
            if pkt.TYPE == 3:
                # A packet bigger than a second's worth passes once the bucket is full.
                if (mrate and bucket[0] < 1) or (brate and bucket[1] < min(len(pkt.raw), brate)):
                    break
                bucket[0] -= 1
                bucket[1] -= len(pkt.raw)
            i += 1
        self._dispatch(packets[:i] if i < n else packets)
        if self.closing:
            return
        if i == n and not self.decoder.has_rest:
            if self._error is not None:
                self.protocol_error(self._error)
                return
            self._unpause(_P_RATE)
            return
        # Over the limit.
        self.router.stats.rate_limited += 1
        if limits.rate_limit_action == "disconnect":
            log.info("client %s exceeds its rate limit: disconnecting",
                     self.session.client_id if self.session else self.address)
            self.close(C.MESSAGE_RATE_TOO_HIGH)
            return
        if i < n:
            self._backlog = packets[i:]
        self._pause(_P_RATE)
        # Woken by the broker's throttle tick for a small batch, not for every token (a
        # timer per message would cost more than the messages) nor for a large one (it
        # would hold up everyone else).
        self.broker.throttle(self)

    def resume_turn(self):
        self._unpause(_P_TURN)

    def throttle_tick(self):
        """The broker's throttle tick (Broker.throttle): the tokens have grown since."""
        self._metered(b"")

    def _pause(self, why):
        if not self._paused and self.transport is not None:
            try:
                self.transport.pause_reading()
            except (RuntimeError, AttributeError):
                pass
        self._paused |= why

    def _unpause(self, why):
        if not self._paused & why:
            return
        self._paused &= ~why
        if not self._paused and not self.closing and self.transport is not None:
            try:
                self.transport.resume_reading()
            except (RuntimeError, AttributeError):
                pass

    def eof_received(self):
        return False  # the transport closes (lingering: the client has read our end)

    def pause_writing(self):
        self._stopped = True
        self.congested = True
        if not self.closing:
            self._pause(_P_WRITE)

    def resume_writing(self):
        self._stopped = False
        self._recheck()

    def _recheck(self):
        """Measure the room the transport leaves and, unless it paused us, stop being congested."""
        t = self.transport
        if t is not None:
            self._room = self._high - t.get_write_buffer_size()
        if self.congested and not self._stopped:
            self._uncongest()

    def _uncongest(self):
        self.congested = False
        if not self.closing:
            self._unpause(_P_WRITE)
            session = self.session
            if session is not None and (session.queue or session.resend or session.retained_due):
                self.router.drain(session)

    def connection_lost(self, exc):
        self._lingering = False
        self._detach(f"connection lost ({exc})" if exc else "connection closed by client")
        self.broker.connections.discard(self)

    def _detach(self, otherwise):
        """The connection is over for the router: its session goes offline (once). The
        reason logged is the DISCONNECT's, the client's, or `otherwise`."""
        self.closing = True
        self.state = states.advance(self.state, states.CLOSE)
        self._unwatch()
        session = self.session
        if session is not None:
            self.session = None
            if self._reason is not None:
                why = C.REASON_NAMES.get(self._reason, hex(self._reason))
            elif self.clean_disconnect:
                why = "client disconnected"
            else:
                why = otherwise
            if log.isEnabledFor(logging.INFO):
                log.info("client %s disconnected from %s: %s", session.client_id, self.address, why,
                         extra={"event": "client.disconnected", "client_id": session.client_id,
                                "address": self.address, "listener": self.listener_name, "reason": why})
            self.router.connection_lost(session, True, why)
        self._out.clear()

    # --- sending -----------------------------------------------------------

    def send(self, data):
        """Queue bytes for this loop turn's single write."""
        out = self._out
        if not out:
            if self.closing:
                return
            self.broker.mark_dirty(self)
        out.append(data)
        self._backed += len(data)
        if self._backed > self._room and not self.congested:
            self._overflow()

    def _overflow(self):
        """This turn's output outgrew the room write_buffer_high left: hand it to the
        transport now (the kernel takes what it can) and see what is left buffered. Over
        the limit, or when output must wait for the store, the connection is congested."""
        if not self.broker.holding():
            self.write_now(self.take_output())
            if self._room >= 0 or self._stopped:
                return
            self.broker.mark_dirty(self)  # a transport that did not pause: look again at the turn's end
        self.congested = True
        self._pause(_P_WRITE)

    def take_output(self):
        """Detach what is queued (the broker holds it until the store says it is durable)."""
        out = self._out
        if not out:
            return b""
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        self._backed = 0
        return data

    def flush(self):
        data = self.take_output()
        if data or self.close_pending:
            self.write_now(data)
            if self.close_pending:
                self.close_pending = False
                self.write_now(None)
        elif self.congested:
            self._recheck()

    def write_now(self, data):
        """Write bytes (or, for None, close the connection: _shut) right away."""
        t = self.transport
        if t is None or t.is_closing() or self._lingering:
            return
        if data is None:
            self._shut()
            return
        t.write(data)
        self._wrote = True
        n = len(data)
        self.router.stats.bytes_sent += n
        self.bytes_out += n
        self._recheck()

    def close(self, reason=None):
        """Close after sending what is queued; 5.0 clients get DISCONNECT(reason) first."""
        if self.closing:
            return
        if reason is not None:
            self._reason = reason
            if self.version == C.MQTT5 and self.state in (OPEN, CLOSED) or \
                    (self.version == C.MQTT5 and reason == C.SESSION_TAKEN_OVER):
                self.send(encode(Disconnect(reason), C.MQTT5))
        if self.broker.holding() and self.transport is not None:
            # Output waits for the store: close after it has been written.
            self.close_pending = True
            self._pause(_P_CLOSE)
            self.closing = True
            self._unwatch()
            self.broker.mark_dirty(self)
            return
        self.flush()
        self.closing = True
        self._unwatch()
        self._shut()

    def _shut(self):
        """Close after the last packet so that the client can read it.

        A socket closed with unread input sends a reset, and so does one closed when more
        input arrives: a client still sending (PUBRELs after a DISCONNECT 0x93, packets
        after a refusing CONNACK) then gets ECONNRESET, often before it has read the
        reason. So the session lets go now, as at any close; the transport half-closes
        once what it holds is written (TCP and Unix sockets: write_eof; TLS: close_notify;
        WebSocket: a close frame, whose handshake websockets runs) and the input that
        still comes is read and dropped until the client closes its side. A client that
        does not is aborted after LINGER_SECONDS, or once it has sent the bytes _discard
        allows (over TLS the TLS layer drops them unseen: the time bound applies). A
        connection that was never sent a byte has nothing to read: it closes at once.
        """
        t = self.transport
        if t is None or self._lingering or t.is_closing():
            return
        self._detach("closed by the broker")
        if not self._wrote:
            t.close()
            return
        self._lingering = True
        self._watch = self.broker.watch(self, monotonic() + LINGER_SECONDS)
        if self._paused:
            self._paused = 0
            try:
                t.resume_reading()
            except (RuntimeError, AttributeError):
                pass
        if not t.can_write_eof():
            t.close()  # TLS, WebSocket: they read and drop what follows their close message
            return
        try:
            t.write_eof()
        except (OSError, RuntimeError):
            t.abort()

    def _discard(self, n):
        """Input after our last packet: dropped, within the bound (_shut)."""
        self._discarded += n
        allowed = self.broker.config.limits.max_packet_size
        if isinstance(self._error, PacketTooLarge):
            allowed = max(allowed, self._error.size)  # the client can still read 0x95 after sending it
        if self._discarded > allowed + LINGER_EXTRA_BYTES:
            log.info("closing %s: it sent %d bytes after its connection was closed",
                     self.address, self._discarded)
            self.abort()

    def abort(self):
        self.closing = True
        if self.transport is not None:
            self.transport.abort()

    def protocol_error(self, err):
        self._error = err
        session = self.session
        who = session.client_id if session is not None else self.address
        if isinstance(err, PacketTooLarge) and self.broker.first_time(
                "packet_too_large", who if session is not None else self.address.rpartition(":")[0]):
            # A client whose publishes are over the limit (Mosquitto's is 256 MB) sees only
            # a lost connection (3.1.1) or a code (5.0): say why and how to raise it, once
            # per client id (once per host before CONNECT), not at every retry.
            log.warning("client %s sent a packet of %d bytes, over [limits] max_packet_size = %d: "
                        "closing its connection (raise max_packet_size to accept such packets; "
                        "said once per client id)", who, err.size, err.limit)
        else:
            log.info("protocol error from %s: %s", who, err)
        if isinstance(err, ConnectRefused):
            if self.state != OPEN:
                self.refuse(err.version, err.reason)
                return
            self.close(C.PROTOCOL_ERROR)  # a second CONNECT is a protocol error, whatever is in it
            return
        self.close(err.reason)

    # --- CONNECT and authentication -----------------------------------------

    def _before_open(self, data):
        if self._error is not None:
            return  # after a bad packet: what it pipelined behind the CONNECT is all it gets
        if self.state == AUTH:
            if self._auth_method is not None:
                self._auth_exchange(data)
            else:
                # Authentication in progress: keep the bytes; reading is paused anyway.
                self._pending = data if self._pending is None else self._pending + data
            return
        sniff = self._sniff
        if sniff:
            self._sniff = False  # only the stream's first bytes say what protocol it is
        try:
            packets = self.decoder.feed(data)
        except MQTTError as e:
            packets = e.packets
            if not packets:
                if not (sniff and self._foreign(data)):
                    self.protocol_error(e)
                return
            self._error = e  # after the CONNECT and the packets behind it (_accept)
        if not packets:
            if sniff:
                self._foreign(data)
            return
        first = packets[0]
        try:
            states.check(NEW, first.TYPE)
        except MQTTError:
            if sniff and self._foreign(data):
                return
            log.info("closing %s: first packet is %s, not CONNECT", self.address,
                     C.PACKET_NAMES.get(first.TYPE))
            self.close()
            return
        self.version = first.version
        rest = packets[1:]
        self._connect = first
        self.state = states.advance(NEW, states.CONNECT_RECEIVED)
        if rest:
            # Already decoded: re-encode is not possible cheaply, so keep the packets.
            self._pending = rest
        self._authenticate(first)

    def _foreign(self, data):
        """Close a plain connection that speaks TLS or HTTP, saying so; True if it did.

        Checked only when the first bytes are not a CONNECT (the decoder failed, waits
        for more, or found another packet), so a normal connect pays nothing for it.
        """
        if data[0] == TLS_HANDSHAKE:
            log.warning("%s sent a TLS ClientHello to plain MQTT listener %s; closing (connect "
                        "without TLS, or use a listener with tls = true)", self.address, self.listener_name)
        elif data[:4] in HTTP_METHODS:
            log.warning("%s sent an HTTP request to MQTT listener %s; closing (a WebSocket client "
                        "needs a type = \"ws\" listener)", self.address, self.listener_name)
        else:
            return False
        self.closing = True
        self.transport.abort()
        return True

    def _client_info(self, pkt):
        return ClientInfo(pkt.client_id, pkt.username, self.address, pkt.version, self.listener_name)

    def _authenticate(self, pkt):
        bans = self.broker.bans
        if bans.entries:
            ban = bans.match(pkt.client_id, pkt.username, self.address)
            if ban is not None:
                bans.refused += 1
                log.info("refusing %s (client %s, user %r): banned by %s %s", self.address, pkt.client_id,
                         pkt.username, ban.kind, ban.value)
                self.refuse(pkt.version, C.BANNED)
                return
        hooks = self.broker.hooks
        props = pkt.properties
        method = props.get("authentication_method") if props and pkt.version == C.MQTT5 else None
        if method is not None:
            hook = hooks.auth_methods.get(method)
            if hook is None:
                self.refuse(pkt.version, C.BAD_AUTHENTICATION_METHOD)
                return
            self._auth_method = method
            self._pause(_P_AUTH)  # until the exchange is over (a plain answer needs no pause)
            self.broker.spawn(self._enhanced_auth(hook, pkt, method, pkt.properties.get("authentication_data"), 0))
            return
        if hooks.auth_async:
            self._pause(_P_AUTH)
            self.broker.spawn(self._authenticate_async(pkt))
        else:
            try:
                result = hooks.authenticate(self._client_info(pkt), pkt)
            except Exception:
                log.exception("authentication hook failed for %s", self.address)
                result = C.UNSPECIFIED_ERROR
            self._auth_done(pkt, result)

    async def _authenticate_async(self, pkt):
        try:
            result = await self.broker.hooks.authenticate_async(self._client_info(pkt), pkt)
        except Exception:
            log.exception("authentication hook failed for %s", self.address)
            result = C.UNSPECIFIED_ERROR
        self._auth_done(pkt, result)

    async def _enhanced_auth(self, hook, pkt, method, data, step):
        try:
            r = hook.enhanced_auth(self._client_info(pkt), method, data, step)
            if asyncio.iscoroutine(r) or isinstance(r, asyncio.Future):
                r = await r
            reason, out = r
        except Exception:
            log.exception("enhanced auth hook failed for %s", self.address)
            reason, out = C.UNSPECIFIED_ERROR, None
        if self.closing:
            return
        props = {"authentication_method": method}
        if out is not None:
            props["authentication_data"] = out
        if reason == C.CONTINUE_AUTHENTICATION:
            self.send(encode(Auth(C.CONTINUE_AUTHENTICATION, props), C.MQTT5))
            if self.state == AUTH:
                self._unpause(_P_AUTH)  # the client's next AUTH must get through
            return
        if self.state == OPEN:  # re-authentication of an open connection
            if reason == 0:
                self.send(encode(Auth(0, props), C.MQTT5))
            else:
                self.close(reason)
            return
        self._auth_done(pkt, True if reason == 0 else reason, props)

    def _auth_exchange(self, data):
        """Bytes during an enhanced-auth exchange before CONNACK: only AUTH may come."""
        try:
            for pkt in self.decoder.feed(data):
                states.check(AUTH, pkt.TYPE)
                if pkt.TYPE == C.DISCONNECT:
                    self.close()
                    return
                if pkt.reason_code != C.CONTINUE_AUTHENTICATION:
                    raise MQTTError(C.PROTOCOL_ERROR, "AUTH during authentication without continue (0x18)")
                self._pause(_P_AUTH)
                self._on_auth_packet(pkt)
        except MQTTError as e:
            self.refuse(C.MQTT5, e.reason)

    def _on_auth_packet(self, pkt):
        """AUTH after CONNECT: a continue step or a re-authentication."""
        method = pkt.properties.get("authentication_method")
        if self._auth_method is None or method != self._auth_method:
            raise MQTTError(C.PROTOCOL_ERROR, "AUTH with a different or no authentication method")
        hook = self.broker.hooks.auth_methods.get(method)
        self.broker.spawn(self._enhanced_auth(hook, self._connect, method,
                                              pkt.properties.get("authentication_data"), 1))

    def _auth_done(self, pkt, result, auth_props=None):
        if self.closing:
            return
        if result is None:  # no hook had an opinion: the [auth] anonymous policy
            if not self.broker.auth.anonymous_allowed(self.listener_name):
                result = C.BAD_USER_NAME_OR_PASSWORD if pkt.username is not None else C.NOT_AUTHORIZED
        if result is False:
            result = C.BAD_USER_NAME_OR_PASSWORD
        if result is not None and result is not True:
            self.refuse(pkt.version, int(result))
            return
        cluster = self.broker.cluster
        if cluster is not None and not pkt.clean_start and pkt.client_id and \
                pkt.client_id not in self.router.sessions:
            # Its session may be on another node: have it handed over first. The CONNECT
            # is all here: the connect timeout, which bounds a client that does not send
            # it, gives way to the claim's own bound (a failover it waits for takes the
            # lease and more), past which the client is told the server is unavailable.
            self._pause(_P_AUTH)
            self._claim = _CLAIMING
            self._unwatch()
            self._watch = self.broker.watch(self, monotonic() + cluster.claim_timeout)
            self.broker.spawn(self._claim_then_accept(cluster, pkt, auth_props))
            return
        self._accept(pkt, auth_props)

    async def _claim_then_accept(self, cluster, pkt, auth_props):
        adopted = False
        try:
            adopted = await cluster.claim(pkt.client_id, self._claim_given_up)
        except TimeoutError:
            # (The session is kept where it is, replicated: starting a new one here would
            # end it. The client is to come back for it.)
            if not self.closing:
                log.info("client %s: its session was not handed over in time", pkt.client_id)
                self.refuse(pkt.version, C.SERVER_UNAVAILABLE)
            return
        except Exception:
            log.exception("taking %s's session over from another node failed", pkt.client_id)
        finally:
            self._claim = _CLAIMED
        if not self.closing and self._client_left():
            # (Its registration, newer than that of the connection it opened since, would
            # take the client id, and the session, from that live connection.)
            log.info("client %s closed its connection while its session was being claimed from another node",
                     pkt.client_id)
            self.abort()
        if not self.closing:
            self._accept(pkt, auth_props)
        elif adopted:
            self.router.park_adopted(pkt.client_id)  # the client left meanwhile

    def _claim_given_up(self):
        """Whether the CONNECT whose session is being claimed is over: refused here (the
        claim outlasted its bound) or closed by its client."""
        return self.closing or self._client_left()

    def _client_left(self):
        """Whether the client has closed its end while reading was paused (a CONNECT it
        gave up waiting for, its session being claimed, before it connected elsewhere): a
        peek at the socket, which takes nothing from it. False when it cannot be told (a
        TLS or WebSocket client's close comes with data first)."""
        transport = self.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None:
            return False
        try:
            with sock.dup() as s:
                return s.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except (BlockingIOError, InterruptedError):
            return False
        except (AttributeError, TypeError, ValueError):
            return False
        except OSError:
            return True  # (reset by the client)

    def _accept(self, pkt, auth_props):
        """Authenticated (and any session on another node handed over): the router's turn."""
        self._unwatch()
        session = self.router.connect(self, pkt, pkt.username, auth_props)
        if session is None:
            return
        self.session = session
        self.state = states.advance(self.state, states.ACCEPTED)
        if self._auth_method is None:
            self._connect = None  # kept only for re-authentication
        self.decoder.version = pkt.version
        now = self._last_rx = monotonic()
        if self.keepalive:
            limit = self.keepalive * 1.5
            if limit < self.broker.config.limits.connect_timeout or self._claim is not None:
                # Sooner than the connect-timeout check, which otherwise starts it (a
                # claim took that check's place: Broker._sweep skips a watched connection).
                self._watch = self.broker.watch(self, now + limit)
        pending = self._pending
        self._pending = None
        self._unpause(_P_AUTH)
        if pending:
            if isinstance(pending, list):
                self._dispatch(pending)
            else:
                self.data_received(pending)
        failed = self._error
        if failed is not None and not self.closing:
            self.protocol_error(failed)

    def refuse(self, version, reason):
        """Answer a CONNECT with a failure CONNACK and close."""
        if version == C.MQTT5:
            self.send(encode(Connack(False, reason), version))
        else:
            rc = C.V5_TO_V311_CONNACK.get(reason)
            if rc is not None:
                self.send(encode(Connack(False, rc), version))
        why = C.REASON_NAMES.get(reason, hex(reason))
        log.info("refused CONNECT from %s: %s", self.address, why,
                 extra={"event": "connect.refused", "address": self.address,
                        "listener": self.listener_name, "reason": why})
        self.close()

    # --- timers ------------------------------------------------------------

    @property
    def watched(self):
        """True while the broker's wheel has a deadline of this connection (Broker.watch)."""
        return self._watch is not None

    def _unwatch(self):
        if self._watch is not None:
            self.broker.unwatch(self, self._watch)
            self._watch = None

    def deadline(self, now):
        """Called by the broker's wheel (Broker.watch): connect timeout, then keepalive;
        after the close, the end of the linger (_shut)."""
        self._watch = None
        if self._lingering:
            self.abort()
            return
        if self.closing:
            return
        state = self.state
        if state == NEW:
            log.info("closing %s: no CONNECT within the connect timeout", self.address)
            self.close()
        elif state == AUTH and self._claim == _CLAIMING:
            # (Its claim goes on: a session it takes now stays here offline, registered
            # here, for the client's next CONNECT: Router.park_adopted.)
            log.info("closing %s: its session was not handed over from another node within %.0f s",
                     self.address, self.broker.cluster.claim_timeout)
            self.refuse(self.version, C.SERVER_UNAVAILABLE)
        elif state == AUTH:
            log.info("closing %s: authentication not finished within the connect timeout", self.address)
            self.refuse(self.version, C.NOT_AUTHORIZED)
        elif self.keepalive:
            limit = self.keepalive * 1.5
            idle = now - self._last_rx
            if idle >= limit:
                log.info("client %s: keepalive timeout after %.1fs idle",
                         self.session.client_id if self.session else self.address, idle)
                self.close(C.KEEP_ALIVE_TIMEOUT)
            else:
                self._watch = self.broker.watch(self, self._last_rx + limit)
