"""What request/reply through meshmq's services costs, beside plain MQTT 5 request/response over
a shared subscription on Mosquitto (docs/benchmarks.md, "Services: request/reply").

Usage::

    .venv/bin/python bench/service_cost.py [--quick] [--workers-list 1,4,16] [--repeat N]

One broker at a time runs under ``taskset -c 0`` (meshmq with ``server.workers = 1``: its log
writer thread shares the CPU), the load (callers and service workers, asyncio clients of
meshmq.client in one process) under ``taskset -c 1``. For each number of service workers N and
each load, every variant runs on a fresh broker, in turn:

* ``mosquitto``: plain MQTT 5 request/response. Service workers subscribe to
  ``$share/svc/svc/bench`` (QoS 1); a caller publishes a request (QoS 1) on ``svc/bench`` with a
  Response Topic and Correlation Data; a worker publishes the reply (QoS 1) to the Response
  Topic with the same Correlation Data. Nothing stored, nothing retried, no envelope.
* ``meshmq-plain``: the same load on meshmq with its commit log off (like for like).
* ``services-interval``: meshmq's services: workers subscribe to ``$service/bench`` with
  ``credit`` 8, callers publish on ``$service/bench``. Each request is appended to the log
  before its PUBACK, its assignment and completion are log records too, and the reply carries
  the envelope; ``log.fsync = "interval"`` (a process crash loses nothing acknowledged).
* ``services-always``: the same with ``log.fsync = "always"`` (meshmq's default: a PUBACK only
  once the request is fsynced; a machine crash loses nothing acknowledged either).

Two loads: ``serial`` (one caller, one request at a time: the round trip with nothing queued)
and ``loaded`` (4 callers x 8 requests in flight: requests/s near saturation). A round trip is
timed in the load process from the request's PUBLISH written to its reply read (the same clock).
After ``warmup`` seconds, the window counts completed requests and keeps every round trip
(percentiles are exact). Broker CPU is read from /proc over the window: ``us/req`` = broker
CPU µs per request, the cost with a CPU to itself; ``wait%`` = the share of the window the
broker was runnable but waiting for its CPU (the scheduler's run delay: other processes on a
shared machine), which says how much of a round trip was spent queued behind others. Every
request must get exactly one reply (a reply with an unknown or repeated correlation, or a
request left without a reply 10 s after the window, fails the run). Prints the table with the
ratios to Mosquitto and writes ``bench/results/services-<UTC time>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from meshbench import BenchError
from meshbench.brokers import (
    LOSSLESS_MESHMQ,
    ProcStats,
    RunningBroker,
    ensure_mosquitto,
    pinned,
    proc_stats,
    start_meshmq,
    start_mosquitto,
)
from meshbench.report import tree_state, write_json

RESULTS = Path(__file__).resolve().parent / "results"
CREDIT = 8  # requests a service worker takes at once (meshmq: the ``credit`` property)
DRAIN = 10.0  # seconds after the window for every sent request to get its reply


@dataclass(frozen=True)
class Variant:
    name: str
    broker: str  # meshmq or mosquitto
    services: bool  # $service/ topics (else plain request/response over $share)
    settings: dict[str, object]


VARIANTS = (
    Variant("mosquitto", "mosquitto", False, {}),
    Variant("meshmq-plain", "meshmq", False, {**LOSSLESS_MESHMQ, "log.enabled": False}),
    Variant("services-interval", "meshmq", True, {**LOSSLESS_MESHMQ, "log.fsync": "interval"}),
    Variant("services-always", "meshmq", True, {**LOSSLESS_MESHMQ, "log.fsync": "always"}),
)
LOADS = {"serial": (1, 1), "loaded": (4, 8)}  # name -> (callers, requests in flight each)


# ---------------------------------------------------------------------- the load process


async def load(port: int, services: bool, workers: int, callers: int, depth: int,
               warmup: float, duration: float) -> dict[str, Any]:
    """Service workers and callers against the broker on ``port``; the window's figures."""
    from meshmq.client import Client
    from meshmq.mqtt.packets import Publish
    from meshmq.mqtt.properties import PropertyId, get_property

    address = f"127.0.0.1:{port}"
    request_topic = "$service/bench" if services else "svc/bench"
    offer = "$service/bench" if services else "$share/svc/svc/bench"
    served: list[Client] = []
    tasks: set[asyncio.Task[Any]] = set()

    for index in range(workers):
        worker = Client(address, f"sw-{index}", clean_start=True, session_expiry=0)

        def serve(packet: Publish, worker: Client = worker) -> None:
            topic = get_property(packet.properties, PropertyId.RESPONSE_TOPIC)
            correlation = get_property(packet.properties, PropertyId.CORRELATION_DATA)
            task = asyncio.ensure_future(worker.publish(
                topic, packet.payload, 1, {PropertyId.CORRELATION_DATA: correlation}))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        worker.add_listener(serve)
        await worker.start()
        properties = {PropertyId.USER_PROPERTY: [("credit", str(CREDIT))]} if services else {}
        code = await worker.subscribe(offer, 1, properties)
        if code > 1:
            raise RuntimeError(f"SUBSCRIBE {offer} refused: 0x{code:02X}")
        served.append(worker)

    loop = asyncio.get_running_loop()
    pending: dict[bytes, asyncio.Future[float]] = {}
    problems: list[str] = []
    replies = duplicates = 0

    clock = time.perf_counter

    def replied(packet: Publish) -> None:
        nonlocal replies, duplicates
        correlation = get_property(packet.properties, PropertyId.CORRELATION_DATA)
        future = pending.pop(correlation or b"", None)
        if future is None or future.done():
            duplicates += 1
            return
        replies += 1
        future.set_result(clock())

    clients = []
    for index in range(callers):
        caller = Client(address, f"caller-{index}", clean_start=True, session_expiry=0)
        caller.add_listener(replied)
        await caller.start()
        await caller.subscribe(f"reply/caller-{index}", 1)
        clients.append(caller)

    window: list[float] = []  # round trips of requests sent inside the window (seconds)
    start = clock() + warmup
    end = start + duration
    counted = 0
    sent = 0
    print("event started", flush=True)

    async def stream(caller: Client, lane: int) -> None:
        nonlocal counted, sent
        properties_base = {PropertyId.RESPONSE_TOPIC: f"reply/{caller.client_id}"}
        number = 0
        while clock() < end:
            correlation = f"{caller.client_id}:{lane}:{number}".encode()
            number += 1
            future: asyncio.Future[float] = loop.create_future()
            pending[correlation] = future
            began = clock()
            sent += 1
            code = await caller.publish(request_topic, b"x" * 64, 1, {
                **properties_base, PropertyId.CORRELATION_DATA: correlation})
            if code >= 0x80:
                problems.append(f"PUBACK 0x{code:02X}")
                pending.pop(correlation, None)
                return
            try:
                arrived = await asyncio.wait_for(future, DRAIN)
            except TimeoutError:
                problems.append(f"no reply to {correlation!r} in {DRAIN:g} s")
                return
            if began >= start and arrived <= end:  # wholly inside the window
                window.append(arrived - began)
                counted += 1

    async def marks() -> None:
        await asyncio.sleep(max(0.0, start - clock()))
        print("event window_start", flush=True)
        await asyncio.sleep(max(0.0, end - clock()))
        print("event window_end", flush=True)

    marker = asyncio.ensure_future(marks())
    await asyncio.gather(*(stream(caller, lane) for caller in clients
                           for lane in range(depth)))
    await marker
    for client in [*clients, *served]:
        await client.close()
    if pending:
        problems.append(f"{len(pending)} requests without a reply")
    if duplicates:
        problems.append(f"{duplicates} replies repeated or unknown")
    return {"requests": counted, "round_trips": window, "sent": sent, "replies": replies,
            "problems": problems}


# ---------------------------------------------------------------------- the driver


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_variant(variant: Variant, workers: int, load_name: str, warmup: float,
                duration: float, mosquitto: str) -> dict[str, Any]:
    callers, depth = LOADS[load_name]
    with tempfile.TemporaryDirectory(prefix="service-cost-") as tmp:
        workdir = Path(tmp)
        broker: RunningBroker
        if variant.broker == "mosquitto":
            broker = start_mosquitto(workdir, mosquitto, "0")
        else:
            broker = start_meshmq(workdir, variant.settings, "0")
        try:
            cmd = pinned("1", [sys.executable, __file__, "--load", json.dumps({
                "port": broker.port, "services": variant.services, "workers": workers,
                "callers": callers, "depth": depth, "warmup": warmup,
                "duration": duration})])
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
            samples: dict[str, tuple[ProcStats, ProcStats]] = {}
            result: dict[str, Any] | None = None
            assert proc.stdout is not None
            for line in proc.stdout:
                kind, _, rest = line.strip().partition(" ")
                if kind == "event" and rest.startswith("window_"):
                    samples[rest] = (broker.stats(), proc_stats(proc.pid))
                elif kind == "result":
                    result = json.loads(rest)
            proc.wait(timeout=60)
            if result is None:
                raise BenchError(f"load process failed: {proc.stderr.read()[-2000:]}"
                                 if proc.stderr else "load process failed")
        finally:
            broker.stop()
    trips = result.pop("round_trips")
    (broker_start, load_start), (broker_end, load_end) = (samples["window_start"],
                                                          samples["window_end"])
    broker_cpu = broker_end.cpu_s - broker_start.cpu_s
    load_cpu = load_end.cpu_s - load_start.cpu_s
    requests = result["requests"]
    return {"variant": variant.name, "workers": workers, "load": load_name,
            "rate": requests / duration, "p50_ms": percentile(trips, 0.5) * 1000,
            "p99_ms": percentile(trips, 0.99) * 1000,
            "broker_us_per_request": broker_cpu / requests * 1e6 if requests else float("nan"),
            "broker_cpu_pct": broker_cpu / duration * 100,
            "load_cpu_pct": load_cpu / duration * 100,
            "broker_wait_pct": (broker_end.wait_s - broker_start.wait_s) / duration * 100,
            "load_wait_pct": (load_end.wait_s - load_start.wait_s) / duration * 100,
            "broker_syscalls_per_request": (broker_end.syscalls - broker_start.syscalls)
            / requests if requests else float("nan"),
            **result}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="services beside plain request/response "
                                "(docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="0.5 s warm-up, 2 s windows")
    p.add_argument("--workers-list", default="1,4,16", help="numbers of service workers")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell (medians)")
    p.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    p.add_argument("--load", help=argparse.SUPPRESS)  # the load process's own arguments
    args = p.parse_args(argv)
    if args.load:
        spec = json.loads(args.load)
        try:
            import uvloop  # as the broker's

            uvloop.install()
        except ImportError:
            pass
        print("result " + json.dumps(asyncio.run(load(**spec))), flush=True)
        return 0
    warmup, duration = (0.5, 2.0) if args.quick else (1.0, 4.0)
    chosen = [v for v in VARIANTS if v.name in args.variants.split(",")]
    try:
        mosquitto = ensure_mosquitto()
        runs: list[dict[str, Any]] = []
        for workers in (int(n) for n in args.workers_list.split(",")):
            for load_name in LOADS:
                for repeat in range(args.repeat):
                    order = chosen if repeat % 2 == 0 else list(reversed(chosen))
                    for variant in order:
                        run = run_variant(variant, workers, load_name, warmup, duration,
                                          mosquitto)
                        runs.append(run)
                        print(f"  {variant.name:<18} N={workers:<3} {load_name:<7}"
                              f" {run['rate']:>8,.0f} req/s p50 {run['p50_ms']:6.2f} ms"
                              f" p99 {run['p99_ms']:6.2f} ms"
                              f" {run['broker_us_per_request']:7.1f} us/req"
                              f" broker {run['broker_cpu_pct']:3.0f}%"
                              f" (waiting {run['broker_wait_pct']:3.0f}%)"
                              f" load {run['load_cpu_pct']:3.0f}%"
                              f" (waiting {run['load_wait_pct']:3.0f}%)"
                              f" {run['problems'] or 'ok'}", file=sys.stderr)
    except BenchError as error:
        print(f"service_cost: {error}", file=sys.stderr)
        return 2
    table = summarise(runs)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    write_json(RESULTS / f"services-{stamp}.json", {
        "time": stamp, "tree": tree_state(), "loadavg": os.getloadavg(), "runs": runs,
        "table": table})
    return 1 if any(run["problems"] for run in runs) else 0


def summarise(runs: list[dict[str, Any]]) -> str:
    """Medians per cell, and each variant's ratio to Mosquitto's (req/s, p50, us/req)."""
    cells: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    for run in runs:
        cells.setdefault((run["workers"], run["load"], run["variant"]), []).append(run)

    def med(key: tuple[int, str, str], figure: str) -> float:
        return statistics.median(run[figure] for run in cells[key])

    lines = [f"{'N':>3} {'load':<7} {'variant':<18} {'req/s':>8} {'p50 ms':>7} {'p99 ms':>7}"
             f" {'us/req':>7} {'wait%':>6} {'x req/s':>8} {'x p50':>6} {'x us/req':>8}"]
    for workers, load_name, variant in sorted(cells, key=lambda k: (k[0], k[1] != "serial")):
        key = (workers, load_name, variant)
        base = (workers, load_name, "mosquitto")
        ratio = ["", "", ""]
        if base in cells:
            ratio = [f"{med(key, figure) / med(base, figure):.2f}"
                     for figure in ("rate", "p50_ms", "broker_us_per_request")]
        lines.append(f"{workers:>3} {load_name:<7} {variant:<18} {med(key, 'rate'):>8,.0f}"
                     f" {med(key, 'p50_ms'):>7.2f} {med(key, 'p99_ms'):>7.2f}"
                     f" {med(key, 'broker_us_per_request'):>7.1f}"
                     f" {med(key, 'broker_wait_pct'):>6.0f} {ratio[0]:>8} {ratio[1]:>6}"
                     f" {ratio[2]:>8}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
