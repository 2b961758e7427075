"""Who may open a connection on a listener: CIDR allow/deny rules and connection limits.

Theory of operation
-------------------
Each listener has one ``Admission``. The I/O layer asks ``admit(host)`` once per accepted
socket, before reading a byte, and gets a ``Decision``:

* ``DENIED``: the source address is outside the listener's CIDR rules (a ``deny`` network
  matches, or an ``allow`` list exists and no network in it matches; deny wins). The socket is
  closed at once; nothing is read from it.
* ``ADMITTED`` with a ``Ticket``: the connection counts against ``max_connections`` and
  ``max_connections_per_ip`` until ``ticket.release()`` (called exactly when the connection is
  gone; further calls do nothing). ``admitted`` is the same without the ``Ticket`` object,
  for a caller that keeps the key and calls ``release(key)`` once itself.
* ``OVER_LIMIT`` with a ``Ticket``: a limit is reached. The connection is kept only long enough
  to read its CONNECT and answer CONNACK 0x97 Quota exceeded (3.1.1: 3 Server unavailable).
  Such refusals are counted separately and bounded by ``max_refusing``, so a flood of surplus
  connections cannot hold more than that many sockets open.
* ``CLOSED``: over a limit *and* ``max_refusing`` refusals are already pending: closed at once.

Everything here is plain bookkeeping (no sockets, no clocks), so it is tested directly.
Invariants: ``active == sum(per_ip.values())``; no ``per_ip`` entry is zero; counters never go
negative whatever order tickets are released in.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
from dataclasses import dataclass
from typing import NamedTuple

from meshmq.networks import IPNetwork, parse_networks

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
__all__ = ["IPNetwork", "parse_networks"]  # parsed where the configuration is checked too

MAX_REFUSING = 64  # surplus connections per listener held open to be told CONNACK 0x97


@functools.lru_cache(maxsize=4096)
def peer_address(host: str) -> IPAddress | None:
    """The address a peer connected from; IPv4-mapped IPv6 addresses become IPv4.

    Cached: parsing costs a few microseconds per accept, and a storm comes from far fewer
    addresses than connections (NAT, a few gateways); the addresses are immutable."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])  # drop an IPv6 zone id
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


@functools.lru_cache(maxsize=4096)
def _address_key(host: str) -> str:
    """The per-address count's key for ``host``: one shared string per address."""
    address = peer_address(host)
    return str(address) if address is not None else host


@dataclass(frozen=True, slots=True)
class NetworkRules:
    """CIDR rules of one listener: deny wins; an empty allow list allows every address."""

    allow: tuple[IPNetwork, ...] = ()
    deny: tuple[IPNetwork, ...] = ()

    @classmethod
    def parse(cls, allow: str, deny: str) -> NetworkRules:
        return cls(parse_networks(allow), parse_networks(deny))

    def permits(self, address: IPAddress | None) -> bool:
        if not self.allow and not self.deny:
            return True
        if address is None:  # not an IP peer (cannot happen on TCP): refuse when rules exist
            return False
        if any(address in network for network in self.deny):
            return False
        return not self.allow or any(address in network for network in self.allow)


class Verdict(enum.Enum):
    ADMITTED = "admitted"
    DENIED = "denied"
    OVER_LIMIT = "over limit"
    CLOSED = "closed"


class Ticket:
    """One connection's place in its listener's counts; ``release()`` gives it back once."""

    __slots__ = ("_admission", "_key", "refusal")

    def __init__(self, admission: Admission, key: str, refusal: bool) -> None:
        self._admission: Admission | None = admission
        self._key = key
        self.refusal = refusal

    def release(self) -> None:
        admission = self._admission
        if admission is None:
            return
        self._admission = None
        admission._release(self._key, self.refusal)


class Decision(NamedTuple):  # (a tuple: one is made per accepted socket)
    verdict: Verdict
    why: str = ""
    ticket: Ticket | None = None


class Admission:
    """CIDR rules and connection counts of one listener (``0`` = no limit)."""

    def __init__(
        self, rules: NetworkRules, max_connections: int = 0, max_connections_per_ip: int = 0,
        max_refusing: int = MAX_REFUSING,
    ) -> None:
        self.rules = rules
        self.max_connections = max_connections
        self.max_connections_per_ip = max_connections_per_ip
        self.max_refusing = max_refusing
        self.active = 0
        self.refusing = 0
        self.per_ip: dict[str, int] = {}
        self.counters = {"admitted": 0, "denied": 0, "over_limit": 0, "closed_at_accept": 0}

    def ticket(self, host: str) -> Ticket | None:
        """The ticket of a connection from ``host`` that is simply admitted (counted), or None
        with nothing counted: then ``admit`` says what to do with it. The accept path of a
        storm: no ``Decision`` is made for the common case."""
        key = self.admitted(host)
        return None if key is None else Ticket(self, key, refusal=False)

    def admitted(self, host: str) -> str | None:
        """``ticket`` without the ``Ticket``: the key its count is under, for the caller to
        give back exactly once with ``release(key)`` (the plain tcp listener's connections,
        which hold it in a slot of their own: one object less per connection)."""
        rules = self.rules
        if (rules.allow or rules.deny) and not rules.permits(peer_address(host)):
            return None
        key = _address_key(host)
        if (self.max_connections or self.max_connections_per_ip) and self._limit_reached(key):
            return None
        self.counters["admitted"] += 1
        self.active += 1
        self.per_ip[key] = self.per_ip.get(key, 0) + 1
        return key

    def release(self, key: str) -> None:
        """Give back the count of a connection ``admitted`` under ``key`` (once per key)."""
        self._release(key, False)

    def admit(self, host: str) -> Decision:
        """Decide for a connection from ``host``; the caller must act on the verdict."""
        ticket = self.ticket(host)
        if ticket is not None:
            return Decision(Verdict.ADMITTED, "", ticket)
        address = peer_address(host)
        if not self.rules.permits(address):
            self.counters["denied"] += 1
            return Decision(Verdict.DENIED, "address not allowed by the listener's CIDR rules")
        key = _address_key(host)
        why = self._limit_reached(key)  # (permitted, not admitted: a limit is reached)
        if self.refusing >= self.max_refusing:
            self.counters["closed_at_accept"] += 1
            return Decision(Verdict.CLOSED, why)
        self.counters["over_limit"] += 1
        self.refusing += 1
        return Decision(Verdict.OVER_LIMIT, why, Ticket(self, key, refusal=True))

    def _limit_reached(self, key: str) -> str:
        if self.max_connections and self.active >= self.max_connections:
            return f"max_connections {self.max_connections} reached"
        if self.max_connections_per_ip and self.per_ip.get(key, 0) >= self.max_connections_per_ip:
            return f"max_connections_per_ip {self.max_connections_per_ip} reached"
        return ""

    def _release(self, key: str, refusal: bool) -> None:
        if refusal:  # a refused connection never counted in ``per_ip``
            self.refusing -= 1
            return
        self.active -= 1
        left = self.per_ip[key] - 1
        if left:
            self.per_ip[key] = left
        else:
            del self.per_ip[key]

    def statistics(self) -> dict[str, int]:
        return {
            "active": self.active, "refusing": self.refusing, "addresses": len(self.per_ip),
            **self.counters,
        }
