"""Connect rate against a set of broker ports: the cluster benchmark's connection storm.

The C load generator (``bench/loadgen.c``, idle mode) connects to one port, so this runs
``len(ports)`` of them at once, one per port, each with its share of the clients and of the
handshakes in flight (``CONCURRENCY`` in all, as the suite's 64). Every client sends CONNECT
(MQTT 3.1.1, clean session, a client id unique to its generator) and waits for the CONNACK; the
clients stay connected until every generator is done, then disconnect.

The rate is every client over the time from the first generator's ``event connecting`` (just
before its first ``connect()``) to the last generator's ``event ready`` (its last CONNACK), as
this process reads those lines. The brokers' CPU over that interval, per client, is the cost
(sampled just before the generators start, once every broker is idle: the disconnects of the
previous run's thousands of clients go on in the brokers after its generators exit, and were
counted in the next run before this wait; and at the last ``ready``).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from meshbench import BenchError
from meshbench.brokers import ProcStats, host_cpu, pinned
from meshbench.clustertraffic import Sampler, await_quiet

CONCURRENCY = 64  # handshakes in flight in all, split over the generators
TIMEOUT = 120.0


class Generator:
    """One load generator process and what its stdout said, read by a thread of its own."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.times: dict[str, float] = {}
        self.ready: dict[str, Any] = {}  # the generator's JSON
        self.result: dict[str, object] = {}
        self.error = ""
        self.got_ready = threading.Event()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind == "event":
                name, _, data = rest.partition(" ")
                self.times[name] = time.monotonic()
                if name == "ready":
                    self.ready = json.loads(data) if data else {}
                    self.got_ready.set()
            elif kind == "result":
                self.result = json.loads(rest)
            elif kind == "error":
                self.error = rest
        self.got_ready.set()  # it ended: nobody waits on a generator that died

    def finish(self) -> None:
        """Close its stdin (its clients disconnect) and wait for it."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.thread.join(timeout=10)
        if self.proc.stderr is not None and not self.error and self.proc.returncode:
            self.error = self.proc.stderr.read().strip()[-300:]


def run_connects(loadgen: Path, ports: list[int], conns: int, cpus: str | None,
                 sampler: Sampler) -> dict[str, object]:
    """``conns`` clients spread evenly over ``ports`` (one generator per port, all at once);
    connections/s, broker CPU µs per connection in all and per broker."""
    share, concurrency = conns // len(ports), max(1, CONCURRENCY // len(ports))
    waited = await_quiet(sampler)
    s0: dict[str, ProcStats] = sampler()
    host0 = host_cpu()
    generators = [Generator(pinned(cpus, [str(loadgen), "--port", str(port), "--mode", "idle",
                                          "--protocol", "4", "--conns", str(share),
                                          "--concurrency", str(concurrency)]))
                  for port in ports]
    problems: list[str] = []
    try:
        deadline = time.monotonic() + TIMEOUT
        for gen in generators:
            if not gen.got_ready.wait(timeout=max(0.0, deadline - time.monotonic())):
                raise BenchError(f"a load generator did not connect its {share} clients "
                                 f"within {TIMEOUT:.0f} s")
        t_end = time.monotonic()
        s1 = sampler()
        host1 = host_cpu()
    finally:
        for gen in generators:
            gen.finish()
    for gen in generators:
        if gen.error or "ready" not in gen.times:
            problems.append(gen.error or f"load generator exited with {gen.proc.returncode}")
        if int(gen.ready.get("connections", 0)) != share:
            problems.append(f"a generator connected {gen.ready.get('connections')} of {share}")
    if problems:
        return {"ok": False, "problems": problems, "figures": {}}
    t_start = min(gen.times["connecting"] for gen in generators)
    t_last = max(gen.times["ready"] for gen in generators)
    wall = max(t_last - t_start, 1e-9)
    total = share * len(ports)
    figures: dict[str, float] = {"connect_rate": total / wall, "connect_s": wall}
    cpu_total = wait_total = 0.0
    for name in sorted(s0.keys() & s1.keys()):
        cpu = s1[name].cpu_s - s0[name].cpu_s
        cpu_total += cpu
        wait_total += s1[name].wait_s - s0[name].wait_s
        figures[f"{name}_us_per_conn"] = 1e6 * cpu / total
    figures["broker_us_per_conn"] = 1e6 * cpu_total / total
    figures["broker_cpu_pct"] = 100.0 * cpu_total / wall
    figures["broker_wait_pct"] = 100.0 * wait_total / wall
    figures["loadgen_cpu_pct"] = sum(float(gen.ready.get("loadgen_cpu_pct", 0.0))
                                     for gen in generators) / len(generators)
    figures["host_busy_pct"] = 100.0 * (host1[0] - host0[0]) / max(t_end - t_start, 1e-9)
    return {"ok": True, "problems": [], "figures": figures, "quiet_wait_s": round(waited, 2),
            "counts": {"connections": total, "generators": len(ports),
                       "concurrency_each": concurrency,
                       "generator_rates": [gen.ready.get("connect_rate") for gen in generators]}}
