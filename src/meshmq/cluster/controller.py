"""The node's agent in the metadata, and the cluster's controller: what each node writes.

Theory of operation
-------------------
Runs in each node's metadata voter process (cluster/metaproc.py), beside the voter, every
``STEP`` seconds:

* **Membership.** The node keeps its member record (``members/<node id>``: its Raft and
  cluster addresses and its worker count) as it is configured, written through the store
  (a follower passes it to the leader).
* **The controller** is the node whose voter leads Raft (cluster.md). While this node's voter
  leads, it makes sure the controller record names it, with an epoch greater than any before
  (``claim_controller``: of two claimants one wins per epoch); every write it then makes is
  fenced by that record's version, so a controller that was replaced cannot write.
* **The cluster's id.** Nodes that all start with seeds have no cluster id (only a node
  without seeds draws one), so the first controller writes one into the metadata (its
  node's, if it knows one, else a new one), once; every worker adopts it from its mirror.
* **Partition assignment.** Once as many nodes as expected have member records (the voters
  as this node's voter knows them), or ``SETTLE`` seconds after this node became
  controller, each partition without an assignment is given to a member, round robin over
  the members by node id, on worker ``partition mod that node's workers``, with leader
  epoch 1.
* **Balance.** A partition whose leader has not marked it written (metarecords.py
  ``mark_written``: done before its first append) holds no record anywhere, so it may move:
  from a node that is no longer a member, or from the node leading the most partitions to
  the one leading the fewest while they differ by more than one, with the next leader epoch
  (one move per step). Nodes that join a running cluster thus take their share of the
  partitions nothing was written to yet. A written partition never moves: with one copy its
  records live on its leader's disk only, so a dead node's partitions stay with it
  (offline, and reported) until it returns; moving them is the replicated log's work.

Everything here goes through ``MetadataStore`` and the typed writes of cluster/metarecords.py,
so it runs against the in-memory model in tests, with a clock and a leadership the test sets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from meshmq.cluster.metadata import Member, MetadataError, MetadataStore, View, members_of
from meshmq.cluster.metarecords import (
    Controller,
    assign_partition,
    assignment_of,
    claim_controller,
    cluster_id_of,
    controller_of,
    settle_cluster_id,
)
from meshmq.cluster.nodelink import new_cluster_id

log = logging.getLogger("meshmq.controller")

STEP = 0.5  # seconds between the agent's looks at the metadata
SETTLE = 10.0  # seconds a new controller waits for the expected nodes before it assigns


@dataclass
class Agent:
    """See the module docstring. ``leads()``: does this node's voter lead Raft now."""

    store: MetadataStore
    member: Member
    workers: int
    partitions: int
    expected: Callable[[], int]  # nodes expected to join: the voters now
    leads: Callable[[], bool]
    clock: Callable[[], float]
    leaving: Callable[[], bool] = lambda: False  # the node is leaving: write nothing more
    own_cluster_id: Callable[[], str] = lambda: ""  # the id this node knows ("": none yet)
    _controller_since: float | None = None

    async def step(self) -> None:
        """One look at the metadata, and the writes it calls for."""
        if self.leaving():
            return
        view = await self.store.read()
        members = members_of(view)
        mine = members.get(self.member.node_id)
        if mine is None or mine.to_json() != self.member.to_json():
            await self.store.add_member(self.member)
            return
        if not self.leads():
            self._controller_since = None
            return
        controller = controller_of(view)
        if controller is None or controller.node != self.member.node_id:
            claimed = await claim_controller(self.store, view, self.member.node_id)
            if claimed.result.ok:
                log.info("controller node=%s epoch=%d", claimed.record.node,
                         claimed.record.epoch)
                self._controller_since = self.clock()
            return
        if self._controller_since is None:
            self._controller_since = self.clock()
        if cluster_id_of(view) is None:  # nodes that all start with seeds have none yet
            settled = await settle_cluster_id(self.store, view,
                                              self.own_cluster_id() or new_cluster_id())
            log.info("cluster id in the metadata cluster_id=%s", settled or "(lost: again)")
            return
        if len(members) < self.expected() and self.clock() - self._controller_since < SETTLE:
            return
        order = sorted(members)
        for partition in range(self.partitions):
            if assignment_of(view, partition) is not None:
                continue
            node = order[partition % len(order)]
            workers = max(1, members[node].workers)
            written = await assign_partition(self.store, view, controller, partition, [node],
                                             partition % workers)
            if not written.result.ok:
                return  # the view moved: look again next step
            log.info("partition assigned partition=%d leader=%s worker=%d epoch=%d",
                     partition, node, written.record.worker, written.record.leader_epoch)
            view = await self.store.read()
        await self._balance(view, controller, members)

    async def _balance(self, view: View, controller: Controller,
                       members: dict[str, Member]) -> None:
        """Move one partition never written (so holding no record anywhere) from a node that
        is not a member any more, or from the node leading the most to the one leading the
        fewest when they differ by more than one; one move per step."""
        counts = dict.fromkeys(members, 0)
        movable: dict[str, list[int]] = {}
        for partition in range(self.partitions):
            assignment = assignment_of(view, partition)
            if assignment is None:
                continue
            if assignment.leader in counts:
                counts[assignment.leader] += 1
            if not assignment.written:
                movable.setdefault(assignment.leader, []).append(partition)
        if not counts:
            return
        fewest = min(sorted(counts), key=counts.__getitem__)
        gone = [node for node in movable if node not in counts]
        if gone:
            source = gone[0]
        else:
            source = max(sorted(counts), key=counts.__getitem__)
            if counts[source] - counts[fewest] <= 1 or source not in movable:
                return
        partition = movable[source][-1]
        workers = max(1, members[fewest].workers)
        written = await assign_partition(self.store, view, controller, partition, [fewest],
                                         partition % workers)
        if written.result.ok:
            log.info("partition moved partition=%d from=%s leader=%s worker=%d epoch=%d "
                     "(never written)", partition, source, fewest, written.record.worker,
                     written.record.leader_epoch)

    async def run(self, stop: asyncio.Event) -> None:
        """``step`` every ``STEP`` seconds until ``stop``; a failed step is logged and tried
        again (no quorum now, a leader change)."""
        while not stop.is_set():
            try:
                await self.step()
            except MetadataError as error:
                log.debug("metadata step deferred: %s", error)
            try:
                await asyncio.wait_for(stop.wait(), STEP)
            except TimeoutError:
                pass
