"""Shared subscriptions (`$share/<name>/<filter>`): each message goes to one member.

`SharedGroups` is the index the router matches topics against (filter -> {share name:
SharedGroup}); `SharedGroup.pick` chooses the member, round robin, online members
first. When a member's client leaves, what the group gave it and the client has not
acknowledged goes to another member (`take_unacknowledged`, then the router delivers).
"""

from .topics import TopicTrie


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


class SharedGroups:
    """Every shared group, by filter and share name."""

    __slots__ = ("_trie",)

    def __init__(self):
        self._trie = TopicTrie()  # filter -> {share name: SharedGroup}

    def join(self, sub):
        """Add shared subscription `sub` to its group (made on its first member)."""
        group = self._trie.get(sub.filter, sub.group)
        if group is None:
            group = SharedGroup(sub.group, sub.filter)
            self._trie.insert(sub.filter, sub.group, group)
        group.members.append(sub)

    def leave(self, sub):
        """Take `sub` out of its group; a group without members is gone."""
        group = self._trie.get(sub.filter, sub.group)
        if group is not None:
            group.members = [m for m in group.members if m is not sub]
            if not group.members:
                self._trie.remove(sub.filter, sub.group)

    def match(self, topic):
        """The groups whose filter matches `topic` (a tuple)."""
        return tuple(g for groups in self._trie.match(topic) for g in groups.values())

    def member_count(self):
        return sum(len(g.members) for _, _, g in self._trie.items())


def take_unacknowledged(session, queues):
    """Take out of `session` (its client is gone) what shared groups gave it that is not
    acknowledged: its in-flight messages not yet released and its queued ones, to go to
    another member. Returns them (Outgoing) in the order they were owed."""
    if not session.inflight and not session.queue:
        return []
    moved = []
    for pid, out in list(session.inflight.items()):
        if out.group is not None and not out.released:
            session.take_inflight(pid)
            moved.append(out)
    if session.queue:
        keep = [o for o in session.queue if o.group is None]
        moved.extend(o for o in session.queue if o.group is not None)
        queues.clear(session)
        for o in keep:
            queues.push(session, o)
    return moved
