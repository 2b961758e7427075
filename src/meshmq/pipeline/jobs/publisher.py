"""Publishing alerts to the broker with paho-mqtt: QoS 1, and an answer for every message.

Entering ``AlertPublisher`` (a context manager) returns once the broker accepted the
connection, or raises ``DeliveryError``. ``publish_all`` sends every message, waits for the
PUBACKs and sorts the messages into acknowledged; refused (PUBACK reason code >= 0x80, or never
written because the connection was already gone: either way the broker does not have it); and
unknown (no answer before the timeout or the connection dropped: the broker may have it).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties


class DeliveryError(Exception):
    """The broker could not be reached or did not take every alert (one line)."""


@dataclass(frozen=True)
class MqttTarget:
    host: str = "127.0.0.1"
    port: int = 1883
    client_id: str = "meshmq-alerts"
    username: str | None = None
    password: str | None = None
    timeout: float = 10.0


@dataclass(frozen=True)
class Outgoing:
    topic: str
    payload: bytes
    user_properties: tuple[tuple[str, str], ...] = ()


@dataclass
class Outcome:
    acknowledged: list[int] = field(default_factory=list)
    refused: dict[int, str] = field(default_factory=dict)
    unknown: list[int] = field(default_factory=list)


class AlertPublisher:
    """One MQTT 5 connection used for one batch of alerts; a context manager."""

    def __init__(self, target: MqttTarget) -> None:
        self.target = target
        self._client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=target.client_id,
                                   protocol=mqtt.MQTTv5, reconnect_on_failure=False)
        if target.username is not None:
            self._client.username_pw_set(target.username, target.password)
        self._changed = threading.Condition()
        self._connack: Any = None
        self._disconnected = False
        self._acks: dict[int, Any] = {}
        self._client.on_connect = self._on_connect
        self._client.on_disconnect = self._on_disconnect
        self._client.on_publish = self._on_publish

    def _on_connect(self, _c: Any, _u: Any, _flags: Any, reason: Any, _props: Any) -> None:
        with self._changed:
            self._connack = reason
            self._changed.notify_all()

    def _on_disconnect(self, _c: Any, _u: Any, _flags: Any, _reason: Any, _props: Any) -> None:
        with self._changed:
            self._disconnected = True
            self._changed.notify_all()

    def _on_publish(self, _c: Any, _u: Any, mid: int, reason: Any, _props: Any) -> None:
        with self._changed:
            self._acks[mid] = reason
            self._changed.notify_all()

    def __enter__(self) -> AlertPublisher:
        where = f"{self.target.host}:{self.target.port}"
        try:
            self._client.connect(self.target.host, self.target.port, keepalive=60)
        except OSError as exc:
            raise DeliveryError(f"cannot reach the broker at {where}: {exc}") from None
        self._client.loop_start()
        with self._changed:
            self._changed.wait_for(lambda: self._connack is not None or self._disconnected,
                                   self.target.timeout)
        if self._connack is None:
            self.__exit__()
            raise DeliveryError(f"no CONNACK from the broker at {where}")
        if self._connack.is_failure:
            self.__exit__()
            raise DeliveryError(f"the broker at {where} refused the connection: {self._connack}")
        return self

    def __exit__(self, *_exc: object) -> None:
        self._client.disconnect()
        self._client.loop_stop()

    def publish_all(self, messages: list[Outgoing]) -> Outcome:
        """Send every message at QoS 1 and wait (up to the timeout) for every PUBACK."""
        mids: list[int] = []
        unsent: set[int] = set()
        for index, message in enumerate(messages):
            properties = Properties(PacketTypes.PUBLISH)
            if message.user_properties:
                properties.UserProperty = list(message.user_properties)
            info = self._client.publish(message.topic, message.payload, qos=1,
                                        properties=properties)
            mids.append(info.mid)
            if info.rc != mqtt.MQTT_ERR_SUCCESS:  # never written: no connection any more
                unsent.add(index)
        with self._changed:
            self._changed.wait_for(
                lambda: self._disconnected or all(
                    mid in self._acks for i, mid in enumerate(mids) if i not in unsent),
                self.target.timeout)
            acks = dict(self._acks)
        outcome = Outcome()
        for index, mid in enumerate(mids):
            reason = acks.get(mid)
            if index in unsent:
                outcome.refused[index] = "not sent: the connection was lost"
            elif reason is None:
                outcome.unknown.append(index)
            elif reason.is_failure:
                outcome.refused[index] = str(reason)
            else:
                outcome.acknowledged.append(index)
        return outcome
