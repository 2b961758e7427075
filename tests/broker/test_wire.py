"""The one byte form of a message (broker/wire.py): its body, and the ``Writer``/``Reader`` fields.

A body comes from a peer or a file: it either decodes to what was encoded or is a
``WireError``, never another exception and never an allocation the bytes did not pay for.
Expected bytes are built by hand (tests/wireformat.py) from the format in wire.py's docstring.
"""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshmq.broker.message import OFFSET_PROPERTY, PARTITION_PROPERTY, Message
from meshmq.broker.wire import Reader, WireError, Writer, decode_message, encode_message
from meshmq.mqtt.codec import decode_properties, encode_properties
from meshmq.mqtt.properties import PacketKind, Properties, PropertyId
from wireformat import (
    BIG_COUNT,
    EXPIRY,
    USER,
    edits,
    field_bytes,
    message_bytes,
    mutate,
    payloads,
    peak_allocation,
    positions,
    publish_properties,
    raw_message,
    text_bytes,
    unicode_text,
)

FAST = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])


def decode_props(block: bytes) -> Properties:
    props, end = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    assert end == len(block)
    return props


def property_block(body: bytes) -> bytes:
    """The property block of a body, found by hand from the documented layout."""
    flags, _, size = struct.unpack_from(">BBH", body)
    pos = 4 + size + (12 if flags & 0x02 else 0)
    pos += 2 + struct.unpack_from(">H", body, pos)[0]
    size = struct.unpack_from(">I", body, pos)[0]
    return body[pos + 4:pos + 4 + size]


def fields_of(message: Message) -> tuple[object, ...]:
    return (message.topic, message.payload, message.qos, message.retain, message.properties,
            message.sender, message.position, message.expires_at)


def _hop(message: Message, sent_at: float, received_at: float) -> Message:
    """One crossing of a link: a body made at ``sent_at``, read at ``received_at``."""
    return decode_message(encode_message(message, sent_at), received_at)


# ---------------------------------------------------------------------- Writer and Reader

FIELDS = st.one_of(
    st.tuples(st.just("u8"), st.integers(0, 2**8 - 1)),
    st.tuples(st.just("u16"), st.integers(0, 2**16 - 1)),
    st.tuples(st.just("u32"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("u64"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("text"), unicode_text),
    st.tuples(st.just("blob"), st.binary(max_size=300)),
    st.tuples(st.just("offsets"), st.lists(st.integers(0, 2**64 - 1), max_size=8)),
)


@given(st.lists(FIELDS, max_size=12), st.binary(max_size=8))
def test_writer_reader_round_trip_every_field_type(fields: list[tuple[str, object]],
                                                   prefix: bytes) -> None:
    writer = Writer()
    for kind, value in fields:
        assert getattr(writer, kind)(value) is writer  # chained, as the frames use it
    body = b"".join(field_bytes(kind, value) for kind, value in fields)
    assert writer.bytes() == body
    reader = Reader(body)
    assert [(kind, getattr(reader, kind)()) for kind, _ in fields] == fields
    reader.end()
    reader = Reader(prefix + body, len(prefix))  # fields after a caller's own
    assert [(kind, getattr(reader, kind)()) for kind, _ in fields] == fields
    reader.end()


@pytest.mark.parametrize("kind", ["u8", "u16", "u32", "u64", "text", "blob", "offsets"])
def test_reader_rejects_trailing_bytes_and_overruns(kind: str) -> None:
    value = {"u8": 0xAB, "u16": 0xABCD, "u32": 2**32 - 2, "u64": 2**64 - 2, "text": "héllo",
             "blob": b"\x00\x01", "offsets": [1, 2**64 - 1]}[kind]
    data = field_bytes(kind, value)
    reader = Reader(data + b"\x00")
    assert getattr(reader, kind)() == value
    with pytest.raises(WireError):
        reader.end()
    for size in range(len(data)):
        with pytest.raises(WireError):
            getattr(Reader(data[:size]), kind)()


@pytest.mark.parametrize(("kind", "too_big"), [
    ("u8", 2**8), ("u16", 2**16), ("u32", 2**32), ("u64", 2**64), ("u8", -1)])
def test_writer_refuses_values_that_do_not_fit(kind: str, too_big: int) -> None:
    with pytest.raises(struct.error):  # refused here, never sent wrapped around
        getattr(Writer(), kind)(too_big)


def test_strings_at_the_u16_limit() -> None:
    longest = "é" * (65535 // 2) + "x"  # 65535 bytes of UTF-8
    body = Writer().text(longest).bytes()
    assert body[:2] == b"\xff\xff"
    assert Reader(body).text() == longest
    with pytest.raises(struct.error):  # refused here, never sent with a wrapped length
        Writer().text(longest + "x")
    message = Message(longest, b"", 0, False, None, longest, now=0.0)
    assert decode_message(encode_message(message, 0.0), 0.0).topic == longest
    with pytest.raises(struct.error):
        encode_message(Message(longest + "x", b"", 0, False, None, None, now=0.0), 0.0)
    with pytest.raises(struct.error):  # the sender (a client id) too
        encode_message(Message("t", b"", 0, False, None, longest + "x", now=0.0), 0.0)


# ---------------------------------------------------------------------- message round trips


@given(unicode_text, payloads, st.integers(0, 2), st.booleans(),
       publish_properties(st.integers(1, 2**32 - 1)),
       st.none() | unicode_text.filter(bool), positions, st.booleans(), st.booleans())
def test_message_round_trip(topic: str, payload: bytes, qos: int, retain: bool,
                            props: Properties, sender: str | None,
                            position: tuple[int, int] | None, delivered: bool,
                            positioned: bool) -> None:
    """A message crosses with its properties as published (MQTT-3.3.2-17, -18) and its log
    position beside them (left out with ``positioned=False``)."""
    message = Message(topic, payload, qos, retain, dict(props), sender, now=0.0)
    if position is not None:
        message.set_position(*position)
    if delivered:  # deliveries here built both cached property blocks
        message.encoded_properties()
        message.encoded_positioned_properties()
    sent = position if positioned else None
    body = encode_message(message, 0.0, positioned)
    block = encode_properties(props) if props else b"\x00"
    assert body == message_bytes(topic, payload, qos, retain, block, sender or "", sent)
    prefix = b"\xaa" * 11  # APPEND and RETAIN carry the body after their own fields
    for received in (decode_message(body, 0.0), decode_message(prefix + body, 0.0, 11)):
        assert (received.topic, received.payload, received.qos, received.retain,
                received.sender, received.position) == (topic, payload, qos, retain, sender,
                                                        sent)
        assert received.properties == props
        assert decode_props(received.encoded_properties()) == props
        assert received.expires_at == message.expires_at  # made and read at the same time


@pytest.mark.parametrize(("interval", "sent_at", "remaining"), [
    (10, 5.0, 5),
    (10, 5.5, 5),  # 4.5 s left: rounded up, never cut short
    (10, 9.25, 1),
    (3600, 5.0, 3595),
    (2**32 - 1, 5.0, 2**32 - 6),
])
def test_message_expiry_counted_down(interval: int, sent_at: float, remaining: int) -> None:
    """The body carries the time left when it was made; the reader counts down from its own
    clock (MQTT-3.3.2-6)."""
    assert remaining == math.ceil(interval - sent_at)
    message = Message("t", b"p", 1, False, {EXPIRY: interval, USER: [("k", "v")]}, "c",
                      now=0.0)
    message.set_position(0, 1)
    body = encode_message(message, sent_at)
    assert decode_props(property_block(body)) == {EXPIRY: remaining, USER: [("k", "v")]}
    assert message.properties[EXPIRY] == interval  # the publisher's properties unchanged
    received = decode_message(body, 100.0)
    assert received.expires_at == 100.0 + remaining
    assert not received.expired(100.0 + remaining - 0.5)
    assert received.expired(100.0 + remaining)
    assert received.properties_for(100.0, None)[EXPIRY] == remaining


def test_message_without_properties_crosses_as_an_empty_block() -> None:
    message = Message("t", b"", 0, False, None, None, now=0.0)
    body = encode_message(message, 1.0)
    assert body == struct.pack(">BBH", 0, 0, 1) + b"t" + struct.pack(">HI", 0, 1) + b"\x00"
    received = decode_message(body, 2.0)
    assert received.properties == {} and received.sender is None
    assert received.expires_at is None and received.position is None


@pytest.mark.parametrize("delivered", [False, True], ids=["fresh", "delivered"])
@pytest.mark.parametrize("own", [[], [("k", "v"), (PARTITION_PROPERTY.upper(), "x")]],
                         ids=["no-user-properties", "user-properties"])  # a look-alike stays
def test_log_position_is_never_mixed_into_the_properties(
        delivered: bool, own: list[tuple[str, str]]) -> None:
    """Over two hops the properties stay as published and the position travels as its own
    field; a client that asked for positions gets the publisher's user properties and then
    the position, exactly once."""
    props: Properties = {USER: list(own)} if own else {}
    message = Message("a/b", b"x", 1, False, props, "pub", now=0.0)
    message.set_position(3, 2**40)
    if delivered:
        message.encoded_positioned_properties()
    body = encode_message(message, 0.0)
    assert property_block(body) == (encode_properties(props) if props else b"\x00")
    assert body[0] & 0x02 and struct.unpack_from(">IQ", body, 4 + 3) == (3, 2**40)
    first = decode_message(body, 0.0)
    if delivered:
        first.encoded_positioned_properties()
    second = _hop(first, 0.0, 0.0)
    for received in (message, first, second):
        assert received.position == (3, 2**40)
        assert received.properties == props
        assert decode_props(received.encoded_properties()) == props
        positioned = decode_props(received.encoded_positioned_properties())[USER]
        assert positioned == [*own, (PARTITION_PROPERTY, "3"), (OFFSET_PROPERTY, str(2**40))]
    assert props == ({USER: own} if own else {})  # the publisher's dict is not changed
    unpositioned = encode_message(message, 0.0, positioned=False)
    assert not unpositioned[0] & 0x02 and decode_message(unpositioned, 0.0).position is None


# ---------------------------------------------------------------------- hostile bodies

BAD_UTF8 = [
    b"\xff",  # never valid
    b"\x80",  # a lone continuation byte
    b"\xc0\xaf",  # an overlong "/"
    b"\xed\xa0\x80",  # an encoded surrogate
    b"\xe2\x82",  # a sequence cut short
    b"ok\xf4\x90\x80\x80",  # above U+10FFFF
]


@pytest.mark.parametrize("bad", BAD_UTF8, ids=lambda b: b.hex())
def test_bad_utf8_is_a_wire_error(bad: bytes) -> None:
    with pytest.raises(WireError):
        Reader(struct.pack(">H", len(bad)) + bad).text()
    with pytest.raises(WireError):
        decode_message(raw_message(topic=bad), 0.0)
    with pytest.raises(WireError):
        decode_message(raw_message(sender=bad), 0.0)
    user = b"\x26" + struct.pack(">H", len(bad)) + bad + text_bytes("v")
    with pytest.raises(WireError):
        decode_message(raw_message(properties=bytes([len(user)]) + user), 0.0)


def test_bad_message_flags_and_qos() -> None:
    assert decode_message(raw_message(flags=0x01, qos=2), 0.0).retain
    for flags in range(256):
        if flags & ~0x03:
            with pytest.raises(WireError):
                decode_message(raw_message(flags=flags), 0.0)
    for qos in range(3, 256):
        with pytest.raises(WireError):
            decode_message(raw_message(qos=qos), 0.0)


def test_position_flag_without_position_is_a_wire_error() -> None:
    with pytest.raises(WireError):  # the flag claims 12 bytes the body does not have
        decode_message(struct.pack(">BBH", 0x02, 0, 1) + b"t" + b"\x00\x00", 0.0)


@pytest.mark.parametrize("block", [
    b"",  # no block at all (an encoder always sends at least b"\x00")
    b"\x05\x26",  # a length running past the block
    b"\x02\x03\x00",  # a content type cut short
    b"\x02\x11\x00",  # session expiry: not a PUBLISH property
    b"\x02\x7f\x00",  # an unknown property
    b"\x02\x01\x07",  # payload format indicator out of range
    b"\x00\x00",  # trailing bytes after an empty block
    b"\x04\x03\x00\x01x\x01",  # trailing bytes after a content type
    b"\x06\x03\x00\x01x\x03\x00",  # a content type twice (and cut short)
    b"\x08\x03\x00\x01x\x03\x00\x01y",  # a content type twice
    b"\xff\xff\xff\xff\xff",  # a variable byte integer longer than four bytes
], ids=lambda b: b.hex() or "empty")
def test_bad_property_block_is_a_wire_error(block: bytes) -> None:
    with pytest.raises(WireError):
        decode_message(raw_message(properties=block), 0.0)


def test_sizes_running_past_the_body_are_wire_errors() -> None:
    """A length announcing more than is there is an error even where what is there would
    decode on its own (an empty property block, a shorter topic or sender)."""
    for announced in (2, 5, BIG_COUNT):
        with pytest.raises(WireError):
            decode_message(struct.pack(">BBH", 0, 0, 1) + b"t" + text_bytes("")
                           + struct.pack(">I", announced) + b"\x00", 0.0)
    with pytest.raises(WireError):
        decode_message(struct.pack(">BBH", 0, 0, 9) + b"t", 0.0)
    with pytest.raises(WireError):
        decode_message(struct.pack(">BBH", 0, 0, 1) + b"t" + struct.pack(">H", 9) + b"s", 0.0)


def test_every_truncation_is_a_wire_error() -> None:
    """With an empty payload every field of the body is needed: any prefix is an error.
    (A payload runs to the end: a body cut inside it is a shorter payload, by design.)"""
    block = encode_properties({USER: [("k", "v")], EXPIRY: 9})
    body = message_bytes("t/é", b"", 1, True, block, "pub", (1, 2))
    assert decode_message(body, 0.0).sender == "pub"
    for size in range(len(body)):
        with pytest.raises(WireError):
            decode_message(body[:size], 0.0)
        with pytest.raises(WireError):
            decode_message(b"\xaa" * 3 + body[:size], 0.0, 3)


@pytest.mark.parametrize("what", ["offsets", "blob", "properties", "sender", "topic"])
def test_huge_announced_sizes_allocate_nothing(what: str) -> None:
    big = struct.pack(">I", BIG_COUNT)
    head = struct.pack(">BBH", 0, 0, 1) + b"t"
    calls = {
        "offsets": lambda: Reader(big + b"\x00" * 16).offsets(),
        "blob": lambda: Reader(big + b"\x00" * 16).blob(),
        "properties": lambda: decode_message(head + text_bytes("") + big + b"\x00" * 16, 0.0),
        "sender": lambda: decode_message(head + b"\xff\xff" + b"\x00" * 16, 0.0),
        "topic": lambda: decode_message(b"\x00\x00\xff\xff" + b"\x00" * 16, 0.0),
    }
    assert peak_allocation(calls[what], WireError) < 64 * 1024


# ---------------------------------------------------------------------- random and mutated bytes


def _decode_anything(data: bytes) -> None:
    """A body from anywhere: a message or a ``WireError``, never another exception."""
    for pos in (0, min(3, len(data))):
        try:
            decode_message(data, 0.0, pos)
        except WireError:
            pass
    reader = Reader(data)
    try:
        reader.text(), reader.blob(), reader.offsets(), reader.u64(), reader.end()
    except WireError:
        pass


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_to_the_decoder(data: bytes) -> None:
    _decode_anything(data)


@FAST
@given(unicode_text, st.binary(max_size=32), st.integers(0, 2), st.booleans(),
       publish_properties(st.integers(1, 2**32 - 1)), unicode_text, positions, edits)
def test_mutated_bodies_to_the_decoder(topic: str, payload: bytes, qos: int, retain: bool,
                                       props: Properties, sender: str,
                                       position: tuple[int, int] | None,
                                       changes: list[tuple[int, int, int]]) -> None:
    block = encode_properties(props) if props else b"\x00"
    _decode_anything(mutate(message_bytes(topic, payload, qos, retain, block, sender, position),
                            changes))


def test_properties_cross_as_published_in_order() -> None:
    """Properties the broker has no use for (correlation data, content type) are carried as
    it came, in order with the user properties."""
    props: Properties = {PropertyId.CORRELATION_DATA: b"\x00\xff", USER: [("b", "1"), ("a", "2")],
                         PropertyId.CONTENT_TYPE: "x/y"}
    received = _hop(Message("t", b"", 0, False, props, None, now=0.0), 0.0, 0.0)
    assert received.properties == props
    assert received.properties[USER] == [("b", "1"), ("a", "2")]
