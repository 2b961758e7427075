"""The state store's files: journal replay, torn tails, damage, compaction (real files), and
a broker starting on a damaged journal or retained message (real processes)."""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import signal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import start_broker
from failedstart import quoted_command, run_pasted, serve_until_exit
from meshmq.mqtt.packets import Puback, Publish
from meshmq.mqtt.properties import PropertyId
from meshmq.state.files import StateError, apply, empty_state
from meshmq.state.store import StateStore
from rawclient import RawClient

client_ids = st.sampled_from(["a", "b", "c"])
filters = st.sampled_from(["x/#", "y/+", "$share/g/z"])
entries = st.one_of(
    st.builds(lambda c, e: {"op": "session", "client_id": c, "expiry": e, "cursor": [e, e]},
              client_ids, st.integers(0, 10)),
    st.builds(lambda c, f, q: {"op": "session", "client_id": c, "expiry": 5,
                               "subs": {f: [q, False, False, 0, None]}},
              client_ids, filters, st.integers(0, 2)),
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


def test_a_session_line_written_as_it_connects_keeps_its_subscriptions(tmp_path, loop):
    """A session handed over from another worker has no "subs" lines in this journal: the
    record written as it connects holds them, and a later update without them (it went
    offline, a cursor checkpoint) keeps them. Such a session came back from kill -9 with no
    subscriptions while its CONNACK said session present."""
    store, _ = reopen(tmp_path, loop)
    options = [1, False, False, 0, None]
    store.write({"op": "session", "client_id": "moved", "expiry": 600, "username": None,
                 "will": None, "detached_at": None, "cursor": None,
                 "subs": {"t/#": options}})  # keeper.connected: the whole record
    store.write({"op": "session", "client_id": "moved", "expiry": 600, "will": None,
                 "detached_at": 5, "cursor": [0, 0]})  # keeper.detached: no subs
    store.close()
    again, state = reopen(tmp_path, loop)
    again.close()
    assert state["sessions"]["moved"]["subs"] == {"t/#": options}


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
    assert journal.read_bytes() == intact  # the torn bytes are cut off...
    kept = list((tmp_path / "state").glob(f"repair-backup-*/{journal.name}"))
    assert [k.read_bytes() for k in kept] == [intact + b'{"op":"end","cli']  # ...not lost


def test_a_whole_last_entry_without_its_newline_is_kept_and_terminated(tmp_path, loop):
    """A crash can tear a write just before its newline: the entry is whole, so it is kept,
    but without its newline the next write would be glued onto it and the journal would no
    longer load."""
    store, _ = reopen(tmp_path, loop)
    store.write({"op": "session", "client_id": "a", "expiry": 5})
    store.write({"op": "session", "client_id": "b", "expiry": 5})
    store.close()
    journal = next((tmp_path / "state").glob("journal-*.jsonl"))
    journal.write_bytes(journal.read_bytes().removesuffix(b"\n"))
    store, state = reopen(tmp_path, loop)
    assert set(state["sessions"]) == {"a", "b"}
    store.write({"op": "session", "client_id": "c", "expiry": 5})
    store.close()
    store, state = reopen(tmp_path, loop)
    store.close()
    assert set(state["sessions"]) == {"a", "b", "c"}
    assert not list((tmp_path / "state").glob("repair-backup-*"))  # nothing was cut


def test_a_second_store_on_the_same_directory_is_refused(tmp_path, loop):
    first, _ = reopen(tmp_path, loop)
    with pytest.raises(StateError, match="in use by another process"):
        StateStore(tmp_path, loop).load()
    first.close()
    again, _ = reopen(tmp_path, loop)  # closing released it
    again.close()


def test_damage_before_the_end_names_file_and_line(tmp_path, loop):
    store, _ = reopen(tmp_path, loop)
    for n in range(3):
        store.write({"op": "session", "client_id": f"c{n}", "expiry": 1})
    store.close()
    journal = next((tmp_path / "state").glob("journal-*.jsonl"))
    lines = journal.read_bytes().split(b"\n")
    lines[1] = b"{garbage"
    journal.write_bytes(b"\n".join(lines))
    with pytest.raises(StateError, match=r"journal-\d+\.jsonl:2: damaged journal line") as caught:
        StateStore(tmp_path, loop).load()
    assert f"`meshmq state repair --data-dir {tmp_path}`" in str(caught.value)


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


# -- a broker starting on a damaged journal -------------------------------------------------


def persistent_session_with_two_subscriptions(port: int) -> None:
    with RawClient(port) as client:
        client.connect("keeper", clean_start=False,
                       properties={PropertyId.SESSION_EXPIRY_INTERVAL: 3600})
        client.subscribe("lost/#", qos=1)
        client.subscribe("kept/#", qos=1)  # journaled after the line the test damages


def test_a_damaged_journal_line_stops_the_broker_naming_state_repair(tmp_path: Path) -> None:
    broker = start_broker(tmp_path)
    persistent_session_with_two_subscriptions(broker.port)
    broker.stop(signal.SIGKILL)  # no compaction: the subscriptions are in the journal
    journal = next((broker.data_dir / "state").glob("journal-*.jsonl"))
    lines = journal.read_bytes().split(b"\n")
    damaged = next(n for n, line in enumerate(lines) if b'"lost/#"' in line)
    lines[damaged] = lines[damaged][:25] + b"\x00\xff" + lines[damaged][27:]  # bit rot
    journal.write_bytes(b"\n".join(lines))

    refused = serve_until_exit(tmp_path)
    assert refused.returncode == 1, refused.stderr
    assert f"{journal}:{damaged + 1}: damaged journal line" in refused.stderr
    repair = quoted_command(refused.stderr, "meshmq state repair")
    assert repair[-2:] == ["--data-dir", str(broker.data_dir.resolve())]
    repaired = run_pasted(repair, cwd=tmp_path)
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert f"{journal}:{damaged + 1}: cut out (damaged)" in repaired.stdout
    assert repaired.stdout.splitlines()[-1].endswith("verify is now clean")

    restarted = start_broker(tmp_path)
    try:
        with RawClient(restarted.port) as client:
            connack = client.connect("keeper", clean_start=False,
                                     properties={PropertyId.SESSION_EXPIRY_INTERVAL: 3600})
            assert connack.session_present  # the line before the damage was kept...
            with RawClient(restarted.port) as publisher:
                publisher.connect("publisher")
                for packet_id, topic in ((1, "lost/x"), (2, "kept/x")):
                    publisher.send(Publish(topic, b"m", 1, packet_id=packet_id))
                    publisher.recv_type(Puback)
            delivered = client.recv_type(Publish)  # ...and so was the one after it; kept/x
            assert delivered.topic == "kept/x"  # arriving first shows lost/x never will
    finally:
        restarted.stop()


def test_a_damaged_retained_message_stops_the_broker_with_one_line(tmp_path: Path) -> None:
    """A stored retained message whose body no longer decodes (valid JSON and base64, bad
    bytes) is named in one line, not a traceback (broker/snapshot.py ``SnapshotError``)."""
    broker = start_broker(tmp_path)
    with RawClient(broker.port) as publisher:
        publisher.connect("publisher")
        publisher.send(Publish("kept/r", b"m", 1, retain=True, packet_id=1))
        publisher.recv_type(Puback)
    broker.stop()  # graceful: compacted into the snapshot file
    snapshot = broker.data_dir / "state" / "snapshot.json"
    state = json.loads(snapshot.read_text())
    stored = state["retained"]["kept/r"]
    body = bytearray(base64.b64decode(stored["body"]))
    body[0] = 0x80  # flags: only 0x01 and 0x02 exist
    stored["body"] = base64.b64encode(bytes(body)).decode("ascii")
    snapshot.write_text(json.dumps(state))

    refused = serve_until_exit(tmp_path)
    assert refused.returncode == 1, refused.stderr
    assert "cannot read the broker state" in refused.stderr
    assert "bad retained message 'kept/r'" in refused.stderr
    assert "Traceback" not in refused.stderr
