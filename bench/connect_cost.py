"""What one idle connection costs meshmq: memory by where it was allocated, and CPU by function.

Usage::

    .venv/bin/python bench/connect_cost.py [--conns 5000] [--protocol 4|5] [--group lineno]
    .venv/bin/python bench/connect_cost.py --profile    # cProfile of the connect phase
    .venv/bin/python bench/connect_cost.py --cpu [--floor]  # CPU per connection (and a floor)
    .venv/bin/python bench/connect_cost.py --python [--protocol 5]  # meshmq's Python alone

Runs a single-process meshmq in this process (uvloop, default configuration apart from
``limits.connect_rate = 0`` and the log off) and drives the compiled load generator
(``bench/loadgen.c``, idle mode) against it: ``--conns`` clients connect, 64 handshakes at a
time, and stay idle. With tracemalloc on, the Python heap that stayed allocated per connection
is grouped by the source file (or line) that allocated it, and objects are counted by type
(``gc``). The RSS growth that bench/run.py measures is this heap plus what tracemalloc cannot
see (libuv's handles and buffers allocated with plain ``malloc``, allocator slack); kernel
socket buffers are not in RSS at all. With ``--profile`` the connect
phase runs under cProfile instead (tracemalloc off, so it does not distort the timings) and the
functions with the most own time are listed. With ``--cpu`` only this process's CPU time per
connection is printed, and ``--floor`` measures a bare uvloop server instead of meshmq (accept,
read, write a CONNACK): the part of a connection's cost that no change to meshmq can remove.
``--python`` leaves sockets, uvloop and the kernel out: the tcp listener's protocol is driven
in this process with a stand-in transport (accept, one read holding the CONNECT, the writes
kept as a byte count; every client must be answered and counted as connected), so what it
prints is meshmq's own Python per connection, steadier than a figure that includes the kernel
and the load generator's timing.
docs/benchmarks.md shows the output and reads it.
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
import time
import tracemalloc
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial

from meshbench.build import build_loadgen
from meshbench.standin import StandInTransport

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


class Floor(asyncio.Protocol):
    """The least an asyncio MQTT server does per connection: accept, read the CONNECT, write
    a CONNACK, keep the socket. What uvloop and the kernel cost, with no broker at all."""

    connack = b"\x20\x02\x00\x00"

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.transport.write(self.connack)  # type: ignore[attr-defined]


async def start_server(args: argparse.Namespace) -> tuple[int, Callable[[], Awaitable[None]]]:
    """(port, stop) of meshmq, or of the ``Floor`` server with ``--floor``."""
    if args.floor:
        if args.protocol == 5:
            Floor.connack = b"\x20\x03\x00\x00\x00"
        loop = asyncio.get_running_loop()
        floor = await loop.create_server(Floor, "127.0.0.1", 0, backlog=4096)

        async def stop_floor() -> None:
            floor.close()

        return floor.sockets[0].getsockname()[1], stop_floor
    data = tempfile.mkdtemp(prefix="meshmq-cost-")
    config = load_config(overrides={
        "server.bind": "127.0.0.1", "server.port": 0, "server.data_dir": data,
        "server.log_level": "warning", "log.enabled": False,
        "limits.connect_burst": 20_000,  # the default since issue 13, set for older trees
    })
    server = BrokerServer(config)
    await server.start()
    return server.port, server.stop


async def measure(args: argparse.Namespace) -> None:
    port, stop = await start_server(args)
    loadgen = await asyncio.create_subprocess_exec(
        str(build_loadgen()), "--port", str(port), "--mode", "idle",
        "--protocol", str(args.protocol), "--conns", str(args.conns), "--concurrency", "64",
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
    assert loadgen.stdout is not None and loadgen.stdin is not None
    await until_line(loadgen.stdout, "event connecting")
    gc.collect()
    types0 = type_counts()
    profiler = cProfile.Profile() if args.profile else None
    if profiler is not None:
        profiler.enable()
    elif not args.cpu:
        tracemalloc.start(1)
    snap0 = tracemalloc.take_snapshot() if tracemalloc.is_tracing() else None
    use0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.monotonic()
    await until_line(loadgen.stdout, "event ready")
    use1, wall = resource.getrusage(resource.RUSAGE_SELF), time.monotonic() - wall0
    user, system = use1.ru_utime - use0.ru_utime, use1.ru_stime - use0.ru_stime
    cpu = user + system
    if profiler is not None:
        profiler.disable()
    if args.cpu:
        n = args.conns
        faults = (use1.ru_minflt - use0.ru_minflt) / n
        print(f"{'floor (uvloop, no broker)' if args.floor else 'meshmq'}: {n} connections"
              f" in {wall:.2f} s, {1e6 * cpu / n:.1f} us of CPU each ({n / cpu:,.0f} per"
              f" CPU-second; user {1e6 * user / n:.1f} us, kernel {1e6 * system / n:.1f} us;"
              f" {faults:.2f} page faults)")
    else:
        gc.collect()
        report(args, types0, snap0, profiler)
    loadgen.stdin.close()
    await loadgen.wait()
    await stop()


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


def connect_packet(number: int, protocol: int) -> bytes:
    """The CONNECT the load generator sends: clean, keep alive 600 s, its kind of client id."""
    client_id = f"lg1-i{number}".encode()
    body = b"\x00\x04MQTT" + bytes((protocol, 0x02, 0x02, 0x58))
    body += (b"\x00" if protocol == 5 else b"") + len(client_id).to_bytes(2, "big") + client_id
    return bytes((0x10, len(body))) + body


async def measure_python(args: argparse.Namespace) -> None:
    """``--python``: accept, CONNECT and CONNACK through meshmq's code alone, best of 5."""
    from meshmq.broker.transport import listeners

    data = tempfile.mkdtemp(prefix="meshmq-cost-")
    server = BrokerServer(load_config(overrides={
        "server.bind": "127.0.0.1", "server.port": 0, "server.data_dir": data,
        "server.log_level": "warning", "log.enabled": False, "limits.connect_rate": 0}))
    await server.start()
    assert server.listeners is not None
    listener = server.listeners.listeners[0]
    if hasattr(listeners, "TcpClientProtocol"):
        factory = listeners.TcpClientProtocol.for_listener(listener)
    else:  # a tree from before it: every socket started with a gate
        factory = partial(listeners.Gate, listener)  # type: ignore[assignment]
    n, best = args.conns, float("inf")
    for rep in range(5):
        packets = [connect_packet(rep * n + i, args.protocol) for i in range(n)]
        transports = [StandInTransport(rep * n + i) for i in range(n)]
        gc.collect()
        start = time.perf_counter()
        for i in range(n):
            protocol = factory()
            protocol.connection_made(transports[i])  # type: ignore[arg-type]  # a stand-in
            (transports[i].protocol or protocol).data_received(packets[i])  # type: ignore[union-attr]
            if i % 64 == 63:
                await asyncio.sleep(0)  # a loop turn per 64, as with 64 handshakes in flight
        await asyncio.sleep(0)
        best = min(best, (time.perf_counter() - start) / n)
        assert all(transport.written for transport in transports), "a CONNACK is missing"
        assert server.broker is not None and server.broker.counters["connects"] == (rep + 1) * n
    print(f"meshmq's Python per connection (MQTT {'5.0' if args.protocol == 5 else '3.1.1'},"
          f" no sockets): {best * 1e6:.1f} us (best of 5 x {n:,})")
    for protocol in list(server.broker.clients if server.broker is not None else ()):
        protocol.closing = True  # (no sockets to close)
    await server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conns", type=int, default=5000)
    p.add_argument("--protocol", type=int, choices=(4, 5), default=4)
    p.add_argument("--profile", action="store_true", help="cProfile instead of tracemalloc")
    p.add_argument("--cpu", action="store_true",
                   help="only the CPU time per connection (no tracemalloc, no profiler)")
    p.add_argument("--floor", action="store_true",
                   help="a bare uvloop server that only answers CONNACK, instead of meshmq")
    p.add_argument("--python", action="store_true",
                   help="meshmq's Python alone: no sockets, a stand-in transport")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--group", choices=("filename", "lineno"), default="filename",
                   help="group the heap by file or by line")
    args = p.parse_args()
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import uvloop

    uvloop.run(measure_python(args) if args.python else measure(args))


if __name__ == "__main__":
    main()
