"""Acknowledged means durable: kill -9 the broker mid-stream, every PUBACKed message is in the log.

Publishers pipeline QoS 1 messages (a window of unacknowledged ones each) and record which were
acknowledged; the broker is killed with SIGKILL while they are still sending. The commit log is
then opened directly, and a restarted broker must recover it and serve again.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import pytest

from conftest import start_broker, wait_for
from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.mqtt.packets import Puback, Publish
from rawclient import RawClient

PUBLISHERS = 3
WINDOW = 16


def publish_until_killed(port: int, name: str, acked: set[bytes], lock: threading.Lock) -> None:
    client = RawClient(port, 5)
    try:
        client.connect(name)
        sent: dict[int, bytes] = {}
        sequence = 0
        while True:
            while len(sent) < WINDOW:
                sequence += 1
                packet_id = sequence % 65535 + 1
                payload = f"{name}-{sequence}".encode()
                sent[packet_id] = payload
                client.send(Publish(f"durable/{name}", payload, 1, packet_id=packet_id))
            ack = client.recv_type(Puback, timeout=10)
            assert ack.reason_code < 0x80
            with lock:
                acked.add(sent.pop(ack.packet_id))
    except (OSError, AssertionError, EOFError, ConnectionError, TimeoutError):
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


@pytest.mark.parametrize("fsync", ["always", "interval"])
def test_kill_9_loses_no_acknowledged_message(tmp_path: Path, fsync: str) -> None:
    config = f'[log]\nfsync = "{fsync}"\nfsync_interval_ms = 200\n'
    broker = start_broker(tmp_path, config)
    acked: set[bytes] = set()
    lock = threading.Lock()
    threads = [
        threading.Thread(target=publish_until_killed, args=(broker.port, f"p{i}", acked, lock))
        for i in range(PUBLISHERS)
    ]
    for thread in threads:
        thread.start()
    wait_for(lambda: len(acked) >= 600, timeout=60, what="600 acknowledged publishes")
    broker.stop(signal.SIGKILL)
    for thread in threads:
        thread.join(timeout=30)
    with lock:
        acknowledged = set(acked)
    stored = stored_payloads(broker.data_dir)
    missing = acknowledged - set(stored)
    assert not missing, f"{len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:3]}"

    (tmp_path / "broker" / "port").unlink()
    restarted = start_broker(tmp_path, config)  # recovers the log left by kill -9
    try:
        client = RawClient(restarted.port, 5)
        client.connect("after")
        assert client.publish("durable/after", b"x", qos=1).reason_code < 0x80
        client.close()
    finally:
        restarted.stop()
