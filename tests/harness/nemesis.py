"""Nemeses: faults injected on a schedule, each with its heal.

A ``Nemesis`` has an ``inject``, a ``took`` condition (how the test knows the fault bit: every
publisher lost its connection, or went ``HELD`` seconds waiting for an answer, or the worker's
death was logged, or acknowledgements go on through a delay) and a ``heal``. ``run_schedule`` draws
rounds from a seeded ``random.Random`` (print the seed; the same seed replays the same order),
and per round: inject, wait until it took, heal, wait until acknowledged publishes flow again.
Nothing sleeps for a fixed time: every phase ends on a condition, bounded by a timeout.

Today's nemeses act on one node (its processes) and on the proxy in front of it; the cluster
work adds the same kinds per link and per node (``NetworkLab.cut``/``partition``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from netns import NetworkLab
from nodes import Node
from proxy import Direction, Proxy
from workload import Workload

from conftest import wait_for

PROGRESS = 100  # acknowledged publishes that show the workload flows again
WORKER_EXITED = "worker exited unexpectedly"  # the supervisor's line (docs/workers.md)
HELD = 1.0  # seconds without an answer that show a fault holding the publishers took effect


@dataclass
class Nemesis:
    name: str
    inject: Callable[[], object]
    took: Callable[[Workload, list[int]], None]  # given the publishers' disconnects before
    heal: Callable[[], object]


def held(every: bool) -> Callable[[Workload, list[int]], None]:
    """The fault took once every publisher (``every=False``: one) has waited ``HELD`` seconds
    without an answer: a fault that closes nothing (a pause, a blackhole) has no other sign."""
    def wait(workload: Workload, _before: list[int]) -> None:
        wait_for(lambda: workload.quiet(HELD, every), timeout=30,
                 what=f"{'every' if every else 'a'} publisher to go {HELD} s without an answer")
    return wait


def disconnected(workload: Workload, before: list[int]) -> None:
    """The fault took once every publisher lost its connection."""
    wait_for(lambda: workload.all_disconnected_since(before), timeout=30,
             what="every publisher to lose its connection")


def flowing(workload: Workload, _before: list[int]) -> None:
    workload.wait_acked(PROGRESS)


def node_nemeses(node: Node) -> list[Nemesis]:
    """Faults of the node's processes: kill -9 / SIGSTOP of a worker or of the whole node."""
    killed: list[int] = []
    exits_before: list[int] = []

    def kill_worker(index: int) -> None:
        exits_before.append(node.log().count(WORKER_EXITED))
        killed.append(node.kill_worker(index))

    def worker_back(index: int) -> None:
        node.wait_worker_restarted(index, killed.pop())

    def worker_died(_workload: Workload, _before: list[int]) -> None:
        exits = exits_before.pop()
        wait_for(lambda: node.log().count(WORKER_EXITED) > exits,
                 what="the supervisor to see the worker die")

    result = [
        Nemesis("pause the node", node.pause, held(every=True), node.resume),
        Nemesis("kill -9 the node", node.kill, disconnected, node.restart),
    ]
    for index in range(1, node.workers):
        result += [
            Nemesis(f"kill -9 worker {index}", partial(kill_worker, index), worker_died,
                    partial(worker_back, index)),
            Nemesis(f"pause worker {index}", partial(node.pause_worker, index),
                    held(every=False), partial(node.resume_worker, index)),
        ]
    return result


def netns_nemeses(lab: NetworkLab, short: str) -> list[Nemesis]:
    """A real partition: namespace ``short`` (a node's) cut off, then healed."""
    return [Nemesis(f"cut namespace {short} off", lambda: lab.cut(short), held(every=True),
                    lab.heal)]


def proxy_nemeses(proxy: Proxy) -> list[Nemesis]:
    """Faults of the link between the clients and the node."""
    return [
        Nemesis("delay 20 ms + up to 30 ms", lambda: proxy.delay(0.02, 0.03), flowing,
                proxy.heal),
        Nemesis("drop connections", proxy.drop, disconnected, proxy.heal),
        Nemesis("blackhole", proxy.blackhole, held(every=True), proxy.heal),
        Nemesis("half-open: only to the node", lambda: proxy.half_open(Direction.TO_NODE),
                held(every=True), proxy.heal),
        Nemesis("half-open: only to the clients", lambda: proxy.half_open(Direction.TO_CLIENT),
                held(every=True), proxy.heal),
    ]


@dataclass
class Round:
    nemesis: str
    took_s: float
    healed_s: float


@dataclass
class Schedule:
    seed: int
    rounds: list[Round] = field(default_factory=list)

    def render(self) -> str:
        lines = [f"nemesis schedule, seed {self.seed} (MESHMQ_FAULTS_SEED={self.seed} replays "
                 "the order):"]
        lines += [f"  {i:2}. {r.nemesis:32} took effect in {r.took_s:5.2f} s, flowing again "
                  f"{r.healed_s:5.2f} s after the heal" for i, r in enumerate(self.rounds, 1)]
        return "\n".join(lines)


def run_schedule(workload: Workload, nemeses: Sequence[Nemesis], rounds: int,
                 seed: int) -> Schedule:
    """``rounds`` nemeses drawn with ``seed`` (each once before any repeats)."""
    rng = random.Random(seed)
    schedule = Schedule(seed)
    order: list[Nemesis] = []
    for _ in range(rounds):
        if not order:
            order = list(nemeses)
            rng.shuffle(order)
        nemesis = order.pop()
        began, before = time.monotonic(), workload.disconnects()
        nemesis.inject()
        nemesis.took(workload, before)
        took = time.monotonic()
        nemesis.heal()
        workload.wait_acked(PROGRESS, timeout=60)
        schedule.rounds.append(Round(nemesis.name, took - began, time.monotonic() - took))
    return schedule
