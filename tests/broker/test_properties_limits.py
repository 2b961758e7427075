"""5.0 properties (expiry, topic aliases, request/response, user properties) and the configured
limits (packet size, queues, QoS, retain, feature switches)."""

from __future__ import annotations

import time

import pytest
from paho.mqtt.packettypes import PacketTypes

from conftest import props, wait_for
from meshmq.mqtt.packets import (
    Connack,
    Connect,
    Disconnect,
    Puback,
    Publish,
    Subscribe,
    SubscriptionOptions,
    Will,
)
from meshmq.mqtt.properties import PropertyId

PERSISTENT = 300


def persistent_subscriber(client_factory, port, client_id, topic, qos=1):
    """A 5.0 paho client with a persistent session subscribed to ``topic``, then offline."""
    sub = client_factory(client_id, 5)
    sub.connect(port, clean_start=True,
                properties=props(PacketTypes.CONNECT, SessionExpiryInterval=PERSISTENT))
    sub.subscribe(topic, qos=qos)
    sub.disconnect()


def reconnect(client_factory, port, client_id):
    sub = client_factory(client_id, 5)
    flags, _, _ = sub.connect(port, clean_start=False,
                              properties=props(PacketTypes.CONNECT,
                                               SessionExpiryInterval=PERSISTENT))
    assert flags.session_present is True
    return sub


def assert_closed_with(raw, code: int | None) -> None:
    """The broker closes ``raw``; with ``code``, its last packet is DISCONNECT ``code``."""
    assert raw.closed(), "broker did not close the connection"
    packets = raw.packets()
    if code is None:
        assert not any(isinstance(p, Disconnect) for p in packets), packets
    else:
        assert packets and isinstance(packets[-1], Disconnect), packets
        assert packets[-1].reason_code == code, f"0x{packets[-1].reason_code:02X}"


def assert_works(client, topic="honest/t"):
    client.subscribe(topic, qos=1)
    client.publish(topic, b"still fine", qos=1)
    assert client.expect().payload == b"still fine"


# ---------------------------------------------------------------------- message expiry


def test_message_expiry_counts_down_for_offline_session(broker, client_factory):
    """A queued message keeps Message Expiry Interval, reduced by the time it waited
    (MQTT-3.3.2-6): 0 < received <= sent."""
    persistent_subscriber(client_factory, broker.port, "exp-sub", "expiry/t")
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("expiry/t", b"fresh", qos=1,
                properties=props(PacketTypes.PUBLISH, MessageExpiryInterval=60))
    sub = reconnect(client_factory, broker.port, "exp-sub")
    msg = sub.expect()
    assert msg.payload == b"fresh"
    assert 0 < msg.properties.MessageExpiryInterval <= 60


def test_expired_message_not_delivered_to_offline_session(broker, client_factory):
    """A message whose expiry interval passed while queued is not delivered (MQTT-3.3.2-5)."""
    persistent_subscriber(client_factory, broker.port, "exp-sub", "expiry/t")
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("expiry/t", b"stale", qos=1,
                properties=props(PacketTypes.PUBLISH, MessageExpiryInterval=1))
    sent_at = time.monotonic()
    pub.publish("expiry/t", b"keeps", qos=1)
    wait_for(lambda: time.monotonic() - sent_at >= 1.5, what="message to expire")
    sub = reconnect(client_factory, broker.port, "exp-sub")
    msg = sub.expect()
    assert msg.payload == b"keeps"
    assert not hasattr(msg.properties, "MessageExpiryInterval")
    sub.expect_none(0.3)


def test_live_message_forwarded_with_expiry(broker, client_factory):
    """A live message is forwarded with its (remaining) expiry interval (MQTT-3.3.2-6)."""
    sub = client_factory("sub", 5)
    sub.connect(broker.port)
    sub.subscribe("expiry/live", qos=0)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("expiry/live", b"x", properties=props(PacketTypes.PUBLISH,
                                                        MessageExpiryInterval=30))
    assert 0 < sub.expect().properties.MessageExpiryInterval <= 30


def test_expired_retained_message_not_sent(broker, client_factory):
    """A retained message past its expiry is no longer sent to new subscribers
    (MQTT-3.3.2-5)."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("expiry/ret", b"old", qos=1, retain=True,
                properties=props(PacketTypes.PUBLISH, MessageExpiryInterval=1))
    sent_at = time.monotonic()
    pub.publish("expiry/ret2", b"lasting", qos=1, retain=True)
    wait_for(lambda: time.monotonic() - sent_at >= 1.5, what="retained message to expire")
    sub = client_factory("sub", 5)
    sub.connect(broker.port)
    sub.subscribe("expiry/+", qos=1)
    msg = sub.expect()
    assert (msg.topic, msg.payload) == ("expiry/ret2", b"lasting")
    sub.expect_none(0.3)


# ---------------------------------------------------------------------- topic aliases


def test_client_topic_alias_is_resolved(broker, raw_factory, client_factory):
    """PUBLISH with topic + alias sets the alias; later PUBLISH with empty topic + alias uses
    it (spec 3.3.2.3.4); subscribers get the full topic and no alias of ours."""
    sub = client_factory("sub", 5)
    sub.connect(broker.port)
    sub.subscribe("alias/#", qos=1)
    raw = raw_factory(broker.port)
    connack = raw.connect("aliaser")
    assert connack.properties[PropertyId.TOPIC_ALIAS_MAXIMUM] >= 1
    raw.publish("alias/full", b"1", qos=1, properties={PropertyId.TOPIC_ALIAS: 1})
    raw.publish("", b"2", qos=1, properties={PropertyId.TOPIC_ALIAS: 1})
    raw.publish("alias/other", b"3", qos=1, properties={PropertyId.TOPIC_ALIAS: 1})  # remap
    raw.publish("", b"4", qos=1, properties={PropertyId.TOPIC_ALIAS: 1})
    got = [sub.expect() for _ in range(4)]
    assert [(m.topic, m.payload) for m in got] == [
        ("alias/full", b"1"), ("alias/full", b"2"), ("alias/other", b"3"), ("alias/other", b"4"),
    ]
    assert not any(hasattr(m.properties, "TopicAlias") for m in got)


def test_topic_alias_above_maximum_disconnects_0x94(broker_factory, raw_factory,
                                                    client_factory):
    """A Topic Alias greater than our Topic Alias Maximum: DISCONNECT 0x94 (MQTT-3.3.2-9)."""
    broker = broker_factory("[mqtt]\ntopic_alias_maximum = 5\n")
    honest = client_factory("honest", 5)
    honest.connect(broker.port)
    raw = raw_factory(broker.port)
    assert raw.connect("alias-hog").properties[PropertyId.TOPIC_ALIAS_MAXIMUM] == 5
    raw.publish("alias/t", b"x", properties={PropertyId.TOPIC_ALIAS: 6})
    assert_closed_with(raw, 0x94)
    assert_works(honest)


def test_topic_alias_when_aliases_disabled_disconnects_0x94(broker_factory, raw_factory):
    """Topic Alias Maximum 0 means the client may not use aliases at all (MQTT-3.3.2-9)."""
    broker = broker_factory("[mqtt]\ntopic_alias_maximum = 0\n")
    raw = raw_factory(broker.port)
    raw.connect("no-alias")
    raw.publish("alias/t", b"x", properties={PropertyId.TOPIC_ALIAS: 1})
    assert_closed_with(raw, 0x94)


def test_topic_alias_zero_is_rejected(broker, raw_factory):
    """Topic Alias 0 is not permitted (MQTT-3.3.2-8): DISCONNECT 0x94 Topic Alias invalid
    (spec 3.3.2.3.4, 4.13.1), like an alias above our maximum."""
    raw = raw_factory(broker.port)
    raw.connect("alias-zero")
    raw.publish("alias/t", b"x", properties={PropertyId.TOPIC_ALIAS: 0})
    assert_closed_with(raw, 0x94)


def test_unknown_topic_alias_with_empty_topic_disconnects_0x82(broker, raw_factory,
                                                              client_factory):
    """Empty topic with an alias that was never set: Protocol Error 0x82 (spec 3.3.4)."""
    honest = client_factory("honest", 5)
    honest.connect(broker.port)
    raw = raw_factory(broker.port)
    raw.connect("alias-ghost")
    raw.publish("", b"x", qos=1, properties={PropertyId.TOPIC_ALIAS: 3}, wait_ack=False)
    assert_closed_with(raw, 0x82)
    assert_works(honest)


def test_topic_aliases_are_per_connection(broker, raw_factory):
    """Alias mappings end with the network connection (MQTT-3.3.2-7): using one on a new
    connection is a Protocol Error."""
    raw = raw_factory(broker.port)
    raw.connect("alias-conn")
    raw.publish("alias/t", b"x", qos=1, properties={PropertyId.TOPIC_ALIAS: 1})
    raw.disconnect()
    again = raw_factory(broker.port)
    again.connect("alias-conn")
    again.publish("", b"y", qos=1, properties={PropertyId.TOPIC_ALIAS: 1}, wait_ack=False)
    assert_closed_with(again, 0x82)


class AliasMap:
    """The broker's topic aliases as a strict client keeps them (MQTT.js does): an alias used
    before it is defined is an error, a topic sent with an alias (re)defines it (spec
    3.3.2.3.4), and no alias may exceed the client's maximum (MQTT-3.1.2-26, MQTT-3.3.2-11)."""

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.topics: dict[int, str] = {}
        self.remaps = 0

    def resolve(self, publish: Publish) -> str:
        alias = publish.properties.get(PropertyId.TOPIC_ALIAS)
        if alias is None:
            assert publish.topic, "empty topic without an alias"
            return publish.topic
        assert 1 <= alias <= self.maximum, f"alias {alias} outside 1..{self.maximum}"
        if publish.topic:
            if self.topics.get(alias, publish.topic) != publish.topic:
                self.remaps += 1
            self.topics[alias] = publish.topic
            return publish.topic
        assert alias in self.topics, f"alias {alias} used before it was defined"
        return self.topics[alias]


def received_resolved(raw, aliases: AliasMap, count: int) -> list[tuple[str, bytes]]:
    """``count`` PUBLISHes, acknowledged, as (topic resolved through ``aliases``, payload)."""
    got = []
    for _ in range(count):
        publish = raw.recv_type(Publish)
        raw.ack(publish)
        got.append((aliases.resolve(publish), publish.payload))
    return got


def test_broker_assigns_topic_aliases_by_default(broker, raw_factory, client_factory):
    """A client with a Topic Alias Maximum gets aliases without any configuration: the topic
    once with an alias, then an empty topic with the same alias (spec 3.3.2.3.4)."""
    raw = raw_factory(broker.port)
    raw.connect("alias-rx", properties={PropertyId.TOPIC_ALIAS_MAXIMUM: 10})
    raw.subscribe("ba/#", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for topic, payload in (("ba/t", b"1"), ("ba/t", b"2"), ("ba/u", b"3"), ("ba/t", b"4")):
        pub.publish(topic, payload, qos=1)
    got = []
    for _ in range(4):
        publish = raw.recv_type(Publish)
        raw.ack(publish)
        got.append(publish)
    first, second, other, fourth = got
    alias = first.properties[PropertyId.TOPIC_ALIAS]
    assert 1 <= alias <= 10 and first.topic == "ba/t" and first.payload == b"1"
    assert (second.topic, second.properties[PropertyId.TOPIC_ALIAS], second.payload) == (
        "", alias, b"2")
    other_alias = other.properties[PropertyId.TOPIC_ALIAS]
    assert other.topic == "ba/u" and 1 <= other_alias <= 10 and other_alias != alias
    assert (fourth.topic, fourth.properties[PropertyId.TOPIC_ALIAS]) == ("", alias)


def test_aliases_go_to_the_topics_a_client_receives_most(broker, raw_factory, client_factory):
    """Topic Alias Maximum 2, two topics seen once, then a busy one: the busy topic takes an
    alias over (sent with topic and alias again: a remap) and then rides on it; a strict
    client resolves every message to its topic, QoS 0 and 1 alike."""
    raw = raw_factory(broker.port)
    raw.connect("alias-hot", properties={PropertyId.TOPIC_ALIAS_MAXIMUM: 2})
    raw.subscribe("hot/#", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    sent = [("hot/cold-a", b"a"), ("hot/cold-b", b"b")]
    sent += [("hot/busy", b"%d" % i) for i in range(20)]
    for index, (topic, payload) in enumerate(sent):
        pub.publish(topic, payload, qos=index % 2)
    aliases = AliasMap(2)
    got = received_resolved(raw, aliases, len(sent))
    assert sorted(got) == sorted(sent)  # every message, on its own topic
    assert [p for t, p in got if t == "hot/busy"] == [b"%d" % i for i in range(20)]
    assert aliases.remaps >= 1 and "hot/busy" in aliases.topics.values()
    pub.publish("hot/busy", b"last", qos=1)
    last = raw.recv_type(Publish)
    assert last.topic == "" and aliases.resolve(last) == "hot/busy"


@pytest.mark.parametrize(("cap", "most"), [(0, 0), (1, 1)])
def test_broker_topic_aliases_caps_the_aliases_or_turns_them_off(broker_factory, raw_factory,
                                                                client_factory, cap, most):
    """``mqtt.broker_topic_aliases`` caps the aliases used below the client's maximum; 0 turns
    them off (MQTT-3.1.2-26)."""
    broker = broker_factory(f"[mqtt]\nbroker_topic_aliases = {cap}\n")
    raw = raw_factory(broker.port)
    raw.connect("alias-cap", properties={PropertyId.TOPIC_ALIAS_MAXIMUM: 10})
    raw.subscribe("cap/#", qos=0)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    topics = ["cap/one", "cap/two", "cap/one", "cap/two", "cap/one"]
    for topic in topics:
        pub.publish(topic, topic, qos=0)
    aliases = AliasMap(10)
    got = [raw.recv_type(Publish) for _ in topics]
    assert [aliases.resolve(p) for p in got] == topics
    used = {p.properties[PropertyId.TOPIC_ALIAS] for p in got
            if PropertyId.TOPIC_ALIAS in p.properties}
    assert len(used) == most and all(alias <= max(cap, 1) for alias in used)


@pytest.mark.parametrize("connect_props", [{}, {PropertyId.TOPIC_ALIAS_MAXIMUM: 0}],
                         ids=["absent", "zero"])
def test_no_broker_aliases_without_client_maximum(broker, raw_factory, client_factory,
                                                  connect_props):
    """A client that sent no Topic Alias Maximum, or 0, never gets an alias (MQTT-3.1.2-27)."""
    raw = raw_factory(broker.port)
    raw.connect("alias-none", properties=connect_props)
    raw.subscribe("none/t", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for index in range(5):
        pub.publish("none/t", b"%d" % index, qos=index % 2)
    for index in range(5):
        publish = raw.recv_type(Publish)
        raw.ack(publish)
        assert (publish.topic, publish.payload) == ("none/t", b"%d" % index)
        assert PropertyId.TOPIC_ALIAS not in publish.properties


def test_broker_alias_not_consumed_by_dropped_oversized_message(broker, raw_factory,
                                                               client_factory):
    """A PUBLISH dropped because it exceeds the client's Maximum Packet Size (MQTT-3.1.2-25)
    must not establish a topic alias: the client never saw the topic, so the next message on
    that topic must carry the full topic name (spec 3.3.2.3.4)."""
    raw = raw_factory(broker.port)
    raw.connect("alias-small", properties={PropertyId.TOPIC_ALIAS_MAXIMUM: 10,
                                           PropertyId.MAXIMUM_PACKET_SIZE: 200})
    raw.subscribe("small/t", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("small/t", b"x" * 500, qos=1)
    pub.publish("small/t", b"tiny", qos=1)
    publish = raw.recv_type(Publish)
    assert publish.payload == b"tiny"
    assert publish.topic == "small/t", "alias used for a topic the client was never told"


def test_paho_without_alias_support_gets_full_topics(broker, client_factory):
    """paho-mqtt 2.2.0 does not resolve incoming aliases and sends no Topic Alias Maximum: with
    aliases on (the default) it gets every topic in full."""
    sub = client_factory("paho-plain", 5)
    sub.connect(broker.port)
    sub.subscribe("paho/#", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for index in range(3):
        pub.publish("paho/t", b"%d" % index, qos=index % 2)
    for index in range(3):
        msg = sub.expect()
        assert (msg.topic, msg.payload) == ("paho/t", b"%d" % index)
        assert not hasattr(msg.properties, "TopicAlias")


def test_paho_asking_for_aliases_gets_a_consistent_mapping(broker, client_factory):
    """A paho client that sends Topic Alias Maximum 2 gets PUBLISHes with an empty topic and a
    Topic Alias (paho hands both to the application unresolved); resolved the strict way,
    every message maps to its own topic and no alias exceeds 2 (MQTT-3.3.2-11)."""
    sub = client_factory("paho-aliases", 5)
    sub.connect(broker.port, properties=props(PacketTypes.CONNECT, TopicAliasMaximum=2))
    sub.subscribe("pa/#", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    sent = [(f"pa/{name}", b"%d" % i) for i, name in enumerate(["a", "b", "a", "c", "c", "c",
                                                                "c", "a", "c", "b", "c", "c"])]
    for topic, payload in sent:
        pub.publish(topic, payload, qos=1)
    aliases: dict[int, str] = {}
    got = []
    empty_topics = 0
    for _ in sent:
        msg = sub.expect()
        alias = getattr(msg.properties, "TopicAlias", None)
        if alias is None:
            got.append((msg.topic, msg.payload))
            continue
        assert 1 <= alias <= 2
        if msg.topic:
            aliases[alias] = msg.topic
        else:
            empty_topics += 1
        assert alias in aliases, f"alias {alias} used before it was defined"
        got.append((aliases[alias], msg.payload))
    assert got == sent
    assert empty_topics  # the aliases were used, not just defined


# ---------------------------------------------------------------------- packet size


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_packet_above_max_packet_size_disconnects_0x95(broker_factory, raw_factory,
                                                      client_factory, version):
    """A packet larger than our Maximum Packet Size: DISCONNECT 0x95 (5.0) and close
    (MQTT-3.2.2-15 / spec 4.13); other clients are unaffected."""
    broker = broker_factory("[mqtt]\nmax_packet_size = 1000\n")
    honest = client_factory("honest", 5)
    honest.connect(broker.port)
    honest.subscribe("big/t", qos=1)
    raw = raw_factory(broker.port, version)
    connack = raw.connect("big")
    if version == 5:
        assert connack.properties[PropertyId.MAXIMUM_PACKET_SIZE] == 1000
    raw.publish("big/t", b"x" * 2000, qos=1, wait_ack=False)
    assert_closed_with(raw, 0x95 if version == 5 else None)
    honest.expect_none(0.2)
    assert_works(honest)


def test_packet_just_below_max_packet_size_is_accepted(broker_factory, raw_factory):
    """The limit counts the whole packet (spec 3.2.2.3.6): exactly max_packet_size bytes is
    accepted, one byte more is 0x95."""
    broker = broker_factory("[mqtt]\nmax_packet_size = 1000\n")
    raw = raw_factory(broker.port)
    raw.connect("fits")
    raw.subscribe("fit/t", qos=0)
    # fixed header 3 + topic 2+5 + packet id 2 + properties 1 = 13 bytes of overhead
    payload = b"y" * (1000 - 13)
    raw.publish("fit/t", payload, qos=1, packet_id=1, wait_ack=False)
    got = sorted([raw.recv(), raw.recv()], key=lambda p: type(p).__name__)
    assert isinstance(got[0], Puback) and got[0].reason_code == 0
    assert isinstance(got[1], Publish) and got[1].payload == payload
    raw.publish("fit/t", payload + b"y", qos=1, packet_id=2, wait_ack=False)  # 1001 bytes
    assert_closed_with(raw, 0x95)


@pytest.mark.parametrize("qos", [0, 1])
def test_message_above_client_maximum_packet_size_is_skipped(broker, raw_factory,
                                                             client_factory, qos):
    """The server does not send packets exceeding the client's Maximum Packet Size
    (MQTT-3.1.2-24, -25): the 500 B message is dropped, the next small one is delivered."""
    raw = raw_factory(broker.port)
    raw.connect("small-client", properties={PropertyId.MAXIMUM_PACKET_SIZE: 200})
    raw.subscribe("mps/t", qos=qos)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("mps/t", b"x" * 500, qos=qos)
    pub.publish("mps/t", b"small", qos=qos)
    publish = raw.recv_type(Publish)
    assert publish.payload == b"small"
    raw.ack(publish)
    raw.recv_nothing(0.3)


# ---------------------------------------------------------------------- forwarded properties


def test_request_response_and_user_properties_forwarded_untouched(broker, client_factory):
    """Response Topic, Correlation Data, Payload Format Indicator, Content Type and User
    Properties (order and duplicates kept) are forwarded unaltered (MQTT-3.3.2-4, -15, -16,
    -17, -18, -20)."""
    sub = client_factory("responder", 5)
    sub.connect(broker.port)
    sub.subscribe("req/t", qos=1)
    pub = client_factory("requester", 5)
    pub.connect(broker.port)
    pub.subscribe("resp/requester", qos=1)
    user = [("b", "2"), ("a", "1"), ("b", "3"), ("a", "1")]
    pub.publish("req/t", '{"q": 1}', qos=1, properties=props(
        PacketTypes.PUBLISH, ResponseTopic="resp/requester", CorrelationData=b"\x00id-42\xff",
        PayloadFormatIndicator=1, ContentType="application/json", UserProperty=user))
    request = sub.expect()
    p = request.properties
    assert p.ResponseTopic == "resp/requester"
    assert p.CorrelationData == b"\x00id-42\xff"
    assert p.PayloadFormatIndicator == 1
    assert p.ContentType == "application/json"
    assert p.UserProperty == user  # order kept, nothing added (no log position unasked)
    sub.publish(p.ResponseTopic, "answer", qos=1,
                properties=props(PacketTypes.PUBLISH, CorrelationData=p.CorrelationData))
    response = pub.expect()
    assert (response.topic, response.payload) == ("resp/requester", b"answer")
    assert response.properties.CorrelationData == b"\x00id-42\xff"


@pytest.mark.parametrize(("pub_qos", "sub_qos"), [(0, 0), (1, 0), (1, 1), (2, 2)])
def test_user_properties_reach_raw_subscriber_in_order(broker, raw_factory, pub_qos, sub_qos):
    """Byte-level check of user property order and duplicates (MQTT-3.3.2-17, -18), for
    in-memory (QoS 0) and persisted (QoS 1/2) messages, on the shared QoS 0 frame and on
    per-delivery frames: exactly the publisher's, nothing added."""
    sub = raw_factory(broker.port)
    sub.connect("raw-sub")
    sub.subscribe("up/t", qos=sub_qos)
    pub = raw_factory(broker.port)
    pub.connect("raw-pub")
    pairs = [("z", "1"), ("a", "2"), ("z", "1"), ("", ""), ("ü", "€")]
    pub.publish("up/t", b"x", qos=pub_qos, properties={PropertyId.USER_PROPERTY: pairs})
    publish = sub.recv_type(Publish)
    assert publish.properties == {PropertyId.USER_PROPERTY: pairs}
    sub.ack(publish)


def test_v5_properties_dropped_for_v311_subscriber(broker, client_factory):
    """A 3.1.1 subscriber gets the plain message of a 5.0 publisher."""
    sub = client_factory("old", 4)
    sub.connect(broker.port)
    sub.subscribe("mixed/t", qos=1)
    pub = client_factory("new", 5)
    pub.connect(broker.port)
    pub.publish("mixed/t", b"hello", qos=1,
                properties=props(PacketTypes.PUBLISH, ContentType="text/plain",
                                 UserProperty=[("k", "v")]))
    msg = sub.expect()
    assert (msg.topic, msg.payload, msg.qos) == ("mixed/t", b"hello", 1)


# ---------------------------------------------------------------------- offline queue bound


@pytest.mark.parametrize(("policy", "kept"), [("drop_oldest", range(5, 10)),
                                              ("drop_newest", range(5))])
def test_offline_queue_bound_and_drop_policy(broker_factory, client_factory, policy, kept):
    """session.max_queued_messages=5 and 10 QoS 1 messages while offline: exactly 5 are
    delivered, in order, per the drop policy; the broker logs the drop."""
    broker = broker_factory(  # an in-memory topic: persisted ones follow the log instead
        f'[session]\nmax_queued_messages = 5\nqueue_drop_policy = "{policy}"\n'
        '[log]\npersist_filters = "persisted/#"\n'
    )
    persistent_subscriber(client_factory, broker.port, "queued", "q/t")
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for i in range(10):
        pub.publish("q/t", str(i), qos=1)
    sub = reconnect(client_factory, broker.port, "queued")
    got = [int(sub.expect().payload) for _ in range(5)]
    assert got == list(kept)
    pub.publish("q/t", "barrier", qos=1)
    assert sub.expect().payload == b"barrier"
    assert "dropped" in broker.log()


def test_offline_qos0_not_queued_by_default(broker, client_factory):
    """QoS 0 messages are not queued for offline sessions unless session.queue_qos0
    (spec 3.1.2.4 allows either)."""
    persistent_subscriber(client_factory, broker.port, "q0", "q0/t", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("q0/t", "zero", qos=0)
    pub.publish("q0/t", "one", qos=1)
    sub = reconnect(client_factory, broker.port, "q0")
    assert sub.expect().payload == b"one"
    sub.expect_none(0.3)


def test_offline_qos0_queued_when_configured(broker_factory, client_factory):
    """session.queue_qos0 = true keeps QoS 0 messages for offline persistent sessions."""
    broker = broker_factory("[session]\nqueue_qos0 = true\n")
    persistent_subscriber(client_factory, broker.port, "q0", "q0/t", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("q0/t", "zero", qos=0)
    pub.publish("q0/t", "one", qos=1)
    sub = reconnect(client_factory, broker.port, "q0")
    assert [sub.expect().payload, sub.expect().payload] == [b"zero", b"one"]


def test_offline_queue_bounded_by_bytes(broker_factory, client_factory):
    """session.max_queued_bytes bounds the offline queue too (oldest dropped by default)."""
    broker = broker_factory(
        '[session]\nmax_queued_bytes = 3000\n[log]\npersist_filters = "persisted/#"\n'
    )
    persistent_subscriber(client_factory, broker.port, "bytes", "qb/t")
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for i in range(10):
        pub.publish("qb/t", str(i).encode() * 1000, qos=1)  # ~1 kB each
    sub = reconnect(client_factory, broker.port, "bytes")
    pub.publish("qb/t", "barrier", qos=1)
    got = []
    while (payload := sub.expect().payload) != b"barrier":
        got.append(int(payload[:1]))
    assert 1 <= len(got) <= 3
    assert got == list(range(10 - len(got), 10))


# ---------------------------------------------------------------------- feature switches


def test_max_qos_limits_grants_and_rejects_higher_publish(broker_factory, raw_factory):
    """mqtt.max_qos=1: CONNACK Maximum QoS 1 (MQTT-3.2.2-9), SUBSCRIBE QoS 2 granted 1,
    PUBLISH QoS 2 -> DISCONNECT 0x9B (MQTT-3.2.2-11)."""
    broker = broker_factory("[mqtt]\nmax_qos = 1\n")
    raw = raw_factory(broker.port)
    connack = raw.connect("qos-capped")
    assert connack.properties[PropertyId.MAXIMUM_QOS] == 1
    assert raw.subscribe("cap/t", qos=2).reason_codes == [1]
    raw.publish("cap/t", b"x", qos=2, wait_ack=False)
    assert_closed_with(raw, 0x9B)


def test_will_qos_above_max_qos_refused(broker_factory, raw_factory):
    """A will QoS above Maximum QoS: CONNACK 0x9B (MQTT-3.2.2-12)."""
    broker = broker_factory("[mqtt]\nmax_qos = 0\n")
    raw = raw_factory(broker.port)
    raw.send(Connect("willq", will=Will("w/t", b"x", 1)))
    connack = raw.recv_type(Connack)
    assert connack.reason_code == 0x9B
    assert raw.closed()


def test_will_topic_with_wildcard_refused(broker, raw_factory):
    """The will topic must be a valid topic name (MQTT-3.1.3-11): CONNACK 0x90 for 5.0."""
    raw = raw_factory(broker.port)
    connack = raw.connect("badwill", will=Will("will/#", b"x"))
    assert connack.reason_code == 0x90
    assert raw.closed()


def test_retain_unavailable(broker_factory, raw_factory):
    """mqtt.retain_available=false: CONNACK Retain Available 0, retained PUBLISH ->
    DISCONNECT 0x9A (MQTT-3.2.2-14)."""
    broker = broker_factory("[mqtt]\nretain_available = false\n")
    raw = raw_factory(broker.port)
    assert raw.connect("noretain").properties[PropertyId.RETAIN_AVAILABLE] == 0
    raw.publish("r/t", b"x", retain=True)
    assert_closed_with(raw, 0x9A)


def test_wildcard_and_shared_subscriptions_can_be_disabled(broker_factory, raw_factory):
    """Disabled features: CONNACK says so; SUBACK 0xA2 / 0x9E for such filters
    (spec 3.2.2.3.14, 3.2.2.3.16)."""
    broker = broker_factory(
        "[mqtt]\nwildcard_subscriptions = false\nshared_subscriptions = false\n"
    )
    raw = raw_factory(broker.port)
    connack = raw.connect("plain-only")
    assert connack.properties[PropertyId.WILDCARD_SUBSCRIPTION_AVAILABLE] == 0
    assert connack.properties[PropertyId.SHARED_SUBSCRIPTION_AVAILABLE] == 0
    assert raw.subscribe("a/+", qos=1).reason_codes == [0xA2]
    assert raw.subscribe("a/#", qos=1).reason_codes == [0xA2]
    assert raw.subscribe("$share/g/a", qos=1).reason_codes == [0x9E]
    assert raw.subscribe("a/b", qos=1).reason_codes == [1]


def test_subscription_identifiers_can_be_disabled(broker_factory, raw_factory):
    """subscription_identifiers=false: CONNACK Subscription Identifiers Available 0, and a
    SUBSCRIBE with one -> DISCONNECT 0xA1 (spec 3.2.2.3.15)."""
    broker = broker_factory("[mqtt]\nsubscription_identifiers = false\n")
    raw = raw_factory(broker.port)
    assert raw.connect("noid").properties[PropertyId.SUBSCRIPTION_IDENTIFIER_AVAILABLE] == 0
    raw.send(Subscribe(1, [("a/b", SubscriptionOptions(1))],
                       {PropertyId.SUBSCRIPTION_IDENTIFIER: [5]}))
    assert_closed_with(raw, 0xA1)


def test_max_topic_levels(broker_factory, raw_factory):
    """mqtt.max_topic_levels=3: deeper filters are refused (0x8F), deeper topic names are a
    0x90 Topic Name invalid."""
    broker = broker_factory("[mqtt]\nmax_topic_levels = 3\n")
    raw = raw_factory(broker.port)
    raw.connect("shallow")
    assert raw.subscribe("a/b/c", qos=0).reason_codes == [0]
    assert raw.subscribe("a/b/c/d", qos=0).reason_codes == [0x8F]
    raw.publish("a/b/c", b"ok")
    assert raw.recv_type(Publish).payload == b"ok"
    raw.publish("a/b/c/d", b"deep")
    assert_closed_with(raw, 0x90)


def test_puback_sent_for_each_qos1_publish(broker, raw_factory):
    """Sanity for the limits above: every QoS 1 PUBLISH is acknowledged once."""
    raw = raw_factory(broker.port)
    raw.connect("acks")
    for packet_id in (1, 2, 3):
        ack = raw.publish("acks/t", b"x", qos=1, packet_id=packet_id)
        assert isinstance(ack, Puback) and ack.packet_id == packet_id
