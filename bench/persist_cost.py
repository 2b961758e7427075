"""CPU per persisted publish on the broker's side of the commit log, in-process.

Usage::

    .venv/bin/python bench/persist_cost.py [--messages N] [--turn K] [--window W]
        [--topics T] [--fsync always|interval] [--repeat R]

A ``Persistence`` (broker/persistence.py) over a fresh log in a temporary directory, on a
uvloop loop: each loop turn appends ``K`` 64-byte QoS 1 messages (as one socket read's
worth of PUBLISHes would), at most ``W`` waiting for their completion (as the load
generator's window does), on ``T`` topics, until ``N`` have completed. It reports the
process's CPU time (every thread: the loop, the writer, the kernel's share of write and
fsync) per message, and the wall time. No MQTT, no sockets: what the log path costs, apart
from what a log-off broker does anyway. Medians of ``R`` runs; compare trees run one after the
other in the same minute (``PYTHONPATH=/other/tree/src``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time

import uvloop

from meshmq.broker.interfaces import AppendOutcome, Stored
from meshmq.broker.message import Message
from meshmq.broker.persistence import Persistence
from meshmq.config import LogSettings


async def one_run(args: argparse.Namespace, data_dir: str) -> tuple[float, float]:
    loop = asyncio.get_running_loop()
    settings = LogSettings(fsync=args.fsync)
    log = Persistence(settings, data_dir, loop)
    topics = [f"bench/in/{n}" for n in range(args.topics)]
    payload = bytes(64)
    finished = loop.create_future()
    state = {"sent": 0, "done": 0, "waiting": 0, "stalled": 0}

    def completed(outcome: AppendOutcome) -> None:
        assert isinstance(outcome, Stored), outcome
        state["done"] += 1
        state["waiting"] -= 1
        if state["done"] == args.messages and not finished.done():
            finished.set_result(None)
        elif state["stalled"]:  # the window was full: the next turn starts now
            state["stalled"] = 0
            loop.call_soon(turn)

    def turn() -> None:
        count = min(args.turn, args.window - state["waiting"], args.messages - state["sent"])
        for _ in range(count):
            n = state["sent"]
            message = Message(topics[n % len(topics)], payload, 1, False, {}, "publisher", 0.0)
            if not log.append(message, "publisher", completed):
                raise SystemExit("the log's queue is full")
            state["sent"] = n + 1
        state["waiting"] += count
        if state["sent"] < args.messages:
            if state["waiting"] < args.window:
                loop.call_soon(turn)
            else:
                state["stalled"] = 1

    cpu0, wall0 = time.process_time(), time.perf_counter()
    loop.call_soon(turn)
    await finished
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    log.close()
    return cpu, wall


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--turn", type=int, default=100, help="appends per loop turn")
    p.add_argument("--window", type=int, default=10_000, help="appends waiting at most")
    p.add_argument("--topics", type=int, default=10)
    p.add_argument("--fsync", default="always", choices=("always", "interval"))
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    per_message, rates = [], []
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory(prefix="persist-cost-") as data_dir:
            cpu, wall = uvloop.run(one_run(args, data_dir))
        per_message.append(1e6 * cpu / args.messages)
        rates.append(args.messages / wall)
    spread = f"{min(per_message):.2f} to {max(per_message):.2f}"
    print(f"fsync {args.fsync}, {args.topics} topics, {args.turn} per turn, window "
          f"{args.window}: {statistics.median(per_message):.2f} us CPU per message ({spread}), "
          f"{statistics.median(rates):,.0f} msg/s")


if __name__ == "__main__":
    main()
