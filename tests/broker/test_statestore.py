"""The state store's files: journal replay, torn tails, damage, compaction (real files)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshmq.broker.statefiles import StateError, apply, empty_state
from meshmq.broker.statestore import StateStore

client_ids = st.sampled_from(["a", "b", "c"])
filters = st.sampled_from(["x/#", "y/+", "$share/g/z"])
entries = st.one_of(
    st.builds(lambda c, e: {"op": "session", "client_id": c, "expiry": e, "cursor": [e, e]},
              client_ids, st.integers(0, 10)),
    st.builds(lambda c: {"op": "end", "client_id": c}, client_ids),
    st.builds(lambda c, f, q: {"op": "subs", "client_id": c,
                               "subs": {f: None if q < 0 else [q, False, False, 0, None]}},
              client_ids, filters, st.integers(-1, 2)),
    st.builds(lambda t, p: {"op": "retain", "topic": t,
                            "message": None if p is None else {"payload": p}},
              st.sampled_from(["r/1", "r/2"]), st.none() | st.text(max_size=5)),
)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def reopen(directory: Path, loop) -> tuple[StateStore, dict]:
    store = StateStore(directory, loop)
    return store, store.load()


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(entries, max_size=30), st.integers(0, 30))
def test_journal_and_compaction_give_the_state_applied_in_memory(
    tmp_path_factory, loop, ops, compact_at
):
    """Whatever the sequence of changes, and wherever a compaction falls, reopening the
    directory (without a clean close: the files as a crash leaves them) gives the state the
    same changes produce in memory."""
    directory = tmp_path_factory.mktemp("state")
    store, state = reopen(directory, loop)
    expected = empty_state()
    for index, entry in enumerate(ops):
        if index == compact_at:
            store.compact(copy.deepcopy(expected))
        store.write(entry)
        apply(expected, entry)
    store.close()  # waits for the writer thread; closing writes no snapshot of its own
    again, state = reopen(directory, loop)
    again.close()
    assert state == expected
    assert len(list(directory.glob("state/journal-*.jsonl"))) == 1


def test_torn_last_line_is_dropped_and_the_rest_kept(tmp_path, loop):
    store, _ = reopen(tmp_path, loop)
    store.write({"op": "session", "client_id": "a", "expiry": 5})
    store.write({"op": "subs", "client_id": "a", "subs": {"x/#": [1, False, False, 0, None]}})
    store.close()
    journal = next((tmp_path / "state").glob("journal-*.jsonl"))
    intact = journal.read_bytes()
    journal.write_bytes(intact + b'{"op":"end","cli')  # a crash in the middle of a write
    store, state = reopen(tmp_path, loop)
    store.close()
    assert state["sessions"]["a"]["subs"] == {"x/#": [1, False, False, 0, None]}
    assert journal.read_bytes() == intact  # the torn bytes are cut off


def test_damage_before_the_end_names_file_and_line(tmp_path, loop):
    store, _ = reopen(tmp_path, loop)
    for n in range(3):
        store.write({"op": "session", "client_id": f"c{n}", "expiry": 1})
    store.close()
    journal = next((tmp_path / "state").glob("journal-*.jsonl"))
    lines = journal.read_bytes().split(b"\n")
    lines[1] = b"{garbage"
    journal.write_bytes(b"\n".join(lines))
    with pytest.raises(StateError, match=r"journal-\d+\.jsonl:2: damaged journal line"):
        StateStore(tmp_path, loop).load()


def test_foreign_snapshot_is_refused(tmp_path, loop):
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "snapshot.json").write_text('{"version": 99}')
    with pytest.raises(StateError, match="unknown state format 99"):
        StateStore(tmp_path, loop).load()


def test_done_runs_on_the_loop_after_the_write(tmp_path, loop):
    store, _ = reopen(tmp_path, loop)
    done = loop.create_future()
    store.write({"op": "session", "client_id": "a", "expiry": 1},
                lambda: done.set_result(next((tmp_path / "state").glob("journal-*")).read_text()))
    text = loop.run_until_complete(asyncio.wait_for(done, 10))
    store.close()
    assert '"client_id":"a"' in text
