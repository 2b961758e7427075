"""Start and stop a broker node: listeners, signals, the event loop (uvloop when available)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
from pathlib import Path

from meshmq.auth.acl import ACLFileError
from meshmq.auth.passwords import PasswordFileError
from meshmq.broker.broker import Broker
from meshmq.broker.listeners import ListenerError, Listeners
from meshmq.broker.statestore import StateError
from meshmq.broker.tls import TLSConfigError
from meshmq.config import BrokerConfig
from meshmq.log.errors import LogConfigError, LogError

log = logging.getLogger("meshmq.server")


class BrokerServer:
    """A running broker node; ``start()`` listens, ``stop()`` shuts down cleanly."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.broker: Broker | None = None
        self.port = 0
        self.listeners: Listeners | None = None

    async def start(self) -> None:
        cfg = self.config.server
        loop = asyncio.get_running_loop()
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
        self.broker = Broker(self.config, loop)
        listeners = self.listeners = Listeners(self.config, self.broker)
        wide = [bind for bind in listeners.binds() if not _is_loopback(bind)]
        if self.config.auth.allow_anonymous and wide:
            log.warning(
                "ANONYMOUS ACCESS IS ON while listening beyond loopback bind=%s: any client may"
                " connect; set auth.password_file (and auth.anonymous = \"deny\")", wide[0],
            )
        await listeners.start()
        self.port = listeners.port("tcp")
        log.info("listening bind=%s port=%d %sdata_dir=%s", cfg.bind, self.port,
                 f"{listeners.describe()} " if listeners.describe() else "", cfg.data_dir)
        if cfg.port_file:
            tmp = f"{cfg.port_file}.tmp"
            Path(tmp).write_text(listeners.port_file_text())
            os.replace(tmp, cfg.port_file)  # readers never see a half-written file

    def reload(self) -> None:
        """SIGHUP: re-read TLS certificates, the password file and the ACL file (existing
        connections are kept; a file that fails to load leaves the old one in force)."""
        log.info("SIGHUP: reloading")
        if self.listeners is not None:
            self.listeners.reload_tls()
        if self.broker is not None:
            self.broker.reload_auth()

    async def stop(self) -> None:
        if self.listeners is not None:
            self.listeners.close()
        if self.broker is not None:
            self.broker.shutdown()
        if self.listeners is not None:
            await self.listeners.wait_closed()
        if self.broker is not None:
            self.broker.close()
        log.info("stopped")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(config: BrokerConfig) -> int:
    """Run a node until SIGTERM or SIGINT; return the process exit code."""
    server = BrokerServer(config)
    try:
        await server.start()
    except (PasswordFileError, ACLFileError, LogConfigError, TLSConfigError) as exc:
        log.error("%s", exc)
        return 2
    except ListenerError as exc:
        log.error("%s", exc)
        return 1
    except LogError as exc:
        log.error("cannot open the commit log: %s (see `meshmq log verify`)", exc)
        return 1
    except StateError as exc:
        log.error("cannot read the broker state: %s", exc)
        return 1
    except OSError as exc:
        log.error("cannot listen bind=%s port=%d error=%r", config.server.bind,
                  config.server.port, exc.strerror or str(exc))
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    await stop.wait()
    log.info("shutting down")
    await server.stop()
    return 0


def run_server(config: BrokerConfig) -> int:
    """Blocking entry point used by ``meshmq serve``."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on supported platforms
        return asyncio.run(serve(config))
    return uvloop.run(serve(config))
