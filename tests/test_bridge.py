"""Bridges ([[bridge]]) between real processes: `wrenmq serve` edges, Debian's Mosquitto
(persistence on, its own port) or another wrenmq as the remote, real clients.

The sans-IO parts (topic mapping, the session's window and cursor) are tested with
plain records first; everything else crosses real sockets."""

import asyncio
import json
import re
import subprocess
import threading
import time

import pytest

from bridge_helpers import collect, first_seen_in_order, publish_acked
from conftest import WRENMQ, free_port, paho_client, subscribe
from mqtt_helpers import drain, scrape, wait_for
from wrenmq import Broker
from wrenmq.bridge import bridge_extensions
from wrenmq.bridge.session import (DELIVER, ECHO, ORIGIN_PROPERTY, POISON_STRIKES, BridgeSession,
                                   packet_id_of)
from wrenmq.bridge.topics import TopicMap
from wrenmq.broker.hooks import Extension
from wrenmq.config import ConfigError, load
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import decode
from wrenmq.mqtt.packets import Connack, Puback, Pubcomp, Publish, Pubrec
from wrenmq.store.format import Record


# --- sans-IO: the topic map and the session ----------------------------------------------

def bridge_cfg(topics, protocol="5", **kw):
    lines = [f'{k} = {json.dumps(v)}' for k, v in kw.items()]
    text = f'[[bridge]]\nname = "b"\naddress = "127.0.0.1:1"\nprotocol = "{protocol}"\n' + "\n".join(lines) + "\n"
    for t in topics:
        text += "[[bridge.topic]]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in t.items())
    return load(text=text).bridge[0]


def test_topic_map_follows_mosquittos_topic_lines():
    m = TopicMap(bridge_cfg([
        {"pattern": "sensors/#", "direction": "out", "qos": 1, "remote_prefix": "site1/"},
        {"pattern": "#", "direction": "in", "qos": 2, "local_prefix": "cloud/", "remote_prefix": "down/site1/"},
        {"pattern": "", "direction": "both", "qos": 0, "local_prefix": "a/b", "remote_prefix": "x/y"},
    ]).topic)
    assert m.outbound("sensors/t1") == ("site1/sensors/t1", 1)
    assert m.outbound("sensors") == ("site1/sensors", 1)  # ("sensors/#" matches its parent too)
    assert m.outbound("other/t1") is None
    assert m.outbound("a/b") == ("x/y", 0) and m.outbound("a/b/c") is None
    assert m.inbound("down/site1/cmd/1") == ("cloud/cmd/1", 2)
    assert m.inbound("down/site1") is None  # (the prefix's parent: not under the prefix)
    assert m.inbound("x/y") == ("a/b", 0)
    assert sorted(m.subscriptions()) == [("down/site1/#", 2), ("x/y", 0)]


def rec(offset, topic="s/1", qos=1, payload=None, client="dev", private=False, props=b"", ts=None):
    return Record(offset, ts if ts is not None else int(time.time() * 1e6), qos, False, topic, client, props,
                  payload if payload is not None else b"%d" % offset, 0, private)


def session(window=4, protocol="5", mark=None, **topic):
    cfg = bridge_cfg([{"pattern": "s/#", **topic}], protocol, max_inflight=window)
    s = BridgeSession(cfg, TopicMap(cfg.topic), "$bridge/b", "edge-b", 10, mark)
    s.connack(Connack(False, 0))
    return s


def test_session_cursor_is_the_oldest_unacknowledged_offset():
    s = session(window=3)
    now = time.time()
    sent = [s.take(rec(o), now) for o in (10, 11, 12)]
    assert all(sent) and s.full
    pkts = [decode(p, C.MQTT5) for p in sent]
    assert [p.packet_id for p in pkts] == [packet_id_of(o) for o in (10, 11, 12)]
    assert s.cursor == 10
    s.acked(Puback(pkts[1].packet_id))  # out of order: the cursor stays at the oldest
    assert s.cursor == 10 and not s.full
    s.acked(Puback(pkts[0].packet_id))
    assert s.cursor == 12
    s.acked(Puback(pkts[2].packet_id))
    assert s.cursor == 13 == s.read_pos and s.sent == 3


def test_session_skips_what_is_not_for_the_remote():
    s = session()
    now = time.time()
    assert s.take(rec(10, private=True), now) is None  # a private record: not of the topic stream
    assert s.take(rec(11, client="$bridge/b"), now) is None  # came in over this bridge
    assert s.take(rec(12, topic="other/1"), now) is None  # not carried out
    assert s.cursor == 13 and not s.inflight
    expired = b"\x02\x00\x00\x00\x05"  # message expiry interval 5 s, published 10 s ago
    assert s.take(rec(13, props=expired, ts=int((now - 10) * 1e6)), now) is None and s.expired == 1
    p = decode(s.take(rec(14, props=expired, ts=int((now - 2) * 1e6)), now), C.MQTT5)
    assert p.properties["message_expiry_interval"] == 3  # what is left of it
    assert p.qos == 1 and p.topic == "s/1"


def test_session_resends_in_flight_with_dup_after_a_reconnect():
    s = session(window=8, qos=2)
    now = time.time()
    a, b = (decode(s.take(rec(o, qos=2), now), C.MQTT5) for o in (20, 21))
    assert s.acked(Pubrec(a.packet_id)) is not None  # PUBREL for a
    s.lost()
    again = [decode(x, C.MQTT5) for x in s.connack(Connack(True, 0))]
    assert [type(x).__name__ for x in again] == ["Pubrel", "Publish"]
    assert again[0].packet_id == a.packet_id and again[1].packet_id == b.packet_id and again[1].dup
    s.acked(Pubcomp(a.packet_id))
    assert s.cursor == 21


def test_session_waits_when_a_packet_id_is_still_in_flight():
    s = session(window=8)
    now = time.time()
    assert s.take(rec(5), now) is not None
    assert s.take(rec(5 + 65534), now) is None and s.blocked  # same packet id
    assert s.read_pos == 5 + 65534  # not taken: it is read again
    s.acked(Puback(packet_id_of(5)))
    assert not s.blocked and s.take(rec(5 + 65534), now) is not None


def test_session_gives_up_on_a_message_the_remote_keeps_closing_on():
    s = session()
    now = time.time()
    s.take(rec(30), now)
    s.take(rec(31), now)
    for _ in range(POISON_STRIKES - 1):
        assert s.lost() is None
        s.connack(Connack(True, 0))
    assert s.lost().offset == 30 and s.cursor == 31 and s.skipped == 1


def test_session_marks_and_recognises_its_own_messages_in_a_cluster():
    s = session(mark="cl-b", direction="both")
    p = decode(s.take(rec(40), time.time()), C.MQTT5)
    assert (ORIGIN_PROPERTY, "cl-b") in p.properties["user_property"]
    assert s.incoming(Publish("s/1", b"x", 1, packet_id=7, properties=dict(p.properties)))[0] == ECHO
    assert s.incoming(Publish("s/1", b"x", 1, packet_id=8))[0] == DELIVER


def test_session_in_flight_bounded_in_bytes_too():
    s = session(window=1000)
    now = time.time()
    big = b"x" * (1 << 20)
    taken = 0
    while not s.full:
        assert s.take(rec(100 + taken, payload=big), now) is not None
        taken += 1
    assert taken == 16 and s.inflight_bytes >= 16 << 20  # (MAX_INFLIGHT_BYTES: 16 MiB)
    s.acked(Puback(packet_id_of(100)))
    assert not s.full and s.inflight_bytes < 16 << 20


def test_session_in_flight_bounded_by_the_remotes_receive_maximum():
    s = session(window=100)
    s.connack(Connack(False, 0, {"receive_maximum": 2}))
    now = time.time()
    assert s.take(rec(10), now) and s.take(rec(11), now) and s.full


# --- real processes ----------------------------------------------------------------------

OUT = '[[bridge.topic]]\npattern = "sensors/#"\nremote_prefix = "site1/"\n'


def edge_config(remote_port, topics=OUT, bridge="", extra="", name="cloud", address=None):
    return (f'[[listener]]\nport = 0\n{extra}[sys]\ninterval = 0.5\n'
            f'[[bridge]]\nname = "{name}"\naddress = "{address or f"127.0.0.1:{remote_port}"}"\n'
            f'reconnect_delay = 0.1\nreconnect_max = 0.5\n{bridge}{topics}')


def status(edge, cfg_path=None):
    """`wrenmq bridge status --json` of a served broker: {name: figures}."""
    args = ["--config", str(cfg_path)] if cfg_path else ["--port", str(edge.port)]
    r = subprocess.run([WRENMQ, "bridge", "status", "--json", "--wait", "3", *args], capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def remote_subscriber(port, flt, client_id="cloud-app", version=4):
    """A persistent subscriber on the remote (it reconnects by itself when the remote restarts)."""
    c = paho_client(port, client_id=client_id, version=version, clean=False)
    c.reconnect_delay_set(0.1, 0.5)
    subscribe(c, flt, 1)
    return c


def test_out_loses_no_acknowledged_message_across_remote_restarts_and_kill_9(tmp_path, serve_broker, mosquitto):
    """QoS 1 to the edge while the remote is up, stopped and started, and across kill -9s of
    the edge (once with messages waiting in its log for the remote, once while it sends):
    every message the edge acknowledged reaches a persistent subscriber of the remote, in
    the order published. Figures in $SYS, the metrics and `wrenmq bridge status`."""
    remote = mosquitto()
    app = remote_subscriber(remote.port, "site1/#")
    metrics = free_port()
    edge = serve_broker(edge_config(remote.port, extra=f'[[listener]]\ntype = "metrics"\nport = {metrics}\n'))
    n = iter(range(10 ** 6))

    def batch(k, client):
        return publish_acked(edge.port, "sensors/a", [b"%d" % next(n) for _ in range(k)], client)

    acked = batch(300, "p1")
    assert len(acked) == 300
    remote.stop()
    acked += batch(300, "p2")  # the remote is down: they wait in the edge's log
    edge.kill()  # kill -9 with them unsent
    edge.start()
    acked += batch(300, "p3")
    remote.start()
    # (the bridge reconnects before the next kill, whatever its backoff under load)
    assert wait_for(lambda: len(re.findall(r"bridge cloud: connected to ", edge.log)) >= 2, timeout=30,
                    interval=0.05), edge.log
    # kill -9 while it sends (and while the publisher is still publishing)
    during = []
    t = threading.Thread(target=lambda: during.extend(batch(3000, "p4")))
    t.start()
    assert wait_for(lambda: len(during) >= 500 or not t.is_alive(), timeout=30, interval=0.005)
    edge.kill()
    t.join(30)
    acked += during
    edge.start()
    acked += batch(200, "p5")
    want = set(acked)
    got = collect(app, lambda g: want <= {m.payload for m in g}, timeout=60)
    payloads = [m.payload for m in got]
    missing = want - set(payloads)
    assert not missing, f"{len(missing)} acknowledged message(s) never reached the remote, e.g. {sorted(missing)[:5]}"
    order = [int(p) for p in first_seen_in_order(payloads)]
    assert order == sorted(order), "the remote got the messages out of order"
    assert all(m.topic == "site1/sensors/a" for m in got)

    def settled():
        f = status(edge)["cloud"]
        return f if f["connected"] == "1" and f["lag/records"] == "0" else None
    figures = wait_for(settled, timeout=20, interval=0.5)
    assert figures, status(edge)
    assert figures["state"] == "connected" and figures["address"] == f"127.0.0.1:{remote.port}"
    assert int(figures["messages/out"]) >= 200  # (since the last start)
    _, _, text = scrape(metrics)
    assert re.search(r'^wrenmq_bridge_connected\{bridge="cloud"\} 1$', text, re.M), text
    out = re.search(r'^wrenmq_bridge_messages_out_total\{bridge="cloud"\} (\d+)$', text, re.M)
    assert out and int(out.group(1)) >= 200, text
    assert re.search(r'^wrenmq_bridge_lag_records\{bridge="cloud"\} 0$', text, re.M), text
    table = subprocess.run([WRENMQ, "bridge", "status", "--port", str(edge.port)], capture_output=True,
                           text=True, timeout=30).stdout
    assert re.search(rf"^cloud\s+connected\s+127\.0\.0\.1:{remote.port}\s", table, re.M), table
    behind = [int(x) for x in re.findall(r"bridge cloud: connected to .*\((\d+) record\(s\) behind\)", edge.log)]
    assert len(behind) >= 3 and behind[1] >= 600, behind  # (what waited in the log across the kill was sent)
    app.loop_stop()
    remote.close()


class PublishesFirst(Extension):
    """An extension started before the bridges: a real client publishes at QoS 1 through the
    listener, open by then, and every message is acknowledged before the bridges start (as
    clients of a busy broker do while its later listeners and extensions start)."""

    def __init__(self, payloads):
        self.payloads = payloads
        self.acked = []

    async def start(self, broker):
        self.acked = await asyncio.get_running_loop().run_in_executor(
            None, publish_acked, broker.port, "sensors/a", self.payloads, "early")


def test_out_sends_what_was_acknowledged_before_the_bridge_started(tmp_path, mosquitto):
    """A new bridge starts at the log's end as the store opened it, not as it is when the
    bridge starts: what clients published between the listener opening and the bridges
    starting reaches the remote too."""
    remote = mosquitto()
    app = remote_subscriber(remote.port, "site1/#")
    config = load(text=edge_config(remote.port) + f'[storage]\ndata_dir = "{tmp_path / "edge"}"\n')
    early = PublishesFirst([b"%d" % i for i in range(50)])
    ready = threading.Event()
    state = {}

    def serve():
        async def main():
            broker = state["broker"] = Broker(config, extensions=[early, *bridge_extensions(config)])
            await broker.start()
            state["loop"] = asyncio.get_running_loop()
            ready.set()
            await broker.serve_forever()
        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        assert ready.wait(60), "the edge did not start"
        assert len(early.acked) == 50
        late = publish_acked(state["broker"].port, "sensors/a", [b"late"], "late")
        want = set(early.acked) | set(late)
        got = collect(app, lambda g: want <= {m.payload for m in g}, timeout=30)
        missing = want - {m.payload for m in got}
        assert not missing, f"{len(missing)} acknowledged message(s) never reached the remote: {sorted(missing)[:5]}"
    finally:
        if "loop" in state:
            asyncio.run_coroutine_threadsafe(state["broker"].stop(), state["loop"]).result(30)
        thread.join(30)
        app.loop_stop()


def test_out_passes_over_exactly_the_damaged_records_of_its_log(tmp_path, serve_broker, mosquitto):
    """Records waiting in the edge's log for the remote, the first two segments of them
    damaged while the edge was down (more records than the bridge reads at a time): the
    bridge sends every readable record after them, and skips (its log reader logs them) only
    the damaged ones."""
    remote = mosquitto()
    app = remote_subscriber(remote.port, "site1/#")
    remote.stop()
    edge = serve_broker(edge_config(remote.port, bridge="max_inflight = 10\n",
                                    extra="[log]\nsegment_bytes = 4096\n"))
    acked = publish_acked(edge.port, "sensors/a", [b"%d" % i for i in range(400)], "p1")
    assert len(acked) == 400
    edge.stop()
    node = (tmp_path / "data" / "node_id").read_text().strip()
    segments = sorted((tmp_path / "data" / "log" / node).glob("*.log"))
    assert len(segments) >= 4, segments
    for seg in segments[:2]:
        seg.write_bytes(b"\xff" * seg.stat().st_size)
    first_kept = int(segments[2].stem)
    assert first_kept > 64  # (more than one read of the bridge's)
    edge.start()
    remote.start()
    want = {b"%d" % i for i in range(first_kept, 400)}
    got = collect(app, lambda g: want <= {m.payload for m in g}, timeout=60)
    payloads = {m.payload for m in got}
    missing = want - payloads
    assert not missing, f"{len(missing)} readable record(s) never reached the remote, e.g. {sorted(missing)[:5]}"
    assert not payloads - want, "records that were damaged reached the remote"
    assert "skipped offsets 0-" in edge.log, edge.log
    app.loop_stop()
    remote.close()


ACL = """topic read fromcloud/#
topic read $SYS/#
user bridge
topic write fromcloud/cmd/#
"""


def test_in_with_prefixes_acl_and_a_remote_session_kept_across_kill_9(tmp_path, serve_broker, mosquitto):
    """MQTT 3.1.1: remote topics under cloud/site1/cmd/ come in as fromcloud/cmd/..., as the
    bridge's local user; what the ACL does not let it publish is counted, not published;
    what the remote holds for the bridge while the edge is down (kill -9) comes in after."""
    remote = mosquitto()
    acl = tmp_path / "acl"
    acl.write_text(ACL)
    topics = ('[[bridge.topic]]\npattern = "cmd/#"\ndirection = "in"\nqos = 1\n'
              'remote_prefix = "cloud/site1/"\nlocal_prefix = "fromcloud/"\n'
              '[[bridge.topic]]\npattern = "cfg/#"\ndirection = "in"\n'
              'remote_prefix = "cloud/site1/"\nlocal_prefix = "fromcloud/"\n')
    edge = serve_broker(edge_config(remote.port, topics, 'protocol = "3.1.1"\nlocal_username = "bridge"\n',
                                    f'[auth]\nacl_file = "{acl}"\n'))
    local = paho_client(edge.port, client_id="local-app", version=4, clean=False)
    local.reconnect_delay_set(0.1, 0.5)
    subscribe(local, "fromcloud/#", 1)
    cloud = paho_client(remote.port, version=4)

    def probe():
        cloud.publish("cloud/site1/cmd/probe", b"p", 1)
        return any(m.topic == "fromcloud/cmd/probe" for m in drain(local, 0.2))
    assert wait_for(probe, timeout=20, interval=0.1), edge.log
    drain(local, 0.3)
    for i in range(20):
        cloud.publish("cloud/site1/cmd/a", b"%d" % i, 1).wait_for_publish(5)
    cloud.publish("cloud/site1/cfg/x", b"denied", 1).wait_for_publish(5)
    cloud.publish("cloud/site1/other", b"not carried", 1).wait_for_publish(5)
    got = collect(local, lambda g: len(g) >= 20, timeout=20)
    assert [(m.topic, m.payload) for m in got] == [("fromcloud/cmd/a", b"%d" % i) for i in range(20)]
    assert wait_for(lambda: status(edge)["cloud"]["messages/denied"] == "1", timeout=10, interval=0.3)
    edge.kill()
    for i in range(20, 40):  # the remote keeps them for the bridge's session (clean_start = false)
        cloud.publish("cloud/site1/cmd/a", b"%d" % i, 1).wait_for_publish(5)
    edge.start()
    got += collect(local, lambda g: len(g) >= 20, timeout=30)
    payloads = first_seen_in_order([m.payload for m in got if m.topic == "fromcloud/cmd/a"])
    assert payloads == [b"%d" % i for i in range(40)], payloads
    assert all(m.topic.startswith("fromcloud/cmd/") for m in got)
    local.loop_stop()
    cloud.loop_stop()
    remote.close()


def test_tls_with_a_client_certificate(tmp_path, serve_broker, mosquitto):
    """The remote asks for a client certificate: the bridge with one gets through, a bridge
    without one does not (and says so in its figures)."""
    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("edge-1")
    files = {}
    for name, blob in (("ca.pem", ca.cert_pem), ("server.pem", server.cert_chain_pems[0]),
                       ("server.key", server.private_key_pem), ("client.pem", client.cert_chain_pems[0]),
                       ("client.key", client.private_key_pem)):
        blob.write_to_path(str(tmp_path / name))
        files[name] = tmp_path / name
    tls_port = free_port()
    remote = mosquitto(extra=(f"listener {tls_port} 127.0.0.1\ncafile {files['ca.pem']}\n"
                                        f"certfile {files['server.pem']}\nkeyfile {files['server.key']}\n"
                                        "require_certificate true\n"))
    app = remote_subscriber(remote.port, "site1/#")
    tls = f'tls = true\ncafile = "{files["ca.pem"]}"\n'
    edge = serve_broker(edge_config(remote.port, address=f"127.0.0.1:{tls_port}", bridge=(
        tls + f'certfile = "{files["client.pem"]}"\nkeyfile = "{files["client.key"]}"\n')) +
        f'[[bridge]]\nname = "nocert"\naddress = "127.0.0.1:{tls_port}"\nreconnect_delay = 0.1\n'
        f'reconnect_max = 0.5\n{tls}{OUT}')
    acked = publish_acked(edge.port, "sensors/t", [b"%d" % i for i in range(50)], "p")
    got = collect(app, lambda g: len({m.payload for m in g}) >= 50, timeout=20)
    assert {m.payload for m in got} == set(acked) and len(acked) == 50
    f = status(edge)
    assert f["cloud"]["state"] == "connected"
    assert f["nocert"]["connected"] == "0" and int(f["nocert"]["connect_failures"]) >= 1, f["nocert"]
    assert "bridge nocert: cannot connect to" in edge.log or "bridge nocert: 127.0.0.1" in edge.log, edge.log
    app.loop_stop()
    remote.close()


def test_two_wrenmq_brokers_bridged_both_ways_do_not_echo(tmp_path, serve_broker):
    """A bridge from a to b, direction both on shared/# at QoS 2: a message published on either
    side reaches each side's subscriber exactly once (MQTT 5 no-local on the remote
    subscription; the log records what came in under the bridge, which does not send it back)."""
    b = serve_broker("[sys]\ninterval = 0\n", args=("--data-dir", "b"))
    a = serve_broker(edge_config(b.port, '[[bridge.topic]]\npattern = "shared/#"\ndirection = "both"\nqos = 2\n'),
                     args=("--data-dir", "a"))
    sa = paho_client(a.port, version=5)
    sb = paho_client(b.port, version=5)
    subscribe(sa, "shared/#", 2)
    subscribe(sb, "shared/#", 2)
    pa = paho_client(a.port, version=5)
    pb = paho_client(b.port, version=5)

    def probe():  # until the bridge's subscription on b is there
        pb.publish("shared/probe", b"p", 1)
        return any(m.payload == b"p" for m in drain(sa, 0.2))
    assert wait_for(probe, timeout=20, interval=0.1), a.log
    time.sleep(0.5)
    drain(sa)
    drain(sb)
    for i in range(10):  # (QoS 2 both ways: PUBREC, PUBREL, PUBCOMP through the bridge too)
        pa.publish("shared/from-a", b"a%d" % i, 2).wait_for_publish(5)
        pb.publish("shared/from-b", b"b%d" % i, 2).wait_for_publish(5)
    time.sleep(1.5)  # (an echo would take a round trip more)
    want = sorted([b"a%d" % i for i in range(10)] + [b"b%d" % i for i in range(10)])
    for c in (sa, sb):
        got = drain(c, 0.5)
        assert sorted(m.payload for m in got) == want
        assert {m.qos for m in got} == {2}
    for c in (sa, sb, pa, pb):
        c.loop_stop()


def test_bad_bridge_config_names_the_key_and_the_file(tmp_path, serve_broker):
    base = '[[bridge]]\nname = "cloud"\naddress = "127.0.0.1:1883"\n[[bridge.topic]]\npattern = "a/#"\n'
    cases = [
        (base + 'direction = "upstream"\n', "bridge[0].topic[0].direction", "expected one of in, out, both"),
        (base + 'remote_prefix = "site/+/"\n', "bridge[0].topic[0].remote_prefix", "no wildcards"),
        (base.replace("127.0.0.1:1883", "cloud.example"), "bridge[0].address", "expected host:port"),
        (base + 'direction = "both"\n' + "", None, None),  # valid (protocol 5)
        (base.replace('address', 'protocol = "3.1.1"\naddress') + 'direction = "both"\n',
         "bridge[0].topic[0].direction", "3.1.1 has no no-local"),
        (base + "[storage]\nmode = \"memory\"\n", "bridge[0].topic[0].direction", "needs [storage] mode"),
        (base + '[log]\ntopics = ["b/#"]\n', "bridge[0].topic[0].pattern", "not all recorded by [log] topics"),
        (base.replace("[[bridge.topic]]\npattern = \"a/#\"\n", ""), "bridge[0].topic", "at least one"),
    ]
    for i, (text, key, expected) in enumerate(cases):
        path = tmp_path / f"bad{i}.toml"
        path.write_text(text)
        if key is None:
            assert load(path).bridge[0].topic[0].direction == "both"
            continue
        with pytest.raises(ConfigError) as e:
            load(path)
        assert str(e.value).startswith(f"{path}: {key}: ") and expected in str(e.value), str(e.value)
    # (the command says the same, on one line)
    r = subprocess.run([WRENMQ, "config", "check", str(tmp_path / "bad0.toml")], capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and r.stderr == f"wrenmq: {tmp_path / 'bad0.toml'}: bridge[0].topic[0].direction: " \
        "expected one of in, out, both, got 'upstream'\n", r.stderr
    # A host nobody answers on: the broker runs, and says which key of which file to look at.
    dead = free_port()
    edge = serve_broker(edge_config(0, address=f"127.0.0.1:{dead}"))
    cfg = next(tmp_path.glob(f"wrenmq-{edge.port}.toml"))
    assert wait_for(lambda: "cannot connect" in edge.log, timeout=10), edge.log
    assert re.search(rf"bridge cloud: cannot connect to 127\.0\.0\.1:{dead} \(bridge\[0\]\.address in "
                     rf"{re.escape(str(cfg))}\): .*refused", edge.log), edge.log
    f = status(edge)["cloud"]
    assert f["connected"] == "0" and int(f["connect_failures"]) >= 1 and f["state"] in ("waiting", "connecting")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    from test_cluster import Etcd
    e = Etcd(tmp_path_factory.mktemp("etcd"))
    yield e
    e.stop()
    e.log.close()


def test_in_a_cluster_one_node_holds_the_remote_session_and_another_takes_it_over(tmp_path, serve_broker, mosquitto, etcd):
    """Two nodes with the same bridge: the node holding the etcd key subscribes on the remote
    (what comes in reaches both nodes' subscribers once), each node sends what its own
    clients publish, a message going out through one node's link and coming back to the
    other's subscription is recognised by its mark; when the holder is killed, the other
    node takes the remote session over (what the remote kept meanwhile comes in)."""
    remote = mosquitto()
    app = remote_subscriber(remote.port, "up/#")
    name = f"cl{int(time.time() * 1000) % 10 ** 8}"
    topics = ('[[bridge.topic]]\npattern = "up/#"\n'
              '[[bridge.topic]]\npattern = "down/#"\ndirection = "in"\n'
              '[[bridge.topic]]\npattern = "shared/#"\ndirection = "both"\n')

    def node(n):
        cluster = (f'[cluster]\nenabled = true\nname = "{name}"\nnode = "{n}"\netcd = ["{etcd.endpoint}"]\n'
                   f'port = {free_port()}\nlease_ttl = 2\n')
        return serve_broker(edge_config(remote.port, topics, extra=cluster), args=("--data-dir", n))
    nodes = {"a": node("a"), "b": node("b")}
    key = f"/wrenmq/{name}/bridges/cloud"

    def holder():
        out = etcd.ctl("get", "--print-value-only", key).stdout.strip()
        return out or None
    owner = wait_for(holder, timeout=20, interval=0.2)
    assert owner in nodes, etcd.ctl("get", "--prefix", f"/wrenmq/{name}/").stdout
    other = "b" if owner == "a" else "a"
    subs = {n: paho_client(b.port, client_id=f"sub-{n}", version=5, clean=False,
                           properties={"SessionExpiryInterval": 300}) for n, b in nodes.items()}
    for c in subs.values():
        c.reconnect_delay_set(0.1, 0.5)
        subscribe(c, "down/#", 1)
        subscribe(c, "shared/#", 1)
    cloud = paho_client(remote.port, version=5)

    def probe():  # the holder's subscription is on the remote, the others' filters known to it
        cloud.publish("down/probe", b"p", 1)
        return all(any(m.payload == b"p" for m in drain(c, 0.2)) for c in subs.values())
    assert wait_for(probe, timeout=30, interval=0.2)
    time.sleep(0.5)
    for c in subs.values():
        drain(c)
    for i in range(5):
        cloud.publish("down/x", b"in%d" % i, 1).wait_for_publish(5)
    for n, b in nodes.items():
        assert len(publish_acked(b.port, f"up/{n}", [b"%s%d" % (n.encode(), i) for i in range(20)], f"p-{n}")) == 20
    assert len(publish_acked(nodes[other].port, "shared/s", [b"s%d" % i for i in range(5)], "p-s")) == 5
    got = collect(app, lambda g: len({m.payload for m in g}) >= 40, timeout=20)
    assert {m.payload for m in got} == {b"%s%d" % (n, i) for n in (b"a", b"b") for i in range(20)}
    time.sleep(1.0)  # (an echo would take a round trip more)
    for n, c in subs.items():
        payloads = sorted(m.payload for m in drain(c, 0.5))
        assert payloads == sorted([b"in%d" % i for i in range(5)] + [b"s%d" % i for i in range(5)]), (n, payloads)
    f = status(nodes[owner])["cloud"]
    assert f["owner"] == owner and f["client_id"] == f"{name}-cloud" and f["state"] == "connected"
    g = status(nodes[other])["cloud"]
    assert g["client_id"] == f"{name}-cloud-{other}" and int(g["messages/echoes"]) == 0
    assert int(f["messages/echoes"]) == 5, f  # the non-holder's shared/s came back to the holder's subscription

    nodes[owner].kill()
    for i in range(5):  # while nobody holds it: the remote keeps them for the session
        cloud.publish("down/y", b"gap%d" % i, 1).wait_for_publish(5)
    assert wait_for(lambda: holder() == other, timeout=20, interval=0.2), holder()
    got = collect(subs[other], lambda g: len({m.payload for m in g}) >= 5, timeout=20)
    assert sorted({m.payload for m in got}) == [b"gap%d" % i for i in range(5)]
    f = wait_for(lambda: (lambda x: x if x["state"] == "connected" else None)(status(nodes[other])["cloud"]),
                 timeout=10, interval=0.3)
    assert f and f["owner"] == other and f["client_id"] == f"{name}-cloud"
    for c in (*subs.values(), cloud, app):
        c.loop_stop()
    remote.close()


@pytest.mark.parametrize("protocol", ["5", "3.1.1"])
def test_a_message_the_remote_cannot_take_does_not_stop_those_behind_it(tmp_path, serve_broker, mosquitto, protocol):
    """The remote's max_packet_size is 1,000 bytes. MQTT 5: the CONNACK says so and the
    bridge drops the large message before sending it. MQTT 3.1.1: the remote closes the
    connection each time it gets it; after five such closes the bridge skips it. Either
    way the messages behind it arrive, and the drop is counted."""
    remote = mosquitto(extra="max_packet_size 1000\n")
    app = remote_subscriber(remote.port, "site1/#")
    edge = serve_broker(edge_config(remote.port, bridge=f'protocol = "{protocol}"\n'))
    acked = publish_acked(edge.port, "sensors/a", [b"before", b"x" * 2000, b"after1", b"after2"], "p")
    assert len(acked) == 4
    got = collect(app, lambda g: {b"after1", b"after2"} <= {m.payload for m in g}, timeout=30)
    assert [m.payload for m in got if len(m.payload) < 100][-2:] == [b"after1", b"after2"], edge.log
    assert all(len(m.payload) < 1000 for m in got)
    f = wait_for(lambda: (lambda x: x if x["messages/dropped"] == "1" else None)(status(edge)["cloud"]),
                 timeout=10, interval=0.3)
    assert f, status(edge)
    assert "message(s) not carried so far" in edge.log
    assert ("skipping it" in edge.log) == (protocol == "3.1.1")  # (5: dropped before it went)
    app.loop_stop()
    remote.close()


def test_in_the_remote_is_told_the_largest_packet_this_broker_takes(tmp_path, serve_broker, mosquitto):
    """MQTT 5: the CONNECT says [limits] max_packet_size, so the remote drops a larger
    message for the bridge instead of sending it (which would end the connection here),
    and the messages behind it come in."""
    remote = mosquitto()
    topics = '[[bridge.topic]]\npattern = "cmd/#"\ndirection = "in"\n'
    edge = serve_broker(edge_config(remote.port, topics) + "[limits]\nmax_packet_size = 1024\n")
    local = paho_client(edge.port, version=5)
    subscribe(local, "cmd/#", 1)
    cloud = paho_client(remote.port, version=5)

    def probe():
        cloud.publish("cmd/probe", b"p", 1)
        return any(m.topic == "cmd/probe" for m in drain(local, 0.2))
    assert wait_for(probe, timeout=20, interval=0.1), edge.log
    drain(local, 0.3)
    for payload in (b"small1", b"x" * 4000, b"small2"):
        cloud.publish("cmd/a", payload, 1).wait_for_publish(5)
    got = collect(local, lambda g: len(g) >= 2, timeout=10)
    assert [m.payload for m in got] == [b"small1", b"small2"]
    assert "cannot take what" not in edge.log and edge.log.count("bridge cloud: connected to") == 1, edge.log
    for c in (local, cloud):
        c.loop_stop()
    remote.close()
