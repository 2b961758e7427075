"""The register checker (tests/cluster/metacheck.py) is trusted only after it catches what is
planted: a fork, a lost acknowledged write, a phantom, a stale read. A history made by
concurrent clients of the reference model passes."""

from __future__ import annotations

import asyncio

from metacheck import Op, check, client_loop, final_register

from meshmq.cluster.memstore import MemoryStore


def write(client: str, value: str, prev: str, expected: int, version: int, outcome: str = "ok",
          start: float = 0.0, end: float = 0.0) -> Op:
    return Op(client, "cas", outcome, start, end, version, expected, value, prev)


def chain_of_three() -> list[Op]:
    return [write("a", "a-1", "", 0, 1, start=0, end=1),
            write("b", "b-1", "a-1", 1, 2, start=2, end=3),
            write("a", "a-2", "b-1", 2, 3, start=4, end=5)]


def test_a_linear_history_is_valid() -> None:
    report = check(chain_of_three(), {"id": "a-2", "prev": "b-1"})
    assert report.valid, report.describe()
    assert (report.acknowledged, report.chain) == (3, 3)


def test_a_planted_fork_is_reported() -> None:
    # b-2 was acknowledged from version 2 as a-2 was: a stale leader took it
    history = [*chain_of_three(), write("b", "b-2", "b-1", 2, 3, start=4, end=5)]
    report = check(history, {"id": "a-2", "prev": "b-1"})
    assert report.forks == ["from version 2: ['a-2', 'b-2']"]
    assert report.lost == ["b-2"]  # and it is not on the chain either


def test_a_lost_acknowledged_write_is_reported() -> None:
    report = check(chain_of_three(), {"id": "b-1", "prev": "a-1"})  # a-2 rolled back
    assert report.lost == ["a-2"] and not report.forks


def test_a_write_that_answered_lost_but_applied_is_a_phantom() -> None:
    history = chain_of_three()
    history[1] = write("b", "b-1", "a-1", 1, 2, outcome="lost", start=2, end=3)
    report = check(history, {"id": "a-2", "prev": "b-1"})
    assert report.phantoms == ["b-1"]


def test_an_unknown_write_may_be_on_the_chain_or_not() -> None:
    history = chain_of_three()
    history[1] = write("b", "b-1", "a-1", 1, 0, outcome="unknown", start=2, end=3)
    assert check(history, {"id": "a-2", "prev": "b-1"}).valid
    history.append(write("c", "c-1", "a-2", 3, 0, outcome="unknown", start=6, end=7))
    assert check(history, {"id": "a-2", "prev": "b-1"}).valid


def test_a_stale_read_is_reported() -> None:
    history = [*chain_of_three(), Op("c", "read", "ok", 6.0, 6.5, 2, value="b-1")]
    report = check(history, {"id": "a-2", "prev": "b-1"})
    assert len(report.stale_reads) == 1 and "version 3 was acknowledged" in report.stale_reads[0]
    # a read that began before the write's acknowledgement may see the older version
    history[-1] = Op("c", "read", "ok", 4.5, 6.5, 2, value="b-1")
    assert check(history, {"id": "a-2", "prev": "b-1"}).valid


def test_a_broken_link_is_reported() -> None:
    history = chain_of_three()
    history[2] = write("a", "a-2", "b-1", 1, 3, start=4, end=5)  # applied against version 1
    report = check(history, {"id": "a-2", "prev": "b-1"})
    assert report.broken_links and report.forks  # two writes from version 1


def test_concurrent_clients_of_the_model_make_a_valid_history() -> None:
    async def run() -> None:
        store = MemoryStore(clock=lambda: 0.0)
        history: list[Op] = []
        budget = {"ops": 600}

        def stop() -> bool:
            budget["ops"] -= 1
            return budget["ops"] < 0

        async with asyncio.TaskGroup() as group:
            for name in ("a", "b", "c"):
                group.create_task(client_loop(store, name, history, stop))
        _, final = await final_register(store)
        report = check(history, final)
        assert report.valid, report.describe()
        assert report.acknowledged == report.chain > 0
        assert any(op.outcome == "lost" for op in history)  # they did race

    asyncio.run(run())
