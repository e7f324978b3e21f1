"""The MQTT client side of a bridge, sans-IO: what to send the remote, what its packets mean.

`BridgeSession` takes decoded packets and log records and gives back bytes to write
and decisions; the asyncio edge (`link.py`) moves the bytes, reads the log and publishes
locally. Nothing here reads a clock or a socket.

Out. Records are taken in log order. A QoS 1/2 message waits in `inflight` until the
remote acknowledges it, and the bridge's cursor (what `link.py` saves) is the lowest
offset still waiting, or the read position when nothing waits: a restart resends from
there, so nothing acknowledged by the broker is lost, at the price of duplicates of
what the remote had already taken. Across reconnects the in-flight messages are sent
again, with DUP, before anything new.

A message's packet id is its offset's (`packet_id_of`), not a counter's: after a
`kill -9` the edge sends the records from its cursor with the ids it used before, so a
QoS 2 message the remote holds awaiting PUBREL is recognised by the remote as the same
one and not delivered twice. Two in-flight records whose offsets share an id cannot
both be in flight: the later one waits (`blocked`). Id 1 is left to SUBSCRIBE.

In. A PUBLISH from the remote is mapped to its local topic and handed to the edge,
which publishes it and sends the acknowledgement only once the local log has it
(the broker holds the bytes like any client's PUBACK). QoS 2 packet ids wait for their
PUBREL in `incoming_qos2`, so a resend is acknowledged but not published twice.
"""

from ..mqtt import constants as C
from ..mqtt.acks import puback, pubcomp, pubrec, pubrel
from ..mqtt.codec import encode, encode_properties, encode_publish
from ..mqtt.packets import Connect, Disconnect, Pubrel, Subscribe, SubscribeTopic
from ..store.store import parse_properties_block

# The user property an outbound message carries in a cluster, where several nodes' links
# of one bridge publish on the remote and no-local covers only the link itself: what
# comes back with the bridge's own mark is not brought in again.
ORIGIN_PROPERTY = "wrenmq-bridge"
SUBSCRIBE_PACKET_ID = 1
# Message properties that belong to one hop (a subscription's id, an alias).
_HOP = ("subscription_identifier", "topic_alias")
# A message whose connection the remote closed this many times in a row, each time with it
# the oldest unacknowledged and no acknowledgement in between, is skipped: a message the
# remote cannot take (too large for it, a topic it refuses by closing) must not stop
# every message behind it for good.
POISON_STRIKES = 5
# Bytes of unacknowledged messages held for resending, at most (with the window, a
# count, it bounds the memory a slow remote can take: 256 messages of 1 MiB would be 256 MiB).
MAX_INFLIGHT_BYTES = 16 << 20


def packet_id_of(offset):
    """The packet id of the record at `offset` (2..65535; 1 is SUBSCRIBE's)."""
    return offset % 65534 + 2


class Outgoing:
    """A QoS 1/2 message sent and not yet acknowledged."""

    __slots__ = ("offset", "pid", "qos", "packet", "released", "timestamp")

    def __init__(self, offset, pid, qos, packet, timestamp):
        self.offset = offset
        self.pid = pid
        self.qos = qos
        self.packet = packet  # the PUBLISH as first sent (a resend sets DUP)
        self.released = False  # QoS 2: PUBREC came, PUBREL sent
        self.timestamp = timestamp  # the record's, microseconds


class BridgeRefused(Exception):
    """The remote's CONNACK refused the connection (the message says why)."""


# What inbound PUBLISHes come to (`BridgeSession.incoming`).
DELIVER, DUPLICATE, UNMAPPED, ECHO = range(4)


class BridgeSession:
    """One bridge's MQTT client state; it outlives connections (`lost` keeps what is in flight)."""

    def __init__(self, cfg, topics, local_id, client_id, cursor, origin_mark=None, subscribe=True,
                 max_packet_size=0):
        self.cfg = cfg
        self.max_packet_size = max_packet_size  # what this side takes (told to an MQTT 5 remote)
        self.topics = topics
        self.v5 = cfg.protocol == "5"
        self.version = C.MQTT5 if self.v5 else C.MQTT311
        self.local_id = local_id  # the client id messages that came in are recorded under
        self.client_id = client_id
        self.origin_mark = origin_mark if self.v5 else None
        self.subscribe = subscribe  # this node holds the bridge's remote subscription
        self.read_pos = cursor  # next log offset to look at
        self.inflight = {}  # offset -> Outgoing, in offset order
        self.pids = {}  # packet id -> Outgoing
        self.blocked = False  # the next record's packet id is still in flight
        self.window = cfg.max_inflight
        self.inflight_bytes = 0
        self.incoming_qos2 = set()
        self.connected = False
        self.session_present = False
        self.remote_max_qos = 2
        self.remote_retain = True
        self.remote_max_packet = 0  # 0: no limit said
        self._strikes = 0
        self._struck_at = None
        # Counters ($SYS, metrics).
        self.sent = 0  # messages sent out (QoS 0 on writing, QoS 1/2 once acknowledged)
        self.received = 0  # messages brought in
        self.refused = 0  # acknowledged by the remote with an error reason
        self.too_large = 0  # over the remote's maximum packet size
        self.expired = 0  # their message expiry ran out before they could go
        self.skipped = 0  # given up on after POISON_STRIKES closes
        self.echoes = 0  # came back from the remote with this bridge's own mark
        self.unmapped = 0  # came in on a topic no [[bridge.topic]] carries in

    # --- connecting ------------------------------------------------------------------

    def connect_packet(self):
        cfg = self.cfg
        props = {}
        if self.v5:
            props["receive_maximum"] = 1024
            if self.max_packet_size:
                props["maximum_packet_size"] = self.max_packet_size
            if not cfg.clean_start:
                props["session_expiry_interval"] = 0xFFFFFFFF  # kept until the bridge comes back
        return encode(Connect(self.client_id, self.version, cfg.clean_start, cfg.keepalive, None,
                              cfg.username or None, cfg.password.encode() if cfg.username else None,
                              props), self.version)

    def connack(self, pkt):
        """The remote's CONNACK: the bytes to send now (the subscription, then what was in
        flight), or BridgeRefused."""
        if pkt.reason_code:
            name = C.REASON_NAMES.get(pkt.reason_code, "") if self.v5 else _V311_REFUSALS.get(pkt.reason_code, "")
            raise BridgeRefused(f"the remote refused the connection: {name or 'reason'} "
                                f"(0x{pkt.reason_code:02x})")
        self.connected = True
        self.session_present = pkt.session_present
        self.window = self.cfg.max_inflight
        props = pkt.properties
        if self.v5 and props:
            self.window = min(self.window, props.get("receive_maximum", 65535))
            self.remote_max_qos = props.get("maximum_qos", 2)
            self.remote_retain = bool(props.get("retain_available", 1))
            self.remote_max_packet = props.get("maximum_packet_size", 0)
        out = []
        subs = self.topics.subscriptions() if self.subscribe else ()
        if subs:
            v5 = self.v5
            out.append(encode(Subscribe(SUBSCRIBE_PACKET_ID, [
                # No local: what the bridge publishes does not come back; retain as published
                # and retained messages only for a new subscription: a reconnect does not
                # bring every retained message in again.
                SubscribeTopic(flt, min(qos, self.remote_max_qos), no_local=v5, retain_as_published=v5,
                               retain_handling=1 if v5 else 0) for flt, qos in subs]), self.version))
        for out_msg in self.inflight.values():
            if out_msg.released:
                out.append(pubrel(out_msg.pid))
            else:
                p = out_msg.packet
                out.append(bytes((p[0] | 0x08,)) + p[1:])  # DUP
        self.blocked = False
        return out

    def disconnect_packet(self):
        return encode(Disconnect(0), self.version)

    def lost(self):
        """The connection is gone. What is in flight stays, to be sent again; returns the
        Outgoing given up on (POISON_STRIKES closes with it the oldest and no progress), or None."""
        self.connected = False
        if not self.inflight:
            self._strikes = 0
            return None
        oldest = next(iter(self.inflight.values()))
        if self._struck_at == oldest.offset:
            self._strikes += 1
        else:
            self._struck_at = oldest.offset
            self._strikes = 1
        if self._strikes < POISON_STRIKES:
            return None
        self._strikes = 0
        self._struck_at = None
        self._done(oldest)
        self.skipped += 1
        return oldest

    # --- out ---------------------------------------------------------------------------

    @property
    def cursor(self):
        """The lowest offset the remote may not have: a restart sends from here."""
        for offset in self.inflight:
            return offset
        return self.read_pos

    @property
    def full(self):
        return self.blocked or len(self.inflight) >= self.window or self.inflight_bytes >= MAX_INFLIGHT_BYTES

    def take(self, rec, now):
        """The PUBLISH for log record `rec` (or None: not for the remote), at wall-clock
        time `now`. Call only while not `full`; a record whose packet id is in flight sets
        `blocked` and is not taken (read_pos stays)."""
        if rec.private or rec.client_id == self.local_id:  # (came in over this bridge)
            self.read_pos = rec.offset + 1
            return None
        hit = self.topics.outbound(rec.topic)
        if hit is None:
            self.read_pos = rec.offset + 1
            return None
        topic, qos = hit
        qos = min(rec.qos, qos, self.remote_max_qos)
        pid = 0
        if qos:
            pid = packet_id_of(rec.offset)
            if pid in self.pids:
                self.blocked = True
                self.read_pos = rec.offset  # (everything before it is looked at)
                return None
        self.read_pos = rec.offset + 1
        props_block = b"\x00" if self.v5 else b""
        if rec.properties or self.origin_mark:
            props = parse_properties_block(rec.properties) if rec.properties else {}
            interval = props.get("message_expiry_interval")
            if interval is not None:
                left = interval - int(now - rec.timestamp / 1e6)
                if left <= 0:
                    self.expired += 1
                    return None
                props["message_expiry_interval"] = left
            if self.v5:
                for k in _HOP:
                    props.pop(k, None)
                if self.origin_mark:
                    props["user_property"] = list(props.get("user_property", ())) + [
                        (ORIGIN_PROPERTY, self.origin_mark)]
                props_block = encode_properties(props)
        packet = encode_publish(topic, rec.payload, qos, rec.retain and self.remote_retain, False, pid or None,
                                props_block)
        if self.remote_max_packet and len(packet) > self.remote_max_packet:
            self.too_large += 1
            return None
        if qos:
            out = Outgoing(rec.offset, pid, qos, packet, rec.timestamp)
            self.inflight[rec.offset] = out
            self.pids[pid] = out
            self.inflight_bytes += len(packet)
        else:
            self.sent += 1
        return packet

    def _done(self, out):
        del self.inflight[out.offset]
        del self.pids[out.pid]
        self.inflight_bytes -= len(out.packet)
        self.blocked = False

    def acked(self, pkt):
        """PUBACK, PUBREC or PUBCOMP from the remote: the PUBREL to send for a PUBREC, else
        None. (An id not in flight, say from before a restart, is ignored.)"""
        out = self.pids.get(pkt.packet_id)
        if out is None:
            if pkt.TYPE == C.PUBREC:  # the remote waits for a release we no longer know of
                return pubrel(pkt.packet_id)
            return None
        self._strikes = 0
        kind = pkt.TYPE
        if kind == C.PUBREC and out.qos == 2 and pkt.reason_code < 0x80:
            out.released = True
            return encode(Pubrel(out.pid), self.version)
        if kind == C.PUBCOMP and not out.released:
            return None  # (a PUBCOMP for a PUBLISH not yet received: out of order, ignore)
        self._done(out)
        if pkt.reason_code >= 0x80:
            self.refused += 1
        else:
            self.sent += 1
        return None

    # --- in ------------------------------------------------------------------------------

    def incoming(self, pkt):
        """(what to do, local topic, properties to publish with) for a PUBLISH from the remote."""
        props = pkt.properties
        mark = self.origin_mark
        if mark is not None and props and "user_property" in props and \
                (ORIGIN_PROPERTY, mark) in props["user_property"]:
            self.echoes += 1
            return ECHO, None, None
        if pkt.qos == 2 and pkt.packet_id in self.incoming_qos2:
            return DUPLICATE, None, None
        hit = self.topics.inbound(pkt.topic)
        if hit is None:
            self.unmapped += 1
            return UNMAPPED, None, None
        if props:
            props = {k: v for k, v in props.items() if k not in _HOP}
        return DELIVER, hit[0], props or None

    def ack_for(self, pkt, taken):
        """The acknowledgement of an incoming PUBLISH (None for QoS 0); `taken`: it was
        published here (a QoS 2 id is then kept until PUBREL)."""
        pid = pkt.packet_id
        if pkt.qos == 1:
            return puback(pid)
        if pkt.qos == 2:
            if taken:
                self.incoming_qos2.add(pid)
            return pubrec(pid)
        return None

    def release(self, pkt):
        """PUBREL from the remote: the PUBCOMP."""
        pid = pkt.packet_id
        self.incoming_qos2.discard(pid)
        return pubcomp(pid)


_V311_REFUSALS = {1: "unacceptable protocol version", 2: "identifier rejected", 3: "server unavailable",
                  4: "bad user name or password", 5: "not authorized"}
