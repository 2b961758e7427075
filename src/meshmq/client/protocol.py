"""The client's side of one MQTT 5 connection, sans I/O: packets out as bytes, bytes in as packets.

It uses the broker's own codec (mqtt/codec.py), which encodes and decodes every packet type in
both directions. ``Framer.feed`` returns the complete packets a chunk of bytes finishes and
keeps the rest; anything that does not decode is a ``RemoteProtocolError`` and the connection
is dropped (the client then reconnects, as after any failure).
"""

from __future__ import annotations

from meshmq.mqtt.codec import decode_packet, encode_packet, parse_fixed_header
from meshmq.mqtt.errors import InsufficientData
from meshmq.mqtt.packets import MQTT_5, Packet


class Framer:
    """Splits the broker's bytes into packets (MQTT 5)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Packet]:
        buffer = self._buffer
        buffer += data
        packets: list[Packet] = []
        pos, end = 0, len(buffer)
        view = bytes(buffer)
        while pos < end:
            try:
                first, start, stop = parse_fixed_header(view, pos, end)
            except InsufficientData:
                break
            packets.append(decode_packet(first, view, start, stop, MQTT_5))
            pos = stop
        del buffer[:pos]
        return packets


def encode(packet: Packet) -> bytes:
    return encode_packet(packet, MQTT_5)
