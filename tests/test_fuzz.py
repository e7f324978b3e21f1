"""Fuzzing: the codec and a live broker take hostile bytes without crashing or growing.

Bounded here (`make test`); `make fuzz` runs the same targets with many more examples
(WRENMQ_FUZZ_EXAMPLES). Inputs are valid MQTT conversations mutated by hypothesis
(bit flips, truncations, insertions, duplicated and reordered chunks) plus raw noise.
"""

import os
import socket
import time

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import RawClient
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import ConnectRefused, Decoder, MQTTError, encode
from wrenmq.mqtt.packets import (Auth, Connect, Disconnect, Pingreq, Puback, Pubcomp, Publish,
                                 Pubrec, Pubrel, Subscribe, SubscribeTopic, Unsubscribe, Will)

EXAMPLES = int(os.environ.get("WRENMQ_FUZZ_EXAMPLES", "300"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize="WRENMQ_FUZZ_EXAMPLES" not in os.environ,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


def conversation(version):
    """A plausible client session as bytes: CONNECT, then a bit of everything."""
    props5 = {"user_property": [("k", "v")], "message_expiry_interval": 30} if version == 5 else None
    pkts = [
        Connect("fz", version, True, 30, Will("w/t", b"bye", 1, False), "u", b"p",
                {"session_expiry_interval": 10, "receive_maximum": 5} if version == 5 else None),
        Subscribe(1, [SubscribeTopic("a/#", 2), SubscribeTopic("$share/g/b/+", 1)]),
        Publish("a/b", b"payload", 0),
        Publish("a/c", b"x" * 300, 1, True, False, 2, props5),
        Publish("a/d", b"", 2, False, False, 3),
        Pubrel(3),
        Puback(9),
        Pubrec(10),
        Pubcomp(11),
        Unsubscribe(4, ["a/#"]),
        Pingreq(),
    ]
    if version == 5:
        pkts.append(Auth(0x19, {"authentication_method": "m"}))
    pkts.append(Disconnect())
    return b"".join(encode(p, version) for p in pkts)


BASE = {v: conversation(v) for v in (3, 4, 5)}


@st.composite
def mutated(draw):
    version = draw(st.sampled_from([3, 4, 5]))
    data = bytearray(BASE[version])
    for _ in range(draw(st.integers(0, 8))):
        op = draw(st.sampled_from(["flip", "set", "cut", "insert", "dup", "truncate"]))
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "set":
            data[i] = draw(st.sampled_from([0x00, 0x7F, 0x80, 0xFF, 0x30, 0x82, 0xE0]))
        elif op == "cut":
            del data[i:i + draw(st.integers(1, 16))]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "dup":
            j = draw(st.integers(i, min(len(data), i + 64)))
            data[j:j] = data[i:j]
        else:
            del data[draw(st.integers(0, len(data))):]
    return bytes(data)


def _decode_all(data, splits):
    dec = Decoder(max_packet_size=4096)
    pos = 0
    for n in splits:
        dec.feed(data[pos:pos + n])
        pos += n
    dec.feed(data[pos:])


@FUZZ
@given(mutated(), st.lists(st.integers(1, 64), max_size=8))
def test_codec_fuzz_mutated_conversations(data, splits):
    try:
        _decode_all(data, splits)
    except (MQTTError, ConnectRefused):
        pass


@FUZZ
@given(st.binary(max_size=512))
def test_codec_fuzz_noise(data):
    try:
        _decode_all(data, [])
    except MQTTError:
        pass


def _rss_kb(pid):
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _alive(port):
    c = RawClient(port, C.MQTT311)
    c.send(Connect("probe", 4, True, 30))
    ack = c.recv()
    c.send(Pingreq())
    pong = c.recv()
    c.close()
    return ack is not None and ack.reason_code == 0 and pong is not None and pong.TYPE == C.PINGRESP


def test_live_broker_fuzz_no_crash_memory_flat(serve_broker):
    """Hostile conversations against `wrenmq serve`: it never dies, answers a fresh client
    afterwards, and its memory does not keep growing with the number of hostile clients."""
    b = serve_broker('[storage]\nmode = "memory"\n[limits]\nconnect_timeout = 1\n'
                     'max_packet_size = 65536\n[sys]\ninterval = 0\n', args=("--log-level", "error"))
    sent = {"n": 0}

    def hit(data):
        s = socket.create_connection(("127.0.0.1", b.port))
        s.settimeout(0.5)
        try:
            s.sendall(data)
            try:
                while s.recv(65536):
                    pass
            except (socket.timeout, ConnectionResetError):
                pass
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            s.close()
        sent["n"] += 1

    @settings(max_examples=max(60, EXAMPLES // 3), deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(mutated())
    def round_(data):
        hit(data)

    round_()  # warm-up: caches, allocator pools, hypothesis itself
    assert _alive(b.port)
    time.sleep(0.5)
    before = _rss_kb(b.proc.pid)
    for _ in range(3):
        round_()
    time.sleep(1.5)  # connect timeout closes whatever is left open
    assert b.proc.poll() is None, "broker died"
    assert _alive(b.port)
    after = _rss_kb(b.proc.pid)
    print(f"\nlive fuzz: {sent['n']} hostile connections, broker RSS {before} -> {after} KiB")
    assert after - before < 8 * 1024, f"broker RSS grew by {after - before} KiB"
