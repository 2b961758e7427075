"""The cluster's metadata store: meshmq's own interface, whatever agrees on the values.

Theory of operation
-------------------
The metadata is a small map of keys to JSON values that every node sees the same way: the
members, the controller, each partition's assignment (leader node and worker, leader epoch,
replicas, ISR) and named epochs (cluster/metarecords.py lays the keys out). Something agrees
on it (cluster/raftstore.py: Raft, by pysyncobj, in its own process per node,
cluster/metaproc.py); the rest of meshmq sees only ``MetadataStore`` below, so another backend
(etcd) could be added without touching it. cluster/memstore.py is the in-memory reference
model the real backend is checked against.

Versions. The store has one version, which grows by one with every change that applies. Each
key carries the store version at which it was last set (0: the key is absent). A
compare-and-set names the key's version the caller read: it applies only if that is still
the key's version (and, optionally, if other keys, ``guards``, still have the versions the
caller read: a controller fences its writes with the controller record's version). It
answers with the new version, or, when it lost, the key's current one: the caller re-reads
and decides again. Absence compares as version 0, so "create if absent" is ``expected=0``.

Reads are linearizable: ``read()`` returns the state as of a moment between its call and its
return, never older than a change that was acknowledged before the call. Watches deliver the
changes this node has applied, in version order, starting with the whole state
(``Change.reset``); they may lag the leader a little, never go back.

Outcomes. A write either applied (``CasResult.ok``), lost its comparison (``ok`` false), or
failed with one of the errors below. ``NotLeader`` means it did not apply. ``NoQuorum`` and
``Timeout`` mean *unknown*: the write may still apply later (it may be in the log of a leader
that was cut off and comes back in the majority). A caller re-reads before deciding again; a
compare-and-set cannot apply twice, so retrying it with the version read is always safe.

Errors::

    MetadataError
     ├── NotLeader    this node cannot take the request now; ``hint`` names who may
     ├── NoQuorum     no majority of voters reachable within the bounded wait
     └── Timeout      no answer within the deadline (also a TimeoutError)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, TypeAlias

Json: TypeAlias = "bool | int | float | str | list[Json] | dict[str, Json] | None"

MEMBERS = "members/"  # members/<node id> -> {"raft": address, "cluster": address}


class MetadataError(Exception):
    """Root of the metadata store's errors."""


class NotLeader(MetadataError):
    """This node cannot take the request now (it is not the leader and knows none it could
    pass it to); the request did not apply. ``hint``: the leader's address, if known."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message if hint is None else f"{message} (leader: {hint})")
        self.hint = hint


class NoQuorum(MetadataError):
    """No majority of voters could be reached within the bounded wait: nothing can be agreed
    until one is back. A write that raised this may still apply later."""


class Timeout(MetadataError, TimeoutError):
    """No answer within the deadline. A write that raised this may still apply later."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A key's value and the store version at which it was last set."""

    value: Json
    version: int


@dataclass(frozen=True, slots=True)
class View:
    """The whole state at one store version. ``entries`` is read-only."""

    version: int
    entries: Mapping[str, Entry] = field(default_factory=lambda: MappingProxyType({}))

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def value(self, key: str, default: Json = None) -> Json:
        entry = self.entries.get(key)
        return default if entry is None else entry.value

    def version_of(self, key: str) -> int:
        """The key's version (0: absent): what a compare-and-set of it names."""
        entry = self.entries.get(key)
        return 0 if entry is None else entry.version

    def under(self, prefix: str) -> dict[str, Entry]:
        """The entries whose keys start with ``prefix``."""
        return {key: entry for key, entry in self.entries.items() if key.startswith(prefix)}


@dataclass(frozen=True, slots=True)
class CasResult:
    """What a compare-and-set did. ``ok``: it applied, and ``version`` is the key's new
    version. Not ``ok``: it lost, ``version`` is the key's current version and ``conflict``
    names the key whose version differed (the key itself or one of the guards)."""

    ok: bool
    version: int
    conflict: str | None = None


@dataclass(frozen=True, slots=True)
class Change:
    """Keys that changed at store version ``version`` (an entry of None: deleted). A
    ``reset`` carries the whole state (a watch's first change, or a snapshot installed):
    keys absent from it are absent."""

    version: int
    changed: Mapping[str, Entry | None]
    reset: bool = False


@dataclass(frozen=True, slots=True)
class Member:
    """A node of the cluster and how to reach it."""

    node_id: str
    raft: str  # host:port of its metadata (Raft) service
    cluster: str  # host:port of its cluster port (links between nodes)
    workers: int = 1  # its worker processes (a partition it leads is on one of them)

    def to_json(self) -> dict[str, Json]:
        return {"raft": self.raft, "cluster": self.cluster, "workers": self.workers}

    @classmethod
    def from_json(cls, node_id: str, value: Json) -> Member:
        if not isinstance(value, dict):
            raise ValueError(f"member {node_id!r}: expected an object, got {value!r}")
        raft, cluster = value.get("raft"), value.get("cluster")
        workers = value.get("workers", 1)
        if not isinstance(raft, str) or not isinstance(cluster, str):
            raise ValueError(f"member {node_id!r}: raft and cluster must be strings")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
            raise ValueError(f"member {node_id!r}: workers must be a positive integer")
        return cls(node_id, raft, cluster, workers)


def members_of(view: View) -> dict[str, Member]:
    """The members recorded in ``view``, by node id."""
    return {key[len(MEMBERS):]: Member.from_json(key[len(MEMBERS):], entry.value)
            for key, entry in view.under(MEMBERS).items()}


class Watch(Protocol):
    def cancel(self) -> None:
        """No more callbacks after this returns."""


WatchCallback: TypeAlias = Callable[[Change], None]


class MetadataStore(Protocol):
    """What meshmq needs from the metadata, whatever agrees on it. Every coroutine runs on
    the caller's event loop and never blocks it; see the module docstring for outcomes."""

    async def read(self) -> View:
        """The whole state, linearizable."""
        ...

    async def cas(self, key: str, expected: int, value: Json,
                  guards: Mapping[str, int] | None = None) -> CasResult:
        """Set ``key`` to ``value`` if its version is ``expected`` (0: absent) and every
        key of ``guards`` has the version given there."""
        ...

    async def delete(self, key: str, expected: int,
                     guards: Mapping[str, int] | None = None) -> CasResult:
        """Remove ``key`` under the same conditions as ``cas``; its version becomes 0."""
        ...

    def watch(self, callback: WatchCallback) -> Watch:
        """Call ``callback`` on the caller's loop with each change this node applies, first
        a reset with the whole state. The callback must not block."""
        ...

    async def add_member(self, member: Member) -> int:
        """Record ``member`` (or update its addresses); the store version after it."""
        ...

    async def remove_member(self, node_id: str) -> int:
        """Forget member ``node_id``; the store version after it."""
        ...

    async def members(self) -> dict[str, Member]:
        """The members, by node id (linearizable, as ``read``)."""
        ...


async def put_member(store: MetadataStore, member: Member, attempts: int = 16) -> int:
    """``add_member`` on top of compare-and-set, for backends that have no membership API of
    their own: re-read and retry while other writers win."""
    key = MEMBERS + member.node_id
    for _ in range(attempts):
        view = await store.read()
        if view.value(key) == member.to_json():
            return view.version
        result = await store.cas(key, view.version_of(key), member.to_json())
        if result.ok:
            return result.version
    raise MetadataError(f"member {member.node_id!r}: lost {attempts} compare-and-sets in a row")


async def drop_member(store: MetadataStore, node_id: str, attempts: int = 16) -> int:
    """``remove_member`` on top of compare-and-set (see ``put_member``)."""
    key = MEMBERS + node_id
    for _ in range(attempts):
        view = await store.read()
        if view.get(key) is None:
            return view.version
        result = await store.delete(key, view.version_of(key))
        if result.ok:
            return result.version
    raise MetadataError(f"member {node_id!r}: lost {attempts} compare-and-sets in a row")
