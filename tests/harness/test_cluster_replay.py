"""Replay by offset and log cursors on any node, with partitions led across nodes (the
metadata on): real ``meshmq serve`` processes on 127.0.0.1 and real paho clients.

A partition's records are in its leader node's log only; a node reads the partitions other
nodes lead from them (cluster/remotelog.py), so a replay or an offline session's cursor on
any node reads every partition, at the same offsets everywhere.
"""

from __future__ import annotations

import queue
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
from nodes import Nodes
from paho.mqtt.packettypes import PacketTypes
from test_cluster import acknowledged, start_cluster
from test_cluster_partitions import PARTITIONS, topics_by_partition

from conftest import Client, asks_positions, props, split_position, wait_for

SESSION = 300  # seconds a persistent session outlives its connection


def replaying(value: str) -> object:
    return props(PacketTypes.SUBSCRIBE, UserProperty=[("meshmq-replay", value)])


def stored_everywhere(publisher: Client, topics: dict[int, str]) -> None:
    """A probe to every partition, acknowledged (every worker's mirror has the assignment)."""
    for topic in topics.values():
        wait_for(lambda topic=topic: acknowledged(publisher, topic, "probe") < 0x80,
                 timeout=30, what=f"a publish to {topic} to be stored")


def received(client: Client, count: int) -> dict[int, list[tuple[str, int | None]]]:
    """``count`` messages, per partition in arrival order: (payload, offset if given)."""
    got: dict[int, list[tuple[str, int | None]]] = defaultdict(list)
    for _ in range(count):
        message = client.expect(timeout=30)
        _own, position = split_position(getattr(message.properties, "UserProperty", None))
        payload = message.payload.decode()
        partition = int(payload.split(":")[0]) if ":" in payload else -1
        if position is not None:
            assert partition in (-1, position[0]), (payload, position)
            partition = position[0]
        got[partition].append((payload, None if position is None else position[1]))
    return got


def reader_on_n1(nodes: Nodes, client_factory: Callable[..., Client], topics: dict[int, str],
                 connect: object) -> tuple[Client, Client]:
    """A publisher on n2, and a persistent subscriber to every partition on n1 that got a
    probe of each (every worker's mirror has the assignment)."""
    publisher = client_factory("pub")
    publisher.connect(nodes[1].port)
    subscriber = client_factory("reader")
    subscriber.connect(nodes[0].port, clean_start=False, properties=connect)
    subscriber.subscribe("seq/#", qos=1)
    stored_everywhere(publisher, topics)
    for _ in range(len(topics)):
        assert subscriber.expect(timeout=30).payload == b"probe"
    return publisher, subscriber


def test_replay_on_any_node_reads_the_partitions_other_nodes_lead(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """Records published on n1 to every partition (led by n1, n2 and n3): a subscriber on n2
    replaying from the earliest gets every one once, in log order per partition, with the
    offsets the leader gave them, then live messages once; one on n3 replaying one
    partition from an offset gets that partition from there only; one replaying from a
    time gets what was stored after it."""
    topics = topics_by_partition()
    with start_cluster(tmp_path, 3) as nodes:
        publisher = client_factory("pub")
        publisher.connect(nodes[0].port)
        stored_everywhere(publisher, topics)
        for number in range(10):
            for partition, topic in topics.items():
                assert acknowledged(publisher, topic, f"{partition}:{number}") < 0x80
        after = time.time() * 1000 + 2  # every record so far was stored before it
        wait_for(lambda: time.time() * 1000 > after, what="the clock to move on")
        cut = int(time.time() * 1000)
        for partition, topic in topics.items():
            assert acknowledged(publisher, topic, f"{partition}:late") < 0x80

        everything = client_factory("replay-all")
        everything.connect(nodes[1].port, properties=asks_positions())
        everything.subscribe("seq/#", qos=1, properties=replaying("earliest"))
        got = received(everything, PARTITIONS * 12)
        offsets = {}
        for partition in topics:
            payloads = [payload for payload, _ in got[partition]]
            assert payloads == ["probe"] * payloads.count("probe") + [
                f"{partition}:{n}" for n in range(10)] + [f"{partition}:late"], payloads
            seen = [offset for _, offset in got[partition]]
            assert seen == list(range(len(seen))), seen  # the leader's offsets, from 0
            offsets[partition] = dict(got[partition])
        for partition, topic in topics.items():  # live after the replay, once
            assert acknowledged(publisher, topic, f"{partition}:live") < 0x80
        live = received(everything, PARTITIONS)
        assert {p: [m for m, _ in got] for p, got in live.items()} == {
            p: [f"{p}:live"] for p in topics}

        chosen = next(iter(topics))
        start = offsets[chosen][f"{chosen}:6"]
        some = client_factory("replay-some")
        some.connect(nodes[2].port)
        some.subscribe("seq/#", qos=1, properties=replaying(f"offsets:{chosen}={start}"))
        assert [some.expect(timeout=30).payload.decode() for _ in range(6)] == [
            f"{chosen}:{n}" for n in range(6, 10)] + [f"{chosen}:late", f"{chosen}:live"]
        for partition, topic in topics.items():  # barriers: no other partition's history
            assert acknowledged(publisher, topic, f"{partition}:end") < 0x80
        assert sorted(some.expect(timeout=30).payload.decode() for _ in topics) == sorted(
            f"{p}:end" for p in topics)

        since = client_factory("replay-since")
        since.connect(nodes[2].port)
        since.subscribe("seq/#", qos=1, properties=replaying(f"timestamp:{cut}"))
        got = received(since, PARTITIONS * 3)
        assert {p: [m for m, _ in got] for p, got in got.items()} == {
            p: [f"{p}:late", f"{p}:live", f"{p}:end"] for p in topics}


def test_an_offline_session_reads_what_it_missed_from_the_leader_nodes_past_its_queue(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """A persistent session whose queue holds 5 messages misses 40 per partition while
    offline: back on its node it gets every one, in order, none dropped (its cursor reads
    the partitions other nodes lead from them); it then goes offline again, misses 30 more
    per partition and comes back on another node: its cursor crossed with it."""
    topics = topics_by_partition()
    extra = "\n[session]\nmax_queued_messages = 5\n"
    connect = props(PacketTypes.CONNECT, SessionExpiryInterval=SESSION)
    with start_cluster(tmp_path, 3, extra=extra) as nodes:
        publisher, subscriber = reader_on_n1(nodes, client_factory, topics, connect)

        for first, count, node in ((0, 40, nodes[0]), (40, 30, nodes[2])):
            subscriber.disconnect()
            for number in range(first, first + count):
                for partition, topic in topics.items():
                    assert acknowledged(publisher, topic, f"{partition}:{number}") < 0x80
            subscriber = client_factory("reader")
            flags, _, _ = subscriber.connect(node.port, clean_start=False, properties=connect)
            assert flags.session_present is True
            got = received(subscriber, count * PARTITIONS)
            assert {p: [m for m, _ in got] for p, got in got.items()} == {
                p: [f"{p}:{n}" for n in range(first, first + count)] for p in topics}
            for partition, topic in topics.items():  # barriers: nothing more came
                assert acknowledged(publisher, topic, f"{partition}:end{first}") < 0x80
            assert sorted(subscriber.expect(timeout=30).payload.decode()
                          for _ in topics) == sorted(f"{p}:end{first}" for p in topics)


def test_a_restarted_nodes_offline_session_reads_what_it_missed_from_the_other_nodes(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """A persistent session on n1 goes offline, 20 messages per partition are published on
    n2, and n1 is killed with -9 and restarted: the session, restored from n1's state store
    with its cursor, gets every one, in order per partition, none twice (n1 reads the
    partitions n2 and n3 lead from them, and waits to know their high watermarks before it
    finishes)."""
    topics = topics_by_partition()
    connect = props(PacketTypes.CONNECT, SessionExpiryInterval=SESSION)
    with start_cluster(tmp_path, 3) as nodes:
        publisher, subscriber = reader_on_n1(nodes, client_factory, topics, connect)
        subscriber.disconnect()
        for number in range(20):
            for partition, topic in topics.items():
                assert acknowledged(publisher, topic, f"{partition}:{number}") < 0x80
        nodes[0].kill()
        nodes[0].restart()
        back = client_factory("reader")
        flags, _, _ = back.connect(nodes[0].port, clean_start=False, properties=connect)
        assert flags.session_present is True
        for partition, topic in topics.items():  # (a refusal, n2's link to n1 not up again
            # yet, stored nothing: asked again)
            wait_for(lambda topic=topic, partition=partition: acknowledged(
                publisher, topic, f"{partition}:end") < 0x80, timeout=30,
                what=f"n2 to store a publish to {topic} again")
        # Every message once at least, in order per partition, then each partition's "end".
        # At least once: what n2 and n3 had routed to n1 and n1 had not acknowledged when it
        # was killed is sent again once it is back (cluster/resend.py), the probes the session
        # got before it went offline among them; nothing else may come twice.
        expected = {p: [f"{p}:{n}" for n in range(20)] + [f"{p}:end"] for p in topics}
        firsts: dict[int, list[str]] = defaultdict(list)
        again = []
        while any(len(firsts[p]) < len(expected[p]) for p in topics):
            try:
                payload = back.expect(timeout=30).payload.decode()
            except queue.Empty:
                pytest.fail(f"nothing more in 30 s; got {dict(firsts)}, again {again}")
            if payload == "probe" or payload in firsts[int(payload.split(":")[0])]:
                again.append(payload)
            else:
                firsts[int(payload.split(":")[0])].append(payload)
        assert dict(firsts) == expected
        assert set(again) <= {"probe"}, again
