"""What a dialed link to another node sent and the other end has not acknowledged yet.

Theory of operation
-------------------
Messages cross to another node in ``FORWARD`` frames (``FORWARD_AT`` with partitions led
across nodes, cluster/nodecatchup.py; and retained messages in
``RETAIN_SYNC``) on the link this worker dialed to it (cluster/nodes.py). The accepting end
counts the frames of those two types it has handled on the link and acknowledges the count
(``FORWARD_ACK``) every ``ACK_EVERY`` frames and on every heartbeat. ``ResendLog`` keeps, per
dialed link, every such frame queued on it until its count is acknowledged.

When the link closes (the other node died, hung past ``DEAD_AFTER``, or was cut off), the log
is kept with the link *parked*: it stays the node's route, so messages routed to that node
meanwhile are added to the log instead of being dropped. When a link to that node is up again,
the unacknowledged frames go first on it, in order, then the new traffic. So a node that comes
back, or a partition that heals, loses nothing that was routed to it; the frames it had
handled but not yet acknowledged come twice (at least once, as QoS 1 allows; docs/cluster.md).

A parked log holds at most ``MAX_PARKED_BYTES``: beyond, the oldest frames go (counted and
logged), so a node that never comes back costs bounded memory; ``meshmq cluster forget``
drops the log.
"""

from __future__ import annotations

import logging
from collections import deque

log = logging.getLogger("meshmq.cluster")

ACK_EVERY = 256  # frames handled between two FORWARD_ACKs (also sent on every heartbeat)
MAX_PARKED_BYTES = 32 * 1024 * 1024  # unacknowledged frames kept for one node, at most


class ResendLog:
    """The frames of one dialed link not acknowledged yet, oldest first."""

    __slots__ = ("base", "bytes", "dropped", "frames", "node_id")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.frames: deque[bytes] = deque()
        self.base = 0  # the link's count of the first frame held
        self.bytes = 0
        self.dropped = 0  # frames given up on (parked past MAX_PARKED_BYTES)

    def append(self, frame: bytes) -> None:
        self.frames.append(frame)
        self.bytes += len(frame)
        if self.bytes > MAX_PARKED_BYTES:
            self._shed()

    def acked(self, count: int) -> None:
        """The other end handled the link's first ``count`` frames."""
        frames = self.frames
        while self.base < count and frames:
            self.bytes -= len(frames.popleft())
            self.base += 1

    def take(self) -> list[bytes]:
        """Everything held, for the next link (this log is done)."""
        frames = list(self.frames)
        self.frames.clear()
        self.bytes = 0
        return frames

    def _shed(self) -> None:
        if not self.dropped:
            log.warning("messages for node %s dropped: more than %d MiB wait for it (it is "
                        "down or does not acknowledge)", self.node_id,
                        MAX_PARKED_BYTES // (1024 * 1024))
        while self.bytes > MAX_PARKED_BYTES and self.frames:
            self.bytes -= len(self.frames.popleft())
            self.base += 1
            self.dropped += 1
