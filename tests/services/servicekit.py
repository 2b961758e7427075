"""Helpers for the services' process tests: clients on a chosen worker, plain paho service
workers and callers (no meshmq code on the client side), and which worker dispatches a service.
"""

from __future__ import annotations

import queue
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes

from conftest import WAIT, Client, props

PARTITIONS = 8  # log.partitions by default


def dispatcher_of(service: str, workers: int) -> int:
    """The worker that dispatches ``service``: the leader of ``$service/NAME``'s partition."""
    return zlib.crc32(f"$service/{service}".encode()) % PARTITIONS % workers


def service_on(worker: int, workers: int, prefix: str) -> str:
    """A service name ``prefix-N`` that worker ``worker`` dispatches."""
    return next(f"{prefix}-{n}" for n in range(100)
                if dispatcher_of(f"{prefix}-{n}", workers) == worker)


def users(message: mqtt.MQTTMessage) -> dict[str, str]:
    return dict(getattr(message.properties, "UserProperty", []) or [])


@dataclass
class Served:
    """A request as a service worker saw it."""

    request_id: str
    retry: int
    dup: bool
    sender: str
    payload: bytes
    correlation: bytes | None
    user: dict[str, str]


@dataclass
class PahoWorker:
    """A plain paho MQTT 5 service worker: records every request, replies (unless ``hang``)
    with ``reply(payload)`` on the Response Topic with the Correlation Data."""

    client: Client
    service: str
    hang: bool = False
    reply: Callable[[bytes], bytes] = lambda payload: b"done:" + payload
    served: list[Served] = field(default_factory=list)
    arrived: queue.Queue[Served] = field(default_factory=queue.Queue)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.client.paho.on_message = self._on_message

    def offer(self, credit: int | None = None, qos: int = 1) -> list[object]:
        properties = None if credit is None else props(
            PacketTypes.SUBSCRIBE, UserProperty=[("credit", str(credit))])
        return self.client.subscribe(f"$service/{self.service}", qos=qos,
                                     properties=properties)

    def _on_message(self, client: mqtt.Client, userdata: object,
                    message: mqtt.MQTTMessage) -> None:
        pairs = users(message)
        served = Served(pairs["meshmq-request-id"], int(pairs["meshmq-retry"]),
                        pairs["meshmq-dup"] == "true", pairs["meshmq-sender"], message.payload,
                        getattr(message.properties, "CorrelationData", None), pairs)
        with self.lock:
            self.served.append(served)
        self.arrived.put(served)
        if self.hang:
            return
        answer = props(PacketTypes.PUBLISH)
        if served.correlation is not None:
            answer.CorrelationData = served.correlation
        client.publish(message.properties.ResponseTopic, self.reply(message.payload), qos=1,
                       properties=answer)


@dataclass
class Reply:
    correlation: bytes | None
    request_id: str | None
    payload: bytes
    error: str | None
    topic: str


class Caller:
    """A plain paho MQTT 5 caller: its replies (on ``reply/<client id>``) by correlation."""

    def __init__(self, client: Client, reply_topic: str) -> None:
        self.client = client
        self.reply_topic = reply_topic
        self.replies: queue.Queue[Reply] = queue.Queue()
        client.paho.on_message = self._on_message
        client.subscribe(reply_topic, qos=1)

    def _on_message(self, client: mqtt.Client, userdata: object,
                    message: mqtt.MQTTMessage) -> None:
        pairs = users(message)
        self.replies.put(Reply(getattr(message.properties, "CorrelationData", None),
                               pairs.get("meshmq-request-id"), message.payload,
                               pairs.get("meshmq-error"), message.topic))

    def call(self, service: str, payload: bytes, correlation: bytes,
             wait: bool = True, user: list[tuple[str, str]] | None = None
             ) -> mqtt.MQTTMessageInfo:
        properties = props(PacketTypes.PUBLISH, ResponseTopic=self.reply_topic,
                           CorrelationData=correlation)
        if user:
            properties.UserProperty = user
        return self.client.publish(f"$service/{service}", payload, qos=1,
                                   properties=properties, wait=wait)

    def expect(self, timeout: float = WAIT) -> Reply:
        return self.replies.get(timeout=timeout)

    def collect(self, count: int, timeout: float = WAIT) -> list[Reply]:
        return [self.expect(timeout) for _ in range(count)]


def acked_code(who: Caller | Client, info: mqtt.MQTTMessageInfo) -> int:
    """The PUBACK reason code of ``info``'s publish (waited for)."""
    client = who.client if isinstance(who, Caller) else who
    while True:
        mid, code = client.acked.get(timeout=WAIT)
        if mid == info.mid:
            return int(code.value)
