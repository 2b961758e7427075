"""The local protocol between workers and the metadata service (cluster/metaproto.py), with no
socket: frames in, messages out."""

from __future__ import annotations

from types import MappingProxyType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmq.cluster.metadata import CasResult, Change, Entry, NoQuorum, NotLeader, Timeout, View
from meshmq.cluster.metaproto import (
    MAX_FRAME,
    FrameDecoder,
    ProtocolError,
    change_from_json,
    change_to_json,
    encode,
    error_from_json,
    error_to_json,
    result_from_json,
    result_to_json,
    view_from_json,
    view_to_json,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=10)


@settings(max_examples=40)  # each example is fed byte by byte
@given(st.lists(st.dictionaries(st.text(), json_values, max_size=4), max_size=5))
def test_messages_survive_framing_whole_or_byte_by_byte(messages: list[dict[str, Any]]) -> None:
    data = b"".join(encode(message) for message in messages)
    assert FrameDecoder().feed(data) == messages
    decoder = FrameDecoder()
    out = []
    for i in range(len(data)):
        out += decoder.feed(data[i:i + 1])
    assert out == messages


@given(st.dictionaries(st.text(), st.tuples(json_values, st.integers(1, 10**9)), max_size=5))
def test_views_and_changes_round_trip(entries: dict[str, tuple[Any, int]]) -> None:
    view = View(7, MappingProxyType({k: Entry(v, n) for k, (v, n) in entries.items()}))
    assert view_from_json(view_to_json(view)) == view
    changed = {**view.entries, "gone": None}
    change = Change(8, MappingProxyType(changed), reset=False)
    assert change_from_json(change_to_json(change)) == change


def test_results_and_errors_round_trip() -> None:
    for result in (CasResult(True, 3), CasResult(False, 2, "controller")):
        assert result_from_json(result_to_json(result)) == result
    hinted = error_from_json(error_to_json(NotLeader("not taken", "10.0.0.2:7884")))
    assert isinstance(hinted, NotLeader) and hinted.hint == "10.0.0.2:7884"
    assert str(hinted) == "not taken (leader: 10.0.0.2:7884)"
    for error in (NoQuorum("no majority"), Timeout("no answer")):
        back = error_from_json(error_to_json(error))
        assert type(back) is type(error) and str(back) == str(error)


@pytest.mark.parametrize("data, problem", [
    ((MAX_FRAME + 1).to_bytes(4, "big"), "a frame of"),
    (b"\x00\x00\x00\x03abc", "not JSON"),
    (b"\x00\x00\x00\x02[]", "not a JSON object"),
])
def test_bad_frames_are_a_protocol_error(data: bytes, problem: str) -> None:
    with pytest.raises(ProtocolError, match=problem):
        FrameDecoder().feed(data)


def test_bad_values_are_a_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        view_from_json({"version": 1, "entries": {"k": [1]}})
    with pytest.raises(ProtocolError):
        view_from_json({"version": 1, "entries": {"k": None}})
    with pytest.raises(ProtocolError):
        result_from_json({"ok": "yes", "version": 1})
