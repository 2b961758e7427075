"""meshmq's benchmark harness: a compiled load generator, meshmq and Mosquitto side by side.

``bench/run.py`` is the command; docs/benchmarks.md explains the method. The modules:

* ``build``: compiles ``bench/loadgen.c`` with the system C compiler into a cache directory;
* ``brokers``: starts meshmq or Mosquitto pinned to CPUs, on an ephemeral 127.0.0.1 port, and
  reads their CPU time and memory from /proc;
* ``scenarios``: the suite (full and ``--quick`` sizes) and each scenario's broker settings;
* ``runner``: runs one scenario against one broker and turns the numbers into figures;
* ``profiling``: py-spy on meshmq during a scenario's window, summarised by function;
* ``report``: the table of figures and ratios, the JSON file and the plot;
* ``workers``, ``linkcost``, ``placed``, ``placement``: the ``server.workers`` benchmark
  (``bench/workers.py``): its loads and tables, the link-cost scenario, an MQTT 5.0 client that
  picks its worker, and which worker serves each load generator
  connection.
"""


class BenchError(Exception):
    """The benchmark cannot run (missing tool, broker that does not start, ...): one line."""
