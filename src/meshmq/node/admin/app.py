"""The admin listener: the HTTP API, /metrics and the dashboard, on aiohttp.

Every request under ``/api/`` carries ``Authorization: Bearer <admin.api_key>`` (401 and a JSON
error without it); ``/metrics`` does too when ``admin.metrics_auth`` is true. The dashboard's
page and its static files need no key (they hold no data; the page asks for the key and sends it
with its API calls). Every error is JSON: ``{"error": "<one line>", "status": <code>}``.

The handlers are in api.py; each asks the node's workers through views.py.
"""

from __future__ import annotations

import hmac
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from meshmq.config import AdminConfig, split_listen
from meshmq.node.admin import AdminError, api
from meshmq.node.admin.metrics import NodeMetrics
from meshmq.node.admin.views import NodeViews

log = logging.getLogger("meshmq.admin")

STATIC = Path(__file__).parent / "static"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def json_error(status: int, message: str, **headers: str) -> web.Response:
    return web.json_response({"error": message, "status": status}, status=status,
                             headers=headers or None)


def _authorized(request: web.Request, api_key: str) -> bool:
    given = request.headers.get("Authorization", "")
    scheme, _, token = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                             api_key.encode())


def make_app(config: AdminConfig, views: NodeViews, metrics: NodeMetrics) -> web.Application:
    """The aiohttp application (routes, authentication, JSON errors)."""

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        needs_key = path.startswith("/api/") or (path == "/metrics" and config.metrics_auth)
        if needs_key and not _authorized(request, config.api_key):
            return json_error(401, "missing or wrong API key: send 'Authorization: Bearer"
                              " <admin.api_key>'", **{"WWW-Authenticate": "Bearer"})
        try:
            return await handler(request)
        except web.HTTPException as exc:  # aiohttp's own (404 route, 405 method): as JSON
            if exc.status < 400:
                raise
            return json_error(exc.status, exc.reason)
        except api.BadRequest as exc:
            return json_error(exc.status, str(exc))
        except Exception as exc:  # a bug: logged with its traceback, answered as JSON
            log.exception("admin request failed: %s %s", request.method, path)
            return json_error(500, f"internal error: {type(exc).__name__}")

    app = web.Application(middlewares=[guard], client_max_size=64 * 1024)
    app[api.VIEWS] = views
    app[api.METRICS] = metrics
    api.add_routes(app)
    app.router.add_get("/", _index)
    app.router.add_static("/static/", STATIC, show_index=False)
    return app


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


def _ssl_context(config: AdminConfig) -> ssl.SSLContext | None:
    if not config.certfile:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(config.certfile, config.keyfile or None)
    except (OSError, ssl.SSLError) as exc:
        raise AdminError(f"admin.certfile: cannot load {config.certfile}: {exc}", 2) from None
    return context


class AdminServer:
    """The admin listener of a node (in worker 0, or the single process)."""

    def __init__(self, config: AdminConfig, views: NodeViews, state_file: Path | None,
                 shared_port: bool) -> None:
        self.config = config
        self.views = views
        self.metrics = NodeMetrics(state_file)
        self.shared_port = shared_port  # the supervisor holds the port (SO_REUSEPORT)
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self) -> None:
        """Listen (AdminError if the address or the certificate cannot be used)."""
        host, port = split_listen(self.config.listen)
        context = _ssl_context(self.config)
        app = make_app(self.config, self.views, self.metrics)
        runner = self.runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, ssl_context=context,
                           reuse_port=self.shared_port or None)
        try:
            await site.start()
        except OSError as exc:
            await runner.cleanup()
            raise AdminError(f"cannot listen listener=admin bind={host} port={port}"
                             f" error={exc.strerror or exc}") from None
        self.port = runner.addresses[0][1]
        log.info("admin listening bind=%s port=%d tls=%s", host, self.port,
                 "on" if context else "off")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
