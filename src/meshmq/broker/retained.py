"""Retained messages: at most one per topic, found by walking a filter through a level trie."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

M = TypeVar("M")


class _Node(Generic[M]):
    __slots__ = ("children", "message", "topic")

    def __init__(self) -> None:
        self.children: dict[str, _Node[M]] = {}
        self.message: M | None = None
        self.topic = ""


class RetainedStore(Generic[M]):
    """Topic -> retained message; ``match(filter)`` visits only branches the filter can reach."""

    def __init__(self) -> None:
        self._root: _Node[M] = _Node()
        self._count = 0

    def set(self, topic: str, message: M | None) -> None:
        """Retain ``message`` on ``topic``, or clear the topic when ``message`` is None."""
        levels = topic.split("/")
        if message is None:
            self._clear(levels)
            return
        node = self._root
        for level in levels:
            child = node.children.get(level)
            if child is None:
                child = node.children[level] = _Node()
            node = child
        if node.message is None:
            self._count += 1
        node.message = message
        node.topic = topic

    def _clear(self, levels: list[str]) -> None:
        path = [self._root]
        for level in levels:
            child = path[-1].children.get(level)
            if child is None:
                return
            path.append(child)
        if path[-1].message is None:
            return
        path[-1].message = None
        self._count -= 1
        for depth in range(len(levels), 0, -1):
            node = path[depth]
            if node.message is not None or node.children:
                break
            del path[depth - 1].children[levels[depth - 1]]

    def get(self, topic: str) -> M | None:
        node = self._root
        for level in topic.split("/"):
            node = node.children.get(level)  # type: ignore[assignment]
            if node is None:
                return None
        return node.message

    def match(self, topic_filter: str) -> list[M]:
        """Retained messages whose topic matches the (non-shared) ``topic_filter``."""
        result: list[M] = []
        self._walk(self._root, topic_filter.split("/"), 0, result)
        return result

    def _walk(self, node: _Node[M], levels: list[str], index: int, result: list[M]) -> None:
        if index == len(levels):
            if node.message is not None:
                result.append(node.message)
            return
        level = levels[index]
        if level == "#":
            if index > 0 and node.message is not None:
                result.append(node.message)  # "sport/#" matches "sport" (MQTT-4.7.1-1)
            self._collect(node, result, skip_dollar=index == 0)
            return
        if level == "+":
            for name, child in node.children.items():
                if index == 0 and name.startswith("$"):
                    continue  # MQTT-4.7.2-1
                self._walk(child, levels, index + 1, result)
            return
        child = node.children.get(level)
        if child is not None:
            self._walk(child, levels, index + 1, result)

    @staticmethod
    def _collect(node: _Node[M], result: list[M], skip_dollar: bool) -> None:
        stack = [
            child for name, child in node.children.items()
            if not (skip_dollar and name.startswith("$"))
        ]
        while stack:
            current = stack.pop()
            if current.message is not None:
                result.append(current.message)
            stack.extend(current.children.values())

    def __len__(self) -> int:
        return self._count

    def items(self) -> Iterator[tuple[str, M]]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.message is not None:
                yield node.topic, node.message
            stack.extend(node.children.values())

    def topics(self) -> Iterator[str]:
        return (topic for topic, _ in self.items())
