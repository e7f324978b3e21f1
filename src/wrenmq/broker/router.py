"""The router: owns sessions, subscriptions, retained messages and routing.

Connections hand it decoded packets; it answers by writing bytes to the
connections involved. It never awaits and never touches a socket: time comes
from `clock`, timers are a heap the broker drives through `tick()`, and every
accepted message passes through `publish()`, the one append point where the
commit log (and later the cluster) sit.
"""

import functools
import heapq
import logging
from collections import deque
import os
import time
from itertools import count

from ..mqtt import constants as C
from ..mqtt.acks import CONNACK_311_ACCEPTED, PINGRESP, puback, pubcomp, pubrec, pubrel
from ..mqtt.codec import MQTTError, encode
from ..mqtt.packets import Connack, Suback, Unsuback
from .message import Message, message_properties
from .retained import RETAINED_TIMER, RetainedSending
from .session import NEVER, QUEUE_ENTRY_COST, Outgoing, Session, Subscription
from .topics import RetainedTrie, TopicError, TopicTrie, parse_shared, topic_matches, validate_topic_filter

log = logging.getLogger("wrenmq.router")

# Timer kinds.
_EXPIRE_SESSION = 1
_PUBLISH_WILL = 2
_CATCH_UP = 3
# What a subscription's objects take besides its filter (the Subscription, its place in
# the session's dict and in the topic trie), measured with 100,000 subscriptions held:
# 593 bytes each for 20-byte filters, 968 for 206-byte ones (the filter is kept twice).
SUBSCRIPTION_COST = 550


def subscription_size(full_filter, filter):
    """What [limits] subscription_memory counts for one subscription: its objects and its
    filter twice (`full_filter` with the $share/<name>/ prefix, `filter` without)."""
    return SUBSCRIPTION_COST + len(full_filter) + len(filter)


# What a will held for its delay takes besides its message (Message.memory): its timer (a
# heap entry, its deadline and sequence number) and the session's numbers for it, from
# the RSS of 20,000 sessions holding a will against as many without one
# (`python -m wrenmq.bench.bounds wills`, docs/BENCHMARKS.md).
HELD_WILL_COST = 250


def will_size(will):
    """What [limits] will_memory counts for a will held for its delay."""
    return will.memory() + HELD_WILL_COST


_CLEARS_KEPT = 100_000  # retained clears remembered (cluster), the oldest forgotten first


def _from_the_log(out):
    """Whether `catch_up` gives the queued `out` back as it was, in log order: a logged
    QoS 1/2 message the session's own subscriptions routed (not shared, not retained on
    subscribe)."""
    return out.tracked and out.qos and out.msg.offset >= 0


def _entry_cost(msg):
    """What one more queue entry holding `msg` adds to Router.queued_bytes: the entry, and
    the message itself if no queue holds it yet (Message.held)."""
    return QUEUE_ENTRY_COST if msg.held else QUEUE_ENTRY_COST + msg.memory()


class Stats:
    """Counters behind $SYS; plain attributes so the hot path can bump them cheaply."""

    __slots__ = ("started", "msgs_received", "msgs_sent", "bytes_received", "bytes_sent",
                 "pub_received", "pub_sent", "pub_dropped", "connects", "clients_maximum",
                 "denied_publish", "denied_subscribe", "denied_deliver", "expired", "rate_limited",
                 "refused_connections", "retained_refused", "sessions_refused", "refused_disk_low",
                 "subscriptions_refused", "wills_early",
                 "_logged")

    def __init__(self):
        self.started = time.time()
        for s in self.__slots__[1:-1]:
            setattr(self, s, 0)
        self._logged = {}  # counter -> when refuse() last said to log

    def refuse(self, counter):
        """Count one refusal in `counter`; return the count so far if the caller should log
        it, at most once a second per counter (a flood of refusals is a line a second), else 0."""
        n = getattr(self, counter) + 1
        setattr(self, counter, n)
        now = time.monotonic()
        if now - self._logged.get(counter, float("-inf")) >= 1.0:
            self._logged[counter] = now
            return n
        return 0


class SharedGroup:
    """The members of one `$share/<name>/<filter>`; each message goes to one of them."""

    __slots__ = ("name", "filter", "members", "next")

    def __init__(self, name, flt):
        self.name = name
        self.filter = flt
        self.members = []  # Subscription, in join order
        self.next = 0

    def pick(self, exclude=None, allowed=None):
        """Round robin over online members; an offline member only if nobody is online.

        `allowed(session)` (the authorize_deliver check for this message) skips members
        that may not read it, so one member's ACL never loses a message for the group.
        """
        members = self.members
        n = len(members)
        if not n:
            return None
        start = self.next
        fallback = None
        for i in range(n):
            sub = members[(start + i) % n]
            if sub.session is exclude:
                continue
            if allowed is not None and not allowed(sub.session):
                continue
            if sub.session.conn is not None:
                self.next = (start + i + 1) % n
                return sub
            if fallback is None:
                fallback = sub
        self.next = (start + 1) % n
        return fallback


class Router(RetainedSending):
    def __init__(self, config, hooks, clock=time.monotonic):
        self.cfg = config
        self.limits = config.limits
        self.hooks = hooks
        self.clock = clock
        self.sessions = {}  # client id -> Session
        self.subs = TopicTrie()  # filter -> {client id: Subscription}
        self.shared = TopicTrie()  # filter -> {group name: SharedGroup}
        self.retained = RetainedTrie()
        self._matches = {}  # topic -> (normal targets, shared groups)
        self.dirty = set()  # stored sessions whose log cursor may have moved
        self.stats = Stats()
        self.online = 0
        self._timers = []
        self._seq = count()
        self.on_timer = None  # broker callback(deadline) when the earliest timer changes
        self.persist = None  # Persistence (commit log + state) when storage is on disk
        self.topic_log = None  # with it, the store's topic_log (the match cache's handle on a logged topic)
        self.cluster = None  # cluster.node.Cluster when [cluster] is on: other nodes' interest, links
        self._adopted = set()  # client ids of sessions handed over by another node, not yet stored here
        self.retained_clears = {}  # topic -> time of its retained clear (cluster only; see _retain)
        self.disk_low = False  # [storage] min_free_bytes crossed: no new messages (set_disk_low)
        self.maximum_qos = config.broker.maximum_qos
        self.retain_available = config.broker.retain_available
        self.max_queued = self.limits.max_queued_messages
        # An offline session's queue in memory, past which the log holds its messages.
        offline = self.limits.max_queued_offline
        self.max_queued_offline = min(offline, self.max_queued) if offline else self.max_queued
        self.queue_qos0 = config.broker.queue_qos0_messages
        self.max_levels = self.limits.max_topic_levels
        lim = self.limits
        self.max_topic_length = lim.max_topic_length if lim.max_topic_length < 65535 else 0
        self.max_queued_bytes = lim.max_queued_bytes or float("inf")
        self.max_inflight_bytes = lim.max_inflight_bytes or float("inf")
        self.queue_memory = lim.queue_memory or float("inf")
        # What the subscriptions of all sessions cost in memory (what subscription_memory
        # bounds): subscription_size of each (`_add_subscription`).
        self.subscription_memory = lim.subscription_memory or float("inf")
        self.subscription_bytes = 0
        # The wills of offline sessions waiting for their delay (what will_memory bounds).
        self.will_memory = lim.will_memory or float("inf")
        self.held_will_bytes = 0
        # What the queues of all sessions cost in memory (what queue_memory bounds): each
        # entry, and each message they hold once (`_queue_push`).
        self.queued_bytes = 0
        self.rx_time = time.time()  # wall clock of the packets being handled (arrived())
        self.rx_us = int(self.rx_time * 1_000_000)
        h = [None] * 16
        h[C.PUBLISH] = self.handle_publish
        h[C.PUBACK] = self.handle_puback
        h[C.PUBREC] = self.handle_pubrec
        h[C.PUBREL] = self.handle_pubrel
        h[C.PUBCOMP] = self.handle_pubcomp
        h[C.SUBSCRIBE] = self.handle_subscribe
        h[C.UNSUBSCRIBE] = self.handle_unsubscribe
        h[C.PINGREQ] = self.handle_pingreq
        h[C.DISCONNECT] = self.handle_disconnect
        for t in (C.CONNECT, C.CONNACK, C.SUBACK, C.UNSUBACK, C.PINGRESP):
            h[t] = self._unexpected
        self.handlers = h

    def arrived(self):
        """Packets of one read are about to be handled: read the wall clock once for them.

        A message's timestamp (the log's record time) is when its read arrived; one
        clock reading per read instead of one per message is 0.1-0.2 us less per message.
        """
        t = self.rx_time = time.time()
        self.rx_us = int(t * 1_000_000)

    # --- timers -------------------------------------------------------------

    def _schedule(self, deadline, kind, session):
        heapq.heappush(self._timers, (deadline, next(self._seq), kind, session, session.generation))
        if self._timers[0][0] == deadline and self.on_timer is not None:
            self.on_timer(deadline)

    def next_deadline(self):
        return self._timers[0][0] if self._timers else None

    def tick(self):
        """Run every timer that is due; return the next deadline (or None)."""
        now = self.clock()
        timers = self._timers
        while timers and timers[0][0] <= now:
            at, _, kind, session, gen = heapq.heappop(timers)
            if session.generation != gen:
                continue  # (re)connected or disconnected since: the timer is stale
            if kind == _CATCH_UP:
                if session.conn is not None:
                    self.drain(session)
                continue
            if kind == RETAINED_TIMER:
                if session.retained_at == at:  # (not one set before the session's last stop)
                    session.retained_at = None
                    self.drain(session, True)
                continue
            if session.conn is not None:
                continue
            if kind == _PUBLISH_WILL:
                if session.will_at is not None and session.will_at <= now:
                    self._publish_will(session)
            elif kind == _EXPIRE_SESSION:
                if session.expires_at is not None and session.expires_at <= now:
                    if self.sessions.get(session.client_id) is session:
                        log.info("session %s expired", session.client_id)
                        self.end_session(session)
        return timers[0][0] if timers else None

    # --- connect / disconnect ----------------------------------------------

    def connect(self, conn, pkt, username, auth_props=None):
        """Accept an authenticated CONNECT: attach or create the session, send CONNACK.

        Returns the session, or None when the CONNECT was refused (CONNACK sent).
        """
        limits = self.limits
        v5 = pkt.version == C.MQTT5
        cid = pkt.client_id
        props = {}
        if limits.max_client_id_length and len(cid) > limits.max_client_id_length // 4 and \
                len(cid.encode()) > limits.max_client_id_length:
            conn.refuse(pkt.version, C.CLIENT_IDENTIFIER_NOT_VALID)
            return None
        if not cid:
            if not v5 and not pkt.clean_start:
                conn.refuse(pkt.version, C.CLIENT_IDENTIFIER_NOT_VALID)
                return None
            cid = "wrenmq-" + os.urandom(9).hex()
            if v5:
                props["assigned_client_identifier"] = cid
        keepalive = pkt.keepalive
        if limits.max_keepalive < 65535 and (keepalive == 0 or keepalive > limits.max_keepalive):
            if not v5:
                conn.refuse(pkt.version, C.CLIENT_IDENTIFIER_NOT_VALID)
                return None
            keepalive = limits.max_keepalive
            props["server_keep_alive"] = keepalive
        if pkt.will is not None:
            try:
                self._check_topic_name(pkt.will.topic)
            except MQTTError:
                conn.refuse(pkt.version, C.TOPIC_NAME_INVALID)
                return None
            if pkt.will.qos > self.maximum_qos:
                conn.refuse(pkt.version, C.QOS_NOT_SUPPORTED)
                return None
            if pkt.will.retain and not self.retain_available:
                conn.refuse(pkt.version, C.RETAIN_NOT_SUPPORTED)
                return None

        # Session expiry requested vs allowed.
        if v5:
            expiry = pkt.properties.get("session_expiry_interval", 0) if pkt.properties else 0
        else:
            expiry = 0 if pkt.clean_start else NEVER
        if expiry > limits.max_session_expiry:
            expiry = limits.max_session_expiry
            if v5:
                props["session_expiry_interval"] = expiry

        session = self.sessions.get(cid)
        present = False
        if session is not None:
            if session.conn is not None:
                self._take_over(session, pkt.clean_start)
            if pkt.clean_start:
                self.end_session(session, publish_will=True)
                session = None
            else:
                present = True
        if session is None:
            max_sessions = limits.max_sessions
            if expiry and max_sessions and len(self.sessions) >= max_sessions:
                # Offline sessions are what a client can pile up (a new client id each
                # time): past the limit only sessions that end with their connection start.
                n = self.stats.refuse("sessions_refused")
                if n:
                    log.warning("refusing a new persistent session for %s: %d sessions held ([limits] "
                                "max_sessions %d); %d refused so far", cid, len(self.sessions),
                                max_sessions, n)
                conn.refuse(pkt.version, C.QUOTA_EXCEEDED)
                return None
            session = Session(cid)
            self.sessions[cid] = session
        if self.cluster is not None:
            self.cluster.client_connected(cid)

        now = self.clock()
        session.generation += 1
        session.version = pkt.version
        session.v5 = v5
        session.conn = conn
        if self.cluster is not None and session.subscriptions:
            self.cluster.presence(session, True)
        session.expiry_interval = expiry
        session.expires_at = None
        self._let_go_will(session)
        session.username = username
        session.address = conn.address
        session.listener = conn.listener_name
        session.connected_at = now
        session.alias_in = None
        session.alias_out = None
        session.receive_max_in = limits.receive_maximum
        cprops = pkt.properties
        session.topic_alias_in_max = limits.topic_alias_maximum if v5 else 0
        if cprops:
            session.send_quota = min(cprops.get("receive_maximum", 65535), limits.max_inflight)
            session.max_packet_out = cprops.get("maximum_packet_size", 0)
            session.alias_out_max = cprops.get("topic_alias_maximum", 0)
            if session.alias_out_max:
                session.alias_out = {}
            session.request_problem_info = bool(cprops.get("request_problem_information", 1))
        else:  # 3.1.1 has none of these properties, and many 5.0 clients send none
            session.send_quota = min(65535, limits.max_inflight)
            session.max_packet_out = 0
            session.alias_out_max = 0
            session.request_problem_info = True
        session.will = self._will_message(pkt.will, cid, session) if pkt.will is not None else None
        conn.keepalive = keepalive
        self.online += 1
        self.stats.connects += 1
        if self.online > self.stats.clients_maximum:
            self.stats.clients_maximum = self.online

        if not v5:
            connack = CONNACK_311_ACCEPTED[present]
        elif props or auth_props:
            props.update(self._connack_properties())
            if auth_props:
                props.update(auth_props)
            connack = encode(Connack(present, 0, props), C.MQTT5)
        else:
            connack = self._connack_v5[present]
        if expiry > 0 and self.persist is not None:
            self.persist.session_started(session, pkt.clean_start)
        if self._adopted and cid in self._adopted:
            self._adopted.discard(cid)
            if session.stored:
                self._store_adopted(session)
        conn.send(connack)
        if log.isEnabledFor(logging.INFO):
            log.info("client %s connected from %s (v%s, clean=%s, keepalive=%s, session present=%s)",
                     cid, conn.address, {3: "3.1", 4: "3.1.1", 5: "5.0"}[pkt.version],
                     int(pkt.clean_start), keepalive, int(present),
                     extra={"event": "client.connected", "client_id": cid, "address": conn.address,
                            "listener": conn.listener_name, "username": username})
        if present:
            self._resume(session)
        self.hooks.on_connect(session)
        return session

    @functools.cached_property
    def _connack_v5(self):
        """The two 5.0 CONNACKs most connects get (only the broker's own properties)."""
        return tuple(encode(Connack(present, 0, self._connack_properties()), C.MQTT5)
                     for present in (False, True))

    def _connack_properties(self):
        limits = self.limits
        b = self.cfg.broker
        props = {
            "receive_maximum": limits.receive_maximum,
            "topic_alias_maximum": limits.topic_alias_maximum,
            "maximum_packet_size": limits.max_packet_size,
        }
        if self.maximum_qos < 2:
            props["maximum_qos"] = self.maximum_qos
        if not self.retain_available:
            props["retain_available"] = 0
        if not b.wildcard_subscriptions:
            props["wildcard_subscription_available"] = 0
        if not b.subscription_identifiers:
            props["subscription_identifier_available"] = 0
        if not b.shared_subscriptions:
            props["shared_subscription_available"] = 0
        return props

    def _will_message(self, will, cid, session):
        """Keep the will as an unpublished Message; its expiry starts when it is published."""
        props = message_properties(will.properties)
        session.will_delay = props.pop("will_delay_interval", 0)
        return Message(will.topic, will.payload, will.qos, will.retain, props, None, cid, session)

    def _take_over(self, session, clean):
        old = session.conn
        log.info("client %s taken over by a new connection", session.client_id)
        old.session = None
        self.online -= 1
        session.conn = None
        if self.cluster is not None and session.subscriptions:
            self.cluster.presence(session, False)
        session.resend = ()
        self._stop_retained(session)
        if session.will is not None and (clean or not session.will_delay):
            self._publish_will(session)
        session.will = None
        old.close(C.SESSION_TAKEN_OVER)

    def _resume(self, session):
        """Resend unacknowledged messages in their original order and packet ids (as many
        as the client's new receive maximum allows, the rest as acks free the window),
        then the queue."""
        now = self.clock()
        for pid, out in list(session.inflight.items()):
            if not out.released and out.msg.expired(now):
                session.take_inflight(pid)
        if session.inflight:
            session.resend = deque(session.inflight)
        self.drain(session)

    def _resend(self, session, pid):
        out = session.inflight.get(pid)
        if out is None:
            return
        if out.released:
            session.conn.send(pubrel(pid))
        else:
            self._write_publish(session, out.msg, out.qos, out.retain, out.sub_ids, pid, True)

    def connection_lost(self, session, publish_will=True, reason=None):
        """The client's connection closed (any way other than takeover)."""
        session.conn = None
        if self.cluster is not None and session.subscriptions:
            self.cluster.presence(session, False)
        session.generation += 1
        session.resend = ()
        self._stop_retained(session)
        self.online -= 1
        now = self.clock()
        self.hooks.on_disconnect(session, reason)
        self._reassign_shared(session)
        will = session.will
        if will is not None and not publish_will:
            session.will = will = None
        if session.expiry_interval == 0:
            self.end_session(session)
            return
        if self.persist is not None:
            if len(session.queue) > self.max_queued_offline:
                self._trim_offline_queue(session)
            self.persist.session_offline(session)
        if will is not None:
            delay = min(session.will_delay, session.expiry_interval)
            if delay > 0 and self.held_will_bytes + will_size(will) > self.will_memory:
                # Sessions that go with a long will delay, a new client id each time, are
                # what a client could pile wills up in.
                n = self.stats.refuse("wills_early")
                if n:
                    log.warning("publishing the will of %s now, not in %d s: held wills take %d bytes "
                                "([limits] will_memory %d); %d published early so far", session.client_id,
                                delay, self.held_will_bytes, self.limits.will_memory, n)
                delay = 0
            if delay <= 0:
                self._publish_will(session)
            else:
                self._hold_will(session, now + delay)
        if session.expiry_interval != NEVER:
            session.expires_at = now + session.expiry_interval
            self._schedule(session.expires_at, _EXPIRE_SESSION, session)

    def _hold_will(self, session, at):
        """Keep the will of `session`, whose client is away, until `at` (monotonic), counted
        in held_will_bytes."""
        self._let_go_will(session)
        session.will_at = at
        session.will_held = will_size(session.will)
        self.held_will_bytes += session.will_held
        self._schedule(at, _PUBLISH_WILL, session)

    def _let_go_will(self, session):
        """The will `session` held while away is published, dropped or its client is back."""
        session.will_at = None
        if session.will_held:
            self.held_will_bytes -= session.will_held
            session.will_held = 0

    def _publish_will(self, session):
        msg = session.will
        session.will = None
        self._let_go_will(session)
        if msg is None:
            return
        hooks = self.hooks
        if hooks.authorize_publish is not None and hooks.authorize_publish(
                session, msg.topic, msg.qos, msg.retain) is False:
            self.stats.denied_publish += 1
            log.info("will of %s on %s denied by ACL", session.client_id, msg.topic)
            return
        msg.timestamp = time.time()
        interval = msg.properties.get("message_expiry_interval")
        cap = self.limits.max_message_expiry
        if cap and (interval is None or interval > cap):
            interval = msg.properties["message_expiry_interval"] = cap
        if interval is not None:
            msg.expiry = self.clock() + interval
        log.info("publishing will of %s on %s", session.client_id, msg.topic)
        self.publish(msg)

    def end_session(self, session, publish_will=True):
        """The session is over: publish a pending will, drop its state."""
        if publish_will and session.will is not None:
            self._publish_will(session)
        session.will = None
        self._let_go_will(session)
        subs = session.subscriptions
        if subs:
            for sub in subs.values():
                self._remove_subscription(session, sub)
            subs.clear()
            self._matches.clear()
        self._stop_retained(session)
        self._clear_queue(session)
        session.match_cache = None  # (queued messages may keep the object: `origin`)
        session.resend = ()
        session.inflight.clear()
        session.inflight_bytes = 0
        session.incoming_qos2 = session.restored_qos2 = frozenset()
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            if self.cluster is not None:
                self.cluster.client_gone(session.client_id)
        if self.persist is not None:
            self.persist.session_ended(session)
        self.hooks.on_session_expired(session.client_id)

    def _reassign_shared(self, session):
        """Unacknowledged messages a shared group gave this session go to another member."""
        if not session.inflight and not session.queue:
            return
        moved = []
        for pid, out in list(session.inflight.items()):
            if out.group is not None and not out.released:
                session.take_inflight(pid)
                moved.append(out)
        if session.queue:
            keep = [o for o in session.queue if o.group is None]
            moved.extend(o for o in session.queue if o.group is not None)
            self._clear_queue(session)
            for o in keep:
                self._queue_push(session, o)
        for out in moved:
            sub = out.group.pick(exclude=session)
            if sub is None or sub.session.conn is None:
                # Nobody else online: keep it for this session.
                self._queue_push(session, out)
                continue
            if session.stored and out.msg.offset >= 0:
                self.persist.shared_done(session, out)
            q = out.msg.qos if out.msg.qos < sub.qos else sub.qos
            self._deliver(sub.session, out.msg, q, False, (sub.sub_id,) if sub.sub_id else (), out.group)

    # --- inbound packets ---------------------------------------------------

    def _unexpected(self, session, pkt):
        raise MQTTError(C.PROTOCOL_ERROR, f"unexpected {C.PACKET_NAMES[pkt.TYPE]} from a client")

    def _check_topic_name(self, topic):
        if not topic:
            raise MQTTError(C.PROTOCOL_ERROR, "empty topic name")
        if "+" in topic or "#" in topic:
            raise MQTTError(C.TOPIC_NAME_INVALID, f"wildcard in topic name {topic!r}")
        if topic.count("/") >= self.max_levels:
            raise MQTTError(C.TOPIC_NAME_INVALID, "too many topic levels")
        if self.max_topic_length and len(topic.encode()) > self.max_topic_length:
            raise MQTTError(C.TOPIC_NAME_INVALID, f"topic longer than {self.max_topic_length} bytes")

    def _new_message(self, topic, payload, qos, retain, props, cid, origin, ts, raw=None, raw_v5=False):
        expiry = None
        cap = self.limits.max_message_expiry
        interval = props.get("message_expiry_interval") if props else None
        if cap and (interval is None or interval > cap):
            interval = cap
            props["message_expiry_interval"] = cap
        if interval is not None:
            expiry = self.clock() + interval
        return Message(topic, payload, qos, retain, props, expiry, cid, origin, raw, raw_v5, ts)

    def handle_publish(self, session, pkt):
        topic = pkt.topic
        props = pkt.properties
        raw = pkt  # forwardable as received (its bytes are cut only if a subscriber needs them)
        if session.v5 and props:
            if "subscription_identifier" in props:
                raise MQTTError(C.PROTOCOL_ERROR, "PUBLISH from a client carries a subscription identifier")
            alias = props.get("topic_alias")
            if alias is not None:
                raw = None
                if not alias or alias > session.topic_alias_in_max:
                    raise MQTTError(C.TOPIC_ALIAS_INVALID, f"topic alias {alias} out of range")
                if topic:
                    if session.alias_in is None:
                        session.alias_in = {}
                    session.alias_in[alias] = topic
                else:
                    topic = session.alias_in.get(alias) if session.alias_in else None
                    if topic is None:
                        raise MQTTError(C.PROTOCOL_ERROR, f"unknown topic alias {alias}")
            props = message_properties(props)
            if "message_expiry_interval" in props:
                raw = None
        else:
            props = {}
        if not topic or "+" in topic or "#" in topic or topic.count("/") >= self.max_levels or (
                self.max_topic_length and len(topic) > self.max_topic_length // 4):
            self._check_topic_name(topic)
        qos = pkt.qos
        if qos:
            raw = None  # the received bytes carry the publisher's QoS and packet id
        if qos > self.maximum_qos:
            raise MQTTError(C.QOS_NOT_SUPPORTED, f"QoS {qos} above the maximum {self.maximum_qos}")
        retain = pkt.retain
        if retain:
            raw = None
            if not self.retain_available:
                raise MQTTError(C.RETAIN_NOT_SUPPORTED, "retain is not supported")
        stats = self.stats
        stats.pub_received += 1
        pid = pkt.packet_id
        if qos == 2:
            if pid in session.incoming_qos2:
                # A resend of a message we already hold: acknowledge again, deliver once.
                session.conn.send(pubrec(pid))
                return
            restored = session.restored_qos2
            if restored and pid in restored:
                # Known from before a restart and not yet released by PUBREL: whatever the
                # DUP flag says (clients do resend without it), this is the same message.
                restored.discard(pid)
                session.add_incoming_qos2(pid)
                session.conn.send(pubrec(pid))
                return
        if qos:
            if len(session.incoming_qos2) >= session.receive_max_in:
                # 3.1.1 has no receive maximum, but the packet ids a session holds until
                # PUBREL are memory a client could pile up (65,535 per session, sessions
                # without end): past it the connection closes, and the session's client
                # releases them when it is back.
                raise MQTTError(C.RECEIVE_MAXIMUM_EXCEEDED, "receive maximum exceeded")
            if self.disk_low:
                # The log could not keep it: refuse it rather than acknowledge it. 3.1.1 has
                # no refusal; the client sends it again after the connection closes.
                stats.refused_disk_low += 1
                if session.v5:
                    session.conn.send(puback(pid, C.QUOTA_EXCEEDED, True) if qos == 1 else
                                      pubrec(pid, C.QUOTA_EXCEEDED, True))
                else:
                    session.conn.close(C.QUOTA_EXCEEDED)
                return

        reason = 0
        denied = topic[:1] == "$" and (topic.startswith("$SYS") or topic.startswith("$share"))
        hooks = self.hooks
        if not denied and hooks.authorize_publish is not None:
            denied = hooks.authorize_publish(session, topic, qos, retain) is False
        if denied:
            stats.denied_publish += 1
            reason = C.NOT_AUTHORIZED
        else:
            hit = self._matches.get(topic)
            if hit is None:
                hit = self._match(topic)
            logged = hit[2]
            if not (hit[0] or hit[1] or retain) and hooks.on_publish is None and (
                    logged is None or not props and hit[3]) and (
                    self.cluster is None or not self.cluster.wanted(topic)):
                # Nobody receives it and it is not retained: no message to build. If the
                # topic is recorded, the log gets the record straight from the packet.
                if logged is not None:
                    logged.record(self.rx_us, qos, session.client_b, pkt.payload, pid)
                if session.v5:
                    reason = C.NO_MATCHING_SUBSCRIBERS
            else:
                if self.limits.max_message_expiry or props:
                    msg = self._new_message(topic, pkt.payload, qos, retain, props,
                                            session.client_id, session, self.rx_time, None, session.v5)
                else:
                    msg = Message(topic, pkt.payload, qos, retain, props, None, session.client_id,
                                  session, None, session.v5, self.rx_time)
                msg.packet = raw
                if not self.publish(msg, pid if qos == 2 else 0) and session.v5:
                    reason = C.NO_MATCHING_SUBSCRIBERS
                msg.packet = None
        if qos == 1:
            session.conn.send(puback(pid, reason, session.v5))
        elif qos == 2:
            if reason < 0x80:
                session.add_incoming_qos2(pid)
                if session.stored:
                    self.persist.qos2_in(session, pid, True)
            session.conn.send(pubrec(pid, reason, session.v5))

    def handle_pubrel(self, session, pkt):
        pid = pkt.packet_id
        if session.release_incoming_qos2(pid):
            if session.stored:
                self.persist.qos2_in(session, pid, False)
            session.conn.send(pubcomp(pid))
        else:
            session.conn.send(pubcomp(pid, C.PACKET_IDENTIFIER_NOT_FOUND, session.v5))

    def handle_puback(self, session, pkt):
        out = session.inflight.get(pkt.packet_id)
        if out is not None and out.qos == 1:
            session.take_inflight(pkt.packet_id)
            if session.stored:
                self.dirty.add(session)
                if out.group is not None and out.msg.offset >= 0:
                    self.persist.shared_done(session, out)
            if session.queue or session.resend or session.resume_from is not None or session.retained_due:
                self.drain(session)

    def handle_pubrec(self, session, pkt):
        pid = pkt.packet_id
        out = session.inflight.get(pid)
        if out is None or out.qos != 2:
            session.conn.send(pubrel(pid, C.PACKET_IDENTIFIER_NOT_FOUND, session.v5))
            return
        if pkt.reason_code >= 0x80:
            session.take_inflight(pid)
            if session.stored and out.msg.offset >= 0:
                self.persist.qos2_out(session, out, 2)
            if session.queue or session.resend or session.resume_from is not None or session.retained_due:
                self.drain(session)
            return
        if not out.released:
            out.released = True
            if session.stored and out.msg.offset >= 0:
                self.persist.qos2_out(session, out, 1)
        session.conn.send(pubrel(pid))

    def handle_pubcomp(self, session, pkt):
        out = session.inflight.get(pkt.packet_id)
        if out is not None and out.qos == 2:
            session.take_inflight(pkt.packet_id)
            if session.stored:
                self.dirty.add(session)
                if out.msg.offset >= 0:
                    self.persist.qos2_out(session, out, 2)
            if session.queue or session.resend or session.resume_from is not None or session.retained_due:
                self.drain(session)

    def handle_pingreq(self, session, pkt):
        session.conn.send(PINGRESP)

    def handle_disconnect(self, session, pkt):
        conn = session.conn
        if session.v5:
            new_expiry = pkt.properties.get("session_expiry_interval")
            if new_expiry is not None:
                if session.expiry_interval == 0 and new_expiry:
                    raise MQTTError(C.PROTOCOL_ERROR, "session expiry set by DISCONNECT after 0 at CONNECT")
                session.expiry_interval = min(new_expiry, self.limits.max_session_expiry)
        if pkt.reason_code != C.DISCONNECT_WITH_WILL:
            session.will = None
        conn.clean_disconnect = True
        conn.close()

    def handle_subscribe(self, session, pkt):
        v5 = session.v5
        b = self.cfg.broker
        sub_id = pkt.properties.get("subscription_identifier") if v5 else None
        codes = []
        retained = []
        hooks = self.hooks
        fail = (lambda rc: rc) if v5 else (lambda rc: 0x80)
        cluster = self.cluster
        routes = cluster.route_seq if cluster is not None else 0
        for t in pkt.topics:
            try:
                group, flt = parse_shared(t.filter)
                validate_topic_filter(flt, self.max_levels)
                if self.max_topic_length and len(t.filter.encode()) > self.max_topic_length:
                    raise TopicError("topic filter too long")
            except TopicError:
                codes.append(fail(C.TOPIC_FILTER_INVALID))
                continue
            existed = t.filter in session.subscriptions
            if not existed:
                if self.limits.max_subscriptions and len(session.subscriptions) >= self.limits.max_subscriptions:
                    codes.append(fail(C.QUOTA_EXCEEDED))
                    continue
                if self.subscription_bytes + subscription_size(t.filter, flt) > self.subscription_memory:
                    # Sessions, each with its max_subscriptions of long filters, are what a
                    # client could pile up without it.
                    n = self.stats.refuse("subscriptions_refused")
                    if n:
                        log.warning("refusing a subscription of %s: subscriptions take about %d bytes "
                                    "([limits] subscription_memory %d); %d refused so far",
                                    session.client_id, self.subscription_bytes, self.limits.subscription_memory, n)
                    codes.append(fail(C.QUOTA_EXCEEDED))
                    continue
            if group is not None:
                if t.no_local and v5:
                    raise MQTTError(C.PROTOCOL_ERROR, "no local on a shared subscription")
                if not b.shared_subscriptions:
                    codes.append(fail(C.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED))
                    continue
            if not b.wildcard_subscriptions and ("+" in flt or "#" in flt):
                codes.append(fail(C.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED))
                continue
            if sub_id is not None and not b.subscription_identifiers:
                codes.append(fail(C.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED))
                continue
            if hooks.authorize_subscribe is not None and \
                    hooks.authorize_subscribe(session, t.filter, t.qos) is False:
                self.stats.denied_subscribe += 1
                codes.append(fail(C.NOT_AUTHORIZED))
                continue
            qos = t.qos if t.qos < self.maximum_qos else self.maximum_qos
            sub = Subscription(flt, qos, t.no_local, t.retain_as_published, t.retain_handling,
                               sub_id, group, session)
            sub.created = session.subscriptions[t.filter].created if existed else self.rx_time
            if self.persist is not None:
                # A re-subscription keeps its place: what the old one still owes is owed.
                sub.since = session.subscriptions[t.filter].since if existed else self.persist.next_offset
                if session.stored:
                    self.persist.subscribed(session, sub)
            if existed:
                self._remove_subscription(session, session.subscriptions[t.filter])
            session.subscriptions[t.filter] = sub
            self._add_subscription(session, sub)
            codes.append(qos)
            if hooks.on_subscribe is not None:
                hooks.on_subscribe(session, t.filter, qos)
            if group is None and (t.retain_handling == 0 or (t.retain_handling == 1 and not existed)):
                retained.append(sub)
        self._matches.clear()
        suback = encode(Suback(pkt.packet_id, codes), session.version)
        conn = session.conn
        if cluster is not None and cluster.route_seq != routes:
            # A filter new to this node: the SUBACK waits until the other nodes have it,
            # so what is published anywhere after it reaches the client.
            cluster.after_routes(routes, lambda: self._subscribed(session, conn, suback, retained))
        else:
            self._subscribed(session, conn, suback, retained)

    def _subscribed(self, session, conn, suback, retained):
        """The SUBACK, then the retained messages for the subscriptions that want them
        (from the next loop turn on, a share a turn: retained.py)."""
        if session.conn is not conn or conn.closing:
            return
        conn.send(suback)
        if retained and self.retained.count:
            self._match_retained(session, retained)

    def _add_subscription(self, session, sub):
        session.match_cache = None
        self.subscription_bytes += subscription_size(sub.full_filter, sub.filter)
        if self.cluster is not None:
            self.cluster.subscribed(sub.group, sub.filter, session.conn is not None)
        if sub.group is None:
            self.subs.insert(sub.filter, session.client_id, sub)
            return
        groups = self.shared.get(sub.filter, sub.group)
        if groups is None:
            groups = SharedGroup(sub.group, sub.filter)
            self.shared.insert(sub.filter, sub.group, groups)
        groups.members.append(sub)

    def _remove_subscription(self, session, sub):
        session.match_cache = None
        self.subscription_bytes -= subscription_size(sub.full_filter, sub.filter)
        if self.cluster is not None:
            self.cluster.unsubscribed(sub.group, sub.filter, session.conn is not None)
        if sub.group is None:
            self.subs.remove(sub.filter, session.client_id)
            return
        group = self.shared.get(sub.filter, sub.group)
        if group is not None:
            group.members = [m for m in group.members if m is not sub]
            if not group.members:
                self.shared.remove(sub.filter, sub.group)

    def handle_unsubscribe(self, session, pkt):
        codes = []
        stopped = False
        for f in pkt.filters:
            sub = session.subscriptions.pop(f, None)
            if sub is None:
                codes.append(C.NO_SUBSCRIPTION_EXISTED)
            else:
                self._remove_subscription(session, sub)
                if session.retained_due is not None and f in session.retained_due:
                    self._stop_retained(session, f)
                    stopped = True
                if session.stored:
                    self.persist.unsubscribed(session, f)
                codes.append(0)
                if self.hooks.on_unsubscribe is not None:
                    self.hooks.on_unsubscribe(session, f)
        self._matches.clear()
        session.conn.send(encode(Unsuback(pkt.packet_id, codes if session.v5 else ()), session.version))
        if stopped and session.queue:
            self.drain(session)  # what waited behind the retained messages it stopped

    # --- routing -----------------------------------------------------------

    def publish(self, msg, packet_id=0):
        """The one entry point of every accepted message. Returns True if anyone matched.

        `packet_id` is the publisher's id of a QoS 2 message (kept in the log for recovery).
        """
        hooks = self.hooks
        if hooks.on_publish is not None:
            msg = hooks.on_publish(msg.origin, msg)
            if msg is None:
                return False
        topic = msg.topic
        hit = self._matches.get(topic)
        if hit is None:
            hit = self._match(topic)
        persist = self.persist
        if hit[2] is not None:
            persist.store.append(msg, packet_id, hit[2].topic)
        if msg.retain and (not msg.payload or not msg.client_id or not self._over_retained_limits(msg)):
            self._retain(msg)
        if self.cluster is not None:
            return self.cluster.route(msg, hit)
        return self.route(msg, hit)

    def receive_forwarded(self, msg, subscribers, retained, sync, groups, replayed=False, skip=None):
        """A message another node accepted (cluster link): deliver it here, never onwards.

        `subscribers`: to the matching non-shared subscribers; `retained`: update the
        retained store (a clear when empty); `sync`: a retained message sent when the
        link came up, kept only if newer than the one held; `groups`: (share name,
        filter) pairs chosen to deliver to one member here; `replayed`: sent again from
        the other node's log after its link was down or behind, so only for
        subscriptions made before it was published; `skip`: sessions that have it
        already (one that just moved here, given it by its old node). Not recorded in
        this node's log: the node that accepted it did (a persistent session here that
        is owed it still gets it written, as `_deliver` does for any unrecorded message).
        """
        topic = msg.topic
        if sync:
            if self._retained_newer(topic, msg.timestamp, False):
                self._retain(msg, False)
            return False
        if retained and (not replayed or self._retained_newer(topic, msg.timestamp, True)):
            self._retain(msg)
        hit = self._matches.get(topic)
        if hit is None:
            hit = self._match(topic)
        normal = hit[0] if subscribers else ()
        if replayed and normal:
            ts = msg.timestamp
            normal = tuple(e for e in normal if any(
                s.created <= ts and s.group is None and topic_matches(s.filter, topic)
                for s in e[0].subscriptions.values()))
        if skip:
            normal = tuple(e for e in normal if e[0] not in skip)
        local = tuple(g for g in hit[1] if (g.name, g.filter) in groups) if groups else ()
        return self.route(msg, (normal, local))

    def matching(self, topic):
        """The router's (cached) match of `topic`, as `route` takes it: first the
        subscribers as (session, qos, retain as published, subscription ids, no local)."""
        hit = self._matches.get(topic)
        return hit if hit is not None else self._match(topic)

    def deliver_to(self, session, msg):
        """A message from another node for one session only (passed on by the node the
        session just left): delivered as its subscriptions here take it."""
        mine = tuple(e for e in self.matching(msg.topic)[0] if e[0] is session)
        return self.route(msg, (mine, ())) if mine else False

    def _retained_newer(self, topic, ts, or_same):
        """Whether a retained message (or clear) of time `ts` from another node is newer
        than what this node holds for `topic`: its retained message, or its last clear."""
        old = self.retained.get(topic)
        held = old.timestamp if old is not None else self.retained_clears.get(topic)
        return held is None or ts > held or (or_same and ts == held)

    def release_session(self, cid):
        """Another node's CONNECT wants client `cid`'s session: close its connection here
        (0x8E), take what the log still owes it into its queue, and return it for the
        caller to serialize and then end with `end_session(session, publish_will=False)`
        (the client is back: a pending will is not published). None if not held here."""
        session = self.sessions.get(cid)
        if session is None:
            return None
        log.info("client %s reconnected on another node: its session goes there", cid)
        if session.conn is not None:
            self._take_over(session, False)
        for _ in range(100):  # bounded: what the log owes beyond this is not moved
            if session.resume_from is None or len(session.queue) >= self.max_queued:
                break
            self.catch_up(session)
        return session

    def adopt_session(self, session, queued):
        """Take in a session another node handed over (`release_session` there); the
        CONNECT that asked for it resumes it next (session present 1)."""
        old = self.sessions.get(session.client_id)
        if old is not None:  # (held here after all: keep it)
            return
        self.sessions[session.client_id] = session
        for sub in session.subscriptions.values():
            self._add_subscription(session, sub)
        for out in queued:
            self._queue_push(session, out)
        self._adopted.add(session.client_id)
        self._matches.clear()

    def park_adopted(self, cid):
        """An adopted session whose CONNECT went away before it resumed: offline here,
        expiring as any session does once its client disconnects."""
        session = self.sessions.get(cid)
        if session is None or session.conn is not None or cid not in self._adopted:
            return
        self._adopted.discard(cid)
        if session.expiry_interval == 0:
            self.end_session(session, publish_will=False)
        elif session.expiry_interval != NEVER:
            session.generation += 1
            session.expires_at = self.clock() + session.expiry_interval
            self._schedule(session.expires_at, _EXPIRE_SESSION, session)

    def _store_adopted(self, session):
        """An adopted session is stored here now: its subscriptions, owed messages and
        open inbound QoS 2 ids go to disk too (messages as private log records)."""
        persist = self.persist
        for sub in session.subscriptions.values():
            persist.subscribed(session, sub)
        for pid in session.incoming_qos2:
            persist.qos2_in(session, pid, True)
        for out in list(session.inflight.values()) + list(session.queue):
            if out.msg.offset < 0:
                persist.store.append(out.msg, 0, private=True)
            if out.qos == 2 and out.packet_id and out.msg.offset >= 0:
                persist.qos2_out(session, out, 1 if out.released else 0)
        self.dirty.add(session)

    def moved_away(self, cid):
        """Client `cid` connected to another node with clean start 1 (or its session was
        not handed over): its session here ends, a connection here is closed with 0x8E
        (session taken over). With clean start 0 the session moves instead
        (`release_session`)."""
        session = self.sessions.get(cid)
        if session is None:
            return
        log.info("client %s connected to another node: its session here ends", cid)
        if session.conn is not None:
            self._take_over(session, True)
        self.end_session(session)  # the session ends: a will still pending is published

    def _retain(self, msg, routed=True):
        """Keep `msg` as its topic's retained message (an empty one clears it), on disk too.
        `routed`: it goes to the subscribers as well (RetainedTrie.set).

        With a cluster, a clear is remembered (its time, for the last _CLEARS_KEPT
        topics cleared; on disk too, so across restarts): another node's older copy,
        sent when its link comes up, must not bring the message back."""
        if msg.payload:
            self.retained.set(msg.topic, msg, routed)
            if self.retained_clears:
                self.retained_clears.pop(msg.topic, None)
        else:
            self.retained.delete(msg.topic)
            if self.cluster is not None:
                clears = self.retained_clears
                clears.pop(msg.topic, None)
                clears[msg.topic] = msg.timestamp
                if len(clears) > _CLEARS_KEPT:
                    oldest = next(iter(clears))
                    del clears[oldest]
                    if self.persist is not None:
                        self.persist.retained_clear_forgotten(oldest)
        if self.persist is not None:
            self.persist.retained_changed(msg)

    def _over_retained_limits(self, msg):
        """True (counted, logged at most once a second) if retaining a client's `msg` would
        take the clients' retained messages past [limits] max_retained_messages or the
        memory they take (RetainedTrie.memory) past max_retained_bytes: it is delivered, not
        retained, and its topic keeps what it had. A replacement that does not grow them is
        always taken."""
        limits = self.limits
        max_n = limits.max_retained_messages
        max_b = limits.max_retained_bytes
        if not max_n and not max_b:
            return False
        retained = self.retained
        topic = msg.topic
        old = retained.get(topic)
        n = retained.client_count + (0 if old is not None and old.client_id else 1)
        b = retained.memory + retained.growth(topic, msg)
        grows = n > retained.client_count or b > retained.memory
        if grows and ((max_n and n > max_n) or (max_b and b > max_b)):
            n = self.stats.refuse("retained_refused")
            if n:
                log.warning("not retaining %r from %s: clients' retained messages at %d, taking %d bytes "
                            "([limits] max_retained_messages %d, max_retained_bytes %d); %d refused so far",
                            topic[:200], msg.client_id, retained.client_count, retained.memory,
                            max_n, max_b, n)
            return True
        return False

    def _match(self, topic):
        agg = {}
        for values in self.subs.match(topic):
            for sub in values.values():
                s = sub.session
                e = agg.get(s)
                if e is None:
                    agg[s] = [sub.qos, sub.retain_as_published, [sub.sub_id] if sub.sub_id else [], sub.no_local]
                else:
                    if sub.qos > e[0]:
                        e[0] = sub.qos
                    e[1] = e[1] or sub.retain_as_published
                    if sub.sub_id:
                        e[2].append(sub.sub_id)
                    e[3] = e[3] and sub.no_local
        normal = tuple((s, q, rap, tuple(sorted(ids)), nl) for s, (q, rap, ids, nl) in agg.items())
        groups = tuple(g for values in self.shared.match(topic) for g in values.values())
        persist = self.persist
        # The third field: the store's handle on the topic if the log records it (else
        # None): its bytes, so a logged message does not encode its topic again, and the
        # call that records a PUBLISH nobody receives. The fourth: whether such a PUBLISH
        # (no properties) may be recorded straight from the packet, which `[limits]
        # max_message_expiry` forbids (its messages record an expiry); a tuple field, not
        # an attribute: the hot path reads it for every logged message.
        logged = self.topic_log(topic.encode()) if persist is not None and not self.disk_low and \
            persist.logged(topic) else None
        result = (normal, groups, logged, not self.limits.max_message_expiry)
        if len(self._matches) > 100_000:
            self._matches.clear()
        self._matches[topic] = result
        return result

    def route(self, msg, hit=None):
        """Deliver `msg` to every matching session; True if there was at least one."""
        if hit is None:
            hit = self._matches.get(msg.topic)
            if hit is None:
                hit = self._match(msg.topic)
        normal, groups = hit[0], hit[1]
        if not normal and not groups:
            return False
        mqos = msg.qos
        origin = msg.origin
        deliver = self._deliver
        logged = msg.offset >= 0
        msg.encodings = None  # its encodings are shared while this routing lasts (Message.parts)
        try:
            for session, qos, rap, ids, no_local in normal:
                if no_local and session is origin:
                    continue
                if session.resume_from is not None and (logged or msg.offset >= 0):
                    continue  # it reads this message from the log when it catches up
                deliver(session, msg, mqos if mqos < qos else qos, msg.retain and rap, ids)
            authorize = self.hooks.authorize_deliver
            for group in groups:
                sub = group.pick(None, None if authorize is None else
                                 (lambda s: authorize(s, msg) is not False))
                if sub is not None:
                    deliver(sub.session, msg, mqos if mqos < sub.qos else sub.qos,
                            msg.retain and sub.retain_as_published,
                            (sub.sub_id,) if sub.sub_id else (), group)
        finally:
            msg.encodings = False
        return True

    def _deliver(self, session, msg, qos, retain, sub_ids, group=None):
        hooks = self.hooks
        if hooks.authorize_deliver is not None and hooks.authorize_deliver(session, msg) is False:
            return
        conn = session.conn
        if not qos:
            if conn is None:
                if self.queue_qos0 and session.expiry_interval:
                    self._enqueue(session, Outgoing(msg, 0, retain, sub_ids, group))
                return
            if conn.congested:
                self.stats.pub_dropped += 1
                session.dropped += 1
                if hooks.on_message_dropped is not None:
                    hooks.on_message_dropped(session, msg, "congested")
                return
            if session.retained_due is not None:  # behind the retained messages still to send
                self._enqueue(session, Outgoing(msg, 0, retain, sub_ids, group))
                return
            if session.alias_out_max or session.max_packet_out or msg.expiry is not None or \
                    (sub_ids and session.v5):
                self._write_publish(session, msg, 0, retain, sub_ids, 0, False)
                return
            conn.send(msg.encode_qos0(session.v5, retain))
            self.stats.pub_sent += 1
            return
        if session.stored:
            if msg.offset < 0 and self.persist is not None and not self.disk_low:
                # Not recorded for readers, but this persistent session is owed it: the
                # log is where owed messages survive a restart. While the disk is low
                # (what other nodes forward, wills) it is owed from memory only: a
                # write the disk cannot take would stop the broker.
                self.persist.store.append(msg, 0, private=True)
                if session.resume_from is not None and group is None:
                    # The session reads the log from before this record when it catches
                    # up (after a crash, with messages still owed): it takes the message
                    # there, as `route` leaves every logged message to it, not twice.
                    self.dirty.add(session)
                    return
        out = Outgoing(msg, qos, retain, sub_ids, group)
        if session.stored:
            self.dirty.add(session)
            if group is not None and msg.offset >= 0:
                self.persist.shared_queued(session, out)
        if conn is not None and not session.queue and len(session.inflight) < session.send_quota \
                and not conn.congested and session.inflight_bytes + out.size <= self.max_inflight_bytes \
                and session.retained_due is None:
            self._send_outgoing(session, out)
        else:
            self._enqueue(session, out)

    def _send_outgoing(self, session, out):
        pid = session.allocate_pid()
        session.inflight[pid] = out
        session.inflight_bytes += out.size
        out.packet_id = pid
        msg = out.msg
        if out.qos == 2 and session.stored and msg.offset >= 0:
            self.persist.qos2_out(session, out, 0)
        if not self._write_publish(session, msg, out.qos, out.retain, out.sub_ids, pid, out.maybe_sent):
            session.take_inflight(pid)

    def _queue_push(self, session, out):
        if session.queue.__class__ is tuple:
            session.queue = deque()
        session.queue.append(out)
        session.queued_bytes += out.size
        msg = out.msg
        self.queued_bytes += _entry_cost(msg)
        msg.held += 1

    def _queue_pop(self, session):
        out = session.queue.popleft()
        session.dequeued += 1
        session.queued_bytes -= out.size
        self._let_go(out.msg)
        return out

    def _let_go(self, msg):
        msg.held -= 1
        if msg.held:
            self.queued_bytes -= QUEUE_ENTRY_COST
        else:
            self.queued_bytes -= QUEUE_ENTRY_COST + msg.memory()

    def _clear_queue(self, session):
        for out in session.queue:
            self._let_go(out.msg)
        session.queued_bytes = 0
        session.queue = ()

    def _enqueue(self, session, out):
        n = len(session.queue)
        full = n >= self.max_queued or session.queued_bytes + out.size > self.max_queued_bytes \
            or self.queued_bytes + _entry_cost(out.msg) > self.queue_memory
        if full or (n >= self.max_queued_offline and session.conn is None):
            if session.stored and _from_the_log(out):
                # The log keeps it: read it back from there once the queue drains. (An
                # offline session holds only max_queued_offline in memory: devices that
                # come and go would otherwise keep max_queued_messages each; make soak.)
                if session.resume_from is None:
                    session.resume_from = out.msg.offset
                return
            if full:
                self._dropped(session, out)
                return
        self._queue_push(session, out)

    def _trim_offline_queue(self, session):
        """A session whose client left while behind keeps max_queued_offline messages in
        memory, as one that was offline all along does (`_enqueue`): the newest of its
        queue, from the first past that bound, are let go and read back from the log
        when it returns (`catch_up`). Only a tail the log gives back as it was
        (`_from_the_log`), and not while QoS 0 messages are queued for offline sessions,
        which the catch-up would then deliver a second time. The cursor it saves next
        (`session_offline`) does not move: what it lets go is newer than what it keeps."""
        if self.queue_qos0 or not session.stored:
            return
        queue = session.queue
        keep = self.max_queued_offline
        cut = len(queue)
        while cut > keep:
            out = queue[cut - 1]
            if not _from_the_log(out):
                break
            cut -= 1
        if cut == len(queue):
            return
        first = queue[cut].msg.offset
        while len(queue) > cut:
            out = queue.pop()
            session.queued_bytes -= out.size
            self._let_go(out.msg)
        if session.resume_from is None or first < session.resume_from:
            session.resume_from = first

    def _dropped(self, session, out):
        session.dropped += 1
        self.stats.pub_dropped += 1
        if self.hooks.on_message_dropped is not None:
            self.hooks.on_message_dropped(session, out.msg, "queue_full")
        if out.group is not None and session.stored and out.msg.offset >= 0:
            self.persist.shared_done(session, out)

    def drain(self, session, retained_turn=False):
        """Move queued messages into the window while the client can take them.

        A session that has more waiting in the commit log than in memory reads the
        next stretch of the log when its queue runs dry (`catch_up`). The retained
        messages a SUBSCRIBE matched go out where they stand in the queue, on the
        loop turn's timer for them (`retained_turn`; `_send_retained`).
        """
        conn = session.conn
        queue = session.queue
        inflight = session.inflight
        now = self.clock()
        resend = session.resend
        while resend and conn is not None and not conn.congested and \
                len(inflight) - len(resend) < session.send_quota:
            self._resend(session, resend.popleft())
        if resend:
            return
        if not queue and session.resume_from is not None and conn is not None:
            self.catch_up(session)
            queue = session.queue
        max_bytes = self.max_inflight_bytes
        authorize = self.hooks.authorize_deliver
        work = 0
        while conn is not None and not conn.congested:
            due = session.retained_due
            if due is not None and (not queue or session.dequeued >= next(iter(due.values())).until):
                if not retained_turn:
                    self._send_retained_soon(session)
                    break
                work = self._send_retained(session, work)
                if work < 0:
                    break
                continue
            if not queue:
                break
            out = queue[0]
            msg = out.msg
            if msg.expiry is not None and now >= msg.expiry:
                self._queue_pop(session)
                self.stats.expired += 1
                if out.group is not None and session.stored and msg.offset >= 0:
                    self.persist.shared_done(session, out)
                continue
            if authorize is not None and authorize(session, msg) is False:
                # Queued (or read back from the log) before a permission change.
                self._queue_pop(session)
                self.stats.denied_deliver += 1
                if out.group is not None and session.stored and msg.offset >= 0:
                    self.persist.shared_done(session, out)
                continue
            if not out.qos:
                self._queue_pop(session)
                self._write_publish(session, msg, 0, out.retain, out.sub_ids, 0, False)
                continue
            if len(inflight) >= session.send_quota or (
                    inflight and session.inflight_bytes + out.size > max_bytes):
                break
            self._queue_pop(session)
            self._send_outgoing(session, out)
            if not queue and session.resume_from is not None:
                self.catch_up(session)
                queue = session.queue

    def catch_up(self, session, max_records=2000):
        """Queue the session's next messages from the commit log (after a crash, a long
        absence or a queue overflow); live routing resumes once it reaches the log end."""
        persist = self.persist
        start = session.resume_from
        if persist is None or start is None:
            return
        want = max(64, session.send_quota - len(session.inflight))
        queued = 0
        scanned = 0
        skip = session.skip_offsets
        while scanned < max_records and queued < want:
            items = persist.read(start, 500)
            if not items:
                if start < persist.start_offset:
                    start = persist.start_offset  # deleted by retention (counted there)
                    continue
                if start < persist.next_offset and start < persist.store.written_through:
                    start += 500  # a damaged stretch of the log (logged by the reader): skip it
                    scanned += 500
                    continue
                break
            for item in items:
                off = item.offset
                start = off + 1
                scanned += 1
                if skip and off in skip:
                    skip.discard(off)
                    continue
                hit = self._session_match(session, item.topic, off)
                if hit is None:
                    continue
                sqos, rap, ids, no_local = hit
                if no_local and item.client_id == session.client_id:
                    continue
                q = item.qos if item.qos < sqos else sqos
                if not q and not self.queue_qos0:
                    continue
                msg = item if isinstance(item, Message) else persist.message_from_record(item)
                out = Outgoing(msg, q, msg.retain and rap, ids)
                out.maybe_sent = off < session.replay_dup_below
                self._queue_push(session, out)
                queued += 1
        if start >= persist.next_offset:
            session.resume_from = None
            session.skip_offsets = None
        else:
            session.resume_from = start
            if not queued:
                # Nothing for it in this stretch: continue on the next loop turn.
                self._schedule(self.clock(), _CATCH_UP, session)
        if session.stored:
            self.dirty.add(session)

    def _session_match(self, session, topic, offset):
        """(qos, retain-as-published, subscription ids, all no-local) of the session's
        non-shared subscriptions matching `topic` that existed at `offset`, or None."""
        cache = session.match_cache
        if cache is None:
            cache = session.match_cache = {}
        subs = cache.get(topic)
        if subs is None:
            subs = cache[topic] = [s for s in session.subscriptions.values()
                                   if s.group is None and topic_matches(s.filter, topic)]
            if len(cache) > 10000:
                cache.clear()
        qos = -1
        rap = False
        ids = []
        nl = True
        for s in subs:
            if offset < s.since:
                continue
            if s.qos > qos:
                qos = s.qos
            rap = rap or s.retain_as_published
            if s.sub_id:
                ids.append(s.sub_id)
            nl = nl and s.no_local
        if qos < 0:
            return None
        return qos, rap, tuple(sorted(ids)), nl

    def _write_publish(self, session, msg, qos, retain, sub_ids, pid, dup):
        """Encode and send one PUBLISH (general path); False if it had to be dropped."""
        v5 = session.v5
        now = self.clock()
        if msg.expiry is not None and now >= msg.expiry:
            self.stats.expired += 1
            return False
        ids = sub_ids if v5 else ()
        alias = None
        alias_only = False
        if session.alias_out_max:
            alias = session.alias_out.get(msg.topic)
            if alias is not None:
                alias_only = True
            elif len(session.alias_out) < session.alias_out_max:
                alias = len(session.alias_out) + 1
                session.alias_out[msg.topic] = alias
        data = msg.encode(v5, qos, retain, pid, dup, ids, now, alias, alias_only)
        if session.max_packet_out and len(data) > session.max_packet_out:
            self.stats.pub_dropped += 1
            session.dropped += 1
            if self.hooks.on_message_dropped is not None:
                self.hooks.on_message_dropped(session, msg, "too_large")
            if alias is not None and not alias_only:
                del session.alias_out[msg.topic]
            return False
        session.conn.send(data)
        self.stats.pub_sent += 1
        return True

    # --- broker-side API ---------------------------------------------------

    def set_disk_low(self, low):
        """[storage] min_free_bytes crossed (`low`) or cleared: QoS 1/2 PUBLISHes are refused
        meanwhile (handle_publish), and the match cache, which says which topics the log
        records, is rebuilt without the log or with it again."""
        self.disk_low = low
        self._matches.clear()

    def publish_internal(self, topic, payload, qos=0, retain=False, properties=None, client=None):
        """Publish as the broker itself ($SYS, the embedding application), or on behalf of
        `client` (a ClientInfo, e.g. a bridge's: the log records its client id, and
        on_publish hooks see it as the publisher). Authorization is the caller's."""
        props = dict(properties) if properties else {}
        cid = client.client_id if client is not None else ""
        msg = self._new_message(topic, payload, qos, retain, props, cid, client, time.time())
        return self.publish(msg)

    def disconnect_client(self, client_id, reason=C.ADMINISTRATIVE_ACTION, end_session=False):
        """An operator's kick (the admin API): close client `client_id`'s connection, a 5.0
        client told DISCONNECT `reason` first, and with `end_session` end its session as well
        (a will it left is published then, as whenever a session ends). Without it the
        session stays for the client's return, as after any lost connection. Returns False
        when no session here has that client id."""
        session = self.sessions.get(client_id)
        if session is None:
            return False
        conn = session.conn
        if conn is not None:
            log.info("client %s: disconnected by an operator%s", client_id,
                     " (session ended)" if end_session else "")
            if end_session:
                session.expiry_interval = 0  # connection_lost ends it once the connection is gone
            conn.close(reason)
        elif end_session:
            log.info("session %s ended by an operator", client_id)
            self.end_session(session)
        return True

    def disconnect_all(self, reason=C.SERVER_SHUTTING_DOWN):
        for session in list(self.sessions.values()):
            if session.conn is not None:
                session.conn.close(reason)

    def subscription_count(self):
        return self.subs.count + sum(len(g.members) for _, _, g in self.shared.items())
