"""Who leads what among a node's workers: one rule, asked in one place.

* Partition ``p`` of the commit log is led by worker ``p mod N``: it opens the partition's
  files, appends to it, and routes what it appends (the partition is the unit of ownership).
* A topic's retained message is owned by the leader of the topic's partition (the same
  ``Partitioner`` the log uses), so a persisted retained publish is appended, routed and stored
  by one worker.
* A client id's session is registered with worker ``crc32(client_id) mod N``, its directory
  owner (cluster/directory.py); the session itself lives where the client connected.
* ``$SYS`` totals are added up by worker 0.

Changing ``server.workers`` changes every answer but no data: partitions keep their files,
retained messages and session registrations move to their new owners (cluster/retained.py,
cluster/directory.py).
"""

from __future__ import annotations

import zlib

from meshmq.cluster.spec import WorkerSpec
from meshmq.log.partitioner import Partitioner

STATISTICS_OWNER = 0  # the worker that publishes the node's $SYS totals


class Leadership:
    """The rule for one node of ``worker.count`` workers and ``partitions`` partitions."""

    def __init__(self, worker: WorkerSpec, partitions: int, key_level: int | None) -> None:
        self.worker = worker
        self.count = worker.count
        self.partitions = partitions
        self.partitioner = Partitioner(partitions, key_level)
        self.mine = self.led_by(worker.index)
        self.leaders = [self.leader_of(p) for p in range(partitions)]  # (asked per publish)

    def leader_of(self, partition: int) -> int:
        return partition % self.count

    def led_by(self, index: int) -> list[int]:
        """The partitions worker ``index`` leads."""
        return list(range(index, self.partitions, self.count))

    def leads(self, partition: int) -> bool:
        return self.leader_of(partition) == self.worker.index

    def partition_for(self, topic: str) -> int:
        return self.partitioner.partition_for(topic)

    def owner_of_topic(self, topic: str) -> int:
        """The worker that stores ``topic``'s retained message."""
        return self.leader_of(self.partitioner.partition_for(topic))

    def owner_of_client(self, client_id: str) -> int:
        """The worker that knows where ``client_id``'s session is."""
        return zlib.crc32(client_id.encode("utf-8")) % self.count

    @property
    def is_statistics_owner(self) -> bool:
        return self.worker.index == STATISTICS_OWNER
