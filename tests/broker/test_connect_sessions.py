"""CONNECT/CONNACK and session lifecycle: clean start, persistence, expiry, takeover, client ids."""

from __future__ import annotations

import pytest
from paho.mqtt.packettypes import PacketTypes

from conftest import props, wait_for
from meshmq.mqtt.packets import Connack, Disconnect, Publish
from meshmq.mqtt.properties import PropertyId

VERSIONS = [pytest.param(4, id="v311"), pytest.param(5, id="v5")]


def connect_session(client_factory, port, client_id, version, *, clean, expiry=300):
    """Connect a paho client; ``clean=False`` asks for a persistent session."""
    if version == 5:
        client = client_factory(client_id, 5)
        properties = props(PacketTypes.CONNECT, SessionExpiryInterval=0 if clean else expiry)
        flags, _, _ = client.connect(port, clean_start=clean, properties=properties)
    else:
        client = client_factory(client_id, 4, clean_session=clean)
        flags, _, _ = client.connect(port)
    return client, flags


@pytest.mark.parametrize("version", VERSIONS)
def test_clean_start_gives_session_present_false(broker, client_factory, version):
    """A clean start discards any session: CONNACK session present is 0 (MQTT-3.2.2-2)."""
    _, flags = connect_session(client_factory, broker.port, "clean", version, clean=True)
    assert flags.session_present is False


@pytest.mark.parametrize("version", VERSIONS)
def test_first_persistent_connect_has_no_session(broker, client_factory, version):
    """No session exists yet: session present is 0 even without clean start (MQTT-3.2.2-3)."""
    _, flags = connect_session(client_factory, broker.port, "fresh", version, clean=False)
    assert flags.session_present is False


@pytest.mark.parametrize("version", VERSIONS)
def test_persistent_session_resumes_and_delivers_offline_messages_in_order(
    broker, client_factory, version
):
    """Resumed session: session present 1 (MQTT-3.2.2-3), subscriptions kept, and QoS 1
    messages published while offline are delivered in publish order (MQTT-4.6.0-5)."""
    sub, _ = connect_session(client_factory, broker.port, "persist", version, clean=False)
    sub.subscribe("persist/t", qos=1)
    sub.disconnect()
    pub = client_factory("persist-pub", version)
    pub.connect(broker.port)
    for i in range(5):
        pub.publish("persist/t", f"m{i}", qos=1)
    sub2, flags = connect_session(client_factory, broker.port, "persist", version, clean=False)
    assert flags.session_present is True
    got = [sub2.expect() for _ in range(5)]
    assert [m.payload for m in got] == [f"m{i}".encode() for i in range(5)]
    assert all(m.qos == 1 for m in got)
    # The subscription itself survived too: a live message still arrives.
    pub.publish("persist/t", "live", qos=1)
    assert sub2.expect().payload == b"live"


@pytest.mark.parametrize("version", VERSIONS)
def test_clean_start_discards_existing_session(broker, client_factory, version):
    """Clean start ends the stored session: no session present, no queued messages, no
    subscriptions (MQTT-3.1.2-4)."""
    sub, _ = connect_session(client_factory, broker.port, "discard", version, clean=False)
    sub.subscribe("discard/t", qos=1)
    sub.disconnect()
    pub = client_factory("discard-pub", version)
    pub.connect(broker.port)
    pub.publish("discard/t", "queued", qos=1)
    sub2, flags = connect_session(client_factory, broker.port, "discard", version, clean=True)
    assert flags.session_present is False
    pub.publish("discard/t", "after", qos=1)
    sub2.subscribe("discard/barrier")
    pub.publish("discard/barrier", "barrier")
    assert sub2.expect().payload == b"barrier"
    sub2.expect_none()


def test_session_expires_after_its_interval(broker, client_factory):
    """A detached session ends when its expiry interval elapses (MQTT-3.1.2-23); a later
    connect without clean start finds no session."""
    sub, _ = connect_session(client_factory, broker.port, "expiring", 5, clean=False, expiry=1)
    sub.subscribe("exp/t", qos=1)
    sub.disconnect()
    wait_for(lambda: "session expired client_id=expiring" in broker.log(), what="expiry log")
    sub2, flags = connect_session(client_factory, broker.port, "expiring", 5, clean=False)
    assert flags.session_present is False
    # Its subscription ended with it.
    pub = client_factory("exp-pub", 5)
    pub.connect(broker.port)
    pub.publish("exp/t", "gone", qos=1)
    sub2.subscribe("exp/barrier")
    pub.publish("exp/barrier", "barrier")
    assert sub2.expect().payload == b"barrier"
    sub2.expect_none()


def test_session_expiry_zero_ends_session_on_disconnect(broker, client_factory):
    """5.0 with Session Expiry Interval absent/0: the session ends with the connection
    (MQTT-3.1.2-23)."""
    first = client_factory("zero-expiry", 5)
    first.connect(broker.port, clean_start=False)
    first.subscribe("zero/t", qos=1)
    first.disconnect()
    _, flags = connect_session(client_factory, broker.port, "zero-expiry", 5, clean=False)
    assert flags.session_present is False


def test_disconnect_can_shorten_session_expiry(broker, raw_factory):
    """DISCONNECT carrying Session Expiry Interval 0 ends a session that had a longer one
    (spec 3.14.2.2.2)."""
    raw = raw_factory(broker.port)
    raw.connect("shorten", clean_start=False, properties={PropertyId.SESSION_EXPIRY_INTERVAL: 300})
    raw.subscribe("shorten/t", qos=1)
    raw.disconnect(properties={PropertyId.SESSION_EXPIRY_INTERVAL: 0})
    again = raw_factory(broker.port)
    connack = again.connect("shorten", clean_start=False,
                            properties={PropertyId.SESSION_EXPIRY_INTERVAL: 300})
    assert connack.session_present is False


def test_session_takeover_disconnects_first_connection_v5(broker, client_factory):
    """A second CONNECT with the same client id takes over: the first connection gets
    DISCONNECT 0x8E Session taken over and is closed (MQTT-3.1.4-3); the second works."""
    first = client_factory("twin", 5)
    first.connect(broker.port)
    second = client_factory("twin", 5)
    second.connect(broker.port)
    reason = first.disconnects.get(timeout=10)
    assert reason.value == 0x8E
    second.subscribe("twin/t", qos=1)
    second.publish("twin/t", "ok", qos=1)
    assert second.expect().payload == b"ok"
    assert second.disconnects.empty()


def test_session_takeover_closes_first_connection_v311(broker, raw_factory, client_factory):
    """3.1.1 has no server DISCONNECT: the first network connection is simply closed
    (MQTT-3.1.4-2), and the new one is served."""
    first = raw_factory(broker.port, version=4)
    assert first.connect("twin311").reason_code == 0
    second = client_factory("twin311", 4)
    second.connect(broker.port)
    assert first.closed(timeout=10)
    assert first.packets() == []
    second.subscribe("twin311/t", qos=1)
    second.publish("twin311/t", "ok", qos=1)
    assert second.expect().payload == b"ok"


def test_session_takeover_keeps_session_state(broker, raw_factory):
    """Taking over without clean start resumes the session: session present 1 and the
    unacknowledged message is resent to the new connection (MQTT-3.1.4-3, MQTT-4.4.0-1)."""
    first = raw_factory(broker.port)
    first.connect("keep", clean_start=False, properties={PropertyId.SESSION_EXPIRY_INTERVAL: 60})
    first.subscribe("keep/t", qos=1)
    pub = raw_factory(broker.port)
    pub.connect("keep-pub")
    pub.publish("keep/t", b"unacked", qos=1)
    original = first.recv_type(Publish)
    second = raw_factory(broker.port)
    connack = second.connect("keep", clean_start=False,
                             properties={PropertyId.SESSION_EXPIRY_INTERVAL: 60})
    assert connack.session_present is True
    assert first.recv_type(Disconnect).reason_code == 0x8E
    resent = second.recv_type(Publish)
    assert (resent.payload, resent.packet_id, resent.dup) == (b"unacked", original.packet_id, True)


def test_empty_client_id_v5_gets_assigned_identifier(broker, client_factory):
    """5.0 zero-length client id: the server assigns one and returns it in CONNACK
    (MQTT-3.1.3-6, MQTT-3.2.2-16), and the connection works normally."""
    client = client_factory("", 5)
    _, _, connack_props = client.connect(broker.port)
    assigned = connack_props.AssignedClientIdentifier
    assert isinstance(assigned, str) and assigned
    client.subscribe("anon/t", qos=1)
    client.publish("anon/t", "hi", qos=1)
    assert client.expect().payload == b"hi"


def test_assigned_client_ids_are_unique(broker, raw_factory):
    """Two anonymous clients get different assigned identifiers (MQTT-3.1.3-6)."""
    ids = set()
    for _ in range(2):
        connack = raw_factory(broker.port).connect("")
        ids.add(connack.properties[PropertyId.ASSIGNED_CLIENT_IDENTIFIER])
    assert len(ids) == 2


def test_empty_client_id_v311_persistent_is_refused(broker, raw_factory):
    """3.1.1 zero-length client id with CleanSession=0: CONNACK return code 0x02 Identifier
    rejected, then close (MQTT-3.1.3-8)."""
    raw = raw_factory(broker.port, version=4)
    connack = raw.connect("", clean_start=False)
    assert isinstance(connack, Connack)
    assert connack.reason_code == 2
    assert connack.session_present is False
    assert raw.closed()


def test_empty_client_id_v311_clean_session_is_accepted(broker, raw_factory):
    """3.1.1 zero-length client id with CleanSession=1 is accepted (MQTT-3.1.3-7)."""
    raw = raw_factory(broker.port, version=4)
    connack = raw.connect("", clean_start=True)
    assert connack.reason_code == 0
    assert raw.subscribe("anon311/t", qos=1).reason_codes == [1]


def test_connack_advertises_limits(broker_factory, raw_factory):
    """CONNACK carries the server's Receive Maximum, Maximum Packet Size and Topic Alias
    Maximum (spec 3.2.2.3)."""
    broker = broker_factory(
        "[mqtt]\nreceive_maximum = 7\nmax_packet_size = 5000\ntopic_alias_maximum = 3\n"
    )
    connack = raw_factory(broker.port).connect("limits")
    assert connack.reason_code == 0
    assert connack.properties[PropertyId.RECEIVE_MAXIMUM] == 7
    assert connack.properties[PropertyId.MAXIMUM_PACKET_SIZE] == 5000
    assert connack.properties[PropertyId.TOPIC_ALIAS_MAXIMUM] == 3


def test_session_expiry_capped_by_server(broker_factory, raw_factory):
    """A requested expiry above session.max_session_expiry is reduced, and CONNACK says so
    (spec 3.2.2.3.2)."""
    broker = broker_factory("[session]\nmax_session_expiry = 10\n")
    connack = raw_factory(broker.port).connect(
        "capped", clean_start=False, properties={PropertyId.SESSION_EXPIRY_INTERVAL: 3600}
    )
    assert connack.properties[PropertyId.SESSION_EXPIRY_INTERVAL] == 10
