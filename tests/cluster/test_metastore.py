"""The metadata's state machine (cluster/metastate.py), the in-memory model
(cluster/memstore.py) and the typed records (cluster/metarecords.py): no thread, no socket,
time is a number the test sets."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from meshmq.cluster.memstore import MemoryStore
from meshmq.cluster.metadata import (
    CasResult,
    Change,
    Member,
    NoQuorum,
    NotLeader,
    Timeout,
)
from meshmq.cluster.metarecords import (
    CONTROLLER,
    Assignment,
    Controller,
    NotController,
    RecordError,
    assign_partition,
    assignment_of,
    bump_epoch,
    change_isr,
    claim_controller,
    controller_of,
    elect_leader,
    epoch_of,
    mark_written,
)
from meshmq.cluster.metastate import REMEMBERED, Command, MetaState, Op

T = TypeVar("T")


def run(body: Callable[[MemoryStore], Awaitable[T]], now: list[float] | None = None) -> T:
    clock = now if now is not None else [0.0]

    async def main() -> T:
        return await body(MemoryStore(clock=lambda: clock[0]))

    return asyncio.run(main())


# -- the state machine ------------------------------------------------------------------------


def test_versions_grow_by_one_per_applied_change_and_absent_is_zero() -> None:
    state = MetaState()
    assert state.apply(Command.set("a", 0, 1))[0] == CasResult(True, 1)
    assert state.apply(Command.set("b", 0, "x"))[0] == CasResult(True, 2)
    assert state.apply(Command.set("a", 1, 2))[0] == CasResult(True, 3)
    assert state.view().version_of("a") == 3 and state.view().version_of("b") == 2
    assert state.view().version_of("missing") == 0


def test_a_lost_compare_changes_nothing_and_names_the_current_version() -> None:
    state = MetaState()
    state.apply(Command.set("a", 0, 1))
    result, change = state.apply(Command.set("a", 0, 2))  # created already
    assert (result, change) == (CasResult(False, 1, "a"), None)
    assert state.version == 1 and state.view().value("a") == 1


def test_a_guard_fences_the_write_with_another_keys_version() -> None:
    state = MetaState()
    state.apply(Command.set("controller", 0, "n1"))  # version 1
    assert state.apply(Command.set("p", 0, "x", guards={"controller": 1}))[0].ok
    state.apply(Command.set("controller", 1, "n2"))  # a new controller: version 3
    result, _ = state.apply(Command.set("p", 2, "y", guards={"controller": 1}))
    assert result == CasResult(False, 2, "controller")
    assert state.view().value("p") == "x"


def test_delete_makes_the_key_absent_and_deleting_an_absent_key_changes_nothing() -> None:
    state = MetaState()
    state.apply(Command.set("a", 0, 1))
    result, change = state.apply(Command.delete("a", 1))
    assert result == CasResult(True, 0) and change is not None and change.changed == {"a": None}
    assert state.version == 2 and state.view().get("a") is None
    assert state.apply(Command.delete("a", 0)) == (CasResult(True, 0), None)
    assert state.version == 2


def test_a_repeated_request_answers_as_the_first_time_and_applies_once() -> None:
    state = MetaState()
    first = state.apply(Command.set("a", 0, 1, request="c-1"))[0]
    again, change = state.apply(Command.set("a", 0, 1, request="c-1"))
    assert first == again == CasResult(True, 1) and change is None and state.version == 1
    # forgotten after REMEMBERED newer requests: then it is an ordinary (losing) compare
    for n in range(REMEMBERED):
        state.apply(Command(Op.BARRIER, request=f"x-{n}"))
    assert state.apply(Command.set("a", 0, 1, request="c-1"))[0] == CasResult(False, 1, "a")


def test_the_state_survives_its_plain_form_and_wire_commands_round_trip() -> None:
    state = MetaState()
    state.apply(Command.set("a", 0, {"nested": [1, 2]}, request="r1"))
    state.apply(Command.set("b", 0, None))
    copy = MetaState.from_plain(state.to_plain())
    assert copy.view() == state.view() and copy.answered == state.answered
    command = Command.set("k", 3, [1, "x"], guards={"g": 2}, request="r9")
    assert Command.from_wire(command.to_wire()) == command


# -- the in-memory model -------------------------------------------------------------------------


def test_the_model_watch_starts_with_the_whole_state_then_each_change_in_order() -> None:
    async def body(store: MemoryStore) -> list[Change]:
        await store.cas("a", 0, 1)
        changes: list[Change] = []
        watch = store.watch(changes.append)
        await store.cas("b", 0, 2)
        await store.cas("a", 1, 3)
        await asyncio.sleep(0)
        watch.cancel()
        await store.cas("c", 0, 4)
        await asyncio.sleep(0)
        return changes

    changes = run(body)
    assert changes[0].reset and dict(changes[0].changed).keys() == {"a"}
    assert [(c.version, dict(c.changed)) for c in changes[1:]] == [
        (2, {"b": changes[1].changed["b"]}), (3, {"a": changes[2].changed["a"]})]
    assert changes[2].changed["a"] is not None and changes[2].changed["a"].value == 3


def test_the_model_fails_as_told_and_an_applied_failure_is_an_unknown_outcome() -> None:
    now = [0.0]

    async def body(store: MemoryStore) -> None:
        store.unavailable(until=5.0)
        with pytest.raises(NoQuorum):
            await store.read()
        now[0] = 5.0
        assert (await store.read()).version == 0
        store.not_leader("10.0.0.2:7884")
        with pytest.raises(NotLeader) as error:
            await store.cas("a", 0, 1)
        assert error.value.hint == "10.0.0.2:7884"
        store.not_leader(None)
        store.fail_next(Timeout("lost answer"), applied=True)
        with pytest.raises(Timeout):
            await store.cas("a", 0, 1)
        assert (await store.read()).value("a") == 1  # it applied: re-read before deciding
        assert (await store.cas("a", 0, 1)) == CasResult(False, 1, "a")

    run(body, now)


def test_the_model_membership_is_records_under_members() -> None:
    async def body(store: MemoryStore) -> None:
        first = await store.add_member(Member("n1", "10.0.0.1:7884", "10.0.0.1:7883"))
        assert await store.add_member(Member("n1", "10.0.0.1:7884", "10.0.0.1:7883")) == first
        await store.add_member(Member("n2", "10.0.0.2:7884", "10.0.0.2:7883", workers=3))
        assert set(await store.members()) == {"n1", "n2"}
        await store.remove_member("n1")
        assert list(await store.members()) == ["n2"]
        assert (await store.read()).value("members/n2") == {"raft": "10.0.0.2:7884",
                                                            "cluster": "10.0.0.2:7883",
                                                            "workers": 3}

    run(body)


# -- typed records ---------------------------------------------------------------------------------


def test_bump_epoch_is_fenced_by_the_version_read() -> None:
    async def body(store: MemoryStore) -> None:
        view = await store.read()
        first = await bump_epoch(store, view, "sessions")
        assert first.result.ok and first.record == 1
        stale = await bump_epoch(store, view, "sessions")  # from the same old view
        assert not stale.result.ok and stale.result.version == first.result.version
        assert epoch_of(await store.read(), "sessions") == 1

    run(body)


def test_two_claimants_of_one_controller_epoch_one_wins() -> None:
    async def body(store: MemoryStore) -> None:
        view = await store.read()
        one = await claim_controller(store, view, "n1")
        two = await claim_controller(store, view, "n2")
        assert one.result.ok and not two.result.ok
        assert controller_of(await store.read()) == Controller("n1", 1)
        again = await claim_controller(store, await store.read(), "n2")
        assert again.record == Controller("n2", 2) and again.result.ok

    run(body)


def test_partition_writes_are_fenced_by_the_controller_record() -> None:
    async def body(store: MemoryStore) -> None:
        view = await store.read()
        controller = (await claim_controller(store, view, "n1")).record
        view = await store.read()
        placed = await assign_partition(store, view, controller, 3, ["n2", "n3", "n1"], 1)
        assert placed.result.ok
        assert assignment_of(await store.read(), 3) == Assignment(
            "n2", 1, 1, ("n2", "n3", "n1"), ("n2", "n3", "n1"), written=False)
        old_view = await store.read()
        await claim_controller(store, old_view, "n2")  # n1 is replaced
        # n1 still holds the old view: the guard on the controller record refuses its write
        late = await change_isr(store, old_view, controller, 3, ["n2", "n3"])
        assert not late.result.ok and late.result.conflict == CONTROLLER
        with pytest.raises(NotController):  # and a fresh view says so before writing
            await change_isr(store, await store.read(), controller, 3, ["n2"])

    run(body)


def test_leader_elections_bump_the_leader_epoch_and_stay_in_the_isr() -> None:
    async def body(store: MemoryStore) -> None:
        controller = (await claim_controller(store, await store.read(), "n1")).record
        await assign_partition(store, await store.read(), controller, 0, ["n1", "n2", "n3"], 0)
        shrunk = await change_isr(store, await store.read(), controller, 0, ["n1", "n2"])
        assert shrunk.record.leader_epoch == 1 and shrunk.record.isr == ("n1", "n2")
        with pytest.raises(RecordError, match="not in sync"):
            await elect_leader(store, await store.read(), controller, 0, "n3", 0)
        moved = await elect_leader(store, await store.read(), controller, 0, "n2", 1)
        assert moved.result.ok and moved.record.leader_epoch == 2 and moved.record.leader == "n2"
        unclean = await elect_leader(store, await store.read(), controller, 0, "n3", 2,
                                     unclean=True)
        assert unclean.record.leader_epoch == 3 and unclean.record.isr == ("n3",)
        with pytest.raises(RecordError, match="must hold the leader"):
            await change_isr(store, await store.read(), controller, 0, ["n1"])

    run(body)


def test_a_partition_moves_only_until_its_leader_marks_it_written() -> None:
    """Its leader marks the assignment before the first append; from then on the controller
    cannot move it (one copy: its records are on that node). A mark by a leader the
    partition moved away from does nothing, and a move wins over a mark that read before it."""
    async def body(store: MemoryStore) -> None:
        controller = (await claim_controller(store, await store.read(), "n1")).record
        await assign_partition(store, await store.read(), controller, 0, ["n1"], 0)
        before_move = await store.read()
        moved = await assign_partition(store, before_move, controller, 0, ["n2"], 1)
        assert moved.result.ok and moved.record.leader_epoch == 2 and not moved.record.written
        late = await mark_written(store, before_move, 0, "n1", 1)  # read before the move
        assert late is not None and not late.result.ok  # the move won: n1 appends nothing
        assert await mark_written(store, await store.read(), 0, "n1", 1) is None  # not n1's
        marked = await mark_written(store, await store.read(), 0, "n2", 2)
        assert marked is not None and marked.result.ok
        assert assignment_of(await store.read(), 0).written  # type: ignore[union-attr]
        with pytest.raises(RecordError, match="holds records on 'n2'"):
            await assign_partition(store, await store.read(), controller, 0, ["n3"], 0)

    run(body)


def test_an_assignment_without_the_written_field_counts_as_written() -> None:
    async def body(store: MemoryStore) -> None:
        await store.cas("partitions/5", 0, {"leader": "n1", "worker": 0, "leader_epoch": 1,
                                            "replicas": ["n1"], "isr": ["n1"]})
        assert assignment_of(await store.read(), 5).written  # type: ignore[union-attr]

    run(body)
