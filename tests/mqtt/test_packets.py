"""The packet classes (mqtt/packets.py) are plain classes, compiled where meshmq is: they keep
what the dataclasses they replaced gave the rest of the code and the tests."""

from __future__ import annotations

import pytest

from meshmq.broker.transport.certauth import CertifiedConnect, certify
from meshmq.mqtt.packets import (
    Auth,
    Connect,
    Disconnect,
    PacketType,
    Pingreq,
    Puback,
    Publish,
    Pubrec,
    Unsuback,
)


def test_packets_are_equal_by_class_and_fields() -> None:
    assert Publish("a/b", b"x", 1, packet_id=7) == Publish("a/b", b"x", qos=1, packet_id=7)
    assert Publish("a/b", b"x", 1, packet_id=7) != Publish("a/b", b"x", 1, packet_id=8)
    assert Puback(3) == Puback(3, 0, {}) and Puback(3) != Puback(3, 0x10)
    assert Puback(3) != Pubrec(3)  # the same fields, another packet
    assert Disconnect(0x8E) != Auth(0x8E)
    assert Pingreq() == Pingreq()
    assert Publish("t", b"") != ("t", b"")


def test_defaults_and_a_fresh_properties_dict_for_each_packet() -> None:
    first, second = Publish("t", b""), Publish("t", b"")
    first.properties[1] = 1
    assert second.properties == {}  # never one dict shared by all
    assert (second.qos, second.retain, second.dup, second.packet_id) == (0, False, False, None)
    assert Unsuback(1).reason_codes == []
    assert Unsuback(1).reason_codes is not Unsuback(1).reason_codes
    assert Connect("c").protocol_level == 5 and Connect("c").keep_alive == 60


def test_the_repr_names_the_class_and_every_field() -> None:
    assert repr(Pubrec(9, 0x10)) == "Pubrec(packet_id=9, reason_code=16, properties={})"
    assert repr(Publish("t", b"p", retain=True)) == (
        "Publish(topic='t', payload=b'p', qos=0, retain=True, dup=False, packet_id=None, "
        "properties={})")


def test_each_class_has_its_type_and_no_attributes_beyond_its_fields() -> None:
    assert Publish.type is PacketType.PUBLISH and Puback(1).type is PacketType.PUBACK
    packet = Puback(1)
    with pytest.raises(AttributeError):
        packet.topic = "x"  # type: ignore[attr-defined]


def test_a_certified_connect_is_the_connect_with_the_proven_user_name_and_no_password() -> None:
    connect = Connect("id", 4, False, 30, "claimed", b"secret", None, {17: 5})
    certified = certify(connect, "CN=device")
    assert isinstance(certified, CertifiedConnect) and isinstance(certified, Connect)
    assert (certified.client_id, certified.protocol_level, certified.clean_start,
            certified.keep_alive, certified.properties) == ("id", 4, False, 30, {17: 5})
    assert (certified.username, certified.password) == ("CN=device", None)
    assert certified != connect
