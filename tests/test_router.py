"""The router without sockets: fake connections, a fake clock, packets in, bytes out.

A `Router` is plain objects (broker/router.py): connections hand it decoded packets and it
answers by handing bytes to the connections involved. Here each client is a
`FakeConnection` that records what the router sends it and how it was closed, and time
is a `FakeClock` the test moves; the timers (session expiry, delayed wills, the retained
messages a SUBSCRIBE matched) run when the test calls `Router.tick`, as the broker
does when the earliest deadline comes. The whole file runs in well under a second; the
same behaviours over real sockets are in test_sessions.py, test_mqtt_features.py,
test_protocol_errors.py, test_limits.py and test_retained.py.
"""

import pytest

from wrenmq.broker import states
from wrenmq.broker.hooks import HookChain
from wrenmq.broker.router import Router
from wrenmq.broker.session import Session
from wrenmq.broker.timers import TimerKind, Timers
from wrenmq.config import load
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import Decoder, MQTTError, encode
from wrenmq.mqtt.packets import (
    Connack, Connect, Disconnect, Puback, Pubcomp, Publish, Pubrec, Pubrel, Suback, Subscribe,
    SubscribeTopic, Unsuback, Unsubscribe, Will,
)

V311 = C.MQTT311
V5 = C.MQTT5
NOT_CLOSED = "open"


class FakeClock:
    """Monotonic time that moves only when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


class FakeConnection:
    """What the router sees of a connection (broker/connection.py): it records the bytes
    the router sends and how it was closed. A close ends the client's connection for
    the router, as a real one does once its socket is shut (`Router.connection_lost`)."""

    def __init__(self, router, version, name):
        self.router = router
        self.version = version
        self.address = f"test:{name}"
        self.listener_name = "test"
        self.keepalive = 0
        self.congested = False
        self.closing = False
        self.clean_disconnect = False
        self.session = None
        self.out = bytearray()
        self.closed_with = NOT_CLOSED  # the reason it was closed with (None: no reason)
        self.refused = None  # the reason of a refused CONNECT

    def send(self, data):
        if not self.closing:
            self.out += data

    def close(self, reason=None):
        if self.closing:
            return
        self.closing = True
        self.closed_with = reason
        session, self.session = self.session, None
        if session is not None:
            self.router.connection_lost(session, True, "closed")

    def refuse(self, version, reason):
        self.refused = reason
        self.close()


class Client:
    """A client of the router: its packets are encoded and decoded as the broker's
    connection would decode them, and handed to `Router.handlers` as
    Connection._dispatch does (a protocol error closes the connection with its reason)."""

    def __init__(self, router, cid, version=V311, clean=True, keepalive=60, will=None, properties=None):
        self.router = router
        self.version = version
        self.conn = FakeConnection(router, version, cid)
        self.session = router.connect(self.conn, Connect(cid, version, clean, keepalive, will,
                                                         properties=properties), None)
        self.conn.session = self.session
        self.decoder = Decoder(version)  # reads what the router sent

    def send(self, *packets):
        data = b"".join(encode(p, self.version) for p in packets)
        router = self.router
        router.arrived()
        for pkt in Decoder(self.version).feed(data):
            try:
                router.handlers[pkt.TYPE](self.session, pkt)
            except MQTTError as e:
                self.conn.close(e.reason)
            if self.conn.closing:
                break

    def received(self):
        """The packets the router sent this client since the last call."""
        data = bytes(self.conn.out)
        self.conn.out.clear()
        return self.decoder.feed(data)

    def publishes(self):
        return [p for p in self.received() if isinstance(p, Publish)]

    def lose_connection(self):
        """The socket went away without a DISCONNECT."""
        self.conn.close()


def make_router(config=""):
    clock = FakeClock()
    return Router(load(text=config), HookChain(), clock=clock), clock


@pytest.fixture
def router():
    return make_router()[0]


# --- connect -----------------------------------------------------------------------------

@pytest.mark.parametrize("version", [V311, V5])
def test_a_new_client_gets_a_connack_and_a_session(router, version):
    c = Client(router, "new", version)
    (ack,) = c.received()
    assert isinstance(ack, Connack) and ack.reason_code == 0 and not ack.session_present
    if version == V5:  # the broker's limits, told to every 5.0 client
        assert ack.properties["receive_maximum"] == router.limits.receive_maximum
    assert router.sessions["new"] is c.session and c.session.conn is c.conn
    assert router.online == 1 and c.conn.closed_with == NOT_CLOSED


def test_a_persistent_session_resumes_with_session_present_and_what_it_missed(router):
    sub = Client(router, "sub", clean=False)
    sub.send(Subscribe(1, [SubscribeTopic("a/#", 1)]))
    sub.send(Disconnect())
    assert sub.conn.closed_with is None and router.online == 0
    pub = Client(router, "pub")
    pub.send(Publish("a/b", b"while away", qos=1, packet_id=7))
    assert pub.received()[1:] == [Puback(7)]
    back = Client(router, "sub", clean=False)
    ack, msg = back.received()
    assert ack.session_present
    assert (msg.topic, msg.payload, msg.qos) == ("a/b", b"while away", 1)
    assert back.session is sub.session  # the same session, subscriptions and all


@pytest.mark.parametrize("version,reason", [(V5, C.SESSION_TAKEN_OVER), (V311, C.SESSION_TAKEN_OVER)])
def test_a_second_connection_takes_the_session_over(router, version, reason):
    first = Client(router, "twice", version, clean=False)
    first.send(Subscribe(1, [SubscribeTopic("t", 0)]))
    second = Client(router, "twice", version, clean=False)
    assert first.conn.closed_with == reason and first.conn.session is None
    (ack,) = second.received()
    assert ack.session_present and router.online == 1
    assert router.sessions["twice"].conn is second.conn
    Client(router, "pub").send(Publish("t", b"x"))
    assert [p.payload for p in second.publishes()] == [b"x"] and first.publishes() == []


@pytest.mark.parametrize("config,connect,reason", [
    ("", dict(cid="", version=V311, clean=False), C.CLIENT_IDENTIFIER_NOT_VALID),
    ("[limits]\nmax_client_id_length = 8\n", dict(cid="x" * 9), C.CLIENT_IDENTIFIER_NOT_VALID),
    ("[limits]\nmax_keepalive = 60\n", dict(cid="k", keepalive=0), C.CLIENT_IDENTIFIER_NOT_VALID),
    ("", dict(cid="w", will=Will("w/#", b"")), C.TOPIC_NAME_INVALID),
    ("[broker]\nmaximum_qos = 1\n", dict(cid="w", will=Will("w", b"", qos=2)), C.QOS_NOT_SUPPORTED),
    ("[broker]\nretain_available = false\n", dict(cid="w", will=Will("w", b"", retain=True)),
     C.RETAIN_NOT_SUPPORTED),
], ids=["empty-id-without-clean-311", "id-too-long", "keepalive-0-311", "will-wildcard", "will-qos",
        "will-retain"])
def test_refused_connects_get_their_reason_and_no_session(config, connect, reason):
    router, _ = make_router(config)
    cid = connect.pop("cid")
    c = Client(router, cid, **connect)
    assert c.session is None and c.conn.refused == reason
    assert cid not in router.sessions and router.online == 0


def test_past_max_sessions_only_sessions_that_end_with_their_connection_start():
    router, _ = make_router("[limits]\nmax_sessions = 1\n")
    Client(router, "kept", clean=False).send(Disconnect())
    refused = Client(router, "another", clean=False)
    assert refused.conn.refused == C.QUOTA_EXCEEDED and "another" not in router.sessions
    assert Client(router, "passing").session is not None  # clean: gone with its connection
    assert router.stats.sessions_refused == 1


def test_a_packet_only_a_server_sends_is_a_protocol_error(router):
    c = Client(router, "c", V5)
    c.send(Suback(1, [0]))
    assert c.conn.closed_with == C.PROTOCOL_ERROR and "c" not in router.sessions


def test_the_connection_states_as_a_table():
    """What a client may send in each state, and how the state moves (broker/states.py)."""
    server_only = {C.CONNACK, C.SUBACK, C.UNSUBACK, C.PINGRESP}
    for ptype in range(1, 16):
        for state, allowed in ((states.NEW, ptype == C.CONNECT),
                               (states.AUTH, ptype in (C.AUTH, C.DISCONNECT)),
                               (states.OPEN, ptype not in server_only | {C.CONNECT}),
                               (states.CLOSED, False)):
            if allowed:
                states.check(state, ptype)
            else:
                with pytest.raises(MQTTError) as info:
                    states.check(state, ptype)
                assert info.value.reason == C.PROTOCOL_ERROR
    state = states.advance(states.NEW, states.CONNECT_RECEIVED)
    state = states.advance(state, states.ACCEPTED)
    assert state == states.OPEN
    assert states.advance(states.advance(state, states.CLOSE), states.CLOSE) == states.CLOSED
    for state, event in ((states.NEW, states.ACCEPTED), (states.OPEN, states.CONNECT_RECEIVED),
                         (states.CLOSED, states.ACCEPTED)):
        with pytest.raises(RuntimeError):
            states.advance(state, event)
    with pytest.raises(ValueError):  # an open connection's table needs a handler for each
        states.dispatch_table({C.PUBLISH: print})


# --- subscribe, unsubscribe -----------------------------------------------------------

def test_subscribe_grants_at_most_the_maximum_qos_and_unsubscribe_stops_delivery():
    router, _ = make_router("[broker]\nmaximum_qos = 1\n")
    sub = Client(router, "sub", V5)
    sub.send(Subscribe(1, [SubscribeTopic("a", 0), SubscribeTopic("b", 1), SubscribeTopic("c", 2),
                           SubscribeTopic("bad/#/x", 0)]))
    assert sub.received()[1:] == [Suback(1, [0, 1, 1, C.TOPIC_FILTER_INVALID])]
    pub = Client(router, "pub")
    pub.send(Publish("c", b"1", qos=1, packet_id=1))
    (msg,) = sub.publishes()
    assert msg.qos == 1
    sub.send(Unsubscribe(2, ["c", "never"]))
    assert sub.received() == [Unsuback(2, [0, C.NO_SUBSCRIPTION_EXISTED])]
    pub.send(Publish("c", b"2"))
    assert sub.publishes() == []
    assert router.subscription_count() == 2


def test_a_shared_group_gives_each_message_to_one_member_in_turn(router):
    a, b, plain = Client(router, "a"), Client(router, "b"), Client(router, "plain")
    for c in (a, b):
        c.send(Subscribe(1, [SubscribeTopic("$share/g/jobs/#", 1)]))
    plain.send(Subscribe(1, [SubscribeTopic("jobs/#", 0)]))
    pub = Client(router, "pub")
    for i in range(4):
        pub.send(Publish(f"jobs/{i}", str(i).encode(), qos=1, packet_id=i + 1))
    got_a = [p.payload for p in a.publishes()]
    got_b = [p.payload for p in b.publishes()]
    assert sorted(got_a + got_b) == [b"0", b"1", b"2", b"3"] and len(got_a) == len(got_b) == 2
    assert len(plain.publishes()) == 4
    # A member that leaves with messages unacknowledged: they go to the other member.
    a.lose_connection()
    assert sorted(p.payload for p in b.publishes()) == sorted(got_a)


def test_retained_messages_go_to_a_new_subscription_on_the_next_turn(router):
    pub = Client(router, "pub")
    pub.send(Publish("r/1", b"one", retain=True), Publish("r/2", b"two", qos=1, retain=True, packet_id=1))
    sub = Client(router, "sub", V5)
    sub.received()
    sub.send(Subscribe(1, [SubscribeTopic("r/#", 1)]))
    assert sub.received() == [Suback(1, [1])]  # the SUBACK first; the messages on the timer
    router.tick()
    got = {p.topic: (p.payload, p.qos, p.retain) for p in sub.publishes()}
    assert got == {"r/1": (b"one", 0, True), "r/2": (b"two", 1, True)}
    sub.send(Subscribe(2, [SubscribeTopic("r/#", 1, retain_handling=2)]))
    router.tick()
    assert sub.publishes() == []  # retain handling 2: none on subscribe


# --- publish, QoS 0/1/2 -----------------------------------------------------------------

def test_qos0_goes_out_as_the_bytes_that_came_in(router):
    sub = Client(router, "sub")
    sub.send(Subscribe(1, [SubscribeTopic("t/#", 0)]))
    sub.received()
    pub = Client(router, "pub")
    packet = Publish("t/x", b"payload")
    pub.send(packet)
    assert bytes(sub.conn.out) == encode(packet, V311)


@pytest.mark.parametrize("version", [V311, V5])
def test_qos1_acknowledged_both_ways(router, version):
    sub = Client(router, "sub", version)
    sub.send(Subscribe(1, [SubscribeTopic("t", 1)]))
    pub = Client(router, "pub", version)
    pub.send(Publish("t", b"m", qos=1, packet_id=10))
    assert pub.received()[1:] == [Puback(10)]
    (msg,) = sub.publishes()
    assert msg.qos == 1 and msg.packet_id in sub.session.inflight
    sub.send(Puback(msg.packet_id))
    assert not sub.session.inflight and sub.received() == []


@pytest.mark.parametrize("version", [V311, V5])
def test_qos2_exchanges_both_ways_deliver_once(router, version):
    sub = Client(router, "sub", version)
    sub.send(Subscribe(1, [SubscribeTopic("t", 2)]))
    sub.received()
    pub = Client(router, "pub", version)
    pub.received()
    pub.send(Publish("t", b"once", qos=2, packet_id=5))
    assert pub.received() == [Pubrec(5)]
    pub.send(Publish("t", b"once", qos=2, dup=True, packet_id=5))  # resent before PUBREL
    assert pub.received() == [Pubrec(5)]
    pub.send(Pubrel(5))
    assert pub.received() == [Pubcomp(5)] and not pub.session.incoming_qos2
    (msg,) = sub.publishes()  # one copy
    sub.send(Pubrec(msg.packet_id))
    assert sub.received() == [Pubrel(msg.packet_id)]
    sub.send(Pubcomp(msg.packet_id))
    assert not sub.session.inflight


def test_a_v5_publish_nobody_receives_is_told_so(router):
    pub = Client(router, "pub", V5)
    pub.received()
    pub.send(Publish("nobody/here", b"x", qos=1, packet_id=3))
    assert pub.received() == [Puback(3, C.NO_MATCHING_SUBSCRIBERS)]


def test_an_unknown_pubrel_is_answered_packet_identifier_not_found(router):
    c = Client(router, "c", V5)
    c.received()
    c.send(Pubrel(42))
    assert c.received() == [Pubcomp(42, C.PACKET_IDENTIFIER_NOT_FOUND)]


# --- flow control -------------------------------------------------------------------------

def test_the_clients_receive_maximum_bounds_what_is_in_flight(router):
    sub = Client(router, "sub", V5, properties={"receive_maximum": 2})
    sub.send(Subscribe(1, [SubscribeTopic("t", 1)]))
    sub.received()
    pub = Client(router, "pub")
    for i in range(5):
        pub.send(Publish("t", bytes([i]), qos=1, packet_id=i + 1))
    first = sub.publishes()
    assert [p.payload for p in first] == [b"\x00", b"\x01"] and len(sub.session.queue) == 3
    sub.send(Puback(first[0].packet_id))
    assert [p.payload for p in sub.publishes()] == [b"\x02"]


def test_a_congested_client_loses_qos0_and_gets_qos1_when_it_drains(router):
    sub = Client(router, "sub")
    sub.send(Subscribe(1, [SubscribeTopic("t", 1)]))
    sub.received()
    sub.conn.congested = True
    pub = Client(router, "pub")
    pub.send(Publish("t", b"q0"), Publish("t", b"q1", qos=1, packet_id=1))
    assert sub.publishes() == [] and router.stats.pub_dropped == 1 and len(sub.session.queue) == 1
    sub.conn.congested = False
    router.drain(sub.session)  # what a connection does when its socket takes more
    assert [p.payload for p in sub.publishes()] == [b"q1"]


def test_more_qos2_messages_unreleased_than_the_receive_maximum_close_the_connection():
    router, _ = make_router("[limits]\nreceive_maximum = 2\n")
    pub = Client(router, "pub", V5)
    pub.send(*(Publish("t", b"x", qos=2, packet_id=i) for i in (1, 2, 3)))
    assert pub.conn.closed_with == C.RECEIVE_MAXIMUM_EXCEEDED


# --- timers: session expiry, delayed wills ----------------------------------------------

def test_timers_come_due_in_order_and_not_for_a_session_that_moved_on():
    timers = Timers()
    told = []
    timers.on_change = told.append  # the broker's: the earliest deadline moved earlier
    a, b = Session("a"), Session("b")
    timers.schedule(20.0, TimerKind.EXPIRE_SESSION, a)
    timers.schedule(10.0, TimerKind.PUBLISH_WILL, b)
    timers.schedule(30.0, TimerKind.CATCH_UP, a)
    assert told == [20.0, 10.0] and timers.next_deadline() == 10.0
    b.generation += 1  # its client came back: its timer is stale
    assert list(timers.due(25.0)) == [(20.0, TimerKind.EXPIRE_SESSION, a)]
    assert timers.next_deadline() == 30.0 and len(timers) == 1


def test_an_offline_session_expires_on_the_timer():
    router, clock = make_router()
    c = Client(router, "brief", V5, clean=False, properties={"session_expiry_interval": 10})
    c.send(Disconnect())
    clock.advance(9.9)
    router.tick()
    assert "brief" in router.sessions
    clock.advance(0.2)
    assert router.tick() is None  # no timer left
    assert "brief" not in router.sessions


def test_a_delayed_will_waits_for_its_delay_unless_the_client_is_back():
    router, clock = make_router()
    watcher = Client(router, "watcher")
    watcher.send(Subscribe(1, [SubscribeTopic("wills/#", 0)]))
    watcher.received()
    will = Will("wills/late", b"gone", properties={"will_delay_interval": 5})
    late = Client(router, "late", V5, clean=False, will=will, properties={"session_expiry_interval": 60})
    late.lose_connection()
    assert router.held_will_bytes > 0
    clock.advance(4)
    router.tick()
    assert watcher.publishes() == []
    clock.advance(1)
    router.tick()
    assert [p.payload for p in watcher.publishes()] == [b"gone"] and router.held_will_bytes == 0

    back = Client(router, "back", V5, clean=False, will=Will("wills/back", b"no", properties={
        "will_delay_interval": 5}), properties={"session_expiry_interval": 60})
    back.lose_connection()
    Client(router, "back", V5, clean=False, properties={"session_expiry_interval": 60})
    clock.advance(10)
    router.tick()
    assert watcher.publishes() == [] and router.held_will_bytes == 0


def test_a_will_goes_at_once_on_a_lost_connection_and_never_after_disconnect(router):
    watcher = Client(router, "watcher")
    watcher.send(Subscribe(1, [SubscribeTopic("w", 0)]))
    watcher.received()
    Client(router, "polite", will=Will("w", b"polite")).send(Disconnect())
    Client(router, "lost", will=Will("w", b"lost")).lose_connection()
    assert [p.payload for p in watcher.publishes()] == [b"lost"]


# --- limits -------------------------------------------------------------------------------

def test_an_offline_sessions_queue_is_bounded():
    router, _ = make_router("[limits]\nmax_queued_messages = 3\n")
    sub = Client(router, "sub", clean=False)
    sub.send(Subscribe(1, [SubscribeTopic("t", 1)]), Disconnect())
    pub = Client(router, "pub")
    for i in range(5):
        pub.send(Publish("t", b"x", qos=1, packet_id=i + 1))
    assert len(router.sessions["sub"].queue) == 3 and router.stats.pub_dropped == 2
    assert router.queued_bytes > 0
    Client(router, "sub", clean=True)  # a clean start ends the session and its queue
    assert router.queued_bytes == 0


@pytest.mark.parametrize("version,refused", [(V5, C.QUOTA_EXCEEDED), (V311, 0x80)])
def test_max_subscriptions(version, refused):
    router, _ = make_router("[limits]\nmax_subscriptions = 2\n")
    c = Client(router, "c", version)
    c.send(Subscribe(1, [SubscribeTopic(t, 0) for t in ("a", "b", "c")]))
    assert c.received()[1:] == [Suback(1, [0, 0, refused])]
    c.send(Subscribe(2, [SubscribeTopic("a", 1)]))  # the same filter again is no new one
    assert c.received() == [Suback(2, [1])]


def test_past_max_retained_messages_a_message_is_delivered_but_not_retained():
    router, _ = make_router("[limits]\nmax_retained_messages = 2\n")
    sub = Client(router, "sub")
    sub.send(Subscribe(1, [SubscribeTopic("r/#", 0)]))
    sub.received()
    pub = Client(router, "pub")
    pub.send(*(Publish(f"r/{i}", b"x", retain=True) for i in range(3)))
    assert len(sub.publishes()) == 3
    assert router.retained.count == 2 and router.retained.get("r/2") is None
    assert router.stats.retained_refused == 1
    pub.send(Publish("r/0", b"replaced", retain=True))  # not one more: taken
    assert router.retained.get("r/0").payload == b"replaced"


def test_past_will_memory_a_delayed_will_goes_at_once():
    router, clock = make_router("[limits]\nwill_memory = 1000\n")
    watcher = Client(router, "watcher")
    watcher.send(Subscribe(1, [SubscribeTopic("w/#", 0)]))
    watcher.received()
    big = Will("w/big", b"x" * 2000, properties={"will_delay_interval": 30})
    gone = Client(router, "big", V5, clean=False, will=big, properties={"session_expiry_interval": 60})
    gone.lose_connection()
    assert [p.topic for p in watcher.publishes()] == ["w/big"]
    assert router.stats.wills_early == 1 and router.held_will_bytes == 0
