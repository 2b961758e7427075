"""A node's worker: the broker core of one process joined to the mesh of the node's workers.

Theory of operation
-------------------
``server.workers = N`` runs N processes (node/supervisor.py); each runs one broker core
(``broker/``) and this module joins it to its peers. The core only knows its interfaces
(broker/interfaces.py); here each gets its cluster version:

* ``Peers``: the ``Mesh`` itself (routes, forwarding, shared groups, barriers);
* ``PartitionLog``: ``PartitionedLog`` (partition ``p`` led by worker ``p mod N``);
* ``RetainedMessages``: ``OwnedRetained`` (a topic's owner is its partition's leader);
* ``SessionDirectory``: ``Directory`` (a client id's owner knows where its session is);
* ``NodeStatistics``: ``MeshStatistics`` (worker 0 adds up ``$SYS``).

Start-up order: link to every peer (``start``), then the broker restores its state, then
``started`` registers the restored sessions and hands retained messages this worker no longer
owns to their owners. Only then does the worker serve clients.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from meshmq.broker.wire import decode_message, encode_message
from meshmq.cluster.admin import MeshAdmin
from meshmq.cluster.directory import Directory
from meshmq.cluster.leaders import Leadership
from meshmq.cluster.mesh import Mesh
from meshmq.cluster.metaclient import MetaClient
from meshmq.cluster.metadata import Change, MetadataError
from meshmq.cluster.metaproc import socket_name_for
from meshmq.cluster.metarecords import assignment_of, cluster_id_of, mark_written
from meshmq.cluster.nodeappends import NodeAppends, Placements
from meshmq.cluster.nodecatchup import NodeCatchup
from meshmq.cluster.nodelink import NodeIdentity
from meshmq.cluster.noderetained import NodeRetained
from meshmq.cluster.nodes import NodeLinks
from meshmq.cluster.nodesessions import NodeSessions
from meshmq.cluster.nodestats import ClusterStatistics
from meshmq.cluster.partitions import PartitionedLog
from meshmq.cluster.remotelog import RemoteLog
from meshmq.cluster.retained import OwnedRetained
from meshmq.cluster.routes import REMOTE_BASE
from meshmq.cluster.sessionowner import SessionOwners
from meshmq.cluster.sockets import MeshSockets
from meshmq.cluster.stats import MeshStatistics
from meshmq.cluster.takeover import NodeTakeover
from meshmq.cluster.tcplinks import NodeSockets

log = logging.getLogger("meshmq.mesh")

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.broker.interfaces import NodeStatistics
    from meshmq.broker.message import Message
    from meshmq.broker.router import Router
    from meshmq.cluster.codec import Forward
    from meshmq.cluster.spec import WorkerSpec


def join_router(mesh: Mesh, router: Router, decode: Callable[[bytes, float], Message],
                on_position: Callable[[tuple[int, int]], None]) -> None:
    """Make ``mesh`` the router's peers, and deliver what peers forward to the router.

    ``on_position``: a forwarded message's place in the log (the partition leader's order,
    which moves this worker's view of that partition's high watermark)."""
    router.peers = mesh

    def forwarded(peer: int, frame: Forward) -> None:
        now = mesh.io.now()
        message = decode(frame.message, now)
        if message.position is not None:  # (from another node: partitions it leads)
            on_position(message.position)
        groups = frame.groups
        if peer >= REMOTE_BASE and mesh.node_links is not None:  # from another node: relay
            here = [key for key in groups if router.has_members(key)]
            groups = mesh.node_links.relay(frame.message, message.topic, groups, here)
        mesh.forwarding = (peer, frame.relayed)
        try:
            router.deliver_forwarded(message, groups, now)
        finally:
            mesh.forwarding = (None, False)

    mesh.on_forward = forwarded


class WorkerCluster:
    """One worker's cluster side: its mesh and the cluster versions of the core's
    interfaces, given to ``broker`` (see the module docstring)."""

    def __init__(self, broker: Broker, worker: WorkerSpec,
                 identity: NodeIdentity | None = None,
                 on_cluster_id: Callable[[str], None] | None = None) -> None:
        config = broker.config
        self.broker = broker
        self.worker = worker
        loop = broker.loop
        key_level = None if config.log.key_level < 0 else config.log.key_level
        self.leadership = Leadership(worker, config.log.partitions, key_level)
        self.sockets = MeshSockets(loop, worker)
        self.log: PartitionedLog | None = None
        self.mesh = mesh = Mesh(worker, self.sockets, encode_message, self._highs)
        # without the metadata each node keeps its own log: a message crossing to another
        # node is not at a place in that node's log, so it goes without one (there it is a
        # copy, like a message that is not persisted: an offline session keeps it queued)
        mesh.encode_for_node = partial(encode_message, positioned=False)
        lifecycle = broker.lifecycle
        if config.log.enabled:
            self.log = PartitionedLog(config.log, config.server.data_dir, loop, self.leadership,
                                      mesh, lifecycle.encode_message, decode_message)
            self.log.route_stored = broker.publishes.route_stored
            # the acks and deliveries of a turn made durable here are written at once
            self.log.local.after_completions = broker.flush_output
        self.retained = OwnedRetained(broker.local_retained, self.leadership, mesh,
                                      lifecycle.encode_message, lifecycle.decode_message)
        self.directory = Directory(lifecycle, self.leadership, mesh, loop.call_soon)
        self.node_statistics = MeshStatistics(mesh, self.leadership.is_statistics_owner)
        self.statistics: NodeStatistics = self.node_statistics
        self.admin = MeshAdmin(mesh, loop)  # the operations plane's queries (node/admin/)
        join_router(mesh, broker.router, decode_message, self._forwarded_position)
        self.nodes: NodeLinks | None = None
        self.node_retained: NodeRetained | None = None
        self.takeover: NodeTakeover | None = None
        self.node_sessions: NodeSessions | None = None
        self.node_sockets: NodeSockets | None = None
        self.node_appends: NodeAppends | None = None
        self.placements: Placements | None = None
        self.node_catchup: NodeCatchup | None = None
        self.remote_log: RemoteLog | None = None
        self.session_owners: SessionOwners | None = None
        self._waking = False
        self.metadata: MetaClient | None = None  # the node's metadata voter (cluster.metadata)
        if identity is not None and config.cluster.metadata:
            self.metadata = MetaClient(socket_name_for(worker.token))
        if identity is not None:  # a node of a cluster: links to the other nodes too
            self.nodes = NodeLinks(mesh, identity, on_cluster_id=on_cluster_id)
            self.node_retained = NodeRetained(self.retained, self.nodes)
            self.takeover = takeover = NodeTakeover(self.directory, self.nodes,
                                                    broker.sessions, lifecycle, loop.time)
            self.node_sessions = node_sessions = NodeSessions(
                self.directory, self.nodes, loop.time, lambda c: takeover.claimed_at.get(c),
                self.log.sync if self.log is not None else None,
                when_stamped=takeover.when_stamped)
            self.statistics = ClusterStatistics(self.node_statistics, self.nodes,
                                                config.mqtt.sys_interval)
            self.node_sockets = NodeSockets(loop, self.sockets, self.nodes,
                                            config.cluster.listen, config.cluster.seeds)
            if self.metadata is not None and self.log is not None:  # partitions by node
                self.placements = Placements(config.log.partitions)
                self.node_appends = NodeAppends(
                    self.log, self.nodes, self.placements, broker.publishes.append_for,
                    lifecycle.encode_message, decode_message, loop.call_soon,
                    partial(self._mark_written, self.metadata, identity.node_id))
                self.node_catchup = NodeCatchup(self.nodes, self.log, self.leadership,
                                                loop.time)
                # a partition's offsets are the same on every node (only its leader node
                # holds it): records cross with their places, cursors with the sessions
                mesh.encode_for_node = encode_message
                node_sessions.positions_cross = True
                self.remote_log = RemoteLog(self.nodes, self.log, self.placements,
                                            identity.node_id)
                self.remote_log.on_ready = self._wake_catchups
                self.log.remote = self.remote_log
                # a CONNECT's claim ordered by its session's owner (the leader node of the
                # client id's partition), not by the hosts' clocks
                self.session_owners = takeover.owners = SessionOwners(
                    self.nodes, self.leadership, self.placements, identity.node_id)
        mesh.on_congested = self._congested
        self._congestion_logged = -1e9
        self._marks: set[asyncio.Task[None]] = set()
        broker.use(mesh, self.log, self.retained, self.directory, self.statistics)

    def _mark_written(self, client: MetaClient, node_id: str, partition: int, epoch: int,
                      done: Callable[[bool | None], None]) -> None:
        """nodeappends.py ``Mark``: through this worker's metadata client."""
        async def run() -> None:
            try:
                for _ in range(3):  # a lost compare-and-set: another worker's mark, or a move
                    view = await client.read()
                    assignment = assignment_of(view, partition)
                    if assignment is None or (assignment.leader, assignment.leader_epoch) != (
                            node_id, epoch):
                        return done(None)
                    if assignment.written:
                        return done(True)
                    marked = await mark_written(client, view, partition, node_id, epoch)
                    if marked is not None and marked.result.ok:
                        log.info("partition marked written partition=%d epoch=%d",
                                 partition, epoch)
                        return done(True)
            except MetadataError as error:
                log.warning("partition %d not marked written yet: %s", partition, error)
            done(False)

        task = self.broker.loop.create_task(run())
        self._marks.add(task)  # (a task nobody holds may be collected before it ends)
        task.add_done_callback(self._marks.discard)

    def _wake_catchups(self) -> None:
        """Records of another node's partition came (or its view): the connected sessions
        that read the log read again, once this loop turn."""
        if not self._waking:
            self._waking = True
            self.broker.loop.call_soon(self._pump_catchups)

    def _pump_catchups(self) -> None:
        self._waking = False
        now = self.broker.loop.time()
        for session in list(self.broker.sessions.values()):
            if session.catchup is not None and session.client is not None:
                session.pump(now)

    def _highs(self) -> dict[int, int]:
        return self.log.leader_highs() if self.log is not None else {}

    def _forwarded_position(self, position: tuple[int, int]) -> None:
        if self.log is not None:
            self.log.routed(*position)

    def _congested(self, peer: int) -> None:
        """A publish was forwarded to a peer whose link is backed up: its publisher waits
        until the link drains (lossless; the clients that do not publish to that peer go on)."""
        self.broker.pause_publisher(f"peer-{peer}", partial(self.mesh.when_drained, peer))
        now = self.broker.loop.time()
        if now - self._congestion_logged >= 10.0:  # one line per 10 s, not per publish
            self._congestion_logged = now
            log.warning("link to worker %d backed up: client input paused for the clients "
                        "publishing to it (episodes=%d)", peer, self.mesh.counters["congested"])

    async def start(self) -> None:
        """Link to every peer (before the broker restores its state); in a cluster, listen
        on the cluster port and dial the other nodes (they link as they come)."""
        await self.sockets.start(self.mesh)
        if self.node_sockets is not None:
            await self.node_sockets.start()
        if self.metadata is not None:  # connects (and reconnects) on its own: no wait here
            self.broker.loop.create_task(self._follow_metadata(self.metadata))

    async def _follow_metadata(self, client: MetaClient) -> None:
        try:
            await client.connect(timeout=30.0)
        except MetadataError as error:
            log.warning("metadata voter not reachable yet: %s", error)
            return
        placements, nodes = self.placements, self.nodes

        def changed(change: Change) -> None:
            view = client.view_nowait()
            if placements is not None:  # the partitions' leaders
                placements.update(view)
            try:
                cluster_id = cluster_id_of(view) if view is not None else None
            except MetadataError as error:
                log.error("metadata: %s", error)
                cluster_id = None
            if nodes is not None and cluster_id:
                nodes.learn_cluster_id(cluster_id, "the metadata", agreed=True)

        client.watch(changed)  # (it keeps the client's mirror of the metadata)

    def started(self) -> None:
        """The broker restored its state: register its sessions with their owners and hand
        on the retained messages it no longer owns."""
        self.directory.restored()
        self.retained.migrate()

    def close(self) -> None:
        if self.metadata is not None:
            self.broker.loop.create_task(self.metadata.close())
        if self.node_sockets is not None:
            self.node_sockets.close()
        self.sockets.close()
