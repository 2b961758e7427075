"""The cluster benchmark's harness (bench/cluster_cost.py, bench/meshbench/cluster*.py): a real
three-node cluster on ephemeral ports carries validated traffic across nodes, the figures are
split per node, a broker still busy with the previous run is waited for, and bad options get
one line."""

from __future__ import annotations

import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import cluster_cost  # noqa: E402
from meshbench.brokers import ProcStats, proc_stats  # noqa: E402
from meshbench.cluster import start_cluster  # noqa: E402
from meshbench.clustertraffic import QUIET_STEP, await_quiet, run_flows  # noqa: E402


def test_cross_node_qos1_pairs_and_a_spread_fanout_validate(tmp_path: Path) -> None:
    # Not pinned: the test suite runs beside other tests, and pinning is the benchmark's job.
    cluster = start_cluster(tmp_path, 3, cluster_cost.MESHMQ, None)
    try:
        n1, n2, n3 = (node.port for node in cluster.nodes)
        pairs = cluster_cost.pair_flows([n1], [n2], ("n1", "n2"), 2)
        outcome = run_flows(pairs, 1, cluster.stats, 0.1, 0.4)
        assert outcome["ok"], outcome["problems"]
        counts = outcome["counts"]
        assert counts["published"] > 0  # type: ignore[index]
        assert counts["delivered"] == counts["published"]  # type: ignore[index]
        assert counts["acked"] >= counts["published"]  # type: ignore[index]  # + the probes
        figures = outcome["figures"]
        # every message crossed: the subscribers' node worked, the third did not take part
        assert figures["n1_us_per_msg"] > 0 and figures["n2_us_per_msg"] > 0  # type: ignore[index]
        assert figures["broker_us_per_msg"] == pytest.approx(  # type: ignore[index]
            sum(figures[f"n{i}_us_per_msg"] for i in (1, 2, 3)))  # type: ignore[index]

        fan = cluster_cost.fanout_flow(n1, [n1, n2, n3], ["n1", "n2", "n3"], 6)
        outcome = run_flows([fan], 0, cluster.stats, 0.1, 0.4)
        assert outcome["ok"], outcome["problems"]
        assert outcome["counts"]["subscribers"] == 6  # type: ignore[index]
        assert cluster.problems() == []
    finally:
        cluster.stop()


def test_persisted_pairs_are_placed_by_their_partitions_leader_and_validate(
        tmp_path: Path) -> None:
    """The persisted part: the log and the metadata on; ``leader`` puts each pair on its
    topic's leader node, ``proxied`` the publisher and subscriber on the two others."""
    cluster = start_cluster(tmp_path, 3, cluster_cost.MESHMQ_LOG, None, metadata=True)
    try:
        leaders = cluster_cost.await_leaders(cluster)
        ports = {node.name: node.port for node in cluster.nodes}
        by_port = {port: name for name, port in ports.items()}
        for proxied in (False, True):
            flows = cluster_cost.led_pair_flows(ports, leaders, 3, proxied)
            for flow in flows:
                leader = leaders[zlib.crc32(flow.topic.encode()) % cluster_cost.PARTITIONS]
                placed = {by_port[flow.publisher_port],
                          *(by_port[p] for p in flow.subscriber_ports)}
                assert placed == ({leader} if not proxied else set(ports) - {leader})
            outcome = run_flows(flows, 1, cluster.stats, 0.1, 0.4)
            assert outcome["ok"], outcome["problems"]
            counts = outcome["counts"]
            assert counts["delivered"] == counts["published"] > 0  # type: ignore[index]
        assert cluster.problems() == []
    finally:
        cluster.stop()


def test_a_broker_still_busy_is_waited_for_before_a_run() -> None:
    # A process that burns a CPU for about a second stands in for a broker still closing the
    # previous run's clients: its CPU must not be counted in the next run's window.
    busy = subprocess.Popen([sys.executable, "-c",
                             "import time\nend = time.monotonic() + 1.0\n"
                             "while time.monotonic() < end: pass\ntime.sleep(30)"])
    try:
        def sampler() -> dict[str, ProcStats]:
            return {"busy": proc_stats(busy.pid)}

        started = time.monotonic()
        waited = await_quiet(sampler)
        assert waited >= 2 * QUIET_STEP  # it saw the CPU move at least once
        assert time.monotonic() - started >= waited
        before = sampler()["busy"].cpu_s
        time.sleep(QUIET_STEP)
        assert sampler()["busy"].cpu_s - before < 0.01  # quiet when it returned
    finally:
        busy.kill()
        busy.wait()


@pytest.mark.parametrize(("argv", "message"), [
    (["--only", "cost,speed"],
     "--only: unknown part 'speed'; known: cost, fanout, connect, persisted, failover"),
    (["--repeat", "0"], "--repeat: must be at least 1"),
    (["--conns", "2"], "--conns: must be at least 3"),
    (["--fail-observe", "0"], "--fail-observe: must be positive"),
])
def test_bad_options_are_one_line_exit_status_2(argv: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, str(BENCH / "cluster_cost.py"), *argv],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip() == f"cluster bench: error: {message}"
