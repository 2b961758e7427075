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

import ipaddress
import math
import os
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.topics import validate_topic_filter
from meshmq.networks import parse_networks


class ConfigError(Exception):
    """A configuration file or value is invalid; the message is one line naming the key."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    bind: str = ""  # empty: listen_address() chooses from auth
    port: int = 1883
    data_dir: str = "./data"
    log_level: str = "info"
    log_format: str = "text"
    port_file: str = ""
    workers: int = 0
    allow: str = ""
    deny: str = ""
    max_connections: int = 0
    max_connections_per_ip: int = 0
    log_connections: bool = True


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
    broker_topic_aliases: int = 65535
    max_topic_levels: int = 128
    connect_timeout: float = 10.0
    sys_interval: float = 10.0


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
    fsync_rules: str = ""
    fsync_inline_max_ms: int = 2
    syncfs_min_partitions: int = 0
    partitions: int = 8
    key_level: int = -1
    segment_bytes: int = 64 * 1024 * 1024
    segment_ms: int = 7 * 24 * 3600 * 1000
    retention_bytes: int = -1
    retention_ms: int = 7 * 24 * 3600 * 1000
    queue_size: int = 100_000
    replication_factor: int = 1
    min_insync_replicas: int = 1


@dataclass(frozen=True, slots=True)
class LimitsConfig:
    connect_rate: int = 1000
    connect_burst: int = 20_000
    connect_rate_per_address: int = 0
    connect_burst_per_address: int = 20
    client_message_rate: int = 0
    client_message_burst: int = 1000
    client_byte_rate: int = 0
    client_byte_burst: int = 1_048_576
    throttle_timeout: int = 60
    max_subscriptions: int = 1000
    max_topic_bytes: int = 4096


@dataclass(frozen=True, slots=True)
class TLSConfig:
    """The MQTT-over-TLS listener, and the certificate settings it shares with wss."""

    enabled: bool = False
    bind: str = ""
    port: int = 8883
    certfile: str = ""
    keyfile: str = ""
    cafile: str = ""
    require_client_cert: bool = False
    cert_username: bool = False
    min_version: str = "1.2"
    allow: str = ""
    deny: str = ""
    max_connections: int = 0
    max_connections_per_ip: int = 0


@dataclass(frozen=True, slots=True)
class WebSocketConfig:
    enabled: bool = False
    bind: str = ""
    port: int = 8083
    path: str = "/mqtt"
    allow: str = ""
    deny: str = ""
    max_connections: int = 0
    max_connections_per_ip: int = 0


@dataclass(frozen=True, slots=True)
class SecureWebSocketConfig(WebSocketConfig):
    port: int = 8084


@dataclass(frozen=True, slots=True)
class HooksConfig:
    """HTTP webhooks: batches of client and publish events POSTed as JSON (docs/operations.md)."""

    url: str = ""
    events: str = "client_connected,client_disconnected"
    publish_filters: str = "#"
    include_payload: bool = False
    authorization: str = ""
    batch_size: int = 100
    batch_delay_ms: int = 200
    queue_size: int = 10_000
    timeout: float = 5.0
    retries: int = 5
    retry_backoff_ms: int = 500
    retry_backoff_max_ms: int = 30_000

    @property
    def event_names(self) -> frozenset[str]:
        return frozenset(_split_list(self.events))

    @property
    def filters(self) -> tuple[str, ...]:
        return tuple(_split_list(self.publish_filters))


@dataclass(frozen=True, slots=True)
class AdminConfig:
    """The operations plane's HTTP listener: admin API, dashboard and /metrics."""

    listen: str = ""
    api_key: str = ""
    metrics_auth: bool = False
    certfile: str = ""
    keyfile: str = ""


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """This node's place in a cluster of nodes (docs/cluster.md); no ``node_id``: no cluster
    (today's single node, unchanged)."""

    node_id: str = ""
    listen: str = ""
    advertise: str = ""
    seeds: tuple[str, ...] = ()
    secret_file: str = ""
    metadata: bool = True

    @property
    def enabled(self) -> bool:
        return bool(self.node_id)

    @property
    def advertised(self) -> str:
        """What peers dial: ``advertise``, else ``listen``."""
        return self.advertise or self.listen


@dataclass(frozen=True, slots=True)
class ServicesConfig:
    """Request/reply through the broker (docs/services.md): every service's defaults, and
    per-service overrides (``[services.service.NAME]``, checked key by key as these)."""

    enabled: bool = True
    timeout: float = 5.0
    retries: int = 3
    dedup_window: float = 60.0
    no_responders: str = "wait"
    max_wait: float = 5.0
    dispatch: str = "round-robin"
    service: dict[str, dict[str, Any]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    mqtt: MQTTConfig = field(default_factory=MQTTConfig)
    session: SessionConfig = field(default_factory=SessionConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    log: LogSettings = field(default_factory=LogSettings)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    tls: TLSConfig = field(default_factory=TLSConfig)
    ws: WebSocketConfig = field(default_factory=WebSocketConfig)
    wss: SecureWebSocketConfig = field(default_factory=SecureWebSocketConfig)
    hooks: HooksConfig = field(default_factory=HooksConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    services: ServicesConfig = field(default_factory=ServicesConfig)


_SECTIONS = {
    "server": ServerConfig, "mqtt": MQTTConfig, "session": SessionConfig, "auth": AuthConfig,
    "log": LogSettings, "limits": LimitsConfig, "tls": TLSConfig, "ws": WebSocketConfig,
    "wss": SecureWebSocketConfig, "hooks": HooksConfig, "admin": AdminConfig,
    "cluster": ClusterConfig, "services": ServicesConfig,
}


class _Key(NamedTuple):
    kind: type  # str, int, float, bool, or tuple (of strings: an array in TOML)
    # numbers: (low, high), high None = unbounded, low exclusive for floats (unless
    # low_included) and inclusive for ints; str: the accepted strings; None: anything of the
    # right type
    allowed: tuple[Any, ...] | None
    description: str
    # a further check of a value of the right type: returns a problem ("" = fine)
    check: Callable[[Any], str] | None = None
    low_included: bool = False  # floats: the low bound itself is allowed (0 = off)


_LOG_LEVELS = ("debug", "info", "warning", "error")


def _check_networks(value: str) -> str:
    try:
        parse_networks(value)
    except ValueError as exc:
        return str(exc)
    return ""


def _check_path(value: str) -> str:
    if not value.startswith("/") or any(c.isspace() or c in "?#" for c in value):
        return f"must be an HTTP path such as /mqtt, got {_show(value)}"
    return ""


# ---------------------------------------------------------------------- [hooks]

HOOK_EVENTS = ("client_connected", "client_disconnected", "publish")


def _split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


_URL_CREDENTIALS = re.compile(r"^([a-z][a-z0-9+.-]*://)[^/@]*@", re.IGNORECASE)


def redact_url(url: str) -> str:
    """``url`` with any ``user:password@`` shown as ``***@`` (for logs and the admin API)."""
    return _URL_CREDENTIALS.sub(r"\1***@", url)


def _check_url(value: str) -> str:
    if value and not value.startswith(("http://", "https://")):
        return f"must be an http:// or https:// URL (or empty), got {_show(value)}"
    return ""


def _check_events(value: str) -> str:
    unknown = [name for name in _split_list(value) if name not in HOOK_EVENTS]
    if unknown:
        return f"unknown event {unknown[0]!r} (known: {', '.join(HOOK_EVENTS)})"
    return ""


def _check_filter(topic_filter: str) -> str:
    """The problem with one plain topic filter ("" = none); the message names the filter."""
    if topic_filter.startswith("$share/"):
        return f"bad topic filter: a shared subscription is no filter here: {topic_filter!r}"
    try:
        validate_topic_filter(topic_filter)
    except RemoteProtocolError as exc:
        return f"bad topic filter: {exc}"  # (names the filter)
    return ""


def _check_filters(value: str) -> str:
    """A comma-separated list of plain topic filters (hooks.publish_filters,
    log.persist_filters): a bad one would silently match other topics than meant."""
    for topic_filter in _split_list(value):
        problem = _check_filter(topic_filter)
        if problem:
            return problem
    return ""


_FSYNC_POLICIES = ("always", "interval", "never")


def _check_fsync_rules(value: str) -> str:
    """``"telemetry/#=interval, cmd/#=always"``: each entry a plain filter and a policy."""
    for item in _split_list(value):
        topic_filter, sep, policy = item.rpartition("=")
        if not sep or policy.strip() not in _FSYNC_POLICIES:
            return f"{item!r} is not FILTER={'|'.join(_FSYNC_POLICIES)}"
        problem = _check_filter(topic_filter.strip())
        if problem:
            return problem
    return ""


def _hooks_keys() -> dict[str, _Key]:
    return {
        "hooks.url": _Key(
            str, None, "http:// or https:// URL the event batches are POSTed to (JSON); empty ="
            " no webhooks", _check_url),
        "hooks.events": _Key(
            str, None, "comma-separated events to send: client_connected, client_disconnected,"
            " publish", _check_events),
        "hooks.publish_filters": _Key(
            str, None, "comma-separated topic filters whose publishes are sent (with the"
            " publish event)", _check_filters),
        "hooks.include_payload": _Key(
            bool, None, "publish events carry the payload (base64); false = its size only"),
        "hooks.authorization": _Key(
            str, None, "value of the Authorization header of each POST, e.g. \"Bearer"
            " s3cret\"; empty = none"),
        "hooks.batch_size": _Key(int, (1, 100_000), "most events in one POST"),
        "hooks.batch_delay_ms": _Key(
            int, (0, None), "longest an event waits for its batch to fill before it is sent"),
        "hooks.queue_size": _Key(
            int, (1, None), "events waiting to be sent, per worker; beyond it new events are"
            " dropped and counted (the message path never waits)"),
        "hooks.timeout": _Key(float, (0.0, None), "seconds one POST may take"),
        "hooks.retries": _Key(
            int, (0, None), "attempts after the first failed POST of a batch before it is dropped"
            " and counted"),
        "hooks.retry_backoff_ms": _Key(
            int, (1, None), "wait before the first retry; doubled at each retry"),
        "hooks.retry_backoff_max_ms": _Key(int, (1, None), "longest wait between retries"),
    }


def split_listen(value: str) -> tuple[str, int]:
    """``"127.0.0.1:18083"`` / ``"[::1]:18083"`` -> (host, port); ValueError says why not."""
    host, sep, port = value.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"must be HOST:PORT such as 127.0.0.1:18083, got {_show(value)}")
    return host, int(port)


def _check_listen(value: str) -> str:
    if not value:
        return ""  # off
    try:
        split_listen(value)
    except ValueError as exc:
        return str(exc)
    return ""


def _check_address(value: str) -> str:
    """A HOST:PORT to dial or listen on for the cluster (empty: unset)."""
    if not value:
        return ""
    try:
        split_listen(value)
    except ValueError as exc:
        return str(exc).replace("127.0.0.1:18083", "10.0.0.1:7883")
    return ""


def _check_addresses(values: tuple[str, ...]) -> str:
    for value in values:
        problem = _check_address(value)
        if problem:
            return problem
    return ""


_NODE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def _check_node_id(value: str) -> str:
    if value and not _NODE_ID.match(value):
        return ("must be 1 to 63 letters, digits, '.', '_' or '-', starting with a letter or"
                f" digit, got {_show(value)}")
    return ""


def _cluster_keys() -> dict[str, _Key]:
    return {
        "cluster.node_id": _Key(
            str, None, "this node's name in the cluster, unique and stable for its life;"
            " empty = no cluster (a single node)", _check_node_id),
        "cluster.listen": _Key(
            str, None, "HOST:PORT of the node's cluster port (links to other nodes); required"
            " with cluster.node_id", _check_address),
        "cluster.advertise": _Key(
            str, None, "HOST:PORT other nodes dial to reach this one; empty = cluster.listen",
            _check_address),
        "cluster.seeds": _Key(
            tuple, None, "HOST:PORT of some existing members (the rest is learned); empty ="
            " this node starts a cluster", _check_addresses),
        "cluster.secret_file": _Key(
            str, None, "file holding the shared secret every node of the cluster proves it"
            " knows before any other frame; required when cluster.listen is not a loopback"
            " address"),
        "cluster.metadata": _Key(
            bool, None, "run this node's metadata voter (Raft, on the cluster port + 1) and"
            " lead the log's partitions across nodes by its assignment (a new node joins the"
            " voters through a live seed; nodes started together name each other in seeds);"
            " its messages are authenticated with cluster.secret_file, or on a loopback"
            " address without one with a secret of this user on this host; false: each node"
            " keeps its own log of every partition"),
    }


def _is_loopback_host(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_cluster(config: BrokerConfig) -> None:
    """The cluster keys together (one-line ConfigError naming the key to fix)."""
    cluster, log = config.cluster, config.log
    if log.replication_factor > 1:
        raise ConfigError("log.replication_factor: must be 1: partitions are not replicated yet"
                          f" (one copy per partition), got {log.replication_factor}")
    if log.min_insync_replicas > log.replication_factor:
        raise ConfigError(f"log.min_insync_replicas: must be at most log.replication_factor"
                          f" ({log.replication_factor}), got {log.min_insync_replicas}")
    if not cluster.enabled:
        for name in ("listen", "advertise", "seeds", "secret_file"):
            if getattr(cluster, name):
                raise ConfigError(f"cluster.node_id: required when cluster.{name} is set")
        return
    if not cluster.listen:
        raise ConfigError("cluster.listen: required when cluster.node_id is set")
    host, port = split_listen(cluster.listen)
    if not cluster.secret_file and not _is_loopback_host(host):
        raise ConfigError(f"cluster.secret_file: required when cluster.listen ({cluster.listen})"
                          " is not a loopback address: peers must prove they belong")
    advertised = cluster.advertised
    if cluster.seeds and advertised in cluster.seeds and len(cluster.seeds) == 1 and port:
        raise ConfigError("cluster.seeds: lists only this node's own address; name another"
                          " member, or leave it empty to start a cluster")


# ---------------------------------------------------------------------- [services]

_SERVICE_SETTINGS = ("timeout", "retries", "dedup_window", "no_responders", "max_wait",
                     "dispatch")
_SERVICE_NAME = re.compile(r"^[^/+#\x00]+$")


def _check_per_service(value: dict[str, Any]) -> str:
    """``[services.service.NAME]`` tables: a service name, then keys of ``[services]``
    checked as there. The problem starts with what follows the key in the message (``.NAME.
    setting: ...`` or ``: ...``)."""
    for name, table in value.items():
        if not _SERVICE_NAME.match(name):
            return f": {_show(name)} is not a service name (one topic level, no wildcard)"
        if not isinstance(table, dict):
            return f".{name}: must be a table, got {_show(table)}"
        for setting, setting_value in table.items():
            if setting not in _SERVICE_SETTINGS:
                return (f".{name}.{setting}: unknown setting (known: "
                        f"{', '.join(_SERVICE_SETTINGS)})")
            try:
                table[setting] = _check(f"services.{setting}", setting_value)
            except ConfigError as error:
                return f".{name}.{str(error).removeprefix('services.')}"
    return ""


def _services_keys() -> dict[str, _Key]:
    return {
        "services.enabled": _Key(
            bool, None, "request/reply through the broker on $service/NAME topics"
            " (docs/services.md); false = those topics are ordinary topics"),
        "services.timeout": _Key(
            float, (0.0, None), "seconds a service worker has to reply to one attempt of a"
            " request before it goes to another"),
        "services.retries": _Key(
            int, (0, 100), "attempts after the first before the caller gets an error reply"),
        "services.dedup_window": _Key(
            float, (0.0, None), "seconds a completed request's reply is remembered: a repeat"
            " (same client id and correlation data) gets it instead of a second execution;"
            " 0 = no deduplication", low_included=True),
        "services.no_responders": _Key(
            str, ("wait", "fail"), "with no service worker connected: wait (up to max_wait)"
            " or fail at once with the error no-responders"),
        "services.max_wait": _Key(
            float, (0.0, None), "seconds a request waits for a service worker with free"
            " credit before the error reply no-responders"),
        "services.dispatch": _Key(
            str, ("round-robin", "least-loaded"), "how a service worker is chosen among those"
            " with free credit"),
        "services.service": _Key(
            dict, None, "per-service settings overriding the ones above: a table"
            " [services.service.NAME] with any of timeout, retries, dedup_window,"
            " no_responders, max_wait, dispatch", _check_per_service),
    }


def _admission_keys(section: str, listener: str) -> dict[str, _Key]:
    """The CIDR rules and connection limits every listener has."""
    return {
        f"{section}.allow": _Key(
            str, None, f"comma-separated CIDR networks allowed on {listener}; empty = any",
            _check_networks),
        f"{section}.deny": _Key(
            str, None, f"comma-separated CIDR networks refused on {listener} (deny wins)",
            _check_networks),
        f"{section}.max_connections": _Key(
            int, (0, None), f"connections open at once on {listener} (the node's total, split"
            " evenly between workers); beyond it CONNACK 0x97 (3.1.1: 3); 0 = no limit"),
        f"{section}.max_connections_per_ip": _Key(
            int, (0, None), f"connections open at once from one source IP on {listener}, in"
            " each worker; beyond it CONNACK 0x97 (3.1.1: 3); 0 = no limit"),
    }

# The one table: dotted key -> type, allowed values, description. Its order is the docs' order.
_KEYS: dict[str, _Key] = {
    "server.bind": _Key(
        str, None, "address to listen on for MQTT over TCP (and for the listeners without a"
        " bind of their own); empty = 127.0.0.1 while anonymous clients are allowed (no"
        " auth.password_file, or auth.anonymous = \"allow\"), else 0.0.0.0"),
    "server.port": _Key(int, (0, 65535), "MQTT TCP port; 0 picks a free port"),
    "server.data_dir": _Key(str, None, "directory for the broker's data (created if missing)"),
    "server.log_level": _Key(str, _LOG_LEVELS, "log verbosity"),
    "server.log_format": _Key(str, ("text", "json"), "log line format on stderr"),
    "server.port_file": _Key(
        str, None, "if set, written once listening: the TCP port on the first line, then a"
        " name=port line per listener (tcp, tls, ws, wss)"),
    "server.workers": _Key(
        int, (0, 256), "broker processes sharing the listening ports, one router each, linked"
        " by the mesh (docs/workers.md); 0 = one per CPU this process may run on"),
    **_admission_keys("server", "the TCP listener"),
    "server.log_connections": _Key(
        bool, None, "log each client connect and disconnect (client id, peer, protocol,"
        " reason) at info level; false = at debug level only"),
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
        int, (0, 65535), "topic aliases the broker may use on its publishes to a 5.0 client,"
        " never more than the client's Topic Alias Maximum (65535: as many as it allows); the"
        " topics it receives most get them; 0 = off"),
    "mqtt.max_topic_levels": _Key(
        int, (1, 65535), "most levels in a topic name or filter"),
    "mqtt.connect_timeout": _Key(
        float, (0.0, None), "seconds to wait for CONNECT after a TCP accept"),
    "mqtt.sys_interval": _Key(
        float, (0.0, None), "seconds between updates of the $SYS/broker/... topics (counts for"
        " the whole node, all workers; the first set is published at start); 0 = no $SYS"
        " topics", low_included=True),
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
        str, None, "comma-separated topic filters whose QoS 1/2 publishes are persisted",
        _check_filters),
    "log.persist_qos0": _Key(bool, None, "persist QoS 0 publishes on those topics too"),
    "log.fsync": _Key(
        str, _FSYNC_POLICIES,
        "always: fsync before PUBACK/PUBREC; interval: fsync every fsync_interval_ms"
        " (a power loss may lose that window); never: leave it to the OS"),
    "log.fsync_interval_ms": _Key(int, (1, None), "fsync period for fsync = interval"),
    "log.fsync_rules": _Key(
        str, None, "per-topic fsync policies, first match wins, e.g. \"telemetry/#=interval,"
        " cmd/#=always\"; topics matching none use log.fsync", _check_fsync_rules),
    "log.fsync_inline_max_ms": _Key(
        int, (0, 60_000), "fsync always on the event loop while those fsyncs average under this"
        " (ms), else on the log writer thread; 0 = always on the thread"),
    "log.syncfs_min_partitions": _Key(
        int, (0, 65536), "a sync of at least this many partitions (a loop turn's or the writer"
        " thread's) is one syncfs of the log's file system (Linux 5.8+) instead of one per"
        " partition; 0 = always one per partition. syncfs also writes what other programs left"
        " dirty there: 2 suits a disk the log has to itself"),
    "log.partitions": _Key(
        int, (1, 65536), "partitions of a new log (fixed once the log exists)"),
    "log.key_level": _Key(
        int, (-1, 128), "topic level hashed to pick a partition; -1 = the whole topic"),
    "log.segment_bytes": _Key(int, (1024, 2**31 - 1), "segment size at which a new one starts"),
    "log.segment_ms": _Key(int, (1, None), "segment age at which a new one starts"),
    "log.retention_bytes": _Key(int, (-1, None), "bytes kept per partition; -1 = no limit"),
    "log.retention_ms": _Key(int, (-1, None), "age after which segments are deleted; -1 = never"),
    "log.queue_size": _Key(
        int, (1, None), "appends waiting for the writer; beyond it publishes get 0x97"),
    "log.replication_factor": _Key(
        int, (1, 100), "copies of each partition across nodes (capped by the node count);"
        " 1 until partitions are replicated"),
    "log.min_insync_replicas": _Key(
        int, (1, 100), "copies that must hold a publish before it is acknowledged; with"
        " fewer in sync the partition refuses publishes"),
    "limits.connect_rate": _Key(
        int, (0, None), "CONNECTs per second the node accepts (token bucket, split evenly"
        " between workers); above it CONNACK 0x9F (3.1.1: 3); 0 = no limit"),
    "limits.connect_burst": _Key(
        int, (1, None), "CONNECTs the node accepts at once before connect_rate applies (a"
        " reconnect storm of that many clients gets in; split evenly between workers)"),
    "limits.connect_rate_per_address": _Key(
        int, (0, None), "CONNECTs per second from one source address, in each worker;"
        " 0 = no limit"),
    "limits.connect_burst_per_address": _Key(
        int, (1, None), "CONNECTs one source address may make at once"),
    "limits.client_message_rate": _Key(
        int, (0, None), "PUBLISH packets per second one client may send; above it the broker"
        " stops reading from it (lossless backpressure); 0 = no limit"),
    "limits.client_message_burst": _Key(
        int, (1, None), "PUBLISH packets a client may send at once before its rate applies"),
    "limits.client_byte_rate": _Key(
        int, (0, None), "bytes per second one client may send (throttled like messages);"
        " 0 = no limit"),
    "limits.client_byte_burst": _Key(
        int, (1, None), "bytes a client may send at once before its byte rate applies"),
    "limits.throttle_timeout": _Key(
        int, (0, None), "seconds a client may stay throttled without a break before it is"
        " disconnected (5.0: DISCONNECT 0x96); 0 = never"),
    "limits.max_subscriptions": _Key(
        int, (0, None), "topic filters one session may hold; beyond it SUBACK 0x97"
        " (3.1.1: 0x80); 0 = no limit"),
    "limits.max_topic_bytes": _Key(
        int, (1, 65535), "longest topic name or filter, in UTF-8 bytes (longer: 0x90/0x8F)"),
    "tls.enabled": _Key(bool, None, "listen for MQTT over TLS"),
    "tls.bind": _Key(str, None, "address of the TLS listener; empty = server.bind"),
    "tls.port": _Key(int, (0, 65535), "MQTT over TLS port; 0 picks a free port"),
    "tls.certfile": _Key(
        str, None, "PEM server certificate (chain) for tls and wss; reloaded on SIGHUP"),
    "tls.keyfile": _Key(str, None, "PEM private key (unencrypted); empty = in certfile"),
    "tls.cafile": _Key(
        str, None, "PEM CA certificates that sign client certificates; empty = none asked"),
    "tls.require_client_cert": _Key(
        bool, None, "mutual TLS: refuse clients without a certificate signed by cafile"),
    "tls.cert_username": _Key(
        bool, None, "a verified client certificate's subject CN is the user name (ACLs apply"
        " to it) and no password is needed"),
    "tls.min_version": _Key(str, ("1.2", "1.3"), "oldest TLS version accepted"),
    **_admission_keys("tls", "the TLS listener"),
    "ws.enabled": _Key(bool, None, "listen for MQTT over WebSocket (subprotocol mqtt)"),
    "ws.bind": _Key(str, None, "address of the WebSocket listener; empty = server.bind"),
    "ws.port": _Key(int, (0, 65535), "MQTT over WebSocket port; 0 picks a free port"),
    "ws.path": _Key(str, None, "HTTP path of the WebSocket endpoint", _check_path),
    **_admission_keys("ws", "the WebSocket listener"),
    "wss.enabled": _Key(
        bool, None, "listen for MQTT over WebSocket over TLS (certificate from [tls])"),
    "wss.bind": _Key(str, None, "address of the WebSocket TLS listener; empty = server.bind"),
    "wss.port": _Key(int, (0, 65535), "MQTT over secure WebSocket port; 0 picks a free port"),
    "wss.path": _Key(str, None, "HTTP path of the secure WebSocket endpoint", _check_path),
    **_admission_keys("wss", "the secure WebSocket listener"),
    **_hooks_keys(),
    "admin.listen": _Key(
        str, None, "HOST:PORT of the HTTP listener for the admin API, the dashboard and"
        " /metrics (docs/operations.md; with several workers served by worker 0); port 0"
        " picks a free port; empty = off", _check_listen),
    "admin.api_key": _Key(
        str, None, "the key API requests carry as 'Authorization: Bearer <key>' (401"
        " without it); required when admin.listen is set"),
    "admin.metrics_auth": _Key(
        bool, None, "/metrics needs the API key too (false: Prometheus scrapes it without"
        " one)"),
    "admin.certfile": _Key(
        str, None, "PEM certificate (chain): serve the admin listener over HTTPS; empty ="
        " plain HTTP"),
    "admin.keyfile": _Key(str, None, "PEM private key of admin.certfile; empty = in certfile"),
    **_cluster_keys(),
    **_services_keys(),
}

_TYPE_WORDS = {str: "a string", int: "an integer", float: "a number", bool: "true or false",
               tuple: "an array of strings", dict: "a table"}


def _requirement(spec: _Key) -> str:
    """The rule for one key as words: 'an integer between 1 and 65535', 'one of a|b'."""
    if spec.kind is str and spec.allowed:
        return "one of " + "|".join(spec.allowed)
    words = _TYPE_WORDS[spec.kind]
    if spec.allowed is None:
        return words
    low, high = spec.allowed
    if spec.kind is float and high is None:  # floats: the low bound is exclusive by default
        return f"{words} {'of at least' if spec.low_included else 'greater than'} {low:g}"
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
    if spec.kind is tuple:
        if from_text and isinstance(value, str):  # --flag a,b: comma-separated
            value = _split_list(value)
        if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
            raise ConfigError(f"{key}: must be {_requirement(spec)}, got {_show(given)}")
        value = tuple(value)
        problem = spec.check(value) if spec.check is not None else ""
        if problem:
            raise ConfigError(f"{key}: {problem}")
        return value
    if spec.kind is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: must be {_requirement(spec)}, got {_show(given)}")
        value = {name: dict(table) if isinstance(table, dict) else table
                 for name, table in value.items()}  # (checked copies: the file's stay as read)
        problem = spec.check(value) if spec.check is not None else ""
        if problem:
            raise ConfigError(f"{key}{problem}")
        return value
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
            above = value >= low if spec.low_included else value > low
            ok = math.isfinite(value) and above and (high is None or value <= high)
        else:
            low, high = spec.allowed
            ok = low <= value and (high is None or value <= high)
    if not ok:
        raise ConfigError(f"{key}: must be {_requirement(spec)}, got {_show(given)}")
    problem = spec.check(value) if spec.check is not None else ""
    if problem:
        raise ConfigError(f"{key}: {problem}")
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
    config = BrokerConfig(**{name: cls(**sections[name]) for name, cls in _SECTIONS.items()})
    _check_listeners(config)
    return config


def _check_listeners(config: BrokerConfig) -> None:
    """Rules that tie keys together (one-line ConfigError naming the key to fix)."""
    tls = config.tls
    if (tls.enabled or config.wss.enabled) and not tls.certfile:
        raise ConfigError("tls.certfile: required when tls.enabled or wss.enabled is true")
    for flag in ("require_client_cert", "cert_username"):
        if getattr(tls, flag) and not tls.cafile:
            raise ConfigError(f"tls.cafile: required when tls.{flag} is true")
    _check_cluster(config)
    admin = config.admin
    if admin.listen and not admin.api_key:
        raise ConfigError("admin.api_key: required when admin.listen is set")
    if admin.keyfile and not admin.certfile:
        raise ConfigError("admin.certfile: required when admin.keyfile is set")
    seen: dict[tuple[str, int], str] = {}
    for name in ("server", "tls", "ws", "wss"):
        section = getattr(config, name)
        if name != "server" and not section.enabled:
            continue
        where = (section.bind or listen_address(config), section.port)
        if section.port and where in seen:
            raise ConfigError(f"{name}.port: {section.port} is already used by {seen[where]}.port")
        seen[where] = name


LOOPBACK = "127.0.0.1"
EVERY_INTERFACE = "0.0.0.0"


def listen_address(config: BrokerConfig) -> str:
    """Where the listeners without a bind of their own listen: ``server.bind``; when it is
    empty, 127.0.0.1 while anonymous clients are allowed (as Mosquitto 2 listens on loopback
    only until configured: a broker started with no configuration is not open to the network
    without authentication), else 0.0.0.0."""
    if config.server.bind:
        return config.server.bind
    return LOOPBACK if config.auth.allow_anonymous else EVERY_INTERFACE


def config_reference() -> list[tuple[str, object, str]]:
    """``(dotted key, default, description)`` for every key, in documentation order."""
    defaults = BrokerConfig()
    rows: list[tuple[str, object, str]] = []
    for key, spec in _KEYS.items():
        section, name = key.split(".", 1)
        rows.append((key, getattr(getattr(defaults, section), name), spec.description))
    return rows


__all__ = [
    "AdminConfig",
    "AuthConfig",
    "BrokerConfig",
    "ClusterConfig",
    "ConfigError",
    "HooksConfig",
    "LimitsConfig",
    "LogSettings",
    "MQTTConfig",
    "SecureWebSocketConfig",
    "ServerConfig",
    "ServicesConfig",
    "SessionConfig",
    "TLSConfig",
    "WebSocketConfig",
    "allowed_values",
    "config_reference",
    "listen_address",
    "load_config",
]
