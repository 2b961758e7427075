"""Helpers for the security tests: broker memory, a counted honest stream, stalled sockets.

``HonestStream`` is the witness that a hostile client hurts nobody else: a paho publisher and a
paho subscriber (MQTT 5, QoS 1) exchange numbered messages through the broker for as long as a
test's hostile action lasts. ``check()`` then asserts that every message sent arrived exactly
once and in order, that each PUBACK came back in reasonable time, and that the broker's
resident memory (VmRSS from /proc) grew by less than the bound the test states.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from conftest import wait_for
from meshmq.mqtt.codec import decode_frames, encode_packet
from meshmq.mqtt.packets import Connack, Connect, Suback, Subscribe, SubscriptionOptions
from meshmq.mqtt.properties import Properties

WAIT = 10.0
PACE = 0.005  # seconds between honest publishes: a steady trickle, not a load test
MAX_ACK_SECONDS = 5.0  # an honest PUBACK slower than this means the broker was starved
MIB = 1024


def rss_kib(pid: int) -> int:
    """Resident memory of process ``pid`` in KiB (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for process {pid}")


class HonestStream:
    """A well-behaved publisher/subscriber pair exchanging a numbered QoS 1 stream.

    Use as a context manager around the hostile action; call ``wait_progress()`` to prove the
    broker keeps serving, then ``check(rss_bound_mib)`` after the block.
    """

    def __init__(self, client_factory: Callable, port: int, pid: int, tag: str,
                 pace: float = PACE) -> None:
        """``pace``: seconds between publishes, so at most 1/pace a second, however fast the
        machine acknowledges (under a per-client rate limit, keep it below the limit)."""
        self.topic = f"honest/stream/{tag}"
        self.pace = pace
        self.pid = pid
        self.sub = client_factory(f"honest-sub-{tag}", 5)
        self.sub.connect(port)
        self.sub.subscribe(self.topic, qos=1)
        self.pub = client_factory(f"honest-pub-{tag}", 5)
        self.pub.connect(port)
        self.rss_base = rss_kib(pid)
        self.rss_peak = self.rss_base
        self.sent = 0
        self.failures: list[str] = []
        self.slowest_ack = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"honest-{tag}", daemon=True)

    def __enter__(self) -> HonestStream:
        self._thread.start()
        self.wait_progress()  # the stream runs before the hostile action starts
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=WAIT + 5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            info = self.pub.paho.publish(self.topic, str(self.sent).encode(), qos=1)
            info.wait_for_publish(timeout=WAIT)
            if not info.is_published():
                self.failures.append(f"message {self.sent} not acknowledged within {WAIT} s")
                return
            self.slowest_ack = max(self.slowest_ack, time.monotonic() - started)
            self.sent += 1
            self.sample_rss()
            self._stop.wait(self.pace)

    def sample_rss(self) -> int:
        rss = rss_kib(self.pid)
        self.rss_peak = max(self.rss_peak, rss)
        return rss

    @property
    def rss_growth_mib(self) -> float:
        return (self.rss_peak - self.rss_base) / MIB

    def wait_progress(self, count: int = 10) -> None:
        """Block until ``count`` more honest messages were acknowledged."""
        target = self.sent + count
        wait_for(lambda: self.sent >= target or self.failures or not self._thread.is_alive(),
                 what=f"{count} more honest messages after {self.sent}")
        assert not self.failures and self.sent >= target, f"honest stream stopped: {self.failures}"

    def check(self, rss_bound_mib: float) -> None:
        """Everything sent arrived once, in order, promptly; broker memory stayed bounded."""
        assert not self.failures, self.failures
        received: list[str] = []
        deadline = time.monotonic() + WAIT
        while len(received) < self.sent:
            try:
                msg = self.sub.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            received.append(msg.payload.decode(errors="replace"))
        assert received == [str(i) for i in range(self.sent)], (
            f"honest stream lost or reordered messages: sent {self.sent}, "
            f"got {len(received)}: {received[:5]}...")
        assert self.sub.disconnects.empty() and self.pub.disconnects.empty()
        assert self.slowest_ack < MAX_ACK_SECONDS, f"an honest PUBACK took {self.slowest_ack:.2f} s"
        self.sample_rss()
        print(f"{self.topic}: {self.sent} honest messages, slowest PUBACK "
              f"{self.slowest_ack * 1000:.0f} ms, broker RSS +{self.rss_growth_mib:.1f} MiB")
        assert self.rss_growth_mib < rss_bound_mib, (
            f"broker RSS grew {self.rss_growth_mib:.1f} MiB (bound {rss_bound_mib} MiB)")


def stalled_subscriber(port: int, client_id: str, topic_filter: str, qos: int = 1,
                       properties: Properties | None = None) -> socket.socket:
    """A connected MQTT 5 subscriber that will never read again (tiny receive buffer)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    sock.settimeout(WAIT)
    sock.connect(("127.0.0.1", port))
    sock.sendall(encode_packet(Connect(client_id, 5, properties=dict(properties or {})), 5))
    sock.sendall(encode_packet(Subscribe(1, [(topic_filter, SubscriptionOptions(qos))]), 5))
    data = b""
    deadline = time.monotonic() + WAIT
    while True:
        data += sock.recv(65536)
        try:
            packets = decode_frames(data, 5)
        except Exception:  # an incomplete frame: read more
            packets = []
        if len(packets) >= 2:
            break
        assert time.monotonic() < deadline, "no CONNACK/SUBACK for the stalled subscriber"
    assert isinstance(packets[0], Connack) and packets[0].reason_code == 0
    assert isinstance(packets[1], Suback) and packets[1].reason_codes == [qos]
    return sock
