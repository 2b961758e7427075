"""Property sets: the typed view (``get_property``) agrees with ``PROPERTY_TABLE`` and with what
the codec decodes; repeatable properties keep their order and place."""

from __future__ import annotations

from typing import get_args

import pytest

from meshmq.mqtt.codec import decode_properties, encode_varint
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.properties import (
    PROPERTY_TABLE,
    REPEATABLE,
    BytesProperty,
    IntProperty,
    PacketKind,
    PropertyId,
    StrProperty,
    SubscriptionIdentifier,
    UserProperty,
    WireType,
    get_property,
    pop_property,
)

# The wire types of each value-type group of mqtt/properties.py.
GROUPS = {
    IntProperty: {WireType.BYTE, WireType.TWO_BYTE, WireType.FOUR_BYTE},
    StrProperty: {WireType.UTF8},
    BytesProperty: {WireType.BINARY},
    UserProperty: {WireType.UTF8_PAIR},
    SubscriptionIdentifier: {WireType.VARINT},
}


def test_every_property_is_in_exactly_one_group_that_matches_its_wire_type() -> None:
    grouped = []
    for group, wires in GROUPS.items():
        for pid in get_args(group):
            assert PROPERTY_TABLE[pid][0] in wires, pid.name
            grouped.append(pid)
    assert sorted(grouped) == sorted(PROPERTY_TABLE)


def test_the_decoder_repeats_only_user_properties_and_subscription_identifiers() -> None:
    """decode_properties collects these two into lists; every other duplicate is an error."""
    assert set(REPEATABLE) == {PropertyId.USER_PROPERTY, PropertyId.SUBSCRIPTION_IDENTIFIER}
    pairs = [pid for pid, entry in PROPERTY_TABLE.items() if entry[0] is WireType.UTF8_PAIR]
    assert pairs == [PropertyId.USER_PROPERTY]


def _utf8(text: str) -> bytes:
    raw = text.encode()
    return len(raw).to_bytes(2, "big") + raw


def _block(*fields: bytes) -> bytes:
    body = b"".join(fields)
    return encode_varint(len(body)) + body


def test_decoded_values_have_the_types_get_property_promises() -> None:
    block = _block(
        b"\x01\x01",  # payload format indicator
        b"\x02\x00\x00\x00\x3c",  # message expiry interval 60
        b"\x03" + _utf8("text/plain"),  # content type
        b"\x08" + _utf8("reply/here"),  # response topic
        b"\x09\x00\x02\xca\xfe",  # correlation data
        b"\x23\x00\x07",  # topic alias 7
        b"\x26" + _utf8("k") + _utf8("v"),  # user property
    )
    props, end = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    assert end == len(block)
    assert get_property(props, PropertyId.PAYLOAD_FORMAT_INDICATOR) == 1
    assert get_property(props, PropertyId.MESSAGE_EXPIRY_INTERVAL) == 60
    assert get_property(props, PropertyId.CONTENT_TYPE) == "text/plain"
    assert get_property(props, PropertyId.RESPONSE_TOPIC) == "reply/here"
    assert get_property(props, PropertyId.CORRELATION_DATA) == b"\xca\xfe"
    assert get_property(props, PropertyId.USER_PROPERTY) == [("k", "v")]
    assert get_property(props, PropertyId.RECEIVE_MAXIMUM) is None
    assert get_property(props, PropertyId.RECEIVE_MAXIMUM, 65535) == 65535
    assert pop_property(props, PropertyId.TOPIC_ALIAS, None) == 7
    assert PropertyId.TOPIC_ALIAS not in props
    assert pop_property(props, PropertyId.TOPIC_ALIAS, None) is None


def test_repeated_properties_keep_their_order_and_the_place_of_the_first() -> None:
    block = _block(
        b"\x26" + _utf8("a") + _utf8("1"),
        b"\x0b\x05",  # subscription identifier 5
        b"\x03" + _utf8("text/plain"),
        b"\x26" + _utf8("b") + _utf8("2"),
        b"\x0b\x81\x01",  # subscription identifier 129
        b"\x26" + _utf8("a") + _utf8("3"),
    )
    props, _ = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    assert list(props) == [PropertyId.USER_PROPERTY, PropertyId.SUBSCRIPTION_IDENTIFIER,
                           PropertyId.CONTENT_TYPE]
    assert get_property(props, PropertyId.USER_PROPERTY) == [("a", "1"), ("b", "2"), ("a", "3")]
    assert get_property(props, PropertyId.SUBSCRIPTION_IDENTIFIER) == [5, 129]


@pytest.mark.parametrize(("field", "code"), [
    (b"\x23\x00\x00", 0x94),  # Topic Alias 0: Topic Alias invalid (MQTT-3.3.2-8)
    (b"\x0b\x00", 0x82),  # Subscription Identifier 0
    (b"\x01\x02", 0x82),  # Payload Format Indicator 2
])
def test_a_number_out_of_its_range_is_refused_with_its_reason_code(field: bytes,
                                                                    code: int) -> None:
    block = _block(field)
    with pytest.raises(RemoteProtocolError) as caught:
        decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    assert caught.value.reason_code == code
