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
  epoch 1. An assignment is never moved by this loop: with one copy per partition a
  partition's records live on its leader's disk only, so a dead node's partitions stay with
  it (offline, and reported) until it returns; moving them is the replicated log's work.

Everything here goes through ``MetadataStore`` and the typed writes of cluster/metarecords.py,
so it runs against the in-memory model in tests, with a clock and a leadership the test sets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from meshmq.cluster.metadata import Member, MetadataError, MetadataStore, members_of
from meshmq.cluster.metarecords import (
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
