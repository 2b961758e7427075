"""The records the metadata holds, and typed writes of them on top of compare-and-set.

Keys (values are JSON)::

    members/<node id>     {"raft": "host:port", "cluster": "host:port"}      (metadata.py)
    cluster_id            "c0ffee..."  (set once, by the first controller, never changed)
    controller            {"node": "n1", "epoch": 7}
    partitions/<n>        {"leader": "n2", "worker": 1, "leader_epoch": 4,
                           "replicas": ["n2", "n3", "n1"], "isr": ["n2", "n3"],
                           "written": true}
    epochs/<name>         12

Every write here is fenced twice: by the version of the record in the ``View`` the caller
read (a compare-and-set), and, for partition assignments, by the controller record's version
in that view (a guard), so a controller that was replaced cannot write one even if the
partition record did not move. Epochs only grow: each write that hands something on (a new
controller, a new partition leader) bumps its epoch, and peers reject requests that carry an
older one (cluster.md: "fence every decision with an epoch").

Each write returns a ``Written``: the compare-and-set's result and the record written. When
``result.ok`` is false nothing was written: read again and decide again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from meshmq.cluster.metadata import CasResult, Json, MetadataError, MetadataStore, View

CONTROLLER = "controller"
CLUSTER_ID = "cluster_id"
PARTITIONS = "partitions/"
EPOCHS = "epochs/"

T = TypeVar("T")


class RecordError(MetadataError):
    """A typed write that would break a rule of the records (the message names it); nothing
    was written."""


class NotController(RecordError):
    """The view names another controller (or another epoch of it) than the one writing."""


@dataclass(frozen=True, slots=True)
class Written(Generic[T]):
    result: CasResult
    record: T


@dataclass(frozen=True, slots=True)
class Controller:
    node: str
    epoch: int

    def to_json(self) -> dict[str, Json]:
        return {"node": self.node, "epoch": self.epoch}


@dataclass(frozen=True, slots=True)
class Assignment:
    """A partition's leader (node and worker), leader epoch, replicas and in-sync replicas."""

    leader: str
    worker: int
    leader_epoch: int
    replicas: tuple[str, ...]
    isr: tuple[str, ...]
    # a record may be in the partition's log: its leader marks it before its first append,
    # and only a partition never written may move to another node (one copy per partition).
    # A record without the field (written before it existed) counts as written.
    written: bool = True

    def to_json(self) -> dict[str, Json]:
        return {"leader": self.leader, "worker": self.worker, "leader_epoch": self.leader_epoch,
                "replicas": list(self.replicas), "isr": list(self.isr),
                "written": self.written}


def partition_key(partition: int) -> str:
    return f"{PARTITIONS}{partition}"


def epoch_key(name: str) -> str:
    return f"{EPOCHS}{name}"


# -- reading ------------------------------------------------------------------------------------


def epoch_of(view: View, name: str) -> int:
    """The epoch named ``name`` (0 before its first bump)."""
    value = view.value(epoch_key(name), 0)
    if not isinstance(value, int):
        raise RecordError(f"{epoch_key(name)}: expected an integer, got {value!r}")
    return value


def controller_of(view: View) -> Controller | None:
    value = view.value(CONTROLLER)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RecordError(f"{CONTROLLER}: expected {{node, epoch}}, got {value!r}")
    return Controller(_text(value, "node", CONTROLLER), _integer(value, "epoch", CONTROLLER))


def cluster_id_of(view: View) -> str | None:
    value = view.value(CLUSTER_ID)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RecordError(f"{CLUSTER_ID}: expected the cluster's id, got {value!r}")
    return value


async def settle_cluster_id(store: MetadataStore, view: View, proposed: str) -> str:
    """The cluster's id: the one the metadata holds, else ``proposed`` (the controller's
    node's id, or a new one), written once (of two writers one wins; the loser reads the
    winner's on its next look)."""
    held = cluster_id_of(view)
    if held is not None:
        return held
    written = await store.cas(CLUSTER_ID, 0, proposed)
    return proposed if written.ok else ""


def assignment_of(view: View, partition: int) -> Assignment | None:
    key = partition_key(partition)
    value = view.value(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise RecordError(f"{key}: expected an assignment, got {value!r}")
    written = value.get("written", True)
    if not isinstance(written, bool):
        raise RecordError(f"{key}: written must be true or false, got {written!r}")
    return Assignment(_text(value, "leader", key), _integer(value, "worker", key),
                      _integer(value, "leader_epoch", key), _texts(value, "replicas", key),
                      _texts(value, "isr", key), written)


def _text(record: dict[str, Json], name: str, key: str) -> str:
    value = record.get(name)
    if not isinstance(value, str):
        raise RecordError(f"{key}: {name} must be a string, got {value!r}")
    return value


def _integer(record: dict[str, Json], name: str, key: str) -> int:
    value = record.get(name)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RecordError(f"{key}: {name} must be an integer, got {value!r}")
    return value


def _texts(record: dict[str, Json], name: str, key: str) -> tuple[str, ...]:
    value = record.get(name)
    if not (isinstance(value, list) and all(isinstance(item, str) for item in value)):
        raise RecordError(f"{key}: {name} must be a list of strings, got {value!r}")
    return tuple(str(item) for item in value)


# -- writing ------------------------------------------------------------------------------------


async def bump_epoch(store: MetadataStore, view: View, name: str) -> Written[int]:
    """Epoch ``name`` + 1, if it is still what ``view`` read."""
    key, epoch = epoch_key(name), epoch_of(view, name) + 1
    return Written(await store.cas(key, view.version_of(key), epoch), epoch)


async def claim_controller(store: MetadataStore, view: View, node: str) -> Written[Controller]:
    """Make ``node`` the controller with the next controller epoch, if the controller record
    is still what ``view`` read (so of two claimants at most one wins each epoch)."""
    current = controller_of(view)
    claimed = Controller(node, (current.epoch if current else 0) + 1)
    return Written(await store.cas(CONTROLLER, view.version_of(CONTROLLER), claimed.to_json()),
                   claimed)


async def assign_partition(store: MetadataStore, view: View, controller: Controller,
                           partition: int, replicas: Sequence[str], worker: int
                           ) -> Written[Assignment]:
    """Place ``partition`` on ``replicas`` (the first leads, on ``worker``), all in sync, with
    the next leader epoch."""
    if not replicas or len(set(replicas)) != len(replicas):
        raise RecordError(f"partition {partition}: replicas must be distinct and not empty, "
                          f"got {list(replicas)}")
    old = assignment_of(view, partition)
    if old is not None and old.written:
        raise RecordError(f"partition {partition} holds records on {old.leader!r}: it cannot "
                          "move to another node (one copy per partition)")
    new = Assignment(replicas[0], worker, (old.leader_epoch if old else 0) + 1,
                     tuple(replicas), tuple(replicas), written=False)
    return await _write_assignment(store, view, controller, partition, new)


async def mark_written(store: MetadataStore, view: View, partition: int, leader: str,
                       leader_epoch: int) -> Written[Assignment] | None:
    """The leader ``leader`` at ``leader_epoch`` is about to append the partition's first
    record: mark the assignment written, so that the controller no longer moves it. Fenced by
    the record's version (a move wins over it or fails). None: the view has the partition
    under another leader or epoch (it moved: append nothing)."""
    old = assignment_of(view, partition)
    if old is None or old.leader != leader or old.leader_epoch != leader_epoch:
        return None
    new = Assignment(old.leader, old.worker, old.leader_epoch, old.replicas, old.isr, True)
    key = partition_key(partition)
    return Written(await store.cas(key, view.version_of(key), new.to_json()), new)


async def elect_leader(store: MetadataStore, view: View, controller: Controller,
                       partition: int, leader: str, worker: int, unclean: bool = False
                       ) -> Written[Assignment]:
    """Hand ``partition`` to ``leader`` (on ``worker``) with the next leader epoch. The new
    leader must be in the ISR unless ``unclean`` (it may lack acknowledged records)."""
    old = _existing(view, partition)
    if leader not in old.replicas:
        raise RecordError(f"partition {partition}: {leader!r} is not a replica "
                          f"({list(old.replicas)})")
    if not unclean and leader not in old.isr:
        raise RecordError(f"partition {partition}: {leader!r} is not in sync ({list(old.isr)}): "
                          "an unclean election must be asked for")
    isr = old.isr if leader in old.isr else (leader,)
    new = Assignment(leader, worker, old.leader_epoch + 1, old.replicas, isr, old.written)
    return await _write_assignment(store, view, controller, partition, new)


async def change_isr(store: MetadataStore, view: View, controller: Controller, partition: int,
                     isr: Sequence[str]) -> Written[Assignment]:
    """Set the in-sync replicas of ``partition`` (the leader and epoch stay)."""
    old = _existing(view, partition)
    if old.leader not in isr or not set(isr) <= set(old.replicas):
        raise RecordError(f"partition {partition}: the ISR must hold the leader "
                          f"{old.leader!r} and only replicas ({list(old.replicas)}), got "
                          f"{list(isr)}")
    new = Assignment(old.leader, old.worker, old.leader_epoch, old.replicas, tuple(isr),
                     old.written)
    return await _write_assignment(store, view, controller, partition, new)


def _existing(view: View, partition: int) -> Assignment:
    old = assignment_of(view, partition)
    if old is None:
        raise RecordError(f"partition {partition} is not assigned")
    return old


async def _write_assignment(store: MetadataStore, view: View, controller: Controller,
                            partition: int, new: Assignment) -> Written[Assignment]:
    if controller_of(view) != controller:
        raise NotController(f"the view read names controller {controller_of(view)}, not "
                            f"{controller}")
    key = partition_key(partition)
    result = await store.cas(key, view.version_of(key), new.to_json(),
                             guards={CONTROLLER: view.version_of(CONTROLLER)})
    return Written(result, new)
