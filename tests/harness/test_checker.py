"""The checker is trusted only once it has caught a loss planted on purpose.

With ``log.fsync = "never"`` a PUBACK promises only that the record reached the OS. Values are
published and acknowledged while the (persistent) subscriber is offline, so they can reach it
only from the log; the node is killed and the tail of one partition is cut as a power loss would
leave it. The checker must report exactly the acknowledged values that were cut as lost, and
nothing else.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from checker import check_workload, log_partitions, read_log
from disk import cut_tail
from nodes import start_nodes
from workload import Outcome, Subscriber, run_workload


def test_the_checker_reports_exactly_the_acknowledged_values_cut_from_the_log(
        tmp_path: Path) -> None:
    with start_nodes(tmp_path, 1, '[log]\nfsync = "never"\n') as nodes:
        node = nodes[0]
        Subscriber("sub-0", node.address()).start().close()  # offline, its session kept
        with run_workload(node.address(), publishers=2, subscribers=0) as workload:
            workload.wait_acked(400)
            workload.stop_publishing()
            node.kill()

            logged = read_log(node.data_dir)
            counts = Counter(r.partition for r in logged)
            partition = max(range(log_partitions(node.data_dir)), key=lambda p: counts[p])
            in_partition = [r for r in logged if r.partition == partition]
            cut = cut_tail(node.data_dir, partition, in_partition[len(in_partition) // 2].offset)
            planted = {(r.publisher, r.seq) for r in in_partition if r.offset >= cut.first_offset}

            node.restart()
            workload.subscribers.append(Subscriber("sub-0", node.address(), resume=True).start())
            workload.drain(node.address())
            report = check_workload(workload, [node.data_dir])

    print(f"cut {cut.size_before - cut.size_after} bytes of partition {partition} "
          f"(offsets {cut.first_offset}..{cut.end_offset - 1}):\n{report.render()}")
    assert report.outcomes[Outcome.UNKNOWN] == report.outcomes[Outcome.REFUSED] == 0
    assert planted and report.lost_values() == planted
    assert not report.unlogged and not report.undelivered and not report.phantoms
    assert not report.undrained
