"""Codec properties: round trips, truncation, chunking, garbage; plus spec rule examples."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshmq.mqtt.codec import (
    decode_frames,
    decode_packet,
    decode_properties,
    encode_packet,
    encode_properties,
    encode_varint,
    parse_fixed_header,
    with_topic_alias,
)
from meshmq.mqtt.errors import InsufficientData, MalformedPacket, RemoteProtocolError
from meshmq.mqtt.packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from meshmq.mqtt.properties import PROPERTY_TABLE, PacketKind, PropertyId, WireType

# ---------------------------------------------------------------- strategies

text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=20,
)
topic = st.text(alphabet="abc/$é", min_size=1, max_size=12)
packet_id = st.integers(1, 65535)
binary = st.binary(max_size=40)
user_props = st.lists(st.tuples(text, text), min_size=1, max_size=3)

_SCALAR = {
    WireType.BYTE: st.integers(0, 255),
    WireType.TWO_BYTE: st.integers(0, 65535),
    WireType.FOUR_BYTE: st.integers(0, 2**32 - 1),
    WireType.UTF8: text,
    WireType.BINARY: binary,
}


def properties_for(kind: PacketKind) -> st.SearchStrategy[dict]:
    """Random valid property sets for a packet kind (with multi-valued ids as lists)."""
    entries = {}
    for pid, (wire, kinds, bounds) in PROPERTY_TABLE.items():
        if kind not in kinds:
            continue
        if wire is WireType.UTF8_PAIR:
            entries[pid] = user_props
        elif wire is WireType.VARINT:
            many = 3 if kind is PacketKind.PUBLISH else 1
            entries[pid] = st.lists(st.integers(1, 268_435_455), min_size=1, max_size=many)
        elif bounds is not None:
            entries[pid] = st.integers(*bounds)
        else:
            entries[pid] = _SCALAR[wire]
    if not entries:
        return st.just({})
    return st.fixed_dictionaries({}, optional=entries)


def v5_or_empty(kind: PacketKind, version: int) -> st.SearchStrategy[dict]:
    return properties_for(kind) if version == 5 else st.just({})


@st.composite
def packets(draw, version: int | None = None):
    version = version or draw(st.sampled_from([4, 5]))
    v5 = version == 5
    choice = draw(st.integers(0, 14))
    if choice == 0:
        will = None
        if draw(st.booleans()):
            will = Will(draw(topic), draw(binary), draw(st.integers(0, 2)), draw(st.booleans()),
                        draw(v5_or_empty(PacketKind.WILL, version)))
        username = draw(st.none() | text)
        password = draw(st.none() | binary) if (username is not None or v5) else None
        packet = Connect(draw(text), version, draw(st.booleans()), draw(st.integers(0, 65535)),
                         username, password, will, draw(v5_or_empty(PacketKind.CONNECT, version)))
    elif choice == 1:
        code = draw(st.sampled_from([0, 0x80, 0x87]) if v5 else st.integers(0, 5))
        packet = Connack(draw(st.booleans()) and code == 0, code,
                         draw(v5_or_empty(PacketKind.CONNACK, version)))
    elif choice == 2:
        qos = draw(st.integers(0, 2))
        packet = Publish(draw(topic), draw(binary), qos, draw(st.booleans()),
                         draw(st.booleans()) and qos > 0, draw(packet_id) if qos else None,
                         draw(v5_or_empty(PacketKind.PUBLISH, version)))
    elif choice in (3, 4, 5, 6):
        cls, kind = [(Puback, PacketKind.PUBACK), (Pubrec, PacketKind.PUBREC),
                     (Pubrel, PacketKind.PUBREL), (Pubcomp, PacketKind.PUBCOMP)][choice - 3]
        acks = (PacketKind.PUBACK, PacketKind.PUBREC)
        codes = [0, 0x10, 0x80, 0x87] if kind in acks else [0, 0x92]
        packet = cls(draw(packet_id), draw(st.sampled_from(codes)) if v5 else 0,
                     draw(v5_or_empty(kind, version)))
    elif choice == 7:
        qos_only = st.builds(SubscriptionOptions, st.integers(0, 2))
        opts = st.builds(SubscriptionOptions, st.integers(0, 2), st.booleans(), st.booleans(),
                         st.integers(0, 2)) if v5 else qos_only
        packet = Subscribe(draw(packet_id), draw(st.lists(st.tuples(topic, opts), min_size=1,
                                                          max_size=4)),
                           draw(v5_or_empty(PacketKind.SUBSCRIBE, version)))
    elif choice == 8:
        codes = [0, 1, 2, 0x80, 0x87, 0x8F] if v5 else [0, 1, 2, 0x80]
        packet = Suback(draw(packet_id), draw(st.lists(st.sampled_from(codes), min_size=1,
                                                       max_size=4)),
                        draw(v5_or_empty(PacketKind.SUBACK, version)))
    elif choice == 9:
        packet = Unsubscribe(draw(packet_id), draw(st.lists(topic, min_size=1, max_size=4)),
                             draw(v5_or_empty(PacketKind.UNSUBSCRIBE, version)))
    elif choice == 10:
        codes = st.lists(st.sampled_from([0, 0x11, 0x80]), min_size=1, max_size=4)
        codes = draw(codes) if v5 else []
        packet = Unsuback(draw(packet_id), codes, draw(v5_or_empty(PacketKind.UNSUBACK, version)))
    elif choice == 11:
        packet = Pingreq()
    elif choice == 12:
        packet = Pingresp()
    elif choice == 13:
        packet = Disconnect(draw(st.sampled_from([0, 4, 0x80, 0x8E])) if v5 else 0,
                            draw(v5_or_empty(PacketKind.DISCONNECT, version)))
    else:
        if not v5:
            packet = Pingreq()
        else:
            packet = Auth(draw(st.sampled_from([0, 0x18, 0x19])),
                          draw(properties_for(PacketKind.AUTH)))
    return version, packet


def decode_one(frame: bytes, version: int):
    first, start, stop = parse_fixed_header(frame, 0, len(frame))
    assert stop == len(frame)
    return decode_packet(first, frame, start, stop, version)


# ---------------------------------------------------------------- properties


@given(packets())
def test_encode_decode_round_trip(case) -> None:
    version, packet = case
    assert decode_one(encode_packet(packet, version), version) == packet


@given(packets())
def test_every_truncated_prefix_needs_more_data(case) -> None:
    version, packet = case
    frame = encode_packet(packet, version)
    for cut in range(len(frame)):
        with pytest.raises(InsufficientData):
            parse_fixed_header(frame, 0, cut)


@given(st.lists(packets(version=5), min_size=1, max_size=5), st.data())
def test_chunked_feeding_equals_one_chunk(cases, data) -> None:
    """Feeding a stream in arbitrary pieces to the connection yields the same packets."""
    from meshmq.mqtt.connection import ServerConnection

    stream = encode_packet(Connect("c", 5), 5) + b"".join(
        encode_packet(p, 5) for _, p in cases if isinstance(p, Publish) and p.qos == 0
    )
    whole = ServerConnection(max_packet_size=10**6)
    whole.receive_data(stream)
    expected = whole.events_received()
    pieces = ServerConnection(max_packet_size=10**6)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    start = 0
    for cut in [*cuts, len(stream)]:
        pieces.receive_data(stream[start:cut])
        start = cut
    assert pieces.events_received() == expected
    assert repr(pieces.error) == repr(whole.error)
    assert pieces.data_to_send() == whole.data_to_send()
    assert_shared_empties_untouched()


@given(st.binary(max_size=200), st.sampled_from([4, 5]))
@settings(suppress_health_check=[HealthCheck.too_slow])
def test_random_bytes_raise_only_remote_protocol_errors(data: bytes, version: int) -> None:
    try:
        decode_frames(data, version)
    except (InsufficientData, RemoteProtocolError):
        pass


@given(st.binary(max_size=300))
def test_byte_at_a_time_equals_one_chunk_for_random_input(data: bytes) -> None:
    from meshmq.mqtt.connection import ServerConnection

    one = ServerConnection()
    one.receive_data(data)
    many = ServerConnection()
    for i in range(len(data)):
        many.receive_data(data[i : i + 1])
    assert many.events_received() == one.events_received()
    assert (many.error is None) == (one.error is None)
    if one.error is not None:
        assert many.error.reason_code == one.error.reason_code
    assert one.data_to_send() == many.data_to_send()  # (the answers to what was parsed)
    assert_shared_empties_untouched()


def assert_shared_empties_untouched() -> None:
    """The empty buffer and output lists every idle connection shares stay empty."""
    from meshmq.mqtt import connection

    assert connection._NO_BUFFER == [] and connection._NO_OUTPUT == []
    assert connection._NO_EVENTS == []


# ---------------------------------------------------------------- spec rules


def body(first: int, payload: bytes) -> bytes:
    return bytes([first]) + encode_varint(len(payload)) + payload


@pytest.mark.parametrize(
    "frame",
    [
        body(0x62, b"\x00\x01"),
    ],
)
def test_valid_pubrel_flags(frame: bytes) -> None:
    assert decode_one(frame, 4) == Pubrel(1)


@pytest.mark.parametrize(
    ("frame", "version", "why"),
    [
        (body(0x41, b"\x00\x01"), 4, "reserved flags on PUBACK"),
        (body(0x60, b"\x00\x01"), 4, "PUBREL without flag 0010"),
        (body(0x80, b"\x00\x01\x00\x01a\x00"), 4, "SUBSCRIBE without flag 0010"),
        (body(0x36, b"\x00\x01a\x00\x01"), 4, "PUBLISH QoS 3"),
        (body(0x38, b"\x00\x01a"), 4, "DUP on QoS 0"),
        (body(0x32, b"\x00\x01a\x00\x00"), 4, "packet id 0"),
        (body(0x30, b"\x00\x02\xc3\x28"), 4, "invalid UTF-8 in topic"),
        (body(0x30, b"\x00\x03\xed\xa0\x80"), 4, "UTF-16 surrogate in topic"),
        (body(0x30, b"\x00\x02a\x00"), 4, "U+0000 in topic"),
        (body(0x00, b""), 4, "reserved packet type 0"),
        (body(0x82, b"\x00\x01\x00\x01a\x04"), 4, "3.1.1 reserved subscription option bits"),
        (body(0x82, b"\x00\x01\x00\x00\x01a\xc0"), 5, "5.0 reserved subscription option bits"),
        (body(0x82, b"\x00\x01\x00\x00\x01a\x30"), 5, "retain handling 3"),
        (body(0x30, b"\x00\x01a\x05\x01\x01\x01\x01\x01"), 5, "duplicate property"),
        (body(0x30, b"\x00\x01a\x02\x11\x00"), 5, "property not allowed in PUBLISH"),
        (body(0x30, b"\x00\x01a\x02\x7f\x00"), 5, "unknown property id"),
        (body(0xC0, b"\x00"), 4, "PINGREQ with a body"),
        (body(0xF0, b""), 4, "AUTH in 3.1.1"),
        (b"\x30\xff\xff\xff\xff\x01", 4, "remaining length of five bytes"),
    ],
)
def test_malformed_frames_are_rejected(frame: bytes, version: int, why: str) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_frames(frame, version)


def test_connect_reserved_flag_and_password_rules() -> None:
    good = encode_packet(Connect("c", 4, username="u", password=b"p"), 4)
    assert decode_one(good, 4).username == "u"
    flags_at = 2 + 6 + 1  # fixed header, "MQTT" string, level
    bad = bytearray(good)
    bad[flags_at] |= 0x01  # MQTT-3.1.2-3
    with pytest.raises(MalformedPacket):
        decode_one(bytes(bad), 4)
    no_user = encode_packet(Connect("c", 5, password=b"p"), 5)  # allowed in 5.0
    assert decode_one(no_user, 5).password == b"p"
    bad311 = bytearray(encode_packet(Connect("c", 4, username="u", password=b"p"), 4))
    bad311[flags_at] &= ~0x80  # password without user name: MQTT-3.1.2-22
    with pytest.raises(RemoteProtocolError):
        decode_one(bytes(bad311), 4)


def test_unsupported_protocol_level_reason_code() -> None:
    frame = bytearray(encode_packet(Connect("c", 4), 4))
    frame[8] = 6
    with pytest.raises(RemoteProtocolError) as info:
        decode_one(bytes(frame), 4)
    assert info.value.reason_code == 0x84


def test_subscription_identifier_zero_is_a_protocol_error() -> None:
    frame = body(0x82, b"\x00\x01\x02\x0b\x00\x00\x01a\x00")
    with pytest.raises(RemoteProtocolError) as info:
        decode_frames(frame, 5)
    assert info.value.reason_code == 0x82


def test_multiple_user_properties_keep_order() -> None:
    pub = Publish("t", b"x", properties={PropertyId.USER_PROPERTY: [("a", "1"), ("a", "2")]})
    assert decode_one(encode_packet(pub, 5), 5).properties[PropertyId.USER_PROPERTY] == [
        ("a", "1"), ("a", "2")
    ]


@given(properties_for(PacketKind.PUBLISH).map(lambda p: {k: v for k, v in p.items()
                                                          if k != PropertyId.TOPIC_ALIAS}),
       st.integers(1, 65535), st.integers(0, 300))
def test_with_topic_alias_adds_the_alias_to_an_encoded_block(props: dict, alias: int,
                                                            padding: int) -> None:
    """The send path's shortcut: the same as encoding the properties with the alias, for
    blocks whose length takes one byte or more, before and after (``padding`` crosses 127)."""
    if padding:
        props = {**props, PropertyId.USER_PROPERTY: [("p", "x" * padding)]}
    block = with_topic_alias(encode_properties(props), alias)
    decoded, end = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    assert end == len(block)
    assert decoded == {**props, PropertyId.TOPIC_ALIAS: alias}
