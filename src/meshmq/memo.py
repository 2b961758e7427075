"""Answers kept per key in a plain dict, bounded: the hot paths' caches (per topic, per
(filter, topic)) look a key up with ``dict.get`` and, on a miss, ``remember`` the answer.

A cache that holds ``limit`` keys is emptied before the next one is added and learns again from
the traffic: no eviction order to keep, and a fleet's working set refills it in a few turns.
Safe to share between threads under the GIL (a race only computes an answer twice).
"""

from __future__ import annotations

from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")

LIMIT = 10_000


def remember(cache: dict[K, V], key: K, value: V, limit: int = LIMIT) -> V:
    """Keep ``value`` for ``key`` in ``cache`` (emptied first if full) and return it."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value
