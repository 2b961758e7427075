"""The in-memory metadata store: the reference model, for deterministic tests.

One ``MetaState`` (cluster/metastate.py) applied at once, no thread, no timer; time is the
clock passed in, so a test decides when things happen. It answers exactly as the Raft backend
does when everything is healthy (tests/cluster/test_metaproc.py runs the same script against
both), and it can be told to fail the way the real one fails, for tests of the code that
uses the store:

* ``unavailable(until)``: every request raises ``NoQuorum`` while ``clock() < until`` (a
  majority lost; the real backend first waits its bounded wait, the model answers at once).
* ``fail_next(error, applied)``: the next write raises ``error``; with ``applied`` it is
  applied first (a lost answer: the caller must treat ``NoQuorum`` and ``Timeout`` as
  unknown).
* ``not_leader(hint)``: requests raise ``NotLeader`` until ``not_leader(None)``.

Watch callbacks run on the event loop that registered them (``call_soon``), in version order,
never inside the write that caused them: as with the real backend, a callback cannot rely on
running before the writer's ``await`` returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

from meshmq.cluster.metadata import (
    CasResult,
    Change,
    Json,
    Member,
    MetadataError,
    NoQuorum,
    NotLeader,
    View,
    WatchCallback,
    drop_member,
    members_of,
    put_member,
)
from meshmq.cluster.metastate import Command, MetaState


class MemoryWatch:
    def __init__(self, store: MemoryStore, callback: WatchCallback,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.callback = callback
        self.loop = loop
        self.cancelled = False

    def deliver(self, change: Change) -> None:
        self.loop.call_soon(self._run, change)

    def _run(self, change: Change) -> None:
        if not self.cancelled:
            self.callback(change)

    def cancel(self) -> None:
        self.cancelled = True
        self.store._watches.discard(self)


class MemoryStore:
    """A ``MetadataStore`` in memory; see the module docstring."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.state = MetaState()
        self._watches: set[MemoryWatch] = set()
        self._down_until = float("-inf")
        self._leader_hint: str | None = None
        self._not_leader = False
        self._next_failure: tuple[MetadataError, bool] | None = None

    # -- faults -----------------------------------------------------------------------------------

    def unavailable(self, until: float) -> None:
        self._down_until = until

    def not_leader(self, hint: str | None) -> None:
        """Requests raise ``NotLeader(hint)``; ``not_leader(None)`` ends it."""
        self._not_leader = hint is not None
        self._leader_hint = hint

    def fail_next(self, error: MetadataError, applied: bool = False) -> None:
        self._next_failure = (error, applied)

    def _check(self) -> None:
        if self.clock() < self._down_until:
            raise NoQuorum(f"no majority of voters reachable until t={self._down_until}")
        if self._not_leader:
            raise NotLeader("this node is not the leader", self._leader_hint)

    # -- MetadataStore ----------------------------------------------------------------------------

    async def read(self) -> View:
        self._check()
        return self.state.view()

    async def cas(self, key: str, expected: int, value: Json,
                  guards: Mapping[str, int] | None = None) -> CasResult:
        return self._write(Command.set(key, expected, value, guards))

    async def delete(self, key: str, expected: int,
                     guards: Mapping[str, int] | None = None) -> CasResult:
        return self._write(Command.delete(key, expected, guards))

    def _write(self, command: Command) -> CasResult:
        self._check()
        failure, self._next_failure = self._next_failure, None
        if failure is not None and not failure[1]:
            raise failure[0]
        result, change = self.state.apply(command)
        if change is not None:
            for watch in list(self._watches):
                watch.deliver(change)
        if failure is not None:
            raise failure[0]
        return result

    def watch(self, callback: WatchCallback) -> MemoryWatch:
        watch = MemoryWatch(self, callback, asyncio.get_running_loop())
        self._watches.add(watch)
        watch.deliver(self.state.reset_change())
        return watch

    async def add_member(self, member: Member) -> int:
        return await put_member(self, member)

    async def remove_member(self, node_id: str) -> int:
        return await drop_member(self, node_id)

    async def members(self) -> dict[str, Member]:
        return members_of(await self.read())
