"""QoS 0/1/2 delivery: downgrade, ordering, flow control (Receive Maximum), redelivery, QoS 2
exactly-once on the inbound side."""

from __future__ import annotations

import pytest
from paho.mqtt.packettypes import PacketTypes

from conftest import props
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import (
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
)
from meshmq.mqtt.properties import PropertyId

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("qos", [0, 1, 2])
def test_publish_is_delivered_at_its_qos(broker, client_factory, version, qos):
    """A message reaches a QoS 2 subscriber at the QoS it was published with (MQTT-3.8.4-8)."""
    sub = client_factory("sub", version)
    sub.connect(broker.port)
    sub.subscribe("qos/t", qos=2)
    pub = client_factory("pub", version)
    pub.connect(broker.port)
    pub.publish("qos/t", b"payload", qos=qos)
    msg = sub.expect()
    assert (msg.topic, msg.payload, msg.qos, msg.retain) == ("qos/t", b"payload", qos, False)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("sub_qos", [0, 1, 2])
def test_delivery_qos_is_downgraded_to_subscription_max(broker, client_factory, version, sub_qos):
    """Delivered QoS is min(published QoS, granted QoS) (MQTT-3.8.4-8)."""
    sub = client_factory("sub", version)
    sub.connect(broker.port)
    granted = sub.subscribe("down/t", qos=sub_qos)
    assert [int(getattr(code, "value", code)) for code in granted] == [sub_qos]
    pub = client_factory("pub", version)
    pub.connect(broker.port)
    for pub_qos in (0, 1, 2):
        pub.publish("down/t", f"q{pub_qos}", qos=pub_qos)
        msg = sub.expect()
        assert msg.payload == f"q{pub_qos}".encode()
        assert msg.qos == min(pub_qos, sub_qos)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("qos", [1, 2])
def test_messages_from_one_publisher_keep_their_order(broker, client_factory, version, qos):
    """Ordered topic: messages of one publisher at the same QoS arrive in publish order
    (MQTT-4.6.0-5, -6)."""
    sub = client_factory("sub", version)
    sub.connect(broker.port)
    sub.subscribe("order/t", qos=qos)
    pub = client_factory("pub", version)
    pub.connect(broker.port)
    infos = [pub.publish("order/t", str(i), qos=qos, wait=False) for i in range(50)]
    for info in infos:
        info.wait_for_publish(timeout=10)
    assert [int(sub.expect().payload) for _ in range(50)] == list(range(50))


def test_puback_reports_no_matching_subscribers_v5(broker, raw_factory):
    """5.0 PUBACK/PUBREC may say 0x10 No matching subscribers (spec 3.4.2.1)."""
    raw = raw_factory(broker.port)
    raw.connect("lonely")
    assert raw.publish("nobody/here", b"x", qos=1).reason_code == 0x10
    raw.send(Publish("nobody/here", b"x", qos=2, packet_id=77))
    assert raw.recv_type(Pubrec).reason_code == 0x10


# ---------------------------------------------------------------------- flow control


def test_inflight_window_honours_client_receive_maximum(broker, raw_factory, client_factory):
    """The server sends at most the client's Receive Maximum unacknowledged QoS>0 PUBLISHes
    (MQTT-3.3.4-9, MQTT-4.9.0-2); the rest follow, in order, as acknowledgements free the window."""
    raw = raw_factory(broker.port)
    raw.connect("windowed", properties={PropertyId.RECEIVE_MAXIMUM: 2})
    raw.subscribe("window/t", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for i in range(5):
        pub.publish("window/t", str(i), qos=1)
    unacked = [raw.recv_type(Publish), raw.recv_type(Publish)]
    raw.recv_nothing(0.5)  # window full: nothing more until an ack
    payloads = [p.payload for p in unacked]
    while unacked:
        raw.send(Puback(unacked.pop(0).packet_id))
        if len(payloads) < 5:
            nxt = raw.recv_type(Publish)
            payloads.append(nxt.payload)
            unacked.append(nxt)
            assert len(unacked) <= 2
            if len(payloads) < 5:
                raw.recv_nothing(0.1)
    assert payloads == [b"0", b"1", b"2", b"3", b"4"]
    raw.recv_nothing(0.3)


def test_inflight_window_capped_by_max_inflight_messages(broker_factory, raw_factory):
    """session.max_inflight_messages caps the window below the client's Receive Maximum."""
    broker = broker_factory("[session]\nmax_inflight_messages = 1\n")
    raw = raw_factory(broker.port)
    raw.connect("capped", properties={PropertyId.RECEIVE_MAXIMUM: 100})
    raw.subscribe("cap/t", qos=1)
    pub = raw_factory(broker.port)
    pub.connect("pub")
    for i in range(3):
        pub.publish("cap/t", str(i).encode(), qos=1)
    first = raw.recv_type(Publish)
    raw.recv_nothing(0.5)
    raw.send(Puback(first.packet_id))
    second = raw.recv_type(Publish)
    assert (first.payload, second.payload) == (b"0", b"1")


def test_client_exceeding_our_receive_maximum_is_disconnected(broker_factory, raw_factory,
                                                               client_factory):
    """More unacknowledged inbound QoS 1 PUBLISHes than our Receive Maximum: DISCONNECT
    0x93 Receive Maximum exceeded (spec 3.2.2.3.3, 4.9; the client broke MQTT-3.3.4-7)."""
    broker = broker_factory("[mqtt]\nreceive_maximum = 2\n")
    raw = raw_factory(broker.port)
    connack = raw.connect("greedy")
    assert connack.properties[PropertyId.RECEIVE_MAXIMUM] == 2
    burst = b"".join(
        encode_packet(Publish("greedy/t", b"x", qos=1, packet_id=i), 5) for i in (1, 2, 3)
    )
    raw.send_bytes(burst)  # one write, no reads in between: three unacknowledged at once
    assert raw.closed()
    packets = raw.packets()
    assert packets, "expected a DISCONNECT before the close"
    assert isinstance(packets[-1], Disconnect)
    assert packets[-1].reason_code == 0x93
    # Other clients are unaffected.
    honest = client_factory("honest", 5)
    honest.connect(broker.port)
    honest.subscribe("honest/t", qos=1)
    honest.publish("honest/t", "ok", qos=1)
    assert honest.expect().payload == b"ok"


# ---------------------------------------------------------------------- redelivery


def _persistent_props(version):
    return {PropertyId.SESSION_EXPIRY_INTERVAL: 60} if version == 5 else None


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("qos", [1, 2])
def test_unacknowledged_publish_is_resent_with_dup_after_reconnect(
    broker, raw_factory, version, qos
):
    """On session resumption unacknowledged PUBLISHes are resent with DUP=1 and the original
    packet identifier (MQTT-4.4.0-1, MQTT-3.3.1-1)."""
    sub = raw_factory(broker.port, version)
    sub.connect("redeliver", clean_start=False, properties=_persistent_props(version))
    sub.subscribe("redeliver/t", qos=qos)
    pub = raw_factory(broker.port, version)
    pub.connect("pub")
    pub.publish("redeliver/t", b"once", qos=qos)
    first = sub.recv_type(Publish)
    assert (first.payload, first.qos, first.dup) == (b"once", qos, False)
    sub.close()  # no acknowledgement
    again = raw_factory(broker.port, version)
    connack = again.connect("redeliver", clean_start=False, properties=_persistent_props(version))
    assert connack.session_present is True
    resent = again.recv_type(Publish)
    assert (resent.payload, resent.qos, resent.dup) == (b"once", qos, True)
    assert resent.packet_id == first.packet_id
    again.ack(resent)
    again.recv_nothing(0.3)


@pytest.mark.parametrize("version", VERSIONS)
def test_pubrel_is_resent_after_reconnect_when_pubcomp_missing(broker, raw_factory, version):
    """A QoS 2 message already PUBREC'd is continued with PUBREL, not re-PUBLISHed, on
    session resumption (MQTT-4.4.0-1, MQTT-4.3.3-3)."""
    sub = raw_factory(broker.port, version)
    sub.connect("rel", clean_start=False, properties=_persistent_props(version))
    sub.subscribe("rel/t", qos=2)
    pub = raw_factory(broker.port, version)
    pub.connect("pub")
    pub.publish("rel/t", b"two", qos=2)
    publish = sub.recv_type(Publish)
    sub.send(Pubrec(publish.packet_id))
    assert sub.recv_type(Pubrel).packet_id == publish.packet_id
    sub.close()  # no PUBCOMP
    again = raw_factory(broker.port, version)
    assert again.connect("rel", clean_start=False,
                         properties=_persistent_props(version)).session_present
    pubrel = again.recv_type(Pubrel)
    assert pubrel.packet_id == publish.packet_id
    again.send(Pubcomp(pubrel.packet_id))
    again.recv_nothing(0.3)


@pytest.mark.parametrize("version", VERSIONS)
def test_resent_qos2_publish_is_not_delivered_twice(broker, raw_factory, client_factory, version):
    """QoS 2 exactly once: a PUBLISH resent with DUP and the same packet id before PUBREL is
    acknowledged again but not forwarded again (MQTT-4.3.3-10)."""
    sub = client_factory("sub", version)
    sub.connect(broker.port)
    sub.subscribe("exactly/#", qos=2)
    pub = raw_factory(broker.port, version)
    pub.connect("pub2")
    pub.send(Publish("exactly/once", b"1", qos=2, packet_id=7))
    assert pub.recv_type(Pubrec).packet_id == 7
    pub.send(Publish("exactly/once", b"1", qos=2, packet_id=7, dup=True))
    assert pub.recv_type(Pubrec).packet_id == 7
    pub.send(Pubrel(7))
    pubcomp = pub.recv_type(Pubcomp)
    assert (pubcomp.packet_id, pubcomp.reason_code) == (7, 0)
    pub.publish("exactly/barrier", b"barrier", qos=1)
    # paho hands a QoS 2 message over at PUBREL, so the QoS 1 barrier may overtake it.
    assert sorted([sub.expect().payload, sub.expect().payload]) == [b"1", b"barrier"]
    sub.expect_none()


@pytest.mark.parametrize("version", VERSIONS)
def test_qos2_packet_id_is_reusable_after_pubcomp(broker, raw_factory, client_factory, version):
    """After PUBCOMP the packet id is free: a new PUBLISH with it is a new message
    (MQTT-4.3.3-10 "until it has received the corresponding PUBREL")."""
    sub = client_factory("sub", version)
    sub.connect(broker.port)
    sub.subscribe("reuse/t", qos=2)
    pub = raw_factory(broker.port, version)
    pub.connect("pub")
    pub.publish("reuse/t", b"a", qos=2, packet_id=9)
    pub.publish("reuse/t", b"b", qos=2, packet_id=9)
    assert [sub.expect().payload, sub.expect().payload] == [b"a", b"b"]


def test_pubrel_for_unknown_packet_id_gets_pubcomp_0x92(broker, raw_factory):
    """PUBREL for an id we hold no state for: PUBCOMP 0x92 Packet Identifier not found
    (spec 3.7.2.1), connection stays up."""
    raw = raw_factory(broker.port)
    raw.connect("stray")
    raw.send(Pubrel(4242))
    pubcomp = raw.recv_type(Pubcomp)
    assert (pubcomp.packet_id, pubcomp.reason_code) == (4242, 0x92)
    assert raw.subscribe("stray/t", qos=1).reason_codes == [1]


def test_pubrel_for_unknown_packet_id_v311_gets_pubcomp(broker, raw_factory):
    """3.1.1: PUBREL for an unknown id is still answered with PUBCOMP (MQTT-4.3.3-11)."""
    raw = raw_factory(broker.port, version=4)
    raw.connect("stray311")
    raw.send(Pubrel(17))
    assert raw.recv_type(Pubcomp).packet_id == 17


def test_qos1_publish_acknowledged_with_puback(broker, raw_factory):
    """QoS 1 PUBLISH is answered by PUBACK with the same packet id (MQTT-4.3.2-4)."""
    raw = raw_factory(broker.port, version=4)
    raw.connect("acker")
    puback = raw.publish("ack/t", b"x", qos=1, packet_id=321)
    assert isinstance(puback, Puback) and puback.packet_id == 321


def test_paho_qos2_roundtrip_with_properties(broker, client_factory):
    """Smoke check of a QoS 2 5.0 exchange carrying properties end to end."""
    sub = client_factory("sub", 5)
    sub.connect(broker.port)
    sub.subscribe("q2props/t", qos=2)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("q2props/t", "x", qos=2, properties=props(PacketTypes.PUBLISH, ContentType="c"))
    msg = sub.expect()
    assert (msg.qos, msg.properties.ContentType) == (2, "c")


def test_resend_on_reconnect_respects_new_receive_maximum(broker, raw_factory, client_factory):
    """Unacknowledged messages resent on session resumption still count against the Receive
    Maximum of the *new* connection (MQTT-3.3.4-9, MQTT-4.9.0-2: the send quota starts at
    Receive Maximum on each connection): 4 unacked, reconnect with Receive
    Maximum 2 -> only 2 PUBLISH until acknowledged, then the others, in order."""
    session = {PropertyId.SESSION_EXPIRY_INTERVAL: 60}
    sub = raw_factory(broker.port)
    sub.connect("shrink", clean_start=False, properties=session)
    sub.subscribe("shrink/t", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for i in range(4):
        pub.publish("shrink/t", str(i), qos=1)
    first = [sub.recv_type(Publish) for _ in range(4)]
    sub.close()  # nothing acknowledged
    again = raw_factory(broker.port)
    connack = again.connect("shrink", clean_start=False,
                            properties={**session, PropertyId.RECEIVE_MAXIMUM: 2})
    assert connack.session_present
    window = [again.recv_type(Publish), again.recv_type(Publish)]
    again.recv_nothing(0.5)  # the window of the new connection is full
    payloads = [p.payload for p in window]
    for _ in range(2):
        again.send(Puback(window.pop(0).packet_id))
        nxt = again.recv_type(Publish)
        window.append(nxt)
        payloads.append(nxt.payload)
    assert payloads == [p.payload for p in first]
    assert all(p.dup for p in window)


def test_full_window_does_not_delay_other_packets(broker, raw_factory):
    """With its Receive Maximum used up, the client still gets PUBACKs for its own publishes,
    SUBACKs and PINGRESPs (MQTT-3.3.4-10: only PUBLISH may be held back)."""
    raw = raw_factory(broker.port)
    raw.connect("busy-window", properties={PropertyId.RECEIVE_MAXIMUM: 1})
    raw.subscribe("loop/t", qos=1)
    raw.send(Publish("loop/t", b"0", qos=1, packet_id=100))
    raw.send(Publish("loop/t", b"1", qos=1, packet_id=101))
    raw.send(Publish("loop/t", b"2", qos=1, packet_id=102))
    got = [raw.recv(), raw.recv(), raw.recv(), raw.recv()]
    acks = sorted(p.packet_id for p in got if isinstance(p, Puback))
    publishes = [p for p in got if isinstance(p, Publish)]
    assert acks == [100, 101, 102]
    assert [p.payload for p in publishes] == [b"0"]  # window of one
    assert raw.subscribe("other/t", qos=0).reason_codes == [0]
    raw.send(Pingreq())
    assert isinstance(raw.recv(), Pingresp)
    raw.send(Puback(publishes[0].packet_id))
    assert raw.recv_type(Publish).payload == b"1"


@pytest.mark.parametrize("version", VERSIONS)
def test_large_message_roundtrip(broker, client_factory, version):
    """A payload near the default 1 MiB packet limit arrives intact (frames split across many
    TCP reads are reassembled)."""
    payload = bytes(range(256)) * 3000  # 768000 bytes
    sub = client_factory("big-sub", version)
    sub.connect(broker.port)
    sub.subscribe("big/t", qos=1)
    pub = client_factory("big-pub", version)
    pub.connect(broker.port)
    pub.publish("big/t", payload, qos=1)
    msg = sub.expect()
    assert msg.payload == payload


def test_pipelined_publishes_in_one_write_are_all_routed(broker, raw_factory, client_factory):
    """Hundreds of PUBLISH frames in one write, frame boundaries anywhere in the TCP stream:
    all are routed, in order."""
    sub = client_factory("pipe-sub", 5)
    sub.connect(broker.port)
    sub.subscribe("pipe/t", qos=0)
    raw = raw_factory(broker.port)
    raw.connect("pipe-pub")
    burst = b"".join(encode_packet(Publish("pipe/t", str(i).encode() * (i % 50 + 1)), 5)
                     for i in range(500))
    raw.send_bytes(burst)
    got = [sub.expect().payload for _ in range(500)]
    assert got == [str(i).encode() * (i % 50 + 1) for i in range(500)]


def test_packets_trickled_byte_by_byte(broker, raw_factory):
    """A client writing one byte at a time is served like any other (framing never depends
    on TCP segment boundaries)."""
    raw = raw_factory(broker.port)
    stream = (
        encode_packet(Connect("trickle", properties={PropertyId.SESSION_EXPIRY_INTERVAL: 0}), 5)
        + encode_packet(Subscribe(1, [("trickle/t", SubscriptionOptions(1))]), 5)
        + encode_packet(Publish("trickle/t", b"x" * 300, qos=1, packet_id=2), 5)
    )
    for i in range(len(stream)):
        raw.send_bytes(stream[i:i + 1])
    assert raw.recv_type(Connack).reason_code == 0
    assert raw.recv_type(Suback).reason_codes == [1]
    got = [raw.recv(), raw.recv()]
    assert sorted(type(p).__name__ for p in got) == ["Puback", "Publish"]
