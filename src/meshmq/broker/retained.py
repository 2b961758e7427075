"""Retained messages: at most one per topic name, found by walking a filter through a level trie.

Each node is one topic level; a node holding a retained message also records its topic name.
A flat ``topic -> node`` index beside the trie makes ``get`` and replacing an existing retained
message O(1) (the common case on the publish path); only a new topic or a clear walks the trie.
``match(filter)`` follows literal levels by dict lookup, fans out over children only at '+',
and collects a whole subtree only at '#', so it visits just the branches the filter reaches.
Clearing a topic prunes nodes left with neither a message nor children.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

M = TypeVar("M")


class _Node(Generic[M]):
    """One topic level: children by level name (lazy), and the retained message, if any."""

    __slots__ = ("children", "message", "topic")

    def __init__(self) -> None:
        self.children: dict[str, _Node[M]] | None = None
        self.message: M | None = None
        self.topic: str | None = None


class RetainedStore(Generic[M]):
    """Topic name -> retained message, matched by plain (non-shared) topic filters."""

    __slots__ = ("_by_topic", "_nodes", "_root")

    def __init__(self) -> None:
        self._root: _Node[M] = _Node()
        self._by_topic: dict[str, _Node[M]] = {}
        self._nodes = 1  # including the root

    # ------------------------------------------------------------------ updates

    def set(self, topic: str, message: M | None) -> None:
        """Retain ``message`` on ``topic`` (replacing any), or clear the topic if None.

        The caller passes None for a retained PUBLISH with an empty payload (MQTT-3.3.1-6).
        """
        node = self._by_topic.get(topic)
        if message is None:
            if node is not None:
                self._clear(topic, node)
        elif node is not None:
            node.message = message  # MQTT-3.3.1-5: replaces the previous retained message
        else:
            node = self._create(topic)
            node.message = message
            node.topic = topic
            self._by_topic[topic] = node

    def _create(self, topic: str) -> _Node[M]:
        """Walk to ``topic``'s node, creating missing levels; the caller stores into it."""
        node = self._root
        for level in topic.split("/"):
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(level)
            if child is None:
                child = children[level] = _Node()
                self._nodes += 1
            node = child
        return node

    def _clear(self, topic: str, node: _Node[M]) -> None:
        """Drop ``topic``'s message and prune every node left empty on its path."""
        del self._by_topic[topic]
        node.message = None
        node.topic = None
        if node.children:
            return
        levels = topic.split("/")
        path = [self._root]
        for level in levels[:-1]:
            above = path[-1].children
            assert above is not None  # the path down to ``node``
            path.append(above[level])
        for depth in range(len(levels) - 1, -1, -1):
            parent = path[depth]
            children = parent.children
            assert children is not None
            del children[levels[depth]]
            self._nodes -= 1
            if children:
                return
            parent.children = None
            if parent.message is not None or depth == 0:
                return

    def clear(self) -> None:
        """Forget every retained message."""
        self._root = _Node()
        self._by_topic.clear()
        self._nodes = 1

    # ------------------------------------------------------------------ queries

    def get(self, topic: str) -> M | None:
        """The message retained on exactly ``topic``, or None."""
        node = self._by_topic.get(topic)
        return None if node is None else node.message

    def match(self, topic_filter: str) -> list[M]:
        """Messages whose topic matches the plain ``topic_filter``; the caller sends each.

        Honours '+', '#' (including the parent level) and MQTT-4.7.2-1: a filter starting with
        a wildcard does not match topics starting with '$'.
        """
        if "+" not in topic_filter and "#" not in topic_filter:
            message = self.get(topic_filter)
            return [] if message is None else [message]
        result: list[M] = []
        frontier = [self._root]
        for index, level in enumerate(topic_filter.split("/")):
            if level == "#":
                self._collect(frontier, index == 0, result)
                return result
            frontier = _descend(frontier, level, index == 0)
            if not frontier:
                return result
        for node in frontier:
            if node.message is not None:
                result.append(node.message)
        return result

    @staticmethod
    def _collect(frontier: list[_Node[M]], at_root: bool, result: list[M]) -> None:
        """Append every message at or below ``frontier`` ('#'); skip '$' topics at the root."""
        stack: list[_Node[M]] = []
        for node in frontier:
            if node.message is not None:
                result.append(node.message)  # "sport/#" matches "sport" (MQTT-4.7.1-1)
            children = node.children
            if children is None:
                continue
            if at_root:  # MQTT-4.7.2-1
                stack.extend(child for name, child in children.items() if name[:1] != "$")
            else:
                stack.extend(children.values())
        while stack:
            node = stack.pop()
            if node.message is not None:
                result.append(node.message)
            if node.children:
                stack.extend(node.children.values())

    def __len__(self) -> int:
        """Number of retained messages."""
        return len(self._by_topic)

    def __contains__(self, topic: object) -> bool:
        return topic in self._by_topic

    def topics(self) -> Iterator[str]:
        """Every topic with a retained message, in no particular order."""
        return iter(self._by_topic)

    def items(self) -> Iterator[tuple[str, M]]:
        """Every (topic, message) pair, in no particular order (e.g. for persistence)."""
        for topic, node in self._by_topic.items():
            if node.message is not None:  # (it is: only nodes holding one are listed)
                yield topic, node.message

    def statistics(self) -> dict[str, int]:
        """Sizes for monitoring: retained topics and trie nodes (root included)."""
        return {"topics": len(self._by_topic), "nodes": self._nodes}


def _descend(frontier: list[_Node[M]], level: str, at_root: bool) -> list[_Node[M]]:
    """Children of ``frontier`` matched by one filter ``level`` ('+' or literal)."""
    following: list[_Node[M]] = []
    for node in frontier:
        children = node.children
        if children is None:
            continue
        if level != "+":
            child = children.get(level)
            if child is not None:
                following.append(child)
        elif at_root:  # MQTT-4.7.2-1: '+' first level skips '$' topics
            following.extend(child for name, child in children.items() if name[:1] != "$")
        else:
            following.extend(children.values())
    return following
