"""The supervisor of a node with ``server.workers`` above 1: it starts and keeps N workers.

Theory of operation
-------------------
Ports. Before any worker exists the supervisor checks each enabled listener's address with a
bind without SO_REUSEPORT (as a single-process node binds): it fails when any other socket
listens on or holds the address, another node's included, so a port in use stops the node with
the same line as with one worker, instead of being shared. Then it binds one socket per
listener with SO_REUSEPORT and keeps it bound, never listening, for as long as it runs. For
port 0 the check is where the port that all workers share gets chosen; the workers'
configuration carries the concrete ports. A bound socket that does not listen receives no
connections, but it keeps the port in the node's hands while a worker restarts (it has no
SO_REUSEADDR, so another node's check fails on it too). Every worker listens on every port with
SO_REUSEPORT and the kernel spreads new connections over the listening sockets.

Files. The password, ACL and TLS files and the data directory (``prepare_data_dir``: a
directory this process can write in, created if missing) are checked once before forking, so a
bad one gives one error line and exit status 2, not one line per worker.

Workers. The supervisor forks (``os.fork``, while it has no thread and no event loop) one child
per ``WorkerSpec(index, count, token)``; the random token is shared by the node's workers (it
names their link sockets). A child asks the kernel to SIGKILL it when the supervisor dies
(PR_SET_PDEATHSIG), drops the supervisor's sockets, pipes and signal handlers and runs
``run_worker``. It never returns into the supervisor's code: it ends in ``os._exit``.

Readiness. Each child has a pipe; its ``ready()`` writes one byte once the worker listens. The
supervisor waits in ``select`` on those pipes and on its signal wakeup pipe
(``signal.set_wakeup_fd``: every signal, SIGCHLD included, wakes it) and reaps children with
``waitpid(WNOHANG)``. When all are ready it writes the port file and logs one line. A worker
that exits before that stops the node with the worker's exit status (it logged why).

Running. SIGTERM or SIGINT: SIGTERM to every worker, wait for them (SIGKILL after 30 s), exit 0.
SIGHUP: passed on to every ready worker (a worker still starting reads the files anyway, and
SIGHUP would kill it). A worker that exits on its own is logged and started again with the same
spec after a backoff (0.2 s, doubling up to 5 s, per worker, from its crashes of the last 60 s);
more than 10 crashes in 60 s stop the node with exit status 1.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import os
import secrets
import select
import signal
import socket
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from meshmq.auth.acl import read_acl_file
from meshmq.auth.passwords import read_password_file
from meshmq.broker.persistence import parse_fsync_rules
from meshmq.broker.transport.certificates import build_server_context
from meshmq.broker.transport.listeners import listener_specs
from meshmq.cluster.spec import WorkerSpec, share_node_limits
from meshmq.config import BrokerConfig, split_listen
from meshmq.log.commit_log import lock_node_log
from meshmq.log.errors import LogError
from meshmq.logsetup import set_worker
from meshmq.node.identity import prepare_identity, raft_secret, read_identity, read_secret
from meshmq.node.reload import ConfigReloader, ConfigSource
from meshmq.node.server import run_worker
from meshmq.node.startup import (
    CANNOT_START,
    StartupError,
    log_unusable,
    prepare_data_dir,
    starting,
)

log = logging.getLogger("meshmq.supervisor")

METADATA = -1  # the metadata voter's slot among the supervisor's children
RAFT_PORT_TRIES = 50  # cluster ports drawn (port 0) before one whose next port is free too

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)
START_FAILURE_GRACE = 10.0  # seconds the other workers get to stop when one fails to start
SHUTDOWN_GRACE = 30.0  # seconds the workers get to stop on SIGTERM before SIGKILL
FIRST_BACKOFF = 0.2
MAX_BACKOFF = 5.0
CRASH_WINDOW = 60.0
CRASH_BUDGET = 10  # crashes allowed within CRASH_WINDOW; one more stops the node
RECHECK = 1.0  # longest wait in select: children are reaped even if a wakeup byte was lost
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class ReservationError(StartupError):
    """A listener's port cannot be bound; the message is one line naming it (exit status 1)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, CANNOT_START)


# ---------------------------------------------------------------------- ports


def reserve_ports(config: BrokerConfig) -> tuple[BrokerConfig, list[socket.socket]]:
    """Bind (without listening) one socket per enabled listener; return the workers' config,
    with the concrete ports, and the sockets, which the caller keeps open while workers run."""
    sockets: list[socket.socket] = []
    ports: dict[str, int] = {}
    taken: dict[tuple[object, ...], str] = {}
    try:
        for spec in listener_specs(config):
            family, address = _resolve(spec.name, spec.bind, spec.port)
            where = (family, *address[:2])
            if spec.port and where in taken:  # our own check would fail on it: say why
                raise ReservationError(
                    f"cannot listen listener={spec.name} bind={spec.bind} port={spec.port}"
                    f" error=the port of listener {taken[where]}")
            sock = _reserve(spec.name, spec.bind, spec.port, family, address)
            sockets.append(sock)
            taken[(family, *sock.getsockname()[:2])] = spec.name
            ports[spec.name] = sock.getsockname()[1]
        config = _reserve_admin(config, sockets)
        config = _reserve_cluster(config, sockets)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return with_ports(config, ports), sockets


def _reserve_admin(config: BrokerConfig, sockets: list[socket.socket]) -> BrokerConfig:
    """Hold the admin listener's port as the MQTT ones are: worker 0 serves it (node/admin/),
    and it stays ours, with the same number, while worker 0 restarts."""
    if not config.admin.listen:
        return config
    host, port = split_listen(config.admin.listen)
    family, address = _resolve("admin", host, port)
    sock = _reserve("admin", host, port, family, address)
    sockets.append(sock)
    listen = f"[{host}]" if ":" in host else host
    admin = dataclasses.replace(config.admin, listen=f"{listen}:{sock.getsockname()[1]}")
    return dataclasses.replace(config, admin=admin)


def _reserve_cluster(config: BrokerConfig, sockets: list[socket.socket]) -> BrokerConfig:
    """Hold the cluster port as the MQTT ones are: every worker listens on it
    (cluster/tcplinks.py), and port 0 becomes one concrete port for all of them (and what
    other nodes dial, unless cluster.advertise says otherwise)."""
    cluster = config.cluster
    if not cluster.enabled:
        return config
    host, port = split_listen(cluster.listen)
    family, address = _resolve("cluster", host, port)
    sock = _reserve("cluster", host, port, family, address)
    for _ in range(RAFT_PORT_TRIES if port == 0 and cluster.metadata else 0):
        # the metadata voter listens on the cluster port + 1 (cluster/metaproc.py): with
        # port 0, draw a cluster port whose next one is free too
        if _free(family, address, sock.getsockname()[1] + 1):
            break
        sock.close()
        sock = _reserve("cluster", host, port, family, address)
    sockets.append(sock)
    shown = f"[{host}]" if ":" in host else host
    listen = f"{shown}:{sock.getsockname()[1]}"
    return dataclasses.replace(config, cluster=dataclasses.replace(cluster, listen=listen))


def _free(family: int, address: tuple[object, ...], port: int) -> bool:
    """Can a listener bind ``port`` on ``address``'s host now (checked, not held)?"""
    if port > 65535:
        return False
    probe = socket.socket(family, socket.SOCK_STREAM)
    try:
        probe.bind((address[0], port, *address[2:]))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _resolve(name: str, bind: str, port: int) -> tuple[int, tuple[object, ...]]:
    """The address family and socket address a listener binds (the first getaddrinfo gives)."""
    try:
        family, _, _, _, address = socket.getaddrinfo(
            bind or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError as exc:
        raise ReservationError(_bind_error(name, bind, port, exc)) from None
    return family, address


def _reserve(name: str, bind: str, port: int, family: int,
             address: tuple[object, ...]) -> socket.socket:
    """The node's socket for one listener: the address checked free, then bound for sharing."""
    with _bound(name, bind, port, family, address, reuse_port=False) as probe:
        # Without SO_REUSEPORT this bind fails (EADDRINUSE) as a single-process node's
        # listener would, when another socket listens on or holds the address; with it, a
        # second node of the same user would silently share the port. Port 0 is chosen here.
        address = (address[0], probe.getsockname()[1], *address[2:])
    try:
        # SO_REUSEPORT without SO_REUSEADDR: our workers can join, and another node's probe
        # fails even while none of our workers listens (starting, or all restarting).
        return _bound(name, bind, port, family, address, reuse_port=True, reuse_address=False)
    except ReservationError:
        # Only leftovers of closed connections on the port (TIME_WAIT of a listener without
        # SO_REUSEPORT) can be in the way now, and SO_REUSEADDR exists for those.
        return _bound(name, bind, port, family, address, reuse_port=True)


def _bound(name: str, bind: str, port: int, family: int, address: tuple[object, ...],
           reuse_port: bool, reuse_address: bool = True) -> socket.socket:
    """A TCP socket bound (not listening) to ``address``; ReservationError if it cannot be."""
    try:
        sock = socket.socket(family, socket.SOCK_STREAM)
    except OSError as exc:
        raise ReservationError(_bind_error(name, bind, port, exc)) from None
    try:
        if reuse_address:  # as asyncio's listeners do
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:  # as asyncio's listeners do: IPv6 only
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ReservationError(_bind_error(name, bind, port, exc)) from None
    return sock


def _bind_error(name: str, bind: str, port: int, exc: OSError) -> str:
    return (f"cannot listen listener={name} bind={bind} port={port}"
            f" error={exc.strerror or exc!s}")


def with_ports(config: BrokerConfig, ports: dict[str, int]) -> BrokerConfig:
    """``config`` with each listener's port (by name: tcp, tls, ws, wss) replaced."""
    sections = {"tcp": "server", "tls": "tls", "ws": "ws", "wss": "wss"}
    changes = {
        sections[name]: dataclasses.replace(getattr(config, sections[name]), port=port)
        for name, port in ports.items()
    }
    return dataclasses.replace(config, **changes)


def port_file_text(config: BrokerConfig) -> str:
    """The port file (as ``Listeners.port_file_text``): the TCP port, then ``name=port``."""
    specs = listener_specs(config)
    lines = [str(config.server.port)] + [f"{spec.name}={spec.port}" for spec in specs]
    if config.admin.listen:
        lines.append(f"admin={split_listen(config.admin.listen)[1]}")
    if config.cluster.enabled:
        lines.append(f"cluster={split_listen(config.cluster.listen)[1]}")
    return "\n".join(lines) + "\n"


def check_files(config: BrokerConfig) -> None:
    """Load the password, ACL and TLS files once, as every worker will; raises their error."""
    if config.auth.password_file:
        read_password_file(config.auth.password_file)
    if config.auth.acl_file:
        read_acl_file(config.auth.acl_file)
    if any(spec.tls for spec in listener_specs(config)):
        build_server_context(config.tls)
    parse_fsync_rules(config.log.fsync_rules)  # every worker opens log partitions
    read_secret(config)
    if config.cluster.enabled and config.cluster.metadata:
        raft_secret(config)


def lock_log(config: BrokerConfig) -> int | None:
    """With ``log.enabled``: take the node's commit log lock (each worker opens the partitions
    it leads); its fd, to close when the node stops. ``StartupError`` if the log is unusable."""
    if not config.log.enabled:
        return None
    try:
        return lock_node_log(config.server.data_dir, config.log.partitions)
    except LogError as exc:
        raise log_unusable(exc, config.server.data_dir) from None


# ---------------------------------------------------------------------- crashes


class CrashHistory:
    """The crashes of the last ``window`` seconds: restart backoff and the crash budget."""

    def __init__(self, window: float = CRASH_WINDOW, budget: int = CRASH_BUDGET) -> None:
        self.window = window
        self.budget = budget
        self.crashes: deque[tuple[float, int]] = deque()  # (time, worker index)

    def record(self, index: int, now: float) -> float | None:
        """Note a crash of worker ``index``; return the delay before starting it again, or
        None when the budget is spent (the caller stops the node)."""
        while self.crashes and self.crashes[0][0] <= now - self.window:
            self.crashes.popleft()
        self.crashes.append((now, index))
        if len(self.crashes) > self.budget:
            return None
        own = sum(1 for _, crashed in self.crashes if crashed == index)
        return min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (own - 1))


# ---------------------------------------------------------------------- workers


@dataclass
class Worker:
    """One worker slot: its spec and, while a process runs it, the pid and the ready pipe."""

    spec: WorkerSpec
    pid: int | None = None
    ready_fd: int | None = None  # read end of the pipe ``ready()`` writes to; None once read
    ready: bool = False
    restart_at: float | None = None  # monotonic time of a pending restart


@dataclass(frozen=True, slots=True)
class Exited:
    """A reaped worker process."""

    worker: Worker
    pid: int
    status: int  # as waitpid gives it


def describe_status(status: int) -> str:
    """``exit:3`` or ``signal:SIGKILL`` for a ``waitpid`` status."""
    if os.WIFSIGNALED(status):
        return f"signal:{signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit:{os.waitstatus_to_exitcode(status)}"


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Supervisor:
    """Forks the workers, waits for them, forwards signals and restarts crashed workers."""

    def __init__(self, config: BrokerConfig, count: int, sockets: list[socket.socket],
                 log_lock: int | None = None, reloader: ConfigReloader | None = None) -> None:
        self.config = config  # the workers' configuration, with the concrete ports
        self.reloader = reloader  # each worker's, for SIGHUP (each worker reloads itself)
        self.sockets = sockets
        self.log_lock = log_lock  # the commit log's node-wide lock, held while workers run
        token = secrets.token_hex(8)
        self.workers = [Worker(WorkerSpec(index, count, token)) for index in range(count)]
        # the node's metadata voter (cluster/metaproc.py), supervised as a worker is
        self.metadata = Worker(WorkerSpec(METADATA, count, token)) if (
            config.cluster.enabled and config.cluster.metadata) else None
        self.crashes = CrashHistory()
        self.pid = os.getpid()
        self.started = False  # every worker was ready once (the port file is written)
        self.wakeup_read, self.wakeup_write = os.pipe()
        os.set_blocking(self.wakeup_read, False)
        os.set_blocking(self.wakeup_write, False)

    def run(self) -> int:
        """Start the workers and supervise them until told to stop; the exit status."""
        previous = {signum: signal.signal(signum, _note_signal) for signum in FORWARDED}
        old_wakeup = signal.set_wakeup_fd(self.wakeup_write)
        try:
            if self.metadata is not None:  # first: the workers connect to it
                self.spawn(self.metadata)
            for worker in self.workers:
                self.spawn(worker)
            failed = self.wait_started()
            if failed is not None:
                return failed
            self.announce()
            return self.supervise()
        except Exception:  # a bug or a failed fork: never leave workers behind
            log.exception("supervisor failed: stopping the workers")
            self.stop_all(START_FAILURE_GRACE)
            return 1
        finally:
            signal.set_wakeup_fd(old_wakeup)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            os.close(self.wakeup_read)
            os.close(self.wakeup_write)

    # ------------------------------------------------------------------ children

    def spawn(self, worker: Worker) -> None:
        """Fork a process running ``worker``'s spec; it reports on ``worker.ready_fd``."""
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            self.become_worker(worker.spec, write_fd)  # never returns
        os.close(write_fd)
        worker.pid, worker.ready_fd, worker.ready, worker.restart_at = pid, read_fd, False, None

    def become_worker(self, spec: WorkerSpec, ready_fd: int) -> None:
        """In the child: leave the supervisor's state behind, run the worker, exit."""
        code = 1
        try:
            _set_parent_death_signal()
            if os.getppid() != self.pid:  # the supervisor died before PDEATHSIG was set
                os._exit(1)
            signal.set_wakeup_fd(-1)
            for signum in FORWARDED:
                signal.signal(signum, signal.SIG_DFL)
            self.drop_inherited()
            if spec.index == METADATA:
                signal.signal(signal.SIGHUP, signal.SIG_IGN)  # nothing to reload
                _ready_writer(ready_fd)()  # workers reconnect until it serves
                code = run_metadata(self.config, spec.token, spec.count)
                return
            set_worker(spec.index)
            code = run_worker(self.config, spec, _ready_writer(ready_fd), self.reloader)
        except BaseException:
            log.exception("worker failed index=%d", spec.index)
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def drop_inherited(self) -> None:
        for sock in self.sockets:
            sock.close()
        if self.log_lock is not None:
            os.close(self.log_lock)  # the supervisor's copy keeps the lock
        for fd in (self.wakeup_read, self.wakeup_write):
            os.close(fd)
        for worker in self.children():
            if worker.ready_fd is not None:
                os.close(worker.ready_fd)

    def children(self) -> list[Worker]:
        """The workers, and the metadata voter if this node runs one."""
        return self.workers if self.metadata is None else [*self.workers, self.metadata]

    def live(self) -> list[Worker]:
        return [worker for worker in self.children() if worker.pid is not None]

    def signal_workers(self, signum: int, ready_only: bool = False) -> None:
        for worker in self.live():
            if worker.spec.index == METADATA and signum == signal.SIGHUP:
                continue
            if worker.pid is not None and (worker.ready or not ready_only):
                os.kill(worker.pid, signum)

    # ------------------------------------------------------------------ waiting

    def wait(self, timeout: float) -> tuple[list[int], list[Exited]]:
        """Wait up to ``timeout`` s for a signal, a ready byte or a child's exit; return the
        signals received and the workers that exited with their ``waitpid`` status."""
        watched = [w.ready_fd for w in self.children() if w.ready_fd is not None]
        readable, _, _ = select.select([self.wakeup_read, *watched], [], [], max(timeout, 0.0))
        signals = self.read_signals() if self.wakeup_read in readable else []
        for worker in self.children():
            if worker.ready_fd is not None and worker.ready_fd in readable:
                self.read_ready(worker)
        return signals, self.reap()

    def read_signals(self) -> list[int]:
        received = b""
        while True:
            try:
                chunk = os.read(self.wakeup_read, 512)
            except BlockingIOError:
                break
            if not chunk:
                break
            received += chunk
        return list(received)

    def read_ready(self, worker: Worker) -> None:
        assert worker.ready_fd is not None
        worker.ready = bool(os.read(worker.ready_fd, 16))  # b"": it died before ready
        os.close(worker.ready_fd)
        worker.ready_fd = None
        if worker.ready and self.started:
            if worker.spec.index == METADATA:
                log.info("metadata voter restarted pid=%s", worker.pid)
            else:
                log.info("worker restarted index=%d pid=%s", worker.spec.index, worker.pid)

    def reap(self) -> list[Exited]:
        exited = []
        for worker in self.live():
            assert worker.pid is not None
            pid, status = os.waitpid(worker.pid, os.WNOHANG)
            if pid == 0:
                continue
            exited.append(Exited(worker, pid, status))
            if worker.ready_fd is not None:
                os.close(worker.ready_fd)
            worker.pid, worker.ready_fd = None, None
        return exited

    # ------------------------------------------------------------------ phases

    def wait_started(self) -> int | None:
        """Wait until every worker is ready; None then, else the node's exit status."""
        while not all(worker.ready for worker in self.workers):
            signals, exited = self.wait(RECHECK)
            if signal.SIGTERM in signals or signal.SIGINT in signals:
                log.info("stopping before every worker was ready")
                self.stop_all(SHUTDOWN_GRACE)
                return 0
            if signal.SIGHUP in signals:
                self.signal_workers(signal.SIGHUP, ready_only=True)
            if exited:
                self.stop_all(START_FAILURE_GRACE)
                return self.start_failure(exited[0])
        return None

    def start_failure(self, exited: Exited) -> int:
        code = os.waitstatus_to_exitcode(exited.status)
        if code > 0:
            return code  # the worker logged why
        log.error("worker exited before it was ready index=%d pid=%d status=%s",
                  exited.worker.spec.index, exited.pid, describe_status(exited.status))
        return 1

    def announce(self) -> None:
        """All workers listen: log the started line (with the workers' pids), then write the
        port file, so that whoever waits for the file finds the line."""
        pids = ",".join(str(worker.pid) for worker in self.workers)
        log.info("workers started count=%d pids=%s port=%d", len(self.workers), pids,
                 self.config.server.port)
        port_file = self.config.server.port_file
        if port_file:
            tmp = f"{port_file}.tmp"
            with open(tmp, "w") as out:
                out.write(port_file_text(self.config))
            os.replace(tmp, port_file)  # readers never see a half-written file
        self.started = True

    def reload(self) -> None:
        """SIGHUP: take what the workers take (quietly: they log it), so that a worker started
        again later runs with it too, and follow ``server.log_level``."""
        if self.reloader is None:
            return
        config = self.reloader.plan(self.config, report=False)
        if config is not None:
            self.config = config
            logging.getLogger().setLevel(config.server.log_level.upper())

    def supervise(self) -> int:
        """Forward signals and restart crashed workers until SIGTERM/SIGINT; exit status."""
        while True:
            signals, exited = self.wait(self.next_timeout())
            if signal.SIGTERM in signals or signal.SIGINT in signals:
                log.info("stopping workers count=%d", len(self.live()))
                self.stop_all(SHUTDOWN_GRACE)
                return 0
            if signal.SIGHUP in signals:
                self.signal_workers(signal.SIGHUP, ready_only=True)
                self.reload()
            if not all(self.schedule_restart(one) for one in exited):
                self.stop_all(SHUTDOWN_GRACE)
                return 1
            self.restart_due()

    def next_timeout(self) -> float:
        due = [w.restart_at for w in self.children() if w.restart_at is not None]
        return min([RECHECK, *(at - time.monotonic() for at in due)])

    def schedule_restart(self, exited: Exited) -> bool:
        """A worker exited on its own: plan its restart; False if workers crash too often."""
        worker = exited.worker
        if worker.spec.index == METADATA:
            log.error("metadata voter exited unexpectedly pid=%d status=%s", exited.pid,
                      describe_status(exited.status))
        else:
            log.error("worker exited unexpectedly index=%d pid=%d status=%s",
                      worker.spec.index, exited.pid, describe_status(exited.status))
        delay = self.crashes.record(worker.spec.index, time.monotonic())
        if delay is None:
            log.error("workers crashed more than %d times in %.0f s: stopping", CRASH_BUDGET,
                      CRASH_WINDOW)
            return False
        worker.restart_at = time.monotonic() + delay
        return True

    def restart_due(self) -> None:
        now = time.monotonic()
        for worker in self.children():
            if worker.restart_at is not None and worker.restart_at <= now:
                self.spawn(worker)

    def stop_all(self, grace: float) -> None:
        """SIGTERM every worker, wait up to ``grace`` s, then SIGKILL and reap the rest."""
        for worker in self.children():
            worker.restart_at = None
        self.signal_workers(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while self.live() and time.monotonic() < deadline:
            self.wait(min(RECHECK, deadline - time.monotonic()))
        for worker in self.live():
            assert worker.pid is not None
            log.error("worker did not stop in time index=%d pid=%d: SIGKILL", worker.spec.index,
                      worker.pid)
            os.kill(worker.pid, signal.SIGKILL)
            os.waitpid(worker.pid, 0)
            worker.pid = None


def run_metadata(config: BrokerConfig, token: str, workers: int) -> int:
    """In the metadata voter's process: its Raft on the cluster port + 1 (the seeds' likewise:
    the voters), serving this node's workers on a socket named by the node's token, and the
    node's agent in the metadata (cluster/controller.py): its member record, and the
    controller's work while this voter leads."""
    from meshmq.cluster.controller import Agent
    from meshmq.cluster.metadata import Member
    from meshmq.cluster.metaproc import MetaService, raft_address_for, socket_name_for
    from meshmq.cluster.raftstore import MetaStartError

    cluster = config.cluster
    host, port = split_listen(cluster.listen)
    raft = raft_address_for(cluster.advertised)
    service = MetaService(
        cluster.node_id, raft, [raft_address_for(seed) for seed in cluster.seeds],
        Path(config.server.data_dir), socket_name_for(token), raft_secret(config),
        bind=raft_address_for(f"{host}:{port}"))
    loop_clock = time.monotonic
    agent = Agent(service.store, Member(cluster.node_id, raft, cluster.advertised, workers),
                  workers, config.log.partitions, lambda: len(service.store.voters),
                  lambda: service.store.status().state == "leader", loop_clock,
                  lambda: service.leaving,
                  lambda: str((read_identity(config.server.data_dir) or {}).get("cluster_id")
                              or ""))

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        async with asyncio.TaskGroup() as group:
            group.create_task(service.serve(stop))
            await asyncio.sleep(0)
            group.create_task(agent.run(stop))

    failed: list[MetaStartError] = []
    try:
        asyncio.run(serve())
    except* MetaStartError as errors:
        failed += [e for e in errors.exceptions if isinstance(e, MetaStartError)]
    if failed:
        log.error("%s", failed[0])
        return failed[0].exit_status
    return 0


def _note_signal(signum: int, frame: object) -> None:
    """Signals are read from the wakeup pipe; a Python handler makes CPython write them there."""


def _ready_writer(fd: int) -> Callable[[], None]:
    def ready() -> None:
        try:
            os.write(fd, b"r")
        except OSError:  # the supervisor is gone (PDEATHSIG will end this process)
            pass

    return ready


def supervise(config: BrokerConfig, count: int, source: ConfigSource | None = None) -> int:
    """Run a node of ``count`` worker processes until SIGTERM or SIGINT; the exit status.

    ``source``: where ``config`` came from; on SIGHUP each worker reads it again.

    Blocking, and must be called from the main thread of a process that has no other thread.
    """
    sockets: list[socket.socket] = []
    try:
        with starting(config.server.data_dir):
            check_files(config)
            prepare_data_dir(config.server.data_dir)
            prepare_identity(config)
            worker_config, sockets = reserve_ports(config)
            worker_config = share_node_limits(worker_config, count)
        log_lock = lock_log(config)
    except StartupError as error:
        for sock in sockets:
            sock.close()
        log.error("%s", error)
        return error.exit_status
    try:
        reloader = None if source is None else ConfigReloader(
            source, config, lambda loaded: share_node_limits(loaded, count))
        return Supervisor(worker_config, count, sockets, log_lock, reloader).run()
    finally:
        for sock in sockets:
            sock.close()
        if log_lock is not None:
            os.close(log_lock)
