"""Partition leaders spread over the workers (docs/workers.md): partition ``p`` is led by worker
``p mod N``, a dead worker takes only its partitions offline, and changing ``server.workers``
keeps every record, session and retained message.

Which worker leads a topic is computed here from the rule (the log's CRC-32 partitioner), not
asked of the broker; the tests then check the broker behaves as the rule says.
"""

from __future__ import annotations

import os
import signal
import zlib
from collections.abc import Callable

from paho.mqtt.packettypes import PacketTypes
from test_workers import LOG_ON, worker_pids

from conftest import WAIT, BrokerProcess, Client, connect_on, props, wait_for

PARTITIONS = 8  # log.partitions by default


def partition_of(topic: str) -> int:
    return zlib.crc32(topic.encode()) % PARTITIONS


def topic_led_by(worker: int, workers: int, prefix: str, skip: int = 0) -> str:
    """A topic ``prefix/<n>`` whose partition worker ``worker`` leads."""
    found = [f"{prefix}/{n}" for n in range(200) if partition_of(f"{prefix}/{n}") % workers
             == worker]
    return found[skip]


def test_each_worker_writes_the_partitions_it_leads(
        broker_factory: Callable[..., BrokerProcess],
        client_factory: Callable[..., Client]) -> None:
    """A worker opens and appends to its own partitions only; every partition's files grow
    whichever worker the publisher is on."""
    broker = broker_factory(LOG_ON, workers=2)
    publishers = [connect_on(client_factory, broker, w) for w in (0, 1)]
    topics = [f"spread/{n}" for n in range(64)]
    assert {partition_of(t) for t in topics} == set(range(PARTITIONS))
    for index, topic in enumerate(topics):
        publishers[index % 2].publish(topic, b"x" * 100, qos=1)
    log_dir = broker.data_dir / "log"
    for partition in range(PARTITIONS):
        directory = log_dir / str(partition)
        assert (directory / ".lock").exists()  # its leader holds it
        assert sum(f.stat().st_size for f in directory.glob("*.log")) > 0, partition
    text = broker.log()
    assert "Traceback" not in text


def test_a_dead_worker_takes_only_its_partitions_offline(
        broker_factory: Callable[..., BrokerProcess],
        client_factory: Callable[..., Client]) -> None:
    """Worker 1 dies and (its supervisor stopped) stays dead: publishes to the partitions it
    leads are refused (5.0: PUBACK 0x80; 3.1.1: the connection is closed), the others go on;
    once it is back, its partitions take publishes again and nothing acknowledged is lost."""
    broker = broker_factory(LOG_ON, workers=2)
    pids = worker_pids(broker)
    mine, theirs = topic_led_by(0, 2, "offline"), topic_led_by(1, 2, "offline")
    subscriber = connect_on(client_factory, broker, 0, "watcher", expiry=600)
    subscriber.subscribe("offline/#", qos=1)
    publisher = connect_on(client_factory, broker, 0)
    for topic in (mine, theirs):
        publisher.publish(topic, "before", qos=1)
        assert publisher.acked.get(timeout=WAIT)[1] == 0
    assert sorted(subscriber.expect().payload for _ in range(2)) == [b"before", b"before"]

    os.kill(broker.proc.pid, signal.SIGSTOP)  # the supervisor: no restart for now
    try:
        os.kill(pids[1], signal.SIGKILL)
        wait_for(lambda: "link lost peer=1" in broker.log(), what="worker 0 to see it")
        info = publisher.publish(theirs, "refused", qos=1, wait=False)
        mid, code = publisher.acked.get(timeout=WAIT)
        assert (mid, code) == (info.mid, 0x80)  # Unspecified error: its partition is offline
        publisher.publish(mine, "accepted", qos=1)
        assert publisher.acked.get(timeout=WAIT)[1] == 0
        assert subscriber.expect().payload == b"accepted"
        old = client_factory(version=4)
        old.connect(broker.port)
        if worker_of_log(broker, old) == 0:  # 3.1.1 cannot be told no: it is disconnected
            old.publish(theirs, "refused", qos=1, wait=False)
            assert old.disconnects.get(timeout=WAIT) != 0
    finally:
        os.kill(broker.proc.pid, signal.SIGCONT)
    wait_for(lambda: "worker restarted index=1" in broker.log(), timeout=30,
             what="worker 1 restarted")

    def accepted_again() -> bool:
        info = publisher.publish(theirs, "after", qos=1, wait=False)
        mid, code = publisher.acked.get(timeout=WAIT)
        return mid == info.mid and code == 0

    wait_for(accepted_again, what="worker 1's partitions back")
    got = [subscriber.expect().payload for _ in range(1)]
    assert got == [b"after"]


def worker_of_log(broker: BrokerProcess, client: Client) -> int:
    """The worker serving a 3.1.1 client (its connect line in the broker's log)."""
    client_id = client.paho._client_id.decode() or None
    lines = [line for line in broker.log().splitlines() if "client connected" in line
             and (client_id is None or f"client_id={client_id}" in line)]
    return int(lines[-1].rsplit("worker=", 1)[1]) if lines else -1


def test_changing_the_worker_count_keeps_records_sessions_and_retained_messages(
        broker_factory: Callable[..., BrokerProcess],
        client_factory: Callable[..., Client]) -> None:
    """Two workers, then three, then one: partitions change leaders, retained messages
    change owners, sessions move to the workers their state folds onto; nothing is lost."""
    broker = broker_factory(LOG_ON, workers=2)
    for worker in (0, 1):
        client = connect_on(client_factory, broker, worker, f"reader-{worker}", expiry=3600)
        client.subscribe("data/#", qos=1)
        client.disconnect()
    publisher = connect_on(client_factory, broker, 1)
    retained = {f"state/{n}": f"value-{n}".encode() for n in range(16)}
    for topic, value in retained.items():
        publisher.publish(topic, value, qos=1, retain=True)
    sent = [f"data/{n % 8}" for n in range(40)]
    for n, topic in enumerate(sent):
        publisher.publish(topic, str(n), qos=1)
    broker.stop()

    for count, batch in ((3, range(40, 50)), (1, range(50, 60))):
        broker = broker_factory(LOG_ON, name="broker", workers=count)
        for worker in range(count):  # every retained message, whichever worker asks
            late = connect_on(client_factory, broker, worker)
            late.subscribe("state/#", qos=1)
            got = {m.topic: m.payload for m in (late.expect() for _ in retained)}
            assert got == retained
            late.disconnect()
        publisher = client_factory()
        publisher.connect(broker.port)
        for n in batch:
            publisher.publish(f"data/{n % 8}", str(n), qos=1)
        publisher.disconnect()
        for worker in (0, 1):  # each session: everything since it last read, per topic in order
            reader = client_factory(f"reader-{worker}")
            flags, _, _ = reader.connect(broker.port, clean_start=False, properties=props(
                PacketTypes.CONNECT, SessionExpiryInterval=3600))
            assert flags.session_present
            expected = list(range(0, batch.stop)) if count == 3 else list(batch)
            got_n = [int(reader.expect().payload) for _ in expected]
            assert sorted(got_n) == expected
            for topic in range(8):
                mine = [n for n in got_n if n % 8 == topic]
                assert mine == sorted(mine)
            reader.disconnect()
        replay = client_factory()
        replay.connect(broker.port)
        replay.subscribe("data/#", qos=1, properties=props(
            PacketTypes.SUBSCRIBE, UserProperty=[("meshmq-replay", "earliest")]))
        history = sorted(int(replay.expect().payload) for _ in range(batch.stop))
        assert history == list(range(batch.stop))  # every record, in the log
        replay.disconnect()
        broker.stop()
