"""Benchmark meshmq's ``server.workers``: throughput with 1 and 2 workers, the mesh link's
CPU cost per message, and the cost of forwarding a persisted publish to the worker that leads
its partition (docs/benchmarks.md, section "Workers").

Usage::

    .venv/bin/python bench/workers.py [--quick] [--repeat N] [--only scaling,link,append]
        [--loads fanin_qos0,pairs_qos0,pairs_qos1,pairs_qos1_log,pairs_qos1_log_interval]

Scaling: each load runs on a fresh node with ``server.workers = 1`` pinned to CPU 0 and with
``server.workers = 2`` pinned to CPUs 0-1; the C load generator is not pinned (2 CPUs here:
there is no third one to give it). The ``pairs_qos1_log*`` loads run with the commit log on
and show the issue's floor for them. Link: a Python client that places its connections on a
chosen worker (the ``meshmq-worker`` CONNACK property) measures broker CPU µs per message
delivered on one worker and across the link. Append: the same client at QoS 1 with the log
on, its publisher on the worker that leads the topic's partition or on another one. Prints the
tables, writes ``bench/results/workers-<UTC time>.json`` and ``.png``. Exit status 1 if a run
failed validation, 2 if it cannot run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from meshbench import (
    BenchError,
    appendcost,
    linkcost,
    run_command,
    validation_status,
    workers,
)
from meshbench.build import build_loadgen
from meshbench.report import tree_state, write_json
from meshbench.runner import Context
from meshbench.scenarios import Scenario, Timing

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("scaling", "link", "append")
FULL = Timing(warmup=1.0, duration=4.0, drain=5.0)
QUICK = Timing(warmup=0.3, duration=1.0, drain=2.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="meshmq server.workers benchmark (docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="1 s windows: a smoke test")
    p.add_argument("--only", help="parts to run, comma-separated: " + ",".join(PARTS))
    p.add_argument("--loads", help="scaling loads, comma-separated: "
                   + ",".join(s.name for s in workers.LOADS))
    p.add_argument("--repeat", type=int, default=3, help="runs per point (figures are medians)")
    p.add_argument("--warmup", type=float, help="seconds before each measured window")
    p.add_argument("--duration", type=float, help="seconds in each measured window")
    p.add_argument("--protocol", type=int, choices=(4, 5), default=4,
                   help="MQTT level of the scaling clients (the link client is always 5.0)")
    p.add_argument("--pairs", type=int, default=4,
                   help="publisher/subscriber pairs, link and append parts")
    p.add_argument("--no-pin", action="store_true", help="do not pin the broker (no taskset)")
    p.add_argument("--results", type=Path, default=RESULTS, help="output directory")
    return p.parse_args(argv)


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + ", ".join(f.read().split()[:3])


def plot(path: Path, scaling: list[dict[str, object]],
         placed: list[tuple[str, list[dict[str, object]]]], title: str) -> None:
    """One row per scaling load (msg/s, CPU-bound msg/s, broker µs/msg for 1 and 2 workers),
    then one per placed-client part (``link``, ``append``): broker µs/msg split by worker, and
    msg/s, per case."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = (("rate", "msg/s"), ("projected_rate", "msg/s, a CPU per worker"),
               ("broker_us_per_msg", "broker CPU us/msg"))
    placed = [(name, rows) for name, rows in placed if rows]
    nrows = len(scaling) + len(placed)
    if not nrows:
        return
    fig, axes = plt.subplots(nrows, 3, figsize=(11, 2.8 * nrows), squeeze=False)
    for row, panels in zip(scaling, axes, strict=False):
        for ax, (figure, unit) in zip(panels, figures, strict=True):
            values = [float(row.get(f"{figure}_w{w}") or 0.0) for w in workers.WORKER_COUNTS]
            bars = ax.bar([f"{w} worker{'s' if w > 1 else ''}" for w in workers.WORKER_COUNTS],
                          values, color=["#9a9a9a", "#3b7dd8"])
            ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.2f}" for v in values],
                         fontsize=7)
            floor = f" (floor {row['floor']}x)" if row.get("floor") and figure == "rate" else ""
            ax.set_title(f"{row['load']}: {unit}{floor}", fontsize=8)
            ax.set_ylim(0, max(values) * 1.2 or 1.0)
            ax.tick_params(labelsize=7)
    for (name, rows), panels in zip(placed, axes[len(scaling):], strict=True):
        plot_placed(panels, name, rows)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_placed(panels: Sequence[Any], name: str, rows: list[dict[str, object]]) -> None:
    """A placed-client part's cases: broker µs/msg stacked by worker, then msg/s."""
    ax = panels[0]
    names = [str(r["case"]) for r in rows]
    w0 = [float(r.get("worker0_us_per_msg") or 0.0) for r in rows]
    w1 = [float(r.get("worker1_us_per_msg") or 0.0) for r in rows]
    ax.bar(names, w0, color="#3b7dd8", label="worker 0")
    ax.bar(names, w1, bottom=w0, color="#e08a3c", label="worker 1")
    ax.set_title(f"{name}: broker CPU us/msg by worker", fontsize=8)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)
    ax = panels[1]
    bars = ax.bar(names, [float(r.get("rate") or 0.0) for r in rows], color="#9a9a9a")
    ax.bar_label(bars, fmt="{:,.0f}", fontsize=7)
    ax.set_title(f"{name}: msg/s", fontsize=8)
    ax.tick_params(labelsize=7)
    panels[2].axis("off")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base = QUICK if args.quick else FULL
    timing = Timing(args.warmup if args.warmup is not None else base.warmup,
                    args.duration if args.duration is not None else base.duration, base.drain)
    loads = workers.select_loads(args.loads.split(",") if args.loads else None)
    cpus = os.sched_getaffinity(0)
    if not args.no_pin and not {0, 1} <= cpus:
        raise BenchError(f"CPUs 0 and 1 are needed for pinning (this process may use {cpus});"
                         " use --no-pin")
    parts = args.only.split(",") if args.only else list(PARTS)
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"--only: unknown part {unknown[0]!r}; known: {', '.join(PARTS)}")
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    load_before = uptime()
    tree = tree_state()
    print(f"workers bench: {load_before}; meshmq {tree['commit']} from {tree['meshmq_from']}; "
          f"warm-up {timing.warmup:g} s, window {timing.duration:g} s, {args.repeat} run(s) "
          "per point; node pinned to CPU 0 (1 worker) / CPUs 0-1 (2 workers), load generator "
          "unpinned", file=sys.stderr)
    started = time.monotonic()
    scaling: workers.ScalingResults = {}
    if "scaling" in parts:
        scaling = run_scaling_part(args, loads, timing)
    link = run_placed_part(args, linkcost.CASES, timing, "link") if "link" in parts else {}
    append = (run_placed_part(args, appendcost.CASES, timing, "append")
              if "append" in parts else {})
    scaling_rows = workers.scaling_rows(scaling)
    link_rows = workers.link_rows(link)
    append_rows = workers.link_rows(append)
    cost = workers.link_cost(link_rows)
    a_cost = appendcost.append_cost(append_rows)
    load_after = uptime()
    print_tables(args, scaling, scaling_rows, link, link_rows, cost, append, append_rows, a_cost)
    print(f"\n{load_before} before, {load_after} after")
    record = {
        "started_utc": stamp,
        "elapsed_s": round(time.monotonic() - started, 1),
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                 "python": platform.python_version(), "loadavg_before": load_before,
                 "loadavg_after": load_after},
        "meshmq_tree": tree,
        "options": {"quick": args.quick, "repeat": args.repeat, "warmup_s": timing.warmup,
                    "duration_s": timing.duration, "protocol": args.protocol,
                    "pairs": args.pairs, "pinned": not args.no_pin, "parts": parts},
        "scaling_table": scaling_rows,
        "link_table": link_rows,
        "link_cost": {**cost, "per_repetition_us": workers.paired_link_costs(link)},
        "append_table": append_rows,
        "append_cost": {**a_cost, "per_repetition_us": appendcost.paired_append_costs(append)},
        "scaling": {k: {str(w): runs for w, runs in v.items()} for k, v in scaling.items()},
        "link": link,
        "append": append,
    }
    json_path = args.results / f"workers-{stamp}.json"
    png_path = args.results / f"workers-{stamp}.png"
    write_json(json_path, record)
    plot(png_path, scaling_rows, [("link", link_rows), ("append", append_rows)],
         f"meshmq workers, {stamp} UTC")
    print(f"\nwrote {json_path} and {png_path}")
    failed = [f"{name}/w={w}" for name, by in scaling.items() for w, runs in by.items()
              if not all(r["ok"] for r in runs)]
    failed += [f"{part}/{name}" for part, results in (("link", link), ("append", append))
               for name, runs in results.items() if not all(r["ok"] for r in runs)]
    return validation_status(failed)


def run_scaling_part(args: argparse.Namespace, loads: list[Scenario],
                     timing: Timing) -> workers.ScalingResults:
    """Every load with 1 and 2 workers, ``--repeat`` times; which goes first alternates."""
    ctx = Context(loadgen=build_loadgen(), timing=timing, protocol=args.protocol)
    scaling: workers.ScalingResults = {}
    for repeat in range(args.repeat):
        for index, load in enumerate(loads):
            order = list(workers.WORKER_COUNTS)
            if (index + repeat) % 2:
                order.reverse()  # alternate which goes first: drift hits both
            for count in order:
                outcome = workers.run_scaling(load, count, ctx, pin=not args.no_pin)
                scaling.setdefault(load.name, {}).setdefault(count, []).append(outcome)
                f: dict[str, float] = outcome["figures"]  # type: ignore[assignment]
                print(f"  {load.name:<23} workers={count} {f.get('rate', 0):>9,.0f} msg/s "
                      f"{f.get('broker_us_per_msg', 0):6.2f} us/msg broker CPU "
                      f"{f.get('broker_cpu_pct', 0):4.0f}% loadgen "
                      f"{f.get('loadgen_cpu_pct', 0):3.0f}% [{run_status(outcome)}]",
                      file=sys.stderr, flush=True)
    return scaling


def run_placed_part(args: argparse.Namespace, cases: Sequence[linkcost.PlacedCase],
                    timing: Timing, part: str) -> workers.LinkResults:
    """The placed-client cases (``link`` or ``append``), ``--repeat`` times, forwards then
    backwards; the results in the cases' order."""
    results: workers.LinkResults = {}
    for repeat in range(args.repeat):
        for case in list(cases) if repeat % 2 == 0 else list(reversed(cases)):
            outcome = linkcost.run_case(
                case, warmup=timing.warmup, duration=timing.duration, pairs=args.pairs,
                cpus=None if args.no_pin else workers.cpus_for(case.workers))
            results.setdefault(case.name, []).append(outcome)
            f: dict[str, float] = outcome["figures"]  # type: ignore[assignment]
            print(f"  {part} {case.name:<11} {f['rate']:>9,.0f} msg/s "
                  f"{f['broker_us_per_msg']:6.2f} us/msg (worker 0 "
                  f"{f.get('worker0_us_per_msg', 0):.2f}, worker 1 "
                  f"{f.get('worker1_us_per_msg', 0):.2f}) [{run_status(outcome)}]",
                  file=sys.stderr, flush=True)
    return {c.name: results[c.name] for c in cases if c.name in results}


def print_tables(args: argparse.Namespace, scaling: workers.ScalingResults,
                 scaling_rows: list[dict[str, object]], link: workers.LinkResults,
                 link_rows: list[dict[str, object]], cost: dict[str, float | None],
                 append: workers.LinkResults, append_rows: list[dict[str, object]],
                 a_cost: dict[str, float | None]) -> None:
    if scaling_rows:
        print("\nScaling (medians; w=1 pinned to CPU 0, w=2 to CPUs 0-1, load generator "
              "unpinned; 'crossing': deliveries whose publisher is on another worker than the "
              "subscriber, w=2; 'appending': log on, pairs whose publisher is not on the "
              "leader of its topic's partition, w=2; floor: the issue's, on msg/s w2/w1)")
        print(workers.render_scaling(scaling_rows))
        print()
        print(workers.render_scaling_runs(scaling))
    if link_rows:
        print(f"\nLink cost (Python placed client, {args.pairs} pairs, QoS 0, MQTT 5.0; broker "
              "CPU per delivered message, medians)")
        print(workers.render_link(link_rows))
        if cost["total_us"] is not None:
            paired = workers.paired_link_costs(link)
            print(f"\nlink cost: forwarded - local = {cost['total_us']:.2f} us of broker CPU per "
                  f"message (sender worker {cost['sender_us']:.2f} us + receiver worker "
                  f"{cost['receiver_us']:.2f} us, against {cost['local_us']:.2f} us on one "
                  "worker); per repetition: " + ", ".join(f"{c:.2f}" for c in paired))
    if append_rows:
        print(f"\nAppend cost (Python placed client, {args.pairs} pairs, QoS 1 publish and "
              "subscription, log on, fsync always, MQTT 5.0; broker CPU per delivered message, "
              "medians; clients placed relative to their topic's partition leader, partition p "
              "on worker p mod 2)")
        print(workers.render_link(append_rows))
        if a_cost["append_us"] is not None:
            paired = appendcost.paired_append_costs(append)
            print(f"\nappend cost: append - leader = {a_cost['append_us']:.2f} us of broker CPU "
                  f"per message (against {a_cost['leader_us']:.2f} us on the leader); "
                  "per repetition: " + ", ".join(f"{c:.2f}" for c in paired))
        if a_cost["append_back_us"] is not None:
            print(f"append and forward back: append_back - leader = "
                  f"{a_cost['append_back_us']:.2f} us per message")


def run_status(outcome: dict[str, object]) -> str:
    """``ok``, or ``FAILED:`` and what failed, for a run's progress line."""
    return "ok" if outcome["ok"] else "FAILED: " + "; ".join(outcome["problems"])  # type: ignore[arg-type]


if __name__ == "__main__":
    run_command(main, "workers bench")
