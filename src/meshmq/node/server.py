"""Start and stop a broker node: listeners, signals, the event loop (uvloop when available).

With ``server.workers`` above 1, ``meshmq serve`` (run.py) hands over to the supervisor
(``supervisor.py``), which starts that many worker processes; each runs ``run_worker``: the same
broker core, given the cluster's versions of its interfaces (cluster/workers.py), listening on
the shared ports (SO_REUSEPORT) and linked to the other workers. This module is where the core
and the cluster are put together: neither imports the other's composition.
"""

from __future__ import annotations

import asyncio
import gc
import ipaddress
import logging
import os
import signal
from collections.abc import Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmq.broker.broker import Broker
from meshmq.broker.transport.listeners import Listeners
from meshmq.cluster.nodelink import NodeIdentity
from meshmq.cluster.servicelinks import MeshServiceLinks
from meshmq.cluster.spec import WorkerSpec
from meshmq.cluster.workers import WorkerCluster
from meshmq.config import BrokerConfig, listen_address, redact_url
from meshmq.logsetup import kv
from meshmq.node.admin import AdminError
from meshmq.node.admin.views import WorkerViews
from meshmq.node.descriptors import raise_file_limit, reserve_descriptors
from meshmq.node.identity import read_identity, read_secret, store_cluster_id
from meshmq.node.reload import ConfigReloader
from meshmq.node.startup import StartupError, prepare_data_dir, starting
from meshmq.node.webhooks import CLOSE_GRACE, Webhooks
from meshmq.services.layer import LocalLinks, ServiceLinks, ServicesLayer
from meshmq.services.settings import Catalogue

if TYPE_CHECKING:
    from meshmq.node.admin.app import AdminServer

log = logging.getLogger("meshmq.server")


class BrokerServer:
    """A running broker node; ``start()`` listens, ``stop()`` shuts down cleanly."""

    def __init__(self, config: BrokerConfig, worker: WorkerSpec | None = None,
                 reloader: ConfigReloader | None = None) -> None:
        self.config = config
        self.worker = worker
        self.reloader = reloader  # None: SIGHUP re-reads the files in use, not the config
        self.broker: Broker | None = None
        self.cluster: WorkerCluster | None = None
        self.services: ServicesLayer | None = None  # request/reply (services.enabled)
        self.port = 0
        self.listeners: Listeners | None = None
        self.webhooks: Webhooks | None = None  # statistics() for $SYS and the admin plane
        self.webhook_task: asyncio.Task[None] | None = None
        self.views: WorkerViews | None = None
        self.admin: AdminServer | None = None  # admin.listen set, here (aiohttp loaded)

    async def start(self) -> None:
        cfg = self.config.server
        loop = asyncio.get_running_loop()
        prepare_data_dir(cfg.data_dir)  # the supervisor checked it too, before forking
        worker = self.worker
        if worker is None:
            broker = self.broker = Broker(self.config, loop)
            self.start_webhooks(broker)
            self._use_services(broker, LocalLinks())
            broker.start()
        else:
            broker = self.broker = Broker(self.config, loop, worker.index, worker.count,
                                          open_log=False)
            self.start_webhooks(broker)
            cluster = self.cluster = WorkerCluster(broker, worker, *self._node_identity(worker))
            links = MeshServiceLinks(cluster.mesh, cluster.leadership)
            links.events = self._use_services(broker, links)
            await cluster.start()  # linked to every peer before the state is restored
            broker.start()
            cluster.started()
        if self.services is not None:
            self.services.start()  # dispatchers recovered before any client is served
        views = self.views = WorkerViews(broker, self.cluster)
        views.services = self.services
        if self.cluster is not None:
            self.cluster.admin.answer = views.answer  # every worker answers admin queries
        listeners = self.listeners = Listeners(self.config, broker, self.worker is not None)
        views.listeners = listeners
        wide = [bind for bind in listeners.binds() if not _is_loopback(bind)]
        first = self.worker is None or self.worker.index == 0  # one line per node
        if self.config.auth.allow_anonymous and wide and first:
            log.warning(
                "ANONYMOUS ACCESS IS ON while listening beyond loopback bind=%s: any client may"
                " connect; set auth.password_file (and auth.anonymous = \"deny\")", wide[0],
            )
        await listeners.start()
        self.port = listeners.port("tcp")
        log.info("listening bind=%s port=%d %sdata_dir=%s", listen_address(self.config),
                 self.port, f"{listeners.describe()} " if listeners.describe() else "",
                 cfg.data_dir)
        if first:
            _say_if_local_only(self.config)
        await self._start_admin(views)

    def announce(self) -> None:
        """Write the port file (a node of one process; for workers the supervisor writes it).
        Called once the signal handlers are in place: a script that sends SIGHUP or SIGTERM as
        soon as the file appears must find them (the default actions end the process)."""
        cfg = self.config.server
        if not cfg.port_file or self.worker is not None or self.listeners is None:
            return
        text = self.listeners.port_file_text()
        if self.admin is not None:
            text += f"admin={self.admin.port}\n"
        tmp = f"{cfg.port_file}.tmp"
        Path(tmp).write_text(text)
        os.replace(tmp, cfg.port_file)  # readers never see a half-written file

    def _use_services(self, broker: Broker, links: ServiceLinks) -> ServicesLayer | None:
        """The services layer on the ``$service/`` topics (services.enabled), reaching the
        node's other workers through ``links``."""
        if not self.config.services.enabled:
            return None
        services = self.services = ServicesLayer(broker, Catalogue(self.config.services), links,
                                                 self.config.server.data_dir)
        broker.use_services(services)
        return services

    def _node_identity(self, worker: WorkerSpec
                       ) -> tuple[NodeIdentity | None, Callable[[str], None] | None]:
        """A node of a cluster: who it is to the other nodes (node/identity.py), and what to
        do when it learns its cluster's id."""
        config = self.config
        cluster = config.cluster
        if not cluster.enabled:
            return None, None
        found = read_identity(config.server.data_dir) or {}
        identity = NodeIdentity(cluster.node_id, int(worker.token, 16), read_secret(config),
                                str(found.get("cluster_id", "")), cluster.advertised)
        return identity, partial(store_cluster_id, config.server.data_dir, cluster.node_id)

    def start_webhooks(self, broker: Broker) -> None:
        """With ``hooks.url``: events go to a queue that a task of their own posts from."""
        if not self.config.hooks.url:
            return
        webhooks = self.webhooks = Webhooks(self.config.hooks, broker.index)
        broker.events = webhooks
        self.webhook_task = asyncio.get_running_loop().create_task(webhooks.run())
        log.info("webhooks on", extra=kv(url=redact_url(self.config.hooks.url),
                                         events=",".join(sorted(webhooks.cfg.event_names))))

    async def _start_admin(self, views: WorkerViews) -> None:
        """The admin listener, in the single process or worker 0 (docs/operations.md: the
        supervisor runs no event loop; worker 0 already adds up the node's $SYS figures)."""
        if not self.config.admin.listen or (self.worker is not None and self.worker.index):
            return
        from meshmq.node.admin.app import AdminServer  # aiohttp only where it serves
        from meshmq.node.admin.views import NodeViews

        state = Path(self.config.server.data_dir) / "admin" / "counters.json"
        self.admin = AdminServer(self.config.admin, NodeViews(views, self.cluster), state,
                                 shared_port=self.worker is not None)
        await self.admin.start()
        gc.freeze()  # aiohttp's and prometheus-client's modules too (broker.GC_THRESHOLDS)

    def reload(self) -> None:
        """SIGHUP: apply what the configuration file changed and may change now
        (node/reload.py), then re-read TLS certificates, the password file and the ACL file
        (existing connections are kept; a file that fails to load leaves the old one in force)."""
        log.info("SIGHUP: reloading")
        if self.reloader is not None:
            config = self.reloader.plan(self.config)
            if config is not None:
                self.reconfigure(config)
        if self.listeners is not None:
            self.listeners.reload_tls(self.config.tls)
        if self.broker is not None:
            self.broker.reload_auth()

    def reconfigure(self, config: BrokerConfig) -> None:
        self.config = config
        logging.getLogger().setLevel(config.server.log_level.upper())
        if self.broker is not None:
            self.broker.reconfigure(config)

    async def stop(self) -> None:
        if self.admin is not None:
            await self.admin.stop()
        if self.listeners is not None:
            self.listeners.close()
        if self.broker is not None:
            self.broker.shutdown()
        if self.cluster is not None:
            self.cluster.close()
        if self.listeners is not None:
            await self.listeners.wait_closed()
        if self.services is not None:
            self.services.close()
        if self.broker is not None:
            self.broker.close()
        await self.stop_webhooks()
        log.info("stopped")

    async def stop_webhooks(self) -> None:
        """Send what is queued (the last disconnections included) within ``CLOSE_GRACE``."""
        if self.webhooks is None or self.webhook_task is None:
            return
        self.webhooks.close()
        try:
            await asyncio.wait_for(self.webhook_task, CLOSE_GRACE)
        except TimeoutError:
            log.warning("webhooks stopped with events unsent",
                        extra=kv(queued=len(self.webhooks.queue)))
        except Exception:  # a bug in the sender must not spoil the shutdown
            log.exception("webhook sender failed")


def _say_if_local_only(config: BrokerConfig) -> None:
    """One line when the node listens on loopback only because nothing said otherwise
    (``listen_address``): a newcomer whose clients on other hosts are refused learns why."""
    if config.server.bind or not config.auth.allow_anonymous:
        return
    names = ["tcp"] + [name for name in ("tls", "ws", "wss")
                       if getattr(config, name).enabled and not getattr(config, name).bind]
    log.warning(
        "listening on %s only (%s): no bind address is set and anonymous clients are allowed;"
        " to accept clients from other hosts, configure authentication (auth.password_file,"
        " auth.anonymous not \"allow\": the node then listens on 0.0.0.0) or set server.bind ="
        " \"0.0.0.0\" (--bind 0.0.0.0)",
        listen_address(config), ", ".join(names))


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def serve(
    config: BrokerConfig, worker: WorkerSpec | None = None,
    ready: Callable[[], None] | None = None, reloader: ConfigReloader | None = None,
) -> int:
    """Run a node (or one worker of it) until SIGTERM or SIGINT; return the exit code.

    ``ready`` is called once the listeners are up (the supervisor waits for it);
    ``reloader`` re-reads the configuration on SIGHUP.
    """
    server = BrokerServer(config, worker, reloader)
    try:
        with starting(config.server.data_dir):
            await server.start()
    except StartupError as error:
        log.error("%s", error)
        if isinstance(error, AdminError):  # the broker and its listeners are up: stop them
            await server.stop()
        return error.exit_status
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    server.announce()
    if ready is not None:
        ready()
    await stop.wait()
    log.info("shutting down")
    await server.stop()
    return 0


def run_node(config: BrokerConfig, reloader: ConfigReloader | None = None) -> int:
    """Blocking entry point of a node of one process (``meshmq serve``, run.py)."""
    return _run(serve(config, reloader=reloader))


def run_worker(config: BrokerConfig, worker: WorkerSpec, ready: Callable[[], None],
               reloader: ConfigReloader | None = None) -> int:
    """Blocking entry point of a worker process (started by the supervisor)."""
    return _run(serve(config, worker, ready, reloader))


def _run(main: Coroutine[Any, Any, int]) -> int:
    limit = raise_file_limit()
    reserved = reserve_descriptors(limit)  # before any thread starts (descriptors.py)
    log.debug("open files limit=%d descriptor table=%d", limit, reserved)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on supported platforms
        return asyncio.run(main)
    return uvloop.run(main)
