"""The subscriptions of all sessions, indexed for routing, and what they cost.

Each session keeps its own (`Session.subscriptions`, full filter -> Subscription);
`Subscriptions` indexes them by filter for matching a topic (a TopicTrie of the
plain ones, SharedGroups of the shared ones), checks a SUBSCRIBE's filters against the
configuration, [limits] and the authorize_subscribe hooks, and counts what they take
in memory (`bytes`), which [limits] subscription_memory bounds.
"""

import logging

from ..mqtt import constants as C
from ..mqtt.codec import MQTTError
from ..mqtt.topics import TopicError, parse_shared, validate_topic_filter
from .shared import SharedGroups
from .topics import TopicTrie

log = logging.getLogger("wrenmq.router")

# What a subscription's objects take besides its filter (the Subscription, its place in
# the session's dict and in the topic trie), measured with 100,000 subscriptions held:
# 593 bytes each for 20-byte filters, 968 for 206-byte ones (the filter is kept twice).
SUBSCRIPTION_COST = 550


def subscription_size(full_filter, filter):
    """What [limits] subscription_memory counts for one subscription: its objects and its
    filter twice (`full_filter` with the $share/<name>/ prefix, `filter` without)."""
    return SUBSCRIPTION_COST + len(full_filter) + len(filter)


class Subscriptions:
    """Every session's subscriptions by filter."""

    __slots__ = ("_plain", "shared", "bytes", "memory", "limits", "broker", "hooks", "stats",
                 "max_levels", "max_topic_length")

    def __init__(self, config, hooks, stats):
        self._plain = TopicTrie()  # filter -> {client id: Subscription}
        self.shared = SharedGroups()
        self.limits = limits = config.limits
        self.broker = config.broker
        self.hooks = hooks
        self.stats = stats
        self.max_levels = limits.max_topic_levels
        self.max_topic_length = limits.max_topic_length if limits.max_topic_length < 65535 else 0
        self.memory = limits.subscription_memory or float("inf")
        self.bytes = 0  # subscription_size of each subscription held

    def check(self, session, request, sub_id):
        """(share name or None, filter, reason): whether `session` may have the
        subscription a SUBSCRIBE asks for (`request`, a SubscribeTopic; `sub_id`, the
        SUBSCRIBE's subscription identifier); `reason` is None if it may, else the 5.0
        reason code to refuse it with. A shared subscription with no local set is a
        protocol error (MQTTError)."""
        full = request.filter
        try:
            group, flt = parse_shared(full)
            validate_topic_filter(flt, self.max_levels)
            if self.max_topic_length and len(full.encode()) > self.max_topic_length:
                raise TopicError("topic filter too long")
        except TopicError:
            return None, full, C.TOPIC_FILTER_INVALID
        if full not in session.subscriptions:
            limits = self.limits
            if limits.max_subscriptions and len(session.subscriptions) >= limits.max_subscriptions:
                return group, flt, C.QUOTA_EXCEEDED
            if self.bytes + subscription_size(full, flt) > self.memory:
                # Sessions, each with its max_subscriptions of long filters, are what a
                # client could pile up without it.
                n = self.stats.refuse("subscriptions_refused")
                if n:
                    log.warning("refusing a subscription of %s: subscriptions take about %d bytes "
                                "([limits] subscription_memory %d); %d refused so far",
                                session.client_id, self.bytes, limits.subscription_memory, n)
                return group, flt, C.QUOTA_EXCEEDED
        b = self.broker
        if group is not None:
            if request.no_local and session.v5:
                raise MQTTError(C.PROTOCOL_ERROR, "no local on a shared subscription")
            if not b.shared_subscriptions:
                return group, flt, C.SHARED_SUBSCRIPTIONS_NOT_SUPPORTED
        if not b.wildcard_subscriptions and ("+" in flt or "#" in flt):
            return group, flt, C.WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED
        if sub_id is not None and not b.subscription_identifiers:
            return group, flt, C.SUBSCRIPTION_IDENTIFIERS_NOT_SUPPORTED
        hooks = self.hooks
        if hooks.authorize_subscribe is not None and \
                hooks.authorize_subscribe(session, full, request.qos) is False:
            self.stats.denied_subscribe += 1
            return group, flt, C.NOT_AUTHORIZED
        return group, flt, None

    def add(self, session, sub):
        """Index `sub` (a subscription of `session`) and count it."""
        self.bytes += subscription_size(sub.full_filter, sub.filter)
        if sub.group is None:
            self._plain.insert(sub.filter, session.client_id, sub)
        else:
            self.shared.join(sub)

    def remove(self, session, sub):
        """Undo `add`."""
        self.bytes -= subscription_size(sub.full_filter, sub.filter)
        if sub.group is None:
            self._plain.remove(sub.filter, session.client_id)
        else:
            self.shared.leave(sub)

    def match(self, topic):
        """(subscribers, shared groups) of `topic`. The subscribers are one entry per
        session, however many of its subscriptions match: (session, highest QoS, retain
        as published if any says so, all their subscription ids sorted, no local if all
        say so)."""
        agg = {}
        for values in self._plain.match(topic):
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
        return normal, self.shared.match(topic)

    def count(self):
        return self._plain.count + self.shared.member_count()
