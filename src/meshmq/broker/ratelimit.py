"""Token buckets for the connect-rate limit and the per-client message and byte rate limits.

Theory of operation
-------------------
A ``TokenBucket`` holds up to ``burst`` tokens and gains ``rate`` tokens per second. Time is an
argument (``now``, the event loop's clock), so everything here is testable without sleeping.
A rate of 0 means "no limit"; such limits are represented by ``None`` and cost nothing.

``ConnectRateLimiter`` (one per node) answers "may this CONNECT proceed?": one bucket for the
whole node and, when configured, one per source address. A CONNECT refused by its address does
not spend a node token, so one noisy address cannot lock everybody else out. The per-address
table is bounded (least recently used addresses are forgotten, which only refills their
buckets; the node bucket still holds).

``ClientThrottle`` (one per connection, from CONNACK on) is the inbound policy for a client:

* every PUBLISH spends one message token, every byte read spends one byte token (a read is
  charged as it arrives, and its packets wait until the byte bucket is out of debt);
* the I/O layer hands the broker only the packets that ``admit()`` lets through; when a bucket
  runs dry it keeps the rest, stops reading the socket (TCP backpressure pushes back to the
  client, nothing is dropped) and resumes after ``wait_time()``;
* a client that stays throttled without a break for ``max_throttle`` seconds keeps offering
  more than its rate however long it is held back: ``flooding()`` says so and the connection is
  closed (MQTT 5: DISCONNECT 0x96 Message rate too high). The throttle episode ends at the
  first read that needs no pause.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

from meshmq.mqtt.packets import Packet, PacketType

if TYPE_CHECKING:
    from meshmq.config import LimitsConfig

_PUBLISH = PacketType.PUBLISH
MAX_TRACKED_ADDRESSES = 65_536
RESUME_BATCH_SECONDS = 0.05  # a throttled client resumes with this much rate in hand


class TokenBucket:
    """``burst`` tokens at most, refilled at ``rate`` per second; may run into debt."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, rate: float, burst: float, now: float) -> None:
        if rate <= 0 or burst <= 0:
            raise ValueError("a token bucket needs a positive rate and burst")
        self.rate = float(rate)
        self.burst = float(burst)
        self.tokens = float(burst)
        self.stamp = now

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now

    def try_take(self, amount: float, now: float) -> bool:
        """Spend ``amount`` tokens if they are all there; False (nothing spent) if not."""
        self._refill(now)
        if self.tokens >= amount:
            self.tokens -= amount
            return True
        return False

    def take(self, amount: float, now: float) -> None:
        """Spend ``amount`` tokens even if that leaves the bucket in debt."""
        self._refill(now)
        self.tokens -= amount

    def wait_time(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` tokens are there (0 if they are now)."""
        self._refill(now)
        missing = amount - self.tokens
        return missing / self.rate if missing > 0 else 0.0

    def available(self, now: float) -> float:
        self._refill(now)
        return self.tokens


def _bucket(rate: int, burst: int, now: float) -> TokenBucket | None:
    return TokenBucket(rate, burst, now) if rate > 0 else None


class ConnectRateLimiter:
    """New-connection rate for the node and per source address."""

    def __init__(
        self, rate: int, burst: int, per_address_rate: int, per_address_burst: int,
        now: float, max_tracked: int = MAX_TRACKED_ADDRESSES,
    ) -> None:
        self._node = _bucket(rate, burst, now)
        self._per_address = (per_address_rate, per_address_burst)
        self.per_address = per_address_rate > 0  # False: ``allow`` ignores the address
        self._addresses: OrderedDict[str, TokenBucket] = OrderedDict()
        self._max_tracked = max_tracked
        self.refused = 0

    @classmethod
    def from_config(cls, limits: LimitsConfig, now: float) -> ConnectRateLimiter:
        return cls(limits.connect_rate, limits.connect_burst, limits.connect_rate_per_address,
                   limits.connect_burst_per_address, now)

    def allow(self, address: str, now: float) -> bool:
        """Spend a token for one CONNECT from ``address``; False means refuse it (0x9F)."""
        rate, burst = self._per_address
        if rate > 0:
            addresses = self._addresses
            bucket = addresses.get(address)
            if bucket is None:
                bucket = addresses[address] = TokenBucket(rate, burst, now)
                if len(addresses) > self._max_tracked:
                    addresses.popitem(last=False)
            else:
                addresses.move_to_end(address)
            if not bucket.try_take(1, now):
                self.refused += 1
                return False
        node = self._node
        if node is not None and not node.try_take(1, now):
            self.refused += 1
            return False
        return True

    def statistics(self) -> dict[str, int]:
        return {"connect_refused_rate": self.refused,
                "connect_rate_addresses": len(self._addresses)}


class ClientThrottle:
    """Inbound message and byte rate of one client (see the module docstring for the policy)."""

    __slots__ = ("_bytes", "_messages", "max_throttle", "throttled_since", "throttles")

    def __init__(
        self, message_rate: int, message_burst: int, byte_rate: int, byte_burst: int,
        max_throttle: float, now: float,
    ) -> None:
        self._messages = _bucket(message_rate, message_burst, now)
        self._bytes = _bucket(byte_rate, byte_burst, now)
        self.max_throttle = max_throttle  # 0: throttle for ever, never disconnect
        self.throttled_since: float | None = None
        self.throttles = 0

    @classmethod
    def from_config(cls, limits: LimitsConfig, now: float) -> ClientThrottle | None:
        """The throttle for a new client, or None when no per-client rate is configured."""
        if limits.client_message_rate <= 0 and limits.client_byte_rate <= 0:
            return None
        return cls(limits.client_message_rate, limits.client_message_burst,
                   limits.client_byte_rate, limits.client_byte_burst,
                   float(limits.throttle_timeout), now)

    def charge_bytes(self, count: int, now: float) -> None:
        """``count`` bytes were read from the socket (they are spent even into debt)."""
        if self._bytes is not None:
            self._bytes.take(count, now)

    def admit(self, events: Sequence[Packet], now: float) -> int:
        """How many of ``events``, from the start, may be handled now (the rest must wait).

        Nothing passes while the bytes already read are not paid for, so a read larger than
        the byte burst waits until the byte rate covers it.
        """
        if self._bytes is not None and self._bytes.available(now) < 0:
            return 0
        messages = self._messages
        if messages is not None:
            for index, packet in enumerate(events):
                if packet.type is _PUBLISH and not messages.try_take(1, now):
                    return index
        return len(events)

    def must_wait(self, waiting: int, now: float) -> bool:
        """True if reading must pause: packets wait, or the byte bucket is in debt."""
        return waiting > 0 or (self._bytes is not None and self._bytes.available(now) < 0)

    def wait_time(self, waiting: int, now: float) -> float:
        """Seconds to pause before trying again (``waiting``: packets held back)."""
        delay = 0.0
        messages = self._messages
        if waiting and messages is not None:  # wait for a batch, not a timer per packet
            batch = min(waiting, messages.burst, max(1.0, messages.rate * RESUME_BATCH_SECONDS))
            delay = messages.wait_time(batch, now)
        if self._bytes is not None:
            delay = max(delay, self._bytes.wait_time(0, now))
        return delay

    def start_pause(self, now: float) -> None:
        """Reading pauses now; a throttle episode starts unless one is running."""
        self.throttles += 1
        if self.throttled_since is None:
            self.throttled_since = now

    def read_without_pause(self) -> None:
        """A read needed no pause: the client is within its rate again."""
        self.throttled_since = None

    def flooding(self, now: float) -> bool:
        """True once throttling has run without a break for ``max_throttle`` seconds."""
        since = self.throttled_since
        return bool(self.max_throttle) and since is not None and now - since >= self.max_throttle
