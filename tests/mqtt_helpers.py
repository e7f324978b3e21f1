"""Helpers shared by the feature tests (real paho clients and raw sockets)."""

import queue
import socket
import time
import uuid

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from wrenmq.mqtt import constants as C
from wrenmq.mqtt.packets import Connect, Subscribe, SubscribeTopic


def uid(prefix="c"):
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def wait_for(pred, timeout=5.0, interval=0.02):
    """Poll `pred` until it returns something truthy (returned) or the timeout passes."""
    deadline = time.monotonic() + timeout
    while True:
        r = pred()
        if r or time.monotonic() >= deadline:
            return r
        time.sleep(interval)


def scrape(port, path="/metrics", context=None):
    """GET over real HTTP(S) (a metrics listener); (status, content type, text)."""
    import urllib.error
    import urllib.request

    scheme = "https" if context is not None else "http"
    try:
        with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}{path}", timeout=10, context=context) as r:
            return r.status, r.headers["Content-Type"], r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read().decode()


def pprops(kind="PUBLISH", **kw):
    """paho Properties for a packet type: pprops("PUBLISH", ContentType="x")."""
    p = Properties(getattr(PacketTypes, kind))
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def rc_int(rc):
    return rc.value if isinstance(rc, ReasonCode) else int(rc)


def _next_ack(client, kind, timeout):
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no {kind}")
        try:
            entry = client.acks.get(timeout=remaining)
        except queue.Empty:
            raise TimeoutError(f"no {kind}") from None
        if entry[0] == kind:
            return entry


def sub(client, topic, qos=0, *, no_local=False, rap=False, rh=0, sub_id=None, timeout=5.0):
    """Subscribe with 5.0 options where the client speaks 5.0; return SUBACK codes as ints."""
    if client._protocol == mqtt.MQTTv5:
        opts = SubscribeOptions(qos=qos, noLocal=no_local, retainAsPublished=rap, retainHandling=rh)
        props = pprops("SUBSCRIBE", SubscriptionIdentifier=sub_id) if sub_id else None
        client.subscribe(topic, options=opts, properties=props)
    else:
        client.subscribe(topic, qos)
    _, _, rcs, _ = _next_ack(client, "suback", timeout)
    return [rc_int(r) for r in rcs]


def unsub(client, topic, timeout=5.0):
    client.unsubscribe(topic)
    _, _, rcs, _ = _next_ack(client, "unsuback", timeout)
    return [rc_int(r) for r in (rcs or [])]


def publish(client, topic, payload, qos=0, retain=False, properties=None, timeout=5.0):
    """Publish and, for QoS > 0, wait for the acknowledgement."""
    info = client.publish(topic, payload, qos, retain, properties)
    if qos:
        info.wait_for_publish(timeout)
        assert info.is_published(), f"no ack for {topic}"
    return info


def drain(client, wait=0.0):
    """Everything in the client's queue now (after waiting `wait` seconds)."""
    if wait:
        time.sleep(wait)
    out = []
    while True:
        try:
            out.append(client.messages.get_nowait())
        except queue.Empty:
            return out


def kill(client):
    """Drop the client's TCP connection without DISCONNECT (and keep paho from reconnecting)."""
    client._reconnect_on_failure = False
    sock = client.socket()
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    client.disconnected_event.wait(5)


def no_reconnect(client):
    client._reconnect_on_failure = False
    return client


def persistent(clients, port, version, client_id, expiry=60, clean=False, properties=None, **kw):
    """A client with a session that outlives the connection (3.1.1 clean_session=0, 5.0 expiry)."""
    if version == 5:
        props = dict(properties or {})
        if expiry:
            props["SessionExpiryInterval"] = expiry
        return clients(port, version=5, client_id=client_id, clean=clean, properties=props or None, **kw)
    return clients(port, version=version, client_id=client_id, clean=clean, **kw)


def session_present(client):
    return bool(client.connack[1].session_present)


def connack_rc(client):
    return rc_int(client.connack[0])


def router(running):
    return running.broker.router


def wait_offline(running, client_id, timeout=5.0):
    """Wait until the broker has seen the client's connection end (session kept or not)."""
    def offline():
        s = running.call(lambda: router(running).sessions.get(client_id))
        return s is None or s.conn is None
    assert wait_for(offline, timeout), f"broker still has {client_id} online"


def clean_disconnect(running, client, client_id):
    client.disconnect()
    client.disconnected_event.wait(5)
    client.loop_stop()
    wait_offline(running, client_id)


def raw_connect(raw_client, port, version=C.MQTT311, client_id=None, **kw):
    """A RawClient that sent CONNECT; returns (client, CONNACK packet)."""
    c = raw_client(port, version)
    c.send(Connect(client_id if client_id is not None else uid("raw"), version=version, **kw))
    return c, c.recv()


def raw_subscribe(c, flt, qos=0, packet_id=1, properties=None, **opts):
    c.send(Subscribe(packet_id, [SubscribeTopic(flt, qos, **opts)], properties))
    ack = c.recv()
    assert ack.TYPE == C.SUBACK, ack
    return ack.reason_codes


def raw_next(c, ptype, timeout=5.0):
    """Next packet of a type from a RawClient, skipping others (None when the socket closed)."""
    deadline = time.monotonic() + timeout
    while True:
        pkt = c.recv(max(0.01, deadline - time.monotonic()))
        if pkt is None or pkt.TYPE == ptype:
            return pkt
