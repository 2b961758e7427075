"""The commit log's partitions led across nodes (cluster.metadata on): real ``meshmq serve``
processes on 127.0.0.1, real paho clients, the nodes' log files read back from disk.

Each partition is assigned to one node by the controller; a publish on any node is appended
by its partition's leader node and acknowledged only after that (cluster/nodeappends.py).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from netns import unavailable as netns_unavailable
from nodes import Node, Nodes
from test_cluster import ADMIN_KEY, acknowledged, metadata, start_metadata_cluster

from conftest import Client, wait_for
from meshmq.log.partitioner import Partitioner
from meshmq.log.view import LogView

PARTITIONS = 8
LONG = os.environ.get("MESHMQ_FAULTS") == "1"


@contextmanager
def metadata_cluster(tmp: Path) -> Iterator[tuple[Nodes, dict[int, str]]]:
    """Three nodes with metadata on; yielded with each partition's leader node once every
    node's metadata has assigned them all."""
    nodes = start_metadata_cluster(tmp)
    try:
        leaders: dict[int, str] = {}
        for node in nodes:
            found = wait_for(lambda node=node: len(metadata(node).get("partitions", {}))
                             == PARTITIONS and metadata(node), timeout=60,
                             what=f"{node.name}'s metadata to assign every partition")
            leaders = {int(p): a["leader"] for p, a in found["partitions"].items()}
        yield nodes, leaders
    finally:
        nodes.stop_all()


def topics_by_partition() -> dict[int, str]:
    """One topic per partition (as every node's partitioner places it)."""
    partitioner, found = Partitioner(PARTITIONS, None), {}
    index = 0
    while len(found) < PARTITIONS:
        topic = f"seq/{index}"
        found.setdefault(partitioner.partition_for(topic), topic)
        index += 1
    return found


def test_a_publish_on_any_node_is_stored_by_its_partitions_leader_node_and_reaches_all(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """Every node publishes to every partition: each message is acknowledged, stored once,
    in its leader node's log only, and reaches a subscriber on every node exactly once, in
    each publisher's order per partition. Then a node is killed with -9: its partitions are
    refused (0x80, offline) while the others' still take publishes and deliver them."""
    topics = topics_by_partition()
    with metadata_cluster(tmp_path) as (nodes, leaders):
        assert sorted(set(leaders.values())) == ["n1", "n2", "n3"]
        publishers = {node.name: client_factory(f"pub-{node.name}") for node in nodes}
        for node in nodes:
            publishers[node.name].connect(node.port)
        for node in nodes:  # every worker's mirror has the assignment: each probe stored
            for topic in topics.values():
                wait_for(lambda node=node, topic=topic: acknowledged(
                    publishers[node.name], topic, "probe") < 0x80, timeout=30,
                    what=f"a publish on {node.name} to {topic} to be stored")
        subscribers = {}
        for node in nodes:
            subscriber = client_factory(f"sub-{node.name}")
            subscriber.connect(node.port)
            subscriber.subscribe("seq/#", qos=1)
            subscribers[node.name] = subscriber
        rounds = 20
        for number in range(rounds):
            for node in nodes:
                for partition, topic in topics.items():
                    assert acknowledged(publishers[node.name], topic,
                                   f"{node.name}:{partition}:{number}") < 0x80
        sent = rounds * len(nodes) * PARTITIONS
        for name, subscriber in subscribers.items():
            got: dict[tuple[str, str], list[int]] = defaultdict(list)
            for _ in range(sent):
                message = subscriber.expect(timeout=30)
                publisher, partition, number = message.payload.decode().split(":")
                got[(publisher, partition)].append(int(number))
            for key, numbers in got.items():
                assert numbers == list(range(rounds)), (name, key, numbers)  # once, in order
            assert len(got) == len(nodes) * PARTITIONS
        for node in nodes:  # each partition's records on its leader's disk only
            with LogView(node.data_dir) as view:
                for partition in range(PARTITIONS):
                    records = view.read(partition, view.earliest_offset(partition))
                    real = [r for r in records if not r.payload.startswith(b"probe")]
                    expected = sent // PARTITIONS if leaders[partition] == node.name else 0
                    assert len(real) == expected, (node.name, partition, len(real))

        victim = nodes[2]
        victim.kill()
        lost = [p for p, leader in leaders.items() if leader == victim.name]
        kept = [p for p, leader in leaders.items() if leader != victim.name]
        publisher = publishers["n1"]
        wait_for(lambda: len(re.findall(rf"link to node lost node={victim.name} ",
                                        nodes[0].log())) >= 2,
                 what=f"both workers of n1 to see {victim.name} gone")  # (a publish sent
        # before would have an unknown outcome: its connection closed, no PUBACK)
        for partition in lost:
            assert acknowledged(publisher, topics[partition], "offline") == 0x80
        for partition in kept:
            assert acknowledged(publisher, topics[partition], f"n1:{partition}:after") < 0x80
            message = subscribers["n2"].expect(timeout=30)
            assert message.payload.decode() == f"n1:{partition}:after"
        shown = subprocess.run(
            [sys.executable, "-m", "meshmq", "cluster", "status", "--admin",
             f"http://127.0.0.1:{nodes[0].ports['admin']}", "--api-key", ADMIN_KEY],
            capture_output=True, text=True, timeout=30).stdout
        assert shown.count("offline") >= len(lost), shown


def test_what_a_leader_node_acknowledged_survives_its_kill_9(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """A publisher on n1 sends to a partition led by n2 without waiting for each PUBACK; n2
    is killed with -9 in the middle. Every publish n1 acknowledged is in n2's log on disk
    (once); the publishes after the kill are refused (0x80), and those in flight when it died
    are held, neither acknowledged nor refused. Restarted on its data, n2 serves the
    partition again, offsets going on; the held ones go again as resends: acknowledged, and
    still once each in its log."""
    topics = topics_by_partition()
    with metadata_cluster(tmp_path) as (nodes, leaders):
        victim = nodes[1]
        partition = next(p for p, leader in leaders.items() if leader == victim.name)
        publisher = client_factory("pub-n1")
        publisher.paho.max_inflight_messages_set(1000)  # (the broker's receive maximum: 1024)
        publisher.connect(nodes[0].port)
        wait_for(lambda: acknowledged(publisher, topics[partition], "probe") < 0x80, timeout=30,
                 what="a publish to the victim's partition to be stored")
        acked: dict[int, int] = {}  # mid -> reason code
        publisher.paho.on_publish = lambda c, u, mid, rc, props: acked.__setitem__(mid, rc.value)
        payload_of: dict[int, int] = {}
        for number in range(3000):
            info = publisher.paho.publish(topics[partition], f"n{number}", qos=1)
            payload_of[info.mid] = number
            if number == 1500:
                wait_for(lambda: len(acked) > 200, what="some PUBACKs before the kill")
                victim.kill()
        wait_for(lambda: any(code >= 0x80 for code in list(acked.values())), timeout=30,
                 what="publishes refused once n2 is gone")

        def stored() -> set[int]:
            return {payload_of[mid] for mid, code in list(acked.items()) if code < 0x80}

        def logged() -> list[int]:
            with LogView(victim.data_dir) as view:
                records = view.read(partition, view.earliest_offset(partition))
            return [int(r.payload[1:]) for r in records if r.payload.startswith(b"n")]

        before = stored()
        assert len(before) > 200
        found = logged()
        assert len(found) == len(set(found))  # once each
        missing = before - set(found)
        assert not missing, f"acknowledged but not in the leader's log: {sorted(missing)[:10]}"

        victim.restart()  # same data and ports: it rejoins, its partition is served again
        wait_for(lambda: len(acked) == len(payload_of), timeout=60,
                 what="every publish answered (the held ones once n2 is back)")
        assert publisher.disconnects.empty()  # held, not unknown: no connection closed
        again = logged()
        assert len(again) == len(set(again))  # the held ones' resends not stored twice
        assert stored() <= set(again)
        back = client_factory("pub-n1-again")
        back.connect(nodes[0].port)
        wait_for(lambda: acknowledged(back, topics[partition], "back") < 0x80, timeout=60,
                 what="n1's other worker to link n2 again")
        with LogView(victim.data_dir) as view:
            records = view.read(partition, view.earliest_offset(partition))
        assert records[-1].payload == b"back"  # appended after what it held, offsets go on
        assert [r.offset for r in records] == list(range(records[0].offset,
                                                         records[0].offset + len(records)))


@pytest.mark.faults
@pytest.mark.skipif(not LONG, reason="the long fault suite runs with MESHMQ_FAULTS=1 "
                    "(docs/testing.md)")
def test_what_a_killed_leader_had_not_yet_routed_reaches_the_other_nodes_after_its_restart(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """A publisher on n1, a subscriber on n2, the partition led by n3. n2 is paused
    (SIGSTOP) so that n3's FORWARDs to it pile up in n3 (more than the sockets hold); n3
    acknowledges every publish, then is killed with -9: what it had not sent to n2 dies with
    it. n2 resumes; once n3 is restarted, n2 asks it for what came after the last record it
    got, and the subscriber ends up with every acknowledged publish."""
    topics = topics_by_partition()
    with metadata_cluster(tmp_path) as (nodes, leaders):
        leader = nodes[2]
        partition = next(p for p, name in leaders.items() if name == leader.name)
        subscriber = client_factory("sub-n2")
        subscriber.connect(nodes[1].port)
        subscriber.subscribe(topics[partition], qos=1)
        publisher = client_factory("pub-n1")
        publisher.connect(nodes[0].port)
        wait_for(lambda: acknowledged(publisher, topics[partition], "probe") < 0x80,
                 timeout=30, what="a publish to the leader's partition to be stored")
        assert subscriber.expect().payload == b"probe"
        nodes[1].pause()
        filler = b"x" * 65536
        stored = set()
        for number in range(200):  # 13 MB: more than the loopback sockets' buffers hold
            if acknowledged(publisher, topics[partition], f"n{number}:".encode() + filler
                            ) < 0x80:
                stored.add(number)
        assert len(stored) == 200
        leader.kill()
        nodes[1].resume()
        got: set[int] = set()

        def received() -> set[int]:
            while not subscriber.messages.empty():
                payload = subscriber.messages.get().payload
                if payload.startswith(b"n"):
                    got.add(int(payload[1:payload.index(b":")]))
            return got

        leader.restart()
        wait_for(lambda: stored <= received(), timeout=60,
                 what=f"every acknowledged publish at n2 ({len(stored - received())} missing)")
        sent_again = [int(n) for n in re.findall(r"sent again to node n2 .* records=(\d+)",
                                                 leader.log())]
        assert sum(sent_again) > 0, "nothing was missing: the test did not test the catch-up"


def test_a_session_moves_to_another_node_with_what_every_partition_kept_for_it(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """With partitions led across nodes: a persistent QoS 1 subscriber of n1 goes offline,
    publishes on n2 fill every partition (led by n1, n2 and n3), and the client reconnects
    to n3: it gets each of them once, in order per partition, session present."""
    from paho.mqtt.packettypes import PacketTypes

    from conftest import props

    topics = topics_by_partition()
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    with metadata_cluster(tmp_path) as (nodes, _leaders):
        subscriber = client_factory("mover")
        subscriber.connect(nodes[0].port, clean_start=False, properties=session)
        subscriber.subscribe("seq/#", qos=1)
        publisher = client_factory("pub-n2")
        publisher.connect(nodes[1].port)
        for topic in topics.values():  # every worker's mirror has the assignment
            wait_for(lambda topic=topic: acknowledged(publisher, topic, "probe") < 0x80,
                     timeout=30, what=f"a publish to {topic} to be stored")
        for _ in topics:
            assert subscriber.expect().payload == b"probe"
        subscriber.disconnect()
        for number in range(5):
            for partition, topic in topics.items():
                assert acknowledged(publisher, topic, f"{partition}:{number}") < 0x80
        back = client_factory("mover")
        flags, _, _ = back.connect(nodes[2].port, clean_start=False, properties=session)
        assert flags.session_present is True
        got: dict[str, list[int]] = defaultdict(list)
        for _ in range(5 * PARTITIONS):
            partition, number = back.expect(timeout=30).payload.decode().split(":")
            got[partition].append(int(number))
        assert got == {str(p): list(range(5)) for p in topics}
        for topic in topics.values():  # barriers: nothing more came before them
            assert acknowledged(publisher, topic, "end") < 0x80
        assert [back.expect(timeout=30).payload for _ in topics] == [b"end"] * len(topics)


def test_a_leader_node_killed_and_restarted_under_load_loses_nothing(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """The fault harness's workload on a cluster with partitions led across nodes: numbered
    QoS 1 publishers on n1 and n2, persistent subscribers on n1 and n2; n3, leader of some
    partitions, is killed with -9 under load and restarted. After a drain the checker finds
    nothing acknowledged lost (every value in a leader's log and delivered), no disorder
    within a partition; publishes refused while n3 was down are not stored."""
    from checker import check_workload
    from workload import Outcome, Publisher, Subscriber, Workload

    topics = topics_by_partition()
    with metadata_cluster(tmp_path) as (nodes, leaders):
        n1, n2, n3 = nodes
        victim_partitions = [p for p, name in leaders.items() if name == n3.name]
        assert victim_partitions
        workload = Workload(prefix="jepsen", partitions=PARTITIONS)
        try:
            for index, node in enumerate((n1, n2)):
                workload.subscribers.append(Subscriber(f"sub-{index}", node.address()).start())
            for index, node in enumerate((n1, n1, n2, n2)):
                workload.publishers.append(Publisher(f"pub-{index}", node.address()).start())
            workload.wait_acked(300)
            before = workload.disconnects()
            n3.kill()
            # publishes to n3's partitions are refused, or (in flight when it died) their
            # outcome is unknown: the publisher is disconnected and its resend waits for n3
            wait_for(lambda: any(p.count(Outcome.REFUSED) for p in workload.publishers)
                     or workload.disconnects() != before, what="n3's partitions offline")
            n3.restart()
            for node in (n1, n2):  # n3's partitions served again from both
                probe = client_factory(f"probe-{node.name}")
                probe.connect(node.port)
                for partition in victim_partitions:
                    wait_for(lambda probe=probe, partition=partition: acknowledged(
                        probe, topics[partition], "probe") < 0x80, timeout=60,
                        what=f"partition {partition} served again through {node.name}")
            workload.wait_acked(300)
            workload.drain(n1.address())
            report = check_workload(workload, [node.data_dir for node in nodes])
        finally:
            workload.close()
    print(report.render())
    assert report.ok and not report.undrained, report.render()


@pytest.mark.faults
@pytest.mark.skipif(not LONG, reason="the long fault suite runs with MESHMQ_FAULTS=1 "
                    "(docs/testing.md)")
@pytest.mark.skipif(netns_unavailable() is not None, reason=netns_unavailable() or "")
@pytest.mark.timeout(300)
def test_a_leader_node_partitioned_away_in_a_namespace_loses_nothing(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """Three nodes with the metadata on, each in a network namespace of its own (a real
    partition, not a proxy); the workload's clients in the root namespace on n1 and n2. n3,
    leader of some partitions, is partitioned away for longer than the 12 s after which a
    silent link is closed, then healed. Its partitions are refused or held meanwhile (the
    appends in flight wait for it), the others go on; after the heal and a drain, the
    checker finds nothing acknowledged lost."""
    from checker import check_workload
    from netns import NetworkLab
    from test_cluster import cluster_config, free_port_pairs
    from workload import Publisher, Subscriber, Workload

    with NetworkLab() as lab:
        spaces = [lab.add(f"n{i + 1}") for i in range(3)]
        lab.attach_host()
        ports = free_port_pairs(3)
        nodes = Nodes([])
        try:
            for space, port in zip(spaces, ports, strict=True):
                seeds = [f"{other.address}:{p}" for other, p in zip(spaces, ports, strict=True)
                         if other is not space]
                text = cluster_config(tmp_path, space.short, seeds, extra="metadata = true\n")
                text = text.replace('listen = "127.0.0.1:0"',
                                    f'listen = "{space.address}:{port}"', 1)
                node = Node(space.short, tmp_path / space.short, text, workers=2,
                            bind=space.address, launcher=space.launcher)
                nodes.members.append(node)
                node.start()
            n1, n2, _ = nodes
            topics = topics_by_partition()
            for node in (n1, n2):  # the metadata settled: every partition stored through both
                probe = client_factory(f"probe-{node.name}")
                probe.paho.connect(node.bind, node.port)
                probe.paho.loop_start()
                probe.connacks.get(timeout=30)
                for topic in topics.values():
                    wait_for(lambda probe=probe, topic=topic: acknowledged(
                        probe, topic, "probe") < 0x80, timeout=90,
                        what=f"{topic} stored through {node.name}")
            workload = Workload(prefix="jepsen", partitions=PARTITIONS)
            try:
                for index, node in enumerate((n1, n2)):
                    workload.subscribers.append(
                        Subscriber(f"sub-{index}", node.address()).start())
                for index, node in enumerate((n1, n1, n2, n2)):
                    workload.publishers.append(
                        Publisher(f"pub-{index}", node.address()).start())
                workload.wait_acked(400, timeout=60)
                lab.partition([["n3"]])
                # both of n1's workers: each closes its own link after its own 12 s of
                # silence, and a link still open at the heal simply carries on (no relink)
                wait_for(lambda: n1.log().count("link to node lost node=n3") >= 2,
                         timeout=60, what="n1's workers to close their links to n3 as dead")
                # (each publisher here publishes to every partition: those with a publish to
                # n3 in flight when it went away wait for it, held, their windows full)
                lab.heal()
                wait_for(lambda: n1.log().count("linked node=n3") >= 4, timeout=60,
                         what="n1's workers to link n3 again")
                workload.wait_acked(200, timeout=60)
                workload.drain(n1.address(), timeout=60)
                report = check_workload(workload, [node.data_dir for node in nodes])
            finally:
                workload.close()
        finally:
            nodes.stop_all()
    print(report.render())
    assert report.ok and not report.undrained, report.render()


@pytest.mark.faults
@pytest.mark.skipif(not LONG, reason="the long fault suite runs with MESHMQ_FAULTS=1 "
                    "(docs/testing.md)")
def test_with_the_majority_lost_a_node_serves_its_written_partitions_and_says_why_not_others(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """n2 and n3 killed with -9: n1's metadata has no majority. n1 goes on taking publishes
    for the partitions it leads and has written to (no agreement needed); one it leads but
    never wrote would need the metadata to mark it, so it is refused after the append's
    deadline, saying so; the dead nodes' partitions are refused as offline. With n2 back,
    the first record of n1's unwritten partition is taken."""
    topics = topics_by_partition()
    with metadata_cluster(tmp_path) as (nodes, leaders):
        mine = [p for p, leader in leaders.items() if leader == "n1"]
        written, unwritten = mine[0], mine[1]
        publisher = client_factory("pub")
        publisher.connect(nodes[0].port)
        wait_for(lambda: acknowledged(publisher, topics[written], "first") < 0x80,
                 timeout=30, what="n1's first record")
        nodes[1].kill()
        nodes[2].kill()
        wait_for(lambda: len(re.findall(r"link to node lost node=n[23] ", nodes[0].log()))
                 >= 4, what="n1's workers to see n2 and n3 gone")
        assert acknowledged(publisher, topics[written], "alone") < 0x80
        other = next(p for p, leader in leaders.items() if leader == "n2")
        assert acknowledged(publisher, topics[other], "offline") == 0x80
        assert acknowledged(publisher, topics[unwritten], "needs agreement") == 0x80
        nodes[1].restart()
        wait_for(lambda: acknowledged(publisher, topics[unwritten], "agreed") < 0x80,
                 timeout=60, what="n1's unwritten partition marked once n2 is back")
        with LogView(nodes[0].data_dir) as view:
            payloads = [r.payload for r in view.read(unwritten, view.earliest_offset(unwritten))]
        assert payloads[-1] == b"agreed" and b"needs agreement" not in payloads
