"""Broker configuration: TOML file plus command-line overrides, validated key by key.

Every key, its type, its allowed values and its description live in one table (``_KEYS``); the
dataclasses hold the defaults. A bad value is a ``ConfigError`` whose message is one line that
names the key, so ``meshmq serve`` can print it and exit with status 2.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, replace
from typing import Any


class ConfigError(Exception):
    """A configuration file or value is invalid; the message names the key."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    bind: str = "0.0.0.0"
    port: int = 1883
    data_dir: str = "./data"
    log_level: str = "info"
    log_format: str = "text"
    port_file: str = ""


@dataclass(frozen=True, slots=True)
class MQTTConfig:
    max_packet_size: int = 1_048_576
    receive_maximum: int = 1024
    max_keepalive: int = 65535
    max_qos: int = 2
    retain_available: bool = True
    wildcard_subscriptions: bool = True
    shared_subscriptions: bool = True
    subscription_identifiers: bool = True
    topic_alias_maximum: int = 65535
    broker_topic_aliases: int = 0
    max_topic_levels: int = 128
    connect_timeout: float = 10.0


@dataclass(frozen=True, slots=True)
class SessionConfig:
    max_session_expiry: int = 4_294_967_295
    max_inflight_messages: int = 65535
    max_queued_messages: int = 10_000
    max_queued_bytes: int = 67_108_864
    queue_qos0: bool = False
    queue_drop_policy: str = "drop_oldest"


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    mqtt: MQTTConfig = field(default_factory=MQTTConfig)
    session: SessionConfig = field(default_factory=SessionConfig)


# dotted key -> (type, (min, max) or choices or None, description)
_KEYS: dict[str, tuple[type, Any, str]] = {
    "server.bind": (str, None, "address to listen on for MQTT over TCP"),
    "server.port": (int, (0, 65535), "MQTT TCP port (0 picks a free port)"),
    "server.data_dir": (str, None, "directory for the broker's data"),
    "server.log_level": (str, ("debug", "info", "warning", "error"), "log verbosity"),
    "server.log_format": (str, ("text", "json"), "log line format"),
    "server.port_file": (str, None, "if set, write the bound port to this file once listening"),
    "mqtt.max_packet_size": (int, (16, 268_435_460),
                             "largest packet accepted, in bytes (advertised in CONNACK)"),
    "mqtt.receive_maximum": (int, (1, 65535),
                             "unacknowledged QoS 1/2 publishes a client may send us at once"),
    "mqtt.max_keepalive": (int, (1, 65535),
                           "largest keep alive granted, seconds; larger or 0 is reduced to it"),
    "mqtt.max_qos": (int, (0, 2), "highest QoS the broker accepts and grants"),
    "mqtt.retain_available": (bool, None, "accept retained messages"),
    "mqtt.wildcard_subscriptions": (bool, None, "allow '+' and '#' in subscriptions"),
    "mqtt.shared_subscriptions": (bool, None, "allow $share/{group}/{filter} subscriptions"),
    "mqtt.subscription_identifiers": (bool, None, "support MQTT 5 subscription identifiers"),
    "mqtt.topic_alias_maximum": (int, (0, 65535), "topic aliases a client may use towards us"),
    "mqtt.broker_topic_aliases": (int, (0, 65535),
                                  "topic aliases the broker assigns, 0 = off"),
    "mqtt.max_topic_levels": (int, (1, 65535), "most levels in a topic name or filter"),
    "mqtt.connect_timeout": (float, (0.001, 3600.0), "seconds to wait for CONNECT after accept"),
    "session.max_session_expiry": (int, (0, 4_294_967_295),
                                   "cap on a session's expiry interval, seconds"),
    "session.max_inflight_messages": (int, (1, 65535),
                                      "cap on unacknowledged QoS 1/2 messages sent to a client"),
    "session.max_queued_messages": (int, (1, 2**31 - 1),
                                    "messages a session may hold waiting (offline or window full)"),
    "session.max_queued_bytes": (int, (1, 2**40), "payload bytes a session may hold waiting"),
    "session.queue_qos0": (bool, None, "queue QoS 0 messages for offline persistent sessions"),
    "session.queue_drop_policy": (str, ("drop_oldest", "drop_newest"),
                                  "what to drop when a session queue is full (counted, logged)"),
}


def _check(key: str, value: Any) -> Any:
    kind, limits, _ = _KEYS[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind is int and isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # command-line strings
    if kind is float and isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if kind is bool and isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
        raise ConfigError(f"{key}: expected {kind.__name__}, got {value!r}")
    if isinstance(limits, tuple) and limits and isinstance(limits[0], str):
        if value not in limits:
            raise ConfigError(f"{key}: must be one of {', '.join(limits)}; got {value!r}")
    elif limits is not None and not limits[0] <= value <= limits[1]:
        raise ConfigError(f"{key}: must be between {limits[0]} and {limits[1]}; got {value!r}")
    return value


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: dict[str, object] | None = None
) -> BrokerConfig:
    """Read ``path`` (TOML; optional) and apply dotted-key ``overrides``; validate all."""
    values: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                document = tomllib.load(handle)
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read config file: {exc.strerror}") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: invalid TOML: {exc}") from None
        for section, table in document.items():
            if section not in ("server", "mqtt", "session"):
                raise ConfigError(f"unknown section {section!r}")
            if not isinstance(table, dict):
                raise ConfigError(f"{section}: expected a table")
            for name, value in table.items():
                values[f"{section}.{name}"] = value
    values.update(overrides or {})
    sections: dict[str, dict[str, Any]] = {"server": {}, "mqtt": {}, "session": {}}
    for key, value in values.items():
        if key not in _KEYS:
            raise ConfigError(f"unknown key {key!r}")
        section, name = key.split(".", 1)
        sections[section][name] = _check(key, value)
    config = BrokerConfig()
    return replace(
        config,
        server=replace(config.server, **sections["server"]),
        mqtt=replace(config.mqtt, **sections["mqtt"]),
        session=replace(config.session, **sections["session"]),
    )


def config_reference() -> list[tuple[str, object, str]]:
    """(dotted key, default, description) for every key, in documentation order."""
    defaults = BrokerConfig()
    rows = []
    for key, (_, _, description) in _KEYS.items():
        section, name = key.split(".", 1)
        rows.append((key, getattr(getattr(defaults, section), name), description))
    return rows
