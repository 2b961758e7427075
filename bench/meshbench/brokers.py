"""Start meshmq or Mosquitto for one scenario: pinned, on an ephemeral 127.0.0.1 port.

Both run under ``taskset -c CPUS`` (taskset execs the broker, so the pid we hold is the
broker's own and /proc/<pid> tells its CPU time and resident memory). meshmq with
``server.workers`` above 1 is a supervisor and N worker processes: the broker's figures are then
the sum over the supervisor and its workers (``RunningBroker.workers``, found once the node is
ready), and ``worker_stats()`` gives each worker's own.

* meshmq: ``python -m meshmq serve`` with a TOML file built from the scenario's settings
  (``BASE_MESHMQ`` plus overrides), ``--port 0`` and ``--port-file`` to learn the port, and a
  temporary data directory on the same disk as /tmp.
* Mosquitto: the Debian package's ``mosquitto`` with a generated file: one listener on
  127.0.0.1 at a port we picked free, ``max_queued_messages 0`` (no limit: its default of 1000
  silently drops QoS 1 messages to a busy subscriber), ``max_inflight_messages`` equal to
  meshmq's, TCP_NODELAY like meshmq, persistence and logging off.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from meshbench import BenchError
from meshbench.secure import Certificate

INFLIGHT = 1024  # both brokers: unacknowledged QoS 1 messages to one subscriber
START_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

# meshmq settings for every scenario (dotted keys; see docs/configuration.md).
BASE_MESHMQ: dict[str, object] = {
    "server.log_level": "warning",
    "server.workers": 1,  # the one-core comparison; the workers scenario sets its own
    # limits.connect_* at their defaults: a burst of 20,000 CONNECTs lets the 10,000-client
    # storms in (until issue 13 the default burst of 1,000 refused most, so runs set rate 0).
    "session.max_inflight_messages": INFLIGHT,
}
# Lossless queues, like Mosquitto's max_queued_messages 0, for the QoS 1 scenarios.
LOSSLESS_MESHMQ: dict[str, object] = {
    "session.max_queued_messages": 10_000_000,
    "session.max_queued_bytes": 4 * 1024**3,
}


@dataclass(frozen=True)
class ProcStats:
    """One process so far: CPU seconds used (user + system), seconds its threads spent
    runnable but waiting for a CPU (the scheduler's run delay: high on a shared machine), and
    resident memory. ``syscalls``: read- and write-type system calls so far (/proc/<pid>/io
    syscr + syscw, every thread); ``wakeups``: voluntary context switches of the main thread
    (an event loop going to sleep in epoll and waking up again). Both show how well work is
    batched: fewer per message is bigger batches."""

    cpu_s: float
    rss_kb: int
    wait_s: float = 0.0
    syscalls: int = 0
    wakeups: int = 0


def proc_stats(pid: int) -> ProcStats:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)
    rss = wakeups = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("voluntary_ctxt_switches:"):
                wakeups = int(line.split()[1])
    return ProcStats(cpu, rss, run_delay(pid), io_syscalls(pid), wakeups)


def io_syscalls(pid: int) -> int:
    """syscr + syscw of /proc/<pid>/io (0 when it cannot be read)."""
    total = 0
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith(("syscr:", "syscw:")):
                    total += int(line.split()[1])
    except OSError:
        return 0
    return total


def run_delay(pid: int) -> float:
    """Seconds the threads of ``pid`` waited on a run queue (/proc/.../schedstat, 2nd field);
    0.0 when the kernel does not keep scheduler statistics."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # a thread that just ended, or no schedstat
    return total / 1e9


def add_stats(parts: list[ProcStats]) -> ProcStats:
    """Several processes as one: CPU, run-queue wait and RSS added up (pages two processes
    share, like a forked worker's copy-on-write heap, count twice)."""
    return ProcStats(sum(p.cpu_s for p in parts), sum(p.rss_kb for p in parts),
                     sum(p.wait_s for p in parts), sum(p.syscalls for p in parts),
                     sum(p.wakeups for p in parts))


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid``, in pid order (from /proc/<pid>/stat of every
    process: this kernel has no /proc/<pid>/task/<tid>/children)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it just ended
        if int(fields[1]) == pid:  # field 4, ppid
            found.append(int(entry))
    return sorted(found)


def socket_inodes(pid: int) -> dict[int, int]:
    """fd -> socket inode for the sockets process ``pid`` holds."""
    inodes = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return {}
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes[int(fd)] = int(target[8:-1])
    return inodes


def worker_indexes(pids: list[int]) -> dict[int, int]:
    """worker index -> pid: the worker that listens on the abstract unix socket
    ``@meshmq-<token>-<index>`` (cluster/spec.py) is worker ``index``. Pids whose socket is
    not found (not meshmq workers, or not listening yet) are left out."""
    listening: dict[int, int] = {}  # inode -> index
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            parts = line.split()
            # Num RefCount Protocol Flags Type St Inode Path; flags 0x10000 = listening
            if len(parts) < 8 or not parts[7].startswith("@meshmq-"):
                continue
            if int(parts[3], 16) & 0x10000:
                index = parts[7].rsplit("-", 1)[1]
                if index.isdigit():
                    listening[int(parts[6])] = int(index)
    found = {}
    for pid in pids:
        for inode in socket_inodes(pid).values():
            if inode in listening:
                found[listening[inode]] = pid
                break
    return dict(sorted(found.items()))


def host_cpu() -> tuple[float, float]:
    """(busy, steal) CPU seconds of the whole machine so far, all CPUs (/proc/stat): busy is
    user + nice + system + irq + softirq + steal; steal is time the hypervisor gave away."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    busy = user + nice + system + irq + softirq + steal
    return busy / CLOCK_TICKS, steal / CLOCK_TICKS


def host_io_stall(path: str = "/proc/pressure/io") -> float | None:
    """Seconds so far in which every runnable task of the machine waited for I/O (the kernel's
    pressure stall information, "full" line), or None where the kernel does not keep it. It
    counts a broker waiting for its own fsync while nothing else runs, too."""
    try:
        with open(path) as f:
            for line in f:
                kind, *fields = line.split()
                if kind == "full":
                    total = dict(field.split("=", 1) for field in fields)["total"]
                    return int(total) / 1e6
    except (OSError, KeyError, ValueError):
        return None
    return None


@dataclass
class RunningBroker:
    """One broker process; ``stop()`` it when done (it is also stopped on error paths)."""

    name: str
    proc: subprocess.Popen
    port: int
    log_path: Path
    workers: dict[int, int] = field(default_factory=dict)  # index -> pid (server.workers > 1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stats(self) -> ProcStats:
        """This broker so far: its process plus, for a meshmq node, every worker."""
        own = proc_stats(self.proc.pid)
        if not self.workers:
            return own
        return add_stats([own, *self.worker_stats().values()])

    def worker_stats(self) -> dict[int, ProcStats]:
        """index -> that worker's figures (a worker that ended is left out)."""
        found = {}
        for index, pid in self.workers.items():
            try:
                found[index] = proc_stats(pid)
            except OSError:
                continue
        return found

    def workers_alive(self) -> bool:
        """Every worker found at start is still the same process (none was restarted)."""
        children = set(child_pids(self.proc.pid))
        return all(pid in children for pid in self.workers.values())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def pinned(cpus: str | None, cmd: list[str]) -> list[str]:
    """``cmd`` under ``taskset -c cpus`` (or as is when ``cpus`` is None)."""
    if cpus is None:
        return cmd
    taskset = shutil.which("taskset")
    if taskset is None:
        raise BenchError("taskset not found (Debian package util-linux)")
    return [taskset, "-c", cpus, *cmd]


def toml_text(settings: dict[str, object]) -> str:
    """Dotted ``table.key`` settings as a TOML document."""
    tables: dict[str, list[str]] = {}
    for dotted, value in settings.items():
        table, key = dotted.split(".", 1)
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, int | float):
            text = str(value)
        else:
            text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
        tables.setdefault(table, []).append(f"{key} = {text}")
    return "".join(f"[{t}]\n" + "\n".join(lines) + "\n\n" for t, lines in tables.items())


def secure_meshmq(password_file: Path | None, cert: Certificate | None) -> dict[str, object]:
    """meshmq settings for a password file (anonymous clients refused, as Mosquitto's
    ``allow_anonymous false``) and a TLS 1.3 listener on a free port."""
    settings: dict[str, object] = {}
    if password_file is not None:
        settings |= {"auth.password_file": str(password_file), "auth.anonymous": "deny"}
    if cert is not None:
        settings |= {"tls.enabled": True, "tls.port": 0, "tls.certfile": str(cert.certfile),
                     "tls.keyfile": str(cert.keyfile), "tls.min_version": "1.3"}
    return settings


def start_meshmq(workdir: Path, settings: dict[str, object], cpus: str | None,
                 password_file: Path | None = None, cert: Certificate | None = None,
                 ) -> RunningBroker:
    """meshmq with ``settings``; with ``cert`` the port measured is the TLS listener's."""
    config = workdir / "meshmq.toml"
    config.write_text(toml_text({**BASE_MESHMQ, **secure_meshmq(password_file, cert),
                                 **settings}))
    port_file = workdir / "port"
    log_path = workdir / "meshmq.log"
    cmd = [sys.executable, "-m", "meshmq", "serve", "--config", str(config), "--bind",
           "127.0.0.1", "--port", "0", "--data-dir", str(workdir / "data"),
           "--port-file", str(port_file)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(pinned(cpus, cmd), stdout=log, stderr=subprocess.STDOUT)
    broker = RunningBroker("meshmq", proc, 0, log_path)
    deadline = time.monotonic() + START_TIMEOUT
    while not (port_file.exists() and port_file.read_text().strip()):
        if not broker.alive():
            raise BenchError(f"meshmq exited with {proc.returncode}: {broker.log_tail()}")
        if time.monotonic() > deadline:
            broker.stop()
            raise BenchError("meshmq did not listen within 30 s")
        time.sleep(0.02)  # polling the port file, not timing anything
    ports = port_file.read_text().split()
    broker.port = int(ports[0])
    if cert is not None:  # "tls=PORT" (docs/workers.md: the port file)
        broker.port = int(next(p for p in ports if p.startswith("tls="))[4:])
    workers = {**BASE_MESHMQ, **settings}["server.workers"]
    if workers != 1:  # a supervisor (0: one worker per CPU); the port file means all are ready
        children = child_pids(proc.pid)
        broker.workers = worker_indexes(children)
        if not broker.workers or (isinstance(workers, int) and workers > 1
                                  and len(broker.workers) != workers):
            broker.stop()
            raise BenchError(f"meshmq: found {len(broker.workers)} of {workers} workers "
                             f"(children {children})")
    return broker


def commit_log_bytes(workdir: Path) -> int:
    """Bytes in the commit log's segment files (``*.log`` under ``data/log``) of a node that
    ``start_meshmq(workdir, ...)`` ran: with the log on, at least the payloads it persisted
    (records are stored uncompressed, docs/log-format.md). 0 with the log off."""
    return sum(f.stat().st_size for f in (workdir / "data" / "log").rglob("*.log")
               if f.is_file())


def find_mosquitto() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)),
        None,
    )


def ensure_mosquitto() -> str:
    """The mosquitto binary, installing the Debian package first if missing and allowed."""
    found = find_mosquitto()
    if found:
        return found
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BenchError("mosquitto not found: install the Debian package mosquitto "
                         "(apt-get install mosquitto) or run with --brokers meshmq")
    print("bench: installing the Debian package mosquitto", file=sys.stderr)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"],
                ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "mosquitto"]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise BenchError(f"{' '.join(cmd)} failed: {done.stderr.strip()[-300:]}")
    found = find_mosquitto()
    if not found:
        raise BenchError("apt-get installed mosquitto but no mosquitto binary was found")
    return found


def mosquitto_version(binary: str) -> str:
    done = subprocess.run([binary, "-h"], capture_output=True, text=True, check=False)
    first = (done.stdout or done.stderr).splitlines()
    return first[0].strip() if first else "unknown"


def mosquitto_conf(port: int, password_file: Path | None = None,
                   cert: Certificate | None = None) -> str:
    secure: tuple[str, ...] = ()
    if password_file is not None:
        secure += (f"password_file {password_file}",)
    if cert is not None:
        secure += (f"certfile {cert.certfile}", f"keyfile {cert.keyfile}", "tls_version tlsv1.3")
    return "\n".join((
        f"listener {port} 127.0.0.1",
        *secure,
        f"allow_anonymous {'false' if password_file is not None else 'true'}",
        "max_queued_messages 0",  # no limit: lossless, like the meshmq settings above
        f"max_inflight_messages {INFLIGHT}",
        "persistence false",
        "log_dest none",
        "set_tcp_nodelay true",  # meshmq (asyncio) sets TCP_NODELAY too
        "",
    ))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def start_mosquitto(workdir: Path, binary: str, cpus: str | None,
                    password_file: Path | None = None, cert: Certificate | None = None,
                    ) -> RunningBroker:
    for _attempt in range(3):  # the port we picked may be taken before Mosquitto binds it
        port = free_port()
        config = workdir / "mosquitto.conf"
        config.write_text(mosquitto_conf(port, password_file, cert))
        log_path = workdir / "mosquitto.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(pinned(cpus, [binary, "-c", str(config)]), stdout=log,
                                    stderr=subprocess.STDOUT)
        broker = RunningBroker("mosquitto", proc, port, log_path)
        deadline = time.monotonic() + START_TIMEOUT
        while broker.alive() and not _listening(port):
            if time.monotonic() > deadline:
                broker.stop()
                raise BenchError("mosquitto did not listen within 30 s")
            time.sleep(0.02)  # polling the port, not timing anything
        if broker.alive():
            return broker
    raise BenchError(f"mosquitto exited with {proc.returncode}: {broker.log_tail()}")
