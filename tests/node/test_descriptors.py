"""The descriptor table a broker grows at start, so that a storm's accepts never wait for it.

Linux doubles a process's descriptor table when a descriptor does not fit, and in a process
with threads every doubling sleeps the thread that asked for an RCU grace period
(``node/descriptors.py``). These tests read the table's size from ``/proc/<pid>/status``
(``FDSize``) of real broker processes and of a child Python that calls the function alone.
"""

from __future__ import annotations

import asyncio
import re
import resource
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import connect_storm, start_broker, wait_for
from meshmq.node.descriptors import RESERVED_DESCRIPTORS

STORM = 1500  # clients: more than a 1024-slot table holds


def table_size(pid: int) -> int:
    """How many descriptors ``pid``'s table holds now (``FDSize``)."""
    match = re.search(r"^FDSize:\s+(\d+)$", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert match is not None
    return int(match.group(1))


def open_descriptors(pid: int) -> set[int]:
    return {int(entry.name) for entry in Path(f"/proc/{pid}/fd").iterdir()}


def file_limit(pid: int) -> int:
    """``pid``'s soft limit on open files (``/proc/<pid>/limits``)."""
    match = re.search(r"^Max open files\s+(\d+)", Path(f"/proc/{pid}/limits").read_text(), re.M)
    assert match is not None
    return int(match.group(1))


@pytest.fixture
def room_for_clients() -> Iterator[None]:
    """This test process's own soft limit raised for the storm's client sockets."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < STORM + 256:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {STORM + 256}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_broker_grows_its_table_at_start_and_a_storm_does_not_grow_it(
        tmp_path: Path, room_for_clients: None) -> None:
    broker = start_broker(tmp_path)
    try:
        pid = broker.proc.pid
        wanted = min(file_limit(pid), RESERVED_DESCRIPTORS)
        before = table_size(pid)
        assert before >= wanted
        assert max(open_descriptors(pid)) < 1000  # the slot used to grow it was closed
        codes = asyncio.run(connect_storm(broker.port, STORM, 4))
        assert codes == Counter({0: STORM}), f"CONNACK codes {dict(codes)}"
        assert table_size(pid) == before  # no growth, hence no wait, during the storm
    finally:
        broker.stop()


def test_every_worker_grows_its_own_table(tmp_path: Path) -> None:
    broker = start_broker(tmp_path, workers=2)
    try:
        match = wait_for(lambda: re.search(r"workers started count=2 pids=(\d+),(\d+)",
                                           broker.log()), what="the workers' started line")
        for pid in (int(match.group(1)), int(match.group(2))):
            assert table_size(pid) >= min(file_limit(pid), RESERVED_DESCRIPTORS)
    finally:
        broker.stop()


def _reserve_in_child(soft_limit: int) -> tuple[int, int, int, str]:
    """In a fresh Python with ``soft_limit`` open files: (what ``reserve_descriptors``
    returned, the table's size after, the highest open descriptor after, its stderr)."""
    code = (
        "import os, resource, re\n"
        "from meshmq.node.descriptors import reserve_descriptors\n"
        "hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft_limit}, hard))\n"
        f"got = reserve_descriptors({soft_limit})\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # to read /proc\n"
        "size = re.search(r'FDSize:\\s+(\\d+)', open('/proc/self/status').read()).group(1)\n"
        "print(got, size, max(int(fd) for fd in os.listdir('/proc/self/fd')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True, timeout=30)
    got, size, highest = (int(word) for word in done.stdout.split())
    return got, size, highest, done.stderr


def test_the_table_is_grown_to_the_open_files_limit_and_no_descriptor_stays_open() -> None:
    got, size, highest, errors = _reserve_in_child(300)
    assert got == 300 and size >= 300
    assert highest < 300  # (listdir's own descriptor is among the low ones)
    assert errors == ""


def test_a_limit_that_leaves_no_room_grows_nothing_and_says_so() -> None:
    # stdin, stdout and stderr already fill a limit of 3: no descriptor is free to grow with.
    got, _size, _highest, errors = _reserve_in_child(3)
    assert got == 0
    assert "cannot grow the descriptor table" in errors and "Too many open files" in errors
