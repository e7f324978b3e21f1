"""What a cluster owed its clients through a fault, against what they got (sans-IO).

The workload (chaos_workload.py) hands over what each client saw, as plain records:

- `PublisherLog`: every message it sent (sequence number, when first sent, topic, payload,
  retain), which were acknowledged (PUBACK, or PUBCOMP at QoS 2) and when, and its
  connections (when, to which node, session present);
- `SubscriberLog`: its filter, when its subscription was first acknowledged (SUBACK), every
  PUBLISH it was given (topic, payload, QoS, retain, dup, the node) and its connections.

`check` applies the rules the high-availability work is held to:

- every acknowledged message is delivered to every subscriber whose subscription existed
  when it was published (first sent after the subscriber's first SUBACK), else it is *lost*;
- a message given twice at QoS 2 to one subscriber is a *duplicate* (QoS 1 ones are allowed
  and only counted);
- per publisher and subscriber, first deliveries come in the order sent (*out of order*
  counts each that comes after a later one);
- the retained message of each topic, as each node answers a new subscription, is the last
  acknowledged retained change (a later change not acknowledged may have landed too);
- at most one owner per client id: the figures the harness reads from the nodes and etcd
  at the end, and every DISCONNECT "session taken over" (0x8E) a client was given, which
  no node may send a workload client (it never opens a second connection);

and reports the clients' failovers (a reconnection landing on another node), the sessions
lost (CONNACK session present 0 to a client that had one) and the longest unavailability:
the longest time any publisher went without an acknowledgement while it had messages out.
"""

from dataclasses import dataclass, field


@dataclass
class PublisherLog:
    name: str
    qos: int
    sent: dict = field(default_factory=dict)  # seq -> (first sent at, topic, payload bytes, retain)
    acked: dict = field(default_factory=dict)  # seq -> acknowledged at
    released: set = field(default_factory=set)  # QoS 2 seqs past PUBREC whose session was lost before PUBCOMP
    refused: int = 0  # acknowledgements with a failure reason code (sent again later)
    connects: list = field(default_factory=list)  # (at, node, session present)
    stopped_at: float = None  # when it stopped sending new messages
    taken_over: list = field(default_factory=list)  # (at, node): DISCONNECT 0x8E, session taken over


@dataclass
class SubscriberLog:
    name: str
    qos: int
    filter: str
    subscribed_at: float = None  # first SUBACK
    deliveries: list = field(default_factory=list)  # (at, topic, payload, qos, retain, dup, node, packet id)
    connects: list = field(default_factory=list)
    taken_over: list = field(default_factory=list)


def topic_matches(flt, topic):
    """MQTT topic filter matching (no $-topic rules: the workload's topics have none)."""
    f, t = flt.split("/"), topic.split("/")
    for i, part in enumerate(f):
        if part == "#":
            return True
        if i >= len(t) or (part != "+" and part != t[i]):
            return False
    return len(f) == len(t)


def parse_payload(payload):
    """(publisher name, seq) of a workload payload, or None."""
    name, sep, seq = bytes(payload).decode("utf-8", "replace").rpartition(":")
    return (name, int(seq)) if sep and seq.isdigit() else None


@dataclass
class Report:
    acknowledged: int = 0  # messages acknowledged to publishers
    expected: int = 0  # (acknowledged message, subscriber) deliveries owed
    lost: int = 0
    duplicates: int = 0  # QoS 2 messages given twice (or more) to one subscriber: the extra copies
    qos1_repeats: int = 0  # QoS 1 messages given again (allowed)
    out_of_order: int = 0
    unknown: int = 0  # deliveries of nothing any publisher sent
    retained_bad: int = 0
    owners_bad: int = 0
    sessions_lost: int = 0
    failovers: int = 0
    reconnects: int = 0
    refused: int = 0
    unavailable: float = 0.0  # seconds: the longest time a publisher waited for an acknowledgement
    unavailable_who: str = ""
    protocol_errors: int = 0  # packets no broker should send (an ack for an id not in flight, ...)
    pending: int = 0  # messages still not acknowledged when the load ended
    # Set by the harness (cluster_harness.under_load): seconds from the fault's end until the
    # cluster was whole again (None: it was not), and how many times a node left it.
    recovery: float = 0.0
    nodes_left: int = 0
    details: list = field(default_factory=list)

    @property
    def ok(self):
        """True if nothing the cluster promises was broken."""
        return not (self.lost or self.duplicates or self.out_of_order or self.unknown or self.retained_bad
                    or self.owners_bad or self.protocol_errors or self.recovery is None)

    def summary(self):
        head = (f"acknowledged {self.acknowledged}, owed {self.expected}, lost {self.lost}, QoS 2 duplicates "
                f"{self.duplicates}, out of order {self.out_of_order}, unknown {self.unknown}, retained wrong "
                f"{self.retained_bad}, owners wrong {self.owners_bad}; sessions lost {self.sessions_lost}, "
                f"failovers {self.failovers}, reconnects {self.reconnects}, refused {self.refused}, longest "
                f"unavailability {self.unavailable:.1f} s ({self.unavailable_who}); QoS 1 repeats {self.qos1_repeats}"
                + (f"; protocol errors {self.protocol_errors}" if self.protocol_errors else "")
                + (f"; {self.pending} never acknowledged" if self.pending else ""))
        return "\n  ".join([head, *self.details[:30]])


def _connection_figures(connects):
    """(reconnects, failovers, sessions lost) of one client's connections."""
    reconnects = max(0, len(connects) - 1)
    failovers = sum(1 for prev, cur in zip(connects, connects[1:]) if cur[1] != prev[1])
    lost = sum(1 for _, _, present in connects[1:] if not present)
    return reconnects, failovers, lost


def unavailability(pub, until=None):
    """The longest time `pub` went without an acknowledgement while it had sent something
    not yet acknowledged (from its first message to `until` or its stop)."""
    if not pub.sent:
        return 0.0
    end = until if until is not None else pub.stopped_at
    times = sorted(pub.acked.values())
    first = min(t for t, *_ in pub.sent.values())
    marks = [first, *times]
    if end is not None and len(pub.acked) < len(pub.sent) and end > marks[-1]:
        marks.append(end)  # (still waiting when it stopped)
    return max((b - a for a, b in zip(marks, marks[1:])), default=0.0)


def expected_retained(pubs):
    """{retained topic: (the payload the last acknowledged change left (None: cleared or
    never set), the payloads of later changes not acknowledged)}."""
    ops = {}
    for p in pubs:
        for seq, (_, topic, payload, retain) in p.sent.items():
            if retain:
                ops.setdefault(topic, []).append((seq, payload, seq in p.acked))
    out = {}
    for topic, changes in ops.items():
        changes.sort()
        last = max((i for i, (_, _, acked) in enumerate(changes) if acked), default=-1)
        value = (changes[last][1] or None) if last >= 0 else None
        later = {payload or None for _, payload, acked in changes[last + 1:]}
        out[topic] = (value, later)
    return out


def retained_errors(view, want):
    """What is wrong in `view` ({topic: payload}, the retained messages a node gives a new
    subscription) against `want` (expected_retained): a line per topic."""
    wrong = []
    for topic, (value, later) in sorted(want.items()):
        have = view.get(topic) or None
        if have != value and have not in later:
            wrong.append(f"retained {topic} is {have!r}, the last acknowledged change left {value!r}")
    for topic in sorted(set(view) - set(want)):
        wrong.append(f"retained {topic} = {view[topic]!r}, never published")
    return wrong


def check(pubs, subs, retained=None, ownership=None, until=None):
    """A Report of publishers' and subscribers' logs. `retained`: {node: {topic: payload}}
    as each live node answers a new subscription to the retained topics; `ownership`: the
    harness's figures ({"bad": n, ...}); `until`: when the fault's load ended."""
    r = Report()
    by_name = {p.name: p for p in pubs}
    stream = {}  # publisher -> {seq: first sent at} of acknowledged non-retained messages
    for p in pubs:
        stream[p.name] = {seq: p.sent[seq][0] for seq in p.acked if not p.sent[seq][3]}
        r.acknowledged += len(p.acked)
        r.refused += p.refused
        gap = unavailability(p, until)
        if gap > r.unavailable:
            r.unavailable, r.unavailable_who = gap, p.name
    for client in [*pubs, *subs]:
        rc, fo, sl = _connection_figures(client.connects)
        r.reconnects += rc
        r.failovers += fo
        r.sessions_lost += sl
        if sl:
            r.details.append(f"{client.name}: session lost {sl} time(s)")
        if client.taken_over:  # (its only connection closed for another one: a second owner)
            r.owners_bad += len(client.taken_over)
            r.details.append(f"{client.name}: told its session was taken over (0x8E) on node "
                             f"{client.taken_over[0][1]}, with no other connection")
    for s in subs:
        got = {}  # publisher -> [seq, ...] in arrival order (retained-on-subscribe copies left out)
        qos2 = {}
        for at, topic, payload, qos, retain, dup, node, _ in s.deliveries:
            who = parse_payload(payload)
            if who is None or who[0] not in by_name or who[1] not in by_name[who[0]].sent:
                r.unknown += 1
                r.details.append(f"{s.name}: unknown delivery {topic} {bytes(payload)[:40]!r}")
                continue
            if retain:
                continue
            got.setdefault(who[0], []).append(who[1])
            if qos == 2:
                qos2[who] = qos2.get(who, 0) + 1
        for (name, seq), n in qos2.items():
            if n > 1:
                r.duplicates += n - 1
                r.details.append(f"{s.name}: {name}:{seq} given {n} times at QoS 2")
        for p in pubs:
            seqs = got.get(p.name, [])
            owed = {seq for seq, at in stream[p.name].items()
                    if s.subscribed_at is not None and at >= s.subscribed_at
                    and topic_matches(s.filter, p.sent[seq][1])}
            r.expected += len(owed)
            missing = sorted(owed - set(seqs))
            if missing:
                r.lost += len(missing)
                r.details.append(f"{s.name} <- {p.name}: {len(missing)} of {len(owed)} acknowledged lost, "
                                 f"e.g. {missing[:10]}")
            r.qos1_repeats += sum(1 for _ in seqs) - len(set(seqs)) - sum(
                n - 1 for (name, _), n in qos2.items() if name == p.name and n > 1)
            seen, top, late = set(), -1, []
            for seq in seqs:
                if seq in seen:
                    continue
                seen.add(seq)
                if seq < top:
                    late.append(seq)
                top = max(top, seq)
            if late:
                r.out_of_order += len(late)
                r.details.append(f"{s.name} <- {p.name}: {len(late)} out of order, e.g. {late[:10]}")
    if retained is not None:
        want = expected_retained(pubs)
        for node, view in sorted(retained.items()):
            wrong = retained_errors(view, want)
            r.retained_bad += len(wrong)
            r.details += [f"node {node}: {w}" for w in wrong]
    if ownership is not None:
        r.owners_bad += ownership["bad"]
        r.details += [f"ownership: {p}" for p in ownership.get("problems", ())]
    return r


def count_missing(pubs, subs):
    """How many owed deliveries have not come yet (the workload waits on it)."""
    return check(pubs, subs).lost
