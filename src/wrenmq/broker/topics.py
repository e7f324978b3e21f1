"""The subscription trie and the retained-message trie.

Matching walks the trie one topic level at a time, so its cost is linear in the
number of levels times the wildcard branches that actually exist: there is no
regular expression anywhere and no input can make it backtrack. Both must agree with
`mqtt.topics.topic_matches`, the plain reference matcher.
"""


class _Node:
    __slots__ = ("children", "values")

    def __init__(self):
        self.children = {}
        self.values = None  # dict key -> value, created on first insert


class TopicTrie:
    """Maps topic filters to values (keyed per filter) and finds the ones matching a topic.

    Used for subscriptions (key: session id, value: Subscription) and for shared
    groups (key: group name, value: SharedGroup).
    """

    __slots__ = ("_root", "count")

    def __init__(self):
        self._root = _Node()
        self.count = 0

    def insert(self, flt, key, value):
        """Add or replace the value for (flt, key); return True if it was new."""
        node = self._root
        for level in flt.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        if node.values is None:
            node.values = {}
        new = key not in node.values
        node.values[key] = value
        if new:
            self.count += 1
        return new

    def get(self, flt, key):
        node = self._root
        for level in flt.split("/"):
            node = node.children.get(level)
            if node is None:
                return None
        return node.values.get(key) if node.values else None

    def remove(self, flt, key):
        """Remove (flt, key); return the removed value or None. Prunes empty branches."""
        path = []
        node = self._root
        for level in flt.split("/"):
            child = node.children.get(level)
            if child is None:
                return None
            path.append((node, level))
            node = child
        if not node.values or key not in node.values:
            return None
        value = node.values.pop(key)
        self.count -= 1
        if not node.values:
            node.values = None
        for parent, level in reversed(path):
            child = parent.children[level]
            if child.values or child.children:
                break
            del parent.children[level]
        return value

    def match(self, topic):
        """Return the list of value-dicts of every filter matching `topic`."""
        levels = topic.split("/")
        n = len(levels)
        out = []
        stack = [(self._root, 0)]
        dollar = topic[:1] == "$"
        while stack:
            node, i = stack.pop()
            children = node.children
            if i == n:
                if node.values:
                    out.append(node.values)
                h = children.get("#")
                if h is not None and h.values:
                    out.append(h.values)
                continue
            if i or not dollar:
                h = children.get("#")
                if h is not None and h.values:
                    out.append(h.values)
                p = children.get("+")
                if p is not None:
                    stack.append((p, i + 1))
            c = children.get(levels[i])
            if c is not None:
                stack.append((c, i + 1))
        return out

    def items(self):
        """Yield (filter, key, value) for everything stored."""
        stack = [(self._root, ())]
        while stack:
            node, path = stack.pop()
            if node.values:
                flt = "/".join(path)
                for k, v in node.values.items():
                    yield flt, k, v
            for level, child in node.children.items():
                stack.append((child, path + (level,)))


# What one node of the retained tree takes besides the text of its label and its key (the
# node, its entry in its parent's dict, that key's and the label's str headers, a share of
# the dicts of nodes with children, its version number), measured with tracemalloc over
# trees of deep and of wide topics (`python -m wrenmq.bench.bounds retained`).
RETAINED_NODE_COST = 200


class _Retained:
    """A node of the retained tree: the levels of the edge into it (`label`, one or more
    levels joined by '/'), its children by their label's first level (None for a leaf), the
    retained message of the topic that ends here (or None), and the tree's version when
    that message was set (0: set without being routed to subscribers).

    A chain of levels that holds no message and does not branch is one node, so a topic of
    128 levels that shares nothing with the others costs one node, not 128: every node
    holds a message or has two children or more. A node's label never changes: a split or
    a merge makes new nodes, so a walk that still holds an old one (`RetainedTrie.walk`)
    reads it as it was, under the same topic names."""

    __slots__ = ("label", "children", "msg", "ver")

    def __init__(self, label, children=None, msg=None, ver=0):
        self.label = label
        self.children = children
        self.msg = msg
        self.ver = ver


def _node_cost(label):
    """What RetainedTrie.memory counts for a node with this label: RETAINED_NODE_COST, the
    label and its first level (the key its parent's dict holds it under)."""
    cut = label.find("/")
    return RETAINED_NODE_COST + len(label) + (cut if cut >= 0 else len(label))


class _Meter:
    """What a walk holds: `held` references to nodes it has still to visit."""

    __slots__ = ("held",)

    def __init__(self):
        self.held = 0


class RetainedTrie:
    """Retained messages by topic, found by topic filter without scanning all of them.

    `count`: all of them. `client_count` and `memory`: the clients' ones and what the tree
    holds for them (each message's Message.memory() and every node's _node_cost), what
    [limits] max_retained_messages and max_retained_bytes bound; the broker's own ($SYS,
    the embedding API: no client id) are not counted there, nor are the nodes of $SYS
    topics (which clients cannot publish to).
    """

    __slots__ = ("_root", "count", "client_count", "memory", "version")

    def __init__(self):
        self._root = _Retained("", {})
        self.count = 0
        self.client_count = 0
        self.memory = 0
        self.version = 0  # one more for every message set (what a walk's `since` compares)

    def _weigh(self, msg, sign):
        if getattr(msg, "client_id", ""):  # (the tests store plain values: not a client's)
            self.client_count += sign
            self.memory += sign * msg.memory()

    def growth(self, topic, msg):
        """How much `memory` would grow, at most, if `msg` (a client's) were set on
        `topic`: its memory less that of a client's message it replaces, and the nodes a
        topic not held yet takes (`set`): a leaf for the rest of the topic, and where the
        topic parts from a label within it, a node more (the label's first levels and its
        rest, keyed by one of its levels)."""
        node = self._root
        pos = 0
        n = len(topic)
        while True:
            end = topic.find("/", pos)
            if end < 0:
                end = n
            children = node.children
            child = children.get(topic[pos:end]) if children else None
            if child is None:
                return msg.memory() + RETAINED_NODE_COST + 2 * (n - pos)
            label = child.label
            stop = pos + len(label)
            if not topic.startswith(label, pos) or (stop < n and topic[stop] != "/") or stop > n:
                return msg.memory() + 2 * RETAINED_NODE_COST + 2 * (n - pos) + len(label)
            if stop == n:
                old = child.msg
                return msg.memory() - (old.memory() if getattr(old, "client_id", "") else 0)
            node = child
            pos = stop + 1

    def _find(self, topic, path=None):
        """The node where `topic` ends, or None; `path` collects (parent, key, node)."""
        node = self._root
        pos = 0
        n = len(topic)
        while True:
            end = topic.find("/", pos)
            if end < 0:
                end = n
            children = node.children
            child = children.get(topic[pos:end]) if children else None
            if child is None:
                return None
            label = child.label
            stop = pos + len(label)
            if not topic.startswith(label, pos) or (stop < n and topic[stop] != "/") or stop > n:
                return None
            if path is not None:
                path.append((node, topic[pos:end], child))
            if stop == n:
                return child
            node = child
            pos = stop + 1

    def get(self, topic):
        node = self._find(topic)
        return node.msg if node is not None else None

    def set(self, topic, msg, routed=True):
        """Keep `msg` as `topic`'s retained message. `routed`: it is being routed to the
        subscribers (as every PUBLISH is), so a walk started before it skips it; a message
        set otherwise (another node's, synchronised) is one walks deliver."""
        self.version += 1
        ver = self.version if routed else 0
        mine = not topic.startswith("$SYS")  # (whether its nodes count in `memory`)
        node = self._root
        pos = 0
        n = len(topic)
        while True:
            end = topic.find("/", pos)
            if end < 0:
                end = n
            children = node.children
            key = topic[pos:end]
            child = children.get(key) if children else None
            if child is None:
                label = topic[pos:]
                if children is None:
                    children = node.children = {}
                children[label if end == n else key] = _Retained(label, None, msg, ver)
                if mine:
                    self.memory += _node_cost(label)
                self.count += 1
                self._weigh(msg, 1)
                return
            label = child.label
            stop = pos + len(label)
            if topic.startswith(label, pos) and (stop == n or (stop < n and topic[stop] == "/")):
                if stop < n:
                    node = child
                    pos = stop + 1
                    continue
                if child.msg is None:
                    self.count += 1
                else:
                    self._weigh(child.msg, -1)
                self._weigh(msg, 1)
                child.msg = msg
                child.ver = ver
                return
            # `topic` parts from the label after its first few levels: a node for those,
            # with the rest of the label below it (a new node: labels never change) and,
            # unless the topic ends there, a leaf for the rest of the topic.
            ll = label.split("/")
            tl = topic[pos:].split("/")
            m = 1
            while m < len(ll) and m < len(tl) and ll[m] == tl[m]:
                m += 1
            cut = len("/".join(ll[:m]))
            upper = label[:cut]
            lower = _Retained(label[cut + 1:], child.children, child.msg, child.ver)
            mid = _Retained(upper, {ll[m]: lower})
            children[key] = mid
            if mine:
                self.memory += _node_cost(upper) + _node_cost(lower.label) - _node_cost(label)
            self.count += 1
            self._weigh(msg, 1)
            if m == len(tl):
                mid.msg = msg
                mid.ver = ver
            else:
                rest = topic[pos + cut + 1:]
                mid.children[tl[m] if "/" in rest else rest] = _Retained(rest, None, msg, ver)
                if mine:
                    self.memory += _node_cost(rest)
            return

    def delete(self, topic):
        path = []
        node = self._find(topic, path)
        if node is None or node.msg is None:
            return None
        msg = node.msg
        node.msg = None
        node.ver = 0
        self.count -= 1
        self._weigh(msg, -1)
        mine = not topic.startswith("$SYS")
        parent, key, _ = path[-1]
        if not node.children:
            del parent.children[key]
            if mine:
                self.memory -= _node_cost(node.label)
            if len(path) > 1:
                if parent.msg is None and len(parent.children) == 1:
                    grand, gkey, _ = path[-2]
                    self._merge(grand, gkey, parent, mine)
                elif not parent.children:
                    parent.children = None
        elif len(node.children) == 1:
            self._merge(parent, key, node, mine)
        return msg

    def _merge(self, parent, key, node, mine):
        """`node` holds no message and has one child left: one node for both."""
        (child,) = node.children.values()
        label = node.label + "/" + child.label
        parent.children[key] = _Retained(label, child.children, child.msg, child.ver)
        if mine:
            self.memory += _node_cost(label) - _node_cost(node.label) - _node_cost(child.label)

    def walk(self, flt, since=None, meter=None):
        """Yield, node by node, the retained messages matching filter `flt`: a message, or
        None for a node visited without one that matches. What the caller reads between
        two items can be spread over loop turns, and the tree may change meanwhile: each
        node's children are taken as they are when the walk gets there (a list of them,
        counted in `meter.held` while the walk holds it), and a node the tree has let go
        since is read as it was, under the same topics. Messages set after version `since`
        (the tree's version when the walk started, by default) are skipped: their
        subscribers were sent them as they were published."""
        if since is None:
            since = self.version
        if meter is None:
            meter = _Meter()
        levels = flt.split("/")
        n = len(levels)
        # plus_end[j]: the first level from j on that is not '+' (n if none), so a label
        # under a run of '+' is matched by counting its levels, not by splitting it.
        plus_end = [n] * (n + 1)
        for j in range(n - 1, -1, -1):
            plus_end[j] = plus_end[j + 1] if levels[j] == "+" else j
        root = self._root.children
        first = levels[0]
        stack = []
        if first == "#" or first == "+":
            # A filter starting with a wildcard does not match the broker's own '$' topics.
            kids = [c for k, c in root.items() if k[:1] != "$"]
            stack.append((iter(kids), -1 if first == "#" else 0, len(kids)))
            meter.held += len(kids)
        elif first in root:
            stack.append((iter((root[first],)), 0, 0))
        try:
            while stack:
                top = stack[-1]
                node = next(top[0], None)
                if node is None:
                    stack.pop()
                    meter.held -= top[2]
                    continue
                i = top[1]
                msg = node.msg
                if msg is not None and node.ver > since:
                    msg = None
                kids = node.children
                if i < 0:  # below a '#': everything
                    yield msg
                    if kids:
                        kids = list(kids.values())
                        stack.append((iter(kids), -1, len(kids)))
                        meter.held += len(kids)
                    continue
                # The label's first level matched on the way here (its key, or a '+').
                j = i + 1
                label = node.label
                if "/" in label:
                    m = label.count("/") + 1
                    if plus_end[j] >= j + m - 1:
                        k = m  # its other levels are under '+'s
                        j += m - 1
                    else:
                        ll = label.split("/")
                        k = 1
                        while k < m and j < n:
                            f = levels[j]
                            if f == "#" or (f != "+" and f != ll[k]):
                                break
                            j += 1
                            k += 1
                    if k < m:
                        if j < n and levels[j] == "#":  # a '#' within the label: all below
                            yield msg
                            if kids:
                                kids = list(kids.values())
                                stack.append((iter(kids), -1, len(kids)))
                                meter.held += len(kids)
                        else:
                            yield None
                        continue
                if j == n:
                    yield msg
                    continue
                f = levels[j]
                if f == "#":  # the topic itself matches 'topic/#' too
                    yield msg
                    if kids:
                        kids = list(kids.values())
                        stack.append((iter(kids), -1, len(kids)))
                        meter.held += len(kids)
                    continue
                yield None
                if kids:
                    if f == "+":
                        kids = list(kids.values())
                        stack.append((iter(kids), j, len(kids)))
                        meter.held += len(kids)
                    elif f in kids:
                        stack.append((iter((kids[f],)), j, 0))
        finally:
            meter.held -= sum(t[2] for t in stack)

    def match(self, flt):
        """Return every retained message whose topic matches filter `flt`."""
        return [m for m in self.walk(flt) if m is not None]

    def values(self):
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.msg is not None:
                yield node.msg
            if node.children:
                stack.extend(node.children.values())

    def recount(self):
        """(count, client_count, memory) counted afresh from what the tree holds: what the
        running sums must equal."""
        count = clients = memory = 0
        stack = [(self._root, False)]
        while stack:
            node, sys = stack.pop()
            if node is not self._root and not sys:
                memory += _node_cost(node.label)
            msg = node.msg
            if msg is not None:
                count += 1
                if getattr(msg, "client_id", ""):
                    clients += 1
                    memory += msg.memory()
            if node.children:
                stack.extend((c, sys or (node is self._root and k.startswith("$SYS")))
                             for k, c in node.children.items())
        return count, clients, memory
