"""Broker state survives a clean restart (SIGTERM) and a kill -9 (issue 3).

Every test runs `wrenmq serve --data-dir <tmp>` as a subprocess and talks to it with
real clients: paho-mqtt (3.1.1 and 5.0) where the client's behaviour is ordinary, and
`RawClient` (bytes on a socket) where the test must control exactly which acks leave.
Most tests run twice: `stop` (SIGTERM: the broker shuts down cleanly and writes a final
checkpoint) and `kill` (SIGKILL: only what the store made durable is there).

Nothing here sleeps for long: the broker's own log (level info) tells when it has seen a
client go, and a QoS 1 publish acknowledged afterwards proves that everything the broker
wrote before it is on disk (`fsync = "always"` holds the PUBACK until its group commit,
and group commits are written in order).
"""

import queue
import sqlite3
import threading
import time

import pytest

from conftest import RawClient, get_messages, no_message
from mqtt_helpers import (drain, kill, no_reconnect, persistent, pprops, publish, raw_next,
                          raw_subscribe, session_present, sub, uid, wait_for)
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import encode
from wrenmq.mqtt.packets import (Connect, Disconnect, Pubcomp, Publish, Pubrec, Pubrel, Subscribe,
                                 SubscribeTopic)
from wrenmq.store.reader import LogReader

HOW = pytest.mark.parametrize("how", ["stop", "kill"])
VERSIONS = pytest.mark.parametrize("version", [4, 5])
NODE = "n1"


# --- harness -------------------------------------------------------------------------------


class Durable:
    """One `wrenmq serve` on a data directory, restartable on the same port."""

    def __init__(self, served, data):
        self.served = served
        self.data = data
        self.port = served.port

    @property
    def log(self):
        return self.served.log

    @property
    def log_dir(self):
        return self.data / "log" / NODE

    def mark(self):
        return len(self.served.log)

    def wait_log(self, needle, since=0, timeout=5.0):
        assert wait_for(lambda: needle in self.served.log[since:], timeout), \
            f"broker never logged {needle!r}:\n{self.served.log[since:][-3000:]}"

    def shutdown(self, how):
        """Stop the broker: SIGTERM ("stop", a clean shutdown) or SIGKILL ("kill")."""
        if how == "kill":
            self.served.kill()
        else:
            rc = self.served.stop()
            assert rc == 0, f"broker exited with {rc}:\n{self.log[-3000:]}"

    def restart(self, how):
        self.shutdown(how)
        self.served.start()

    def start(self):
        self.served.start()

    def records(self, topic_filters=None):
        reader = LogReader(self.log_dir)
        try:
            return list(reader.records(topic_filters=topic_filters))
        finally:
            reader.close()

    def segments(self):
        return sorted(p for p in self.log_dir.glob("*.log"))


@pytest.fixture
def durable(serve_broker, tmp_path):
    """Factory: durable(config_text) -> Durable on tmp_path/data (node id "n1", $SYS off)."""
    def factory(config="", data=None):
        data = data if data is not None else tmp_path / "data"
        text = config
        if "[broker]" not in text:
            text = f'[broker]\nnode_id = "{NODE}"\n' + text
        if "[sys]" not in text:
            text += "\n[sys]\ninterval = 0\n"
        served = serve_broker(text, args=("--data-dir", str(data), "--log-level", "info"))
        return Durable(served, data)
    return factory


@pytest.fixture
def pc(clients):
    """paho clients that never reconnect by themselves (an automatic reconnect after a
    broker restart would silently resume the session on the old client object)."""
    def factory(port, **kw):
        return no_reconnect(clients(port, **kw))
    return factory


def go_offline(b, client, cid):
    """Disconnect cleanly and wait until the broker has logged it."""
    mark = b.mark()
    client.disconnect()
    client.disconnected_event.wait(5)
    client.loop_stop()
    b.wait_log(f"client {cid} disconnected", mark)


def drop(b, client, cid):
    """Drop the TCP connection without DISCONNECT (the will stays armed)."""
    mark = b.mark()
    kill(client)
    client.loop_stop()
    b.wait_log(f"client {cid} disconnected", mark)


def barrier(b, version=4):
    """Everything the broker did before this returns is on disk (see module docstring).

    A persistent session's SUBSCRIBE is a durable state change, so its SUBACK waits for
    a group commit whether or not the commit log is on; the QoS 1 PUBLISH does the same
    through the log when it is on."""
    c = RawClient(b.port, version)
    try:
        c.send(_connect(uid("barrier"), version, clean=False, expiry=60))
        assert c.recv().TYPE == C.CONNACK
        assert raw_subscribe(c, "barrier/sync", 1) == [1]
        c.send(Publish("barrier/x", b"", qos=1, packet_id=2))
        ack = raw_next(c, C.PUBACK)
        assert ack is not None and ack.packet_id == 2
    finally:
        c.close()


def _connect(cid, version, clean=True, expiry=None, **kw):
    props = {"session_expiry_interval": expiry} if version == 5 and expiry else None
    return Connect(cid, version=version, clean_start=clean, properties=props, **kw)


def raw_session(raw_client, port, version, cid, clean=False, expiry=300):
    """A RawClient with a persistent session (3.1.1 clean session 0 / 5.0 expiry)."""
    c = raw_client(port, version)
    c.send(_connect(cid, version, clean, expiry))
    ack = c.recv()
    assert ack is not None and ack.TYPE == C.CONNACK and ack.reason_code == 0, ack
    return c, ack


def publish_many(client, items, timeout=15.0):
    """Publish (topic, payload, qos) items without waiting one by one; wait for all acks."""
    infos = [client.publish(t, p, q) for t, p, q in items]
    deadline = time.monotonic() + timeout
    for info in infos:
        info.wait_for_publish(max(0.01, deadline - time.monotonic()))
        assert info.is_published(), "publish not acknowledged"


def sys_value(pc, port, topic, pred, timeout=5.0):
    """Watch a $SYS topic until pred(int value) holds; return the last value seen."""
    c = pc(port, version=4)
    sub(c, topic, 0)
    last = [None]

    def check():
        for m in drain(c):
            last[0] = int(m.payload)
        return last[0] is not None and pred(last[0])

    wait_for(check, timeout)
    c.disconnect()
    c.loop_stop()
    return last[0]


def payloads(msgs):
    return [m.payload for m in msgs]


# --- persistent sessions -------------------------------------------------------------------


@HOW
@VERSIONS
def test_persistent_session_and_offline_messages_survive(durable, pc, version, how):
    b = durable()
    cid = uid("ps")
    s = persistent(pc, b.port, version, cid, expiry=300)
    assert not session_present(s)
    assert sub(s, "ps/#", 2) == [2]
    go_offline(b, s, cid)

    p = pc(b.port, version=version)
    sent = {1: [], 2: []}
    for i in range(12):
        q = 1 + i % 2
        publish(p, f"ps/{q}/{i}", b"m%d" % i, q)
        sent[q].append((f"ps/{q}/{i}", b"m%d" % i))
    publish(p, "ps/0", b"qos0 is not queued", 0)
    publish(p, "ps/1/last", b"last", 1)  # also the barrier for the QoS 0 one
    sent[1].append(("ps/1/last", b"last"))
    p.disconnect()

    b.restart(how)

    s2 = persistent(pc, b.port, version, cid, expiry=300)
    assert session_present(s2), "persistent session lost by the restart"
    got = get_messages(s2, 13)
    # paho hands a QoS 2 message over at PUBREL, so order is compared per QoS level.
    for q in (1, 2):
        assert [(m.topic, m.payload) for m in got if m.qos == q] == sent[q], f"QoS {q} backlog"
    assert len(got) == 13
    no_message(s2, 0.3)

    # The subscription itself survived: no re-subscribe, live messages still arrive.
    p2 = pc(b.port, version=version)
    publish(p2, "ps/2/live", b"live", 2)
    [m] = get_messages(s2, 1)
    assert (m.payload, m.qos) == (b"live", 2)

    # Everything was acknowledged: a second restart must not deliver any of it again
    # (QoS 2 exactly once; QoS 1 may come again only after a kill -9 that beat a checkpoint).
    go_offline(b, s2, cid)
    barrier(b)
    b.restart(how)
    s3 = persistent(pc, b.port, version, cid, expiry=300)
    assert session_present(s3)
    again = drain(s3, 0.5)
    assert not [m for m in again if m.qos == 2], f"QoS 2 delivered twice: {payloads(again)}"
    if how == "stop":
        assert not again, f"acknowledged messages delivered again after a clean restart: {payloads(again)}"


@HOW
def test_v5_subscription_options_survive(durable, pc, how):
    """QoS, no-local, retain-as-published and subscription identifiers after a restart,
    for messages read back from the log (published while offline) and for live ones."""
    b = durable()
    cid = uid("opt")
    s = persistent(pc, b.port, 5, cid, expiry=300)
    assert sub(s, "opt/q1/#", 1) == [1]
    assert sub(s, "opt/q0", 0) == [0]
    assert sub(s, "opt/nl", 1, no_local=True) == [1]
    assert sub(s, "opt/rap", 1, rap=True) == [1]
    assert sub(s, "opt/norap", 1) == [1]
    assert sub(s, "opt/id/#", 1, sub_id=42) == [1]
    publish(s, "opt/nl", b"own, before", 1)  # no-local: never to itself, not via the log either
    go_offline(b, s, cid)

    p = pc(b.port, version=5)
    publish(p, "opt/q1/a", b"q2 as q1", 2)
    publish(p, "opt/nl", b"other", 1)
    publish(p, "opt/rap", b"rap", 1, retain=True)
    publish(p, "opt/norap", b"norap", 1, retain=True)
    publish(p, "opt/id/x", b"id", 1)
    p.disconnect()

    b.restart(how)

    def check(msgs, phase):
        by = {m.payload: m for m in msgs}
        assert set(by) == {b"q2 as q1", b"other", b"rap", b"norap", b"id"}, f"{phase}: {payloads(msgs)}"
        assert by[b"q2 as q1"].qos == 1, f"{phase}: subscription QoS lost"
        assert by[b"rap"].retain, f"{phase}: retain-as-published lost"
        assert not by[b"norap"].retain, f"{phase}: retain flag without retain-as-published"
        assert getattr(by[b"id"].properties, "SubscriptionIdentifier", None) == [42], \
            f"{phase}: subscription identifier lost"
        for k in (b"q2 as q1", b"other", b"rap", b"norap"):
            assert getattr(by[k].properties, "SubscriptionIdentifier", None) is None, phase

    s2 = persistent(pc, b.port, 5, cid, expiry=300)
    assert session_present(s2)
    check(get_messages(s2, 5), "offline backlog after restart")
    no_message(s2, 0.3)

    # Live, without re-subscribing.
    p2 = pc(b.port, version=5)
    publish(p2, "opt/q1/a", b"q2 as q1", 2)
    publish(p2, "opt/nl", b"other", 1)
    publish(p2, "opt/rap", b"rap", 1, retain=True)
    publish(p2, "opt/norap", b"norap", 1, retain=True)
    publish(p2, "opt/id/x", b"id", 1)
    check(get_messages(s2, 5), "live after restart")
    publish(p2, "opt/q0", b"q0", 1)
    [m] = get_messages(s2, 1)
    assert (m.payload, m.qos) == (b"q0", 0)
    publish(s2, "opt/nl", b"own, after", 1)
    no_message(s2, 0.3)


@HOW
@VERSIONS
def test_shared_subscription_and_its_backlog_survive(durable, pc, version, how):
    """A persistent session's $share/g/... subscription is there after a restart, and the
    QoS 1 messages the group gave it (its only member) while it was offline - acknowledged
    to the publisher - are delivered, before live ones."""
    b = durable()
    cid = uid("sh")
    s = persistent(pc, b.port, version, cid, expiry=300)
    assert sub(s, "$share/g/sh/#", 1) == [1]
    go_offline(b, s, cid)
    p = pc(b.port, version=version)
    for i in range(3):
        publish(p, f"sh/{i}", b"%d" % i, 1)
    p.disconnect()
    b.restart(how)
    s2 = persistent(pc, b.port, version, cid, expiry=300)
    assert session_present(s2)
    time.sleep(0.2)  # (give a backlog the chance to come first)
    p2 = pc(b.port, version=version)
    publish(p2, "sh/live", b"live", 1)
    got = payloads(get_messages(s2, 4, timeout=1))
    assert b"live" in got, f"shared subscription lost by the restart: {got}"
    assert got == [b"0", b"1", b"2", b"live"], \
        f"acknowledged messages queued for the shared subscription were lost by the restart: {got}"


@HOW
@VERSIONS
def test_non_persistent_sessions_leave_nothing(durable, pc, version, how):
    """Clean sessions (3.1.1 clean session 1, 5.0 expiry 0) - one gone before the restart,
    one still connected when the broker goes - and a stored session ended by a clean start
    are not there after the restart, nor are their subscriptions."""
    b = durable()
    gone, live, replaced = uid("clean"), uid("cleanlive"), uid("replaced")
    kw = {"properties": {"SessionExpiryInterval": 0}} if version == 5 else {}
    c1 = pc(b.port, version=version, client_id=gone, clean=True, **kw)
    sub(c1, "cl/#", 1)
    c2 = pc(b.port, version=version, client_id=live, clean=True, **kw)
    sub(c2, "cl/#", 1)
    go_offline(b, c1, gone)
    s = persistent(pc, b.port, version, replaced, expiry=300)
    sub(s, "cl/#", 1)
    go_offline(b, s, replaced)
    # 3.1.1: clean session 1 (nothing kept); 5.0: clean start with expiry (a new, empty session).
    s2 = persistent(pc, b.port, version, replaced, expiry=300, clean=True)
    assert not session_present(s2)
    go_offline(b, s2, replaced)
    p = pc(b.port, version=version)
    publish(p, "cl/x", b"before", 1)
    assert payloads(get_messages(c2, 1)) == [b"before"]
    p.disconnect()
    b.restart(how)
    c2.loop_stop()
    back = {cid: persistent(pc, b.port, version, cid, expiry=300) for cid in (gone, live, replaced)}
    assert not session_present(back[gone]), "a clean session was restored"
    assert not session_present(back[live]), "a clean session (connected at the restart) was restored"
    assert session_present(back[replaced]) == (version == 5), "the session after the clean start"
    p2 = pc(b.port, version=version)
    publish(p2, "cl/y", b"after", 1)
    for cid, c in back.items():
        no_message(c, 0.2)  # no subscription came back


# --- retained messages ---------------------------------------------------------------------


@HOW
def test_retained_set_replace_clear_persist(durable, pc, how):
    b = durable()
    p = pc(b.port, version=4)
    publish(p, "ret/a", b"a1", 1, retain=True)
    publish(p, "ret/b", b"b1", 2, retain=True)
    publish(p, "ret/c", b"c1", 1, retain=True)
    publish(p, "ret/a", b"a2", 1, retain=True)  # replace
    publish(p, "ret/c", b"", 1, retain=True)  # clear (acknowledged)
    publish(p, "ret/d", b"d1", 0, retain=True)  # QoS 0 set...
    publish(p, "ret/b", b"", 0, retain=True)  # ...and QoS 0 clear,
    publish(p, "ret/e", b"e1", 1, retain=True)  # made durable by this acknowledged publish
    p.disconnect()
    p5 = pc(b.port, version=5)
    props = pprops("PUBLISH", ContentType="text/plain", ResponseTopic="reply/here",
                   UserProperty=[("k", "v")])
    publish(p5, "ret/p", b"p1", 1, retain=True, properties=props)
    p5.disconnect()
    b.restart(how)

    s = pc(b.port, version=5)
    sub(s, "ret/#", 2)
    got = {m.topic: m for m in get_messages(s, 4)}
    assert {t: m.payload for t, m in got.items()} == \
        {"ret/a": b"a2", "ret/d": b"d1", "ret/e": b"e1", "ret/p": b"p1"}
    assert all(m.retain for m in got.values())
    assert {t: m.qos for t, m in got.items()} == {"ret/a": 1, "ret/d": 0, "ret/e": 1, "ret/p": 1}
    pp = got["ret/p"].properties
    assert (pp.ContentType, pp.ResponseTopic, pp.UserProperty) == ("text/plain", "reply/here", [("k", "v")])
    no_message(s, 0.3)

    # Changes after the restart persist as well.
    p2 = pc(b.port, version=5)
    publish(p2, "ret/a", b"", 1, retain=True)
    publish(p2, "ret/f", b"f1", 1, retain=True)
    p2.disconnect()
    b.restart(how)
    s2 = pc(b.port, version=4)
    sub(s2, "ret/#", 2)
    got = {m.topic: m.payload for m in get_messages(s2, 4)}
    assert got == {"ret/d": b"d1", "ret/e": b"e1", "ret/f": b"f1", "ret/p": b"p1"}
    no_message(s2, 0.3)


# --- in-flight messages ----------------------------------------------------------------------


@HOW
@VERSIONS
def test_unacked_qos1_redelivered_with_dup(durable, pc, version, how):
    """QoS 1 messages sent but not PUBACKed before the broker went are resent after the
    restart with DUP = 1 and their original packet identifiers, in order."""
    b = durable()
    cid = uid("inf")
    s = persistent(pc, b.port, version, cid, expiry=300)
    s.manual_ack_set(True)
    sub(s, "inf/#", 1)
    p = pc(b.port, version=version)
    for i in range(4):
        publish(p, "inf/t", b"%d" % i, 1)
    got = get_messages(s, 4)
    assert payloads(got) == [b"0", b"1", b"2", b"3"]
    assert not any(m.dup for m in got)
    s.ack(got[0].mid, 1)  # only the first is acknowledged
    mids = {m.payload: m.mid for m in got}
    # A publish of its own on the same connection: once it is acknowledged, the broker has
    # processed that PUBACK (TCP keeps the order) and made everything before it durable.
    publish(s, "inf-sync", b"", 1)
    p.disconnect()
    b.restart(how)  # the subscriber is still connected when the broker goes
    s.loop_stop()

    s2 = persistent(pc, b.port, version, cid, expiry=300)
    assert session_present(s2)
    again = get_messages(s2, 3)
    if how == "kill" and again and again[0].payload == b"0":
        # Acknowledged, but a kill -9 may beat the checkpoint of the cursor (at least once).
        again = again[1:] + get_messages(s2, 1)
    assert payloads(again) == [b"1", b"2", b"3"], "unacknowledged messages not redelivered in order"
    problems = []
    if [m.dup for m in again] != [True] * 3:
        problems.append(f"DUP flags {[int(m.dup) for m in again]} (want 1 1 1)")
    if [m.mid for m in again] != [mids[m.payload] for m in again]:
        problems.append(f"packet ids {[m.mid for m in again]} (originally {[mids[m.payload] for m in again]})")
    assert not problems, "redelivery after the restart: " + "; ".join(problems)


@HOW
@VERSIONS
def test_qos2_outbound_resumes_with_pubrel(durable, pc, raw_client, version, how):
    """Outgoing QoS 2 exchanges resume where they stood: PUBREC received -> PUBREL again
    (not a second PUBLISH); PUBLISH sent, nothing back -> PUBLISH again with DUP and the
    same id; completed -> nothing."""
    b = durable()
    cid = uid("q2o")
    c, ack = raw_session(raw_client, b.port, version, cid)
    assert raw_subscribe(c, "q2o/#", 2) == [2]
    p = pc(b.port, version=version)
    for name in (b"done", b"released", b"published"):
        publish(p, "q2o/" + name.decode(), name, 2)
    pubs = {}
    for _ in range(3):
        pkt = raw_next(c, C.PUBLISH)
        assert pkt.qos == 2 and not pkt.dup
        pubs[pkt.payload] = pkt.packet_id
    # "done": the whole exchange.
    c.send(Pubrec(pubs[b"done"]))
    rel = raw_next(c, C.PUBREL)
    assert rel.packet_id == pubs[b"done"]
    c.send(Pubcomp(pubs[b"done"]))
    # "released": PUBREC sent, PUBREL received (so the broker has it on disk), no PUBCOMP.
    c.send(Pubrec(pubs[b"released"]))
    rel = raw_next(c, C.PUBREL)
    assert rel.packet_id == pubs[b"released"]
    # "published": no answer at all.
    barrier(b)
    p.disconnect()
    b.restart(how)
    c.close()

    c2, ack = raw_session(raw_client, b.port, version, cid)
    assert ack.session_present
    first = c2.recv()
    assert first.TYPE == C.PUBREL and first.packet_id == pubs[b"released"], \
        f"expected PUBREL {pubs[b'released']} first, got {first}"
    second = c2.recv()
    assert second.TYPE == C.PUBLISH, second
    assert (second.payload, second.packet_id, second.dup, second.qos) == \
        (b"published", pubs[b"published"], True, 2), second
    c2.send(Pubcomp(pubs[b"released"]))
    c2.send(Pubrec(pubs[b"published"]))
    rel = raw_next(c2, C.PUBREL)
    assert rel.packet_id == pubs[b"published"]
    c2.send(Pubcomp(pubs[b"published"]))
    with pytest.raises(TimeoutError):
        extra = c2.recv(0.3)
        pytest.fail(f"unexpected packet after the exchanges completed: {extra}")

    # A second restart: nothing of the three comes back.
    barrier(b)
    b.restart(how)
    c2.close()
    c3, ack = raw_session(raw_client, b.port, version, cid)
    assert ack.session_present
    with pytest.raises(TimeoutError):
        extra = c3.recv(0.3)
        pytest.fail(f"completed QoS 2 exchange resumed again: {extra}")


@HOW
@VERSIONS
def test_qos2_inbound_exactly_once(durable, pc, raw_client, version, how):
    """A publisher whose QoS 2 PUBLISH got PUBREC before the broker went: resending it
    (DUP) is answered PUBREC and not delivered again; PUBREL gets PUBCOMP."""
    b = durable()
    scid = uid("q2is")
    s = persistent(pc, b.port, version, scid, expiry=300)
    sub(s, "q2i/#", 2)
    go_offline(b, s, scid)

    pcid = uid("q2ip")
    c, _ = raw_session(raw_client, b.port, version, pcid)
    c.send(Publish("q2i/a", b"A", qos=2, packet_id=7))
    rec = raw_next(c, C.PUBREC)
    assert (rec.packet_id, rec.reason_code) == (7, 0)
    c.send(Publish("q2i/b", b"B", qos=2, packet_id=8))
    rec = raw_next(c, C.PUBREC)
    assert (rec.packet_id, rec.reason_code) == (8, 0)
    b.restart(how)
    c.close()

    c2, ack = raw_session(raw_client, b.port, version, pcid)
    assert ack.session_present
    # 7: the client did not see the PUBREC (as far as it knows) and resends the PUBLISH.
    c2.send(Publish("q2i/a", b"A", qos=2, dup=True, packet_id=7))
    rec = raw_next(c2, C.PUBREC)
    assert (rec.packet_id, rec.reason_code) == (7, 0)
    c2.send(Pubrel(7))
    comp = raw_next(c2, C.PUBCOMP)
    assert (comp.packet_id, comp.reason_code) == (7, 0)
    # 8: the client moves on with PUBREL.
    c2.send(Pubrel(8))
    comp = raw_next(c2, C.PUBCOMP)
    assert (comp.packet_id, comp.reason_code) == (8, 0)
    # The ids are free again: a new message with id 7 is a new message.
    c2.send(Publish("q2i/c", b"C", qos=2, packet_id=7))
    rec = raw_next(c2, C.PUBREC)
    assert (rec.packet_id, rec.reason_code) == (7, 0)
    c2.send(Pubrel(7))
    assert raw_next(c2, C.PUBCOMP).packet_id == 7

    s2 = persistent(pc, b.port, version, scid, expiry=300)
    assert session_present(s2)
    assert payloads(get_messages(s2, 3)) == [b"A", b"B", b"C"]
    no_message(s2, 0.5)
    logged = [r.payload for r in b.records(["q2i/#"])]
    assert logged == [b"A", b"B", b"C"], f"commit log holds {logged}"


def publish_qos2_then_lose_its_commit(b, raw_client, version, pcid, topic, payload, retain=False,
                                      also=()):
    """A QoS 2 PUBLISH (packet id 9) from persistent session `pcid`, kill -9 once PUBREC
    came, then the database rolled back to before that commit, as a crash between log and
    database would: the publisher's qos2_in id, each (statement, params) of `also` (one
    row each), and log_through."""
    c, _ = raw_session(raw_client, b.port, version, pcid)
    c.send(Publish(topic, payload, qos=2, retain=retain, packet_id=9))
    assert raw_next(c, C.PUBREC).packet_id == 9
    b.shutdown("kill")
    c.close()
    db = sqlite3.connect(b.data / "state.db")
    with db:
        assert db.execute("DELETE FROM qos2_in WHERE client_id=?", (pcid,)).rowcount == 1
        for statement, params in also:
            assert db.execute(statement, params).rowcount == 1
        db.execute("UPDATE meta SET value='0' WHERE key='log_through'")
    db.close()


def resend_qos2(b, raw_client, version, pcid, topic, payload, retain=False):
    """The publisher back in its session: the DUP resend of packet id 9, PUBREL, PUBCOMP."""
    c, ack = raw_session(raw_client, b.port, version, pcid)
    assert ack.session_present
    c.send(Publish(topic, payload, qos=2, retain=retain, dup=True, packet_id=9))
    assert raw_next(c, C.PUBREC).packet_id == 9
    c.send(Pubrel(9))
    assert raw_next(c, C.PUBCOMP).packet_id == 9


@VERSIONS
def test_qos2_inbound_id_from_the_log_survives_a_second_crash(durable, raw_client, version):
    """A QoS 2 PUBLISH whose log record was written but whose id never reached the
    database (kill -9 between the two): recovery finds the id in the log. It must
    also write it to the database, or a second crash after the next commit forgets
    it and the client's resend is taken as a new message (found by test_crash)."""
    b = durable()  # fsync = "always" by default
    pcid = uid("q2twice")
    publish_qos2_then_lose_its_commit(b, raw_client, version, pcid, "q2t/a", b"once")

    b.start()
    barrier(b, version)  # a later commit moves log_through past the record
    b.restart("kill")

    resend_qos2(b, raw_client, version, pcid, "q2t/a", b"once")
    logged = [r.payload for r in b.records(["q2t/#"])]
    assert logged == [b"once"], f"the resend was accepted as a new message: {logged}"


@VERSIONS
def test_qos2_in_the_log_but_not_the_database_still_reaches_a_shared_group(durable, raw_client, version):
    """A QoS 2 PUBLISH whose log record was written but whose state changes were not (kill
    -9 between the two): the shared group's choice of a member was among those. The
    publisher's resend is answered from the log without routing it again, so recovery
    must route it to the group itself, or it is acknowledged and never delivered (found
    by test_crash's shared-group run)."""
    b = durable()
    mcid, pcid = uid("q2share-m"), uid("q2share-p")
    m, _ = raw_session(raw_client, b.port, version, mcid)
    m.send(Subscribe(1, [SubscribeTopic("$share/g/q2s/#", 2)]))
    assert raw_next(m, C.SUBACK) is not None
    mark = b.mark()
    m.send(Disconnect())
    m.close()
    b.wait_log(f"client {mcid} disconnected", mark)
    publish_qos2_then_lose_its_commit(b, raw_client, version, pcid, "q2s/a", b"once",
                                      also=[("DELETE FROM outgoing WHERE client_id=?", (mcid,))])

    b.start()
    resend_qos2(b, raw_client, version, pcid, "q2s/a", b"once")
    m2, ack = raw_session(raw_client, b.port, version, mcid)
    assert ack.session_present
    got = raw_next(m2, C.PUBLISH)
    assert got is not None and (got.topic, got.payload, got.qos) == ("q2s/a", b"once", 2)
    m2.send(Pubrec(got.packet_id))
    assert raw_next(m2, C.PUBREL).packet_id == got.packet_id
    m2.send(Pubcomp(got.packet_id))
    try:
        again = raw_next(m2, C.PUBLISH, timeout=0.5)
    except TimeoutError:
        again = None
    assert again is None, f"delivered twice: {again}"
    assert [r.payload for r in b.records(["q2s/#"])] == [b"once"]


@VERSIONS
def test_qos2_retained_in_the_log_but_not_the_database_is_retained(durable, raw_client, version):
    """The same crash for a retained QoS 2 PUBLISH: the retained message was a state
    change of the lost transaction, and the resend is not routed again; recovery sets
    it from the log, and it survives a second crash."""
    b = durable()
    pcid = uid("q2ret-p")
    publish_qos2_then_lose_its_commit(b, raw_client, version, pcid, "q2r/a", b"kept", retain=True,
                                      also=[("DELETE FROM retained WHERE topic=?", ("q2r/a",))])

    b.start()
    resend_qos2(b, raw_client, version, pcid, "q2r/a", b"kept", retain=True)
    barrier(b, version)
    b.restart("kill")
    for _ in range(2):  # now, and after the restart that follows
        s, _ = raw_session(raw_client, b.port, version, uid("q2ret-s"), clean=True, expiry=0)
        s.send(Subscribe(1, [SubscribeTopic("q2r/#", 1)]))
        got = raw_next(s, C.PUBLISH)
        assert got is not None and (got.topic, got.payload, got.retain) == ("q2r/a", b"kept", True)
        s.close()
        b.restart("kill")


@VERSIONS
def test_qos2_id_released_before_a_kill_stays_released(durable, raw_client, version):
    """The rescan at recovery starts at log_through, which the writer moves with every
    transaction that changes state but otherwise only once a second. A QoS 2 id released
    by PUBREL, then QoS 0 traffic (no state changes), then a kill -9: the id must not come
    back from the rescan, so a new PUBLISH with it after the restart is a new message."""
    b = durable()
    flood = raw_client(b.port, version)
    flood.send(_connect(uid("q2flood"), version, True, 0))
    assert flood.recv().TYPE == C.CONNACK
    # A second after the start, a round of QoS 0 alone writes a log_through of its own:
    # from here on, only the QoS 2 exchange's transactions can move it past its record.
    time.sleep(1.2)
    flood.send(Publish("q2r/flood", b"early", qos=0))
    assert wait_for(lambda: b.records(["q2r/flood"]), 5)
    pcid = uid("q2rel")
    c, _ = raw_session(raw_client, b.port, version, pcid)
    c.send(Publish("q2r/a", b"first", qos=2, packet_id=5))
    assert raw_next(c, C.PUBREC).packet_id == 5
    c.send(Pubrel(5))
    assert raw_next(c, C.PUBCOMP).packet_id == 5
    for i in range(300):
        flood.send(Publish("q2r/flood", b"%d" % i, qos=0))
    assert wait_for(lambda: len(b.records(["q2r/flood"])) == 301, 5)
    b.shutdown("kill")
    c.close()
    b.start()
    c2, ack = raw_session(raw_client, b.port, version, pcid)
    assert ack.session_present
    c2.send(Publish("q2r/a", b"second", qos=2, packet_id=5))
    assert raw_next(c2, C.PUBREC).packet_id == 5
    c2.send(Pubrel(5))
    assert raw_next(c2, C.PUBCOMP).packet_id == 5
    logged = [r.payload for r in b.records(["q2r/a"])]
    assert logged == [b"first", b"second"], f"the new message was taken for a resend: {logged}"


@pytest.mark.parametrize("fsync", ["interval", "never"])
def test_acknowledged_qos1_survives_kill_while_the_writer_is_behind(durable, raw_client, tmp_path, fsync):
    """Under fsync "interval" and "never" a kill -9 (the machine stays up, and so does the
    page cache) must not lose an acknowledged message either: the PUBACK waits until the
    writer has written its record, even with the writer megabytes behind a QoS 0 flood.
    The kill follows each PUBACK at once, several times, from a fresh data directory."""
    big = b"f" * (64 * 1024)
    flood_bytes = b"".join(
        encode(Publish("flood/x", big, qos=0), C.MQTT311) for _ in range(64))  # 4 MiB a send
    for attempt in range(4):
        b = durable(f'[storage]\nfsync = "{fsync}"\nfsync_interval_ms = 100\n',
                    data=tmp_path / f"data-{fsync}-{attempt}")
        flood = raw_client(b.port)
        flood.send(_connect(uid("flood"), 4, True, 0))
        assert flood.recv().TYPE == C.CONNACK
        c = raw_client(b.port)
        c.send(_connect(uid("acked"), 4, True, 0))
        assert c.recv().TYPE == C.CONNACK
        stop = threading.Event()

        def pour():
            try:
                while not stop.is_set():
                    flood.sock.sendall(flood_bytes)
            except OSError:  # the broker was killed
                pass
        t = threading.Thread(target=pour, daemon=True)
        t.start()
        # Let the writer fall behind (the flood is read in 64 KiB payloads, copied to the log).
        assert wait_for(lambda: len(b.records(["flood/x"])) >= 200, 10)
        c.send(Publish("acked/x", b"m%d" % attempt, qos=1, packet_id=7))
        assert raw_next(c, C.PUBACK).packet_id == 7
        b.shutdown("kill")
        stop.set()
        t.join(5)
        logged = [r.payload for r in b.records(["acked/x"])]
        assert logged == [b"m%d" % attempt], f"attempt {attempt}: acknowledged, then lost: {logged}"
        c.close()
        flood.close()


# --- timers across downtime ------------------------------------------------------------------


def _will_client(pc, port, cid, delay, retain=False, expiry=60):
    will = {"topic": f"will/{cid}", "payload": b"gone:" + cid.encode(), "qos": 1, "retain": retain,
            "properties": pprops("WILLMESSAGE", WillDelayInterval=delay)}
    return pc(port, version=5, client_id=cid, clean=True,
              properties={"SessionExpiryInterval": expiry}, will=will)


@HOW
def test_delayed_will_survives_restart_within_delay(durable, pc, how):
    """Client dropped with will delay 2 s; the broker restarts meanwhile: the will comes
    once, after the delay."""
    b = durable()
    ocid = uid("wobs")
    obs = persistent(pc, b.port, 5, ocid, expiry=300)
    sub(obs, "will/#", 1)
    cid = uid("wd")
    w = _will_client(pc, b.port, cid, delay=2)
    drop(b, w, cid)
    t_drop = time.monotonic()
    barrier(b)
    b.restart(how)
    obs.loop_stop()
    obs2 = persistent(pc, b.port, 5, ocid, expiry=300)
    assert session_present(obs2)
    got = []
    while time.monotonic() < t_drop + 3.2:
        try:
            m = obs2.messages.get(timeout=0.1)
        except queue.Empty:
            continue
        got.append((m.payload, time.monotonic() - t_drop))
    assert [g[0] for g in got] == [b"gone:" + cid.encode()], f"will published {len(got)} times: {got}"
    assert got[0][1] >= 1.7, f"will published {got[0][1]:.2f}s after the drop, before its 2s delay"


@HOW
def test_timers_keep_running_across_downtime(durable, pc, how):
    """Session expiry, retained message expiry and will delays count the time the broker
    was down (one 2.6 s downtime for all of them):
    - session expiry 2 s: gone after the restart; 30 s: still there; 3 s (not touched after
      the restart): gone 3 s after its disconnect, not 3 s after the restart;
    - retained with message expiry 1 s: gone; 30 s: kept, remaining interval reduced;
    - will with delay 1 s (session expiry 60 s), due while the broker was down: published
      once, at the restart (retained, so a new subscriber sees it too)."""
    b = durable()
    problems = []
    short, long_, later = uid("exs"), uid("exl"), uid("exm")
    for cid, expiry in ((short, 2), (long_, 30), (later, 3)):
        c = persistent(pc, b.port, 5, cid, expiry=expiry)
        sub(c, f"exp/{cid}", 1)
        go_offline(b, c, cid)
    t_off = time.monotonic()
    p = pc(b.port, version=5)
    publish(p, "rexp/short", b"short", 1, retain=True,
            properties=pprops("PUBLISH", MessageExpiryInterval=1))
    publish(p, "rexp/long", b"long", 1, retain=True,
            properties=pprops("PUBLISH", MessageExpiryInterval=30))
    t_ret = time.monotonic()
    p.disconnect()
    ocid = uid("wobs")
    obs = persistent(pc, b.port, 5, ocid, expiry=300)
    sub(obs, "will/#", 1)
    go_offline(b, obs, ocid)
    wcid = uid("wd")
    will = b"gone:" + wcid.encode()
    w = _will_client(pc, b.port, wcid, delay=1, retain=True)
    drop(b, w, wcid)
    barrier(b)

    b.shutdown(how)
    time.sleep(max(0.0, t_off + 2.6 - time.monotonic()))
    mark = b.mark()
    b.start()

    # Sessions.
    c = persistent(pc, b.port, 5, short, expiry=2)
    if session_present(c):
        problems.append("session with expiry 2s survived 2.6s of downtime")
    c = persistent(pc, b.port, 5, long_, expiry=30)
    if not session_present(c):
        problems.append("session with expiry 30s lost after 2.6s of downtime")
    else:
        p = pc(b.port, version=5)
        publish(p, f"exp/{long_}", b"still subscribed", 1)
        if payloads(get_messages(c, 1)) != [b"still subscribed"]:
            problems.append("session with expiry 30s came back without its subscription")
    # Retained.
    r = pc(b.port, version=5)
    sub(r, "rexp/#", 1)
    got = get_messages(r, 2, timeout=0.4)  # retained messages come right after the SUBACK
    if payloads(got) != [b"long"]:
        problems.append(f"retained after the downtime: {payloads(got)} (want only b'long')")
    else:
        remaining = got[0].properties.MessageExpiryInterval
        if remaining > 30 - int(time.monotonic() - t_ret) + 1:
            problems.append(f"retained message expiry restarted at the restart (remaining {remaining}s)")
    # Will.
    if not wait_for(lambda: f"publishing will of {wcid}" in b.log[mark:], 2):
        problems.append("will due during the downtime not published at the restart")
    fresh = pc(b.port, version=5)
    sub(fresh, "will/#", 1)
    got = get_messages(fresh, 1)
    if [(m.payload, m.retain) for m in got] != [(will, True)]:
        problems.append(f"retained will not there after the restart: {payloads(got)}")
    obs2 = persistent(pc, b.port, 5, ocid, expiry=300)
    got = get_messages(obs2, 2, timeout=0.4)
    if payloads(got) != [will]:
        problems.append(f"observer got the will {len(got)} times: {payloads(got)}")
    # The 3 s session goes 3 s after its disconnect.
    time.sleep(max(0.0, t_off + 3.6 - time.monotonic()))
    c = persistent(pc, b.port, 5, later, expiry=3)
    if session_present(c):
        problems.append("session expiry restarted from zero at the restart (3s session alive 3.6s "
                        "after its disconnect)")
    assert not problems, "; ".join(problems)


# --- configuration: [storage] and [log] -----------------------------------------------------


def _persistent_scenario(b, pc, version=5):
    """A persistent subscriber with a backlog and a retained message; returns a check()."""
    cid = uid("scn")
    s = persistent(pc, b.port, version, cid, expiry=300)
    sub(s, "scn/#", 2)
    go_offline(b, s, cid)
    p = pc(b.port, version=version)
    sent = []
    for i in range(10):
        publish(p, f"scn/{i}", b"%d" % i, 1 + i % 2)
        sent.append(b"%d" % i)
    publish(p, "scn/ret", b"kept", 1, retain=True)
    sent.append(b"kept")
    p.disconnect()

    def check(persisted=True):
        s2 = persistent(pc, b.port, version, cid, expiry=300)
        if not persisted:
            assert not session_present(s2)
            no_message(s2, 0.3)
        else:
            assert session_present(s2)
            got = get_messages(s2, len(sent))
            assert sorted(payloads(got)) == sorted(sent)
            assert [m.payload for m in got if m.qos == 1 and m.payload != b"kept"] == sent[0:10:2]
            assert [m.payload for m in got if m.qos == 2] == sent[1:10:2]
        r = pc(b.port, version=version)
        sub(r, "scn/ret", 1)
        if persisted:
            [m] = get_messages(r, 1)
            assert m.retain and m.payload == b"kept"
        else:
            no_message(r, 0.3)
    return check


def test_memory_mode_keeps_nothing(durable, pc):
    b = durable('[storage]\nmode = "memory"\n')
    check = _persistent_scenario(b, pc)
    b.restart("stop")
    check(persisted=False)
    assert not (b.data / "state.db").exists() and not (b.data / "log").exists()


@HOW
def test_log_disabled_still_persists_sessions_and_retained(durable, pc, how):
    b = durable('[log]\nenabled = false\n')
    cid = uid("nolog")
    s = persistent(pc, b.port, 5, cid, expiry=300)
    sub(s, "nolog/#", 1, sub_id=5)
    p = pc(b.port, version=5)
    publish(p, "nolog/ret", b"kept", 1, retain=True)
    assert payloads(get_messages(s, 1)) == [b"kept"]
    go_offline(b, s, cid)
    p.disconnect()
    barrier(b)
    b.restart(how)
    s2 = persistent(pc, b.port, 5, cid, expiry=300)
    assert session_present(s2)
    p2 = pc(b.port, version=5)
    publish(p2, "nolog/live", b"live", 1)
    [m] = get_messages(s2, 1)
    assert m.payload == b"live" and m.properties.SubscriptionIdentifier == [5]
    r = pc(b.port, version=5)
    sub(r, "nolog/#", 1)
    [m] = get_messages(r, 1)
    assert m.retain and m.payload == b"kept"
    # With the log disabled nothing is recorded for readers; what the log holds is only the
    # private records that kept messages owed to this persistent session.
    from wrenmq.store.reader import LogReader
    reader = LogReader(b.log_dir)
    assert list(reader.records()) == [], "topic records written with the log disabled"
    assert all(r.private for r in reader.records(private=True))


@pytest.mark.parametrize("config", ['[log]\nenabled = false\n', '[log]\ntopics = ["sensors/#"]\n'],
                         ids=["log-disabled", "topic-not-logged"])
def test_offline_messages_on_unlogged_topics_survive_restart(durable, pc, config):
    """The publisher got PUBACK for a message queued to an offline persistent session;
    a clean restart must not lose it, whether or not the topic is recorded in the log."""
    b = durable(config)
    cid = uid("unl")
    s = persistent(pc, b.port, 4, cid)
    sub(s, "other/#", 1)
    go_offline(b, s, cid)
    p = pc(b.port, version=4)
    publish(p, "other/a", b"queued", 1)
    p.disconnect()
    b.restart("stop")
    s2 = persistent(pc, b.port, 4, cid)
    assert session_present(s2)
    assert payloads(get_messages(s2, 1, timeout=1)) == [b"queued"], \
        "an acknowledged QoS 1 message for an offline persistent session was lost by a clean restart"


def test_log_topics_filter(durable, pc):
    """Only matching topics are recorded; $SYS never, even when a filter names it."""
    b = durable('[log]\ntopics = ["sensors/#", "$SYS/#"]\n[sys]\ninterval = 0.1\n')
    cid = uid("sens")
    s = persistent(pc, b.port, 5, cid, expiry=300)
    sub(s, "sensors/#", 1)
    go_offline(b, s, cid)
    p = pc(b.port, version=5)
    publish(p, "sensors/a", b"1", 1)
    publish(p, "other/b", b"2", 1)
    publish(p, "sensors/x/y", b"3", 0)
    publish(p, "sensors/b", b"4", 2, retain=True)
    publish(p, "sensorsX", b"5", 1)
    w = pc(b.port, version=4)
    sub(w, "$SYS/broker/uptime", 0)
    assert len(get_messages(w, 3, timeout=3)) == 3  # $SYS was published several times
    topics = [r.topic for r in b.records()]
    assert topics == ["sensors/a", "sensors/x/y", "sensors/b"], topics
    b.restart("stop")
    s2 = persistent(pc, b.port, 5, cid, expiry=300)
    assert session_present(s2)
    assert sorted(payloads(get_messages(s2, 2))) == [b"1", b"4"]
    assert [r.topic for r in b.records()] == ["sensors/a", "sensors/x/y", "sensors/b"]


def test_records_carry_the_time_their_message_arrived(durable, pc):
    """A record's timestamp is when its message reached the broker (read once per read),
    on both paths: no subscriber (the record comes straight from the packet) and a
    subscriber (through a Message). The pauses make a stale clock reading show."""
    b = durable()
    p = pc(b.port, version=4)
    s = pc(b.port, version=4)
    sub(s, "ts/seen", 0)
    topics = ["ts/alone", "ts/seen", "ts/alone", "ts/seen"]
    windows = []
    for topic in topics:
        time.sleep(0.3)
        before = time.time()
        publish(p, topic, b"x", 1)
        windows.append((before, time.time()))
    recs = [r for r in b.records() if r.topic.startswith("ts/")]
    assert [r.topic for r in recs] == topics
    for r, (before, after) in zip(recs, windows):
        assert before - 0.001 <= r.timestamp / 1e6 <= after + 0.001, (r, before, after)


@pytest.mark.parametrize("fsync", ["interval", "never"])
def test_fsync_modes_keep_everything_over_clean_restart(durable, pc, fsync):
    b = durable(f'[storage]\nfsync = "{fsync}"\nfsync_interval_ms = 50\n')
    check = _persistent_scenario(b, pc)
    b.restart("stop")
    check()
    # and the broker keeps working after the restart
    s = pc(b.port, version=4)
    sub(s, "fs/#", 1)
    p = pc(b.port, version=5)
    publish(p, "fs/x", b"x", 2)
    assert payloads(get_messages(s, 1)) == [b"x"]


def test_interval_fsyncs_are_counted_and_kill_loses_nothing(durable, pc):
    """fsync = "interval": the periodic fdatasync (on a thread of its own, beside the
    writer) happens and is counted in $SYS/broker/log/syncs; what was acknowledged is in
    the log after a kill -9."""
    b = durable('[storage]\nfsync = "interval"\nfsync_interval_ms = 20\n[sys]\ninterval = 0.2\n')
    p = pc(b.port, version=4)
    for i in range(40):
        publish(p, "sy/x", b"%04d" % i, 1)
        time.sleep(0.01)
    assert sys_value(pc, b.port, "$SYS/broker/log/syncs", lambda v: v >= 3) >= 3
    b.restart("kill")
    assert [r.payload for r in b.records() if r.topic == "sy/x"] == [b"%04d" % i for i in range(40)]


def test_interval_rolled_segments_are_synced_by_the_syncer_and_kill_loses_nothing(durable, pc):
    """fsync = "interval": a segment the log rolls away from is fsynced by the syncer
    thread (the writer goes on with the next one), every one of them, counted in
    $SYS/broker/log/sealed_syncs; after its syncs the log says it is durable to its end
    (the file the Spark source reads up to); what was acknowledged, across all the
    segments, is in the log after a kill -9."""
    b = durable('[storage]\nfsync = "interval"\nfsync_interval_ms = 20\n'
                '[log]\nsegment_bytes = 4096\n[sys]\ninterval = 0.2\n')
    p = pc(b.port, version=4)
    for i in range(60):
        publish(p, "sr/x", b"%04d" % i + b"." * 700, 1)
    segments = sys_value(pc, b.port, "$SYS/broker/log/segments", lambda v: v >= 5)
    assert sys_value(pc, b.port, "$SYS/broker/log/sealed_syncs", lambda v: v >= segments - 1) \
        == segments - 1
    reader = LogReader(b.log_dir)

    def durable_to_end():
        reader.refresh()
        return reader.end_offset >= 60 and reader.durable_end_offset == reader.end_offset

    assert wait_for(durable_to_end, 5), (reader.durable_mark, reader.end_offset)
    reader.close()
    b.restart("kill")
    assert [r.payload[:4] for r in b.records() if r.topic == "sr/x"] == [b"%04d" % i for i in range(60)]


# --- the offline queue beyond max_queued_messages ----------------------------------------------


def _owed_while_offline(b, pc, prefix, bodies):
    """A persistent session subscribed to `prefix/#` goes offline and `bodies` are
    published at QoS 1; returns its client id."""
    cid = uid(prefix)
    s = persistent(pc, b.port, 4, cid)
    sub(s, f"{prefix}/#", 1)
    go_offline(b, s, cid)
    p = pc(b.port, version=4)
    publish_many(p, [(f"{prefix}/{i % 3}", body, 1) for i, body in enumerate(bodies)])
    p.disconnect()
    return cid


def _owed_past_the_queue(b, pc, prefix, bodies, how):
    """`_owed_while_offline` with more than the session's queue holds; the broker restarts
    `how` (None: not at all) and the session comes back. Returns (its client, the
    messages it got)."""
    cid = _owed_while_offline(b, pc, prefix, bodies)
    if how:
        b.restart(how)
    s2 = persistent(pc, b.port, 4, cid)
    assert session_present(s2)
    return s2, get_messages(s2, len(bodies), timeout=10)


@pytest.mark.parametrize("how", [None, "stop", "kill"])
def test_direct_io_log_is_read_back_and_survives_restarts(durable, pc, how):
    """[log] direct_io = true: messages of a few KiB (so appends cross 4 KiB blocks and
    take the O_DIRECT path) owed to an offline session beyond its in-memory queue are read
    back from the log files, also after a stop or kill -9."""
    b = durable('[log]\ndirect_io = true\n[limits]\nmax_queued_messages = 10\n')
    body = [(b"%05d" % i) * (300 + 97 * (i % 13)) for i in range(150)]
    _, got = _owed_past_the_queue(b, pc, "dio", body, how)
    assert payloads(got) == body


@pytest.mark.parametrize("how", [None, "stop", "kill"])
def test_queue_overflow_is_read_back_from_the_log(durable, pc, how):
    b = durable('[limits]\nmax_queued_messages = 10\n[sys]\ninterval = 0.2\n')
    s2, got = _owed_past_the_queue(b, pc, "ovf", [b"%d" % i for i in range(200)], how)
    assert payloads(got) == [b"%d" % i for i in range(200)], \
        f"got {len(got)} of 200 (first missing: {next((i for i, m in enumerate(got) if m.payload != b'%d' % i), len(got))})"
    no_message(s2, 0.3)
    assert sys_value(pc, b.port, "$SYS/broker/publish/messages/dropped", lambda v: True) == 0


def test_an_offline_session_keeps_max_queued_offline_in_memory_and_the_rest_in_the_log(durable, pc):
    # Devices that come and go each held up to max_queued_messages (10,000) in memory
    # (make soak). With the log on, an offline session holds max_queued_offline; the
    # rest waits in the log and reaches the client, in order, when it is back.
    b = durable('[limits]\nmax_queued_offline = 10\n[sys]\ninterval = 0.2\n')
    cid = _owed_while_offline(b, pc, "off", [b"%d" % i for i in range(200)])
    held = sys_value(pc, b.port, "$SYS/broker/store/messages/count", lambda v: v > 0)
    assert held == 10
    s2 = persistent(pc, b.port, 4, cid)
    assert session_present(s2)
    assert payloads(get_messages(s2, 200, timeout=10)) == [b"%d" % i for i in range(200)]
    no_message(s2, 0.3)
    assert sys_value(pc, b.port, "$SYS/broker/publish/messages/dropped", lambda v: True) == 0


@pytest.mark.parametrize("how", [None, "kill"])
def test_a_session_that_leaves_while_behind_keeps_max_queued_offline_in_memory(durable, pc, how):
    # A client that stops acknowledging and then leaves kept its whole queue in memory
    # (up to max_queued_messages). Now it keeps max_queued_offline, as a session offline
    # all along does; the rest is read back from the log, in order, when it is back.
    b = durable('[limits]\nmax_queued_offline = 10\n[sys]\ninterval = 0.2\n')
    cid = uid("behind")
    s = RawClient(b.port, 5)
    s.send(Connect(cid, 5, True, 60, properties={"session_expiry_interval": 300, "receive_maximum": 2}))
    assert s.recv().reason_code == 0
    s.send(Subscribe(1, [SubscribeTopic("behind/#", 1)]))
    assert s.recv().TYPE == C.SUBACK
    bodies = [b"%d" % i for i in range(200)]
    p = pc(b.port, version=4)
    publish_many(p, [(f"behind/{i % 3}", body, 1) for i, body in enumerate(bodies)])
    p.disconnect()
    # Its window's two went out, unacknowledged; 198 wait in its queue while it is online.
    assert sys_value(pc, b.port, "$SYS/broker/store/messages/count", lambda v: v == 200) == 200
    s.sock.close()
    assert sys_value(pc, b.port, "$SYS/broker/store/messages/count", lambda v: v < 200) == 2 + 10
    if how:
        b.restart(how)
    s2 = persistent(pc, b.port, 5, cid, expiry=300)
    assert session_present(s2)
    assert payloads(get_messages(s2, 200, timeout=10)) == bodies
    no_message(s2, 0.3)
    assert sys_value(pc, b.port, "$SYS/broker/publish/messages/dropped", lambda v: True) == 0


def test_max_queued_offline_does_not_apply_without_the_log(durable, pc):
    # Nothing to read back from in memory mode: the queue keeps max_queued_messages.
    b = durable('[storage]\nmode = "memory"\n[limits]\nmax_queued_offline = 10\n')
    _, got = _owed_past_the_queue(b, pc, "offm", [b"%d" % i for i in range(200)], None)
    assert payloads(got) == [b"%d" % i for i in range(200)]


def test_queue_overflow_drops_in_memory_mode(durable, pc):
    b = durable('[storage]\nmode = "memory"\n[limits]\nmax_queued_messages = 10\n[sys]\ninterval = 0.2\n')
    cid = _owed_while_offline(b, pc, "ovm", [b"%d" % i for i in range(200)])
    s2 = persistent(pc, b.port, 4, cid)
    assert session_present(s2)
    got = get_messages(s2, 200, timeout=1)
    assert payloads(got) == [b"%d" % i for i in range(10)]
    dropped = sys_value(pc, b.port, "$SYS/broker/publish/messages/dropped", lambda v: v >= 190)
    assert dropped == 190


# --- retention ---------------------------------------------------------------------------------


RETENTION = ('[log]\nsegment_bytes = 4096\nretention_bytes = 8192\n{hard}'
             '[storage]\ncheckpoint_interval_ms = 50\n[sys]\ninterval = 0.2\n')


def _checkpoints(b, n=2, timeout=5.0):
    """Wait for n checkpoints of the running broker (it saves `last_alive` each time).
    Retention runs in the first checkpoint after a start, then every 30 s."""
    seen = set()

    def read():
        try:
            with sqlite3.connect(f"file:{b.data / 'state.db'}?mode=ro", uri=True, timeout=1) as db:
                row = db.execute("SELECT value FROM meta WHERE key='last_alive'").fetchone()
        except sqlite3.Error:
            return False
        if row and float(row[0]) > started:
            seen.add(row[0])
        return len(seen) >= n

    started = time.time()
    assert wait_for(read, timeout), "no checkpoint"


def _backlog(b, pc, prefix, n=60, size=1000):
    """A persistent session offline while n messages (one batch each) fill ~n/4 segments."""
    _checkpoints(b)  # this run's retention check is done; the next one is 30 s away
    cid = uid(prefix)
    s = persistent(pc, b.port, 4, cid)
    sub(s, f"{prefix}/#", 1)
    go_offline(b, s, cid)
    p = pc(b.port, version=4)
    for i in range(n):
        publish(p, f"{prefix}/t", b"%04d" % i + b"x" * (size - 4), 1)
    p.disconnect()
    return cid


def test_retention_keeps_segments_a_session_needs(durable, pc):
    """Over retention_bytes, but every segment holds messages an offline persistent session
    has not had: all are kept (and delivered); once it has them, retention deletes them."""
    b = durable(RETENTION.format(hard=""))
    cid = _backlog(b, pc, "rk")
    before = b.segments()
    assert len(before) >= 10
    b.restart("stop")  # retention runs in the first checkpoint after a start
    _checkpoints(b)
    assert b.segments() == before, "retention deleted segments a persistent session still needs"
    s = persistent(pc, b.port, 4, cid)
    got = get_messages(s, 60)
    assert [m.payload[:4] for m in got] == [b"%04d" % i for i in range(60)]
    go_offline(b, s, cid)
    barrier(b)
    # Nobody needs them now: the next retention run deletes down to retention_bytes.
    b.restart("stop")
    assert wait_for(lambda: len(b.segments()) <= 3, 5), f"{len(b.segments())} segments left"
    assert sum(f.stat().st_size for f in b.segments()[:-1]) <= 8192 + 4096
    assert sys_value(pc, b.port, "$SYS/broker/log/retention/lost", lambda v: True) == 0


@HOW
def test_retention_hard_limit_deletes_and_counts_the_loss(durable, pc, how):
    """Over retention_hard_bytes, needed segments go too; $SYS counts the records lost and
    the session resumes at the oldest record left, in order."""
    b = durable(RETENTION.format(hard="retention_hard_bytes = 16384\n"))
    cid = _backlog(b, pc, "rh")
    last = len(b.segments())
    b.restart(how)
    lost = sys_value(pc, b.port, "$SYS/broker/log/retention/lost", lambda v: v > 0)
    assert lost > 0
    assert len(b.segments()) < last
    assert sum(f.stat().st_size for f in b.segments()) <= 16384 + 4096
    assert "deleted although persistent sessions still needed" in b.log
    s = persistent(pc, b.port, 4, cid)
    got = []
    while not got or got[-1] != 59:
        m = get_messages(s, 1)
        assert m, f"the tail of the backlog did not arrive: {got}"
        got.append(int(m[0].payload[:4]))
    no_message(s, 0.2)
    assert got == list(range(got[0], 60)), f"received {got}"
    assert got[0] > 0 and len(got) == 60 - lost, f"$SYS says {lost} lost, {60 - len(got)} missing"


# --- recovery of a damaged log tail ------------------------------------------------------------


@HOW
@pytest.mark.parametrize("damage", ["garbage", "torn", "stale-batch"])
def test_damaged_log_tail_does_not_stop_the_broker(durable, pc, how, damage):
    """garbage: random bytes after the last batch; torn: the first half of a batch (a write
    cut short); stale-batch: an intact copy of an old batch (offsets going backwards).
    The broker starts, truncates and reports the tail, and loses nothing acknowledged."""
    b = durable()
    cid = uid("ct")
    s = persistent(pc, b.port, 5, cid, expiry=300)
    sub(s, "ct/t", 1)
    go_offline(b, s, cid)
    p = pc(b.port, version=5)
    ends = []
    for i in range(5):
        publish(p, "ct/t", b"%d" % i, 1)  # acknowledged, so on disk: one batch each
        ends.append(b.segments()[-1].stat().st_size)
    p.disconnect()
    b.shutdown(how)
    seg = b.segments()[-1]
    data = seg.read_bytes()
    assert len(data) == ends[-1]
    with open(seg, "ab") as fh:
        if damage == "garbage":
            fh.write(b"\xde\xad\xbe\xef" * 40)
        elif damage == "torn":
            last = data[ends[-2]:]
            fh.write(last[:len(last) // 2])
        else:
            fh.write(data[:ends[0]])
    mark = b.mark()
    b.start()  # (recovery happens before the listener opens)
    s2 = persistent(pc, b.port, 5, cid, expiry=300)
    assert session_present(s2)
    assert payloads(get_messages(s2, 5, timeout=2)) == [b"%d" % i for i in range(5)], \
        "acknowledged messages lost after recovering the damaged tail:\n" + b.log[mark:]
    assert "truncating" in b.log[mark:], "damaged tail not reported:\n" + b.log[mark:]
    p2 = pc(b.port, version=5)
    for i in range(5, 8):
        publish(p2, "ct/t", b"%d" % i, 1)
    assert payloads(get_messages(s2, 3)) == [b"5", b"6", b"7"]
    no_message(s2, 0.2)
    b.shutdown("stop")
    reader = LogReader(b.log_dir)
    try:
        assert reader.verify() == []
        recs = [(r.offset, r.payload) for r in reader.records(topic_filters=["ct/#"])]
        assert [r[1] for r in recs] == [b"%d" % i for i in range(8)], recs
        offsets = [r[0] for r in recs]
        assert offsets == sorted(set(offsets)), f"offsets not increasing: {offsets}"
    finally:
        reader.close()
