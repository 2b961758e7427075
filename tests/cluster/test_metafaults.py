"""The metadata store under faults, the long way (``MESHMQ_FAULTS=1 pytest -m faults``,
docs/testing.md): a paused leader (SIGSTOP, then SIGCONT: its stale write is not accepted),
a leader cut off by a real partition (network namespaces), the majority lost (agreement stops
and says so), and kill -9 of the leader round after round. Each run ends with the register
checker (metacheck.py): no fork, no acknowledged write lost, no stale read.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from metacheck import REGISTER, Op, check, client_loop, final_register
from metanodes import MetaNode, find_leader, meta_nodes, wait_until

from meshmq.cluster.metadata import MetadataError, NoQuorum

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "harness"))
from netns import NetworkLab, unavailable  # (tests/harness: on the path above)

LONG = os.environ.get("MESHMQ_FAULTS") == "1"
pytestmark = [pytest.mark.faults, pytest.mark.skipif(
    not LONG, reason="the long fault suite runs with MESHMQ_FAULTS=1 (docs/testing.md)")]
ROUNDS = int(os.environ.get("MESHMQ_FAULTS_ROUNDS", "5"))
LOAD = Path(__file__).with_name("metaload.py")


def acknowledged_after(history: list[Op], after: float, client: str | None = None) -> int:
    return sum(op.kind == "cas" and op.outcome == "ok" and op.start > after
               and (client is None or op.client == client) for op in history)


async def wait_acknowledged(history: list[Op], after: float, count: int = 5) -> float:
    """Wait for ``count`` writes begun after ``after``; the time the first was acknowledged."""
    deadline = time.monotonic() + 30
    while acknowledged_after(history, after) < count:
        assert time.monotonic() < deadline, f"no {count} writes acknowledged after the fault"
        await asyncio.sleep(0.02)
    return min(op.end for op in history
               if op.kind == "cas" and op.outcome == "ok" and op.start > after)


def verdict(history: list[Op], final: dict[str, Any] | None) -> None:
    report = check(history, final)
    print(report.describe())
    assert report.valid, report.describe()


def test_a_paused_leader_gets_no_stale_write_accepted(tmp_path: Path) -> None:
    """SIGSTOP the leader under load; the others elect a new one and go on. A write prepared
    on the paused leader's node with the version read before the pause is sent while it is
    paused; after SIGCONT it must not be acknowledged (it loses: the version moved)."""

    async def run() -> None:
        history: list[Op] = []
        with meta_nodes(tmp_path, 3) as nodes:
            await find_leader(nodes)
            clients = [node.client() for node in nodes]
            for client in clients:
                await client.connect()
            done = asyncio.Event()
            async with asyncio.TaskGroup() as group:
                for i, client in enumerate(clients):
                    group.create_task(client_loop(client, f"c{i + 1}", history, done.is_set))
                for _ in range(ROUNDS):
                    await wait_acknowledged(history, time.monotonic())
                    leader = await find_leader(nodes)
                    stale = leader.client()
                    await stale.connect()
                    read = await stale.read()
                    leader.pause()
                    paused_at = time.monotonic()
                    write = group.create_task(stale.cas(REGISTER, read.version_of(REGISTER),
                                                        {"id": "stale", "prev": ""}))
                    first = await wait_acknowledged(history, paused_at)
                    print(f"paused leader {leader.name}: first write acknowledged "
                          f"{first - paused_at:.2f} s after")
                    leader.resume()
                    try:
                        result = await write
                        assert not result.ok, f"the paused leader's stale write applied: {result}"
                    except MetadataError as error:
                        print(f"stale write: {type(error).__name__}")  # unknown: the checker
                    await stale.close()
                done.set()
            _, final = await final_register(clients[0])
            for client in clients:
                await client.close()
        assert final is None or final.get("id") != "stale"
        verdict(history, final)

    asyncio.run(run())


def test_losing_the_majority_stops_agreement_and_says_so(tmp_path: Path) -> None:
    async def run() -> None:
        with meta_nodes(tmp_path, 3) as nodes:
            leader = await find_leader(nodes)
            client = leader.client()
            await client.connect()
            assert (await client.cas("k", 0, 1)).ok
            followers = [node for node in nodes if node is not leader]
            for node in followers:
                node.kill()
            started = time.monotonic()
            with pytest.raises(NoQuorum, match="no majority of the 3 metadata voters"):
                await client.cas("k", 1, 2)
            print(f"NoQuorum after {time.monotonic() - started:.2f} s")
            with pytest.raises(NoQuorum):
                await client.read()
            followers[0].start()  # a majority again
            restarted = time.monotonic()
            view = await client.read()
            result = await client.cas("k", view.version_of("k"), 3)
            assert result.ok
            print(f"agreement back {time.monotonic() - restarted:.2f} s after the restart")
            await client.close()

    asyncio.run(run())


def test_cas_stays_linearizable_through_repeated_kill_9_of_the_leader(tmp_path: Path) -> None:
    async def run() -> None:
        history: list[Op] = []
        with meta_nodes(tmp_path, 3) as nodes:
            await find_leader(nodes)
            clients = [node.client() for node in nodes]
            for client in clients:
                await client.connect()
            done = asyncio.Event()
            gaps = []
            async with asyncio.TaskGroup() as group:
                for i, client in enumerate(clients):
                    group.create_task(client_loop(client, f"c{i + 1}", history, done.is_set))
                for _ in range(ROUNDS):
                    await wait_acknowledged(history, time.monotonic())
                    leader = await find_leader(nodes)
                    killed_at = time.monotonic()
                    leader.kill()
                    gaps.append(await wait_acknowledged(history, killed_at) - killed_at)
                    leader.start()
                done.set()
            print("kill -9 to first acknowledged write: "
                  + ", ".join(f"{gap:.2f} s" for gap in gaps))
            _, final = await final_register(clients[0])
            for client in clients:
                await client.close()
        verdict(history, final)

    asyncio.run(run())


# -- a real partition ------------------------------------------------------------------------------


def leader_from_logs(nodes: list[MetaNode]) -> MetaNode | None:
    """The voter whose log says it became leader in the highest term (voters in namespaces
    cannot be asked from here: their sockets are in their namespace)."""
    best: tuple[int, MetaNode] | None = None
    for node in nodes:
        for state, term in re.findall(r"-> (\w+) term=(\d+)", node.log()):
            if state == "leader" and (best is None or int(term) > best[0]):
                best = (int(term), node)
    return best[1] if best else None


class Load:
    """A metaload.py client in a namespace; its operations arrive in ``history`` as it goes."""

    def __init__(self, lab: NetworkLab, node: MetaNode, stop: Path, history: list[Op]) -> None:
        self.proc = subprocess.Popen(
            [*lab[node.name].launcher, sys.executable, str(LOAD), node.socket, node.name,
             str(stop)], stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=self._read, args=(history,), daemon=True)
        self.reader.start()

    def _read(self, history: list[Op]) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            history.append(Op(**json.loads(line)))

    def wait(self) -> None:
        self.proc.wait(timeout=60)
        self.reader.join(timeout=10)


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_leader_cut_off_by_a_partition_gets_nothing_accepted(tmp_path: Path) -> None:
    """Each voter in a network namespace, a client beside each. The leader's namespace is put
    on a bridge of its own: the majority elects a new leader and goes on, the cut-off leader
    steps down, and its client gets no write acknowledged until the heal."""
    history: list[Op] = []
    with NetworkLab() as lab:
        spaces = [lab.add(f"n{i + 1}") for i in range(3)]
        with meta_nodes(tmp_path, 3, hosts=[space.address for space in spaces],
                        launchers=[space.launcher for space in spaces]) as nodes:
            stop = tmp_path / "stop"
            loads = [Load(lab, node, stop, history) for node in nodes]
            wait_until(lambda: acknowledged_after(history, 0.0) >= 5, what="writes")
            leader = leader_from_logs(nodes)
            assert leader is not None
            lab.partition([[leader.name], [n.name for n in nodes if n is not leader]])
            # (taken once the cut is in place: an append that completes while the `ip`
            # commands run was still the leader's to accept)
            cut_at = time.monotonic()
            new = wait_until(lambda: (found := leader_from_logs(nodes)) is not leader and found,
                             timeout=30, what="a new leader on the majority side")
            print(f"partition: new leader {new.name} "
                  f"{time.monotonic() - cut_at:.2f} s after the cut")
            wait_until(lambda: "-> follower" in leader.log().rsplit("-> leader", 1)[-1],
                       timeout=10, what="the cut-off leader stepping down")
            wait_until(lambda: acknowledged_after(history, time.monotonic() - 0.5) >= 5
                       or acknowledged_after(history, cut_at) >= 10,
                       timeout=30, what="the majority side acknowledging writes")
            healed_at = time.monotonic()
            lab.heal()
            wait_until(lambda: acknowledged_after(history, healed_at, leader.name) >= 1,
                       timeout=30, what="the cut-off side writing again after the heal")
            stop.touch()
            for load in loads:
                load.wait()
            final = subprocess.run([*lab[nodes[0].name].launcher, sys.executable, str(LOAD),
                                    nodes[0].socket, "--final"], capture_output=True, text=True,
                                   timeout=60, check=True)
            register = json.loads(final.stdout)["value"]
    isolated = [op for op in history if op.client == leader.name and op.kind == "cas"
                and op.outcome == "ok" and op.start > cut_at and op.end < healed_at]
    assert not isolated, f"the cut-off leader's side acknowledged {isolated[:3]}"
    verdict(history, register)
