"""The ``properties`` column: an MQTT 5 property block as a ``map<string,string>``.

The log stores each publish's property block exactly as the broker encoded it (a varint
length then the properties; one ``0`` byte, or nothing at all, when there are none). This
module turns it into string pairs, with the MQTT codec's own decoder:

* every User Property (``name -> value``; when a name repeats the last value wins);
* ``content_type``, ``response_topic``, ``correlation_data`` (lower-case hex),
  ``payload_format`` (``"0"`` unspecified bytes, ``"1"`` UTF-8) and ``message_expiry``
  (seconds, as published) — these names win over a User Property with the same name;
* other identifiers (a topic alias, subscription identifiers) are dropped: they describe a
  connection, not the message.

A block that does not decode (which a broker never writes) is not an error for the reader:
its bytes are kept, hex-encoded, under ``malformed_properties`` so nothing is lost silently.
"""

from __future__ import annotations

from meshmq.mqtt.codec import decode_properties
from meshmq.mqtt.errors import MQTTError
from meshmq.mqtt.properties import PacketKind, PropertyId, get_property

MALFORMED_KEY = "malformed_properties"

_NAMED: dict[int, str] = {
    PropertyId.CONTENT_TYPE: "content_type",
    PropertyId.RESPONSE_TOPIC: "response_topic",
    PropertyId.CORRELATION_DATA: "correlation_data",
    PropertyId.PAYLOAD_FORMAT_INDICATOR: "payload_format",
    PropertyId.MESSAGE_EXPIRY_INTERVAL: "message_expiry",
}
_EMPTY: dict[str, str] = {}


def properties_map(block: bytes) -> dict[str, str]:
    """The ``properties`` column value for one stored property block (do not mutate it)."""
    if len(block) <= 1 and block in (b"", b"\x00"):
        return _EMPTY
    try:
        props, end = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    except MQTTError:
        return {MALFORMED_KEY: block.hex()}
    if end != len(block):
        return {MALFORMED_KEY: block.hex()}
    result: dict[str, str] = {}
    for name, text in get_property(props, PropertyId.USER_PROPERTY) or ():
        result[name] = text
    for pid, key in _NAMED.items():
        value = props.get(pid)
        if value is None:
            continue
        result[key] = value.hex() if isinstance(value, bytes) else str(value)
    return result
