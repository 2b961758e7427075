"""What each worker answers, and the node's answer put together from all of them.

``WorkerViews.answer(query, args)`` runs on every worker: it reads that worker's broker through
broker/queries.py (and its log and mesh for the metrics, collect.py) and returns JSON-ready
data. The worker that serves the admin listener answers for itself directly and asks the others
over the mesh (cluster/admin.py); ``NodeViews.ask`` returns every worker's answer by index, and
the HTTP handlers (app.py) merge them. A single-process node is a node of one worker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmq import __version__
from meshmq.broker import queries
from meshmq.broker.message import Message
from meshmq.cluster.admin import QueryFailed
from meshmq.cluster.metadata import MetadataError, members_of
from meshmq.cluster.metarecords import assignment_of, controller_of
from meshmq.cluster.nodestats import ClusterStatistics
from meshmq.node.admin.collect import own_log, worker_samples

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.broker.transport.listeners import Listeners
    from meshmq.cluster.workers import WorkerCluster
    from meshmq.services.layer import ServicesLayer


class WorkerViews:
    """One worker's answers to the admin queries (``answer``)."""

    def __init__(self, broker: Broker, cluster: WorkerCluster | None) -> None:
        self.broker = broker
        self.cluster = cluster
        self.listeners: Listeners | None = None  # once they listen
        self.services: ServicesLayer | None = None  # request/reply, when it is on
        self.started = time.time()
        self._queries: dict[str, Callable[[dict[str, Any]], Any]] = {
            "metrics": lambda args: worker_samples(broker, cluster, self.listeners,
                                                   self.services),
            "worker": lambda args: self.worker(),
            "clients": lambda args: queries.clients(broker),
            "kick": lambda args: queries.kick(broker, args["client_id"]),
            "sessions": lambda args: queries.sessions(broker),
            "session": lambda args: queries.session_detail(broker, args["client_id"]),
            "delete_session": lambda args: queries.delete_session(broker, args["client_id"]),
            "subscriptions": lambda args: queries.subscriptions(broker),
            "match": lambda args: queries.matching(broker, args["topic"]),
            "retained": lambda args: queries.retained(broker, args["filter"]),
            "partitions": lambda args: self.partitions(),
            "segments": lambda args: self.segments(args["partition"]),
            "cursors": lambda args: self.cursors(),
            "cluster": lambda args: self.cluster_view(),
            "forget": lambda args: self.forget(args["node_id"]),
        }

    def answer(self, query: str, args: dict[str, Any]) -> Any:
        view = self._queries.get(query)
        if view is None:
            raise KeyError(f"no admin query {query!r}")
        return view(args)

    def cluster_view(self) -> dict[str, Any] | None:
        """This worker's links to the other nodes (None: no cluster): for each node it knows,
        whether its own dialed link is up and whether it suspects it."""
        cluster = self.cluster
        links = cluster.nodes if cluster is not None else None
        if cluster is None or links is None:
            return None
        up = set(links.linked_nodes().values())
        suspected = {link.remote.hello.node_id for link in links.mesh.remote.values()
                     if link.remote.suspect and link.remote.hello is not None}
        return {"node_id": links.identity.node_id, "cluster_id": links.identity.cluster_id,
                "nodes": [{"node_id": node.node_id, "address": node.address,
                           "linked": node.node_id in up, "suspected": node.node_id in suspected}
                          for node in sorted(links.nodes.values(), key=lambda n: n.node_id)],
                "counters": {**links.counters, **(
                    cluster.node_appends.counters if cluster.node_appends is not None else {}),
                    **(cluster.node_catchup.counters if cluster.node_catchup is not None
                       else {}),
                    **(cluster.remote_log.counters if cluster.remote_log is not None else {}),
                    **(cluster.session_owners.counters if cluster.session_owners is not None
                       else {})},
                "metadata": self.metadata_view(),
                "metadata_configured": cluster.metadata is not None,
                "stats": cluster.statistics.figures()
                if isinstance(cluster.statistics, ClusterStatistics) else {}}

    def forget(self, node_id: str) -> bool | None:
        """This worker drops ``node_id`` and tells the other nodes (None: not a cluster node;
        this node's own id: it is leaving, and the others drop it)."""
        links = self.cluster.nodes if self.cluster is not None else None
        return None if links is None else links.forget(node_id, spread=True)

    async def leave_metadata(self) -> str | None:
        """This node leaves the metadata: its member record and its Raft voter (None: no
        metadata here). Raises ``MetadataError`` when that cannot be agreed now."""
        client = self.cluster.metadata if self.cluster is not None else None
        return None if client is None else await client.leave()

    async def forget_in_metadata(self, node_id: str) -> str | None:
        """Drop a node gone for good from the metadata: its Raft voter, then its member
        record (None: no metadata here). Raises ``MetadataError`` as above."""
        client = self.cluster.metadata if self.cluster is not None else None
        if client is None:
            return None
        member = members_of(await client.read()).get(node_id)
        if member is None:
            return f"{node_id} has no member record"
        done = await client.remove_voter(member.raft)
        await client.remove_member(node_id)
        return done

    def metadata_view(self) -> dict[str, Any] | None:
        """The metadata as this worker's client mirrors it (None: no metadata voter, or not
        connected yet): members, the controller, each partition's assignment."""
        client = self.cluster.metadata if self.cluster is not None else None
        view = client.view_nowait() if client is not None else None
        if view is None:
            return None
        controller = controller_of(view)
        return {
            "version": view.version,
            "members": {node: member.to_json() for node, member in members_of(view).items()},
            "controller": None if controller is None else controller.to_json(),
            "partitions": {str(p): a.to_json() for p in range(self.broker.config.log.partitions)
                           if (a := assignment_of(view, p)) is not None}}

    def worker(self) -> dict[str, Any]:
        broker = self.broker
        listeners = self.listeners
        return {
            "index": broker.index or 0, "pid": os.getpid(), "started": round(self.started, 3),
            "clients": len(queries.clients(broker)), "sessions": len(broker.sessions),
            "listeners": [] if listeners is None else [
                {"name": item.spec.name, "bind": item.spec.bind, "port": item.port,
                 "path": item.spec.path} for item in listeners.listeners],
            "leads": [] if (log := own_log(broker, self.cluster)) is None else list(log.owned),
        }

    def partitions(self) -> list[dict[str, Any]]:
        """The partitions this worker leads."""
        log = own_log(self.broker, self.cluster)
        if log is None:
            return []
        settings = self.broker.config.log
        rows = []
        for partition, stats in zip(log.owned, log.commit_log.statistics().partitions,
                                    strict=True):
            rows.append({
                "partition": partition, "leader": self.broker.index or 0,
                "earliest_offset": stats.earliest_offset,
                "next_offset": stats.next_offset,
                "high_watermark": log.high_watermark[partition],
                "segments": stats.segments, "size_bytes": stats.size_bytes,
                "retention_bytes": settings.retention_bytes,
                "retention_ms": settings.retention_ms,
            })
        return rows

    def segments(self, partition: int) -> list[dict[str, Any]] | None:
        """The segment files of ``partition``, if this worker leads it (else None)."""
        log = own_log(self.broker, self.cluster)
        if log is None or partition not in log.owned:
            return None
        directory = Path(log.commit_log.partition(partition).directory)
        rows = []
        for path in sorted(directory.glob("*.log")):
            rows.append({"base_offset": int(path.stem), "size_bytes": path.stat().st_size,
                         "file": path.name})
        return rows

    def cursors(self) -> list[dict[str, Any]]:
        broker = self.broker
        rows = []
        for session in broker.sessions.values():
            cursor = queries.cursor(broker, session)
            if cursor is None:
                continue
            lag = sum(row["lag"] for row in cursor)
            rows.append({"client_id": session.client_id, "online": session.client is not None,
                         "lag": lag, "cursor": cursor})
        return rows


class NodeViews:
    """The node's answers: this worker's, and the other workers' over the mesh."""

    def __init__(self, local: WorkerViews, cluster: WorkerCluster | None) -> None:
        self.local = local
        self.cluster = cluster
        self.index = local.broker.index or 0
        self.workers = 1 if cluster is None else cluster.worker.count
        self.started = time.time()

    async def ask(self, query: str, **args: Any) -> dict[int, Any]:
        """Every worker's answer to ``query`` by index; a worker missing or failing is
        absent (a failure on this worker raises, as a bug should)."""
        answers: dict[int, Any] = {}
        if self.cluster is not None:
            peers = [i for i in range(self.workers) if i != self.index]
            asked = await self.cluster.admin.ask(peers, query, args)
            answers.update({i: a for i, a in asked.items() if not isinstance(a, QueryFailed)})
        answers[self.index] = self.local.answer(query, args)
        return dict(sorted(answers.items()))

    async def leave_metadata(self) -> str | None:
        return await self.local.leave_metadata()

    async def raft_status(self) -> dict[str, Any] | None:
        """This node's Raft voter as it answers: its state, leader, term and the voters
        (None: no metadata here, or the voter does not answer now)."""
        client = self.cluster.metadata if self.cluster is not None else None
        if client is None:
            return None
        try:
            status = await client.status()
        except MetadataError:
            return None
        return {name: status.get(name) for name in ("state", "leader", "term", "voters")}

    async def forget_in_metadata(self, node_id: str) -> str | None:
        return await self.local.forget_in_metadata(node_id)

    async def merged(self, query: str, **args: Any) -> list[Any]:
        """The answers of every worker to a list query, concatenated."""
        return [row for rows in (await self.ask(query, **args)).values() for row in rows]

    def delete_retained(self, topic: str) -> None:
        """Clear ``topic``'s retained message at its owner (an empty retained message in the
        store, MQTT-3.3.1-6; it is not published to subscribers)."""
        broker = self.local.broker
        now = broker.loop.time()
        broker.retained.keep(Message(topic, b"", 0, True, None, None, now), None)

    def version(self) -> str:
        return __version__
