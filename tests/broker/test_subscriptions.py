"""Subscriptions: wildcard matching, '$' topics, overlapping subscriptions, subscription options
(no local, retain as published, retain handling), shared subscriptions, UNSUBSCRIBE."""

from __future__ import annotations

import queue

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from conftest import props, start_broker, wait_for
from meshmq.mqtt.packets import Disconnect, Publish, Subscribe, SubscriptionOptions
from meshmq.mqtt.properties import PropertyId

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


def expect_payload_then_barrier(sub, pub, payload: bytes | None, barrier_topic: str) -> None:
    """Publish a barrier on ``barrier_topic`` (which ``sub`` must be subscribed to): the
    messages before it must be exactly ``payload`` (or nothing when None)."""
    pub.publish(barrier_topic, b"barrier", qos=1)
    got = []
    while True:
        msg = sub.expect()
        if msg.topic == barrier_topic and msg.payload == b"barrier":
            break
        got.append(msg.payload)
    assert got == ([] if payload is None else [payload])


# ---------------------------------------------------------------------- matching


@pytest.fixture(scope="module")
def shared_broker(tmp_path_factory):
    """One broker for the matching table (clean-start clients only, nothing retained)."""
    proc = start_broker(tmp_path_factory.mktemp("matching"))
    yield proc
    proc.stop()


MATCHING = [
    # (filter, topic, matches) -- spec 4.7.1 examples
    ("sport/#", "sport", True),  # MQTT-4.7.1-1: '#' includes the parent level
    ("sport/#", "sport/tennis/player1", True),
    ("sport/tennis/#", "sport/tennis", True),
    ("sport/tennis/player1/#", "sport/tennis/player1/ranking", True),
    ("sport/tennis/#", "sport/football", False),
    ("#", "a/b/c", True),
    ("sport/tennis/+", "sport/tennis/player1", True),
    ("sport/tennis/+", "sport/tennis/player1/ranking", False),
    ("sport/+", "sport", False),
    ("sport/+", "sport/", True),  # '+' matches an empty level
    ("+/+", "/finance", True),
    ("/+", "/finance", True),
    ("+", "/finance", False),
    ("+", "finance", True),
    ("+/tennis/#", "sport/tennis", True),
    ("sport/+/player1", "sport/tennis/player1", True),
    ("a/+/c", "a//c", True),
    ("Sport/#", "sport/x", False),  # case sensitive (MQTT-4.7.3-4 family)
    ("sport/x", "sport/x/", False),
]


@pytest.mark.parametrize(
    ("topic_filter", "topic", "matches"), MATCHING,
    ids=[f"{f}~{t}={'y' if m else 'n'}" for f, t, m in MATCHING],
)
def test_wildcard_matching(shared_broker, client_factory, topic_filter, topic, matches, request):
    """'+' matches exactly one level, '#' any number of levels including the parent
    (MQTT-4.7.1-1, -2; spec 4.7.1.2, 4.7.1.3)."""
    uid = f"m{request.node.callspec.indices['topic_filter']}"
    sub = client_factory(f"{uid}-sub", 5)
    sub.connect(shared_broker.port)
    sub.subscribe(topic_filter, qos=1)
    sub.subscribe(f"barrier/{uid}", qos=1)
    pub = client_factory(f"{uid}-pub", 5)
    pub.connect(shared_broker.port)
    pub.publish(topic, b"probe", qos=1)
    expect_payload_then_barrier(sub, pub, b"probe" if matches else None, f"barrier/{uid}")
    sub.unsubscribe(topic_filter)


@pytest.mark.parametrize("topic_filter", ["#", "+/x", "+/#", "+/+"])
def test_dollar_topics_not_matched_by_leading_wildcards(broker, client_factory, topic_filter):
    """A filter starting with a wildcard does not match a topic starting with '$'
    (MQTT-4.7.2-1)."""
    sub = client_factory("wild", 5)
    sub.connect(broker.port)
    sub.subscribe(topic_filter, qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("$SYS/x", b"dollar", qos=1)
    pub.publish("$app/x", b"dollar", qos=1)
    expect_payload_then_barrier(sub, pub, None, "barrier/x")


def test_dollar_topics_matched_by_explicit_prefix(broker, client_factory):
    """'$SYS/#' matches '$SYS/...' topics (spec 4.7.2)."""
    sub = client_factory("sys", 5)
    sub.connect(broker.port)
    sub.subscribe("$SYS/#", qos=1)
    sub.subscribe("$app/+/x", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("$SYS/meshmq-test/x", b"sys", qos=1)
    pub.publish("$app/a/x", b"app", qos=1)
    seen = {}
    while len(seen) < 2:
        msg = sub.expect()
        if msg.topic in ("$SYS/meshmq-test/x", "$app/a/x"):  # ignore any broker $SYS output
            seen[msg.topic] = msg.payload
    assert seen == {"$SYS/meshmq-test/x": b"sys", "$app/a/x": b"app"}


@pytest.mark.parametrize("version", VERSIONS)
def test_invalid_topic_filters_are_refused_in_suback(broker, raw_factory, version):
    """Malformed filters get SUBACK 0x8F (5.0) / 0x80 (3.1.1) while valid ones in the same
    SUBSCRIBE are granted (MQTT-4.7.1-1, -2, MQTT-3.8.4-6)."""
    raw = raw_factory(broker.port, version)
    raw.connect("badfilters")
    opts = SubscriptionOptions(1)
    suback = raw.subscribe([("a/#/b", opts), ("ok/+", opts), ("a+/b", opts), ("x#", opts)])
    bad = 0x8F if version == 5 else 0x80
    assert suback.reason_codes == [bad, 1, bad, bad]


# ---------------------------------------------------------------------- overlapping


def test_overlapping_subscriptions_deliver_one_copy_with_all_identifiers(broker, client_factory):
    """Overlapping subscriptions of one client: one PUBLISH, at the highest granted QoS,
    carrying every matching Subscription Identifier (MQTT-3.3.4-2, -3, -4, -5)."""
    sub = client_factory("overlap", 5)
    sub.connect(broker.port)
    sub.subscribe("ov/+", qos=0, properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=1))
    sub.subscribe("ov/#", qos=2, properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=2))
    sub.subscribe("ov/a", qos=1)  # no identifier on this one
    sub.subscribe("ovbarrier", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("ov/a", b"x", qos=2)
    msg = sub.expect()
    assert (msg.topic, msg.payload, msg.qos) == ("ov/a", b"x", 2)
    assert sorted(msg.properties.SubscriptionIdentifier) == [1, 2]
    expect_payload_then_barrier(sub, pub, None, "ovbarrier")


def test_subscription_identifier_delivered_with_message(broker, client_factory):
    """The Subscription Identifier of the matching subscription is sent with the PUBLISH
    (MQTT-3.3.4-3); a subscription without one adds none."""
    sub = client_factory("subid", 5)
    sub.connect(broker.port)
    sub.subscribe("id/t", qos=1,
                  properties=props(PacketTypes.SUBSCRIBE, SubscriptionIdentifier=268435455))
    sub.subscribe("noid/t", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("id/t", b"1", qos=1)
    assert sub.expect().properties.SubscriptionIdentifier == [268435455]
    pub.publish("noid/t", b"2", qos=1)
    assert not hasattr(sub.expect().properties, "SubscriptionIdentifier")


def test_resubscribe_replaces_subscription(broker, client_factory):
    """A SUBSCRIBE for an existing filter replaces it (new QoS), no duplicate delivery
    (MQTT-3.8.4-3)."""
    sub = client_factory("resub", 5)
    sub.connect(broker.port)
    sub.subscribe("re/t", qos=0)
    sub.subscribe("re/t", qos=2)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("re/t", b"x", qos=2)
    assert sub.expect().qos == 2
    sub.subscribe("rebarrier", qos=1)
    expect_payload_then_barrier(sub, pub, None, "rebarrier")


def test_resubscribe_replaces_subscription_identifier(broker, client_factory):
    """Re-subscribing replaces the whole subscription, identifier included (MQTT-3.8.4-3):
    a new id replaces the old one, no id removes it."""
    sub = client_factory("resubid", 5)
    sub.connect(broker.port)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    sub.subscribe("rid/t", qos=1, properties=props(PacketTypes.SUBSCRIBE,
                                                    SubscriptionIdentifier=1))
    sub.subscribe("rid/t", qos=1, properties=props(PacketTypes.SUBSCRIBE,
                                                    SubscriptionIdentifier=2))
    pub.publish("rid/t", b"a", qos=1)
    assert sub.expect().properties.SubscriptionIdentifier == [2]
    sub.subscribe("rid/t", qos=1)
    pub.publish("rid/t", b"b", qos=1)
    assert not hasattr(sub.expect().properties, "SubscriptionIdentifier")


@pytest.mark.parametrize("version", VERSIONS)
def test_unsubscribe_stops_delivery(broker, client_factory, version):
    """After UNSUBSCRIBE the filter no longer delivers (MQTT-3.10.4-1..-2)."""
    sub = client_factory("unsub", version)
    sub.connect(broker.port)
    sub.subscribe("un/t", qos=1)
    sub.subscribe("unbarrier", qos=1)
    pub = client_factory("pub", version)
    pub.connect(broker.port)
    sub.unsubscribe("un/t")
    pub.publish("un/t", b"x", qos=1)
    expect_payload_then_barrier(sub, pub, None, "unbarrier")


def test_unsuback_reason_codes_v5(broker, raw_factory):
    """5.0 UNSUBACK: 0x00 for a removed filter, 0x11 No subscription existed (spec 3.11.3)."""
    raw = raw_factory(broker.port)
    raw.connect("unsubcodes")
    raw.subscribe("have/t", qos=0)
    assert raw.unsubscribe("have/t", "never/t").reason_codes == [0x00, 0x11]


# ---------------------------------------------------------------------- subscription options


def test_no_local_suppresses_own_messages(broker, client_factory):
    """No Local: the server does not forward a client's own PUBLISH to it (MQTT-3.8.3-3);
    other clients' messages still arrive, and other subscribers get the client's messages."""
    me = client_factory("me", 5)
    me.connect(broker.port)
    me.subscribe("nl/t", options=mqtt.SubscribeOptions(qos=1, noLocal=True))
    me.subscribe("nlbarrier", qos=1)
    other = client_factory("other", 5)
    other.connect(broker.port)
    other.subscribe("nl/t", qos=1)
    me.publish("nl/t", b"mine", qos=1)
    assert other.expect().payload == b"mine"
    other.publish("nl/t", b"theirs", qos=1)
    assert other.expect().payload == b"theirs"
    expect_payload_then_barrier(me, other, b"theirs", "nlbarrier")


@pytest.mark.parametrize("rap", [True, False])
def test_retain_as_published(broker, client_factory, rap):
    """Retain As Published 1 keeps the RETAIN flag on forwarded messages, 0 clears it
    (MQTT-3.3.1-12, -13)."""
    sub = client_factory("rap", 5)
    sub.connect(broker.port)
    sub.subscribe("rap/t", options=mqtt.SubscribeOptions(qos=1, retainAsPublished=rap))
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("rap/t", b"r", qos=1, retain=True)
    msg = sub.expect()
    assert (msg.payload, msg.retain) == (b"r", rap)
    pub.publish("rap/t", b"", qos=1, retain=True)  # clean up the retained message


def test_live_messages_to_v311_subscriber_have_retain_cleared(broker, client_factory):
    """3.1.1: a retained message forwarded to an existing subscription has RETAIN 0
    (MQTT-3.3.1-9 of 3.1.1)."""
    sub = client_factory("live311", 4)
    sub.connect(broker.port)
    sub.subscribe("live/t", qos=1)
    pub = client_factory("pub", 4)
    pub.connect(broker.port)
    pub.publish("live/t", b"r", qos=1, retain=True)
    assert sub.expect().retain is False


def test_retain_handling(broker, client_factory):
    """Retain Handling 0 sends retained messages on every SUBSCRIBE (MQTT-3.3.1-9), 1 only
    when the subscription is new (MQTT-3.3.1-10), 2 never (MQTT-3.3.1-11)."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("rh/t", b"kept", qos=1, retain=True)
    sub = client_factory("rh", 5)
    sub.connect(broker.port)
    sub.subscribe("rhbarrier", qos=1)

    def subscribe_and_collect(topic_filter, handling):
        sub.subscribe(topic_filter, options=mqtt.SubscribeOptions(qos=1, retainHandling=handling))
        pub.publish("rhbarrier", b"barrier", qos=1)
        got = []
        while (msg := sub.expect()).topic != "rhbarrier":
            got.append((msg.payload, msg.retain))
        return got

    assert subscribe_and_collect("rh/t", 0) == [(b"kept", True)]
    assert subscribe_and_collect("rh/t", 0) == [(b"kept", True)]  # again on re-subscribe
    assert subscribe_and_collect("rh/+", 1) == [(b"kept", True)]  # new subscription
    assert subscribe_and_collect("rh/+", 1) == []  # already existed
    assert subscribe_and_collect("rh/#", 2) == []  # never
    sub.unsubscribe("rh/t")
    sub.unsubscribe("rh/+")
    sub.unsubscribe("rh/#")


# ---------------------------------------------------------------------- shared subscriptions


def _collect(client, count_total, others, timeout=10):
    """Drain messages from ``client`` and ``others`` until ``count_total`` arrived in all."""
    received = {id(c): [] for c in (client, *others)}
    clients = (client, *others)

    def drained():
        for c in clients:
            while True:
                try:
                    received[id(c)].append(c.messages.get_nowait())
                except queue.Empty:
                    break
        return sum(len(v) for v in received.values()) >= count_total

    wait_for(drained, timeout, what=f"{count_total} messages")
    return [received[id(c)] for c in clients]


@pytest.mark.parametrize("version", VERSIONS)
def test_shared_subscription_round_robin(broker, client_factory, version):
    """A shared subscription delivers each message to exactly one member (spec 4.8.2);
    meshmq rotates round-robin, so 10 messages split 5/5 and together are all 10."""
    members = []
    for name in ("m1", "m2"):
        member = client_factory(name, version)
        member.connect(broker.port)
        member.subscribe("$share/g/sh/t", qos=1)
        members.append(member)
    pub = client_factory("pub", version)
    pub.connect(broker.port)
    for i in range(10):
        pub.publish("sh/t", str(i), qos=1)
    first, second = _collect(members[0], 10, members[1:])
    assert len(first) == 5 and len(second) == 5
    assert sorted(int(m.payload) for m in first + second) == list(range(10))
    assert all(m.topic == "sh/t" for m in first + second)
    members[0].expect_none(0.3)
    members[1].expect_none(0.1)


def test_shared_subscription_groups_are_independent(broker, client_factory):
    """Each share group gets its own copy, and plain subscribers get every message
    (spec 4.8.2)."""
    members = []
    for name in ("g1", "g2"):
        member = client_factory(name, 5)
        member.connect(broker.port)
        member.subscribe("$share/g/grp/+", qos=1)
        members.append(member)
    loner = client_factory("h1", 5)
    loner.connect(broker.port)
    loner.subscribe("$share/h/grp/+", qos=1)
    plain = client_factory("plain", 5)
    plain.connect(broker.port)
    plain.subscribe("grp/#", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for i in range(10):
        pub.publish("grp/t", str(i), qos=1)
    assert [int(loner.expect().payload) for _ in range(10)] == list(range(10))
    assert [int(plain.expect().payload) for _ in range(10)] == list(range(10))
    first, second = _collect(members[0], 10, members[1:])
    assert sorted(int(m.payload) for m in first + second) == list(range(10))


def test_shared_subscription_redistributes_unacked_messages(broker, raw_factory, client_factory):
    """When a member's session ends with unacknowledged shared messages, they go to another
    member of the group (spec 4.8.2 "If the Server is in the process of sending...";
    meshmq redistributes on session end)."""
    member_a = raw_factory(broker.port)
    member_a.connect("member-a")  # session expiry 0: the session ends with the connection
    member_a.subscribe("$share/g/rd/t", qos=1)
    member_b = client_factory("member-b", 5)
    member_b.connect(broker.port)
    member_b.subscribe("$share/g/rd/t", qos=1)
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for i in range(4):
        pub.publish("rd/t", str(i), qos=1)
    held = [member_a.recv_type(Publish), member_a.recv_type(Publish)]  # never acknowledged
    assert len({p.payload for p in held}) == 2
    member_a.close()
    got = _collect(member_b, 4, ())[0]
    assert sorted(int(m.payload) for m in got) == [0, 1, 2, 3]
    member_b.expect_none(0.3)


def test_unsubscribed_shared_member_gets_no_more(broker, client_factory):
    """After one member unsubscribes, the remaining member gets every message (spec 4.8.2)."""
    stay = client_factory("stay", 5)
    stay.connect(broker.port)
    stay.subscribe("$share/g/us/t", qos=1)
    leave = client_factory("leave", 5)
    leave.connect(broker.port)
    leave.subscribe("$share/g/us/t", qos=1)
    leave.subscribe("usbarrier", qos=1)
    leave.unsubscribe("$share/g/us/t")
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    for i in range(4):
        pub.publish("us/t", str(i), qos=1)
    assert [int(stay.expect().payload) for _ in range(4)] == [0, 1, 2, 3]
    expect_payload_then_barrier(leave, pub, None, "usbarrier")


def test_shared_subscription_no_local_is_protocol_error(broker, raw_factory):
    """No Local on a shared subscription is a Protocol Error (MQTT-3.8.3-4)."""
    raw = raw_factory(broker.port)
    raw.connect("nlshare")
    raw.send(Subscribe(1, [("$share/g/t", SubscriptionOptions(1, no_local=True))]))
    disconnect = raw.recv_type(Disconnect)
    assert disconnect.reason_code == 0x82
    assert raw.closed()


@pytest.mark.parametrize("bad", ["$share/g", "$share//t", "$share/g+/t", "$share/#/t"])
def test_invalid_shared_filters_refused(broker, raw_factory, bad):
    """Malformed $share filters get SUBACK 0x8F (MQTT-4.8.2-1, -2)."""
    raw = raw_factory(broker.port)
    raw.connect("badshare")
    assert raw.subscribe(bad, qos=1).reason_codes == [0x8F]


def test_shared_subscription_retained_not_sent_on_subscribe(broker, client_factory):
    """Retained messages are sent only when a new *non-shared* subscription is made
    (spec 3.3.1.3 RETAIN, 3.8.3.1 Retain Handling); a shared one gets live messages only."""
    pub = client_factory("pub", 5)
    pub.connect(broker.port)
    pub.publish("shret/t", b"retained", qos=1, retain=True)
    member = client_factory("member", 5)
    member.connect(broker.port)
    member.subscribe("$share/g/shret/t", qos=1)
    pub.publish("shret/t", b"live", qos=1)
    assert member.expect().payload == b"live"
    pub.publish("shret/t", b"", qos=1, retain=True)


def test_subscribe_properties_reach_connack_flags(broker, raw_factory):
    """CONNACK omits the *_AVAILABLE flags when features are on (absent means available)."""
    connack = raw_factory(broker.port).connect("flags")
    for pid in (PropertyId.WILDCARD_SUBSCRIPTION_AVAILABLE,
                PropertyId.SUBSCRIPTION_IDENTIFIER_AVAILABLE,
                PropertyId.SHARED_SUBSCRIPTION_AVAILABLE, PropertyId.RETAIN_AVAILABLE):
        assert connack.properties.get(pid, 1) == 1
