"""ServerConnection without any I/O: bytes in, events and bytes out."""

from __future__ import annotations

from meshmq.mqtt.codec import decode_frames, encode_packet
from meshmq.mqtt.connection import CLOSED, CONNECTED, CONNECTING, ServerConnection
from meshmq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Puback,
    Publish,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
)
from meshmq.mqtt.properties import PropertyId
from meshmq.mqtt.reason_codes import ReasonCode


def connected(version: int = 5, **kwargs) -> ServerConnection:
    conn = ServerConnection(**kwargs)
    conn.receive_data(encode_packet(Connect("c", version), version))
    assert conn.state is CONNECTING
    assert [type(e) for e in conn.events_received()] == [Connect]
    conn.send_connack(0)
    assert conn.state is CONNECTED
    assert decode_frames(conn.data_to_send(), version) == [Connack(False, 0)]
    return conn


def test_connect_then_publish_events_in_order() -> None:
    conn = connected()
    frames = encode_packet(Publish("a/b", b"1"), 5) + encode_packet(Publish("a/c", b"2"), 5)
    conn.receive_data(frames)
    assert [e.topic for e in conn.events_received()] == ["a/b", "a/c"]


def test_pingreq_pipelined_behind_connect_is_answered_after_the_connack() -> None:
    # MQTT-3.2.0-1: the first packet the server sends is the CONNACK, in 5.0 and 3.1.1.
    for version in (5, 4):
        conn = ServerConnection()
        conn.receive_data(encode_packet(Connect("c", version), version) + b"\xc0\x00" * 2)
        assert [type(e) for e in conn.events_received()] == [Connect]
        assert conn.data_to_send() == b""  # nothing before the CONNACK
        conn.send_connack(0)
        connack = encode_packet(Connack(False, 0), version)
        # then one PINGRESP per PINGREQ, in order
        assert conn.data_to_send() == connack + b"\xd0\x00" * 2


def test_pingreq_pipelined_behind_a_refused_connect_is_never_answered() -> None:
    conn = ServerConnection()
    conn.receive_data(encode_packet(Connect("c", 5), 5) + b"\xc0\x00")
    conn.events_received()
    conn.send_connack(ReasonCode.QUOTA_EXCEEDED)
    assert decode_frames(conn.data_to_send(), 5) == [Connack(False, ReasonCode.QUOTA_EXCEEDED)]
    assert conn.state is CLOSED


def test_claimed_length_above_maximum_is_refused_before_buffering() -> None:
    conn = connected(max_packet_size=1024)
    conn.receive_data(b"\x30\xff\xff\xff\x7f")  # claims 256 MB; no body sent
    assert conn.state is CLOSED
    assert conn.error is not None and conn.error.reason_code == ReasonCode.PACKET_TOO_LARGE
    assert decode_frames(conn.data_to_send(), 5) == [Disconnect(ReasonCode.PACKET_TOO_LARGE)]
    conn.receive_data(b"\x00" * 100)  # later input is discarded
    assert conn.events_received() == []


def test_problem_information_zero_strips_reason_strings_from_acks() -> None:
    conn = ServerConnection()
    conn.receive_data(encode_packet(
        Connect("c", 5, properties={PropertyId.REQUEST_PROBLEM_INFORMATION: 0}), 5))
    conn.events_received()
    conn.send_connack(0)
    conn.data_to_send()
    conn.send(Puback(1, 0x80, {PropertyId.REASON_STRING: "nope"}))
    assert decode_frames(conn.data_to_send(), 5) == [Puback(1, 0x80)]  # MQTT-3.1.2-29


def test_receive_maximum_exceeded_is_0x93() -> None:
    conn = connected(receive_maximum=2)
    burst = b"".join(encode_packet(Publish("t", b"", 1, packet_id=i), 5) for i in (1, 2, 3))
    conn.receive_data(burst)
    assert conn.error is not None
    assert conn.error.reason_code == ReasonCode.RECEIVE_MAXIMUM_EXCEEDED


def test_puback_frees_a_receive_maximum_slot() -> None:
    conn = connected(receive_maximum=1)
    for packet_id in (1, 2, 3):
        conn.receive_data(encode_packet(Publish("t", b"", 1, packet_id=packet_id), 5))
        assert len(conn.events_received()) == 1
        conn.send_puback(packet_id)
    assert conn.error is None


def test_inbound_topic_alias_is_resolved_and_removed() -> None:
    conn = connected(topic_alias_maximum=4)
    conn.receive_data(encode_packet(Publish("a/b", b"1", properties={0x23: 2}), 5))
    conn.receive_data(encode_packet(Publish("", b"2", properties={0x23: 2}), 5))
    events = conn.events_received()
    assert [(e.topic, e.properties) for e in events] == [("a/b", {}), ("a/b", {})]


def test_oversize_outgoing_frame_is_not_queued() -> None:
    conn = ServerConnection()
    conn.receive_data(encode_packet(
        Connect("c", 5, properties={PropertyId.MAXIMUM_PACKET_SIZE: 20}), 5))
    conn.events_received()
    conn.send_connack(0)
    conn.data_to_send()
    assert conn.send(Publish("t", b"x" * 50)) is False
    assert conn.send(Publish("t", b"x")) is True
    assert decode_frames(conn.data_to_send(), 5) == [Publish("t", b"x")]


def test_v311_protocol_error_closes_without_disconnect_packet() -> None:
    conn = connected(version=4)
    conn.receive_data(encode_packet(Publish("a/+", b""), 4))
    assert conn.state is CLOSED
    assert conn.data_to_send() == b""


def test_topic_alias_zero_is_topic_alias_invalid() -> None:
    """Topic Alias 0 is not permitted (MQTT-3.3.2-8): DISCONNECT 0x94 Topic Alias invalid
    (spec 3.3.2.3.4, 4.13.1), as for an alias above our maximum (MQTT-3.3.2-9)."""
    for alias in (0, 5):
        conn = connected(topic_alias_maximum=4)
        conn.receive_data(encode_packet(Publish("a/b", b"1", properties={0x23: alias}), 5))
        assert conn.state is CLOSED
        assert conn.error is not None and conn.error.reason_code == 0x94
        assert decode_frames(conn.data_to_send(), 5) == [Disconnect(0x94)]


# ---------------------------------------------------------------------- MQTT 3.1 (MQIsdp)


def connect_31(client_id: str = "device", clean: bool = True) -> ServerConnection:
    conn = ServerConnection()
    conn.receive_data(encode_packet(Connect(client_id, 3, clean, protocol_name="MQIsdp"), 3))
    return conn


def test_mqtt31_connect_is_accepted_without_a_session_present_flag() -> None:
    conn = connect_31(clean=False)
    assert conn.state is CONNECTING and conn.version == 3
    assert [type(e) for e in conn.events_received()] == [Connect]
    conn.send_connack(0, session_present=True)
    assert conn.state is CONNECTED
    assert conn.data_to_send() == b"\x20\x02\x00\x00"  # 3.1.1 would set the first byte to 1
    assert conn.outgoing_aliases is None


def test_mqtt31_client_identifier_outside_1_to_23_characters_gets_return_code_2() -> None:
    for client_id in ("", "x" * 24):
        conn = connect_31(client_id)
        assert conn.state is CLOSED and conn.events_received() == []  # the broker never sees it
        assert conn.data_to_send() == b"\x20\x02\x00\x02"
    assert connect_31("x" * 23).state is CONNECTING


def test_mqtt31_suback_never_carries_a_failure_code() -> None:
    """3.1 grants 0, 1 or 2: a refusal cannot be said, so the connection closes instead,
    with ``local_close`` saying why; 3.1.1 gets 0x80 and 5.0 the reason code itself."""
    conn = connect_31()
    conn.send_connack(0)
    conn.data_to_send()
    conn.send_suback(1, [0, 2])
    assert decode_frames(conn.data_to_send(), 3) == [Suback(1, [0, 2])]
    conn.send_suback(2, [1, 0x87])
    assert conn.state is CLOSED and conn.data_to_send() == b""
    assert conn.local_close is not None and "0x87" in conn.local_close
    v311 = connected(version=4)
    v311.send_suback(1, [1, 0x87])
    assert decode_frames(v311.data_to_send(), 4) == [Suback(1, [1, 0x80])]


def test_mqtt31_dup_flag_allowed_on_resent_subscribe_and_pubrel_only() -> None:
    conn = connect_31()
    conn.send_connack(0)
    conn.events_received()
    subscribe = bytearray(encode_packet(Subscribe(1, [("t", SubscriptionOptions(0))]), 3))
    subscribe[0] |= 0x08
    pubrel = bytearray(encode_packet(Pubrel(2), 3))
    pubrel[0] |= 0x08
    conn.receive_data(bytes(subscribe) + bytes(pubrel))
    assert [type(e) for e in conn.events_received()] == [Subscribe, Pubrel]
    puback = bytearray(encode_packet(Puback(3), 3))
    puback[0] |= 0x08
    conn.receive_data(bytes(puback))
    assert conn.state is CLOSED and conn.error is not None  # malformed: PUBACK has no DUP


def test_protocol_name_and_level_must_match() -> None:
    """"MQIsdp" is level 3 only, "MQTT" levels 4 and 5: anything else gets return code 1
    (MQTT-3.1.2-2)."""
    for name, level in (("MQIsdp", 4), ("MQIsdp", 5), ("MQTT", 3)):
        conn = ServerConnection()
        conn.receive_data(encode_packet(Connect("c", level, protocol_name=name), 4))
        assert conn.state is CLOSED
        assert conn.data_to_send() == b"\x20\x02\x00\x01"
