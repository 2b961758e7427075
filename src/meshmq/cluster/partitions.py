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
  out before any ``FORWARD`` to that peer routed after them, and before any frame that
  reports high watermarks to it (``before_ordered``), so every worker sees a partition in its
  leader's order and learns that an offset was its own publish before its view passes it (a
  retained publish, answered only once journaled, is forwarded as usual instead). A leader
  that is not linked (it crashed and is being restarted) refuses at once: its partitions are
  offline, the others go on. So nothing is delivered before it is durable, and a PUBACK means
  durable whichever worker the publisher is on. APPENDs travel in the mesh's data lane: a
  leader that does not keep up makes its link congested, and the publisher waits
  (``on_congested``).
* **Unknown outcomes.** An append that went out and got no answer (the link dropped, or
  ``APPEND_TIMEOUT`` passed) may have been stored and routed by the leader: its outcome is
  ``Unknown``, never ``Refused`` (the broker closes the publisher's connection instead of
  saying no, broker/publishes.py). Each append carries a message id drawn here (the record's
  id); the leader remembers the ids of the last ``RECOGNISED_MAX`` publishes peers had it
  store, and a resend with one of them (the session kept the id, broker/session.py) is
  answered with where the first was stored instead of being stored again (a restarted
  leader reads the ids of its partitions' last records back from the log). A resend whose
  leader is not linked is unknown again, not refused: its first attempt may be stored. An
  answer that
  comes after its deadline (a slow or stopped leader, the link still up) still brings the
  message to this worker's subscribers (the leader left them to us), and the resend's answer
  then delivers nothing more here. Only an append that never left this worker is refused for
  a missing link. Answers belong to the link
  their request came on: one computed after that link dropped is dropped with it, never
  sent on a later link, where the peer's request ids mean other publishes.
* **Serving appends** (``APPEND`` from a peer): the same local append (a frame's publishes
  go to the writer's queue in one call), then the broker's
  ``route_stored`` routes it and stores it as retained if flagged; the answer carries where it
  was stored and to how many receivers it went.
* **Reading.** Partitions led here are read from the open log; the others from their files
  (``LogView``: no lock, whole checksummed batches only), never beyond this worker's *view* of
  their high watermark; with partitions led across nodes, those another node leads from that
  node (``remote``, cluster/remotelog.py).
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
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from meshmq.broker.interfaces import (
    AppendOutcome,
    Completion,
    Refused,
    Stored,
    StoredElsewhere,
    Unknown,
)
from meshmq.broker.persistence import LogAccess, Persistence
from meshmq.cluster.codec import (
    Append,
    AppendAnswer,
    Appended,
    AppendEntry,
    FrameType,
    GroupKey,
    Hello,
    Highs,
    Sync,
    Synced,
    new_named,
)
from meshmq.completions import after_both
from meshmq.log.record import new_message_id
from meshmq.log.view import LogView
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    import asyncio

    from meshmq.broker.message import Message
    from meshmq.cluster.leaders import Leadership
    from meshmq.cluster.mesh import Mesh
    from meshmq.cluster.remotelog import RemoteLog
    from meshmq.cluster.timers import Timer
    from meshmq.config import LogSettings
    from meshmq.log.record import Record

log = logging.getLogger("meshmq.partitions")

RouteStored = Callable[["Message", Stored, Callable[[int], None]], None]
Decode = Callable[[bytes, float], "Message"]
Encode = Callable[["Message"], bytes]
Elsewhere = Callable[[int, "Message", str, Completion, "bytes | None"], bool]


class _Pending(NamedTuple):
    """An append waiting for its leader's answer."""

    leader: int
    partition: int
    done: Completion
    message_id: bytes


class _Stored(NamedTuple):
    """A publish a peer asked this leader to store, remembered by its message id: where it
    is, to how many receivers it went, and the peer it was left to deliver to its own
    subscribers (``local_for``; -1: none)."""

    partition: int
    offset: int
    receivers: int
    left_to: int


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
        # in a cluster whose partitions are led across nodes: takes a publish whose partition
        # another node leads (True), or leaves it to this node (cluster/nodeappends.py)
        self.elsewhere: Elsewhere | None = None
        # partitions other nodes lead, read from them (cluster/remotelog.py; the metadata on)
        self.remote: RemoteLog | None = None
        self.counters = {"appends_forwarded": 0, "appends_served": 0, "appends_refused": 0,
                         "appends_unknown": 0, "appends_recognised": 0,
                         "answers_dropped": 0, "answers_late": 0}
        self._next_request = 1
        self._pending: dict[int, _Pending] = {}  # appends waiting for their leader's answer
        self._outbox: dict[int, list[AppendEntry]] = {}  # this turn's appends, per leader
        # (deadline, last request id) per turn's APPEND frames, in the order they went, and
        # the one mesh timer for the oldest that still waits for an answer
        self._deadlines: deque[tuple[float, int]] = deque()
        self._deadline_timer: Timer | None = None
        self._answers: dict[int, list[AppendAnswer]] = {}  # this turn's answers, per peer
        self._stored: dict[bytes, _Stored] = {}  # by message id, oldest first
        # appends whose answer did not come in time, should it come late (by request id)
        self._late: OrderedDict[int, _Pending] = OrderedDict()
        self._delivered_late: OrderedDict[bytes, None] = OrderedDict()  # their message ids
        self._recall_stored()
        mesh.handle(FrameType.APPEND, self._on_append)
        mesh.handle(FrameType.APPENDED, self._on_appended)
        mesh.before_send += [self._send_appends, self._send_answers]
        mesh.before_ordered = self._answers_first
        mesh.on_link_down.append(self._link_down)
        mesh.handle(FrameType.SYNC, self._on_sync)
        mesh.on_link_up.append(self._on_link_up)
        mesh.on_highs = lambda peer, highs: self.synced(highs)

    # ------------------------------------------------------------------ the core's interface

    def append(self, message: Message, client_id: str, done: Completion,
               message_id: bytes | None = None) -> bool:
        partition = self.partition_for(message.topic)
        elsewhere = self.elsewhere
        if elsewhere is not None and elsewhere(partition, message, client_id, done, message_id):
            return True
        leader = self._leaders[partition]
        if leader == self._me:
            if message_id is not None:
                stored = self._stored.get(message_id)
                if stored is not None:  # a resend of one a peer stored here: never twice
                    self.counters["appends_recognised"] += 1
                    self.loop.call_soon(done, StoredElsewhere(
                        stored.partition, stored.offset, stored.receivers, None))
                    return True
            return self.local.append(message, client_id, done, message_id)
        mesh = self.mesh
        link = mesh.peers.get(leader)
        if link is None:
            why = f"partition {partition} is offline: its leader, worker {leader}, is down"
            if message_id is not None:  # a resend of one its leader may have stored: unknown
                self.counters["appends_unknown"] += 1
                self.loop.call_soon(done, Unknown(why, message_id))
                return True
            self.counters["appends_refused"] += 1
            self.loop.call_soon(done, Refused(ReasonCode.UNSPECIFIED_ERROR, why))
            return True
        resend = message_id is not None
        if message_id is None:
            message_id = new_message_id(int(time.time() * 1000))
        request_id = self._next_request
        self._next_request += 1
        self._pending[request_id] = new_named(_Pending, (leader, partition, done, message_id))
        outbox = self._outbox.get(leader)
        if outbox is None:
            outbox = self._outbox[leader] = []
        outbox.append(new_named(AppendEntry, (request_id, client_id, message_id, resend,
                                              self.encode(message))))
        mesh.wake()
        self.counters["appends_forwarded"] += 1
        if link.congested and mesh.on_congested is not None:
            mesh.on_congested(leader)  # the publisher waits until the leader's link drains
        return True

    def _send_appends(self) -> None:
        """Before the mesh writes: one APPEND frame per leader with this turn's publishes,
        and one deadline for all of them."""
        if not self._outbox:
            return
        outbox, self._outbox = self._outbox, {}
        for leader, entries in outbox.items():
            if not self.mesh.send(leader, Append(entries).encode()):
                for entry in entries:  # never sent: this attempt is not stored
                    if entry.resend:  # (its first may be)
                        self._unknown(entry.request_id, "its leader went down")
                    else:
                        self._fail(entry.request_id, "its leader went down")
        self._deadlines.append((self.mesh.io.now() + APPEND_TIMEOUT, self._next_request - 1))
        if self._deadline_timer is None:
            self._arm_deadline()

    def _arm_deadline(self) -> None:
        """Drop the deadlines of turns whose appends were all answered; set the timer for
        the oldest turn still waiting (one timer, not one per turn)."""
        deadlines, pending = self._deadlines, self._pending
        oldest = next(iter(pending)) if pending else self._next_request
        while deadlines and deadlines[0][1] < oldest:
            deadlines.popleft()
        self._deadline_timer = None if not deadlines else self.mesh.call_at(
            deadlines[0][0], self._expire_appends)

    def _expire_appends(self) -> None:
        timer = self._deadline_timer
        now = max(self.mesh.io.now(), timer.when if timer is not None else 0.0)
        deadlines = self._deadlines
        while deadlines and deadlines[0][0] <= now:
            self._overdue(deadlines.popleft()[1])
        self._arm_deadline()

    def _on_appended(self, peer: int, frame: Appended) -> None:
        waiting = self._pending
        for request_id, status, partition, offset, receivers, local in frame.answers:
            pending = waiting.pop(request_id, None)
            if pending is None:
                self._late_answer(peer, request_id, status, partition, offset, local)
                continue
            if pending.leader != peer:
                continue
            if local is not None and self._delivered_late and (
                    pending.message_id in self._delivered_late):
                local = None  # a resend of one delivered here when its late answer came,
                receivers = max(receivers, 1)  # to the subscribers it matched here
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

    def _unknown(self, request_id: int, why: str, late: bool = False) -> None:
        """The outcome is not known; ``late``: its answer may still come on this link."""
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self.counters["appends_unknown"] += 1
            if late:
                self._late[request_id] = pending
                if len(self._late) > RECOGNISED_MAX:
                    self._late.popitem(last=False)
            pending.done(Unknown(f"partition {pending.partition}: {why}", pending.message_id))

    def _late_answer(self, peer: int, request_id: int, status: int, partition: int,
                     offset: int, local: list[GroupKey] | None) -> None:
        """An answer after its append's outcome was given as unknown (the leader was slow or
        stopped): stored after all, and routed everywhere but here, so the subscribers here
        get it now (the publisher was not acknowledged: it resends, and that resend is then
        not delivered here again)."""
        pending = self._late.pop(request_id, None)
        if pending is None or pending.leader != peer or status:
            return
        self.counters["answers_late"] += 1
        self.routed(partition, offset)
        delivered = self._delivered_late
        delivered[pending.message_id] = None
        if len(delivered) > RECOGNISED_MAX:
            delivered.popitem(last=False)
        pending.done(StoredElsewhere(partition, offset, 0, local))

    def _link_down(self, peer: int) -> None:
        """The link to ``peer`` is gone: the appends it was asked for may or may not be
        stored (unknown); those still in this turn's outbox were never sent (refused, unless
        a resend: its first attempt may be stored); the answers queued for it belong to that
        link (dropped)."""
        unsent = {entry.request_id: entry.resend for entry in self._outbox.pop(peer, [])}
        for request_id in [r for r, p in self._pending.items() if p.leader == peer]:
            if request_id in unsent and not unsent[request_id]:
                self._fail(request_id, f"its leader, worker {peer}, went down")
            else:
                self._unknown(request_id, f"the link to its leader, worker {peer}, dropped "
                                          "before the answer came")
        for request_id in [r for r, p in self._late.items() if p.leader == peer]:
            del self._late[request_id]  # no answer comes on a later link
        dropped = self._answers.pop(peer, None)
        if dropped:
            self.counters["answers_dropped"] += len(dropped)

    def _overdue(self, last: int) -> None:
        """The appends sent ``APPEND_TIMEOUT`` ago (ids up to ``last``) that are still
        unanswered: unknown (``_pending`` is in request id order: the oldest come first)."""
        overdue = []
        for request_id in self._pending:
            if request_id > last:
                break
            overdue.append(request_id)
        for request_id in overdue:
            self._unknown(request_id, f"no answer from its leader within {APPEND_TIMEOUT:.0f} s",
                          late=True)

    def _led_elsewhere(self, partition: int) -> RemoteLog | None:
        """The reader of ``partition`` when another node leads it (the metadata on)."""
        remote = self.remote
        return remote if remote is not None and remote.elsewhere(partition) else None

    def _read_remotely(self, partition: int) -> RemoteLog | None:
        """The reader of ``partition`` unless this node is known to lead it (the metadata
        on): a partition not placed yet (a worker that just started has not reached the
        metadata) may be led elsewhere, so this node's log is no answer for it; its reads
        bring nothing until it is placed (which wakes the catch-ups)."""
        remote = self.remote
        return remote if remote is not None and not remote.here(partition) else None

    def read(self, partition: int, offset: int, max_records: int) -> list[Record]:
        remote = self._read_remotely(partition)
        if remote is not None:
            return remote.read(partition, offset, max_records)
        if self.leadership.leads(partition):
            return self.local.read(partition, offset, max_records)
        return self.view.read(partition, offset, max_records=max_records)

    def routes_all(self, partition: int) -> bool:
        """(Partitions led across nodes: only once the metadata says this node leads it; a
        worker that starts does not know that yet.)"""
        remote = self.remote
        return self.leadership.leads(partition) and (remote is None or remote.here(partition))

    def earliest_offset(self, partition: int) -> int:
        remote = self._read_remotely(partition)
        if remote is not None:
            return remote.earliest[partition]
        if self.leadership.leads(partition):
            return self.local.earliest_offset(partition)
        return self.view.earliest_offset(partition)

    def offset_for_timestamp(self, partition: int, timestamp_ms: int) -> int | None:
        remote = self._read_remotely(partition)
        if remote is not None:
            return remote.offset_for_timestamp(partition, timestamp_ms)
        if self.leadership.leads(partition):
            return self.local.offset_for_timestamp(partition, timestamp_ms)
        return self.view.offset_for_timestamp(partition, timestamp_ms)

    def views_known(self) -> bool:
        return self.remote is None or self.remote.views_known()

    def sync(self, done: Callable[[], None], timestamp_ms: int | None = None) -> None:
        """Bring the view up to the leaders' high watermarks, this node's workers' and
        (partitions led across nodes) the other nodes', as of after our route changes; then
        ``done()``."""
        remote = self.remote
        if remote is None:
            return self.sync_workers(done)
        after_both(done, self.sync_workers, partial(remote.sync, timestamp_ms=timestamp_ms))()

    def sync_workers(self, done: Callable[[], None]) -> None:
        """Ask every partition leader of this node for its high watermarks (as of after our
        route changes); then ``done()``. A leader that does not answer is passed over."""
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
            if partition < len(view) and not leads(partition) and high > view[partition] \
                    and self._led_elsewhere(partition) is None:
                view[partition] = high

    def leader_highs(self) -> Highs:
        """The high watermarks of the partitions this worker leads (for HELLO, barriers);
        not those another node leads (its view of them is not a leader's)."""
        return {p: self.high_watermark[p] for p in self.leadership.mine
                if self._led_elsewhere(p) is None}

    def _on_link_up(self, peer: int, hello: Hello) -> None:
        self.synced(hello.highs)

    def _on_sync(self, peer: int, frame: Sync) -> None:
        self.mesh.send(peer, Synced(frame.request_id, self.leader_highs()).encode())

    # ------------------------------------------------------------------ serving peers

    def _on_append(self, peer: int, frame: Append) -> None:
        """Persist a peer's publishes (queued to the writer together), route each once durable,
        answer each (in this turn's batch, on the link the request came on)."""
        now = self.loop.time()
        link = self.mesh.incarnation(peer)
        assert link is not None  # a frame came on it
        partition_for, leaders, me, decode = (
            self.partition_for, self._leaders, self._me, self.decode)
        accepted: list[tuple[Message, str, Completion, bytes | None]] = []
        request_ids: list[int] = []
        stored = self._stored
        for request_id, client_id, message_id, resend, body in frame.entries:
            known = stored.get(message_id) if resend else None
            if known is not None:  # a resend after an answer that never arrived
                self.counters["appends_recognised"] += 1
                self._answer(peer, link, AppendAnswer(
                    request_id, 0, known.partition, known.offset, known.receivers,
                    [] if known.left_to == peer else None))
                continue
            message = decode(body, now)
            if leaders[partition_for(message.topic)] != me:
                self._answer(peer, link, AppendAnswer(request_id, ReasonCode.UNSPECIFIED_ERROR))
                continue  # the leaders changed under the sender
            accepted.append((message, client_id,
                             self._durable(peer, link, request_id, message_id, message),
                             message_id))
            request_ids.append(request_id)
        queued = self.local.append_many(accepted) if accepted else 0
        for request_id in request_ids[queued:]:  # the writer's queue is full
            self._answer(peer, link, AppendAnswer(request_id, ReasonCode.QUOTA_EXCEEDED))

    def _answer(self, peer: int, link: int, answer: AppendAnswer) -> None:
        """Queue ``answer`` for this turn's APPENDED to ``peer``, if the link its request came
        on is still the peer's (an answer never goes to a later incarnation)."""
        if self.mesh.incarnation(peer) != link:
            self.counters["answers_dropped"] += 1
            return
        answers = self._answers.get(peer)
        if answers is None:
            answers = self._answers[peer] = []
        answers.append(answer)
        self.mesh.wake()

    def _recall_stored(self) -> None:
        """At start: the message ids of the last records of the partitions led here, so that
        a resend whose first attempt this leader stored before it restarted is recognised
        too (who delivered it where is not known any more: the resend delivers nowhere)."""
        local = self.local
        owned = local.owned
        if not owned:
            return
        each = RECOGNISED_MAX // len(owned)
        for partition in owned:
            offset = max(local.earliest_offset(partition),
                         self.high_watermark[partition] - each)  # (the log's end, at start)
            while True:
                records = local.read(partition, offset, 4096)
                if not records:
                    break
                for record in records:
                    self._remember(record.message_id, partition, record.offset, 1, -1)
                offset = records[-1].offset + 1

    def remember(self, message_id: bytes, partition: int, offset: int, receivers: int) -> None:
        """Another node's publish is stored and routed here: its resend is answered from here
        (cluster/nodeappends.py)."""
        self._remember(message_id, partition, offset, receivers, -1)

    def _remember(self, message_id: bytes, partition: int, offset: int, receivers: int,
                  peer: int) -> None:
        """A peer's publish is stored and routed: its resend is answered from here."""
        stored = self._stored
        stored[message_id] = new_named(_Stored, (partition, offset, receivers, peer))
        if len(stored) > RECOGNISED_MAX:
            del stored[next(iter(stored))]

    def _durable(self, peer: int, link: int, request_id: int, message_id: bytes,
                 message: Message) -> Completion:
        """What to do once a peer's publish is durable: remember it, route it, answer."""
        def durable(outcome: AppendOutcome) -> None:
            if not isinstance(outcome, Stored) or self.route_stored is None:
                code = outcome.reason_code if isinstance(outcome, Refused) else (
                    ReasonCode.UNSPECIFIED_ERROR)
                log.error("append for worker %d failed topic=%r: %s", peer, message.topic,
                          getattr(outcome, "why", "no broker"))
                return self._answer(peer, link, AppendAnswer(request_id, code))
            self.counters["appends_served"] += 1
            partition, offset = outcome.partition, outcome.offset
            if message.retain:  # answered once journaled: forwarded as usual meanwhile
                def journaled(receivers: int) -> None:
                    self._remember(message_id, partition, offset, receivers, -1)
                    self._answer(peer, link, AppendAnswer(request_id, 0, partition, offset,
                                                          receivers))

                self.route_stored(message, outcome, journaled)
                return
            mesh = self.mesh

            def routed(receivers: int) -> None:
                self._remember(message_id, partition, offset, receivers, peer)
                self._answer(peer, link, AppendAnswer(request_id, 0, partition, offset,
                                                      receivers, mesh.local_groups))

            mesh.local_for, mesh.local_groups = peer, None  # it delivers this one itself
            try:
                self.route_stored(message, outcome, routed)
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
        """A FORWARD, or a frame that reports high watermarks, is about to go to ``peer``:
        the answers to its appends routed before it go first, so that the peer delivers its
        own publishes at their place in the partition's order (the leader's), as it would
        have delivered them forwarded, and learns that an offset was its own publish before
        any high watermark passes it."""
        batch = self._answers.pop(peer, None)
        if batch:
            self.mesh.send(peer, Appended(batch).encode())

    def statistics(self) -> dict[str, Any]:
        return {"leads": list(self.leadership.mine), **self.counters}


APPEND_TIMEOUT = 10.0  # seconds a leader may take to make an append durable (a slow disk)
RECOGNISED_MAX = 65536  # message ids of stored appends a leader remembers, to spot resends
