"""A topic trie of subscription filters, matched against topic names in O(levels).

Theory of operation
-------------------
Each node is one topic level; a filter's entries (``key -> value``, e.g. client id ->
subscription) live on the node where the filter ends. ``match(topic)`` walks the topic's
levels, following at each node the literal child, the ``+`` child, and collecting the ``#``
child (which also matches the parent level, MQTT-4.7.1-1). At the first level, wildcards are
not followed for topics starting with ``$`` (MQTT-4.7.2-1).

Hot topics are served from a bounded cache (topic -> matched entry dicts). Any add or remove
clears the whole cache: subscription changes are rare next to publishes, and a wholesale clear
can never leave a stale result behind. The cached dicts are the live node dicts, so a replaced
value is seen at once; callers must not mutate them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

CACHE_LIMIT = 10_000


class _Node(Generic[K, V]):
    __slots__ = ("children", "entries", "topic_filter")

    def __init__(self) -> None:
        self.children: dict[str, _Node[K, V]] = {}
        self.entries: dict[K, V] = {}
        self.topic_filter = ""


class SubscriptionTrie(Generic[K, V]):
    """Topic filters -> {key: value}, with wildcard matching of topic names."""

    def __init__(self) -> None:
        self._root: _Node[K, V] = _Node()
        self._count = 0
        self._cache: dict[str, list[tuple[str, dict[K, V]]]] = {}

    def add(self, topic_filter: str, key: K, value: V) -> bool:
        """Store ``value`` for ``key`` on ``topic_filter``; True if the key is new there."""
        node = self._root
        for level in topic_filter.split("/"):
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        node.topic_filter = topic_filter
        is_new = key not in node.entries
        node.entries[key] = value
        if is_new:
            self._count += 1
            self._cache.clear()
        return is_new

    def remove(self, topic_filter: str, key: K) -> bool:
        """Remove ``key`` from ``topic_filter``; prune empty nodes. False if absent."""
        path = [self._root]
        for level in topic_filter.split("/"):
            child = path[-1].children.get(level)
            if child is None:
                return False
            path.append(child)
        if path[-1].entries.pop(key, _MISSING) is _MISSING:
            return False
        self._count -= 1
        self._cache.clear()
        levels = topic_filter.split("/")
        for depth in range(len(levels), 0, -1):
            node = path[depth]
            if node.entries or node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]
        return True

    def get(self, topic_filter: str, key: K) -> V | None:
        node = self._root
        for level in topic_filter.split("/"):
            node = node.children.get(level)  # type: ignore[assignment]
            if node is None:
                return None
        return node.entries.get(key)

    def match(self, topic: str) -> list[tuple[str, dict[K, V]]]:
        """(filter, entries) for every filter matching ``topic``; do not mutate the dicts."""
        cached = self._cache.get(topic)
        if cached is not None:
            return cached
        result: list[tuple[str, dict[K, V]]] = []
        levels = topic.split("/")
        self._walk(self._root, levels, 0, result, topic.startswith("$"))
        if len(self._cache) >= CACHE_LIMIT:
            self._cache.clear()
        self._cache[topic] = result
        return result

    def _walk(
        self, node: _Node[K, V], levels: list[str], index: int,
        result: list[tuple[str, dict[K, V]]], dollar: bool,
    ) -> None:
        children = node.children
        if not children:
            return
        wildcards_ok = not (dollar and index == 0)
        if wildcards_ok:
            hash_node = children.get("#")
            if hash_node is not None and hash_node.entries:
                result.append((hash_node.topic_filter, hash_node.entries))
        if index == len(levels):
            return
        last = index + 1 == len(levels)
        for child in (children.get(levels[index]), children.get("+") if wildcards_ok else None):
            if child is None:
                continue
            if last:
                if child.entries:
                    result.append((child.topic_filter, child.entries))
                hash_node = child.children.get("#")
                if hash_node is not None and hash_node.entries:
                    result.append((hash_node.topic_filter, hash_node.entries))
            else:
                self._walk(child, levels, index + 1, result, dollar)

    def __len__(self) -> int:
        return self._count

    def filters(self) -> Iterator[str]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.entries:
                yield node.topic_filter
            stack.extend(node.children.values())

    def statistics(self) -> dict[str, int]:
        nodes = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            nodes += 1
            stack.extend(node.children.values())
        return {"entries": self._count, "nodes": nodes, "cache": len(self._cache)}


_MISSING = object()
