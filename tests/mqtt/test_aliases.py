"""Outgoing topic aliases (mqtt/aliases.py): checked against a strict client's alias map."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshmq.mqtt.aliases import PERIOD, OutgoingAliases


class StrictClient:
    """What a strict client (MQTT.js) keeps: an alias used before it is defined is an error,
    a topic sent with an alias (re)defines it (spec 3.3.2.3.4), never above its maximum."""

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.topics: dict[int, str] = {}
        self.remaps = 0

    def receive(self, topic: str, result: int) -> str:
        """The topic the client resolves for a PUBLISH built from ``lookup``'s ``result``."""
        if result == 0:
            return topic
        alias = abs(result)
        assert 1 <= alias <= self.maximum, f"alias {alias} outside 1..{self.maximum}"
        if result > 0:
            assert alias in self.topics, f"alias {alias} used before it was defined"
            return self.topics[alias]
        if alias in self.topics and self.topics[alias] != topic:
            self.remaps += 1
        self.topics[alias] = topic
        return topic


def deliver(aliases: OutgoingAliases, client: StrictClient, topics: list[str]) -> list[int]:
    results = []
    for topic in topics:
        result = aliases.lookup(topic)
        assert client.receive(topic, result) == topic
        results.append(result)
    return results


def test_free_aliases_go_first_come_and_are_reused() -> None:
    aliases = OutgoingAliases(3)
    client = StrictClient(3)
    assert deliver(aliases, client, ["a/aa", "b/bb", "a/aa", "c/cc", "b/bb"]) == [
        -1, -2, 1, -3, 2]


def test_short_topics_get_no_alias() -> None:
    """An alias costs 3 bytes: a topic of 3 characters or fewer saves nothing with one."""
    aliases = OutgoingAliases(5)
    assert [aliases.lookup(topic) for topic in ("a", "a/b", "a/b", "abcd")] == [0, 0, 0, -1]


def test_the_topics_received_most_take_the_aliases_over() -> None:
    """Two aliases, two cold topics first, then a hot one: it takes the coldest alias once it
    clearly outnumbers it (a remap: topic and alias again), then rides on the alias."""
    aliases = OutgoingAliases(2)
    client = StrictClient(2)
    deliver(aliases, client, ["cold/a", "cold/b"] + ["cold/b"] * 10)
    results = deliver(aliases, client, ["hot/x"] * 5)
    assert results[:2] == [0, 0]  # counted as a candidate first
    assert results[2] == -1  # remaps alias 1 (cold/a: the coldest)
    assert results[3:] == [1, 1]
    assert client.remaps == 1 and client.topics == {1: "hot/x", 2: "cold/b"}


def test_topics_of_equal_rate_do_not_take_aliases_from_each_other() -> None:
    """Three topics round robin on two aliases: the hysteresis (a newcomer needs more than
    twice the rate of the alias it takes) keeps the remaps rare instead of one per message."""
    aliases = OutgoingAliases(2)
    client = StrictClient(2)
    deliver(aliases, client, ["t/one", "t/two", "t/three"] * (10 * PERIOD // 3))
    assert client.remaps <= 10


def test_a_new_workload_takes_the_aliases_within_a_few_periods() -> None:
    aliases = OutgoingAliases(2)
    client = StrictClient(2)
    deliver(aliases, client, ["old/one", "old/two"] * (5 * PERIOD))
    results = deliver(aliases, client, ["new/one", "new/two"] * (2 * PERIOD))
    assert results[-2:] == [1, 2] or results[-2:] == [2, 1]
    assert set(client.topics.values()) == {"new/one", "new/two"}


def test_an_alias_whose_definition_was_not_sent_is_defined_again() -> None:
    aliases = OutgoingAliases(2)
    client = StrictClient(2)
    assert aliases.lookup("big/t") == -1
    aliases.not_sent(1)  # e.g. above the client's maximum packet size: the client has nothing
    assert deliver(aliases, client, ["big/t", "big/t"]) == [-1, 1]


def test_maximum_out_of_range_is_refused() -> None:
    for maximum in (0, 65536):
        with pytest.raises(ValueError):
            OutgoingAliases(maximum)


@given(st.integers(1, 4),
       st.lists(st.tuples(st.sampled_from(["aa/1", "bb/2", "cc/3", "dd/4", "ee/5", "ff/6", "x"]),
                          st.booleans()), max_size=300))
def test_a_strict_client_always_resolves_the_right_topic(
        maximum: int, deliveries: list[tuple[str, bool]]) -> None:
    """Whatever the order, and whichever definitions are not sent: every alias is 1..maximum
    (MQTT-3.1.2-26, MQTT-3.3.2-11), never used before the client has it, and resolves to the
    topic the message was published on."""
    aliases = OutgoingAliases(maximum)
    client = StrictClient(maximum)
    for topic, sent in deliveries:
        result = aliases.lookup(topic)
        if result < 0 and not sent:
            aliases.not_sent(-result)
            continue
        assert client.receive(topic, result) == topic
