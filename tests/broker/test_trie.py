"""SubscriptionTrie: exact matching semantics, cache coherence under churn, and pruning."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshmq.broker.trie import SubscriptionTrie
from meshmq.mqtt.topics import topic_matches, validate_topic_filter, validate_topic_name

FIRST_TOPIC_LEVELS = ["a", "b", "", "$x"]
TOPIC_LEVELS = ["a", "b", ""]
FILTER_LEVELS = ["a", "b", "", "+", "$x"]


@st.composite
def topics(draw: st.DrawFn) -> str:
    first = draw(st.sampled_from(FIRST_TOPIC_LEVELS))
    rest = draw(st.lists(st.sampled_from(TOPIC_LEVELS), max_size=3))
    topic = "/".join([first, *rest])
    if not topic:
        topic = "a"
    validate_topic_name(topic)
    return topic


@st.composite
def filters(draw: st.DrawFn) -> str:
    levels = draw(st.lists(st.sampled_from(FILTER_LEVELS), max_size=4))
    if draw(st.booleans()):
        levels.append("#")
    topic_filter = "/".join(levels) or "+"
    validate_topic_filter(topic_filter)
    return topic_filter


def matched(trie: SubscriptionTrie[str, int], topic: str) -> dict[str, dict[str, int]]:
    """Snapshot of trie.match(topic) as {filter: entries}, asserting each filter appears once."""
    result = trie.match(topic)
    snapshot = {topic_filter: dict(entries) for topic_filter, entries in result}
    assert len(snapshot) == len(result)
    assert all(snapshot.values())
    return snapshot


def test_spec_examples() -> None:
    trie: SubscriptionTrie[str, int] = SubscriptionTrie()
    for topic_filter in [
        "sport/tennis/player1/#",
        "sport/#",
        "#",
        "+",
        "+/tennis/#",
        "sport/tennis/+",
        "$SYS/#",
        "+/x",
        "$SYS/+",
        "sport/+",
    ]:
        trie.add(topic_filter, "c", 1)
    assert set(matched(trie, "sport")) == {"sport/#", "#", "+"}
    assert set(matched(trie, "sport/tennis/player1")) == {
        "sport/tennis/player1/#",
        "sport/#",
        "#",
        "sport/tennis/+",
        "+/tennis/#",
    }
    assert set(matched(trie, "sport/tennis")) == {"sport/#", "#", "+/tennis/#", "sport/+"}
    assert set(matched(trie, "$SYS/x")) == {"$SYS/#", "$SYS/+"}
    assert set(matched(trie, "$SYS")) == {"$SYS/#"}
    assert set(matched(trie, "other/x")) == {"#", "+/x"}


def test_dollar_topics_not_matched_by_leading_wildcards() -> None:
    trie: SubscriptionTrie[str, int] = SubscriptionTrie()
    trie.add("#", "all", 1)
    trie.add("+/x", "plus", 2)
    assert matched(trie, "$SYS/x") == {}
    trie.add("$SYS/#", "sys", 3)
    assert matched(trie, "$SYS/x") == {"$SYS/#": {"sys": 3}}
    assert matched(trie, "y/x") == {"#": {"all": 1}, "+/x": {"plus": 2}}


def test_add_get_remove_and_len() -> None:
    trie: SubscriptionTrie[str, str] = SubscriptionTrie()
    assert trie.add("a/+", "c1", "v1") is True
    assert trie.add("a/+", "c2", "v2") is True
    assert trie.add("a/+", "c1", "v1b") is False
    assert trie.add("a/#", "c1", "h") is True
    assert len(trie) == 3
    assert trie.get("a/+", "c1") == "v1b"
    assert trie.get("a/+", "nobody") is None
    assert trie.get("a", "c1") is None
    assert trie.get("a/b", "c1") is None
    assert sorted(trie.filters()) == ["a/#", "a/+"]
    assert trie.remove("a/+", "nobody") is False
    assert trie.remove("a/b", "c1") is False
    assert trie.remove("a/+", "c1") is True
    assert trie.remove("a/+", "c1") is False
    assert len(trie) == 2
    assert trie.statistics()["entries"] == 2


def test_cached_results_see_replaced_values_and_new_keys() -> None:
    trie: SubscriptionTrie[str, int] = SubscriptionTrie()
    trie.add("a/+", "c1", 1)
    assert matched(trie, "a/b") == {"a/+": {"c1": 1}}
    assert trie.statistics()["cache_size"] == 1
    trie.add("a/+", "c1", 2)
    trie.add("a/+", "c2", 3)
    assert matched(trie, "a/b") == {"a/+": {"c1": 2, "c2": 3}}
    trie.remove("a/+", "c1")
    assert matched(trie, "a/b") == {"a/+": {"c2": 3}}
    trie.add("a/b", "c1", 4)  # new filter: cache must not hide it
    assert matched(trie, "a/b") == {"a/+": {"c2": 3}, "a/b": {"c1": 4}}
    trie.remove("a/+", "c2")  # last entry of a filter: it must disappear
    assert matched(trie, "a/b") == {"a/b": {"c1": 4}}


def test_cache_is_bounded() -> None:
    trie: SubscriptionTrie[str, int] = SubscriptionTrie(cache_size=10)
    trie.add("#", "c", 1)
    for index in range(100):
        assert len(trie.match(f"t/{index}")) == 1
        assert trie.statistics()["cache_size"] <= 10
    uncached: SubscriptionTrie[str, int] = SubscriptionTrie(cache_size=0)
    uncached.add("#", "c", 1)
    assert len(uncached.match("x")) == 1
    assert uncached.statistics()["cache_size"] == 0


def test_pruning_returns_to_root_only() -> None:
    trie: SubscriptionTrie[tuple[str, str], int] = SubscriptionTrie()
    added = []
    for index in range(300):
        topic_filter = ["a/b/c", f"x/{index}/y", f"+/{index % 7}/#", "#", f"$s/{index}"][index % 5]
        key = (f"share{index % 3}", f"client{index}")
        trie.add(topic_filter, key, index)
        added.append((topic_filter, key))
        trie.match(f"x/{index}/y")
    assert trie.statistics()["nodes"] > 1
    for topic_filter, key in reversed(added[::2]):
        assert trie.remove(topic_filter, key)
    for topic_filter, key in added[1::2]:
        assert trie.remove(topic_filter, key)
    assert len(trie) == 0
    assert list(trie.filters()) == []
    assert trie.statistics()["nodes"] == 1
    assert trie.match("x/1/y") == []


@settings(max_examples=300)
@given(st.lists(filters(), max_size=12), st.lists(topics(), min_size=1, max_size=8))
def test_match_equals_reference(filter_list: list[str], topic_list: list[str]) -> None:
    trie: SubscriptionTrie[str, int] = SubscriptionTrie()
    for index, topic_filter in enumerate(filter_list):
        trie.add(topic_filter, f"k{index}", index)
    for topic in topic_list:
        expected = {f for f in filter_list if topic_matches(f, topic)}
        assert set(matched(trie, topic)) == expected
        assert set(matched(trie, topic)) == expected  # second time from the cache


OPERATIONS = st.one_of(
    st.tuples(st.just("add"), filters(), st.sampled_from("pqr"), st.integers(0, 3)),
    st.tuples(st.just("remove"), filters(), st.sampled_from("pqr")),
    st.tuples(st.just("match"), topics()),
)


@settings(max_examples=300)
@given(st.lists(OPERATIONS, max_size=40), st.sampled_from([10_000, 2, 0]))
def test_match_after_random_churn(operations: list[tuple], cache_size: int) -> None:
    trie: SubscriptionTrie[str, int] = SubscriptionTrie(cache_size=cache_size)
    model: dict[str, dict[str, int]] = {}
    for operation in operations:
        if operation[0] == "add":
            _, topic_filter, key, value = operation
            entries = model.setdefault(topic_filter, {})
            assert trie.add(topic_filter, key, value) is (key not in entries)
            entries[key] = value
        elif operation[0] == "remove":
            _, topic_filter, key = operation
            entries = model.get(topic_filter, {})
            assert trie.remove(topic_filter, key) is (key in entries)
            entries.pop(key, None)
            if not entries:
                model.pop(topic_filter, None)
        else:
            topic = operation[1]
            expected = {f: e for f, e in model.items() if topic_matches(f, topic)}
            assert matched(trie, topic) == expected
        assert len(trie) == sum(len(entries) for entries in model.values())
        assert sorted(trie.filters()) == sorted(model)
    for topic_filter, entries in list(model.items()):
        for key in list(entries):
            assert trie.get(topic_filter, key) == entries[key]
            assert trie.remove(topic_filter, key)
    assert trie.statistics()["nodes"] == 1
