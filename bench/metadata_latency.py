"""The metadata store's commit latency and election stability (docs/cluster.md, "Metadata").

Usage::

    .venv/bin/python bench/metadata_latency.py [--ops N] [--idle S] [--burn N] [--election MIN,MAX]

Three voters (``python -m meshmq.cluster.metaproc serve``) on 127.0.0.1, as the tests start
them (tests/cluster/metanodes.py). Through the local socket of the leader's node and of a
follower's node, one request at a time: ``--ops`` reads (each a barrier through the log) and
``--ops`` compare-and-sets of one key. Prints p50 / p90 / p99 in milliseconds. Then the
voters are left alone for ``--idle`` seconds, with ``--burn`` processes spinning on the CPUs
meanwhile (a loaded machine), and the elections that happened are counted from the voters'
logs (any term change after the first leader is a false election: nothing failed).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "cluster"))

from metanodes import MetaNode, find_leader, meta_nodes

from meshmq.cluster.metaclient import MetaClient


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    return (f"p50 {statistics.median(ordered) * 1000:.2f} ms  p90 {at(0.9):.2f} ms  "
            f"p99 {at(0.99):.2f} ms")


async def measure(client: MetaClient, ops: int, key: str) -> tuple[list[float], list[float]]:
    reads, writes = [], []
    for n in range(ops):
        started = time.perf_counter()
        view = await client.read()
        reads.append(time.perf_counter() - started)
        started = time.perf_counter()
        result = await client.cas(key, view.version_of(key), n)
        writes.append(time.perf_counter() - started)
        assert result.ok, result
    return reads, writes


def burn(stop: multiprocessing.synchronize.Event) -> None:  # type: ignore[name-defined]
    while not stop.is_set():
        sum(range(10000))


def elections(nodes: list[MetaNode]) -> int:
    terms = {int(term) for node in nodes
             for term in re.findall(r"-> leader term=(\d+)", node.log())}
    return len(terms)


async def run(args: argparse.Namespace) -> None:
    extra = ["--election", args.election] if args.election else []
    with tempfile.TemporaryDirectory() as root, meta_nodes(Path(root), 3, extra=extra) as nodes:
        leader = await find_leader(nodes)
        follower = next(node for node in nodes if node is not leader)
        for name, node in (("leader's node", leader), ("a follower's node", follower)):
            client = node.client()
            await client.connect()
            await measure(client, 20, f"warm-{node.name}")
            reads, writes = await measure(client, args.ops, f"k-{node.name}")
            await client.close()
            print(f"through {name}: read  {percentiles(reads)}")
            print(f"through {name}: cas   {percentiles(writes)}")
        before = elections(nodes)
        stop = multiprocessing.Event()
        burners = [multiprocessing.Process(target=burn, args=(stop,)) for _ in range(args.burn)]
        for burner in burners:
            burner.start()
        await asyncio.sleep(args.idle)  # the measurement window itself
        stop.set()
        for burner in burners:
            burner.join()
        extra = elections(nodes) - before
        print(f"idle {args.idle:.0f} s with {args.burn} CPU burners: {extra} elections "
              f"(false: nothing failed)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=500)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--burn", type=int, default=4)
    parser.add_argument("--election", help="the voters' election timeouts MIN,MAX")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
