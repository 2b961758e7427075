"""Limits: connect rate, per-client message and byte rates, subscriptions per client, topic
length, and bounded output to clients that do not read.

The token buckets are tested without a clock (time is an argument); everything else runs a
real broker process and real clients.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from securitykit import HonestStream, rss_kib, stalled_subscriber

from conftest import WAIT, wait_for
from meshmq.broker.ratelimit import ClientThrottle, ConnectRateLimiter, TokenBucket
from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import (
    Connack,
    Disconnect,
    Puback,
    Publish,
    Pubrel,
    SubscriptionOptions,
    Will,
)
from rawclient import ConnectionClosed, RawClient

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


# ---------------------------------------------------------------------- token buckets


@given(st.integers(1, 50), st.integers(1, 50),
       st.lists(st.tuples(st.floats(0, 2), st.integers(1, 5)), max_size=60))
def test_a_bucket_never_gives_more_than_burst_plus_rate_times_time(rate, burst, steps):
    bucket = TokenBucket(rate, burst, now=0.0)
    now = taken = 0.0
    for dt, amount in steps:
        now += dt
        if bucket.try_take(amount, now):
            taken += amount
        assert taken <= burst + rate * now + 1e-9


def test_wait_time_is_when_tokens_are_back():
    bucket = TokenBucket(rate=10, burst=2, now=0.0)
    assert bucket.try_take(2, 0.0) and not bucket.try_take(1, 0.0)
    assert bucket.wait_time(1, 0.0) == pytest.approx(0.1)
    assert not bucket.try_take(1, 0.09)
    assert bucket.try_take(1, 0.1)
    bucket.take(5, 0.1)  # debt
    assert bucket.available(0.1) == pytest.approx(-5)
    assert bucket.wait_time(0, 0.1) == pytest.approx(0.5)


def test_connect_limiter_refuses_per_address_without_spending_node_tokens():
    limiter = ConnectRateLimiter(rate=1, burst=3, per_address_rate=1, per_address_burst=1,
                                 now=0.0)
    assert limiter.allow("10.0.0.1", 0.0)
    for _ in range(5):
        assert not limiter.allow("10.0.0.1", 0.0)  # its own bucket is empty
    assert limiter.allow("10.0.0.2", 0.0) and limiter.allow("10.0.0.3", 0.0)  # node had 3
    assert not limiter.allow("10.0.0.4", 0.0)  # the node bucket is empty now
    assert limiter.allow("10.0.0.4", 1.0)  # ...and refills at its rate
    assert limiter.refused == 6


def test_connect_limiter_forgets_least_recent_addresses():
    limiter = ConnectRateLimiter(0, 1, 1, 1, now=0.0, max_tracked=2)
    for address in ("a", "b", "c"):
        assert limiter.allow(address, 0.0)
    assert limiter.statistics()["connect_rate_addresses"] == 2
    assert not limiter.allow("c", 0.0)  # still tracked
    assert limiter.allow("a", 0.0)  # forgotten, so its bucket is fresh


def test_throttle_admits_in_order_and_detects_a_flood():
    throttle = ClientThrottle(message_rate=10, message_burst=2, byte_rate=0, byte_burst=1,
                              max_throttle=1.0, now=0.0)
    events = [Publish("t", b""), Puback(1), Publish("t", b""), Publish("t", b""), Puback(2)]
    assert throttle.admit(events, 0.0) == 3  # two publishes and the ack between them
    assert throttle.must_wait(2, 0.0) and throttle.wait_time(2, 0.0) == pytest.approx(0.1)
    throttle.start_pause(0.0)
    assert not throttle.flooding(0.5)
    throttle.start_pause(0.6)  # still the same episode
    assert throttle.flooding(1.0)
    throttle.read_without_pause()
    assert not throttle.flooding(5.0)


def test_byte_debt_pauses_until_repaid():
    throttle = ClientThrottle(0, 1, byte_rate=1000, byte_burst=500, max_throttle=0, now=0.0)
    throttle.charge_bytes(1500, 0.0)
    events = [Publish("t", b"x" * 1400)]
    assert throttle.admit(events, 0.0) == 0  # held until the read is paid for
    assert throttle.must_wait(1, 0.0) and throttle.wait_time(1, 0.0) == pytest.approx(1.0)
    assert throttle.admit(events, 1.0) == 1
    assert not throttle.must_wait(0, 1.0)
    assert not throttle.flooding(100.0)  # max_throttle 0: never disconnect


# ---------------------------------------------------------------------- connect rate


def _refused_connects(port: int, version: int, attempts: int = 30) -> tuple[int, Connack]:
    """Connect until one is refused; return (accepted before it, the refusing CONNACK)."""
    for accepted in range(attempts):
        raw = RawClient(port, version)
        connack = raw.connect(f"storm-{version}-{accepted}")
        if connack.reason_code:
            assert raw.closed(), "a refused connection must be closed"
            raw.close()
            return accepted, connack
        raw.close()
    pytest.fail(f"{attempts} CONNECTs in a row were all accepted")


@pytest.mark.parametrize(("version", "code"), [(5, 0x9F), (4, 3)])
def test_connect_rate_refuses_with_0x9f_or_rc3(broker_factory, version, code):
    """Over the node's connect rate: 5.0 gets CONNACK 0x9F Connection rate exceeded
    (spec 3.2.2.2), 3.1.1 gets return code 3 Server unavailable (spec 3.2.2.3); both are
    closed. The bucket refills, so a later client gets in."""
    broker = broker_factory("[limits]\nconnect_rate = 2\nconnect_burst = 5\n")
    started = time.monotonic()
    accepted, connack = _refused_connects(broker.port, version)
    assert connack.reason_code == code
    assert 5 <= accepted <= 5 + 2 * (time.monotonic() - started) + 1

    def gets_in() -> bool:
        with RawClient(broker.port, version) as raw:
            return raw.connect("patient").reason_code == 0

    wait_for(gets_in, what="the connect bucket to refill")
    assert "connection refused" in broker.log() and "connect rate" in broker.log()


def test_connect_rate_per_address(broker_factory):
    """Per source address: the 3rd CONNECT from 127.0.0.1 in a burst of 2 is refused."""
    broker = broker_factory(
        "[limits]\nconnect_rate = 0\nconnect_rate_per_address = 1\n"
        "connect_burst_per_address = 2\n")
    accepted, connack = _refused_connects(broker.port, 5)
    assert connack.reason_code == 0x9F and 2 <= accepted <= 4


# ---------------------------------------------------------------------- message and byte rates


def _receive_all(client, count: int) -> list[bytes]:
    return [client.expect(timeout=WAIT).payload for _ in range(count)]


@pytest.mark.slow
@pytest.mark.parametrize(("version", "qos"), [(5, 1), (4, 0)])
def test_message_rate_throttles_without_loss(broker_factory, client_factory, version, qos):
    """Over limits.client_message_rate the broker stops reading from the client: it is slowed
    to its rate (TCP backpressure) and nothing is lost, QoS 0 included."""
    broker = broker_factory(
        "[limits]\nclient_message_rate = 200\nclient_message_burst = 20\n"
        "throttle_timeout = 30\n")
    sub = client_factory("rate-sub", 5)
    sub.connect(broker.port)
    sub.subscribe("rate/#", qos=1)
    pub = client_factory("rate-pub", version)
    pub.connect(broker.port)
    count = 400
    started = time.monotonic()
    infos = [pub.publish("rate/t", str(i), qos=qos, wait=False) for i in range(count)]
    received = _receive_all(sub, count)
    elapsed = time.monotonic() - started
    assert received == [str(i).encode() for i in range(count)]
    assert elapsed >= 0.8 * (count - 20) / 200, f"not throttled: {count} in {elapsed:.2f} s"
    if qos:
        infos[-1].wait_for_publish(timeout=WAIT)
    assert pub.disconnects.empty()
    assert "over its rate limit" not in broker.log()


@pytest.mark.slow
def test_byte_rate_throttles_without_loss(broker_factory, client_factory):
    """limits.client_byte_rate: 400 KB at 200 KB/s (burst 50 KB) takes about 1.75 s."""
    broker = broker_factory(
        "[limits]\nclient_byte_rate = 200000\nclient_byte_burst = 50000\n")
    sub = client_factory("bytes-sub", 5)
    sub.connect(broker.port)
    sub.subscribe("bytes/#", qos=1)
    pub = client_factory("bytes-pub", 4)
    pub.connect(broker.port)
    payload = b"x" * 10_000
    started = time.monotonic()
    for _ in range(40):
        pub.publish("bytes/t", payload, qos=1, wait=False)
    received = _receive_all(sub, 40)
    elapsed = time.monotonic() - started
    assert received == [payload] * 40
    assert elapsed >= 0.8 * (400_000 - 50_000) / 200_000, f"not throttled: {elapsed:.2f} s"


@pytest.mark.parametrize("version", VERSIONS)
def test_a_client_flooding_past_the_throttle_timeout_is_disconnected(
        broker_factory, client_factory, raw_factory, version):
    """A client still over its rate after limits.throttle_timeout seconds of throttling is a
    flooder: DISCONNECT 0x96 Message rate too high (5.0, spec 3.14.2.1), a plain close for
    3.1.1. An honest client is served throughout."""
    broker = broker_factory(
        "[limits]\nclient_message_rate = 100\nclient_message_burst = 10\n"
        "throttle_timeout = 1\n")
    # the honest client is under the same per-client limit: half its rate, on any machine
    with HonestStream(client_factory, broker.port, broker.proc.pid, "flood",
                      pace=2 / 100) as honest:
        raw = raw_factory(broker.port, version)
        raw.connect("flooder")
        flood = b"".join(encode_packet(Publish("flood/t", b"x" * 10), version)
                         for _ in range(3000))
        sender = threading.Thread(target=_send_ignoring_reset, args=(raw.sock, flood))
        sender.start()
        assert raw.closed(timeout=WAIT), "the flooder was not disconnected"
        sender.join(WAIT)
        packets = raw.packets()
        if version == 5:
            assert packets and isinstance(packets[-1], Disconnect), packets
            assert packets[-1].reason_code == 0x96
        else:
            assert packets == []
        honest.wait_progress()
    honest.check(rss_bound_mib=32)
    assert "over its rate limit" in broker.log()


def _send_ignoring_reset(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass  # the broker closed the connection mid-flood, as it should


# ---------------------------------------------------------------------- subscriptions, topics


@pytest.mark.parametrize(("version", "refused"), [(5, 0x97), (4, 0x80)])
def test_max_subscriptions_per_client(broker_factory, raw_factory, version, refused):
    """Beyond limits.max_subscriptions a filter gets SUBACK 0x97 Quota exceeded (5.0) or 0x80
    Failure (3.1.1) (spec 3.9.3); replacing an existing filter is not a new one, and an
    UNSUBSCRIBE frees a place."""
    broker = broker_factory("[limits]\nmax_subscriptions = 3\n")
    raw = raw_factory(broker.port, version)
    raw.connect("many-subs")
    opts = SubscriptionOptions(0)
    suback = raw.subscribe([(name, opts) for name in ("a", "b", "c", "d", "e")])
    assert suback.reason_codes == [0, 0, 0, refused, refused]
    assert raw.subscribe("a", qos=1).reason_codes == [1]  # a replacement
    raw.unsubscribe("b")
    assert raw.subscribe("d").reason_codes == [0]
    assert raw.subscribe("e").reason_codes == [refused]
    raw.publish("e", b"not for you")
    raw.publish("d", b"for you")
    assert raw.recv_type(Publish).payload == b"for you"
    assert "quota full" in broker.log()


@pytest.mark.parametrize("version", VERSIONS)
def test_max_topic_bytes(broker_factory, raw_factory, version):
    """limits.max_topic_bytes counts UTF-8 bytes: a longer topic name is refused with
    DISCONNECT 0x90 Topic Name invalid (5.0; 3.1.1 is closed), a longer filter with 0x8F
    (3.1.1: 0x80), a longer will topic with CONNACK 0x90 (3.1.1: closed)."""
    broker = broker_factory("[limits]\nmax_topic_bytes = 64\n")
    raw = raw_factory(broker.port, version)
    raw.connect("topics")
    at_limit, over = "é" * 32, "é" * 33  # 64 and 66 bytes
    filter_code = 0x8F if version == 5 else 0x80
    assert raw.subscribe([(at_limit, SubscriptionOptions(0)), (over, SubscriptionOptions(0))]
                         ).reason_codes == [0, filter_code]
    raw.publish(at_limit, b"fits")
    assert raw.recv_type(Publish).topic == at_limit
    raw.publish(over, b"too long")
    assert raw.closed()
    packets = raw.packets()
    if version == 5:
        assert [(type(p), p.reason_code) for p in packets] == [(Disconnect, 0x90)]
    else:
        assert packets == []
    will = raw_factory(broker.port, version)
    if version == 5:
        assert will.connect("will", will=Will(over, b"x")).reason_code == 0x90
    else:
        with pytest.raises(ConnectionClosed):
            will.connect("will", will=Will(over, b"x"))


# ---------------------------------------------------------------------- clients that do not read


@pytest.mark.slow
def test_client_that_never_reads_its_answers_is_paused_not_buffered(broker_factory,
                                                                    client_factory):
    """A client that keeps sending requests (here PUBRELs, each answered by a PUBCOMP) but
    never reads the answers: once they pass the hard write limit the broker stops reading from
    it (TCP backpressure), so the answers cannot grow broker memory; an honest client is
    served meanwhile."""
    broker = broker_factory()
    with HonestStream(client_factory, broker.port, broker.proc.pid, "deaf") as honest:
        sock = stalled_subscriber(broker.port, "deaf", "nothing/here", qos=0)
        # 3M PUBRELs (12 MB) would make 15 MB of PUBCOMP 0x92 if all were answered
        frames = encode_packet(Pubrel(7), 5) * 3_000_000
        sock.settimeout(None)  # the send blocks until the broker reads again (or never)
        sender = threading.Thread(target=_send_ignoring_reset, args=(sock, frames), daemon=True)
        sender.start()
        wait_for(lambda: "reading paused" in broker.log() or not sender.is_alive(), timeout=60,
                 what="the broker to stop reading from the deaf client")
        honest.wait_progress(20)
        assert sender.is_alive(), "the broker read everything: no backpressure"
        settled = honest.sample_rss()
        honest.wait_progress(50)
        assert honest.sample_rss() - settled < 4 * 1024, "broker memory still growing"
        sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked sendall
        sender.join(WAIT)
        sock.close()
        honest.wait_progress()
    honest.check(rss_bound_mib=32)


@pytest.mark.slow
def test_stalled_qos0_subscriber_gets_bounded_output_and_counted_drops(broker_factory,
                                                                       client_factory):
    """A QoS 0 subscriber that never reads: the broker writes up to the high watermark, then
    queues in the bounded session queue and drops the oldest (counted, logged); its memory
    stays bounded and the publisher is not slowed."""
    broker = broker_factory("[session]\nmax_queued_messages = 1000\n")
    sock = stalled_subscriber(broker.port, "stalled-qos0", "fan/#", qos=0)
    pub = client_factory("fan-pub", 5)
    pub.connect(broker.port)
    base = rss_kib(broker.proc.pid)
    payload = b"y" * 1000
    started = time.monotonic()
    for i in range(20_000):
        pub.publish("fan/t", payload, qos=1 if i % 1000 == 999 else 0)  # an ack every 1000
    elapsed = time.monotonic() - started
    wait_for(lambda: "messages dropped client_id=stalled-qos0" in broker.log(),
             what="the drop to be logged")
    growth_mib = (rss_kib(broker.proc.pid) - base) / 1024
    assert growth_mib < 32, f"broker RSS grew {growth_mib:.1f} MiB"
    assert elapsed < 30
    sock.close()
