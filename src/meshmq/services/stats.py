"""Per-service figures: counters and the round-trip latency histogram (for /metrics).

A dispatcher counts what happens to its service's requests; the worker processes' desks count
the late replies they drop themselves. ``as_dict`` is what a worker answers the admin plane
with (node/admin/collect.py); figures of the same service from several processes add up.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

# Upper bounds (seconds) of the round-trip histogram's buckets (the last bucket: above them).
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                   5.0, 10.0)


@dataclass(slots=True)
class ServiceStats:
    requests: int = 0  # stored requests, repeats included
    duplicates: int = 0  # repeats answered from the deduplication memory or a pending request
    dispatched: int = 0  # attempts given to a service worker
    retries: int = 0  # attempts after the first
    timeouts: int = 0  # attempts whose worker did not reply in time
    lost: int = 0  # attempts whose worker went
    replies: int = 0  # replies that completed a request
    late_replies: int = 0  # replies dropped: their request was complete or given up
    errors: dict[str, int] = field(default_factory=dict)  # error replies by kind
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    latency_sum: float = 0.0

    def observe(self, seconds: float) -> None:
        """One request answered by its service, ``seconds`` after it was stored."""
        self.latency_buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests, "duplicates": self.duplicates,
            "dispatched": self.dispatched, "retries": self.retries, "timeouts": self.timeouts,
            "lost": self.lost, "replies": self.replies, "late_replies": self.late_replies,
            "errors": dict(self.errors), "latency_buckets": list(self.latency_buckets),
            "latency_sum": self.latency_sum,
        }
