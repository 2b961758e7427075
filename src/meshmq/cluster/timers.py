"""Every deadline of the mesh in one heap, behind the I/O layer's single timer.

Theory of operation
-------------------
The mesh's I/O layer gives it one timer (``MeshIO.schedule(when)`` sets it, replacing the one
before), as the real one does (cluster/sockets.py: one loop timer). Everything the mesh and its
components must do at a time (a request's deadline, an append's timeout, a stand-in's expiry, a
handshake's limit) is a ``Timer`` in ``Timers``: ``call_at`` adds one, ``cancel`` drops it, and
``run_due(now)`` calls those that are due, in deadline order (equal deadlines in the order they
were added). The mesh sets the I/O timer to ``next_deadline()`` after every change that moves
it earlier and after every run, so no deadline is forgotten however many share the timer: the
fault this replaced kept only the earliest deadline and lost a later one once the earlier
fired.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable


class Timer:
    """One deadline: ``callback()`` at ``when`` unless cancelled."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Timers:
    """A heap of ``Timer`` (sans-I/O: time is an argument)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = 0

    def __len__(self) -> int:
        return sum(1 for _, _, timer in self._heap if not timer.cancelled)

    def call_at(self, when: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(when, callback)
        self._seq += 1
        heapq.heappush(self._heap, (when, self._seq, timer))
        return timer

    def next_deadline(self) -> float | None:
        """The earliest deadline still to run (None: none)."""
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def run_due(self, now: float) -> None:
        """Call every timer due at ``now`` (also those a callback adds that are due)."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            timer = heapq.heappop(heap)[2]
            if not timer.cancelled:
                timer.cancelled = True  # ran: a later cancel() is harmless
                timer.callback()
