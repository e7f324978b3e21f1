"""Topic names, topic filters and the subscription trie.

Matching walks the trie one topic level at a time, so its cost is linear in the
number of levels times the wildcard branches that actually exist: there is no
regular expression anywhere and no input can make it backtrack.
"""

SHARE_PREFIX = "$share/"


class TopicError(ValueError):
    pass


def validate_topic_name(topic, max_levels=0):
    """Raise TopicError unless `topic` may be published to."""
    if not topic:
        raise TopicError("empty topic name")
    if "+" in topic or "#" in topic:
        raise TopicError("wildcard in topic name")
    if max_levels and topic.count("/") >= max_levels:
        raise TopicError(f"topic name has more than {max_levels} levels")


def validate_topic_filter(flt, max_levels=0):
    """Raise TopicError unless `flt` is a valid (non-shared) topic filter."""
    if not flt:
        raise TopicError("empty topic filter")
    levels = flt.split("/")
    if max_levels and len(levels) > max_levels:
        raise TopicError(f"topic filter has more than {max_levels} levels")
    last = len(levels) - 1
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != last):
            raise TopicError("'#' must be the last level on its own")
        if "+" in level and level != "+":
            raise TopicError("'+' must occupy a whole level")


def parse_shared(flt):
    """Split '$share/group/filter' into (group, filter); (None, flt) if not shared."""
    if not flt.startswith(SHARE_PREFIX):
        return None, flt
    rest = flt[len(SHARE_PREFIX):]
    group, sep, inner = rest.partition("/")
    if not group or not sep or not inner:
        raise TopicError("shared subscription needs $share/<group>/<filter>")
    if "+" in group or "#" in group:
        raise TopicError("wildcard in shared subscription group name")
    return group, inner


def topic_matches(flt, topic):
    """Reference matcher (plain, level by level); the trie must agree with it."""
    if topic.startswith("$") and flt[:1] in ("+", "#"):
        return False
    fl = flt.split("/")
    tl = topic.split("/")
    for i, f in enumerate(fl):
        if f == "#":
            return True
        if i >= len(tl):
            return False
        if f != "+" and f != tl[i]:
            return False
    return len(fl) == len(tl)


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


def retained_size(topic, msg):
    """What a client's retained message counts against [limits] max_retained_bytes: its
    topic (UTF-8) and payload."""
    return len(topic.encode()) + len(msg.payload)


class RetainedTrie:
    """Retained messages by topic, found by topic filter without scanning all of them.

    `count`: all of them. `client_count` and `client_bytes` (retained_size of each): the
    clients' ones, what [limits] max_retained_messages and max_retained_bytes bound; the
    broker's own ($SYS, the embedding API: no client id) are not counted there.
    """

    __slots__ = ("_root", "count", "client_count", "client_bytes")

    def __init__(self):
        self._root = _Node()
        self.count = 0
        self.client_count = 0
        self.client_bytes = 0

    def _weigh(self, topic, msg, sign):
        if getattr(msg, "client_id", ""):  # (the tests store plain values: not a client's)
            self.client_count += sign
            self.client_bytes += sign * retained_size(topic, msg)

    def set(self, topic, msg):
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        if node.values is None:
            self.count += 1
        else:
            self._weigh(topic, node.values, -1)
        self._weigh(topic, msg, 1)
        node.values = msg

    def get(self, topic):
        node = self._root
        for level in topic.split("/"):
            node = node.children.get(level)
            if node is None:
                return None
        return node.values

    def delete(self, topic):
        path = []
        node = self._root
        for level in topic.split("/"):
            child = node.children.get(level)
            if child is None:
                return None
            path.append((node, level))
            node = child
        msg = node.values
        if msg is None:
            return None
        node.values = None
        self.count -= 1
        self._weigh(topic, msg, -1)
        for parent, level in reversed(path):
            child = parent.children[level]
            if child.values is not None or child.children:
                break
            del parent.children[level]
        return msg

    def match(self, flt):
        """Return every retained message whose topic matches filter `flt`."""
        levels = flt.split("/")
        n = len(levels)
        out = []
        stack = [(self._root, 0)]
        while stack:
            node, i = stack.pop()
            if i == n:
                if node.values is not None:
                    out.append(node.values)
                continue
            level = levels[i]
            if level == "#":
                # '#' matches this level's parent too, and everything below.
                if node.values is not None and i:
                    out.append(node.values)
                sub = [(c, k) for k, c in node.children.items() if i or k[:1] != "$"]
                while sub:
                    cnode, _ = sub.pop()
                    if cnode.values is not None:
                        out.append(cnode.values)
                    sub.extend((c, k) for k, c in cnode.children.items())
            elif level == "+":
                for k, c in node.children.items():
                    if i or k[:1] != "$":
                        stack.append((c, i + 1))
            else:
                c = node.children.get(level)
                if c is not None:
                    stack.append((c, i + 1))
        return out

    def values(self):
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.values is not None:
                yield node.values
            stack.extend(node.children.values())
