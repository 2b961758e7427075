"""Interoperability with the Eclipse Mosquitto command-line clients (3.1.1 and 5.0)."""

from __future__ import annotations

import os
import pty
import select
import shutil
import subprocess
import time

import pytest

pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(
        shutil.which("mosquitto_pub") is None or shutil.which("mosquitto_sub") is None,
        reason="mosquitto clients not installed",
    ),
]

VERSIONS = ["mqttv311", "mqttv5"]
TIMEOUT = 10


class Output:
    """stdout of a child process read through a pty (so it is line-buffered), by line."""

    def __init__(self, cmd: list[str]) -> None:
        master, slave = pty.openpty()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=slave,
                                     stderr=subprocess.STDOUT)
        os.close(slave)
        self._fd = master
        self._pending = b""
        self.lines: list[str] = []

    def _read(self, timeout: float) -> str:
        """Read what is available within ``timeout``: "data", "timeout" or "eof"."""
        ready, _, _ = select.select([self._fd], [], [], max(timeout, 0))
        if not ready:
            return "timeout"
        try:
            chunk = os.read(self._fd, 4096)
        except OSError:  # EIO: the child closed its side
            chunk = b""
        if not chunk:
            if self._pending:
                self.lines.append(self._pending.decode(errors="replace").rstrip("\r"))
                self._pending = b""
            return "eof"
        self._pending += chunk
        *complete, self._pending = self._pending.split(b"\n")
        self.lines += [line.decode(errors="replace").rstrip("\r") for line in complete]
        return "data"

    def wait_line(self, predicate, timeout: float = TIMEOUT) -> str:
        """Wait until the process prints a line matching ``predicate``; return it."""
        deadline = time.monotonic() + timeout
        checked = 0
        while True:
            for line in self.lines[checked:]:
                if predicate(line):
                    return line
            checked = len(self.lines)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"no matching line within {timeout} s; output: {self.lines}")
            ended = self._read(min(remaining, 0.2)) == "eof"
            if ended and not any(predicate(line) for line in self.lines[checked:]):
                pytest.fail(f"process ended without a matching line; output: {self.lines}")

    def finish(self, timeout: float = TIMEOUT) -> int:
        """Wait for the process to exit; read the rest of its output; return its status."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(f"{self.proc.args[0]} did not exit; output: {self.lines}")
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline and self._read(0.2) == "data":
            pass
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self._fd)


@pytest.fixture
def spawn():
    started: list[Output] = []

    def factory(cmd: list[str]) -> Output:
        out = Output(cmd)
        started.append(out)
        return out

    yield factory
    for out in started:
        out.close()


def mosquitto_pub(port: int, version: str, topic: str, message: str, *extra: str) -> None:
    result = subprocess.run(
        ["mosquitto_pub", "-h", "127.0.0.1", "-p", str(port), "-V", version, "-t", topic,
         "-m", message, *extra],
        capture_output=True, timeout=TIMEOUT, check=False,
    )
    assert result.returncode == 0, result.stderr.decode(errors="replace")


def sub_cmd(port: int, version: str, topic: str, *extra: str) -> list[str]:
    return ["mosquitto_sub", "-h", "127.0.0.1", "-p", str(port), "-V", version, "-t", topic,
            "-F", "MSG %t %p", *extra]


def messages(out: Output) -> list[str]:
    return [line for line in out.lines if line.startswith("MSG ")]


@pytest.mark.parametrize("version", VERSIONS)
def test_mosquitto_sub_receives_mosquitto_pub_qos1(broker, spawn, version):
    """mosquitto_sub -C 2 gets both QoS 1 messages of mosquitto_pub, in order."""
    sub = spawn(sub_cmd(broker.port, version, "interop/t", "-q", "1", "-C", "2", "-d",
                        "-i", f"msub-{version}"))
    sub.wait_line(lambda line: line.startswith("Subscribed"))
    mosquitto_pub(broker.port, version, "interop/t", "one", "-q", "1")
    mosquitto_pub(broker.port, version, "interop/t", "two", "-q", "1")
    assert sub.finish() == 0
    assert messages(sub) == ["MSG interop/t one", "MSG interop/t two"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mosquitto_persistent_session_gets_queued_messages(broker, spawn, version):
    """A persistent mosquitto_sub session (-c) receives QoS 1 messages sent while offline."""
    persist = ["-c", "-i", f"mpersist-{version}", "-q", "1"]
    if version == "mqttv5":
        persist += ["-x", "300"]
    first = spawn(sub_cmd(broker.port, version, "interop/p", *persist, "-E"))
    assert first.finish() == 0
    mosquitto_pub(broker.port, version, "interop/p", "queued-1", "-q", "1")
    mosquitto_pub(broker.port, version, "interop/p", "queued-2", "-q", "1")
    second = spawn(sub_cmd(broker.port, version, "interop/p", *persist, "-C", "2"))
    assert second.finish() == 0
    assert messages(second) == ["MSG interop/p queued-1", "MSG interop/p queued-2"]


@pytest.mark.parametrize("version", VERSIONS)
def test_mosquitto_retained_message(broker, spawn, version):
    """mosquitto_pub -r stores a retained message that a later mosquitto_sub receives."""
    mosquitto_pub(broker.port, version, "interop/r", "kept", "-q", "1", "-r")
    sub = spawn(sub_cmd(broker.port, version, "interop/#", "-C", "1", "-F", "MSG %t %p %r"))
    assert sub.finish() == 0
    # -F given twice: the last one wins, so the retain flag is printed.
    assert messages(sub) == ["MSG interop/r kept 1"]


def test_mosquitto_v5_properties_reach_paho(broker, client_factory):
    """User property and content type set by mosquitto_pub (5.0) arrive at a paho client."""
    sub = client_factory("paho-sub", 5)
    sub.connect(broker.port)
    sub.subscribe("interop/props", qos=1)
    mosquitto_pub(broker.port, "mqttv5", "interop/props", "{}", "-q", "1",
                  "-D", "publish", "user-property", "origin", "mosquitto",
                  "-D", "publish", "content-type", "application/json")
    msg = sub.expect()
    assert msg.payload == b"{}"
    assert msg.properties.UserProperty == [("origin", "mosquitto")]  # exactly, nothing added
    assert msg.properties.ContentType == "application/json"


@pytest.mark.parametrize("ask", [False, True], ids=["plain", "asking"])
def test_mosquitto_sub_gets_log_positions_only_when_it_asks(broker, spawn, ask):
    """mosquitto_sub prints the publisher's user properties as they were sent; with
    ``-D connect user-property meshmq-positions true`` the log position follows them."""
    extra = ["-D", "connect", "user-property", "meshmq-positions", "true"] if ask else []
    sub = spawn(sub_cmd(broker.port, "mqttv5", "interop/pos", "-q", "1", "-C", "1", "-d",
                        *extra, "-F", "MSG %t %p %P"))
    sub.wait_line(lambda line: line.startswith("Subscribed"))
    mosquitto_pub(broker.port, "mqttv5", "interop/pos", "m", "-q", "1",
                  "-D", "publish", "user-property", "origin", "mosquitto")
    assert sub.finish() == 0
    (line,) = messages(sub)
    topic, payload, *pairs = line.split()[1:]
    assert (topic, payload) == ("interop/pos", "m")
    if not ask:
        assert pairs == ["origin:mosquitto"]
    else:
        assert pairs[0] == "origin:mosquitto" and len(pairs) == 3
        assert pairs[1].startswith("meshmq-partition:") and pairs[2].startswith("meshmq-offset:")


@pytest.mark.parametrize("version", VERSIONS)
def test_paho_publish_reaches_mosquitto_sub(broker, client_factory, spawn, version):
    """A paho QoS 2 publish is delivered to mosquitto_sub subscribed at QoS 2."""
    sub = spawn(sub_cmd(broker.port, version, "interop/q2", "-q", "2", "-C", "1", "-d"))
    sub.wait_line(lambda line: line.startswith("Subscribed"))
    pub = client_factory("paho-pub", 5 if version == "mqttv5" else 4)
    pub.connect(broker.port)
    pub.publish("interop/q2", "exactly once", qos=2)
    assert sub.finish() == 0
    assert messages(sub) == ["MSG interop/q2 exactly once"]
