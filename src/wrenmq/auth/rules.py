"""Per-client publish/subscribe rules that a login brings with it, in EMQX's formats.

A JWT's `acl` claim and an HTTP authentication answer's `acl` field carry the rules
of one client (the same JSON in both, so services written for EMQX work unchanged):

- the list format (EMQX 5.5+):
  `[{"permission": "allow"|"deny", "action": "publish"|"subscribe"|"all",
     "topic": "t/${clientid}/#", "qos": [0, 1], "retain": false}, ...]`
  The first rule that matches decides; when none matches the client's other sources
  decide (hooks behind, then the broker's default: allowed). `topic` is an MQTT filter
  with `${clientid}` and `${username}` put in; "eq t/#" matches the filter "t/#"
  itself only (a subscription to exactly that). `qos` and `retain` narrow a rule (`retain`: to retained
  PUBLISHes only when true, to others only when false).
- the older whitelist format: `{"pub": [...], "sub": [...], "all": [...]}` with `%c` and
  `%u` (or `${clientid}`, `${username}`) in the filters: what is not listed is refused.

A SUBSCRIBE passes a rule whose filter covers everything its filter can match ("t/#"
covers "t/+/x"; "t/+" does not cover "t/#"). A shared subscription is checked by its
filter ("$share/g/t/1" by "t/1"). Pure functions and data: no I/O.
"""

from ..mqtt.topics import TopicError, filter_covers, parse_shared, topic_matches, validate_topic_filter

MAX_RULES = 1000  # per client: what one check may walk

PUBLISH, SUBSCRIBE = "publish", "subscribe"


class RulesError(ValueError):
    """Rules that are not in either format (the login is refused: its grant is unclear)."""


def _fill(template, client_id, username):
    return (template.replace("${clientid}", client_id).replace("%c", client_id)
            .replace("${username}", username or "").replace("%u", username or ""))


class _Rule:
    __slots__ = ("allow", "actions", "topic", "exact", "qos", "retain")

    def __init__(self, allow, actions, topic, exact=False, qos=None, retain=None):
        self.allow = allow
        self.actions = actions
        self.topic = topic
        self.exact = exact
        self.qos = qos
        self.retain = retain

    def matches(self, action, name, qos, retain, client_id, username):
        if action not in self.actions:
            return False
        if self.qos is not None and qos not in self.qos:
            return False
        if self.retain is not None and action == PUBLISH and bool(retain) != self.retain:
            return False
        flt = _fill(self.topic, client_id, username)
        if self.exact:
            return name == flt
        if action == PUBLISH:
            return topic_matches(flt, name)
        return filter_covers(flt, name)


class ClientRules:
    """One client's rules; `check` answers True (allow), False (deny) or None (no rule)."""

    __slots__ = ("rules", "whitelist")

    def __init__(self, rules, whitelist):
        self.rules = rules
        self.whitelist = whitelist

    def check(self, action, name, qos, retain, client_id, username):
        if action == SUBSCRIBE:
            group, name = parse_shared(name)
        for rule in self.rules:
            if rule.matches(action, name, qos, retain, client_id, username):
                return rule.allow
        return False if self.whitelist else None

    def __len__(self):
        return len(self.rules)


_ACTIONS = {"publish": (PUBLISH,), "subscribe": (SUBSCRIBE,), "all": (PUBLISH, SUBSCRIBE),
            "pub": (PUBLISH,), "sub": (SUBSCRIBE,)}


def _filter(value, where):
    if not isinstance(value, str) or not value:
        raise RulesError(f"{where}: a topic filter is needed, got {value!r}")
    exact = value.startswith("eq ")
    flt = value[3:] if exact else value
    try:
        validate_topic_filter(flt.replace("${clientid}", "c").replace("${username}", "u"))
    except TopicError as e:
        raise RulesError(f"{where}: {value!r} is not a topic filter ({e})") from None
    return flt, exact


def parse_rules(value):
    """ClientRules from the JSON value of an `acl` claim or field; None for none (null or
    an empty list); RulesError for anything else than the two formats."""
    if value is None or value == [] or value == {}:
        return None
    rules = []
    if isinstance(value, list):
        if len(value) > MAX_RULES:
            raise RulesError(f"{len(value)} rules, at most {MAX_RULES}")
        for i, r in enumerate(value):
            where = f"rule {i}"
            if not isinstance(r, dict):
                raise RulesError(f"{where}: expected an object, got {type(r).__name__}")
            perm = r.get("permission")
            if perm not in ("allow", "deny"):
                raise RulesError(f"{where}: permission must be \"allow\" or \"deny\", got {perm!r}")
            actions = _ACTIONS.get(r.get("action"))
            if actions is None or r.get("action") in ("pub", "sub"):
                raise RulesError(f"{where}: action must be publish, subscribe or all, got {r.get('action')!r}")
            flt, exact = _filter(r.get("topic"), where)
            qos = r.get("qos")
            if qos is not None:
                if isinstance(qos, int) and not isinstance(qos, bool):
                    qos = [qos]
                if not isinstance(qos, list) or not all(q in (0, 1, 2) and not isinstance(q, bool) for q in qos):
                    raise RulesError(f"{where}: qos must be a list of 0, 1, 2, got {r.get('qos')!r}")
                qos = frozenset(qos)
            retain = r.get("retain")
            if retain is not None and not isinstance(retain, bool):
                raise RulesError(f"{where}: retain must be true or false, got {retain!r}")
            rules.append(_Rule(perm == "allow", actions, flt, exact, qos, retain))
        return ClientRules(tuple(rules), whitelist=False)
    if isinstance(value, dict):
        unknown = set(value) - {"pub", "sub", "all"}
        if unknown:
            raise RulesError(f"unknown keys {sorted(unknown)} (expected pub, sub, all)")
        for key in ("pub", "sub", "all"):
            topics = value.get(key, [])
            if not isinstance(topics, list):
                raise RulesError(f"{key}: expected a list of topic filters")
            for t in topics:
                flt, exact = _filter(t, key)
                rules.append(_Rule(True, _ACTIONS[key], flt, exact))
        if len(rules) > MAX_RULES:
            raise RulesError(f"{len(rules)} rules, at most {MAX_RULES}")
        return ClientRules(tuple(rules), whitelist=True)
    raise RulesError(f"expected a list of rules or a pub/sub/all object, got {type(value).__name__}")
