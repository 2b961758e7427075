"""The files of a state directory (``data_dir/state``, ``state-N``): what they hold and how
they are read.

* ``snapshot.json`` — ``{"version": 1, "generation": N, "sessions": {...}, "retained": {...}}``,
  the whole state at some moment;
* ``journal-<N>.jsonl`` — one JSON object per line, one per change since snapshot ``N``:
  ``{"op": "session"|"end"|"subs"|"retain", ...}``. Every change is a *set* (a session's fields,
  one subscription, one retained topic), so applying a line twice gives the same state, and a
  line skipped loses only its own change. A ``session`` line with ``subs`` (written when the
  session connects) sets its whole set of subscriptions; one without leaves them as they are.

The store (``store.py``) and ``meshmq state verify|repair`` (``check.py``) read the
files with these functions only: one reader of the format.
"""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1
SNAPSHOT_FILE = "snapshot.json"
State = dict[str, dict[str, Any]]  # {"sessions": {client id: record}, "retained": {topic: m}}
_ENTRY_FIELDS: dict[str, dict[str, type | tuple[type, ...]]] = {  # op -> fields, their types
    "session": {"client_id": str},
    "end": {"client_id": str},
    "subs": {"client_id": str, "subs": dict},
    "retain": {"topic": str, "message": (dict, type(None))},
}


class StateError(Exception):
    """The state directory cannot be read (the message names the file and the problem)."""


def empty_state() -> State:
    return {"sessions": {}, "retained": {}}


def journal_name(generation: int) -> str:
    return f"journal-{generation}.jsonl"


def state_tool(action: str, directory: Path) -> str:
    """``meshmq state ACTION --data-dir DIR`` for the data_dir holding ``directory``, ready to
    paste (absolute, quoted)."""
    return f"meshmq state {action} --data-dir {shlex.quote(os.path.abspath(directory.parent))}"


def read_snapshot(path: Path) -> tuple[int, State]:
    """The generation and state in a snapshot file; ``StateError`` naming what is wrong."""
    try:
        data = json.loads(path.read_bytes())
        if data.get("version") != FORMAT_VERSION:
            raise StateError(f"{path}: unknown state format {data.get('version')!r}")
        generation = int(data["generation"])
        state = {"sessions": data["sessions"], "retained": data["retained"]}
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise StateError(f"{path}: not a meshmq state snapshot ({error})") from None
    if not all(isinstance(part, dict) for part in state.values()):
        raise StateError(f"{path}: not a meshmq state snapshot (sessions or retained is not an "
                         "object)")
    return generation, state


@dataclass(frozen=True, slots=True)
class BadLine:
    """A journal line that does not apply: bytes ``[start, end)``, ``number`` counted from 1.

    ``torn`` marks bytes after the last newline that do not decode: a write a crash
    interrupted, never acknowledged. Any other bad line is damage.
    """

    number: int
    start: int
    end: int
    reason: str
    torn: bool


@dataclass(slots=True)
class JournalScan:
    """What ``scan_journal`` found: how many lines applied and which did not.

    ``unterminated``: the last line is a whole entry (applied) but its newline was never
    written; the owner adds it before appending, or the next line would be glued onto it.
    """

    size: int
    applied: int = 0
    bad: list[BadLine] = field(default_factory=list)
    unterminated: bool = False

    @property
    def damaged(self) -> list[BadLine]:
        return [line for line in self.bad if not line.torn]

    def keep(self) -> list[tuple[int, int]]:
        """The byte ranges left when every bad line is cut out."""
        ranges, position = [], 0
        for line in self.bad:
            if line.start > position:
                ranges.append((position, line.start))
            position = line.end
        if position < self.size:
            ranges.append((position, self.size))
        return ranges


def scan_journal(data: bytes, state: State) -> JournalScan:
    """Apply every whole line of a journal that decodes to ``state``; record the others.

    Good lines after a bad one are applied too: each entry *sets* a session field, a
    subscription or a retained topic, so skipping one loses only that change.
    """
    scan = JournalScan(len(data))
    position = 0
    for number, line in enumerate(data.split(b"\n"), 1):
        start, position = position, position + len(line) + 1
        if not line:
            continue
        last = position > len(data)  # no newline after it
        try:
            entry = json.loads(line)
            check_entry(entry)
        except ValueError as error:
            scan.bad.append(BadLine(number, start, min(position, len(data)), str(error), last))
            continue
        apply(state, entry)
        scan.applied += 1
        scan.unterminated = last
    return scan


def check_entry(entry: Any) -> None:
    """Raise ``ValueError`` naming the problem unless ``entry`` is a journal entry ``apply``
    takes whole (checked first, so a bad entry never half-applies)."""
    if not isinstance(entry, dict):
        raise ValueError(f"not a JSON object: {type(entry).__name__}")
    op = entry.get("op")
    fields = _ENTRY_FIELDS.get(op) if isinstance(op, str) else None  # a list is unhashable
    if fields is None:
        raise ValueError(f"unknown state operation {op!r}")
    for name, kind in fields.items():
        if name not in entry:
            raise ValueError(f"{entry['op']!r} entry without {name!r}")
        if not isinstance(entry[name], kind):
            raise ValueError(f"{entry['op']!r} entry with a bad {name!r}")
    if entry["op"] == "subs" and not all(
            isinstance(options, list | None) for options in entry["subs"].values()):
        raise ValueError("'subs' entry with bad subscription options")
    if entry["op"] == "session" and "subs" in entry and not (
            isinstance(entry["subs"], dict)
            and all(isinstance(options, list) for options in entry["subs"].values())):
        raise ValueError("'session' entry with bad subscription options")


def apply(state: State, entry: dict[str, Any]) -> None:
    """Apply one journal entry to ``state`` (idempotent)."""
    op = entry["op"]
    sessions = state["sessions"]
    if op == "session":
        record = sessions.setdefault(entry["client_id"], {"subs": {}})
        for key in ("expiry", "username", "will", "detached_at", "cursor"):
            if key in entry:
                record[key] = entry[key]
        if "subs" in entry:  # the whole session as it connected (one handed over from
            record["subs"] = dict(entry["subs"])  # another worker has no "subs" lines here)
    elif op == "end":
        sessions.pop(entry["client_id"], None)
    elif op == "subs":
        record = sessions.setdefault(entry["client_id"], {"subs": {}})
        subs = record.setdefault("subs", {})
        for topic_filter, options in entry["subs"].items():
            if options is None:
                subs.pop(topic_filter, None)
            else:
                subs[topic_filter] = options
    elif op == "retain":
        if entry["message"] is None:
            state["retained"].pop(entry["topic"], None)
        else:
            state["retained"][entry["topic"]] = entry["message"]
    else:
        raise ValueError(f"unknown state operation {op!r}")
