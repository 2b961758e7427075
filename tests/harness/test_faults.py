"""Fault runs against today's node: workload, nemesis, heal, drain, check.

The short run (always): a node of two workers, ``kill -9`` of one worker under load; nothing
acknowledged may be lost (duplicates are allowed and reported).

The long suite (``MESHMQ_FAULTS=1 pytest tests/harness -m faults``, docs/testing.md): several
nemesis rounds per run, longer workloads, through a proxy.
"""

from __future__ import annotations

from pathlib import Path

from checker import check_workload
from nodes import start_nodes
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
    assert report.ok, report.render()
