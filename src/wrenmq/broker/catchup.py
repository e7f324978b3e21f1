"""Catching a persistent session up from the commit log.

A session that has more owed than it holds in memory (after a restart, a long absence,
a queue past its bounds: queues.py) has `resume_from`, the log offset to read on from.
Live routing passes it by for logged messages meanwhile (Router.route), so order is kept;
when its queue runs dry, `catch_up` reads the next stretch of the log, matches each
record against the session's own subscriptions as they were at that offset, and queues
what they want, until it reaches the log's end and live routing takes over again.
"""

from ..mqtt.topics import topic_matches
from .message import Message
from .session import Outgoing
from .timers import TimerKind


def catch_up(router, session, max_records=2000):
    """Queue the session's next messages from the commit log: at least what its window
    has room for (64 at least), reading at most `max_records` records."""
    persist = router.persist
    start = session.resume_from
    if persist is None or start is None:
        return
    queues = router.queues
    queue_qos0 = queues.queue_qos0
    want = max(64, session.send_quota - len(session.inflight))
    queued = 0
    scanned = 0
    skip = session.skip_offsets
    while scanned < max_records and queued < want:
        items, after = persist.read_span(start, 500)
        if not items:
            if after > start:  # a stretch of state records (replicated log): passed over
                scanned += after - start
                start = after
                continue
            if start < persist.start_offset:
                start = persist.start_offset  # deleted by retention (counted there)
                continue
            # Past a stretch the log's reader found damaged (and logged); an empty read
            # for any other reason is tried again (next turn), never passed over.
            past = persist.store.unreadable_end(start) if start < persist.next_offset else None
            if past is not None:
                scanned += past - start
                start = past
                continue
            break
        for item in items:
            off = item.offset
            start = off + 1
            scanned += 1
            if skip and off in skip:
                skip.discard(off)
                continue
            hit = session_match(session, item.topic, off)
            if hit is None:
                continue
            sqos, rap, ids, no_local = hit
            if no_local and item.client_id == session.client_id:
                continue
            q = item.qos if item.qos < sqos else sqos
            if not q and not queue_qos0:
                continue
            msg = item if isinstance(item, Message) else persist.message_from_record(item)
            out = Outgoing(msg, q, msg.retain and rap, ids)
            out.maybe_sent = off < session.replay_dup_below
            queues.push(session, out)
            queued += 1
        start = after  # (and past the state records after the last one)
    if start >= persist.next_offset:
        session.resume_from = None
        session.skip_offsets = None
    else:
        session.resume_from = start
        if not queued:
            # Nothing for it in this stretch: continue on the next loop turn.
            router.timers.schedule(router.clock(), TimerKind.CATCH_UP, session)
    if session.stored:
        router.dirty.add(session)


def session_match(session, topic, offset):
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
