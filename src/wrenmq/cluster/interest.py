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
    """Reference counts of this node's filters: a key changes only on 0 -> 1 and 1 -> 0."""

    __slots__ = ("counts",)

    def __init__(self):
        self.counts = {}  # (group, filter) -> subscriptions

    def add(self, group, flt):
        """True if this is the first subscription to (group, flt) here."""
        key = (group, flt)
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        return n == 0

    def remove(self, group, flt):
        """True if that was the last one."""
        key = (group, flt)
        n = self.counts.get(key, 0)
        if n <= 1:
            self.counts.pop(key, None)
            return n == 1
        self.counts[key] = n - 1
        return False


class RemoteInterest:
    """The other nodes' filters, matched per topic (cached until they change)."""

    __slots__ = ("_normal", "_shared", "_cache", "by_node")

    def __init__(self):
        self._normal = TopicTrie()  # filter -> {node: True}
        self._shared = TopicTrie()  # filter -> {(share name, node): filter}
        self._cache = {}
        self.by_node = {}  # node -> set of (group, filter), to drop a node at once

    def add(self, node, group, flt):
        keys = self.by_node.setdefault(node, set())
        if (group, flt) in keys:
            return
        keys.add((group, flt))
        if group is None:
            self._normal.insert(flt, node, True)
        else:
            self._shared.insert(flt, (group, node), flt)
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
        """(nodes with a matching filter, {(share name, filter): nodes with members})."""
        hit = self._cache.get(topic)
        if hit is not None:
            return hit
        nodes = set()
        for values in self._normal.match(topic):
            nodes.update(values)
        shared = {}
        for values in self._shared.match(topic):
            for (group, node), flt in values.items():
                shared.setdefault((group, flt), []).append(node)
        hit = (frozenset(nodes), {k: tuple(sorted(v)) for k, v in shared.items()})
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
