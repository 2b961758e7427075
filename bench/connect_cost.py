"""What one idle connection costs meshmq: memory by where it was allocated, and CPU by function.

Usage::

    .venv/bin/python bench/connect_cost.py [--conns 5000] [--profile] [--protocol 4|5]

Runs a single-process meshmq in this process (uvloop, default configuration apart from
``limits.connect_rate = 0`` and the log off) and drives the compiled load generator
(``bench/loadgen.c``, idle mode) against it: ``--conns`` clients connect, 64 handshakes at a
time, and stay idle. With tracemalloc on, the Python heap that stayed allocated per connection
is grouped by the source file (or line) that allocated it, and objects are counted by type
(``gc``). The RSS growth that bench/run.py measures is this heap plus what tracemalloc cannot
see (libuv's handles and buffers allocated with plain ``malloc``, allocator slack); kernel
socket buffers are not in RSS at all. With ``--profile`` the connect
phase runs under cProfile instead (tracemalloc off, so it does not distort the timings) and the
functions with the most own time are listed. docs/benchmarks.md shows the output and reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import pstats
import resource
import tempfile
import tracemalloc
from collections import Counter

from meshbench.build import build_loadgen

from meshmq.config import load_config
from meshmq.node.server import BrokerServer


def type_counts() -> Counter[str]:
    return Counter(type(o).__name__ for o in gc.get_objects())


async def until_line(stream: asyncio.StreamReader, wanted: str) -> None:
    while True:
        line = (await stream.readline()).decode()
        if not line:
            raise RuntimeError(f"load generator ended before {wanted!r}")
        if line.startswith(("error", "result")):
            raise RuntimeError(f"load generator: {line.strip()}")
        if line.startswith(wanted):
            return


async def measure(args: argparse.Namespace) -> None:
    data = tempfile.mkdtemp(prefix="meshmq-cost-")
    config = load_config(overrides={
        "server.bind": "127.0.0.1", "server.port": 0, "server.data_dir": data,
        "server.log_level": "warning", "log.enabled": False, "limits.connect_rate": 0,
    })
    server = BrokerServer(config)
    await server.start()
    loadgen = await asyncio.create_subprocess_exec(
        str(build_loadgen()), "--port", str(server.port), "--mode", "idle",
        "--protocol", str(args.protocol), "--conns", str(args.conns), "--concurrency", "64",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert loadgen.stdout is not None and loadgen.stdin is not None
    await until_line(loadgen.stdout, "event connecting")
    gc.collect()
    types0 = type_counts()
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    else:
        tracemalloc.start(1)
    snap0 = None if profiler else tracemalloc.take_snapshot()
    await until_line(loadgen.stdout, "event ready")
    if profiler is not None:
        profiler.disable()
    gc.collect()
    report(args, types0, snap0, profiler)
    loadgen.stdin.close()
    await loadgen.wait()
    await server.stop()


def report(args: argparse.Namespace, types0: Counter[str],
           snap0: tracemalloc.Snapshot | None, profiler: cProfile.Profile | None) -> None:
    n = args.conns
    print(f"{n} idle connections, MQTT {'5.0' if args.protocol == 5 else '3.1.1'}")
    if profiler is not None:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(args.top)
        print(out.getvalue())
        return
    assert snap0 is not None
    grown = type_counts()  # before the snapshot, whose records are objects too
    grown.subtract(types0)
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    diff = snap1.compare_to(snap0, args.group)
    traced = sum(d.size_diff for d in diff) / n
    print(f"Python heap per connection (tracemalloc): {traced:,.0f} B (RSS is measured by"
          " bench/run.py: tracemalloc's own records inflate it here)")
    print("\nPython heap per connection, by the file that allocated it:")
    for d in diff[:args.top]:
        if d.size_diff / n >= 8:
            where = d.traceback[0]
            line = f":{where.lineno}" if args.group == "lineno" else ""
            print(f"  {d.size_diff / n:7,.0f} B  {short(where.filename)}{line}")
    print("\nobjects per connection, by type (gc-tracked only):")
    for name, count in grown.most_common(args.top):
        if count / n >= 0.5:
            print(f"  {count / n:5.2f}  {name}")


def short(path: str) -> str:
    for marker in ("/src/", "/site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1]
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conns", type=int, default=5000)
    p.add_argument("--protocol", type=int, choices=(4, 5), default=4)
    p.add_argument("--profile", action="store_true", help="cProfile instead of tracemalloc")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--group", choices=("filename", "lineno"), default="filename",
                   help="group the heap by file or by line")
    args = p.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    uvloop.run(measure(args))


if __name__ == "__main__":
    main()
