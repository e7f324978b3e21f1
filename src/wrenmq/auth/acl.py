"""Mosquitto ACL files.

Syntax (one rule per line; `#` at the start of a line is a comment):

    topic [read|write|readwrite|deny] <topic>     rule for the current user
    user <username>                               following `topic` rules are this user's
    pattern [read|write|readwrite|deny] <topic>   rule for every client, %c = client id,
                                                  %u = user name

`topic` rules before the first `user` line apply to anonymous clients. The
access word is optional (default readwrite) unless the topic contains a space.
`pattern` rules apply to every client wherever they appear in the file.

Evaluation is Mosquitto 2.0's (`mosquitto_acl_check_default`), for a concrete
topic and an access (READ for delivery, WRITE for publish):

1. the client's own rules (its `user` block, or the anonymous block), `deny`
   rules first, then in file order: a matching `deny` refuses; a matching rule
   that grants the access allows;
2. if nothing decided and the file has patterns: a client whose id or user name
   contains `+` or `#` is refused; then the patterns with %c/%u substituted,
   `deny` first, the same way (a pattern with %u does not apply to a client
   without a user name);
3. otherwise refused.

An ACL topic that does not start with `$` never matches a topic that does
(`#` does not grant `$SYS/...`).

Subscriptions: Mosquitto 2.0 accepts every SUBSCRIBE and only filters what is
delivered. wrenmq also filters every delivery, and in addition refuses a
subscription that could never deliver anything, with the same two steps on
the filter: a `deny` rule that covers the whole filter refuses; a rule granting
read whose topic overlaps the filter (some topic matches both) accepts. So with
`topic read sensors/+/temp`, a subscription to `sensors/#` is accepted (and gets
only the temperatures) and one to `secret/#` is refused. `$share/<group>/` is
stripped before the check.
"""

import logging

from ..mqtt.topics import TopicError, parse_shared, topic_matches, validate_topic_filter

log = logging.getLogger("wrenmq.auth")

DENY = 0
READ = 1
WRITE = 2
READWRITE = READ | WRITE
_ACCESS = {"read": READ, "write": WRITE, "readwrite": READWRITE, "deny": DENY}
_NAMES = {v: k for k, v in _ACCESS.items()}


class AclError(ValueError):
    """An ACL file that cannot be used; the message names the file and the line."""


class Rule:
    __slots__ = ("access", "topic", "line", "ucount", "ccount")

    def __init__(self, access, topic, line):
        self.access = access
        self.topic = topic
        self.line = line
        self.ucount = topic.count("%u")
        self.ccount = topic.count("%c")

    def __repr__(self):
        return f"Rule({_NAMES[self.access]} {self.topic!r}, line {self.line})"


def _ordered(rules):
    """Mosquitto puts `deny` rules in front of the others (each in file order)."""
    return [r for r in rules if r.access == DENY] + [r for r in rules if r.access != DENY]


def _intersects(a, b):
    """True if some topic name matches both filters `a` and `b`."""
    if (a[:1] == "$") != (b[:1] == "$"):
        # A filter starting with a wildcard matches no $ topic; one starting with a
        # literal "$..." matches only $ topics; two literals are compared below.
        if a[:1] in ("+", "#") or b[:1] in ("+", "#"):
            return False
    al = a.split("/")
    bl = b.split("/")
    for i in range(max(len(al), len(bl))):
        x = al[i] if i < len(al) else None
        y = bl[i] if i < len(bl) else None
        if x == "#" or y == "#":
            return True
        if x is None or y is None:
            return False
        if x != "+" and y != "+" and x != y:
            return False
    return True


def _covers(d, f):
    """True if every topic name matching filter `f` also matches filter `d`."""
    if (f[:1] == "$") != (d[:1] == "$"):
        return False  # wildcards never match $ topics; literals differ
    dl = d.split("/")
    fl = f.split("/")
    for i, x in enumerate(fl):
        if i >= len(dl):
            return False
        y = dl[i]
        if y == "#":
            return True
        if x == "#":
            return False  # f goes on (or stops a level early) where d cannot
        if y == "+":
            continue
        if x != y:
            return False
    return len(dl) == len(fl) or (len(dl) == len(fl) + 1 and dl[-1] == "#")


def _dollar_skip(rule_topic, topic):
    """Mosquitto: a topic starting with '$' is only matched by ACL topics starting with '$'."""
    return topic[:1] == "$" and rule_topic[:1] != "$"


class Acl:
    def __init__(self, path, anonymous, users, patterns):
        self.path = path
        self.anonymous = _ordered(anonymous)
        self.users = {u: _ordered(rs) for u, rs in users.items()}
        self.patterns = _ordered(patterns)

    @property
    def rule_count(self):
        return len(self.anonymous) + sum(len(r) for r in self.users.values()) + len(self.patterns)

    def _own_rules(self, username):
        if username is None:
            return self.anonymous
        return self.users.get(username, ())

    @staticmethod
    def _substitute(rule, client_id, username):
        t = rule.topic
        if rule.ccount:
            t = t.replace("%c", client_id)
        if rule.ucount:
            t = t.replace("%u", username)
        return t

    def _pattern_topics(self, client_id, username):
        """(rule, substituted topic) for the patterns that apply; None if the client's id or
        name makes patterns unsafe (Mosquitto refuses such clients everything here)."""
        if username is not None and ("+" in username or "#" in username):
            log.info("ACL refusing client with dangerous user name %r", username)
            return None
        if client_id and ("+" in client_id or "#" in client_id):
            log.info("ACL refusing client with dangerous client id %r", client_id)
            return None
        out = []
        for rule in self.patterns:
            if rule.ucount and username is None:
                continue
            out.append((rule, self._substitute(rule, client_id or "", username)))
        return out

    def check(self, client_id, username, topic, access):
        """May the client READ (receive) or WRITE (publish) on the topic name?"""
        for rule in self._own_rules(username):
            if _dollar_skip(rule.topic, topic):
                continue
            if topic_matches(rule.topic, topic):
                if rule.access == DENY:
                    return False
                if rule.access & access:
                    return True
        if not self.patterns:
            return False
        pats = self._pattern_topics(client_id, username)
        if pats is None:
            return False
        for rule, t in pats:
            if _dollar_skip(t, topic):
                continue
            if topic_matches(t, topic):
                if rule.access == DENY:
                    return False
                if rule.access & access:
                    return True
        return False

    def check_subscribe(self, client_id, username, topic_filter):
        """May the client subscribe to the filter? (See the module docstring.)"""
        try:
            _, flt = parse_shared(topic_filter)
        except TopicError:
            return False
        stages = [[(r, r.topic) for r in self._own_rules(username)]]
        if self.patterns:
            pats = self._pattern_topics(client_id, username)
            if pats is None:
                return False
            stages.append(pats)
        for stage in stages:
            for rule, t in stage:
                if _dollar_skip(t, flt):
                    continue
                if rule.access == DENY:
                    if _covers(t, flt):
                        return False
                elif rule.access & READ and _intersects(t, flt):
                    return True
        return False

    # --- parsing --------------------------------------------------------------

    @classmethod
    def load(cls, path):
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as e:
            raise AclError(f"{path}: cannot read ACL file: {e.strerror or e}") from None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data[:e.start].count(b"\n") + 1
            raise AclError(f"{path}:{line}: not valid UTF-8") from None
        return cls.parse(text, path)

    @classmethod
    def parse(cls, text, path="<string>"):
        anonymous, users, patterns = [], {}, []
        current = None  # None = the anonymous block
        for n, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            word, _, rest = line.partition(" ")
            rest = rest.strip()
            if word in ("topic", "pattern"):
                if not rest:
                    raise AclError(f"{path}:{n}: {word} without a topic")
                first, _, tail = rest.partition(" ")
                tail = tail.strip()
                if tail:
                    access = _ACCESS.get(first)
                    if access is None:
                        raise AclError(f"{path}:{n}: invalid access {first!r} (expected read, write, "
                                       "readwrite or deny)")
                    topic = tail
                else:
                    if first in _ACCESS:
                        raise AclError(f"{path}:{n}: {word} {first} without a topic")
                    access, topic = READWRITE, first
                try:
                    validate_topic_filter(topic)
                except TopicError as e:
                    raise AclError(f"{path}:{n}: invalid topic {topic!r}: {e}") from None
                rule = Rule(access, topic, n)
                if word == "pattern":
                    if not rule.ucount and not rule.ccount:
                        log.warning("%s:%d: pattern %r contains neither %%c nor %%u", path, n, topic)
                    patterns.append(rule)
                elif current is None:
                    anonymous.append(rule)
                else:
                    users[current].append(rule)
            elif word == "user":
                if not rest:
                    raise AclError(f"{path}:{n}: user without a name")
                current = rest
                users.setdefault(current, [])
            else:
                raise AclError(f"{path}:{n}: unknown keyword {word!r} (expected topic, pattern or user)")
        return cls(path, anonymous, users, patterns)
