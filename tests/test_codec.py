"""The sans-IO MQTT codec, driven by tables of hand-written wire bytes.

Every expected byte string below was worked out from the MQTT 3.1.1 and 5.0
specifications (never produced by `encode`); the comment above each one spells
out the fields so that a reader can check it.
"""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from packet_table import MALFORMED, MQISDP, MQTT_V4, MQTT_V5, h
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import ConnectRefused, Decoder, MQTTError, decode, encode
from wrenmq.mqtt.packets import (
    PINGREQ, PINGRESP, Auth, Connack, Connect, Disconnect, Pingreq, Pingresp, Puback, Pubcomp,
    Publish, Pubrec, Pubrel, Suback, Subscribe, SubscribeTopic, Unsuback, Unsubscribe, Will,
)


def case(id, version, wire, packet, encodes=True):
    """One row: `encodes=False` marks a decode-only row (the encoder picks another form)."""
    return pytest.param(version, wire, packet, encodes, id=id)


CASES = [
    # ---------------------------------------------------------------- CONNECT
    # 3.1 (MQIsdp, level 3): flags clean (02), keepalive 60, client "abc"
    case("connect-v31-clean", 3, h("10 11" + MQISDP + "02 003c" "0003 616263"),
         Connect("abc", version=3, clean_start=True, keepalive=60)),
    # 3.1: will flag 04 + will QoS 2 (10) + clean 02 = 16; will "t" with empty payload
    case("connect-v31-will", 3, h("10 14" + MQISDP + "16 003c" "0001 61" "0001 74" "0000"),
         Connect("a", version=3, keepalive=60, will=Will("t", b"", qos=2))),
    # 3.1.1 clean session, keepalive 60, client "abc": 10 + 5 = 15
    case("connect-v311-clean", 4, h("10 0f" + MQTT_V4 + "02 003c" "0003 616263"),
         Connect("abc", version=4, clean_start=True, keepalive=60)),
    # 3.1.1 persistent session (flags 00), keepalive 300, client "c1": 10 + 4 = 14
    case("connect-v311-persistent", 4, h("10 0e" + MQTT_V4 + "00 012c" "0002 6331"),
         Connect("c1", version=4, clean_start=False, keepalive=300)),
    # 3.1.1 user 80 | password 40 | will retain 20 | will QoS 1 08 | will 04 | clean 02 = ee
    # payload: "id", will topic "w/t", will payload "bye", user "user", password "pw" (24)
    case("connect-v311-will-user-password", 4,
         h("10 22" + MQTT_V4 + "ee 000a" "0002 6964" "0003 772f74" "0003 627965"
           "0004 75736572" "0002 7077"),
         Connect("id", version=4, keepalive=10, will=Will("w/t", b"bye", qos=1, retain=True),
                 username="user", password=b"pw")),
    # 3.1.1 user name only (80 | 02 = 82): client "x", user "u"
    case("connect-v311-username-only", 4, h("10 10" + MQTT_V4 + "82 003c" "0001 78" "0001 75"),
         Connect("x", version=4, username="u")),
    # 5.0 clean start, no properties (property length 00), client "abc": 11 + 5 = 16
    case("connect-v5-clean", 5, h("10 10" + MQTT_V5 + "02 003c 00" "0003 616263"),
         Connect("abc", version=5)),
    # 5.0 persistent with user+password (c0), keepalive 30, 60 bytes of properties:
    #   11 session expiry 120 / 21 receive max 20 / 22 topic alias max 10 /
    #   19 request response info 1 / 17 request problem info 0 / 27 max packet size 1024 /
    #   15 auth method "SCRAM" / 16 auth data 01 02 / 26 k1=v1, k2=v2, k1=v3 (order kept)
    # remaining: 10 + 1 + 60 + client "cid" 5 + user "me" 4 + password 00 ff 4 = 84
    case("connect-v5-properties", 5,
         h("10 54" + MQTT_V5 + "c0 001e 3c"
           "11 00000078" "21 0014" "22 000a" "19 01" "17 00" "27 00000400"
           "15 0005 534352414d" "16 0002 0102"
           "26 0002 6b31 0002 7631" "26 0002 6b32 0002 7632" "26 0002 6b31 0002 7633"
           "0003 636964" "0002 6d65" "0002 00ff"),
         Connect("cid", version=5, clean_start=False, keepalive=30, username="me",
                 password=b"\x00\xff", properties={
                     "session_expiry_interval": 120, "receive_maximum": 20,
                     "topic_alias_maximum": 10, "request_response_information": 1,
                     "request_problem_information": 0, "maximum_packet_size": 1024,
                     "authentication_method": "SCRAM", "authentication_data": b"\x01\x02",
                     "user_property": [("k1", "v1"), ("k2", "v2"), ("k1", "v3")]})),
    # 5.0 will (04 | QoS 2 10 | clean 02 = 16) with 40 bytes of will properties:
    #   18 will delay 5 / 01 payload format 1 / 02 message expiry 3600 /
    #   03 content type "text/plain" / 08 response topic "r" / 09 correlation 01 / 26 a=b
    # payload: client "w" 3 + 41 + will topic "t/w" 5 + will payload "gone" 6 = 55; 11 + 55 = 66
    case("connect-v5-will-properties", 5,
         h("10 42" + MQTT_V5 + "16 003c 00" "0001 77"
           "28" "18 00000005" "01 01" "02 00000e10" "03 000a 746578742f706c61696e"
           "08 0001 72" "09 0001 01" "26 0001 61 0001 62"
           "0003 742f77" "0004 676f6e65"),
         Connect("w", version=5, will=Will("t/w", b"gone", qos=2, properties={
             "will_delay_interval": 5, "payload_format_indicator": 1,
             "message_expiry_interval": 3600, "content_type": "text/plain",
             "response_topic": "r", "correlation_data": b"\x01",
             "user_property": [("a", "b")]}))),
    # 5.0 allows a password without a user name (40 | 02 = 42): client "p", password "secret"
    case("connect-v5-password-without-username", 5,
         h("10 16" + MQTT_V5 + "42 003c 00" "0001 70" "0006 736563726574"),
         Connect("p", version=5, password=b"secret")),

    # ---------------------------------------------------------------- CONNACK
    case("connack-v311-accepted-session-present", 4, h("20 02 01 00"), Connack(True, 0)),
    case("connack-v311-accepted", 4, h("20 02 00 00"), Connack(False, 0)),
    case("connack-v311-bad-protocol", 4, h("20 02 00 01"), Connack(False, 1)),
    case("connack-v311-identifier-rejected", 4, h("20 02 00 02"), Connack(False, 2)),
    case("connack-v311-server-unavailable", 4, h("20 02 00 03"), Connack(False, 3)),
    case("connack-v311-bad-credentials", 4, h("20 02 00 04"), Connack(False, 4)),
    case("connack-v311-not-authorized", 4, h("20 02 00 05"), Connack(False, 5)),
    case("connack-v5-success", 5, h("20 03 00 00 00"), Connack(False, 0)),
    case("connack-v5-session-present", 5, h("20 03 01 00 00"), Connack(True, 0)),
    # 43 bytes of properties: 12 assigned id "auto-1" / 13 server keep alive 120 /
    # 24 max QoS 1 / 25 retain available 0 / 22 topic alias max 5 / 21 receive max 100 /
    # 27 max packet size 65536 / 28 wildcard 1 / 29 sub ids 0 / 2a shared 1 /
    # 11 session expiry ffffffff / 1a response information "ri"
    case("connack-v5-properties", 5,
         h("20 2e 00 00 2b" "12 0006 6175746f2d31" "13 0078" "24 01" "25 00" "22 0005"
           "21 0064" "27 00010000" "28 01" "29 00" "2a 01" "11 ffffffff" "1a 0002 7269"),
         Connack(False, 0, {
             "assigned_client_identifier": "auto-1", "server_keep_alive": 120,
             "maximum_qos": 1, "retain_available": 0, "topic_alias_maximum": 5,
             "receive_maximum": 100, "maximum_packet_size": 65536,
             "wildcard_subscription_available": 1, "subscription_identifier_available": 0,
             "shared_subscription_available": 1, "session_expiry_interval": 0xFFFFFFFF,
             "response_information": "ri"})),
    # 9c use another server: 1c server reference "other:1883" / 1f reason string "moved"
    case("connack-v5-use-another-server", 5,
         h("20 18 00 9c 15" "1c 000a 6f746865723a31383833" "1f 0005 6d6f766564"),
         Connack(False, 0x9C, {"server_reference": "other:1883", "reason_string": "moved"})),
    case("connack-v5-not-authorized-user-property", 5, h("20 0a 00 87 07 26 0001 78 0001 79"),
         Connack(False, 0x87, {"user_property": [("x", "y")]})),

    # ---------------------------------------------------------------- PUBLISH
    case("publish-v311-qos0", 4, h("30 07 0003 612f62 6869"), Publish("a/b", b"hi")),
    case("publish-v311-qos1", 4, h("32 09 0003 612f62 000a 6869"),
         Publish("a/b", b"hi", qos=1, packet_id=10)),
    # 30 | dup 08 | QoS 2 04 | retain 01 = 3d; packet id ffff, empty payload
    case("publish-v311-qos2-dup-retain", 4, h("3d 05 0001 74 ffff"),
         Publish("t", b"", qos=2, retain=True, dup=True, packet_id=0xFFFF)),
    case("publish-v311-qos0-retain", 4, h("31 03 0001 74"), Publish("t", retain=True)),
    case("publish-v311-qos1-dup", 4, h("3a 06 0001 74 0001 78"),
         Publish("t", b"x", qos=1, dup=True, packet_id=1)),
    # remaining length 203 = cb 01 (two bytes)
    case("publish-v311-two-byte-length", 4, h("30 cb 01 0001 74") + b"x" * 200,
         Publish("t", b"x" * 200)),
    # remaining length 16387 = 83 80 01 (three bytes)
    case("publish-v311-three-byte-length", 4, h("30 83 80 01 0001 74") + b"y" * 16384,
         Publish("t", b"y" * 16384)),
    case("publish-v5-qos0", 5, h("30 08 0003 612f62 00 6869"), Publish("a/b", b"hi")),
    # QoS 2 (04) | retain (01) = 35, packet id 1, no properties, empty payload
    case("publish-v5-qos2-retain", 5, h("35 06 0001 74 0001 00"),
         Publish("t", b"", qos=2, retain=True, packet_id=1)),
    # every PUBLISH property, 62 bytes: 01 payload format 1 / 02 expiry 60 /
    # 03 content type "json" / 08 response topic "reply" / 09 correlation 010203 /
    # 26 a=1, b=2, a=3 / 23 topic alias 5 / 0b sub ids 1, 128 (80 01), 268435455 (ff ff ff 7f)
    # remaining: topic 3 + packet id 2 + 1 + 62 + payload "{}" 2 = 70
    case("publish-v5-all-properties", 5,
         h("32 46 0001 74 0007 3e"
           "01 01" "02 0000003c" "03 0004 6a736f6e" "08 0005 7265706c79" "09 0003 010203"
           "26 0001 61 0001 31" "26 0001 62 0001 32" "26 0001 61 0001 33" "23 0005"
           "0b 01" "0b 8001" "0b ffffff7f" "7b7d"),
         Publish("t", b"{}", qos=1, packet_id=7, properties={
             "payload_format_indicator": 1, "message_expiry_interval": 60,
             "content_type": "json", "response_topic": "reply",
             "correlation_data": b"\x01\x02\x03",
             "user_property": [("a", "1"), ("b", "2"), ("a", "3")],
             "topic_alias": 5, "subscription_identifier": [1, 128, 268435455]})),
    # user properties interleaved with another property keep their relative order
    case("publish-v5-user-properties-interleaved", 5,
         h("30 16 0001 74 11" "26 0001 61 0001 31" "23 0005" "26 0001 62 0001 32" "7a"),
         Publish("t", b"z", properties={"user_property": [("a", "1"), ("b", "2")],
                                        "topic_alias": 5}), encodes=False),

    # ---------------------------------------------------- PUBACK/PUBREC/PUBREL/PUBCOMP
    case("puback-v311", 4, h("40 02 0001"), Puback(1)),
    case("pubrec-v311", 4, h("50 02 0002"), Pubrec(2)),
    case("pubrel-v311", 4, h("62 02 0003"), Pubrel(3)),
    case("pubcomp-v311", 4, h("70 02 ffff"), Pubcomp(0xFFFF)),
    case("puback-v5-short", 5, h("40 02 0001"), Puback(1)),
    case("pubrec-v5-short", 5, h("50 02 0002"), Pubrec(2)),
    case("pubrel-v5-short", 5, h("62 02 0003"), Pubrel(3)),
    case("pubcomp-v5-short", 5, h("70 02 0004"), Pubcomp(4)),
    case("puback-v5-reason", 5, h("40 03 0005 10"), Puback(5, 0x10)),
    case("pubrel-v5-reason", 5, h("62 03 0007 92"), Pubrel(7, 0x92)),
    # 1f reason string "no" / 26 k=v (12 bytes)
    case("pubrec-v5-reason-properties", 5,
         h("50 10 0006 80 0c" "1f 0002 6e6f" "26 0001 6b 0001 76"),
         Pubrec(6, 0x80, {"reason_string": "no", "user_property": [("k", "v")]})),
    case("pubcomp-v5-reason-properties", 5, h("70 0b 0008 92 07 1f 0004 676f6e65"),
         Pubcomp(8, 0x92, {"reason_string": "gone"})),
    # reason 0 must still be written when properties follow
    case("puback-v5-success-with-properties", 5, h("40 09 0009 00 05 1f 0002 6f6b"),
         Puback(9, 0, {"reason_string": "ok"})),
    case("puback-v5-explicit-success", 5, h("40 03 0001 00"), Puback(1), encodes=False),
    case("puback-v5-success-empty-properties", 5, h("40 04 0001 00 00"), Puback(1),
         encodes=False),
    case("pubrec-v5-reason-empty-properties", 5, h("50 04 0002 10 00"), Pubrec(2, 0x10),
         encodes=False),
    case("pubrel-v5-explicit-success", 5, h("62 03 0003 00"), Pubrel(3), encodes=False),
    case("pubcomp-v5-explicit-success", 5, h("70 03 0004 00"), Pubcomp(4), encodes=False),

    # ---------------------------------------------------------------- SUBSCRIBE
    # packet id 10; "a/+" QoS 0, "b/#" QoS 1, "c" QoS 2
    case("subscribe-v311", 4, h("82 12 000a" "0003 612f2b 00" "0003 622f23 01" "0001 63 02"),
         Subscribe(10, [SubscribeTopic("a/+", 0), SubscribeTopic("b/#", 1),
                        SubscribeTopic("c", 2)])),
    # packet id 11; 0b subscription id 200 (c8 01) / 26 u=1 (10 bytes)
    # "x": QoS 1 | no local 04 = 05; "y/#": QoS 2 | retain as published 08 | handling 1 10 = 1a;
    # "$share/g/z": QoS 0 | retain handling 2 (20)
    case("subscribe-v5-options", 5,
         h("82 24 000b 0a" "0b c801" "26 0001 75 0001 31"
           "0001 78 05" "0003 792f23 1a" "000a 247368617265 2f672f7a 20"),
         Subscribe(11, [SubscribeTopic("x", 1, no_local=True),
                        SubscribeTopic("y/#", 2, retain_as_published=True, retain_handling=1),
                        SubscribeTopic("$share/g/z", 0, retain_handling=2)],
                   {"subscription_identifier": 200, "user_property": [("u", "1")]})),
    # QoS 1 | no local | retain as published | retain handling 2 = 2d
    case("subscribe-v5-all-options", 5, h("82 07 0001 00 0001 74 2d"),
         Subscribe(1, [SubscribeTopic("t", 1, True, True, 2)])),

    # ---------------------------------------------------------------- SUBACK
    case("suback-v311", 4, h("90 06 000a 00 01 02 80"), Suback(10, [0, 1, 2, 0x80])),
    case("suback-v5", 5, h("90 04 0002 00 00"), Suback(2, [0])),
    case("suback-v5-properties", 5, h("90 11 000b 0a 1f 0007 7061727469616c 01 02 8f a2"),
         Suback(11, [1, 2, 0x8F, 0xA2], {"reason_string": "partial"})),

    # ---------------------------------------------------------------- UNSUBSCRIBE
    case("unsubscribe-v311", 4, h("a2 0a 0003 0003 612f62 0001 23"), Unsubscribe(3, ["a/b", "#"])),
    case("unsubscribe-v5", 5, h("a2 06 0005 00 0001 78"), Unsubscribe(5, ["x"])),
    case("unsubscribe-v5-user-property", 5, h("a2 0d 0004 07 26 0001 6b 0001 76 0001 78"),
         Unsubscribe(4, ["x"], {"user_property": [("k", "v")]})),

    # ---------------------------------------------------------------- UNSUBACK
    case("unsuback-v311", 4, h("b0 02 0003"), Unsuback(3)),
    case("unsuback-v5", 5, h("b0 06 0004 00 00 11 87"), Unsuback(4, [0x00, 0x11, 0x87])),
    case("unsuback-v5-properties", 5, h("b0 0a 0005 06 1f 0003 626164 8f"),
         Unsuback(5, [0x8F], {"reason_string": "bad"})),

    # ---------------------------------------------------------------- PING
    case("pingreq-v311", 4, h("c0 00"), Pingreq()),
    case("pingresp-v311", 4, h("d0 00"), Pingresp()),
    case("pingreq-v5", 5, h("c0 00"), PINGREQ),
    case("pingresp-v5", 5, h("d0 00"), PINGRESP),

    # ---------------------------------------------------------------- DISCONNECT
    case("disconnect-v311", 4, h("e0 00"), Disconnect()),
    case("disconnect-v5-normal", 5, h("e0 00"), Disconnect()),
    case("disconnect-v5-reason", 5, h("e0 01 8e"), Disconnect(0x8E)),
    # 04 with will: 11 session expiry 3600 / 1f reason string "bye" (11 bytes)
    case("disconnect-v5-session-expiry-reason-string", 5,
         h("e0 0d 04 0b 11 00000e10 1f 0003 627965"),
         Disconnect(0x04, {"session_expiry_interval": 3600, "reason_string": "bye"})),
    case("disconnect-v5-server-moved", 5, h("e0 08 9d 06 1c 0003 623a31"),
         Disconnect(0x9D, {"server_reference": "b:1"})),
    case("disconnect-v5-normal-with-properties", 5, h("e0 07 00 05 11 00000000"),
         Disconnect(0, {"session_expiry_interval": 0})),
    case("disconnect-v5-explicit-normal", 5, h("e0 01 00"), Disconnect(), encodes=False),
    case("disconnect-v5-normal-empty-properties", 5, h("e0 02 00 00"), Disconnect(),
         encodes=False),

    # ---------------------------------------------------------------- AUTH
    case("auth-v5-success", 5, h("f0 00"), Auth()),
    # 18 continue: 15 method "SCRAM" / 16 data 010203 (14 bytes)
    case("auth-v5-continue", 5, h("f0 10 18 0e 15 0005 534352414d 16 0003 010203"),
         Auth(0x18, {"authentication_method": "SCRAM", "authentication_data": b"\x01\x02\x03"})),
    # 19 re-authenticate: 15 method "X" / 1f reason "again" / 26 a=b (19 bytes)
    case("auth-v5-reauthenticate", 5,
         h("f0 15 19 13 15 0001 58 1f 0005 616761696e 26 0001 61 0001 62"),
         Auth(0x19, {"authentication_method": "X", "reason_string": "again",
                     "user_property": [("a", "b")]})),
    case("auth-v5-explicit-success", 5, h("f0 01 00"), Auth(), encodes=False),
]

ENCODE_CASES = [c for c in CASES if c.values[3]]


@pytest.mark.parametrize("version, wire, packet, encodes", ENCODE_CASES)
def test_encode(version, wire, packet, encodes):
    assert encode(packet, version) == wire


@pytest.mark.parametrize("version, wire, packet, encodes", CASES)
def test_decode(version, wire, packet, encodes):
    got = decode(wire, version)
    assert type(got) is type(packet)
    assert got == packet
    if isinstance(packet, Publish):
        assert got.raw == wire


def test_table_covers_every_packet_type_in_both_versions():
    seen = {(c.values[0], c.values[2].TYPE) for c in CASES}
    for ptype in range(C.CONNECT, C.AUTH):
        assert (4, ptype) in seen and (5, ptype) in seen, C.PACKET_NAMES[ptype]
    assert (5, C.AUTH) in seen and (3, C.CONNECT) in seen


def test_user_property_order_survives_decoding():
    pkt = decode(h("30 16 0001 74 11" "26 0001 62 0001 32" "23 0005" "26 0001 61 0001 31" "7a"), 5)
    assert pkt.properties["user_property"] == [("b", "2"), ("a", "1")]


# --------------------------------------------------------------------------- negative cases

# The malformed packets are one table with the broker's protocol-error tests (packet_table.py).
NEGATIVE = [pytest.param(m.version, m.wire, m.reason, m.refused_version, id=m.id) for m in MALFORMED]


@pytest.mark.parametrize("version, wire, reason, refused_version", NEGATIVE)
def test_decode_rejects(version, wire, reason, refused_version):
    dec = Decoder(version)
    with pytest.raises(MQTTError) as info:
        dec.feed(wire)
    err = info.value
    assert err.reason == reason, str(err)
    if refused_version is not None:
        assert isinstance(err, ConnectRefused)
        assert err.version == refused_version


@pytest.mark.parametrize("name", ["MQTX", "mqtt", "MQIsdp3", ""])
def test_connect_unknown_protocol_name(name):
    """The 5.0 spec allows either a CONNACK 0x84 or a plain close; never a decoded CONNECT."""
    raw = name.encode()
    body = len(raw).to_bytes(2, "big") + raw + h("04 02 003c 0000")
    with pytest.raises(MQTTError) as info:
        Decoder(4).feed(bytes([0x10, len(body)]) + body)
    assert info.value.reason in (0x81, 0x84)


def test_packet_too_large_rejected_from_header_alone():
    # remaining length 1000 (e8 07) with only the topic length of the body present
    dec = Decoder(5, max_packet_size=100)
    with pytest.raises(MQTTError) as info:
        dec.feed(h("30 e8 07 0001"))
    assert info.value.reason == 0x95


def test_packet_too_large_four_byte_length_rejected_before_body():
    dec = Decoder(4, max_packet_size=1024)
    with pytest.raises(MQTTError) as info:
        dec.feed(h("32 ff ff ff 7f 00"))
    assert info.value.reason == C.PACKET_TOO_LARGE


def test_max_packet_size_counts_the_whole_packet():
    # "30 07 0003 612f62 6869" is 9 bytes on the wire
    wire = h("30 07 0003 612f62 6869")
    assert Decoder(4, max_packet_size=9).feed(wire) == [Publish("a/b", b"hi")]
    with pytest.raises(MQTTError) as info:
        Decoder(4, max_packet_size=8).feed(wire)
    assert info.value.reason == 0x95


def test_decode_requires_exactly_one_packet():
    with pytest.raises(MQTTError):
        decode(h("c0 00 c0 00"))
    with pytest.raises(MQTTError):
        decode(h("30 07 0003 612f62"))  # body missing


# --------------------------------------------------------------------------- incremental decoding

def stream_of(version):
    """(bytes, packets) for a whole session: one CONNECT, then every other row of `version`."""
    rows = [c.values for c in CASES if c.values[0] == version]
    connect = next(r for r in rows if r[2].TYPE == C.CONNECT)
    rest = [r for r in rows if r[2].TYPE != C.CONNECT]
    rows = [connect] + rest + rest[::-1]
    return b"".join(r[1] for r in rows), [r[2] for r in rows]


STREAMS = {v: stream_of(v) for v in (4, 5)}


@pytest.mark.parametrize("version", [4, 5])
def test_stream_all_at_once(version):
    data, packets = STREAMS[version]
    dec = Decoder(4)  # the CONNECT switches it to the stream's version
    assert dec.feed(data) == packets
    assert dec.buffered == 0
    assert dec.version == version


@pytest.mark.parametrize("version", [4, 5])
def test_stream_one_byte_at_a_time(version):
    data, packets = STREAMS[version]
    dec = Decoder(4)
    out = []
    since_boundary = 0
    for i in range(len(data)):
        got = dec.feed(data[i:i + 1])
        since_boundary += 1
        if got:
            assert len(got) == 1
            since_boundary = 0
        out.extend(got)
        assert dec.buffered == since_boundary
    assert out == packets


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(version=st.sampled_from([4, 5]), data=st.data())
def test_stream_random_splits(version, data):
    wire, packets = STREAMS[version]
    cuts = data.draw(st.lists(st.integers(1, len(wire) - 1), max_size=40, unique=True))
    cuts = [0] + sorted(cuts) + [len(wire)]
    dec = Decoder(4)
    out = []
    for a, b in zip(cuts, cuts[1:]):
        out.extend(dec.feed(wire[a:b]))
    assert out == packets
    assert dec.buffered == 0


def test_buffered_tracks_partial_packet():
    dec = Decoder(4)
    assert dec.buffered == 0
    assert dec.feed(h("30")) == []
    assert dec.buffered == 1
    assert dec.feed(h("83 80")) == []  # remaining-length still incomplete
    assert dec.buffered == 3
    assert dec.feed(h("01 0001 74") + b"y" * 100) == []
    assert dec.buffered == 3 + 4 + 100
    pkts = dec.feed(b"y" * 16284 + h("c0 00 d0"))
    assert pkts == [Publish("t", b"y" * 16384), PINGREQ]
    assert dec.buffered == 1
    assert dec.feed(h("00")) == [PINGRESP]
    assert dec.buffered == 0


def test_feed_accepts_bytearray_and_memoryview():
    dec = Decoder(4)
    assert dec.feed(bytearray(h("c0 00"))) == [PINGREQ]
    assert dec.feed(memoryview(h("d0 00"))) == [PINGRESP]


# --------------------------------------------------------------------------- round trips

NUL_FREE = st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")
text = st.text(NUL_FREE, max_size=12)
blob = st.binary(max_size=24)
flag = st.integers(0, 1)
u16 = st.integers(0, 0xFFFF)
u16_nonzero = st.integers(1, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
varint_nonzero = st.integers(1, 268_435_455)
packet_id = u16_nonzero
user_props = st.lists(st.tuples(text, text), min_size=1, max_size=3)

# Allowed properties per packet, from the tables of MQTT 5.0 section 3.
WILL_PROPS = {
    "will_delay_interval": u32, "payload_format_indicator": flag, "message_expiry_interval": u32,
    "content_type": text, "response_topic": text, "correlation_data": blob,
    "user_property": user_props,
}
CONNECT_PROPS = {
    "session_expiry_interval": u32, "receive_maximum": u16_nonzero,
    "maximum_packet_size": st.integers(1, 0xFFFFFFFF), "topic_alias_maximum": u16,
    "request_response_information": flag, "request_problem_information": flag,
    "user_property": user_props, "authentication_method": text, "authentication_data": blob,
}
CONNACK_PROPS = {
    "session_expiry_interval": u32, "receive_maximum": u16_nonzero, "maximum_qos": flag,
    "retain_available": flag, "maximum_packet_size": st.integers(1, 0xFFFFFFFF),
    "assigned_client_identifier": text, "topic_alias_maximum": u16, "reason_string": text,
    "user_property": user_props, "wildcard_subscription_available": flag,
    "subscription_identifier_available": flag, "shared_subscription_available": flag,
    "server_keep_alive": u16, "response_information": text, "server_reference": text,
    "authentication_method": text, "authentication_data": blob,
}
PUBLISH_PROPS = {
    "payload_format_indicator": flag, "message_expiry_interval": u32,
    "topic_alias": u16_nonzero, "response_topic": text, "correlation_data": blob,
    "user_property": user_props, "content_type": text,
    "subscription_identifier": st.lists(varint_nonzero, min_size=1, max_size=3),
}
ACK_PROPS = {"reason_string": text, "user_property": user_props}
SUBSCRIBE_PROPS = {"subscription_identifier": varint_nonzero, "user_property": user_props}
UNSUBSCRIBE_PROPS = {"user_property": user_props}
DISCONNECT_PROPS = {
    "session_expiry_interval": u32, "reason_string": text, "user_property": user_props,
    "server_reference": text,
}
AUTH_PROPS = {
    "authentication_method": text, "authentication_data": blob, "reason_string": text,
    "user_property": user_props,
}

# Reason codes per packet, from the tables of MQTT 5.0 section 3.
CONNACK_REASONS = [0x00, 0x80, 0x81, 0x82, 0x83, 0x84, 0x85, 0x86, 0x87, 0x88, 0x89, 0x8A,
                   0x8C, 0x90, 0x95, 0x97, 0x99, 0x9A, 0x9B, 0x9C, 0x9D, 0x9F]
PUBACK_REASONS = [0x00, 0x10, 0x80, 0x83, 0x87, 0x90, 0x91, 0x97, 0x99]
PUBREL_REASONS = [0x00, 0x92]
SUBACK_REASONS = [0x00, 0x01, 0x02, 0x80, 0x83, 0x87, 0x8F, 0x91, 0x97, 0x9E, 0xA1, 0xA2]
UNSUBACK_REASONS = [0x00, 0x11, 0x80, 0x83, 0x87, 0x8F, 0x91]
DISCONNECT_REASONS = [0x00, 0x04, 0x80, 0x81, 0x82, 0x83, 0x87, 0x89, 0x8B, 0x8D, 0x8E, 0x8F,
                      0x90, 0x93, 0x94, 0x95, 0x96, 0x97, 0x98, 0x99, 0x9A, 0x9B, 0x9C, 0x9D,
                      0x9E, 0x9F, 0xA0, 0xA1, 0xA2]
AUTH_REASONS = [0x00, 0x18, 0x19]


def props(table):
    return st.fixed_dictionaries({}, optional=table)


def connect_props():
    def fix(p):  # authentication data needs an authentication method
        if "authentication_data" in p and "authentication_method" not in p:
            del p["authentication_data"]
        return p
    return props(CONNECT_PROPS).map(fix)


@st.composite
def connects(draw, version):
    v5 = version == 5
    will = None
    if draw(st.booleans()):
        will = Will(draw(text), draw(blob), draw(st.integers(0, 2)), draw(st.booleans()),
                    draw(props(WILL_PROPS)) if v5 else None)
    username = draw(st.none() | text)
    password = draw(st.none() | blob) if (username is not None or v5) else None
    return Connect(draw(text), version, draw(st.booleans()), draw(u16), will, username,
                   password, draw(connect_props()) if v5 else None)


@st.composite
def publishes(draw, version):
    qos = draw(st.integers(0, 2))
    return Publish(draw(text), draw(st.binary(max_size=300)), qos, draw(st.booleans()),
                   draw(st.booleans()) if qos else False, draw(packet_id) if qos else None,
                   draw(props(PUBLISH_PROPS)) if version == 5 else None)


def subscribe_topics(version):
    if version == 5:
        topic = st.builds(SubscribeTopic, text, st.integers(0, 2), st.booleans(), st.booleans(),
                          st.integers(0, 2))
    else:
        topic = st.builds(SubscribeTopic, text, st.integers(0, 2))
    return st.lists(topic, min_size=1, max_size=5)


def packets(version):
    v5 = version == 5
    none = st.none()
    ack = lambda cls, reasons: st.builds(  # noqa: E731
        cls, packet_id, st.sampled_from(reasons) if v5 else st.just(0),
        props(ACK_PROPS) if v5 else none)
    options = [
        connects(version),
        st.builds(Connack, st.booleans(),
                  st.sampled_from(CONNACK_REASONS) if v5 else st.integers(0, 5),
                  props(CONNACK_PROPS) if v5 else none),
        publishes(version),
        ack(Puback, PUBACK_REASONS), ack(Pubrec, PUBACK_REASONS),
        ack(Pubrel, PUBREL_REASONS), ack(Pubcomp, PUBREL_REASONS),
        st.builds(Subscribe, packet_id, subscribe_topics(version),
                  props(SUBSCRIBE_PROPS) if v5 else none),
        st.builds(Suback, packet_id,
                  st.lists(st.sampled_from(SUBACK_REASONS if v5 else [0, 1, 2, 0x80]),
                           min_size=1, max_size=5),
                  props(ACK_PROPS) if v5 else none),
        st.builds(Unsubscribe, packet_id, st.lists(text, min_size=1, max_size=5),
                  props(UNSUBSCRIBE_PROPS) if v5 else none),
        st.builds(Unsuback, packet_id,
                  st.lists(st.sampled_from(UNSUBACK_REASONS), min_size=1, max_size=5)
                  if v5 else st.just(()),
                  props(ACK_PROPS) if v5 else none),
        st.just(Pingreq()), st.just(Pingresp()),
        st.builds(Disconnect, st.sampled_from(DISCONNECT_REASONS), props(DISCONNECT_PROPS))
        if v5 else st.just(Disconnect()),
    ]
    if v5:
        options.append(st.builds(Auth, st.sampled_from(AUTH_REASONS), props(AUTH_PROPS)))
    return st.one_of(options)


versioned_packets = st.one_of(
    st.tuples(st.just(3), connects(3)),
    st.tuples(st.just(4), packets(4)),
    st.tuples(st.just(5), packets(5)),
)


@settings(max_examples=1000, deadline=None)
@given(versioned_packets)
def test_roundtrip(vp):
    version, packet = vp
    wire = encode(packet, version)
    got = decode(wire, version)
    assert got == packet
    assert encode(got, version) == wire


@settings(max_examples=100, deadline=None)
@given(st.lists(packets(5), min_size=1, max_size=8), st.data())
def test_roundtrip_stream_v5(pkts, data):
    wire = b"".join(encode(p, 5) for p in pkts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(wire)), max_size=10)))
    dec = Decoder(5)
    out = []
    for a, b in zip([0] + cuts, cuts + [len(wire)]):
        out.extend(dec.feed(wire[a:b]))
    # a CONNECT in the stream switches the decoder to that CONNECT's version: still 5 here
    assert out == pkts


# --------------------------------------------------------------------------- robustness

def feed_all(version, data, max_packet_size=C.MAX_REMAINING_LENGTH + 5):
    try:
        Decoder(version, max_packet_size).feed(data)
    except MQTTError as e:
        assert isinstance(e.reason, int) and 0x80 <= e.reason <= 0xA2


@settings(max_examples=800, deadline=None)
@given(st.sampled_from([4, 5]), st.binary(max_size=300))
def test_random_bytes_only_raise_mqtt_errors(version, data):
    feed_all(version, data)
    feed_all(version, data, max_packet_size=64)


@settings(max_examples=800, deadline=None)
@given(st.sampled_from([4, 5]), st.integers(1, 15), st.binary(max_size=200))
def test_random_body_with_valid_header_only_raises_mqtt_errors(version, ptype, body):
    flags = {C.PUBREL: 2, C.SUBSCRIBE: 2, C.UNSUBSCRIBE: 2}.get(ptype, 0)
    n = len(body)
    length = bytes([n]) if n < 128 else bytes([n & 0x7F | 0x80, n >> 7])
    feed_all(version, bytes([ptype << 4 | flags]) + length + body)


@st.composite
def mutated(draw):
    version, packet = draw(versioned_packets)
    wire = bytearray(encode(packet, version))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "truncate", "insert", "delete", "set"]))
        if op == "flip" and wire:
            i = draw(st.integers(0, len(wire) - 1))
            wire[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate" and wire:
            del wire[draw(st.integers(0, len(wire) - 1)):]
        elif op == "insert":
            i = draw(st.integers(0, len(wire)))
            wire[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete" and wire:
            del wire[draw(st.integers(0, len(wire) - 1))]
        elif op == "set" and wire:
            wire[draw(st.integers(0, len(wire) - 1))] = draw(st.integers(0, 255))
    return version, bytes(wire)


@settings(max_examples=1500, deadline=None)
@given(mutated())
def test_mutated_packets_only_raise_mqtt_errors(vw):
    version, wire = vw
    feed_all(version, wire)
    # also as the tail of a stream that already holds a complete packet
    feed_all(version, h("c0 00") + wire)
