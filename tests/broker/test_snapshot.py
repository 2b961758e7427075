"""The session snapshot codec (broker/snapshot.py): the state store's JSON record, the hand-over
bytes with a running session's live state, and the stored form of retained messages.

What is read comes from a file or another worker: it decodes to what was written or is a
``SnapshotError``, raised before anything is installed (``decode``/``from_record`` return a
value or raise; nothing is half-built). Expected records and bytes are written here by hand from
the formats in snapshot.py's docstring and broker/wire.py's (tests/wireformat.py).
"""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshmq.broker.message import Message
from meshmq.broker.session import LiveState, Outbound, QueueEntry, Subscription
from meshmq.broker.snapshot import (
    SessionSnapshot,
    SnapshotError,
    message_from_json,
    message_to_json,
    wall_ms,
)
from meshmq.mqtt.codec import encode_properties
from meshmq.mqtt.packets import SubscriptionOptions, Will
from meshmq.mqtt.properties import Properties, PropertyId
from wireformat import (
    BIG_COUNT,
    EXPIRY,
    USER,
    blob_bytes,
    edits,
    message_bytes,
    mutate,
    peak_allocation,
    positions,
    publish_properties,
    unicode_text,
)

FAST = settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def message_view(message: Message) -> tuple[object, ...]:
    return (message.topic, message.payload, message.qos, message.retain, message.properties,
            message.sender, message.position, message.expires_at)


def live_view(live: LiveState | None) -> object:
    """A live state as plain values (``Outbound`` and ``Message`` compare by identity)."""
    if live is None:
        return None
    return (live.qos2_in, live.next_packet_id, live.dropped,
            [(packet_id, message_view(out.message), out.qos, out.retain, out.subscription_ids,
              out.group, out.released) for packet_id, out in live.inflight],
            [(message_view(entry.message), *entry[1:]) for entry in live.queue],
            live.catchup)


def snapshot_view(snapshot: SessionSnapshot) -> object:
    return (snapshot.client_id, snapshot.expiry, snapshot.username, snapshot.will,
            snapshot.detached_at, snapshot.subscriptions, snapshot.cursor,
            live_view(snapshot.live))


def split_handover(data: bytes) -> tuple[list[bytes], dict[str, Any]]:
    """A hand-over read by hand: ``u32 count | (u32 length | message body)* | u32 length |
    JSON head``, nothing after."""
    count = struct.unpack_from(">I", data)[0]
    pos, bodies = 4, []
    for _ in range(count + 1):
        size = struct.unpack_from(">I", data, pos)[0]
        bodies.append(data[pos + 4:pos + 4 + size])
        pos += 4 + size
    assert pos == len(data)
    return bodies[:-1], json.loads(bodies[-1])


def handover_bytes(bodies: list[bytes], head: object) -> bytes:
    return (struct.pack(">I", len(bodies)) + b"".join(blob_bytes(b) for b in bodies)
            + blob_bytes(json.dumps(head).encode("utf-8")))


# ---------------------------------------------------------------------- an example by hand

WILL_BLOCK = b"\x05\x18\x00\x00\x00\x05"  # will delay interval 0x18 = 5 s
SUBSCRIPTIONS = {
    "a/+": Subscription(SubscriptionOptions(1, False, True, 2), 7),
    "$share/g/b": Subscription(SubscriptionOptions(0, True, False, 0), None),
}


def example(live: bool) -> SessionSnapshot:
    """A detached session: will, subscriptions with and without ids, a log cursor and (in a
    hand-over) two inflight messages, one queued, a catch-up."""
    first = Message("x/1", b"one", 1, False, {USER: [("k", "v")]}, "pub", now=0.0)
    first.set_position(0, 41)
    second = Message("x/2", b"", 2, True, None, None, now=0.0)
    queued = Message("x/3", b"three", 1, False, None, "other", now=0.0)
    state = LiveState(
        {3, 9}, 12, 4,
        [(10, Outbound(first, 1, False, [7], None)),
         (11, Outbound(second, 2, True, None, ("g", "b")))],
        [QueueEntry(queued, 1, False, [7, 8], None, True)],
        {"filters": [["a/+", [41, 0]], ["c", [50, 2]]], "dup_below": [45, 3], "lost": 2})
    state.inflight[1][1].released = True
    return SessionSnapshot("cl-é", 3600, "ann", Will("w", b"bye", 1, True,
                                                      {PropertyId.WILL_DELAY_INTERVAL: 5}),
                           1_700_000_000_000, dict(SUBSCRIPTIONS), [41, 2],
                           state if live else None)


EXPECTED_RECORD = {
    "expiry": 3600, "username": "ann",
    "will": {"topic": "w", "payload": b64(b"bye"), "qos": 1, "retain": True,
             "properties": b64(WILL_BLOCK)},
    "detached_at": 1_700_000_000_000, "cursor": [41, 2],
    "subs": {"a/+": [1, False, True, 2, 7], "$share/g/b": [0, True, False, 0, None]},
}
EXPECTED_LIVE = {
    "qos2_in": [3, 9], "next_packet_id": 12, "dropped": 4,
    "inflight": [[10, 0, 1, False, [7], None, False], [11, 1, 2, True, None, ["g", "b"], True]],
    "queue": [[2, 1, False, [7, 8], None, True]],
    "catchup": {"filters": [["a/+", [41, 0]], ["c", [50, 2]]], "dup_below": [45, 3], "lost": 2},
}
EXPECTED_BODIES = [
    message_bytes("x/1", b"one", 1, False, encode_properties({USER: [("k", "v")]}), "pub",
                  (0, 41)),
    message_bytes("x/2", b"", 2, True, b"\x00"),
    message_bytes("x/3", b"three", 1, False, b"\x00", "other"),
]


def test_record_layout() -> None:
    record = example(live=False).record()
    assert record == EXPECTED_RECORD
    assert example(live=True).record() == EXPECTED_RECORD  # live state never reaches the store
    restored = SessionSnapshot.from_record("cl-é", json.loads(json.dumps(record)))
    assert restored == example(live=False)


def test_handover_layout() -> None:
    data = example(live=True).encode(0.0)
    bodies, head = split_handover(data)
    assert bodies == EXPECTED_BODIES  # inflight first, then the queue, each once
    assert head == {"client_id": "cl-é", **EXPECTED_RECORD, "live": EXPECTED_LIVE}
    decoded = SessionSnapshot.decode(handover_bytes(EXPECTED_BODIES, head), 0.0)
    assert snapshot_view(decoded) == snapshot_view(example(live=True))
    assert decoded.live is not None and decoded.live.inflight[1][1].released


def test_handover_without_live_state() -> None:
    data = example(live=False).encode(0.0)
    assert split_handover(data) == ([], {"client_id": "cl-é", **EXPECTED_RECORD})
    assert SessionSnapshot.decode(data, 0.0) == example(live=False)


def test_handover_counts_expiry_down_between_the_workers() -> None:
    """A message waiting in a moved session keeps the time it had left (MQTT-3.3.2-6)."""
    message = Message("t", b"p", 1, False, {EXPIRY: 60}, "pub", now=0.0)
    snapshot = example(live=True)
    assert snapshot.live is not None
    snapshot.live.queue = [QueueEntry(message, 1, False, None, None, False)]
    decoded = SessionSnapshot.decode(snapshot.encode(20.0), 1000.0)
    assert decoded.live is not None
    moved = decoded.live.queue[0].message
    assert moved.properties[EXPIRY] == 40
    assert moved.expires_at == 1040.0


# ---------------------------------------------------------------------- round trips

options = st.builds(SubscriptionOptions, st.integers(0, 2), st.booleans(), st.booleans(),
                    st.integers(0, 2))
subscriptions = st.dictionaries(
    unicode_text.filter(bool),
    st.builds(Subscription, options, st.none() | st.integers(1, 268_435_455)), max_size=4)
will_properties = st.builds(
    lambda props, delay: {**props, **({} if delay is None else
                                      {PropertyId.WILL_DELAY_INTERVAL: delay})},
    publish_properties(st.integers(0, 2**32 - 1)), st.none() | st.integers(0, 2**32 - 1))
wills = st.none() | st.builds(Will, unicode_text, st.binary(max_size=40), st.integers(0, 2),
                              st.booleans(), will_properties)
u64s = st.integers(0, 2**64 - 1)


@st.composite
def messages(draw: st.DrawFn) -> Message:
    message = Message(draw(unicode_text), draw(st.binary(max_size=40)), draw(st.integers(0, 2)),
                      draw(st.booleans()), draw(publish_properties(st.integers(1, 2**32 - 1))),
                      draw(st.none() | unicode_text.filter(bool)), now=0.0)
    position = draw(positions)
    if position is not None:
        message.set_position(*position)
    return message


ids = st.none() | st.lists(st.integers(1, 268_435_455), min_size=1, max_size=3)
groups = st.none() | st.tuples(unicode_text.filter(bool), unicode_text.filter(bool))


@st.composite
def outbound(draw: st.DrawFn) -> tuple[int, Outbound]:
    out = Outbound(draw(messages()), draw(st.integers(1, 2)), draw(st.booleans()), draw(ids),
                   draw(groups))
    out.released = draw(st.booleans())
    return draw(st.integers(1, 65535)), out


catchups = st.none() | st.fixed_dictionaries({
    "filters": st.lists(st.tuples(unicode_text, st.lists(u64s, max_size=3)).map(list),
                        max_size=3),
    "dup_below": st.none() | st.lists(u64s, max_size=3),
    "lost": st.integers(0, 2**40)})
live_states = st.builds(
    LiveState, st.sets(st.integers(1, 65535), max_size=4), st.integers(1, 65535),
    st.integers(0, 2**40), st.lists(outbound(), max_size=3),
    st.lists(st.builds(QueueEntry, messages(), st.integers(0, 2), st.booleans(), ids, groups,
                       st.booleans()), max_size=3),
    catchups)
snapshots = st.builds(
    SessionSnapshot, unicode_text, st.integers(0, 2**32 - 1), st.none() | unicode_text, wills,
    st.none() | st.integers(0, 2**50), subscriptions, st.none() | st.lists(u64s, max_size=4))


@given(snapshots)
def test_record_round_trip(snapshot: SessionSnapshot) -> None:
    """What the state store writes (a JSON line) reads back as it was."""
    line = json.dumps(snapshot.record())
    assert SessionSnapshot.from_record(snapshot.client_id, json.loads(line)) == snapshot


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(snapshots, st.none() | live_states)
def test_handover_round_trip(snapshot: SessionSnapshot, live: LiveState | None) -> None:
    snapshot.live = live
    data = snapshot.encode(0.0)
    bodies, head = split_handover(data)
    refs = [] if live is None else (
        [out.message for _, out in live.inflight] + [entry.message for entry in live.queue])
    assert len(bodies) == len(refs)
    for body, message in zip(bodies, refs, strict=True):  # each as its one wire body
        block = encode_properties(message.properties) if message.properties else b"\x00"
        assert body == message_bytes(message.topic, message.payload, message.qos,
                                     message.retain, block, message.sender or "",
                                     message.position)
    assert head["client_id"] == snapshot.client_id
    assert snapshot_view(SessionSnapshot.decode(data, 0.0)) == snapshot_view(snapshot)


# ---------------------------------------------------------------------- malformed hand-overs

GOOD_HEAD = {"client_id": "cl-é", **EXPECTED_RECORD, "live": EXPECTED_LIVE}


def _with(original: dict[str, Any], path: list[object], value: object) -> dict[str, Any]:
    """A copy of ``original`` with the item at ``path`` replaced (``...``: removed)."""
    head = json.loads(json.dumps(original))
    where = head
    for key in path[:-1]:
        where = where[key]
    if value is ...:
        del where[path[-1]]
    else:
        where[path[-1]] = value
    return head  # type: ignore[no-any-return]


# (what is wrong, where in the head, the value there; ``...``: left out)
RECORD_CHANGES: list[tuple[str, list[object], object]] = [
    ("subs not a map", ["subs"], [["a", [0, False, False, 0, None]]]),
    ("options too short", ["subs", "a/+"], [1, False, True, 2]),
    ("qos not a number", ["subs", "a/+"], ["one", False, True, 2, None]),
    ("expiry not a number", ["expiry"], "never"),
    ("cursor not a list", ["cursor"], 5),
    ("will without payload", ["will", "payload"], ...),
    ("will payload not base64", ["will", "payload"], "!!"),
    ("will properties cut short", ["will", "properties"], b64(WILL_BLOCK[:-1])),
    ("will properties not a will's", ["will", "properties"], b64(b"\x02\x23\x00")),
    ("will properties empty", ["will", "properties"], ""),
]
LIVE_CHANGES: list[tuple[str, list[object], object]] = [
    ("no client id", ["client_id"], ...),
    ("no live queue", ["live", "queue"], ...),
    ("inflight entry too short", ["live", "inflight", 0], [10, 0, 1, False, [7], None]),
    ("message index past the end", ["live", "inflight", 0, 1], 3),
    ("message index negative", ["live", "queue", 0, 0], -1),
    ("message index not a number", ["live", "queue", 0, 0], "0"),
    ("subscription ids not a list", ["live", "queue", 0, 3], 7),
    ("group too short", ["live", "inflight", 1, 5], ["g"]),
    ("catch-up filter not text", ["live", "catchup", "filters", 0, 0], 5),
    ("catch-up start not offsets", ["live", "catchup", "filters", 0, 1], ["0"]),
    ("catch-up without filters", ["live", "catchup", "filters"], ...),
    ("qos2 ids not a list", ["live", "qos2_in"], 3),
]
BAD_HEADS: dict[str, object] = {
    "a list": [GOOD_HEAD],
    "null": None,
    **{name: _with(GOOD_HEAD, path, value) for name, path, value in RECORD_CHANGES},
    **{name: _with(GOOD_HEAD, path, value) for name, path, value in LIVE_CHANGES},
}
BAD_RECORDS: dict[str, object] = {
    "a list": [EXPECTED_RECORD],
    "null": None,
    **{name: _with(EXPECTED_RECORD, path, value) for name, path, value in RECORD_CHANGES},
}


def test_good_head_decodes() -> None:
    """The bad heads below differ from this one in one place only."""
    decoded = SessionSnapshot.decode(handover_bytes(EXPECTED_BODIES, GOOD_HEAD), 0.0)
    assert snapshot_view(decoded) == snapshot_view(example(live=True))


@pytest.mark.parametrize("name", list(BAD_HEADS))
def test_malformed_handover_head_is_a_snapshot_error(name: str) -> None:
    with pytest.raises(SnapshotError):
        SessionSnapshot.decode(handover_bytes(EXPECTED_BODIES, BAD_HEADS[name]), 0.0)


@pytest.mark.parametrize("head", [b"", b"{", b"\xff", b"[" * 100_000, b'{"client_id": "c"} x'],
                         ids=["empty", "cut-short", "not-utf8", "nested-deep", "trailing"])
def test_handover_head_that_is_not_json_is_a_snapshot_error(head: bytes) -> None:
    with pytest.raises(SnapshotError):
        SessionSnapshot.decode(struct.pack(">I", 0) + blob_bytes(head), 0.0)


def test_handover_with_a_bad_message_body_is_a_snapshot_error() -> None:
    good = json.dumps(GOOD_HEAD).encode("utf-8")
    for bad in (b"", b"\x04" + EXPECTED_BODIES[0][1:], EXPECTED_BODIES[0][:5]):
        data = (struct.pack(">I", 3) + blob_bytes(bad) + blob_bytes(EXPECTED_BODIES[1])
                + blob_bytes(EXPECTED_BODIES[2]) + blob_bytes(good))
        with pytest.raises(SnapshotError):
            SessionSnapshot.decode(data, 0.0)


def test_every_truncation_and_trailing_bytes_are_snapshot_errors() -> None:
    data = example(live=True).encode(0.0)
    assert SessionSnapshot.decode(data, 0.0).client_id == "cl-é"
    for size in range(len(data)):
        with pytest.raises(SnapshotError):
            SessionSnapshot.decode(data[:size], 0.0)
    with pytest.raises(SnapshotError):
        SessionSnapshot.decode(data + b"\x00", 0.0)


@pytest.mark.parametrize("what", ["messages", "message", "head"])
def test_huge_announced_counts_allocate_nothing(what: str) -> None:
    big = struct.pack(">I", BIG_COUNT)
    data = {
        "messages": big + blob_bytes(EXPECTED_BODIES[0]),
        "message": struct.pack(">I", 1) + big + EXPECTED_BODIES[0],
        "head": struct.pack(">I", 0) + big + b"{}",
    }[what]
    assert peak_allocation(lambda: SessionSnapshot.decode(data, 0.0), SnapshotError) < 64 * 1024


@FAST
@given(edits)
def test_mutated_handovers_are_snapshots_or_snapshot_errors(
        changes: list[tuple[int, int, int]]) -> None:
    data = mutate(example(live=True).encode(0.0), changes)
    try:
        SessionSnapshot.decode(data, 0.0)
    except SnapshotError:
        pass


@FAST
@given(st.binary(max_size=200))
def test_random_bytes_are_snapshot_errors(data: bytes) -> None:
    with pytest.raises(SnapshotError):  # at least the JSON head is missing
        SessionSnapshot.decode(data, 0.0)


# ---------------------------------------------------------------------- malformed records


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_malformed_record_is_a_snapshot_error(name: str) -> None:
    """What the state keeper turns into a one-line error naming the state directory."""
    with pytest.raises(SnapshotError):
        SessionSnapshot.from_record("c", BAD_RECORDS[name])  # type: ignore[arg-type]


def test_record_of_an_older_version_with_fields_missing() -> None:
    """Missing optional fields take their defaults (records written before they existed)."""
    restored = SessionSnapshot.from_record("c", {})
    assert restored == SessionSnapshot("c", 0, None, None, None, {}, None)


# ---------------------------------------------------------------------- retained messages


def test_retained_message_to_json() -> None:
    message = Message("r/é", b"payload", 1, True, {USER: [("k", "v")], EXPIRY: 100}, "pub",
                      now=0.0)
    message.set_position(2, 9)
    before = wall_ms()
    data = message_to_json(message, 30.0)
    after = wall_ms()
    assert set(data) == {"body", "stored_at"}
    assert before <= data["stored_at"] <= after
    block = encode_properties({USER: [("k", "v")], EXPIRY: 70})  # 70 s left when stored
    assert base64.b64decode(data["body"]) == message_bytes("r/é", b"payload", 1, True, block,
                                                          "pub", (2, 9))
    restored = message_from_json("r/é", json.loads(json.dumps(data)), 500.0)
    assert restored is not None
    assert (restored.topic, restored.payload, restored.qos, restored.retain, restored.sender,
            restored.position) == ("r/é", b"payload", 1, True, "pub", (2, 9))
    assert restored.properties[USER] == [("k", "v")]
    assert restored.properties[EXPIRY] in (69, 70)  # whole seconds stored (none, or one tick)
    assert restored.expires_at == 500.0 + restored.properties[EXPIRY]


@given(messages())
def test_retained_round_trip(message: Message) -> None:
    before = wall_ms()
    restored = message_from_json(message.topic, message_to_json(message, 0.0), 0.0)
    waited = (wall_ms() - before) // 1000 + 1  # whole seconds of wall clock, at most
    expiry = message.properties.get(EXPIRY)
    if restored is None:  # only if it expired while "stored"
        assert expiry is not None and expiry <= waited  # type: ignore[operator]
        return
    view, original = message_view(restored), message_view(message)
    assert view[:4] + view[5:7] == original[:4] + original[5:7]
    if expiry is None:
        assert restored.properties == message.properties and restored.expires_at is None
    else:
        assert expiry - waited <= restored.properties[EXPIRY] <= expiry  # type: ignore[operator]
        others = {k: v for k, v in restored.properties.items() if k != EXPIRY}
        assert others == {k: v for k, v in message.properties.items() if k != EXPIRY}


def test_retained_message_expires_while_stored() -> None:
    message = Message("r", b"p", 0, True, {EXPIRY: 100}, None, now=0.0)
    data = message_to_json(message, 0.0)
    data["stored_at"] -= 40_000  # stored 40 s ago
    restored = message_from_json("r", data, 7.0)
    assert restored is not None and restored.properties[EXPIRY] in (59, 60)
    assert restored.expires_at == 7.0 + restored.properties[EXPIRY]
    data["stored_at"] -= 60_000  # 100 s ago: gone
    assert message_from_json("r", data, 7.0) is None
    forever = message_to_json(Message("r", b"p", 0, True, None, None, now=0.0), 0.0)
    forever["stored_at"] -= 10**9  # no expiry: kept however long it was stored
    assert message_from_json("r", forever, 7.0) is not None


def legacy_record(**changes: object) -> dict[str, Any]:
    """A retained message as meshmq versions before the one body stored it."""
    record = {"payload": b64(b"old"), "qos": 1, "sender": "pub",
              "properties": b64(b"\x06\x26\x00\x01k\x00\x00"), "stored_at": wall_ms(),
              "expiry": 60, "position": [2, 9]}  # properties: one user property ("k", "")
    record.update(changes)
    return record


def test_legacy_retained_record() -> None:
    restored = message_from_json("r/old", legacy_record(), 5.0)
    assert restored is not None
    assert (restored.topic, restored.payload, restored.qos, restored.retain, restored.sender,
            restored.position) == ("r/old", b"old", 1, True, "pub", (2, 9))
    assert restored.properties[USER] == [("k", "")]
    assert restored.properties[EXPIRY] in (59, 60)
    assert restored.expires_at == 5.0 + restored.properties[EXPIRY]
    plain = message_from_json("r", legacy_record(expiry=None, position=None, sender=None,
                                                 properties=b64(b"\x00")), 5.0)
    assert plain is not None
    assert (plain.properties, plain.expires_at, plain.position, plain.sender) == (
        {}, None, None, None)
    assert message_from_json("r", legacy_record(stored_at=wall_ms() - 61_000), 5.0) is None


@pytest.mark.parametrize("data", [
    {"body": "!!", "stored_at": 0},  # not base64
    {"body": "", "stored_at": 0},  # no message in it
    {"body": b64(b"\x04\x00\x00\x01t\x00\x00\x00\x00\x00\x01\x00"), "stored_at": 0},  # flags
    {"body": b64(message_bytes("t", b"", 0, True, b"\x02\x11\x00")), "stored_at": 0},
    {"body": b64(message_bytes("t", b"", 0, True, b"\x05\x02\x00\x00\x00\x09"))},  # when?
    legacy_record(properties=b64(b"\x05\x26")),  # a property block cut short
    legacy_record(properties="!!"),
    {k: v for k, v in legacy_record().items() if k != "payload"},
], ids=["base64", "empty", "flags", "properties", "no-stored-at", "legacy-properties",
        "legacy-base64", "legacy-no-payload"])
def test_malformed_retained_record_is_a_snapshot_error(data: dict[str, Any]) -> None:
    """The state keeper turns a ``SnapshotError`` into a one-line error naming the file."""
    with pytest.raises(SnapshotError):
        message_from_json("t", data, 0.0)


def test_retained_properties_kept_as_published() -> None:
    props: Properties = {USER: [("b", "1"), ("a", "2")], PropertyId.CONTENT_TYPE: "x/y",
                         PropertyId.CORRELATION_DATA: b"\x00\xff"}
    message = Message("r", b"", 1, True, props, None, now=0.0)
    restored = message_from_json("r", message_to_json(message, 0.0), 0.0)
    assert restored is not None and restored.properties == props
