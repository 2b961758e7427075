"""``repair``: make a damaged log open again, keeping every batch that verifies.

Theory of operation
-------------------
Repair holds the log's ``.lock`` flock for its whole run, so it refuses to start while a broker
has the log open and no broker can open it meanwhile. It runs ``verify`` (not live: every
damaged byte is damage), then plans one action per segment:

* ``rewrite`` a ``.log`` file with damage: keep the byte ranges of its good batches, drop the
  rest (a torn tail, a corrupt tail, corrupt bytes in the middle: valid batches after them are
  kept, so only the damaged batches' offsets are lost), then rebuild its indexes;
* ``rebuild`` the indexes of a segment whose ``.log`` is fine but whose indexes are missing or
  wrong;
* ``unrepairable`` for overlapping segments: which copy is right needs a human.

A rewrite is crash-safe and keeps what it cuts, with the same code (``backup.py``) the broker
uses when it cuts a torn tail at start-up: the damaged files are first hard-linked (or copied)
into ``<partition>/repair-backup-<UTC time>/`` and that directory fsynced; the old index files
are removed; the kept ranges are written to ``.<name>.log.repair-tmp``, fsynced and renamed over
the ``.log``, and the directory fsynced; finally ``LogSegment`` rebuilds the indexes from the
new file and they are fsynced. A crash at any point leaves either the old or the new ``.log``
(plus, maybe, a temp file the broker ignores and the next repair removes), and index files are
caches the broker rebuilds. ``verify`` runs again at the end.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from meshmq.log.backup import (
    REPAIR_TEMP_SUFFIX,
    backup_stamp,
    keep_copy,
    make_backup_dir,
    rewrite_keeping,
)
from meshmq.log.errors import LogDirectoryLocked
from meshmq.log.files import fsync_directory
from meshmq.log.locks import LOCK_FILE, acquire
from meshmq.log.reader import LogDirectory, SegmentFile
from meshmq.log.segment import DEFAULT_INDEX_INTERVAL_BYTES, LogSegment
from meshmq.log.verify import Problem, SegmentCheck, VerifyReport, verify


@dataclass(slots=True)
class RepairAction:
    """One thing repair does (or, with ``--dry-run``, would do) to one segment."""

    kind: str  # "rewrite", "rebuild" (indexes only), "unrepairable", "remove" (a temp file)
    partition: int
    path: Path
    problems: list[Problem] = field(default_factory=list)
    keep: list[tuple[int, int]] = field(default_factory=list)

    @property
    def bytes_lost(self) -> int:
        return sum(p.length for p in self.problems if p.kind in ("corrupt", "tail"))

    @property
    def lost_offsets(self) -> list[tuple[int, int | None]]:
        return [p.lost_offsets for p in self.problems
                if p.kind in ("corrupt", "tail") and p.lost_offsets is not None]


@dataclass(slots=True)
class RepairReport:
    before: VerifyReport
    actions: list[RepairAction]
    dry_run: bool
    backups: list[Path] = field(default_factory=list)
    after: VerifyReport | None = None

    @property
    def bytes_lost(self) -> int:
        return sum(action.bytes_lost for action in self.actions)

    @property
    def succeeded(self) -> bool:
        """Nothing left to fix (or, in a dry run, everything fixable)."""
        if self.dry_run:
            return all(action.kind != "unrepairable" for action in self.actions)
        return self.after is None or self.after.clean


@contextmanager
def exclusive_lock(log: LogDirectory) -> Iterator[None]:
    """Hold the log's flock, as ``CommitLog`` does; ``LogDirectoryLocked`` if a broker has it."""
    fd = acquire(log.path / LOCK_FILE)
    if fd is None:
        raise LogDirectoryLocked(
            f"{log.path} is in use (a running broker holds its lock): stop the broker first")
    try:
        yield
    finally:
        os.close(fd)


def repair(log: LogDirectory, *, dry_run: bool = False, backup: bool = True,
           now: datetime | None = None) -> RepairReport:
    """Verify ``log`` under its lock and fix what can be fixed; see the module docstring.

    Raises ``LogDirectoryLocked`` when a broker has the log open (nothing is touched).
    """
    with exclusive_lock(log):
        before = verify(log, live=False)
        report = RepairReport(before, plan(before), dry_run)
        if dry_run or not report.actions:
            return report
        stamp = backup_stamp(now)
        backups: dict[int, Path] = {}
        for action in report.actions:
            target = None
            if backup and action.kind in ("rewrite", "rebuild"):
                target = backups.get(action.partition)
                if target is None:
                    target = backups[action.partition] = make_backup_dir(
                        log.partition_dir(action.partition), stamp)
            _apply(action, target)
        report.backups = sorted(backups.values())
        report.after = verify(log, live=False)
        return report


def plan(report: VerifyReport) -> list[RepairAction]:
    """The actions that fix ``report``'s problems, in partition and offset order."""
    actions = [RepairAction("remove", note.partition, note.path) for note in report.notes
               if note.path.name.endswith(REPAIR_TEMP_SUFFIX)]
    for check in report.segments:
        action = _plan_segment(check)
        if action is not None:
            actions.append(action)
    return actions


def _plan_segment(check: SegmentCheck) -> RepairAction | None:
    segment = check.segment
    problems = check.data_problems + check.index_problems
    if any(p.kind == "overlap" for p in problems):
        return RepairAction("unrepairable", segment.partition, segment.path, problems)
    if check.data_problems:
        return RepairAction("rewrite", segment.partition, segment.path, problems,
                            list(check.keep))
    if check.index_problems:
        return RepairAction("rebuild", segment.partition, segment.path, problems)
    return None


def _apply(action: RepairAction, backup: Path | None) -> None:
    if action.kind == "remove":
        action.path.unlink(missing_ok=True)
        return
    if action.kind == "unrepairable":
        return
    segment = _segment_of(action)
    if backup is not None:
        _back_up(segment, backup, with_log=action.kind == "rewrite")
    if action.kind == "rewrite":
        _rewrite(segment, action.keep)
    _rebuild_indexes(segment)


def _segment_of(action: RepairAction) -> SegmentFile:
    return SegmentFile(action.partition, int(action.path.stem), action.path)


def _back_up(segment: SegmentFile, backup: Path, *, with_log: bool) -> None:
    """Keep the files about to be replaced; the ``.log`` file only when it is rewritten."""
    sources = (segment.path,) if with_log else ()
    for source in (*sources, segment.index_path, segment.timeindex_path):
        if source.exists():
            keep_copy(source, backup)


def _rewrite(segment: SegmentFile, keep: list[tuple[int, int]]) -> None:
    for index in (segment.index_path, segment.timeindex_path):
        index.unlink(missing_ok=True)  # caches of the old file: rebuilt below
    rewrite_keeping(segment.path, keep)


def _rebuild_indexes(segment: SegmentFile) -> None:
    for index in (segment.index_path, segment.timeindex_path):
        index.unlink(missing_ok=True)
    rebuilt = LogSegment(segment.path.parent, segment.base_offset,
                         index_interval_bytes=DEFAULT_INDEX_INTERVAL_BYTES)
    try:
        if rebuilt.damage is not None:  # the file changed under us: never write over it
            raise rebuilt.damage
        rebuilt.flush_indexes()
    finally:
        rebuilt.close()
    fsync_directory(segment.path.parent)
