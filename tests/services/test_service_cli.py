"""``meshmq call``, ``meshmq worker`` and ``meshmq sub``'s history options, as a shell runs them.

No fixed waits: a call made before the worker offered its service waits for it (the broker's
``max_wait``), and the worker exits by itself after ``--count`` requests.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from conftest import BrokerProcess, Client

WAITING = """
[log]
fsync = "interval"
[services]
max_wait = 20.0
[services.service.absent]
no_responders = "fail"
"""


def meshmq(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "meshmq", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)


def run(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshmq", *args], capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_worker_runs_a_command_per_request_and_call_prints_the_reply(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(WAITING, workers=2)
    port = str(broker.port)
    worker = meshmq("worker", "-p", port, "upper", "--count", "2", "--exec", "tr a-z A-Z")
    try:
        first = run("call", "-p", port, "upper", "-m", "hello world", "-v")
        second = run("call", "-b", f"127.0.0.1:1,127.0.0.1:{port}", "upper", "-m", "again")
        _, errors = worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert first.returncode == 0, first.stderr
    request_id, payload = first.stdout.rstrip("\n").split(" ", 1)
    assert payload == "HELLO WORLD" and request_id.count("-") == 1
    assert (second.returncode, second.stdout) == (0, "AGAIN\n")
    assert worker.returncode == 0, errors


def test_a_failed_call_is_one_line_and_status_1(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(WAITING)
    result = run("call", "-p", str(broker.port), "absent", "-m", "x")
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == "meshmq call: no-responders\n"
    usage = run("call", "-p", str(broker.port), "absent")  # no payload option
    assert usage.returncode == 2 and "one of the arguments -m/--message" in usage.stderr


def test_a_failing_command_reaches_the_caller_as_a_worker_error(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    broker = broker_factory(WAITING)
    port = str(broker.port)
    worker = meshmq("worker", "-p", port, "broken", "--count", "1", "--exec", "false")
    try:
        result = run("call", "-p", port, "broken", "-m", "x")
        worker.communicate(timeout=30)
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
    assert result.returncode == 1
    assert result.stderr == "meshmq call: worker-error: false exited with status 1\n"


def test_sub_replays_history_with_log_positions(
        broker_factory: Callable[..., BrokerProcess],
        client_factory: Callable[..., Client]) -> None:
    broker = broker_factory(WAITING)
    publisher = client_factory("history")
    publisher.connect(broker.port)
    before = int(time.time() * 1000)
    for n in range(3):
        publisher.publish("history/a", f"m{n}", qos=1)
    port = str(broker.port)
    result = run("sub", "-p", port, "-t", "history/#", "-q", "1", "-C", "3", "--from",
                 "earliest", "--positions", "-v")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    positions = [line.split(" ", 1)[0] for line in lines]
    assert [line.split(" ", 1)[1] for line in lines] == [
        "history/a m0", "history/a m1", "history/a m2"]
    partition = positions[0].split(":")[0]
    offsets = [int(position.split(":")[1]) for position in positions]
    assert offsets == [offsets[0], offsets[0] + 1, offsets[0] + 2]
    resumed = run("sub", "-p", port, "-t", "history/#", "-q", "1", "-C", "1", "--from",
                  f"{partition}={offsets[2]}")
    assert resumed.stdout == "m2\n"
    by_time = run("sub", "-p", port, "-t", "history/#", "-q", "1", "-C", "3", "--from",
                  str(before))
    assert by_time.stdout == "m0\nm1\nm2\n"
    bad = run("sub", "-p", port, "-t", "x", "--from", "yesterday")
    assert bad.returncode == 2 and "--from" in bad.stderr
    old = run("sub", "-p", port, "-t", "x", "-V", "311", "--positions")
    assert old.returncode == 2 and "--positions needs -V 5" in old.stderr


def test_a_connection_ended_right_after_its_connack_is_no_start_failure(
        broker_factory: Callable[..., BrokerProcess]) -> None:
    """``meshmq sub -C N --from earliest`` may get its N replayed messages, and disconnect, in
    the network thread before the command's thread sees the CONNACK: that is a success (the
    suite once failed here with 'closed before CONNACK'). Forced: the CONNACK handler
    disconnects, and the command's thread wakes only once the connection is closed."""
    import threading

    from meshmq.cli import build_parser
    from meshmq.clientlink import ClientLink

    broker = broker_factory()
    args = build_parser().parse_args(["sub", "-p", str(broker.port), "-t", "x"])
    link = ClientLink(args)
    accept = link.client.on_connect

    def accept_then_end(*callback: object) -> None:
        accept(*callback)
        link.client.disconnect()  # what sub does once it has its -C messages

    class WokenLate(threading.Event):
        def wait(self, timeout: float | None = None) -> bool:
            link.closed.wait(timeout)
            return super().wait(timeout)

    link.client.on_connect = accept_then_end
    link.connack = WokenLate()
    link.connect()
    try:
        link.start()  # before the fix: ClientError("... closed before CONNACK")
    finally:
        link.client.loop_stop()
    assert link.closed.is_set() and link.refusal is None
