"""``meshmq serve``: a node of one process, or the supervisor of a node of several.

The command line calls ``run_server``; ``server.workers`` decides which runs: server.py runs
one process (the node, or one of its workers) and never imports the supervisor; supervisor.py
forks the workers, each of which runs server.py's ``run_worker``.
"""

from __future__ import annotations

import logging

from meshmq.cluster.spec import resolve_workers
from meshmq.config import BrokerConfig
from meshmq.node.reload import ConfigReloader, ConfigSource
from meshmq.node.server import run_node
from meshmq.node.startup import BindError, check_bind_hosts
from meshmq.node.supervisor import supervise

log = logging.getLogger("meshmq.server")


def run_server(config: BrokerConfig, source: ConfigSource | None = None) -> int:
    """Run the node until SIGTERM or SIGINT; its exit status. ``source``: where ``config``
    came from (SIGHUP reads it again)."""
    try:
        check_bind_hosts(config)  # before the supervisor forks: one line for the node
    except BindError as error:
        log.error("%s", error)
        return error.exit_status
    count = resolve_workers(config.server.workers)
    if count > 1 or config.cluster.enabled:  # (a cluster node of one worker too)
        return supervise(config, count, source)
    reloader = ConfigReloader(source, config) if source is not None else None
    return run_node(config, reloader)
