"""A session on its way to another worker: what is routed to it meanwhile follows it there.

Theory of operation
-------------------
When worker A hands a session over to worker B (a ``CLAIM``: the client connected to B), A's
routes still point at the session until B's routes for it reach every worker, and B does not
know the session until A's answer arrives. A message that is not in the commit log (QoS 0, or
QoS 1/2 with the log off) routed in between would reach neither worker's copy of the session;
on one worker a takeover has no such gap.

So A does not drop the session's subscriptions when it hands it over: it puts a
``MovedSession`` in its place, which sends every delivery it gets to B as a ``DELIVER`` frame
(this client, this QoS, these subscription ids), after the ``CLAIMED`` answer on the same
link, so B has adopted the session when it arrives. It skips what reaches B anyway:

* a persisted message on a plain subscription: the session's log cursor (moved with it) reads
  it, as it reads everything routed while the session is offline;
* a publish made on A that A also forwards to B (B's routes match it): B delivers that copy,
  since it arrives after the session did.

B, once it has adopted the session and sent its routes, sends ``SETTLED``; A then drops the
stub and its routes (B's now cover the session, and anything B routed before arrived at A
before ``SETTLED`` and was sent back). The stub keeps the session as A handed it over
(``blob``): if the link to B drops or ``SETTLE_TIMEOUT`` passes without ``SETTLED``, A takes
the session back instead of losing it (cluster/directory.py keeps the stubs).

With more than two workers, a third worker C may forward a message to both A (whose stub sends
it on) and B in the moment between learning B's routes and A's withdrawal: B can then receive
it twice (docs/workers.md). Nothing is lost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from meshmq.broker.session import Session, SharedKey

if TYPE_CHECKING:
    from meshmq.broker.message import Message
    from meshmq.cluster.timers import Timer

SETTLE_TIMEOUT = 10.0  # seconds a stub waits for SETTLED before it gives up

Redirect = Callable[["Message", int, bool, "list[int] | None", "SharedKey | None"], None]


class MovedSession(Session):
    """Stands in for a session handed over to ``peer`` until that worker has settled it."""

    __slots__ = ("blob", "covered", "peer", "redirect", "timer")

    def __init__(self, moved: Session, peer: int, redirect: Redirect,
                 covered: Callable[[Message], bool], blob: bytes = b"") -> None:
        super().__init__(moved.client_id, moved.limits)
        self.subscriptions = moved.subscriptions  # still in this router's trie
        self.peer = peer
        self.redirect = redirect
        self.covered = covered  # True: the peer gets this message anyway
        self.blob = blob  # the session as handed over, until the peer confirms it
        self.timer: Timer | None = None  # SETTLE_TIMEOUT

    def deliver(
        self, message: Message, qos: int, retain: bool, subscription_ids: list[int] | None,
        now: float, group: SharedKey | None = None,
    ) -> None:
        if group is None and (message.position is not None or self.covered(message)):
            return
        self.redirect(message, qos, retain, subscription_ids, group)
