"""Topic names and topic filters: validation, `$share/` parsing, the reference matcher, and
how two filters relate (`filters_overlap`, `filter_covers`).

Pure functions of strings, used by the broker, the config, the store's readers and the
tools alike; the tries that match many filters at once are the broker's (broker/topics.py)
and must agree with `topic_matches`.
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


def filters_overlap(a, b):
    """Whether some topic matches both MQTT filters `a` and `b`."""
    la, lb = a.split("/"), b.split("/")
    for x, y in zip(la, lb):
        if x == "#" or y == "#":
            return True
        if x != y and "+" not in (x, y):
            return False
    if len(la) == len(lb):
        return True
    longer = la if len(la) > len(lb) else lb
    return longer[min(len(la), len(lb))] == "#"  # ("a/#" matches "a" too)


def filter_covers(general, specific):
    """Whether every topic that filter `specific` matches is matched by filter `general`."""
    lg, ls = general.split("/"), specific.split("/")
    for i, x in enumerate(lg):
        if x == "#":
            return not (i == 0 and ls[0][:1] == "$")  # (a wildcard first matches no $ topic)
        if i >= len(ls):
            return False
        y = ls[i]
        if y == "#":
            return False
        if x == "+":
            if i == 0 and y[:1] == "$":
                return False
        elif x != y:
            return False
    return len(lg) == len(ls)
