"""Replay requests: the ``meshmq-replay`` user property on SUBSCRIBE (docs/replay.md).

Values (case-insensitive keywords):

* ``earliest`` — everything still in the log;
* ``latest`` — nothing old: the subscription goes live (same as no property);
* ``timestamp:T`` — records stored at or after ``T``, Unix milliseconds or ISO 8601
  (``2026-11-23T10:00:00Z``);
* ``offsets:P=O,P=O`` — partition ``P`` from offset ``O``; partitions not listed start at
  ``latest``. Offsets below what retention kept start at the earliest kept record; offsets past
  the end start at the end.

A value that does not parse is refused with SUBACK reason 0x83 (implementation specific error)
for the filters of that SUBSCRIBE, and a reason string naming the problem.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshmq.broker.interfaces import PartitionLog

REPLAY_PROPERTY = "meshmq-replay"


class ReplayError(ValueError):
    """A ``meshmq-replay`` value that cannot be understood."""


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    kind: str  # earliest | latest | timestamp | offsets
    timestamp_ms: int = 0
    offsets: tuple[tuple[int, int], ...] = ()


def parse_replay(value: str) -> ReplayRequest:
    text = value.strip()
    keyword, _, argument = text.partition(":")
    keyword = keyword.strip().lower()
    if keyword in ("earliest", "latest") and not argument:
        return ReplayRequest(keyword)
    if keyword == "timestamp":
        return ReplayRequest("timestamp", timestamp_ms=_parse_timestamp(argument.strip()))
    if keyword == "offsets":
        return ReplayRequest("offsets", offsets=_parse_offsets(argument))
    raise ReplayError(
        f"{REPLAY_PROPERTY}: expected earliest, latest, timestamp:T or offsets:P=O,..., "
        f"got {value!r}"
    )


def _parse_timestamp(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ReplayError(f"{REPLAY_PROPERTY}: bad timestamp {text!r}") from None
    if moment.tzinfo is None:
        raise ReplayError(f"{REPLAY_PROPERTY}: timestamp {text!r} needs a time zone (e.g. Z)")
    return int(moment.timestamp() * 1000)


def _parse_offsets(text: str) -> tuple[tuple[int, int], ...]:
    pairs = []
    for item in text.split(","):
        partition, sep, offset = item.strip().partition("=")
        if not sep or not partition.strip().isdigit() or not offset.strip().isdigit():
            raise ReplayError(f"{REPLAY_PROPERTY}: bad partition=offset pair {item.strip()!r}")
        pairs.append((int(partition), int(offset)))
    return tuple(pairs)


def start_offsets(request: ReplayRequest, log_: PartitionLog) -> list[int]:
    """Per partition, the first offset to deliver for ``request``."""
    high = list(log_.high_watermark)
    if request.kind == "latest":
        return high
    earliest = [log_.earliest_offset(p) for p in range(len(high))]
    if request.kind == "earliest":
        return earliest
    if request.kind == "timestamp":
        found = [log_.offset_for_timestamp(p, request.timestamp_ms) for p in range(len(high))]
        return [h if f is None else min(f, h) for f, h in zip(found, high, strict=True)]
    start = high
    for partition, offset in request.offsets:
        if partition >= len(high):
            raise ReplayError(
                f"{REPLAY_PROPERTY}: partition {partition} does not exist "
                f"(the log has {len(high)})"
            )
        start[partition] = min(max(offset, earliest[partition]), high[partition])
    return start
