"""Placeholder: the mesh is being written."""

from __future__ import annotations

from typing import Any


class Mesh:
    def __init__(self, broker: Any, worker: Any) -> None:
        self.broker = broker
        self.worker = worker

    async def start(self) -> None:
        return None
