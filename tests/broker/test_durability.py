"""Acknowledged means durable: kill -9 the broker mid-stream, every PUBACKed message is in the log.

Publishers pipeline QoS 1 messages (a window of unacknowledged ones each) on topics of every
partition and record which were acknowledged; the broker is killed with SIGKILL while they are
still sending. The commit log is then opened directly, and a restarted broker must recover it
and serve again. With two workers, publishers are placed on both: each publishes to partitions
its worker leads (appended there) and to partitions the other leads (``APPEND`` to it).
"""

from __future__ import annotations

import signal
import threading
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import BrokerProcess, start_broker, wait_for
from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.files import filesystem_sync
from meshmq.mqtt.packets import Puback, Publish
from meshmq.mqtt.properties import PropertyId
from rawclient import ConnectionClosed, RawClient

PUBLISHERS = 4
WINDOW = 16
TOPICS = 8  # per publisher: with the default 8 partitions, leaders on every worker
ADMIN_KEY = "durable-key"


def connect_to(port: int, name: str, worker: int | None) -> RawClient:
    """A connection of client ``name`` served by ``worker`` (None: wherever it lands)."""
    for _ in range(64):
        client = RawClient(port, 5)
        connack = client.connect(name)
        served = dict(connack.properties.get(PropertyId.USER_PROPERTY) or ()).get(
            "meshmq-worker", "0")
        if worker is None or int(served) == worker:  # type: ignore[arg-type]
            return client
        client.close()
    raise AssertionError(f"no connection of {name} landed on worker {worker}")


def publish_until_killed(port: int, name: str, acked: set[bytes], lock: threading.Lock,
                         worker: int | None = None) -> None:
    try:
        client = connect_to(port, name, worker)
    except (OSError, ConnectionError, ConnectionClosed):
        return
    try:
        sent: dict[int, bytes] = {}
        sequence = 0
        while True:
            while len(sent) < WINDOW:
                sequence += 1
                packet_id = sequence % 65535 + 1
                payload = f"{name}-{sequence}".encode()
                sent[packet_id] = payload
                topic = f"durable/{name}/{sequence % TOPICS}"
                client.send(Publish(topic, payload, 1, packet_id=packet_id))
            ack = client.recv_type(Puback, timeout=10)
            assert ack.reason_code < 0x80
            with lock:
                acked.add(sent.pop(ack.packet_id))
    except (OSError, AssertionError, EOFError, ConnectionError, ConnectionClosed,
            TimeoutError):
        return  # the broker was killed
    finally:
        client.close()


def stored_payloads(data_dir: Path) -> list[bytes]:
    payloads: list[bytes] = []
    with CommitLog(data_dir, LogConfig()) as commit_log:
        for partition in range(commit_log.partition_count):
            offset = commit_log.earliest_offset(partition)
            end = commit_log.next_offset(partition)
            while offset < end:
                records = commit_log.read(partition, offset)
                payloads.extend(record.payload for record in records)
                offset = records[-1].offset + 1
    return payloads


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("fsync", ["always", "interval"])
def test_kill_9_loses_no_acknowledged_message(tmp_path: Path, fsync: str, workers: int) -> None:
    config = f'[log]\nfsync = "{fsync}"\nfsync_interval_ms = 200\n'
    kill_under_load_and_check(tmp_path, config, workers)


def log_fsyncs(port: int) -> dict[str, float]:
    """``meshmq_log_fsyncs_total`` by path (``loop``, ``thread``), and under ``filesystem``
    ``meshmq_log_filesystem_syncs_total``, from the admin listener."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "meshmq_log_fsyncs_total":
                found[sample.labels["path"]] = sample.value
            elif sample.name == "meshmq_log_filesystem_syncs_total":
                found["filesystem"] = sample.value
    return found


def wait_for_syncs(seen: dict[str, float], paths: tuple[str, ...], what: str,
                   broker: BrokerProcess) -> None:
    """Until the log's fsyncs on ``paths`` add up to 100 (while the publishers go on); the
    last metrics read are left in ``seen``."""
    def enough() -> bool:
        seen.update(log_fsyncs(broker.port_of("admin")))
        return sum(seen.get(path, 0) for path in paths) >= 100
    wait_for(enough, timeout=60, what=what)


def test_kill_9_with_fsync_always_on_the_event_loop_loses_no_acknowledged_message(
        tmp_path: Path) -> None:
    """fsync ``always`` on the event loop (no writer thread between the publish and its
    PUBACK; the limit raised so that a busy test machine's slow fsyncs keep it there): the
    metrics show every fsync was on the loop, and every PUBACK was durable. (The test above
    runs with the default limit, where slow fsyncs move to the thread and back.)"""
    config = (f'[log]\nfsync = "always"\nfsync_inline_max_ms = 60000\n[admin]\n'
              f'listen = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n')
    seen: dict[str, float] = {}
    kill_under_load_and_check(tmp_path, config, 1, before_kill=partial(
        wait_for_syncs, seen, ("loop",), "100 fsyncs on the event loop"))
    assert seen["thread"] == 0, seen


@pytest.mark.skipif(filesystem_sync() is None, reason="no trusted syncfs (Linux < 5.8?)")
@pytest.mark.parametrize("min_partitions", [2, 0])
def test_kill_9_with_turns_synced_by_one_syncfs_loses_no_acknowledged_message(
        tmp_path: Path, min_partitions: int) -> None:
    """The publishers' turns touch several partitions: with ``log.syncfs_min_partitions = 2``
    their syncs are one syncfs each (the metric counts them) and every PUBACK was durable;
    with 0 (the default) there is none."""
    config = (f'[log]\nfsync = "always"\nsyncfs_min_partitions = {min_partitions}\n'
              f'[admin]\nlisten = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n')
    seen: dict[str, float] = {}
    kill_under_load_and_check(tmp_path, config, 1, before_kill=partial(
        wait_for_syncs, seen, ("loop", "thread"), "100 syncs of the log"))
    if min_partitions:
        assert seen["filesystem"] >= 50, seen
    else:
        assert seen["filesystem"] == 0, seen


def kill_under_load_and_check(tmp_path: Path, config: str, workers: int,
                              before_kill: Callable[[BrokerProcess], None] | None = None
                              ) -> None:
    """Publish QoS 1 from every publisher, kill -9 the broker mid-stream, then check every
    acknowledged message is in the log and a restarted broker recovers it."""
    broker = start_broker(tmp_path, config, workers=workers)
    acked: set[bytes] = set()
    lock = threading.Lock()
    threads = [
        threading.Thread(target=publish_until_killed, args=(
            broker.port, f"p{i}", acked, lock, i % workers if workers > 1 else None))
        for i in range(PUBLISHERS)
    ]
    for thread in threads:
        thread.start()
    names = {f"p{i}".encode() for i in range(PUBLISHERS)}

    def under_way() -> bool:
        with lock:
            return len(acked) >= 600 and {p.split(b"-")[0] for p in acked} == names

    wait_for(under_way, timeout=60, what="600 acknowledged publishes, from every publisher")
    if before_kill is not None:
        before_kill(broker)
    broker.stop(signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=30)
    with lock:
        acknowledged = set(acked)
    stored = stored_payloads(broker.data_dir)
    missing = acknowledged - set(stored)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:3]}"

    (tmp_path / "broker" / "port").unlink()
    restarted = start_broker(tmp_path, config, workers=workers)  # recovers the log
    try:
        client = RawClient(restarted.port, 5)
        client.connect("after")
        assert client.publish("durable/after", b"x", qos=1).reason_code < 0x80
        client.close()
    finally:
        restarted.stop()
