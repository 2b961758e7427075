"""The broker's event counters: one typed field each, under the name users see.

The names are public: the admin API shows them under ``counters`` (broker/queries.py), the
Prometheus metrics are made from them (node/admin/collect.py), and tests read them; renaming a
field renames what operators see. Each is counted where the event happens, with ``+= 1`` on a
slot of one object (no dictionary lookup on the message path).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(slots=True)
class Counters:
    """One router's counters (see the module docstring); all start at zero."""

    connects: int = 0  # CONNECTs accepted (CONNACK 0)
    rejected: int = 0  # CONNECTs refused with a CONNACK reason code
    protocol_errors: int = 0  # connections closed for breaking the protocol
    wills: int = 0  # will messages published
    acl_denied: int = 0  # publishes and subscriptions the ACL refused
    refused_publishes: int = 0  # publishes refused: the log's queue was full, or it failed
    throttled: int = 0  # times a client's reading was paused by its rate limits
    rate_disconnects: int = 0  # clients disconnected for staying over their rate limits
    subscription_quota: int = 0  # filters refused over ``limits.max_subscriptions``
    log_failures: int = 0  # commit log appends that failed
    unknown_outcomes: int = 0  # publishes whose append got no answer: connection closed
    ended_drops: int = 0  # messages dropped by sessions that ended here (queries.py)
    bytes_in: int = 0  # MQTT bytes read from clients
    bytes_out: int = 0  # MQTT bytes written to clients

    def as_dict(self) -> dict[str, int]:
        """Every counter by name, in the order above (a copy)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}

    def __getitem__(self, name: str) -> int:
        """A counter by the name users see it under: ``counters["connects"]``."""
        if name not in NAMES:
            raise KeyError(name)
        value: int = getattr(self, name)
        return value


NAMES = frozenset(field.name for field in fields(Counters))
