"""The metadata service as real processes (``python -m meshmq.cluster.metaproc``): three Raft
voters on 127.0.0.1, clients over the local socket (cluster/metaclient.py), kill -9 and
restarts. The long runs (pauses, partitions, majority loss) are in test_metafaults.py.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from metacheck import REGISTER, Op, check, client_loop, final_register
from metanodes import (
    MetaNode,
    cut_journal,
    find_leader,
    meta_nodes,
    status_of,
    wait_until,
    wait_until_async,
)

from meshmq.cluster.memstore import MemoryStore
from meshmq.cluster.metaclient import MetaClient
from meshmq.cluster.metadata import Change, Member, MetadataError, MetadataStore, NoQuorum


async def script(store: MetadataStore) -> list[Any]:
    """Every kind of request, and what each answered (as plain data)."""
    seen: list[Change] = []
    store.watch(seen.append)
    out: list[Any] = []
    out.append(await store.cas("a", 0, {"x": [1, 2]}))
    out.append(await store.cas("a", 0, "again"))  # lost: created already
    out.append(await store.cas("b", 0, 7, guards={"a": 1}))
    out.append(await store.cas("b", 2, 8, guards={"a": 0}))  # lost on the guard
    out.append(await store.delete("a", 1))
    out.append(await store.delete("a", 0))  # absent already: nothing changes
    out.append(await store.add_member(Member("n1", "10.0.0.1:7884", "10.0.0.1:7883")))
    out.append(sorted((await store.members()).items()))
    view = await store.read()
    out.append((view.version, dict(view.entries)))
    await wait_until_async(lambda: seen and seen[-1].version == view.version, what="changes")
    out.append([(change.version, change.reset, dict(change.changed)) for change in seen])
    return out


def test_the_raft_backend_answers_as_the_reference_model(tmp_path: Path) -> None:
    async def run() -> None:
        expected = await script(MemoryStore(clock=time.monotonic))
        with meta_nodes(tmp_path, 3) as nodes:
            leader = await find_leader(nodes)
            follower = next(node for node in nodes if node is not leader)
            client = follower.client()  # through a follower: it passes writes on
            await client.connect()
            try:
                assert await script(client) == expected
            finally:
                await client.close()

    asyncio.run(run())


async def until_acknowledged(history: list[Op], after: float, count: int = 5) -> None:
    await wait_until_async(
        lambda: sum(op.kind == "cas" and op.outcome == "ok" and op.start > after
                    for op in history) >= count, what=f"{count} writes acknowledged")


def test_cas_stays_linearizable_through_kill_9_of_the_leader(tmp_path: Path) -> None:
    """Three clients (one per voter) race on a register; the leader is killed with -9 and
    started again on its files. Nothing acknowledged is lost, no two writes forked, no read
    went back, and the restarted voter serves the same state."""

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
                await until_acknowledged(history, 0.0)
                leader = await find_leader(nodes)
                killed_at = time.monotonic()
                leader.kill()
                await until_acknowledged(history, killed_at)
                first = min(op.end for op in history
                            if op.kind == "cas" and op.outcome == "ok" and op.start > killed_at)
                print(f"first write acknowledged {first - killed_at:.2f} s after the kill")
                leader.start()
                restarted_at = time.monotonic()
                await until_acknowledged(history, restarted_at)
                done.set()
            final_version, final = await final_register(clients[0])
            await wait_until_async(
                lambda: _applied(leader, final_version), what="the restarted voter caught up")
            again = leader.client()
            await again.connect()
            assert (await again.read()).value(REGISTER) == final
            await again.close()
            for client in clients:
                await client.close()
        report = check(history, final)
        print(report.describe())
        assert report.valid, report.describe()
        assert report.acknowledged > 10

    asyncio.run(run())


async def _applied(node: MetaNode, version: int) -> bool:
    client = node.client()
    try:
        await client.connect(2.0)
        return (await client.read()).version_of(REGISTER) >= version
    except MetadataError:
        return False
    finally:
        await client.close()


def test_a_commit_index_past_the_journal_is_lowered_before_the_voter_starts(
        tmp_path: Path) -> None:
    """Upstream pysyncobj issue 197: after an unclean stop the stored commit index can name
    records the journal lost. Started as it is, a voter that becomes leader counts its new
    records as committed up to that stale index and acknowledges them with no follower
    holding them. Here every voter is left so (ten records cut), two are started, and the
    follower is paused: a write must not be acknowledged."""

    async def run() -> None:
        with meta_nodes(tmp_path, 3) as nodes:
            client = (await find_leader(nodes)).client()
            await client.connect()
            for n in range(15):
                view = await client.read()
                assert (await client.cas(REGISTER, view.version_of(REGISTER), n)).ok
            await client.close()
            commit = await _stored_commit_index(nodes)
            for node in nodes:
                node.kill()
                cut_journal(node.directory / "raft" / "journal", commit - 10)
            live = nodes[:2]
            for node in live:
                node.start()
            leader = await find_leader(nodes, among=live)
            follower = next(node for node in live if node is not leader)
            follower.pause()
            client = MetaClient(leader.socket, request_timeout=1.5)
            await client.connect()
            view_version = commit - 10  # any version: the write must not be acknowledged
            try:
                with pytest.raises(MetadataError):
                    result = await client.cas("after", 0, view_version)
                    pytest.fail(f"acknowledged with no follower holding it: {result}")
            finally:
                await client.close()
                follower.resume()
            assert "raft commit index lowered from" in leader.log()

    asyncio.run(run())


async def _stored_commit_index(nodes: list[MetaNode]) -> int:
    """Wait until every voter's journal.meta holds the leader's commit index (pysyncobj
    writes it once a second) and return the lowest stored."""
    from pysyncobj.journal import MetaStorer

    def stored() -> int:
        values = [MetaStorer(str(node.directory / "raft" / "journal.meta")).getMeta()
                  .get("raftCommitIndex", 0) for node in nodes]
        return min(values)

    status = await status_of(await find_leader(nodes))
    assert status is not None
    await wait_until_async(lambda: stored() >= status["commit_index"],
                           what="the commit index stored by every voter")
    return stored()


def test_the_client_rides_out_a_restart_of_its_service(tmp_path: Path) -> None:
    """The client dials again while its node's service is down (kill -9); a write made
    meanwhile is sent once the service is back; the watch goes on without a version twice
    or an older one, though the restarted service replays its log from the start."""

    async def run() -> None:
        with meta_nodes(tmp_path, 1) as (node,):
            client = node.client()
            await client.connect()
            versions: list[int] = []
            client.watch(lambda change: versions.append(change.version))
            for n in range(5):
                assert (await client.cas(f"k{n}", 0, n)).ok
            await wait_until_async(lambda: versions[-1:] == [5], what="the watch at 5")
            node.kill()
            async with asyncio.TaskGroup() as group:
                write = group.create_task(client.cas("during", 0, "x"))
                node.start()
            assert write.result().ok
            await wait_until_async(lambda: versions[-1:] == [6], what="the watch at 6")
            assert versions == sorted(set(versions)), versions
            view = client.view_nowait()
            assert view is not None and view.value("during") == "x" and view.version == 6
            await client.close()

    asyncio.run(run())


CLIENT = textwrap.dedent("""
    import asyncio, sys
    from meshmq.cluster.metaclient import MetaClient

    async def main():
        client = MetaClient(sys.argv[1], request_timeout=1.0)
        try:
            await client.connect(1.0)
            print("status", (await client.status())["state"])
        except Exception as error:
            print("refused", type(error).__name__)
        finally:
            await client.close()

    asyncio.run(main())
""")


def test_only_this_nodes_processes_may_use_the_service(tmp_path: Path) -> None:
    """A worker of the node (a sibling: a child of the same parent) is served; a process of
    the same user that is not (a grandchild here) is refused before a byte is read."""
    with meta_nodes(tmp_path, 1) as (node,):
        sibling = subprocess.run([sys.executable, "-c", CLIENT, node.socket],
                                 capture_output=True, text=True, timeout=30)
        assert sibling.stdout.startswith("status"), sibling.stdout + sibling.stderr
        through = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"
        outsider = subprocess.run([sys.executable, "-c", through, sys.executable, "-c", CLIENT,
                                   node.socket], capture_output=True, text=True, timeout=30)
        assert outsider.stdout.strip() == "refused NoQuorum", outsider.stdout + outsider.stderr
        wait_until(lambda: "is not a worker of this node" in node.log(), what="the refusal")


def test_a_service_that_cannot_start_says_why_in_one_line(tmp_path: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "meshmq.cluster.metaproc", "serve",
                               "--node-id", "n1", "--raft", "127.0.0.1:9", "--data-dir",
                               str(tmp_path / "n1"), "--socket", "meshmq-test-meta-bad", *args],
                              capture_output=True, text=True, timeout=30)

    missing = serve("--secret-file", str(tmp_path / "absent"))
    assert missing.returncode == 2 and "--secret-file: cannot read" in missing.stderr
    (tmp_path / "empty").write_text("\n")
    empty = serve("--secret-file", str(tmp_path / "empty"))
    assert empty.returncode == 2 and "needs the cluster secret" in empty.stderr
    assert len(empty.stderr.strip().splitlines()) == 1, empty.stderr
    backwards = serve("--secret-file", str(tmp_path / "empty"), "--election", "2,1")
    assert backwards.returncode == 2 and "expected 0 < MIN < MAX" in backwards.stderr


def test_a_node_without_its_service_says_so_within_the_bounded_wait() -> None:
    async def run() -> None:
        client = MetaClient("meshmq-test-meta-nobody", request_timeout=0.5)
        with pytest.raises(NoQuorum, match="does not answer"):
            await client.connect(0.5)
        with pytest.raises(NoQuorum, match="was not reached"):
            await client.read()
        await client.close()

    asyncio.run(run())
