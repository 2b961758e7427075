"""The metadata's voter set changes while the cluster runs (cluster/raftvoters.py): a node
joins through one seed, restarts with what it learned, leaves and comes back. Real voter
processes (``python -m meshmq.cluster.metaproc``) on 127.0.0.1; the choice itself also in
process."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from metanodes import MetaNode, find_leader, free_port, meta_nodes, status_of, wait_until_async

from meshmq.cluster.raftvoters import VoterStatus, choose_voters, read_voters, write_voters


def test_a_node_takes_the_voters_of_a_cluster_that_has_a_leader() -> None:
    cluster = frozenset({"a:1", "b:1", "c:1"})
    joined = choose_voters("d:1", {"a:1"}, [VoterStatus("a:1", "b:1", cluster)])
    assert (joined.voters, joined.join_via) == (cluster | {"d:1"}, "a:1")
    member = choose_voters("c:1", {"a:1", "b:1"}, [VoterStatus("a:1", "a:1", cluster)])
    assert (member.voters, member.join_via) == (cluster, None)


def test_without_a_leader_in_sight_a_node_starts_with_what_it_knows() -> None:
    # a new cluster forming: the seeds answer, none has a leader yet
    leaderless = [VoterStatus("a:1", None, frozenset({"a:1", "b:1", "c:1"}))]
    choice = choose_voters("c:1", {"a:1", "b:1"}, leaderless)
    assert (choice.voters, choice.join_via) == (frozenset({"a:1", "b:1", "c:1"}), None)
    assert choose_voters("a:1", set(), []).voters == frozenset({"a:1"})


def test_the_voter_file_round_trips_and_a_bad_one_is_ignored(tmp_path: Path) -> None:
    assert read_voters(tmp_path) is None
    write_voters(tmp_path, {"b:2", "a:1"})
    assert json.loads((tmp_path / "voters").read_text()) == ["a:1", "b:2"]
    assert read_voters(tmp_path) == frozenset({"a:1", "b:2"})
    (tmp_path / "voters").write_text("{not json")
    assert read_voters(tmp_path) is None


async def voters_of(node: MetaNode) -> list[str] | None:
    status = await status_of(node)
    return None if status is None else sorted(status["voters"])


async def voters_everywhere(nodes: list[MetaNode], expected: set[str]) -> None:
    async def agreed() -> bool:
        seen = [await voters_of(node) for node in nodes]
        return all(voters == sorted(expected) for voters in seen)

    await wait_until_async(agreed, what=f"every voter to see {sorted(expected)}")


async def write_through(node: MetaNode, key: str, value: Any) -> None:
    client = node.client()
    await client.connect()
    try:
        result = await client.cas(key, 0, value)
        assert result.ok, result
        view = await client.read()
        assert view.entries[key].value == value
    finally:
        await client.close()


async def leave(node: MetaNode) -> None:
    """``node``'s voter leaves the set (another voter removes it)."""
    client = node.client()
    await client.connect()
    try:
        assert "removed" in await client.leave()
    finally:
        await client.close()


def test_a_node_joins_through_one_seed_restarts_leaves_and_comes_back(tmp_path: Path) -> None:
    async def run() -> None:
        with meta_nodes(tmp_path, 3) as nodes:
            await find_leader(nodes)
            founders = {node.raft for node in nodes}
            newcomer = MetaNode("n4", f"127.0.0.1:{free_port()}", [nodes[0].raft],
                                tmp_path / "n4", nodes[0].secret_file)
            everyone = [*nodes, newcomer]
            try:
                newcomer.start()
                await voters_everywhere(everyone, founders | {newcomer.raft})
                await write_through(newcomer, "from-n4", 1)
                # a restart (kill -9) comes back as a voter and catches up
                newcomer.kill()
                await write_through(nodes[1], "while-n4-was-down", 2)
                newcomer.start()
                await voters_everywhere(everyone, founders | {newcomer.raft})
                await write_through(newcomer, "after-restart", 3)

                # it leaves: the others drop it, the majority is 2 of 3 again
                await leave(newcomer)
                await voters_everywhere(nodes, founders)
                newcomer.stop()
                await write_through(nodes[2], "after-leave", 4)

                # started again with its files, it asks to be a voter again
                newcomer.start()
                await voters_everywhere(everyone, founders | {newcomer.raft})
                await write_through(newcomer, "back", 5)
                assert "joining through" in newcomer.log()
            finally:
                newcomer.stop()

    asyncio.run(run())


def test_a_voter_restarted_alone_keeps_the_voters_it_learned(tmp_path: Path) -> None:
    """pysyncobj starts from the voter set of its dump, which a change after the dump is not
    in: the voter file is what a voter restarted while the others are down starts from."""
    async def run() -> None:
        with meta_nodes(tmp_path, 3) as nodes:
            await find_leader(nodes)
            client = nodes[0].client()
            await client.connect()
            try:  # past the compaction threshold (1,000 entries): each voter writes a dump
                for version in range(1100):
                    assert (await client.cas("counter", version, version)).ok
            finally:
                await client.close()
            await wait_until_async(lambda: all((n.directory / "raft" / "dump").exists()
                                               for n in nodes), what="the dumps")
            newcomer = MetaNode("n4", f"127.0.0.1:{free_port()}", [nodes[0].raft],
                                tmp_path / "n4", nodes[0].secret_file)
            try:
                newcomer.start()
                expected = {node.raft for node in nodes} | {newcomer.raft}
                await voters_everywhere([*nodes, newcomer], expected)
                for node in nodes:
                    node.kill()
                nodes[0].start()  # nobody to ask: its files only

                async def dump_loaded() -> bool:
                    status = await status_of(nodes[0])
                    # (a dump is written past 1,000 entries: it holds at least those)
                    return status is not None and status["applied"] >= 1000

                await wait_until_async(dump_loaded, timeout=60, what="n1 to load its dump")
                assert await voters_of(nodes[0]) == sorted(expected)
            finally:
                newcomer.stop()

    asyncio.run(run())


def test_the_raft_leader_leaves_by_handing_its_leadership_on(tmp_path: Path) -> None:
    """pysyncobj cannot remove a leader: the leaving leader hands the leadership on first,
    then another voter removes it; the two left agree on writes."""
    async def run() -> None:
        with meta_nodes(tmp_path, 3) as nodes:
            leader = await find_leader(nodes)
            await leave(leader)
            rest = [node for node in nodes if node is not leader]
            await voters_everywhere(rest, {node.raft for node in rest})
            await write_through(rest[0], "after-the-leader-left", 1)
            assert (await find_leader(nodes, among=rest)) in rest

    asyncio.run(run())
