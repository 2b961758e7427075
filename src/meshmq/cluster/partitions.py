"""The commit log across a node's workers: each partition has one leader, every worker reads all.

Theory of operation
-------------------
``PartitionedLog`` is the core's ``PartitionLog`` (broker/interfaces.py) for one worker of
several. Partition ``p`` is led by worker ``p mod N`` (cluster/leaders.py):

* **Appending.** A persisted publish on a partition this worker leads goes to its own writer
  (``Persistence`` over those partitions only, each under its own lock) and comes back
  ``Stored``: the broker routes it here. One on another partition goes to that partition's
  leader (``APPEND``: the publishes of one loop turn for one leader in one frame); the leader
  appends it, routes it once durable (to its own subscribers and, as ``FORWARD``, to every
  other worker with a match) and answers (``APPENDED``, batched the same way):
  ``StoredElsewhere``, or ``Refused`` with its reason. The requester has the message already,
  so the leader does not send it back: the answer says which shared groups the requester
  serves and it delivers the message to its own subscribers itself. The answers to a peer go
  out before any ``FORWARD`` to that peer routed after them, so every worker sees a
  partition in its leader's order (a retained publish, answered only once journaled, is
  forwarded as usual instead). A leader that is not linked (it crashed and is being
  restarted) refuses at once: its partitions are offline, the others go on. So nothing is
  delivered before it is durable, and a PUBACK means durable whichever worker the publisher
  is on.
* **Serving appends** (``APPEND`` from a peer): the same local append (a frame's publishes
  go to the writer's queue in one call), then the broker's
  ``route_stored`` routes it and stores it as retained if flagged; the answer carries where it
  was stored and to how many receivers it went.
* **Reading.** Partitions led here are read from the open log; the others from their files
  (``LogView``: no lock, whole checksummed batches only), never beyond this worker's *view* of
  their high watermark.
* **The view** of a partition led elsewhere only moves on what its leader says, in order on one
  link: the high watermarks in its ``HELLO``, in each ``BARRIER_DONE`` and ``SYNCED``, the
  position of each persisted message it forwards, and each ``APPENDED`` answer. Every record at
  or above the view that matches a route of this worker is still to be forwarded here, so a catch-up
  that reads up to the view and then goes live neither misses nor repeats one; and since a
  SUBACK waits for a barrier with every peer, a cursor started from the view never reaches
  back before its subscription existed (docs/workers.md).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from meshmq.broker.interfaces import (
    AppendOutcome,
    Completion,
    Refused,
    Stored,
    StoredElsewhere,
)
from meshmq.broker.persistence import LogAccess, Persistence
from meshmq.cluster.codec import (
    Append,
    AppendAnswer,
    Appended,
    AppendEntry,
    FrameType,
    Hello,
    Highs,
    Sync,
    Synced,
    new_named,
)
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
Decode = Callable[[bytes, float], "Message"]
Encode = Callable[["Message"], bytes]


class _Pending(NamedTuple):
    """An append waiting for its leader's answer."""

    leader: int
    partition: int
    done: Completion


class PartitionedLog(LogAccess):
    """This worker's partitions, and its view of the others' (see the module docstring)."""

    def __init__(self, settings: LogSettings, data_dir: str, loop: asyncio.AbstractEventLoop,
                 leadership: Leadership, mesh: Mesh, encode: Encode, decode: Decode) -> None:
        super().__init__(settings)
        self.leadership = leadership
        self.partition_for = leadership.partitioner.partition_for  # (cached per topic)
        self._leaders = leadership.leaders
        self._me = leadership.worker.index
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
        self._next_request = 1
        self._pending: dict[int, _Pending] = {}  # appends waiting for their leader's answer
        # (deadline, last request id) per APPEND frame sent, in the order they were sent
        self._deadlines: deque[tuple[float, int]] = deque()
        self._outbox: dict[int, list[AppendEntry]] = {}  # this turn's appends, per leader
        self._answers: dict[int, list[AppendAnswer]] = {}  # this turn's answers, per peer
        mesh.handle(FrameType.APPEND, self._on_append)
        mesh.handle(FrameType.APPENDED, self._on_appended)
        mesh.before_send += [self._send_appends, self._send_answers]
        mesh.before_forward = self._answers_first
        mesh.on_link_down.append(self._leader_down)
        mesh.on_tick.append(self._expire)
        mesh.handle(FrameType.SYNC, self._on_sync)
        mesh.on_link_up.append(self._on_link_up)
        mesh.on_highs = lambda peer, highs: self.synced(highs)

    # ------------------------------------------------------------------ the core's interface

    def append(self, message: Message, client_id: str, done: Completion) -> bool:
        partition = self.partition_for(message.topic)
        leader = self._leaders[partition]
        if leader == self._me:
            return self.local.append(message, client_id, done)
        if leader not in self.mesh.peers:
            self.counters["appends_refused"] += 1
            self.loop.call_soon(done, Refused(
                ReasonCode.UNSPECIFIED_ERROR,
                f"partition {partition} is offline: its leader, worker {leader}, is down"))
            return True
        request_id = self._next_request
        self._next_request += 1
        self._pending[request_id] = new_named(_Pending, (leader, partition, done))
        outbox = self._outbox.get(leader)
        if outbox is None:
            outbox = self._outbox[leader] = []
        outbox.append(new_named(AppendEntry, (request_id, client_id, self.encode(message))))
        self.mesh.wake()
        self.counters["appends_forwarded"] += 1
        return True

    def _send_appends(self) -> None:
        """Before the mesh writes: one APPEND frame per leader with this turn's publishes."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for leader, entries in outbox.items():
            if not self.mesh.send(leader, Append(entries).encode()):
                for request_id, _, _ in entries:
                    self._fail(request_id, "its leader went down")
        deadline = self.mesh.io.now() + APPEND_TIMEOUT  # one for this turn's frames
        self._deadlines.append((deadline, self._next_request - 1))
        if len(self._deadlines) == 1:
            self.mesh.io.schedule(deadline)

    def _on_appended(self, peer: int, frame: Appended) -> None:
        waiting = self._pending
        for request_id, status, partition, offset, receivers, local in frame.answers:
            pending = waiting.pop(request_id, None)
            if pending is None or pending.leader != peer:
                continue
            if status:
                outcome: AppendOutcome = Refused(status, (
                    f"partition {pending.partition}: refused by its leader (0x{status:02X})"))
            else:
                self.routed(partition, offset)  # all before it came here first
                outcome = StoredElsewhere(partition, offset, receivers, local)
            pending.done(outcome)

    def _fail(self, request_id: int, why: str) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.counters["appends_refused"] += 1
            pending.done(Refused(ReasonCode.UNSPECIFIED_ERROR,
                                 f"partition {pending.partition}: {why}"))

    def _leader_down(self, peer: int) -> None:
        for request_id in [r for r, p in self._pending.items() if p.leader == peer]:
            self._fail(request_id, f"its leader, worker {peer}, went down")
        self._outbox.pop(peer, None)

    def _expire(self, now: float) -> None:
        """Fail the appends of every frame sent ``APPEND_TIMEOUT`` ago that are unanswered
        (``_pending`` is in request id order: the oldest come first)."""
        deadlines = self._deadlines
        while deadlines:
            deadline, last = deadlines[0]
            if deadline > now and self._pending and next(iter(self._pending)) <= last:
                self.mesh.io.schedule(deadline)
                return
            deadlines.popleft()
            if deadline > now:
                continue  # all of that frame's appends are answered
            overdue = []
            for request_id in self._pending:
                if request_id > last:
                    break
                overdue.append(request_id)
            for request_id in overdue:
                self._fail(request_id, f"no answer from its leader within {APPEND_TIMEOUT:.0f} s")

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        if self.leadership.leads(partition):
            return self.local.read(partition, offset, max_records)
        return self.view.read(partition, offset, max_records=max_records)

    def routes_all(self, partition: int) -> bool:
        return self.leadership.leads(partition)

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
        """Persist a peer's publishes (queued to the writer together), route each once durable,
        answer each (in this turn's batch)."""
        now = self.loop.time()
        partition_for, leaders, me, decode = (
            self.partition_for, self._leaders, self._me, self.decode)
        accepted: list[tuple[Message, str, Completion]] = []
        request_ids: list[int] = []
        for request_id, client_id, body in frame.entries:
            message = decode(body, now)
            if leaders[partition_for(message.topic)] != me:
                self._answer(peer, AppendAnswer(request_id, ReasonCode.UNSPECIFIED_ERROR))
                continue  # the leaders changed under the sender
            accepted.append((message, client_id, self._durable(peer, request_id, message)))
            request_ids.append(request_id)
        queued = self.local.append_many(accepted) if accepted else 0
        for request_id in request_ids[queued:]:  # the writer's queue is full
            self._answer(peer, AppendAnswer(request_id, ReasonCode.QUOTA_EXCEEDED))

    def _answer(self, peer: int, answer: AppendAnswer) -> None:
        answers = self._answers.get(peer)
        if answers is None:
            answers = self._answers[peer] = []
        answers.append(answer)
        self.mesh.wake()

    def _durable(self, peer: int, request_id: int, message: Message) -> Completion:
        """What to do once a peer's publish is durable: route it, then answer."""
        def durable(outcome: AppendOutcome) -> None:
            if not isinstance(outcome, Stored) or self.route_stored is None:
                code = outcome.reason_code if isinstance(outcome, Refused) else (
                    ReasonCode.UNSPECIFIED_ERROR)
                log.error("append for worker %d failed topic=%r: %s", peer, message.topic,
                          getattr(outcome, "why", "no broker"))
                return self._answer(peer, AppendAnswer(request_id, code))
            self.counters["appends_served"] += 1
            partition, offset = outcome.partition, outcome.offset
            if message.retain:  # answered once journaled: forwarded as usual meanwhile
                self.route_stored(message, outcome, lambda receivers: self._answer(
                    peer, AppendAnswer(request_id, 0, partition, offset, receivers)))
                return
            mesh = self.mesh
            mesh.local_for, mesh.local_groups = peer, None  # it delivers this one itself
            try:
                self.route_stored(message, outcome, lambda receivers: self._answer(
                    peer, AppendAnswer(request_id, 0, partition, offset, receivers,
                                       mesh.local_groups)))
            finally:
                mesh.local_for = None
        return durable

    def _send_answers(self) -> None:
        if not self._answers:
            return
        answers, self._answers = self._answers, {}
        for peer, batch in answers.items():
            self.mesh.send(peer, Appended(batch).encode())

    def _answers_first(self, peer: int) -> None:
        """A FORWARD is about to go to ``peer``: the answers to its appends routed before it go
        first, so that the peer delivers its own publishes at their place in the partition's
        order (the leader's), as it would have delivered them forwarded."""
        batch = self._answers.pop(peer, None)
        if batch:
            self.mesh.send(peer, Appended(batch).encode())

    def statistics(self) -> dict[str, Any]:
        return {"leads": list(self.leadership.mine), **self.counters}


APPEND_TIMEOUT = 30.0  # seconds a leader may take to make an append durable (a slow disk)
