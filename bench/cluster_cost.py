"""A cluster of three meshmq nodes on this machine beside one node and Mosquitto, on the same
CPUs: broker CPU per message delivered across nodes, fan-out over the nodes, connect rate
across them, and a node killed under QoS 1 traffic (docs/benchmarks.md, section "A cluster of
three nodes on one machine").

Usage::

    .venv/bin/python bench/cluster_cost.py [--quick] [--repeat N]
        [--only cost,fanout,connect,persisted,failover] [--failovers N]
        [--kill controller|other]
        [--fault kill|stop|pause] [--fail-observe S]

Every broker (Mosquitto, the single meshmq node, all three cluster nodes) runs under ``taskset
-c 0`` (``--broker-cpus``); the clients (this process and the C load generators) run on CPU 1
(``--client-cpus``). So the cluster gets no more CPU than the one node: what it shows is what
crossing between nodes costs, not how the work spreads. Each meshmq node has one worker, the
commit log off (the like-for-like setting of the suite; the failover part has it on) and an
admin listener. Per repetition each setup (Mosquitto, one meshmq node, the cluster) is started
once, in an order that alternates, and runs every part:

* ``cost``: ``--pairs`` publisher → subscriber pairs (own topic each, MQTT 5.0, 64-byte
  payloads), QoS 0 and QoS 1 (publishes and subscriptions); on the cluster ``local`` (all on n1)
  and ``cross`` (publishers on n1, subscribers on n2: every message crosses once). Broker CPU
  µs per delivered message (= CPU ms per 1,000 messages) over all the setup's processes.
* ``fanout``: one publisher (on n1) → ``--fanout-subs`` subscribers of one topic, QoS 0; on the
  cluster ``one`` (all on n1) and ``spread`` (round robin over n1, n2, n3). µs per delivery.
* ``connect``: ``--conns`` clients connect, 64 handshakes in flight, through three C load
  generators at once; on the cluster ``one`` (all three to n1) and ``spread`` (one per node).
  Connections/s and broker CPU µs per connection.
* ``persisted``: the pairs at QoS 1 with the commit log on (``fsync = "always"``, the
  default) and the metadata on (the default): a one-node setup with the log, and a cluster
  whose partitions are led across its nodes. On the cluster ``leader`` (each pair's publisher
  and subscriber on the node leading its topic's partition: nothing crosses) and ``proxied``
  (the publisher on the next node, the subscriber on the third: the append crosses to the
  leader and the delivery crosses from it). Mosquitto (no persistence) runs the same pairs
  for reference. Broker CPU µs per delivered message.
* ``failover`` (``clusterfail``): a fresh cluster with ``cluster.metadata = true`` and the log
  on; paced QoS 1 publishes on the two surviving nodes; kill -9 of one node (``--fault stop``:
  SIGSTOP of its every process, a hung host; ``pause``: the same, then SIGCONT, and the node's
  subscribers must hear new publishes again); the time until the survivors' ``GET
  /api/v1/cluster`` reports it down (its partitions offline) and the longest gap in PUBACKs on
  the survivors.

Prints the tables (medians over the repetitions, ratios), writes
``bench/results/cluster-<UTC time>.json``. Exit status 1 if a run failed validation, 2 if it
cannot run (one line on stderr).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from datetime import UTC, datetime
from functools import partial
from pathlib import Path

from meshbench import BenchError, run_command, validation_status
from meshbench.brokers import (
    RunningBroker,
    ensure_mosquitto,
    mosquitto_version,
    start_meshmq,
    start_mosquitto,
)
from meshbench.build import build_loadgen
from meshbench.cluster import API_KEY, Cluster, partitions_settled, start_cluster
from meshbench.clusterconnect import run_connects
from meshbench.clusterfail import FAULTS, run_failover
from meshbench.clustertraffic import Flow, Sampler, run_flows
from meshbench.report import tree_state, write_json
from meshbench.scenarios import LOG_OFF

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("cost", "fanout", "connect", "persisted", "failover")
SETUPS = ("mosquitto", "single", "cluster", "single-log", "cluster-log")
NODES = 3
# Every meshmq node of the cost, fan-out and connect parts: one worker, log off, lossless
# queues (as Mosquitto's max_queued_messages 0), an admin listener (the cluster's nodes need
# one to say when they are linked; the single node has one too, so both carry the same).
MESHMQ: dict[str, object] = {**LOG_OFF, "server.workers": 1, "admin.listen": "127.0.0.1:0",
                             "admin.api_key": API_KEY}
# The persisted part's nodes: the same with the commit log on, fsync always (the defaults).
MESHMQ_LOG: dict[str, object] = {**MESHMQ, "log.enabled": True, "log.fsync": "always"}
PARTITIONS = 8  # log.partitions, the default

Results = dict[str, dict[str, list[dict[str, object]]]]  # part -> case -> runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="meshmq: a 3-node cluster on this machine beside one node and Mosquitto "
                    "(docs/benchmarks.md)")
    p.add_argument("--quick", action="store_true", help="short windows, small loads: a smoke test")
    p.add_argument("--only", help="parts to run, comma-separated: " + ",".join(PARTS))
    p.add_argument("--repeat", type=int, help="repetitions of each setup (default 2; 1 quick)")
    p.add_argument("--warmup", type=float, help="seconds of traffic before each window")
    p.add_argument("--duration", type=float, help="seconds in each measured window")
    p.add_argument("--pairs", type=int, default=6, help="publisher/subscriber pairs, cost part")
    p.add_argument("--fanout-subs", type=int, help="subscribers in the fan-out (default 300)")
    p.add_argument("--conns", type=int, help="clients in the connect part (default 6000)")
    p.add_argument("--failovers", type=int, default=1, help="kills in the failover part")
    p.add_argument("--kill", choices=("controller", "other"), default="controller",
                   help="failover: kill the controller's node, or another one")
    p.add_argument("--fault", choices=FAULTS, default="kill",
                   help="failover: kill -9 the node, SIGSTOP every process of it (a hang), or "
                        "pause it (SIGSTOP, then SIGCONT after --fail-observe)")
    p.add_argument("--fail-observe", type=float,
                   help="failover: seconds of traffic after the fault (default 8 for kill, 16 "
                        "for stop and pause: a silent link is closed after 12 s; 4 and 15 with "
                        "--quick)")
    p.add_argument("--fail-rate", type=float, default=100.0,
                   help="failover: QoS 1 publishes/s of each of the 16 publishers")
    p.add_argument("--no-mosquitto", action="store_true", help="meshmq only")
    p.add_argument("--broker-cpus", default="0", help="taskset list for every broker")
    p.add_argument("--client-cpus", default="1", help="taskset list for the clients")
    p.add_argument("--no-pin", action="store_true", help="pin nothing")
    p.add_argument("--results", type=Path, default=RESULTS, help="output directory")
    args = p.parse_args(argv)
    args.parts = args.only.split(",") if args.only else list(PARTS)
    unknown = [part for part in args.parts if part not in PARTS]
    if unknown:
        raise ValueError(f"--only: unknown part {unknown[0]!r}; known: {', '.join(PARTS)}")
    quick = args.quick
    args.repeat = args.repeat if args.repeat is not None else (1 if quick else 2)
    args.warmup = args.warmup if args.warmup is not None else (0.3 if quick else 1.0)
    args.duration = args.duration if args.duration is not None else (1.0 if quick else 3.0)
    args.fanout_subs = args.fanout_subs or (30 if quick else 300)
    args.conns = args.conns or (1500 if quick else 6000)
    if args.fail_observe is None:
        args.fail_observe = 4.0 if quick else 8.0
        if args.fault != "kill":
            args.fail_observe = 15.0 if quick else 16.0
    if args.fail_observe <= 0:
        raise ValueError("--fail-observe: must be positive")
    for name in ("repeat", "pairs", "fanout_subs", "conns"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}: must be at least 1")
    if args.failovers < 0:
        raise ValueError("--failovers: must be 0 or more")
    if args.duration <= 0 or args.warmup < 0:
        raise ValueError("--duration must be positive and --warmup not negative")
    if args.conns < NODES:
        raise ValueError(f"--conns: must be at least {NODES}")
    return args


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + ", ".join(f.read().split()[:3])


def cpu_set(text: str) -> set[int]:
    """The CPUs of a taskset list such as ``0``, ``0-1`` or ``0,2``."""
    found: set[int] = set()
    for item in text.split(","):
        low, _, high = item.partition("-")
        try:
            found |= set(range(int(low), int(high or low) + 1))
        except ValueError:
            raise ValueError(f"not a CPU list: {text!r}") from None
    return found


def pin_self(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(broker CPUs, client CPUs) as taskset lists, None when not pinned; this process (the
    Python clients) moves to the client CPUs."""
    if args.no_pin:
        return None, None
    wanted = cpu_set(args.broker_cpus) | cpu_set(args.client_cpus)
    allowed = os.sched_getaffinity(0)
    if not wanted <= allowed:
        raise BenchError(f"CPUs {sorted(wanted)} are needed for pinning (this process may use "
                         f"{sorted(allowed)}); use --broker-cpus/--client-cpus or --no-pin")
    os.sched_setaffinity(0, cpu_set(args.client_cpus))
    return args.broker_cpus, args.client_cpus


# ------------------------------------------------------------------------------ cases


def pair_flows(pub_ports: list[int], sub_ports: list[int], names: tuple[str, str],
               pairs: int) -> list[Flow]:
    """``pairs`` flows ``bench/cluster/pair/<i>``, publisher i on ``pub_ports[i % n]``,
    subscriber on ``sub_ports[i % n]``."""
    return [Flow(f"bench/cluster/pair/{i}", pub_ports[i % len(pub_ports)],
                 (sub_ports[i % len(sub_ports)],), names) for i in range(pairs)]


def fanout_flow(pub_port: int, sub_ports: list[int], names: list[str], subs: int) -> Flow:
    """One publisher, ``subs`` subscribers of ``bench/cluster/out`` round robin over
    ``sub_ports``."""
    chosen = [sub_ports[i % len(sub_ports)] for i in range(subs)]
    where = tuple(names[i % len(names)] for i in range(subs))
    return Flow("bench/cluster/out", pub_port, tuple(chosen), where)


Case = tuple[str, str, Callable[[], dict[str, object]]]  # (part, case, run)


def setups_for(parts: list[str], mosquitto: bool) -> list[str]:
    """The setups that have a case to run for ``parts``."""
    wanted = []
    if mosquitto and any(p in parts for p in ("cost", "fanout", "connect", "persisted")):
        wanted.append("mosquitto")
    if any(p in parts for p in ("cost", "fanout", "connect")):
        wanted += ["single", "cluster"]
    if "persisted" in parts:
        wanted += ["single-log", "cluster-log"]
    return wanted


def led_pair_flows(ports: dict[str, int], leaders: dict[int, str], pairs: int,
                   proxied: bool) -> list[Flow]:
    """The pairs of ``pair_flows`` placed by their partition's leader node: publisher and
    subscriber on it, or (``proxied``) the publisher on the next node and the subscriber on
    the one after (crc32 of the topic modulo the partitions, as the log's partitioner)."""
    names = sorted(ports)
    flows = []
    for i in range(pairs):
        topic = f"bench/cluster/pair/{i}"
        leader = leaders[zlib.crc32(topic.encode()) % PARTITIONS]
        at = names.index(leader)
        pub, sub = ((names[(at + 1) % len(names)], names[(at + 2) % len(names)]) if proxied
                    else (leader, leader))
        flows.append(Flow(topic, ports[pub], (ports[sub],), (pub, sub)))
    return flows


def cases_for(setup: str, args: argparse.Namespace, ports: dict[str, int], sampler: Sampler,
              loadgen: Path | None, client_cpus: str | None, flip: bool,
              leaders: dict[int, str] | None = None) -> list[Case]:
    """What runs on one started setup, in order; ``flip`` reverses the order of the two
    cluster cases of each part (drift hits both)."""
    w, d = args.warmup, args.duration
    cases: list[Case] = []
    if setup in ("single-log", "cluster-log"):
        if setup == "cluster-log":
            node_ports = {name: port for name, port in ports.items() if name.startswith("n")}
            led = {name: led_pair_flows(node_ports, leaders or {}, args.pairs, name == "proxied")
                   for name in ("leader", "proxied")}
        else:
            led = {setup: pair_flows([ports[setup]], [ports[setup]], (setup, setup),
                                     args.pairs)}
        return [("persisted", name, partial(run_flows, led[name], 1, sampler, w, d))
                for name in (reversed(list(led)) if flip else led)]
    if setup == "cluster":
        n1, n2 = ports["n1"], ports["n2"]
        spread = [ports[f"n{i + 1}"] for i in range(NODES)]
        names = [f"n{i + 1}" for i in range(NODES)]
        message = {"local": pair_flows([n1], [n1], ("n1", "n1"), args.pairs),
                   "cross": pair_flows([n1], [n2], ("n1", "n2"), args.pairs)}
        fan = {"one": fanout_flow(n1, [n1], ["n1"], args.fanout_subs),
               "spread": fanout_flow(n1, spread, names, args.fanout_subs)}
        conn = {"one": [n1] * NODES, "spread": spread}
    else:
        port = ports[setup]
        message = {setup: pair_flows([port], [port], (setup, setup), args.pairs)}
        fan = {setup: fanout_flow(port, [port], [setup], args.fanout_subs)}
        conn = {setup: [port] * NODES}

    def ordered(items: dict) -> list:
        keys = list(items)
        return list(reversed(keys)) if flip else keys

    if "persisted" in args.parts and setup == "mosquitto":
        cases.append(("persisted", "mosquitto",
                      partial(run_flows, message[setup], 1, sampler, w, d)))
    if "cost" in args.parts:
        for qos in (0, 1):
            for name in ordered(message):
                cases.append((f"qos{qos}", name,
                              partial(run_flows, message[name], qos, sampler, w, d)))
    if "fanout" in args.parts:
        for name in ordered(fan):
            cases.append(("fanout", name, partial(run_flows, [fan[name]], 0, sampler, w, d)))
    if "connect" in args.parts and loadgen is not None:
        for name in ordered(conn):
            cases.append(("connect", name, partial(run_connects, loadgen, conn[name],
                                                   args.conns, client_cpus, sampler)))
    return cases


def run_setup(setup: str, args: argparse.Namespace, cpus: tuple[str | None, str | None],
              mosquitto: str | None, loadgen: Path | None, flip: bool,
              results: Results) -> None:
    """Start ``setup``, run its cases, stop it; the outcomes go to ``results``."""
    broker_cpus, client_cpus = cpus
    workdir = Path(tempfile.mkdtemp(prefix=f"meshbench-cluster-{setup}-"))
    broker: RunningBroker | None = None
    cluster: Cluster | None = None
    leaders: dict[int, str] | None = None
    try:
        if setup in ("cluster", "cluster-log"):
            persisted = setup == "cluster-log"
            cluster = start_cluster(workdir, NODES, MESHMQ_LOG if persisted else MESHMQ,
                                    broker_cpus, metadata=persisted)
            ports = {node.name: node.port for node in cluster.nodes}
            sampler: Sampler = cluster.stats
            if persisted:
                leaders = await_leaders(cluster)

            def problems() -> list[str]:
                return cluster.problems() if cluster is not None else []
        else:
            if setup == "mosquitto":
                assert mosquitto is not None
                broker = start_mosquitto(workdir, mosquitto, broker_cpus)
            else:
                broker = start_meshmq(workdir, MESHMQ_LOG if setup == "single-log" else MESHMQ,
                                      broker_cpus)
            ports = {setup: broker.port}
            one = broker
            sampler = lambda: {setup: one.stats()}  # noqa: E731

            def problems() -> list[str]:
                return [] if one.alive() else [f"{setup} died: {one.log_tail(3)}"]
        for part, case, run in cases_for(setup, args, ports, sampler, loadgen, client_cpus,
                                         flip, leaders):
            try:
                outcome = run()
            except BenchError as exc:  # a run that broke: recorded, the others go on
                outcome = {"ok": False, "problems": [str(exc)], "figures": {}}
            outcome["problems"] = [*outcome["problems"], *problems()]  # type: ignore[misc]
            outcome["ok"] = outcome["ok"] and not outcome["problems"]
            results.setdefault(part, {}).setdefault(case, []).append(outcome)
            progress(part, case, outcome)
    finally:
        if cluster is not None:
            cluster.stop()
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def await_leaders(cluster: Cluster) -> dict[int, str]:
    """Each partition's leader node, once every node's metadata has them all."""
    deadline = time.monotonic() + 60
    while not partitions_settled(cluster, PARTITIONS):
        if time.monotonic() > deadline:
            raise BenchError("the metadata did not assign every partition within 60 s")
        time.sleep(0.1)
    state = cluster.nodes[0].admin()["metadata"]["partitions"]
    return {int(partition): a["leader"] for partition, a in state.items()}


def progress(part: str, case: str, outcome: dict[str, object]) -> None:
    f: dict[str, float] = outcome.get("figures") or {}  # type: ignore[assignment]
    status = "ok" if outcome["ok"] else "FAILED: " + "; ".join(outcome["problems"])  # type: ignore[arg-type]
    if part == "connect":
        text = (f"{f.get('connect_rate', 0):>9,.0f} conn/s "
                f"{f.get('broker_us_per_conn', 0):6.1f} us/conn broker CPU")
    else:
        text = (f"{f.get('rate', 0):>9,.0f} msg/s {f.get('broker_us_per_msg', 0):6.2f} us/msg "
                f"broker CPU {f.get('broker_cpu_pct', 0):4.0f}% client "
                f"{f.get('client_cpu_pct', 0):3.0f}%")
    print(f"  {part:<8} {case:<10} {text} [{status}]", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------ tables


def median(results: Results, part: str, case: str, figure: str) -> float | None:
    values = [float(r["figures"][figure])  # type: ignore[index]
              for r in results.get(part, {}).get(case, [])
              if r["ok"] and figure in r["figures"]]  # type: ignore[operator]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def num(value: float | None, digits: int = 2) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def grid(header: list[str], lines: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

    def fmt(row: list[str]) -> str:
        return "  ".join(cell.rjust(w) if i else cell.ljust(w)
                         for i, (cell, w) in enumerate(zip(row, widths, strict=True)))

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *map(fmt, lines)])


def summary(results: Results) -> dict[str, list[dict[str, object]]]:
    """The tables' rows (medians, ratios), as printed and as written to the JSON file."""
    tables: dict[str, list[dict[str, object]]] = {"cost": [], "fanout": [], "connect": [],
                                                  "persisted": []}
    if "persisted" in results:
        us = {case: median(results, "persisted", case, "broker_us_per_msg")
              for case in ("mosquitto", "single-log", "leader", "proxied")}
        rate = {case: median(results, "persisted", case, "rate") for case in us}
        tables["persisted"].append({
            "us_per_msg": us, "rate": rate,
            "proxied_minus_leader_us": (None if us["proxied"] is None or us["leader"] is None
                                        else us["proxied"] - us["leader"]),
            "proxied_over_leader": ratio(us["proxied"], us["leader"]),
            "leader_over_single": ratio(us["leader"], us["single-log"]),
            "single_over_mosquitto": ratio(us["single-log"], us["mosquitto"])})
    for part in ("qos0", "qos1"):
        if part not in results:
            continue
        us = {case: median(results, part, case, "broker_us_per_msg")
              for case in ("mosquitto", "single", "local", "cross")}
        rate = {case: median(results, part, case, "rate") for case in us}
        tables["cost"].append({
            "load": part, "us_per_msg": us, "rate": rate,
            "cross_n1_us": median(results, part, "cross", "n1_us_per_msg"),
            "cross_n2_us": median(results, part, "cross", "n2_us_per_msg"),
            "cross_n3_us": median(results, part, "cross", "n3_us_per_msg"),
            "cross_minus_local_us": (None if us["cross"] is None or us["local"] is None
                                     else us["cross"] - us["local"]),
            "cross_over_local": ratio(us["cross"], us["local"]),
            "cross_over_single": ratio(us["cross"], us["single"]),
            "cross_over_mosquitto": ratio(us["cross"], us["mosquitto"]),
            "single_over_mosquitto": ratio(us["single"], us["mosquitto"])})
    if "fanout" in results:
        us = {case: median(results, "fanout", case, "broker_us_per_msg")
              for case in ("mosquitto", "single", "one", "spread")}
        rate = {case: median(results, "fanout", case, "rate") for case in us}
        tables["fanout"].append({
            "us_per_delivery": us, "rate": rate,
            "spread_over_one": ratio(us["spread"], us["one"]),
            "spread_over_single": ratio(us["spread"], us["single"]),
            "spread_over_mosquitto": ratio(us["spread"], us["mosquitto"])})
    if "connect" in results:
        us = {case: median(results, "connect", case, "broker_us_per_conn")
              for case in ("mosquitto", "single", "one", "spread")}
        rate = {case: median(results, "connect", case, "connect_rate") for case in us}
        tables["connect"].append({
            "us_per_conn": us, "rate": rate,
            "spread_over_one_rate": ratio(rate["spread"], rate["one"]),
            "spread_over_single_rate": ratio(rate["spread"], rate["single"]),
            "spread_over_mosquitto_rate": ratio(rate["spread"], rate["mosquitto"]),
            "spread_over_one_cpu": ratio(us["spread"], us["one"])})
    return tables


def print_tables(tables: dict[str, list[dict[str, object]]],
                 failovers: list[dict[str, object]], args: argparse.Namespace) -> None:
    for row in tables["cost"]:
        us: dict = row["us_per_msg"]  # type: ignore[assignment]
        rate: dict = row["rate"]  # type: ignore[assignment]
        if row is tables["cost"][0]:
            print(f"\nBroker CPU per delivered message, µs (= CPU ms per 1,000 messages), "
                  f"{args.pairs} pairs, MQTT 5.0, medians of {args.repeat}; local: all on n1, "
                  "cross: publishers on n1, subscribers on n2")
        print(f"\n{row['load']} (log off)")
        print(grid(["figure", "Mosquitto", "one node", "cluster local", "cluster cross"], [
            ["broker µs/msg", *(num(us[c]) for c in ("mosquitto", "single", "local", "cross"))],
            ["msg/s", *(num(rate[c]) for c in ("mosquitto", "single", "local", "cross"))]]))
        print(f"cross - local = {num(row['cross_minus_local_us'])} µs per message "  # type: ignore[arg-type]
              f"(n1 {num(row['cross_n1_us'])}, n2 {num(row['cross_n2_us'])}, "  # type: ignore[arg-type]
              f"n3 {num(row['cross_n3_us'])} µs in cross); "  # type: ignore[arg-type]
              f"cross/local {times(row['cross_over_local'])}, "  # type: ignore[arg-type]
              f"cross/one node {times(row['cross_over_single'])}, "  # type: ignore[arg-type]
              f"cross/Mosquitto {times(row['cross_over_mosquitto'])}, "  # type: ignore[arg-type]
              f"one node/Mosquitto {times(row['single_over_mosquitto'])}")  # type: ignore[arg-type]
    for row in tables["fanout"]:
        us, rate = row["us_per_delivery"], row["rate"]  # type: ignore[assignment]
        print(f"\nFan-out QoS 0, 1 publisher on n1 -> {args.fanout_subs} subscribers "
              "(one: all on n1; spread: round robin over n1, n2, n3)")
        print(grid(["figure", "Mosquitto", "one node", "cluster one", "cluster spread"], [
            ["broker µs/delivery", *(num(us[c]) for c in ("mosquitto", "single", "one",
                                                          "spread"))],
            ["deliveries/s", *(num(rate[c]) for c in ("mosquitto", "single", "one",
                                                      "spread"))]]))
        print(f"spread/one {times(row['spread_over_one'])}, spread/one node "  # type: ignore[arg-type]
              f"{times(row['spread_over_single'])}, spread/Mosquitto "  # type: ignore[arg-type]
              f"{times(row['spread_over_mosquitto'])} (CPU per delivery)")  # type: ignore[arg-type]
    for row in tables["connect"]:
        us, rate = row["us_per_conn"], row["rate"]  # type: ignore[assignment]
        print(f"\nConnect, {args.conns:,} clients, 3 load generators, 64 handshakes in flight "
              "(one: all to n1; spread: one generator per node)")
        print(grid(["figure", "Mosquitto", "one node", "cluster one", "cluster spread"], [
            ["conn/s", *(num(rate[c]) for c in ("mosquitto", "single", "one", "spread"))],
            ["broker µs/conn", *(num(us[c], 1) for c in ("mosquitto", "single", "one",
                                                         "spread"))]]))
        print(f"rate spread/one {times(row['spread_over_one_rate'])}, spread/one node "  # type: ignore[arg-type]
              f"{times(row['spread_over_single_rate'])}, spread/Mosquitto "  # type: ignore[arg-type]
              f"{times(row['spread_over_mosquitto_rate'])}; CPU per connection spread/one "  # type: ignore[arg-type]
              f"{times(row['spread_over_one_cpu'])}")  # type: ignore[arg-type]
    for row in tables["persisted"]:
        us, rate = row["us_per_msg"], row["rate"]  # type: ignore[assignment]
        cases = ("mosquitto", "single-log", "leader", "proxied")
        print(f"\nQoS 1 persisted (log on, fsync always; cluster with the metadata on), "
              f"{args.pairs} pairs; leader: publisher and subscriber on the partition's leader "
              "node; proxied: publisher on the next node, subscriber on the third")
        print(grid(["figure", "Mosquitto (no log)", "one node", "cluster leader",
                    "cluster proxied"], [
            ["broker µs/msg", *(num(us[c]) for c in cases)],
            ["msg/s", *(num(rate[c]) for c in cases)]]))
        print(f"proxied - leader = {num(row['proxied_minus_leader_us'])} µs per message; "  # type: ignore[arg-type]
              f"proxied/leader {times(row['proxied_over_leader'])}, "  # type: ignore[arg-type]
              f"leader/one node {times(row['leader_over_single'])}, "  # type: ignore[arg-type]
              f"one node/Mosquitto {times(row['single_over_mosquitto'])}")  # type: ignore[arg-type]
    if failovers:
        fault = {"kill": "kill -9", "stop": "SIGSTOP of every process of the node",
                 "pause": "SIGSTOP of every process of the node; SIGCONT "
                          f"{args.fail_observe:g} s later"}[args.fault]
        print(f"\nFailover (cluster.metadata = true, log on, fsync always; 16 QoS 1 publishers "
              f"on the survivors at {args.fail_rate:g}/s each; seconds from the {fault})")
        lines = []
        for n, run in enumerate(failovers, 1):
            f: dict = run.get("figures") or {}  # type: ignore[assignment]
            lines.append([
                str(n), str(run.get("victim", "-"))
                + (" (controller)" if run.get("victim_was_controller") else ""),
                num(f.get("suspected_s")), num(f.get("down_s")), num(f.get("controller_moved_s")),
                num(f.get("ack_gap_before_s"), 3),
                num(f.get("ack_gap_after_other_partitions_s"), 3),
                num(f.get("victim_partitions_refused_s"), 3),
                num(f.get("victim_partitions_waiting"), 0),
                num(f.get("ack_latency_max_after_s"), 3), num(f.get("delivery_gap_after_s"), 3),
                *([num(f.get("relinked_s")), num(f.get("victim_subscribers_resumed_s")),
                   num(f.get("victim_subscribers_missed"), 0)]
                  if args.fault == "pause" else []),
                "ok" if run["ok"] else "FAILED"])
        print(grid(["run", "failed node", "suspected", "reported down", "controller moved",
                    "PUBACK gap before", "PUBACK gap after (other partitions)",
                    "its partitions refused after", "acked, waiting for its return",
                    "max PUBACK wait after", "delivery gap after",
                    *(["relinked after SIGCONT", "its subscribers heard new publishes",
                       "messages its subscribers missed"]
                      if args.fault == "pause" else []), "state"], lines))


# ------------------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cpus = pin_self(args)
    steady = any(part in args.parts for part in ("cost", "fanout", "connect", "persisted"))
    mosquitto = None if args.no_mosquitto or not steady else ensure_mosquitto()
    loadgen = build_loadgen() if "connect" in args.parts else None
    setups = setups_for(args.parts, mosquitto is not None)
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
    args.results.mkdir(parents=True, exist_ok=True)
    load_before = loadavg()
    tree = tree_state()
    print(f"cluster bench: {load_before}; meshmq {tree['commit']}; brokers on CPUs "
          f"{cpus[0] or 'any'}, clients on {cpus[1] or 'any'}; warm-up {args.warmup:g} s, "
          f"window {args.duration:g} s, {args.repeat} repetition(s); parts "
          f"{','.join(args.parts)}", file=sys.stderr)
    started = time.monotonic()
    results: Results = {}
    if steady:
        for repeat in range(args.repeat):
            order = setups if repeat % 2 == 0 else list(reversed(setups))
            for setup in order:
                print(f"repetition {repeat + 1}: {setup}", file=sys.stderr, flush=True)
                run_setup(setup, args, cpus, mosquitto, loadgen, bool(repeat % 2), results)
    failovers: list[dict[str, object]] = []
    if "failover" in args.parts:
        for n in range(args.failovers):
            workdir = Path(tempfile.mkdtemp(prefix="meshbench-cluster-fail-"))
            try:
                outcome = run_failover(workdir, cpus[0], baseline=1.0 if args.quick else 3.0,
                                       observe=args.fail_observe, rate=args.fail_rate,
                                       kill=args.kill, fault=args.fault)
            except BenchError as exc:
                outcome = {"ok": False, "problems": [str(exc)], "figures": {}}
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            failovers.append(outcome)
            f: dict = outcome.get("figures") or {}  # type: ignore[assignment]
            problems: list[str] = outcome["problems"]  # type: ignore[assignment]
            state = "ok" if outcome["ok"] else "FAILED: " + "; ".join(problems)
            print(f"  failover {n + 1}: {args.fault} {outcome.get('victim', '-')}, reported down "
                  f"after {num(f.get('down_s'))} s, longest PUBACK gap after "
                  f"{num(f.get('ack_gap_after_s'), 3)} s (before "
                  f"{num(f.get('ack_gap_before_s'), 3)} s) [{state}]",
                  file=sys.stderr, flush=True)
    tables = summary(results)
    load_after = loadavg()
    print_tables(tables, failovers, args)
    print(f"\n{load_before} before, {load_after} after; {time.monotonic() - started:.0f} s")
    record = {
        "started_utc": stamp, "elapsed_s": round(time.monotonic() - started, 1),
        "command": " ".join(sys.argv),
        "host": {"cpus": os.cpu_count(), "kernel": platform.release(),
                 "python": platform.python_version(), "loadavg_before": load_before,
                 "loadavg_after": load_after,
                 "mosquitto": mosquitto_version(mosquitto) if mosquitto else None},
        "meshmq_tree": tree,
        "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "pinning": {"brokers": cpus[0], "clients": cpus[1]},
        "tables": tables, "failovers": failovers, "runs": results,
    }
    path = args.results / f"cluster-{stamp}.json"
    write_json(path, record)
    print(f"wrote {path}")
    failed = [f"{part}/{case}" for part, by in results.items() for case, runs in by.items()
              if not all(r["ok"] for r in runs)]
    failed += [f"failover {n + 1}" for n, run in enumerate(failovers) if not run["ok"]]
    return validation_status(failed)


if __name__ == "__main__":
    run_command(main, "cluster bench")
