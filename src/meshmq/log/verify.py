"""``verify``: check every batch, the offsets and the indexes of a log, without writing.

Theory of operation
-------------------
Each partition's segments are walked in order with ``inspect.walk_batches``: every batch must
pass its checksum and header rules, decode record by record, and carry offsets that increase
within the segment (gaps are allowed: a repaired log has them). A damaged region becomes a
``Problem`` that says where it is (partition, file, byte), what is wrong, how many bytes it
spans and which offsets it makes unreadable; the walk then resumes at the next valid batch, so
one run reports everything. Segments must not overlap each other.

Each segment's ``.index`` and ``.timeindex`` are read *before* its ``.log`` (a running broker
writes an index entry only after its batch), then checked against the batches: size a whole
number of entries, both files in lockstep, every entry naming the start of a good batch with
the right relative offset and the running maximum timestamp. Missing index files are problems
too (the broker would rebuild them; ``repair`` does).

With ``live=True`` (a broker holds the log) a damaged region that runs to the end of a
partition's last segment, or that only zeros follow (the space the broker preallocates), is a
write in progress: a note, not a problem. Other damage in that segment makes it read once more
first: a read racing with a write may see a later page of it copied and an earlier one not
yet. ``SegmentCheck`` keeps the byte ranges of the good batches: ``repair`` rewrites a segment
from them.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from meshmq.log.backup import REPAIR_TEMP_SUFFIX
from meshmq.log.files import INDEX_SUFFIX, TIMEINDEX_SUFFIX
from meshmq.log.index import OffsetIndex, TimeIndex
from meshmq.log.inspect import Batch, Damage, decoded_header, walk_batches
from meshmq.log.reader import LogDirectory, SegmentFile
from meshmq.log.record import NO_TIMESTAMP, BatchHeader, peek_batch_header


@dataclass(frozen=True, slots=True)
class Problem:
    """Something that makes the log fail to open or read, or an index wrong.

    ``kind`` is ``corrupt`` (valid batches follow in the same file), ``tail`` (nothing valid
    follows: a torn or corrupt end), ``overlap`` (segments overlap; not repairable) or
    ``index``. ``lost_offsets`` is the inclusive offset range the damage makes unreadable
    (last None: open-ended, the end was never written).
    """

    partition: int
    path: Path
    kind: str
    detail: str
    position: int | None = None
    length: int = 0
    lost_offsets: tuple[int, int | None] | None = None
    reason: str = ""  # the short cause (a damaged batch's check failure), for repair's report

    def describe(self) -> str:
        where = f"partition {self.partition}, {self.path.name}"
        if self.position is not None:
            where += f", byte {self.position}"
        text = f"{where}: {self.detail}"
        if self.length:
            text += f"; {self.length} bytes"
        if self.lost_offsets is not None:
            text += f"; {format_range(self.lost_offsets)} unreadable"
        return text


@dataclass(frozen=True, slots=True)
class Note:
    """Worth knowing, not wrong: gaps, writes in progress, leftovers the broker cleans up."""

    partition: int
    path: Path
    detail: str

    def describe(self) -> str:
        return f"partition {self.partition}, {self.path.name}: {self.detail}"


@dataclass(slots=True)
class SegmentCheck:
    segment: SegmentFile
    size: int = 0
    batches: int = 0
    records: int = 0
    next_offset: int = 0
    keep: list[tuple[int, int]] = field(default_factory=list)  # byte ranges of good batches
    data_problems: list[Problem] = field(default_factory=list)
    index_problems: list[Problem] = field(default_factory=list)
    vanished: bool = False


@dataclass(slots=True)
class VerifyReport:
    log: LogDirectory
    live: bool
    segments: list[SegmentCheck] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)
    notes: list[Note] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not self.problems

    @property
    def records(self) -> int:
        return sum(check.records for check in self.segments)

    @property
    def size_bytes(self) -> int:
        return sum(check.size for check in self.segments)


def format_range(offsets: tuple[int, int | None]) -> str:
    """``offset 7``, ``offsets 7-9``, ``offsets 7 and later``."""
    first, last = offsets
    if last is None:
        return f"offsets {first} and later"
    return f"offset {first}" if first == last else f"offsets {first}-{last}"


def verify(log: LogDirectory, *, live: bool | None = None) -> VerifyReport:
    """Check every partition; ``live`` defaults to whether a broker holds the log."""
    report = VerifyReport(log, log.is_locked() if live is None else live)
    for partition in range(log.partitions):
        _verify_partition(report, partition)
    for check in report.segments:
        report.problems += check.data_problems + check.index_problems
    report.problems.sort(key=lambda p: (p.partition, p.path.stem, p.kind == "index",
                                        p.position or 0))
    return report


def _verify_partition(report: VerifyReport, partition: int) -> None:
    log = report.log
    directory = log.partition_dir(partition)
    if not directory.is_dir():
        report.notes.append(Note(partition, directory, "partition directory missing (empty)"))
        return
    segments = log.segments(partition)
    _note_leftovers(report, partition, directory, segments)
    previous: SegmentCheck | None = None
    for i, segment in enumerate(segments):
        following = segments[i + 1].base_offset if i + 1 < len(segments) else None
        check = _verify_segment(report, segment, following)
        if check.vanished:
            continue
        if previous is not None:
            _check_boundary(report, previous, check)
        report.segments.append(check)
        previous = check


def _note_leftovers(report: VerifyReport, partition: int, directory: Path,
                    segments: list[SegmentFile]) -> None:
    stems = {segment.path.stem for segment in segments}
    for name in sorted(os.listdir(directory)):
        path = directory / name
        stem, suffix = os.path.splitext(name)
        if suffix in (INDEX_SUFFIX, TIMEINDEX_SUFFIX) and stem.isdigit() and stem not in stems:
            report.notes.append(Note(partition, path, "index without a .log file (left by an "
                                     "interrupted deletion; the broker removes it)"))
        elif name.endswith(REPAIR_TEMP_SUFFIX):
            report.notes.append(Note(partition, path, "leftover of an interrupted repair "
                                     "(repair removes it)"))


def _check_boundary(report: VerifyReport, previous: SegmentCheck, check: SegmentCheck) -> None:
    base = check.segment.base_offset
    partition = check.segment.partition
    if base < previous.next_offset:
        check.data_problems.append(Problem(
            partition, check.segment.path, "overlap",
            f"segment starts at offset {base} but {previous.segment.path.name} holds offsets "
            f"up to {previous.next_offset - 1}; restore one of them from a backup or replica"))
    elif base > previous.next_offset and not previous.data_problems:
        report.notes.append(Note(partition, check.segment.path,
                                 f"{format_range((previous.next_offset, base - 1))} absent "
                                 "(gap)"))


def _verify_segment(report: VerifyReport, segment: SegmentFile,
                    following: int | None) -> SegmentCheck:
    check = SegmentCheck(segment, next_offset=segment.base_offset)
    index = _IndexCheck(segment)  # read before the .log: see the module docstring
    data = segment.read()
    if data is None:
        check.vanished = True  # deleted by retention since the listing
        return check
    if report.live and following is None and _damaged(data, segment.base_offset):
        data = segment.read() or data  # perhaps a racing read of a write: read it once more
    check.size = len(data)
    running_max, after_damage = NO_TIMESTAMP, False
    for item in walk_batches(data, segment.base_offset, check=decoded_header):
        if isinstance(item, Damage):
            _record_damage(report, check, data, item, following)
            after_damage = True
            continue
        header = item.header
        if header.base_offset > check.next_offset and not after_damage:
            gap = format_range((check.next_offset, header.base_offset - 1))
            report.notes.append(Note(segment.partition, segment.path,
                                     f"{gap} absent (gap) before byte {item.position}"))
        after_damage = False
        running_max = max(running_max, header.max_timestamp)
        index.see(item, running_max)
        _keep(check, item)
    check.index_problems = index.finish()
    return check


def _damaged(data: bytes, segment_base: int) -> bool:
    """Whether the segment's bytes hold damage that cannot be a write in progress."""
    return any(isinstance(item, Damage) and not item.in_progress
               for item in walk_batches(data, segment_base, check=decoded_header))


def _keep(check: SegmentCheck, item: Batch) -> None:
    header = item.header
    end = item.position + header.batch_length
    if check.keep and check.keep[-1][1] == item.position:
        check.keep[-1] = (check.keep[-1][0], end)
    else:
        check.keep.append((item.position, end))
    check.batches += 1
    check.records += header.record_count
    check.next_offset = header.last_offset + 1


def _record_damage(report: VerifyReport, check: SegmentCheck, data: bytes, damage: Damage,
                   following: int | None) -> None:
    segment = check.segment
    is_last = following is None
    if report.live and is_last and damage.in_progress:
        report.notes.append(Note(segment.partition, segment.path,
                                 f"{len(data) - damage.position} bytes at byte "
                                 f"{damage.position} are a write in progress"))
        return
    end = len(data) if damage.resume is None else damage.resume
    lost: tuple[int, int | None] | None
    if end < len(data):
        next_base = peek_batch_header(data, end).base_offset
        lost = (damage.expected_offset, next_base - 1)
    elif following is not None:
        lost = (damage.expected_offset, following - 1)
    else:
        lost = (damage.expected_offset, None)
    if lost[1] is not None and lost[1] < lost[0]:
        lost = None
    kind = "corrupt" if end < len(data) else "tail"
    reason = damage.reason if kind == "corrupt" or not damage.incomplete else (
        f"torn tail: {damage.reason}")
    check.data_problems.append(Problem(
        segment.partition, segment.path, kind, _damage_detail(damage, kind, end),
        damage.position, end - damage.position, lost, reason))


def _damage_detail(damage: Damage, kind: str, end: int) -> str:
    what = f"torn tail ({damage.reason})" if kind == "tail" and damage.incomplete else (
        damage.reason)
    if damage.claimed is not None:
        what += f", in a batch whose unverified header claims {format_range(damage.claimed)}"
    if kind == "corrupt":
        return f"{what}; the next valid batch starts at byte {end}"
    return what if damage.incomplete else f"{what}; no valid batch follows"


class _IndexCheck:
    """Checks a segment's two index files against its batches, seen in file order."""

    def __init__(self, segment: SegmentFile) -> None:
        self.segment = segment
        self.problems: list[Problem] = []
        self.entries: list[tuple[int, int, int]] = []  # (relative offset, position, timestamp)
        self.next = 0
        self.bad: list[str] = []
        offsets = self._read(segment.index_path, OffsetIndex.ENTRY)
        times = self._read(segment.timeindex_path, TimeIndex.ENTRY)
        if offsets is not None and times is not None:
            self._load(offsets, times)

    def _problem(self, path: Path, detail: str) -> None:
        self.problems.append(Problem(self.segment.partition, path, "index", detail))

    def _read(self, path: Path, entry: struct.Struct) -> list[tuple[int, ...]] | None:
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._problem(path, "missing")
            return None
        if len(data) % entry.size:
            self._problem(path, f"size {len(data)} is not a multiple of {entry.size} bytes")
            return None
        return list(entry.iter_unpack(data))

    def _load(self, offsets: list[tuple[int, ...]], times: list[tuple[int, ...]]) -> None:
        index_path = self.segment.index_path
        if [entry[0] for entry in offsets] != [entry[1] for entry in times]:
            self._problem(self.segment.timeindex_path, "not in lockstep with the .index file")
        elif any(a[0] >= b[0] or a[1] >= b[1] for a, b in pairwise(offsets)):
            self._problem(index_path, "entries do not strictly increase")
        elif any(a[0] > b[0] for a, b in pairwise(times)):
            self._problem(self.segment.timeindex_path, "timestamps decrease")
        else:
            self.entries = [(o[0], o[1], t[0]) for o, t in zip(offsets, times, strict=True)]

    def see(self, batch: Batch, running_max: int) -> None:
        entries, header = self.entries, batch.header
        while self.next < len(entries) and entries[self.next][1] < batch.position:
            self._entry_off_batch(self.next)
            self.next += 1
        if self.next < len(entries) and entries[self.next][1] == batch.position:
            self._match(entries[self.next], header, running_max)
            self.next += 1

    def _entry_off_batch(self, i: int) -> None:
        self.bad.append(f"entry {i} names byte {self.entries[i][1]}, where no valid batch "
                        "starts")

    def _match(self, entry: tuple[int, int, int], header: BatchHeader, running_max: int) -> None:
        relative, position, timestamp = entry
        actual = header.base_offset - self.segment.base_offset
        if relative != actual:
            self.bad.append(f"entry for byte {position} says relative offset {relative}, "
                            f"the batch has {actual}")
        elif timestamp != running_max:
            self.bad.append(f"time entry for byte {position} says {timestamp}, the batches up "
                            f"to it have maximum {running_max}")

    def finish(self) -> list[Problem]:
        while self.next < len(self.entries):
            self._entry_off_batch(self.next)
            self.next += 1
        if self.bad:
            more = f" (and {len(self.bad) - 1} more)" if len(self.bad) > 1 else ""
            entries = "entry" if len(self.bad) == 1 else "entries"
            self._problem(self.segment.index_path,
                          f"{len(self.bad)} wrong {entries}: {self.bad[0]}{more}")
        return self.problems
