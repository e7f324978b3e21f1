"""Sans-IO MQTT codec: bytes in, packet objects out, and back.

`Decoder.feed(data)` takes whatever arrived on the wire and returns every
complete packet in it, keeping a partial packet for the next call. Every
violation of the specification raises `MQTTError` carrying the reason code the
peer should be told (0x81 malformed, 0x82 protocol error, 0x95 too large, ...)
and, in `packets`, the complete packets that came before the bad one in the same
bytes: a client that pipelines valid packets ahead of a bad one gets them handled.
`encode(packet, version)` is the inverse. Nothing here performs I/O.
"""

from struct import Struct

from . import acks
from . import constants as C
from .packets import (
    NO_PROPERTIES, PINGREQ, PINGRESP, Auth, Connack, Connect, Disconnect, Puback, Pubcomp,
    Publish, Pubrec, Pubrel, Suback, Subscribe, SubscribeTopic, Unsuback, Unsubscribe, Will,
)

_U16 = Struct("!H")
_U32 = Struct("!I")
_unpack_u16 = _U16.unpack_from
_unpack_u32 = _U32.unpack_from
_pack_u16 = _U16.pack
_pack_u32 = _U32.pack


class MQTTError(Exception):
    """A violation of the protocol; `reason` is the MQTT 5 reason code to report.

    Raised by `Decoder.feed`, `packets` lists the packets decoded before the violation
    (in order), which the caller handles before it closes the connection.
    """

    packets = ()

    def __init__(self, reason, message):
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __str__(self):
        return f"{self.message} ({C.REASON_NAMES.get(self.reason, hex(self.reason))})"


class ConnectRefused(MQTTError):
    """CONNECT is unacceptable in a way that is answered with a CONNACK, not a bare close.

    `version` is the protocol level to encode that CONNACK with.
    """

    def __init__(self, reason, message, version):
        super().__init__(reason, message)
        self.version = version


class PacketTooLarge(MQTTError):
    """A packet of `size` bytes (fixed header included) over the decoder's `limit`."""

    def __init__(self, size, limit):
        super().__init__(C.PACKET_TOO_LARGE, f"packet of {size} bytes exceeds the maximum of {limit}")
        self.size = size
        self.limit = limit


def _malformed(msg):
    return MQTTError(C.MALFORMED_PACKET, msg)


def _protocol(msg):
    return MQTTError(C.PROTOCOL_ERROR, msg)


# --- primitive readers -----------------------------------------------------

def decode_varint(data, pos, end):
    """Return (value, new_pos); raise MQTTError if malformed or truncated."""
    value = 0
    shift = 0
    for i in range(4):
        if pos >= end:
            raise _malformed("truncated variable byte integer")
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            if b == 0 and i:
                raise _malformed("variable byte integer not minimally encoded")
            return value, pos
        shift += 7
    raise _malformed("variable byte integer longer than 4 bytes")


def _read_u16(data, pos, end):
    if pos + 2 > end:
        raise _malformed("truncated two byte integer")
    return _unpack_u16(data, pos)[0], pos + 2


def _read_binary(data, pos, end):
    if pos + 2 > end:
        raise _malformed("truncated length prefix")
    n = (data[pos] << 8) | data[pos + 1]
    pos += 2
    if pos + n > end:
        raise _malformed("length prefix runs past the packet")
    return bytes(data[pos:pos + n]), pos + n


def check_utf8(raw):
    """Decode an MQTT UTF-8 string: well formed, no surrogates, no U+0000."""
    try:
        s = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed("invalid UTF-8 string") from None
    if "\x00" in s:
        raise _malformed("UTF-8 string contains U+0000")
    return s


def _read_string(data, pos, end):
    raw, pos = _read_binary(data, pos, end)
    return check_utf8(raw), pos


# --- properties ------------------------------------------------------------

_ZERO_FORBIDDEN = {
    "receive_maximum": "receive maximum of 0",
    "maximum_packet_size": "maximum packet size of 0",
    "subscription_identifier": "subscription identifier of 0",
}
_BOOLEAN_PROPS = frozenset({
    "payload_format_indicator", "request_problem_information", "request_response_information",
    "maximum_qos", "retain_available", "wildcard_subscription_available",
    "subscription_identifier_available", "shared_subscription_available",
})


def decode_properties(data, pos, end, letter):
    """Read a property block at `pos`; return (properties, new_pos)."""
    length, pos = decode_varint(data, pos, end)
    stop = pos + length
    if stop > end:
        raise _malformed("property length runs past the packet")
    if not length:
        return NO_PROPERTIES, pos
    props = {}
    table = C.PROPERTIES
    while pos < stop:
        pid, pos = decode_varint(data, pos, stop)
        spec = table.get(pid)
        if spec is None:
            raise _malformed(f"unknown property 0x{pid:02x}")
        name, kind, where = spec
        if letter not in where:
            raise _malformed(f"property {name} is not allowed in this packet")
        if kind == C.BYTE:
            if pos >= stop:
                raise _malformed(f"truncated property {name}")
            value = data[pos]
            pos += 1
        elif kind == C.TWO:
            if pos + 2 > stop:
                raise _malformed(f"truncated property {name}")
            value = _unpack_u16(data, pos)[0]
            pos += 2
        elif kind == C.FOUR:
            if pos + 4 > stop:
                raise _malformed(f"truncated property {name}")
            value = _unpack_u32(data, pos)[0]
            pos += 4
        elif kind == C.VARINT:
            value, pos = decode_varint(data, pos, stop)
        elif kind == C.STRING:
            value, pos = _read_string(data, pos, stop)
        elif kind == C.BINARY:
            value, pos = _read_binary(data, pos, stop)
        else:  # PAIR
            k, pos = _read_string(data, pos, stop)
            v, pos = _read_string(data, pos, stop)
            value = (k, v)
        if name in _BOOLEAN_PROPS and value > 1:
            raise _protocol(f"property {name} must be 0 or 1")
        if value == 0 and name in _ZERO_FORBIDDEN:
            raise _protocol(_ZERO_FORBIDDEN[name])
        if pid == C.USER_PROPERTY:
            props.setdefault(name, []).append(value)
        elif pid == C.SUBSCRIPTION_IDENTIFIER and letter == "P":
            props.setdefault(name, []).append(value)
        elif name in props:
            raise _protocol(f"property {name} included more than once")
        else:
            props[name] = value
    if pos != stop:
        raise _malformed("property block length mismatch")
    return props, pos


def encode_varint(n):
    if n < 128:
        return bytes((n,))
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _enc_str(s):
    b = s.encode("utf-8")
    return _pack_u16(len(b)) + b


def _enc_bin(b):
    return _pack_u16(len(b)) + bytes(b)


def encode_properties(props):
    """Encode a properties mapping, length prefix included (b'\\x00' when empty)."""
    if not props:
        return b"\x00"
    out = bytearray()
    ids = C.PROPERTY_IDS
    for name, value in props.items():
        pid = ids[name]
        kind = C.PROPERTIES[pid][1]
        if pid == C.USER_PROPERTY:
            for k, v in value:
                out.append(pid)
                out += _enc_str(k)
                out += _enc_str(v)
            continue
        if pid == C.SUBSCRIPTION_IDENTIFIER and isinstance(value, (list, tuple)):
            for v in value:
                out.append(pid)
                out += encode_varint(v)
            continue
        out.append(pid)
        if kind == C.BYTE:
            out.append(int(value))
        elif kind == C.TWO:
            out += _pack_u16(value)
        elif kind == C.FOUR:
            out += _pack_u32(value)
        elif kind == C.VARINT:
            out += encode_varint(value)
        elif kind == C.STRING:
            out += _enc_str(value)
        else:
            out += _enc_bin(value)
    return encode_varint(len(out)) + bytes(out)


# --- packet decoders (body = data[pos:end]) --------------------------------

_PROTOCOLS = {("MQTT", C.MQTT311), ("MQTT", C.MQTT5), ("MQIsdp", C.MQTT31)}


def _decode_connect(flags, data, pos, end, version):
    if flags:
        raise _malformed("CONNECT fixed header flags must be 0")
    name, pos = _read_string(data, pos, end)
    if pos >= end:
        raise _malformed("truncated CONNECT")
    level = data[pos]
    pos += 1
    if name not in ("MQTT", "MQIsdp"):
        raise _malformed(f"unknown protocol name {name!r}")
    if (name, level) not in _PROTOCOLS:
        # The level is unknown, so is the CONNACK format: answer in 3.1.1 form.
        raise ConnectRefused(C.UNSUPPORTED_PROTOCOL_VERSION,
                             f"unsupported protocol {name} level {level}", C.MQTT311)
    try:
        return _decode_connect_rest(data, pos, end, name, level)
    except ConnectRefused:
        raise
    except MQTTError as e:
        # Now the version is known: let the connection answer with a CONNACK.
        raise ConnectRefused(e.reason, e.message, level) from None


def _decode_connect_rest(data, pos, end, name, level):
    v5 = level == C.MQTT5
    if pos + 3 > end:
        raise _malformed("truncated CONNECT")
    cflags = data[pos]
    keepalive = _unpack_u16(data, pos + 1)[0]
    pos += 3
    if cflags & 0x01:
        raise _malformed("CONNECT reserved flag must be 0")
    clean = bool(cflags & 0x02)
    will_flag = cflags & 0x04
    will_qos = (cflags >> 3) & 0x03
    will_retain = bool(cflags & 0x20)
    has_password = cflags & 0x40
    has_username = cflags & 0x80
    if will_qos == 3:
        raise _malformed("will QoS 3")
    if not will_flag and (will_qos or will_retain):
        raise _malformed("will QoS/retain set without will flag")
    if has_password and not has_username and not v5:
        raise _malformed("password flag set without user name flag")
    props = NO_PROPERTIES
    if v5:
        props, pos = decode_properties(data, pos, end, "C")
        if "authentication_data" in props and "authentication_method" not in props:
            raise _protocol("authentication data without authentication method")
    client_id, pos = _read_string(data, pos, end)
    will = None
    if will_flag:
        wprops = NO_PROPERTIES
        if v5:
            wprops, pos = decode_properties(data, pos, end, "W")
        wtopic, pos = _read_string(data, pos, end)
        wpayload, pos = _read_binary(data, pos, end)
        will = Will(wtopic, wpayload, will_qos, will_retain, wprops)
    username = password = None
    if has_username:
        username, pos = _read_string(data, pos, end)
    if has_password:
        password, pos = _read_binary(data, pos, end)
    if pos != end:
        raise _malformed("trailing bytes after CONNECT payload")
    return Connect(client_id, level, clean, keepalive, will, username, password, props, name)


def _decode_connack(flags, data, pos, end, version):
    if flags:
        raise _malformed("CONNACK fixed header flags must be 0")
    if pos + 2 > end:
        raise _malformed("truncated CONNACK")
    ack_flags = data[pos]
    if ack_flags & 0xFE:
        raise _malformed("CONNACK reserved flags must be 0")
    rc = data[pos + 1]
    pos += 2
    props = NO_PROPERTIES
    if version == C.MQTT5:
        if rc not in C.VALID_REASONS[C.CONNACK]:
            raise _malformed(f"invalid CONNACK reason 0x{rc:02x}")
        if pos < end:
            props, pos = decode_properties(data, pos, end, "K")
    elif rc > 5:
        raise _malformed(f"invalid CONNACK return code {rc}")
    if pos != end:
        raise _malformed("trailing bytes after CONNACK")
    return Connack(bool(ack_flags & 1), rc, props)


def decode_publish(flags, data, pos, end, version, start):
    qos = (flags >> 1) & 3
    if qos == 3:
        raise _malformed("PUBLISH with QoS 3")
    dup = bool(flags & 8)
    if dup and not qos:
        raise _malformed("DUP set on a QoS 0 PUBLISH")
    if pos + 2 > end:
        raise _malformed("truncated PUBLISH topic")
    n = (data[pos] << 8) | data[pos + 1]
    pos += 2
    tend = pos + n
    if tend > end:
        raise _malformed("PUBLISH topic runs past the packet")
    try:
        topic = data[pos:tend].decode("utf-8")
    except UnicodeDecodeError:
        raise _malformed("PUBLISH topic is not valid UTF-8") from None
    if "\x00" in topic:
        raise _malformed("PUBLISH topic contains U+0000")
    pos = tend
    pid = None
    if qos:
        if pos + 2 > end:
            raise _malformed("truncated packet identifier")
        pid = (data[pos] << 8) | data[pos + 1]
        if not pid:
            raise _malformed("packet identifier 0")
        pos += 2
    props = NO_PROPERTIES
    if version == C.MQTT5:
        if pos < end and data[pos] == 0:
            pos += 1
        else:
            props, pos = decode_properties(data, pos, end, "P")
    return Publish(topic, data[pos:end], qos, bool(flags & 1), dup, pid, props, None, (data, start, end))


def _ack_decoder(cls, ptype, want_flags):
    valid = C.VALID_REASONS[ptype]
    name = C.PACKET_NAMES[ptype]

    def decode(flags, data, pos, end, version):
        if flags != want_flags:
            raise _malformed(f"{name} fixed header flags must be {want_flags}")
        if pos + 2 > end:
            raise _malformed(f"truncated {name}")
        pid = (data[pos] << 8) | data[pos + 1]
        if not pid:
            raise _malformed("packet identifier 0")
        pos += 2
        rc = 0
        props = NO_PROPERTIES
        if version == C.MQTT5:
            if pos < end:
                rc = data[pos]
                pos += 1
                if rc not in valid:
                    raise _malformed(f"invalid {name} reason 0x{rc:02x}")
                if pos < end:
                    props, pos = decode_properties(data, pos, end, "R")
        if pos != end:
            raise _malformed(f"trailing bytes after {name}")
        return cls(pid, rc, props)

    return decode


def _decode_subscribe(flags, data, pos, end, version):
    if flags != 2:
        raise _malformed("SUBSCRIBE fixed header flags must be 2")
    pid, pos = _read_u16(data, pos, end)
    if not pid:
        raise _malformed("packet identifier 0")
    props = NO_PROPERTIES
    v5 = version == C.MQTT5
    if v5:
        props, pos = decode_properties(data, pos, end, "S")
    topics = []
    while pos < end:
        flt, pos = _read_string(data, pos, end)
        if pos >= end:
            raise _malformed("missing subscription options")
        opts = data[pos]
        pos += 1
        qos = opts & 3
        if qos == 3:
            raise _malformed("subscription QoS 3")
        if v5:
            rh = (opts >> 4) & 3
            if opts & 0xC0 or rh == 3:
                raise _malformed("reserved subscription option bits set")
            topics.append(SubscribeTopic(flt, qos, bool(opts & 4), bool(opts & 8), rh))
        else:
            if opts & 0xFC:
                raise _malformed("reserved subscription option bits set")
            topics.append(SubscribeTopic(flt, qos))
    if not topics:
        raise _protocol("SUBSCRIBE with no topic filter")
    return Subscribe(pid, topics, props)


def _decode_suback(flags, data, pos, end, version):
    if flags:
        raise _malformed("SUBACK fixed header flags must be 0")
    pid, pos = _read_u16(data, pos, end)
    if not pid:
        raise _malformed("packet identifier 0")
    props = NO_PROPERTIES
    if version == C.MQTT5:
        props, pos = decode_properties(data, pos, end, "T")
        valid = C.VALID_REASONS[C.SUBACK]
    else:
        valid = (0, 1, 2, 0x80)
    codes = list(data[pos:end])
    for rc in codes:
        if rc not in valid:
            raise _malformed(f"invalid SUBACK reason 0x{rc:02x}")
    return Suback(pid, codes, props)


def _decode_unsubscribe(flags, data, pos, end, version):
    if flags != 2:
        raise _malformed("UNSUBSCRIBE fixed header flags must be 2")
    pid, pos = _read_u16(data, pos, end)
    if not pid:
        raise _malformed("packet identifier 0")
    props = NO_PROPERTIES
    if version == C.MQTT5:
        props, pos = decode_properties(data, pos, end, "U")
    filters = []
    while pos < end:
        flt, pos = _read_string(data, pos, end)
        filters.append(flt)
    if not filters:
        raise _protocol("UNSUBSCRIBE with no topic filter")
    return Unsubscribe(pid, filters, props)


def _decode_unsuback(flags, data, pos, end, version):
    if flags:
        raise _malformed("UNSUBACK fixed header flags must be 0")
    pid, pos = _read_u16(data, pos, end)
    if not pid:
        raise _malformed("packet identifier 0")
    props = NO_PROPERTIES
    codes = []
    if version == C.MQTT5:
        props, pos = decode_properties(data, pos, end, "T")
        codes = list(data[pos:end])
        valid = C.VALID_REASONS[C.UNSUBACK]
        for rc in codes:
            if rc not in valid:
                raise _malformed(f"invalid UNSUBACK reason 0x{rc:02x}")
    elif pos != end:
        raise _malformed("trailing bytes after UNSUBACK")
    return Unsuback(pid, codes, props)


def _empty_decoder(singleton, name):
    def decode(flags, data, pos, end, version):
        if flags:
            raise _malformed(f"{name} fixed header flags must be 0")
        if pos != end:
            raise _malformed(f"{name} must have no body")
        return singleton
    return decode


def _reason_decoder(cls, ptype, letter):
    valid = C.VALID_REASONS[ptype]
    name = C.PACKET_NAMES[ptype]

    def decode(flags, data, pos, end, version):
        if flags:
            raise _malformed(f"{name} fixed header flags must be 0")
        if version != C.MQTT5:
            if ptype == C.AUTH:
                raise _protocol("AUTH is an MQTT 5 packet")
            if pos != end:
                raise _malformed(f"{name} must have no body")
            return cls()
        rc = 0
        props = NO_PROPERTIES
        if pos < end:
            rc = data[pos]
            pos += 1
            if rc not in valid:
                raise _malformed(f"invalid {name} reason 0x{rc:02x}")
            if pos < end:
                props, pos = decode_properties(data, pos, end, letter)
        if pos != end:
            raise _malformed(f"trailing bytes after {name}")
        return cls(rc, props)

    return decode


_DECODERS = [None] * 16
_DECODERS[C.CONNECT] = _decode_connect
_DECODERS[C.CONNACK] = _decode_connack
_DECODERS[C.PUBACK] = _ack_decoder(Puback, C.PUBACK, 0)
_DECODERS[C.PUBREC] = _ack_decoder(Pubrec, C.PUBREC, 0)
_DECODERS[C.PUBREL] = _ack_decoder(Pubrel, C.PUBREL, 2)
_DECODERS[C.PUBCOMP] = _ack_decoder(Pubcomp, C.PUBCOMP, 0)
_DECODERS[C.SUBSCRIBE] = _decode_subscribe
_DECODERS[C.SUBACK] = _decode_suback
_DECODERS[C.UNSUBSCRIBE] = _decode_unsubscribe
_DECODERS[C.UNSUBACK] = _decode_unsuback
_DECODERS[C.PINGREQ] = _empty_decoder(PINGREQ, "PINGREQ")
_DECODERS[C.PINGRESP] = _empty_decoder(PINGRESP, "PINGRESP")
_DECODERS[C.DISCONNECT] = _reason_decoder(Disconnect, C.DISCONNECT, "D")
_DECODERS[C.AUTH] = _reason_decoder(Auth, C.AUTH, "A")


class Decoder:
    """Incremental decoder for one byte stream.

    `version` is the protocol level used for packets other than CONNECT (which
    declares its own); the owner sets it once CONNECT is seen. `max_packet_size`
    bounds the whole packet (fixed header included): a larger one raises
    MQTTError(0x95) as soon as its header arrives, before its body is buffered.
    """

    __slots__ = ("version", "max_packet_size", "_parts", "_have", "_need", "_rest")

    def __init__(self, version=C.MQTT311, max_packet_size=C.MAX_REMAINING_LENGTH + 5):
        self.version = version
        self.max_packet_size = max_packet_size
        self._parts = []  # pieces of an incomplete packet (never of a complete one)
        self._have = 0  # bytes in _parts
        self._need = 0  # total size of that packet once its fixed header is known
        self._rest = None  # (data, pos): bytes not decoded yet because of a `limit`

    @property
    def buffered(self):
        """Bytes held back: an incomplete packet, or packets not decoded yet (`limit`)."""
        rest = self._rest
        return self._have + (len(rest[0]) - rest[1] if rest is not None else 0)

    @property
    def has_rest(self):
        """True if an earlier `limit` left complete packets undecoded."""
        return self._rest is not None

    def feed(self, data, limit=None):
        """Return the list of packets completed by `data` (possibly empty).

        With `limit`, decode at most that many packets and keep the rest of the bytes
        as they are (a rate-limited client's input waits undecoded); feed b"" later to
        go on. Bytes are copied only for a packet split across two reads (and then only
        that packet); everything else is decoded in place. A violation raises MQTTError
        with the packets completed before it as its `packets`; the decoder is not
        usable after that (the connection ends).
        """
        if type(data) is not bytes:
            data = bytes(data)
        out = []
        start = 0
        rest = self._rest
        if rest is not None:
            self._rest = None
            rdata, rpos = rest
            if data:
                data = rdata[rpos:] + data
            else:
                data, start = rdata, rpos
        else:
            parts = self._parts
            if parts:
                need = self._need
                have = self._have
                if need:
                    if have + len(data) < need:
                        parts.append(data)
                        self._have = have + len(data)
                        return out
                    start = need - have
                    parts.append(data[:start])
                    self._parts = []
                    self._have = self._need = 0
                    self._parse(b"".join(parts), 0, out, None)
                else:
                    # The fixed header itself was split: join (the piece before is < 5 bytes).
                    parts.append(data)
                    data = b"".join(parts)
                    self._parts = []
                    self._have = 0
        if limit is not None:
            limit -= len(out)
        pos, need = self._parse(data, start, out, limit)
        if pos < len(data):
            if need < 0:  # stopped by the limit
                self._rest = (data, pos)
            else:
                rest = data[pos:] if pos else data
                self._parts = [rest]
                self._have = len(rest)
                self._need = need
        return out

    def _parse(self, data, pos, out, count):
        """Decode whole packets from data[pos:] into `out` (at most `count` if given).

        Returns (position of the first packet not decoded, its total size if it is
        incomplete and its fixed header is known, 0 if unknown, -1 if `count` stopped).
        An MQTTError carries `out` (what was decoded before it) as its `packets`.
        """
        n = len(data)
        version = self.version
        limit = self.max_packet_size
        decoders = _DECODERS
        need = 0
        if count is not None:
            count += len(out)
        try:
            while pos < n:
                if count is not None and len(out) >= count:
                    need = -1
                    break
                first = data[pos]
                if pos + 1 >= n:
                    break
                b = data[pos + 1]
                if b < 128:  # one-byte remaining length: the common case
                    length = b
                    body = pos + 2
                else:
                    length = b & 0x7F
                    body = pos + 2
                    shift = 7
                    while True:
                        if body >= n:
                            length = -1  # header incomplete
                            break
                        b = data[body]
                        body += 1
                        length |= (b & 0x7F) << shift
                        if b < 128:
                            if not b:
                                raise _malformed("remaining length not minimally encoded")
                            break
                        shift += 7
                        if shift == 28:
                            raise _malformed("remaining length longer than 4 bytes")
                    if length < 0:
                        break
                end = body + length
                if end - pos > limit:
                    raise PacketTooLarge(end - pos, limit)
                if end > n:
                    need = end - pos
                    break
                ptype = first >> 4
                if ptype == 3:
                    pkt = decode_publish(first & 0x0F, data, body, end, version, pos)
                else:
                    dec = decoders[ptype]
                    if dec is None:
                        raise _malformed("reserved packet type 0")
                    pkt = dec(first & 0x0F, data, body, end, version)
                    if ptype == 1:
                        version = self.version = pkt.version
                out.append(pkt)
                pos = end
        except MQTTError as e:
            e.packets = out  # the complete packets before the bad one, for the caller to handle
            raise
        return pos, need


def decode(data, version=C.MQTT311):
    """Decode exactly one packet from `data` (for tests and tools)."""
    dec = Decoder(version)
    pkts = dec.feed(bytes(data))
    if len(pkts) != 1 or dec.buffered:
        raise _malformed(f"expected exactly one packet, got {len(pkts)} and {dec.buffered} spare bytes")
    return pkts[0]


# --- encoders --------------------------------------------------------------

def _fixed(first, body):
    n = len(body)
    if n < 128:
        return bytes((first, n)) + body
    if n > C.MAX_REMAINING_LENGTH:
        raise ValueError("packet too large to encode")
    return bytes((first,)) + encode_varint(n) + body


def publish_head(topic, qos, retain, dup, rest):
    """A PUBLISH up to its packet id: the fixed header and the topic name (`topic`, bytes;
    b'' when a topic alias stands for it). `rest` is the length of what follows: the
    packet id (QoS 1/2), the property block (5.0) and the payload. A broker sending one
    message to many clients keeps the head of each variant and puts each client's
    packet id between it and the rest (`encode_publish` is the whole packet)."""
    tl = len(topic)
    n = 2 + tl + rest
    first = 0x30 | (qos << 1) | (1 if retain else 0) | (8 if dup else 0)
    if n < 128:
        return bytes((first, n, tl >> 8, tl & 0xFF)) + topic
    return bytes((first,)) + encode_varint(n) + bytes((tl >> 8, tl & 0xFF)) + topic


def encode_publish(topic, payload, qos=0, retain=False, dup=False, packet_id=None,
                   props_bytes=b""):
    """Encode a PUBLISH from its parts; `props_bytes` is the encoded property block
    (b'' for MQTT 3.1.1, at least b'\\x00' for 5.0)."""
    if isinstance(topic, str):
        topic = topic.encode("utf-8")
    if qos:
        return publish_head(topic, qos, retain, dup, 2 + len(props_bytes) + len(payload)) + \
            _pack_u16(packet_id) + props_bytes + payload
    return publish_head(topic, 0, retain, dup, len(props_bytes) + len(payload)) + props_bytes + payload


def _enc_connect(p, version):
    v5 = p.version == C.MQTT5
    flags = 0
    if p.clean_start:
        flags |= 0x02
    if p.will is not None:
        flags |= 0x04 | (p.will.qos << 3) | (0x20 if p.will.retain else 0)
    if p.password is not None:
        flags |= 0x40
    if p.username is not None:
        flags |= 0x80
    body = bytearray(_enc_str(p.protocol_name))
    body.append(p.version)
    body.append(flags)
    body += _pack_u16(p.keepalive)
    if v5:
        body += encode_properties(p.properties)
    body += _enc_str(p.client_id)
    if p.will is not None:
        if v5:
            body += encode_properties(p.will.properties)
        body += _enc_str(p.will.topic)
        body += _enc_bin(p.will.payload)
    if p.username is not None:
        body += _enc_str(p.username)
    if p.password is not None:
        body += _enc_bin(p.password)
    return _fixed(0x10, bytes(body))


def _enc_connack(p, version):
    rc = p.reason_code
    body = bytes((1 if p.session_present else 0, rc))
    if version == C.MQTT5:
        body += encode_properties(p.properties)
    return _fixed(0x20, body)


def _enc_publish(p, version):
    props = encode_properties(p.properties) if version == C.MQTT5 else b""
    return encode_publish(p.topic, p.payload, p.qos, p.retain, p.dup, p.packet_id, props)


def _ack_encoder(first, plain):
    def enc(p, version):
        if version == C.MQTT5 and p.properties:
            pid = p.packet_id
            return _fixed(first, bytes((pid >> 8, pid & 0xFF, p.reason_code)) + encode_properties(p.properties))
        return plain(p.packet_id, p.reason_code, version == C.MQTT5)
    return enc


def _enc_subscribe(p, version):
    v5 = version == C.MQTT5
    body = bytearray(_pack_u16(p.packet_id))
    if v5:
        body += encode_properties(p.properties)
    for t in p.topics:
        body += _enc_str(t.filter)
        opts = t.qos
        if v5:
            opts |= (4 if t.no_local else 0) | (8 if t.retain_as_published else 0) | (t.retain_handling << 4)
        body.append(opts)
    return _fixed(0x82, bytes(body))


def _enc_suback(p, version):
    body = _pack_u16(p.packet_id)
    if version == C.MQTT5:
        body += encode_properties(p.properties)
    return _fixed(0x90, body + bytes(p.reason_codes))


def _enc_unsubscribe(p, version):
    body = bytearray(_pack_u16(p.packet_id))
    if version == C.MQTT5:
        body += encode_properties(p.properties)
    for f in p.filters:
        body += _enc_str(f)
    return _fixed(0xA2, bytes(body))


def _enc_unsuback(p, version):
    body = _pack_u16(p.packet_id)
    if version == C.MQTT5:
        body += encode_properties(p.properties) + bytes(p.reason_codes)
    return _fixed(0xB0, body)


def _reason_encoder(first):
    def enc(p, version):
        if version != C.MQTT5 or (not p.reason_code and not p.properties):
            return bytes((first, 0))
        body = bytes((p.reason_code,))
        if p.properties:
            body += encode_properties(p.properties)
        return _fixed(first, body)
    return enc


_ENCODERS = {
    C.CONNECT: _enc_connect,
    C.CONNACK: _enc_connack,
    C.PUBLISH: _enc_publish,
    C.PUBACK: _ack_encoder(0x40, acks.puback),
    C.PUBREC: _ack_encoder(0x50, acks.pubrec),
    C.PUBREL: _ack_encoder(0x62, acks.pubrel),
    C.PUBCOMP: _ack_encoder(0x70, acks.pubcomp),
    C.SUBSCRIBE: _enc_subscribe,
    C.SUBACK: _enc_suback,
    C.UNSUBSCRIBE: _enc_unsubscribe,
    C.UNSUBACK: _enc_unsuback,
    C.PINGREQ: lambda p, v: acks.PINGREQ,
    C.PINGRESP: lambda p, v: acks.PINGRESP,
    C.DISCONNECT: _reason_encoder(0xE0),
    C.AUTH: _reason_encoder(0xF0),
}


def encode(packet, version=C.MQTT311):
    """Encode `packet` for a peer speaking protocol level `version`."""
    return _ENCODERS[packet.TYPE](packet, version)
