"""Topic aliases the server assigns on the PUBLISHes it sends to one client (spec 3.3.2.3.4).

Theory of operation
-------------------
A client that sent a Topic Alias Maximum N > 0 in its CONNECT accepts aliases 1..N
(MQTT-3.3.2-10); we never send a larger one (MQTT-3.1.2-26, MQTT-3.3.2-11), and none at all to
a client that sent 0 or nothing (MQTT-3.1.2-27: no ``OutgoingAliases`` is made for it). A
mapping lives as long as the network connection (MQTT-3.3.2-7), like this object.

Policy: the topics the client receives most hold the aliases.

* While aliases are free, a topic gets the next one on its first delivery (most clients
  receive fewer topics than their maximum, and then that is all there is).
* Once all are taken, every alias counts its deliveries, and a topic without one counts its
  own in ``_candidates``. Every ``period`` deliveries the counts are halved, the candidates
  forgotten and the ``VICTIMS`` coldest aliases picked; a candidate that clearly outnumbers
  the coldest (more than its count plus one) takes that alias over. Halving against a fresh
  start is a hysteresis of about 2: a topic must come twice as often as the one it replaces,
  so two topics of equal rate never take an alias from each other back and forth.
* Taking an alias over is a remap: the next PUBLISH carries the new topic *and* the alias,
  which the client must treat as the new mapping (spec 3.3.2.3.4); after that, an empty
  topic with the alias.

``lookup`` returns an int so that a delivery allocates nothing here: ``a > 0`` send an empty
topic and alias ``a`` (the client knows it); ``a < 0`` send the topic and alias ``-a`` (this
defines or remaps it); ``0`` send the topic without an alias (topics of 3 characters or fewer
gain nothing from one). If a PUBLISH that was to define an alias is not sent after all (e.g.
above the client's Maximum Packet Size), ``not_sent`` makes the next one define it again.
"""

from __future__ import annotations

import heapq

PERIOD = 1024  # deliveries between two halvings of the counts (at least 4 x the maximum)
VICTIMS = 16  # coldest aliases chosen per period, the ones candidates may take over
MAX_CANDIDATES = 1024  # topics without an alias counted at once (all forgotten beyond)
MIN_TOPIC_CHARS = 4  # an alias (3 bytes) saves nothing on a shorter topic


class OutgoingAliases:
    """The alias map of one connection, server to client."""

    __slots__ = ("_alias_of", "_candidates", "_countdown", "_hits", "_next", "_topic_of",
                 "_victims", "maximum", "period")

    def __init__(self, maximum: int) -> None:
        if not 0 < maximum <= 65535:
            raise ValueError(f"topic alias maximum must be 1..65535, got {maximum}")
        self.maximum = maximum
        self.period = max(PERIOD, 4 * maximum)
        self._alias_of: dict[str, int] = {}  # topic -> alias; negative until the client has it
        self._topic_of: list[str | None] = [None] * (maximum + 1)
        self._hits = [0] * (maximum + 1)  # deliveries per alias, halved every period
        self._candidates: dict[str, int] = {}  # deliveries of topics without an alias
        self._victims: list[int] = []  # the coldest aliases when last picked
        self._next = 1  # the next alias never used yet
        self._countdown = self.period

    def lookup(self, topic: str) -> int:
        """The alias for a PUBLISH on ``topic`` now: > 0 known to the client, < 0 to define
        (send topic and alias ``-result``), 0 none. Counts the delivery."""
        self._countdown -= 1
        if not self._countdown:
            self._decay()
        alias = self._alias_of.get(topic)
        if alias is not None:
            if alias < 0:
                alias = -alias
                self._alias_of[topic] = alias  # defined by the PUBLISH about to be sent
                self._hits[alias] += 1
                return -alias
            self._hits[alias] += 1
            return alias
        if len(topic) < MIN_TOPIC_CHARS:
            return 0
        if self._next <= self.maximum:
            alias = self._next
            self._next += 1
            result = self._assign(topic, alias, 1)
            if self._next > self.maximum:
                self._pick_victims()  # all taken from now on
            return result
        return self._contend(topic)

    def not_sent(self, alias: int) -> None:
        """The PUBLISH that was to define ``alias`` was not sent: define it with the next."""
        topic = self._topic_of[alias]
        if topic is not None:
            self._alias_of[topic] = -alias

    def _assign(self, topic: str, alias: int, hits: int) -> int:
        old = self._topic_of[alias]
        if old is not None:
            del self._alias_of[old]
        self._topic_of[alias] = topic
        self._alias_of[topic] = alias
        self._hits[alias] = hits
        return -alias

    def _contend(self, topic: str) -> int:
        """Every alias is taken: count ``topic``; it takes the coldest alias over once it
        clearly outnumbers it."""
        candidates = self._candidates
        count = candidates.pop(topic, 0) + 1
        victims = self._victims
        if victims:
            hits = self._hits
            coldest = min(victims, key=hits.__getitem__)  # at most VICTIMS to look at
            if count > hits[coldest] + 1:
                victims.remove(coldest)
                return self._assign(topic, coldest, count)
        if len(candidates) >= MAX_CANDIDATES:
            candidates.clear()
        candidates[topic] = count
        return 0

    def _decay(self) -> None:
        """Once per period: halve the counts, forget the candidates, pick new victims."""
        self._countdown = self.period
        hits = self._hits
        for alias in range(1, len(hits)):
            hits[alias] >>= 1
        self._candidates.clear()
        if self._next > self.maximum:
            self._pick_victims()

    def _pick_victims(self) -> None:
        self._victims = heapq.nsmallest(VICTIMS, range(1, self.maximum + 1),
                                        key=self._hits.__getitem__)

    def statistics(self) -> dict[str, int]:
        return {"aliases": len(self._alias_of), "candidates": len(self._candidates)}
