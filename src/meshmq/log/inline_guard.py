"""``InlineGuard``: may an event loop fsync on its own thread, or is the disk too slow for it?

Theory of operation
-------------------
``LogWriter.write_now`` fsyncs ``always`` batches on its caller's thread (an event loop) to
save the round trip through the writer thread. While it does, every connection of that loop
waits for the disk, so each inline fsync's duration (all the partitions of one call) goes
into a moving average (``AVERAGE_WEIGHT``: a lone spike barely moves it, a run of slow fsyncs
does). Above ``slow_s`` the guard refuses inline fsyncs and the caller hands ``always`` batches
to the writer thread again, where a slow fsync stalls only the publishes waiting for it.

Only inline fsyncs are measured: one on the writer thread is timed from Python, so its time
includes waiting for the GIL (milliseconds while the loop is busy) and says little about the
disk. So the guard comes back by trying: ``backoff`` seconds after it refused it allows inline
fsyncs again with the average set half way to the limit, so that a run of slow ones soon
crosses it again while one slow fsync among quick ones does not. A try that crosses the limit
within its first ``TRIAL_FSYNCS`` doubles the next wait (1 s, 2 s, ... up to 16 s); once the
loop has been fsyncing for longer, the next refusal waits 1 s again. The caller fsyncs inline
only when nothing of its is waiting in the writer thread (offsets keep their order):
broker/persistence.py holds the turns that end meanwhile until the writer is back.

Not thread-safe: one caller (the event loop) asks and reports; the writer reads ``inline`` for
its statistics only.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

log = logging.getLogger("meshmq.log")

AVERAGE_WEIGHT = 0.1  # of the latest fsync: 3 in a row 10x over the average cross 2x of it
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 16.0
TRIAL_FSYNCS = 20  # a try refused again within these many fsyncs waits twice as long next


class InlineGuard:
    """Decides whether ``always`` fsyncs run inline; ``slow_s`` <= 0: never."""

    def __init__(self, slow_s: float, clock: Callable[[], float]) -> None:
        self.slow_s = slow_s
        self.clock = clock
        self.inline = slow_s > 0  # fsync inline (else on the thread until ``_retry_at``)
        self.average = 0.0  # seconds, of the inline fsyncs
        self.backoff = FIRST_BACKOFF_S  # the wait after a try that fails
        self._retry_at = math.inf
        self._trial_left = 0  # fsyncs before the current try counts as a success

    def allows(self) -> bool:
        """May the caller fsync inline now? (True again, for a try, once the wait ran out)"""
        if self.inline:
            return True
        if self.slow_s <= 0 or self.clock() < self._retry_at:
            return False
        self.inline = True
        self.average = self.slow_s / 2
        self._trial_left = TRIAL_FSYNCS
        return True

    def note(self, elapsed: float) -> None:
        """An inline fsync took ``elapsed`` seconds."""
        if self.slow_s <= 0:
            return
        self.average += AVERAGE_WEIGHT * (elapsed - self.average)
        if self.average > self.slow_s:
            failed_try = self._trial_left > 0
            wait = self.backoff if failed_try else FIRST_BACKOFF_S
            self.inline = False
            self._retry_at = self.clock() + wait
            self.backoff = min(wait * 2, MAX_BACKOFF_S)
            self._trial_left = 0
            (log.debug if failed_try else log.warning)(
                "commit log fsyncs are slow (%.1f ms on average, over %.1f ms): they run on"
                " the log writer thread; inline ones are tried again in %g s",
                self.average * 1000, self.slow_s * 1000, wait)
        elif self._trial_left:
            self._trial_left -= 1
            if not self._trial_left:
                log.info("commit log fsyncs are quick again (%.2f ms on average): they run"
                         " inline", self.average * 1000)
