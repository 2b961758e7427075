"""The connection's fast paths (a PUBLISH on an already accepted topic, a plain PUBACK) must
give exactly what the full decoder gives: the same events, the same errors, the same state.

``ServerConnection`` decodes a PUBLISH in one step when its topic was accepted before on this
connection and nothing about it needs checking; everything else takes ``decode_packet`` and the
per-packet rules. These properties compare a connection that knows the topics ("warm") with one
that does not ("cold") on the same bytes, and both with the reference decoder.
"""

from __future__ import annotations

import struct

from hypothesis import given, settings
from hypothesis import strategies as st

from meshmq.mqtt.codec import decode_frames, encode_packet, encode_publish, encode_varint
from meshmq.mqtt.connection import ServerConnection
from meshmq.mqtt.packets import Connect, Puback, Publish

TOPICS = ["a", "a/b", "sensors/d1/temp", "é/ü", "$SYS/x"]
OTHER_TOPICS = ["z", "z/y", "other/d2/temp", "ö/ä", "$SYS/y"]  # same sizes, never in TOPICS


def connected(version: int, **limits) -> ServerConnection:
    conn = ServerConnection(**limits)
    conn.receive_data(encode_packet(Connect("c", version), version))
    conn.events_received()
    conn.send_connack(0)
    conn.data_to_send()
    return conn


def warm_up(conn: ServerConnection, topics: list[str], version: int) -> None:
    """Publish once at QoS 0 on each topic: the same state either way but for known topics."""
    conn.receive_data(b"".join(encode_packet(Publish(t, b"w"), version) for t in topics))
    assert len(conn.events_received()) == len(topics)


def outcome(conn: ServerConnection) -> tuple:
    error = conn.error
    return (conn.events_received(), conn.closed, conn.data_to_send(),
            None if error is None else (error.reason_code, str(error)), conn.statistics())


@st.composite
def publish_frames(draw, version: int) -> bytes:
    """A PUBLISH frame, usually valid, sometimes with a bad flag, id, length or properties."""
    topic = draw(st.sampled_from(TOPICS)).encode()
    qos = draw(st.sampled_from([0, 0, 1, 1, 2, 3]))
    dup = draw(st.booleans()) if qos else draw(st.sampled_from([False, False, False, True]))
    retain = draw(st.booleans())
    packet_id = draw(st.sampled_from([1, 2, 7, 65535, 0])) if qos else None
    props = None
    if version == 5:
        props = draw(st.sampled_from([
            b"\x00", b"\x00", b"\x03\x23\x00\x02",  # none; a topic alias
            b"\x02\x02\x05",  # message expiry, truncated
            b"\x05\x02\x00\x00\x00\x3c",  # message expiry 60 s
            b"\x02\x0b\x01",  # subscription identifier: refused from a client
        ]))
    payload = draw(st.binary(max_size=200))
    frame = encode_publish(topic, payload, qos & 1 if qos == 3 else qos, retain, dup,
                           packet_id if qos else None, props)
    if qos == 3:  # set both QoS bits by hand: the encoder cannot express it
        frame = bytes((frame[0] | 0x06,)) + frame[1:]
    cut = draw(st.sampled_from([None, None, None, "topic", "id"]))
    if cut == "topic":  # a topic length running past the frame
        body = struct.pack(">H", len(topic) + 200) + topic
        frame = bytes((frame[0],)) + encode_varint(len(body)) + body
    elif cut == "id" and qos:  # the frame ends inside the packet id
        body = struct.pack(">H", len(topic)) + topic + b"\x00"
        frame = bytes((frame[0],)) + encode_varint(len(body)) + body
    return frame


@st.composite
def streams(draw) -> tuple[int, dict, bytes]:
    version = draw(st.sampled_from([4, 5]))
    limits = draw(st.fixed_dictionaries({}, optional={
        "receive_maximum": st.integers(1, 3),
        "max_qos": st.integers(0, 2),
        "retain_available": st.booleans(),
    }))
    frames = draw(st.lists(st.one_of(
        publish_frames(version),
        st.builds(lambda pid: b"\x40\x02" + struct.pack(">H", pid),
                  st.sampled_from([0, 1, 9, 65535])),
        st.just(b"\x40\x03\x00\x01\x00"),  # PUBACK with a reason code byte
    ), min_size=1, max_size=8))
    return version, limits, b"".join(frames)


@settings(max_examples=400)
@given(streams())
def test_known_topics_change_nothing_but_speed(case) -> None:
    """Same bytes, same outcome, whether or not the connection has seen the topics."""
    version, limits, data = case
    warm = connected(version, **limits)
    warm_up(warm, TOPICS, version)
    cold = connected(version, **limits)
    warm_up(cold, OTHER_TOPICS, version)
    warm.receive_data(data)
    cold.receive_data(data)
    assert outcome(warm) == outcome(cold)


@settings(max_examples=200)
@given(st.sampled_from([4, 5]), st.data())
def test_valid_publishes_and_acks_equal_the_reference_decoder(version, data) -> None:
    """Repeated topics (fast path after the first) decode exactly as ``decode_frames`` does."""
    packets = data.draw(st.lists(st.one_of(
        st.builds(lambda t, p, q, r, d, i: Publish(t, p, q, r, d and q > 0, i if q else None),
                  st.sampled_from(TOPICS), st.binary(max_size=300), st.integers(0, 2),
                  st.booleans(), st.booleans(), st.integers(1, 65535)),
        st.builds(Puback, st.integers(1, 65535)),
    ), min_size=1, max_size=20))
    stream = b"".join(encode_packet(p, version) for p in packets)
    conn = connected(version)
    cut = data.draw(st.integers(0, len(stream)))
    conn.receive_data(stream[:cut])
    conn.receive_data(stream[cut:])
    assert conn.error is None
    assert conn.events_received() == decode_frames(stream, version)


def test_puback_encoding_is_four_bytes_for_both_versions() -> None:
    for version in (4, 5):
        conn = connected(version)
        conn.receive_data(encode_packet(Publish("t", b"x", 1, packet_id=258), version))
        conn.events_received()
        conn.send_puback(258)
        assert conn.data_to_send() == b"\x40\x02\x01\x02"
        assert decode_frames(b"\x40\x02\x01\x02", version) == [Puback(258)]


def test_refused_puback_keeps_its_reason_code_in_5_0() -> None:
    conn = connected(5)
    conn.receive_data(encode_packet(Publish("t", b"x", 1, packet_id=3), 5))
    conn.events_received()
    conn.send_puback(3, 0x97)
    assert decode_frames(conn.data_to_send(), 5) == [Puback(3, 0x97)]


def test_topic_length_past_the_frame_is_malformed_even_for_a_known_topic() -> None:
    """A topic length running into the next frame's bytes must not match a known topic."""
    frame = b"\x30\x03\x00\x03a" + b"/b"  # topic length 3, frame ends after "a"; "/b" follows
    warm = connected(4)
    warm_up(warm, TOPICS, 4)
    cold = connected(4)
    warm_up(cold, OTHER_TOPICS, 4)
    warm.receive_data(frame)
    cold.receive_data(frame)
    assert warm.closed and warm.events_received() == []
    assert outcome(warm) == outcome(cold)


def test_receive_maximum_holds_on_known_topics() -> None:
    for version in (4, 5):
        for qos in (1, 2):
            conn = connected(version, receive_maximum=2)
            warm_up(conn, TOPICS, version)
            burst = [encode_packet(Publish("a", b"x", qos, packet_id=i), version) for i in (1, 2)]
            conn.receive_data(b"".join(burst))
            assert len(conn.events_received()) == 2 and conn.error is None
            if qos == 2:  # a resend of a held QoS 2 id takes no new slot
                conn.receive_data(burst[1])
                assert len(conn.events_received()) == 1 and conn.error is None
            conn.receive_data(encode_packet(Publish("a", b"x", qos, packet_id=3), version))
            assert conn.error is not None and conn.error.reason_code == 0x93


def test_puback_with_packet_id_zero_is_malformed() -> None:
    for version in (4, 5):
        conn = connected(version)
        conn.receive_data(b"\x40\x02\x00\x00")
        assert conn.closed and conn.events_received() == []
        assert conn.error is not None and conn.error.reason_code == 0x81
