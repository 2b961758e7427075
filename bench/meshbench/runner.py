"""Run one scenario against one broker and turn what was measured into figures.

Sequence: start the broker (pinned), sample its memory, start the load generator (pinned
elsewhere) and follow its events: at ``window-start`` and ``window-end`` the broker's CPU time
and memory are read from /proc (and py-spy may sample it in between); at ``ready`` in the idle
scenario the broker's memory is read once it stops growing, then the generator is told to
disconnect. The generator's ``result`` line carries its own counts, validation and CPU use.

A meshmq node with several workers (``server.workers``) is measured as the sum of its processes;
each worker's CPU share, and which worker serves each connection (``placement``), are added.
The whole machine's busy CPU over the window is recorded too (``host_busy_pct``, all CPUs,
100 = one CPU), so a run on a shared machine says how much else was running; so are the time
the hypervisor gave away (``host_steal_pct``) and the time every task waited for I/O
(``host_io_stall_pct``, /proc/pressure/io, the broker's own fsyncs included), which the
health table shows: latency with fsync ``always`` follows the disk, and a run of a scenario
that stalled much more than its other runs shared the disk with other work.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshbench import BenchError, placement, profiling, secure
from meshbench.brokers import (
    ProcStats,
    RunningBroker,
    commit_log_bytes,
    host_cpu,
    host_io_stall,
    pinned,
    proc_stats,
    start_meshmq,
    start_mosquitto,
)
from meshbench.scenarios import Scenario, Timing

SETUP_ALLOWANCE = 120.0  # seconds for connecting and draining, on top of warm-up + window


@dataclass
class Context:
    """What every run needs: binaries, CPUs, protocol, timing, and where to put profiles."""

    loadgen: Path
    timing: Timing
    protocol: int = 4
    broker_cpus: str | None = "0"
    loadgen_cpus: str | None = "1"
    mosquitto: str | None = None
    profile: tuple[str, ...] = ()  # scenario names to profile (meshmq only)
    profile_dir: Path | None = None
    profiles: dict[str, dict[str, object]] = field(default_factory=dict)


@dataclass
class LoadgenRun:
    result: dict[str, object] | None
    error: str | None
    returncode: int


def drive_loadgen(cmd: list[str], on_event: Callable[[str, dict, subprocess.Popen], None],
                  timeout: float) -> LoadgenRun:
    """Run the generator, calling ``on_event(name, data, proc)`` for each ``event`` line."""
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    result: dict[str, object] | None = None
    error: str | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "event":
                name, _, data = rest.partition(" ")
                on_event(name, json.loads(data) if data else {}, proc)
            elif kind == "result":
                result = json.loads(rest)
            elif kind == "error":
                error = rest
        proc.wait()
    finally:
        killer.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode < 0 and error is None:
        error = f"load generator killed after {timeout:.0f} s"
    stderr = proc.stderr.read().strip() if proc.stderr else ""
    if error is None and result is None:
        error = stderr or f"load generator exited with {proc.returncode} and no result"
    return LoadgenRun(result, error, proc.returncode)


def settled_rss(broker: RunningBroker, limit: float = 5.0) -> int:
    """The broker's RSS once two reads 0.25 s apart differ by under 1% (or after ``limit``)."""
    previous = broker.stats().rss_kb
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        time.sleep(0.25)  # the harness, not a test: memory needs a moment to settle
        current = broker.stats().rss_kb
        if abs(current - previous) <= previous / 100:
            return current
        previous = current
    return previous


def broker_cpus(scenario: Scenario, ctx: Context) -> str | None:
    if ctx.broker_cpus is None:
        return None  # not pinned at all (--no-pin, tests)
    return scenario.broker_cpus or ctx.broker_cpus


def loadgen_cpus(scenario: Scenario, ctx: Context) -> str | None:
    return None if scenario.loadgen_unpinned else ctx.loadgen_cpus


def start_broker(name: str, scenario: Scenario, workdir: Path, ctx: Context) -> RunningBroker:
    cpus = broker_cpus(scenario, ctx)
    cert = secure.certificate(workdir) if scenario.tls else None
    if name == "meshmq":
        password_file = secure.meshmq_password_file(workdir) if scenario.auth else None
        return start_meshmq(workdir, scenario.meshmq, cpus, password_file, cert)
    if name == "mosquitto":
        if ctx.mosquitto is None:
            raise BenchError("mosquitto binary not set")
        password_file = secure.mosquitto_password_file(workdir) if scenario.auth else None
        return start_mosquitto(workdir, ctx.mosquitto, cpus, password_file, cert)
    raise BenchError(f"unknown broker {name!r}")


def run_one(scenario: Scenario, broker_name: str, ctx: Context) -> dict[str, object]:
    """Run ``scenario`` on a fresh ``broker_name``; return its figures and health."""
    workdir = Path(tempfile.mkdtemp(prefix=f"meshbench-{broker_name}-"))
    try:
        broker = start_broker(broker_name, scenario, workdir, ctx)
        try:
            outcome = _measure(scenario, broker, ctx)
        finally:
            broker.stop()
        if broker_name == "meshmq":
            outcome["log_bytes"] = commit_log_bytes(workdir)
        return outcome
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _measure(scenario: Scenario, broker: RunningBroker, ctx: Context) -> dict[str, object]:
    samples: dict[str, ProcStats] = {"start": broker.stats()}
    marks: dict[str, float] = {}
    spy: list[subprocess.Popen] = []
    profile_out = None
    if broker.name == "meshmq" and scenario.name in ctx.profile and ctx.profile_dir:
        profile_out = ctx.profile_dir / f"profile-{scenario.name}.txt"

    ready_data: dict[str, object] = {}
    lg_cpus = loadgen_cpus(scenario, ctx)
    per_worker: dict[str, dict[int, ProcStats]] = {}
    host: dict[str, tuple[float, float]] = {}
    io_stall: dict[str, float | None] = {}
    served_by: list[int] = []

    def on_event(name: str, data: dict, proc: subprocess.Popen) -> None:
        marks[name] = time.monotonic()
        if name in ("window-start", "window-end"):
            samples[name] = broker.stats()
            try:
                samples[f"loadgen-{name}"] = proc_stats(proc.pid)
            except OSError:
                pass  # it ended already
            host[name] = host_cpu()
            io_stall[name] = host_io_stall()
            if broker.workers:
                per_worker[name] = broker.worker_stats()
        if name == "window-start" and broker.workers and scenario.mode != "idle":
            served_by.extend(placement.client_workers(proc.pid, broker.port, broker.workers))
        if name == "window-start" and profile_out is not None:
            spy.append(profiling.start(_profiled_pid(broker), ctx.timing.duration, profile_out,
                                       lg_cpus))
        if name == "connecting":  # idle: the connect phase starts
            samples["connecting"] = broker.stats()
            host["connecting"] = host_cpu()
            if broker.workers:
                per_worker["connecting"] = broker.worker_stats()
            if profile_out is not None:  # stopped at "ready": the connect phase only
                spy.append(profiling.start(_profiled_pid(broker), 600, profile_out, lg_cpus))
        if name == "ready" and scenario.mode == "idle":
            connected = broker.stats()
            host["connected"] = host_cpu()
            if broker.workers:
                per_worker["connected"] = broker.worker_stats()
            for process in spy:
                profiling.stop(process)
            samples["connected"] = connected
            samples["ready"] = ProcStats(connected.cpu_s, settled_rss(broker))
            ready_data.update(data)
            assert proc.stdin is not None
            proc.stdin.close()  # the generator disconnects everyone and reports

    cmd = pinned(lg_cpus, [str(ctx.loadgen), "--port", str(broker.port),
                           *scenario.loadgen_args(ctx.timing, ctx.protocol)])
    timeout = ctx.timing.warmup + ctx.timing.duration + ctx.timing.drain + SETUP_ALLOWANCE
    run = drive_loadgen(cmd, on_event, timeout)
    samples["end"] = broker.stats() if broker.alive() else samples["start"]
    outcome = _figures(scenario, run, samples, marks, ready_data)
    if "connecting" in host and "connected" in host:
        _connect_phase(outcome["figures"], scenario, marks, host,  # type: ignore[arg-type]
                       per_worker)
    if "window-start" in host and "window-end" in host:
        wall = max(marks["window-end"] - marks["window-start"], 1e-9)
        (busy0, steal0), (busy1, steal1) = host["window-start"], host["window-end"]
        figures: dict[str, float] = outcome["figures"]  # type: ignore[assignment]
        figures["host_busy_pct"] = 100.0 * (busy1 - busy0) / wall
        figures["host_steal_pct"] = 100.0 * (steal1 - steal0) / wall
        stall0, stall1 = io_stall.get("window-start"), io_stall.get("window-end")
        if stall0 is not None and stall1 is not None:
            figures["host_io_stall_pct"] = 100.0 * (stall1 - stall0) / wall
        if broker.workers and "window-start" in per_worker and "window-end" in per_worker:
            w0, w1 = per_worker["window-start"], per_worker["window-end"]
            for index in sorted(w0.keys() & w1.keys()):
                figures[f"worker{index}_cpu_pct"] = 100.0 * (w1[index].cpu_s
                                                             - w0[index].cpu_s) / wall
    if broker.workers:
        outcome["workers"] = len(broker.workers)
        if served_by:
            outcome["placement"] = placement.summarise(
                scenario.topology, scenario.pubs, scenario.subs, served_by, len(broker.workers))
        if broker.alive() and not broker.workers_alive():
            outcome["ok"] = False
            outcome["problems"].append(  # type: ignore[union-attr]
                f"a worker was restarted during the run: {broker.log_tail(5)}")
    if not broker.alive():
        outcome["ok"] = False
        outcome["problems"].append(  # type: ignore[union-attr]
            f"{broker.name} died (exit {broker.proc.returncode}): {broker.log_tail(5)}")
    for process in spy:
        _, err = process.communicate(timeout=ctx.timing.duration + 60)
        if profile_out is not None and profile_out.exists():
            summary = profiling.summarise(profile_out)
            ctx.profiles[scenario.name] = summary
            outcome["profile"] = str(profile_out)
        else:
            outcome["problems"].append(f"py-spy failed: {err.strip()[-300:]}")  # type: ignore[union-attr]
    return outcome


def _profiled_pid(broker: RunningBroker) -> int:
    """The process py-spy samples: the broker, or worker 0 of a node of several."""
    return broker.workers.get(0, broker.pid) if broker.workers else broker.pid


def _connect_phase(figures: dict[str, float], scenario: Scenario, marks: dict[str, float],
                   host: dict[str, tuple[float, float]],
                   per_worker: dict[str, dict[int, ProcStats]]) -> None:
    """Idle: the whole machine's busy CPU while the clients connected and, with workers, each
    worker's CPU per connection and the rate the busiest one allows (CPU-bound conn/s)."""
    wall = max(marks["ready"] - marks["connecting"], 1e-9)
    figures["host_busy_pct"] = 100.0 * (host["connected"][0] - host["connecting"][0]) / wall
    w0, w1 = per_worker.get("connecting", {}), per_worker.get("connected", {})
    busiest = 0.0
    for index in sorted(w0.keys() & w1.keys()):
        cpu = w1[index].cpu_s - w0[index].cpu_s
        figures[f"worker{index}_cpu_pct"] = 100.0 * cpu / wall
        busiest = max(busiest, cpu)
    if busiest > 0 and scenario.conns:
        figures["connect_rate_cpu_bound"] = scenario.conns / busiest


def _figures(scenario: Scenario, run: LoadgenRun, samples: dict[str, ProcStats],
             marks: dict[str, float], ready: dict[str, object]) -> dict[str, object]:
    lg = run.result or {}
    problems: list[str] = []
    if run.error:
        problems.append(run.error)
    if lg.get("error"):
        problems.append(str(lg["error"]))
    figures: dict[str, float] = {}
    start, end = samples["start"], samples["end"]
    if scenario.mode == "idle":
        at = samples.get("ready")
        if at is not None and scenario.conns:
            figures["connect_rate"] = float(ready.get("connect_rate", 0.0))  # type: ignore[arg-type]
            figures["rss_per_conn_kb"] = (at.rss_kb - start.rss_kb) / scenario.conns
            figures["loadgen_cpu_pct"] = float(ready.get("loadgen_cpu_pct", 0.0))  # type: ignore[arg-type]
        c0, c1 = samples.get("connecting"), samples.get("connected")
        if c0 is not None and c1 is not None and scenario.conns:
            wall = max(marks["ready"] - marks["connecting"], 1e-9)
            cpu = c1.cpu_s - c0.cpu_s
            figures["connect_us"] = 1e6 * cpu / scenario.conns  # broker CPU per connection
            figures["broker_cpu_pct"] = 100.0 * cpu / wall
            figures["broker_wait_pct"] = 100.0 * (c1.wait_s - c0.wait_s) / wall
    elif "window-start" in samples and "window-end" in samples:
        s0, s1 = samples["window-start"], samples["window-end"]
        wall = marks["window-end"] - marks["window-start"]
        cpu = s1.cpu_s - s0.cpu_s
        wall = wall if wall > 0 else 1e-9
        figures["broker_cpu_pct"] = 100.0 * cpu / wall
        figures["broker_wait_pct"] = 100.0 * (s1.wait_s - s0.wait_s) / wall
        figures["loadgen_cpu_pct"] = float(lg.get("loadgen_cpu_pct", 0.0))  # type: ignore[arg-type]
        g0, g1 = samples.get("loadgen-window-start"), samples.get("loadgen-window-end")
        if g0 is not None and g1 is not None:
            figures["loadgen_wait_pct"] = 100.0 * (g1.wait_s - g0.wait_s) / wall
        figures["rss_mb"] = end.rss_kb / 1024
        figures["rate"] = float(lg.get("delivery_rate", 0.0))  # type: ignore[arg-type]
        if scenario.mode in ("latency", "storm"):
            for key in ("p50_us", "p99_us", "p999_us", "max_us"):
                figures[key] = float(lg.get(key, 0.0))  # type: ignore[arg-type]
        if scenario.mode == "storm":
            for key in ("calm_p50_us", "calm_p99_us", "calm_max_us", "storm_rate"):
                figures[key] = float(lg.get(key, 0.0))  # type: ignore[arg-type]
            if cpu > 0:
                figures["connect_us"] = 1e6 * cpu / scenario.conns  # with the stream's work
        elif scenario.mode != "latency":
            delivered = float(lg.get("delivered_window", 0))  # type: ignore[arg-type]
            figures["per_cpu"] = delivered / cpu if cpu > 0 else 0.0
            if delivered:
                figures["broker_syscalls_per_msg"] = (s1.syscalls - s0.syscalls) / delivered
                figures["broker_wakeups_per_msg"] = (s1.wakeups - s0.wakeups) / delivered
            figures["rss_growth_mb"] = (end.rss_kb - start.rss_kb) / 1024
        if scenario.stalled:
            figures["stalled_disconnected"] = float(lg.get("stalled_disconnected", 0))  # type: ignore[arg-type]
        lost = int(lg.get("missing", 0))  # type: ignore[call-overload]
        figures["lost"] = lost
        if lost and scenario.qos:
            problems.append(f"QoS 1: {lost} messages missing")
    ok = run.returncode == 0 and bool(lg.get("ok")) and not problems
    return {"ok": ok, "problems": problems, "figures": figures, "loadgen": lg}
