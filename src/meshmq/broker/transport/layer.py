"""The plumbing shared by transport layers (TLS, WebSocket) stacked under ``ClientProtocol``.

Each layer is an ``asyncio.Protocol`` to the transport below and an ``asyncio.Transport`` to
the protocol above; these methods only pass flow control and buffer questions through.
"""

from __future__ import annotations

import asyncio
from typing import Any


def stream_transport(transport: asyncio.BaseTransport) -> asyncio.Transport:
    """The transport ``connection_made`` receives, typed as the stream transport it is.

    The asyncio stubs type that argument ``BaseTransport``, and uvloop's transports do not
    subclass ``asyncio.Transport``, so ``isinstance`` cannot narrow it; every stream transport,
    uvloop's included, has the ``Transport`` methods."""
    return transport  # type: ignore[return-value]  # the asyncio stubs and uvloop, above


class StackedLayer:
    below: Any  # asyncio.Transport | None
    inner: Any  # asyncio.BaseProtocol | None
    _closing: bool

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def close(self) -> None:
        """Close gracefully: each layer runs its own closing handshake, then its socket's."""
        raise NotImplementedError

    def abort(self) -> None:
        self._closing = True
        if self.below is not None:
            self.below.abort()

    def is_closing(self) -> bool:
        return self._closing or self.below is None or self.below.is_closing()

    def can_write_eof(self) -> bool:
        return False

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        if self.below is not None:
            self.below.set_write_buffer_limits(high, low)

    def get_write_buffer_size(self) -> int:
        return self.below.get_write_buffer_size() if self.below is not None else 0

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.inner = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.inner
