"""A session handed from one node to another, as data: sans-IO.

When a client that keeps its session (clean start 0) connects to a node that does
not hold it, that node asks the node that does (`clients/<id>` in etcd says which)
over the link. The holder ends its session and answers with `session_state`: the
subscriptions, the inbound QoS 2 packet ids still open, and the messages it owes,
in-flight ones with their packet ids (so QoS 2 stays exactly once) and queued ones in
order. The asking node rebuilds it with `build_session` and the CONNECT resumes it
as if it had never left (CONNACK session present 1).
"""

from ..broker.session import Outgoing, Session, Subscription
from ..mqtt.topics import parse_shared
from .frames import message_from, publish_bytes


def session_state(session, request_id, now, max_bytes):
    """(state, PUBLISH bytes) of `session`; messages past `max_bytes` in all are left
    out (returned as the count in state["dropped"])."""
    subs = [[full, s.qos, s.no_local, s.retain_as_published, s.retain_handling, s.sub_id]
            for full, s in session.subscriptions.items()]
    msgs = []
    pubs = []
    size = 0
    dropped = 0
    owed = [("i", pid, out) for pid, out in session.inflight.items()]
    owed += [("q", 0, out) for out in session.queue]
    for where, pid, out in owed:
        msg = out.msg
        if not out.released and msg.expired(now):
            continue
        p = publish_bytes(msg, now)
        if size + len(p) > max_bytes:
            dropped += 1
            continue
        size += len(p)
        msgs.append([where, pid, out.qos, bool(out.retain), out.released, list(out.sub_ids),
                     msg.client_id, msg.timestamp])
        pubs.append(p)
    qos2 = set(session.incoming_qos2) | set(session.restored_qos2)
    state = {"id": request_id, "cid": session.client_id, "found": True, "version": session.version,
             "expiry": session.expiry_interval, "subs": subs, "qos2_in": sorted(qos2), "msgs": msgs,
             "dropped": dropped}
    return state, pubs


def build_session(state, pkts, clock, since):
    """A Session from `session_state`'s output; (session, queued Outgoings in order).

    `since`: the log offset its subscriptions start at here."""
    s = Session(state["cid"])
    s.version = int(state["version"])
    s.v5 = s.version == 5
    s.expiry_interval = int(state["expiry"])
    for full, qos, nl, rap, rh, sub_id in state["subs"]:
        group, flt = parse_shared(full)
        sub = Subscription(flt, int(qos), bool(nl), bool(rap), int(rh), sub_id, group, s)
        sub.since = since
        s.subscriptions[full] = sub
    for pid in state["qos2_in"]:
        s.add_incoming_qos2(int(pid))
    queued = []
    now = clock()
    for (where, pid, qos, retain, released, sub_ids, cid, ts), pkt in zip(state["msgs"], pkts):
        out = Outgoing(message_from(pkt, cid, ts, now), int(qos), bool(retain), tuple(sub_ids))
        if where == "i":
            pid = int(pid)
            out.packet_id = pid
            out.released = bool(released)
            out.maybe_sent = True
            s.inflight[pid] = out
            s.inflight_bytes += out.size
            s.next_pid = pid + 1 if pid < 65535 else 1
        else:
            queued.append(out)
    return s, queued
