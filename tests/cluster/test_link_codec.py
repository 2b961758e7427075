"""The mesh link protocol (cluster/codec.py): every frame type, the stream, hostile input.

Every byte from a peer is untrusted: what a peer sends either decodes to what was encoded or is a
``LinkError``, never another exception and never an allocation the bytes did not pay for.
Expected frames are built here with ``struct`` from the layouts in codec.py (tests/wireformat.py),
not taken from the code under test. A message inside a frame is an opaque body (broker/wire.py,
tests/broker/test_wire.py); where a frame carries one, it is decoded here as the handler would.
"""

from __future__ import annotations

import dataclasses
import itertools
import struct
import tracemalloc
from collections.abc import Callable, Iterable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshmq.broker.wire import decode_message
from meshmq.cluster.codec import (
    FRAMES,
    KNOWN_TYPES,
    MAX_FRAME,
    Admin,
    AdminAnswer,
    Append,
    AppendAnswer,
    Appended,
    Barrier,
    BarrierDone,
    Claim,
    Claimed,
    Deliver,
    Fetch,
    Forget,
    Forward,
    ForwardAck,
    ForwardAt,
    FrameReader,
    FrameType,
    Hello,
    LinkAuth,
    LinkError,
    LinkHello,
    LogData,
    LogRead,
    Members,
    NodeAppend,
    NodeAppendAnswer,
    NodeAppended,
    NodeAppendEntry,
    NodeStats,
    Ping,
    QueryRetained,
    Register,
    Release,
    Reply,
    Retain,
    Retained,
    RetainSync,
    Routes,
    ServiceOffer,
    ServiceReplied,
    ServiceReply,
    ServiceRequest,
    ServiceSync,
    SessionFetch,
    SessionMoved,
    SessionOwned,
    SessionOwner,
    SessionPart,
    Settled,
    Stats,
    Sync,
    Synced,
    Takeover,
    Writer,
    decode_frame,
    forward_frame,
)
from meshmq.mqtt.codec import encode_properties
from wireformat import (
    BIG_COUNT,
    USER,
    blob_bytes,
    edits,
    frame_bytes,
    message_bytes,
    mutate,
    offsets_bytes,
    peak_allocation,
    text_bytes,
    unicode_text,
)

FAST = settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])

# Messages with an empty payload: a payload runs to the end of the body, so only then does every
# truncation leave a field incomplete.
MESSAGE_BODY = message_bytes("t/é", b"", 1, True, encode_properties({USER: [("k", "v")]}),
                             "pub", (1, 2))
PLAIN_BODY = message_bytes("r", b"", 0, False, b"\x00")


def feed_all(chunks: Iterable[bytes]) -> list[tuple[int, bytes]]:
    reader = FrameReader()
    frames: list[tuple[int, bytes]] = []
    for chunk in chunks:
        frames += reader.feed(chunk)
    return frames


def messages_in(frame: object) -> list[bytes]:
    """The message bodies a frame carries (each decoded by whoever handles the frame)."""
    if isinstance(frame, Forward | Retain | Deliver | ServiceRequest | ServiceReply):
        return [frame.message]
    if isinstance(frame, ForwardAt):
        return [frame.forward.message]
    if isinstance(frame, NodeAppend):
        return [entry.message for entry in frame.entries]
    if isinstance(frame, Append):
        return [body for _, _, _, _, body in frame.entries]
    if isinstance(frame, Retained):
        return [body for _, body in frame.found]
    return []


def read(frame_type: int, body: bytes) -> object:
    """A body read as the mesh's handler reads it: the frame, then any message in it."""
    frame = decode_frame(frame_type, body)
    for message in messages_in(frame):
        decode_message(message, 0.0)
    return frame


def u(fmt: str, *values: int) -> bytes:
    return struct.pack(">" + fmt, *values)


# ---------------------------------------------------------------------- one case per frame
#
# (frame, its body written by hand, whether its decode checks the end of the body). Frames
# ending with a message body do not: the message (its payload) runs to the end by design.

CASES: list[tuple[object, bytes, bool]] = [
    (Hello(1, 3, "tökén", {7: 0, 0: 5, 2: 2**64 - 1}),
     u("HH", 1, 3) + text_bytes("tökén") + u("I", 3) + u("IQ", 0, 5) + u("IQ", 2, 2**64 - 1)
     + u("IQ", 7, 0), True),  # highs sorted by partition
    (Hello(0, 1, "", {}), u("HHHI", 0, 1, 0, 0), True),
    (Routes([(True, "", "a/+"), (False, "g", "b/#")]),
     u("IB", 2, 1) + text_bytes("") + text_bytes("a/+") + u("B", 0) + text_bytes("g")
     + text_bytes("b/#"), True),
    (Forward([("g", "t/#"), ("h", "+/é")], MESSAGE_BODY),
     u("I", 2) + text_bytes("g") + text_bytes("t/#") + text_bytes("h") + text_bytes("+/é")
     + MESSAGE_BODY, False),
    (Forward([], PLAIN_BODY), u("I", 0) + PLAIN_BODY, False),  # the hot case: no groups
    (Forward([], PLAIN_BODY, True), u("I", 1 << 31) + PLAIN_BODY, False),  # flag kept
    (Append([(7, "client-é", b"\x01" * 16, False, MESSAGE_BODY),
             (8, "", bytes(range(16)), True, PLAIN_BODY)]),
     u("IQ", 2, 7) + b"\x01" * 16 + u("B", 0) + text_bytes("client-é")
     + blob_bytes(MESSAGE_BODY) + u("Q", 8) + bytes(range(16)) + u("B", 1) + text_bytes("")
     + blob_bytes(PLAIN_BODY), True),
    (Append([]), u("I", 0), True),
    (Appended([AppendAnswer(7, 0, 3, 2**40, 2, [("g", "t/#")]), AppendAnswer(8, 0x80),
               AppendAnswer(9, 0, 1, 5, 0, [])]),
     u("I", 3) + u("QBIQIB", 7, 0, 3, 2**40, 2, 1) + u("I", 1) + text_bytes("g")
     + text_bytes("t/#") + u("QBIQIB", 8, 0x80, 0, 0, 0, 0) + u("QBIQIBI", 9, 0, 1, 5, 0, 1, 0),
     True),
    (Retain(8, True, PLAIN_BODY), u("QB", 8, 1) + PLAIN_BODY, False),
    (Reply(9, 0x97, 4, 2**40, 3), u("QBIQI", 9, 0x97, 4, 2**40, 3), True),
    (Reply(10, 0), u("QBIQI", 10, 0, 0, 0, 0), True),
    (QueryRetained(11, ["a/#", "+"]), u("QH", 11, 2) + text_bytes("a/#") + text_bytes("+"),
     True),
    (Retained(12, [(0, MESSAGE_BODY), (1, PLAIN_BODY)]),
     u("QI", 12, 2) + u("H", 0) + blob_bytes(MESSAGE_BODY) + u("H", 1) + blob_bytes(PLAIN_BODY),
     True),
    (Claim(13, "c-1", True), u("Q", 13) + text_bytes("c-1") + u("B", 1), True),
    (Release(14, "c-é", False, 4), u("Q", 14) + text_bytes("c-é") + u("BH", 0, 4), True),
    (Claimed(15, 1, [0, 2], [b"session-a", b""]),
     u("QBHHH", 15, 1, 2, 0, 2) + u("I", 2) + blob_bytes(b"session-a") + blob_bytes(b""), True),
    (Register(["a", "é"], ["b"], True),
     u("BI", 1, 2) + text_bytes("a") + text_bytes("é") + u("I", 1) + text_bytes("b"), True),
    (Sync(16), u("Q", 16), True),
    (Synced(17, {0: 3, 1: 4}), u("QI", 17, 2) + u("IQ", 0, 3) + u("IQ", 1, 4), True),
    (Stats({"a": 1, "b": 2**64 - 1}),
     u("H", 2) + text_bytes("a") + text_bytes("b") + offsets_bytes([1, 2**64 - 1]), True),
    (Barrier(18), u("QB", 18, 0), True),
    (Barrier(18, nodes=True), u("QB", 18, 1), True),
    (BarrierDone(19, {3: 5}), u("QI", 19, 1) + u("IQ", 3, 5), True),
    (Deliver("c-é", 1, True, [7, 2**64 - 1], ("g", "t/#"), MESSAGE_BODY),
     text_bytes("c-é") + u("BB", 1, 1) + offsets_bytes([7, 2**64 - 1]) + text_bytes("g")
     + text_bytes("t/#") + MESSAGE_BODY, False),
    (Deliver("c", 0, False, [], None, PLAIN_BODY),
     text_bytes("c") + u("BB", 0, 0) + offsets_bytes([]) + text_bytes("") + text_bytes("")
     + PLAIN_BODY, False),
    (Settled("c-1"), text_bytes("c-1"), True),
    (Admin(20, "kick", b'{"client_id":"c"}'),
     u("Q", 20) + text_bytes("kick") + u("I", 17) + b'{"client_id":"c"}', True),
    (AdminAnswer(21, b'{"ok":true}'), u("QI", 21, 11) + b'{"ok":true}', True),
    (LinkHello(1, "c1", "n-é", 2**64 - 1, 3, 4, b"\x07" * 16, "10.0.0.1:7883"),
     u("H", 1) + text_bytes("c1") + text_bytes("n-é") + u("QHH", 2**64 - 1, 3, 4)
     + blob_bytes(b"\x07" * 16) + text_bytes("10.0.0.1:7883"), True),
    (LinkAuth(b"\x01" * 32), blob_bytes(b"\x01" * 32), True),
    (Ping(), b"", True),
    (Members([("n1", "a:1"), ("n2", "")]),
     u("I", 2) + text_bytes("n1") + text_bytes("a:1") + text_bytes("n2") + text_bytes(""),
     True),
    (RetainSync([("room/é", 2**64 - 1, "n1", b"body"), ("gone", 7, "n2", None)]),
     u("I", 2) + text_bytes("room/é") + u("Q", 2**64 - 1) + text_bytes("n1") + u("B", 1)
     + blob_bytes(b"body") + text_bytes("gone") + u("Q", 7) + text_bytes("n2") + u("B", 0),
     True),
    (NodeStats("n2", {"clients_connected": 3}),
     text_bytes("n2") + u("H", 1) + text_bytes("clients_connected") + offsets_bytes([3]),
     True),
    (Forget("n-é"), text_bytes("n-é"), True),
    (ForwardAck(2**64 - 1), u("Q", 2**64 - 1), True),
    (Takeover("c-é", True, 2**64 - 1), text_bytes("c-é") + u("BQ", 1, 2**64 - 1), True),
    (ServiceOffer("billing", "w-é", 2**64 - 1, 10),
     text_bytes("billing") + text_bytes("w-é") + u("QI", 2**64 - 1, 10), True),
    (ServiceSync([("s", "w1", 3, 5, [("2-17", 0), ("2-18", 4)]), ("t", "w2", 4, 1, [])]),
     u("I", 2) + text_bytes("s") + text_bytes("w1") + u("QII", 3, 5, 2) + text_bytes("2-17")
     + u("I", 0) + text_bytes("2-18") + u("I", 4) + text_bytes("t") + text_bytes("w2")
     + u("QII", 4, 1, 0), True),
    (ServiceRequest("s", "w1", 9, "3-4", 2, True, MESSAGE_BODY),
     text_bytes("s") + text_bytes("w1") + u("Q", 9) + text_bytes("3-4") + u("IB", 2, 1)
     + MESSAGE_BODY, False),
    (ServiceReply(5, "s", "3-4", "w1", -1, None, PLAIN_BODY),
     u("Q", 5) + text_bytes("s") + text_bytes("3-4") + text_bytes("w1") + u("IB", 0, 0)
     + PLAIN_BODY, False),
    (ServiceReply(6, "", "3-5", "w2", 3, ("r/é", b"\x00\x01"), MESSAGE_BODY),
     u("Q", 6) + text_bytes("") + text_bytes("3-5") + text_bytes("w2") + u("IB", 4, 2)
     + text_bytes("r/é") + blob_bytes(b"\x00\x01") + MESSAGE_BODY, False),
    (ServiceReply(7, "s", "3-6", "w2", 0, ("r", None), PLAIN_BODY),
     u("Q", 7) + text_bytes("s") + text_bytes("3-6") + text_bytes("w2") + u("IB", 1, 1)
     + text_bytes("r") + PLAIN_BODY, False),
    (ServiceReplied(8, "accepted"), u("Q", 8) + text_bytes("accepted"), True),
    (SessionFetch(2**64 - 1, "c-é", 7), u("Q", 2**64 - 1) + text_bytes("c-é") + u("Q", 7),
     True),
    (SessionPart(9, 1, 2, 3, b"\x00part"), u("QBII", 9, 1, 2, 3) + blob_bytes(b"\x00part"),
     True),
    (SessionPart(10, 0, 0, 0, b""), u("QBII", 10, 0, 0, 0) + blob_bytes(b""), True),
    (SessionMoved(0, 11, "c"), u("BQ", 0, 11) + text_bytes("c") + u("BB", 0, 0)
     + offsets_bytes([]) + text_bytes("") + text_bytes("") + blob_bytes(b""), True),
    (SessionMoved(1, 0, "c-é", 2, True, [5, 2**40], ("g", "t/#"), MESSAGE_BODY),
     u("BQ", 1, 0) + text_bytes("c-é") + u("BB", 2, 1) + offsets_bytes([5, 2**40])
     + text_bytes("g") + text_bytes("t/#") + blob_bytes(MESSAGE_BODY), True),
    (NodeAppend([NodeAppendEntry(2**64 - 1, 7, 3, "c-é", b"m" * 16, True, MESSAGE_BODY),
                 NodeAppendEntry(1, 0, 1, "", b"n" * 16, False, PLAIN_BODY)]),
     u("I", 2) + u("QII", 2**64 - 1, 7, 3) + text_bytes("c-é") + blob_bytes(b"m" * 16)
     + u("B", 1) + blob_bytes(MESSAGE_BODY) + u("QII", 1, 0, 1) + text_bytes("")
     + blob_bytes(b"n" * 16) + u("B", 0) + blob_bytes(PLAIN_BODY), True),
    (NodeAppended([NodeAppendAnswer(2**64 - 1, 0, 2**63, 4),
                   NodeAppendAnswer(5, 1, 0, 0, "n-é", 2**32 - 1)]),
     u("I", 2) + u("QBQI", 2**64 - 1, 0, 2**63, 4) + text_bytes("") + u("I", 0)
     + u("QBQI", 5, 1, 0, 0) + text_bytes("n-é") + u("I", 2**32 - 1), True),
    (ForwardAt(7, 2**64 - 1, Forward([], MESSAGE_BODY)),
     u("IQ", 7, 2**64 - 1) + u("I", 0) + MESSAGE_BODY, False),
    (ForwardAt(0, 3, Forward([("g", "a/+")], PLAIN_BODY, True)),
     u("IQ", 0, 3) + u("I", 1 | 1 << 31) + text_bytes("g") + text_bytes("a/+") + PLAIN_BODY,
     False),
    (Fetch("n-é", [(3, 2**64 - 1), (0, 0)]),
     text_bytes("n-é") + u("I", 2) + u("IQ", 3, 2**64 - 1) + u("IQ", 0, 0), True),
    (SessionOwner(7, "c-é"), u("Q", 7) + text_bytes("c-é"), True),
    (SessionOwned(2**64 - 1, 2**64 - 1), u("QQ", 2**64 - 1, 2**64 - 1), True),
    (LogRead(2**64 - 1, 0), u("QBIQIQ", 2**64 - 1, 0, 0, 0, 0, 0), True),
    (LogRead(5, 1, 7, 2**64 - 1, 1024, 1_700_000_000_000),
     u("QBIQIQ", 5, 1, 7, 2**64 - 1, 1024, 1_700_000_000_001), True),
    (LogData(9, 0, [(3, 10, 2, -1), (4, 2**64 - 1, 0, 7)], b"\x01\x02"),
     u("QBI", 9, 0, 2) + u("IQQQ", 3, 10, 2, 0) + u("IQQQ", 4, 2**64 - 1, 0, 8)
     + u("I", 2) + b"\x01\x02", True),
]
TYPE_OF = {cls: frame_type for frame_type, cls in FRAMES.items()}


def _id(case: tuple[object, bytes, bool]) -> str:
    return f"{type(case[0]).__name__}-{CASES.index(case)}"


def test_every_frame_type_has_a_case() -> None:
    """A new frame type without a case here fails (and one without a decoder in FRAMES)."""
    assert KNOWN_TYPES == set(FrameType) == set(FRAMES)
    assert {TYPE_OF[type(frame)] for frame, _, _ in CASES} == set(FrameType)
    assert len(TYPE_OF) == len(FrameType)  # one dataclass per type


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_frame_round_trip_at_every_split(case: tuple[object, bytes, bool]) -> None:
    frame, body, _ = case
    frame_type = TYPE_OF[type(frame)]
    data = frame.encode()  # type: ignore[attr-defined]
    assert data[:5] == struct.pack(">IB", len(body) + 1, frame_type)  # u32 length | u8 type
    assert struct.unpack_from(">I", data)[0] == len(data) - 4
    assert data == frame_bytes(frame_type, body)
    for size in range(len(data) + 1):  # no frame and no error until the frame is complete
        reader = FrameReader()
        first = reader.feed(data[:size])
        second = reader.feed(data[size:])
        assert (first, second) == (([], [(frame_type, body)]) if size < len(data)
                                   else ([(frame_type, body)], []))
        assert decode_frame(frame_type, (first + second)[0][1]) == frame
    assert read(frame_type, body) == frame
    assert type(frame).decode(body) == frame  # type: ignore[attr-defined]


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_truncated_bodies_and_trailing_bytes(case: tuple[object, bytes, bool]) -> None:
    frame, body, checks_end = case
    frame_type = TYPE_OF[type(frame)]
    for size in range(len(body)):  # a body that ends early, wherever, is a LinkError
        with pytest.raises(LinkError):
            read(frame_type, body[:size])
    if checks_end:
        with pytest.raises(LinkError):
            decode_frame(frame_type, body + b"\x00")
    else:  # the message runs to the end: a byte more is a byte more of its payload
        longer = decode_frame(frame_type, body + b"\x00")
        if isinstance(frame, ForwardAt):  # (a FORWARD inside)
            assert isinstance(longer, ForwardAt)
            frame, longer = frame.forward, longer.forward
        assert longer == dataclasses.replace(frame, message=frame.message + b"\x00")  # type: ignore[type-var, attr-defined]
        assert decode_message(longer.message, 0.0).payload == b"\x00"  # type: ignore[attr-defined]


def test_which_frames_check_their_end() -> None:
    """Exactly the frames that end with a message body run to the end of the frame."""
    open_ended = {TYPE_OF[type(frame)] for frame, _, checks_end in CASES if not checks_end}
    assert open_ended == {FrameType.FORWARD, FrameType.RETAIN, FrameType.DELIVER,
                          FrameType.SERVICE_REQUEST, FrameType.SERVICE_REPLY,
                          FrameType.FORWARD_AT}
    for frame, _, checks_end in CASES:
        fields = {f.name for f in dataclasses.fields(frame)}  # type: ignore[arg-type]
        assert checks_end == ("message" not in fields and "forward" not in fields)


# ---------------------------------------------------------------------- frames from Hypothesis

u8s, u16s = st.integers(0, 2**8 - 1), st.integers(0, 2**16 - 1)
u32s, u64s = st.integers(0, 2**32 - 1), st.integers(0, 2**64 - 1)
highs = st.dictionaries(u32s, u64s, max_size=4)
texts = st.lists(unicode_text, max_size=4)
groups = st.lists(st.tuples(unicode_text, unicode_text), max_size=4)
bodies = st.binary(max_size=80)  # opaque here

FRAME_STRATEGIES: dict[FrameType, st.SearchStrategy[object]] = {
    FrameType.HELLO: st.builds(Hello, u16s, u16s, unicode_text, highs),
    FrameType.ROUTES: st.builds(Routes, st.lists(st.tuples(st.booleans(), unicode_text,
                                                           unicode_text), max_size=4)),
    FrameType.FORWARD: st.builds(Forward, groups, bodies),
    FrameType.APPEND: st.builds(Append, st.lists(st.tuples(
        u64s, unicode_text, st.binary(min_size=16, max_size=16), st.booleans(), bodies),
        max_size=3)),
    FrameType.APPENDED: st.builds(Appended, st.lists(st.builds(
        AppendAnswer, u64s, u8s, u32s, u64s, u32s, st.none() | groups), max_size=3)),
    FrameType.RETAIN: st.builds(Retain, u64s, st.booleans(), bodies),
    FrameType.REPLY: st.builds(Reply, u64s, u8s, u32s, u64s, u32s),
    FrameType.QUERY_RETAINED: st.builds(QueryRetained, u64s, texts),
    FrameType.RETAINED: st.builds(Retained, u64s, st.lists(st.tuples(u16s, bodies), max_size=3)),
    FrameType.CLAIM: st.builds(Claim, u64s, unicode_text, st.booleans()),
    FrameType.RELEASE: st.builds(Release, u64s, unicode_text, st.booleans(), u16s),
    FrameType.CLAIMED: st.builds(Claimed, u64s, u8s, st.lists(u16s, max_size=3),
                                 st.lists(bodies, max_size=3)),
    FrameType.REGISTER: st.builds(Register, texts, texts, st.booleans()),
    FrameType.SYNC: st.builds(Sync, u64s),
    FrameType.SYNCED: st.builds(Synced, u64s, highs),
    FrameType.STATS: st.builds(Stats, st.dictionaries(unicode_text, u64s, max_size=4)),
    FrameType.BARRIER: st.builds(Barrier, u64s, st.booleans()),
    FrameType.BARRIER_DONE: st.builds(BarrierDone, u64s, highs),
    FrameType.DELIVER: st.builds(Deliver, unicode_text, st.integers(0, 2), st.booleans(),
                                 st.lists(u64s, max_size=3),
                                 st.none() | st.tuples(unicode_text.filter(bool), unicode_text),
                                 bodies),
    FrameType.SETTLED: st.builds(Settled, unicode_text),
    FrameType.ADMIN: st.builds(Admin, u64s, unicode_text, bodies),
    FrameType.ADMIN_ANSWER: st.builds(AdminAnswer, u64s, bodies),
    FrameType.LINK_HELLO: st.builds(LinkHello, u16s, unicode_text, unicode_text, u64s, u16s,
                                    u16s, bodies, unicode_text),
    FrameType.LINK_AUTH: st.builds(LinkAuth, bodies),
    FrameType.PING: st.builds(Ping),
    FrameType.MEMBERS: st.builds(Members, st.lists(st.tuples(unicode_text, unicode_text),
                                                   max_size=3)),
    FrameType.FORGET: st.builds(Forget, unicode_text),
    FrameType.FORWARD_ACK: st.builds(ForwardAck, u64s),
    FrameType.TAKEOVER: st.builds(Takeover, unicode_text, st.booleans(), u64s),
    FrameType.NODE_STATS: st.builds(NodeStats, unicode_text,
                                    st.dictionaries(unicode_text, u64s, max_size=4)),
    FrameType.RETAIN_SYNC: st.builds(RetainSync, st.lists(st.tuples(
        unicode_text, u64s, unicode_text, st.none() | bodies), max_size=3)),
    FrameType.SERVICE_OFFER: st.builds(ServiceOffer, unicode_text, unicode_text, u64s, u32s),
    FrameType.SERVICE_SYNC: st.builds(ServiceSync, st.lists(st.tuples(
        unicode_text, unicode_text, u64s, u32s,
        st.lists(st.tuples(unicode_text, u32s), max_size=3)), max_size=3)),
    FrameType.SERVICE_REQUEST: st.builds(ServiceRequest, unicode_text, unicode_text, u64s,
                                         unicode_text, u32s, st.booleans(), bodies),
    FrameType.SERVICE_REPLY: st.builds(ServiceReply, u64s, unicode_text, unicode_text,
                                       unicode_text, st.integers(-1, 2**32 - 2),
                                       st.none() | st.tuples(unicode_text,
                                                             st.none() | bodies), bodies),
    FrameType.SERVICE_REPLIED: st.builds(ServiceReplied, u64s, unicode_text),
    FrameType.SESSION_FETCH: st.builds(SessionFetch, u64s, unicode_text, u64s),
    FrameType.SESSION_PART: st.integers(1, 2**32 - 1).flatmap(lambda parts: st.builds(
        SessionPart, u64s, st.integers(0, 2), st.integers(0, parts - 1), st.just(parts),
        bodies)),
    FrameType.SESSION_MOVED: st.builds(SessionMoved, st.integers(0, 1), u64s, unicode_text,
                                       st.integers(0, 2), st.booleans(),
                                       st.lists(u64s, max_size=3),
                                       st.none() | st.tuples(unicode_text.filter(bool),
                                                             unicode_text), bodies),
    FrameType.NODE_APPEND: st.builds(NodeAppend, st.lists(st.builds(
        NodeAppendEntry, u64s, u32s, u32s, unicode_text, st.binary(min_size=16, max_size=16),
        st.booleans(), bodies), max_size=3)),
    FrameType.FORWARD_AT: st.builds(ForwardAt, u32s, u64s, st.builds(Forward, groups, bodies,
                                                                      st.booleans())),
    FrameType.FETCH: st.builds(Fetch, unicode_text, st.lists(st.tuples(u32s, u64s),
                                                              max_size=3)),
    FrameType.SESSION_OWNER: st.builds(SessionOwner, u64s, unicode_text),
    FrameType.SESSION_OWNED: st.builds(SessionOwned, u64s, u64s),
    FrameType.LOG_READ: st.builds(LogRead, u64s, st.integers(0, 1), u32s, u64s, u32s,
                                  st.integers(-1, 2**63)),
    FrameType.LOG_DATA: st.builds(LogData, u64s, u8s, st.lists(st.tuples(
        u32s, u64s, u64s, st.integers(-1, 2**63)), max_size=3), st.binary(max_size=64)),
    FrameType.NODE_APPENDED: st.builds(NodeAppended, st.lists(st.builds(
        NodeAppendAnswer, u64s, u8s, u64s, u32s, unicode_text, u32s), max_size=3)),
}
any_frame = st.sampled_from(list(FrameType)).flatmap(lambda t: FRAME_STRATEGIES[t])


def test_every_frame_type_has_a_strategy() -> None:
    assert set(FRAME_STRATEGIES) == set(FrameType)


@given(st.lists(any_frame, min_size=1, max_size=6))
def test_frames_round_trip(frames: list[object]) -> None:
    stream = b"".join(frame.encode() for frame in frames)  # type: ignore[attr-defined]
    got = feed_all([stream])
    assert [frame_type for frame_type, _ in got] == [TYPE_OF[type(f)] for f in frames]
    assert [decode_frame(frame_type, body) for frame_type, body in got] == frames


@given(groups, st.binary(max_size=300))
def test_forward_frame_is_the_forward_encoding(groups: list[tuple[str, str]],
                                               body: bytes) -> None:
    """The hot path builds FORWARD from a body shared by every peer: the same bytes."""
    head = struct.pack(">I", len(groups)) + b"".join(
        text_bytes(name) + text_bytes(topic_filter) for name, topic_filter in groups)
    frame = forward_frame(groups, body)
    assert frame == frame_bytes(FrameType.FORWARD, head + body) == Forward(groups, body).encode()
    assert decode_frame(FrameType.FORWARD, frame[5:]) == Forward(groups, body)


FIELDS = st.one_of(
    st.tuples(st.just("u8"), u8s), st.tuples(st.just("u16"), u16s),
    st.tuples(st.just("u32"), u32s), st.tuples(st.just("u64"), u64s),
    st.tuples(st.just("text"), unicode_text), st.tuples(st.just("blob"), bodies),
    st.tuples(st.just("offsets"), st.lists(u64s, max_size=8)),
)


@given(st.lists(FIELDS, max_size=12), st.sampled_from(FrameType))
def test_writer_frame_header(fields: list[tuple[str, object]], frame_type: FrameType) -> None:
    writer = Writer()
    for kind, value in fields:
        getattr(writer, kind)(value)
    body = writer.bytes()
    assert writer.frame(frame_type) == struct.pack(">IB", len(body) + 1, frame_type) + body
    assert feed_all([writer.frame(frame_type)]) == [(frame_type, body)]


# ---------------------------------------------------------------------- the stream


@st.composite
def frame_lists(draw: st.DrawFn) -> list[tuple[int, bytes]]:
    """1-6 (type, body) frames: raw bodies (possibly empty) and real encoded frames."""
    frames: list[tuple[int, bytes]] = []
    for _ in range(draw(st.integers(1, 6))):
        if draw(st.booleans()):
            frames.append((draw(st.sampled_from(FrameType)), draw(st.binary(max_size=80))))
        else:
            data = draw(any_frame).encode()  # type: ignore[attr-defined]
            frames.append((data[4], data[5:]))
    return frames


def stream_of(frames: list[tuple[int, bytes]]) -> bytes:
    return b"".join(frame_bytes(frame_type, body) for frame_type, body in frames)


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
        with pytest.raises(LinkError):  # nor is it decoded when handed over directly
            decode_frame(value, b"body")


# ---------------------------------------------------------------------- hostile bodies

BAD_UTF8 = [
    b"\xff",  # never valid
    b"\x80",  # a lone continuation byte
    b"\xc0\xaf",  # an overlong "/"
    b"\xed\xa0\x80",  # an encoded surrogate
    b"\xe2\x82",  # a sequence cut short
    b"ok\xf4\x90\x80\x80",  # above U+10FFFF
]

# A body per frame type with a string in it, that string given as raw (bad) bytes.
WITH_TEXT: dict[str, Callable[[bytes], bytes]] = {
    "hello-token": lambda s: u("HH", 1, 2) + s + u("I", 0),
    "routes-group": lambda s: u("IB", 1, 1) + s + text_bytes("a/#"),
    "routes-filter": lambda s: u("IB", 1, 1) + text_bytes("") + s,
    "forward-name": lambda s: u("I", 1) + s + text_bytes("a/#") + MESSAGE_BODY,
    "forward-filter": lambda s: u("I", 1) + text_bytes("g") + s + MESSAGE_BODY,
    "append-client": lambda s: u("IQ", 1, 1) + bytes(17) + s + blob_bytes(MESSAGE_BODY),
    "appended-group": lambda s: u("I", 1) + u("QBIQIB", 1, 0, 0, 0, 0, 1) + u("I", 1) + s
    + text_bytes("f"),
    "query-filter": lambda s: u("QH", 1, 1) + s,
    "claim-client": lambda s: u("Q", 1) + s + u("B", 0),
    "release-client": lambda s: u("Q", 1) + s + u("BH", 0, 1),
    "register-added": lambda s: u("BI", 0, 1) + s + u("I", 0),
    "register-removed": lambda s: u("BII", 0, 0, 1) + s,
    "stats-name": lambda s: u("H", 1) + s + offsets_bytes([1]),
    "deliver-client": lambda s: s + u("BB", 0, 0) + offsets_bytes([]) + text_bytes("")
    + text_bytes("") + MESSAGE_BODY,
    "deliver-group": lambda s: text_bytes("c") + u("BB", 0, 0) + offsets_bytes([]) + s
    + text_bytes("a") + MESSAGE_BODY,
    "settled-client": lambda s: s,
}
WITH_TEXT_TYPES = {"hello": FrameType.HELLO, "routes": FrameType.ROUTES,
                   "forward": FrameType.FORWARD, "append": FrameType.APPEND,
                   "appended": FrameType.APPENDED,
                   "query": FrameType.QUERY_RETAINED, "claim": FrameType.CLAIM,
                   "release": FrameType.RELEASE, "register": FrameType.REGISTER,
                   "stats": FrameType.STATS, "deliver": FrameType.DELIVER,
                   "settled": FrameType.SETTLED}


@pytest.mark.parametrize("where", list(WITH_TEXT))
def test_bad_utf8_is_a_link_error(where: str) -> None:
    frame_type = WITH_TEXT_TYPES[where.split("-")[0]]
    body = WITH_TEXT[where]
    assert decode_frame(frame_type, body(text_bytes("ok")))  # the body is right otherwise
    for bad in BAD_UTF8:
        with pytest.raises(LinkError):
            decode_frame(frame_type, body(struct.pack(">H", len(bad)) + bad))


def test_deliver_with_a_bad_qos_is_a_link_error() -> None:
    for qos in (3, 255):
        with pytest.raises(LinkError):
            decode_frame(FrameType.DELIVER, text_bytes("c") + u("BB", qos, 0)
                         + offsets_bytes([]) + text_bytes("") + text_bytes("") + PLAIN_BODY)


def test_stats_with_names_and_values_of_different_numbers_is_a_link_error() -> None:
    for values in ([], [1, 2]):
        with pytest.raises(LinkError):
            decode_frame(FrameType.STATS, u("H", 1) + text_bytes("a") + offsets_bytes(values))


@pytest.mark.parametrize("what", ["hello-highs", "routes", "groups", "retained",
                                  "claimed-sessions", "register", "synced-highs",
                                  "stats", "deliver-ids", "query-filters", "appends",
                                  "answers", "answer-groups"])
def test_huge_announced_counts_allocate_nothing(what: str) -> None:
    big = struct.pack(">I", BIG_COUNT)
    bodies: dict[str, tuple[FrameType, bytes]] = {
        "hello-highs": (FrameType.HELLO, u("HH", 1, 2) + text_bytes("t") + big + u("IQ", 0, 1)),
        "routes": (FrameType.ROUTES, big + u("B", 1) + text_bytes("") + text_bytes("a")),
        "groups": (FrameType.FORWARD, big + MESSAGE_BODY),
        "retained": (FrameType.RETAINED, u("Q", 1) + big + u("H", 0) + blob_bytes(b"x")),
        "claimed-sessions": (FrameType.CLAIMED, u("QBH", 1, 0, 0) + big + blob_bytes(b"s")),
        "register": (FrameType.REGISTER, u("B", 0) + big + text_bytes("a")),
        "synced-highs": (FrameType.SYNCED, u("Q", 1) + big + u("IQ", 0, 1)),
        "stats": (FrameType.STATS, u("H", 1) + text_bytes("a") + big),
        "deliver-ids": (FrameType.DELIVER, text_bytes("c") + u("BB", 0, 0) + big + PLAIN_BODY),
        "query-filters": (FrameType.QUERY_RETAINED, u("QH", 1, 0xFFFF) + text_bytes("a")),
        "appends": (FrameType.APPEND, big + u("Q", 1) + text_bytes("") + blob_bytes(b"x")),
        "answers": (FrameType.APPENDED, big + u("QBIQIB", 1, 0, 0, 0, 0, 0)),
        "answer-groups": (FrameType.APPENDED, u("I", 1) + u("QBIQIB", 1, 0, 0, 0, 0, 1) + big
                          + text_bytes("g") + text_bytes("f")),
    }
    frame_type, body = bodies[what]
    assert peak_allocation(lambda: decode_frame(frame_type, body), LinkError) < 64 * 1024


# ---------------------------------------------------------------------- random and mutated bytes


def _decode_everything(data: bytes) -> None:
    """Every decoder a peer's bytes reach, and the messages in what decodes: only
    ``LinkError`` may escape."""
    for frame_type in FrameType:
        try:
            read(frame_type, data)
        except LinkError:
            pass


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
    data = mutate(stream_of(frames), changes)
    bounds = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    got: list[tuple[int, bytes]] = []
    reader = FrameReader()
    try:
        for start, stop in itertools.pairwise(bounds):
            got += reader.feed(data[start:stop])
    except LinkError:
        pass
    assert data.startswith(stream_of(got))
    for frame_type, body in got:
        try:
            read(frame_type, body)
        except LinkError:
            pass


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_to_the_decoders(data: bytes) -> None:
    _decode_everything(data)


real_bodies = st.one_of(
    st.sampled_from([body for _, body, _ in CASES]),  # with real message bodies in them
    any_frame.map(lambda frame: frame.encode()[5:]),  # type: ignore[attr-defined]
)


@FAST
@given(real_bodies, edits)
def test_mutated_bodies_to_the_decoders(body: bytes, changes: list[tuple[int, int, int]]) -> None:
    _decode_everything(mutate(body, changes))
