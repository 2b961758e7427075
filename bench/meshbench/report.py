"""The table of figures with meshmq/Mosquitto ratios, the JSON record and the plot.

``results[scenario][broker]`` is a list of run outcomes (one per ``--repeat``); a figure is the
median over those runs. The ratio is always meshmq / Mosquitto, so above 1 is better for
throughput and below 1 is better for latency; a row with ``versus`` compares meshmq with itself
in another scenario (2 workers against 1), that scenario's figure standing in the Mosquitto
column. The issue's floors are checked where they apply.
Throughput figures come twice: raw (what each broker reached on its pinned CPU) and per
second of broker CPU (delivered messages / CPU seconds the broker used in the window), which
is what to compare on a machine whose CPUs are shared with other work.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

Results = dict[str, dict[str, list[dict[str, object]]]]


# (meshmq, Mosquitto, ratio) -> floor met? None when it cannot be told (no Mosquitto figure).
Check = Callable[[float, float | None, float | None], bool | None]


@dataclass(frozen=True)
class Row:
    scenario: str
    figure: str
    label: str
    unit: str
    floor: str = ""  # the floor, as text
    met: Check | None = None
    versus: str | None = None  # compare with meshmq's own figure in this scenario instead


def _ratio_at_least(x: float) -> Check:
    return lambda m, q, r: None if r is None else r >= x


def _ratio_at_most(x: float) -> Check:
    return lambda m, q, r: None if r is None else r <= x


def _throughput(scenario: str, label: str, unit: str, floor: float | None = None) -> list[Row]:
    text = f">= {floor}x" if floor else ""
    check = _ratio_at_least(floor) if floor else None
    return [Row(scenario, "rate", label, unit, text, check),
            Row(scenario, "per_cpu", f"{label}, per broker CPU-s", "msg/CPU-s", text, check)]


def _connects(scenario: str, label: str, floor: float | None = None) -> list[Row]:
    text = f">= {floor}x" if floor else ""
    check = _ratio_at_least(floor) if floor else None
    return [Row(scenario, "connect_rate", f"{label}: connect rate", "conn/s", text, check),
            Row(scenario, "connect_us", f"{label}: broker CPU per connection", "us")]


def _storm(scenario: str, label: str) -> list[Row]:
    return [Row(scenario, "calm_p99_us", f"{label}: QoS 1 stream p99 before", "us"),
            Row(scenario, "p50_us", f"{label}: QoS 1 stream p50 during", "us"),
            Row(scenario, "p99_us", f"{label}: QoS 1 stream p99 during", "us"),
            Row(scenario, "max_us", f"{label}: QoS 1 stream max during", "us"),
            Row(scenario, "storm_rate", f"{label}: connect rate", "conn/s")]


def _latency_log(scenario: str, label: str) -> list[Row]:
    """QoS 1 latency with the log on, beside Mosquitto's (which persists nothing)."""
    return [Row(scenario, "p50_us", f"{label}: p50", "us"),
            Row(scenario, "p99_us", f"{label}: p99", "us"),
            Row(scenario, "p999_us", f"{label}: p99.9", "us"),
            Row(scenario, "broker_cpu_pct", f"{label}: broker CPU", "%")]


ROWS: list[Row] = [
    *_throughput("fanin_qos0", "fan-in QoS 0", "msg/s", 0.5),
    *_throughput("fanin_qos1", "fan-in QoS 1, log off", "msg/s", 0.5),
    *_throughput("fanin_qos1_log", "fan-in QoS 1, meshmq log on", "msg/s"),
    *_throughput("fanin_qos1_log_interval", "fan-in QoS 1, meshmq log on (fsync interval)",
                 "msg/s"),
    *_throughput("fanout_qos0", "fan-out QoS 0", "deliveries/s", 0.6),
    *_throughput("pairs_qos1", "100 pairs QoS 1, log off", "msg/s"),
    *_throughput("pairs_qos1_log", "100 pairs QoS 1, meshmq log on", "msg/s"),
    *_throughput("pairs_qos1_log_interval", "100 pairs QoS 1, meshmq log on (fsync interval)",
                 "msg/s"),
    Row("latency_qos0", "p50_us", "latency QoS 0 p50", "us"),
    Row("latency_qos0", "p99_us", "latency QoS 0 p99", "us", "<= 2x", _ratio_at_most(2.0)),
    Row("latency_qos0", "p999_us", "latency QoS 0 p99.9", "us"),
    Row("latency_qos1", "p50_us", "latency QoS 1 p50", "us"),
    Row("latency_qos1", "p99_us", "latency QoS 1 p99", "us"),
    Row("latency_qos1", "p999_us", "latency QoS 1 p99.9", "us"),
    Row("latency_qos1", "broker_cpu_pct", "latency QoS 1: broker CPU", "%"),
    *_latency_log("latency_qos1_log", "latency QoS 1, meshmq log on"),
    *_latency_log("latency_qos1_log_interval", "latency QoS 1, meshmq log on (fsync interval)"),
    Row("latency8_qos1", "p50_us", "latency QoS 1, 8 pairs, p50", "us"),
    Row("latency8_qos1", "p99_us", "latency QoS 1, 8 pairs, p99", "us"),
    Row("latency8_qos1", "broker_cpu_pct", "latency QoS 1, 8 pairs: broker CPU", "%"),
    *_latency_log("latency8_qos1_log", "latency QoS 1, 8 pairs, meshmq log on"),
    *_latency_log("latency8_qos1_log_syncfs", "latency QoS 1, 8 pairs, meshmq log on, syncfs"),
    *_connects("idle", "idle", 0.8),
    Row("idle", "rss_per_conn_kb", "idle: broker RSS per connection", "KB",
        "meshmq <= 2.5 KB", lambda m, q, r: m <= 2.5),
    *_connects("idle_v5", "idle 5.0", 0.8),
    *_connects("idle_auth", "idle, password file", 0.8),
    *_connects("idle_auth_v5", "idle 5.0, password file", 0.8),
    *_connects("idle_tls", "idle, TLS 1.3"),
    Row("idle_workers2", "connect_rate", "idle, 2 workers: connect rate", "conn/s"),
    Row("idle_workers2", "connect_rate", "idle, 2 workers / 1 worker: connect rate", "conn/s",
        versus="idle"),
    Row("idle_workers2", "connect_rate_cpu_bound",
        "idle, 2 workers: CPU-bound conn/s (busiest worker)", "conn/s"),
    Row("idle_workers2", "rss_per_conn_kb", "idle, 2 workers: RSS per connection", "KB"),
    *_throughput("stalled", "1 stalled subscriber: healthy sub", "msg/s"),
    Row("stalled", "rss_growth_mb", "1 stalled subscriber: broker RSS growth", "MB"),
    *_storm("storm_qos1", "storm"),
    *_storm("storm_qos1_workers2", "storm, 2 workers"),
]


def figure(results: Results, scenario: str, broker: str, name: str) -> float | None:
    runs = results.get(scenario, {}).get(broker, [])
    values = [r["figures"][name] for r in runs if name in r.get("figures", {})]  # type: ignore[operator, index]
    return statistics.median(values) if values else None  # type: ignore[type-var]


def reference_of(scenarios: dict[str, str | None], scenario: str) -> str:
    """Where Mosquitto's figure for ``scenario`` comes from (itself, or its reference)."""
    return scenarios.get(scenario) or scenario


def table_rows(results: Results, references: dict[str, str | None]) -> list[dict[str, object]]:
    rows = []
    for row in ROWS:
        mesh = figure(results, row.scenario, "meshmq", row.figure)
        if row.versus is not None:  # meshmq against itself (e.g. 2 workers against 1)
            mosq = figure(results, row.versus, "meshmq", row.figure)
            if mesh is None or mosq is None:
                continue
        else:
            mosq = figure(results, reference_of(references, row.scenario), "mosquitto",
                          row.figure)
        if mesh is None and mosq is None:
            continue
        ratio = mesh / mosq if mesh is not None and mosq else None
        met = row.met(mesh, mosq, ratio) if row.met and mesh is not None else None
        rows.append({"scenario": row.scenario, "figure": row.figure, "label": row.label,
                     "unit": row.unit, "meshmq": mesh, "mosquitto": mosq, "ratio": ratio,
                     "floor": row.floor, "met": met})
    return rows


def _num(value: object) -> str:
    if value is None:
        return "-"
    v = float(value)  # type: ignore[arg-type]
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.2f}" if abs(v) < 10 else f"{v:.1f}"


def _grid(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths, strict=True)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, lines)])


def render_table(rows: list[dict[str, object]]) -> str:
    lines = []
    for r in rows:
        met = {True: "yes", False: "NO", None: ""}[r["met"]]  # type: ignore[index]
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        lines.append([str(r["label"]), str(r["unit"]), _num(r["meshmq"]), _num(r["mosquitto"]),
                      ratio, str(r["floor"]), met])
    return _grid(["figure", "unit", "meshmq", "Mosquitto", "ratio", "floor", "met"], lines)


def render_health(results: Results) -> str:
    """Per run: validation; the CPU the broker and the load generator used in the window and
    how long they were runnable but waiting for a CPU (both as % of the window); the time the
    hypervisor gave away and the time every task of the machine waited for I/O (steal and
    I/O stall, % of the window). The broker's own fsyncs count as I/O stall too: compare
    runs of one scenario, where one with much more than the others shared its disk."""
    lines = []
    for scenario, brokers in results.items():
        for broker, runs in brokers.items():
            for i, run in enumerate(runs):
                figs: dict[str, float] = run.get("figures", {})  # type: ignore[assignment]
                problems = "; ".join(run.get("problems", []))  # type: ignore[arg-type]
                lines.append([
                    scenario + (f" #{i + 1}" if len(runs) > 1 else ""), broker,
                    "ok" if run.get("ok") else "FAILED",
                    _num(figs.get("broker_cpu_pct")), _num(figs.get("broker_wait_pct")),
                    _num(figs.get("loadgen_cpu_pct")), _num(figs.get("loadgen_wait_pct")),
                    _num(figs.get("lost")), _num(figs.get("host_steal_pct")),
                    _num(figs.get("host_io_stall_pct")), problems[:80],
                ])
    return _grid(["scenario", "broker", "counts", "broker CPU %", "waiting %", "loadgen CPU %",
                  "waiting %", "lost", "steal %", "I/O stall %", "problems"], lines)


def tree_state() -> dict[str, object]:
    """The meshmq source measured: commit, files under src/ changed since (others may be
    editing the tree while the benchmark runs), and where this interpreter imports meshmq from
    (the broker processes are started with the same interpreter and environment)."""
    root = Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=False)
        return done.stdout if done.returncode == 0 else ""

    changed = [line[3:] for line in git("status", "--porcelain", "--", "src").splitlines()]
    spec = importlib.util.find_spec("meshmq")
    return {"commit": git("rev-parse", "HEAD").strip() or None, "changed_in_src": changed,
            "meshmq_from": str(Path(spec.origin).parent) if spec and spec.origin else None}


def write_json(path: Path, record: dict[str, object]) -> None:
    path.write_text(json.dumps(record, indent=2, sort_keys=False) + "\n")


def plot(path: Path, rows: list[dict[str, object]], title: str) -> None:
    """One small panel per figure: meshmq and Mosquitto side by side, ratio in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r["meshmq"] is not None or r["mosquitto"] is not None]
    if not shown:
        return
    cols = 4
    nrows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.9 * nrows), squeeze=False)
    for ax, r in zip(axes.flat, shown, strict=False):
        values = [r["meshmq"] or 0.0, r["mosquitto"] or 0.0]
        bars = ax.bar(["meshmq", "Mosquitto"], values, color=["#3b7dd8", "#9a9a9a"])
        ax.bar_label(bars, labels=[_num(v) for v in (r["meshmq"], r["mosquitto"])], fontsize=7)
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        met = {True: ", met", False: ", NOT met", None: ""}[r["met"]]  # type: ignore[index]
        floor = f" (floor {r['floor']}{met})" if r["floor"] else ""
        ax.set_title(f"{r['label']}\n{ratio}{floor}", fontsize=8)
        ax.set_ylabel(str(r["unit"]), fontsize=7)
        ax.set_ylim(0, max(values) * 1.18 or 1.0)  # room for the value labels
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.97))  # keep the first row clear of the title
    fig.savefig(path, dpi=110)
    plt.close(fig)
