"""Partitions led across nodes: a publish is appended by its partition's leader node.

Theory of operation
-------------------
With the metadata store on (``cluster.metadata``), the controller assigns every partition of
the commit log to one node (cluster/controller.py): ``partitions/<p>`` names its leader node
and a *leader epoch* that grows each time the assignment changes. Each worker follows the
metadata through its client's mirror (``Placements``: partition -> (leader node, epoch)).
Inside the leader node the partition is led by worker ``p mod N`` as on a single node
(cluster/partitions.py); this module adds the step between nodes.

* **Appending.** A persisted publish on a partition led by *another* node goes to that node
  (``NODE_APPEND`` over this worker's dialed link, the publishes of one loop turn for one node
  in one frame), stamped with the leader epoch the sender knows. The worker that receives it
  checks the stamp against its own mirror: if its node leads the partition at exactly that
  epoch, it appends the publish (to its own log, or through its node's leader worker of the
  partition) and routes it once durable, as a publish made there: to its node's subscribers
  and to every other node with a match, the sender's included (``FORWARD``, in the leader's
  order). Its answer (``NODE_APPENDED``, on the link the request came on) carries the offset,
  and only then is the publisher acknowledged: a PUBACK means durable at the leader.
* **Not leader.** A receiver whose mirror does not say that (the sender's view, or its own,
  is behind) stores nothing and answers ``NOT_LEADER`` with a hint: the leader and epoch it
  knows. The sender goes to the hinted node if its epoch is newer than the one it tried;
  otherwise it asks again shortly (its own mirror, or the receiver's, catches up), until the
  append's deadline, then refuses the publish (not stored, so a refusal is the truth). A
  node's epoch check makes every append name the leadership it was meant for, so a leader
  that has been replaced takes none that were meant for its successor.
* **Offline.** A partition whose leader node is not linked to this worker (down, cut off,
  leaving) is offline: its publishes are refused at once with reason code 0x80 and a reason
  string naming the partition and node ("unspecified error": MQTT 5.0 has no code for it;
  3.1.1 publishers are disconnected), and ``meshmq cluster status`` lists it offline. Other
  partitions go on.
* **The first record.** A partition the controller assigned and nobody wrote to may still
  move to another node (a node joined: cluster/controller.py). So before a leader node
  appends a partition's first record, it marks the assignment written in the metadata
  (``mark``: a compare-and-set on the record, which a move made meanwhile defeats); the
  publishes that arrive meanwhile wait, then go to this node's log, or to the node the
  partition moved to. Once per partition and leader epoch, a few milliseconds. Without a
  majority of the metadata's voters the mark cannot be made: the publishes wait, the mark is
  asked again, and they are refused at their deadline (``APPEND_TIMEOUT``), stored nowhere.
* **No leader yet.** Before the metadata is reached and a partition assigned (a cluster
  starting), a publish waits: the worker looks at its mirror again every ``RETRY_AFTER``
  and sends it once a leader is named, or refuses it (0x80, "has no leader") at the
  append's deadline.
* **Held, then unknown.** An append sent whose link then dropped (the leader node died or
  was cut off) may be stored there: it is neither refused nor answered, but *held* until the
  node links again, then sent again marked as a resend (the leader node's worker that stored
  the first attempt recognises its message id and answers with its place instead of storing
  it twice). So the publisher just waits for that PUBACK while the node is away; its other
  publishes go on (refused if for the node's partitions). After ``HOLD_FOR_LEADER`` without
  the node, or when an answer does not come within ``APPEND_TIMEOUT`` on a live link, the
  outcome is ``Unknown``, as between workers (cluster/partitions.py): the publisher's
  connection is closed, its session keeps the message id, and the client's resend carries
  it (and is held the same way while the node is down).
* **Who delivers.** The leader node routes every message of its partitions, so subscribers on
  every node get them in partition order. The publisher's own node gets its copy back from the
  leader like any other node: it does not deliver the publish itself. Each copy carries its
  place in the partition, the same on every node (cluster/remotelog.py: a session's cursor
  reads the partitions other nodes lead from them).
* ``$`` topics (``$SYS``, ``$service/``) stay on the node they were published on.

With the metadata off, nothing here runs: each node keeps its own log of every partition.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from meshmq.broker.interfaces import (
    AppendOutcome,
    Completion,
    Refused,
    Stored,
    StoredElsewhere,
    Unknown,
)
from meshmq.cluster.codec import (
    NOT_LEADER,
    OUTCOME_UNKNOWN,
    FrameType,
    NodeAppend,
    NodeAppendAnswer,
    NodeAppended,
    NodeAppendEntry,
)
from meshmq.cluster.metadata import MetadataError
from meshmq.cluster.metarecords import assignment_of
from meshmq.cluster.partitions import APPEND_TIMEOUT
from meshmq.log.record import new_message_id
from meshmq.mqtt.reason_codes import ReasonCode

if TYPE_CHECKING:
    from meshmq.broker.message import Message
    from meshmq.cluster.metadata import View
    from meshmq.cluster.nodes import NodeLinks
    from meshmq.cluster.partitions import PartitionedLog
    from meshmq.cluster.timers import Timer

log = logging.getLogger("meshmq.partitions")

AppendFor = Callable[["Message", str, "bytes | None", Callable[[AppendOutcome, int], None]], bool]
Decode = Callable[[bytes, float], "Message"]
Encode = Callable[["Message"], bytes]

RETRY_AFTER = 0.2  # seconds before asking again after a "not leader" without a newer hint
HOLD_FOR_LEADER = 30.0  # seconds an append that may be stored waits for its leader node
CHECK_EVERY = 1.0  # seconds between looks for appends past their deadline


class Placements:
    """Each partition's leader node and leader epoch, as this worker's metadata mirror says
    (None: not assigned, or the metadata not reached yet)."""

    def __init__(self, partitions: int) -> None:
        self.leaders: list[tuple[str, int] | None] = [None] * partitions
        self.written = [True] * partitions  # marked written (metarecords.py mark_written)
        self.version = -1
        self.on_change: list[Callable[[list[int]], None]] = []  # partitions placed anew

    def update(self, view: View | None) -> None:
        if view is None or view.version <= self.version:
            return
        leaders: list[tuple[str, int] | None] = []
        written: list[bool] = []
        for partition in range(len(self.leaders)):
            try:
                assignment = assignment_of(view, partition)
            except MetadataError as error:  # a record this version cannot read: unassigned
                log.error("partition %d: %s", partition, error)
                assignment = None
            leaders.append(None if assignment is None
                           else (assignment.leader, assignment.leader_epoch))
            written.append(assignment is None or assignment.written)
        self.written = written
        changed = [p for p, (old, new) in enumerate(zip(self.leaders, leaders, strict=True))
                   if old != new]
        self.leaders, self.version = leaders, view.version
        if changed:
            log.info("partition leaders changed partitions=%s leaders=%s", changed,
                     [leaders[p] for p in changed])
            for listener in self.on_change:
                listener(changed)

    def of(self, partition: int) -> tuple[str, int] | None:
        return self.leaders[partition] if partition < len(self.leaders) else None

    def note_written(self, partition: int, placed: tuple[str, int]) -> None:
        """This node marked ``partition`` written under ``placed`` (before the mirror says so)."""
        if self.of(partition) == placed:
            self.written[partition] = True


Mark = Callable[[int, int, Callable[["bool | None"], None]], None]
"""``mark(partition, leader_epoch, done)``: mark the partition written in the metadata as its
leader at that epoch; ``done(True)`` once it is (by this call or another), ``done(None)`` if
the partition is no longer this node's at that epoch, ``done(False)`` if it could not be
decided now (ask again)."""


@dataclass(slots=True)
class _Pending:
    """An append sent (or about to be) to a partition's leader node."""

    partition: int
    node: str
    epoch: int
    peer: int  # the node's peer id on this worker (-1: not sent yet)
    message: Message
    client_id: str
    message_id: bytes
    resend: bool
    done: Completion
    deadline: float


@dataclass(slots=True)
class _Unmarked:
    """A publish for a partition this node leads but has not marked written yet."""

    message: Message
    client_id: str
    done: Completion
    message_id: bytes | None
    deadline: float


class NodeAppends:
    """One worker's appends to other nodes, and its answers to theirs (module docstring)."""

    def __init__(self, partitions: PartitionedLog, links: NodeLinks, placements: Placements,
                 append_for: AppendFor, encode: Encode, decode: Decode,
                 call_soon: Callable[..., object], mark: Mark | None = None) -> None:
        self.log = partitions
        self.mark = mark
        self._unmarked: dict[int, list[_Unmarked]] = {}  # by partition: waiting for the mark
        self._marking: set[int] = set()
        self.call_soon = call_soon
        self.links = links
        self.mesh = mesh = links.mesh
        self.node_id = links.identity.node_id
        self.placements = placements
        self.append_for = append_for
        self.encode = encode
        self.decode = decode
        self.counters = {"node_appends_sent": 0, "node_appends_served": 0,
                         "node_appends_refused": 0, "node_appends_unknown": 0,
                         "node_appends_redirected": 0, "node_appends_not_leader": 0,
                         "node_appends_held": 0}
        self._next_request = 1
        self._pending: dict[int, _Pending] = {}
        self._outbox: dict[int, list[NodeAppendEntry]] = {}  # this turn's, per node peer
        self._answers: dict[int, tuple[int, list[NodeAppendAnswer]]] = {}  # per peer, link
        self._retry: list[_Pending] = []
        self._held: dict[str, list[_Pending]] = {}  # by leader node, while it is not linked
        self._retry_timer: Timer | None = None
        self._check_timer: Timer | None = None
        partitions.elsewhere = self.append
        links.handlers[FrameType.NODE_APPEND] = self._on_append
        links.answers[FrameType.NODE_APPENDED] = self._on_appended
        links.on_node_down.append(self._node_down)
        links.on_node_up.append(self._node_up)
        mesh.before_send.append(self._flush)

    # ------------------------------------------------------------------ sending

    def append(self, partition: int, message: Message, client_id: str, done: Completion,
               message_id: bytes | None) -> bool:
        """``PartitionedLog.elsewhere``: take the publish if another node leads its partition
        (or none does yet); False leaves it to this node's log."""
        if message.topic.startswith("$"):
            return False  # $SYS and services stay on their node
        placed = self.placements.of(partition)
        if placed is not None and placed[0] == self.node_id:
            if self.mark is None or self.placements.written[partition]:
                return False  # this node's log takes it
            self._unmarked.setdefault(partition, []).append(_Unmarked(
                message, client_id, done, message_id, self.mesh.io.now() + APPEND_TIMEOUT))
            self._mark(partition, placed)
            self._arm_check()
            return True
        resend = message_id is not None
        if message_id is None:
            message_id = new_message_id(int(time.time() * 1000))
        pending = _Pending(partition, "", 0, -1, message, client_id, message_id, resend, done,
                           self.mesh.io.now() + APPEND_TIMEOUT)
        if placed is None:
            self._wait_for_leader(pending)
            return True
        pending.node, pending.epoch = placed
        self._send(pending)
        return True

    def _mark(self, partition: int, placed: tuple[str, int]) -> None:
        """Before this node's first append to ``partition``: mark it written in the metadata
        (so the controller no longer moves it), the publishes waiting meanwhile."""
        if partition in self._marking or self.mark is None:
            return
        self._marking.add(partition)
        self.mark(partition, placed[1], partial(self._marked, partition, placed))

    def _marked(self, partition: int, placed: tuple[str, int], result: bool | None) -> None:
        self._marking.discard(partition)
        if result:
            self.placements.note_written(partition, placed)
            self._release(partition)
        else:  # moved away (the mirror follows), or undecided: look again shortly
            self.mesh.call_at(self.mesh.io.now() + RETRY_AFTER,
                              partial(self._release, partition))

    def _release(self, partition: int) -> None:
        """The publishes that waited for the mark go on: to this node's log, to the node the
        partition moved to, or back to waiting (refused at their deadline)."""
        waiting = self._unmarked.pop(partition, [])
        now = self.mesh.io.now()
        placed = self.placements.of(partition)
        still = placed is not None and placed[0] == self.node_id and not (
            self.placements.written[partition])
        for item in waiting:
            if still and now < item.deadline:  # waits on, its deadline kept
                self._unmarked.setdefault(partition, []).append(item)
            elif now >= item.deadline:
                self._unmarked_refused(partition, item)
            elif not self.log.append(item.message, item.client_id, item.done,
                                     item.message_id):
                item.done(Refused(ReasonCode.QUOTA_EXCEEDED, "the commit log's queue is full"))
        if partition in self._unmarked and placed is not None:
            self._mark(partition, placed)

    def _wait_for_leader(self, pending: _Pending) -> None:
        """No leader known for the partition (a cluster starting: the metadata not reached
        yet, or the partition not assigned yet): ask again shortly, until the deadline."""
        if self.mesh.io.now() >= pending.deadline:
            self._refuse(pending, f"partition {pending.partition} has no leader (the cluster's "
                                  "metadata did not assign it, or was not reached, within "
                                  f"{APPEND_TIMEOUT:.0f} s)")
            return
        self._retry_later(pending)

    def _send(self, pending: _Pending) -> None:
        link = self.links.dialed(pending.node)
        if link is None:
            why = (f"partition {pending.partition} is offline: its leader, node "
                   f"{pending.node}, is not linked")
            if pending.resend:  # its first attempt may be stored there: wait for the node
                return self._hold(pending)
            return self._refuse(pending, why)
        peer = link.peer
        assert peer is not None  # (dialed: up)
        pending.peer = peer
        request_id = self._next_request
        self._next_request += 1
        self._pending[request_id] = pending
        outbox = self._outbox.get(peer)
        if outbox is None:
            outbox = self._outbox[peer] = []
        outbox.append(NodeAppendEntry(request_id, pending.partition, pending.epoch,
                                      pending.client_id, pending.message_id, pending.resend,
                                      self.encode(pending.message)))
        self.counters["node_appends_sent"] += 1
        mesh = self.mesh
        mesh.wake()
        self._arm_check()
        if link.congested and mesh.on_congested is not None:
            mesh.on_congested(peer)  # the publisher waits until the leader's link drains

    def _flush(self) -> None:
        """Before the mesh writes: one NODE_APPEND per node with this turn's publishes, and
        this turn's answers to other nodes."""
        if self._outbox:
            outbox, self._outbox = self._outbox, {}
            for peer, entries in outbox.items():
                if not self.mesh.send(peer, NodeAppend(entries).encode()):
                    for entry in entries:
                        pending = self._pending.pop(entry.request_id, None)
                        if pending is not None:
                            self._never_left(pending, pending.node)
        if self._answers:
            answers, self._answers = self._answers, {}
            for peer, (link, batch) in answers.items():
                self.mesh.send(peer, NodeAppended(batch).encode(), link)

    def _on_appended(self, peer: int, frame: NodeAppended) -> None:
        waiting = self._pending
        for request_id, status, offset, receivers, hint_node, hint_epoch in frame.answers:
            pending = waiting.get(request_id)
            if pending is None or pending.peer != peer:
                continue  # answered already (its deadline passed), or not this link's
            del waiting[request_id]
            if status == 0:
                pending.done(StoredElsewhere(pending.partition, offset, receivers, None))
            elif status == NOT_LEADER:
                self._not_leader(pending, hint_node, hint_epoch)
            elif status == OUTCOME_UNKNOWN:
                self._unknown(pending, f"partition {pending.partition}: node {pending.node} "
                                       "lost the answer of its leader worker")
            else:
                self.counters["node_appends_refused"] += 1
                pending.done(Refused(status, f"partition {pending.partition}: refused by its "
                                             f"leader, node {pending.node} (0x{status:02X})"))

    def _not_leader(self, pending: _Pending, hint_node: str, hint_epoch: int) -> None:
        """Not stored: go to a newer leader if the hint or our mirror names one, or ask
        again shortly (someone's mirror is behind), within the append's deadline."""
        self.counters["node_appends_not_leader"] += 1
        placed = self.placements.of(pending.partition)
        newer = [(epoch, node) for node, epoch in ((hint_node, hint_epoch), placed or ("", 0))
                 if node and epoch > pending.epoch]
        if newer:
            pending.epoch, pending.node = max(newer)
            self.counters["node_appends_redirected"] += 1
            return self._go(pending)
        if self.mesh.io.now() >= pending.deadline:
            self._refuse(pending, f"partition {pending.partition}: node {pending.node} does "
                                  f"not lead it at epoch {pending.epoch} (it knows "
                                  f"{hint_node or 'no leader'}, epoch {hint_epoch})")
            return
        self._retry_later(pending)

    def _retry_later(self, pending: _Pending) -> None:
        self._retry.append(pending)
        if self._retry_timer is None:
            self._retry_timer = self.mesh.call_at(self.mesh.io.now() + RETRY_AFTER,
                                                  self._retry_now)

    def _retry_now(self) -> None:
        self._retry_timer = None
        retry, self._retry = self._retry, []
        for pending in retry:
            self._again(pending)

    def _again(self, pending: _Pending) -> None:
        """Send ``pending`` again, to the leader the mirror names now if it is as new as the
        one tried."""
        placed = self.placements.of(pending.partition)
        if placed is None and not pending.node:
            return self._wait_for_leader(pending)
        if placed is not None and placed[1] >= pending.epoch:
            pending.node, pending.epoch = placed
        self._go(pending)

    def _go(self, pending: _Pending) -> None:
        if pending.node != self.node_id:
            return self._send(pending)
        # the partition is led by this node now: its log takes the publish
        self.log.append(pending.message, pending.client_id, pending.done,
                        pending.message_id if pending.resend else None)

    def _check(self) -> None:
        """Appends whose answer did not come within ``APPEND_TIMEOUT``, and appends held
        ``HOLD_FOR_LEADER`` for a node that did not come back: unknown."""
        now = self.mesh.io.now()
        self._check_timer = None
        overdue = [r for r, p in self._pending.items() if p.deadline <= now]
        for request_id in overdue:
            pending = self._pending.pop(request_id)
            self._unknown(pending, f"partition {pending.partition}: no answer from its leader, "
                                   f"node {pending.node}, within {APPEND_TIMEOUT:.0f} s")
        for node_id, held in list(self._held.items()):
            kept = [pending for pending in held if pending.deadline > now]
            for pending in held:
                if pending.deadline <= now:
                    self._unknown(pending, f"partition {pending.partition}: its leader, node "
                                           f"{node_id}, did not come back within "
                                           f"{HOLD_FOR_LEADER:.0f} s")
            if kept:
                self._held[node_id] = kept
            else:
                del self._held[node_id]
        for partition, waiting in list(self._unmarked.items()):
            self._unmarked[partition] = [item for item in waiting if item.deadline > now]
            for item in waiting:
                if item.deadline <= now:
                    self._unmarked_refused(partition, item)
        self._arm_check()

    def _arm_check(self) -> None:
        if self._check_timer is None and (self._pending or self._held or any(
                self._unmarked.values())):
            self._check_timer = self.mesh.call_at(self.mesh.io.now() + CHECK_EVERY,
                                                  self._check)

    def _unmarked_refused(self, partition: int, item: _Unmarked) -> None:
        self.counters["node_appends_refused"] += 1
        item.done(Refused(ReasonCode.UNSPECIFIED_ERROR, f"partition {partition}: its first "
                          "record could not be marked in the cluster's metadata (no majority "
                          f"of its voters?) within {APPEND_TIMEOUT:.0f} s"))

    def _node_down(self, peer: int, node_id: str) -> None:
        """The link to a node is gone: its appends not sent yet are refused (they never
        left); those sent may be stored there: they wait for the node (``_hold``)."""
        unsent = {entry.request_id for entry in self._outbox.pop(peer, [])}
        for request_id in [r for r, p in self._pending.items() if p.peer == peer]:
            pending = self._pending.pop(request_id)
            if request_id in unsent:
                self._never_left(pending, node_id)
            else:
                self._hold(pending)

    def _never_left(self, pending: _Pending, node_id: str) -> None:
        """An append whose frame never left (the node went down first): this attempt is not
        stored, so it is refused, unless it is a resend, whose first attempt may be: held."""
        if pending.resend:
            return self._hold(pending)
        self._refuse(pending, f"partition {pending.partition} is offline: node {node_id} "
                              "went down")

    def _hold(self, pending: _Pending) -> None:
        """An append that may be stored at a leader node that is not linked now: no answer
        yet (neither a refusal, which could be false, nor an unknown outcome, which closes
        the publisher's connection and makes it resend everything in flight); it goes again,
        as a resend, when the node links again, or is unknown after ``HOLD_FOR_LEADER``."""
        pending.peer, pending.resend = -1, True
        pending.deadline = self.mesh.io.now() + HOLD_FOR_LEADER
        self._held.setdefault(pending.node, []).append(pending)
        self.counters["node_appends_held"] += 1
        self._arm_check()

    def _node_up(self, peer: int, node_id: str) -> None:
        """The dialed link to ``node_id`` is up: what was held for it goes now."""
        for pending in self._held.pop(node_id, []):
            self._again(pending)

    def _refuse(self, pending: _Pending, why: str) -> None:
        self.counters["node_appends_refused"] += 1
        self.call_soon(pending.done, Refused(ReasonCode.UNSPECIFIED_ERROR, why))

    def _unknown(self, pending: _Pending, why: str) -> None:
        self.counters["node_appends_unknown"] += 1
        self.call_soon(pending.done, Unknown(why, pending.message_id))

    # ------------------------------------------------------------------ serving other nodes

    def _on_append(self, peer: int, frame: NodeAppend) -> None:
        """Another node's publishes for partitions it takes this node to lead."""
        link = self.mesh.remote.get(peer)
        assert link is not None  # a frame came on it
        ident = link.ident
        now = self.mesh.io.now()
        me, placements = self.node_id, self.placements
        for request_id, partition, epoch, client_id, message_id, _resend, body in frame.entries:
            placed = placements.of(partition)
            if placed != (me, epoch):
                hint_node, hint_epoch = placed or ("", 0)
                self._answer(peer, ident, NodeAppendAnswer(request_id, NOT_LEADER, 0, 0,
                                                           hint_node, hint_epoch))
                continue
            message = self.decode(body, now)
            if self.log.partition_for(message.topic) != partition:
                log.error("append from another node for partition %d, topic %r is in %d here: "
                          "log.partitions or log.key_level differs between nodes", partition,
                          message.topic, self.log.partition_for(message.topic))
                self._answer(peer, ident, NodeAppendAnswer(request_id,
                                                           ReasonCode.UNSPECIFIED_ERROR))
                continue
            done = partial(self._served, peer, ident, request_id, message_id)
            if not self.append_for(message, client_id, message_id, done):
                self._answer(peer, ident, NodeAppendAnswer(request_id,
                                                           ReasonCode.QUOTA_EXCEEDED))

    def _served(self, peer: int, link: int, request_id: int, message_id: bytes,
                outcome: AppendOutcome, receivers: int) -> None:
        if isinstance(outcome, Stored):
            self.counters["node_appends_served"] += 1
            self.log.remember(message_id, outcome.partition, outcome.offset, receivers)
            answer = NodeAppendAnswer(request_id, 0, outcome.offset, receivers)
        elif isinstance(outcome, StoredElsewhere):
            self.counters["node_appends_served"] += 1
            answer = NodeAppendAnswer(request_id, 0, outcome.offset, receivers)
        elif isinstance(outcome, Unknown):
            answer = NodeAppendAnswer(request_id, OUTCOME_UNKNOWN)
        else:
            log.warning("append for node peer %d refused: %s", peer, outcome.why)
            answer = NodeAppendAnswer(request_id, outcome.reason_code)
        self._answer(peer, link, answer)

    def _answer(self, peer: int, link: int, answer: NodeAppendAnswer) -> None:
        queued = self._answers.get(peer)
        if queued is None or queued[0] != link:
            queued = self._answers[peer] = (link, [])
        queued[1].append(answer)
        self.mesh.wake()

    def statistics(self) -> dict[str, int]:
        return dict(self.counters)
