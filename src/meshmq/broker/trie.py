"""A topic-level trie of subscription filters, matched once per PUBLISH.

Theory of operation
-------------------
Each node is one filter level. Literal levels hang off ``children`` (a dict, created lazily);
the wildcards get their own slots, ``plus`` and ``hash``, so the hot loop reads attributes
instead of doing extra dict lookups. A node that ends at least one subscribed filter has
``entries``: a dict ``key -> value`` (e.g. client id -> subscription) and ``topic_filter``.

``match(topic)`` splits the topic into levels and advances a frontier of nodes one level at a
time: from each node it follows the literal child for the level and the ``+`` child, and
reports the ``#`` child on the spot. At the end it reports the frontier's own entries and their
``#`` children (``sport/#`` matches ``sport``). At level 0 the wildcards are skipped for topics
starting with '$' (MQTT-4.7.2-1). Cost is O(levels x wildcard branching), independent of the
number of subscriptions; no scan.

Match cache: results are cached per topic name in a plain dict of at most ``cache_size``
entries; when full it is cleared wholesale (no LRU bookkeeping on the hot path, and a workload
with more distinct hot topics than the cap just degrades to uncached walks). A result is a list
of ``(filter, entries)`` where ``entries`` is the node's live dict, so replacing a value or
adding/removing a key on a node that keeps at least one entry is visible through cached
results without invalidation. The cache is cleared exactly when the *set* of filters with
entries changes: a node gains its first entry or loses its last one. Callers must therefore
treat results as read-only and must not subscribe/unsubscribe while iterating one.

Removing the last entry of a node prunes it and every ancestor left with neither entries nor
children, so memory returns to the bare root after churn.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Final, Generic, TypeVar

K = TypeVar("K")
V = TypeVar("V")

DEFAULT_CACHE_SIZE: Final = 10_000


class _Node(Generic[K, V]):
    """One filter level; see the module docstring for the meaning of each slot."""

    __slots__ = ("children", "entries", "hash", "plus", "topic_filter")

    def __init__(self) -> None:
        self.children: dict[str, _Node[K, V]] | None = None
        self.plus: _Node[K, V] | None = None
        self.hash: _Node[K, V] | None = None
        self.entries: dict[K, V] | None = None
        self.topic_filter = ""  # the filter this node ends, once it has entries

    def child(self, level: str) -> _Node[K, V] | None:
        """The child for ``level`` ('+', '#' or literal), or None; the caller walks on."""
        if level == "+":
            return self.plus
        if level == "#":
            return self.hash
        children = self.children
        return None if children is None else children.get(level)

    def add_child(self, level: str) -> _Node[K, V]:
        """Create and attach an empty child for ``level``; the caller walks into it."""
        node: _Node[K, V] = _Node()
        if level == "+":
            self.plus = node
        elif level == "#":
            self.hash = node
        elif self.children is None:
            self.children = {level: node}
        else:
            self.children[level] = node
        return node

    def drop_child(self, level: str) -> None:
        """Detach the child for ``level``; the caller has checked it is empty."""
        if level == "+":
            self.plus = None
        elif level == "#":
            self.hash = None
        else:
            children = self.children
            assert children is not None
            del children[level]
            if not children:
                self.children = None

    def is_empty(self) -> bool:
        """True if nothing ends here or below, so the caller may prune this node."""
        return (
            self.entries is None and not self.children and self.plus is None and self.hash is None
        )


class SubscriptionTrie(Generic[K, V]):
    """Maps plain topic filters to ``{key: value}`` entries and matches topic names to them.

    Filters must already be validated and stripped of ``$share/{name}/``; topics passed to
    ``match`` must be valid topic names (no wildcards).
    """

    __slots__ = ("_cache", "_cache_size", "_nodes", "_root", "entry_count")

    def __init__(self, cache_size: int = DEFAULT_CACHE_SIZE) -> None:
        self._root: _Node[K, V] = _Node()
        self.entry_count = 0  # (filter, key) entries, as len(); read it, never set it
        self._nodes = 1  # including the root
        self._cache: dict[str, list[tuple[str, dict[K, V]]]] = {}
        self._cache_size = cache_size

    # ------------------------------------------------------------------ updates

    def add(self, topic_filter: str, key: K, value: V) -> bool:
        """Set ``value`` for ``key`` at ``topic_filter``; True if new, False if replaced."""
        node = self._root
        for level in topic_filter.split("/"):
            child = node.child(level)
            if child is None:
                child = node.add_child(level)
                self._nodes += 1
            node = child
        entries = node.entries
        if entries is None:
            node.entries = {key: value}
            node.topic_filter = topic_filter
            self.entry_count += 1
            self._cache.clear()  # a new filter now matches some topics
            return True
        new = key not in entries
        entries[key] = value  # live dict: cached results see it
        if new:
            self.entry_count += 1
        return new

    def remove(self, topic_filter: str, key: K) -> bool:
        """Drop ``key`` at ``topic_filter``, pruning emptied nodes; False if it was absent."""
        path: list[tuple[_Node[K, V], str]] = []
        node = self._root
        for level in topic_filter.split("/"):
            child = node.child(level)
            if child is None:
                return False
            path.append((node, level))
            node = child
        entries = node.entries
        if entries is None or key not in entries:
            return False
        del entries[key]
        self.entry_count -= 1
        if not entries:
            node.entries = None
            node.topic_filter = ""
            self._cache.clear()  # this filter no longer matches anything
            self._prune(path)
        return True

    def _prune(self, path: list[tuple[_Node[K, V], str]]) -> None:
        """Detach empty nodes from the end of ``path`` upwards, stopping at the first in use."""
        for parent, level in reversed(path):
            child = parent.child(level)
            if child is None or not child.is_empty():
                return
            parent.drop_child(level)
            self._nodes -= 1

    def clear(self) -> None:
        """Forget every filter and cached match."""
        self._root = _Node()
        self.entry_count = 0
        self._nodes = 1
        self._cache.clear()

    # ------------------------------------------------------------------ queries

    def get(self, topic_filter: str, key: K) -> V | None:
        """The value stored for ``key`` at exactly ``topic_filter`` (no wildcard matching)."""
        node: _Node[K, V] | None = self._root
        for level in topic_filter.split("/"):
            assert node is not None
            node = node.child(level)
            if node is None:
                return None
        entries = node.entries if node is not None else None
        return None if entries is None else entries.get(key)

    def match(self, topic: str) -> list[tuple[str, dict[K, V]]]:
        """Every ``(filter, entries)`` whose filter matches ``topic``; each filter once.

        The caller delivers to each entry. The list and dicts are shared with the cache and
        the trie: read them, never mutate them, and finish before changing subscriptions.
        """
        cache = self._cache
        result = cache.get(topic)
        if result is None:
            result = self._walk(topic)
            if len(cache) >= self._cache_size:
                cache.clear()  # wholesale: see the module docstring
                if not self._cache_size:
                    return result
            cache[topic] = result
        return result

    def _walk(self, topic: str) -> list[tuple[str, dict[K, V]]]:
        """Uncached match: advance a frontier of nodes one topic level at a time."""
        result: list[tuple[str, dict[K, V]]] = []
        levels = topic.split("/")
        if topic[:1] == "$":  # MQTT-4.7.2-1: the root's wildcards never match '$' topics
            children = self._root.children
            start = None if children is None else children.get(levels[0])
            if start is None:
                return result
            frontier = [start]
            del levels[0]
        else:
            frontier = [self._root]
        for level in levels:
            following: list[_Node[K, V]] = []
            for node in frontier:
                hash_node = node.hash
                if hash_node is not None and hash_node.entries:  # '#' matches the rest
                    result.append((hash_node.topic_filter, hash_node.entries))
                if node.plus is not None:
                    following.append(node.plus)
                children = node.children
                if children is not None:
                    child = children.get(level)
                    if child is not None:
                        following.append(child)
            if not following:
                return result
            frontier = following
        for node in frontier:
            if node.entries:
                result.append((node.topic_filter, node.entries))
            hash_node = node.hash
            if hash_node is not None and hash_node.entries:  # MQTT-4.7.1-1: parent level
                result.append((hash_node.topic_filter, hash_node.entries))
        return result

    def __len__(self) -> int:
        """Number of (filter, key) entries."""
        return self.entry_count

    def filters(self) -> Iterator[str]:
        """Every filter with at least one entry, in no particular order."""
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.entries:
                yield node.topic_filter
            if node.children:
                stack.extend(node.children.values())
            if node.plus is not None:
                stack.append(node.plus)
            if node.hash is not None:
                stack.append(node.hash)

    def statistics(self) -> dict[str, int]:
        """Sizes for monitoring: entries, trie nodes (root included), cached topics."""
        return {"entries": self.entry_count, "nodes": self._nodes, "cache_size": len(self._cache)}
