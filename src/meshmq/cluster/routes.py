"""Routes across the mesh: which filters have subscribers where, and who serves a shared group.

Theory of operation
-------------------
``Routes`` is sans-I/O. It holds both sides of the route exchange:

* **ours**: the router reports every subscription added or removed (``local_change``); routes
  are counted per (group, filter), and only a filter's first subscriber and its last one's
  departure are news for the peers (``take_changes()`` gives the batch to send in a
  ``ROUTES`` frame; ``announce_all()`` the whole set for a new link);
* **theirs**: each peer's announced routes (``apply``), kept in two tries: plain filters →
  peers, and shared filters → group → peers. A peer whose link drops loses them (``forget``).

``targets(topic, local_groups)`` decides where a publish goes besides the local plain
subscribers: every peer with a matching plain route gets it once, and each shared group that
matches, wherever its members are, gets exactly one delivery, round robin over this worker (if it
has members) and the peers with members. It returns the groups to serve here and, per peer, the
groups that peer must serve.

**The node's routes** (a cluster of nodes, docs/cluster.md). Peers are this node's other
workers (``peer < REMOTE_BASE``) and other nodes (``peer >= REMOTE_BASE``: a node is one peer,
whichever of its workers carries the link). What another node hears from this worker is the
node's routes: the union of this worker's and its local peers' (``node_change``, counted per
(group, filter) across the node's workers; ``take_node_changes``, ``announce_node``). A message
that came from another node is passed on inside this node by ``relay_targets``: the local peers
with a plain match, and for each shared group the other node chose this node for, one worker of
this node with members (this one or a peer).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from meshmq.broker.trie import SubscriptionTrie
from meshmq.memo import remember

RouteKey = tuple[str, str]  # (group or "", filter)
RouteChange = tuple[bool, str, str]  # (added, group or "", filter)
LOCAL = -1  # "this worker" among the candidates of a shared group
REMOTE_BASE = 1 << 16  # peers from here up are other nodes (links between nodes)


class Routes:
    """This worker's routes, as announced, and its peers' routes, as heard."""

    def __init__(self) -> None:
        self._local: dict[RouteKey, int] = {}  # subscribers here per (group, filter)
        self._changes: list[RouteChange] = []
        self._peer_routes: dict[int, set[RouteKey]] = {}
        self.remote: SubscriptionTrie[int, bool] = SubscriptionTrie()
        self.remote_shared: SubscriptionTrie[str, set[int]] = SubscriptionTrie()
        self._turn: dict[RouteKey, int] = {}
        # plain_peers per topic, until the peers' plain routes change (every publish asks)
        self._plain: dict[str, frozenset[int]] = {}
        self._node: dict[RouteKey, int] = {}  # this node's workers with the route, per key
        self._node_changes: list[RouteChange] = []

    # ------------------------------------------------------------------ ours

    def local_change(self, added: bool, group: str, topic_filter: str) -> bool:
        """A subscription here was added or removed; True if the peers must hear of it
        (queued for ``take_changes``)."""
        key = (group, topic_filter)
        count = self._local.get(key, 0) + (1 if added else -1)
        if count > 0:
            self._local[key] = count
            if count == 1 and added:
                self._changes.append((True, group, topic_filter))
                self._node_change(key, 1)
                return True
        elif key in self._local:
            del self._local[key]
            self._changes.append((False, group, topic_filter))
            self._node_change(key, -1)
            return True
        return False

    # ------------------------------------------------------------------ the node's

    def _node_change(self, key: RouteKey, step: int) -> None:
        """One of this node's workers gained (1) or lost (-1) its route ``key``."""
        count = self._node.get(key, 0) + step
        if count > 0:
            self._node[key] = count
            if count == 1:
                self._node_changes.append((True, *key))
        elif key in self._node:
            del self._node[key]
            self._node_changes.append((False, *key))

    @property
    def node_pending(self) -> bool:
        return bool(self._node_changes)

    def take_node_changes(self) -> list[RouteChange]:
        """Changes of this node's routes, for the other nodes (then forgotten)."""
        changes, self._node_changes = self._node_changes, []
        return changes

    def announce_node(self) -> list[RouteChange]:
        """Every route of this node, for another node that just linked."""
        return [(True, group, topic_filter) for group, topic_filter in self._node]

    @property
    def pending(self) -> bool:
        return bool(self._changes)

    def take_changes(self) -> list[RouteChange]:
        """The route changes to announce to every peer, in order (then forgotten)."""
        changes, self._changes = self._changes, []
        return changes

    def announce_all(self) -> list[RouteChange]:
        """Every route this worker has, for a peer that just linked."""
        return [(True, group, topic_filter) for group, topic_filter in self._local]

    # ------------------------------------------------------------------ theirs

    def apply(self, peer: int, changes: Iterable[RouteChange]) -> None:
        """A ``ROUTES`` frame from ``peer``."""
        known = self._peer_routes.setdefault(peer, set())
        local = peer < REMOTE_BASE
        for added, group, topic_filter in changes:
            key = (group, topic_filter)
            if added and key not in known:
                known.add(key)
                self._add_remote(peer, key)
                if local:
                    self._node_change(key, 1)
            elif not added and key in known:
                known.discard(key)
                self._remove_remote(peer, key)
                if local:
                    self._node_change(key, -1)

    def replace(self, peer: int, changes: Iterable[RouteChange]) -> None:
        """``peer``'s whole route set (a node that linked again): routes it no longer has go,
        new ones come, those it still has stay in place throughout."""
        wanted = {(group, topic_filter) for added, group, topic_filter in changes if added}
        known = self._peer_routes.get(peer, set())
        self.apply(peer, [(False, group, topic_filter) for group, topic_filter in known
                          if (group, topic_filter) not in wanted]
                   + [(True, group, topic_filter) for group, topic_filter in wanted])

    def forget(self, peer: int) -> None:
        """``peer``'s link dropped: its routes go (it announces them again when it relinks)."""
        for key in self._peer_routes.pop(peer, set()):
            self._remove_remote(peer, key)
            if peer < REMOTE_BASE:
                self._node_change(key, -1)

    def peer_routes(self, peer: int) -> set[RouteKey]:
        return set(self._peer_routes.get(peer, ()))

    def _add_remote(self, peer: int, key: RouteKey) -> None:
        group, topic_filter = key
        if not group:
            self.remote.add(topic_filter, peer, True)
            self._plain.clear()
            return
        peers = self.remote_shared.get(topic_filter, group)
        if peers is None:
            self.remote_shared.add(topic_filter, group, {peer})
        else:
            peers.add(peer)

    def _remove_remote(self, peer: int, key: RouteKey) -> None:
        group, topic_filter = key
        if not group:
            self.remote.remove(topic_filter, peer)
            self._plain.clear()
            return
        peers = self.remote_shared.get(topic_filter, group)
        if peers is not None:
            peers.discard(peer)
            if not peers:
                self.remote_shared.remove(topic_filter, group)

    # ------------------------------------------------------------------ routing

    def plain_peers(self, topic: str) -> frozenset[int]:
        """Peers with a plain route matching ``topic`` (kept per topic until a peer's plain
        routes change: ``meshmq/memo.py``)."""
        found = self._plain.get(topic)
        if found is None:
            peers: set[int] = set()
            if self.remote.entry_count:
                for _, matched in self.remote.match(topic):
                    peers.update(matched)
            found = remember(self._plain, topic, frozenset(peers))
        return found

    def targets(self, topic: str, local_groups: Collection[RouteKey], linked: Collection[int],
                parked: Collection[int] = ()) -> tuple[list[RouteKey], dict[int, list[RouteKey]]]:
        """Where a publish on ``topic`` goes besides the local plain subscribers: the shared
        groups to serve here, and per linked peer the groups it serves (an empty list: plain
        subscribers only). ``local_groups``: the groups matching ``topic`` with members here.
        ``parked``: nodes that are down (what is routed there waits for them,
        cluster/resend.py): a group's message goes to a member that is up, to a parked node
        only when no member is up anywhere."""
        targets: dict[int, list[RouteKey]] = {p: [] for p in self.plain_peers(topic)
                                              if p in linked}
        here: list[RouteKey] = []
        remote = self.remote_shared.match(topic) if self.remote_shared.entry_count else ()
        if not remote and not local_groups:
            return here, targets
        remote_groups = {(name, f): peers for f, groups in remote
                         for name, peers in groups.items()}
        for key in sorted(set(local_groups) | remote_groups.keys()):
            candidates = [LOCAL] if key in local_groups else []
            peers = [p for p in remote_groups.get(key, ()) if p in linked]
            up = [p for p in peers if p not in parked] if parked else peers
            candidates += sorted(up if up or candidates else peers)
            if not candidates:
                continue
            chosen = self._next_in_turn(key, candidates)
            if chosen == LOCAL:
                here.append(key)
            else:
                targets.setdefault(chosen, []).append(key)
        return here, targets

    def relay_targets(self, topic: str, groups: Iterable[RouteKey],
                      local_groups: Collection[RouteKey], linked: Collection[int]
                      ) -> tuple[list[RouteKey], dict[int, list[RouteKey]]]:
        """A message another node sent this node: which of ``linked`` (this node's other
        workers) get it (plain matches), and for each of ``groups`` (the shared groups that
        node chose this node for) whether it is served here or by which peer."""
        targets: dict[int, list[RouteKey]] = {p: [] for p in self.plain_peers(topic)
                                              if p in linked}
        here: list[RouteKey] = []
        for key in groups:
            members = self.remote_shared.get(key[1], key[0]) or ()
            candidates = [LOCAL] if key in local_groups else []
            candidates += sorted(p for p in members if p in linked)
            if not candidates:
                here.append(key)  # gone meanwhile: served here (group_elsewhere) or dropped
                continue
            chosen = self._next_in_turn(key, candidates)
            if chosen == LOCAL:
                here.append(key)
            else:
                targets.setdefault(chosen, []).append(key)
        return here, targets

    def group_peer(self, key: RouteKey, linked: Collection[int]) -> int | None:
        """A peer with members of the shared group ``key`` (none left here), round robin."""
        peers = sorted(p for p in self.remote_shared.get(key[1], key[0]) or () if p in linked)
        return self._next_in_turn(key, peers) if peers else None

    def _next_in_turn(self, key: RouteKey, candidates: list[int]) -> int:
        turn = self._turn.get(key, 0)
        self._turn[key] = turn + 1
        return candidates[turn % len(candidates)]
