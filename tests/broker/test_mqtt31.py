"""MQTT 3.1 (protocol name "MQIsdp", level 3), as older devices and mosquitto_pub -V mqttv31
speak it: accepted with its own rules, and otherwise served as 3.1.1.

Its rules (IBM's MQTT V3.1 specification): a client identifier of 1 to 23 characters, else
CONNACK return code 2; no session present flag in CONNACK (that byte is reserved); SUBACK
grants QoS 0, 1 or 2 and has no failure code; DUP may be set on a resent SUBSCRIBE, PUBREL or
UNSUBSCRIBE.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest

from conftest import wait_for
from meshmq.mqtt.codec import encode_packet, encode_utf8
from meshmq.mqtt.packets import (
    Connack,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Will,
)
from rawclient import RawClient

MQTT_31 = 3
TIMEOUT = 10


def connect_31(port: int, client_id: str, clean: bool = True) -> tuple[RawClient, bytes]:
    """A 3.1 CONNECT written byte by byte; returns the connection and the CONNACK's 4 bytes."""
    raw = RawClient(port, MQTT_31)
    flags = 0x02 if clean else 0
    body = encode_utf8("MQIsdp") + bytes([3, flags, 0, 60]) + encode_utf8(client_id)
    raw.send_bytes(bytes([0x10, len(body)]) + body)
    connack = b""
    while len(connack) < 4:
        chunk = raw.sock.recv(4 - len(connack))
        assert chunk, f"closed after {connack!r}"
        connack += chunk
    return raw, connack


def test_mqtt31_client_publishes_and_subscribes_at_every_qos(broker, raw_factory,
                                                            client_factory):
    """A 3.1 client connects (CONNACK return code 0), subscribes at QoS 0-2, completes the
    QoS 1 and 2 handshakes both ways, talks to a 3.1.1 paho client, and its will works."""
    raw = raw_factory(broker.port, MQTT_31)
    assert raw.connect("device-31", will=Will("up/will", b"bye", 1)) == Connack(False, 0)
    suback = raw.subscribe([(f"down/q{qos}", SubscriptionOptions(qos)) for qos in (0, 1, 2)])
    assert suback.reason_codes == [0, 1, 2]
    modern = client_factory("modern", 4)
    modern.connect(broker.port)
    modern.subscribe("up/#", qos=2)
    assert isinstance(raw.publish("up/q1", b"one", qos=1), Puback)
    assert isinstance(raw.publish("up/q2", b"two", qos=2), Pubcomp)
    got = sorted((m.topic, m.payload, m.qos) for m in (modern.expect(), modern.expect()))
    assert got == [("up/q1", b"one", 1), ("up/q2", b"two", 2)]
    modern.publish("down/q2", b"to the device", qos=2)
    publish = raw.recv_type(Publish)
    assert (publish.topic, publish.payload, publish.qos) == ("down/q2", b"to the device", 2)
    raw.send(Pubrec(publish.packet_id))  # type: ignore[arg-type]
    assert raw.recv_type(Pubrel).packet_id == publish.packet_id
    raw.send(Pubcomp(publish.packet_id))  # type: ignore[arg-type]
    raw.close()  # abnormal close: the 3.1 will is published
    will = modern.expect()
    assert (will.topic, will.payload) == ("up/will", b"bye")


@pytest.mark.parametrize(("client_id", "accepted"), [
    ("a" * 23, True),
    ("a" * 24, False),
    ("", False),
    ("ü" * 23, True),  # characters, not bytes
])
def test_mqtt31_client_identifier_is_1_to_23_characters(broker, client_id, accepted):
    """Outside 1..23 characters: CONNACK return code 2 (identifier rejected), then close."""
    raw, connack = connect_31(broker.port, client_id)
    try:
        if accepted:
            assert connack == b"\x20\x02\x00\x00"
        else:
            assert connack == b"\x20\x02\x00\x02"
            assert raw.closed()
    finally:
        raw.close()


def test_mqtt31_connack_has_no_session_present_flag(broker):
    """A resumed 3.1 session (clean session 0) gets its queued message, but the CONNACK's
    first byte stays 0: 3.1 has no session present flag."""
    raw, connack = connect_31(broker.port, "keeper-31", clean=False)
    assert connack == b"\x20\x02\x00\x00"
    raw.subscribe("keep/t", qos=1)
    raw.disconnect()
    with RawClient(broker.port) as pub:
        pub.connect("keep-pub")
        pub.publish("keep/t", b"while away", qos=1)
    raw, connack = connect_31(broker.port, "keeper-31", clean=False)
    try:
        assert connack == b"\x20\x02\x00\x00"  # 3.1.1 would say 0x01: session present
        assert raw.recv_type(Publish).payload == b"while away"
    finally:
        raw.close()


def test_mqtt31_subscription_refusal_closes_instead_of_granting(broker_factory, tmp_path,
                                                                 raw_factory):
    """3.1's SUBACK cannot say no: a refused filter (here by the ACL) closes the connection
    with a log line saying why, instead of granting a QoS that was not granted."""
    acl = tmp_path / "acl"
    acl.write_text("* readwrite open/#\n")
    broker = broker_factory(f'[auth]\nacl_file = "{acl}"\n')
    raw = raw_factory(broker.port, MQTT_31)
    raw.connect("refused-31")
    assert raw.subscribe("open/t", qos=1).reason_codes == [1]
    raw.send(Subscribe(2, [("open/u", SubscriptionOptions(1)),
                           ("secret/t", SubscriptionOptions(1))]))
    assert raw.closed(), "the broker did not close the connection"
    assert raw.packets() == []  # no SUBACK at all
    wait_for(lambda: "MQTT 3.1 SUBACK cannot refuse a subscription (reason 0x87)"
             in broker.log(), what="the log line")


def test_mqtt31_dup_flag_on_a_resent_subscribe_is_accepted(broker, raw_factory):
    """3.1 sets DUP on a resent SUBSCRIBE (fixed header 0x8A); 3.1.1 calls that malformed."""
    raw = raw_factory(broker.port, MQTT_31)
    raw.connect("resender-31")
    frame = bytearray(encode_packet(Subscribe(7, [("dup/t", SubscriptionOptions(0))]), 4))
    frame[0] |= 0x08
    raw.send_bytes(bytes(frame))
    assert raw.recv_type(Suback) == Suback(7, [0])


@pytest.mark.skipif(shutil.which("mosquitto_pub") is None, reason="mosquitto-clients missing")
def test_mosquitto_pub_v31_reaches_a_paho_subscriber(broker, client_factory):
    sub = client_factory("paho-sub", 5)
    sub.connect(broker.port)
    sub.subscribe("legacy/t", qos=1)
    result = subprocess.run(
        ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(broker.port), "-V", "mqttv31",
         "-i", "legacy-pub", "-t", "legacy/t", "-m", "from 3.1", "-q", "2"],
        capture_output=True, timeout=TIMEOUT, check=False)
    assert result.returncode == 0, result.stderr
    msg = sub.expect()
    assert (msg.topic, msg.payload, msg.qos) == ("legacy/t", b"from 3.1", 1)


@pytest.mark.skipif(shutil.which("mosquitto_sub") is None, reason="mosquitto-clients missing")
def test_mosquitto_sub_v31_receives(broker, client_factory):
    sub = subprocess.Popen(
        ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(broker.port), "-V", "mqttv31",
         "-i", "legacy-sub", "-t", "legacy/#", "-q", "1", "-C", "1", "-d"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "legacy-sub" in broker.log() and "subscribed" in broker.log()
                 and "filters=['legacy/#']" in broker.log(), what="mosquitto_sub subscribed")
        pub = client_factory("paho-pub", 4)
        pub.connect(broker.port)
        pub.publish("legacy/x", b"to 3.1", qos=1)
        output, _ = sub.communicate(timeout=TIMEOUT)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    assert sub.returncode == 0, output
    assert "to 3.1" in output.splitlines()
    assert "CONNACK (0)" in output
