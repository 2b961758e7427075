"""The metadata's state machine: commands in, results and changes out; no I/O, no clock.

Every backend applies the same ``Command`` values in the same order to a ``MetaState`` (the
Raft backend on every node, from its log; the in-memory model directly), so they answer the
same. Invariants:

* ``version`` grows by exactly one with each command that changes something; a command that
  loses its comparison, a barrier, or a repeated request changes nothing.
* A key's version is the store version of the command that last set it; an absent key has
  version 0 and is not stored.
* A request id is applied at most once: a command whose id was applied before (a client's
  retry after a lost answer or a leader change) answers what the first application answered
  and changes nothing. The last ``REMEMBERED`` ids are kept, in application order, so every
  replica forgets the same ones.

The state is plain data (``to_plain`` / ``from_plain``): snapshots never depend on class
names.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from meshmq.cluster.metadata import CasResult, Change, Entry, Json, View

REMEMBERED = 4096  # request ids kept for retries (a retry comes within seconds)


class Op(enum.Enum):
    SET = "set"
    DELETE = "delete"
    BARRIER = "barrier"  # changes nothing; a read that goes through the log


@dataclass(frozen=True, slots=True)
class Command:
    """One write (or barrier). ``request``: a unique id for retries ("" none)."""

    op: Op
    key: str = ""
    expected: int = 0
    value: Json = None
    guards: tuple[tuple[str, int], ...] = ()
    request: str = ""

    @classmethod
    def set(cls, key: str, expected: int, value: Json,
            guards: Mapping[str, int] | None = None, request: str = "") -> Command:
        return cls(Op.SET, key, expected, value, _guards(guards), request)

    @classmethod
    def delete(cls, key: str, expected: int, guards: Mapping[str, int] | None = None,
               request: str = "") -> Command:
        return cls(Op.DELETE, key, expected, None, _guards(guards), request)

    def to_wire(self) -> tuple[Any, ...]:
        """Plain data for a log entry (no class names in the log)."""
        return (self.op.value, self.key, self.expected, self.value,
                [list(guard) for guard in self.guards], self.request)

    @classmethod
    def from_wire(cls, data: tuple[Any, ...] | list[Any]) -> Command:
        op, key, expected, value, guards, request = data
        return cls(Op(op), key, expected, value,
                   tuple((str(k), int(v)) for k, v in guards), request)


def _guards(guards: Mapping[str, int] | None) -> tuple[tuple[str, int], ...]:
    return tuple(sorted((guards or {}).items()))


class MetaState:
    """See the module docstring."""

    def __init__(self) -> None:
        self.version = 0
        self.entries: dict[str, Entry] = {}
        self.answered: dict[str, CasResult] = {}  # request id -> its result, oldest first

    def apply(self, command: Command) -> tuple[CasResult, Change | None]:
        """Apply ``command``: its result, and the change it made (None: nothing changed)."""
        if command.request and command.request in self.answered:
            return self.answered[command.request], None
        result, change = self._apply(command)
        if command.request:
            self.answered[command.request] = result
            if len(self.answered) > REMEMBERED:
                del self.answered[next(iter(self.answered))]
        return result, change

    def _apply(self, command: Command) -> tuple[CasResult, Change | None]:
        if command.op is Op.BARRIER:
            return CasResult(True, self.version), None
        current = self.version_of(command.key)
        if current != command.expected:
            return CasResult(False, current, command.key), None
        for key, version in command.guards:
            if self.version_of(key) != version:
                return CasResult(False, current, key), None
        entry: Entry | None
        if command.op is Op.DELETE:
            if command.key not in self.entries:
                return CasResult(True, 0), None  # already absent: nothing changes
            self.version += 1
            del self.entries[command.key]
            entry, new = None, 0
        else:
            self.version += 1
            entry = Entry(command.value, self.version)
            self.entries[command.key] = entry
            new = self.version
        return CasResult(True, new), Change(self.version, MappingProxyType({command.key: entry}))

    def version_of(self, key: str) -> int:
        entry = self.entries.get(key)
        return 0 if entry is None else entry.version

    def view(self) -> View:
        """A copy of the whole state (later commands do not change it)."""
        return View(self.version, MappingProxyType(dict(self.entries)))

    def reset_change(self) -> Change:
        """The whole state as a change (a watch's first one)."""
        return Change(self.version, MappingProxyType(dict(self.entries)), reset=True)

    # -- snapshots ----------------------------------------------------------------------------

    def to_plain(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "entries": {key: (entry.value, entry.version) for key, entry in self.entries.items()},
            "answered": [(request, result.ok, result.version, result.conflict)
                         for request, result in self.answered.items()],
        }

    @classmethod
    def from_plain(cls, data: Mapping[str, Any]) -> MetaState:
        state = cls()
        state.version = int(data["version"])
        state.entries = {key: Entry(value, int(version))
                         for key, (value, version) in data["entries"].items()}
        state.answered = {request: CasResult(ok, version, conflict)
                          for request, ok, version, conflict in data["answered"]}
        return state
