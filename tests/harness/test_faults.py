"""Fault runs against today's node: workload, nemesis, heal, drain, check.

The short run (always): a node of two workers, ``kill -9`` of one worker under load; nothing
acknowledged may be lost (duplicates are allowed and reported).

The long suite (``MESHMQ_FAULTS=1 pytest tests/harness -m faults``, docs/testing.md): several
nemesis rounds per run, longer workloads, through a proxy.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from checker import check_workload
from nemesis import netns_nemeses, node_nemeses, proxy_nemeses, run_schedule
from netns import NetworkLab, unavailable
from nodes import start_nodes
from proxy import Proxy
from workload import run_workload


def test_kill_9_of_a_worker_under_load_loses_nothing(tmp_path: Path) -> None:
    with start_nodes(tmp_path, 1, workers=2) as nodes:
        node = nodes[0]
        with run_workload(node.address(), publishers=4, subscribers=2) as workload:
            workload.wait_acked(300)
            killed = node.kill_worker(1)
            node.wait_worker_restarted(1, killed)
            workload.wait_acked(300)  # publishing goes on, on both workers' partitions
            workload.drain(node.address())
            report = check_workload(workload, [node.data_dir])
    print(report.render())
    assert report.ok and not report.undrained, report.render()


# -- the long suite ---------------------------------------------------------------------------

LONG = os.environ.get("MESHMQ_FAULTS") == "1"
long_suite = pytest.mark.skipif(
    not LONG, reason="the long fault suite runs with MESHMQ_FAULTS=1 (docs/testing.md)")


def schedule_settings() -> tuple[int, int]:
    """(seed, rounds): MESHMQ_FAULTS_SEED replays a schedule, MESHMQ_FAULTS_ROUNDS sizes it."""
    seed = int(os.environ.get("MESHMQ_FAULTS_SEED") or random.randrange(1 << 32))
    return seed, int(os.environ.get("MESHMQ_FAULTS_ROUNDS") or 14)


@pytest.mark.faults
@long_suite
@pytest.mark.timeout(900)
@pytest.mark.parametrize("subscribers_via", ["proxy", "node"])
def test_nemesis_rounds_on_a_node_of_two_workers(tmp_path: Path, subscribers_via: str) -> None:
    """Process faults (kill -9 / SIGSTOP of a worker, of the node) and link faults (delay,
    drop, blackhole, half-open) in a seeded order; publishers reach the node through the proxy,
    subscribers through it too or directly."""
    seed, rounds = schedule_settings()
    with start_nodes(tmp_path, 1, workers=2) as nodes, Proxy(nodes[0].address) as proxy:
        node = nodes[0]
        direct = node.address() if subscribers_via == "node" else None
        with run_workload(proxy.address(), publishers=4, subscribers=2,
                          subscriber_address=direct) as workload:
            workload.wait_acked(200)
            schedule = run_schedule(workload, node_nemeses(node) + proxy_nemeses(proxy),
                                    rounds, seed)
            workload.drain(proxy.address())
            report = check_workload(workload, [node.data_dir])
    print(f"{schedule.render()}\n{report.render()}")
    assert report.ok, f"{schedule.render()}\n{report.render()}"


@pytest.mark.faults
@long_suite
@pytest.mark.timeout(900)
@pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")
def test_nemesis_rounds_with_the_node_partitioned_in_a_namespace(tmp_path: Path) -> None:
    """The node in its own network namespace, the clients in the root namespace (through the
    bridge): real cuts between them, mixed with kills and pauses of the node's processes."""
    seed, rounds = schedule_settings()
    with NetworkLab() as lab:
        namespace = lab.add("n1")
        lab.attach_host()
        with start_nodes(tmp_path, 1, workers=2, bind=namespace.address,
                         launchers=[namespace.launcher]) as nodes:
            node = nodes[0]
            with run_workload(node.address(), publishers=4, subscribers=2) as workload:
                workload.wait_acked(200)
                nemeses = netns_nemeses(lab, "n1") * 3 + node_nemeses(node)
                schedule = run_schedule(workload, nemeses, rounds, seed)
                workload.drain(node.address())
                report = check_workload(workload, [node.data_dir])
    print(f"{schedule.render()}\n{report.render()}")
    assert report.ok, f"{schedule.render()}\n{report.render()}"
