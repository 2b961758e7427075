"""A checker for a compare-and-set register history (Jepsen's shape), and the workload that
makes one against the metadata store.

The register is one key. Each write reads the register (value ``{"id", "prev"}`` and its
version) and compare-and-sets it to a new value whose ``prev`` is the id it read, naming the
version it read. A history is the list of ``Op`` the clients recorded, with their outcome:

* ``ok``: acknowledged (the compare-and-set applied), with the key's new version;
* ``lost``: the compare-and-set lost (another write came first), nothing applied;
* ``unknown``: ``Timeout`` or ``NoQuorum``: it may or may not have applied;
* ``failed``: ``NotLeader``: it did not apply.

``check(history, final)`` (``final``: the register as read after the faults healed) reports:

* **forks**: two acknowledged writes from the same version (a stale leader took one);
* **lost**: an acknowledged write not on the chain from the final value back to the start;
* **phantoms**: a write that answered ``lost`` or ``failed`` but is on the chain;
* **broken links**: an acknowledged write on the chain whose version is not one above the
  version its predecessor got (a write applied against another state than it read);
* **stale reads**: a read that returned a version below one acknowledged before it began.

Times are ``time.monotonic()`` (one clock for every process of the machine).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from meshmq.cluster.metadata import MetadataStore, NotLeader, View

REGISTER = "register"


@dataclass
class Op:
    client: str
    kind: str  # "cas" or "read"
    outcome: str  # ok, lost, unknown, failed
    start: float
    end: float
    version: int = 0  # cas ok: the new version; lost: the current one; read: the one read
    expected: int = 0  # cas: the version it named
    value: str = ""  # cas: the id written; read: the id read
    prev: str = ""  # cas: the id it read

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Report:
    acknowledged: int = 0
    unknown: int = 0
    chain: int = 0
    forks: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    phantoms: list[str] = field(default_factory=list)
    broken_links: list[str] = field(default_factory=list)
    stale_reads: list[str] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not (self.forks or self.lost or self.phantoms or self.broken_links
                    or self.stale_reads)

    def describe(self) -> str:
        lines = [f"acknowledged writes {self.acknowledged}, unknown {self.unknown}, "
                 f"chain length {self.chain}"]
        for name in ("forks", "lost", "phantoms", "broken_links", "stale_reads"):
            items = getattr(self, name)
            lines.append(f"{name}: {len(items)}" + (f" e.g. {items[:3]}" if items else ""))
        return "\n".join(lines)


def check(history: list[Op], final_value: dict[str, Any] | None) -> Report:
    report = Report()
    writes = [op for op in history if op.kind == "cas"]
    acked = [op for op in writes if op.outcome == "ok"]
    report.acknowledged = len(acked)
    report.unknown = sum(op.outcome == "unknown" for op in writes)
    by_base: dict[int, list[Op]] = {}
    for op in acked:
        by_base.setdefault(op.expected, []).append(op)
    report.forks = [f"from version {base}: {[op.value for op in ops]}"
                    for base, ops in sorted(by_base.items()) if len(ops) > 1]
    by_id = {op.value: op for op in writes}
    chain = _chain(final_value, by_id)
    report.chain = len(chain)
    on_chain = set(chain)
    report.lost = [op.value for op in acked if op.value not in on_chain]
    report.phantoms = [value for value in chain
                       if value in by_id and by_id[value].outcome in ("lost", "failed")]
    for child, parent in itertools.pairwise(chain):
        write, before = by_id.get(child), by_id.get(parent)
        if write is None or before is None or write.outcome != "ok" or before.outcome != "ok":
            continue
        if write.expected != before.version:
            report.broken_links.append(f"{child} named version {write.expected}, "
                                       f"{parent} got {before.version}")
    report.stale_reads = _stale_reads(history, acked)
    return report


def _chain(final_value: dict[str, Any] | None, by_id: dict[str, Op]) -> list[str]:
    """The ids from the final value back to the first write (newest first)."""
    chain: list[str] = []
    value_id = final_value.get("id") if final_value else None
    seen = set()
    while value_id and value_id not in seen:
        seen.add(value_id)
        chain.append(value_id)
        op = by_id.get(value_id)
        value_id = op.prev if op is not None else None
    return chain


def _stale_reads(history: list[Op], acked: list[Op]) -> list[str]:
    """Reads that began after a write was acknowledged and returned an older version."""
    ends = sorted((op.end, op.version) for op in acked)
    times = [end for end, _ in ends]
    newest_by = list(itertools.accumulate((version for _, version in ends), max))
    stale = []
    for read in (op for op in history if op.kind == "read" and op.outcome == "ok"):
        before = bisect.bisect_left(times, read.start)  # acknowledged strictly before
        newest = newest_by[before - 1] if before else 0
        if read.version < newest:
            stale.append(f"{read.client} read version {read.version} at {read.start:.3f}, "
                         f"version {newest} was acknowledged before")
    return stale


# -- the workload --------------------------------------------------------------------------------


def _outcome(error: BaseException) -> str:
    return "failed" if isinstance(error, NotLeader) else "unknown"


async def client_loop(store: MetadataStore, client: str, history: list[Op],
                      stop: Callable[[], bool], pause: float = 0.0) -> None:
    """Read, then compare-and-set the register, until ``stop()``; every operation is
    appended to ``history``. Errors are outcomes, not failures (the loop goes on)."""
    count = 0
    while not stop():
        start = time.monotonic()
        try:
            view: View = await store.read()
        except Exception as error:  # NoQuorum, Timeout, NotLeader, a lost service
            history.append(Op(client, "read", _outcome(error), start, time.monotonic()))
            await asyncio.sleep(0.05)  # the store is down: do not spin
            continue
        entry = view.get(REGISTER)
        prev = str(entry.value.get("id", "")) if entry and isinstance(entry.value, dict) else ""
        history.append(Op(client, "read", "ok", start, time.monotonic(), view.version_of(
            REGISTER), value=prev))
        await asyncio.sleep(0)  # let the other clients run between the read and the write
        count += 1
        value = f"{client}-{count}"
        expected = view.version_of(REGISTER)
        start = time.monotonic()
        try:
            result = await store.cas(REGISTER, expected, {"id": value, "prev": prev})
        except Exception as error:
            history.append(Op(client, "cas", _outcome(error), start, time.monotonic(),
                              expected=expected, value=value, prev=prev))
            continue
        history.append(Op(client, "cas", "ok" if result.ok else "lost", start,
                          time.monotonic(), result.version, expected, value, prev))
        if pause:
            await asyncio.sleep(pause)


async def final_register(store: MetadataStore) -> tuple[int, dict[str, Any] | None]:
    view = await store.read()
    value = view.value(REGISTER)
    return view.version_of(REGISTER), value if isinstance(value, dict) else None
