"""Benchmark meshmq beside Mosquitto: one command, one table, one JSON file, one plot.

Usage::

    .venv/bin/python bench/run.py [--quick] [--scenarios fanin_qos0,idle,...] [--profile]

It builds bench/loadgen.c (cached), installs Mosquitto if it is missing and we may, then runs
each scenario against a fresh meshmq and a fresh Mosquitto, each pinned to the same CPU
(``--broker-cpus``, default 0) with the load generator pinned elsewhere (``--loadgen-cpus``,
default 1). It prints the figures with meshmq/Mosquitto ratios and the issue's floors, then a
health table (counts validated, CPU used by broker and load generator), and writes
``bench/results/<timestamp>.json`` and ``.png``. Exit status 1 if any run failed validation.
docs/benchmarks.md describes the scenarios and the method.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from meshbench import BenchError, profiling, report, run_command, validation_status
from meshbench.brokers import ensure_mosquitto, mosquitto_version
from meshbench.build import build_loadgen
from meshbench.runner import Context, run_one
from meshbench.scenarios import FULL, QUICK, Scenario, Timing, select, suite

BROKERS = ("meshmq", "mosquitto")
RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    names = ", ".join(s.name for s in suite())
    p = argparse.ArgumentParser(description="meshmq vs Mosquitto benchmark (docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="short runs: a smoke test of ~1 minute")
    p.add_argument("--scenarios", help=f"comma-separated subset of: {names}")
    p.add_argument("--brokers", default=",".join(BROKERS), help="meshmq,mosquitto (default both)")
    p.add_argument("--protocol", type=int, choices=(4, 5), default=4,
                   help="MQTT protocol level of every client: 4 = 3.1.1 (default), 5 = 5.0")
    p.add_argument("--repeat", type=int, help="runs per scenario and broker (median; default:"
                   " 3 for the idle scenarios, 1 for the others)")
    p.add_argument("--warmup", type=float, help="seconds before each measured window")
    p.add_argument("--duration", type=float, help="seconds in each measured window")
    p.add_argument("--broker-cpus", default="0", help="taskset CPU list for the brokers")
    p.add_argument("--loadgen-cpus", default="1", help="taskset CPU list for the load generator")
    p.add_argument("--no-pin", action="store_true", help="do not pin anything (no taskset)")
    p.add_argument("--profile", nargs="?", const="fanin_qos0,fanin_qos1", default="",
                   help="py-spy meshmq during these scenarios' windows"
                        " (default when given: fanin_qos0,fanin_qos1)")
    p.add_argument("--results", type=Path, default=RESULTS, help="output directory")
    p.add_argument("--list", action="store_true", help="list the scenarios and exit")
    args = p.parse_args(argv)
    if args.repeat is not None and args.repeat < 1:
        p.error("--repeat must be at least 1")
    return args


def raise_nofile(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it
    if hard < needed:
        raise BenchError(f"RLIMIT_NOFILE hard limit is {hard}, the idle scenario needs {needed}"
                         " (ulimit -Hn, or run with --quick)")


def summary_line(scenario: Scenario, broker: str, outcome: dict[str, object]) -> str:
    f: dict[str, float] = outcome["figures"]  # type: ignore[assignment]
    if scenario.mode == "idle":
        text = (f"{f.get('connect_rate', 0):,.0f} conn/s, "
                f"{f.get('connect_us', 0):,.1f} us CPU/conn, "
                f"{f.get('rss_per_conn_kb', 0):.2f} KB/conn")
    elif scenario.mode == "storm":
        text = (f"stream p99 {f.get('calm_p99_us', 0):,.0f} us before, "
                f"{f.get('p99_us', 0):,.0f} us during (max {f.get('max_us', 0):,.0f} us) "
                f"a storm of {f.get('storm_rate', 0):,.0f} conn/s")
    elif scenario.mode == "latency":
        text = (f"p50 {f.get('p50_us', 0):,.0f} us, p99 {f.get('p99_us', 0):,.0f} us, "
                f"p99.9 {f.get('p999_us', 0):,.0f} us at {f.get('rate', 0):,.0f} msg/s")
    else:
        text = f"{f.get('rate', 0):,.0f} msg/s, {f.get('per_cpu', 0):,.0f} msg/CPU-s"
    cpu = (f" broker CPU {f['broker_cpu_pct']:.0f}% (waiting {f.get('broker_wait_pct', 0):.0f}%)"
           if "broker_cpu_pct" in f else "")
    status = "ok" if outcome["ok"] else "FAILED: " + "; ".join(outcome["problems"])  # type: ignore[arg-type]
    return f"  {scenario.name:<15} {broker:<9} {text}{cpu}  [{status}]"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    scenarios = select(suite(args.quick), args.scenarios.split(",") if args.scenarios else None)
    if args.list:
        for s in suite(args.quick):
            print(f"{s.name:<26} {s.title}")
        return 0
    brokers = [b for b in args.brokers.split(",") if b]
    if unknown := [b for b in brokers if b not in BROKERS]:
        raise BenchError(f"unknown broker {unknown[0]!r}: choose from meshmq, mosquitto")
    base = QUICK if args.quick else FULL
    timing = Timing(args.warmup if args.warmup is not None else base.warmup,
                    args.duration if args.duration is not None else base.duration, base.drain)
    raise_nofile(max((s.conns for s in scenarios), default=0) + 256)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    profile_names = tuple(n for n in args.profile.split(",") if n)
    ctx = Context(
        loadgen=build_loadgen(), timing=timing, protocol=args.protocol,
        broker_cpus=None if args.no_pin else args.broker_cpus,
        loadgen_cpus=None if args.no_pin else args.loadgen_cpus,
        mosquitto=ensure_mosquitto() if "mosquitto" in brokers else None,
        profile_dir=args.results / f"{stamp}-profiles",
    )
    if profile_names:
        profiling.find_py_spy()
        select(suite(args.quick), list(profile_names))  # unknown names fail now, not later
        ctx.profile_dir.mkdir(parents=True, exist_ok=True)  # type: ignore[union-attr]
    load_before = os.getloadavg()
    tree = report.tree_state()
    started = time.monotonic()
    results: report.Results = {}

    def runs(scenario: Scenario) -> int:
        return args.repeat or scenario.repeats

    print(f"bench: {len(scenarios)} scenarios x {brokers}, warm-up {timing.warmup:g} s, "
          f"window {timing.duration:g} s, MQTT {'5.0' if args.protocol == 5 else '3.1.1'}",
          file=sys.stderr)
    for repeat in range(max((runs(s) for s in scenarios), default=0)):
        for index, scenario in enumerate(scenarios):
            if runs(scenario) <= repeat:
                continue
            order = [b for b in brokers if b in scenario.brokers]
            if (index + repeat) % 2:
                order.reverse()  # alternate who goes first: shared-machine drift hits both
            for broker in order:
                outcome = run_one(scenario, broker, ctx)
                results.setdefault(scenario.name, {}).setdefault(broker, []).append(outcome)
                print(summary_line(scenario, broker, outcome), file=sys.stderr, flush=True)
    if profile_names:  # separate runs, so py-spy's own cost stays out of the figures above
        ctx.profile = profile_names
        for scenario in select(suite(args.quick), list(profile_names)):
            if scenario.name in profile_names:
                outcome = run_one(scenario, "meshmq", ctx)
                print(summary_line(scenario, "meshmq", outcome) + " (profiled)",
                      file=sys.stderr, flush=True)
    references = {s.name: s.reference for s in scenarios}
    rows = report.table_rows(results, references)
    print()
    print(report.render_table(rows))
    if args.quick:
        print("(quick: 2,000 idle clients connect in about 0.1 s and each window lasts 1.5 s, so"
              " the floors' checks above are a smoke test; judge them on a full run)")
    print()
    print(report.render_health(results))
    for name, summary in ctx.profiles.items():
        print()
        print(profiling.render(f"meshmq profile, {name}", summary))
    record = {
        "started_utc": stamp,
        "elapsed_s": round(time.monotonic() - started, 1),
        "host": {
            "cpus": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(),
            "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
            "mosquitto": mosquitto_version(ctx.mosquitto) if ctx.mosquitto else None,
        },
        "meshmq_tree": tree,
        "options": {"quick": args.quick, "protocol": args.protocol,
                    "repeat": {s.name: runs(s) for s in scenarios},
                    "warmup_s": timing.warmup, "duration_s": timing.duration,
                    "broker_cpus": ctx.broker_cpus, "loadgen_cpus": ctx.loadgen_cpus},
        "table": rows,
        "results": results,
        "profiles": ctx.profiles,
    }
    json_path = args.results / f"{stamp}.json"
    png_path = args.results / f"{stamp}.png"
    report.write_json(json_path, record)
    report.plot(png_path, rows, f"meshmq vs Mosquitto, {stamp} UTC"
                f"{' (quick)' if args.quick else ''}")
    print(f"\nwrote {json_path} and {png_path}")
    return validation_status([f"{s}/{b}" for s, runs in results.items()
                              for b, rs in runs.items() if not all(r["ok"] for r in rs)])


if __name__ == "__main__":
    run_command(main, "bench")
