"""Protocol violations by a raw client: the broker closes that connection (with the right
CONNACK/DISCONNECT where 5.0 has one) and keeps serving an honest paho client."""

from __future__ import annotations

import socket
import threading

import pytest

from meshmq.auth.passwords import hash_password, write_password_file
from meshmq.mqtt.codec import decode_frames, encode_packet, encode_utf8
from meshmq.mqtt.packets import (
    Auth,
    Connack,
    Connect,
    Disconnect,
    Pingreq,
    Publish,
    Subscribe,
    SubscriptionOptions,
    Will,
)
from meshmq.mqtt.properties import PropertyId
from rawclient import RawClient

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


@pytest.fixture
def honest(broker, client_factory):
    """A well-behaved 5.0 client that must keep working while others misbehave."""
    client = client_factory("honest", 5)
    client.connect(broker.port)
    client.subscribe("honest/#", qos=1)
    return client


def still_works(honest, tag: str = "after") -> None:
    honest.publish(f"honest/{tag}", tag, qos=1)
    msg = honest.expect()
    assert (msg.topic, msg.payload) == (f"honest/{tag}", tag.encode())
    assert honest.disconnects.empty(), "the honest client was disconnected"


def closed_packets(raw: RawClient) -> list:
    """Wait for the broker to close ``raw``; return what it sent before closing."""
    assert raw.closed(), "broker did not close the connection"
    return raw.packets()


def assert_disconnect(packets: list, code: int) -> None:
    assert packets, "expected a DISCONNECT before the close"
    assert isinstance(packets[-1], Disconnect), packets
    assert packets[-1].reason_code == code, f"got 0x{packets[-1].reason_code:02X}"


# ---------------------------------------------------------------------- before CONNECT


@pytest.mark.parametrize("version", VERSIONS)
def test_publish_before_connect_closes_without_connack(broker, raw_factory, honest, version):
    """The first packet must be CONNECT (MQTT-3.1.0-1): anything else closes the connection
    and no CONNACK is sent."""
    raw = raw_factory(broker.port, version)
    raw.send(Publish("honest/evil", b"sneaky"))
    assert closed_packets(raw) == []
    still_works(honest)
    honest.expect_none(0.2)  # the sneaky publish was not routed


def test_subscribe_before_connect_closes(broker, raw_factory, honest):
    """MQTT-3.1.0-1 for SUBSCRIBE as well."""
    raw = raw_factory(broker.port)
    raw.send(Subscribe(1, [("#", SubscriptionOptions(0))]))
    assert closed_packets(raw) == []
    still_works(honest)


def test_pingreq_before_connect_closes(broker, raw_factory, honest):
    """MQTT-3.1.0-1 for PINGREQ."""
    raw = raw_factory(broker.port)
    raw.send(Pingreq())
    assert closed_packets(raw) == []
    still_works(honest)


def test_no_connect_within_timeout_closes(broker_factory, raw_factory):
    """A connection that sends no CONNECT is closed after mqtt.connect_timeout (spec 3.1.4
    "reasonable amount of time")."""
    broker = broker_factory("[mqtt]\nconnect_timeout = 0.5\n")
    raw = raw_factory(broker.port)
    assert raw.closed(timeout=5)
    assert raw.packets() == []


# ---------------------------------------------------------------------- CONNECT problems


@pytest.mark.parametrize("version", VERSIONS)
def test_second_connect_is_protocol_error(broker, raw_factory, honest, version):
    """A second CONNECT is a Protocol Error (MQTT-3.1.0-2): DISCONNECT 0x82 for 5.0, a plain
    close for 3.1.1."""
    raw = raw_factory(broker.port, version)
    assert raw.connect("twice").reason_code == 0
    raw.send(Connect("twice", version))
    packets = closed_packets(raw)
    if version == 5:
        assert_disconnect(packets, 0x82)
    else:
        assert packets == []
    still_works(honest)


@pytest.mark.parametrize(("name", "level", "code"), [
    ("MQTT", 3, 0x01),  # 3.1's level under the 3.1.1/5.0 name
    ("MQIsdp", 4, 0x01),  # 3.1's name (test_mqtt31.py) with a later level
    ("MQIsdp", 5, 0x01),
    ("MQTT", 6, 0x01),
])
def test_unsupported_protocol_level_gets_connack_refusal(broker, raw_factory, honest, name,
                                                         level, code):
    """Unsupported protocol level: CONNACK 0x01 Unacceptable protocol version, then close
    (MQTT-3.1.2-2)."""
    raw = raw_factory(broker.port, version=4)
    body = encode_utf8(name) + bytes([level, 0x02, 0, 60]) + encode_utf8("old")
    raw.send_bytes(bytes([0x10, len(body)]) + body)
    packets = closed_packets(raw)
    assert len(packets) == 1 and isinstance(packets[0], Connack)
    assert packets[0].reason_code == code
    still_works(honest)


def test_bad_protocol_name_closes(broker, raw_factory, honest):
    """An unknown protocol name: the server may close without CONNACK (MQTT-3.1.2-1)."""
    raw = raw_factory(broker.port)
    body = encode_utf8("HTTP") + bytes([5, 0x02, 0, 60, 0]) + encode_utf8("x")
    raw.send_bytes(bytes([0x10, len(body)]) + body)
    packets = closed_packets(raw)
    assert not any(isinstance(p, Connack) and p.reason_code == 0 for p in packets)
    still_works(honest)


def test_connect_reserved_flag_is_malformed(broker, raw_factory, honest):
    """CONNECT reserved flag set is a Malformed Packet (MQTT-3.1.2-3): the connection is
    closed, optionally after CONNACK 0x81 (spec 4.13.1 "MAY send a CONNACK")."""
    raw = raw_factory(broker.port)
    frame = bytearray(encode_packet(Connect("reserved"), 5))
    frame[9] |= 0x01  # connect flags byte: 2 header + 6 name + 1 level
    raw.send_bytes(bytes(frame))
    packets = closed_packets(raw)
    assert [(type(p), p.reason_code) for p in packets] in ([], [(Connack, 0x81)])
    still_works(honest)


def test_auth_method_refused(broker, raw_factory):
    """No enhanced authentication methods are offered: CONNACK 0x8C Bad authentication
    method (MQTT-4.12.0-1)."""
    raw = raw_factory(broker.port)
    connack = raw.connect("auth", properties={PropertyId.AUTHENTICATION_METHOD: "SCRAM-SHA-1"})
    assert connack.reason_code == 0x8C
    assert raw.closed()


def test_auth_packet_without_method_is_protocol_error(broker, raw_factory, honest):
    """AUTH when no authentication method was given is a Protocol Error (MQTT-4.12.0-1)."""
    raw = raw_factory(broker.port)
    raw.connect("auth-later")
    raw.send(Auth(0x19))
    assert_disconnect(closed_packets(raw), 0x82)
    still_works(honest)


# ---------------------------------------------------------------------- after CONNECT


@pytest.mark.parametrize("topic", ["honest/+", "honest/#", "+"])
@pytest.mark.parametrize("version", VERSIONS)
def test_wildcard_in_publish_topic_disconnects_0x90(broker, raw_factory, honest, version,
                                                   topic):
    """A PUBLISH topic name must not contain wildcards (MQTT-3.3.2-2): DISCONNECT 0x90
    Topic Name invalid for 5.0, close for 3.1.1; nothing is routed."""
    raw = raw_factory(broker.port, version)
    raw.connect("wild-pub")
    raw.publish(topic, b"bad", qos=1, wait_ack=False)
    packets = closed_packets(raw)
    if version == 5:
        assert_disconnect(packets, 0x90)
    else:
        assert packets == []
    still_works(honest)


def test_empty_topic_without_alias_is_topic_name_invalid(broker, raw_factory, honest):
    """Zero-length topic name without a Topic Alias: DISCONNECT 0x82/0x90 (MQTT-3.3.2-1)."""
    raw = raw_factory(broker.port)
    raw.connect("empty-topic")
    raw.publish("", b"x")
    packets = closed_packets(raw)
    assert packets and isinstance(packets[-1], Disconnect)
    assert packets[-1].reason_code in (0x82, 0x90)
    still_works(honest)


@pytest.mark.parametrize("version", VERSIONS)
def test_publish_qos3_is_malformed(broker, raw_factory, honest, version):
    """PUBLISH with both QoS bits set is malformed (MQTT-3.3.1-4): DISCONNECT 0x81 (5.0)."""
    raw = raw_factory(broker.port, version)
    raw.connect("qos3")
    frame = bytearray(encode_packet(Publish("q/t", b"x", qos=1, packet_id=1), version))
    frame[0] |= 0x06
    raw.send_bytes(bytes(frame))
    packets = closed_packets(raw)
    if version == 5:
        assert_disconnect(packets, 0x81)
    else:
        assert packets == []
    still_works(honest)


def test_subscribe_with_bad_fixed_header_flags_is_malformed(broker, raw_factory, honest):
    """SUBSCRIBE fixed-header flags must be 0010 (MQTT-3.8.1-1): DISCONNECT 0x81."""
    raw = raw_factory(broker.port)
    raw.connect("flags")
    frame = bytearray(encode_packet(Subscribe(1, [("a", SubscriptionOptions(0))]), 5))
    frame[0] = 0x80
    raw.send_bytes(bytes(frame))
    assert_disconnect(closed_packets(raw), 0x81)
    still_works(honest)


def test_packet_id_zero_is_malformed(broker, raw_factory, honest):
    """A QoS 1 PUBLISH with packet identifier 0 is malformed (MQTT-2.2.1-3)."""
    raw = raw_factory(broker.port)
    raw.connect("zero-id")
    frame = bytearray(encode_packet(Publish("z/t", b"x", qos=1, packet_id=1), 5))
    frame[7:9] = b"\x00\x00"  # header 2 + topic 2+3 -> packet id at offset 7
    raw.send_bytes(bytes(frame))
    assert_disconnect(closed_packets(raw), 0x81)
    still_works(honest)


def test_subscription_identifier_in_client_publish_is_protocol_error(broker, raw_factory,
                                                                     honest):
    """A client must not send a Subscription Identifier in PUBLISH (MQTT-3.3.4-6)."""
    raw = raw_factory(broker.port)
    raw.connect("subid-pub")
    raw.publish("s/t", b"x", properties={PropertyId.SUBSCRIPTION_IDENTIFIER: [1]})
    assert_disconnect(closed_packets(raw), 0x82)
    still_works(honest)


def test_server_only_packet_from_client_is_protocol_error(broker, raw_factory, honest):
    """A client sending CONNACK is a Protocol Error (spec 2.1.2): DISCONNECT 0x82."""
    raw = raw_factory(broker.port)
    raw.connect("connack-sender")
    raw.send(Connack())
    assert_disconnect(closed_packets(raw), 0x82)
    still_works(honest)


def test_disconnect_setting_expiry_after_zero_is_protocol_error(broker, raw_factory, honest):
    """DISCONNECT with a non-zero Session Expiry Interval after CONNECT had 0: Protocol
    Error (MQTT-3.14.2-2)."""
    raw = raw_factory(broker.port)
    raw.connect("late-expiry")
    raw.send(Disconnect(0, {PropertyId.SESSION_EXPIRY_INTERVAL: 60}))
    assert_disconnect(closed_packets(raw), 0x82)
    still_works(honest)


def test_duplicate_property_is_protocol_error(broker, raw_factory, honest):
    """A property that may appear once appearing twice is a Protocol Error (spec 2.2.2.2)."""
    raw = raw_factory(broker.port)
    raw.connect("dup-prop")
    props = b"\x06" + b"\x03\x00\x00" + b"\x03\x00\x00"  # content type "" twice
    body = encode_utf8("d/t") + props + b"x"
    raw.send_bytes(bytes([0x30, len(body)]) + body)
    assert_disconnect(closed_packets(raw), 0x82)
    still_works(honest)


def test_invalid_utf8_topic_is_malformed(broker, raw_factory, honest):
    """Ill-formed UTF-8 in a topic name is a Malformed Packet (MQTT-1.5.4-1)."""
    raw = raw_factory(broker.port)
    raw.connect("bad-utf8")
    body = b"\x00\x03a\xff/" + b"\x00" + b"x"
    raw.send_bytes(bytes([0x30, len(body)]) + body)
    assert_disconnect(closed_packets(raw), 0x81)
    still_works(honest)


@pytest.mark.parametrize("version", VERSIONS)
def test_will_published_when_closed_for_protocol_error(broker, raw_factory, honest, version):
    """A connection closed by the server for a protocol error publishes its will
    (spec 3.1.2.5, MQTT-3.1.2-8)."""
    raw = raw_factory(broker.port, version)
    raw.connect("rogue", will=Will("honest/will", b"rogue died", 1))
    raw.publish("bad/#", b"x")
    closed_packets(raw)
    msg = honest.expect()
    assert (msg.topic, msg.payload) == ("honest/will", b"rogue died")
    still_works(honest)


# ---------------------------------------------------------------------- garbage


@pytest.mark.parametrize("garbage", [
    pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", id="http"),
    pytest.param(b"\x00\x00\x00\x00", id="reserved-type-0"),
    pytest.param(b"\xf0\x00", id="reserved-type-15-before-connect"),
    pytest.param(b"\x10\xff\xff\xff\xff\x7f", id="remaining-length-5-bytes"),
    pytest.param(bytes(range(256)), id="noise"),
])
def test_garbage_bytes_close_the_connection(broker_factory, raw_factory, client_factory,
                                            garbage):
    """Bytes that are not MQTT: the connection is closed (spec 4.13), at the latest when the
    CONNECT deadline passes (an HTTP request parses as the header of an incomplete packet),
    and the broker keeps running."""
    broker = broker_factory("[mqtt]\nconnect_timeout = 1.5\n")
    honest = client_factory("honest", 5)
    honest.connect(broker.port)
    honest.subscribe("honest/#", qos=1)
    raw = raw_factory(broker.port)
    raw.send_bytes(garbage)
    assert raw.closed(timeout=5), "broker did not close the connection"
    packets = raw.packets()
    assert not any(isinstance(p, Connack) and p.reason_code == 0 for p in packets)
    still_works(honest)


@pytest.mark.parametrize("version", VERSIONS)
def test_garbage_after_connect_closes(broker, raw_factory, honest, version):
    """A malformed packet after CONNECT: DISCONNECT 0x81 (5.0) / close (3.1.1)."""
    raw = raw_factory(broker.port, version)
    raw.connect("garbler")
    raw.send_bytes(b"\x00\x02\xde\xad")
    packets = closed_packets(raw)
    if version == 5:
        assert_disconnect(packets, 0x81)
    else:
        assert packets == []
    still_works(honest)


def test_many_bad_clients_do_not_hurt_the_broker(broker, raw_factory, honest):
    """A burst of misbehaving connections, one after another, leaves the broker serving."""
    for i in range(20):
        raw = raw_factory(broker.port)
        raw.send_bytes(bytes([0x30 + (i % 16), 0x7F]) + b"\x00" * (i % 5))
        raw.close()
    still_works(honest, "burst")


# ------------------------------------------------------------ closing (broker/transport/linger.py)


@pytest.mark.parametrize(("version", "code"), [(4, 4), (5, 0x86)])
def test_refused_connect_is_read_by_a_client_still_sending(broker_factory, tmp_path, version,
                                                          code):
    """Bad credentials while the client pipelines a SUBSCRIBE and keeps publishing: it reads
    the CONNACK refusal, then an orderly end of stream (FIN), not a reset: a reset would make
    its sends fail and, on many stacks, discard the CONNACK before it is read."""
    passwords = tmp_path / "passwords"
    write_password_file(passwords, {"alice": hash_password("wonderland")})
    broker = broker_factory(f'[auth]\npassword_file = "{passwords}"\n')
    connect = encode_packet(Connect("mallory", version, username="alice", password=b"guess"),
                            version)
    subscribe = encode_packet(Subscribe(1, [("#", SubscriptionOptions(1))]), version)
    publish = encode_packet(Publish("t/y", b"y" * 10_000), version)
    with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as sock:
        sender = threading.Thread(target=send_ignoring_errors,
                                  args=(sock, connect + subscribe + publish * 60))
        sender.start()
        received, ending = read_to_end(sock)
        sender.join(timeout=10)
    assert decode_frames(received, version) == [Connack(False, code)]
    assert ending == "eof"


def send_ignoring_errors(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # a reset: the test sees it on the reading side


def read_to_end(sock: socket.socket) -> tuple[bytes, str]:
    """Everything received, and how the stream ended: "eof" (FIN) or "reset"."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data, "reset"
        if not chunk:
            return data, "eof"
        data += chunk
