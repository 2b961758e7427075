"""SIGHUP: re-read the configuration file and apply what can change without a restart.

Theory of operation
-------------------
``ConfigReloader`` keeps how the running configuration was made (``ConfigSource``: the TOML file
and the command-line overrides, which still win) and the configuration that file gave at start
(``loaded``). On SIGHUP ``plan()`` reads the file again and compares it with ``loaded`` key by
key. A key of ``RELOADABLE`` (or of a ``RELOADABLE_SECTIONS`` table) is applied: one line per
changed key. Every other changed key is listed on one line as needing a restart and keeps its
running value (it is listed again at each reload until the restart).

Nothing is applied when the file cannot be used: bad TOML, a bad value, or a password, ACL or
certificate file newly named that does not load. One line names the problem and the running
configuration stays. (The files already in use are re-read after the plan whatever it says, as
before: a bad one of those is reported by its own reload and the previous contents stay.)

A worker of a node of several reloads itself (the supervisor passes SIGHUP on): ``prepare`` turns
the file's configuration into the worker's (node-wide limits shared between the workers).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshmq.auth.acl import ACLFileError, read_acl_file
from meshmq.auth.passwords import PasswordFileError, read_password_file
from meshmq.broker.transport.certificates import TLSConfigError, build_server_context
from meshmq.config import BrokerConfig, ConfigError, config_reference, load_config
from meshmq.logsetup import kv

log = logging.getLogger("meshmq.reload")

# Whole tables that apply on reload: limits (new connections, and the next CONNECT, SUBSCRIBE or
# topic check of connected clients), auth (the next CONNECT, SUBSCRIBE and delivery).
RELOADABLE_SECTIONS = frozenset({"limits", "auth"})
RELOADABLE = frozenset({
    "server.log_level",
    "server.log_connections",
    "mqtt.max_keepalive",  # granted at CONNECT
    "mqtt.connect_timeout",  # a connection's CONNECT deadline starts at accept
    "session.max_session_expiry",  # capped at CONNECT and DISCONNECT
    "tls.certfile",  # later handshakes
    "tls.keyfile",
})


def reloadable(key: str) -> bool:
    return key in RELOADABLE or key.split(".", 1)[0] in RELOADABLE_SECTIONS


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """Where the configuration comes from: the file (None: none) and the flags' overrides."""

    path: str | None = None
    overrides: dict[str, object] = field(default_factory=dict)

    def load(self) -> BrokerConfig:
        return load_config(self.path, self.overrides)


def value_of(config: BrokerConfig, key: str) -> Any:
    section, name = key.split(".", 1)
    return getattr(getattr(config, section), name)


def changed_keys(old: BrokerConfig, new: BrokerConfig) -> list[str]:
    """The dotted keys whose values differ, in documentation order."""
    return [key for key, _, _ in config_reference() if value_of(old, key) != value_of(new, key)]


def with_values(config: BrokerConfig, source: BrokerConfig, keys: list[str]) -> BrokerConfig:
    """``config`` with the values of ``keys`` taken from ``source``."""
    sections: dict[str, dict[str, Any]] = {}
    for key in keys:
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value_of(source, key)
    return dataclasses.replace(config, **{
        section: dataclasses.replace(getattr(config, section), **values)
        for section, values in sections.items()})


def check_new_files(running: BrokerConfig, new: BrokerConfig) -> None:
    """Load the password, ACL and certificate files that ``new`` names and ``running`` does
    not (they must work before anything changes); raises their error."""
    auth, tls = new.auth, new.tls
    if auth.password_file and auth.password_file != running.auth.password_file:
        read_password_file(auth.password_file)
    if auth.acl_file and auth.acl_file != running.auth.acl_file:
        read_acl_file(auth.acl_file)
    tls_used = running.tls.enabled or running.wss.enabled
    if tls_used and (tls.certfile, tls.keyfile) != (running.tls.certfile, running.tls.keyfile):
        build_server_context(dataclasses.replace(
            running.tls, certfile=tls.certfile, keyfile=tls.keyfile))


class ConfigReloader:
    """Plans a reload of the running configuration from its source (module docstring)."""

    def __init__(self, source: ConfigSource, loaded: BrokerConfig,
                 prepare: Callable[[BrokerConfig], BrokerConfig] = lambda config: config
                 ) -> None:
        self.source = source
        self.loaded = loaded
        self.prepare = prepare

    def plan(self, running: BrokerConfig, report: bool = True) -> BrokerConfig | None:
        """The running configuration with what the file changed and may change now (logged),
        or None when the file cannot be used (logged: the caller keeps ``running``).
        ``report=False``: log nothing (the supervisor: its workers report)."""
        try:
            new = self.source.load()
            check_new_files(running, new)
        except (ConfigError, PasswordFileError, ACLFileError, TLSConfigError) as exc:
            if report:
                log.error("configuration not reloaded, keeping the running one: %s", exc)
            return None
        changed = changed_keys(self.loaded, new)
        now = [key for key in changed if reloadable(key)]
        if report:
            self.report(changed, now, new)
        self.loaded = with_values(self.loaded, new, now)
        return with_values(running, self.prepare(new), now)

    def report(self, changed: list[str], now: list[str], new: BrokerConfig) -> None:
        """One line per key applied (``now``), one for the rest of ``changed``."""
        later = [key for key in changed if key not in now]
        for key in now:
            log.info("configuration changed", extra=kv(
                key=key, old=_shown(value_of(self.loaded, key)), new=_shown(value_of(new, key))))
        if later:
            log.warning("configuration changes that need a restart",
                        extra=kv(keys=",".join(later)))
        if not changed:
            log.info("configuration unchanged")


def _shown(value: Any) -> Any:
    """A value as the file spells it (booleans in lower case)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value
