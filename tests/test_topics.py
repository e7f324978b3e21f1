"""Topic validation, the subscription trie and the retained-message trie."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from wrenmq.broker.topics import RetainedTrie, TopicTrie
from wrenmq.mqtt.topics import (
    TopicError, parse_shared, topic_matches, validate_topic_filter, validate_topic_name,
)

# --------------------------------------------------------------------------- validation

VALID_NAMES = ["a", "a/b", "/", "/a", "a/", "a//b", "$SYS/broker/uptime", " ", "a b/c",
               "caf\u00e9/\u6f22\u5b57", "$share/g/t", "x" * 1000]
INVALID_NAMES = ["", "+", "#", "a/+", "a/#", "+/a", "a+b", "a#b", "a/b#", "sport/+/player"]


@pytest.mark.parametrize("name", VALID_NAMES)
def test_valid_topic_names(name):
    validate_topic_name(name)


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_invalid_topic_names(name):
    with pytest.raises(TopicError):
        validate_topic_name(name)


VALID_FILTERS = ["#", "+", "a", "a/b", "a/#", "a/+", "+/+", "+/#", "/+", "/#", "+/", "a//b",
                 "a/+/c", "a/+/#", "/", "//", "$SYS/#", "$SYS/+/x", "sport/tennis/+/#"]
INVALID_FILTERS = ["", "a#", "#a", "#/a", "a/#/b", "a/#/", "##", "+a", "a+", "a/b+", "++",
                   "a/+#", "a/#+", "sport/tennis#", "sport+/x"]


@pytest.mark.parametrize("flt", VALID_FILTERS)
def test_valid_topic_filters(flt):
    validate_topic_filter(flt)


@pytest.mark.parametrize("flt", INVALID_FILTERS)
def test_invalid_topic_filters(flt):
    with pytest.raises(TopicError):
        validate_topic_filter(flt)


def check_subscription_filter(flt):
    """What a SUBSCRIBE does with a filter: split off $share, then validate the rest."""
    group, inner = parse_shared(flt)
    validate_topic_filter(inner)
    return group, inner


@pytest.mark.parametrize("flt, expected", [
    ("$share/g/f", ("g", "f")),
    ("$share/group-1/a/+/#", ("group-1", "a/+/#")),
    ("$share/g/#", ("g", "#")),
    ("$share/g//", ("g", "/")),
    ("$share/g/$SYS/#", ("g", "$SYS/#")),
    ("a/b", (None, "a/b")),
    ("$SHARE/g/f", (None, "$SHARE/g/f")),  # the prefix is case sensitive
    ("$shared/g/f", (None, "$shared/g/f")),
    ("$share", (None, "$share")),
])
def test_shared_filters(flt, expected):
    assert check_subscription_filter(flt) == expected


@pytest.mark.parametrize("flt", [
    "$share/g", "$share/g/", "$share//f", "$share/", "$share//", "$share/+/f", "$share/#/f",
    "$share/g+/f", "$share/g#/f", "$share/g/a#", "$share/g/#/a",
])
def test_invalid_shared_filters(flt):
    with pytest.raises(TopicError):
        check_subscription_filter(flt)


@pytest.mark.parametrize("depth, ok", [(1, True), (3, True), (4, False)])
def test_max_levels(depth, ok):
    name = "/".join(["a"] * depth)
    flt = "/".join(["+"] * depth)
    if ok:
        validate_topic_name(name, max_levels=3)
        validate_topic_filter(flt, max_levels=3)
    else:
        with pytest.raises(TopicError):
            validate_topic_name(name, max_levels=3)
        with pytest.raises(TopicError):
            validate_topic_filter(flt, max_levels=3)


# --------------------------------------------------------------------------- matching table

# (filter, topic, matches), from MQTT 3.1.1 section 4.7 and 5.0 section 4.7.
MATCH_TABLE = [
    ("a", "a", True), ("a", "b", False), ("a", "a/b", False), ("a/b", "a", False),
    ("#", "a", True), ("#", "a/b/c", True), ("#", "/", True), ("#", "/a", True),
    ("a/#", "a", True), ("a/#", "a/b", True), ("a/#", "a/b/c", True), ("a/#", "ab", False),
    ("a/#", "b/a", False), ("a/#", "a/", True),
    ("+", "a", True), ("+", "a/b", False), ("+", "/", False), ("+/+", "/", True),
    ("/+", "/a", True), ("/+", "a", False), ("+/a", "/a", True), ("/#", "/a", True),
    ("/#", "/", True), ("/#", "a", False),
    ("a/+/b", "a//b", True), ("a//b", "a//b", True), ("a//b", "a/x/b", False),
    ("a/+", "a/", True), ("a/+", "a", False), ("a/+/#", "a/b", True), ("a/+/#", "a", False),
    ("+/#", "a", True), ("+/+/+", "a/b", False),
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False), ("sport/+", "sport/", True),
    # '$' topics are not matched by a leading wildcard
    ("#", "$SYS", False), ("#", "$SYS/x", False), ("+/x", "$SYS/x", False),
    ("+/#", "$SYS/x", False), ("+", "$SYS", False), ("+", "$", False),
    ("$SYS/#", "$SYS/x", True), ("$SYS/#", "$SYS", True), ("$SYS/+", "$SYS/x", True),
    ("$SYS/x", "$SYS/x", True), ("$SYS/#", "$SYS/a/b", True),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    # ...but a '$' further down is an ordinary character
    ("a/#", "a/$x", True), ("a/+", "a/$x", True), ("+/+", "a/$x", True),
]


@pytest.mark.parametrize("flt, topic, expected", MATCH_TABLE)
def test_reference_matcher(flt, topic, expected):
    assert topic_matches(flt, topic) is expected


@pytest.mark.parametrize("flt, topic, expected", MATCH_TABLE)
def test_topic_trie_match_table(flt, topic, expected):
    trie = TopicTrie()
    trie.insert(flt, "k", flt)
    assert matched(trie, topic) == ({(flt, "k")} if expected else set())


@pytest.mark.parametrize("flt, topic, expected", MATCH_TABLE)
def test_retained_trie_match_table(flt, topic, expected):
    rt = RetainedTrie()
    rt.set(topic, topic)
    assert rt.match(flt) == ([topic] if expected else [])


def test_trie_with_all_table_filters_at_once():
    trie = TopicTrie()
    for flt, _, _ in MATCH_TABLE:
        trie.insert(flt, "k", flt)
    for _, topic, _ in MATCH_TABLE:
        want = {(flt, "k") for flt, _, _ in MATCH_TABLE if topic_matches(flt, topic)}
        assert matched(trie, topic) == want


# --------------------------------------------------------------------------- TopicTrie units

def matched(trie, topic):
    """Set of (filter, key) matched; each value stored is the filter itself."""
    out = set()
    for values in trie.match(topic):
        for key, flt in values.items():
            out.add((flt, key))
    return out


def test_insert_get_replace_count():
    trie = TopicTrie()
    assert trie.insert("a/+", "s1", "v1") is True
    assert trie.insert("a/+", "s2", "v2") is True
    assert trie.insert("a/+", "s1", "v1b") is False
    assert trie.count == 2
    assert trie.get("a/+", "s1") == "v1b"
    assert trie.get("a/+", "nobody") is None
    assert trie.get("a", "s1") is None
    assert trie.get("a/+/c", "s1") is None
    assert trie.match("a/x") == [{"s1": "v1b", "s2": "v2"}]


def test_remove_returns_value_and_prunes():
    trie = TopicTrie()
    trie.insert("a/b/c", "k", 1)
    trie.insert("a/b", "k", 2)
    trie.insert("a/#", "j", 3)
    assert trie.remove("a/b/c", "other") is None
    assert trie.remove("a/b/c/d", "k") is None
    assert trie.remove("x", "k") is None
    assert trie.count == 3
    assert trie.remove("a/b/c", "k") == 1
    assert trie.remove("a/b/c", "k") is None
    assert trie.count == 2
    assert trie.match("a/b/c") == [{"j": 3}]
    assert trie.match("a/b") == [{"j": 3}, {"k": 2}] or trie.match("a/b") == [{"k": 2}, {"j": 3}]
    assert trie.remove("a/b", "k") == 2
    assert trie.remove("a/#", "j") == 3
    assert trie.count == 0
    assert list(trie.items()) == []
    assert trie._root.children == {}  # every emptied branch was pruned


def test_remove_keeps_branch_with_other_filters_below():
    trie = TopicTrie()
    trie.insert("a", "k", "a")
    trie.insert("a/b", "k", "a/b")
    assert trie.remove("a", "k") == "a"
    assert matched(trie, "a/b") == {("a/b", "k")}
    assert matched(trie, "a") == set()


def test_items_lists_everything():
    trie = TopicTrie()
    entries = {("a/#", "x", 1), ("a/#", "y", 2), ("+", "x", 3), ("/", "z", 4), ("a//b", "x", 5)}
    for e in entries:
        trie.insert(*e)
    assert set(trie.items()) == entries


def test_sys_topics():
    trie = TopicTrie()
    for flt in ["#", "+/#", "+/broker/uptime", "+", "$SYS/#", "$SYS/+/uptime", "$SYS/broker/uptime"]:
        trie.insert(flt, "k", flt)
    assert matched(trie, "$SYS/broker/uptime") == {
        ("$SYS/#", "k"), ("$SYS/+/uptime", "k"), ("$SYS/broker/uptime", "k")}
    assert matched(trie, "$SYS") == {("$SYS/#", "k")}
    assert matched(trie, "x/broker/uptime") == {("#", "k"), ("+/#", "k"), ("+/broker/uptime", "k")}


def test_hash_matches_parent_level():
    trie = TopicTrie()
    trie.insert("a/#", "k", "a/#")
    trie.insert("a/b/#", "k", "a/b/#")
    assert matched(trie, "a") == {("a/#", "k")}
    assert matched(trie, "a/b") == {("a/#", "k"), ("a/b/#", "k")}
    assert matched(trie, "a/b/c/d") == {("a/#", "k"), ("a/b/#", "k")}
    assert matched(trie, "b") == set()


def test_empty_levels():
    trie = TopicTrie()
    for flt in ["a//b", "a/+/b", "/a", "+/a", "/+", "/#", "+/+", "+"]:
        trie.insert(flt, "k", flt)
    assert matched(trie, "a//b") == {("a//b", "k"), ("a/+/b", "k")}
    assert matched(trie, "/a") == {("/a", "k"), ("+/a", "k"), ("/+", "k"), ("/#", "k"),
                                   ("+/+", "k")}
    assert matched(trie, "/") == {("/+", "k"), ("/#", "k"), ("+/+", "k")}
    assert matched(trie, "a") == {("+", "k")}


# --------------------------------------------------------------------------- properties

LEVELS = ["a", "b", "$x", ""]


def all_topics(max_depth=3):
    out = []
    for depth in range(1, max_depth + 1):
        out.extend("/".join(p) for p in itertools.product(LEVELS, repeat=depth))
    return out


TOPICS = all_topics() + ["a/b/a/b", "$x/a/b/", "///"]

level = st.sampled_from(LEVELS + ["+"])
filters = st.builds(
    lambda body, hash_: "/".join(body + (["#"] if hash_ else [])),
    st.lists(level, min_size=0, max_size=4), st.booleans(),
).filter(bool)
topics = st.lists(st.sampled_from(LEVELS), min_size=1, max_size=5).map("/".join)
keys = st.sampled_from(["s1", "s2", "s3"])


def expected_matches(entries, topic):
    return {(f, k) for f, k in entries if topic_matches(f, topic)}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(filters, keys), max_size=25), st.lists(topics, max_size=15),
       st.data())
def test_trie_agrees_with_reference_and_removal_equals_fresh(entries, extra_topics, data):
    entries = set(entries)
    trie = TopicTrie()
    for f, k in entries:
        trie.insert(f, k, f)
    assert trie.count == len(entries)
    check_topics = TOPICS + extra_topics
    for t in check_topics:
        assert matched(trie, t) == expected_matches(entries, t), t

    removed = data.draw(st.sets(st.sampled_from(sorted(entries)))) if entries else set()
    for f, k in removed:
        assert trie.remove(f, k) == f
    remaining = entries - removed
    fresh = TopicTrie()
    for f, k in remaining:
        fresh.insert(f, k, f)
    assert trie.count == fresh.count == len(remaining)
    assert set(trie.items()) == set(fresh.items()) == {(f, k, f) for f, k in remaining}
    for t in check_topics:
        assert matched(trie, t) == matched(fresh, t) == expected_matches(remaining, t), t


class TopicTrieMachine(RuleBasedStateMachine):
    """Random inserts and removes against a dict model, checked on every step."""

    @initialize()
    def setup(self):
        self.trie = TopicTrie()
        self.model = {}

    @rule(f=filters, k=keys, v=st.integers())
    def insert(self, f, k, v):
        new = self.trie.insert(f, k, (f, v))
        assert new == ((f, k) not in self.model)
        self.model[(f, k)] = (f, v)

    @rule(f=filters, k=keys)
    def remove(self, f, k):
        assert self.trie.remove(f, k) == self.model.pop((f, k), None)

    @invariant()
    def agrees(self):
        assert self.trie.count == len(self.model)
        for t in TOPICS[::3]:
            got = set()
            for values in self.trie.match(t):
                for k, (f, v) in values.items():
                    got.add((f, k, v))
            want = {(f, k, v) for (f, k), (_, v) in self.model.items() if topic_matches(f, t)}
            assert got == want, t


TopicTrieMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30,
                                              deadline=None)
test_topic_trie_state_machine = TopicTrieMachine.TestCase

FILTER_UNIVERSE = sorted({"/".join(p) for d in range(1, 4)
                          for p in itertools.product(LEVELS + ["+"], repeat=d)}
                         | {"/".join(p + ("#",)) for d in range(0, 3)
                            for p in itertools.product(LEVELS + ["+"], repeat=d)})


@settings(max_examples=200, deadline=None)
@given(st.sets(topics, max_size=30), st.data())
def test_retained_trie_agrees_with_reference(stored, data):
    rt = RetainedTrie()
    for t in stored:
        rt.set(t, t)
    deleted = data.draw(st.sets(st.sampled_from(sorted(stored)))) if stored else set()
    for t in deleted:
        assert rt.delete(t) == t
        assert rt.delete(t) is None
    live = stored - deleted
    assert rt.count == len(live)
    assert sorted(rt.values()) == sorted(live)
    for t in stored:
        assert rt.get(t) == (t if t in live else None)
    for flt in FILTER_UNIVERSE[::2] + data.draw(st.lists(filters, max_size=10)):
        got = rt.match(flt)
        assert len(got) == len(set(got)), flt  # nothing reported twice
        assert set(got) == {t for t in live if topic_matches(flt, t)}, flt


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.sampled_from(LEVELS + ["$SYS", "long" * 20]),
                                                  min_size=1, max_size=6).map("/".join),
                          st.integers(0, 100)), max_size=40))
def test_retained_trie_memory_is_what_it_holds(ops):
    """`memory`, a running sum through every split and merge of the tree, equals the tree
    counted afresh (`recount`) after any sets and deletes of clients' messages (the $SYS
    ones not counted), and a set grows it by no more than `growth` said beforehand: what
    max_retained_bytes is checked against."""
    from wrenmq.broker.message import Message

    rt = RetainedTrie()
    for keep, topic, size in ops:
        if keep:
            msg = Message(topic, b"p" * size, 0, True, {}, None, "" if topic.startswith("$SYS") else "c")
            most = rt.growth(topic, msg)
            before = rt.memory
            rt.set(topic, msg)
            assert rt.memory - before <= most, topic
        else:
            rt.delete(topic)
        assert rt.recount() == (rt.count, rt.client_count, rt.memory)
    for topic in {t for _, t, _ in ops}:
        rt.delete(topic)
    assert (rt.count, rt.client_count, rt.memory) == (0, 0, 0) and not rt._root.children


def test_retained_trie_set_replace_delete():
    rt = RetainedTrie()
    rt.set("a/b", 1)
    rt.set("a/b", 2)
    rt.set("a", 3)
    assert rt.count == 2
    assert rt.get("a/b") == 2
    assert rt.get("a/c") is None
    assert sorted(rt.match("a/#")) == [2, 3]
    assert rt.match("#") == [3, 2] or rt.match("#") == [2, 3]
    assert rt.delete("a/c") is None
    assert rt.delete("a") == 3
    assert rt.match("a") == []
    assert rt.match("a/+") == [2]
    assert rt.delete("a/b") == 2
    assert rt.count == 0
    assert rt._root.children == {}  # emptied branches pruned


def test_retained_sys_topics():
    rt = RetainedTrie()
    for t in ["$SYS/uptime", "$SYS/a/b", "$x", "a", "a/$SYS"]:
        rt.set(t, t)
    assert sorted(rt.match("#")) == ["a", "a/$SYS"]
    assert sorted(rt.match("+")) == ["a"]
    assert sorted(rt.match("+/+")) == ["a/$SYS"]
    assert sorted(rt.match("$SYS/#")) == ["$SYS/a/b", "$SYS/uptime"]
    assert sorted(rt.match("$SYS/+")) == ["$SYS/uptime"]
    assert rt.match("$x") == ["$x"]


# --------------------------------------------------------------------------- deep topics

DEPTH = 10_000


def test_deep_topic_in_subscription_trie():
    topic = "/".join(["a"] * DEPTH)
    all_plus = "/".join(["+"] * DEPTH)
    alternating = "/".join("+" if i % 2 else "a" for i in range(DEPTH))
    wrong_last = "/".join(["+"] * (DEPTH - 1) + ["b"])
    too_long = "/".join(["+"] * (DEPTH + 1))
    half_then_hash = "/".join(["+"] * (DEPTH // 2) + ["#"])
    trie = TopicTrie()
    for f in [all_plus, alternating, wrong_last, too_long, half_then_hash, "#", "a/#"]:
        trie.insert(f, "k", f)
    for depth in range(1, 300):  # many shorter all-'+' filters sharing one branch
        trie.insert("/".join(["+"] * depth), "k", depth)
    got = {v for values in trie.match(topic) for v in values.values()}
    assert got == {all_plus, alternating, half_then_hash, "#", "a/#"}
    for f in [all_plus, alternating, half_then_hash, "#", "a/#"]:
        assert topic_matches(f, topic)
    for f in [wrong_last, too_long]:
        assert not topic_matches(f, topic)


def test_deep_topic_in_retained_trie():
    rt = RetainedTrie()
    deep = "/".join(["a"] * DEPTH)
    rt.set(deep, "deep")
    rt.set("a/b", "short")
    assert rt.match("/".join(["+"] * DEPTH)) == ["deep"]
    assert rt.match("/".join(["+"] * (DEPTH - 1))) == []
    assert sorted(rt.match("#")) == ["deep", "short"]
    assert sorted(rt.match("+/#")) == ["deep", "short"]
    assert rt.match("/".join(["a"] * (DEPTH // 2) + ["#"])) == ["deep"]
    assert rt.delete(deep) == "deep"
    assert rt.match("#") == ["short"]
