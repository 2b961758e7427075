"""Byte formats written by hand, for the tests of broker/wire.py, cluster/codec.py and
broker/snapshot.py.

Everything here is built with ``struct`` from the formats in those modules' docstrings, never
with the code under test, so a test compares the code against the documented layout. Also the
Hypothesis strategies and the byte mutator those tests share.
"""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable

from hypothesis import strategies as st

from meshmq.mqtt.properties import Properties, PropertyId

BIG_COUNT = 2**32 - 1  # the largest u32 count or size a hostile peer can announce


def text_bytes(value: str) -> bytes:
    """A string: ``u16 length | UTF-8``."""
    data = value.encode("utf-8")
    return struct.pack(">H", len(data)) + data


def blob_bytes(value: bytes) -> bytes:
    """A byte string: ``u32 length | bytes``."""
    return struct.pack(">I", len(value)) + value


def offsets_bytes(values: list[int]) -> bytes:
    """A list of u64: ``u32 count | u64*``."""
    return struct.pack(">I", len(values)) + b"".join(struct.pack(">Q", v) for v in values)


def field_bytes(kind: str, value: object) -> bytes:
    if kind == "text":
        return text_bytes(value)  # type: ignore[arg-type]
    if kind == "blob":
        return blob_bytes(value)  # type: ignore[arg-type]
    if kind == "offsets":
        return offsets_bytes(value)  # type: ignore[arg-type]
    return struct.pack({"u8": ">B", "u16": ">H", "u32": ">I", "u64": ">Q"}[kind], value)


def message_bytes(topic: str, payload: bytes, qos: int, retain: bool, properties: bytes,
                  sender: str = "", position: tuple[int, int] | None = None) -> bytes:
    """A message body: u8 flags (0x01 retain, 0x02 position) | u8 qos | u16 topic length |
    topic | [u32 partition | u64 offset] | u16 sender length | sender | u32 properties length
    | properties | payload (to the end)."""
    flags = (0x01 if retain else 0) | (0x02 if position is not None else 0)
    topic_data = topic.encode("utf-8")
    where = b"" if position is None else struct.pack(">IQ", *position)
    return (struct.pack(">BBH", flags, qos, len(topic_data)) + topic_data + where
            + text_bytes(sender) + blob_bytes(properties) + payload)


def raw_message(flags: int = 0, qos: int = 0, topic: bytes = b"t", sender: bytes = b"",
                properties: bytes = b"\x00", payload: bytes = b"") -> bytes:
    """A message body from raw parts (to build ones ``encode_message`` never would)."""
    return (struct.pack(">BBH", flags, qos, len(topic)) + topic
            + struct.pack(">H", len(sender)) + sender + blob_bytes(properties) + payload)


def frame_bytes(frame_type: int, body: bytes) -> bytes:
    """A link frame: ``u32 length (type + body) | u8 type | body``."""
    return struct.pack(">IB", len(body) + 1, frame_type) + body


def peak_allocation(call: Callable[[], object], error: type[Exception]) -> int:
    """Peak bytes allocated by ``call``, which must raise ``error``."""
    tracemalloc.start()
    try:
        try:
            call()
        except error:
            pass
        else:
            raise AssertionError(f"{call} did not raise {error.__name__}")
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


# ---------------------------------------------------------------------- strategies

USER = PropertyId.USER_PROPERTY
EXPIRY = PropertyId.MESSAGE_EXPIRY_INTERVAL

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
    return st.fixed_dictionaries({}, optional={  # type: ignore[arg-type]
        USER: st.lists(st.tuples(mqtt_text, mqtt_text), min_size=1, max_size=5),
        PropertyId.CONTENT_TYPE: mqtt_text,
        EXPIRY: expiry,
        PropertyId.CORRELATION_DATA: st.binary(max_size=64),
        PropertyId.RESPONSE_TOPIC: mqtt_text,
        PropertyId.PAYLOAD_FORMAT_INDICATOR: st.integers(0, 1),
    })


# ---------------------------------------------------------------------- mutations


def mutate(data: bytes, edits: list[tuple[int, int, int]]) -> bytes:
    """Bit flips, byte sets, insertions, deletions, truncation and 4-byte overwrites with
    extreme counts, at (position % length)."""
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
