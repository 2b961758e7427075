"""A cluster of meshmq nodes on 127.0.0.1 for ``bench/cluster_cost.py``: start, watch, kill.

Each node is a ``meshmq serve`` of its own (a supervisor and its workers, and with
``cluster.metadata`` its metadata voter), pinned with ``taskset`` like the suite's brokers, with
its own data directory, an ephemeral MQTT port, an admin listener (``GET /api/v1/cluster`` says
when the links are up) and a ``[cluster]`` section:

* without the metadata (``metadata=False``, written as ``metadata = false``: it is on by
  default): ``listen = "127.0.0.1:0"``; the first node starts the cluster and the others
  name it as their seed (as ``meshmq cluster dev --no-metadata`` does). Loopback only, so
  no secret is needed.
* with it: every node's cluster port is fixed (its Raft port is the cluster port + 1, which
  port 0 would not reserve), every node names the others as seeds (the voters), and they share
  a secret file (the Raft messages are authenticated with it).

A node's CPU and run-queue wait are the sum over its processes (the supervisor and the children
found once it is ready), read from /proc as ``brokers.proc_stats`` does.
"""

from __future__ import annotations

import json
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from meshbench import BenchError
from meshbench.brokers import (
    BASE_MESHMQ,
    STOP_TIMEOUT,
    ProcStats,
    add_stats,
    child_pids,
    pinned,
    proc_stats,
    toml_text,
)

API_KEY = "cluster-bench-key"
SECRET = "cluster bench secret, loopback only\n"
START_TIMEOUT = 60.0  # a node to write its port file; the cluster to link (a loaded machine)
POLL = 0.02  # seconds between checks while waiting for a state (the harness, not a test)


@dataclass
class ClusterNode:
    """One running node; ``stop()`` or ``kill()`` it."""

    name: str
    directory: Path
    proc: subprocess.Popen
    port: int = 0
    ports: dict[str, int] = field(default_factory=dict)  # cluster=, admin= (the port file)
    pids: list[int] = field(default_factory=list)  # supervisor first, then its children

    @property
    def log_path(self) -> Path:
        return self.directory / "node.log"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stats(self) -> ProcStats:
        """CPU, run-queue wait, RSS of every process of the node (a process gone is left out)."""
        found = []
        for pid in self.pids or [self.proc.pid]:
            try:
                found.append(proc_stats(pid))
            except OSError:
                continue
        return add_stats(found)

    def same_processes(self) -> bool:
        """Every process found at start is still a child of the supervisor (no restart)."""
        return self.alive() and set(self.pids[1:]) <= set(child_pids(self.proc.pid))

    def log_tail(self, lines: int = 10) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def admin(self, path: str = "/api/v1/cluster", timeout: float = 5.0) -> dict:
        """The admin API's JSON answer for ``path``."""
        url = f"http://127.0.0.1:{self.ports['admin']}{path}"
        request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return json.load(answer)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        """``kill -9`` the supervisor (its children die with it: PR_SET_PDEATHSIG); returns
        once every process of the node is gone, so its ports are free."""
        self.proc.kill()
        self.proc.wait()
        deadline = time.monotonic() + STOP_TIMEOUT
        while any(_alive(pid) for pid in self.pids[1:]):
            if time.monotonic() > deadline:
                raise BenchError(f"{self.name}: processes {self.pids[1:]} outlived the kill")
            time.sleep(POLL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Cluster:
    nodes: list[ClusterNode]
    workers: int
    metadata: bool

    def by_name(self, name: str) -> ClusterNode:
        return next(node for node in self.nodes if node.name == name)

    def stats(self) -> dict[str, ProcStats]:
        """node name -> its figures so far (nodes killed are left out)."""
        return {node.name: node.stats() for node in self.nodes if node.alive()}

    def problems(self) -> list[str]:
        """Nodes that died or restarted a process since they were ready."""
        found = []
        for node in self.nodes:
            if not node.alive():
                found.append(f"{node.name} died (exit {node.proc.returncode}): "
                             f"{node.log_tail(3)}")
            elif not node.same_processes():
                found.append(f"{node.name}: a process was restarted: {node.log_tail(3)}")
        return found

    def stop(self) -> None:
        for node in self.nodes:
            if node.alive():
                node.proc.send_signal(signal.SIGTERM)
        for node in self.nodes:
            node.stop()


def free_port_pairs(count: int) -> list[int]:
    """``count`` ports P free now with P + 1 free too (a node's cluster port and its voter's
    Raft port), drawn below the kernel's ephemeral range, where other programs' outgoing
    connections do not take them meanwhile."""
    found: list[int] = []
    while len(found) < count:
        port = random.randrange(20000, 32000)
        if any(abs(port - other) < 2 for other in found):
            continue
        probes = [socket.socket() for _ in range(2)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", port + offset))
            found.append(port)
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    return found


def cluster_section(name: str, listen: str, seeds: list[str], secret_file: Path | None,
                    metadata: bool) -> str:
    listed = ", ".join(f'"{seed}"' for seed in seeds)
    text = f'[cluster]\nnode_id = "{name}"\nlisten = "{listen}"\nseeds = [{listed}]\n'
    if secret_file is not None:
        text += f'secret_file = "{secret_file}"\n'
    text += f"metadata = {'true' if metadata else 'false'}\n"  # (on by default)
    return text + "\n"


def _launch(name: str, directory: Path, settings: dict[str, object], section: str,
            cpus: str | None) -> ClusterNode:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "meshmq.toml"
    config.write_text(toml_text({**BASE_MESHMQ, **settings, "admin.listen": "127.0.0.1:0",
                                 "admin.api_key": API_KEY}) + section)
    port_file = directory / "port"
    cmd = [sys.executable, "-m", "meshmq", "serve", "--config", str(config), "--bind",
           "127.0.0.1", "--port", "0", "--data-dir", str(directory / "data"), "--port-file",
           str(port_file)]
    with open(directory / "node.log", "wb") as log:
        proc = subprocess.Popen(pinned(cpus, cmd), stdout=log, stderr=subprocess.STDOUT)
    return ClusterNode(name, directory, proc)


def _await_ready(node: ClusterNode, deadline: float) -> None:
    """Until the node's port file is written (every worker listens): its ports and pids."""
    port_file = node.directory / "port"
    while not (port_file.exists() and port_file.read_text().strip()):
        if not node.alive():
            raise BenchError(f"{node.name} exited with {node.proc.returncode}: "
                             f"{node.log_tail()}")
        if time.monotonic() > deadline:
            raise BenchError(f"{node.name} did not listen within {START_TIMEOUT:.0f} s")
        time.sleep(POLL)
    first, *named = port_file.read_text().split()
    node.port = int(first)
    node.ports = {key: int(value) for key, value in (item.split("=", 1) for item in named)}


def start_cluster(workdir: Path, count: int, settings: dict[str, object], cpus: str | None,
                  metadata: bool = False) -> Cluster:
    """``count`` nodes named n1, n2...; returns once every worker of every node is linked to
    every other node (and, with ``metadata``, every node sees every member, a controller and
    every partition assigned). ``settings``: dotted meshmq keys for every node."""
    workers = int(settings.get("server.workers", BASE_MESHMQ["server.workers"]))  # type: ignore[call-overload]
    cluster = Cluster([], workers, metadata)
    deadline = time.monotonic() + START_TIMEOUT
    try:
        if metadata:
            secret = workdir / "cluster.secret"
            secret.write_text(SECRET)
            secret.chmod(0o600)
            ports = free_port_pairs(count)
            for index, port in enumerate(ports):
                seeds = [f"127.0.0.1:{other}" for other in ports if other != port]
                section = cluster_section(f"n{index + 1}", f"127.0.0.1:{port}", seeds, secret,
                                          True)
                cluster.nodes.append(_launch(f"n{index + 1}", workdir / f"n{index + 1}",
                                             settings, section, cpus))
        else:
            first = _launch("n1", workdir / "n1", settings,
                            cluster_section("n1", "127.0.0.1:0", [], None, False), cpus)
            cluster.nodes.append(first)
            _await_ready(first, deadline)
            seed = f"127.0.0.1:{first.ports['cluster']}"
            for index in range(1, count):
                name = f"n{index + 1}"
                section = cluster_section(name, "127.0.0.1:0", [seed], None, False)
                cluster.nodes.append(_launch(name, workdir / name, settings, section, cpus))
        for node in cluster.nodes:
            _await_ready(node, deadline)
        _await_linked(cluster, deadline)
        for node in cluster.nodes:  # the workers (and voter) exist once the node listens
            node.pids = [node.proc.pid, *child_pids(node.proc.pid)]
        return cluster
    except BaseException:
        cluster.stop()
        raise


def linked_everywhere(cluster: Cluster, state: dict, node: ClusterNode) -> bool:
    """``node``'s view (its ``/api/v1/cluster`` answer) has every other node fully linked and,
    with the metadata, every member, a controller and every partition assigned."""
    others = {n.name for n in cluster.nodes} - {node.name}
    rows = {row["node_id"]: row for row in state.get("nodes", [])}
    if set(rows) != others or any(rows[name]["linked"] < cluster.workers for name in others):
        return False
    if not cluster.metadata:
        return True
    meta = state.get("metadata") or {}
    return (len(meta.get("members", {})) == len(cluster.nodes) and bool(meta.get("controller"))
            and len(meta.get("partitions", {})) > 0)


def _await_linked(cluster: Cluster, deadline: float) -> None:
    for node in cluster.nodes:
        while True:
            try:
                if linked_everywhere(cluster, node.admin(), node):
                    break
            except OSError:
                pass  # the admin listener is not answering yet
            if not node.alive():
                raise BenchError(f"{node.name} exited with {node.proc.returncode}: "
                                 f"{node.log_tail()}")
            if time.monotonic() > deadline:
                raise BenchError(f"{node.name} did not link every other node within "
                                 f"{START_TIMEOUT:.0f} s: {node.log_tail(3)}")
            time.sleep(POLL * 5)


def partitions_settled(cluster: Cluster, partitions: int) -> bool:
    """With the metadata: every live node reports all ``partitions`` assigned."""
    for node in cluster.nodes:
        if not node.alive():
            continue
        meta = node.admin().get("metadata") or {}
        if len(meta.get("partitions", {})) != partitions:
            return False
    return True

