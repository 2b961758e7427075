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
disk. So the guard comes back by trying: ``backoff`` seconds after it refused (1 s, doubled
after each failed try up to 16 s) it allows one inline fsync again, which alone decides: under
``slow_s`` and the loop fsyncs inline again (its duration is the new average), else it refuses
for twice as long. The caller may only fsync inline when nothing of its is waiting in the
writer thread (offsets keep their order), so under a load that always keeps the writer busy
the try waits for the first moment it is idle.

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


class InlineGuard:
    """Decides whether ``always`` fsyncs run inline; ``slow_s`` <= 0: never."""

    def __init__(self, slow_s: float, clock: Callable[[], float]) -> None:
        self.slow_s = slow_s
        self.clock = clock
        self.inline = slow_s > 0  # fsync inline (else on the thread until ``_retry_at``)
        self.average = 0.0  # seconds, of the inline fsyncs
        self.backoff = FIRST_BACKOFF_S
        self._retry_at = math.inf
        self._trying = False

    def allows(self) -> bool:
        """May the caller fsync inline now? (True again for one try once the backoff ran out)"""
        if self.inline:
            return True
        if self.slow_s <= 0 or self.clock() < self._retry_at:
            return False
        self.inline = self._trying = True
        return True

    def note(self, elapsed: float) -> None:
        """An inline fsync took ``elapsed`` seconds."""
        if self.slow_s <= 0:
            return
        trying, self._trying = self._trying, False
        if trying:
            self.average = elapsed
        else:
            self.average += AVERAGE_WEIGHT * (elapsed - self.average)
        if self.average > self.slow_s:
            self.inline = False
            self._retry_at = self.clock() + self.backoff
            log.warning("commit log fsyncs are slow (%.1f ms on average, over %.1f ms): they"
                        " run on the log writer thread; an inline one is tried again in %g s",
                        self.average * 1000, self.slow_s * 1000, self.backoff)
            self.backoff = min(self.backoff * 2, MAX_BACKOFF_S)
        elif trying:
            self.backoff = FIRST_BACKOFF_S
            log.info("commit log fsyncs are quick again (%.2f ms): they run inline",
                     elapsed * 1000)
