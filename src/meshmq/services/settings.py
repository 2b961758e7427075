"""Per-service settings: the ``[services]`` defaults, and each service's own overrides.

``[services]`` in the configuration (config.py ``ServicesConfig``) gives the defaults; a
table ``[services.service.NAME]`` overrides any of them for service NAME (docs/services.md,
docs/configuration.md). The values are checked by config.py; here they are only looked up.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshmq.config import ServicesConfig

ROUND_ROBIN = "round-robin"
LEAST_LOADED = "least-loaded"
WAIT = "wait"  # no-responders policy: a request waits (up to max_wait) for a service worker
FAIL = "fail"  # ... fails at once with no-responders while none is connected


@dataclass(frozen=True, slots=True)
class ServiceSettings:
    """How one service's requests are dispatched."""

    timeout: float = 5.0  # seconds a service worker has to reply to one attempt
    retries: int = 3  # attempts after the first, each on another service worker if there is one
    dedup_window: float = 60.0  # seconds a completed request's reply is remembered
    no_responders: str = WAIT  # with no service worker connected: wait, or fail at once
    max_wait: float = 5.0  # seconds a request waits for a service worker with free credit
    dispatch: str = ROUND_ROBIN  # or least-loaded


SETTING_NAMES = tuple(f.name for f in fields(ServiceSettings))


class Catalogue:
    """Each service's settings from the configuration (defaults, then its overrides)."""

    def __init__(self, config: ServicesConfig | None = None) -> None:
        if config is None:
            self.defaults = ServiceSettings()
            self.overrides: dict[str, dict[str, object]] = {}
            return
        self.defaults = ServiceSettings(**{name: getattr(config, name)
                                           for name in SETTING_NAMES})
        self.overrides = {name: dict(values) for name, values in config.service.items()}

    def settings_for(self, service: str) -> ServiceSettings:
        override = self.overrides.get(service)
        if not override:
            return self.defaults
        return replace(self.defaults, **override)  # type: ignore[arg-type]
