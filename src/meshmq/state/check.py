"""``verify`` and ``repair`` for the broker's state directories (``meshmq state ...``).

Theory of operation
-------------------
A data_dir holds one state directory per broker process: ``state`` (a single broker, or worker
0) and ``state-1``, ``state-2``... for the other workers. ``verify`` reads each one as the
broker does (``files.py``: the snapshot, then every line of its journal) but goes on past
a bad line, so one run finds every problem: a damaged snapshot, damaged journal lines, a torn
last line (bytes after the last newline: a write a crash interrupted, which the broker itself
cuts at start-up). It only reads and takes no lock; a directory a running broker holds is
marked ``in_use``, and its unterminated last line is then a write in progress, not a problem.

``repair`` first takes the ``.lock`` of every directory (a running broker holds it: refused,
nothing touched), verifies again, and for each journal with bad lines cuts exactly those lines
out with the commit log's ``cut_file``: the journal as it was is kept in ``repair-backup-<UTC
time>/`` in the state directory, and every good line, before and after the bad ones, stays in
order (each entry *sets* one thing, so a skipped line loses only its own change). Leftover
temporary files of an interrupted repair are removed. A damaged snapshot is not repairable
here (it holds everything older than its journal): restore it, or move the directory away.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from meshmq.log.backup import REPAIR_TEMP_SUFFIX, backup_stamp, cut_file
from meshmq.log.locks import LOCK_FILE, acquire, is_locked
from meshmq.state.files import (
    SNAPSHOT_FILE,
    StateError,
    empty_state,
    journal_name,
    read_snapshot,
    scan_journal,
)

STATE_DIRECTORY = re.compile(r"state(-\d+)?")
JOURNAL_FILE = re.compile(r"journal-(\d+)\.jsonl")


class StateDirectoryError(Exception):
    """The given directory holds no broker state, or it is in use: one line, exit status 2."""


@dataclass(frozen=True, slots=True)
class StateProblem:
    """``kind``: ``snapshot`` (unreadable), ``damaged`` (a journal line) or ``torn`` (the
    journal's unterminated end). ``line`` and ``text`` are the journal line's number and
    bytes."""

    path: Path
    kind: str
    detail: str
    line: int | None = None
    text: bytes = b""


@dataclass(slots=True)
class DirectoryCheck:
    """One state directory as ``verify`` found it; the counts are after the journal."""

    path: Path
    in_use: bool
    generation: int = 0
    sessions: int = 0
    retained: int = 0
    journal: Path | None = None
    lines_applied: int = 0
    keep: list[tuple[int, int]] = field(default_factory=list)  # the journal's good bytes
    problems: list[StateProblem] = field(default_factory=list)
    notes: list[tuple[Path, str]] = field(default_factory=list)

    @property
    def cuttable(self) -> list[StateProblem]:
        return [p for p in self.problems if p.kind in ("damaged", "torn")]


@dataclass(slots=True)
class StateReport:
    data_dir: Path
    directories: list[DirectoryCheck]

    @property
    def problems(self) -> list[StateProblem]:
        return [p for d in self.directories for p in d.problems]

    @property
    def clean(self) -> bool:
        return not self.problems


@dataclass(slots=True)
class StateRepair:
    before: StateReport
    dry_run: bool
    cut: list[StateProblem] = field(default_factory=list)  # the journal lines cut out
    kept: list[Path] = field(default_factory=list)  # the journals as they were
    removed: list[Path] = field(default_factory=list)  # leftover temporary files
    after: StateReport | None = None

    @property
    def unrepairable(self) -> list[StateProblem]:
        return [p for p in self.before.problems if p.kind == "snapshot"]

    @property
    def succeeded(self) -> bool:
        if self.dry_run:
            return not self.unrepairable
        return self.after is None or self.after.clean


def state_directories(given: Path | str) -> tuple[Path, list[Path]]:
    """The data_dir and its state directories (``given`` may be one state directory itself);
    ``StateDirectoryError`` when there are none."""
    given = Path(given)
    if not given.is_dir():
        raise StateDirectoryError(f"{given}: no such directory")
    if STATE_DIRECTORY.fullmatch(given.name) and _holds_state(given):
        return given.parent, [given]
    found = sorted((p for p in given.iterdir() if STATE_DIRECTORY.fullmatch(p.name)
                    and p.is_dir()), key=lambda p: int(p.name[6:] or 0))
    if not found:
        raise StateDirectoryError(f"{given}: no broker state here (no {given / 'state'})")
    return given, found


def _holds_state(path: Path) -> bool:
    return (path / SNAPSHOT_FILE).exists() or any(path.glob("journal-*.jsonl"))


def verify(given: Path | str) -> StateReport:
    """Check every state directory of ``given``; see the module docstring."""
    data_dir, directories = state_directories(given)
    return StateReport(data_dir, [check_directory(d, live=is_locked(d / LOCK_FILE))
                                  for d in directories])


def check_directory(path: Path, *, live: bool) -> DirectoryCheck:
    check = DirectoryCheck(path, live)
    state = empty_state()
    snapshot = path / SNAPSHOT_FILE
    if snapshot.exists():
        try:
            check.generation, state = read_snapshot(snapshot)
        except StateError as error:
            detail = str(error).removeprefix(f"{snapshot}: ")  # the problem names the file
            check.problems.append(StateProblem(snapshot, "snapshot", detail))
    journal = path / journal_name(check.generation)
    if journal.exists():
        check.journal, data = journal, journal.read_bytes()
        scan = scan_journal(data, state)
        check.lines_applied, check.keep = scan.applied, scan.keep()
        for bad in scan.bad:
            _add_bad_line(check, journal, bad.number, bad.reason, bad.torn,
                          data[bad.start:bad.end].removesuffix(b"\n"))
        if scan.unterminated:
            check.notes.append((journal, "the last line has no newline yet: a write in progress"
                                if live else "the last line has no newline (a crash interrupted "
                                "its write; the entry is whole: the broker keeps it and adds "
                                "the newline)"))
    check.sessions, check.retained = len(state["sessions"]), len(state["retained"])
    _note_leftovers(check)
    return check


def _add_bad_line(check: DirectoryCheck, journal: Path, number: int, reason: str, torn: bool,
                  text: bytes) -> None:
    if torn and check.in_use:
        check.notes.append((journal, f"line {number} is not whole yet: a write in progress"))
        return
    if torn:
        detail = (f"torn last line ({reason}): a write a crash interrupted, never acknowledged; "
                  "the broker cuts it at start-up")
    else:
        detail = f"damaged line ({reason}); the broker refuses to start"
    check.problems.append(StateProblem(journal, "torn" if torn else "damaged", detail, number,
                                       text))


def _note_leftovers(check: DirectoryCheck) -> None:
    current = journal_name(check.generation)
    for name in sorted(os.listdir(check.path)):
        if name.endswith(REPAIR_TEMP_SUFFIX):
            check.notes.append((check.path / name, "leftover of an interrupted repair "
                                "(repair removes it)"))
        elif name == f"{SNAPSHOT_FILE}.tmp":
            check.notes.append((check.path / name, "leftover of an interrupted compaction "
                                "(the broker overwrites it)"))
        elif JOURNAL_FILE.fullmatch(name) and name != current:
            check.notes.append((check.path / name, "journal of another generation, left by an "
                                "interrupted compaction (the broker ignores it)"))


def repair(given: Path | str, *, dry_run: bool = False,
           now: datetime | None = None) -> StateRepair:
    """Cut the bad journal lines out of every state directory of ``given``, keeping a copy.

    Raises ``StateDirectoryError`` when a broker holds one of the directories (nothing is
    touched).
    """
    data_dir, directories = state_directories(given)
    with _locked(directories):
        before = StateReport(data_dir, [check_directory(d, live=False) for d in directories])
        report = StateRepair(before, dry_run)
        stamp = backup_stamp(now)
        for check in before.directories:
            _repair_directory(check, report, stamp)
        if not dry_run:
            report.after = StateReport(data_dir, [check_directory(d, live=False)
                                                  for d in directories])
        return report


def _repair_directory(check: DirectoryCheck, report: StateRepair, stamp: str) -> None:
    report.removed += [path for path, _ in check.notes
                       if path.name.endswith(REPAIR_TEMP_SUFFIX)]
    cut = check.cuttable
    report.cut += cut
    if report.dry_run:
        return
    for path, _ in check.notes:
        if path.name.endswith(REPAIR_TEMP_SUFFIX):
            path.unlink(missing_ok=True)
    if cut and check.journal is not None:
        report.kept.append(cut_file(check.journal, check.keep, stamp=stamp))


@contextmanager
def _locked(directories: list[Path]) -> Iterator[None]:
    with ExitStack() as stack:
        for directory in directories:
            fd = acquire(directory / LOCK_FILE)
            if fd is None:
                raise StateDirectoryError(
                    f"{directory} is in use (a running broker holds its lock): stop the broker "
                    "first")
            stack.callback(os.close, fd)
        yield
