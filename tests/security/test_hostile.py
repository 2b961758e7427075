"""Hostile clients: for each attack, the right reason code or close, an honest client served
throughout with no loss, and bounded broker memory.

Every test runs its hostile action inside a ``HonestStream`` (a paho publisher/subscriber pair
exchanging a numbered QoS 1 stream), then checks that every honest message arrived exactly
once and in order, that no honest PUBACK took longer than a few seconds, and that the broker's
VmRSS grew by less than the bound the test states. Hostile publishes aim at the honest topic,
so a message the broker should have refused would show up in the honest stream and fail it.

The reason codes themselves are also checked in tests/broker/test_protocol_errors.py; what this
suite adds is the concurrent honest client and the memory bound.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from securitykit import HonestStream, stalled_subscriber

from conftest import WAIT, BrokerProcess, start_broker, wait_for
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Publish,
    Pubrec,
    Pubrel,
    Subscribe,
    SubscriptionOptions,
)
from meshmq.mqtt.properties import PropertyId
from rawclient import RawClient

RSS_BOUND_MIB = 16  # a single hostile connection must not cost the broker more than this
CONNECT_TIMEOUT = 1.5


@pytest.fixture(scope="module")
def hostile_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    """One broker for the whole suite (each test has its own honest clients)."""
    broker = start_broker(tmp_path_factory.mktemp("hostile"),
                          f"[mqtt]\nconnect_timeout = {CONNECT_TIMEOUT}\n")
    yield broker
    broker.stop()


def honest_stream(client_factory, broker: BrokerProcess, tag: str) -> HonestStream:
    return HonestStream(client_factory, broker.port, broker.proc.pid, tag)


def _publish_frame(topic: bytes, version: int, props: bytes = b"\x00",
                   payload: bytes = b"evil") -> bytes:
    """A QoS 0 PUBLISH built by hand around raw topic bytes (which may be invalid)."""
    body = len(topic).to_bytes(2, "big") + topic + (props if version == 5 else b"") + payload
    return bytes([0x30, len(body)]) + body


def _with_reserved_flag(version: int) -> bytes:
    frame = bytearray(encode_packet(Connect("reserved", version), version))
    frame[9] |= 0x01  # connect flags: after 2 header bytes, "MQTT" (6) and the level (1)
    return bytes(frame)


def _honest_topic(tag: str) -> bytes:
    return f"honest/stream/{tag}".encode()


# Each case: (id, connect first?, bytes to send given (version, honest topic), expected outcome)
# Outcome: a 5.0 reason code (a 3.1.1 client is just closed), or "close" (no CONNACK, close).
CASES = [
    # Spec 4.13 / MQTT-3.1.0-1: anything but CONNECT first is refused, nothing is answered.
    ("garbage", False, lambda v, t: bytes(range(256)) * 4, "close"),
    ("http-request", False, lambda v, t: b"GET /mqtt HTTP/1.1\r\nHost: x\r\n\r\n", "close"),
    ("tls-hello-on-plain-port", False, lambda v, t: b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1",
     "close"),
    ("publish-before-connect", False, lambda v, t: _publish_frame(t, v), "close"),
    # MQTT-3.1.2-3: the CONNECT reserved flag must be 0 (Malformed Packet).
    ("connect-reserved-flag", False, lambda v, t: _with_reserved_flag(v), "close"),
    # A remaining length that lies (longer than what is sent): the body never comes, the
    # CONNECT deadline closes the connection (spec 3.1.4: "a reasonable amount of time").
    ("connect-length-lies-longer", False, lambda v, t: b"\x10\x7f\x00\x04MQTT\x05", "close"),
    # 256 MB claimed before CONNECT: refused from the header alone, nothing buffered.
    ("connect-claims-256MB", False, lambda v, t: b"\x10\xff\xff\xff\x7f" + b"\x00" * 4096,
     "close"),
    # After CONNECT: 256 MB claimed. MQTT-3.2.2-? / spec 4.13: 0x95 Packet too large, checked
    # against our Maximum Packet Size from the fixed header before any body is buffered.
    ("publish-claims-256MB", True, lambda v, t: b"\x30\xff\xff\xff\x7f" + b"\x00" * 4096,
     0x95),
    # Remaining length longer than 4 bytes (spec 1.5.5): Malformed Packet.
    ("length-five-bytes", True, lambda v, t: b"\x30\xff\xff\xff\xff\x01", 0x81),
    # A remaining length that lies (shorter): the rest of the body parses as a bad packet.
    ("publish-length-lies-shorter", True,
     lambda v, t: bytes([0x30, 2]) + _publish_frame(t, v)[2:], 0x81),
    # MQTT-1.5.4-1 / -2: ill-formed UTF-8 and U+0000 in a topic are Malformed Packets.
    ("invalid-utf8-topic", True, lambda v, t: _publish_frame(t + b"\xff\xfe", v), 0x81),
    ("surrogate-in-topic", True, lambda v, t: _publish_frame(t + b"\xed\xa0\x80", v), 0x81),
    ("nul-in-topic", True, lambda v, t: _publish_frame(t + b"\x00", v), 0x81),
    # MQTT-2.1.3-1: reserved fixed-header flags; MQTT-3.3.1-4: QoS 3; reserved type 0.
    ("subscribe-reserved-flags", True,
     lambda v, t: b"\x80" + encode_packet(Subscribe(1, [("a", SubscriptionOptions())]), v)[1:],
     0x81),
    ("pubrel-reserved-flags", True, lambda v, t: b"\x60\x02\x00\x01", 0x81),
    ("pingreq-reserved-flags", True, lambda v, t: b"\xc1\x00", 0x81),
    ("publish-qos3", True, lambda v, t: b"\x36" + _publish_frame(t, v)[1:], 0x81),
    ("reserved-packet-type-0", True, lambda v, t: b"\x00\x00", 0x81),
    # MQTT-3.1.0-2: a second CONNECT is a Protocol Error.
    ("second-connect", True, lambda v, t: encode_packet(Connect("again", v), v), 0x82),
    # MQTT-3.3.2-2: no wildcards in a PUBLISH topic: 0x90 Topic Name invalid.
    ("wildcard-plus-in-publish", True, lambda v, t: _publish_frame(t + b"/+", v), 0x90),
    ("wildcard-hash-in-publish", True, lambda v, t: _publish_frame(b"honest/#", v), 0x90),
    # Spec 2.2.2.2: a property that may appear once appearing twice is a Protocol Error.
    ("duplicate-property", True,
     lambda v, t: _publish_frame(t, v, props=b"\x06\x03\x00\x00\x03\x00\x00"), 0x82),
]
VERSION_ONLY_5 = {"duplicate-property"}  # 3.1.1 has no properties


def _case_params():
    for name, connect, build, outcome in CASES:
        for version in (4, 5):
            if version == 4 and name in VERSION_ONLY_5:
                continue
            yield pytest.param(connect, build, outcome, version, id=f"{name}-v{version}")


@pytest.mark.parametrize(("connect", "build", "outcome", "version"), list(_case_params()))
def test_hostile_bytes(hostile_broker, client_factory, connect, build, outcome, version):
    tag = f"bytes-{version}-{time.monotonic_ns()}"
    with honest_stream(client_factory, hostile_broker, tag) as honest:
        raw = RawClient(hostile_broker.port, version)
        try:
            if connect:
                assert raw.connect(f"hostile-{tag}").reason_code == 0
            raw.send_bytes(build(version, _honest_topic(tag)))
            assert raw.closed(timeout=CONNECT_TIMEOUT + WAIT), "the broker kept the connection"
            packets = raw.packets()
        finally:
            raw.close()
        if outcome == "close" or version == 4:
            # before CONNECT nothing is answered; 3.1.1 has no DISCONNECT packet
            assert not any(isinstance(p, Connack) and p.reason_code == 0 for p in packets)
            assert not any(isinstance(p, Disconnect) for p in packets), packets
        else:
            assert [(type(p), p.reason_code) for p in packets] == [(Disconnect, outcome)]
        honest.wait_progress()
    honest.check(RSS_BOUND_MIB)


@pytest.mark.parametrize("version", [4, 5])
def test_truncated_packet_then_silence_is_closed_by_keep_alive(hostile_broker, client_factory,
                                                               version):
    """Half a PUBLISH, then nothing: the keep alive (1.5 x 1 s, MQTT-3.1.2-24) closes the
    connection (5.0: DISCONNECT 0x8D); the half packet is never routed."""
    tag = f"trunc-{version}"
    with honest_stream(client_factory, hostile_broker, tag) as honest:
        with RawClient(hostile_broker.port, version) as raw:
            assert raw.connect(f"half-{tag}", keep_alive=1).reason_code == 0
            frame = _publish_frame(_honest_topic(tag), version)
            raw.send_bytes(frame[: len(frame) // 2])
            assert raw.closed(timeout=WAIT)
            packets = raw.packets()
        expected = [(Disconnect, 0x8D)] if version == 5 else []
        assert [(type(p), p.reason_code) for p in packets] == expected
        honest.wait_progress()
    honest.check(RSS_BOUND_MIB)


def test_truncated_packet_then_eof_routes_nothing(hostile_broker, client_factory):
    """Half a PUBLISH, then the client closes: nothing is routed (the honest stream would
    see it), and the broker forgets the connection."""
    tag = "trunc-eof"
    with honest_stream(client_factory, hostile_broker, tag) as honest:
        for cut in (1, 3, 7):
            with RawClient(hostile_broker.port, 5) as raw:
                assert raw.connect(f"eof-{cut}").reason_code == 0
                raw.send_bytes(_publish_frame(_honest_topic(tag), 5)[:cut])
        honest.wait_progress()
    honest.check(RSS_BOUND_MIB)


@pytest.mark.parametrize("version", [4, 5])
def test_qos2_packet_id_reuse_before_pubrel_is_not_delivered_twice(hostile_broker,
                                                                   client_factory, version):
    """Spec 4.3.3 (method B): until PUBREL, a PUBLISH reusing a QoS 2 packet id is
    acknowledged with PUBREC but not delivered again, even with another payload; after
    PUBCOMP the id is free for a new message."""
    tag = f"reuse-{version}"
    with honest_stream(client_factory, hostile_broker, tag) as honest:
        with RawClient(hostile_broker.port, version) as raw:
            raw.connect(f"reuse-{version}")
            raw.subscribe(f"reuse/{version}", qos=0)
            for payload in (b"first", b"second", b"third"):
                raw.publish(f"reuse/{version}", payload, qos=2, packet_id=7, wait_ack=False)
                received = raw.recv()
                if isinstance(received, Publish):
                    delivered = [received.payload]
                    received = raw.recv()
                else:
                    delivered = []
                assert isinstance(received, Pubrec) and received.packet_id == 7, received
                assert delivered == ([payload] if payload != b"second" else []), delivered
                if payload != b"first":
                    raw.send(Pubrel(7))
                    assert raw.recv().packet_id == 7  # PUBCOMP
            raw.recv_nothing(0.2)
        honest.wait_progress()
    honest.check(RSS_BOUND_MIB)


@pytest.mark.slow
@pytest.mark.parametrize("persisted", [True, False], ids=["persisted-topic", "in-memory-topic"])
def test_stalled_reader_holding_10k_queued_qos1_messages(hostile_broker, broker_factory,
                                                         client_factory, persisted):
    """A QoS 1 subscriber that never reads, with far more messages for it than its socket
    takes: the broker writes up to the high watermark, queues 10,000 in the bounded session
    queue, and beyond that follows the commit log (persisted topic: nothing is lost, the
    client gets everything when it reads again) or drops the oldest, counted and logged
    (in-memory topic). Memory stays bounded and everyone else is served."""
    broker = hostile_broker if persisted else broker_factory(
        '[log]\npersist_filters = "persisted/#"\n')
    client_id = f"stalled-{persisted}"
    total = 0
    with honest_stream(client_factory, broker, f"stalled-{persisted}") as honest:
        sock = stalled_subscriber(broker.port, client_id, "stall/#", qos=1, properties={
            PropertyId.RECEIVE_MAXIMUM: 65535, PropertyId.SESSION_EXPIRY_INTERVAL: 600})
        pub = client_factory(f"stall-pub-{persisted}", 5)
        pub.paho.max_inflight_messages_set(500)
        pub.connect(broker.port)

        def publish(count: int) -> None:
            nonlocal total
            infos = [pub.publish("stall/t", f"{total + i:08d}".encode().ljust(1000, b"."),
                                 qos=1, wait=False) for i in range(count)]
            total += count
            infos[-1].wait_for_publish(timeout=60)
            assert infos[-1].is_published()

        publish(16_000)  # more than the socket, the watermark and the 10k queue together
        honest.wait_progress()
        full = honest.sample_rss()
        publish(4_000)  # the queue is full: memory must hold
        honest.wait_progress()
        assert honest.sample_rss() - full < 8 * 1024, "memory grows with a full queue"
        dropped = f"messages dropped client_id={client_id}"
        if persisted:
            assert dropped not in broker.log()
        else:
            wait_for(lambda: dropped in broker.log(), what="the queue overflow to be logged")
        sock.close()
        honest.wait_progress()
    honest.check(64)  # 10k queued 1 KB messages, the inflight ones, socket buffers
    if persisted:
        assert _resume_and_count(broker.port, client_id, total) == list(range(total))


def _resume_and_count(port: int, client_id: str, total: int) -> list[int]:
    """Reconnect the stalled session and read (and acknowledge) until ``total`` distinct
    messages arrived; return their numbers in order of first arrival."""
    seen: dict[int, None] = {}
    with RawClient(port, 5) as raw:
        connack = raw.connect(client_id, clean_start=False,
                              properties={PropertyId.RECEIVE_MAXIMUM: 1000})
        assert connack.session_present
        while len(seen) < total:
            publish = raw.recv_type(Publish)
            seen.setdefault(int(publish.payload[:8]), None)
            raw.ack(publish)
    return list(seen)


@pytest.mark.slow
def test_flood_without_configured_limits_does_not_starve_others(hostile_broker,
                                                                client_factory):
    """A client blasting small QoS 0 publishes as fast as TCP allows, with no rate limit
    configured: the per-turn parsing budget keeps the event loop fair, so the honest stream
    is served promptly, and memory stays bounded."""
    tag = "flood"
    with honest_stream(client_factory, hostile_broker, tag) as honest:
        raw = RawClient(hostile_broker.port, 5)
        raw.connect("flooder")
        frames = encode_packet(Publish("flood/nobody", b"x"), 5) * 1_500_000  # ~18 MB

        def flood() -> None:
            try:
                raw.sock.sendall(frames)
            except OSError:
                pass

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        honest.wait_progress(50)
        raw.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked sendall
        sender.join(WAIT)
        raw.close()
        honest.wait_progress()
    honest.check(RSS_BOUND_MIB * 2)
