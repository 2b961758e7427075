"""One subscription of a session: the options it was made with and its identifier.

A value shared by the router (its trie's entries), the session, the catch-up that reads the
log for it and the codec that stores it (snapshot.py); it sits below all of them, so that none
of them needs another's module for its type.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshmq.mqtt.packets import SubscriptionOptions


@dataclass(slots=True, frozen=True)
class Subscription:
    options: SubscriptionOptions
    subscription_id: int | None = None
