"""The ``server.workers`` benchmark: the same load on meshmq with 1 and with 2 workers, and the
mesh link's cost per message (``linkcost``).

Scaling loads (the C load generator; where each connection lands is the kernel's choice, read
back from /proc, see ``placement``):

* ``fanin_qos0``: 10 publishers → 1 subscriber of ``bench/in/#``, QoS 0. One hot wildcard
  subscriber: every message is delivered by the subscriber's worker, and those published on
  the other worker cross the link first.
* ``pairs_qos0`` / ``pairs_qos1``: 100 independent publisher → subscriber pairs on distinct
  topics (QoS 1 with the log off, lossless queues). A pair whose two clients land on different
  workers crosses the link; about half of them with 2 workers.

CPUs: the node is pinned to ``cpus_for(workers)`` (CPU 0 for 1 worker, CPUs 0-1 for 2), the
load generator is not pinned: the machine has 2 CPUs, so with 2 workers the load generator
shares them with the broker (its CPU use is reported, and the CPU seconds per message show the
scaling even where the rate is capped by the CPUs there are).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from meshbench.report import _grid, _num
from meshbench.runner import Context, run_one
from meshbench.scenarios import LOG_OFF, Scenario

WORKER_COUNTS = (1, 2)

LOADS: tuple[Scenario, ...] = (
    Scenario("fanin_qos0", "fan-in QoS 0 (10 pub -> 1 wildcard sub)", "throughput", pubs=10,
             subs=1, qos=0, meshmq=LOG_OFF, brokers=("meshmq",)),
    Scenario("pairs_qos0", "100 independent pairs, QoS 0", "throughput", topology="pairs",
             pubs=100, subs=100, qos=0, meshmq=LOG_OFF, brokers=("meshmq",)),
    Scenario("pairs_qos1", "100 independent pairs, QoS 1, log off", "throughput",
             topology="pairs", pubs=100, subs=100, qos=1, meshmq=LOG_OFF, brokers=("meshmq",)),
)


def cpus_for(workers: int) -> str:
    """The CPUs a node of ``workers`` workers is pinned to: one per worker from CPU 0."""
    return "0" if workers == 1 else f"0-{workers - 1}"


def select_loads(names: list[str] | None) -> list[Scenario]:
    if not names:
        return list(LOADS)
    known = {s.name: s for s in LOADS}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown load {unknown[0]!r}; known: {', '.join(known)}")
    return [s for s in LOADS if s.name in names]


def run_scaling(load: Scenario, workers: int, ctx: Context, pin: bool = True) -> dict[str, object]:
    """``load`` on a fresh node of ``workers`` workers; the run's outcome with per-message CPU
    figures added, and a QoS 0 message missing counted as a failure too."""
    scenario = replace(load, meshmq={**load.meshmq, "server.workers": workers})
    run_ctx = replace(ctx, broker_cpus=cpus_for(workers) if pin else None, loadgen_cpus=None)
    outcome = run_one(scenario, "meshmq", run_ctx)
    outcome["workers"] = workers
    outcome["broker_cpus"] = run_ctx.broker_cpus
    figures: dict[str, float] = outcome["figures"]  # type: ignore[assignment]
    lg: dict[str, object] = outcome.get("loadgen") or {}  # type: ignore[assignment]
    delivered = float(lg.get("delivered_window", 0) or 0)  # type: ignore[arg-type]
    if figures.get("per_cpu"):
        figures["broker_us_per_msg"] = 1e6 / figures["per_cpu"]
    busiest = max((v for k, v in figures.items() if k.startswith("worker")
                   and k.endswith("_cpu_pct")), default=figures.get("broker_cpu_pct", 0.0))
    if busiest and figures.get("rate"):
        # What the node would deliver with a CPU to each worker: the busiest worker at 100%
        # (the others are idle part of the time: the load is not spread evenly, e.g. fan-in).
        figures["projected_rate"] = figures["rate"] * 100.0 / busiest
    if delivered:
        figures["loadgen_us_per_msg"] = 1e6 * float(lg.get("loadgen_cpu_s", 0.0)) / delivered  # type: ignore[arg-type]
    missing = int(lg.get("missing", 0) or 0)  # type: ignore[call-overload]
    if missing and not load.qos:  # the QoS 1 runs already fail on this
        outcome["ok"] = False
        outcome["problems"].append(f"QoS 0: {missing} messages missing")  # type: ignore[union-attr]
    return outcome


def median(runs: list[dict[str, object]], name: str) -> float | None:
    values = [r["figures"][name] for r in runs if name in r.get("figures", {})]  # type: ignore[operator, index]
    return statistics.median(values) if values else None  # type: ignore[type-var]


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a is not None and b else "-"


ScalingResults = dict[str, dict[int, list[dict[str, object]]]]  # load -> workers -> runs
LinkResults = dict[str, list[dict[str, object]]]  # case -> runs


def scaling_rows(results: ScalingResults) -> list[dict[str, object]]:
    """Per load: medians for each worker count and the workers=2 / workers=1 ratios."""
    rows = []
    for load in LOADS:
        by_count = results.get(load.name)
        if not by_count:
            continue
        row: dict[str, object] = {"load": load.name, "title": load.title}
        for workers, runs in sorted(by_count.items()):
            for name in ("rate", "projected_rate", "broker_cpu_pct", "broker_us_per_msg",
                         "loadgen_cpu_pct", "loadgen_us_per_msg", "broker_wait_pct",
                         "host_busy_pct"):
                row[f"{name}_w{workers}"] = median(runs, name)
            crossing = [r["placement"]["crossing_fraction"] for r in runs  # type: ignore[index]
                        if "placement" in r]
            row[f"crossing_w{workers}"] = statistics.median(crossing) if crossing else None
            row[f"ok_w{workers}"] = all(r["ok"] for r in runs)
            row[f"runs_w{workers}"] = len(runs)
        a, b = row.get("rate_w2"), row.get("rate_w1")
        row["rate_ratio"] = a / b if a is not None and b else None  # type: ignore[operator]
        a, b = row.get("broker_us_per_msg_w2"), row.get("broker_us_per_msg_w1")
        row["us_ratio"] = a / b if a is not None and b else None  # type: ignore[operator]
        a, b = row.get("projected_rate_w2"), row.get("projected_rate_w1")
        row["projected_ratio"] = a / b if a is not None and b else None  # type: ignore[operator]
        rows.append(row)
    return rows


def render_scaling(rows: list[dict[str, object]]) -> str:
    lines = []
    for r in rows:
        ok = "ok" if r.get("ok_w1", True) and r.get("ok_w2", True) else "FAILED"
        crossing = r.get("crossing_w2")
        lines.append([
            str(r["load"]), _num(r.get("rate_w1")), _num(r.get("rate_w2")),
            _ratio(r.get("rate_w2"), r.get("rate_w1")),  # type: ignore[arg-type]
            _num(r.get("broker_us_per_msg_w1")), _num(r.get("broker_us_per_msg_w2")),
            _num(r.get("projected_rate_w1")), _num(r.get("projected_rate_w2")),
            _ratio(r.get("projected_rate_w2"), r.get("projected_rate_w1")),  # type: ignore[arg-type]
            _num(r.get("broker_cpu_pct_w1")), _num(r.get("broker_cpu_pct_w2")),
            _num(r.get("loadgen_cpu_pct_w1")), _num(r.get("loadgen_cpu_pct_w2")),
            _num(r.get("loadgen_us_per_msg_w2")),
            f"{100 * crossing:.0f}%" if isinstance(crossing, float) else "-",
            _num(r.get("host_busy_pct_w2")), ok,
        ])
    return _grid(["load", "msg/s w=1", "msg/s w=2", "w2/w1", "broker us/msg w=1",
                  "w=2", "CPU-bound msg/s w=1", "w=2", "w2/w1", "broker CPU% w=1", "w=2",
                  "loadgen CPU% w=1", "w=2",
                  "loadgen us/msg", "crossing", "host busy%", "counts"], lines)


def render_scaling_runs(results: ScalingResults) -> str:
    """One line per run: its rate, CPU per worker, placement and validation."""
    lines = []
    for load, by_count in results.items():
        for workers, runs in sorted(by_count.items()):
            for i, run in enumerate(runs):
                f: dict[str, float] = run["figures"]  # type: ignore[assignment]
                per_worker = " / ".join(f"{f[k]:.0f}" for k in sorted(f)
                                        if k.startswith("worker") and k.endswith("_cpu_pct"))
                place: dict[str, object] = run.get("placement") or {}  # type: ignore[assignment]
                where = ""
                if place:
                    where = (f"pubs {place['publishers_per_worker']} subs "
                             f"{place['subscribers_per_worker']}")
                problems = "; ".join(run.get("problems", []))  # type: ignore[arg-type]
                lines.append([
                    f"{load} #{i + 1}", str(workers), _num(f.get("rate")),
                    _num(f.get("broker_us_per_msg")), _num(f.get("broker_cpu_pct")),
                    per_worker or "-", _num(f.get("broker_wait_pct")),
                    _num(f.get("loadgen_cpu_pct")), _num(f.get("host_busy_pct")),
                    str(int(f.get("lost", 0))), where,
                    "ok" if run["ok"] else "FAILED " + problems[:60],
                ])
    return _grid(["run", "workers", "msg/s", "broker us/msg", "broker CPU%", "per worker %",
                  "waiting %", "loadgen CPU%", "host busy%", "lost", "placement", "counts"],
                 lines)


def link_rows(results: LinkResults) -> list[dict[str, object]]:
    rows = []
    for case, runs in results.items():
        row: dict[str, object] = {"case": case, "runs": len(runs),
                                  "ok": all(r["ok"] for r in runs)}
        names = {k for r in runs for k in r["figures"]}  # type: ignore[attr-defined]
        for name in sorted(names):
            row[name] = median(runs, name)
        rows.append(row)
    return rows


def link_cost(rows: list[dict[str, object]]) -> dict[str, float | None]:
    """forwarded - local broker µs per message, in all and per side (sender: worker 0, which
    took the publish; receiver: worker 1, which delivered it)."""
    by = {str(r["case"]): r for r in rows}
    local, forwarded = by.get("local"), by.get("forwarded")
    if local is None or forwarded is None:
        return {"total_us": None, "sender_us": None, "receiver_us": None}

    def get(row: dict[str, object], name: str) -> float:
        value = row.get(name)
        return float(value) if isinstance(value, int | float) else 0.0

    return {
        "total_us": get(forwarded, "broker_us_per_msg") - get(local, "broker_us_per_msg"),
        "forwarded_us": get(forwarded, "broker_us_per_msg"),
        # the sender does what a local worker does, minus the delivery, plus the FORWARD
        "sender_us": get(forwarded, "worker0_us_per_msg"),
        "receiver_us": get(forwarded, "worker1_us_per_msg"),
        "local_us": get(local, "broker_us_per_msg"),
        "single_us": get(by["single"], "broker_us_per_msg") if "single" in by else None,
        "spread_us": get(by["spread"], "broker_us_per_msg") if "spread" in by else None,
    }


def paired_link_costs(results: LinkResults) -> list[float]:
    """forwarded - local broker µs per message of each repetition (run close together in
    time, so drift on a shared machine hits both)."""
    local, forwarded = results.get("local", []), results.get("forwarded", [])
    return [float(f["figures"]["broker_us_per_msg"]) - float(x["figures"]["broker_us_per_msg"])  # type: ignore[index]
            for x, f in zip(local, forwarded, strict=False)]


def render_link(rows: list[dict[str, object]]) -> str:
    lines = []
    for r in rows:
        lines.append([
            str(r["case"]), _num(r.get("rate")), _num(r.get("broker_us_per_msg")),
            _num(r.get("worker0_us_per_msg")), _num(r.get("worker1_us_per_msg")),
            _num(r.get("broker_cpu_pct")), _num(r.get("broker_wait_pct")),
            _num(r.get("client_cpu_pct")), _num(r.get("host_busy_pct")),
            "ok" if r["ok"] else "FAILED",
        ])
    return _grid(["case", "msg/s", "broker us/msg", "worker 0", "worker 1", "broker CPU%",
                  "waiting %", "client CPU%", "host busy%", "counts"], lines)
