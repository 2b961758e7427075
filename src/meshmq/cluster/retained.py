"""Retained messages across a node's workers: each topic has one owner, which stores it.

Theory of operation
-------------------
``OwnedRetained`` is the core's ``RetainedMessages`` (broker/interfaces.py) for one worker of
several. A topic's retained message is owned by the leader of the topic's partition
(cluster/leaders.py): the worker that appends and routes a persisted publish on it also stores
it, with no further hop.

* ``keep``: a retained publish is routed by the worker that received it (so a publisher's
  messages on a topic keep their order whatever their retain flag), then stored by its owner:
  here (``LocalRetained``: store and journal), or by ``RETAIN`` to the owner, answered once
  journaled (the PUBACK of a retained publish waits for it). Acknowledged means stored, for
  retained messages too: an owner that is down refuses the publish (``Refused``), and one
  that does not answer makes its outcome unknown (``Unknown``: the publisher's connection is
  closed, broker/publishes.py), never a PUBACK.
* ``query``: a filter without wildcards names one topic and asks its owner; a filter with
  wildcards asks every worker (each answers with what it owns). The answers are put together
  per filter. A worker that does not answer (down) contributes nothing: its retained
  messages come back with it.
* After a change of ``server.workers``, a worker restores the retained messages it journaled
  and hands those it no longer owns to their owners (``migrate``: kept only where the owner
  has none), then forgets them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from meshmq.broker.interfaces import Refused, Unknown
from meshmq.cluster.codec import FrameType, QueryRetained, Reply, Retain, Retained
from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mqtt.topics import has_wildcard

if TYPE_CHECKING:
    from meshmq.broker.interfaces import Kept
    from meshmq.broker.local import LocalRetained
    from meshmq.broker.message import Message
    from meshmq.cluster.leaders import Leadership
    from meshmq.cluster.mesh import Mesh

log = logging.getLogger("meshmq.retained")

Encode = Callable[["Message"], bytes]
Decode = Callable[[bytes], "Message"]
Found = list[list["Message"]]


class OwnedRetained:
    """This worker's retained messages, and the way to the others' (module docstring)."""

    def __init__(self, local: LocalRetained, leadership: Leadership, mesh: Mesh,
                 encode: Encode, decode: Decode) -> None:
        self.local = local
        self.leadership = leadership
        self.mesh = mesh
        self.encode = encode
        self.decode = decode
        # a client of this node changed a topic's retained message, stored here (its owner):
        # the cluster's other nodes are told (cluster/noderetained.py)
        self.on_kept: Callable[[Message], None] | None = None
        mesh.handle(FrameType.RETAIN, self._on_retain)
        mesh.handle(FrameType.QUERY_RETAINED, self._on_query)

    @property
    def me(self) -> int:
        return self.leadership.worker.index

    def count(self) -> int:
        return self.local.count()

    # ------------------------------------------------------------------ the core's interface

    def keep(self, message: Message, done: Kept | None) -> None:
        owner = self.leadership.owner_of_topic(message.topic)
        if owner == self.me:
            self.local.keep(message, done)
            if self.on_kept is not None:
                self.on_kept(message)
            return

        def answer(reply: Reply | None) -> None:
            if reply is None:
                log.warning("retained message perhaps not stored: its owner, worker %d, did "
                            "not answer topic=%r", owner, message.topic)
                if done is not None:
                    done(Unknown(f"the retained store, worker {owner}, did not answer", None))
            elif done is not None:
                done(Refused(reply.status, f"refused by its owner, worker {owner}")
                     if reply.status else None)

        body = self.encode(message)
        if not self.mesh.request(owner, lambda request_id: Retain(
                request_id, False, body).encode(), answer):
            log.warning("retained message not stored: its owner, worker %d, is down "
                        "topic=%r", owner, message.topic)
            if done is not None:
                done(Refused(ReasonCode.UNSPECIFIED_ERROR,
                             f"the retained store of this topic, worker {owner}, is down"))

    def query(self, filters: list[str], done: Callable[[Found], None]) -> None:
        found: Found = [[] for _ in filters]
        asks: dict[int, list[int]] = {}  # worker -> indexes of the filters it is asked
        for index, topic_filter in enumerate(filters):
            owners = (range(self.leadership.count) if has_wildcard(topic_filter)
                      else [self.leadership.owner_of_topic(topic_filter)])
            for owner in owners:
                asks.setdefault(owner, []).append(index)
        for index in asks.pop(self.me, []):
            found[index].extend(self.local.matching(filters[index]))
        waiting = [0]

        def answered() -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                done(found)

        for owner, indexes in asks.items():
            asked = [filters[i] for i in indexes]

            def answer(reply: Retained | None, indexes: list[int] = indexes,
                       owner: int = owner) -> None:
                if reply is None:
                    log.warning("retained messages of worker %d not sent: it did not answer",
                                owner)
                else:
                    for position, body in reply.found:
                        if position < len(indexes):
                            found[indexes[position]].append(self.decode(body))
                answered()

            def query(request_id: int, asked: list[str] = asked) -> bytes:
                return QueryRetained(request_id, asked).encode()

            waiting[0] += 1
            if not self.mesh.request(owner, query, answer):
                waiting[0] -= 1  # down: its retained messages come back with it
        if waiting[0] == 0:
            done(found)

    # ------------------------------------------------------------------ serving peers

    def _on_retain(self, peer: int, frame: Retain) -> None:
        message = self.decode(frame.message)
        reply = Reply(frame.request_id, 0).encode()
        link = self.mesh.incarnation(peer)
        if frame.migrate and self.local.store.get(message.topic) is not None:
            self.mesh.send(peer, reply)  # the owner's own copy stays
            return

        def stored(failure: object) -> None:
            self.mesh.send(peer, reply, link)  # (only on the link the request came on)

        self.local.keep(message, stored)
        if self.on_kept is not None and not frame.migrate:
            self.on_kept(message)

    def _on_query(self, peer: int, frame: QueryRetained) -> None:
        found = [(index, self.encode(message)) for index, topic_filter in
                 enumerate(frame.filters) for message in self.local.matching(topic_filter)]
        self.mesh.send(peer, Retained(frame.request_id, found).encode())

    # ------------------------------------------------------------------ a new worker count

    def migrate(self) -> int:
        """Hand the retained messages this worker no longer owns to their owners (once
        linked); returns how many are on their way."""
        moving = [(topic, message) for topic, message in self.local.store.items()
                  if self.leadership.owner_of_topic(topic) != self.me]
        for topic, message in moving:
            owner = self.leadership.owner_of_topic(topic)

            def answer(reply: Reply | None, topic: str = topic, message: Message = message
                       ) -> None:
                if reply is not None and self.local.store.get(topic) is message:
                    self.local.store.set(topic, None)
                    self.local.keeper.retained(topic, None)

            body = self.encode(message)

            def retain(request_id: int, body: bytes = body) -> bytes:
                return Retain(request_id, True, body).encode()

            self.mesh.request(owner, retain, answer)
        if moving:
            log.info("retained messages handed to their new owners count=%d", len(moving))
        return len(moving)
