"""Links between nodes: one worker's links to the other nodes of its cluster, sans-I/O.

Theory of operation
-------------------
A node of a cluster is a supervisor and its workers (docs/workers.md); the workers of a node
are linked by the mesh over unix sockets (cluster/mesh.py). Between nodes, each worker dials
every other node's cluster port once (cluster/tcplinks.py), and any worker of that node may
accept it (the kernel chooses). So each worker has exactly one *dialed* link to each other
node and any number of *accepted* ones, and a pair of nodes has as many links as their two
worker counts added up: links grow with nodes² times workers per node, never with all
workers².

Each link is used one way for messages: the dialing worker sends on it what it routes to that
node (``FORWARD``) and its requests; the accepting worker sends the *node's* routes (the union
of its own and its local peers' routes, cluster/routes.py) and the answers. So for the dialing
worker a node is one peer (``peer >= REMOTE_BASE``, the same id across relinks) with one route
set; a publish crosses to each node at most once, whichever of its workers the link lands on,
and that worker passes it on inside its node (``relay``: the local peers with a plain match, and
one member's worker for each shared group the sender chose the node for), never to a third node.

Handshake (cluster/nodelink.py): ``LINK_HELLO`` both ways, then ``LINK_AUTH`` (the HMAC proof
of the cluster secret over both nonces); nothing else before, frames capped, a deadline. Then
the accepting side sends the node's routes and ``MEMBERS`` (the nodes it knows, so that a node
that joined through one seed dials the rest). A worker that learns of a node it did not know
(from ``MEMBERS`` or from that node dialing it) passes the news to its own node's workers and
to the workers of other nodes that dialed it, so every worker of every node ends up dialing
every node, whichever worker the kernel gave each link to.

Liveness. A socket close is not enough between hosts (a stopped or cut-off node closes
nothing), so every link carries a ``PING`` when it has been quiet for ``HEARTBEAT``; a link that
heard nothing for ``SUSPECT_AFTER`` is *suspect* (logged once), and after ``DEAD_AFTER`` it is
closed as dead, its requests gone (the dialing side dials again with backoff); its routes
stay, and what is routed to that node meanwhile waits for the next link (cluster/resend.py:
every FORWARD is kept until the other end acknowledges it, ``FORWARD_ACK``). The
times allow for a loaded 2-core machine: an event loop stalled by a garbage collection or an
fsync for a second must not look dead.

Barriers. A SUBACK waits until every worker that may route a publish to the new subscription
has its route: the local peers (as before) and, across nodes, every worker that dialed this
node: each local peer asks its own accepted links before it answers (``Barrier(nodes=True)``),
and this worker asks its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from meshmq.cluster.codec import (
    MAX_FRAME,
    Barrier,
    BarrierDone,
    Forget,
    Forward,
    ForwardAck,
    ForwardAt,
    FrameType,
    LinkAuth,
    LinkError,
    LinkHello,
    Members,
    Ping,
    Routes,
    decode_frame,
    forward_frame,
)
from meshmq.cluster.nodelink import (
    PROTOCOL_VERSION,
    NodeIdentity,
    check_hello,
    check_mac,
    link_mac,
    new_nonce,
)
from meshmq.cluster.resend import ACK_EVERY, ResendLog
from meshmq.cluster.routes import REMOTE_BASE, RouteKey

if TYPE_CHECKING:
    from meshmq.cluster.mesh import Mesh, _Link
    from meshmq.cluster.timers import Timer

log = logging.getLogger("meshmq.cluster")

HEARTBEAT = 1.0  # seconds of quiet after which a link carries a PING
SUSPECT_AFTER = 4.0  # seconds without a byte from the other end: suspect
DEAD_AFTER = 12.0  # ... and dead: the link is closed


class Side(Enum):
    DIALED = "dialed"  # this worker dialed: it routes to that node over this link
    ACCEPTED = "accepted"  # the other node's worker dialed: this side sends routes, answers


@dataclass(slots=True)
class RemoteState:
    """What one link between nodes knows of its other end."""

    side: Side
    nonce: bytes
    hello: LinkHello | None = None
    cluster_id: str = ""
    ready: bool = False
    suspect: bool = False
    received: int = 0  # (accepted) FORWARD and RETAIN_SYNC frames handled on this link
    acked: int = 0  # ... and the count last acknowledged (FORWARD_ACK)
    fresh_routes: bool = True  # (dialed) the next ROUTES is the node's whole set


@dataclass(slots=True)
class NodePeer:
    """Another node as this worker knows it."""

    node_id: str
    address: str
    link: _Link | None = None  # the dialed link, once ready


# Frames a link between nodes may carry once ready, by the side it arrives on.
_FROM_ACCEPTOR = frozenset({FrameType.ROUTES, FrameType.MEMBERS, FrameType.PING,
                            FrameType.BARRIER, FrameType.BARRIER_DONE, FrameType.FORWARD_ACK})
_FROM_DIALER = frozenset({FrameType.FORWARD, FrameType.FORWARD_AT, FrameType.PING,
                          FrameType.BARRIER,
                          FrameType.BARRIER_DONE, FrameType.MEMBERS})


@dataclass
class NodeLinks:
    """One worker's links to the other nodes (see the module docstring)."""

    mesh: Mesh
    identity: NodeIdentity
    on_cluster_id: Callable[[str], None] | None = None  # the node learned its cluster's id
    on_members: Callable[[list[tuple[str, str]]], None] | None = None  # nodes to dial
    on_node_up: list[Callable[[int, str], None]] = field(default_factory=list)
    on_node_down: list[Callable[[int, str], None]] = field(default_factory=list)
    on_forget: list[Callable[[str], None]] = field(default_factory=list)  # stop dialing it
    nodes: dict[str, NodePeer] = field(default_factory=dict)  # by node id
    # frames of the layers above (retained messages...) that a dialing node may send here
    handlers: dict[int, Callable[[int, Any], None]] = field(default_factory=dict)
    # ... and those the accepting end may send back on a link this worker dialed (answers)
    answers: dict[int, Callable[[int, Any], None]] = field(default_factory=dict)
    on_closed: list[Callable[[int], None]] = field(default_factory=list)  # a ready link, any side
    # a FORWARD_AT's place: (node id, its incarnation, partition, offset) (nodecatchup.py)
    on_place: Callable[[str, int, int, int], None] | None = None
    # nodes that left or were removed: not dialed, not taken from MEMBERS, until they link
    forgotten: set[str] = field(default_factory=set)
    _peer_ids: dict[str, int] = field(default_factory=dict)  # node id -> its peer id
    # peer id -> the closed dialed link that stays its route until a new one is up
    _parked: dict[int, _Link] = field(default_factory=dict)
    _next_accepted: int = REMOTE_BASE + (1 << 15)
    _heartbeat: Timer | None = None
    counters: dict[str, int] = field(default_factory=lambda: {
        "links_refused": 0, "links_dead": 0, "suspected": 0, "relayed": 0, "resent": 0})

    def __post_init__(self) -> None:
        self.mesh.node_links = self
        self.mesh.handle(FrameType.MEMBERS, lambda peer, frame: self._members(frame.members))
        self.mesh.handle(FrameType.FORGET, self._forget_from_peer)
        self.handlers[FrameType.FORGET] = self._forget_from_node

    # ------------------------------------------------------------------ links

    def opened(self, link: _Link, dialed: bool) -> None:
        """A TCP link exists: send our LINK_HELLO (the mesh set the handshake deadline)."""
        state = link.remote = RemoteState(Side.DIALED if dialed else Side.ACCEPTED,
                                          new_nonce())
        identity, worker = self.identity, self.mesh.worker
        self.mesh.queue(link, LinkHello(
            PROTOCOL_VERSION, identity.cluster_id, identity.node_id, identity.incarnation,
            worker.index, worker.count, state.nonce, identity.address).encode())
        self._arm_heartbeat()

    def closed(self, link: _Link) -> None:
        state: RemoteState | None = link.remote
        peer = link.peer
        if state is None or not state.ready or peer is None:
            return
        mesh = self.mesh
        if mesh.remote.get(peer) is not link:
            return  # replaced by a newer link
        del mesh.remote[peer]
        mesh.requests.link_down(link.ident)
        for closed in self.on_closed:
            closed(peer)
        node_id = state.hello.node_id if state.hello else "?"
        if state.side is Side.DIALED:
            if mesh.closing or node_id in self.forgotten or link.resend is None:
                mesh.routes.forget(peer)
            else:  # its routes stay; what is routed there waits (cluster/resend.py)
                link.parked = True
                link.congested = False
                link.data, link.data_bytes = [], 0
                mesh.routable[peer] = link
                mesh.parked.add(peer)
                self._parked[peer] = link
            known = self.nodes.get(node_id)
            if known is not None and known.link is link:
                known.link = None
            if not mesh.closing:
                log.warning("link to node lost node=%s", node_id)
            mesh.release_drained(peer)
            for listener in self.on_node_down:
                listener(peer, node_id)

    def dispatch(self, link: _Link, frame_type: int, body: bytes) -> None:
        """A frame on a link between nodes (``LinkError`` closes the link)."""
        state: RemoteState = link.remote
        if not state.ready:
            return self._handshake(link, state, frame_type, body)
        dialed = state.side is Side.DIALED
        allowed = _FROM_ACCEPTOR if dialed else _FROM_DIALER
        extra = self.answers if dialed else self.handlers
        if frame_type not in allowed and frame_type not in extra:
            raise LinkError(f"frame type {frame_type} is not taken from another node here")
        peer = link.peer
        assert peer is not None
        mesh = self.mesh
        if frame_type == FrameType.PING:
            return
        if frame_type == FrameType.FORWARD:
            if mesh.on_forward is not None:
                mesh.on_forward(peer, Forward.decode(body))
            self._handled(link, state)
            return
        if frame_type == FrameType.FORWARD_AT:
            at = ForwardAt.decode(body)
            if self.on_place is not None and state.hello is not None:
                self.on_place(state.hello.node_id, state.hello.incarnation, at.partition,
                              at.offset)
            if mesh.on_forward is not None:
                mesh.on_forward(peer, at.forward)
            self._handled(link, state)
            return
        frame = decode_frame(frame_type, body)
        handler = extra.get(frame_type)
        if handler is not None:
            handler(peer, frame)
            if frame_type == FrameType.RETAIN_SYNC and not dialed:
                self._handled(link, state)
        elif frame_type == FrameType.FORWARD_ACK:
            assert isinstance(frame, ForwardAck)
            if link.resend is not None:
                link.resend.acked(frame.count)
        elif frame_type == FrameType.ROUTES:
            assert isinstance(frame, Routes)
            if state.fresh_routes:  # the node's whole set, after (re)linking
                state.fresh_routes = False
                mesh.routes.replace(peer, frame.changes)
            else:
                mesh.routes.apply(peer, frame.changes)
        elif frame_type == FrameType.MEMBERS:
            assert isinstance(frame, Members)
            self._members(frame.members)
        elif frame_type == FrameType.BARRIER:
            assert isinstance(frame, Barrier)
            mesh.answer_barrier(peer, frame)
        else:  # BARRIER_DONE, the one answer a link between nodes carries today
            assert isinstance(frame, BarrierDone)
            mesh.requests.answer(link.ident, frame.request_id, frame)

    def _handled(self, link: _Link, state: RemoteState) -> None:
        """(accepted) One more FORWARD or RETAIN_SYNC handled: acknowledged every
        ``ACK_EVERY`` (and on each heartbeat)."""
        state.received += 1
        if state.received - state.acked >= ACK_EVERY:
            self._ack(link, state)

    def _ack(self, link: _Link, state: RemoteState) -> None:
        state.acked = state.received
        self.mesh.queue(link, ForwardAck(state.received).encode())

    def _handshake(self, link: _Link, state: RemoteState, frame_type: int, body: bytes) -> None:
        if state.hello is None:
            if frame_type != FrameType.LINK_HELLO:
                raise LinkError(f"frame type {frame_type} before LINK_HELLO")
            hello = LinkHello.decode(body)
            state.cluster_id = check_hello(self.identity, hello)
            state.hello = hello
            self.mesh.queue(link, LinkAuth(link_mac(
                self.identity.secret, self.identity.node_id, self.mesh.worker.index,
                state.nonce, hello.nonce)).encode())
            return
        if frame_type != FrameType.LINK_AUTH:
            raise LinkError(f"frame type {frame_type} before LINK_AUTH")
        if not check_mac(self.identity.secret, state.hello, state.nonce,
                         LinkAuth.decode(body).mac):
            self.counters["links_refused"] += 1
            raise LinkError(f"node {state.hello.node_id!r} does not know the cluster secret")
        self._ready(link, state, state.hello)

    def learn_cluster_id(self, cluster_id: str, source: str, agreed: bool = False) -> None:
        """This node's cluster id, learned from a node's hello (kept if it has none yet) or
        ``agreed`` in the metadata (nodes that all start with seeds have none until their
        controller writes one; and the metadata's, agreed by every voter of this cluster,
        wins over one a node learned or drew before it was written: all converge on it)."""
        old = self.identity.cluster_id
        if old == cluster_id or (old and not agreed):
            return
        self.identity.cluster_id = cluster_id
        if old:
            log.warning("cluster id now cluster_id=%s as agreed in %s (was %s)", cluster_id,
                        source, old)
        else:
            log.info("joined cluster cluster_id=%s through %s", cluster_id, source)
        if self.on_cluster_id is not None:
            self.on_cluster_id(cluster_id)

    def _ready(self, link: _Link, state: RemoteState, hello: LinkHello) -> None:
        mesh = self.mesh
        state.ready = True
        link.ready = True
        link.reader.max_frame = MAX_FRAME
        mesh.handshake_done(link)
        if state.cluster_id:
            self.learn_cluster_id(state.cluster_id, f"node={hello.node_id}")
        if hello.node_id in self.forgotten:
            self.forgotten.discard(hello.node_id)  # it linked again itself: a member again
            log.info("forgotten node back node=%s", hello.node_id)
        known = self.nodes.get(hello.node_id)
        if known is None:
            known = self.nodes[hello.node_id] = NodePeer(hello.node_id, hello.address)
            if hello.address:
                self._new_members([(hello.node_id, hello.address)],
                                  dial=state.side is Side.ACCEPTED)
        elif hello.address and hello.address != known.address:
            # restarted at another address (a new port, a new host): dialed there from now on
            known.address = hello.address
            self._new_members([(hello.node_id, hello.address)],
                              dial=state.side is Side.ACCEPTED)
        if state.side is Side.DIALED:
            peer = self._peer_ids.get(hello.node_id)
            if peer is None:
                peer = self._peer_ids[hello.node_id] = REMOTE_BASE + len(self._peer_ids)
            link.peer = peer
            old = mesh.remote.get(peer)
            if old is not None and old is not link:  # a newer link to that node replaces it
                self.closed(old)
                mesh.close_link(old)
            mesh.remote[peer] = link
            mesh.routable[peer] = link
            known.link = link
            link.resend = ResendLog(hello.node_id)
            parked = self._parked.pop(peer, None)
            mesh.parked.discard(peer)
            if parked is not None and parked.resend is not None:
                waiting = parked.resend.take()  # first, in order: they were routed first
                for frame in waiting:
                    mesh.forward_to(link, frame)
                self.counters["resent"] += len(waiting)
                if waiting:
                    log.info("resent to node=%s frames=%d (not acknowledged before the link "
                             "closed, or routed while it was down)", hello.node_id,
                             len(waiting))
            log.info("linked node=%s address=%s their_worker=%d", hello.node_id,
                     hello.address, hello.worker)
            for listener in self.on_node_up:
                listener(peer, hello.node_id)
        else:
            peer = link.peer = self._next_accepted
            self._next_accepted += 1
            mesh.remote[peer] = link
            # the whole set, even empty: it replaces what the dialer kept while unlinked
            mesh.queue(link, Routes(mesh.routes.announce_node()).encode())
            mesh.queue(link, Members(self.members()).encode())

    # ------------------------------------------------------------------ members

    def members(self) -> list[tuple[str, str]]:
        """This node and the nodes it knows, with their addresses."""
        known = [(self.identity.node_id, self.identity.address)]
        known += [(n.node_id, n.address) for n in self.nodes.values() if n.address]
        return known

    def _members(self, members: list[tuple[str, str]]) -> None:
        new = []
        for node_id, address in members:
            if node_id == self.identity.node_id or not address or node_id in self.forgotten:
                continue
            known = self.nodes.get(node_id)
            if known is None:
                self.nodes[node_id] = NodePeer(node_id, address)
                new.append((node_id, address))
            elif known.address != address and known.link is None:
                known.address = address  # it came back elsewhere: dial it there too
                new.append((node_id, address))
        if new:
            self._new_members(new)

    def _new_members(self, new: list[tuple[str, str]], dial: bool = True) -> None:
        """Nodes this worker did not know: dial them, and tell the workers of other nodes
        that dialed this one (a node that joined through one of this node's workers is then
        known to every worker of every node)."""
        if dial and self.on_members is not None:
            self.on_members(new)
        frame = Members(self.members()).encode()
        for peer in self.accepted_peers():
            self.mesh.queue(self.mesh.remote[peer], frame)
        self.mesh.broadcast(frame)  # this node's other workers (the kernel chose who accepts)

    def forget(self, node_id: str, spread: bool = False) -> bool:
        """Drop ``node_id`` from this worker's members and stop dialing it (its links, if any
        are up, stay until they close: a node that links again is a member again). With
        ``spread`` (the admin's worker), tell every other node too. False if it was not
        known."""
        if node_id == self.identity.node_id and not spread:
            return False  # (this node's own leaving is spread, never applied here)
        if node_id != self.identity.node_id:
            self.forgotten.add(node_id)
            peer = self._peer_ids.get(node_id)
            parked = self._parked.pop(peer, None) if peer is not None else None
            if parked is not None and peer is not None:  # what waited for it goes too
                self.mesh.parked.discard(peer)
                self.mesh.routes.forget(peer)
                if self.mesh.routable.get(peer) is parked:
                    del self.mesh.routable[peer]
        known = self.nodes.pop(node_id, None)
        for listener in self.on_forget:
            listener(node_id)
        if spread:
            frame = Forget(node_id).encode()
            for peer in self.linked_nodes():
                self.mesh.send(peer, frame)
        if known is not None:
            log.info("node forgotten node=%s", node_id)
        return known is not None

    def _forget_from_peer(self, peer: int, frame: Forget) -> None:
        """A worker of this node passed on another node's FORGET."""
        self.forget(frame.node_id)

    def _forget_from_node(self, peer: int, frame: Forget) -> None:
        """Another node says ``frame.node_id`` left: this worker and its node's others."""
        self.forget(frame.node_id)
        self.mesh.broadcast(frame.encode())

    def dialed(self, node_id: str) -> _Link | None:
        """This worker's dialed link to ``node_id``, if it is up (its ``peer`` set)."""
        known = self.nodes.get(node_id)
        link = known.link if known is not None else None
        return link if link is not None and link.peer is not None else None

    def linked_nodes(self) -> dict[int, str]:
        """The nodes this worker routes to now: peer id -> node id."""
        return {peer: link.remote.hello.node_id for peer, link in self.mesh.remote.items()
                if link.remote.side is Side.DIALED}

    def accepted_peers(self) -> list[int]:
        return [peer for peer, link in self.mesh.remote.items()
                if link.remote.side is Side.ACCEPTED]

    # ------------------------------------------------------------------ routes and relay

    def flush_routes(self) -> None:
        """This node's route changes to every worker that dialed this one."""
        routes = self.mesh.routes
        if not routes.node_pending:
            return
        frame = Routes(routes.take_node_changes()).encode()
        for peer in self.accepted_peers():
            self.mesh.queue(self.mesh.remote[peer], frame)

    def relay(self, body: bytes, topic: str, groups: list[RouteKey],
              local_groups: list[RouteKey]) -> list[RouteKey]:
        """A message another node sent this worker: pass it on to this node's other workers
        that need it (the same body, once each); returns the shared groups to serve here."""
        mesh = self.mesh
        here, targets = mesh.routes.relay_targets(topic, groups, local_groups, mesh.peers)
        for peer, peer_groups in targets.items():
            link = mesh.peers[peer]
            mesh.forward_to(link, forward_frame(peer_groups, body))
        if targets:
            self.counters["relayed"] += len(targets)
        return here

    # ------------------------------------------------------------------ liveness

    def _arm_heartbeat(self) -> None:
        if self._heartbeat is None:
            self._heartbeat = self.mesh.call_at(self.mesh.io.now() + HEARTBEAT, self._beat)

    def _beat(self) -> None:
        """Every ``HEARTBEAT``: a PING on quiet links, suspicion, death."""
        self._heartbeat = None
        mesh = self.mesh
        now = mesh.io.now()
        remote_links = [link for link in list(mesh.links()) if link.remote is not None]
        for link in remote_links:
            state: RemoteState = link.remote
            quiet = now - link.last_in
            name = state.hello.node_id if state.hello else "?"
            if state.ready and quiet >= DEAD_AFTER:
                self.counters["links_dead"] += 1
                mesh.fail_link(link, f"node {name} silent for {quiet:.0f} s: dead")
                continue
            if state.ready and quiet >= SUSPECT_AFTER and not state.suspect:
                state.suspect = True
                self.counters["suspected"] += 1
                log.warning("node suspected node=%s silent=%.1f s", name, quiet)
            elif quiet < SUSPECT_AFTER and state.suspect:
                state.suspect = False
                log.info("node no longer suspected node=%s", name)
            if state.ready and state.received > state.acked:
                self._ack(link, state)
            if state.ready and now - link.last_out >= HEARTBEAT:
                mesh.queue(link, Ping().encode())
        if remote_links:
            self._arm_heartbeat()

    def statistics(self) -> dict[str, Any]:
        return {"nodes": sorted(self.linked_nodes().values()), **self.counters}
