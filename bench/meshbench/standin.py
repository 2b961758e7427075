"""A stand-in for a socket transport: what the tcp listener's protocol uses of one, with no
socket, so that a benchmark drives meshmq's own code in-process (``connect_cost.py
--python``, ``publish_cost.py``)."""

from __future__ import annotations

import asyncio


class StandInTransport:
    """Counts what the protocol writes (``written``) and, with ``keep``, keeps it (``take``)."""

    def __init__(self, number: int, keep: bool = False) -> None:
        self.peer = ("127.0.0.1", 1024 + number % 60000)
        self.written = 0
        self.keep = keep
        self.chunks: list[bytes] = []
        self.protocol: asyncio.BaseProtocol | None = None

    def get_extra_info(self, name: str, default: object = None) -> object:
        return self.peer if name == "peername" else default

    def write(self, data: bytes) -> None:
        self.written += len(data)
        if self.keep:
            self.chunks.append(bytes(data))

    def writelines(self, chunks: list[bytes]) -> None:
        for chunk in chunks:
            self.write(chunk)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:  # (more than a turn's packets in one read: the rest is
        pass  # parsed next turn, and nothing more arrives meanwhile)

    def resume_reading(self) -> None:
        pass

    def take(self) -> bytes:
        """What was written since the last call (``keep`` only)."""
        data = b"".join(self.chunks)
        self.chunks.clear()
        return data
