"""The operations plane's cost on the message path (docs/benchmarks.md, "Operations plane").

Usage::

    .venv/bin/python bench/admin_cost.py [--quick] [--repeat N] [--workers N]

Fan-in QoS 0 and QoS 1 (10 publishers -> 1 wildcard subscriber, the C load generator, as in
bench/run.py), each on a fresh node with the admin listener off, then on with ``/metrics`` and
``/api/v1/overview`` (what the open dashboard polls) fetched every second through the run,
alternating off/on ``--repeat`` times. The broker is pinned to CPU 0 (CPUs 0-1 with 2 workers)
and the load generator to CPU 1. Figures are medians: broker CPU µs per message (all runs), and
msg/s delivered over the runs in which the broker waited for its CPU less than
``CONTENDED_WAIT`` of the window (on a shared machine another process on CPU 0 halves the rate
of a run without changing its CPU per message). The issue's floor: at most 3% more CPU per
message, and 3% fewer msg/s, with admin on. Prints the table and writes
``bench/results/admin-<UTC time>.json``. Exit status 1 if a run failed validation or the floor
is missed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import urllib.request
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from meshbench import BenchError
from meshbench.brokers import free_port
from meshbench.build import build_loadgen
from meshbench.report import tree_state, write_json
from meshbench.runner import Context, run_one
from meshbench.scenarios import LOG_OFF, Scenario, Timing

RESULTS = Path(__file__).resolve().parent / "results"
FULL = Timing(warmup=1.0, duration=5.0, drain=5.0)
QUICK = Timing(warmup=0.3, duration=1.0, drain=2.0)
KEY = "bench-key"
FLOOR = 0.97  # msg/s with admin on / off, at least (CPU per message: at most 1 / FLOOR)
CONTENDED_WAIT = 10.0  # % of the window the broker spent runnable, waiting for a CPU
LOADS = (
    Scenario("fanin_qos0", "fan-in QoS 0 (10 pub -> 1 wildcard sub)", "throughput", pubs=10,
             subs=1, qos=0, brokers=("meshmq",)),
    Scenario("fanin_qos1", "fan-in QoS 1, log off", "throughput", pubs=10, subs=1, qos=1,
             meshmq=LOG_OFF, brokers=("meshmq",)),
)


class Scraper:
    """Fetches /metrics and the dashboard's overview every second until stopped."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.scrapes = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            try:
                for path in ("/metrics", "/api/v1/overview"):
                    request = urllib.request.Request(
                        f"http://127.0.0.1:{self.port}{path}",
                        headers={"Authorization": f"Bearer {KEY}"})
                    with urllib.request.urlopen(request, timeout=5) as response:
                        response.read()
                self.scrapes += 1
            except OSError:
                pass  # the broker is not listening yet, or has stopped

    def stop(self) -> int:
        self.stopped.set()
        self.thread.join(10)
        return self.scrapes


def run(load: Scenario, admin: bool, workers: int, ctx: Context) -> dict[str, object]:
    settings = {**load.meshmq, "server.workers": workers}
    scraper = None
    if admin:
        port = free_port()
        settings |= {"admin.listen": f"127.0.0.1:{port}", "admin.api_key": KEY}
        scraper = Scraper(port)
    try:
        outcome = run_one(replace(load, meshmq=settings), "meshmq", ctx)
    finally:
        scrapes = scraper.stop() if scraper is not None else 0
    outcome["admin"] = admin
    outcome["scrapes"] = scrapes
    if admin and scrapes < ctx.timing.duration / 2:
        outcome["ok"] = False
        outcome["problems"].append(f"only {scrapes} scrapes answered")  # type: ignore[union-attr]
    return outcome


def median(runs: list[dict[str, object]], name: str, calm: bool = False) -> float:
    """The median over the runs that produced ``name`` (NaN: none did); ``calm``: only those
    whose broker did not wait for its CPU."""
    values = []
    for run in runs:
        figures: dict[str, float] = run["figures"]  # type: ignore[assignment]
        if name in figures and (not calm
                                or figures.get("broker_wait_pct", 0.0) < CONTENDED_WAIT):
            values.append(figures[name])
    return statistics.median(values) if values else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="cost of the admin listener (docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="1 s windows: a smoke test")
    p.add_argument("--repeat", type=int, default=5, help="off/on pairs per load (medians)")
    p.add_argument("--workers", type=int, default=1, help="server.workers of the node")
    args = p.parse_args(argv)
    cpus = "0" if args.workers == 1 else f"0-{args.workers - 1}"
    ctx = Context(loadgen=build_loadgen(), timing=QUICK if args.quick else FULL,
                  broker_cpus=cpus, loadgen_cpus=None if args.workers > 1 else "1")
    results: dict[str, dict[str, list[dict[str, object]]]] = {}
    ok = True
    for repeat in range(args.repeat):
        for load in LOADS:
            for admin in (False, True) if repeat % 2 == 0 else (True, False):
                outcome = run(load, admin, args.workers, ctx)
                ok &= bool(outcome["ok"])
                side = "on" if admin else "off"
                results.setdefault(load.name, {}).setdefault(side, []).append(outcome)
                f: dict[str, float] = outcome["figures"]  # type: ignore[assignment]
                status = "ok" if outcome["ok"] else outcome["problems"]
                print(f"  {load.name:<11} admin {side:<3} {f.get('rate', 0):>10,.0f} msg/s "
                      f"{1e6 / f['per_cpu'] if f.get('per_cpu') else 0:>6.2f} us/msg "
                      f"scrapes={outcome['scrapes']} {status}", file=sys.stderr)
    rows = []
    print("\nmsg/s: runs whose broker waited for its CPU under"
          f" {CONTENDED_WAIT:g}% of the window; us/msg: all runs")
    print(f"{'load':<12}{'off msg/s':>12}{'on msg/s':>12}{'on/off':>8}"
          f"{'off us/msg':>12}{'on us/msg':>11}{'on/off':>8}")
    for name, sides in results.items():
        off_rate, on_rate = median(sides["off"], "rate", True), median(sides["on"], "rate", True)
        off_cpu = 1e6 / median(sides["off"], "per_cpu")
        on_cpu = 1e6 / median(sides["on"], "per_cpu")
        rows.append({"load": name, "off_rate": off_rate, "on_rate": on_rate,
                     "rate_ratio": on_rate / off_rate, "off_us_per_msg": off_cpu,
                     "on_us_per_msg": on_cpu, "cpu_ratio": on_cpu / off_cpu})
        ok &= on_rate / off_rate >= FLOOR and on_cpu / off_cpu <= 1 / FLOOR
        print(f"{name:<12}{off_rate:>12,.0f}{on_rate:>12,.0f}{on_rate / off_rate:>8.3f}"
              f"{off_cpu:>12.2f}{on_cpu:>11.2f}{on_cpu / off_cpu:>8.3f}")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_json(RESULTS / f"admin-{stamp}.json", {
        "workers": args.workers, "repeat": args.repeat, "timing": vars(ctx.timing),
        "rows": rows, "tree": tree_state(), "runs": results})
    print(f"floor: on/off msg/s >= {FLOOR} and CPU/msg <= {1 / FLOOR:.3f}:"
          f" {'met' if ok else 'MISSED (or a run failed)'}")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"admin_cost: {exc}", file=sys.stderr)
        sys.exit(2)
