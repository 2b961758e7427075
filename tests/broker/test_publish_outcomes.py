"""The publish path in one process: ``Publishes`` (broker/publishes.py) built with small fakes.

What the handler is given is what a broker gives it (``PublishHost``): here a real ``Router``
with real ``Session``s, a fake ``PartitionLog`` that holds each append until the test says
how it ended (``Stored``, ``StoredElsewhere``, ``Refused``), and fake connections around real
sans-I/O ``ServerConnection``s, fed the bytes a client sends and read for the bytes the
broker sends back. No event loop, no sockets: the outcome decides what the publisher and the
subscribers see, and nothing is acknowledged or routed before the log answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from meshmq.broker.client import protocol_violation
from meshmq.broker.counters import Counters
from meshmq.broker.interfaces import (
    AppendOutcome,
    Completion,
    Refused,
    Stored,
    StoredElsewhere,
    Unknown,
)
from meshmq.broker.local import LocalRetained, NoServices
from meshmq.broker.message import OFFSET_PROPERTY, PARTITION_PROPERTY, Message
from meshmq.broker.publishes import Publishes
from meshmq.broker.retained import RetainedStore
from meshmq.broker.router import Router
from meshmq.broker.session import Session, Subscription
from meshmq.config import SessionConfig
from meshmq.mqtt.codec import decode_frames, encode_packet
from meshmq.mqtt.connection import ServerConnection
from meshmq.mqtt.packets import (
    MQTT_5,
    Connect,
    Packet,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    SubscriptionOptions,
)
from meshmq.mqtt.properties import PropertyId
from meshmq.mqtt.reason_codes import ReasonCode

MQTT_311 = 4
NOW = 100.0
TOPIC = "plant/1/temp"


class Clock:
    """The loop as the handler sees it: only ``time()``."""

    def time(self) -> float:
        return NOW


class FakeConnection:
    """A client connection as the core sees it (``ClientHandle``): a real ``ServerConnection``
    fed what the client sends; ``sent()`` decodes what the broker queued for it."""

    def __init__(self, client_id: str, version: int) -> None:
        self.conn = ServerConnection()
        self.conn.receive_data(encode_packet(Connect(client_id, protocol_level=version),
                                             version))
        assert [type(p) for p in self.conn.events_received()] == [Connect]
        self.conn.send_connack(0)
        self.conn.data_to_send()  # the CONNACK
        self.version = version
        self.client_id = client_id
        self.session: Session | None = None
        self.peer = "127.0.0.1:50000"
        self.log_positions = False
        self.congested = False
        self.rejected = self.closing = self.gone = False
        self.held: list[Packet] | None = None
        self.close_reason = ""
        self.connected_at = self.last_read = self.keep_alive_limit = 0.0
        self.woken = 0

    def packets_for_the_broker(self, packet: Packet) -> list[Packet]:
        """``packet`` as the transport hands it on: encoded, fed, decoded, checked."""
        self.conn.receive_data(encode_packet(packet, self.version))
        return self.conn.events_received()

    def sent(self) -> list[Packet]:
        return decode_frames(self.conn.data_to_send(), self.version)

    def wake(self) -> None:
        self.woken += 1

    def close(self) -> None:
        self.closing = True

    def flush(self) -> None:
        pass


@dataclass
class Append:
    message: Message
    client_id: str
    done: Completion
    message_id: bytes | None = None


@dataclass
class FakeLog:
    """A ``PartitionLog`` whose appends wait for the test: ``complete(outcome)``."""

    accepts: bool = True  # False: its queue is full
    high_watermark: list[int] = field(default_factory=lambda: [0, 0])
    appends: list[Append] = field(default_factory=list)
    routed_at: list[tuple[int, int]] = field(default_factory=list)

    def wants(self, topic: str, qos: int) -> bool:
        return qos > 0

    def append(self, message: Message, client_id: str, done: Completion,
               message_id: bytes | None = None) -> bool:
        if self.accepts:
            self.appends.append(Append(message, client_id, done, message_id))
        return self.accepts

    def routed(self, partition: int, offset: int) -> None:
        self.routed_at.append((partition, offset))
        self.high_watermark[partition] = max(self.high_watermark[partition], offset + 1)

    def complete(self, outcome: AppendOutcome) -> None:
        """The append in flight ends with ``outcome`` (on the loop, as a real log's do)."""
        self.appends.pop(0).done(outcome)


class Journal:
    """Where retained changes are made durable: at once here."""

    def retained(self, topic: str, message: Message | None, done=None) -> None:
        if done is not None:
            done()


class Host:
    """What a broker gives its publish path (``PublishHost``)."""

    def __init__(self, log: FakeLog) -> None:
        self.loop = Clock()
        self.sessions: dict[str, Session] = {}
        self.router = Router(self.sessions)
        self.acl = None
        self.events = None
        self.services = NoServices()  # no request/reply layer: $service/ topics are ordinary
        self.persistence = log
        self.retained = LocalRetained(RetainedStore(), Journal(), self.loop.time)
        self.counters = Counters()

    def protocol_violation(self, client: FakeConnection, code: int, why: str) -> None:
        protocol_violation(client, self.counters, code, why)  # the broker's own


class Scene:
    """A publisher and a subscriber to ``plant/#`` (5.0, QoS 2), both connected."""

    def __init__(self, version: int = MQTT_5) -> None:
        self.log = FakeLog()
        self.host = Host(self.log)
        self.publishes = Publishes(self.host)
        self.publisher = self.connect("sensor", version)
        self.subscriber = self.connect("dashboard", MQTT_5)
        self.host.router.subscribe(self.subscriber.session, "plant/#",
                                   Subscription(SubscriptionOptions(qos=2)))

    def connect(self, client_id: str, version: int) -> FakeConnection:
        client = FakeConnection(client_id, version)
        session = self.host.sessions[client_id] = Session(client_id, SessionConfig())
        client.session = session
        session.attach(client, NOW)
        return client

    def publish(self, qos: int, packet_id: int = 7, retain: bool = False,
                dup: bool = False) -> None:
        """The publisher sends one PUBLISH; the handler takes it as the broker would."""
        packet = Publish(TOPIC, b"21.5", qos=qos, retain=retain, packet_id=packet_id,
                         dup=dup)
        for event in self.publisher.packets_for_the_broker(packet):
            assert isinstance(event, Publish)
            self.publishes.on_publish(self.publisher, event)

    def delivered(self) -> list[Publish]:
        got = self.subscriber.sent()
        assert all(isinstance(p, Publish) for p in got), got
        return got


def acknowledgement(qos: int, packet_id: int, code: int = 0) -> Packet:
    return Puback(packet_id, code) if qos == 1 else Pubrec(packet_id, code)


# ---------------------------------------------------------------------- Stored


@pytest.mark.parametrize("qos", [1, 2])
def test_stored_here_is_routed_then_acknowledged_only_once_durable(qos: int) -> None:
    scene = Scene()
    scene.publish(qos)
    assert scene.publisher.sent() == [] and scene.delivered() == []  # not durable yet
    assert [a.client_id for a in scene.log.appends] == ["sensor"]

    scene.log.complete(Stored(partition=1, offset=41))

    assert scene.publisher.sent() == [acknowledgement(qos, 7)]
    [delivery] = scene.delivered()
    assert (delivery.topic, delivery.payload, delivery.qos) == (TOPIC, b"21.5", qos)
    assert scene.log.routed_at == [(1, 41)]  # the high watermark passed it
    assert scene.log.high_watermark == [0, 42]


def test_a_qos2_resend_while_the_append_is_pending_is_not_stored_twice() -> None:
    scene = Scene()
    scene.publish(2)
    scene.publish(2)  # DUP of the same packet id, before the log answered
    assert len(scene.log.appends) == 1 and scene.publisher.sent() == []
    scene.log.complete(Stored(0, 3))
    assert scene.publisher.sent() == [Pubrec(7)]
    scene.publish(2)  # again, now that it is durable and routed: acknowledged, not routed
    assert scene.publisher.sent() == [Pubrec(7)]
    assert len(scene.delivered()) == 1 and scene.log.appends == []
    for event in scene.publisher.packets_for_the_broker(Pubrel(7)):
        scene.publishes.on_pubrel(scene.publisher, event)
    assert scene.publisher.sent() == [Pubcomp(7)]


def test_stored_after_the_publisher_left_is_routed_and_not_acknowledged() -> None:
    scene = Scene()
    scene.publish(1)
    scene.publisher.gone = True  # its connection ended; the resend on the next one acks
    scene.log.complete(Stored(0, 5))
    assert scene.publisher.sent() == []
    assert [p.payload for p in scene.delivered()] == [b"21.5"]


def test_a_stored_retained_publish_is_acknowledged_once_kept_as_retained() -> None:
    scene = Scene()
    scene.publish(1, retain=True)
    scene.log.complete(Stored(0, 9))
    assert scene.publisher.sent() == [Puback(7)]
    assert [m.payload for m in scene.host.retained.matching("plant/#")] == [b"21.5"]


# ---------------------------------------------------------------------- StoredElsewhere


@pytest.mark.parametrize("qos", [1, 2])
def test_stored_elsewhere_is_acknowledged_and_left_to_its_leader(qos: int) -> None:
    """``local`` None: the leader routed it to every router, this one included (its copy
    comes over the mesh): nothing is delivered here from the append."""
    scene = Scene()
    scene.publish(qos)
    scene.log.complete(StoredElsewhere(partition=0, offset=12, receivers=3))
    assert scene.publisher.sent() == [acknowledgement(qos, 7)]
    assert scene.delivered() == []
    assert scene.log.routed_at == []  # another router's partition


@pytest.mark.parametrize("qos", [1, 2])
def test_stored_elsewhere_with_local_is_delivered_to_our_own_subscribers(qos: int) -> None:
    """``local`` given: the leader left this router's subscribers to it (it has the message
    already); they get it here, with its place in the log."""
    scene = Scene()
    scene.subscriber.log_positions = True
    scene.publish(qos)
    scene.log.complete(StoredElsewhere(partition=1, offset=12, receivers=0, local=[]))
    assert scene.publisher.sent() == [acknowledgement(qos, 7)]  # 1 receiver: ours
    [delivery] = scene.delivered()
    assert delivery.payload == b"21.5"
    pairs = delivery.properties[PropertyId.USER_PROPERTY]
    assert (PARTITION_PROPERTY, "1") in pairs and (OFFSET_PROPERTY, "12") in pairs


def test_stored_elsewhere_with_no_receivers_says_so_to_a_5_0_publisher() -> None:
    scene = Scene()
    scene.publish(1)
    scene.log.complete(StoredElsewhere(partition=0, offset=1, receivers=0))
    assert scene.publisher.sent() == [Puback(7, ReasonCode.NO_MATCHING_SUBSCRIBERS)]


# ---------------------------------------------------------------------- Refused


@pytest.mark.parametrize("qos", [1, 2])
def test_refused_tells_a_5_0_publisher_the_reason_code(qos: int) -> None:
    scene = Scene()
    scene.publish(qos)
    scene.log.complete(Refused(ReasonCode.UNSPECIFIED_ERROR, "disk full"))
    assert scene.publisher.sent() == [acknowledgement(qos, 7, ReasonCode.UNSPECIFIED_ERROR)]
    assert scene.delivered() == []
    assert not scene.publisher.closing
    counters = scene.host.counters
    assert (counters.log_failures, counters.refused_publishes) == (1, 1)
    if qos == 2:  # the exchange is over: the same id is a new message
        assert 7 not in scene.publisher.session.qos2_in


@pytest.mark.parametrize("qos", [1, 2])
def test_refused_closes_a_3_1_1_publisher_which_cannot_be_told(qos: int) -> None:
    scene = Scene(version=MQTT_311)
    scene.publish(qos)
    scene.log.complete(Refused(ReasonCode.UNSPECIFIED_ERROR, "disk full"))
    publisher = scene.publisher
    assert publisher.sent() == []  # no acknowledgement: it resends on its next connection
    assert publisher.closing and publisher.rejected
    assert publisher.close_reason.startswith("protocol error 0x80: log failure")
    assert scene.delivered() == []
    assert scene.host.counters.protocol_errors == 1


@pytest.mark.parametrize("qos", [1, 2])
def test_a_full_log_queue_refuses_at_once_with_quota_exceeded(qos: int) -> None:
    scene = Scene()
    scene.log.accepts = False
    scene.publish(qos)
    assert scene.publisher.sent() == [acknowledgement(qos, 7, ReasonCode.QUOTA_EXCEEDED)]
    assert scene.delivered() == [] and scene.host.counters.refused_publishes == 1


# ---------------------------------------------------------------------- Unknown


MESSAGE_ID = bytes(range(16))


def reconnect(scene: Scene) -> FakeConnection:
    """The publisher's session, attached to a new connection of the same client."""
    session = scene.publisher.session
    assert session is not None
    again = FakeConnection("sensor", MQTT_5)
    again.session = session
    session.attach(again, NOW)
    scene.publisher = again
    return again


@pytest.mark.parametrize("qos", [1, 2])
def test_unknown_is_neither_acknowledged_nor_refused_the_connection_closes(qos: int) -> None:
    """The leader may have stored it: a PUBACK/PUBREC with 0x80 would be a lie, a success
    too. 5.0 is told DISCONNECT 0x80, and the session keeps the attempt's message id."""
    scene = Scene()
    scene.publish(qos)
    scene.log.complete(Unknown("no answer from its leader", MESSAGE_ID))
    sent = scene.publisher.sent()
    assert [type(p).__name__ for p in sent] == ["Disconnect"]
    assert sent[0].reason_code == ReasonCode.UNSPECIFIED_ERROR
    assert scene.publisher.closing and scene.delivered() == []
    session = scene.publisher.session
    assert session is not None and session.uncertain == {7: MESSAGE_ID}
    assert 7 not in session.qos2_in  # a QoS 2 resend must be stored again, not re-acked
    assert scene.host.counters.unknown_outcomes == 1


def test_unknown_closes_a_3_1_1_publisher_too() -> None:
    scene = Scene(MQTT_311)
    scene.publish(1)
    scene.log.complete(Unknown("the link to its leader dropped", MESSAGE_ID))
    assert scene.publisher.sent() == [] and scene.publisher.closing


@pytest.mark.parametrize("qos", [1, 2])
def test_the_resend_after_an_unknown_outcome_carries_the_first_message_id(qos: int) -> None:
    """The client resends (DUP) on its next connection: that append carries the id its
    leader can recognise; acknowledged once the leader answers."""
    scene = Scene()
    scene.publish(qos)
    scene.log.complete(Unknown("no answer", MESSAGE_ID))
    session = scene.publisher.session
    again = reconnect(scene)  # the same session, on a new connection
    scene.publish(qos, dup=True)
    assert scene.log.appends[0].message_id == MESSAGE_ID
    scene.log.complete(StoredElsewhere(0, 5, 1, None))
    assert again.sent() == [acknowledgement(qos, 7)]
    assert session is not None and session.uncertain == {}


def test_a_new_publish_reusing_the_packet_id_without_dup_is_a_new_message() -> None:
    scene = Scene()
    scene.publish(1)
    scene.log.complete(Unknown("no answer", MESSAGE_ID))
    reconnect(scene)
    scene.publish(1, dup=False)
    assert scene.log.appends[0].message_id is None


def test_a_retained_publish_whose_store_refuses_is_not_acknowledged_as_stored() -> None:
    """Acknowledged means stored, retained messages too: a store that is down refuses."""
    scene = Scene()
    scene.host.persistence = None  # not persisted: routed, then kept as retained

    def refusing(message: Message, done: object) -> None:
        assert callable(done)
        done(Refused(ReasonCode.UNSPECIFIED_ERROR, "its owner is down"))

    scene.host.retained.keep = refusing  # type: ignore[method-assign]
    scene.publish(1, retain=True)
    assert scene.publisher.sent() == [Puback(7, ReasonCode.UNSPECIFIED_ERROR)]


def test_a_retained_publish_whose_store_does_not_answer_closes_the_connection() -> None:
    scene = Scene()
    scene.host.persistence = None

    def silent(message: Message, done: object) -> None:
        assert callable(done)
        done(Unknown("its owner did not answer", None))

    scene.host.retained.keep = silent  # type: ignore[method-assign]
    scene.publish(1, retain=True)
    sent = scene.publisher.sent()
    assert [type(p).__name__ for p in sent] == ["Disconnect"] and scene.publisher.closing


def test_a_stored_outcome_is_equal_to_another_at_the_same_position() -> None:
    """``Stored`` is a plain class (compiled, a dataclass is made slowly): it keeps the
    dataclass's keywords, equality and repr."""
    assert Stored(partition=1, offset=41) == Stored(1, 41)
    assert Stored(1, 41) != Stored(1, 42) and Stored(1, 41) != Stored(2, 41)
    assert Stored(1, 41) != (1, 41)
    assert repr(Stored(1, 41)) == "Stored(partition=1, offset=41)"
