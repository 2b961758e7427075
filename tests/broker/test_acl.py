"""ACLs enforced by a real broker: denied SUBSCRIBE and PUBLISH reason codes, delivery filter."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from conftest import start_broker, wait_for
from meshmq.auth.passwords import hash_password, write_password_file
from meshmq.mqtt.packets import Puback


@pytest.fixture
def guarded(tmp_path: Path):
    acl = tmp_path / "acl"
    acl.write_text(
        "* readwrite devices/%c/#\n"  # each device owns its subtree, secrets included
        "* deny devices/+/secret\n"  # nobody else reads them
        "* read devices/#\n"
    )
    broker = start_broker(tmp_path, f'[auth]\nacl_file = "{acl}"\n', "guarded")
    yield broker
    broker.stop()


@pytest.mark.parametrize(("version", "code"), [(4, 0x80), (5, 0x87)])
def test_denied_subscribe_gets_not_authorized(guarded, raw_factory, version, code) -> None:
    raw = raw_factory(guarded.port, version)
    raw.connect("d1")
    assert raw.subscribe("other/#", qos=1).reason_codes == [code]
    assert raw.subscribe("devices/#", qos=1).reason_codes == [1]


def test_denied_publish_v5_gets_0x87_and_is_not_routed(guarded, raw_factory) -> None:
    reader = raw_factory(guarded.port, 5)
    reader.connect("reader")
    reader.subscribe("devices/#", qos=1)
    writer = raw_factory(guarded.port, 5)
    writer.connect("d1")
    ack = writer.publish("devices/d2/cmd", b"not mine", qos=1)
    assert isinstance(ack, Puback) and ack.reason_code == 0x87
    assert writer.publish("devices/d1/temp", b"mine", qos=1).reason_code in (0, 0x10)
    delivered = reader.recv()
    assert (delivered.topic, delivered.payload) == ("devices/d1/temp", b"mine")
    wait_for(lambda: "publish denied client_id=d1" in guarded.log(), what="the denial log")


def test_denied_publish_v311_is_acknowledged_and_dropped(guarded, raw_factory) -> None:
    reader = raw_factory(guarded.port, 4)
    reader.connect("reader")
    reader.subscribe("devices/#", qos=1)
    writer = raw_factory(guarded.port, 4)
    writer.connect("d1")
    assert writer.publish("devices/d2/cmd", b"no", qos=1).reason_code == 0
    writer.publish("devices/d1/ok", b"yes", qos=1)
    assert reader.recv().payload == b"yes"


def test_deny_inside_an_allowed_filter_holds_per_delivery(guarded, raw_factory) -> None:
    reader = raw_factory(guarded.port, 5)
    reader.connect("reader")
    reader.subscribe("devices/#", qos=1)
    writer = raw_factory(guarded.port, 5)
    writer.connect("d1")
    assert writer.publish("devices/d1/secret", b"hidden", qos=1).reason_code in (0, 0x10)
    writer.publish("devices/d1/public", b"shown", qos=1)
    assert reader.recv().payload == b"shown"  # the secret, published first, was not delivered
    owner = raw_factory(guarded.port, 5)
    owner.connect("d1-reader")
    assert owner.subscribe("devices/d1/secret", qos=1).reason_codes == [0x87]


def test_sighup_reloads_the_acl_file_and_keeps_connections(tmp_path: Path, raw_factory) -> None:
    """SIGHUP re-reads the ACL file: a new rule applies to the next SUBSCRIBE of a client that
    stayed connected; a broken file is logged and the rules in force stay."""
    acl = tmp_path / "acl"
    acl.write_text("* read open/#\n")
    broker = start_broker(tmp_path, f'[auth]\nacl_file = "{acl}"\n', "reloading")
    try:
        raw = raw_factory(broker.port, 5)
        raw.connect("c1")
        assert raw.subscribe("later/#", qos=1).reason_codes == [0x87]
        acl.write_text("* read open/#\n* read later/#\n")
        broker.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "ACL file reloaded" in broker.log(), what="the reload")
        assert raw.subscribe("later/#", qos=1).reason_codes == [1]
        acl.write_text("* bogus-access later/#\n")
        broker.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "ACL file not reloaded" in broker.log(), what="the refused reload")
        assert raw.subscribe("open/#", qos=1).reason_codes == [1]
    finally:
        broker.stop()


def test_every_topic_for_one_user_and_sys_for_a_monitoring_user(tmp_path: Path,
                                                                raw_factory) -> None:
    """``#`` as a rule's topic is every topic (not a comment); ``$SYS/#`` is granted only by a
    rule naming it (MQTT-4.7.2-1: ``#`` matches no ``$`` topic)."""
    passwords = tmp_path / "passwords"
    write_password_file(passwords, {"admin": hash_password("a-secret"),
                                    "monitor": hash_password("m-secret")})
    acl = tmp_path / "acl"
    acl.write_text("# who      access     topic\n"
                   "user:admin readwrite #        # the operator\n"
                   "user:monitor read   $SYS/#\n")
    broker = start_broker(tmp_path, f'[auth]\npassword_file = "{passwords}"\n'
                          f'acl_file = "{acl}"\n[mqtt]\nsys_interval = 0.2\n', "acl-hash")
    try:
        admin = raw_factory(broker.port, 5)
        assert admin.connect("admin-1", username="admin", password=b"a-secret").reason_code == 0
        assert admin.subscribe("#", qos=1).reason_codes == [1]
        assert admin.subscribe("$SYS/#", qos=0).reason_codes == [0x87]
        admin.publish("any/topic", b"hello", qos=0)
        delivered = admin.recv()
        assert (delivered.topic, delivered.payload) == ("any/topic", b"hello")
        monitor = raw_factory(broker.port, 5)
        assert monitor.connect("mon-1", username="monitor",
                               password=b"m-secret").reason_code == 0
        assert monitor.subscribe("#", qos=0).reason_codes == [0x87]
        assert monitor.subscribe("$SYS/#", qos=0).reason_codes == [0]
        assert monitor.recv().topic.startswith("$SYS/broker/")
    finally:
        broker.stop()
