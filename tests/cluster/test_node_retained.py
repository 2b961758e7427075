"""Retained messages across nodes (cluster/noderetained.py) in the simulated network: several
nodes of several workers, each worker with its retained store and its owner's role; changes
on one node reach every node, links that come back catch up, and nodes agree on the newest
version of a topic whatever the order things arrive in. Time and wall clocks are the test's.
"""

from __future__ import annotations

from collections.abc import Callable

from simnet import ClusterNet, Node

from meshmq.broker.local import LocalRetained
from meshmq.broker.message import Message
from meshmq.broker.retained import RetainedStore
from meshmq.cluster.noderetained import NodeRetained
from meshmq.cluster.retained import OwnedRetained


class Journal:
    """The keeper's part: what was journaled, each write durable at once."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, bytes | None]] = []

    def retained(self, topic: str, message: Message | None,
                 done: Callable[[], None] | None = None) -> None:
        self.writes.append((topic, None if message is None else message.payload))
        if done is not None:
            done()


class Wall:
    """One node's wall clock in nanoseconds, set by the test."""

    def __init__(self, nanos: int = 1_000) -> None:
        self.nanos = nanos

    def __call__(self) -> int:
        return self.nanos


def attach(net: ClusterNet, walls: dict[str, Wall] | None = None) -> dict[int, NodeRetained]:
    """Give every worker of ``net`` its retained store, as WorkerCluster does."""
    parts = {}
    for node_id, workers in net.workers.items():
        wall = (walls or {}).get(node_id) or Wall()
        for worker in workers:
            local = LocalRetained(RetainedStore(), Journal(), lambda: net.clock.time)
            owned = OwnedRetained(local, worker.leadership, worker.mesh,
                                  worker.host.encode_message, worker.host.decode_message)
            parts[worker.index] = NodeRetained(owned, worker.links, clock=wall)
    return parts


def keep(net: ClusterNet, parts: dict[int, NodeRetained], worker: Node, topic: str,
         payload: bytes) -> None:
    """A client of ``worker`` publishes a retained message; its PUBACK's outcome is checked."""
    outcomes: list[object] = []
    parts[worker.index].owned.keep(Message(topic, payload, 1, True), outcomes.append)
    net.pump()
    assert outcomes == [None], outcomes  # stored by its owner in this node


def held(net: ClusterNet, parts: dict[int, NodeRetained], node_id: str,
         topic_filter: str = "#") -> dict[str, bytes]:
    """What a subscriber of ``topic_filter`` on each worker of ``node_id`` would get (all the
    workers must agree): topic -> payload."""
    seen = []
    for worker in net.workers[node_id]:
        found: list[list[Message]] = []
        parts[worker.index].owned.query([topic_filter], found.extend)
        net.pump()
        seen.append({message.topic: message.payload for message in found[0]})
    assert all(view == seen[0] for view in seen), seen
    return seen[0]


def partition(net: ClusterNet, one: str, other: str) -> None:
    """Every link between the workers of node ``one`` and those of ``other`` breaks."""
    for (index, ident), (peer, _) in list(net.ends.items()):
        if {net.node_of[index], net.node_of[peer]} == {one, other} \
                and (index, ident) in net.ends:
            net.cut_ends(index, ident)
    net.pump()


def heal(net: ClusterNet, one: str, other: str) -> None:
    """Each worker of each side dials the other node again (as after a reconnect)."""
    for worker in net.workers[one]:
        net.dial(worker.index, other, pump=False)
    for worker in net.workers[other]:
        net.dial(worker.index, one, pump=False)
    net.pump()


def test_a_retained_message_kept_on_one_node_is_served_by_every_node() -> None:
    net = ClusterNet({"a": 2, "b": 3, "c": 1})
    parts = attach(net)
    for n in range(8):
        keep(net, parts, net.of("a", n % 2), f"room/{n}/temp", f"{n}".encode())
    for node_id in ("a", "b", "c"):
        assert held(net, parts, node_id) == {f"room/{n}/temp": f"{n}".encode()
                                             for n in range(8)}, node_id
    assert held(net, parts, "c", "room/3/temp") == {"room/3/temp": b"3"}
    keep(net, parts, net.of("b", 2), "room/3/temp", b"")  # cleared on another node
    for node_id in ("a", "b", "c"):
        assert "room/3/temp" not in held(net, parts, node_id), node_id
    # each change crossed to each other node once, from its owner, never passed on further
    applied = sum(part.counters["retained_applied"] for part in parts.values())
    assert applied == (8 + 1) * 2


def test_a_node_cut_off_catches_up_when_its_links_come_back() -> None:
    net = ClusterNet({"a": 2, "b": 2})
    parts = attach(net)
    keep(net, parts, net.of("a"), "kept", b"before")
    keep(net, parts, net.of("a"), "cleared", b"before")
    partition(net, "a", "b")
    assert net.of("a").links.linked_nodes() == {}
    keep(net, parts, net.of("a", 1), "kept", b"changed while cut off")
    keep(net, parts, net.of("a", 0), "cleared", b"")
    keep(net, parts, net.of("a", 1), "new/on-a", b"a")
    keep(net, parts, net.of("b", 1), "new/on-b", b"b")
    assert held(net, parts, "b") == {"kept": b"before", "cleared": b"before",
                                     "new/on-b": b"b"}  # served from what it had
    heal(net, "a", "b")
    expected = {"kept": b"changed while cut off", "new/on-a": b"a", "new/on-b": b"b"}
    assert held(net, parts, "a") == expected
    assert held(net, parts, "b") == expected


def test_two_nodes_changing_one_topic_at_once_end_with_the_newer_everywhere() -> None:
    """Both changes are stored at once by their own node's owner and cross each other on the
    links: without stamps each node would end with the other's. The greater stamp wins."""
    walls = {"a": Wall(5_000), "b": Wall(7_000)}
    net = ClusterNet({"a": 1, "b": 2, "c": 1})
    parts = attach(net, walls)
    for worker, payload in ((net.of("a"), b"older"), (net.of("b", 1), b"newer")):
        parts[worker.index].owned.keep(Message("door", payload, 1, True), None)
    net.pump()
    for node_id in ("a", "b", "c"):
        assert held(net, parts, node_id) == {"door": b"newer"}, node_id
    # a later change on a node whose clock is behind still replaces what that node holds
    keep(net, parts, net.of("a"), "door", b"latest, from a slow clock")
    for node_id in ("a", "b", "c"):
        assert held(net, parts, node_id) == {"door": b"latest, from a slow clock"}, node_id


def test_an_old_copy_arriving_after_a_clear_does_not_bring_the_message_back() -> None:
    net = ClusterNet({"a": 1, "b": 1, "c": 1})
    parts = attach(net, {"a": Wall(1_000), "b": Wall(2_000), "c": Wall(3_000)})
    keep(net, parts, net.of("a"), "alarm", b"on")
    partition(net, "c", "a")
    partition(net, "c", "b")  # c keeps its copy of "alarm"
    keep(net, parts, net.of("b"), "alarm", b"")  # cleared while c is away
    assert "alarm" not in held(net, parts, "a")
    assert held(net, parts, "c") == {"alarm": b"on"}
    heal(net, "c", "a")
    heal(net, "c", "b")
    for node_id in ("a", "b", "c"):
        assert held(net, parts, node_id) == {}, node_id


def test_copies_restored_at_start_without_stamps_agree_on_one_node() -> None:
    """After a restart a node's retained messages have no stamp; two nodes holding different
    copies of a topic both keep the copy of the greater node id instead of swapping."""
    net = ClusterNet({"a": 1, "b": 1})
    parts = attach(net)
    partition(net, "a", "b")
    for node_id, payload in (("a", b"a's"), ("b", b"b's")):
        worker = net.of(node_id)
        parts[worker.index].owned.local.store.set("state", Message("state", payload, 0, True))
    heal(net, "a", "b")
    assert held(net, parts, "a") == held(net, parts, "b") == {"state": b"b's"}


def test_sys_topics_stay_on_their_node() -> None:
    net = ClusterNet({"a": 1, "b": 1})
    parts = attach(net)
    keep(net, parts, net.of("a"), "$SYS/broker/uptime", b"12")
    keep(net, parts, net.of("a"), "barrier", b"after")
    assert held(net, parts, "b", "#") == {"barrier": b"after"}
    assert held(net, parts, "b", "$SYS/#") == {}
