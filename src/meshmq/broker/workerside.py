"""The broker's side of the mesh: what a worker asks of the other workers, and does for them.

Theory of operation
-------------------
``Broker`` inherits these methods; they only run when ``server.workers`` is above 1 (see
docs/workers.md and cluster/mesh.py for the protocol):

* joining: ``join_mesh`` links to every peer before sessions are restored; a worker other than
  the leader then reads the commit log through ``RemoteLog``;
* CONNECT: ``_claimed`` adopts the sessions peers handed over and, once the peers route the
  moved subscriptions here (a barrier), connects; ``release_session`` is the other side;
* persisted publishes and retained messages are the leader's: ``append_for_peer``,
  ``store_retained`` and ``retained_matching`` serve the other workers, ``_keep_retained``
  stores here or asks the leader;
* catch-up on a worker that is not the leader reads up to the leader's high watermark as of
  after its routes moved (``_sync_catchup``, ``_sync_replay``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from meshmq.broker.message import Message
from meshmq.broker.replay import ReplayError, ReplayRequest, start_offsets
from meshmq.cluster.mesh import Mesh
from meshmq.cluster.remotelog import RemoteLog
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.broker.protocol import ClientProtocol
    from meshmq.broker.session import Session
    from meshmq.mqtt.packets import Connect


log = logging.getLogger("meshmq.broker")


class WorkerSide:
    """Mixin of ``Broker`` (every method's ``self`` is the broker)."""

    async def join_mesh(self: Broker) -> None:
        """Link to the other workers of this node (cluster/mesh.py); returns once linked."""
        worker = self.worker
        if worker is None or worker.count == 1:
            return
        self.mesh = Mesh(self, worker)
        await self.mesh.start()
        if self.config.log.enabled and not worker.is_leader:
            self.persistence = RemoteLog(self.config.log, self.config.server.data_dir,
                                         self.mesh, self.mesh.leader_high)

    def _claimed(
        self: Broker, client: ClientProtocol, packet: Connect, sessions: list[bytes]
    ) -> None:
        """Peers answered the claim (workers): adopt what they handed over, then connect."""
        mesh = self.mesh
        assert mesh is not None
        mesh.drop_moved(packet.client_id)  # a stand-in left here is not a session
        adopted = mesh.adopt(sessions) if sessions else []
        for session in adopted:
            self._sync_catchup(session)
            session.connecting = not client.gone  # QoS 0 waits for the CONNACK, as on one worker
        if adopted:
            mesh.settle(packet.client_id)
        if not client.gone and any(session.subscriptions for session in adopted):
            # CONNACK once the peers route the moved subscriptions here.
            mesh.barrier(partial(self._connect_claimed, client, packet, adopted))
            return
        self._connect_claimed(client, packet, adopted)

    def _connect_claimed(
        self: Broker, client: ClientProtocol, packet: Connect, adopted: list[Session]
    ) -> None:
        if client.gone:  # the new connection went away meanwhile: what it adopted waits here
            for session in adopted:
                session.connecting = False
                if session.client is None and session.expiry_handle is None:
                    self._start_expiry(session)
                    self.keeper.detached(session)
            return
        self._accept_connect(client, packet)
        client.release()

    def _sync_catchup(
        self: Broker, session: Session, then: Callable[[], None] | None = None
    ) -> None:
        """Workers: a session's log cursor reads up to the leader's high watermark as of
        after its routes are in place here (a session handed over: records routed while its
        routes moved went to neither worker live; remotelog.py). Until the leader answers the
        cursor reads nothing; ``then`` runs before it reads again."""
        catchup = session.catchup
        if catchup is None or self.persistence is None or self.persistence.routes_locally:
            return
        catchup.syncing += 1

        def synced() -> None:
            catchup.syncing -= 1
            if then is not None:
                then()
            session.pump(self.loop.time())

        self.mesh.sync(synced)  # type: ignore[union-attr]

    def _sync_replay(
        self: Broker, session: Session, request: ReplayRequest, filters: list[str]
    ) -> None:
        """Workers: history ends where the leader's high watermark is once our new routes are
        in place. Until it answers, the replay covers everything (live messages on these
        filters wait for it) and reads nothing; then its start offsets are computed again."""
        if session.catchup is None:
            return
        entries = [e for e in session.catchup.filters if e.topic_filter in filters]
        for entry in entries:
            entry.start = [0] * len(entry.start)

        def restart() -> None:
            try:
                start = start_offsets(request, self.persistence)  # type: ignore[arg-type]
            except ReplayError:  # checked at SUBSCRIBE; the log cannot shrink its partitions
                start = list(self.persistence.high_watermark)  # type: ignore[union-attr]
            for entry in entries:
                entry.start = list(start)

        self._sync_catchup(session, restart)

    def _keep_retained(self: Broker, message: Message, done: Callable[[], None] | None) -> None:
        """Store the retained message of ``message.topic`` durably (clear it if the payload
        is empty), then ``done``: here, or at the leader when this worker is not it."""
        if self.router.keeps_retained:
            self.keeper.retained(message.topic, message if message.payload else None, done)
        else:
            self.mesh.store_retained(message, done)  # type: ignore[union-attr]

    def store_retained(self: Broker, message: Message, done: Callable[[], None]) -> None:
        """Leader: a peer's retained publish (already routed by the peer)."""
        stored = message if message.payload else None
        self.router.retained.set(message.topic, stored)
        self.keeper.retained(message.topic, stored, done)

    def retained_matching(self: Broker, topic_filter: str) -> list[Message]:
        """Leader: the retained messages ``topic_filter`` matches, dropping expired ones."""
        now = self.loop.time()
        found = []
        for message in self.router.retained_for(topic_filter):
            if message.expired(now):
                self.router.retained.set(message.topic, None)
                self.keeper.retained(message.topic, None)
            else:
                found.append(message)
        return found

    def append_for_peer(self: Broker, message: Message, client_id: str,
                        reply: Callable[..., None]) -> None:
        """Leader: persist a peer's publish, route it once durable, then answer the peer."""
        persistence = self.persistence
        if persistence is None or not persistence.routes_locally:
            return reply(ReasonCode.UNSPECIFIED_ERROR)

        def durable(outcome: object) -> None:
            if isinstance(outcome, BaseException):
                log.error("commit log append failed topic=%r error=%r", message.topic,
                          str(outcome))
                return reply(ReasonCode.UNSPECIFIED_ERROR)
            partition, offset = outcome  # type: ignore[misc]
            message.set_position(partition, offset)
            persistence.routed(partition, offset)
            receivers = self.router.publish(message, self.loop.time())
            if message.retain:
                self.keeper.retained(message.topic, message if message.payload else None,
                                     partial(reply, 0, partition, offset, receivers))
            else:
                reply(0, partition, offset, receivers)

        if not persistence.append(message, client_id, durable):
            reply(ReasonCode.QUOTA_EXCEEDED)

    def release_session(self: Broker, client_id: str, clean_start: bool) -> Session | None:
        """A peer claims ``client_id``: disconnect its client here (0x8E) and hand the session
        over (removed from here; its routes stay until the mesh's stand-in for it is dropped),
        or end it if the new connection starts clean."""
        session = self.sessions.get(client_id)
        if session is not None and session.client is not None:
            self._take_over(session.client)  # type: ignore[arg-type]
            session = self.sessions.get(client_id)
        if session is None:
            return None
        if clean_start:
            self._end_session(session, self.loop.time())
            return None
        self._cancel_timers(session)  # its will and expiry go with it
        session.will = None
        if self.sessions.get(client_id) is session:
            del self.sessions[client_id]  # the mesh puts a stand-in here (cluster/moving.py)
            self.keeper.ended(session)
        return session

    def discard_session(self: Broker, session: Session) -> None:
        """Remove a session from this worker without a will or redistribution (it lives on
        elsewhere)."""
        if session.client is not None:
            self._take_over(session.client)  # type: ignore[arg-type]
        self._cancel_timers(session)
        session.will = None
        subscriptions = dict(session.subscriptions)
        for topic_filter in subscriptions:
            self.router.unsubscribe(session, topic_filter)
        session.subscriptions = subscriptions  # still part of what is handed over
        if self.sessions.get(session.client_id) is session:
            del self.sessions[session.client_id]
            self.keeper.ended(session)
