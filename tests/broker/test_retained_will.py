"""Retained messages and will messages (incl. will delay), keep-alive enforcement."""

from __future__ import annotations

import time

import pytest
from paho.mqtt.packettypes import PacketTypes

from conftest import asks_positions, props, split_position
from meshmq.mqtt.packets import Disconnect, Pingreq, Pingresp, Publish, Will
from meshmq.mqtt.properties import PropertyId

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


def retained_on_subscribe(client_factory, port, topic_filter, version=5, name="probe"):
    """Subscribe a fresh client to ``topic_filter`` and return the messages that arrive
    before a barrier published after the SUBACK (i.e. the retained ones)."""
    probe = client_factory(name, version)
    probe.connect(port)
    probe.subscribe(f"barrier/{name}", qos=1)
    probe.subscribe(topic_filter, qos=1)
    probe.publish(f"barrier/{name}", b"barrier", qos=1)
    got = []
    while (msg := probe.expect()).topic != f"barrier/{name}":
        got.append(msg)
    probe.disconnect()
    return got


# ---------------------------------------------------------------------- retained


@pytest.mark.parametrize("version", VERSIONS)
def test_retained_message_delivered_on_subscribe_with_retain_flag(broker, client_factory,
                                                                   version):
    """A new subscription receives the retained message with RETAIN 1 (MQTT-3.3.1-6,
    MQTT-3.3.1-8 / 3.1.1 MQTT-3.3.1-8)."""
    pub = client_factory("pub", version)
    pub.connect(broker.port)
    pub.publish("ret/t", b"stored", qos=1, retain=True)
    got = retained_on_subscribe(client_factory, broker.port, "ret/t", version)
    assert [(m.topic, m.payload, m.retain, m.qos) for m in got] == [("ret/t", b"stored", True, 1)]


def test_retained_message_replace_and_clear(broker, client_factory):
    """A new retained message replaces the old (MQTT-3.3.1-5); an empty retained payload
    removes it (MQTT-3.3.1-6, -7)."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("ret/r", b"one", qos=1, retain=True)
    assert [m.payload for m in retained_on_subscribe(client_factory, broker.port, "ret/r",
                                                     name="p1")] == [b"one"]
    pub.publish("ret/r", b"two", qos=1, retain=True)
    assert [m.payload for m in retained_on_subscribe(client_factory, broker.port, "ret/r",
                                                     name="p2")] == [b"two"]
    pub.publish("ret/r", b"", qos=1, retain=True)
    assert retained_on_subscribe(client_factory, broker.port, "ret/r", name="p3") == []


def test_non_retained_publish_does_not_replace_retained(broker, client_factory):
    """A PUBLISH with RETAIN 0 leaves the retained message alone (MQTT-3.3.1-10 of 3.1.1)."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("ret/k", b"keep", qos=1, retain=True)
    pub.publish("ret/k", b"transient", qos=1)
    assert [m.payload for m in retained_on_subscribe(client_factory, broker.port,
                                                     "ret/k")] == [b"keep"]


def test_wildcard_subscription_gets_all_matching_retained(broker, client_factory):
    """Every retained message matching the filter is sent (MQTT-3.3.1-6), none other."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for topic in ("w/a", "w/b/c", "w", "other/x", "wx/y"):
        pub.publish(topic, topic.encode(), qos=1, retain=True)
    got = retained_on_subscribe(client_factory, broker.port, "w/#")
    assert sorted(m.topic for m in got) == ["w", "w/a", "w/b/c"]
    assert all(m.retain and m.payload == m.topic.encode() for m in got)
    plus = retained_on_subscribe(client_factory, broker.port, "+/a", name="plus")
    assert [m.topic for m in plus] == ["w/a"]


def test_retained_message_qos_downgraded_to_subscription(broker, client_factory):
    """Retained messages are sent at min(stored QoS, granted QoS) (MQTT-3.8.4-8)."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("ret/q", b"q2", qos=2, retain=True)
    probe = client_factory("q0probe", 5)
    probe.connect(broker.port)
    probe.subscribe("ret/q", qos=0)
    msg = probe.expect()
    assert (msg.payload, msg.qos, msg.retain) == (b"q2", 0, True)


def test_retained_message_keeps_properties(broker, client_factory):
    """Retained 5.0 messages keep their properties (spec 3.3.2.3)."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("ret/p", b"{}", qos=1, retain=True,
                properties=props(PacketTypes.PUBLISH, ContentType="application/json",
                                 UserProperty=[("k", "v")]))
    (msg,) = retained_on_subscribe(client_factory, broker.port, "ret/p")
    assert msg.properties.ContentType == "application/json"
    assert msg.properties.UserProperty == [("k", "v")]  # as published: no log position


def test_retained_dollar_topics_not_matched_by_leading_wildcards(broker, client_factory):
    """Retained '$' topics are not sent for '#' or '+/...' filters (MQTT-4.7.2-1), but are for
    an explicit '$app/#'."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("$app/x", b"dollar", qos=1, retain=True)
    pub.publish("app/x", b"plain", qos=1, retain=True)
    assert [m.topic for m in retained_on_subscribe(client_factory, broker.port, "#",
                                                   name="hash")
            if m.topic.endswith("/x")] == ["app/x"]
    assert [m.topic for m in retained_on_subscribe(client_factory, broker.port, "+/x",
                                                   name="plus")] == ["app/x"]
    assert [m.topic for m in retained_on_subscribe(client_factory, broker.port, "$app/#",
                                                   name="dollar")] == ["$app/x"]


def test_retained_message_carries_subscription_identifier(broker, client_factory):
    """Retained messages sent on SUBSCRIBE carry that subscription's identifier
    (MQTT-3.3.4-3)."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("ret/id", b"x", qos=1, retain=True)
    sub = client_factory("sub", 5)
    sub.connect(broker.port)
    sub.subscribe("ret/#", qos=1,
                  properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=77))
    msg = sub.expect()
    assert (msg.topic, msg.retain) == ("ret/id", True)
    assert msg.properties.SubscriptionIdentifier == [77]


# ---------------------------------------------------------------------- wills


def watcher(client_factory, port, topic="will/#", version=5):
    client = client_factory("watcher", version)
    client.connect(port)
    client.subscribe(topic, qos=1)
    return client


@pytest.mark.parametrize("version", VERSIONS)
def test_will_published_on_abnormal_close(broker, raw_factory, client_factory, version):
    """Closing the network connection without DISCONNECT publishes the will (MQTT-3.1.2-8);
    5.0 will properties travel with it (spec 3.1.3.2)."""
    watch = watcher(client_factory, broker.port)
    asking = client_factory("asking-watcher", 5)  # wants log positions (docs/replay.md)
    asking.connect(broker.port, properties=asks_positions())
    asking.subscribe("will/#", qos=1)
    will_props = {}
    if version == 5:
        will_props = {
            PropertyId.USER_PROPERTY: [("origin", "dead"), ("origin", "again")],
            PropertyId.CONTENT_TYPE: "text/plain",
            PropertyId.PAYLOAD_FORMAT_INDICATOR: 1,
            PropertyId.RESPONSE_TOPIC: "will/reply",
            PropertyId.CORRELATION_DATA: b"\x01\x02",
        }
    raw = raw_factory(broker.port, version)
    raw.connect("dying", will=Will("will/dying", b"gone", 1, False, will_props))
    raw.close()
    msg = watch.expect()
    assert (msg.topic, msg.payload, msg.qos, msg.retain) == ("will/dying", b"gone", 1, False)
    own, position = split_position(getattr(asking.expect().properties, "UserProperty", None))
    assert position is not None  # a QoS 1 will is persisted like any publish
    if version == 5:
        assert own == [("origin", "dead"), ("origin", "again")]
        assert msg.properties.UserProperty == own  # nothing added for a client that did not ask
        assert msg.properties.ContentType == "text/plain"
        assert msg.properties.PayloadFormatIndicator == 1
        assert msg.properties.ResponseTopic == "will/reply"
        assert msg.properties.CorrelationData == b"\x01\x02"


@pytest.mark.parametrize("version", VERSIONS)
def test_no_will_after_normal_disconnect(broker, raw_factory, client_factory, version):
    """DISCONNECT 0x00 discards the will (MQTT-3.1.2-10, MQTT-3.14.4-3)."""
    watch = watcher(client_factory, broker.port)
    raw = raw_factory(broker.port, version)
    raw.connect("polite", will=Will("will/polite", b"gone", 1))
    raw.disconnect()
    watch.expect_none(1.0)


def test_will_sent_after_disconnect_with_will_message(broker, raw_factory, client_factory):
    """DISCONNECT 0x04 Disconnect with Will Message: the will is published (spec 3.14.2.1)."""
    watch = watcher(client_factory, broker.port)
    raw = raw_factory(broker.port)
    raw.connect("willful", will=Will("will/willful", b"as asked", 0))
    raw.disconnect(reason_code=0x04)
    msg = watch.expect()
    assert (msg.topic, msg.payload) == ("will/willful", b"as asked")


def test_retained_will(broker, raw_factory, client_factory):
    """A will with Will Retain 1 is published as a retained message (MQTT-3.1.2-17)."""
    watch = watcher(client_factory, broker.port)
    raw = raw_factory(broker.port)
    raw.connect("retwill", will=Will("will/retained", b"last words", 1, True))
    raw.close()
    assert watch.expect().payload == b"last words"  # published (and stored) by now
    got = retained_on_subscribe(client_factory, broker.port, "will/retained")
    assert [(m.payload, m.retain) for m in got] == [(b"last words", True)]


def test_will_delay_interval_delays_the_will(broker, raw_factory, client_factory):
    """Will Delay Interval 2 s (session expiry 10 s): the will is published no earlier than
    2 s after the connection closes (MQTT-3.1.3-9, spec 3.1.3.2.2)."""
    watch = watcher(client_factory, broker.port)
    raw = raw_factory(broker.port)
    raw.connect("delayed", clean_start=True,
                properties={PropertyId.SESSION_EXPIRY_INTERVAL: 10},
                will=Will("will/delayed", b"late", 1, False,
                          {PropertyId.WILL_DELAY_INTERVAL: 2}))
    closed_at = time.monotonic()
    raw.close()
    msg = watch.expect(timeout=6)
    elapsed = time.monotonic() - closed_at
    assert msg.payload == b"late"
    assert elapsed >= 1.9, f"will published after {elapsed:.2f} s"
    assert not hasattr(msg.properties, "WillDelayInterval")


def test_will_delay_capped_by_session_expiry(broker, raw_factory, client_factory):
    """The will is sent when the session ends if that comes first (spec 3.1.3.2.2):
    delay 60 s, session expiry 1 s -> will after about 1 s."""
    watch = watcher(client_factory, broker.port)
    raw = raw_factory(broker.port)
    raw.connect("short-session", properties={PropertyId.SESSION_EXPIRY_INTERVAL: 1},
                will=Will("will/short", b"session over", 0, False,
                          {PropertyId.WILL_DELAY_INTERVAL: 60}))
    closed_at = time.monotonic()
    raw.close()
    msg = watch.expect(timeout=5)
    assert msg.payload == b"session over"
    assert time.monotonic() - closed_at >= 0.9


def test_reconnect_before_will_delay_cancels_will(broker, raw_factory, client_factory):
    """Reconnecting to the session before the will delay passes: no will (MQTT-3.1.3-9)."""
    watch = watcher(client_factory, broker.port)
    session = {PropertyId.SESSION_EXPIRY_INTERVAL: 10}
    raw = raw_factory(broker.port)
    raw.connect("comeback", properties=session,
                will=Will("will/comeback", b"should not", 1, False,
                          {PropertyId.WILL_DELAY_INTERVAL: 2}))
    raw.close()
    again = raw_factory(broker.port)
    assert again.connect("comeback", clean_start=False, properties=session).session_present
    watch.expect_none(2.5)


def test_takeover_publishes_will_without_delay(broker, raw_factory, client_factory):
    """Session takeover closes the old connection; its will (no delay) is published
    (MQTT-3.1.4-3 -> spec 3.1.2.5)."""
    watch = watcher(client_factory, broker.port)
    old = raw_factory(broker.port)
    old.connect("takeover-will", will=Will("will/takeover", b"replaced", 0))
    raw_factory(broker.port).connect("takeover-will")
    assert old.recv_type(Disconnect).reason_code == 0x8E
    assert watch.expect().payload == b"replaced"


# ---------------------------------------------------------------------- keep alive


@pytest.mark.parametrize("version", VERSIONS)
def test_keep_alive_timeout_closes_and_publishes_will(broker, raw_factory, client_factory,
                                                      version):
    """No packet within 1.5x the keep alive: the server closes the connection
    (MQTT-3.1.2-24; 5.0 with DISCONNECT 0x8D) and the will is published (MQTT-3.1.2-8)."""
    watch = watcher(client_factory, broker.port)
    raw = raw_factory(broker.port, version)
    raw.connect("silent", keep_alive=1, will=Will("will/silent", b"timed out", 1))
    started = time.monotonic()
    assert raw.closed(timeout=4)
    elapsed = time.monotonic() - started
    assert 1.0 <= elapsed <= 3.0, f"closed after {elapsed:.2f} s"
    packets = raw.packets()
    if version == 5:
        assert [(type(p), p.reason_code) for p in packets] == [(Disconnect, 0x8D)]
    else:
        assert packets == []
    assert watch.expect().payload == b"timed out"


def test_keep_alive_respected_when_client_pings(broker, raw_factory):
    """A client that sends PINGREQ within the keep alive stays connected (spec 3.1.2.10)."""
    raw = raw_factory(broker.port)
    raw.connect("pinger", keep_alive=1)
    for _ in range(4):
        raw.send(Pingreq())
        raw.recv_type(Pingresp)
        assert not raw.closed(timeout=0.6)


def test_max_keepalive_sets_server_keep_alive(broker_factory, raw_factory):
    """mqtt.max_keepalive=5 and the client asks 60: CONNACK Server Keep Alive 5
    (MQTT-3.2.2-21, -22); keep alive 0 is also reduced to it."""
    broker = broker_factory("[mqtt]\nmax_keepalive = 5\n")
    connack = raw_factory(broker.port).connect("slowpoke", keep_alive=60)
    assert connack.properties[PropertyId.SERVER_KEEP_ALIVE] == 5
    connack = raw_factory(broker.port).connect("forever", keep_alive=0)
    assert connack.properties[PropertyId.SERVER_KEEP_ALIVE] == 5
    connack = raw_factory(broker.port).connect("modest", keep_alive=3)
    assert PropertyId.SERVER_KEEP_ALIVE not in connack.properties


def test_max_keepalive_not_silently_imposed_on_v311_clients(broker_factory, raw_factory):
    """3.1.1 has no Server Keep Alive, so the client cannot learn a reduced value: the server
    may only time it out after 1.5x *its own* keep alive (3.1.1 MQTT-3.1.2-24), or refuse the
    CONNECT (mosquitto answers 0x02). Closing an idle but compliant client after
    1.5x max_keepalive is neither."""
    broker = broker_factory("[mqtt]\nmax_keepalive = 1\n")
    raw = raw_factory(broker.port, version=4)
    connack = raw.connect("old-and-slow", keep_alive=60)
    assert connack.reason_code == 2  # identifier rejected, as mosquitto answers
    assert raw.closed()


def test_publish_from_raw_client_counts_as_activity(broker, raw_factory, client_factory):
    """Any control packet resets the keep-alive timer, not just PINGREQ (spec 3.1.2.10)."""
    raw = raw_factory(broker.port)
    raw.connect("busy", keep_alive=1)
    for i in range(4):
        raw.publish("busy/t", str(i).encode(), qos=1)
        assert not raw.closed(timeout=0.6)
    assert raw.subscribe("busy/t", qos=0).reason_codes == [0]
    raw.publish("busy/t", b"x")
    assert raw.recv_type(Publish).payload == b"x"
