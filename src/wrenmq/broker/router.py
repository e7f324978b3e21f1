"""The router: sessions, CONNECT and takeover, the packet handlers, and routing.

Connections hand it decoded packets; it answers by writing bytes to the
connections involved. It never awaits and never touches a socket: time comes
from `clock`, timers are a heap the broker drives through `tick()`, and every
accepted message passes through `publish()`, the one append point where the
commit log and the cluster sit, then `route()`, which finds its subscribers
through a match cache.
"""

import logging
import time

from ..mqtt import constants as C
from ..mqtt.acks import PINGRESP, puback, pubcomp, pubrec, pubrel
from ..mqtt.codec import ConnectRefused, MQTTError, encode
from ..mqtt.packets import Puback, Pubrec, Suback, Unsuback
from ..mqtt.topics import topic_matches
from .catchup import catch_up
from .connect import ConnectTerms
from .delivery import Delivery
from .message import Message, message_properties
from .queues import Queues
from .retained import RetainedDelivery, RetainedStore
from .session import NEVER, Session, Subscription
from .shared import take_unacknowledged
from .states import dispatch_table
from .stats import Stats
from .subscriptions import Subscriptions
from .timers import TimerKind, Timers
from .topics import RetainedTrie
from .wills import Wills

log = logging.getLogger("wrenmq.router")


class Router:
    """Sessions, subscriptions and retained messages, and every message's way to its
    subscribers. The parts it is made of own their state, each in a module of its own:
    `subscriptions` (with the shared groups), `delivery`, `queues`, `retained_store`
    and `retained_delivery`, `wills`, `timers`, `connect_terms`, `stats`; catching a
    session up from the log is catchup.py."""

    def __init__(self, config, hooks, clock=time.monotonic):
        self.cfg = config
        self.limits = config.limits
        self.hooks = hooks
        self.clock = clock
        self.sessions = {}  # client id -> Session
        self.stats = Stats()
        self.subscriptions = Subscriptions(config, hooks, self.stats)
        self.retained = RetainedTrie()  # topic -> its retained message
        self._matches = {}  # topic -> (normal targets, shared groups, the log's handle, raw record allowed)
        self.dirty = set()  # stored sessions whose log cursor may have moved
        self.online = 0
        self.timers = Timers()  # the broker sets timers.on_change and calls tick()
        self.persist = None  # Persistence (commit log + state) when storage is on disk
        self.topic_log = None  # with it, the store's topic_log (the match cache's handle on a logged topic)
        self.cluster = None  # cluster.node.Cluster when [cluster] is on: other nodes' interest, links
        self._adopted = set()  # client ids of sessions handed over by another node, not yet stored here
        self.disk_low = False  # [storage] min_free_bytes crossed: no new messages (set_disk_low)
        self.insync_low = False  # [cluster] min_insync not met: no new QoS 1/2 messages (set_insync_low)
        self.maximum_qos = config.broker.maximum_qos
        self.retain_available = config.broker.retain_available
        self.connect_terms = ConnectTerms(config)
        self.queues = Queues(self.limits, config.broker.queue_qos0_messages)
        self.max_levels = self.limits.max_topic_levels
        lim = self.limits
        self.max_topic_length = lim.max_topic_length if lim.max_topic_length < 65535 else 0
        self.max_inflight_bytes = lim.max_inflight_bytes or float("inf")
        self.wills = Wills(self)
        self.retained_store = RetainedStore(self)
        self.retained_delivery = RetainedDelivery(self)
        self.delivery = Delivery(self)
        # Move what waits for a session into its window (Delivery.drain): after an
        # acknowledgement, and when a connection can take more.
        self.drain = self.delivery.drain
        self.rx_time = time.time()  # wall clock of the packets being handled (arrived())
        self.rx_us = int(self.rx_time * 1_000_000)
        # What an open connection calls per packet type (a list; None: AUTH, which the
        # connection handles; a protocol error for what a client may not send: states.py).
        self.handlers = dispatch_table({
            C.PUBLISH: self.handle_publish,
            C.PUBACK: self.handle_puback,
            C.PUBREC: self.handle_pubrec,
            C.PUBREL: self.handle_pubrel,
            C.PUBCOMP: self.handle_pubcomp,
            C.SUBSCRIBE: self.handle_subscribe,
            C.UNSUBSCRIBE: self.handle_unsubscribe,
            C.PINGREQ: self.handle_pingreq,
            C.DISCONNECT: self.handle_disconnect,
        })

    def arrived(self):
        """Packets of one read are about to be handled: read the wall clock once for them.

        A message's timestamp (the log's record time) is when its read arrived; one
        clock reading per read instead of one per message is 0.1-0.2 us less per message.
        """
        t = self.rx_time = time.time()
        self.rx_us = int(t * 1_000_000)

    # --- timers -------------------------------------------------------------

    def tick(self):
        """Act on every timer that is due; return the next deadline (or None)."""
        now = self.clock()
        for at, kind, session in self.timers.due(now):
            if kind == TimerKind.CATCH_UP:
                if session.conn is not None:
                    self.drain(session)
            elif kind == TimerKind.SEND_RETAINED:
                if session.retained_at == at:  # (not one set before the session's last stop)
                    session.retained_at = None
                    self.drain(session, True)
            elif session.conn is not None:
                continue
            elif kind == TimerKind.PUBLISH_WILL:
                if session.will_at is not None and session.will_at <= now:
                    self.wills.publish(session)
            elif kind == TimerKind.EXPIRE_SESSION:
                if session.expires_at is not None and session.expires_at <= now:
                    if self.sessions.get(session.client_id) is session:
                        log.info("session %s expired", session.client_id)
                        self.end_session(session)
        return self.timers.next_deadline()

    # --- connect / disconnect ----------------------------------------------

    def connect(self, conn, pkt, username, auth_props=None):
        """Accept an authenticated CONNECT: attach or create the session, send CONNACK.

        Returns the session, or None when the CONNECT was refused (CONNACK sent).
        """
        try:
            cid, keepalive, expiry, props = self.connect_terms.terms(pkt)
        except ConnectRefused as e:
            conn.refuse(e.version, e.reason)
            return None
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
            max_sessions = self.limits.max_sessions
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
        session.v5 = pkt.version == C.MQTT5
        session.conn = conn
        if self.cluster is not None and session.subscriptions:
            self.cluster.presence(session, True)
        session.expiry_interval = expiry
        session.expires_at = None
        self.wills.let_go(session)
        session.username = username
        session.address = conn.address
        session.listener = conn.listener_name
        session.connected_at = now
        self.connect_terms.apply_client_limits(session, pkt)
        session.will = self.wills.from_connect(pkt.will, cid, session) if pkt.will is not None else None
        conn.keepalive = keepalive
        self.online += 1
        self.stats.connects += 1
        if self.online > self.stats.clients_maximum:
            self.stats.clients_maximum = self.online

        connack = self.connect_terms.connack(pkt.version, present, props, auth_props)
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
            self.delivery.resume(session)
        self.hooks.on_connect(session)
        return session

    def _take_over(self, session, clean):
        old = session.conn
        log.info("client %s taken over by a new connection", session.client_id)
        old.session = None
        self.online -= 1
        session.conn = None
        if self.cluster is not None and session.subscriptions:
            self.cluster.presence(session, False)
        session.resend = ()
        self.retained_delivery.stop(session)
        if session.will is not None and (clean or not session.will_delay):
            self.wills.publish(session)
        session.will = None
        old.close(C.SESSION_TAKEN_OVER)

    def connection_lost(self, session, publish_will=True, reason=None):
        """The client's connection closed (any way other than takeover)."""
        session.conn = None
        if self.cluster is not None and session.subscriptions:
            self.cluster.presence(session, False)
        session.generation += 1
        session.resend = ()
        self.retained_delivery.stop(session)
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
            self.queues.trim_offline(session)
            self.persist.session_offline(session)
        if will is not None:
            self.wills.client_gone(session, now)
        if session.expiry_interval != NEVER:
            session.expires_at = now + session.expiry_interval
            self.timers.schedule(session.expires_at, TimerKind.EXPIRE_SESSION, session)

    def end_session(self, session, publish_will=True):
        """The session is over: publish a pending will, drop its state."""
        if publish_will and session.will is not None:
            self.wills.publish(session)
        session.will = None
        self.wills.let_go(session)
        subs = session.subscriptions
        if subs:
            for sub in subs.values():
                self.remove_subscription(session, sub)
            subs.clear()
            self._matches.clear()
        self.retained_delivery.stop(session)
        self.queues.clear(session)
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
        for out in take_unacknowledged(session, self.queues):
            sub = out.group.pick(exclude=session)
            if sub is None or sub.session.conn is None:
                # Nobody else online: keep it for this session.
                self.queues.push(session, out)
                continue
            if session.stored and out.msg.offset >= 0:
                self.persist.shared_done(session, out)
            q = out.msg.qos if out.msg.qos < sub.qos else sub.qos
            self.delivery.deliver(sub.session, out.msg, q, False, (sub.sub_id,) if sub.sub_id else (),
                                  out.group)

    # --- inbound packets ---------------------------------------------------

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
            if self.insync_low:
                self._refuse_insync_low(session, qos, pid)
                return
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
        sub_id = pkt.properties.get("subscription_identifier") if v5 else None
        codes = []
        retained = []
        hooks = self.hooks
        check = self.subscriptions.check
        cluster = self.cluster
        routes = cluster.route_seq if cluster is not None else 0
        for t in pkt.topics:
            group, flt, refused = check(session, t, sub_id)
            if refused is not None:
                codes.append(refused if v5 else 0x80)
                continue
            existed = t.filter in session.subscriptions
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
                self.remove_subscription(session, session.subscriptions[t.filter])
            session.subscriptions[t.filter] = sub
            self.add_subscription(session, sub)
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
            self.retained_delivery.start(session, retained)

    def add_subscription(self, session, sub):
        """Put `sub`, which `session` holds (in its `subscriptions`), where routing finds
        it (and, with a cluster, where the other nodes learn of it). The caller clears
        the match cache (`forget_matches`) once it has added what it adds."""
        session.match_cache = None
        self.subscriptions.add(session, sub)
        if self.cluster is not None:
            self.cluster.subscribed(sub.group, sub.filter, session.conn is not None)

    def remove_subscription(self, session, sub):
        """Undo `add_subscription` (the caller takes it out of the session's
        `subscriptions` and clears the match cache)."""
        session.match_cache = None
        self.subscriptions.remove(session, sub)
        if self.cluster is not None:
            self.cluster.unsubscribed(sub.group, sub.filter, session.conn is not None)

    def forget_matches(self):
        """Clear the match cache (topic -> subscribers): subscriptions were added or
        removed (`add_subscription`, `remove_subscription`)."""
        self._matches.clear()

    def handle_unsubscribe(self, session, pkt):
        codes = []
        stopped = False
        for f in pkt.filters:
            sub = session.subscriptions.pop(f, None)
            if sub is None:
                codes.append(C.NO_SUBSCRIPTION_EXISTED)
            else:
                self.remove_subscription(session, sub)
                if session.retained_due is not None and f in session.retained_due:
                    self.retained_delivery.stop(session, f)
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
        if msg.retain and (not msg.payload or not msg.client_id or not self.retained_store.refuses(msg)):
            self.retained_store.keep(msg)
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
        is owed it still gets it written, as Delivery.deliver does for any unrecorded message).
        """
        topic = msg.topic
        if sync:
            if self.retained_store.newer(topic, msg.timestamp, False):
                self.retained_store.keep(msg, False)
            return False
        if retained and (not replayed or self.retained_store.newer(topic, msg.timestamp, True)):
            self.retained_store.keep(msg)
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
            if session.resume_from is None or len(session.queue) >= self.queues.max_queued:
                break
            catch_up(self, session)
        return session

    def adopt_session(self, session, queued):
        """Take in a session another node handed over (`release_session` there); the
        CONNECT that asked for it resumes it next (session present 1)."""
        old = self.sessions.get(session.client_id)
        if old is not None:  # (held here after all: keep it)
            return
        self.sessions[session.client_id] = session
        for sub in session.subscriptions.values():
            self.add_subscription(session, sub)
        for out in queued:
            self.queues.push(session, out)
        self._adopted.add(session.client_id)
        self._matches.clear()

    def park_adopted(self, cid):
        """An adopted session whose CONNECT went away before it resumed: offline here,
        stored, expiring as any session does once its client disconnects, and in a
        cluster registered as this node's client, as its CONNECT would have."""
        session = self.sessions.get(cid)
        if session is None or session.conn is not None or cid not in self._adopted:
            return
        self._adopted.discard(cid)
        if session.expiry_interval == 0:
            self.end_session(session, publish_will=False)
            return
        if self.cluster is not None:
            # Held here now, and by no other node (the one that handed it over ended it):
            # the client's next CONNECT, wherever it goes, must be told to ask this node.
            self.cluster.client_connected(cid)
        persist = self.persist
        if persist is not None:
            # And stored, as a CONNECT that resumed it and went would have: a restart here
            # (or, replicated, the node that takes this one's log over) keeps it.
            persist.session_started(session, False)
            if session.stored:
                self._store_adopted(session)
                self.queues.trim_offline(session)
                persist.session_offline(session)
        if session.expiry_interval != NEVER:
            session.generation += 1
            session.expires_at = self.clock() + session.expiry_interval
            self.timers.schedule(session.expires_at, TimerKind.EXPIRE_SESSION, session)

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

    def _match(self, topic):
        """Match `topic` and keep the result in the match cache (`_matches`)."""
        normal, groups = self.subscriptions.match(topic)
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
        deliver = self.delivery.deliver
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

    # --- broker-side API ---------------------------------------------------

    def set_disk_low(self, low):
        """[storage] min_free_bytes crossed (`low`) or cleared: QoS 1/2 PUBLISHes are refused
        meanwhile (handle_publish), and the match cache, which says which topics the log
        records, is rebuilt without the log or with it again."""
        self.disk_low = low
        self._matches.clear()

    def set_insync_low(self, low):
        """With [cluster] replicas > 1: fewer than min_insync replicas hold this node's log in
        sync (`low`), or enough again. Meanwhile a QoS 1/2 PUBLISH is refused before it is
        logged: nothing is acknowledged that is not replicated."""
        self.insync_low = low

    def _refuse_insync_low(self, session, qos, pid):
        """MQTT 5: PUBACK / PUBREC 0x83 (implementation specific error: the PUBLISH is valid,
        the server does not take it now), with a reason string if the client accepts one;
        3.1.1 has no refusal: the connection closes and the client sends it again."""
        self.stats.refused_insync += 1
        if session.v5:
            props = {"reason_string": "not enough in-sync replicas"} if session.request_problem_info else None
            ack = (Puback if qos == 1 else Pubrec)(pid, C.IMPLEMENTATION_SPECIFIC_ERROR, props)
            session.conn.send(encode(ack, C.MQTT5))
        else:
            session.conn.close(C.IMPLEMENTATION_SPECIFIC_ERROR)

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

    def subscription_count(self):
        return self.subscriptions.count()

    @property
    def subscription_bytes(self):
        """What the subscriptions take in memory ($SYS/broker/subscriptions/bytes)."""
        return self.subscriptions.bytes

    @property
    def queued_bytes(self):
        """What the sessions' queues take in memory ($SYS/broker/store/messages/bytes)."""
        return self.queues.queued_bytes

    @property
    def held_will_bytes(self):
        """What the wills held for their delay take ($SYS/broker/wills/held bytes)."""
        return self.wills.held_bytes
