"""meshmq's benchmark harness: a compiled load generator, meshmq and Mosquitto side by side.

``bench/run.py`` is the command; docs/benchmarks.md explains the method. The modules:

* ``build``: compiles ``bench/loadgen.c`` with the system C compiler into a cache directory;
* ``brokers``: starts meshmq or Mosquitto pinned to CPUs, on an ephemeral 127.0.0.1 port, and
  reads their CPU time and memory from /proc;
* ``scenarios``: the suite (full and ``--quick`` sizes) and each scenario's broker settings;
* ``runner``: runs one scenario against one broker and turns the numbers into figures;
* ``profiling``: py-spy on meshmq during a scenario's window, summarised by function;
* ``report``: the table of figures and ratios, the JSON file and the plot;
* ``workers``, ``linkcost``, ``appendcost``, ``placed``, ``endpoints``, ``placement``: the
  ``server.workers`` benchmark (``bench/workers.py``): its loads and tables, the link-cost
  scenario, the append-cost cases (a persisted publish sent to its partition's leader), an
  MQTT 5.0 client that picks its worker, its publishers and subscribers (QoS 0 and 1), and
  which worker serves each load generator connection.
* ``cluster``, ``clustertraffic``, ``clusterconnect``, ``clusterfail``: the cluster benchmark
  (``bench/cluster_cost.py``): start, watch and kill a cluster of nodes on this machine,
  publish → subscribe flows whose clients each pick a node, one load generator per node at
  once, and a node killed, hung or paused under QoS 1 traffic.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn


class BenchError(Exception):
    """The benchmark cannot run (missing tool, broker that does not start, ...): one line."""


def validation_status(failed: list[str]) -> int:
    """A command's exit status from its runs that failed validation (named on stderr)."""
    if failed:
        print(f"FAILED validation: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def run_command(main: Callable[[], int], name: str) -> NoReturn:
    """Exit with ``main()``'s status; a ``BenchError`` or ``ValueError`` is one line, status 2."""
    try:
        sys.exit(main())
    except (BenchError, ValueError) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        sys.exit(2)
