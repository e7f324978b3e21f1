"""Which node wants which topic: the cluster's routing state, sans-IO.

Each node publishes in etcd one key per topic filter its sessions subscribe to
(counted here, so a thousand subscribers to one filter are one key), and keeps
the other nodes' keys in a trie. A PUBLISH goes to each other node once, only
if a filter there matches. Shared groups are kept per (share name, filter) with
the nodes that have members, so one node is chosen per message, cluster-wide.

A node tells its changes twice: over its links at once (ROUTE frames, in order) and
through etcd a round trip later. Each change has a number (`seq`, growing on the
node, in the etcd value as `<flag>@<seq>`), so what etcd says late does not undo
what a link said since: a filter subscribed again right after its unsubscribe is
not dropped by the etcd delete of the first one arriving after the link's news.
"""

from collections import deque

from ..broker.topics import TopicTrie

NODES = "nodes/"
ROUTES = "routes/"
CLIENTS = "clients/"
_NO_GROUPS = {}  # (left_groups' answer while no node that left had groups: read, never written)


def route_key(prefix, node, group, flt):
    """etcd key of one node's interest in `flt` (`group`: share name, or None)."""
    if group is None:
        return f"{prefix}{ROUTES}{node}/n/{flt}".encode()
    return f"{prefix}{ROUTES}{node}/s/{group}/{flt}".encode()


def route_value(flag, seq):
    """etcd value of a route key: the group flag (`LocalInterest.value`) and the change's number."""
    return b"%s@%d" % (flag, seq)


def parse_route_value(value):
    """(a member connected, change number) of a route key's value; number 0 if it has none."""
    flag, at, seq = value.partition(b"@")
    try:
        n = int(seq) if at else 0
    except ValueError:
        n = 0
    return flag != b"0", n


def parse_route_key(rest):
    """(node, group, filter) from what follows `routes/` in a key; None if malformed."""
    node, _, rest = rest.partition("/")
    kind, _, rest = rest.partition("/")
    if not node or not rest:
        return None
    if kind == "n":
        return node, None, rest
    if kind == "s":
        group, _, flt = rest.partition("/")
        if group and flt:
            return node, group, flt
    return None


class LocalInterest:
    """Reference counts of this node's filters: a key changes only on 0 -> 1 and 1 -> 0.

    For a shared group it also counts the members whose client is connected: the key's
    value says whether there is one (b"1") or not (b"0"), so the other nodes send the
    group's messages where a member can take them now."""

    __slots__ = ("counts", "online")

    def __init__(self):
        self.counts = {}  # (group, filter) -> subscriptions
        self.online = {}  # (share name, filter) -> members connected now

    def add(self, group, flt, online=False):
        """True if (group, flt)'s key must be written: its first subscription here, or
        its first connected member."""
        key = (group, flt)
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        flipped = self.connected(group, flt, 1) if online and group is not None else False
        return n == 0 or flipped

    def remove(self, group, flt, online=False):
        """"delete" if that was the last subscription, "update" if the last connected
        member of a group left but others remain, else None."""
        key = (group, flt)
        flipped = self.connected(group, flt, -1) if online and group is not None else False
        n = self.counts.get(key, 0)
        if n <= 1:
            self.counts.pop(key, None)
            return "delete" if n == 1 else None
        self.counts[key] = n - 1
        return "update" if flipped else None

    def connected(self, group, flt, delta):
        """A member of group (group, flt) connected (+1) or disconnected (-1); True if
        whether one is connected changed."""
        key = (group, flt)
        n = self.online.get(key, 0)
        m = n + delta
        if m <= 0:
            self.online.pop(key, None)
            return n > 0
        self.online[key] = m
        return n == 0

    def value(self, group, flt):
        """The etcd value of the key: b"" for a plain filter, b"1"/b"0" for a group."""
        if group is None:
            return b""
        return b"1" if self.online.get((group, flt)) else b"0"


class RemoteInterest:
    """The other nodes' filters, matched per topic (cached until they change).

    Changes come from the links (`linked`), from etcd's watch (`put`, `deleted`) and from
    a direct read of etcd (`read`, before a replay to the node); `add` and `remove` apply
    one without asking where it came from."""

    __slots__ = ("_normal", "_shared", "_cache", "by_node", "_told", "_removals", "_left", "_left_cache",
                 "left_nodes")

    TOLD_MAX = 10_000  # removals a link told that etcd has not said, kept; past it the oldest go

    def __init__(self):
        self._normal = TopicTrie()  # filter -> {node: True}
        self._shared = TopicTrie()  # filter -> {(share name, node): (filter, has a connected member)}
        self._cache = {}
        self.by_node = {}  # node -> set of (group, filter), to drop a node at once
        # (node, group, filter) -> (seq, present, online): the last change a link told (or
        # a read of etcd found) that the watch has not yet said (or said something older than).
        self._told = {}
        self._removals = deque()  # keys of removals in _told, oldest first (some since replaced)
        # The shared groups of nodes that left the cluster, until they are back (`left`):
        # filter -> {(share name, node): filter}, and node -> set of (share name, filter).
        self._left = TopicTrie()
        self._left_cache = {}
        self.left_nodes = {}

    def linked(self, node, group, flt, online, removed, seq):
        """A ROUTE from `node`'s link: its change number `seq`, ahead of etcd."""
        told = self._told
        key = (node, group, flt)
        told[key] = (seq, not removed, online)
        if removed:
            removals = self._removals
            removals.append(key)
            while len(removals) > self.TOLD_MAX:
                # Removals etcd never says (a filter added and removed before the node
                # wrote etcd): forgetting one lets a late etcd put add its filter back
                # until the delete follows, which costs forwarding, never a message.
                old = removals.popleft()
                v = told.get(old)
                if v is not None and not v[1]:
                    del told[old]
            self.remove(node, group, flt)
        else:
            self.add(node, group, flt, online)

    def put(self, node, group, flt, online, seq):
        """etcd: `node` has the filter, as of its change `seq`."""
        key = (node, group, flt)
        told = self._told.get(key)
        if told is not None:
            if told[0] > seq:
                return  # a link said something newer
            del self._told[key]
        self.add(node, group, flt, online)

    def read(self, node, group, flt, online, seq):
        """A read of etcd (not the watch) found `node`'s filter, as of its change `seq`.

        Kept as a link's news is: the watch may still bring older events of that key (a
        delete before the node wrote it again), which must not undo it; a link that told
        something newer wins."""
        key = (node, group, flt)
        told = self._told.get(key)
        if told is not None and told[0] >= seq:
            return
        self._told[key] = (seq, True, online)
        self.add(node, group, flt, online)

    def deleted(self, node, group, flt, seq):
        """etcd: `node`'s key is gone; `seq`: the change number of the value deleted (-1 if
        unknown). A link that said more recently that the filter is there wins (etcd's
        put of it follows)."""
        key = (node, group, flt)
        told = self._told.get(key)
        if told is not None:
            if told[0] > seq and told[1]:
                return
            del self._told[key]
        self.remove(node, group, flt)

    def restore_told(self):
        """After `clear` and a reread of etcd: what the links said since etcd was read."""
        for (node, group, flt), (seq, present, online) in list(self._told.items()):
            if present:
                self.add(node, group, flt, online)

    def add(self, node, group, flt, online=True):
        """Node `node` subscribes to `flt` (group: share name or None); for a group,
        `online` says whether one of its members there is connected."""
        keys = self.by_node.setdefault(node, set())
        if group is None:
            if (group, flt) in keys:
                return
            self._normal.insert(flt, node, True)
        else:
            if (group, flt) in keys and self._shared.get(flt, (group, node)) == (flt, online):
                return
            self._shared.insert(flt, (group, node), (flt, online))
        keys.add((group, flt))
        self._cache.clear()

    def remove(self, node, group, flt):
        keys = self.by_node.get(node)
        if not keys or (group, flt) not in keys:
            return
        keys.discard((group, flt))
        if group is None:
            self._normal.remove(flt, node)
        else:
            self._shared.remove(flt, (group, node))
        self._cache.clear()

    def drop_node(self, node, forget_told=True):
        for group, flt in list(self.by_node.get(node, ())):
            self.remove(node, group, flt)
        self.by_node.pop(node, None)
        if forget_told and self._told:
            for key in [k for k in self._told if k[0] == node]:
                del self._told[key]

    def left(self, node):
        """`node` left the cluster (its registration went: it stopped, or its lease ran out):
        its filters go, its shared groups are kept (`left_groups`) until it is `back`. With
        disk storage its sessions come back with it, their groups' members too, and a
        group's message that no node in the cluster has a member for is for them (the
        sender's log holds it until then; a plain filter's messages need no such memory:
        a replay matches the log against the filters the node has when it is back)."""
        new = [key for key in self.by_node.get(node, ()) if key[0] is not None]
        if new:
            kept = self.left_nodes.setdefault(node, set())  # (it may leave again before it is back)
            for group, flt in new:
                self._left.insert(flt, (group, node), flt)
                kept.add((group, flt))
            self._left_cache.clear()
        self.drop_node(node)

    def back(self, node):
        """`node` is back, its filters known again: forget the groups it left with."""
        groups = self.left_nodes.pop(node, None)
        if groups:
            for group, flt in groups:
                self._left.remove(flt, (group, node))
            self._left_cache.clear()

    def left_groups(self, topic):
        """{(share name, filter): nodes that left with members of it} of the groups that
        match `topic` (empty at once while no node that left had any)."""
        if not self.left_nodes:
            return _NO_GROUPS
        hit = self._left_cache.get(topic)
        if hit is None:
            found = {}
            for values in self._left.match(topic):
                for (group, node), flt in values.items():
                    found.setdefault((group, flt), []).append(node)
            hit = {k: tuple(sorted(v)) for k, v in found.items()}
            if len(self._left_cache) > 100_000:
                self._left_cache.clear()
            self._left_cache[topic] = hit
        return hit

    def clear(self):
        """Every node's filters gone, but not what the links said (`restore_told`)."""
        for node in list(self.by_node):
            self.drop_node(node, forget_told=False)

    def match(self, topic):
        """(nodes with a matching filter, {(share name, filter): (nodes with a connected
        member, nodes with members)})."""
        hit = self._cache.get(topic)
        if hit is not None:
            return hit
        nodes = set()
        for values in self._normal.match(topic):
            nodes.update(values)
        shared = {}
        for values in self._shared.match(topic):
            for (group, node), (flt, online) in values.items():
                entry = shared.get((group, flt))
                if entry is None:
                    entry = shared[(group, flt)] = ([], [])
                entry[1].append(node)
                if online:
                    entry[0].append(node)
        hit = (frozenset(nodes), {k: (tuple(sorted(on)), tuple(sorted(every))) for k, (on, every) in shared.items()})
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[topic] = hit
        return hit


class SharedPicker:
    """Round robin over the nodes that have members of one shared group."""

    __slots__ = ("_next",)

    def __init__(self):
        self._next = {}  # (share name, filter) -> counter

    def pick(self, key, nodes):
        i = self._next.get(key, 0)
        self._next[key] = i + 1
        return nodes[i % len(nodes)]

    def forget(self, key):
        self._next.pop(key, None)
