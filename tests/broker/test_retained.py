"""RetainedStore: one message per topic, wildcard lookup equal to brute force, pruning."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from meshmq.broker.retained import RetainedStore
from meshmq.mqtt.topics import topic_matches, validate_topic_filter, validate_topic_name

FIRST_TOPIC_LEVELS = ["a", "b", "", "$x"]
TOPIC_LEVELS = ["a", "b", "", "$y"]
FILTER_LEVELS = ["a", "b", "", "+", "$x"]


@st.composite
def topics(draw: st.DrawFn) -> str:
    first = draw(st.sampled_from(FIRST_TOPIC_LEVELS))
    rest = draw(st.lists(st.sampled_from(TOPIC_LEVELS), max_size=3))
    topic = "/".join([first, *rest]) or "a"
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


def test_set_get_replace_clear() -> None:
    store: RetainedStore[str] = RetainedStore()
    store.set("a/b", "m1")
    store.set("a/b", "m2")
    store.set("a", "m3")
    assert store.get("a/b") == "m2"
    assert store.get("a") == "m3"
    assert store.get("a/c") is None
    assert len(store) == 2
    assert sorted(store.topics()) == ["a", "a/b"]
    assert sorted(store.items()) == [("a", "m3"), ("a/b", "m2")]
    store.set("a", None)
    store.set("missing/topic", None)
    assert store.get("a") is None
    assert store.get("a/b") == "m2"
    assert len(store) == 1


def test_match_spec_examples() -> None:
    store: RetainedStore[str] = RetainedStore()
    for topic in [
        "sport",
        "sport/tennis",
        "sport/tennis/player1",
        "sport/tennis/player1/ranking",
        "/finance",
        "$SYS/x",
        "$SYS",
        "other/x",
    ]:
        store.set(topic, topic)
    assert sorted(store.match("sport/#")) == [
        "sport",
        "sport/tennis",
        "sport/tennis/player1",
        "sport/tennis/player1/ranking",
    ]
    assert sorted(store.match("sport/tennis/+")) == ["sport/tennis/player1"]
    assert sorted(store.match("+/+")) == ["/finance", "other/x", "sport/tennis"]
    assert store.match("sport/tennis") == ["sport/tennis"]
    assert sorted(store.match("sport/+/player1/#")) == [
        "sport/tennis/player1",
        "sport/tennis/player1/ranking",
    ]


def test_dollar_topics_not_matched_by_leading_wildcards() -> None:
    store: RetainedStore[str] = RetainedStore()
    store.set("$SYS/x", "sys")
    store.set("$SYS", "sysroot")
    store.set("y/x", "plain")
    assert sorted(store.match("#")) == ["plain"]
    assert store.match("+/x") == ["plain"]
    assert store.match("+") == []
    assert sorted(store.match("$SYS/#")) == ["sys", "sysroot"]
    assert store.match("$SYS/+") == ["sys"]


def test_pruning_returns_to_root_only() -> None:
    store: RetainedStore[int] = RetainedStore()
    topic_list = [f"a/{i % 10}/{i}" for i in range(200)] + ["a", "a/1", "/", "//x", "$SYS/q"]
    for index, topic in enumerate(topic_list):
        store.set(topic, index)
    assert store.statistics()["nodes"] > 1
    for topic in topic_list[::2] + topic_list[1::2]:
        store.set(topic, None)
    assert len(store) == 0
    assert store.statistics() == {"topics": 0, "nodes": 1}
    assert store.match("#") == []


@settings(max_examples=300)
@given(
    st.lists(st.tuples(topics(), st.one_of(st.none(), st.integers(0, 5))), max_size=25),
    st.lists(filters(), min_size=1, max_size=8),
)
def test_match_equals_brute_force(
    updates: list[tuple[str, int | None]], filter_list: list[str]
) -> None:
    store: RetainedStore[tuple[str, int]] = RetainedStore()
    model: dict[str, tuple[str, int]] = {}
    for topic, value in updates:
        message = None if value is None else (topic, value)
        store.set(topic, message)
        if message is None:
            model.pop(topic, None)
        else:
            model[topic] = message
    assert len(store) == len(model)
    assert dict(store.items()) == model
    for topic in model:
        assert store.get(topic) == model[topic]
    for topic_filter in filter_list:
        expected = sorted(m for t, m in model.items() if topic_matches(topic_filter, t))
        assert sorted(store.match(topic_filter)) == expected
    for topic in list(model):
        store.set(topic, None)
    assert store.statistics()["nodes"] == 1
