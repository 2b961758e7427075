"""Persistence (broker/persistence.py) in-process, over a real log in tmp_path: a loop turn's
publishes are encoded into one batch per partition, written at the end of the turn, and
completed in publish order; with fsync ``always`` a publish is stored only once fsynced."""

from __future__ import annotations

import asyncio
import os
import threading
from functools import partial
from pathlib import Path

import pytest

from meshmq.broker.interfaces import AppendOutcome, Refused, Stored
from meshmq.broker.message import Message
from meshmq.broker.persistence import SYNCFS, Persistence
from meshmq.config import LogSettings
from meshmq.log.record import read_batch_header
from meshmq.mqtt.reason_codes import ReasonCode

WAIT = 10.0


def publish(topic: str, n: int) -> Message:
    return Message(topic, b"%d" % n, 1, False, {}, "pub", 0.0)


async def run_turns(persistence: Persistence, turns: list[list[str]]
                    ) -> list[tuple[int, AppendOutcome]]:
    """Append each turn's publishes in one loop turn (turn after turn, without waiting for
    completions); return (publish number, outcome) in the order the outcomes came."""
    loop = asyncio.get_running_loop()
    outcomes: list[tuple[int, AppendOutcome]] = []
    total = sum(len(topics) for topics in turns)
    finished = loop.create_future()

    def done(n: int, outcome: AppendOutcome) -> None:
        outcomes.append((n, outcome))
        if len(outcomes) == total:
            finished.set_result(None)

    n = 0
    for topics in turns:
        for topic in topics:
            assert persistence.append(publish(topic, n), "pub", partial(done, n))
            n += 1
        await asyncio.sleep(0)  # the end of the turn runs: this turn goes to the log
    await asyncio.wait_for(finished, WAIT)
    return outcomes


@pytest.mark.parametrize("whole_file_system", [False, True])
def test_fsync_always_stores_a_publish_only_once_its_bytes_were_fsynced(
        tmp_path: Path, whole_file_system: bool) -> None:
    """Per partition (an fsync of its file: its size then, preallocated zeros included) or
    with one syncfs for the turn's partitions (each partition's batches' bytes then)."""
    if whole_file_system and SYNCFS is None:
        pytest.skip("no trusted syncfs (Linux < 5.8?)")
    synced: dict[int, int] = {}  # inode -> bytes of the file synced
    made: list[Persistence] = []

    def recording_fsync(fd: int) -> None:
        size_before = os.fstat(fd)
        os.fsync(fd)
        synced[size_before.st_ino] = size_before.st_size

    def recording_syncfs(fd: int) -> None:
        assert SYNCFS is not None
        if not made:  # the log's first one, as it opens
            return SYNCFS(fd)
        log = made[0].commit_log
        written = {os.stat(log.partition(n).active_segment.log_path).st_ino:
                   log.partition(n).statistics().size_bytes for n in log.owned}
        SYNCFS(fd)
        synced.update(written)

    seen: list[tuple[int, int, int]] = []  # partition, offset, bytes fsynced when stored

    async def main() -> None:
        persistence = Persistence(
            LogSettings(fsync="always", partitions=2, syncfs_min_partitions=2), str(tmp_path),
            asyncio.get_running_loop(), fsync=recording_fsync,
            syncfs=recording_syncfs if whole_file_system else None)
        made.append(persistence)
        log = persistence.commit_log
        all_stored = asyncio.Event()

        def check(outcome: AppendOutcome) -> None:
            assert isinstance(outcome, Stored), outcome
            inode = os.stat(log.partition(outcome.partition).active_segment.log_path).st_ino
            seen.append((outcome.partition, outcome.offset, synced.get(inode, 0)))
            if len(seen) == 600:
                all_stored.set()

        for turn in range(30):
            for i in range(20):
                persistence.append(publish(f"t/{i}", turn * 20 + i), "pub", check)
            await asyncio.sleep(0)
        await asyncio.wait_for(all_stored.wait(), 30)
        persistence.close()

    asyncio.run(main())
    filesystem_syncs = made[0].writer.statistics().filesystem_syncs
    assert filesystem_syncs > 0 if whole_file_system else filesystem_syncs == 0
    # Where each record's batch ends in its partition's one segment file.
    ends: dict[tuple[int, int], int] = {}
    for partition in (0, 1):
        data = (tmp_path / "log" / str(partition)).glob("*.log")
        [path] = list(data)
        raw, position = path.read_bytes(), 0
        while position < len(raw):
            header = read_batch_header(raw, position)
            position += header.batch_length
            for offset in range(header.base_offset, header.last_offset + 1):
                ends[(partition, offset)] = position
    assert len(seen) == 600 and len(ends) == 600
    late = [(p, o, fsynced, ends[(p, o)]) for p, o, fsynced in seen if fsynced < ends[(p, o)]]
    assert late == []  # every Stored came after an fsync covering its record


def test_turns_complete_in_publish_order_and_offsets_follow_it_across_policies(
        tmp_path: Path) -> None:
    """One partition, ``cmd/#`` fsynced always and the rest at intervals: a turn mixing both
    waits for the fsync, and a later turn of interval-only publishes completes after it."""
    settings = LogSettings(fsync="interval", fsync_interval_ms=600_000,
                           fsync_rules="cmd/#=always", partitions=1)

    async def main() -> tuple[list[tuple[int, AppendOutcome]], list[bytes]]:
        persistence = Persistence(settings, str(tmp_path), asyncio.get_running_loop())
        outcomes = await run_turns(persistence, [
            ["cmd/a", "tel/a", "cmd/b", "tel/b", "tel/c"],  # mixed
            ["tel/a", "tel/b"],  # interval only, behind a turn still in the writer
            ["cmd/a"],
        ])
        payloads = [r.payload for r in persistence.read(0, 0, 100)]
        persistence.close()
        return outcomes, payloads

    outcomes, payloads = asyncio.run(main())
    assert [n for n, _ in outcomes] == list(range(8))
    assert [(o.partition, o.offset) for _, o in outcomes if isinstance(o, Stored)] == [
        (0, n) for n in range(8)]
    assert payloads == [b"%d" % n for n in range(8)]


def test_turns_that_wait_for_no_fsync_are_written_on_the_loop(tmp_path: Path) -> None:
    settings = LogSettings(fsync="interval", fsync_interval_ms=600_000, partitions=4)

    async def main() -> tuple[list[tuple[int, AppendOutcome]], int]:
        persistence = Persistence(settings, str(tmp_path), asyncio.get_running_loop())
        outcomes = await run_turns(persistence, [[f"t/{i}" for i in range(50)]] * 4)
        groups = persistence.writer.statistics().groups
        persistence.close()
        return outcomes, groups

    outcomes, groups = asyncio.run(main())
    assert [n for n, _ in outcomes] == list(range(200))
    assert all(isinstance(o, Stored) for _, o in outcomes)
    assert len({(o.partition, o.offset) for _, o in outcomes}) == 200  # type: ignore[union-attr]
    assert groups == 0  # no round trip through the writer thread


def test_a_full_queue_refuses_the_publish_at_once(tmp_path: Path) -> None:
    settings = LogSettings(fsync="always", partitions=1, queue_size=5)

    async def main() -> list[AppendOutcome]:
        persistence = Persistence(settings, str(tmp_path), asyncio.get_running_loop())
        outcomes: list[AppendOutcome] = []
        five = asyncio.Event()

        def note(outcome: AppendOutcome) -> None:
            outcomes.append(outcome)
            if len(outcomes) == 5:
                five.set()

        taken = [persistence.append(publish("t", n), "pub", note) for n in range(7)]
        assert taken == [True] * 5 + [False] * 2
        await asyncio.wait_for(five.wait(), 30)
        persistence.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert [o.offset for o in outcomes if isinstance(o, Stored)] == [0, 1, 2, 3, 4]


def test_a_record_the_log_cannot_hold_is_refused_alone(tmp_path: Path) -> None:
    settings = LogSettings(fsync="always", partitions=1)

    async def main() -> list[tuple[int, AppendOutcome]]:
        persistence = Persistence(settings, str(tmp_path), asyncio.get_running_loop())
        loop = asyncio.get_running_loop()
        outcomes: list[tuple[int, AppendOutcome]] = []
        finished = loop.create_future()

        def done(n: int, outcome: AppendOutcome) -> None:
            outcomes.append((n, outcome))
            if len(outcomes) == 3:
                finished.set_result(None)

        persistence.append(publish("t", 0), "pub", partial(done, 0))
        persistence.append(publish("t", 1), "pub", partial(done, 1), message_id=b"short")
        persistence.append(publish("t", 2), "pub", partial(done, 2))
        await asyncio.wait_for(finished, WAIT)
        persistence.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert [n for n, _ in outcomes] == [0, 1, 2]
    assert isinstance(outcomes[0][1], Stored) and isinstance(outcomes[2][1], Stored)
    assert (outcomes[0][1].offset, outcomes[2][1].offset) == (0, 1)
    refused = outcomes[1][1]
    assert isinstance(refused, Refused)
    assert refused.reason_code == ReasonCode.UNSPECIFIED_ERROR


class SlowDisk:
    """An fsync whose duration the test chooses, seen through the writer's injected clock."""

    def __init__(self) -> None:
        self.now = 0.0
        self.seconds = 0.0001

        self.thread_gate = threading.Event()  # the writer thread's fsyncs wait for it
        self.thread_gate.set()

    def fsync(self, fd: int) -> None:
        if threading.current_thread().name == "meshmq-log-writer":
            assert self.thread_gate.wait(WAIT)
        os.fsync(fd)
        self.now += self.seconds

    def clock(self) -> float:
        return self.now


def test_fsync_always_completes_in_the_turn_and_uses_the_thread_while_fsyncs_are_slow(
        tmp_path: Path) -> None:
    disk = SlowDisk()
    topics = [f"t/{i}" for i in range(6)]

    async def main() -> list[AppendOutcome]:
        persistence = Persistence(LogSettings(fsync="always", partitions=2), str(tmp_path),
                                  asyncio.get_running_loop(), fsync=disk.fsync,
                                  fsync_clock=disk.clock)
        writer = persistence.writer
        outcomes: list[AppendOutcome] = []
        # Quick fsyncs: each turn is written, fsynced and completed in that same loop turn.
        for turn in range(5):
            for topic in topics:
                assert persistence.append(publish(topic, turn), "pub", outcomes.append)
            await asyncio.sleep(0)  # the end of the turn runs
            assert len(outcomes) == 6 * (turn + 1)
        stats = writer.statistics()
        assert (stats.groups, stats.inline_fsyncs, stats.fsyncs) == (0, 5, 5)
        disk.seconds = 0.025  # 50 ms for a turn's two partitions: one is enough
        outcomes += [o for _, o in await run_turns(persistence, [topics])]
        assert not writer.statistics().fsync_inline
        outcomes += [o for _, o in await run_turns(persistence, [topics] * 3)]
        stats = writer.statistics()
        assert stats.groups >= 1 and stats.inline_fsyncs == 6
        disk.seconds = 0.0001
        disk.now += 1.0  # the backoff ran out: the next turn tries inline, and stays
        groups = writer.statistics().groups
        outcomes += [o for _, o in await run_turns(persistence, [topics] * 2)]
        stats = writer.statistics()
        assert (stats.groups, stats.inline_fsyncs, stats.fsync_inline) == (groups, 8, True)
        persistence.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert all(isinstance(o, Stored) for o in outcomes)
    for partition in (0, 1):  # dense offsets, completed in publish order in every mode
        offsets = [o.offset for o in outcomes if o.partition == partition]  # type: ignore[union-attr]
        assert offsets == list(range(len(offsets))) and offsets


def test_turns_behind_the_writer_gather_and_go_inline_once_it_is_back(
        tmp_path: Path) -> None:
    """Coming back from the writer thread under load: turns that end while an earlier turn
    is still in the writer keep gathering, then are written and fsynced on the loop as one."""
    disk = SlowDisk()

    async def main() -> list[tuple[int, AppendOutcome]]:
        persistence = Persistence(LogSettings(fsync="always", partitions=1), str(tmp_path),
                                  asyncio.get_running_loop(), fsync=disk.fsync,
                                  fsync_clock=disk.clock)
        writer = persistence.writer
        loop = asyncio.get_running_loop()
        outcomes: list[tuple[int, AppendOutcome]] = []
        finished = loop.create_future()

        def done(n: int, outcome: AppendOutcome) -> None:
            outcomes.append((n, outcome))
            if len(outcomes) == 9:
                finished.set_result(None)

        def turn(first: int) -> None:
            for n in range(first, first + 3):
                assert persistence.append(publish("t", n), "pub", partial(done, n))

        disk.seconds = 0.050
        turn(0)
        await asyncio.sleep(0)  # inline, and too slow: the next turns go to the thread
        assert not writer.statistics().fsync_inline and len(outcomes) == 3
        disk.thread_gate.clear()
        turn(3)
        await asyncio.sleep(0)  # to the writer thread, which waits in its fsync
        disk.seconds = 0.0001
        disk.now += 1.0  # the backoff ran out: fsyncs may be tried on the loop again
        turn(6)
        await asyncio.sleep(0)  # held: the turn before it is still in the writer
        assert len(outcomes) == 3 and persistence._held
        disk.thread_gate.set()
        await asyncio.wait_for(finished, WAIT)
        stats = writer.statistics()
        assert (stats.groups, stats.inline_fsyncs, stats.fsync_inline) == (1, 2, True)
        persistence.close()
        return outcomes

    outcomes = asyncio.run(main())
    assert [n for n, _ in outcomes] == list(range(9))
    assert [o.offset for _, o in outcomes] == list(range(9))  # type: ignore[union-attr]


def test_the_output_hook_runs_once_after_each_turns_completions(tmp_path: Path) -> None:
    """``after_completions`` (the broker writes the queued acks and deliveries there) runs
    after every completion of a turn written on the loop, once per turn; and once after the
    writer thread's turns, when they come back to the loop."""
    disk = SlowDisk()
    events: list[str] = []

    async def main() -> None:
        persistence = Persistence(LogSettings(fsync="always", partitions=2), str(tmp_path),
                                  asyncio.get_running_loop(), fsync=disk.fsync,
                                  fsync_clock=disk.clock)
        persistence.after_completions = partial(events.append, "written out")

        def done(n: int, outcome: AppendOutcome) -> None:
            assert isinstance(outcome, Stored), outcome
            events.append(f"stored {n}")

        for turn in ((0, 1, 2), (3,)):  # quick fsyncs: completed on the loop, turn by turn
            for n in turn:
                assert persistence.append(publish(f"t/{n}", n), "pub", partial(done, n))
            await asyncio.sleep(0)
        assert events == ["stored 0", "stored 1", "stored 2", "written out",
                          "stored 3", "written out"]
        disk.seconds = 0.050  # too slow: this turn is the last fsynced on the loop
        await run_turns(persistence, [["t/4"]])
        del events[:]
        finished = asyncio.get_running_loop().create_future()

        def written_out() -> None:
            events.append("written out")
            if not finished.done():
                finished.set_result(None)

        persistence.after_completions = written_out
        for n in (5, 6, 7):  # to the writer thread
            assert persistence.append(publish("t/x", n), "pub", partial(done, n))
        await asyncio.wait_for(finished, WAIT)
        assert not persistence.writer.statistics().fsync_inline
        persistence.close()

    asyncio.run(main())
    assert events == ["stored 5", "stored 6", "stored 7", "written out"]
