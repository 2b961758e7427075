"""The node's agent and the controller (cluster/controller.py) against the in-memory metadata
model: membership records, one controller per epoch, partitions assigned round robin once the
expected nodes are in, never moved, every write fenced."""

from __future__ import annotations

import asyncio

from meshmq.cluster.controller import SETTLE, Agent
from meshmq.cluster.memstore import MemoryStore
from meshmq.cluster.metadata import Member, members_of
from meshmq.cluster.metarecords import (
    assignment_of,
    cluster_id_of,
    controller_of,
    mark_written,
)
from meshmq.cluster.nodelink import new_cluster_id


class Clock:
    def __init__(self) -> None:
        self.time = 100.0

    def __call__(self) -> float:
        return self.time


def agents(store: MemoryStore, clock: Clock, workers: dict[str, int], leader: list[str],
           partitions: int = 8) -> dict[str, Agent]:
    return {node: Agent(store, Member(node, f"{node}:7884", f"{node}:7883", count), count,
                        partitions, lambda: len(workers), lambda node=node: leader[0] == node,
                        clock)
            for node, count in workers.items()}


def steps(*agents_: Agent, rounds: int = 4) -> None:
    async def run() -> None:
        for _ in range(rounds):
            for agent in agents_:
                await agent.step()

    asyncio.run(run())


def test_members_register_the_leader_claims_control_and_assigns_round_robin() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    leader = ["n1"]
    nodes = agents(store, clock, {"n1": 2, "n2": 1, "n3": 3}, leader)
    steps(*nodes.values())
    view = asyncio.run(store.read())
    assert sorted(members_of(view)) == ["n1", "n2", "n3"]
    assert members_of(view)["n3"].workers == 3
    controller = controller_of(view)
    assert controller is not None and controller.node == "n1" and controller.epoch == 1
    placed = [(a.leader, a.worker, a.leader_epoch) for a in
              (assignment_of(view, p) for p in range(8)) if a is not None]
    assert placed == [("n1", 0, 1), ("n2", 0, 1), ("n3", 2, 1), ("n1", 1, 1), ("n2", 0, 1),
                      ("n3", 2, 1), ("n1", 0, 1), ("n2", 0, 1)]


def test_the_controller_waits_for_the_expected_nodes_at_most_settle() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    leader = ["n1"]
    nodes = agents(store, clock, {"n1": 1, "n2": 1}, leader)
    steps(nodes["n1"])  # n2 has not registered yet
    view = asyncio.run(store.read())
    assert assignment_of(view, 0) is None
    clock.time += SETTLE + 0.1
    steps(nodes["n1"])
    view = asyncio.run(store.read())
    assert all(assignment_of(view, p).leader == "n1" for p in range(8))  # type: ignore[union-attr]


def test_a_new_controller_takes_a_new_epoch_and_moves_nothing() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    leader = ["n1"]
    nodes = agents(store, clock, {"n1": 1, "n2": 1}, leader)
    steps(*nodes.values())
    before = asyncio.run(store.read())
    leader[0] = "n2"  # n1's voter lost the Raft leadership
    steps(*nodes.values())
    after = asyncio.run(store.read())
    controller = controller_of(after)
    assert controller is not None and (controller.node, controller.epoch) == ("n2", 2)
    assert [assignment_of(after, p) for p in range(8)] == [
        assignment_of(before, p) for p in range(8)]


def test_no_quorum_is_waited_out() -> None:
    clock = Clock()
    store = MemoryStore(clock)
    nodes = agents(store, clock, {"n1": 1}, ["n1"])
    store.unavailable(until=clock.time + 5)

    async def run() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(nodes["n1"].run(stop))
        await asyncio.sleep(0)
        stop.set()
        await task

    asyncio.run(run())  # the step's NoQuorum is logged and retried, not raised
    clock.time += 6
    steps(nodes["n1"])
    assert controller_of(asyncio.run(store.read())) is not None


def test_the_first_controller_writes_the_cluster_id_once() -> None:
    """Nodes that all start with seeds have no cluster id: the controller writes its node's
    (or a new one) into the metadata, and a later controller keeps it."""
    clock = Clock()
    store = MemoryStore(clock)
    leader = ["n1"]
    nodes = agents(store, clock, {"n1": 1, "n2": 1}, leader)
    steps(*nodes.values())
    first = cluster_id_of(asyncio.run(store.read()))
    assert first is not None and len(first) == len(new_cluster_id())
    leader[0] = "n2"
    nodes["n2"].own_cluster_id = lambda: "another-id"
    steps(*nodes.values())
    assert cluster_id_of(asyncio.run(store.read())) == first

    known = MemoryStore(clock)
    named = agents(known, clock, {"n1": 1}, ["n1"])
    named["n1"].own_cluster_id = lambda: "drawn-by-n1"
    steps(*named.values())
    assert cluster_id_of(asyncio.run(known.read())) == "drawn-by-n1"


def test_nodes_that_join_take_the_partitions_nothing_was_written_to() -> None:
    """n1 alone takes every partition; n2 and n3 join. The partitions n1 never wrote move to
    them (with the next leader epoch) until the counts differ by at most one; the two n1
    marked written stay on n1, whatever the balance."""
    clock = Clock()
    store = MemoryStore(clock)
    leader = ["n1"]
    alone = agents(store, clock, {"n1": 1}, leader)
    steps(alone["n1"])
    view = asyncio.run(store.read())
    assert all(assignment_of(view, p).leader == "n1" for p in range(8))  # type: ignore[union-attr]
    for partition in (0, 1):
        assert asyncio.run(mark_written(store, asyncio.run(store.read()), partition, "n1", 1))
    nodes = agents(store, clock, {"n1": 1, "n2": 2, "n3": 1}, leader)
    steps(*nodes.values(), rounds=12)
    view = asyncio.run(store.read())
    placed = {p: assignment_of(view, p) for p in range(8)}
    counts = {n: sum(a.leader == n for a in placed.values() if a) for n in ("n1", "n2", "n3")}
    assert sorted(counts.values()) == [2, 3, 3], counts
    assert placed[0].leader == placed[1].leader == "n1"  # type: ignore[union-attr]
    for a in placed.values():
        assert a is not None
        assert a.leader_epoch == (1 if a.leader == "n1" else 2)
        if a.leader == "n2":
            assert a.worker in (0, 1)
