"""Links between nodes in the simulated network (tests/cluster/simnet.py ``ClusterNet``):
several nodes of several workers, each worker dialing every other node once and any worker of
that node accepting; real meshes and routers; time moved by the test.
"""

from __future__ import annotations

from simnet import ClusterNet, Node

from meshmq.cluster.nodes import DEAD_AFTER, SUSPECT_AFTER, Side


def dialed(worker: Node) -> dict[int, str]:
    return worker.links.linked_nodes()


def test_every_worker_routes_to_every_other_node_over_one_link() -> None:
    net = ClusterNet({"a": 2, "b": 3, "c": 1})
    for node_id, workers in net.workers.items():
        others = sorted(set(net.workers) - {node_id})
        for worker in workers:
            assert sorted(dialed(worker).values()) == others
            assert len(worker.mesh.peers) == len(workers) - 1  # its own node's workers
    links = sum(len(w.mesh.remote) for w in net.nodes)  # each link counted at both ends
    assert links == 2 * 6 * 2  # 6 workers, each dialing 2 other nodes


def test_a_publish_reaches_every_subscriber_on_every_node_once_crossing_once_per_node() -> None:
    net = ClusterNet({"a": 2, "b": 2, "c": 2})
    subscribers = []
    for node_id, workers in net.workers.items():
        for worker in workers:
            name = f"{node_id}{worker.spec.index}"
            worker.subscribe(name, "t/+")
            subscribers.append((worker, name))
    net.pump()
    publisher = net.of("a", 1)
    before = {peer: link.data_bytes for peer, link in publisher.mesh.remote.items()}
    sent = publisher.mesh.counters["forwarded"]
    publisher.publish("t/1", b"once")
    assert publisher.mesh.counters["forwarded"] - sent == 1 + 2  # its node peer + 2 nodes
    assert before  # (it has links to the other nodes)
    net.pump()
    for worker, name in subscribers:
        assert worker.deliveries.get(name) == [b"once"], name
    relayed = sum(w.links.counters["relayed"] for w in net.nodes)
    assert relayed == 2  # each other node passed it to its second worker, once


def test_a_shared_group_across_nodes_gets_each_message_once() -> None:
    net = ClusterNet({"a": 2, "b": 1, "c": 2})
    members = [(net.of("a", 1), "m-a1"), (net.of("b"), "m-b"), (net.of("c", 0), "m-c0"),
               (net.of("c", 1), "m-c1")]
    for worker, name in members:
        worker.subscribe(name, "$share/g/jobs/#")
    net.pump()
    for n in range(24):
        net.of("a", 0).publish("jobs/run", f"{n}".encode())
        net.pump()
    got = [p for worker, name in members for p in worker.deliveries.get(name, [])]
    assert sorted(got) == sorted(f"{n}".encode() for n in range(24))
    assert all(worker.deliveries.get(name) for worker, name in members)  # spread over all


def test_a_subscription_is_routed_from_every_node_once_its_barrier_is_done() -> None:
    """A SUBACK waits for the route barrier: after it, a publish on any worker of any node
    reaches the new subscription, though the other nodes hear of it through other workers."""
    net = ClusterNet({"a": 2, "b": 2})
    subscriber = net.of("b", 1)
    subscriber.subscribe("late", "news/#")
    done: list[bool] = []
    subscriber.mesh.barrier(lambda: done.append(True))
    net.pump()
    assert done == [True]
    for worker in net.nodes:
        if worker is not subscriber:
            worker.publish("news/x", f"from {worker.index}".encode())
    net.pump()
    assert len(subscriber.deliveries["late"]) == 3


def test_a_node_without_the_secret_is_refused_before_anything_else() -> None:
    net = ClusterNet({"a": 1, "b": 1, "intruder": 1},
                     secrets={"a": b"s3cret", "b": b"s3cret", "intruder": b"guess"})
    assert sorted(dialed(net.of("a")).values()) == ["b"]
    assert dialed(net.of("intruder")) == {}
    assert net.of("a").links.counters["links_refused"] >= 1
    # each side checks the other's proof: the refusing side's own LINK_AUTH still goes out
    # before its close, so both log the refusal, whichever checked first
    assert net.of("intruder").links.counters["links_refused"] >= 1
    net.of("intruder").subscribe("spy", "#")
    net.pump()
    net.of("a").publish("secret/plans", b"x")
    net.pump()
    assert net.of("intruder").deliveries == {}


def test_nodes_of_different_clusters_refuse_each_other() -> None:
    net = ClusterNet({"a": 1, "b": 1, "z": 1}, cluster_ids={"a": "one", "b": "one", "z": "two"})
    assert sorted(dialed(net.of("a")).values()) == ["b"]
    assert dialed(net.of("z")) == {}


def test_a_node_that_knows_no_cluster_id_adopts_its_peers() -> None:
    net = ClusterNet({"a": 1, "fresh": 2}, cluster_ids={"a": "one"})
    for worker in net.workers["fresh"]:
        assert worker.links.identity.cluster_id == "one"


def test_the_id_agreed_in_the_metadata_wins_over_one_learned_from_a_peer() -> None:
    """Nodes that all started with seeds had none; one peer's id came over a link, then the
    metadata's agreed one: that one is kept (every voter of the cluster converges on it),
    while a peer's hello never replaces an id a node has."""
    net = ClusterNet({"a": 1, "fresh": 1}, cluster_ids={"a": "one"})
    links = net.of("fresh").links
    assert links.identity.cluster_id == "one"
    links.learn_cluster_id("two", "node=z")  # a hello: does not replace
    assert links.identity.cluster_id == "one"
    links.learn_cluster_id("agreed", "the metadata", agreed=True)
    assert links.identity.cluster_id == "agreed"


def test_a_silent_node_is_suspected_then_dead_and_the_others_go_on() -> None:
    net = ClusterNet({"a": 1, "b": 1, "c": 1})
    net.of("c").subscribe("s", "t")
    net.of("b").subscribe("s", "t")
    net.pump()
    net.stop(net.of("c").index)  # SIGSTOP: its sockets stay open, it says nothing
    net.advance(SUSPECT_AFTER + 1.1)
    assert net.of("a").links.counters["suspected"] == 2  # its link to c, and c's to it
    assert "c" in dialed(net.of("a")).values()  # suspected, not dead yet
    net.advance(DEAD_AFTER - SUSPECT_AFTER)
    assert "c" not in dialed(net.of("a")).values()
    assert net.of("a").links.counters["links_dead"] >= 1
    net.of("a").publish("t", b"still served")
    net.pump()
    assert net.of("b").deliveries == {"s": [b"still served"]}


def test_a_quiet_link_carries_pings_and_is_never_suspected() -> None:
    net = ClusterNet({"a": 1, "b": 1})
    for _ in range(10):
        net.advance(SUSPECT_AFTER / 2)
    assert all(w.links.counters["suspected"] == 0 for w in net.nodes)
    assert all(state.remote.side in (Side.DIALED, Side.ACCEPTED)
               for w in net.nodes for state in w.mesh.remote.values())


def test_a_forgotten_node_is_dropped_everywhere_until_it_links_again() -> None:
    from meshmq.cluster.codec import Members

    net = ClusterNet({"a": 2, "b": 2, "c": 1})
    net.stop(net.of("c").index)
    net.advance(DEAD_AFTER + 1)  # c is dead for a and b
    for worker in net.workers["a"]:  # the admin asks every worker of a
        worker.links.forget("c", spread=True)
    net.pump()
    for worker in net.workers["a"] + net.workers["b"]:
        assert "c" not in worker.links.nodes, worker.index
        assert "c" in worker.links.forgotten
    gossip = net.of("b", 1)  # a MEMBERS list from a node that still knew c is not heeded
    gossip.links._members(Members([("c", "c:7883")]).members)
    assert "c" not in gossip.links.nodes
    net.resume(net.of("c").index)
    net.dial(net.of("c").index, "b")  # c comes back and links itself: a member again
    assert "c" in net.of("b", 0).links.nodes or "c" in net.of("b", 1).links.nodes


def test_what_was_routed_to_a_node_that_hung_past_dead_reaches_it_when_it_links_again() -> None:
    """A node that hangs longer than DEAD_AFTER has its links closed as dead. What was queued
    for it, sent but not acknowledged (in buffers the close threw away), or routed to it while
    it was down was dropped: its subscribers, whose sessions survived, missed all of it. Now
    the unacknowledged frames and those routed meanwhile wait, and go first on the next
    link."""
    net = ClusterNet({"a": 1, "b": 2})
    for worker in net.workers["b"]:
        worker.subscribe(f"s{worker.spec.index}", "t/#")
    net.pump()
    publisher = net.of("a")
    sent = [f"before-{n}".encode() for n in range(20)]
    for payload in sent:
        publisher.publish("t/x", payload)
    net.pump()
    for worker in net.workers["b"]:
        net.stop(worker.index)
    for n in range(30):
        sent.append(f"hung-{n}".encode())
        publisher.publish("t/x", sent[-1])
    net.pump()
    net.advance(DEAD_AFTER + 1)
    assert "b" not in dialed(publisher).values()  # closed as dead
    for n in range(30):
        sent.append(f"down-{n}".encode())
        publisher.publish("t/x", sent[-1])
    net.pump()
    for worker in net.workers["b"]:
        net.resume(worker.index)
    net.dial(publisher.index, "b")  # (the real layer redials with backoff)
    for worker in net.workers["b"]:
        got = worker.deliveries[f"s{worker.spec.index}"]
        assert set(got) == set(sent), worker.index  # nothing lost (some may come twice)
        assert list(dict.fromkeys(got)) == sent  # in the order they were published
    assert publisher.links.counters["resent"] >= 60


def test_acknowledged_frames_are_not_kept() -> None:
    net = ClusterNet({"a": 1, "b": 1})
    net.of("b").subscribe("s", "t")
    net.pump()
    for n in range(600):
        net.of("a").publish("t", f"{n}".encode())
    net.pump()
    net.advance(2.0)  # a heartbeat acknowledges the rest
    (link,) = [link for link in net.of("a").mesh.remote.values()
               if link.remote.side is Side.DIALED]
    assert link.resend is not None and len(link.resend.frames) == 0
    assert len(net.of("b").deliveries["s"]) == 600


def test_a_forgotten_node_drops_what_waited_for_it() -> None:
    net = ClusterNet({"a": 1, "b": 1})
    net.of("b").subscribe("s", "t")
    net.pump()
    net.stop(net.of("b").index)
    net.advance(DEAD_AFTER + 1)
    net.of("a").publish("t", b"never")
    net.of("a").links.forget("b", spread=True)
    assert net.of("a").mesh.routable == {}
    net.resume(net.of("b").index)
    net.dial(net.of("a").index, "b")
    net.of("a").publish("t", b"after")
    net.pump()
    assert net.of("b").deliveries["s"] == [b"after"]


def test_a_shared_groups_messages_go_to_members_that_are_up_not_to_a_node_that_is_down() -> None:
    net = ClusterNet({"a": 1, "b": 1, "c": 1})
    net.of("b").subscribe("m-b", "$share/g/jobs")
    net.of("c").subscribe("m-c", "$share/g/jobs")
    net.pump()
    net.stop(net.of("c").index)
    net.advance(DEAD_AFTER + 1)  # c is down: parked
    for n in range(10):
        net.of("a").publish("jobs", f"{n}".encode())
    net.pump()
    assert net.of("b").deliveries["m-b"] == [f"{n}".encode() for n in range(10)]
