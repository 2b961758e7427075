"""Topic name/filter validation, shared-filter parsing and the reference matcher (spec 4.7, 4.8)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mqtt.topics import (
    has_wildcard,
    parse_shared_filter,
    topic_matches,
    validate_topic_filter,
    validate_topic_name,
)

VALID_NAMES = [
    "sport/tennis/player1",
    "sport",
    "/",
    "/finance",
    "sport//x",
    "$SYS/broker/load",
    "$share",
    "a" * 65535,
    "é" * 32767,  # 65534 bytes
    "/".join(["x"] * 128),
]

INVALID_NAMES = [
    "",
    "sport/+",
    "sport/#",
    "#",
    "+",
    "sport+",
    "a\x00b",
    "a" * 65536,
    "é" * 32768,  # 65536 bytes in fewer than 65536 characters
    "/".join(["x"] * 129),
]


@pytest.mark.parametrize("topic", VALID_NAMES, ids=lambda t: repr(t[:30]))
def test_valid_topic_names(topic: str) -> None:
    validate_topic_name(topic)


@pytest.mark.parametrize("topic", INVALID_NAMES, ids=lambda t: repr(t[:30]))
def test_invalid_topic_names(topic: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        validate_topic_name(topic)
    assert info.value.reason_code == ReasonCode.TOPIC_NAME_INVALID


def test_topic_name_max_levels_is_configurable() -> None:
    validate_topic_name("a/b/c", max_levels=3)
    with pytest.raises(RemoteProtocolError):
        validate_topic_name("a/b/c/d", max_levels=3)


VALID_FILTERS = [
    "sport/tennis/player1/#",
    "sport/#",
    "#",
    "+",
    "+/tennis/#",
    "sport/+/player1",
    "+/+",
    "/+",
    "sport/tennis/+",
    "/",
    "//",
    "$SYS/#",
    "$SYS/+/x",
    "+/#",
    "a/b",
    "$share",
    "$sharex/a",
    "$share/g/a/b",
    "$share/g/#",
    "$share/g/+/x",
    "$share/g/$SYS/#",
    "$share/g//",
    "$share/g/$share/h/x",
    "/".join(["x"] * 128),
]

INVALID_FILTERS = [
    "",
    "sport+",
    "sport/tennis#",
    "sport/tennis/#/ranking",
    "#/a",
    "##",
    "a/##",
    "a/#/#",
    "+a",
    "a/+b",
    "a/b+/c",
    "++",
    "a\x00b",
    "$share/",
    "$share//a",
    "$share/g",
    "$share/g/",
    "$share/g+/x",
    "$share/+/x",
    "$share/g#/x",
    "$share/#/x",
    "$share/g/sport+",
    "$share/g/a/#/b",
    "$share/g/a\x00",
    "a" * 65536,
    "/".join(["x"] * 129),
]


@pytest.mark.parametrize("topic_filter", VALID_FILTERS, ids=lambda t: repr(t[:30]))
def test_valid_topic_filters(topic_filter: str) -> None:
    validate_topic_filter(topic_filter)


@pytest.mark.parametrize("topic_filter", INVALID_FILTERS, ids=lambda t: repr(t[:30]))
def test_invalid_topic_filters(topic_filter: str) -> None:
    with pytest.raises(RemoteProtocolError) as info:
        validate_topic_filter(topic_filter)
    assert info.value.reason_code == ReasonCode.TOPIC_FILTER_INVALID


def test_topic_filter_max_levels_applies_to_shared_filter_part() -> None:
    validate_topic_filter("$share/g/a/b/c", max_levels=3)
    with pytest.raises(RemoteProtocolError):
        validate_topic_filter("$share/g/a/b/c/d", max_levels=3)


def _reference_filter_ok(topic_filter: str) -> bool:
    """Level-by-level restatement of MQTT-4.7.1-1/-2 for plain filters."""
    if not topic_filter:
        return False
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != len(levels) - 1):
            return False
        if "+" in level and level != "+":
            return False
    return True


FILTER_PIECES = st.lists(
    st.sampled_from(["a", "", "+", "#", "a+", "#a", "+#", "$x"]), min_size=1, max_size=5
)


@given(FILTER_PIECES, st.booleans())
def test_filter_validation_agrees_with_level_rules(pieces: list[str], shared: bool) -> None:
    plain = "/".join(pieces)
    topic_filter = f"$share/grp/{plain}" if shared else plain
    try:
        validate_topic_filter(topic_filter)
        accepted = True
    except RemoteProtocolError:
        accepted = False
    assert accepted == _reference_filter_ok(plain)


@pytest.mark.parametrize(
    ("topic_filter", "expected"),
    [
        ("$share/g/a/b", ("g", "a/b")),
        ("$share/group-1/#", ("group-1", "#")),
        ("$share/g//", ("g", "/")),
        ("a/b", (None, "a/b")),
        ("$share", (None, "$share")),
        ("$SYS/#", (None, "$SYS/#")),
    ],
)
def test_parse_shared_filter(topic_filter: str, expected: tuple[str | None, str]) -> None:
    assert parse_shared_filter(topic_filter) == expected


@pytest.mark.parametrize(
    ("topic_filter", "expected"),
    [("a/b", False), ("a/+", True), ("#", True), ("$SYS/x", False), ("a/#", True)],
)
def test_has_wildcard(topic_filter: str, expected: bool) -> None:
    assert has_wildcard(topic_filter) is expected


MATCHES = [
    # spec 4.7.1.2 examples
    ("sport/tennis/player1/#", "sport/tennis/player1", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/score/wimbledon", True),
    ("sport/#", "sport", True),
    ("#", "sport/tennis", True),
    ("#", "/", True),
    # spec 4.7.1.3 examples
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player2", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+/tennis/#", "sport/tennis", True),
    ("+/tennis/#", "sport/tennis/x/y", True),
    ("+/tennis/#", "sport/golf", False),
    # literal and empty levels
    ("a/b", "a/b", True),
    ("a/b", "a/b/c", False),
    ("a/b/c", "a/b", False),
    ("a//b", "a//b", True),
    ("a/+/b", "a//b", True),
    ("+", "", True),
    # spec 4.7.2: '$' topics and leading wildcards (MQTT-4.7.2-1)
    ("#", "$SYS", False),
    ("#", "$SYS/x", False),
    ("+/x", "$SYS/x", False),
    ("+", "$SYS", False),
    ("+/monitor/Clients", "$SYS/monitor/Clients", False),
    ("$SYS/#", "$SYS/x", True),
    ("$SYS/#", "$SYS", True),
    ("$SYS/monitor/+", "$SYS/monitor/Clients", True),
    ("$SYS/+", "$SYS/x", True),
    ("x/#", "x/$y", True),
    ("x/+", "x/$y", True),
]


@pytest.mark.parametrize(("topic_filter", "topic", "expected"), MATCHES)
def test_topic_matches(topic_filter: str, topic: str, expected: bool) -> None:
    assert topic_matches(topic_filter, topic) is expected
