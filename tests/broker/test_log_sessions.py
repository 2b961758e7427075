"""Sessions as cursors into the commit log: log positions on delivery (to clients that ask),
replay on SUBSCRIBE, offline catch-up without copies, and session/retained state across
restarts and kill -9."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.packettypes import PacketTypes

from conftest import (
    BrokerProcess,
    asks_positions,
    props,
    split_position,
    start_broker,
    wait_for,
)
from meshmq.mqtt.packets import Publish
from meshmq.mqtt.properties import PropertyId

PERSISTENT = props(PacketTypes.CONNECT, SessionExpiryInterval=3600)


def replay_props(value: str):
    return props(PacketTypes.SUBSCRIBE, UserProperty=[("meshmq-replay", value)])


def restart(tmp_path: Path, broker: BrokerProcess, sig: int, config: str = "") -> BrokerProcess:
    assert broker.stop(sig) in (0, -signal.SIGKILL)
    (tmp_path / "broker" / "port").unlink()
    return start_broker(tmp_path, config)


def received(client, count: int) -> list[mqtt.MQTTMessage]:
    return [client.expect() for _ in range(count)]


# ---------------------------------------------------------------------- positions on delivery


def test_persisted_message_carries_partition_and_offset(broker, client_factory):
    """Each persisted delivery to a 5.0 client that asked (``meshmq-positions`` on CONNECT)
    names its partition and offset; offsets in one partition (one topic) increase by one."""
    sub = client_factory("pos-sub", 5)
    sub.connect(broker.port, properties=asks_positions())
    sub.subscribe("pos/t", qos=1)
    pub = client_factory("pos-pub", 5)
    pub.connect(broker.port)
    for i in range(3):
        pub.publish("pos/t", str(i), qos=1)
    positions = [split_position(m.properties.UserProperty)[1] for m in received(sub, 3)]
    assert all(p is not None for p in positions)
    assert len({p[0] for p in positions}) == 1
    first = positions[0][1]
    assert [p[1] for p in positions] == [first, first + 1, first + 2]


@pytest.mark.parametrize("sub_qos", [0, 1])
def test_positions_only_for_a_client_that_asked(broker, client_factory, sub_qos):
    """The same persisted messages: a client that did not ask gets the publisher's user
    properties exactly (order kept, nothing added: MQTT-3.3.2-17, -18), or none at all; one
    that asked gets them followed by the position."""
    plain = client_factory("plain-sub", 5)
    plain.connect(broker.port)
    plain.subscribe("ask/#", qos=sub_qos)
    asking = client_factory("asking-sub", 5)
    asking.connect(broker.port, properties=asks_positions())
    asking.subscribe("ask/#", qos=sub_qos)
    pub = client_factory("ask-pub", 5)
    pub.connect(broker.port)
    own = [("b", "2"), ("a", "1"), ("b", "2")]
    pub.publish("ask/own", b"1", qos=1, properties=props(PacketTypes.PUBLISH, UserProperty=own))
    pub.publish("ask/none", b"2", qos=1)
    first, second = received(plain, 2)
    assert first.properties.UserProperty == own
    assert not hasattr(second.properties, "UserProperty")
    first, second = received(asking, 2)
    assert split_position(first.properties.UserProperty)[0] == own
    assert split_position(first.properties.UserProperty)[1] is not None
    assert split_position(second.properties.UserProperty)[0] == []
    assert split_position(second.properties.UserProperty)[1] is not None


def test_resumed_session_follows_its_current_connect(broker, client_factory):
    """Asking is per connection: a persistent session that asked, then reconnects without
    asking, reads what it missed from the log without positions, and the other way round."""
    first = client_factory("resumer", 5)
    first.connect(broker.port, properties=asks_positions(SessionExpiryInterval=3600))
    first.subscribe("resume/t", qos=1)
    first.disconnect()
    pub = client_factory("resume-pub", 5)
    pub.connect(broker.port)
    pub.publish("resume/t", b"missed", qos=1,
                properties=props(PacketTypes.PUBLISH, UserProperty=[("k", "v")]))
    back = client_factory("resumer", 5)
    flags, _, _ = back.connect(broker.port, clean_start=False, properties=PERSISTENT)
    assert flags.session_present
    assert back.expect().properties.UserProperty == [("k", "v")]
    back.disconnect()
    pub.publish("resume/t", b"missed again", qos=1)
    again = client_factory("resumer", 5)
    again.connect(broker.port, clean_start=False,
                  properties=asks_positions(SessionExpiryInterval=3600))
    msg = again.expect()
    assert msg.payload == b"missed again"
    assert split_position(msg.properties.UserProperty)[1] is not None


def test_bad_positions_value_is_refused_with_0x83(broker, client_factory):
    client = client_factory("bad-positions", 5)
    _, reason, _ = client.connect(
        broker.port, expect_success=False,
        properties=props(PacketTypes.CONNECT, UserProperty=[("meshmq-positions", "yes")]))
    assert reason.value == 0x83
    wait_for(lambda: "meshmq-positions must be 'true' or 'false', got 'yes'" in broker.log(),
             what="the refusal logged")


def test_qos0_is_not_persisted_by_default(broker, client_factory):
    sub = client_factory("q0-sub", 5)
    sub.connect(broker.port, properties=asks_positions())
    sub.subscribe("q0/t", qos=1)
    pub = client_factory("q0-pub", 5)
    pub.connect(broker.port)
    pub.publish("q0/t", "zero", qos=0)
    msg = sub.expect()
    assert split_position(getattr(msg.properties, "UserProperty", None))[1] is None


# ---------------------------------------------------------------------- replay on SUBSCRIBE


def publish_history(client_factory, port: int, topic: str, count: int) -> None:
    pub = client_factory(f"hist-{topic.replace('/', '-')}", 5)
    pub.connect(port)
    for i in range(count):
        pub.publish(topic, f"m{i}", qos=1)
    pub.disconnect()


def test_replay_earliest_then_live(broker, client_factory):
    """meshmq-replay=earliest delivers every stored message on the filter, in order, then
    live messages, with no duplicate at the seam."""
    publish_history(client_factory, broker.port, "hist/a", 20)
    publish_history(client_factory, broker.port, "other/b", 5)
    sub = client_factory("replayer", 5)
    sub.connect(broker.port)
    codes = sub.subscribe("hist/#", qos=1, properties=replay_props("earliest"))
    assert codes[0].value == 1
    got = [m.payload.decode() for m in received(sub, 20)]
    assert got == [f"m{i}" for i in range(20)]
    live = client_factory("live-pub", 5)
    live.connect(broker.port)
    live.publish("hist/a", "live", qos=1)
    assert sub.expect().payload == b"live"
    sub.expect_none(0.3)


def test_replay_from_offset_resumes_where_the_device_left(broker, client_factory):
    """A client that kept the partition/offset of a message resumes right after it."""
    publish_history(client_factory, broker.port, "dev/7/cmd", 10)
    first = client_factory("dev7", 5)
    first.connect(broker.port, properties=asks_positions())
    first.subscribe("dev/7/cmd", qos=1, properties=replay_props("earliest"))
    history = received(first, 10)
    partition, offset = split_position(history[3].properties.UserProperty)[1]
    first.disconnect()
    again = client_factory("dev7-again", 5)
    again.connect(broker.port)
    again.subscribe("dev/7/cmd", qos=1,
                    properties=replay_props(f"offsets:{partition}={offset + 1}"))
    assert [m.payload.decode() for m in received(again, 6)] == [f"m{i}" for i in range(4, 10)]
    again.expect_none(0.3)


def test_replay_from_timestamp(broker, client_factory):
    publish_history(client_factory, broker.port, "ts/t", 3)
    cut = int(time.time() * 1000) + 5
    wait_for(lambda: int(time.time() * 1000) > cut + 5, what="the clock to pass the cut")
    pub = client_factory("ts-pub", 5)
    pub.connect(broker.port)
    pub.publish("ts/t", "after", qos=1)
    sub = client_factory("ts-sub", 5)
    sub.connect(broker.port)
    sub.subscribe("ts/t", qos=1, properties=replay_props(f"timestamp:{cut}"))
    assert sub.expect().payload == b"after"
    sub.expect_none(0.3)


def test_bad_replay_value_is_refused_with_0x83(broker, client_factory):
    sub = client_factory("bad-replay", 5)
    sub.connect(broker.port)
    codes = sub.subscribe("x/#", qos=1, properties=replay_props("yesterday"))
    assert codes[0].value == 0x83
    assert "replay refused" in broker.log()


def test_replay_is_refused_when_the_log_is_off(broker_factory, client_factory):
    broker = broker_factory("[log]\nenabled = false\n")
    sub = client_factory("no-log", 5)
    sub.connect(broker.port)
    assert sub.subscribe("x/#", qos=1, properties=replay_props("earliest"))[0].value == 0x83


# ---------------------------------------------------------------------- offline catch-up


def test_offline_session_reads_what_it_missed_from_the_log(broker_factory, client_factory):
    """Persisted messages are not copied into a small session queue: an offline session gets
    every one of 3000 messages, in order, although its queue holds 50."""
    broker = broker_factory("[session]\nmax_queued_messages = 50\n")
    sub = client_factory("cursor-sub", 5)
    sub.connect(broker.port, properties=PERSISTENT)
    sub.subscribe("cur/t", qos=1)
    sub.disconnect()
    pub = client_factory("cursor-pub", 5)
    pub.connect(broker.port)
    infos = [pub.publish("cur/t", str(i), qos=1, wait=False) for i in range(3000)]
    for info in infos:
        info.wait_for_publish(timeout=30)
    back = client_factory("cursor-sub", 5)
    flags, _, _ = back.connect(broker.port, clean_start=False, properties=PERSISTENT)
    assert flags.session_present
    got = [int(back.expect().payload) for _ in range(3000)]
    assert got == list(range(3000))
    back.expect_none(0.3)
    assert "dropped" not in broker.log()


def test_slow_subscriber_overflow_falls_back_to_the_log(broker_factory, client_factory):
    """A connected subscriber that cannot keep up (tiny queue, window 1) loses nothing on a
    persisted topic: the overflow is read from the log later, in order."""
    broker = broker_factory("[session]\nmax_queued_messages = 10\nmax_inflight_messages = 1\n")
    sub = client_factory("slow", 5)
    sub.connect(broker.port, properties=PERSISTENT)
    sub.subscribe("slow/t", qos=1)
    pub = client_factory("fast", 5)
    pub.connect(broker.port)
    infos = [pub.publish("slow/t", str(i), qos=1, wait=False) for i in range(500)]
    for info in infos:
        info.wait_for_publish(timeout=30)
    assert [int(sub.expect().payload) for _ in range(500)] == list(range(500))
    assert "dropped" not in broker.log()


# ---------------------------------------------------------------------- restarts


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["clean", "kill-9"])
def test_sessions_and_retained_survive_restart(tmp_path, client_factory, sig):
    """A persistent session (subscriptions, cursor), what it missed while offline, and a
    retained message all survive a restart, including kill -9 right after the acks."""
    broker = start_broker(tmp_path)
    sub = client_factory("keeper", 5)
    sub.connect(broker.port, properties=PERSISTENT)
    sub.subscribe("keep/#", qos=1)
    sub.disconnect()
    pub = client_factory("keep-pub", 5)
    pub.connect(broker.port)
    for i in range(50):
        pub.publish("keep/t", str(i), qos=1)  # each waits for its PUBACK
    pub.publish("keep/state", "on", qos=1, retain=True)
    pub.disconnect()
    broker = restart(tmp_path, broker, sig)
    try:
        back = client_factory("keeper", 5)
        flags, _, _ = back.connect(broker.port, clean_start=False, properties=PERSISTENT)
        assert flags.session_present
        got = received(back, 51)  # order holds per partition, so compare per topic
        assert [m.payload.decode() for m in got if m.topic == "keep/t"] == [
            str(i) for i in range(50)
        ]
        assert [m.payload for m in got if m.topic == "keep/state"] == [b"on"]
        late = client_factory("late", 5)
        late.connect(broker.port)
        late.subscribe("keep/state", qos=1)
        retained = late.expect()
        assert (retained.payload, retained.retain) == (b"on", True)
    finally:
        broker.stop()


def test_kill_9_after_suback_keeps_the_subscription(tmp_path, client_factory):
    """SUBACK means the subscription is on disk: after kill -9 the session still has it and
    receives what was published while the broker was down... and after."""
    broker = start_broker(tmp_path)
    sub = client_factory("subkeeper", 5)
    sub.connect(broker.port, properties=PERSISTENT)
    sub.subscribe("after/t", qos=1)
    broker = restart(tmp_path, broker, signal.SIGKILL)
    try:
        pub = client_factory("after-pub", 5)
        pub.connect(broker.port)
        pub.publish("after/t", "while-away", qos=1)
        back = client_factory("subkeeper", 5)
        flags, _, _ = back.connect(broker.port, clean_start=False, properties=PERSISTENT)
        assert flags.session_present
        assert back.expect().payload == b"while-away"
    finally:
        broker.stop()


def test_unacknowledged_deliveries_come_again_with_dup_after_kill_9(tmp_path, raw_factory,
                                                                   client_factory):
    """A connected subscriber that received 20 QoS 1 messages but acknowledged none gets all
    20 again after kill -9 and restart, in order, each with DUP set (MQTT-4.4.0-1 / 3.3.1.1)."""
    broker = start_broker(tmp_path)
    sub = raw_factory(broker.port, 5)
    sub.connect("noack", properties={PropertyId.SESSION_EXPIRY_INTERVAL: 3600})
    sub.subscribe("dup/t", qos=1)
    pub = client_factory("dup-pub", 5)
    pub.connect(broker.port)
    for i in range(20):
        pub.publish("dup/t", str(i), qos=1)
    first = [sub.recv_type(Publish) for _ in range(20)]  # never acknowledged
    assert [int(p.payload) for p in first] == list(range(20))
    broker = restart(tmp_path, broker, signal.SIGKILL)
    try:
        back = raw_factory(broker.port, 5)
        connack = back.connect("noack", clean_start=False,
                               properties={PropertyId.SESSION_EXPIRY_INTERVAL: 3600})
        assert connack.session_present
        again = [back.recv_type(Publish) for _ in range(20)]
        assert [int(p.payload) for p in again] == list(range(20))
        assert all(p.dup for p in again)
        for publish in again:
            back.ack(publish)
        back.recv_nothing(0.3)
    finally:
        broker.stop()


def test_a_fleet_reconnecting_after_kill_9_reads_the_log_once(tmp_path, raw_factory,
                                                              client_factory):
    """200 devices, each subscribed to its own topic with a persistent session, each sent one
    QoS 1 command while offline; kill -9; all reconnect: each gets its session and its own
    command, and the broker read the log once at start-up to find them (catchup.py, "The
    index"), not once per device."""
    devices = 200
    expiry = {PropertyId.SESSION_EXPIRY_INTERVAL: 3600}
    broker = start_broker(tmp_path)
    for device in range(devices):
        raw = raw_factory(broker.port, 5)
        raw.connect(f"dev-{device}", properties=expiry)
        raw.subscribe(f"fleet/{device}/cmd", qos=1)
        raw.close()
    pub = client_factory("fleet-pub", 5)
    pub.connect(broker.port)
    for device in range(devices):
        pub.publish(f"fleet/{device}/cmd", f"cmd-{device}", qos=1)  # each waits for its PUBACK
    pub.disconnect()
    broker = restart(tmp_path, broker, signal.SIGKILL)
    try:
        assert f"catch-ups indexed sessions={devices} records={devices}" in broker.log()
        back = []
        for device in range(devices):
            raw = raw_factory(broker.port, 5)
            assert raw.connect(f"dev-{device}", clean_start=False, properties=expiry
                               ).session_present
            back.append(raw)
        for device, raw in enumerate(back):
            publish = raw.recv_type(Publish)
            assert (publish.topic, publish.payload) == (f"fleet/{device}/cmd",
                                                        f"cmd-{device}".encode())
            raw.ack(publish)
        barrier = client_factory("fleet-barrier", 5)
        barrier.connect(broker.port)
        barrier.publish("fleet/0/cmd", "after", qos=1)
        assert back[0].recv_type(Publish).payload == b"after"  # nothing else came first
    finally:
        broker.stop()


def test_ended_session_does_not_come_back(tmp_path, client_factory):
    broker = start_broker(tmp_path)
    sub = client_factory("gone", 5)
    sub.connect(broker.port, properties=PERSISTENT)
    sub.subscribe("g/t", qos=1)
    sub.disconnect()
    clean = client_factory("gone", 5)
    clean.connect(broker.port, clean_start=True)  # expiry 0: the session ends on disconnect
    clean.disconnect()

    def end_journaled() -> bool:  # the end of a session is written without anyone waiting
        return any('"op":"end","client_id":"gone"' in journal.read_text()
                   for journal in (broker.data_dir / "state").glob("journal-*.jsonl"))

    wait_for(end_journaled, what="the session end in the state journal")
    broker = restart(tmp_path, broker, signal.SIGKILL)
    try:
        back = client_factory("gone", 5)
        flags, _, _ = back.connect(broker.port, clean_start=False, properties=PERSISTENT)
        assert not flags.session_present
    finally:
        broker.stop()


def test_damaged_state_journal_is_a_one_line_error(tmp_path, client_factory):
    broker = start_broker(tmp_path)
    sub = client_factory("dmg", 5)
    sub.connect(broker.port, properties=PERSISTENT)
    sub.subscribe("d/t", qos=1)
    assert broker.stop(signal.SIGKILL) == -signal.SIGKILL
    journal = next((broker.data_dir / "state").glob("journal-*.jsonl"))
    journal.write_bytes(b"{not json\n" + journal.read_bytes())
    (tmp_path / "broker" / "port").unlink()
    with pytest.raises(pytest.fail.Exception, match="damaged journal line"):
        start_broker(tmp_path)


def test_bad_fsync_rule_is_a_one_line_error(tmp_path):
    config = tmp_path / "meshmq.toml"
    config.write_text('[log]\nfsync_rules = "telemetry/#=interval, cmd/#=sometimes"\n')
    result = subprocess.run(
        [sys.executable, "-m", "meshmq", "serve", "--config", str(config), "--port", "0",
         "--bind", "127.0.0.1", "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "log.fsync_rules" in errors[0] and "cmd/#=sometimes" in errors[0]


def test_fsync_rules_apply_per_topic(broker_factory, client_factory):
    """Topics under an ``interval`` rule and under the default ``always`` both persist and are
    delivered with their log positions."""
    broker = broker_factory('[log]\nfsync_rules = "bulk/#=interval"\n')
    sub = client_factory("rules-sub", 5)
    sub.connect(broker.port, properties=asks_positions())
    sub.subscribe("#", qos=1)
    pub = client_factory("rules-pub", 5)
    pub.connect(broker.port)
    pub.publish("bulk/a", "b", qos=1)
    pub.publish("cmd/a", "c", qos=1)
    got = {m.topic: split_position(m.properties.UserProperty)[1] for m in received(sub, 2)}
    assert set(got) == {"bulk/a", "cmd/a"} and all(got.values())
