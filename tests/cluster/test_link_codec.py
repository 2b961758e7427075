"""The mesh link protocol: the codec (cluster/codec.py) and message transfer (cluster/transfer.py).

Every byte from a peer is untrusted: what a peer sends either decodes to what was encoded or is a
``LinkError``, never another exception and never an allocation the bytes did not pay for.
Expected bytes and frames are built here with ``struct`` from the format in codec.py's docstring,
not taken from the code under test; the per-type readers below read bodies the way the handlers
in cluster/mesh.py do.
"""

from __future__ import annotations

import itertools
import math
import struct
import tracemalloc
from collections.abc import Callable, Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshmq.broker.message import OFFSET_PROPERTY, PARTITION_PROPERTY, Message
from meshmq.cluster.codec import (
    KNOWN_TYPES,
    MAX_FRAME,
    FrameReader,
    FrameType,
    LinkError,
    Reader,
    WireMessage,
    Writer,
    decode_message,
    encode_message,
    forward_frame,
    messages_blob,
    parse_forward,
    read_messages,
)
from meshmq.cluster.transfer import from_wire, message_body, to_wire
from meshmq.mqtt.codec import decode_properties, encode_properties
from meshmq.mqtt.properties import PacketKind, Properties, PropertyId

USER = PropertyId.USER_PROPERTY
EXPIRY = PropertyId.MESSAGE_EXPIRY_INTERVAL
BIG_COUNT = 2**32 - 1  # the largest u32 count or size a hostile peer can announce

# ---------------------------------------------------------------------- the format, by hand


def frame_bytes(frame_type: int, body: bytes) -> bytes:
    """``length (u32, type + body) | type (u8) | body``."""
    return struct.pack(">IB", len(body) + 1, frame_type) + body


def text_bytes(value: str) -> bytes:
    data = value.encode("utf-8")
    return struct.pack(">H", len(data)) + data


def blob_bytes(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def field_bytes(kind: str, value: object) -> bytes:
    if kind == "text":
        return text_bytes(value)  # type: ignore[arg-type]
    if kind == "blob":
        return blob_bytes(value)  # type: ignore[arg-type]
    if kind == "offsets":
        values: list[int] = value  # type: ignore[assignment]
        return struct.pack(">I", len(values)) + b"".join(struct.pack(">Q", v) for v in values)
    return struct.pack({"u8": ">B", "u16": ">H", "u32": ">I", "u64": ">Q"}[kind], value)


def message_bytes(message: WireMessage) -> bytes:
    """flags, qos, topic (u16-prefixed), [position u32 u64], sender (u16-prefixed),
    properties (u32-prefixed), payload (to the end)."""
    flags = (0x01 if message.retain else 0) | (0x02 if message.position is not None else 0)
    topic = message.topic.encode("utf-8")
    position = b"" if message.position is None else struct.pack(">IQ", *message.position)
    return (struct.pack(">BBH", flags, message.qos, len(topic)) + topic + position
            + text_bytes(message.sender) + blob_bytes(message.properties) + message.payload)


def raw_message(flags: int = 0, qos: int = 0, topic: bytes = b"t", sender: bytes = b"",
                properties: bytes = b"\x00", payload: bytes = b"") -> bytes:
    """A message body from raw parts (to build ones ``encode_message`` never would)."""
    return (struct.pack(">BBH", flags, qos, len(topic)) + topic
            + struct.pack(">H", len(sender)) + sender + blob_bytes(properties) + payload)


def feed_all(chunks: Iterable[bytes]) -> list[tuple[int, bytes]]:
    reader = FrameReader()
    frames: list[tuple[int, bytes]] = []
    for chunk in chunks:
        frames += reader.feed(chunk)
    return frames


def decode_props(block: bytes) -> Properties:
    props, end = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    assert end == len(block)
    return props


# ---------------------------------------------------------------------- strategies

unicode_text = st.text(alphabet=st.characters(codec="utf-8"), max_size=40)
mqtt_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"),
                    max_size=30)  # a 5.0 UTF-8 string: no U+0000


def _repeat(seed: bytes, size: int) -> bytes:
    return (seed * (size // len(seed) + 1))[:size]


payloads = st.one_of(
    st.binary(max_size=300),
    st.builds(_repeat, st.binary(min_size=1, max_size=16), st.integers(0, 64 * 1024)),
)
positions = st.none() | st.tuples(st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1))


def publish_properties(expiry: st.SearchStrategy[int]) -> st.SearchStrategy[Properties]:
    """Random valid 5.0 PUBLISH properties (what a publisher may send and a peer forwards)."""
    return st.fixed_dictionaries({}, optional={
        USER: st.lists(st.tuples(mqtt_text, mqtt_text), min_size=1, max_size=5),
        PropertyId.CONTENT_TYPE: mqtt_text,
        EXPIRY: expiry,
        PropertyId.CORRELATION_DATA: st.binary(max_size=64),
        PropertyId.RESPONSE_TOPIC: mqtt_text,
        PropertyId.PAYLOAD_FORMAT_INDICATOR: st.integers(0, 1),
    })


@st.composite
def wire_messages(draw: st.DrawFn, payload: st.SearchStrategy[bytes] = payloads,
                  ) -> tuple[WireMessage, Properties]:
    props = draw(publish_properties(st.integers(0, 2**32 - 1)))
    message = WireMessage(draw(unicode_text), draw(payload), draw(st.integers(0, 2)),
                          draw(st.booleans()), encode_properties(props), draw(unicode_text),
                          draw(positions))
    return message, props


small_messages = wire_messages(st.binary(max_size=64)).map(lambda pair: pair[0])
groups_lists = st.lists(st.tuples(unicode_text, unicode_text), max_size=5)

FIELDS = st.one_of(
    st.tuples(st.just("u8"), st.integers(0, 2**8 - 1)),
    st.tuples(st.just("u16"), st.integers(0, 2**16 - 1)),
    st.tuples(st.just("u32"), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("u64"), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("text"), unicode_text),
    st.tuples(st.just("blob"), st.binary(max_size=300)),
    st.tuples(st.just("offsets"), st.lists(st.integers(0, 2**64 - 1), max_size=8)),
)


@st.composite
def frame_lists(draw: st.DrawFn) -> list[tuple[int, bytes]]:
    """1-6 (type, body) frames: raw bodies (possibly empty) and real FORWARD bodies."""
    frames: list[tuple[int, bytes]] = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            frames.append((draw(st.sampled_from(FrameType)), draw(st.binary(max_size=80))))
        else:
            groups = draw(st.lists(st.tuples(unicode_text, unicode_text), max_size=2))
            head = struct.pack(">I", len(groups)) + b"".join(
                text_bytes(name) + text_bytes(topic_filter) for name, topic_filter in groups)
            frames.append((FrameType.FORWARD, head + message_bytes(draw(small_messages))))
    return frames


def stream_of(frames: list[tuple[int, bytes]]) -> bytes:
    return b"".join(frame_bytes(frame_type, body) for frame_type, body in frames)


# ---------------------------------------------------------------------- round trips


@given(st.lists(FIELDS, max_size=12), st.sampled_from(FrameType))
def test_writer_reader_round_trip_every_field_type(fields: list[tuple[str, object]],
                                                   frame_type: FrameType) -> None:
    writer = Writer()
    for kind, value in fields:
        getattr(writer, kind)(value)
    body = b"".join(field_bytes(kind, value) for kind, value in fields)
    frame = writer.frame(frame_type)
    assert frame == frame_bytes(frame_type, body)
    assert feed_all([frame]) == [(frame_type, body)]
    reader = Reader(body)
    assert [(kind, getattr(reader, kind)()) for kind, _ in fields] == fields
    reader.end()


@pytest.mark.parametrize("kind", ["u8", "u16", "u32", "u64", "text", "blob", "offsets"])
def test_reader_rejects_trailing_bytes_and_overruns(kind: str) -> None:
    value = {"u8": 0xAB, "u16": 0xABCD, "u32": 2**32 - 2, "u64": 2**64 - 2, "text": "héllo",
             "blob": b"\x00\x01", "offsets": [1, 2**64 - 1]}[kind]
    data = field_bytes(kind, value)
    reader = Reader(data + b"\x00")
    assert getattr(reader, kind)() == value
    with pytest.raises(LinkError):
        reader.end()
    for size in range(len(data)):
        with pytest.raises(LinkError):
            getattr(Reader(data[:size]), kind)()


def test_strings_at_the_u16_limit() -> None:
    longest = "é" * (65535 // 2) + "x"  # 65535 bytes of UTF-8
    body = b"".join(Writer().text(longest).parts)
    assert body[:2] == b"\xff\xff"
    assert Reader(body).text() == longest
    with pytest.raises(struct.error):  # refused here, never sent with a wrapped length
        Writer().text(longest + "x")
    with pytest.raises(struct.error):
        encode_message(WireMessage(longest + "x", b"", 0, False, b"\x00", ""))


@given(wire_messages())
def test_message_round_trip(drawn: tuple[WireMessage, Properties]) -> None:
    message, props = drawn
    body = encode_message(message)
    assert body == message_bytes(message)
    decoded = decode_message(body)
    assert decoded == message
    assert decode_props(decoded.properties) == props
    prefix = b"\xaa" * 11  # APPEND and RETAIN carry the message after their own fields
    assert decode_message(prefix + body, len(prefix)) == message


@given(groups_lists, wire_messages())
def test_forward_frame_round_trip(groups: list[tuple[str, str]],
                                  drawn: tuple[WireMessage, Properties]) -> None:
    message, _ = drawn
    body = encode_message(message)
    frame = forward_frame(groups, body)
    head = struct.pack(">I", len(groups)) + b"".join(
        text_bytes(name) + text_bytes(topic_filter) for name, topic_filter in groups)
    assert frame == frame_bytes(FrameType.FORWARD, head + body)
    assert feed_all([frame]) == [(FrameType.FORWARD, head + body)]
    assert parse_forward(head + body) == (groups, message)


@given(st.lists(small_messages, max_size=4), st.binary(max_size=60))
def test_messages_blob_round_trip(messages: list[WireMessage], head: bytes) -> None:
    bodies = [encode_message(message) for message in messages]
    data = b"".join(messages_blob(bodies).blob(head).parts)  # laid out as export_session does
    assert data == (struct.pack(">I", len(bodies)) + b"".join(blob_bytes(b) for b in bodies)
                    + blob_bytes(head))
    reader = Reader(data)
    assert read_messages(reader) == messages
    assert reader.blob() == head
    reader.end()


# ---------------------------------------------------------------------- the stream


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(frame_lists())
def test_frames_split_at_every_byte_boundary(frames: list[tuple[int, bytes]]) -> None:
    stream = stream_of(frames)
    assert feed_all([stream]) == frames  # several frames in one chunk
    for cut in range(len(stream) + 1):
        assert feed_all([stream[:cut], stream[cut:]]) == frames
    assert feed_all(stream[i:i + 1] for i in range(len(stream))) == frames


@given(frame_lists(), st.lists(st.integers(0, 2**16), max_size=12))
def test_each_chunk_returns_exactly_the_frames_it_completes(
        frames: list[tuple[int, bytes]], cuts: list[int]) -> None:
    stream = stream_of(frames)
    ends = list(itertools.accumulate(len(body) + 5 for _, body in frames))
    bounds = sorted({0, len(stream), *(cut % (len(stream) + 1) for cut in cuts)})
    reader = FrameReader()
    for start, stop in itertools.pairwise(bounds):
        completed = [frame for frame, end in zip(frames, ends, strict=True) if start < end <= stop]
        assert reader.feed(stream[start:stop]) == completed
        assert reader.feed(b"") == []


# ---------------------------------------------------------------------- each frame type
#
# A body per type, written as mesh.py writes it, and read as mesh.py's handler (or the answer
# callback of the request) reads it. Messages have an empty payload: a payload runs to the end
# of the body, so only then does every truncation leave a field incomplete.

MESSAGE = WireMessage("t/é", b"", 1, True, encode_properties({USER: [("k", "v")]}), "pub",
                      (1, 2))
PLAIN = WireMessage("r", b"", 0, False, b"\x00", "")
MESSAGE_BODY = encode_message(MESSAGE)


def read_hello(body: bytes) -> object:
    reader = Reader(body)
    values = (reader.u16(), reader.u16(), reader.text(), reader.offsets())
    reader.end()
    return values


def read_routes(body: bytes) -> object:
    reader = Reader(body)
    values = [(reader.u8(), reader.text(), reader.text()) for _ in range(reader.u32())]
    reader.end()
    return values


def read_append(body: bytes) -> object:
    reader = Reader(body)
    request_id, client_id = reader.u64(), reader.text()
    return request_id, client_id, decode_message(body, reader.pos)


def read_retain(body: bytes) -> object:
    reader = Reader(body)
    request_id = reader.u64()
    return request_id, decode_message(body, reader.pos)


def read_reply(body: bytes) -> object:
    reader = Reader(body)
    return reader.u64(), reader.u8(), reader.u32(), reader.u64(), reader.u32()


def read_query_retained(body: bytes) -> object:
    reader = Reader(body)
    request_id = reader.u64()
    filters = [reader.text() for _ in range(reader.u16())]
    reader.end()
    return request_id, filters


def read_retained(body: bytes) -> object:
    reader = Reader(body)
    request_id = reader.u64()
    return request_id, [(reader.u16(), decode_message(reader.blob()))
                        for _ in range(reader.u32())]


def read_claim(body: bytes) -> object:
    reader = Reader(body)
    values = (reader.u64(), reader.text(), bool(reader.u8()))
    reader.end()
    return values


def read_claimed(body: bytes) -> object:
    reader = Reader(body)
    return reader.u64(), reader.u8(), reader.blob()


def read_sync(body: bytes) -> object:
    return Reader(body).u64()


def read_synced(body: bytes) -> object:
    reader = Reader(body)
    return reader.u64(), reader.offsets()


def read_stats(body: bytes) -> object:
    reader = Reader(body)
    names = [reader.text() for _ in range(reader.u16())]
    values = reader.offsets()
    reader.end()
    return names, values


def read_deliver(body: bytes) -> object:
    reader = Reader(body)
    values = (reader.text(), reader.u8(), reader.u8(), reader.offsets(), reader.text(),
              reader.text())
    return (*values, decode_message(body, reader.pos))


def read_settled(body: bytes) -> object:
    reader = Reader(body)
    value = reader.text()
    reader.end()
    return value


def _with_message(writer: Writer, body: bytes) -> Writer:
    writer.parts.append(body)
    return writer


# type -> (the frame, how its body is read, what reading it gives, whether trailing bytes fail)
CASES: dict[FrameType, tuple[bytes, Callable[[bytes], object], object, bool]] = {
    FrameType.HELLO: (
        Writer().u16(1).u16(3).text("tökén").offsets([5, 0, 2**64 - 1]).frame(FrameType.HELLO),
        read_hello, (1, 3, "tökén", [5, 0, 2**64 - 1]), True),
    FrameType.ROUTES: (
        Writer().u32(2).u8(1).text("").text("a/+").u8(0).text("g").text("b/#")
        .frame(FrameType.ROUTES),
        read_routes, [(1, "", "a/+"), (0, "g", "b/#")], True),
    FrameType.FORWARD: (
        forward_frame([("g", "t/#"), ("h", "+/é")], MESSAGE_BODY),
        parse_forward, ([("g", "t/#"), ("h", "+/é")], MESSAGE), False),
    FrameType.APPEND: (
        _with_message(Writer().u64(7).text("client-é"), MESSAGE_BODY).frame(FrameType.APPEND),
        read_append, (7, "client-é", MESSAGE), False),
    FrameType.RETAIN: (
        _with_message(Writer().u64(8), encode_message(PLAIN)).frame(FrameType.RETAIN),
        read_retain, (8, PLAIN), False),
    FrameType.REPLY: (
        Writer().u64(9).u8(0).u32(4).u64(2**40).u32(3).frame(FrameType.REPLY),
        read_reply, (9, 0, 4, 2**40, 3), False),
    FrameType.QUERY_RETAINED: (
        Writer().u64(10).u16(2).text("a/#").text("+").frame(FrameType.QUERY_RETAINED),
        read_query_retained, (10, ["a/#", "+"]), True),
    FrameType.RETAINED: (
        Writer().u64(11).u32(2).u16(0).blob(MESSAGE_BODY).u16(1).blob(encode_message(PLAIN))
        .frame(FrameType.RETAINED),
        read_retained, (11, [(0, MESSAGE), (1, PLAIN)]), False),
    FrameType.CLAIM: (
        Writer().u64(12).text("c-1").u8(1).frame(FrameType.CLAIM),
        read_claim, (12, "c-1", True), True),
    FrameType.CLAIMED: (
        Writer().u64(13).u8(1).blob(b"session").frame(FrameType.CLAIMED),
        read_claimed, (13, 1, b"session"), False),
    FrameType.SYNC: (Writer().u64(14).frame(FrameType.SYNC), read_sync, 14, False),
    FrameType.SYNCED: (
        Writer().u64(15).offsets([3, 4]).frame(FrameType.SYNCED),
        read_synced, (15, [3, 4]), False),
    FrameType.STATS: (
        Writer().u16(2).text("a").text("b").offsets([1, 2]).frame(FrameType.STATS),
        read_stats, (["a", "b"], [1, 2]), True),
    FrameType.BARRIER: (Writer().u64(16).frame(FrameType.BARRIER), read_sync, 16, False),
    FrameType.BARRIER_DONE: (
        Writer().u64(17).offsets([5]).frame(FrameType.BARRIER_DONE), read_synced, (17, [5]),
        False),
    FrameType.DELIVER: (
        _with_message(Writer().text("c-é").u8(1).u8(1).offsets([7]).text("g").text("t/#"),
                      MESSAGE_BODY).frame(FrameType.DELIVER),
        read_deliver, ("c-é", 1, 1, [7], "g", "t/#", MESSAGE), False),
    FrameType.SETTLED: (
        Writer().text("c-1").frame(FrameType.SETTLED), read_settled, "c-1", True),
}


def test_every_frame_type_has_a_case() -> None:
    assert set(CASES) == set(FrameType) == set(range(1, 18))
    assert set(range(1, 18)) == KNOWN_TYPES


@pytest.mark.parametrize("frame_type", list(FrameType), ids=lambda t: t.name)
def test_frame_type_truncated_at_every_length(frame_type: FrameType) -> None:
    frame, read, expected, checks_end = CASES[frame_type]
    body = frame[5:]
    assert frame[:5] == struct.pack(">IB", len(body) + 1, frame_type)
    assert read(body) == expected
    for size in range(len(frame)):  # no frame and no error until the frame is complete
        reader = FrameReader()
        assert reader.feed(frame[:size]) == []
        assert reader.feed(frame[size:]) == [(frame_type, body)]
    for size in range(len(body)):  # a body that ends early, wherever, is a LinkError
        with pytest.raises(LinkError):
            read(body[:size])
    if checks_end:
        with pytest.raises(LinkError):
            read(body + b"\x00")


# ---------------------------------------------------------------------- hostile headers


@pytest.mark.parametrize("length", [0, MAX_FRAME + 1, 2**31, BIG_COUNT])
def test_frame_length_out_of_range(length: int) -> None:
    header = struct.pack(">IB", length, FrameType.FORWARD)
    with pytest.raises(LinkError):
        FrameReader().feed(header + b"body")
    reader = FrameReader()
    with pytest.raises(LinkError):  # at the latest once the header is complete
        for index in range(len(header)):
            reader.feed(header[index:index + 1])
    valid = frame_bytes(FrameType.SYNC, b"\x00" * 8)
    with pytest.raises(LinkError):
        FrameReader().feed(valid + header)


def test_frame_length_at_the_limit_waits_without_allocating_it() -> None:
    reader = FrameReader()
    tracemalloc.start()
    try:
        assert reader.feed(struct.pack(">IB", MAX_FRAME, FrameType.FORWARD)) == []
        assert reader.feed(b"\x00" * 4096) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * 1024


def test_unknown_frame_types() -> None:
    unknown = [value for value in range(256) if value not in KNOWN_TYPES]
    assert len(unknown) == 256 - len(FrameType)
    for value in unknown:
        with pytest.raises(LinkError):
            FrameReader().feed(frame_bytes(value, b"body"))
        with pytest.raises(LinkError):  # the body need not arrive for the type to be refused
            FrameReader().feed(struct.pack(">IB", 100, value))


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
def test_bad_utf8_is_a_link_error(bad: bytes) -> None:
    with pytest.raises(LinkError):
        Reader(struct.pack(">H", len(bad)) + bad).text()
    with pytest.raises(LinkError):
        decode_message(raw_message(topic=bad))
    with pytest.raises(LinkError):
        decode_message(raw_message(sender=bad))
    group = struct.pack(">H", len(bad)) + bad
    for head in (group + text_bytes("a/#"), text_bytes("g") + group):
        with pytest.raises(LinkError):
            parse_forward(struct.pack(">I", 1) + head + MESSAGE_BODY)
    hello = (struct.pack(">HH", 1, 2) + struct.pack(">H", len(bad)) + bad
             + struct.pack(">I", 0))
    with pytest.raises(LinkError):
        read_hello(hello)
    user = (b"\x26" + struct.pack(">H", len(bad)) + bad + text_bytes("v"))
    wire = decode_message(raw_message(properties=bytes([len(user)]) + user))
    with pytest.raises(LinkError):
        from_wire(wire, 0.0)


def test_bad_message_flags_and_qos() -> None:
    assert decode_message(raw_message(flags=0x01, qos=2)).retain
    for flags in range(256):
        if flags & ~0x03:
            with pytest.raises(LinkError):
                decode_message(raw_message(flags=flags))
    for qos in range(3, 256):
        with pytest.raises(LinkError):
            decode_message(raw_message(qos=qos))


def test_position_flag_without_position_is_a_link_error() -> None:
    with pytest.raises(LinkError):  # the flag claims 12 bytes the body does not have
        decode_message(struct.pack(">BBH", 0x02, 0, 1) + b"t" + b"\x00\x00")


@pytest.mark.parametrize("block", [
    b"",  # no block at all (to_wire always sends at least b"\x00")
    b"\x05\x26",  # a length running past the block
    b"\x02\x03\x00",  # a content type cut short
    b"\x02\x11\x00",  # session expiry: not a PUBLISH property
    b"\x02\x7f\x00",  # an unknown property
    b"\x02\x01\x07",  # payload format indicator out of range
    b"\x00\x00",  # trailing bytes after an empty block
    encode_properties({PropertyId.CONTENT_TYPE: "x"}) + b"\x01",  # trailing bytes
    b"\x06\x03\x00\x01x\x03\x00",  # a content type twice (and cut short)
    b"\x08\x03\x00\x01x\x03\x00\x01y",  # a content type twice
], ids=lambda b: b.hex() or "empty")
def test_bad_property_block_is_a_link_error(block: bytes) -> None:
    wire = decode_message(raw_message(properties=block))
    with pytest.raises(LinkError):
        from_wire(wire, 0.0)


def _bounded(call: Callable[[], object]) -> int:
    """Peak bytes allocated by ``call``, which must raise ``LinkError``."""
    tracemalloc.start()
    try:
        with pytest.raises(LinkError):
            call()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("what", ["offsets", "blob", "routes", "groups", "messages",
                                  "properties", "retained", "stats"])
def test_huge_announced_counts_allocate_nothing(what: str) -> None:
    big = struct.pack(">I", BIG_COUNT)
    calls: dict[str, Callable[[], object]] = {
        "offsets": lambda: Reader(big + b"\x00" * 16).offsets(),
        "blob": lambda: Reader(big + b"\x00" * 16).blob(),
        "routes": lambda: read_routes(big + b"\x01" + text_bytes("") + text_bytes("a")),
        "groups": lambda: parse_forward(big + MESSAGE_BODY),
        "messages": lambda: read_messages(Reader(big + blob_bytes(MESSAGE_BODY))),
        "properties": lambda: decode_message(struct.pack(">BBH", 0, 0, 1) + b"t"
                                             + text_bytes("") + big + b"\x00" * 16),
        "retained": lambda: read_retained(struct.pack(">Q", 1) + big),
        "stats": lambda: read_stats(struct.pack(">H", 1) + text_bytes("a") + big),
    }
    assert _bounded(calls[what]) < 64 * 1024


# ---------------------------------------------------------------------- random and mutated bytes


def _decode_everything(data: bytes) -> None:
    """Every entry point a peer's bytes reach; only ``LinkError`` may escape."""
    for decode in (
        lambda: from_wire(decode_message(data), 0.0),
        lambda: parse_forward(data),
        lambda: from_wire(parse_forward(data)[1], 0.0),
        lambda: read_messages(Reader(data)),
        lambda: read_append(data),
        lambda: read_retained(data),
        lambda: read_hello(data),
        lambda: read_routes(data),
        lambda: read_stats(data),
    ):
        try:
            decode()
        except LinkError:
            pass


def _mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Bit flips, byte sets, insertions, deletions and truncation at (position % length)."""
    out = bytearray(data)
    for op, where, value in edits:
        pos = where % (len(out) + 1)
        if op == 0 and pos < len(out):
            out[pos] ^= 1 << (value % 8)
        elif op == 1 and pos < len(out):
            out[pos] = value
        elif op == 2:
            out[pos:pos] = bytes([value])
        elif op == 3:
            del out[pos:pos + 1 + value % 8]
        elif op == 4:
            del out[pos:]
        else:
            out[pos:pos + 4] = [b"\xff\xff\xff\xff", b"\x00\x00\x00\x00",
                                b"\x00\x00\x00\x01", b"\x7f\xff\xff\xff"][value % 4]
    return bytes(out)


edits = st.lists(st.tuples(st.integers(0, 5), st.integers(0, 2**16), st.integers(0, 255)),
                 min_size=1, max_size=6)
FAST = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(st.binary(max_size=300), st.lists(st.integers(0, 300), max_size=6))
def test_random_bytes_to_the_frame_reader(data: bytes, cuts: list[int]) -> None:
    bounds = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    frames: list[tuple[int, bytes]] = []
    reader = FrameReader()
    try:
        for start, stop in itertools.pairwise(bounds):
            frames += reader.feed(data[start:stop])
    except LinkError:
        pass
    assert data.startswith(stream_of(frames))  # nothing invented, nothing reordered


@FAST
@given(frame_lists(), edits, st.lists(st.integers(0, 2**16), max_size=6))
def test_mutated_streams_to_the_frame_reader(frames: list[tuple[int, bytes]],
                                             changes: list[tuple[int, int, int]],
                                             cuts: list[int]) -> None:
    data = _mutate(stream_of(frames), changes)
    bounds = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    got: list[tuple[int, bytes]] = []
    reader = FrameReader()
    try:
        for start, stop in itertools.pairwise(bounds):
            got += reader.feed(data[start:stop])
    except LinkError:
        pass
    assert data.startswith(stream_of(got))
    for _, body in got:
        _decode_everything(body)


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_to_the_decoders(data: bytes) -> None:
    _decode_everything(data)


@FAST
@given(groups_lists, wire_messages(st.binary(max_size=32)), edits)
def test_mutated_bodies_to_the_decoders(groups: list[tuple[str, str]],
                                        drawn: tuple[WireMessage, Properties],
                                        changes: list[tuple[int, int, int]]) -> None:
    body = encode_message(drawn[0])
    _decode_everything(_mutate(body, changes))
    _decode_everything(_mutate(forward_frame(groups, body)[5:], changes))
    _decode_everything(_mutate(b"".join(messages_blob([body, body]).parts), changes))


# ---------------------------------------------------------------------- broker messages


def _hop(message: Message, sent_at: float, received_at: float) -> Message:
    """One crossing of a link: to_wire, bytes, from_wire."""
    return from_wire(decode_message(encode_message(to_wire(message, sent_at))), received_at)


@given(unicode_text, payloads, st.integers(0, 2), st.booleans(),
       publish_properties(st.integers(1, 2**32 - 1)),
       st.none() | unicode_text.filter(bool), positions, st.booleans())
def test_transfer_round_trip(topic: str, payload: bytes, qos: int, retain: bool,
                             props: Properties, sender: str | None,
                             position: tuple[int, int] | None, delivered: bool) -> None:
    """A message crosses a link with its properties as published (MQTT-3.3.2-17, -18) and its
    log position beside them, whether or not a receiver here asked for positions."""
    message = Message(topic, payload, qos, retain, dict(props), sender, now=0.0)
    if position is not None:
        message.set_position(*position)
    if delivered:  # deliveries here built both property blocks
        message.encoded_properties()
        message.encoded_positioned_properties()
    for positioned in (True, False):  # the encoder the mesh uses is the same bytes
        assert message_body(message, 0.0, positioned) == encode_message(
            to_wire(message, 0.0, positioned))
    received = _hop(message, 0.0, 0.0)
    assert (received.topic, received.payload, received.qos, received.retain,
            received.sender, received.position) == (topic, payload, qos, retain, sender,
                                                    position)
    assert decode_props(received.encoded_properties()) == props
    assert received.properties == props


@pytest.mark.parametrize("delivered", [False, True], ids=["fresh", "delivered"])
@pytest.mark.parametrize("own", [[], [("k", "v"), (PARTITION_PROPERTY.upper(), "x")]],
                         ids=["no-user-properties", "user-properties"])  # a look-alike stays
def test_log_position_is_never_mixed_into_the_properties(
        delivered: bool, own: list[tuple[str, str]]) -> None:
    """Over two hops the properties stay as published; a client that asked for positions gets
    the publisher's user properties and then the position, exactly once."""
    props: Properties = {USER: list(own)} if own else {}
    message = Message("a/b", b"x", 1, False, props, "pub", now=0.0)
    message.set_position(3, 2**40)
    if delivered:
        message.encoded_positioned_properties()
    first = _hop(message, 0.0, 0.0)
    if delivered:
        first.encoded_positioned_properties()
    second = _hop(first, 0.0, 0.0)
    for received in (message, first, second):
        assert received.position == (3, 2**40)
        assert decode_props(received.encoded_properties()) == props
        positioned = decode_props(received.encoded_positioned_properties())[USER]
        assert positioned == [*own, (PARTITION_PROPERTY, "3"), (OFFSET_PROPERTY, str(2**40))]
    assert props == ({USER: own} if own else {})  # the publisher's dict is not changed


@pytest.mark.parametrize(("interval", "sent_at", "remaining"), [
    (10, 5.0, 5),
    (10, 5.5, 5),  # 4.5 s left: rounded up, never cut short
    (10, 9.25, 1),
    (3600, 5.0, 3595),
    (2**32 - 1, 5.0, 2**32 - 6),
])
def test_message_expiry_counted_down(interval: int, sent_at: float, remaining: int) -> None:
    assert remaining == math.ceil(interval - sent_at)
    message = Message("t", b"p", 1, False, {EXPIRY: interval, USER: [("k", "v")]}, "c",
                      now=0.0)
    message.set_position(0, 1)
    wire = to_wire(message, sent_at)
    assert decode_props(wire.properties) == {EXPIRY: remaining, USER: [("k", "v")]}
    received = from_wire(decode_message(encode_message(wire)), 100.0)
    assert received.expires_at == 100.0 + remaining
    assert not received.expired(100.0 + remaining - 0.5)
    assert received.expired(100.0 + remaining)
    assert received.properties_for(100.0, None)[EXPIRY] == remaining


def test_message_without_properties_crosses_as_an_empty_block() -> None:
    message = Message("t", b"", 0, False, None, None, now=0.0)
    wire = to_wire(message, 1.0)
    assert wire.properties == b"\x00" and wire.sender == "" and wire.position is None
    received = _hop(message, 1.0, 2.0)
    assert received.properties == {} and received.sender is None
    assert received.expires_at is None
