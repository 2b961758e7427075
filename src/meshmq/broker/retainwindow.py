"""A new subscription gets each retained message once: live, or as the retained copy.

Theory of operation
-------------------
When a SUBSCRIBE asks for retained messages (MQTT-3.3.1-9..-11), the subscription is installed
at one moment and the retained messages are looked up at another: after the SUBACK on one
worker, at the owner of the retained messages (another worker) with several. A retained publish
routed in between reaches the subscriber live *and* sits in the store it then reads: one
message, two deliveries (for QoS 2 that breaks exactly once, MQTT 4.3.3).

A ``RetainedWindow`` is opened on the session when the subscription is installed and sees every
live delivery of a message published with the retain flag (``live()``):

* while a lookup is pending, it remembers the topics that got a live retained publish; their
  copies are skipped when the lookup answers (``copies()``): what came live is at least as
  new, since whoever answers the lookup had stored it before answering, or it is still on its
  way;
* once the copies are delivered, a live publish identical to a copy (same topic, publisher and
  payload) that was still on its way from another worker is dropped, once. ``close()`` ends
  that when nothing sent before the copies can still arrive (after a route barrier with every
  peer; at once on a single-process node, where nothing is in flight).

Matching on content rather than on an identity is exact in what a client can observe: two
identical publishes are indistinguishable, so dropping either one gives the same stream.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from meshmq.mqtt.topics import topic_matches

if TYPE_CHECKING:
    from meshmq.broker.message import Message

CopyKey = tuple[str | None, bytes]  # (publisher, payload) of a copy, per topic


class RetainedWindow:
    """Per session: retained lookups in flight and the copies they delivered."""

    __slots__ = ("_delivered", "_filters", "_live_topics", "_settling", "pending")

    def __init__(self) -> None:
        self.pending = 0  # lookups not answered yet
        self._settling = 0  # lookups answered whose copies may still meet a live duplicate
        self._filters: list[str] = []  # the filters of those lookups
        self._live_topics: set[str] = set()
        self._delivered: dict[str, CopyKey] = {}

    def open(self, filters: Iterable[str]) -> None:
        """A subscription on ``filters`` was installed; its lookup is pending."""
        self.pending += 1
        self._filters.extend(filters)

    def live(self, message: Message) -> bool:
        """A live delivery of a retained publish: True if it duplicates a delivered copy."""
        topic = message.topic
        copied = self._delivered.get(topic)
        if copied is not None and copied == (message.sender, message.payload):
            del self._delivered[topic]  # once: a later identical publish is a new message
            return True
        if self.pending and any(topic_matches(f, topic) for f in self._filters):
            self._live_topics.add(topic)
        return False

    def copies(self, found: list[list[Message]]) -> list[list[Message]]:
        """One lookup answered with ``found`` (per filter): the copies still to deliver, those
        of topics no live retained publish reached meanwhile."""
        fresh = [[m for m in messages if m.topic not in self._live_topics]
                 for messages in found]
        for messages in fresh:
            for message in messages:
                self._delivered[message.topic] = (message.sender, message.payload)
        self.pending -= 1
        self._settling += 1
        if not self.pending:
            self._filters.clear()
            self._live_topics.clear()
        return fresh

    def close(self) -> bool:
        """Nothing sent before one answer's copies can arrive any more (call once per
        ``copies()``); True if the window is now empty and can be dropped."""
        self._settling -= 1
        if not self._settling:
            self._delivered.clear()
        return not self.pending and not self._settling
