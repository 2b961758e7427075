"""Appends to another worker's partition that its leader never answers end after
``APPEND_TIMEOUT`` (cluster/partitions.py) with an unknown outcome (the leader may have
stored them: never a refusal), in one process with an injected clock: one deadline per APPEND
frame, and an answered frame never ends later."""

from __future__ import annotations

import asyncio
from pathlib import Path

from meshmq.broker.interfaces import AppendOutcome, StoredElsewhere, Unknown
from meshmq.broker.message import Message
from meshmq.broker.wire import decode_message, encode_message
from meshmq.cluster.codec import AppendAnswer, Appended
from meshmq.cluster.leaders import Leadership
from meshmq.cluster.mesh import Mesh
from meshmq.cluster.partitions import APPEND_TIMEOUT, PartitionedLog
from meshmq.cluster.spec import WorkerSpec
from meshmq.config import LogSettings


class Wire:
    """A mesh's I/O: the clock is a number the test moves; bytes move when the test says."""

    def __init__(self) -> None:
        self.time = 100.0

    def now(self) -> float:
        return self.time

    def wake(self) -> None:
        pass

    def schedule(self, when: float) -> None:
        pass

    def close_link(self, link: int, last: bytes = b"") -> None:
        raise AssertionError("no link is closed here")


def _carry(source: Mesh, target: Mesh) -> None:
    for data in source.data_to_send().values():
        target.data_received(1, data)


def test_unanswered_appends_end_unknown_after_the_timeout_and_answered_ones_never(
        tmp_path: Path) -> None:
    loop = asyncio.new_event_loop()
    wire = Wire()
    spec = WorkerSpec(1, 2, "token")
    mesh = Mesh(spec, wire, encode_message, lambda: {})  # type: ignore[arg-type]
    leader = Mesh(WorkerSpec(0, 2, "token"), Wire(), encode_message,  # type: ignore[arg-type]
                  lambda: {})
    leadership = Leadership(spec, 8, None)
    log = PartitionedLog(LogSettings(), str(tmp_path), loop, leadership, mesh,
                         lambda message: encode_message(message, wire.time), decode_message)
    try:
        mesh.link_opened(1, 0)
        leader.link_opened(1, None)
        _carry(mesh, leader)
        _carry(leader, mesh)  # HELLOs: linked both ways
        assert 0 in mesh.peers
        topic = next(f"t/{i}" for i in range(100)
                     if leadership.leader_of(leadership.partition_for(f"t/{i}")) == 0)
        outcomes: dict[str, AppendOutcome] = {}

        def append(name: str) -> None:
            assert log.append(Message(topic, name.encode(), 1), "c", lambda outcome:
                              outcomes.__setitem__(name, outcome))
            mesh.data_to_send()  # the end of the turn: the APPEND frame goes (and is lost)

        append("first")
        wire.time += 10
        append("second")
        assert outcomes == {}
        answer = Appended([AppendAnswer(2, 0, leadership.partition_for(topic), 7, 1, None)])
        mesh.data_received(1, answer.encode())  # the leader answers the second only
        assert outcomes == {"second": StoredElsewhere(leadership.partition_for(topic), 7, 1,
                                                       None)}
        mesh.expire(100 + APPEND_TIMEOUT - 0.5)
        assert list(outcomes) == ["second"]  # not yet
        mesh.expire(100 + APPEND_TIMEOUT + 0.5)
        first = outcomes["first"]
        assert isinstance(first, Unknown) and "no answer from its leader" in first.why
        assert first.message_id is not None and len(first.message_id) == 16
        mesh.expire(110 + APPEND_TIMEOUT + 0.5)  # the second's frame is due: it was answered
        assert outcomes["second"] == StoredElsewhere(leadership.partition_for(topic), 7, 1,
                                                     None)
        assert log.counters["appends_unknown"] == 1 and log.counters["appends_refused"] == 0
    finally:
        log.close()
        loop.close()
