"""The checker: after heal and drain, what became of every value the workload sent.

Inputs: every publish and its outcome (``workload.Sent``), every delivery of every subscriber,
and every record of the commit log(s), read with the project's reader (``meshmq.log.view``).
Barrier messages of the drain are left out. A value is ``publisher:seq``.

Verdicts, per value acknowledged (PUBACK success):

* **lost**: not in any log, and never delivered to a subscriber that should have got it (one
  whose filter matches; every subscriber subscribed before the publishers started). With no
  such subscriber, not in the log is enough. This is the one the broker must never have.
* **unlogged**: not in the log, yet delivered to every subscriber that should have got it: the
  log lost it (a replay or a later subscriber will miss it) while the live path did not.
* **undelivered** (per subscriber): in the log, never delivered to a subscriber that should
  have got it: a delivery failure, recoverable by a replay from the log.

Also counted: **duplicates** (a value stored or delivered more than once: QoS 1 allows them);
**order**: within one log partition (the log's partitioner, ``log/partitioner.py``) one
publisher's values must appear in increasing ``seq`` order, in the log and at each subscriber
(first copies only; a later copy of an earlier value is a duplicate, not disorder);
**refused but stored** (a PUBACK failure code, yet the value is in the log: the client was
told "not accepted" about something it will see delivered), or refused, not stored, yet
delivered; **unknown and stored**; **phantoms** (stored or delivered, never sent); **sessions lost**
(a subscriber reconnected and the broker had forgotten its session); **drain incomplete** (a
subscriber never got the drain's barriers: the broker stopped delivering to it).

``Report.render()`` is the human-readable form; ``Report.ok`` means nothing lost.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from workload import BARRIER, Delivery, Outcome, Sent, Subscriber, Workload, parse_payload

from meshmq.log.partitioner import Partitioner
from meshmq.log.view import LogView
from meshmq.mqtt.topics import topic_matches

Value = tuple[str, int]  # (publisher, seq)
EXAMPLES = 10  # values listed per finding in the rendered report


@dataclass(frozen=True)
class Logged:
    """One workload record found in a log."""

    partition: int
    offset: int
    publisher: str
    seq: int
    topic: str


@dataclass(frozen=True)
class Received:
    """What the checker needs of one subscriber."""

    name: str
    topic_filter: str
    deliveries: Sequence[Delivery]
    sessions_lost: int = 0

    @classmethod
    def of(cls, subscriber: Subscriber) -> Received:
        return cls(subscriber.name, subscriber.topic_filter, subscriber.snapshot(),
                   subscriber.sessions_lost())


@dataclass(frozen=True)
class Disorder:
    """``seq`` came (first) after ``after``, from ``publisher`` in ``partition``, at ``where``
    (``log`` or a subscriber)."""

    where: str
    publisher: str
    partition: int
    seq: int
    after: int


def read_log(data_dir: Path) -> list[Logged]:
    """Every workload record of the log under ``data_dir``, partition by partition, in offset
    order (the node may be running: only whole, checksummed batches are read)."""
    found: list[Logged] = []
    with LogView(data_dir) as view:
        for partition in range(view.partition_count):
            offset = view.earliest_offset(partition)
            while records := view.read(partition, offset):
                for record in records:
                    parsed = parse_payload(record.payload)
                    if parsed is not None:
                        found.append(Logged(partition, record.offset, *parsed, record.topic))
                offset = records[-1].offset + 1
    return found


def log_partitions(data_dir: Path) -> int:
    with LogView(data_dir) as view:
        return view.partition_count


@dataclass
class Report:
    """The checker's findings; see the module docstring for each."""

    sent: int = 0
    outcomes: Counter[Outcome] = field(default_factory=Counter)
    publishers: int = 0
    logged: int = 0  # distinct values in the log
    lost: list[Sent] = field(default_factory=list)
    lost_by_partition: dict[int, list[Sent]] = field(default_factory=dict)
    unlogged: list[Sent] = field(default_factory=list)
    undelivered: dict[str, list[Sent]] = field(default_factory=dict)
    log_duplicates: int = 0
    duplicates: dict[str, int] = field(default_factory=dict)
    disorder: list[Disorder] = field(default_factory=list)
    refused_but_stored: list[Sent] = field(default_factory=list)  # in the log
    refused_but_delivered: list[Sent] = field(default_factory=list)  # not in the log
    unknown_stored: int = 0
    phantoms: list[Value] = field(default_factory=list)
    sessions_lost: dict[str, int] = field(default_factory=dict)
    undrained: dict[str, list[int]] = field(default_factory=dict)  # barriers never received
    partitions: int = 0

    @property
    def ok(self) -> bool:
        return not self.lost

    def lost_values(self) -> set[Value]:
        return {(sent.publisher, sent.seq) for sent in self.lost}

    def render(self) -> str:
        return "\n".join(_render(self))


def check(sent: Iterable[Sent], received: Sequence[Received], logged: Sequence[Logged],
          partitioner: Partitioner) -> Report:
    """Judge one run; see the module docstring."""
    values = {(s.publisher, s.seq): s for s in sent if not s.publisher.startswith(BARRIER)}
    logged = [r for r in logged if not r.publisher.startswith(BARRIER)]
    in_log = Counter((r.publisher, r.seq) for r in logged)
    got = {sub.name: Counter((d.publisher, d.seq) for d in sub.deliveries
                             if not d.publisher.startswith(BARRIER)) for sub in received}
    report = Report(sent=len(values), partitions=partitioner.partitions,
                    outcomes=Counter(s.outcome for s in values.values()),
                    publishers=len({s.publisher for s in values.values()}),
                    logged=len(in_log), log_duplicates=sum(in_log.values()) - len(in_log),
                    sessions_lost={sub.name: sub.sessions_lost for sub in received})
    for value, s in sorted(values.items()):
        expected = [sub.name for sub in received if topic_matches(sub.topic_filter, s.topic)]
        missed = [name for name in expected if value not in got[name]]
        if s.outcome is Outcome.ACKED and value not in in_log:
            (report.lost if missed or not expected else report.unlogged).append(s)
        elif s.outcome is Outcome.ACKED:
            for name in missed:
                report.undelivered.setdefault(name, []).append(s)
        if s.outcome is Outcome.REFUSED and value in in_log:
            report.refused_but_stored.append(s)
        elif s.outcome is Outcome.REFUSED and any(value in c for c in got.values()):
            report.refused_but_delivered.append(s)
        report.unknown_stored += s.outcome is Outcome.UNKNOWN and value in in_log
    for s in report.lost:
        report.lost_by_partition.setdefault(partitioner.partition_for(s.topic), []).append(s)
    report.duplicates = {name: sum(c.values()) - len(c) for name, c in got.items()}
    seen = set(in_log) | {value for counts in got.values() for value in counts}
    report.phantoms = sorted(seen - set(values))
    report.disorder = disorder("log", [(r.partition, r.publisher, r.seq) for r in logged])
    for sub in received:
        report.disorder += disorder(sub.name, [
            (partitioner.partition_for(d.topic), d.publisher, d.seq) for d in sub.deliveries
            if not d.publisher.startswith(BARRIER)])
    return report


def disorder(where: str, stream: Iterable[tuple[int, str, int]]) -> list[Disorder]:
    """Values of one publisher in one partition whose first copy comes after a higher seq."""
    highest: dict[tuple[int, str], int] = {}
    firsts: set[tuple[str, int]] = set()
    found = []
    for partition, publisher, seq in stream:
        if (publisher, seq) in firsts:
            continue  # a later copy: a duplicate, counted elsewhere
        firsts.add((publisher, seq))
        top = highest.get((partition, publisher), 0)
        if seq < top:
            found.append(Disorder(where, publisher, partition, seq, top))
        highest[(partition, publisher)] = max(top, seq)
    return found


def check_workload(workload: Workload, data_dirs: Sequence[Path],
                   key_level: int | None = None) -> Report:
    """``check`` a finished workload against the logs under ``data_dirs`` (one per node)."""
    logged = [record for data_dir in data_dirs for record in read_log(data_dir)]
    partitioner = Partitioner(log_partitions(data_dirs[0]), key_level)
    sent = [s for publisher in workload.publishers for s in publisher.sent.values()]
    report = check(sent, [Received.of(s) for s in workload.subscribers], logged, partitioner)
    report.undrained = dict(workload.undrained)
    return report


# -- rendering ---------------------------------------------------------------------------------


def _values(sents: Sequence[Sent]) -> str:
    shown = ", ".join(f"{s.publisher}:{s.seq}" for s in sents[:EXAMPLES])
    return shown + (f" ... ({len(sents) - EXAMPLES} more)" if len(sents) > EXAMPLES else "")


def _render(r: Report) -> list[str]:
    o = r.outcomes
    lines = [
        f"publishes: {r.sent} by {r.publishers} publishers: {o[Outcome.ACKED]} acknowledged, "
        f"{o[Outcome.REFUSED]} refused, {o[Outcome.UNKNOWN]} unknown",
        f"log: {r.logged} values in {r.partitions} partitions "
        f"({r.log_duplicates} extra copies)",
        f"LOST: {len(r.lost)} acknowledged, not in the log, never delivered where expected",
    ]
    lines += [f"  partition {partition}: {_values(sents)}"
              for partition, sents in sorted(r.lost_by_partition.items())]
    lines.append(f"unlogged: {len(r.unlogged)} acknowledged and delivered, but not in the log"
                 + (f": {_values(r.unlogged)}" if r.unlogged else ""))
    for name, dups in sorted(r.duplicates.items()):
        missed = r.undelivered.get(name, [])
        lines.append(f"subscriber {name}: {len(missed)} acknowledged and logged but never "
                     f"delivered{': ' + _values(missed) if missed else ''}; {dups} duplicate "
                     f"deliveries (QoS 1 allows them); {r.sessions_lost.get(name, 0)} "
                     "sessions lost")
    for name, partitions in sorted(r.undrained.items()):
        lines.append(f"DRAIN INCOMPLETE: {name} never got the barrier of partitions "
                     f"{partitions}: the broker stopped delivering to it")
    lines.append(f"order: {len(r.disorder)} values out of order within a partition")
    lines += [f"  {d.where}: {d.publisher}:{d.seq} after :{d.after} in partition {d.partition}"
              for d in r.disorder[:EXAMPLES]]
    lines.append(f"refused (PUBACK >= 0x80) yet in the log: {len(r.refused_but_stored)}"
                 + (f": {_values(r.refused_but_stored)}" if r.refused_but_stored else ""))
    if r.refused_but_delivered:
        lines.append(f"refused, not in the log, yet delivered: {_values(r.refused_but_delivered)}")
    lines.append(f"unknown outcome, found in the log: {r.unknown_stored}")
    if r.phantoms:
        lines.append(f"phantoms (never sent): {r.phantoms[:EXAMPLES]}")
    lines.append("verdict: " + ("ok, nothing lost" if r.ok else f"FAIL, {len(r.lost)} lost"))
    return lines
