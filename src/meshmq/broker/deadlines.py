"""Per-connection deadlines (CONNECT timeout, keep alive) in one timer wheel, not a timer each.

Theory of operation
-------------------
Time is cut into slots of ``resolution`` seconds; slot ``n`` ends at ``n * resolution``. A
connection with a deadline sits in the slot that ends at or after it, so a deadline is never
noticed early and at most ``resolution`` late. Filing, moving and removing a connection are a
few dict operations; nothing is allocated per connection beyond its place in a slot.

Keep alive is checked lazily: reading from a client only stamps ``last_read`` (no wheel work
per packet), and when the client's slot comes due ``expired()`` looks at it: silent for its
whole ``keep_alive_limit`` (1.5 times the Keep Alive, MQTT-3.1.2-24) means expired; otherwise
the client is filed again at ``last_read + keep_alive_limit``. So an idle connection costs one
check per keep-alive period and a busy one costs nothing, whatever the number of connections.
A connection still waiting for its CONNECT has ``keep_alive_limit == 0``: its deadline is
absolute (``mqtt.connect_timeout`` after accept) and bytes that are not a CONNECT do not move it.

``TimerWheel`` and ``KeepAliveWheel`` are plain bookkeeping with time as an argument (tested
with an injected clock); ``WheelTimer`` is the asyncio glue, one loop timer per broker set for
the earliest slot that holds anything, so an idle broker sleeps until a deadline can be due.

Invariants: every filed item is in exactly one slot and ``_slot_of`` says which; no slot in
``_slots`` is empty; every slot number in ``_slots`` is also in ``_heap`` and in ``_numbers``.
"""

from __future__ import annotations

import asyncio
import heapq
import math
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

T = TypeVar("T")
RESOLUTION = 0.25  # seconds: how late a deadline may be noticed, at most
TIMER_SLACK = 0.002  # seconds after a slot's end the loop timer is set for


class TimerWheel(Generic[T]):
    """Items with deadlines, found again once their slot's end has passed."""

    def __init__(self, resolution: float = RESOLUTION) -> None:
        self.resolution = resolution
        self._slots: dict[int, dict[T, None]] = {}  # slot -> its items (ordered, no values)
        self._slot_of: dict[T, int] = {}
        self._heap: list[int] = []  # slot numbers, possibly stale (emptied since)
        # Each slot's number as one int object, which ``_slot_of`` shares among the slot's
        # items (a slot number is a large int: 32 bytes per connection otherwise).
        self._numbers: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, item: object) -> bool:
        return item in self._slot_of

    def add(self, item: T, deadline: float) -> bool:
        """File ``item`` at ``deadline`` (in place of any deadline it had); True if that opened
        a slot (the only case in which the earliest deadline can have moved earlier)."""
        slot = math.ceil(deadline / self.resolution)
        old = self._slot_of.get(item)
        if old == slot:
            return False
        if old is not None:
            self._remove(item, old)
        items = self._slots.get(slot)
        if items is None:
            items = self._slots[slot] = {}
            self._numbers[slot] = slot
            heapq.heappush(self._heap, slot)
            self._slot_of[item] = slot
            items[item] = None
            return True
        self._slot_of[item] = self._numbers[slot]
        items[item] = None
        return False

    def discard(self, item: T) -> None:
        slot = self._slot_of.pop(item, None)
        if slot is not None:
            self._remove(item, slot, forget=False)

    def _remove(self, item: T, slot: int, forget: bool = True) -> None:
        if forget:
            del self._slot_of[item]
        items = self._slots[slot]
        del items[item]
        if not items:
            del self._slots[slot]  # its heap entry goes stale; next_due() skips it
            del self._numbers[slot]

    def next_due(self) -> float | None:
        """When the earliest slot holding anything ends (None: the wheel is empty)."""
        heap, slots = self._heap, self._slots
        while heap and heap[0] not in slots:
            heapq.heappop(heap)
        return heap[0] * self.resolution if heap else None

    def pop_due(self, now: float) -> list[T]:
        """Remove and return every item whose slot has ended by ``now`` (deadline order)."""
        due: list[T] = []
        heap, slots = self._heap, self._slots
        last = math.floor(now / self.resolution + 1e-9)
        while heap and heap[0] <= last:
            number = heapq.heappop(heap)
            items = slots.pop(number, None)
            if items:
                del self._numbers[number]
                for item in items:
                    del self._slot_of[item]
                due.extend(items)
        return due


class Watched(Protocol):
    """What the keep-alive check reads of a connection."""

    last_read: float  # loop time of the last bytes read from the client
    keep_alive_limit: float  # seconds of silence allowed; 0 while waiting for CONNECT


W = TypeVar("W", bound=Watched)


class KeepAliveWheel(TimerWheel[W]):
    """The CONNECT deadline and the keep-alive check of every connection of a broker."""

    def await_connect(self, conn: W, now: float, timeout: float) -> bool:
        """File a new connection at its CONNECT deadline; True if a slot was opened (``add``).

        In a connect storm the connections of a quarter second share one slot, so only the
        first of them asks for the loop timer."""
        return self.add(conn, now + timeout)

    def watch(self, conn: W) -> bool:
        """CONNACK sent: check ``conn`` for silence from now on (its limit is set); True if a
        slot was opened.

        A CONNECT deadline due before the keep-alive one stays where it is: when it comes due,
        ``expired()`` sees the limit and files the connection at its keep-alive deadline. So a
        connect storm does no wheel work per CONNACK; each connection moves once, later."""
        deadline = conn.last_read + conn.keep_alive_limit
        slot = self._slot_of.get(conn)
        if slot is None or slot * self.resolution > deadline:
            return self.add(conn, deadline)
        return False

    def expired(self, now: float, excused: bool = False) -> list[W]:
        """The connections past their deadline at ``now``: no CONNECT in time, or silent for
        their keep-alive limit. The others that came due are filed again. ``excused``: the
        broker itself stopped reading every client, so nobody's silence counts (it restarts)."""
        late: list[W] = []
        for conn in self.pop_due(now):
            limit = conn.keep_alive_limit
            if not limit:
                late.append(conn)
                continue
            if excused:
                conn.last_read = now
            if now - conn.last_read >= limit:  # MQTT-3.1.2-24
                late.append(conn)
            else:
                self.add(conn, conn.last_read + limit)
        return late


class WheelTimer:
    """Runs ``on_due`` when the wheel's earliest slot ends: one loop timer for the broker."""

    def __init__(self, wheel: TimerWheel, loop: asyncio.AbstractEventLoop,
                 on_due: Callable[[float], None]) -> None:
        self.wheel = wheel
        self.loop = loop
        self.on_due = on_due
        self._handle: asyncio.TimerHandle | None = None
        self._at = math.inf

    def arm(self) -> None:
        """Call after filing something: wake up no later than its slot's end."""
        due = self.wheel.next_due()
        if due is None or due >= self._at:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at = due
        # A little past the slot's end: uvloop's timers tick in milliseconds and may fire a
        # fraction of one early, when the slot has not ended yet.
        self._handle = self.loop.call_at(due + TIMER_SLACK, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._at = math.inf
        self.on_due(self.loop.time())
        self.arm()

    def close(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._at = math.inf
