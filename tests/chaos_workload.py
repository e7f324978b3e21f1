"""MQTT load that keeps going across node faults: persistent publishers and subscribers.

The clients speak MQTT over plain sockets with the project's own codec (a thread each),
not paho: a fault test must know exactly which message was acknowledged and which was not,
and must resend exactly as the protocol says. paho 2.x turns a QoS 2 message that waits for
PUBCOMP into a new PUBLISH after a second failed reconnect (a duplicate no broker can tell
from a new message; tests/test_crash.py works around it), and it reconnects only to the
address it was given.

Every client has a persistent session (3.1.1 clean session 0; 5.0 clean start 0 with a
session expiry of an hour). When its connection is lost (closed, refused, or silent for
DEAD_AFTER seconds: PINGREQ goes every second) it reconnects with clean start 0, to its
home node only (`failover="home"`: what a cluster without replication can serve, the
sessions being on their node's disk) or to the next node in the list that answers
(`failover="any"`). With session present 1 a publisher sends again what was not
acknowledged (PUBLISH with DUP, or PUBREL for QoS 2 past PUBREC); with session present 0
it sends its unacknowledged PUBLISHes as new messages and counts the QoS 2 ones already
past PUBREC as released (the broker took them; their PUBCOMP will not come). A
subscriber given session present 0 subscribes again, and one at QoS 2 remembers the
packet ids it answered PUBREC to until their PUBREL, so a QoS 2 message sent again with
DUP is not taken twice.

Payloads are "<publisher>:<seq>". Every RETAIN_EVERY-th message of a publisher is a retained
change of `<prefix>/r/<publisher>` (every CLEAR_EVERY-th of those a clear), the others go
to `<prefix>/m/<publisher>`; subscribers take `<prefix>/m/#`.
"""

import collections
import socket
import threading
import time
import uuid

from chaos_checker import PublisherLog, SubscriberLog, count_missing
from wrenmq.mqtt import constants as C
from wrenmq.mqtt.codec import Decoder, MQTTError, encode
from wrenmq.mqtt.packets import (Connect, Disconnect, Pingreq, Puback, Pubcomp, Publish, Pubrec, Pubrel,
                                 Subscribe, SubscribeTopic)

KEEPALIVE = 10  # seconds, in CONNECT (the clients ping every second)
PING_EVERY = 1.0
DEAD_AFTER = 6.0  # seconds without a packet from the broker: the connection is dead
CONNACK_WAIT = 5.0
SESSION_EXPIRY = 3600
RETAIN_EVERY = 10
CLEAR_EVERY = 4


class ConnectionDead(Exception):
    pass


class _Client:
    """A persistent MQTT session over a socket, on its own thread; subclasses add what they
    send (`step`) and take (`on_packet`), and what they do on a new connection."""

    def __init__(self, cid, version, addresses, home, failover):
        assert failover in ("home", "any"), failover
        self.cid, self.version = cid, version
        self.addresses, self.home, self.failover = addresses, home, failover
        self.node = None  # where it is connected (or was last)
        self.sock = None
        self.decoder = None
        self.lock = threading.Lock()
        self.connects = []  # (at, node, session present)
        self.taken_over = []  # (at, node) of each DISCONNECT "session taken over" (5.0)
        self.anomalies = []  # packets no broker should have sent
        self._last_in = self._last_out = 0.0
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=cid)
        self._next_id = 1
        self._backlog = []  # packets read with the CONNACK, not handled yet

    def start(self):
        self._thread.start()

    def stop(self, timeout=10):
        self._stopping.set()
        self._thread.join(timeout)

    # --- the connection -----------------------------------------------------------------

    def _candidates(self):
        if self.failover == "home":
            return [self.home]
        names = list(self.addresses)
        i = (names.index(self.node) + 1) if self.node in names else names.index(self.home)
        return names[i % len(names):] + names[:i % len(names)]

    def _send(self, pkt):
        self.sock.sendall(encode(pkt, self.version))
        self._last_out = time.monotonic()

    def _connect(self):
        """Try the candidate nodes once each; True once one gave CONNACK success."""
        for name in self._candidates():
            if self._stopping.is_set():
                return False
            try:
                sock = socket.create_connection(("127.0.0.1", self.addresses[name]), timeout=2)
            except OSError:
                continue
            self.sock, self.decoder, self.node, self._backlog = sock, Decoder(self.version), name, []
            props = {"session_expiry_interval": SESSION_EXPIRY} if self.version == C.MQTT5 else None
            try:
                self._send(Connect(self.cid, version=self.version, clean_start=False, keepalive=KEEPALIVE,
                                   properties=props))
                ack = self._read_until(C.CONNACK, CONNACK_WAIT)
            except (OSError, ConnectionDead, MQTTError):
                self._close()
                continue
            if ack.reason_code != 0:
                self._close()
                continue
            self._last_in = time.monotonic()
            with self.lock:
                self.connects.append((time.time(), name, bool(ack.session_present)))
                self.connected(bool(ack.session_present))
            return True
        return False

    def _read_until(self, ptype, wait):
        """The next packet of type `ptype`; those after it in the same read wait in
        `_backlog` (a session's queued messages can come with its CONNACK)."""
        deadline = time.monotonic() + wait
        while True:
            packets = self._read(max(0.01, deadline - time.monotonic()))
            for i, pkt in enumerate(packets):
                if pkt.TYPE == ptype:
                    self._backlog = packets[i + 1:]
                    return pkt
            if time.monotonic() >= deadline:
                raise ConnectionDead(f"no packet {ptype} within {wait} s")

    def _read(self, wait):
        self.sock.settimeout(wait)
        try:
            data = self.sock.recv(65536)
        except socket.timeout:
            return []
        if not data:
            raise ConnectionDead("closed by the broker")
        self._last_in = time.monotonic()
        return self.decoder.feed(data)

    def _close(self):
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = None

    def _run(self):
        backoff = 0.1
        while not self._stopping.is_set():
            if self.sock is None:
                if not self._connect():
                    time.sleep(backoff)
                    backoff = min(1.0, backoff * 2)
                    continue
                backoff = 0.1
            try:
                with self.lock:
                    self.step()
                packets, self._backlog = self._backlog + self._read(0.05), []
                with self.lock:
                    for pkt in packets:
                        self.on_packet(pkt)
                now = time.monotonic()
                if now - self._last_in > DEAD_AFTER:
                    raise ConnectionDead("silent")
                if now - self._last_out > PING_EVERY:
                    self._send(Pingreq())
            except (OSError, ConnectionDead, MQTTError):
                self._close()
        if self.sock is not None:
            try:
                with self.lock:
                    self.finish()
                self._send(Disconnect())
            except OSError:
                pass
            self._close()

    def packet_id(self, in_use):
        for _ in range(65535):
            pid = self._next_id
            self._next_id = pid % 65535 + 1
            if pid not in in_use:
                return pid
        raise RuntimeError("no free packet id")

    # --- what subclasses do -----------------------------------------------------------------

    def connected(self, session_present):
        pass

    def step(self):
        pass

    def on_packet(self, pkt):
        if pkt.TYPE == C.DISCONNECT:
            if pkt.reason_code == C.SESSION_TAKEN_OVER:  # (this client never has two connections)
                self.taken_over.append((time.time(), self.node))
            raise ConnectionDead(f"DISCONNECT {pkt.reason_code:#x}")
        if pkt.TYPE not in (C.PINGRESP,):
            self.anomalies.append(repr(pkt)[:200])

    def finish(self):
        pass


class Publisher(_Client):
    """Sends `rate` messages a second at `qos`, at most `window` unacknowledged."""

    def __init__(self, name, version, qos, addresses, home, prefix, *, rate=10.0, window=10, failover="home",
                 cid=None):
        super().__init__(cid or f"{prefix.replace('/', '-')}-{name}", version, addresses, home, failover)
        self.name, self.qos, self.prefix = name, qos, prefix
        self.rate, self.window = rate, window
        self.log = PublisherLog(name, qos)
        self.inflight = collections.OrderedDict()  # packet id -> [seq, "publish" | "pubrel"]
        self.retry = collections.deque()  # seqs refused, to send again as new messages
        self.next_seq = 0
        self.publishing = True
        self._due = None

    def message(self, seq):
        """(topic, payload, retain) of message `seq`."""
        if seq % RETAIN_EVERY == RETAIN_EVERY - 1:
            clear = (seq // RETAIN_EVERY) % CLEAR_EVERY == CLEAR_EVERY - 1
            return f"{self.prefix}/r/{self.name}", b"" if clear else f"{self.name}:{seq}".encode(), True
        return f"{self.prefix}/m/{self.name}", f"{self.name}:{seq}".encode(), False

    def _publish(self, pid, seq, dup):
        _, topic, payload, retain = self.log.sent[seq]
        self._send(Publish(topic, payload, self.qos, retain, dup, pid))

    def connected(self, session_present):
        for pid, (seq, stage) in list(self.inflight.items()):
            if stage == "pubrel":
                if session_present:
                    self._send(Pubrel(pid))
                else:  # the broker took it (PUBREC); the session that would say PUBCOMP is gone
                    self.log.released.add(seq)
                    del self.inflight[pid]
            else:
                self._publish(pid, seq, dup=session_present)

    def step(self):
        now = time.monotonic()
        if self._due is None:
            self._due = now
        while self.retry and len(self.inflight) < self.window:
            seq = self.retry.popleft()
            pid = self.packet_id(self.inflight)
            self.inflight[pid] = [seq, "publish"]
            self._publish(pid, seq, dup=False)
        while self.publishing and len(self.inflight) < self.window and now >= self._due:
            seq = self.next_seq
            self.next_seq += 1
            self._due = max(self._due + 1.0 / self.rate, now - 1.0)
            self.log.sent[seq] = (time.time(), *self.message(seq))
            pid = self.packet_id(self.inflight)
            self.inflight[pid] = [seq, "publish"]
            self._publish(pid, seq, dup=False)

    def on_packet(self, pkt):
        t = pkt.TYPE
        if t not in (C.PUBACK, C.PUBREC, C.PUBCOMP):
            return super().on_packet(pkt)
        entry = self.inflight.get(pkt.packet_id)
        want = {C.PUBACK: (1, "publish"), C.PUBREC: (2, "publish"), C.PUBCOMP: (2, "pubrel")}[t]
        if entry is None or (self.qos, entry[1]) != want:
            if t == C.PUBREC:  # (answered as the protocol says, so the broker can let the id go)
                self._send(Pubrel(pkt.packet_id, 0x92 if self.version == C.MQTT5 else 0))
            self.anomalies.append(f"unexpected {pkt!r}"[:200])
            return
        seq = entry[0]
        # A failure code refuses a PUBLISH (PUBACK, PUBREC: sent again shortly as a new
        # message), never a PUBREL: past PUBREC the broker owns the message and the client
        # must not publish it again (MQTT-4.3.3-4). PUBCOMP 0x92 (packet id not found) says
        # the release reached the broker before (its PUBCOMP was lost with a connection):
        # the exchange is over, and the message counts as acknowledged (owed to subscribers).
        if pkt.reason_code >= 0x80 and t != C.PUBCOMP:
            del self.inflight[pkt.packet_id]
            self.log.refused += 1
            self.retry.append(seq)
        elif t == C.PUBREC:
            entry[1] = "pubrel"
            self._send(Pubrel(pkt.packet_id))
        else:
            del self.inflight[pkt.packet_id]
            self.log.acked.setdefault(seq, time.time())

    def stop_publishing(self):
        with self.lock:
            self.publishing = False
            self.log.stopped_at = time.time()

    @property
    def pending(self):
        with self.lock:
            return len(self.inflight) + len(self.retry)

    def snapshot(self):
        with self.lock:
            log = self.log
            return PublisherLog(log.name, log.qos, dict(log.sent), dict(log.acked), set(log.released),
                                log.refused, list(self.connects), log.stopped_at, list(self.taken_over))


class Subscriber(_Client):
    """Subscribed to `flt` at `qos` from its first connection on; records every PUBLISH."""

    def __init__(self, name, version, qos, addresses, home, flt, *, failover="home", cid=None, prefix=""):
        super().__init__(cid or f"{prefix.replace('/', '-')}-{name}", version, addresses, home, failover)
        self.name, self.qos, self.filter = name, qos, flt
        self.log = SubscriberLog(name, qos, flt)
        self.awaiting_rel = set()  # QoS 2 packet ids answered PUBREC, before their PUBREL
        self.subscribed = threading.Event()
        self._suback_id = None

    def connected(self, session_present):
        if not session_present:
            self.awaiting_rel.clear()
        if not session_present or self.log.subscribed_at is None:
            self._suback_id = self.packet_id(())
            self._send(Subscribe(self._suback_id, [SubscribeTopic(self.filter, self.qos)]))

    def on_packet(self, pkt):
        t = pkt.TYPE
        if t == C.PUBLISH:
            give = pkt.qos < 2 or pkt.packet_id not in self.awaiting_rel
            if give:
                self.log.deliveries.append((time.time(), pkt.topic, bytes(pkt.payload), pkt.qos, bool(pkt.retain),
                                            bool(pkt.dup), self.node, pkt.packet_id))
            if pkt.qos == 1:
                self._send(Puback(pkt.packet_id))
            elif pkt.qos == 2:
                self.awaiting_rel.add(pkt.packet_id)
                self._send(Pubrec(pkt.packet_id))
        elif t == C.PUBREL:
            self.awaiting_rel.discard(pkt.packet_id)
            self._send(Pubcomp(pkt.packet_id))
        elif t == C.SUBACK:
            if pkt.packet_id == self._suback_id and all(rc < 0x80 for rc in pkt.reason_codes):
                if self.log.subscribed_at is None:
                    self.log.subscribed_at = time.time()
                self.subscribed.set()
            else:
                self.anomalies.append(f"SUBACK {pkt!r}"[:200])
        else:
            super().on_packet(pkt)

    @property
    def delivered(self):
        with self.lock:
            return len(self.log.deliveries)

    def snapshot(self):
        with self.lock:
            log = self.log
            return SubscriberLog(log.name, log.qos, log.filter, log.subscribed_at, list(log.deliveries),
                                 list(self.connects), list(self.taken_over))


class Workload:
    """Publishers and persistent subscribers over the nodes at `addresses` ({node: MQTT
    port}). By default, on every node: a 3.1.1 subscriber at QoS 1 and a 5.0 one at QoS 2,
    and a 3.1.1 publisher at QoS 1 and a 5.0 one at QoS 2, each publisher sending `rate`
    messages a second."""

    def __init__(self, addresses, *, prefix=None, rate=10.0, window=10, failover="home", nodes=None):
        self.addresses = dict(addresses)
        self.prefix = prefix or f"chaos/{uuid.uuid4().hex[:8]}"
        self.client_prefix = f"{self.prefix.replace('/', '-')}-"  # of every client id of the workload
        homes = nodes or list(self.addresses)
        flt = f"{self.prefix}/m/#"
        self.subscribers = [Subscriber(f"s{n}{q}", v, q, self.addresses, n, flt, failover=failover,
                                       prefix=self.prefix)
                            for n in homes for v, q in ((C.MQTT311, 1), (C.MQTT5, 2))]
        self.publishers = [Publisher(f"p{n}{q}", v, q, self.addresses, n, self.prefix, rate=rate, window=window,
                                     failover=failover)
                           for n in homes for v, q in ((C.MQTT311, 1), (C.MQTT5, 2))]
        self.started_at = None
        self.stopped_at = None

    @property
    def clients(self):
        return [*self.subscribers, *self.publishers]

    def start(self, timeout=30, warmup=1.0):
        """Subscribers first (until each has its SUBACK), then, `warmup` seconds later (the
        routes are on every node by SUBACK; the pause is margin), the publishers."""
        for s in self.subscribers:
            s.start()
        deadline = time.monotonic() + timeout
        for s in self.subscribers:
            assert s.subscribed.wait(max(0.1, deadline - time.monotonic())), f"{s.name} could not subscribe"
        time.sleep(warmup)
        self.started_at = time.time()
        for p in self.publishers:
            p.start()
        return self

    def stop_publishing(self):
        self.stopped_at = time.time()
        for p in self.publishers:
            p.stop_publishing()

    def drain(self, timeout=60):
        """Wait until every publisher's messages are acknowledged; how many are not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(p.pending for p in self.publishers):
            time.sleep(0.1)
        return sum(p.pending for p in self.publishers)

    def snapshot(self):
        return [p.snapshot() for p in self.publishers], [s.snapshot() for s in self.subscribers]

    def missing(self):
        return count_missing(*self.snapshot())

    def settle(self, quiet=3.0, timeout=60):
        """Wait until every subscriber has everything it is owed, or nothing was delivered
        for `quiet` seconds (what is missing then is lost), at most `timeout`; the count
        still missing."""
        deadline = time.monotonic() + timeout
        last, last_change = None, time.monotonic()
        while True:
            missing = self.missing()
            count = sum(s.delivered for s in self.subscribers)
            now = time.monotonic()
            if count != last:
                last, last_change = count, now
            if not missing or now - last_change >= quiet or now >= deadline:
                return missing
            time.sleep(0.25)

    def connected(self):
        """{client id: the node it is connected to} of the clients connected now."""
        out = {}
        for c in self.clients:
            with c.lock:
                if c.sock is not None:
                    out[c.cid] = c.node
        return out

    def anomalies(self):
        return {c.cid: list(c.anomalies) for c in self.clients if c.anomalies}

    def close(self, end_sessions=True):
        """Stop every client (DISCONNECT); with `end_sessions`, end their sessions too (a
        clean start with each client id), so the cluster keeps none of them."""
        for c in self.clients:
            c._stopping.set()
        for c in self.clients:
            c.stop()
        if end_sessions:
            for c in self.clients:
                end_session(c.addresses, c.node or c.home, c.cid, c.version)


def _session(port, cid, version, clean, timeout=5.0):
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.sendall(encode(Connect(cid, version=version, clean_start=clean, keepalive=30), version))
    decoder, deadline = Decoder(version), time.monotonic() + timeout
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = sock.recv(65536)
        if not data:
            break
        for pkt in decoder.feed(data):
            if pkt.TYPE == C.CONNACK:
                return sock, decoder, pkt
    sock.close()
    raise ConnectionError(f"no CONNACK for {cid}")


def end_session(addresses, node, cid, version):
    """End `cid`'s session wherever it is (a clean start 1 on `node` or, if it does not
    answer, any other node); False if no node answered."""
    for name in [node, *[n for n in addresses if n != node]]:
        try:
            sock, _, _ = _session(addresses[name], cid, version, clean=True)
        except OSError:
            continue
        sock.sendall(encode(Disconnect(), version))
        sock.close()
        return True
    return False


def retained_state(port, prefix, wait=0.5):
    """{topic: payload} of the retained messages under `<prefix>/r/` a node gives a new
    subscription (clean session; waits `wait` seconds after the SUBACK for them)."""
    sock, decoder, _ = _session(port, f"retained-{uuid.uuid4().hex[:8]}", C.MQTT5, clean=True)
    out = {}
    try:
        sock.sendall(encode(Subscribe(1, [SubscribeTopic(f"{prefix}/r/#", 1)]), C.MQTT5))
        deadline, give_up = None, time.monotonic() + 10
        while time.monotonic() < (give_up if deadline is None else deadline):
            sock.settimeout(0.1 if deadline is None else max(0.01, deadline - time.monotonic()))
            try:
                data = sock.recv(65536)
            except socket.timeout:
                continue
            if not data:
                break
            for pkt in decoder.feed(data):
                if pkt.TYPE == C.SUBACK:
                    deadline = time.monotonic() + wait
                elif pkt.TYPE == C.PUBLISH:
                    if pkt.retain:
                        out[pkt.topic] = bytes(pkt.payload)
                    if pkt.qos == 1:
                        sock.sendall(encode(Puback(pkt.packet_id), C.MQTT5))
        sock.sendall(encode(Disconnect(), C.MQTT5))
    finally:
        sock.close()
    return out
