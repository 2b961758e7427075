"""Exceptions raised by the protocol layer.

    MQTTError
    ├── LocalProtocolError      we misused the API (a bug on our side)
    └── RemoteProtocolError     the peer broke the protocol; carries the reason code to send
        └── MalformedPacket     the bytes do not parse (0x81)

``InsufficientData`` is internal to the codec: it means "need more bytes" and never escapes
``receive_data()``.
"""

from __future__ import annotations

from meshmq.mqtt.reason_codes import ReasonCode


class MQTTError(Exception):
    """Root of every error the protocol layer raises."""


class LocalProtocolError(MQTTError):
    """Our side tried to do something the protocol forbids."""


class RemoteProtocolError(MQTTError):
    """The peer violated the protocol; ``reason_code`` is what to tell it (5.0)."""

    def __init__(self, message: str, reason_code: int = ReasonCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.reason_code = int(reason_code)


class NotConnect(RemoteProtocolError):
    """The first byte a client sent is not a CONNECT's (MQTT-3.1.0-1): HTTP, TLS, noise."""

    def __init__(self, first_byte: int) -> None:
        super().__init__(f"first byte 0x{first_byte:02X} is not CONNECT")
        self.first_byte = first_byte


class MalformedPacket(RemoteProtocolError):
    """The packet cannot be parsed as MQTT."""

    def __init__(self, message: str) -> None:
        super().__init__(message, ReasonCode.MALFORMED_PACKET)


class InsufficientData(Exception):
    """The buffer ends before the frame does; feed more bytes and try again."""
