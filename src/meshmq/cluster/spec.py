"""Who a worker is: its index among the node's workers, and how to reach its peers."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshmq.config import BrokerConfig

@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """One worker of a node started with ``server.workers = count``.

    ``token`` is random per node start; it names the link sockets (abstract unix sockets, so no
    path length limit and nothing left on disk) and is checked in the link handshake.
    """

    index: int
    count: int
    token: str

    def link_address(self, index: int) -> str:
        """The abstract unix socket worker ``index`` accepts links on."""
        return f"\0meshmq-{self.token}-{index}"


def resolve_workers(configured: int) -> int:
    """``server.workers``: 0 means one per CPU this process may run on (taskset respected)."""
    if configured > 0:
        return configured
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not on Linux
        return max(1, os.cpu_count() or 1)


def share_node_limits(config: BrokerConfig, count: int) -> BrokerConfig:
    """The configuration of one of ``count`` workers: limits meant for the whole node
    (``max_connections`` of each listener, ``limits.connect_rate`` and ``connect_burst``) split
    evenly, rounded up, since the kernel spreads connections evenly over the workers. Limits per
    source address and per client apply in each worker as they are (docs/workers.md)."""
    def share(value: int) -> int:
        return -(-value // count) if value > 0 else value

    server, tls, ws, wss, limits = config.server, config.tls, config.ws, config.wss, config.limits
    return dataclasses.replace(
        config,
        server=dataclasses.replace(server, max_connections=share(server.max_connections)),
        tls=dataclasses.replace(tls, max_connections=share(tls.max_connections)),
        ws=dataclasses.replace(ws, max_connections=share(ws.max_connections)),
        wss=dataclasses.replace(wss, max_connections=share(wss.max_connections)),
        limits=dataclasses.replace(limits, connect_rate=share(limits.connect_rate),
                                   connect_burst=max(1, share(limits.connect_burst))),
    )
