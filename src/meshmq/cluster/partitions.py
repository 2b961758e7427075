"""The commit log across a node's workers: each partition has one leader, every worker reads all.

Theory of operation
-------------------
``PartitionedLog`` is the core's ``PartitionLog`` (broker/interfaces.py) for one worker of
several. Partition ``p`` is led by worker ``p mod N`` (cluster/leaders.py):

* **Appending.** A persisted publish on a partition this worker leads goes to its own writer
  (``Persistence`` over those partitions only, each under its own lock) and comes back
  ``Stored``: the broker routes it here. One on another partition goes to that partition's
  leader (``APPEND``); the leader appends it, routes it once durable (to its own subscribers
  and, as ``FORWARD``, to every worker with a match, this one included) and answers
  (``REPLY``): ``StoredElsewhere``, or ``Refused`` with its reason. A leader that is not linked
  (it crashed and is being restarted) refuses at once: its partitions are offline, the others
  go on. So the order of a partition is its leader's order everywhere, nothing is delivered
  before it is durable, and a PUBACK means durable whichever worker the publisher is on.
* **Serving appends** (``APPEND`` from a peer): the same local append, then the broker's
  ``route_stored`` routes it and stores it as retained if flagged; the answer carries where it
  was stored and to how many receivers it went.
* **Reading.** Partitions led here are read from the open log; the others from their files
  (``LogView``: no lock, whole checksummed batches only), never beyond this worker's *view* of
  their high watermark.
* **The view** of a partition led elsewhere only moves on what its leader says, in order on one
  link: the high watermarks in its ``HELLO``, in each ``BARRIER_DONE`` and ``SYNCED``, the
  position of each persisted message it forwards, and each ``REPLY``. Every record at or above
  the view that matches a route of this worker is still to be forwarded here, so a catch-up
  that reads up to the view and then goes live neither misses nor repeats one; and since a
  SUBACK waits for a barrier with every peer, a cursor started from the view never reaches
  back before its subscription existed (docs/workers.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshmq.broker.interfaces import (
    AppendOutcome,
    Completion,
    Refused,
    Stored,
    StoredElsewhere,
)
from meshmq.broker.persistence import LogAccess, Persistence
from meshmq.cluster.codec import Append, FrameType, Hello, Highs, Reply, Sync, Synced
from meshmq.log.view import LogView
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    import asyncio

    from meshmq.broker.message import Message
    from meshmq.cluster.leaders import Leadership
    from meshmq.cluster.mesh import Mesh
    from meshmq.config import LogSettings
    from meshmq.log.record import Record

log = logging.getLogger("meshmq.partitions")

RouteStored = Callable[["Message", Stored, Callable[[int], None]], None]
Decode = Callable[[bytes], "Message"]
Encode = Callable[["Message"], bytes]


class PartitionedLog(LogAccess):
    """This worker's partitions, and its view of the others' (see the module docstring)."""

    def __init__(self, settings: LogSettings, data_dir: str, loop: asyncio.AbstractEventLoop,
                 leadership: Leadership, mesh: Mesh, encode: Encode, decode: Decode) -> None:
        super().__init__(settings)
        self.leadership = leadership
        self.mesh = mesh
        self.loop = loop
        self.encode = encode
        self.decode = decode
        self.high_watermark = [0] * settings.partitions
        self.local = Persistence(settings, data_dir, loop, owned=leadership.mine,
                                 high_watermark=self.high_watermark)
        self.view = LogView(data_dir)
        self.route_stored: RouteStored | None = None  # set by the broker's side (workers.py)
        self.counters = {"appends_forwarded": 0, "appends_served": 0, "appends_refused": 0}
        mesh.handle(FrameType.APPEND, self._on_append)
        mesh.handle(FrameType.SYNC, self._on_sync)
        mesh.on_link_up.append(self._on_link_up)
        mesh.on_highs = lambda peer, highs: self.synced(highs)

    # ------------------------------------------------------------------ the core's interface

    def append(self, message: Message, client_id: str, done: Completion) -> bool:
        partition = self.leadership.partition_for(message.topic)
        if self.leadership.leads(partition):
            return self.local.append(message, client_id, done)
        leader = self.leadership.leader_of(partition)

        def answer(reply: Reply | None) -> None:
            done(self._outcome(partition, leader, reply))

        body = self.encode(message)
        if not self.mesh.request(leader, lambda request_id: Append(
                request_id, client_id, body).encode(), answer, timeout=APPEND_TIMEOUT):
            self.counters["appends_refused"] += 1
            self.loop.call_soon(done, Refused(
                ReasonCode.UNSPECIFIED_ERROR,
                f"partition {partition} is offline: its leader, worker {leader}, is down"))
            return True
        self.counters["appends_forwarded"] += 1
        return True

    def _outcome(self, partition: int, leader: int, reply: Reply | None) -> AppendOutcome:
        if reply is None:
            self.counters["appends_refused"] += 1
            return Refused(ReasonCode.UNSPECIFIED_ERROR,
                           f"partition {partition}: no answer from its leader, worker {leader}")
        if reply.status:
            return Refused(reply.status, f"partition {partition}: refused by its leader "
                                         f"(0x{reply.status:02X})")
        self.routed(reply.partition, reply.offset)  # everything before it was forwarded here
        return StoredElsewhere(reply.partition, reply.offset, reply.receivers)

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        if self.leadership.leads(partition):
            return self.local.read(partition, offset, max_records)
        return self.view.read(partition, offset, max_records=max_records)

    def earliest_offset(self, partition: int) -> int:
        if self.leadership.leads(partition):
            return self.local.earliest_offset(partition)
        return self.view.earliest_offset(partition)

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        if self.leadership.leads(partition):
            return self.local.offset_for_timestamp(partition, timestamp_ms)
        return self.view.offset_for_timestamp(partition, timestamp_ms)

    def sync(self, done: Callable[[], None]) -> None:
        """Ask every partition leader for its high watermarks (as of after our route
        changes); then ``done()``. A leader that does not answer is passed over."""
        leaders = {self.leadership.leader_of(p) for p in range(self.leadership.partitions)}
        leaders.discard(self.leadership.worker.index)

        def on_answer(peer: int, frame: Synced | None, late: bool) -> None:
            if frame is not None:
                self.synced(frame.highs)

        self.mesh.ask_all(lambda request_id: Sync(request_id).encode(), on_answer, done,
                          "high watermark sync", peers=sorted(leaders))

    def close(self) -> None:
        self.local.close()
        self.view.close()

    # ------------------------------------------------------------------ the view

    def synced(self, highs: Highs) -> None:
        """A leader's high watermarks, after everything it sent before."""
        view = self.high_watermark
        leads = self.leadership.leads
        for partition, high in highs.items():
            if partition < len(view) and not leads(partition) and high > view[partition]:
                view[partition] = high

    def leader_highs(self) -> Highs:
        """The high watermarks of the partitions this worker leads (for HELLO, barriers)."""
        return {p: self.high_watermark[p] for p in self.leadership.mine}

    def _on_link_up(self, peer: int, hello: Hello) -> None:
        self.synced(hello.highs)

    def _on_sync(self, peer: int, frame: Sync) -> None:
        self.mesh.send(peer, Synced(frame.request_id, self.leader_highs()).encode())

    # ------------------------------------------------------------------ serving peers

    def _on_append(self, peer: int, frame: Append) -> None:
        message = self.decode(frame.message)

        def reply(status: int, partition: int = 0, offset: int = 0, receivers: int = 0
                  ) -> None:
            self.mesh.send(peer, Reply(frame.request_id, status, partition, offset,
                                       receivers).encode())

        def durable(outcome: AppendOutcome) -> None:
            if not isinstance(outcome, Stored) or self.route_stored is None:
                code = outcome.reason_code if isinstance(outcome, Refused) else (
                    ReasonCode.UNSPECIFIED_ERROR)
                log.error("append for worker %d failed topic=%r: %s", peer, message.topic,
                          getattr(outcome, "why", "no broker"))
                return reply(code)
            self.counters["appends_served"] += 1
            self.route_stored(message, outcome, lambda receivers: reply(
                0, outcome.partition, outcome.offset, receivers))

        partition = self.leadership.partition_for(message.topic)
        if not self.leadership.leads(partition):  # the leaders changed under the sender
            return reply(ReasonCode.UNSPECIFIED_ERROR)
        if not self.local.append(message, frame.client_id, durable):
            reply(ReasonCode.QUOTA_EXCEEDED)

    def statistics(self) -> dict[str, Any]:
        return {"leads": list(self.leadership.mine), **self.counters}


APPEND_TIMEOUT = 30.0  # seconds a leader may take to make an append durable (a slow disk)
