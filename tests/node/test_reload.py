"""SIGHUP reloads the configuration file (node/reload.py): a real broker, one or two workers.

What changed is observed through MQTT (a password file named after start admits its user and
refuses anonymous clients, a lowered subscription limit refuses the next filter) and through the
log lines; a file that cannot be used leaves the running configuration as it was.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from pathlib import Path

import pytest

from conftest import BrokerProcess, start_broker, wait_for
from meshmq.auth.passwords import hash_password, write_password_file
from meshmq.config import load_config
from meshmq.mqtt.packets import Connack, SubscriptionOptions
from meshmq.mqtt.properties import PropertyId
from meshmq.node.reload import ConfigReloader, ConfigSource

NOT_AUTHORIZED = 0x87
QUOTA_EXCEEDED = 0x97


def config_file(broker: BrokerProcess) -> Path:
    return broker.log_path.parent / "meshmq.toml"  # the file start_broker wrote


def worker_of(connack: Connack) -> str | None:
    """The worker that serves a 5.0 client (None on a single-process node)."""
    pairs = connack.properties.get(PropertyId.USER_PROPERTY, [])
    return dict(pairs).get("meshmq-worker")


def two_filters(qos: int = 2) -> list[tuple[str, SubscriptionOptions]]:
    return [("a/#", SubscriptionOptions(qos)), ("b/#", SubscriptionOptions(qos))]


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, dict[str, object]]]:
    """Each captured record's message and its key=value fields."""
    return [(record.getMessage(), getattr(record, "kv", {})) for record in caplog.records]


def hup_and_wait(broker: BrokerProcess, line: str, times: int) -> None:
    """SIGHUP, then wait until ``line`` was logged ``times`` more times (once per worker)."""
    before = broker.log().count(line)
    broker.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: broker.log().count(line) >= before + times, what=f"{line!r} x{times}")


@pytest.mark.parametrize("workers", [1, 2])
def test_sighup_applies_a_new_password_file_and_limit_and_lists_restart_keys(
        tmp_path: Path, raw_factory, workers: int) -> None:
    broker = start_broker(tmp_path, "[limits]\nmax_subscriptions = 1000\n", workers=workers)
    try:
        earlier = raw_factory(broker.port)
        assert earlier.connect("earlier").reason_code == 0  # anonymous: no password file yet
        assert earlier.subscribe(two_filters()).reason_codes == [2, 2]
        passwords = tmp_path / "passwords"
        write_password_file(passwords, {"carol": hash_password("c4r0l")})
        config_file(broker).write_text(
            f'[limits]\nmax_subscriptions = 1\n[auth]\npassword_file = "{passwords}"\n'
            "[mqtt]\nmax_qos = 1\n")
        # the last line of each worker's report (node/reload.py): its other lines came first
        hup_and_wait(broker, "configuration changes that need a restart keys=mqtt.max_qos",
                     workers)
        log = broker.log()
        assert log.count(f'configuration changed key=auth.password_file old="" new='
                         f"{passwords}") == workers
        assert log.count("configuration changed key=limits.max_subscriptions old=1000 new=1") \
            == workers
        if workers == 2:
            changed = re.findall(r"key=limits.max_subscriptions old=1000 new=1 worker=(\d)", log)
            assert sorted(changed) == ["0", "1"]
        # a connected client keeps its connection; its next SUBSCRIBE meets the new limit
        assert earlier.subscribe("c/#", qos=1).reason_codes == [QUOTA_EXCEEDED]
        seen: set[str | None] = set()
        for attempt in range(40):  # until every worker has answered
            anonymous = raw_factory(broker.port)
            assert anonymous.connect(f"anon-{attempt}").reason_code == NOT_AUTHORIZED
            carol = raw_factory(broker.port)
            connack = carol.connect(f"carol-{attempt}", username="carol", password=b"c4r0l")
            assert connack.reason_code == 0
            seen.add(worker_of(connack))
            # max_qos needs a restart: QoS 2 is still granted; the second filter is one too many
            assert carol.subscribe(two_filters()).reason_codes == [2, QUOTA_EXCEEDED]
            if len(seen) == workers:
                break
        assert len(seen) == workers, seen
    finally:
        broker.stop()
    assert "Traceback" not in broker.log()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_file_on_sighup_keeps_the_running_configuration(
        tmp_path: Path, raw_factory, workers: int) -> None:
    broker = start_broker(tmp_path, "[limits]\nmax_subscriptions = 1\n", workers=workers)
    try:
        config = config_file(broker)
        config.write_text('[limits]\nmax_subscriptions = "lots"\n')
        hup_and_wait(broker, "configuration not reloaded, keeping the running one:"
                             " limits.max_subscriptions: must be an integer of at least 0,"
                             " got 'lots'", workers)
        missing = tmp_path / "no-such-passwords"
        config.write_text(f'[limits]\nmax_subscriptions = 5\n[auth]\npassword_file = "{missing}"\n')
        hup_and_wait(broker, f"configuration not reloaded, keeping the running one:"
                             f" {missing}", workers)
        assert "configuration changed" not in broker.log()
        for attempt in range(2 * workers):
            client = raw_factory(broker.port)
            assert client.connect(f"c-{attempt}").reason_code == 0  # still anonymous
            assert client.subscribe(two_filters(1)).reason_codes == [1, QUOTA_EXCEEDED]
        config.write_text("[limits]\nmax_subscriptions = 2\n")  # a good file applies again
        hup_and_wait(broker, "configuration changed key=limits.max_subscriptions old=1 new=2",
                     workers)
        client = raw_factory(broker.port)
        assert client.connect("after").reason_code == 0
        assert client.subscribe(two_filters(1)).reason_codes == [1, 1]
    finally:
        broker.stop()


def test_the_reloader_applies_reloadable_keys_and_lets_flags_win(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """In-process: the plan for a file that changes the log level, a limit and the port."""
    path = tmp_path / "meshmq.toml"
    path.write_text('[server]\nlog_level = "info"\nport = 1883\n')
    flags = {"server.log_connections": "true"}
    source = ConfigSource(str(path), flags)
    running = source.load()
    reloader = ConfigReloader(source, running)
    path.write_text('[server]\nlog_level = "warning"\nport = 1999\nlog_connections = false\n'
                    "[limits]\nconnect_rate = 5\n")
    with caplog.at_level(logging.INFO, logger="meshmq.reload"):
        planned = reloader.plan(running)
    assert planned is not None
    assert planned.server.log_level == "warning" and planned.limits.connect_rate == 5
    assert planned.server.port == 1883  # needs a restart: the running value stays
    assert planned.server.log_connections is True  # the flag still wins over the file
    assert lines(caplog) == [
        ("configuration changed", {"key": "server.log_level", "old": "info", "new": "warning"}),
        ("configuration changed", {"key": "limits.connect_rate", "old": 1000, "new": 5}),
        ("configuration changes that need a restart", {"keys": "server.port"}),
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="meshmq.reload"):
        again = reloader.plan(planned)  # the port is reported until the restart
    assert again == planned
    assert lines(caplog) == [
        ("configuration changes that need a restart", {"keys": "server.port"})]
    assert load_config(path).server.port == 1999


def test_a_worker_restarted_after_a_reload_runs_with_the_reloaded_configuration(
        tmp_path: Path, raw_factory) -> None:
    broker = start_broker(tmp_path, "[limits]\nmax_subscriptions = 1000\n", workers=2)
    try:
        config_file(broker).write_text("[limits]\nmax_subscriptions = 1\n")
        hup_and_wait(broker, "configuration changed key=limits.max_subscriptions", 2)
        started = wait_for(lambda: re.search(r"workers started count=2 pids=(\d+),(\d+)",
                                             broker.log()), what="the started line")
        os.kill(int(started.group(2)), signal.SIGKILL)
        wait_for(lambda: "worker restarted index=1" in broker.log(), what="the restart")
        for attempt in range(100):  # until the new worker 1 serves a client
            client = raw_factory(broker.port)
            connack = client.connect(f"after-{attempt}")
            if worker_of(connack) == "1":
                break
            client.close()
        assert worker_of(connack) == "1"
        assert client.subscribe(two_filters(1)).reason_codes == [1, QUOTA_EXCEEDED]
    finally:
        broker.stop()
