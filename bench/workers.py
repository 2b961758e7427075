"""Benchmark meshmq's ``server.workers``: throughput with 1 and 2 workers, and the mesh link's
CPU cost per message (docs/benchmarks.md, section "Workers").

Usage::

    .venv/bin/python bench/workers.py [--quick] [--repeat N] [--only scaling|link]
                                      [--loads fanin_qos0,pairs_qos0,pairs_qos1]

Scaling: each load runs on a fresh node with ``server.workers = 1`` pinned to CPU 0 and with
``server.workers = 2`` pinned to CPUs 0-1; the C load generator is not pinned (2 CPUs here:
there is no third one to give it). Link: a Python client that places its connections on a
chosen worker (the ``meshmq-worker`` CONNACK property) measures broker CPU µs per message
delivered on one worker and across the link. Prints the tables, writes
``bench/results/workers-<UTC time>.json`` and ``.png``. Exit status 1 if a run failed
validation, 2 if it cannot run.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from meshbench import BenchError, linkcost, run_command, validation_status, workers
from meshbench.build import build_loadgen
from meshbench.report import write_json
from meshbench.runner import Context
from meshbench.scenarios import Timing

RESULTS = Path(__file__).resolve().parent / "results"
FULL = Timing(warmup=1.0, duration=4.0, drain=5.0)
QUICK = Timing(warmup=0.3, duration=1.0, drain=2.0)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="meshmq server.workers benchmark (docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="1 s windows: a smoke test")
    p.add_argument("--only", choices=("scaling", "link"), help="run one part only")
    p.add_argument("--loads", help="scaling loads, comma-separated: "
                   + ",".join(s.name for s in workers.LOADS))
    p.add_argument("--repeat", type=int, default=3, help="runs per point (figures are medians)")
    p.add_argument("--warmup", type=float, help="seconds before each measured window")
    p.add_argument("--duration", type=float, help="seconds in each measured window")
    p.add_argument("--protocol", type=int, choices=(4, 5), default=4,
                   help="MQTT level of the scaling clients (the link client is always 5.0)")
    p.add_argument("--pairs", type=int, default=4, help="publisher/subscriber pairs, link part")
    p.add_argument("--no-pin", action="store_true", help="do not pin the broker (no taskset)")
    p.add_argument("--results", type=Path, default=RESULTS, help="output directory")
    return p.parse_args(argv)


def uptime() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + ", ".join(f.read().split()[:3])


def plot(path: Path, scaling: list[dict[str, object]], link: list[dict[str, object]],
         title: str) -> None:
    """One row per scaling load (msg/s, CPU-bound msg/s, broker µs/msg for 1 and 2 workers),
    then the link cases (broker µs/msg, split by worker)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = (("rate", "msg/s"), ("projected_rate", "msg/s, a CPU per worker"),
               ("broker_us_per_msg", "broker CPU us/msg"))
    nrows = len(scaling) + (1 if link else 0)
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
            ax.set_title(f"{row['load']}: {unit}", fontsize=8)
            ax.set_ylim(0, max(values) * 1.2 or 1.0)
            ax.tick_params(labelsize=7)
    if link:
        panels = axes[-1]
        ax = panels[0]
        names = [str(r["case"]) for r in link]
        w0 = [float(r.get("worker0_us_per_msg") or 0.0) for r in link]
        w1 = [float(r.get("worker1_us_per_msg") or 0.0) for r in link]
        ax.bar(names, w0, color="#3b7dd8", label="worker 0")
        ax.bar(names, w1, bottom=w0, color="#e08a3c", label="worker 1")
        ax.set_title("link: broker CPU us/msg by worker", fontsize=8)
        ax.legend(fontsize=7)
        ax.tick_params(labelsize=7)
        ax = panels[1]
        bars = ax.bar(names, [float(r.get("rate") or 0.0) for r in link], color="#9a9a9a")
        ax.bar_label(bars, fmt="{:,.0f}", fontsize=7)
        ax.set_title("link: msg/s", fontsize=8)
        ax.tick_params(labelsize=7)
        panels[2].axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    load_before = uptime()
    print(f"workers bench: {load_before}; warm-up {timing.warmup:g} s, window "
          f"{timing.duration:g} s, {args.repeat} run(s) per point; node pinned to CPU 0 "
          "(1 worker) / CPUs 0-1 (2 workers), load generator unpinned", file=sys.stderr)
    started = time.monotonic()
    scaling: workers.ScalingResults = {}
    if args.only != "link":
        ctx = Context(loadgen=build_loadgen(), timing=timing, protocol=args.protocol)
        for repeat in range(args.repeat):
            for index, load in enumerate(loads):
                order = list(workers.WORKER_COUNTS)
                if (index + repeat) % 2:
                    order.reverse()  # alternate which goes first: drift hits both
                for count in order:
                    outcome = workers.run_scaling(load, count, ctx, pin=not args.no_pin)
                    scaling.setdefault(load.name, {}).setdefault(count, []).append(outcome)
                    f: dict[str, float] = outcome["figures"]  # type: ignore[assignment]
                    status = run_status(outcome)
                    print(f"  {load.name:<11} workers={count} {f.get('rate', 0):>9,.0f} msg/s "
                          f"{f.get('broker_us_per_msg', 0):6.2f} us/msg broker CPU "
                          f"{f.get('broker_cpu_pct', 0):4.0f}% loadgen "
                          f"{f.get('loadgen_cpu_pct', 0):3.0f}% [{status}]",
                          file=sys.stderr, flush=True)
    link: workers.LinkResults = {}
    if args.only != "scaling":
        for repeat in range(args.repeat):
            cases = list(linkcost.CASES) if repeat % 2 == 0 else list(reversed(linkcost.CASES))
            for case in cases:
                outcome = linkcost.run_case(
                    case, warmup=timing.warmup, duration=timing.duration, pairs=args.pairs,
                    cpus=None if args.no_pin else workers.cpus_for(case.workers))
                link.setdefault(case.name, []).append(outcome)
                f = outcome["figures"]  # type: ignore[assignment]
                status = run_status(outcome)
                print(f"  link {case.name:<10} {f['rate']:>9,.0f} msg/s "
                      f"{f['broker_us_per_msg']:6.2f} us/msg (worker 0 "
                      f"{f.get('worker0_us_per_msg', 0):.2f}, worker 1 "
                      f"{f.get('worker1_us_per_msg', 0):.2f}) [{status}]",
                      file=sys.stderr, flush=True)
    # Sort each link case's runs back into CASES order for the table.
    link = {c.name: link[c.name] for c in linkcost.CASES if c.name in link}
    scaling_rows = workers.scaling_rows(scaling)
    link_rows = workers.link_rows(link)
    cost = workers.link_cost(link_rows)
    load_after = uptime()
    if scaling_rows:
        print("\nScaling (medians; w=1 pinned to CPU 0, w=2 to CPUs 0-1, load generator "
              "unpinned; 'crossing': deliveries whose publisher is on another worker than the "
              "subscriber, w=2)")
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
    print(f"\n{load_before} before, {load_after} after")
    record = {
        "started_utc": stamp,
        "elapsed_s": round(time.monotonic() - started, 1),
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                 "python": platform.python_version(), "loadavg_before": load_before,
                 "loadavg_after": load_after},
        "options": {"quick": args.quick, "repeat": args.repeat, "warmup_s": timing.warmup,
                    "duration_s": timing.duration, "protocol": args.protocol,
                    "pairs": args.pairs, "pinned": not args.no_pin},
        "scaling_table": scaling_rows,
        "link_table": link_rows,
        "link_cost": {**cost, "per_repetition_us": workers.paired_link_costs(link)},
        "scaling": {k: {str(w): runs for w, runs in v.items()} for k, v in scaling.items()},
        "link": link,
    }
    json_path = args.results / f"workers-{stamp}.json"
    png_path = args.results / f"workers-{stamp}.png"
    write_json(json_path, record)
    plot(png_path, scaling_rows, link_rows, f"meshmq workers, {stamp} UTC")
    print(f"\nwrote {json_path} and {png_path}")
    failed = [f"{name}/w={w}" for name, by in scaling.items() for w, runs in by.items()
              if not all(r["ok"] for r in runs)]
    failed += [f"link/{name}" for name, runs in link.items() if not all(r["ok"] for r in runs)]
    return validation_status(failed)


def run_status(outcome: dict[str, object]) -> str:
    """``ok``, or ``FAILED:`` and what failed, for a run's progress line."""
    return "ok" if outcome["ok"] else "FAILED: " + "; ".join(outcome["problems"])  # type: ignore[arg-type]


if __name__ == "__main__":
    run_command(main, "workers bench")
