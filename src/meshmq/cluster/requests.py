"""Requests across the mesh: ids, answers, deadlines, and asking every peer at once.

Theory of operation
-------------------
A request is a frame carrying a ``request_id`` sent to one peer over one link; its answer is a
frame carrying the same id, on the same link, after everything the peer sent before it (so an
answer is also a barrier for that peer's earlier frames). A request belongs to the *link* it
went out on, not to the peer: ids restart in every process, so an answer that comes on a later
link to the same peer (the peer restarted, or the link was replaced) is never taken for the
answer to a request of an earlier one. ``Requests`` is sans-I/O: it hands out ids, keeps the
pending ones with their link and deadline, and is told what happened:

* ``answer(link, request_id, frame)``: the answer arrived on ``link``; the request's callback
  gets the frame (an id pending on another link is not this answer's: it is ignored);
* ``link_down(link)``: every request pending on that link fails (its callback gets None);
* ``expire(now)``: requests past their deadline fail the same way (time is an argument, as in
  ``mqtt/connection.py``; the mesh calls it from a timer).

``ask_all`` sends one request to each of several peers and completes once every peer has
answered, failed, or the deadline passed, whichever is first: a stopped or stuck peer must not
hold the caller back. Every answer still reaches ``on_answer`` (with ``late=True`` after
completion), so what a late peer hands over is never silently lost.

This is the seed of the services layer: a request/reply with ids, timeouts and failover is the
same machinery between workers, nodes and service workers.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

A = TypeVar("A")  # the answer frame type

Answer = Callable[["A | None"], None]  # None: the link dropped or the deadline passed


@dataclass(slots=True)
class _Pending(Generic[A]):
    link: int  # the link incarnation the request went out on
    deadline: float
    callback: Callable[[A | None], None]


@dataclass(slots=True)
class _Group(Generic[A]):
    """One ``ask_all``: how many answers it still waits for."""

    on_answer: Callable[[int, A | None, bool], None]
    done: Callable[[list[int]], None]
    deadline: float
    waiting: set[int] = field(default_factory=set)
    finished: bool = False

    def finish(self) -> None:
        if not self.finished:
            self.finished = True
            self.done(sorted(self.waiting))


class Requests(Generic[A]):
    """Pending requests of one worker to its peers."""

    def __init__(self, late_grace: float = 30.0) -> None:
        self.late_grace = late_grace  # how long after an ask_all's deadline answers still count
        self._next = 1
        self._pending: dict[int, _Pending[A]] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, request id)
        self._groups: list[tuple[float, int, _Group[A]]] = []  # heap of unfinished ask_alls
        self._group_seq = 0

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, link: int, callback: Callable[[A | None], None], deadline: float) -> int:
        """A new request sent on ``link``; returns its id, for the frame the caller sends."""
        request_id = self._next
        self._next += 1
        self._pending[request_id] = _Pending(link, deadline, callback)
        heapq.heappush(self._deadlines, (deadline, request_id))
        return request_id

    def answer(self, link: int, request_id: int, frame: A) -> bool:
        """An answer arrived on ``link``; False if no such request is pending on it (too
        late, asked on an earlier link, or never asked: the caller ignores it)."""
        pending = self._pending.get(request_id)
        if pending is None or pending.link != link:
            return False
        del self._pending[request_id]
        pending.callback(frame)
        return True

    def link_down(self, link: int) -> None:
        """Fail every request pending on ``link``."""
        for request_id in [r for r, p in self._pending.items() if p.link == link]:
            self._fail(request_id)

    def next_deadline(self) -> float | None:
        """The earliest deadline of a pending request or an unfinished ask_all."""
        heap, groups = self._deadlines, self._groups
        while heap and (heap[0][1] not in self._pending
                        or self._pending[heap[0][1]].deadline != heap[0][0]):
            heapq.heappop(heap)
        while groups and groups[0][2].finished:
            heapq.heappop(groups)
        candidates = [heap[0][0]] if heap else []
        if groups:
            candidates.append(groups[0][0])
        return min(candidates) if candidates else None

    def expire(self, now: float) -> float | None:
        """Finish the ask_alls and fail the requests whose deadline is ``now`` or earlier;
        return the next deadline (None: nothing pending), for the caller's timer."""
        groups = self._groups
        while groups and groups[0][0] <= now:
            heapq.heappop(groups)[2].finish()
        heap = self._deadlines
        while heap:
            deadline, request_id = heap[0]
            pending = self._pending.get(request_id)
            if pending is None or pending.deadline != deadline:
                heapq.heappop(heap)  # answered already
                continue
            if deadline > now:
                break
            heapq.heappop(heap)
            self._fail(request_id)
        while groups and groups[0][2].finished:
            heapq.heappop(groups)
        candidates = [heap[0][0]] if heap else []
        if groups:
            candidates.append(groups[0][0])
        return min(candidates) if candidates else None

    def _fail(self, request_id: int) -> None:
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            pending.callback(None)

    def ask_all(self, peers: Iterable[tuple[int, int]], send: Callable[[int, int], None],
                on_answer: Callable[[int, A | None, bool], None],
                done: Callable[[list[int]], None], deadline: float) -> list[int]:
        """Send a request to each of ``peers``, (peer, link) pairs (``send(peer,
        request_id)``); ``done(missing)``
        once all answered or failed, or at ``deadline``, whichever comes first (at once when
        there is no peer; ``missing``: the peers that had not answered). ``on_answer(peer,
        frame or None, late)`` sees every outcome, also those after ``done`` (``late``), up
        to ``late_grace`` seconds after the deadline. Returns the peers asked."""
        group: _Group[A] = _Group(on_answer, done, deadline)
        asked = list(peers)

        def one(peer: int) -> Callable[[A | None], None]:
            def callback(frame: A | None) -> None:
                group.on_answer(peer, frame, group.finished)
                group.waiting.discard(peer)
                if not group.waiting:
                    group.finish()
            return callback

        group.waiting = {peer for peer, _ in asked}
        if not asked:
            group.finish()
            return []
        self._group_seq += 1
        heapq.heappush(self._groups, (deadline, self._group_seq, group))
        for peer, link in asked:
            send(peer, self.start(link, one(peer), deadline + self.late_grace))
        return [peer for peer, _ in asked]
