"""Broker configuration: TOML file plus dotted-key overrides, validated key by key.

Every key, its type, its allowed values and its description live in one table (``_KEYS``); the
dataclasses hold the defaults. A bad value is a ``ConfigError`` whose message is one line that
names the key, e.g. ``mqtt.max_qos: must be an integer between 0 and 2, got 3``, so
``meshmq serve`` can print it and exit with status 2.

Values from the TOML file must have the right TOML type (``port = "1883"`` is an error, and a
boolean is never an integer). Overrides are checked the same way, except that a *string* given
for a non-string key is parsed as command-line text (``"1884"``, ``"0.5"``, ``"true"``), since
that is what flags such as ``--port`` produce.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import dataclass, field
from typing import Any, NamedTuple


class ConfigError(Exception):
    """A configuration file or value is invalid; the message is one line naming the key."""


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
class AuthConfig:
    password_file: str = ""
    anonymous: str = "auto"
    acl_file: str = ""

    @property
    def allow_anonymous(self) -> bool:
        """'auto': anonymous clients are allowed only while no password file is configured."""
        if self.anonymous == "auto":
            return not self.password_file
        return self.anonymous == "allow"


@dataclass(frozen=True, slots=True)
class LogSettings:
    enabled: bool = True
    persist_filters: str = "#"
    persist_qos0: bool = False
    fsync: str = "always"
    fsync_interval_ms: int = 1000
    partitions: int = 8
    key_level: int = -1
    segment_bytes: int = 64 * 1024 * 1024
    retention_bytes: int = -1
    retention_ms: int = 7 * 24 * 3600 * 1000
    queue_size: int = 100_000


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    mqtt: MQTTConfig = field(default_factory=MQTTConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    log: LogSettings = field(default_factory=LogSettings)


_SECTIONS = {
    "server": ServerConfig, "mqtt": MQTTConfig, "session": SessionConfig, "auth": AuthConfig,
    "log": LogSettings,
}


class _Key(NamedTuple):
    kind: type  # str, int, float or bool
    # numbers: (low, high), high None = unbounded, low exclusive for floats and inclusive for
    # ints; str: the accepted strings; None: anything of the right type
    allowed: tuple[Any, ...] | None
    description: str


_LOG_LEVELS = ("debug", "info", "warning", "error")

# The one table: dotted key -> type, allowed values, description. Its order is the docs' order.
_KEYS: dict[str, _Key] = {
    "server.bind": _Key(str, None, "address to listen on for MQTT over TCP"),
    "server.port": _Key(int, (0, 65535), "MQTT TCP port; 0 picks a free port"),
    "server.data_dir": _Key(str, None, "directory for the broker's data (created if missing)"),
    "server.log_level": _Key(str, _LOG_LEVELS, "log verbosity"),
    "server.log_format": _Key(str, ("text", "json"), "log line format on stderr"),
    "server.port_file": _Key(
        str, None, "if set, the bound port is written to this file once listening"),
    "mqtt.max_packet_size": _Key(
        int, (1, 268_435_455), "largest packet accepted, in bytes (advertised in CONNACK)"),
    "mqtt.receive_maximum": _Key(
        int, (1, 65535), "unacknowledged QoS 1/2 publishes a client may send us at once"),
    "mqtt.max_keepalive": _Key(
        int, (1, 65535),
        "largest keep alive granted, seconds: 5.0 clients asking more (or 0) get it as"
        " Server Keep Alive, 3.1.1 clients are refused (return code 2)"),
    "mqtt.max_qos": _Key(int, (0, 2), "highest QoS the broker accepts and grants"),
    "mqtt.retain_available": _Key(bool, None, "accept retained messages"),
    "mqtt.wildcard_subscriptions": _Key(bool, None, "allow '+' and '#' in subscriptions"),
    "mqtt.shared_subscriptions": _Key(bool, None, "allow $share/{group}/{filter} subscriptions"),
    "mqtt.subscription_identifiers": _Key(bool, None, "support MQTT 5 subscription identifiers"),
    "mqtt.topic_alias_maximum": _Key(
        int, (0, 65535), "topic aliases a client may use towards the broker"),
    "mqtt.broker_topic_aliases": _Key(
        int, (0, 65535), "topic aliases the broker assigns on outgoing publishes; 0 = off"),
    "mqtt.max_topic_levels": _Key(
        int, (1, 65535), "most levels in a topic name or filter"),
    "mqtt.connect_timeout": _Key(
        float, (0.0, None), "seconds to wait for CONNECT after a TCP accept"),
    "session.max_session_expiry": _Key(
        int, (0, 4_294_967_295), "cap on a session's expiry interval, seconds"),
    "session.max_inflight_messages": _Key(
        int, (1, 65535), "cap on unacknowledged QoS 1/2 messages sent to a client"),
    "session.max_queued_messages": _Key(
        int, (1, None), "messages a session may hold waiting (offline or window full)"),
    "session.max_queued_bytes": _Key(
        int, (1, None), "payload bytes a session may hold waiting"),
    "session.queue_qos0": _Key(bool, None, "queue QoS 0 messages for offline persistent sessions"),
    "session.queue_drop_policy": _Key(
        str, ("drop_oldest", "drop_newest"), "what to drop when a session queue is full"),
    "auth.password_file": _Key(
        str, None, "file of user:argon2id-hash lines (see `meshmq passwd`); empty = none"),
    "auth.anonymous": _Key(
        str, ("auto", "allow", "deny"),
        "clients without a user name: auto = allowed only when no password file is set"),
    "auth.acl_file": _Key(
        str, None, "ACL rules file (first match wins, default deny); empty = no ACLs"),
    "log.enabled": _Key(bool, None, "write persisted publishes to the commit log under data_dir"),
    "log.persist_filters": _Key(
        str, None, "comma-separated topic filters whose QoS 1/2 publishes are persisted"),
    "log.persist_qos0": _Key(bool, None, "persist QoS 0 publishes on those topics too"),
    "log.fsync": _Key(
        str, ("always", "interval", "never"),
        "always: fsync before PUBACK/PUBREC; interval: fsync every fsync_interval_ms"
        " (a power loss may lose that window); never: leave it to the OS"),
    "log.fsync_interval_ms": _Key(int, (1, None), "fsync period for fsync = interval"),
    "log.partitions": _Key(
        int, (1, 65536), "partitions of a new log (fixed once the log exists)"),
    "log.key_level": _Key(
        int, (-1, 128), "topic level hashed to pick a partition; -1 = the whole topic"),
    "log.segment_bytes": _Key(int, (1024, 2**31 - 1), "segment size at which a new one starts"),
    "log.retention_bytes": _Key(int, (-1, None), "bytes kept per partition; -1 = no limit"),
    "log.retention_ms": _Key(int, (-1, None), "age after which segments are deleted; -1 = never"),
    "log.queue_size": _Key(
        int, (1, None), "appends waiting for the writer; beyond it publishes get 0x97"),
}

_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false"}


def _requirement(spec: _Key) -> str:
    """The rule for one key as words: 'an integer between 1 and 65535', 'one of a|b'."""
    if spec.kind is str and spec.allowed:
        return "one of " + "|".join(spec.allowed)
    words = _TYPE_WORDS[spec.kind]
    if spec.allowed is None:
        return words
    low, high = spec.allowed
    if spec.kind is float and high is None:  # floats: the low bound is exclusive
        return f"{words} greater than {low:g}"
    if high is None:
        return f"{words} of at least {low}"
    return f"{words} between {low} and {high}"


def allowed_values(key: str) -> str:
    """What ``key`` accepts, in words (for documentation); KeyError for an unknown key."""
    return _requirement(_KEYS[key])


def _from_text(kind: type, text: str) -> Any:
    """Parse command-line text for a non-string key; return ``text`` unchanged if it can't be."""
    stripped = text.strip()
    try:
        if kind is int:
            return int(stripped, 10)
        if kind is float:
            return float(stripped)
    except ValueError:
        return text
    if kind is bool and stripped.lower() in ("true", "false"):
        return stripped.lower() == "true"
    return text


def _check(key: str, value: Any, from_text: bool = False) -> Any:
    spec = _KEYS[key]
    given = value
    if from_text and spec.kind is not str and isinstance(value, str):
        value = _from_text(spec.kind, value)
    if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    ok = isinstance(value, spec.kind) and (spec.kind is bool or not isinstance(value, bool))
    if ok and spec.allowed is not None:
        if spec.kind is str:
            ok = value in spec.allowed
        elif spec.kind is float:
            low, high = spec.allowed
            ok = math.isfinite(value) and value > low and (high is None or value <= high)
        else:
            low, high = spec.allowed
            ok = low <= value and (high is None or value <= high)
    if not ok:
        raise ConfigError(f"{key}: must be {_requirement(spec)}, got {_show(given)}")
    return value


def _show(value: Any) -> str:
    """A short one-line rendering of a bad value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, list):
        return "an array"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _read_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    name = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"{name}: cannot read config file: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{name}: invalid TOML: {_one_line(str(exc))}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{name}: invalid TOML: the file is not UTF-8 text") from None


def load_config(
    path: str | os.PathLike[str] | None = None, overrides: dict[str, object] | None = None
) -> BrokerConfig:
    """Read ``path`` (TOML, optional), then apply dotted-key ``overrides``; validate everything.

    Raises ``ConfigError`` (one line, naming the key or the file) on any problem.
    """
    values: dict[str, Any] = {}
    if path is not None:
        for section, table in _read_file(path).items():
            if section not in _SECTIONS:
                what = "table" if isinstance(table, dict) else "key"
                raise ConfigError(f"unknown {what} {section!r}")
            if not isinstance(table, dict):
                raise ConfigError(f"{section}: must be a table, got {_show(table)}")
            for name, value in table.items():
                key = f"{section}.{name}"
                if key not in _KEYS:
                    raise ConfigError(f"unknown key {key!r}")
                values[key] = _check(key, value)
    for key, value in (overrides or {}).items():
        if key not in _KEYS:
            raise ConfigError(f"unknown key {key!r}")
        values[key] = _check(key, value, from_text=True)

    sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
    for key, value in values.items():
        section, name = key.split(".", 1)
        sections[section][name] = value
    return BrokerConfig(**{name: cls(**sections[name]) for name, cls in _SECTIONS.items()})


def config_reference() -> list[tuple[str, object, str]]:
    """``(dotted key, default, description)`` for every key, in documentation order."""
    defaults = BrokerConfig()
    rows: list[tuple[str, object, str]] = []
    for key, spec in _KEYS.items():
        section, name = key.split(".", 1)
        rows.append((key, getattr(getattr(defaults, section), name), spec.description))
    return rows


__all__ = [
    "AuthConfig",
    "BrokerConfig",
    "ConfigError",
    "LogSettings",
    "MQTTConfig",
    "ServerConfig",
    "SessionConfig",
    "allowed_values",
    "config_reference",
    "load_config",
]
