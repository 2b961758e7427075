"""Start and stop a broker node: listeners, signals, the event loop (uvloop when available)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import socket
from pathlib import Path

from meshmq.auth.acl import ACLFileError
from meshmq.auth.passwords import PasswordFileError
from meshmq.broker.broker import Broker
from meshmq.broker.protocol import ClientProtocol
from meshmq.config import BrokerConfig
from meshmq.log.errors import LogConfigError, LogError

log = logging.getLogger("meshmq.server")


class BrokerServer:
    """A running broker node; ``start()`` listens, ``stop()`` shuts down cleanly."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.broker: Broker | None = None
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> None:
        cfg = self.config.server
        loop = asyncio.get_running_loop()
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
        self.broker = Broker(self.config, loop)
        broker = self.broker
        if self.config.auth.allow_anonymous and not _is_loopback(cfg.bind):
            log.warning(
                "ANONYMOUS ACCESS IS ON while listening beyond loopback bind=%s: any client may"
                " connect; set auth.password_file (and auth.anonymous = \"deny\")", cfg.bind,
            )
        self._server = await loop.create_server(
            lambda: ClientProtocol(broker), cfg.bind, cfg.port, reuse_address=True, backlog=4096
        )
        for sock in self._server.sockets:
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("listening bind=%s port=%d data_dir=%s", cfg.bind, self.port, cfg.data_dir)
        if cfg.port_file:
            tmp = f"{cfg.port_file}.tmp"
            Path(tmp).write_text(f"{self.port}\n")
            os.replace(tmp, cfg.port_file)  # readers never see a half-written file

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        if self.broker is not None:
            self.broker.shutdown()
        if self._server is not None:
            await self._server.wait_closed()
        if self.broker is not None and self.broker.persistence is not None:
            self.broker.persistence.close()
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
    except (PasswordFileError, ACLFileError, LogConfigError) as exc:
        log.error("%s", exc)
        return 2
    except LogError as exc:
        log.error("cannot open the commit log: %s (see `meshmq log verify`)", exc)
        return 1
    except OSError as exc:
        log.error("cannot listen bind=%s port=%d error=%r", config.server.bind,
                  config.server.port, exc.strerror or str(exc))
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
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
