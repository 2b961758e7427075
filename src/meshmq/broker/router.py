"""The router: subscriptions, shared subscriptions, and publish routing.

Theory of operation
-------------------
The router owns two indexes and no sockets:

* ``subscriptions``: a topic trie of plain filters, entries keyed by client id;
* ``shared``: a topic trie of the filters of ``$share/{group}/{filter}``, entries keyed by
  group name, each a ``SharedGroup`` of members served round-robin.

``publish()`` matches the topic once (O(levels), cached for hot topics) and hands the shared
``Message`` to each matching ``Session.deliver()``. A client whose filters overlap gets one copy
with the highest granted QoS and every matching subscription identifier (MQTT-3.3.4-2, -3,
-4). Each shared group delivers to exactly one member, preferring attached, uncongested ones.

Events in (subscribe, unsubscribe, publish), deliveries out (``Session.deliver``). Beyond this
router lie its ``peers`` (broker/interfaces.py): they hear every route change, and
``publish()`` hands them each message after the local plain deliveries, so that it reaches the
other routers with a match, and they decide which shared groups this router serves (one
delivery per group wherever its members are). A single-process node's peers are
``LocalPeers``: nobody, every group served here. Retained messages are not the router's
(broker/interfaces.py ``RetainedMessages``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

from meshmq.broker.local import LocalPeers
from meshmq.broker.message import SYS_PREFIX, Message
from meshmq.broker.session import Session, Subscription
from meshmq.broker.trie import SubscriptionTrie
from meshmq.mqtt.topics import parse_shared_filter

if TYPE_CHECKING:
    from meshmq.broker.interfaces import Peers

SharedKey = tuple[str, str]  # (group name, filter)
_NO_GROUPS: Final[dict[SharedKey, SharedGroup]] = {}  # never written to: the common "no group" case


class SharedGroup:
    """Members of one ``$share/{group}/{filter}``; each message goes to one of them."""

    __slots__ = ("_next", "_order", "members")

    def __init__(self) -> None:
        self.members: dict[str, Subscription] = {}
        self._order: list[str] = []
        self._next = 0

    def add(self, client_id: str, subscription: Subscription) -> None:
        if client_id not in self.members:
            self._order.append(client_id)
        self.members[client_id] = subscription

    def remove(self, client_id: str) -> None:
        if self.members.pop(client_id, None) is not None:
            self._order.remove(client_id)

    def choose(
        self, sessions: dict[str, Session], exclude: str | None = None
    ) -> tuple[Session, Subscription] | None:
        """Next member round-robin, preferring one that is connected and keeping up."""
        order = self._order
        count = len(order)
        fallback = None
        for step in range(count):
            index = (self._next + step) % count
            client_id = order[index]
            session = sessions.get(client_id)
            if session is None or client_id == exclude:
                continue
            client = session.client
            if client is not None and not client.congested:
                self._next = index + 1
                return session, self.members[client_id]
            if fallback is None:
                fallback = index
        if fallback is None:
            return None
        self._next = fallback + 1
        client_id = order[fallback]
        return sessions[client_id], self.members[client_id]


class Router:
    """Routes publishes to sessions by subscription, and to its ``peers``."""

    def __init__(self, sessions: dict[str, Session], peers: Peers | None = None) -> None:
        self.sessions = sessions
        self.subscriptions: SubscriptionTrie[str, Subscription] = SubscriptionTrie()
        self.shared: SubscriptionTrie[str, SharedGroup] = SubscriptionTrie()
        # By the publish's QoS (index 0, 1, 2): messages routed here (received from clients)
        # and deliveries made here; $SYS and the operations plane (node/admin) read them.
        self.routed_qos = [0, 0, 0]
        self.delivered_qos = [0, 0, 0]
        self.peers: Peers = peers or LocalPeers()
        self.forwarded_in = False  # routing a message another router forwarded

    @property
    def routed(self) -> int:
        """Messages routed here (the publishes of this router's clients)."""
        return sum(self.routed_qos)

    @property
    def delivered(self) -> int:
        """Deliveries made here."""
        return sum(self.delivered_qos)

    # ------------------------------------------------------------------ subscriptions

    def subscribe(self, session: Session, topic_filter: str, subscription: Subscription) -> bool:
        """Add or replace a subscription; True if it already existed (retain handling 1)."""
        existed = session.add_subscription(topic_filter, subscription)
        group, plain = parse_shared_filter(topic_filter)
        if not existed:
            self.peers.route_changed(True, group or "", plain)
        if group is None:
            self.subscriptions.add(plain, session.client_id, subscription)
        else:
            shared = self.shared.get(plain, group)
            if shared is None:
                shared = SharedGroup()
                self.shared.add(plain, group, shared)
            shared.add(session.client_id, subscription)
        return existed

    def unsubscribe(self, session: Session, topic_filter: str) -> bool:
        """Remove a subscription; False if the session had none on that filter."""
        if session.subscriptions.pop(topic_filter, None) is None:
            return False
        group, plain = parse_shared_filter(topic_filter)
        self.peers.route_changed(False, group or "", plain)
        if group is None:
            self.subscriptions.remove(plain, session.client_id)
        else:
            shared = self.shared.get(plain, group)
            if shared is not None:
                shared.remove(session.client_id)
                if not shared.members:
                    self.shared.remove(plain, group)
        return True

    def drop_session(self, session: Session, now: float) -> None:
        """Forget every subscription of an ending session; hand its shared messages on."""
        for topic_filter in list(session.subscriptions):
            self.unsubscribe(session, topic_filter)
        for group, message, qos in session.take_shared():
            self.deliver_shared(group, message, qos, now, exclude=session.client_id)

    # ------------------------------------------------------------------ publishing

    def publish(self, message: Message, now: float) -> int:
        """Route ``message`` here and to the peers that have a match. Returns receivers (here,
        plus one per peer it went to)."""
        qos = message.qos
        self.routed_qos[qos] += 1
        count = self._deliver_plain(message, now)
        shared = self.shared  # entry_count: no __len__ call per publish
        local: dict[SharedKey, SharedGroup] = _NO_GROUPS
        if shared.entry_count:
            local = {(group_name, topic_filter): group
                     for topic_filter, groups in shared.match(message.topic)
                     for group_name, group in groups.items() if group.members}
        here, peers = self.peers.route(message, local, now)
        for key in here:
            count += self._deliver_to_group(key, local[key], message, qos, now, None)
        self.delivered_qos[qos] += count
        return count + peers

    def publish_internal(self, message: Message, now: float) -> int:
        """Route a message the broker itself publishes ($SYS): not counted as received."""
        routed, delivered = list(self.routed_qos), list(self.delivered_qos)
        count = self.publish(message, now)
        self.routed_qos[:], self.delivered_qos[:] = routed, delivered
        return count

    def deliver_forwarded(
        self, message: Message, groups: list[SharedKey], now: float
    ) -> int:
        """A message another router routed: our plain subscribers, and one member of each
        shared group in ``groups`` (the sender chose us for those)."""
        self.forwarded_in = True  # for sessions that moved on (cluster/moving.py)
        count = self._deliver_plain(message, now)
        for key in groups:  # a group that emptied meanwhile: a member elsewhere takes it
            count += self.deliver_shared(key, message, message.qos, now, None)
        self.forwarded_in = False
        if not message.topic.startswith(SYS_PREFIX):  # $SYS counts only client traffic
            self.delivered_qos[message.qos] += count
        return count

    def _deliver_plain(self, message: Message, now: float) -> int:
        matches = self.subscriptions.match(message.topic)
        if not matches:
            return 0
        sessions = self.sessions
        sender = message.sender
        msg_qos = message.qos
        retain = message.retain
        if len(matches) == 1:  # common case: no overlap possible
            count = 0
            for client_id, sub in matches[0][1].items():
                opts = sub.options
                if opts.no_local and client_id == sender:
                    continue  # MQTT-3.8.3-3
                ids = None if sub.subscription_id is None else [sub.subscription_id]
                qos = opts.qos if opts.qos < msg_qos else msg_qos
                sessions[client_id].deliver(
                    message, qos, retain and opts.retain_as_published, ids, now
                )
                count += 1
            return count
        merged: dict[str, list] = {}
        for _, entries in matches:
            for client_id, sub in entries.items():
                opts = sub.options
                if opts.no_local and client_id == sender:
                    continue
                target = merged.get(client_id)
                if target is None:
                    target = merged[client_id] = [0, False, []]
                target[0] = max(target[0], min(opts.qos, msg_qos))
                target[1] = target[1] or (retain and opts.retain_as_published)
                if sub.subscription_id is not None:
                    target[2].append(sub.subscription_id)
        for client_id, (qos, retain_flag, ids) in merged.items():
            sessions[client_id].deliver(message, qos, retain_flag, ids or None, now)
        return len(merged)

    def has_members(self, key: SharedKey) -> bool:
        """Does the shared group ``key`` (name, filter) have members here?"""
        group = self.shared.get(key[1], key[0])
        return group is not None and bool(group.members)

    def deliver_shared(
        self, key: SharedKey, message: Message, qos: int, now: float, exclude: str | None
    ) -> int:
        """Deliver to one member of the shared group ``key`` (used on redistribution)."""
        group_name, topic_filter = key
        group = self.shared.get(topic_filter, group_name)
        delivered = 0 if group is None else self._deliver_to_group(
            key, group, message, qos, now, exclude)
        if not delivered:  # no member left here: one elsewhere, if a peer has one
            return self.peers.group_elsewhere(key, message, now)
        return delivered

    def _deliver_to_group(
        self, key: SharedKey, group: SharedGroup, message: Message, qos: int, now: float,
        exclude: str | None,
    ) -> int:
        chosen = group.choose(self.sessions, exclude)
        if chosen is None:
            return 0
        session, sub = chosen
        ids = None if sub.subscription_id is None else [sub.subscription_id]
        granted = min(sub.options.qos, qos)
        # Retained flag is cleared for shared deliveries unless retain-as-published.
        retain = message.retain and sub.options.retain_as_published
        session.deliver(message, granted, retain, ids, now, key)
        return 1

    def statistics(self) -> dict[str, int]:
        return {
            "subscriptions": len(self.subscriptions),
            "shared_groups": len(self.shared),
            "routed": self.routed,
            "delivered": self.delivered,
        }
