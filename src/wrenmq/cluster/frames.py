"""The node-to-node link's wire format: sans-IO, bytes in and frames out.

A link carries frames `u32 length | u8 kind | body` (the length counts kind and
body). The first frame on a link is HELLO (JSON: cluster, node, secret, the
identity of the sender's commit log, the first offset this run of the sender wrote
and an identity of the run); the receiving node answers RESUME (how far in that
log it has what was sent to it, and the etcd revision by which its filters are all
in etcd, which the sender reads up to before it replays). A message travels as FORWARD: a small binary
header (its offset in the sender's log or -1, what the receiver does with it, the
publisher's client id and arrival time, the shared groups it is for) followed by
the message as an MQTT 5 PUBLISH, so properties, QoS, retain and the remaining
expiry use the codec every client connection already uses. ROUTE tells the
receiver of a filter new on the sender, which answers ROUTE_ACK once it has it
(and of one the sender no longer has, or whose group's last connected member left).
RELAY passes a FORWARD on to the node a session moved to, for that session only (or,
without TO_SUBSCRIBERS, for the shared groups it names, whose member the session was).
"""

import json
import struct

from ..broker.message import Message, message_properties
from ..mqtt import constants as C
from ..mqtt.codec import Decoder, MQTTError, decode

HELLO = 1
FORWARD = 2
SESSION_ASK = 3  # "hand me client X's session": JSON {"id", "cid"}
SESSION = 4  # the answer: JSON state, then the messages it owes as PUBLISHes
RESUME = 5  # answer to HELLO: JSON {"offset", "announced"}: the last offset of the sender's log received
# here, -1 (none known: the sender decides) or -2 (nothing from before the sender last learned of this
# node); and the etcd revision by which this node's filters are all in etcd (the replay waits for it)
ROUTE = 6  # a filter the sender's clients now subscribe to (or no longer), ahead of etcd:
#           JSON {"seq", "group", "filter", "online"[, "removed": true]}
ROUTE_ACK = 7  # the receiver applied the sender's ROUTEs up to JSON {"seq"}
MARK = 8  # the receiver has the sender's log up to JSON {"offset"} (with disk storage: saved), once a
#          second: what the sender keeps for replays up to there may go (replay.GroupsSent)
RELAY = 9  # a FORWARD this node took for a session it has just handed to the receiver, passed on
#           for that session only: u16 n | client id | u16 n | the origin's log id | FORWARD body
#           (flags without TO_SUBSCRIBERS: for the groups it names, which lost their member here)
LIVE = 10  # the sender has replayed its log to the receiver: what follows is live. JSON {}

# FORWARD flags: what the receiving node does with the message.
TO_SUBSCRIBERS = 1  # deliver to its (non-shared) subscribers that match
SET_RETAINED = 2  # a retained message (or a clear): update the retained store
SYNC = 4  # a retained message sent when the link came up: keep it only if newer
REPLAYED = 8  # sent again from the sender's log: only for subscriptions older than the message

_FRAME = struct.Struct(">IB")
_U32 = struct.Struct(">I")
_FORWARD = struct.Struct(">qBdH")
_U16 = struct.Struct(">H")


class FrameError(ValueError):
    """A peer sent something that is not a frame of this format: close that link."""


def publish_bytes(msg, now):
    """A message as it travels between nodes: its MQTT 5 PUBLISH (QoS and retain its own,
    the expiry what is left of it at `now`)."""
    return msg.encode(True, msg.qos, msg.retain, 1 if msg.qos else 0, now=now)


def message_from(pkt, client_id, timestamp, now):
    """The Message a `publish_bytes` PUBLISH came from (its expiry counted from `now`)."""
    props = message_properties(pkt.properties) if pkt.properties else {}
    interval = props.get("message_expiry_interval")
    payload = pkt.payload if pkt.payload.__class__ is bytes else bytes(pkt.payload)
    return Message(pkt.topic, payload, pkt.qos, pkt.retain, props,
                   now + interval if interval is not None else None, client_id, None, None, True, timestamp)


def _json_frame(kind, fields):
    """A control frame: `fields` as JSON."""
    body = json.dumps(fields).encode()
    return _FRAME.pack(len(body) + 1, kind) + body


def _json_fields(body, name, pick):
    """`pick(the JSON object of a control frame's body)`; FrameError if the body is not
    JSON or `pick` finds what it needs missing or of the wrong type."""
    try:
        return pick(json.loads(bytes(body)))
    except (ValueError, KeyError, TypeError, OverflowError) as e:
        raise FrameError(f"malformed {name}: {e}") from None


def encode_hello(cluster, node, secret, log_id="", log_from=0, run=""):
    """`log_id`: the identity of the sender's commit log ("" if it has none to replay
    from); `log_from`: the first offset this run of the sender wrote (everything before
    it is on its disk); `run`: an identity of the sender's process."""
    return _json_frame(HELLO, {"cluster": cluster, "node": node, "secret": secret, "log": log_id,
                               "from": log_from, "run": run})


def decode_hello(body):
    """(cluster, node, secret, log id, log from, run)."""
    return _json_fields(body, "HELLO", lambda h: (
        str(h["cluster"]), str(h["node"]), str(h.get("secret", "")), str(h.get("log", "")),
        int(h.get("from", 0)), str(h.get("run", ""))))


def encode_resume(offset, announced=0):
    """`offset`: the last offset of the sender's log the receiver has (or -1, -2: RESUME
    above); `announced`: the etcd revision of the receiver's last write there, by which
    its filters are all in etcd (the sender's replay waits until it has read that far)."""
    return _json_frame(RESUME, {"offset": offset, "announced": announced})


def decode_resume(body):
    """(offset, announced); announced 0 from a node that does not say."""
    return _json_fields(body, "RESUME", lambda r: (int(r["offset"]), int(r.get("announced", 0))))


def encode_live():
    return _json_frame(LIVE, {})


def encode_mark(offset):
    return _json_frame(MARK, {"offset": offset})


def decode_mark(body):
    return _json_fields(body, "MARK", lambda r: int(r["offset"]))


def encode_route(seq, group, flt, online, removed=False):
    route = {"seq": seq, "group": group, "filter": flt, "online": bool(online)}
    if removed:
        route["removed"] = True
    return _json_frame(ROUTE, route)


def decode_route(body):
    """(seq, group or None, filter, online, removed) of a ROUTE body."""
    return _json_fields(body, "ROUTE", lambda r: (
        int(r["seq"]), None if r["group"] is None else str(r["group"]), str(r["filter"]), bool(r["online"]),
        r.get("removed") is True))


def encode_route_ack(seq):
    return _json_frame(ROUTE_ACK, {"seq": seq})


def decode_route_ack(body):
    return _json_fields(body, "ROUTE_ACK", lambda r: int(r["seq"]))


def encode_forward(publish, flags, client_id, timestamp, groups=(), offset=-1):
    """FORWARD frame around `publish` (the message's MQTT 5 PUBLISH bytes).

    `groups`: (share name, filter) pairs the receiver gives the message to one member of.
    `offset`: the message's offset in the sender's commit log, if the sender would
    replay it from there after a link failure (else -1).
    """
    cid = client_id.encode()
    parts = [b"", _FORWARD.pack(offset, flags, timestamp, len(cid)), cid, _U16.pack(len(groups))]
    for name, flt in groups:
        g = f"{name}\x00{flt}".encode()
        parts.append(_U16.pack(len(g)))
        parts.append(g)
    parts.append(publish)
    n = sum(map(len, parts)) + 1
    parts[0] = _FRAME.pack(n, FORWARD)
    return b"".join(parts)


def regroup_forward(body, flags, groups):
    """The FORWARD body `body` (checked by `decode_forward`) with other flags and shared
    groups: the same message, client, time and offset."""
    offset, _, ts, cid, _, pos = _forward_head(body)
    return encode_forward(bytes(body[pos:]), flags, cid, ts, groups, offset)[_FRAME.size:]


def _forward_head(body):
    """(offset, flags, timestamp, client id, groups, where the PUBLISH starts) of a
    FORWARD body; struct.error or UnicodeDecodeError if it is malformed."""
    offset, flags, ts, n = _FORWARD.unpack_from(body, 0)
    pos = _FORWARD.size
    cid = bytes(body[pos:pos + n]).decode()
    pos += n
    (count,) = _U16.unpack_from(body, pos)
    pos += 2
    groups = []
    for _ in range(count):
        (n,) = _U16.unpack_from(body, pos)
        pos += 2
        name, _, flt = bytes(body[pos:pos + n]).decode().partition("\x00")
        groups.append((name, flt))
        pos += n
    return offset, flags, ts, cid, groups, pos


def forward_decoder():
    """A Decoder for `decode_forward`, kept per link (one per frame costs more than the frame)."""
    return Decoder(C.MQTT5)


def decode_forward(body, decoder=None):
    """(flags, client id, timestamp, groups, Publish, offset) of a FORWARD body."""
    try:
        offset, flags, ts, cid, groups, pos = _forward_head(body)
        if decoder is None:
            pkt = decode(body[pos:], C.MQTT5)
        else:
            pkts = decoder.feed(body[pos:])
            if len(pkts) != 1 or decoder.buffered:
                decoder.__init__(C.MQTT5)  # (drop what it holds: the link closes anyway)
                raise FrameError("FORWARD does not hold exactly one packet")
            pkt = pkts[0]
    except (struct.error, UnicodeDecodeError, MQTTError) as e:
        if decoder is not None:
            decoder.__init__(C.MQTT5)
        raise FrameError(f"malformed FORWARD: {e}") from None
    if pkt is None or pkt.TYPE != C.PUBLISH:
        raise FrameError("FORWARD does not hold one PUBLISH")
    return flags, cid, ts, groups, pkt, offset


def encode_relay(client_id, origin, forward):
    """RELAY frame: the FORWARD body `forward`, taken from the node whose log is
    `origin`, for the session of `client_id` only."""
    cid = client_id.encode()
    org = origin.encode()
    head = _U16.pack(len(cid)) + cid + _U16.pack(len(org)) + org
    return _FRAME.pack(len(head) + len(forward) + 1, RELAY) + head + forward


def decode_relay(body):
    """(client id, origin log id, FORWARD body) of a RELAY body."""
    try:
        (n,) = _U16.unpack_from(body, 0)
        cid = bytes(body[2:2 + n]).decode()
        pos = 2 + n
        (m,) = _U16.unpack_from(body, pos)
        origin = bytes(body[pos + 2:pos + 2 + m]).decode()
        pos += 2 + m
        if len(body) - pos < _FORWARD.size:
            raise FrameError("RELAY holds no FORWARD")
    except (struct.error, UnicodeDecodeError) as e:
        raise FrameError(f"malformed RELAY: {e}") from None
    return cid, origin, body[pos:]


def encode_session_ask(request_id, client_id):
    return _json_frame(SESSION_ASK, {"id": request_id, "cid": client_id})


def decode_session_ask(body):
    return _json_fields(body, "SESSION_ASK", lambda a: (int(a["id"]), str(a["cid"])))


def encode_session(state, publishes):
    """SESSION frame: `u32 n | state JSON (n bytes) | (u32 n | PUBLISH)*`. `state["msgs"]`
    describes the PUBLISHes, in order."""
    head = json.dumps(state).encode()
    parts = [b"", _U32.pack(len(head)), head]
    for p in publishes:
        parts.append(_U32.pack(len(p)))
        parts.append(p)
    n = sum(map(len, parts)) + 1
    parts[0] = _FRAME.pack(n, SESSION)
    return b"".join(parts)


def decode_session(body):
    """(state dict, [Publish]) of a SESSION body."""
    try:
        (n,) = _U32.unpack_from(body, 0)
        state = json.loads(bytes(body[4:4 + n]))
        pos = 4 + n
        pkts = []
        while pos < len(body):
            (m,) = _U32.unpack_from(body, pos)
            pkt = decode(bytes(body[pos + 4:pos + 4 + m]), C.MQTT5)
            if pkt.TYPE != C.PUBLISH:
                raise FrameError("SESSION holds a packet that is not a PUBLISH")
            pkts.append(pkt)
            pos += 4 + m
        if not isinstance(state, dict) or len(state.get("msgs", ())) != len(pkts):
            raise FrameError("SESSION's state does not describe its messages")
    except (struct.error, ValueError, MQTTError) as e:
        raise FrameError(f"malformed SESSION: {e}") from None
    return state, pkts


class FrameReader:
    """Cuts a byte stream into (kind, body) frames; bounded by `max_frame`.

    Whole frames in a read are sliced out of it as they are; only a frame split
    across reads is kept (its pieces joined once it is complete)."""

    __slots__ = ("max_frame", "_buf")

    def __init__(self, max_frame):
        self.max_frame = max_frame
        self._buf = b""

    def feed(self, data):
        if self._buf:
            data = self._buf + data
        elif type(data) is not bytes:
            data = bytes(data)
        out = []
        pos = 0
        end = len(data)
        unpack = _FRAME.unpack_from
        while end - pos >= 5:
            n, kind = unpack(data, pos)
            if n < 1 or n > self.max_frame:
                self._buf = b""
                raise FrameError(f"frame of {n} bytes (at most {self.max_frame})")
            if end - pos - 4 < n:
                break
            out.append((kind, data[pos + 5:pos + 4 + n]))
            pos += 4 + n
        self._buf = data[pos:] if pos < end else b""
        return out

    @property
    def buffered(self):
        return len(self._buf)
