"""The demo's simulated fleet and the subscriber that counts its alerts.

Each device takes ``readings`` readings ``interval`` seconds apart (event times ending now):
temperature on a slow wave around its own level, humidity on a wave with its own phase, and
a battery that drains at its own pace, so no two devices draw the same line. Device 0 runs
hot (its temperature crosses the demo's ``too-hot`` threshold), device 1's battery runs down
(``battery-low`` fires near the end) and the last device also sends ``BAD_PAYLOADS``.

``FleetPublisher`` sends every device's readings at QoS 1 from its own MQTT connection, all
devices at once, spread evenly over ``publish_over`` seconds of wall-clock time, so the
broker sees a steady flow rather than one burst (the demo starts Spark meanwhile).
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from meshmq.pipeline.jobs.common import JobError

BAD_PAYLOADS = (b"temp=21.5", b'{"status": "ok"}', b"[21.5, 40]")
TIMEOUT = 30.0
HOT_DEVICE = 0
DRAINING_DEVICE = 1


def device_name(device: int) -> str:
    return f"sensor-{device:02d}"


def device_topic(device: int) -> str:
    return f"devices/{device_name(device)}/telemetry"


def reading(device: int, step: int, readings: int, rng: random.Random) -> dict[str, float]:
    """One device's reading at ``step`` of ``readings``: waves, drains and a little noise."""
    phase = step / 12 + device
    temp = 21 + device * 0.8 + 4 * math.sin(phase) + rng.uniform(-0.5, 0.5)
    if device == HOT_DEVICE:
        temp += 8
    if device == DRAINING_DEVICE:
        battery = 100 - step * 90 / max(readings - 1, 1)  # reaches 10 % at the last reading
    else:
        battery = 100 - 2 * device - step * (0.1 + 0.04 * device)
    return {"temp": round(temp, 2), "humidity": round(50 + 10 * math.cos(phase), 1),
            "battery": round(max(battery, 0.0), 1)}


def fleet_payloads(devices: int, readings: int, interval: int,
                   now: float) -> dict[str, list[bytes]]:
    """Every device's payloads (topic -> JSON readings with ``ts``, then any broken ones)."""
    rng = random.Random(int(now))
    start = now - readings * interval
    fleet: dict[str, list[bytes]] = {}
    for device in range(devices):
        payloads = []
        for step in range(readings):
            values: dict[str, float] = reading(device, step, readings, rng)
            values["ts"] = round(start + step * interval + rng.uniform(0, 2), 3)
            payloads.append(json.dumps(values).encode())
        if device == devices - 1:
            payloads += BAD_PAYLOADS
        fleet[device_topic(device)] = payloads
    return fleet


def publish_paced(host: str, port: int, client_id: str, topic: str, payloads: list[bytes],
                  over: float, stop: threading.Event) -> int:
    """Publish at QoS 1, spread over ``over`` seconds; return once every PUBACK is in."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id,
                         protocol=mqtt.MQTTv5)
    client.connect(host, port)
    client.loop_start()
    try:
        gap = over / max(len(payloads), 1)
        began = time.monotonic()
        infos = []
        for index, payload in enumerate(payloads):
            if stop.wait(max(0.0, began + index * gap - time.monotonic())):
                raise JobError("demo: interrupted while the devices were publishing")
            infos.append(client.publish(topic, payload, qos=1))
        for info in infos:
            info.wait_for_publish(TIMEOUT)
            if not info.is_published():
                raise JobError(f"demo: the broker at {host}:{port} did not acknowledge")
    finally:
        client.disconnect()
        client.loop_stop()
    return len(payloads)


class FleetPublisher:
    """Every device publishing from its own thread; ``wait()`` for all of them to finish."""

    def __init__(self, host: str, port: int, fleet: dict[str, list[bytes]],
                 over: float) -> None:
        self.stop = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=max(len(fleet), 1),
                                        thread_name_prefix="demo-device")
        self._futures: list[Future[int]] = [
            self._pool.submit(publish_paced, host, port, f"demo-{topic.split('/')[1]}", topic,
                              payloads, over, self.stop)
            for topic, payloads in fleet.items()]

    def wait(self) -> int:
        """How many messages were published; raises the first device's error, if any."""
        try:
            return sum(future.result() for future in self._futures)
        finally:
            self.close()

    def close(self) -> None:
        self.stop.set()
        self._pool.shutdown(wait=True)


class AlertCounter:
    """Subscribes to ``alerts/#`` and counts what arrives."""

    def __init__(self, host: str, port: int) -> None:
        self.count = 0
        self._ready = threading.Event()
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="",
                                   protocol=mqtt.MQTTv5)
        self._client.on_subscribe = lambda *_args: self._ready.set()
        self._client.on_message = self._on_message
        self._client.connect(host, port)
        self._client.subscribe("alerts/#", qos=1)
        self._client.loop_start()
        if not self._ready.wait(TIMEOUT):
            raise JobError("demo: no SUBACK for alerts/#")

    def _on_message(self, *_args: Any) -> None:
        self.count += 1

    def wait_for(self, count: int) -> int:
        """Wait (up to ``TIMEOUT``) until ``count`` alerts have arrived; return how many did."""
        deadline = time.monotonic() + TIMEOUT
        while self.count < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.count

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()
