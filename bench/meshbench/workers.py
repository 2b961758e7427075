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
* ``pairs_qos1_log`` / ``pairs_qos1_log_interval``: the same 100 QoS 1 pairs with the commit
  log on (every ``bench/pair/<n>`` persisted), ``log.fsync = "always"`` (the default policy)
  and ``"interval"`` (every 1,000 ms). Each publish is appended by the worker that leads its
  topic's partition (``appendcost.leader_of_topic``); a publisher on another worker sends it
  there first (``appending``: the fraction of pairs whose publisher does). The issue's floor
  once partition leaders are spread over the workers: ``FLOORS``, on the msg/s ratio.

CPUs: the node is pinned to ``cpus_for(workers)`` (CPU 0 for 1 worker, CPUs 0-1 for 2), the
load generator is not pinned: the machine has 2 CPUs, so with 2 workers the load generator
shares them with the broker (its CPU use is reported, and the CPU seconds per message show the
scaling even where the rate is capped by the CPUs there are).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from meshbench.appendcost import leader_of_topic
from meshbench.brokers import LOSSLESS_MESHMQ
from meshbench.report import _grid, _num
from meshbench.runner import Context, run_one
from meshbench.scenarios import LOG_OFF, LOG_ON, Scenario

WORKER_COUNTS = (1, 2)
LOG_INTERVAL: dict[str, object] = {"log.enabled": True, "log.fsync": "interval",
                                   "log.fsync_interval_ms": 1000, **LOSSLESS_MESHMQ}

LOADS: tuple[Scenario, ...] = (
    Scenario("fanin_qos0", "fan-in QoS 0 (10 pub -> 1 wildcard sub)", "throughput", pubs=10,
             subs=1, qos=0, meshmq=LOG_OFF, brokers=("meshmq",)),
    Scenario("pairs_qos0", "100 independent pairs, QoS 0", "throughput", topology="pairs",
             pubs=100, subs=100, qos=0, meshmq=LOG_OFF, brokers=("meshmq",)),
    Scenario("pairs_qos1", "100 independent pairs, QoS 1, log off", "throughput",
             topology="pairs", pubs=100, subs=100, qos=1, meshmq=LOG_OFF, brokers=("meshmq",)),
    Scenario("pairs_qos1_log", "100 independent pairs, QoS 1, log on, fsync always",
             "throughput", topology="pairs", pubs=100, subs=100, qos=1, meshmq=LOG_ON,
             brokers=("meshmq",)),
    Scenario("pairs_qos1_log_interval", "100 independent pairs, QoS 1, log on, fsync interval",
             "throughput", topology="pairs", pubs=100, subs=100, qos=1, meshmq=LOG_INTERVAL,
             brokers=("meshmq",)),
)
# The floor for msg/s with 2 workers / with 1, once partition leaders are spread.
FLOORS: dict[str, float] = {"pairs_qos1_log": 1.6, "pairs_qos1_log_interval": 1.6}


def pair_topic(pair: int) -> str:
    """The topic of pair ``pair`` in the ``pairs`` loads, as bench/loadgen.c names it."""
    return f"bench/pair/{pair}"


def appending_fraction(pair_workers: list[list[int]], workers: int) -> float:
    """The fraction of pairs whose publisher is on a worker that does not lead its topic's
    partition: each of its publishes crosses to the leader (APPEND) and back (REPLY)."""
    off = sum(1 for i, (pub, _sub) in enumerate(pair_workers)
              if pub != leader_of_topic(pair_topic(i), workers))
    return off / max(1, len(pair_workers))


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
    for name in [k for k in figures if k.startswith("worker") and k.endswith("_cpu_pct")]:
        if figures.get("rate"):  # each worker's share of the CPU per message
            figures[name.replace("_cpu_pct", "_us_per_msg")] = (
                1e4 * figures[name] / figures["rate"])
    if load.meshmq.get("log.enabled"):
        place: dict[str, object] = outcome.get("placement") or {}  # type: ignore[assignment]
        if "pair_workers" in place:
            place["appending_fraction"] = appending_fraction(place["pair_workers"], workers)  # type: ignore[arg-type]
        published = int(lg.get("published", 0) or 0)  # type: ignore[call-overload]
        persisted = int(outcome.get("log_bytes", 0))  # type: ignore[call-overload]
        if persisted < published * load.size:  # the records hold the payloads, uncompressed
            outcome["ok"] = False
            outcome["problems"].append(  # type: ignore[union-attr]
                f"the commit log holds {persisted} bytes for {published} persisted messages")
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
                         "host_busy_pct", *[f"worker{i}_{f}" for i in range(workers)
                                            for f in ("cpu_pct", "us_per_msg")]):
                row[f"{name}_w{workers}"] = median(runs, name)
            for name in ("crossing", "appending"):
                found = [r["placement"][f"{name}_fraction"] for r in runs  # type: ignore[index]
                         if f"{name}_fraction" in r.get("placement", {})]  # type: ignore[operator]
                row[f"{name}_w{workers}"] = statistics.median(found) if found else None
            row[f"ok_w{workers}"] = all(r["ok"] for r in runs)
            row[f"runs_w{workers}"] = len(runs)
        a, b = row.get("rate_w2"), row.get("rate_w1")
        row["rate_ratio"] = a / b if a is not None and b else None  # type: ignore[operator]
        a, b = row.get("broker_us_per_msg_w2"), row.get("broker_us_per_msg_w1")
        row["us_ratio"] = a / b if a is not None and b else None  # type: ignore[operator]
        a, b = row.get("projected_rate_w2"), row.get("projected_rate_w1")
        row["projected_ratio"] = a / b if a is not None and b else None  # type: ignore[operator]
        floor = FLOORS.get(load.name)
        row["floor"] = floor
        ratio = row["rate_ratio"]
        row["floor_met"] = None if floor is None or ratio is None else ratio >= floor  # type: ignore[operator]
        rows.append(row)
    return rows


def _percent(value: object) -> str:
    return f"{100 * value:.0f}%" if isinstance(value, float) else "-"


def per_worker_cell(row: dict[str, object], workers: int = 2) -> str:
    """Each worker's CPU % and (µs per message), e.g. ``97 (9.1) / 60 (5.6)``."""
    parts = [f"{_num(row.get(f'worker{i}_cpu_pct_w{workers}'))} "
             f"({_num(row.get(f'worker{i}_us_per_msg_w{workers}'))})" for i in range(workers)
             if row.get(f"worker{i}_cpu_pct_w{workers}") is not None]
    return " / ".join(parts) or "-"


def render_scaling(rows: list[dict[str, object]]) -> str:
    lines = []
    for r in rows:
        ok = "ok" if r.get("ok_w1", True) and r.get("ok_w2", True) else "FAILED"
        floor = r.get("floor")
        met = {True: "yes", False: "NO", None: ""}[r.get("floor_met")]  # type: ignore[index]
        lines.append([
            str(r["load"]), _num(r.get("rate_w1")), _num(r.get("rate_w2")),
            _ratio(r.get("rate_w2"), r.get("rate_w1")),  # type: ignore[arg-type]
            _num(r.get("broker_us_per_msg_w1")), _num(r.get("broker_us_per_msg_w2")),
            _num(r.get("projected_rate_w1")), _num(r.get("projected_rate_w2")),
            _ratio(r.get("projected_rate_w2"), r.get("projected_rate_w1")),  # type: ignore[arg-type]
            _num(r.get("broker_cpu_pct_w1")), _num(r.get("broker_cpu_pct_w2")),
            _num(r.get("loadgen_cpu_pct_w1")), _num(r.get("loadgen_cpu_pct_w2")),
            _num(r.get("loadgen_us_per_msg_w2")), per_worker_cell(r),
            _percent(r.get("crossing_w2")), _percent(r.get("appending_w2")),
            _num(r.get("host_busy_pct_w2")), f">= {floor}x" if floor else "", met, ok,
        ])
    return _grid(["load", "msg/s w=1", "msg/s w=2", "w2/w1", "broker us/msg w=1",
                  "w=2", "CPU-bound msg/s w=1", "w=2", "w2/w1", "broker CPU% w=1", "w=2",
                  "loadgen CPU% w=1", "w=2", "loadgen us/msg", "w=2 per worker CPU% (us/msg)",
                  "crossing", "appending", "host busy%", "floor w2/w1", "met", "counts"], lines)


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
                    if "appending_fraction" in place:
                        where += f" appending {_percent(place['appending_fraction'])}"
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
