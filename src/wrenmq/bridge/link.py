"""A bridge's I/O edge: its connection to the remote broker, its reads of the commit log.

One `Bridge` per [[bridge]], on the broker's event loop (no thread). It connects to
each address in turn, with a backoff, and speaks MQTT through `BridgeSession` (sans-IO)
over an asyncio Protocol, `_Wire`, with TLS from the stdlib.

Out: `_pump` reads the log from the session's read position, a chunk per loop turn,
while the window has room and the socket drains; the broker calls `wake` at the end of a
turn in which the log grew. The cursor goes to the state database (`Store.set_meta`,
written with the next epoch, atomically with it) whenever it moves: a restart sends
from there again.

In: a PUBLISH from the remote is published here on behalf of the bridge's local identity
(`ClientInfo` "$bridge/<name>", with `local_username`: ACL hooks decide as for a client),
and its PUBACK/PUBREC waits in `_Wire`'s output like any client's acknowledgement: the
broker's end-of-turn flush holds it until the log has the message (`Broker.mark_dirty`).
"""

import asyncio
import logging
import ssl
import time
from time import monotonic

from ..broker.hooks import ClientInfo
from ..mqtt.topics import TopicError, validate_topic_name
from ..config import ConfigError
from ..mqtt import constants as C
from ..mqtt.codec import Decoder, MQTTError
from .session import DELIVER, POISON_STRIKES, BridgeRefused, BridgeSession
from .topics import TopicMap

log = logging.getLogger("wrenmq.bridge")

CONNECT_TIMEOUT = 10.0  # seconds for the TCP/TLS connect, and again for the CONNACK
_READ_CHUNK = 500  # log records read per loop turn at most
_TICK = 1.0  # seconds between keepalive checks at most
_HIGH_WATER = 1 << 20  # bytes the socket may buffer before the log is not read further


def cursor_key(name):
    """The state database's meta key of bridge `name`'s cursor."""
    return f"bridge/{name}/cursor"


def tls_context(cfg, where):
    """The client TLS context of a [[bridge]] with tls (`where`: "FILE: bridge[i]"); a file
    that cannot be used is a ConfigError naming its key."""
    try:
        ctx = ssl.create_default_context(cafile=cfg.cafile or None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"{where}.cafile: cannot load {cfg.cafile}: {e}") from None
    if cfg.certfile:
        try:
            ctx.load_cert_chain(cfg.certfile, cfg.keyfile or None)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(f"{where}.certfile: cannot load {cfg.certfile}"
                              f"{' with ' + cfg.keyfile if cfg.keyfile else ''}: {e}") from None
    return ctx


class _Wire(asyncio.Protocol):
    """One connection to the remote. For the broker's end-of-turn flush it is also a
    connection with output (`take_output`, `flush`, `write_now`): the acknowledgements
    of messages brought in wait there until what they confirm is in the log."""

    def __init__(self, bridge):
        self.bridge = bridge
        self.transport = None
        # What a client may send here bounds what a remote may: an MQTT 5 remote is told
        # (and drops larger messages for the bridge); from a 3.1.1 remote a larger packet
        # ends the connection.
        self.decoder = Decoder(bridge.session.version, bridge.session.max_packet_size)
        self.paused = False  # the socket is over its write buffer limit
        self.close_pending = False
        self.opened = monotonic()
        self.closed = asyncio.get_running_loop().create_future()
        self._out = []

    def connection_made(self, transport):
        self.transport = transport
        transport.set_write_buffer_limits(high=_HIGH_WATER)

    def data_received(self, data):
        self.bridge._received(self, data)

    def eof_received(self):
        return False

    def connection_lost(self, exc):
        self.transport = None
        if not self.closed.done():
            self.closed.set_result(exc)

    def pause_writing(self):
        self.paused = True

    def resume_writing(self):
        self.paused = False
        self.bridge.wake()

    def write(self, data):
        t = self.transport
        if t is not None and not t.is_closing():
            t.write(data)
            self.bridge.last_tx = monotonic()

    def abort(self):
        if self.transport is not None:
            self.transport.abort()

    # --- what the broker's flush calls (connection.py has the same) ------------------

    def send_held(self, data):
        """Queue an acknowledgement for this loop turn's flush (held while the store must)."""
        if not self._out:
            self.bridge.broker.mark_dirty(self)
        self._out.append(data)

    def take_output(self):
        out = self._out
        if not out:
            return b""
        data = b"".join(out)
        out.clear()
        return data

    def flush(self):
        data = self.take_output()
        if data:
            self.write_now(data)

    def write_now(self, data):
        if data is None:
            self.abort()
        elif data:
            self.write(data)


class Bridge:
    """One [[bridge]]: its session with the remote, its connection, its cursor in the log."""

    def __init__(self, broker, cfg, index, node, cluster_name=None, ssl_context=None):
        self.broker = broker
        self.cfg = cfg
        self.name = cfg.name
        self.key = f"bridge[{index}]"
        self.source = broker.config.source
        self.topics = TopicMap(cfg.topic)
        self.has_out = bool(self.topics.out)
        self.node = node
        self.clustered = cluster_name is not None
        self.base_id = cfg.client_id or f"{cluster_name or node}-{cfg.name}"
        self.ssl = ssl_context
        version = C.MQTT5 if cfg.protocol == "5" else C.MQTT311
        # Who the messages brought in are from, for ACL hooks and the log record.
        self.local = ClientInfo(f"$bridge/{cfg.name}", cfg.local_username or None, f"bridge:{cfg.name}",
                                version, f"bridge:{cfg.name}")
        store = broker.store
        self.store = store if self.has_out else None
        cursor = 0
        if self.store is not None:
            # The log's end when the store opened, not now: extensions start once the
            # listeners are open, so clients may have published (and been acknowledged)
            # already, and those records are this bridge's to send. (Below next_offset: a
            # replicated partition's log may have been cut back since.)
            end = min(store.opened_at, store.next_offset)
            saved = store.meta_at_open.get(cursor_key(cfg.name))
            # A new bridge starts at that end; a saved cursor past it (the log's tail was
            # cut at start-up, and its offsets are written again) comes back to it.
            cursor = min(int(saved), end) if saved and saved.isdigit() else end
        self.saved = None
        self.owner = not self.clustered  # holds the remote subscription (cluster: the etcd lease)
        self.owner_node = node if self.owner else ""
        mark = self.base_id if self.clustered else None
        self.session = BridgeSession(cfg, self.topics, self.local.client_id, self.base_id, cursor, mark,
                                     subscribe=self.owner, max_packet_size=broker.config.limits.max_packet_size)
        self.state = "stopped"
        self.on_change = None  # called with the bridge when its state changes ($SYS at once)
        self.address = ""
        self.wire = None
        self.last_rx = self.last_tx = monotonic()
        self.connects = 0
        self.failures = 0
        self.lost = 0  # records [log] retention deleted before the bridge sent them
        self.denied = 0  # messages brought in that the ACL refused here
        self.invalid = 0  # messages brought in on topics this broker does not take
        self._said_disk = False
        self._drops_said = 0
        self._pump_soon = False
        self._task = None
        self._tick_handle = None
        self._stopping = False
        self._changed = None  # set when the role changes (cluster), to cut a backoff short
        if self.store is not None:
            self._save_cursor()

    # --- lifecycle ------------------------------------------------------------------------

    def _set_state(self, state):
        if state != self.state:
            self.state = state
            if self.on_change is not None:
                self.on_change(self)

    def start(self):
        self._set_state("connecting")
        self._changed = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self):
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        wire = self.wire
        if wire is not None and wire.transport is not None:
            if self.session.connected:
                wire.write(self.session.disconnect_packet())
            wire.transport.close()
        self._disconnected(wire, "the broker is stopping")
        if self.store is not None:
            self._save_cursor()
        self.state = "stopped"  # (not reported: the broker is stopping)

    def set_owner(self, owner, holder=""):
        """(Cluster) this node holds the bridge's remote session now, or no longer: reconnect
        under the client id that goes with it."""
        self.owner_node = holder
        if owner == self.owner:
            return
        self.owner = owner
        self.session.subscribe = owner
        log.info("bridge %s: %s", self.name, "this node runs the remote session now (subscriptions, "
                 "client id %s)" % self.base_id if owner else "another node runs the remote session now")
        wire = self.wire
        if wire is not None and wire.transport is not None:
            if self.session.connected:
                wire.write(self.session.disconnect_packet())
            wire.transport.close()
        if self._changed is not None:
            self._changed.set()

    @property
    def client_id(self):
        return self.base_id if self.owner or not self.clustered else f"{self.base_id}-{self.node}"

    def _wanted(self):
        """Whether this node connects at all: to hold the remote session, or to send what
        its log has for the remote."""
        return self.owner or self.has_out

    async def _run(self):
        cfg = self.cfg
        delay = cfg.reconnect_delay
        attempt = 0
        while not self._stopping:
            if not self._wanted():
                self._set_state("standby")
                self._changed.clear()
                await self._changed.wait()
                continue
            address = cfg.address[attempt % len(cfg.address)]
            attempt += 1
            self._changed.clear()
            up = await self._connect(address, delay)
            if self._stopping:
                return
            if up:
                delay = cfg.reconnect_delay
                attempt -= 1  # (the address that worked is tried first again)
                if self._changed.is_set():
                    continue  # the role changed: reconnect at once under the other client id
            self._set_state("waiting")
            try:
                await asyncio.wait_for(self._changed.wait(), delay)
            except asyncio.TimeoutError:
                pass
            delay = min(delay * 2, cfg.reconnect_max)

    async def _connect(self, address, delay):
        """One connection, from the connect to its end; True if the remote accepted it."""
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        self.address = address
        self._set_state("connecting")
        loop = asyncio.get_running_loop()
        wire = _Wire(self)
        self.session.client_id = self.client_id
        try:
            await asyncio.wait_for(loop.create_connection(
                lambda: wire, host, int(port), ssl=self.ssl, server_hostname=host if self.ssl else None),
                CONNECT_TIMEOUT)
        except (OSError, asyncio.TimeoutError, ssl.SSLError) as e:
            self.failures += 1
            why = str(e) or type(e).__name__
            if isinstance(e, asyncio.TimeoutError):
                why = f"no answer in {CONNECT_TIMEOUT:g} s"
            log.warning("bridge %s: cannot connect to %s (%s.address in %s): %s; retrying in %.1f s",
                        self.name, address, self.key, self.source, why, delay)
            return False
        self.wire = wire
        self.last_rx = self.last_tx = wire.opened = monotonic()
        wire.write(self.session.connect_packet())
        self._tick_handle = loop.call_later(min(_TICK, self.cfg.keepalive / 4), self._tick)
        why = await wire.closed
        up = self.session.connected
        if not up and not self._stopping:
            self.failures += 1
        self._disconnected(wire, why, self.cfg.reconnect_delay if up else delay)
        return up

    def _disconnected(self, wire, why, delay=None):
        if wire is None or self.wire is not wire:
            return
        self.wire = None
        if self._tick_handle is not None:
            self._tick_handle.cancel()
            self._tick_handle = None
        session = self.session
        was_up = session.connected
        skipped = session.lost()
        if skipped is not None:
            log.error("bridge %s: the remote closed the connection %d times with the message at offset %d "
                      "unacknowledged; skipping it (counted in messages/dropped)", self.name,
                      POISON_STRIKES, skipped.offset)
        if was_up and not self._stopping:
            reason = why if isinstance(why, str) else (f"{why}" if why else "closed by the remote")
            log.warning("bridge %s: connection to %s lost (%s); reconnecting%s", self.name, self.address,
                        reason, f" in {delay:.1f} s" if delay else "")
        elif not was_up and why and not self._stopping and self.state == "connecting":
            log.warning("bridge %s: %s closed the connection before accepting it (%s)", self.name,
                        self.address, why)

    def _tick(self):
        wire = self.wire
        self._tick_handle = None
        if wire is None or wire.transport is None:
            return
        now = monotonic()
        ka = self.cfg.keepalive
        if not self.session.connected:
            if now - wire.opened > CONNECT_TIMEOUT:
                log.warning("bridge %s: no CONNACK from %s in %g s", self.name, self.address, CONNECT_TIMEOUT)
                wire.abort()
                return
        elif now - self.last_rx > ka * 1.5:
            log.warning("bridge %s: %s silent for %.0f s (keepalive %d s); reconnecting", self.name,
                        self.address, now - self.last_rx, ka)
            wire.abort()
            return
        else:
            if now - self.last_tx >= ka:
                wire.write(b"\xc0\x00")  # PINGREQ
            self.wake()  # (a read that came back short is tried again)
        self._tick_handle = asyncio.get_running_loop().call_later(min(_TICK, ka / 4), self._tick)

    # --- what the remote sends -------------------------------------------------------------

    def _received(self, wire, data):
        if wire is not self.wire:
            return
        self.last_rx = monotonic()
        session = self.session
        try:
            packets = wire.decoder.feed(data)
        except MQTTError as e:
            hint = " ([limits] max_packet_size bounds what a remote may send)" \
                if e.reason == C.PACKET_TOO_LARGE else ""
            log.warning("bridge %s: cannot take what %s sent: %s%s; reconnecting", self.name, self.address, e, hint)
            wire.abort()
            return
        moved = False
        for pkt in packets:
            kind = pkt.TYPE
            if not session.connected:
                if kind != C.CONNACK:
                    log.warning("bridge %s: %s sent %s before CONNACK", self.name, self.address,
                                C.PACKET_NAMES.get(kind, kind))
                    wire.abort()
                    return
                try:
                    out = session.connack(pkt)
                except BridgeRefused as e:
                    log.error("bridge %s: %s (%s at %s, client id %r)", self.name, e, self.key, self.address,
                              session.client_id)
                    wire.abort()
                    return
                self.connects += 1
                self._set_state("connected")
                end = self.store.next_offset if self.store is not None else 0
                log.info("bridge %s: connected to %s as %s (MQTT %s, session %s)%s", self.name, self.address,
                         session.client_id, self.cfg.protocol, "resumed" if session.session_present else "new",
                         f"; sending from offset {session.cursor} ({end - session.cursor} record(s) behind)"
                         if self.store is not None else "")
                for data_out in out:
                    wire.write(data_out)
                moved = True
            elif kind == C.PUBLISH:
                self._incoming(wire, pkt)
            elif kind in (C.PUBACK, C.PUBREC, C.PUBCOMP):
                rel = session.acked(pkt)
                if rel is not None:
                    wire.write(rel)
                moved = True
            elif kind == C.PUBREL:
                wire.send_held(session.release(pkt))
            elif kind == C.SUBACK:
                for (flt, _), code in zip(self.topics.subscriptions(), pkt.reason_codes):
                    if code >= 0x80:
                        log.error("bridge %s: %s refused the subscription to %r: %s", self.name, self.address,
                                  flt, C.REASON_NAMES.get(code, hex(code)))
            elif kind == C.DISCONNECT:
                log.warning("bridge %s: %s disconnected the bridge: %s", self.name, self.address,
                            C.REASON_NAMES.get(pkt.reason_code, hex(pkt.reason_code)))
                wire.abort()
                return
            elif kind != C.PINGRESP:
                log.warning("bridge %s: unexpected %s from %s; reconnecting", self.name,
                            C.PACKET_NAMES.get(kind, kind), self.address)
                wire.abort()
                return
        if moved:
            self._pump()
        self._note_drops()

    def _note_drops(self):
        """Log what was not carried, at 1, 2, 4, 8... of them (a few lines, not one per message)."""
        s = self.session
        n = s.refused + s.too_large + s.expired + s.skipped + s.unmapped + self.invalid
        if n > self._drops_said and n >= 2 * self._drops_said:
            self._drops_said = n
            log.warning("bridge %s: %d message(s) not carried so far: %d refused by the remote, %d over its "
                        "maximum packet size, %d expired, %d skipped, %d in on topics not carried in, %d in on "
                        "topics not valid here", self.name, n, s.refused, s.too_large, s.expired, s.skipped,
                        s.unmapped, self.invalid)

    def _incoming(self, wire, pkt):
        action, topic, props = self.session.incoming(pkt)
        taken = False
        if action == DELIVER:
            broker = self.broker
            router = broker.router
            qos = min(pkt.qos, broker.config.broker.maximum_qos)
            if qos and router.disk_low:
                # The log cannot take it: not acknowledged, so the remote sends it again
                # once the bridge is back (after the backoff).
                if not self._said_disk:
                    self._said_disk = True
                    log.warning("bridge %s: the disk is low ([storage] min_free_bytes): disconnecting from "
                                "%s so the remote keeps the messages", self.name, self.address)
                wire.abort()
                return
            self._said_disk = False
            limits = broker.config.limits
            try:
                validate_topic_name(topic, limits.max_topic_levels)
                if len(topic.encode()) > limits.max_topic_length:
                    raise TopicError("too long")
            except TopicError:
                self.invalid += 1
                topic = None
            hooks = broker.hooks
            if topic is None:
                pass
            elif hooks.authorize_publish is not None and \
                    hooks.authorize_publish(self.local, topic, qos, pkt.retain) is False:
                self.denied += 1
                if self.denied & (self.denied - 1) == 0:  # 1, 2, 4...: a few lines, not one per message
                    log.warning("bridge %s: the ACL does not let %s publish to %s (%d refused so far)",
                                self.name, self.local.username or "the bridge (no local_username)", topic,
                                self.denied)
            else:
                broker.publish(topic, pkt.payload, qos, pkt.retain and router.retain_available, props,
                               client=self.local)
                self.session.received += 1
                taken = True
        ack = self.session.ack_for(pkt, taken)
        if ack is not None:
            wire.send_held(ack)

    # --- what goes out ------------------------------------------------------------------------

    def wake(self):
        """The log grew, or there is room again: pump in a coming loop turn (once)."""
        if not self._pump_soon and self.wire is not None and self.store is not None:
            self._pump_soon = True
            asyncio.get_running_loop().call_soon(self._pump)

    def _pump(self):
        """Send what the log holds from the read position: one chunk of records this turn,
        while the window has room and the socket drains; again next turn if there is more."""
        self._pump_soon = False
        wire = self.wire
        session = self.session
        store = self.store
        if store is None or wire is None or not session.connected or wire.paused or wire.transport is None:
            self._save_cursor()
            return
        end = store.next_offset
        start = store.start_offset
        if session.read_pos < start:
            lost = start - session.read_pos
            self.lost += lost
            log.warning("bridge %s: %d record(s) were deleted by [log] retention before the bridge could "
                        "send them", self.name, lost)
            session.read_pos = start
        if session.read_pos < end and not session.full:
            room = session.window - len(session.inflight)
            recs, after = store.read_span(session.read_pos, max(64, min(_READ_CHUNK, room)))
            retry = False
            if not recs:
                # Past a stretch of state records (a replicated log's), or one the log's
                # reader found damaged (it logged it); nothing else makes a read below the
                # end come back empty for good (retention deleting the records meanwhile is
                # seen next turn, above), so look again on the next tick, never passing
                # over records unsent.
                past = after if after > session.read_pos else store.unreadable_end(session.read_pos)
                if past is not None:
                    session.read_pos = min(past, end)
                else:
                    retry = True
            now = time.time()
            out = []
            take = session.take
            for rec in recs:
                if session.full:
                    break
                packet = take(rec, now)
                if packet is not None:
                    out.append(packet)
            if recs and session.read_pos == recs[-1].offset + 1:  # (all taken)
                session.read_pos = max(session.read_pos, min(after, end))
            if out:
                wire.transport.writelines(out)
                self.last_tx = monotonic()
            if session.read_pos < end and not session.full and not retry:
                self.wake()
            self._note_drops()
        self._save_cursor()

    def _save_cursor(self):
        cursor = self.session.cursor
        if cursor != self.saved and self.store is not None and self.store.failed is None:
            self.saved = cursor
            self.store.set_meta(cursor_key(self.name), str(cursor))

    # --- figures ---------------------------------------------------------------------------------

    def lag(self):
        """(records behind, seconds behind): the log's end minus the cursor, and the age of
        the oldest record not yet acknowledged by the remote."""
        store = self.store
        if store is None:
            return 0, 0.0
        session = self.session
        cursor = session.cursor
        end = store.next_offset
        if cursor >= end:
            return 0, 0.0
        if session.inflight:
            ts = next(iter(session.inflight.values())).timestamp
        else:
            recs = store.read(max(cursor, store.start_offset), 1)
            ts = recs[0].timestamp if recs else time.time() * 1e6
        return end - cursor, max(0.0, time.time() - ts / 1e6)

    def figures(self):
        s = self.session
        records, seconds = self.lag()
        return {
            "state": self.state,
            "connected": int(s.connected),
            "address": self.address,
            "client_id": s.client_id,
            "owner": self.owner_node,
            "messages/out": s.sent,
            "messages/in": s.received,
            "messages/dropped": s.refused + s.too_large + s.expired + s.skipped + s.unmapped + self.invalid,
            "messages/denied": self.denied,
            "messages/echoes": s.echoes,
            "messages/inflight": len(s.inflight),
            "lag/records": records,
            "lag/seconds": round(seconds, 3),
            "cursor": s.cursor if self.store is not None else -1,
            "lost": self.lost,
            "connects": self.connects,
            "connect_failures": self.failures,
        }
