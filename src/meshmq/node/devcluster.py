"""``meshmq cluster dev``: a cluster of nodes on 127.0.0.1 in the foreground, for trying it.

Each node is a ``meshmq serve`` process of its own with its own data directory
(``DIR/n1``, ``DIR/n2``...), MQTT port (``--port``, then the next ones) and cluster port
(``--cluster-port``, then the next ones), all on loopback. Each node runs a metadata voter
(``cluster.metadata``: Raft on its cluster port + 1, so the cluster ports go up by two),
every node names all the others as seeds (they start together with the same voters), and a
secret is drawn into ``DIR/cluster.secret``: the partitions are led across the nodes. With
``--no-metadata`` there are no voters and no secret (only this host can reach the nodes):
each node keeps its own log of every partition, the first node starts the cluster and the
others name it as their seed.
Ctrl-C (or SIGTERM) stops them all; if one of them exits, the others are stopped too and the
command exits with status 1. A node's log goes to ``DIR/nN/node.log``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

STOP_GRACE = 30.0  # seconds each node gets to stop cleanly before it is killed


@dataclass
class DevNode:
    name: str
    directory: Path
    port: int
    cluster_port: int
    admin_port: int | None = None  # None: no admin listener
    proc: subprocess.Popen[bytes] | None = None


DEV_API_KEY = "dev"  # the admin listeners are on 127.0.0.1 only: a trial cluster's key


def node_config(node: DevNode, seeds: list[int], secret_file: Path | None = None) -> str:
    """``secret_file``: with the metadata on (``seeds`` then names every other node)."""
    listed = ", ".join(f'"127.0.0.1:{seed}"' for seed in seeds)
    admin = "" if node.admin_port is None else (
        f'\n[admin]\nlisten = "127.0.0.1:{node.admin_port}"\napi_key = "{DEV_API_KEY}"\n')
    metadata = "metadata = false\n" if secret_file is None else (
        f'metadata = true\nsecret_file = "{secret_file}"\n')
    return (f'[cluster]\nnode_id = "{node.name}"\nlisten = "127.0.0.1:{node.cluster_port}"\n'
            f"seeds = [{listed}]\n{metadata}{admin}")


def dev_secret(directory: Path) -> Path:
    """The trial cluster's secret (drawn once, kept for its next runs), readable by its
    owner only."""
    path = directory / "cluster.secret"
    if not path.exists():
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_hex(32) + "\n")
    return path


def run_dev_cluster(count: int, directory: Path, port: int, cluster_port: int,
                    workers: int, admin_port: int = 0, metadata: bool = True) -> int:
    """Start ``count`` nodes, wait for Ctrl-C or for one to exit; the exit status.
    ``admin_port``: the first node's admin listener, the others on the next ones (0: none);
    ``metadata``: run the metadata voters (see the module docstring)."""
    step = 2 if metadata else 1  # (a voter's Raft port is its cluster port + 1)
    nodes = [DevNode(f"n{i + 1}", directory / f"n{i + 1}", port + i, cluster_port + step * i,
                     admin_port + i if admin_port else None) for i in range(count)]
    secret_file = dev_secret(directory) if metadata else None
    stopping: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: stopping.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for node in nodes:
            node.directory.mkdir(parents=True, exist_ok=True)
            config = node.directory / "meshmq.toml"
            if metadata:  # every node is a voter: each names all the others
                seeds = [other.cluster_port for other in nodes if other is not node]
            else:  # the first node starts the cluster, the others join through it
                seeds = [] if node is nodes[0] else [nodes[0].cluster_port]
            config.write_text(node_config(node, seeds, secret_file))
            with open(node.directory / "node.log", "ab") as log_file:
                node.proc = subprocess.Popen(
                    [sys.executable, "-m", "meshmq", "serve", "--config", str(config),
                     "--bind", "127.0.0.1", "--port", str(node.port), "--data-dir",
                     str(node.directory / "data"), "--workers", str(workers)],
                    stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"meshmq cluster dev: {count} nodes on 127.0.0.1"
              f"{', partitions led across them (metadata on)' if metadata else ''} "
              "(Ctrl-C stops them all)")
        for node in nodes:
            admin = "" if node.admin_port is None else \
                f"  admin http://127.0.0.1:{node.admin_port}"
            print(f"  {node.name}: mqtt://127.0.0.1:{node.port}  cluster port "
                  f"{node.cluster_port}{admin}  log {node.directory / 'node.log'}")
        if nodes[0].admin_port is not None:
            print(f"  meshmq cluster status --admin http://127.0.0.1:{nodes[0].admin_port} "
                  f"--api-key {DEV_API_KEY}")
        sys.stdout.flush()
        status = 0
        while not stopping:
            exited = [n for n in nodes if n.proc is not None and n.proc.poll() is not None]
            if exited:
                node = exited[0]
                assert node.proc is not None
                print(f"meshmq cluster dev: {node.name} exited with status "
                      f"{node.proc.returncode} (see {node.directory / 'node.log'}); stopping "
                      "the others", file=sys.stderr)
                status = 1
                break
            time.sleep(0.2)  # a foreground supervisor's poll, not a test
        _stop_all(nodes)
        return status
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _stop_all(nodes: list[DevNode]) -> None:
    for node in nodes:
        if node.proc is not None and node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    for node in nodes:
        if node.proc is None:
            continue
        try:
            node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.proc.kill()
            node.proc.wait()
