"""Nodes for the fault harness: ``meshmq serve`` processes that a nemesis can kill, pause and
restart, each on its own ephemeral port(s) and data directory.

A ``Node`` is one ``meshmq serve`` (one supervisor and its workers, or a single process with
``workers=1``). It keeps everything a test needs across restarts: its directory (the data
directory, the configuration file, one log file per run: ``run-1.log``, ``run-2.log``...), its
configuration and worker count. ``restart()`` starts it again on the same data directory and,
by default, on the same port (the one the first run drew), as a host that reboots keeps its
address: clients and peers reconnect by themselves.

``Nodes`` starts several and stops every one of them on exit, even when the test failed (a
stopped node is continued first, so nothing is left behind in state T).

Today the nodes are independent brokers; the cluster work will hand each a ``[cluster]``
section through ``config`` (a callable may build it per node, once ports are known), and a
``launcher`` prefix runs a node inside a network namespace (``netns.Namespace.launcher``).

Why not ``conftest.start_broker``: a node needs a launcher prefix, a bind address other than
127.0.0.1, its logs kept across restarts, and its worker pids; the readiness rule (the port
file, written once every worker listens) and ``wait_for`` are the same.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from conftest import WAIT, wait_for

STARTED = re.compile(r"workers started count=(\d+) pids=([\d,]+)")
RESTARTED = re.compile(r"worker restarted index=(\d+) pid=(\d+)")


class NodeError(Exception):
    """A node did something the harness cannot go on from (exited while starting, ...)."""


@dataclass
class Node:
    """One ``meshmq serve`` on ``bind``; see the module docstring."""

    name: str
    directory: Path
    config: str = ""
    workers: int = 1
    bind: str = "127.0.0.1"
    launcher: Sequence[str] = ()  # e.g. ("ip", "netns", "exec", "ns1"): runs the node there
    proc: subprocess.Popen | None = None
    port: int = 0
    ports: dict[str, int] = field(default_factory=dict)
    runs: int = 0
    paused: bool = False

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        """The log of the current (or last) run."""
        return self.directory / f"run-{self.runs}.log"

    def address(self) -> tuple[str, int]:
        """Where clients reach the node now (changes with every restart)."""
        return self.bind, self.port

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.runs else ""

    # -- life cycle -----------------------------------------------------------------------

    def start(self, port: int = 0) -> Node:
        """Start a run on the node's data directory, on ``port`` (0: an ephemeral one);
        return once every worker listens."""
        if self.running():
            raise NodeError(f"{self.name} is already running")
        self.directory.mkdir(parents=True, exist_ok=True)
        port_file = self.directory / "port"
        port_file.unlink(missing_ok=True)  # never read the previous run's port
        config_file = self.directory / "meshmq.toml"
        config_file.write_text(self.config)
        self.runs += 1
        cmd = [*self.launcher, sys.executable, "-m", "meshmq", "serve",
               "--config", str(config_file), "--bind", self.bind, "--port", str(port),
               "--data-dir", str(self.data_dir), "--log-level", "debug",
               "--port-file", str(port_file), "--workers", str(self.workers)]
        with open(self.log_path, "wb") as log_file:
            self.proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
        self.paused = False
        try:
            wait_for(lambda: self._ready(port_file), what=f"{self.name} to listen")
        except BaseException:  # never leave a half-started node behind
            self.proc.kill()
            self.proc.wait()
            raise
        first, *named = port_file.read_text().split()
        self.port = int(first)
        self.ports = {key: int(value) for key, value in (line.split("=") for line in named)}
        return self

    def _ready(self, port_file: Path) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise NodeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log()}")
        return port_file.exists() and port_file.read_text().strip() != ""

    def stop(self, sig: int = signal.SIGTERM, timeout: float = WAIT) -> int | None:
        """Stop the run with ``sig`` (SIGKILL after ``timeout``); its exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            if sig != signal.SIGKILL:
                self._signal_all(signal.SIGCONT)  # a stopped node or worker ignores SIGTERM
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.paused = False
        return self.proc.returncode

    def kill(self) -> int | None:
        """``kill -9`` the node: the supervisor, and with it every worker (PR_SET_PDEATHSIG)."""
        pids = self.pids()
        status = self.stop(signal.SIGKILL)
        # The kernel kills the workers when the supervisor dies; wait until it has, so the next
        # run finds the partitions' locks free.
        wait_for(lambda: not any(_alive(pid) for pid in pids), what=f"{self.name}'s workers to die")
        return status

    def restart(self, same_port: bool = True) -> Node:
        """A new run on the same data directory (after ``stop`` or ``kill``), by default on
        the same port, as a host that reboots keeps its address: clients and peers that know
        it reconnect by themselves."""
        if self.running():
            self.stop()
        return self.start(self.port if same_port else 0)

    def pause(self) -> None:
        """SIGSTOP every process of the node, and return once all are stopped: a paused node
        answers nothing and closes nothing (its sockets stay open), as a host that froze."""
        pids = self.pids()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: all(process_state(pid) == "T" for pid in pids),
                 what=f"{self.name} to stop")
        self.paused = True

    def resume(self) -> None:
        """SIGCONT every process of the node; return once none is stopped."""
        pids = self._signal_all(signal.SIGCONT)
        wait_for(lambda: all(process_state(pid) != "T" for pid in pids),
                 what=f"{self.name} to go on")
        self.paused = False

    def _signal_all(self, sig: int) -> list[int]:
        """Send ``sig`` to every process of the node that is still there."""
        sent = []
        for pid in self.pids():
            try:
                os.kill(pid, sig)
                sent.append(pid)
            except ProcessLookupError:
                pass
        return sent

    # -- workers --------------------------------------------------------------------------

    def worker_pids(self) -> list[int]:
        """The current pid of each worker, in index order, as the supervisor logged them (a
        single-process node is its own worker 0)."""
        if self.proc is None:
            return []
        text = self.log()
        started = STARTED.search(text)
        if started is None and not self.supervised():
            return [self.proc.pid]
        if started is None:
            raise NodeError(f"{self.name}: no 'workers started' line in {self.log_path}")
        pids = [int(pid) for pid in started.group(2).split(",")]
        for index, pid in RESTARTED.findall(text[started.end():]):
            pids[int(index)] = int(pid)
        return pids

    def supervised(self) -> bool:
        """Runs under a supervisor: several workers, or a cluster node (one worker too)."""
        return self.workers > 1 or "[cluster]" in self.config

    def pids(self) -> list[int]:
        """The supervisor (if any) then every worker."""
        if self.proc is None:
            return []
        workers = self.worker_pids()
        return [self.proc.pid, *workers] if self.supervised() else workers

    def kill_worker(self, index: int) -> int:
        """``kill -9`` one worker; the supervisor restarts it (``wait_worker_restarted``).
        Returns the pid killed."""
        pid = self.worker_pids()[index]
        os.kill(pid, signal.SIGKILL)
        return pid

    def pause_worker(self, index: int) -> int:
        """SIGSTOP one worker; return its pid once it is stopped."""
        pid = self.worker_pids()[index]
        os.kill(pid, signal.SIGSTOP)
        wait_for(lambda: process_state(pid) == "T", what=f"{self.name} worker {index} to stop")
        return pid

    def resume_worker(self, index: int) -> int:
        """SIGCONT one worker; return its pid once it runs again."""
        pid = self.worker_pids()[index]
        os.kill(pid, signal.SIGCONT)
        wait_for(lambda: process_state(pid) != "T", what=f"{self.name} worker {index} to go on")
        return pid

    def wait_worker_restarted(self, index: int, old_pid: int, timeout: float = 30.0) -> int:
        """Wait until the supervisor logged worker ``index`` ready again with a pid other than
        ``old_pid``; return the new pid."""
        def restarted() -> int | None:
            pid = self.worker_pids()[index]
            return pid if pid != old_pid else None
        return int(wait_for(restarted, timeout=timeout, what=f"{self.name} worker {index} back"))


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (``T`` stopped, ``Z`` zombie); ``X`` if gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(") ", 1)[1][0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return "X"


def _alive(pid: int) -> bool:
    return process_state(pid) not in "ZX"  # a zombie is dead, only not reaped yet


@dataclass
class Nodes:
    """The nodes of one test; ``nodes[i]`` or ``nodes["n1"]``."""

    members: list[Node]

    def __getitem__(self, key: int | str) -> Node:
        if isinstance(key, int):
            return self.members[key]
        return next(node for node in self.members if node.name == key)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.members)

    def __len__(self) -> int:
        return len(self.members)

    def stop_all(self) -> None:
        """Stop every node (continued first if paused); errors of one do not spare the rest."""
        for node in self.members:
            try:
                node.stop()
            except Exception:
                if node.proc is not None and node.proc.poll() is None:
                    node.proc.kill()


ConfigFor = str | Callable[[int], str]


@contextmanager
def start_nodes(root: Path, count: int, config: ConfigFor = "", workers: int = 1,
                bind: str = "127.0.0.1", launchers: Sequence[Sequence[str]] = (),
                prefix: str = "n") -> Iterator[Nodes]:
    """Start ``count`` nodes under ``root`` (``root/n1``, ``root/n2``...), yield them, and stop
    every one on the way out, passed or failed.

    ``config`` is the TOML text of every node, or a function of the node's index (0-based);
    ``launchers[i]``, when given, prefixes node ``i``'s command (a network namespace).
    """
    nodes = Nodes([])
    try:
        for i in range(count):
            text = config(i) if callable(config) else config
            launcher = launchers[i] if i < len(launchers) else ()
            node = Node(f"{prefix}{i + 1}", root / f"{prefix}{i + 1}", text, workers, bind,
                        launcher)
            nodes.members.append(node)
            node.start()
        yield nodes
    finally:
        nodes.stop_all()
