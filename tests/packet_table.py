"""Packets the MQTT codec must reject, and the reason code it reports: one table for the
codec's tests and the broker's.

test_codec.py feeds each row to a `Decoder` and checks the MQTTError's reason (and, for
a CONNECT the broker answers with a CONNACK, that it is a ConnectRefused in that
protocol version); test_protocol_errors.py sends each to a running broker and checks
that the client is told that reason as the protocol version allows, then closed
(`answer`). Every expected byte string was worked out from the MQTT 3.1.1 and 5.0
specifications: the hex rows spell out their fields, the others are built field by
field with the builders below.
"""

from typing import NamedTuple

from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import encode_varint

V311 = C.MQTT311
V5 = C.MQTT5


def h(text):
    return bytes.fromhex(text)


MQTT_V4 = "00 04 4d 51 54 54 04"  # "MQTT", level 4
MQTT_V5 = "00 04 4d 51 54 54 05"  # "MQTT", level 5
MQISDP = "00 06 4d 51 49 73 64 70 03"  # "MQIsdp", level 3


# --- builders: packets field by field ---------------------------------------------------

def fixed(first, body):
    return bytes((first,)) + encode_varint(len(body)) + body


def s(text):
    b = text.encode("utf-8") if isinstance(text, str) else text
    return len(b).to_bytes(2, "big") + b


def props(raw=b""):
    """A 5.0 property block from raw property bytes (length prefix added)."""
    return encode_varint(len(raw)) + raw


def connect(level=V311, name="MQTT", flags=0x02, client_id="c", cprops=b"", payload_tail=b"",
            keepalive=60):
    """A CONNECT built byte by byte; `payload_tail` follows the client id."""
    body = s(name) + bytes((level, flags)) + keepalive.to_bytes(2, "big")
    if level == V5:
        body += props(cprops)
    return fixed(0x10, body + s(client_id) + payload_tail)


def publish(topic, payload=b"x", first=0x30, pid=None, pprops=b"", version=V311):
    """A PUBLISH built byte by byte; `topic` may be raw bytes (invalid UTF-8)."""
    body = s(topic)
    if pid is not None:
        body += pid.to_bytes(2, "big")
    if version == V5:
        body += props(pprops)
    return fixed(first, body + payload)


def subscribe(filters, pid=1, first=0x82, sprops=b"", version=V311):
    """filters: [(filter, options byte)]."""
    body = pid.to_bytes(2, "big")
    if version == V5:
        body += props(sprops)
    for f, opts in filters:
        body += s(f) + bytes((opts,))
    return fixed(first, body)


def prop_u32(pid, v):
    return bytes((pid,)) + v.to_bytes(4, "big")


def prop_u16(pid, v):
    return bytes((pid,)) + v.to_bytes(2, "big")


SESSION_EXPIRY = 0x11
TOPIC_ALIAS = 0x23
SUB_ID = 0x0B
RECEIVE_MAX = 0x21
REQ_PROBLEM_INFO = 0x17
USER_PROPERTY = 0x26

WILL_V311 = s("will/t") + s(b"bye")
WILL_V5 = props() + s("will/t") + s(b"bye")


# --- the table ---------------------------------------------------------------------------

class Malformed(NamedTuple):
    """`version`: the protocol version the packet is decoded in (of the connection it
    comes on); `refused_version`: the error is a ConnectRefused, answered with a CONNACK
    in that version; `first`: the packet comes as a connection's first (else after a
    valid CONNECT of `version`)."""

    id: str
    version: int
    wire: bytes
    reason: int
    refused_version: int = None
    first: bool = False


def malformed(id, version, wire, reason, refused_version=None, first=False):
    return Malformed(id, version, wire, reason, refused_version, first or refused_version is not None)


MALFORMED = [
    # --- packets of every type, decoded on a connection of `version`
    # reserved fixed-header flags
    malformed("flags-connect", 4, h("11 0c" + MQTT_V4 + "02 003c 0000"), 0x81),
    malformed("flags-connack", 4, h("21 02 00 00"), 0x81),
    malformed("flags-puback", 4, h("41 02 0001"), 0x81),
    malformed("flags-pubrec", 4, h("52 02 0001"), 0x81),
    malformed("flags-pubrel-must-be-2", 4, h("60 02 0001"), 0x81),
    malformed("flags-pubrel-v5", 5, h("63 02 0001"), 0x81),
    malformed("flags-pubcomp", 4, h("78 02 0001"), 0x81),
    malformed("flags-subscribe-must-be-2", 4, h("80 06 0001 0001 74 00"), 0x81),
    malformed("flags-subscribe-v5", 5, h("8a 07 0001 00 0001 74 00"), 0x81),
    malformed("flags-suback", 4, h("92 03 0001 00"), 0x81),
    malformed("flags-unsubscribe-must-be-2", 4, h("a0 05 0001 0001 74"), 0x81),
    malformed("flags-unsuback", 4, h("b1 02 0001"), 0x81),
    malformed("flags-pingreq", 4, h("c1 00"), 0x81),
    malformed("flags-pingresp", 5, h("d2 00"), 0x81),
    malformed("flags-disconnect", 4, h("e4 00"), 0x81),
    malformed("flags-disconnect-v5", 5, h("e8 00"), 0x81),
    malformed("flags-auth", 5, h("f1 00"), 0x81),
    # PUBLISH header
    malformed("publish-qos3", 4, h("36 05 0001 74 0001"), 0x81),
    malformed("publish-qos3-v5", 5, h("37 06 0001 74 0001 00"), 0x81),
    malformed("publish-dup-on-qos0", 4, h("38 03 0001 74"), 0x81),
    # remaining length
    malformed("remaining-length-5-bytes", 4, h("30 80 80 80 80 01"), 0x81),
    malformed("remaining-length-not-minimal-pingreq", 4, h("c0 80 00"), 0x81),
    malformed("remaining-length-not-minimal-publish", 4, h("30 83 80 00 0001 74"), 0x81),
    malformed("reserved-packet-type-0", 4, h("00 00"), 0x81),
    malformed("reserved-packet-type-0-v5", 5, h("00 02 0001"), 0x81),
    # packet identifier 0
    malformed("packet-id-0-publish-qos1", 4, h("32 05 0001 74 0000"), 0x81),
    malformed("packet-id-0-publish-qos2-v5", 5, h("34 06 0001 74 0000 00"), 0x81),
    malformed("packet-id-0-puback", 4, h("40 02 0000"), 0x81),
    malformed("packet-id-0-pubrec", 5, h("50 02 0000"), 0x81),
    malformed("packet-id-0-pubrel", 4, h("62 02 0000"), 0x81),
    malformed("packet-id-0-pubcomp", 5, h("70 02 0000"), 0x81),
    malformed("packet-id-0-subscribe", 4, h("82 06 0000 0001 74 00"), 0x81),
    malformed("packet-id-0-unsubscribe", 5, h("a2 06 0000 00 0001 74"), 0x81),
    malformed("packet-id-0-suback", 4, h("90 03 0000 00"), 0x81),
    malformed("packet-id-0-suback-v5", 5, h("90 04 0000 00 00"), 0x81),
    malformed("packet-id-0-unsuback", 4, h("b0 02 0000"), 0x81),
    malformed("packet-id-0-unsuback-v5", 5, h("b0 04 0000 00 00"), 0x81),
    # UTF-8 strings
    malformed("utf8-invalid-publish-topic", 4, h("30 04 0002 c328"), 0x81),
    malformed("utf8-overlong-publish-topic", 4, h("30 04 0002 c0af"), 0x81),
    malformed("utf8-nul-in-publish-topic", 4, h("30 05 0003 61 00 62"), 0x81),
    malformed("utf8-surrogate-in-publish-topic", 4, h("30 05 0003 eda080"), 0x81),
    malformed("utf8-surrogate-in-topic-v5", 5, h("30 06 0003 eda080 00"), 0x81),
    malformed("utf8-invalid-subscribe-filter", 4, h("82 06 0001 0001 ff 00"), 0x81),
    malformed("utf8-nul-in-subscribe-filter", 5, h("82 07 0001 00 0001 00 00"), 0x81),
    malformed("utf8-surrogate-in-unsubscribe-filter", 4, h("a2 07 0001 0003 edb080"), 0x81),
    malformed("utf8-surrogate-in-content-type", 5, h("30 0a 0001 74 06 03 0003 eda080"), 0x81),
    malformed("utf8-nul-in-user-property", 5, h("30 0b 0001 74 07 26 0001 00 0001 61"), 0x81),
    malformed("utf8-invalid-client-id", 4, h("10 0d" + MQTT_V4 + "02 003c 0001 ff"), 0x81, 4),
    malformed("utf8-surrogate-in-will-topic", 4,
        h("10 14" + MQTT_V4 + "06 003c 0001 61 0003 eda080 0000"), 0x81, 4),
    malformed("utf8-nul-in-username", 4, h("10 10" + MQTT_V4 + "82 003c 0000 0002 6100"), 0x81, 4),
    # properties
    malformed("property-unknown-04", 5, h("30 07 0001 74 03 04 0000"), 0x81),
    malformed("property-unknown-7f", 5, h("30 06 0001 74 02 7f 00"), 0x81),
    malformed("property-session-expiry-in-publish", 5, h("30 09 0001 74 05 11 00000001"), 0x81),
    malformed("property-topic-alias-in-puback", 5, h("40 07 0001 00 03 23 0001"), 0x81),
    malformed("property-will-delay-in-connect", 5,
        h("10 12" + MQTT_V5 + "02 003c 05 18 00000001 0000"), 0x81, 5),
    malformed("property-session-expiry-in-will", 5,
        h("10 18" + MQTT_V5 + "06 003c 00 0000 05 11 00000001 0001 74 0000"), 0x81, 5),
    malformed("property-subscription-id-in-unsubscribe", 5, h("a2 08 0001 02 0b 01 0001 74"), 0x81),
    malformed("property-duplicate-topic-alias", 5, h("30 0a 0001 74 06 23 0001 23 0002"), 0x82),
    malformed("property-duplicate-subscription-id-in-subscribe", 5,
        h("82 0b 0001 04 0b 01 0b 02 0001 74 00"), 0x82),
    malformed("property-duplicate-reason-string", 5, h("e0 0a 80 08 1f 0001 61 1f 0001 62"), 0x82),
    malformed("property-duplicate-session-expiry-in-connect", 5,
        h("10 17" + MQTT_V5 + "02 003c 0a 11 00000001 11 00000002 0000"), 0x82, 5),
    malformed("property-receive-maximum-0", 5, h("10 10" + MQTT_V5 + "02 003c 03 21 0000 0000"),
        0x82, 5),
    malformed("property-maximum-packet-size-0", 5,
        h("10 12" + MQTT_V5 + "02 003c 05 27 00000000 0000"), 0x82, 5),
    malformed("property-subscription-id-0", 5, h("82 09 0001 02 0b 00 0001 74 00"), 0x82),
    malformed("property-maximum-qos-2", 5, h("20 05 00 00 02 24 02"), 0x82),
    malformed("property-request-problem-information-2", 5,
        h("10 0f" + MQTT_V5 + "02 003c 02 17 02 0000"), 0x82, 5),
    malformed("property-auth-data-without-method", 5,
        h("10 11" + MQTT_V5 + "02 003c 04 16 0001 01 0000"), 0x82, 5),
    malformed("property-varint-not-minimal", 5, h("30 07 0001 74 03 0b 8000"), 0x81),
    malformed("property-length-past-packet", 5, h("30 06 0001 74 09 01 01"), 0x81),
    malformed("property-value-truncated", 5, h("30 07 0001 74 03 02 0000"), 0x81),
    # CONNECT
    malformed("connect-reserved-flag", 4, h("10 0c" + MQTT_V4 + "03 003c 0000"), 0x81, 4),
    malformed("connect-reserved-flag-v5", 5, h("10 0d" + MQTT_V5 + "01 003c 00 0000"), 0x81, 5),
    malformed("connect-will-qos-3", 4, h("10 12" + MQTT_V4 + "1e 003c 0001 61 0001 74 0000"), 0x81, 4),
    malformed("connect-will-qos-without-will-flag", 4, h("10 0c" + MQTT_V4 + "0a 003c 0000"), 0x81, 4),
    malformed("connect-will-retain-without-will-flag", 5,
        h("10 0d" + MQTT_V5 + "22 003c 00 0000"), 0x81, 5),
    malformed("connect-v311-password-without-username", 4,
        h("10 0e" + MQTT_V4 + "42 003c 0000 0000"), 0x81, 4),
    malformed("connect-trailing-bytes", 4, h("10 0d" + MQTT_V4 + "02 003c 0000 ff"), 0x81, 4),
    malformed("connect-missing-will-payload", 4, h("10 0f" + MQTT_V4 + "06 003c 0000 0001 74"), 0x81, 4),
    malformed("connect-protocol-level-6", 4, h("10 0c 0004 4d515454 06 02 003c 0000"), 0x84, 4),
    malformed("connect-protocol-level-6-decoder-v5", 5, h("10 0c 0004 4d515454 06 02 003c 0000"),
        0x84, 4),
    malformed("connect-mqtt-name-level-3", 4, h("10 0c 0004 4d515454 03 02 003c 0000"), 0x84, 4),
    malformed("connect-mqisdp-name-level-4", 4, h("10 0e 0006 4d5149736470 04 02 003c 0000"),
        0x84, 4),
    # trailing bytes inside the remaining length
    malformed("trailing-connack-v311", 4, h("20 03 00 00 00"), 0x81),
    malformed("trailing-puback-v311", 4, h("40 03 0001 00"), 0x81),
    malformed("trailing-pubrel-v311", 4, h("62 04 0001 0000"), 0x81),
    malformed("trailing-puback-v5-after-properties", 5, h("40 05 0001 00 00 ff"), 0x81),
    malformed("trailing-unsuback-v311", 4, h("b0 03 0001 00"), 0x81),
    malformed("trailing-pingreq", 4, h("c0 01 00"), 0x81),
    malformed("trailing-pingresp-v5", 5, h("d0 01 00"), 0x81),
    malformed("trailing-disconnect-v311", 4, h("e0 01 00"), 0x81),
    malformed("trailing-disconnect-v5-after-properties", 5, h("e0 03 00 00 ff"), 0x81),
    malformed("trailing-auth-after-properties", 5, h("f0 03 18 00 ff"), 0x81),
    # truncated structures inside a complete packet
    malformed("publish-topic-past-packet", 4, h("30 03 0005 74"), 0x81),
    malformed("publish-missing-packet-id", 4, h("32 04 0001 74 00"), 0x81),
    malformed("publish-v5-missing-property-length", 5, h("30 03 0001 74"), 0x81),
    malformed("connack-too-short", 4, h("20 01 00"), 0x81),
    malformed("puback-too-short", 4, h("40 01 00"), 0x81),
    malformed("subscribe-missing-options", 4, h("82 05 0001 0001 74"), 0x81),
    malformed("unsubscribe-string-past-packet", 4, h("a2 05 0001 0005 74"), 0x81),
    # SUBSCRIBE / UNSUBSCRIBE
    malformed("subscribe-no-filters", 4, h("82 02 0001"), 0x82),
    malformed("subscribe-no-filters-v5", 5, h("82 03 0001 00"), 0x82),
    malformed("unsubscribe-no-filters", 4, h("a2 02 0001"), 0x82),
    malformed("unsubscribe-no-filters-v5", 5, h("a2 03 0001 00"), 0x82),
    malformed("subscribe-v311-option-bit-2", 4, h("82 06 0001 0001 74 04"), 0x81),
    malformed("subscribe-v311-option-bit-7", 4, h("82 06 0001 0001 74 80"), 0x81),
    malformed("subscribe-qos-3", 4, h("82 06 0001 0001 74 03"), 0x81),
    malformed("subscribe-qos-3-v5", 5, h("82 07 0001 00 0001 74 03"), 0x81),
    malformed("subscribe-v5-option-bit-6", 5, h("82 07 0001 00 0001 74 40"), 0x81),
    malformed("subscribe-v5-option-bit-7", 5, h("82 07 0001 00 0001 74 80"), 0x81),
    malformed("subscribe-v5-retain-handling-3", 5, h("82 07 0001 00 0001 74 30"), 0x81),
    # reason codes not allowed in that packet
    malformed("reason-connack-v311-6", 4, h("20 02 00 06"), 0x81),
    malformed("reason-connack-v5-01", 5, h("20 03 00 01 00"), 0x81),
    malformed("reason-connack-v5-8b", 5, h("20 03 00 8b 00"), 0x81),
    malformed("reason-connack-reserved-ack-flags", 4, h("20 02 02 00"), 0x81),
    malformed("reason-puback-92", 5, h("40 03 0001 92"), 0x81),
    malformed("reason-pubrec-01", 5, h("50 03 0001 01"), 0x81),
    malformed("reason-pubrel-10", 5, h("62 03 0001 10"), 0x81),
    malformed("reason-pubcomp-80", 5, h("70 03 0001 80"), 0x81),
    malformed("reason-suback-v311-03", 4, h("90 03 0001 03"), 0x81),
    malformed("reason-suback-v311-87", 4, h("90 03 0001 87"), 0x81),
    malformed("reason-suback-v5-11", 5, h("90 04 0001 00 11"), 0x81),
    malformed("reason-unsuback-v5-01", 5, h("b0 04 0001 00 01"), 0x81),
    malformed("reason-disconnect-v5-01", 5, h("e0 01 01"), 0x81),
    malformed("reason-disconnect-v5-88", 5, h("e0 01 88"), 0x81),
    malformed("reason-auth-01", 5, h("f0 01 01"), 0x81),
    malformed("reason-auth-87", 5, h("f0 01 87"), 0x81),
    malformed("auth-in-v311", 4, h("f0 00"), 0x82),
    # --- CONNECT as a connection's first packet (the broker decodes it as 3.1.1 until
    # the CONNECT says its level)
    # protocol name and level
    malformed("protocol-name-MQTX", V311, connect(V311, name="MQTX"), 0x81, first=True),
    malformed("protocol-name-MQTX-v5", V5, connect(V5, name="MQTX"), 0x81, first=True),
    malformed("protocol-name-lowercase", V311, connect(V311, name="mqtt"), 0x81, first=True),
    # an unknown level: the 3.1.1-form CONNACK 0x01
    malformed("protocol-level-6", V311, connect(6), 0x84, V311),
    malformed("protocol-level-0", V311, connect(0), 0x84, V311),
    malformed("protocol-MQTT-level-3", V311, connect(3), 0x84, V311),
    malformed("protocol-MQIsdp-level-4", V311, connect(4, name="MQIsdp"), 0x84, V311),
    # reserved flag, will flags
    malformed("reserved-flag", V311, connect(V311, flags=0x03), 0x81, V311),
    malformed("reserved-flag-v5", V5, connect(V5, flags=0x03), 0x81, V5),
    malformed("will-qos-3", V311,
              connect(V311, flags=0x02 | 0x04 | 0x18, payload_tail=WILL_V311), 0x81, V311),
    malformed("will-qos-3-v5", V5, connect(V5, flags=0x02 | 0x04 | 0x18, payload_tail=WILL_V5), 0x81, V5),
    malformed("will-qos-without-will-flag", V311, connect(V311, flags=0x02 | 0x08), 0x81, V311),
    malformed("will-qos-without-will-flag-v5", V5, connect(V5, flags=0x02 | 0x08), 0x81, V5),
    malformed("will-retain-without-will-flag", V311, connect(V311, flags=0x02 | 0x20), 0x81, V311),
    malformed("will-retain-without-will-flag-v5", V5, connect(V5, flags=0x02 | 0x20), 0x81, V5),
    # user name / password flags
    malformed("password-without-username", V311,
              connect(V311, flags=0x42, payload_tail=s(b"pw")), 0x81, V311),
    malformed("username-flag-without-username", V311, connect(V311, flags=0x82), 0x81, V311),
    malformed("username-flag-without-username-v5", V5, connect(V5, flags=0x82), 0x81, V5),
    # strings
    malformed("client-id-invalid-utf8", V311, connect(V311, client_id=b"\xc3\x28"), 0x81, V311),
    malformed("client-id-invalid-utf8-v5", V5, connect(V5, client_id=b"\xc3\x28"), 0x81, V5),
    malformed("client-id-nul", V5, connect(V5, client_id=b"a\x00b"), 0x81, V5),
    malformed("client-id-surrogate", V5, connect(V5, client_id=b"\xed\xa0\x80"), 0x81, V5),
    malformed("trailing-bytes", V311, connect(V311, payload_tail=b"\x00"), 0x81, V311),
    malformed("trailing-bytes-v5", V5, connect(V5, payload_tail=b"\x00"), 0x81, V5),
    malformed("truncated-connect", V311, fixed(0x10, s("MQTT") + b"\x04"), 0x81, V311),
    malformed("connect-header-flags", V311, b"\x12" + connect(V311)[1:], 0x81, first=True),
    # 5.0 properties
    malformed("property-unknown-id", V5, connect(V5, cprops=b"\x7f\x00"), 0x81, V5),
    malformed("property-not-for-connect", V5, connect(V5, cprops=prop_u16(TOPIC_ALIAS, 1)), 0x81, V5),
    malformed("property-truncated", V5, connect(V5, cprops=b"\x11\x00\x00"), 0x81, V5),
    malformed("property-length-past-connect", V5, fixed(0x10, s("MQTT") + b"\x05\x02\x00\x3c\x20"), 0x81, V5),
    malformed("property-user-property-bad-utf8", V5,
              connect(V5, cprops=bytes((USER_PROPERTY,)) + s(b"\xff") + s("v")), 0x81, V5),
    malformed("property-duplicate-session-expiry", V5,
              connect(V5, cprops=prop_u32(SESSION_EXPIRY, 10) + prop_u32(SESSION_EXPIRY, 20)), 0x82, V5),
    malformed("property-duplicate-receive-maximum", V5,
              connect(V5, cprops=prop_u16(RECEIVE_MAX, 10) + prop_u16(RECEIVE_MAX, 10)), 0x82, V5),
    malformed("property-receive-maximum-0-connect", V5,
              connect(V5, cprops=prop_u16(RECEIVE_MAX, 0)), 0x82, V5),
    malformed("property-request-problem-info-2", V5,
              connect(V5, cprops=bytes((REQ_PROBLEM_INFO, 2))), 0x82, V5),
    malformed("property-auth-data-without-method-connect", V5,
              connect(V5, cprops=b"\x16" + s(b"x")), 0x82, V5),
    malformed("will-property-not-for-will", V5,
              connect(V5, flags=0x06, payload_tail=props(prop_u32(SESSION_EXPIRY, 1)) + s("w") + s(b"")),
              0x81, V5),
    # not a CONNECT, and not even a packet a 3.1.1 decoder takes
    malformed("first-packet-auth", V311, b"\xf0\x00", 0x82, first=True),
    malformed("first-packet-reserved-type-0", V311, b"\x00\x00", 0x81, first=True),
    malformed("first-packet-remaining-length-5-bytes", V311, b"\x10\xff\xff\xff\xff\x7f", 0x81, first=True),

    # --- after a valid CONNECT
    # packet types and the fixed header
    malformed("reserved-packet-type-0-v5-empty", V5, b"\x00\x00", 0x81),
    malformed("remaining-length-5-bytes-pingreq", V311, b"\xc0\xff\xff\xff\xff\x7f", 0x81),
    malformed("remaining-length-5-bytes-pingreq-v5", V5, b"\xc0\xff\xff\xff\xff\x7f", 0x81),
    malformed("remaining-length-not-minimal-v5", V5, b"\xc0\x80\x00", 0x81),
    malformed("pingreq-with-body-v5", V5, b"\xc0\x01\x00", 0x81),
    malformed("pingreq-flags-v5", V5, b"\xc1\x00", 0x81),
    # PUBLISH
    malformed("publish-dup-qos-0-v5", V5, publish("a/b", first=0x38, version=V5), 0x81),
    malformed("publish-packet-id-0-v5", V5, publish("a/b", first=0x32, pid=0, version=V5), 0x81),
    malformed("publish-duplicate-property-v5", V5,
              publish("a/b", pprops=prop_u32(0x02, 1) + prop_u32(0x02, 1), version=V5), 0x82),
    malformed("publish-property-not-for-publish-v5", V5,
              publish("a/b", pprops=prop_u32(SESSION_EXPIRY, 1), version=V5), 0x81),
    malformed("publish-payload-format-2-v5", V5, publish("a/b", pprops=b"\x01\x02", version=V5), 0x82),
    malformed("publish-invalid-utf8-topic-v5", V5, publish(b"a/\xff", version=V5), 0x81),
    malformed("publish-overlong-utf8-topic-v5", V5, publish(b"\xc0\xaf", version=V5), 0x81),
    malformed("publish-nul-topic-v5", V5, publish(b"a/\x00b", version=V5), 0x81),
    malformed("publish-topic-length-past-packet-v5", V5, b"\x30\x04\x00\x10ab", 0x81),
    malformed("publish-truncated-packet-id-v5", V5, b"\x32\x04\x00\x01a\x00", 0x81),
    # SUBSCRIBE, UNSUBSCRIBE
    malformed("subscribe-flags-0-v5", V5, subscribe([("a", 0)], first=0x80, version=V5), 0x81),
    malformed("subscribe-flags-3-v5", V5, subscribe([("a", 0)], first=0x83, version=V5), 0x81),
    malformed("subscribe-missing-options-v5", V5, fixed(0x82, b"\x00\x01\x00" + s("a")), 0x81),
    malformed("subscribe-packet-id-0-v5", V5, subscribe([("a", 0)], pid=0, version=V5), 0x81),
    malformed("subscribe-filter-invalid-utf8-v5", V5, subscribe([(b"a/\xff", 0)], version=V5), 0x81),
    malformed("subscribe-filter-nul-v5", V5, subscribe([(b"a\x00", 0)], version=V5), 0x81),
    malformed("subscribe-sub-id-0-v5", V5,
              subscribe([("a", 0)], sprops=bytes((SUB_ID, 0)), version=V5), 0x82),
    malformed("unsubscribe-flags-0-v5", V5, fixed(0xA0, b"\x00\x01\x00" + s("a")), 0x81),
    # acknowledgements, DISCONNECT
    malformed("pubrel-flags-0-v5", V5, fixed(0x60, b"\x00\x2a"), 0x81),
    malformed("puback-invalid-reason-v5", V5, fixed(0x40, b"\x00\x01\x05"), 0x81),
    malformed("disconnect-invalid-reason-v5", V5, b"\xe0\x01\x05", 0x81),
]
