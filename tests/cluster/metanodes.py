"""Metadata services as real processes (``python -m meshmq.cluster.metaproc serve``), for the
tests of the Raft backend: start N voters on 127.0.0.1 (or in network namespaces), kill -9,
pause, continue and restart them, and find the leader.

Raft ports are drawn free from the kernel (bind port 0, read it, close) just before the
voters start, since every voter must know the others' addresses up front. Each voter logs to
``<dir>/run-N.log``. Everything started is stopped on the way out, failed or not.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import secrets
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from conftest import wait_for
from meshmq.cluster.metaclient import MetaClient

WAIT = 20.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def process_state(pid: int) -> str:
    """The state letter of ``pid`` in /proc (T: stopped), "" if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return text[text.rindex(")") + 2]


@dataclass
class MetaNode:
    name: str
    raft: str
    peers: list[str]
    directory: Path
    secret_file: Path
    socket: str = field(default_factory=lambda: f"meshmq-test-meta-{secrets.token_hex(6)}")
    launcher: Sequence[str] = ()
    extra: Sequence[str] = ()  # more arguments of ``serve``
    proc: subprocess.Popen[bytes] | None = None
    runs: int = 0

    @property
    def log_path(self) -> Path:
        return self.directory / f"run-{self.runs}.log"

    def start(self) -> None:
        self.runs += 1
        self.directory.mkdir(parents=True, exist_ok=True)
        command = [*self.launcher, sys.executable, "-m", "meshmq.cluster.metaproc", "serve",
                   "--node-id", self.name, "--raft", self.raft, "--data-dir",
                   str(self.directory), "--socket", self.socket, "--secret-file",
                   str(self.secret_file)]
        for peer in self.peers:
            command += ["--peer", peer]
        command += self.extra
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)

    def log(self) -> str:
        return "".join(path.read_text(errors="replace")
                       for path in sorted(self.directory.glob("run-*.log")))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9, and wait until it is gone."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=WAIT)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            if process_state(self.proc.pid) == "T":
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout=WAIT)

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        wait_until(lambda: process_state(self.proc.pid) == "T", what=f"{self.name} stopped")

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)
        wait_until(lambda: process_state(self.proc.pid) not in ("T", ""),
                   what=f"{self.name} running")

    def client(self) -> MetaClient:
        return MetaClient(self.socket)


def cut_journal(path: Path, keep: int) -> None:
    """Cut pysyncobj's journal after the record of index ``keep``, as an unclean stop leaves
    it when the pages of its last records never reached the disk (its header names the end)."""
    data = bytearray(path.read_bytes())
    header = 24 + 8 + 4 + 4
    end = struct.unpack_from("<I", data, header - 4)[0]
    offset = kept_end = header
    while offset < end:
        size = struct.unpack_from("<I", data, offset)[0]
        if struct.unpack_from("<Q", data, offset + 4)[0] > keep:
            break
        offset += size + 8
        kept_end = offset
    struct.pack_into("<I", data, header - 4, kept_end)
    path.write_bytes(bytes(data))


def wait_until(condition: Callable[[], Any], timeout: float = WAIT, what: str = "condition"
               ) -> Any:
    """The suite's ``wait_for`` with this module's longer default (voters elect slowly on a
    loaded machine)."""
    return wait_for(condition, timeout, what)


async def wait_until_async(condition: Callable[[], Any], timeout: float = WAIT,
                           what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextmanager
def meta_nodes(root: Path, count: int, host: str = "127.0.0.1",
               launchers: Sequence[Sequence[str]] | None = None,
               hosts: Sequence[str] | None = None, extra: Sequence[str] = ()
               ) -> Iterator[list[MetaNode]]:
    """``count`` voters under ``root`` (``root/n1``...), started; all stopped at the end.
    ``hosts``: each voter's address (namespaces); default ``host`` with free ports."""
    secret_file = root / "secret"
    secret_file.write_text(secrets.token_hex(16))
    if hosts is None:
        addresses = [f"{host}:{free_port(host)}" for _ in range(count)]
    else:
        addresses = [f"{address}:{free_port()}" for address in hosts]
    nodes = [MetaNode(f"n{i + 1}", address, [a for a in addresses if a != address],
                      root / f"n{i + 1}", secret_file,
                      launcher=launchers[i] if launchers else (), extra=extra)
             for i, address in enumerate(addresses)]
    try:
        for node in nodes:
            node.start()
        yield nodes
    finally:
        for node in nodes:
            node.stop()


async def status_of(node: MetaNode, timeout: float = 2.0) -> dict[str, Any] | None:
    """The voter's status, or None if it does not answer within ``timeout``."""
    client = MetaClient(node.socket, request_timeout=timeout)
    try:
        await client.connect(timeout)
        return await client.status()
    except Exception:
        return None
    finally:
        await client.close()


async def find_leader(nodes: Sequence[MetaNode], among: Sequence[MetaNode] | None = None,
                      timeout: float = WAIT) -> MetaNode:
    """The voter that says it leads (among ``among``, default all live ones)."""
    candidates = list(among if among is not None else nodes)

    async def leader() -> MetaNode | None:
        for node in candidates:
            if not node.alive() or process_state(node.proc.pid) == "T":  # type: ignore[union-attr]
                continue
            status = await status_of(node)
            if status is not None and status["state"] == "leader" and status["has_quorum"]:
                return node
        return None

    found = await wait_until_async(leader, timeout, "a metadata leader")
    assert isinstance(found, MetaNode)
    return found
