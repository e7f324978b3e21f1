"""Which node wants which topic: the cluster's routing state, sans-IO.

Each node publishes in etcd one key per topic filter its sessions subscribe to
(counted here, so a thousand subscribers to one filter are one key), and keeps
the other nodes' keys in a trie. A PUBLISH goes to each other node once, only
if a filter there matches. Shared groups are kept per (share name, filter) with
the nodes that have members, so one node is chosen per message, cluster-wide.
"""

from ..broker.topics import TopicTrie

NODES = "nodes/"
ROUTES = "routes/"
CLIENTS = "clients/"


def route_key(prefix, node, group, flt):
    """etcd key of one node's interest in `flt` (`group`: share name, or None)."""
    if group is None:
        return f"{prefix}{ROUTES}{node}/n/{flt}".encode()
    return f"{prefix}{ROUTES}{node}/s/{group}/{flt}".encode()


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
    """The other nodes' filters, matched per topic (cached until they change)."""

    __slots__ = ("_normal", "_shared", "_cache", "by_node")

    def __init__(self):
        self._normal = TopicTrie()  # filter -> {node: True}
        self._shared = TopicTrie()  # filter -> {(share name, node): (filter, has a connected member)}
        self._cache = {}
        self.by_node = {}  # node -> set of (group, filter), to drop a node at once

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

    def drop_node(self, node):
        for group, flt in list(self.by_node.get(node, ())):
            self.remove(node, group, flt)
        self.by_node.pop(node, None)

    def clear(self):
        for node in list(self.by_node):
            self.drop_node(node)

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
