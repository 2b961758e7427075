"""The commit log as a worker other than the leader sees it.

Theory of operation
-------------------
Worker 0, the leader, owns the commit log (it holds its lock and its writer). Another worker:

* sends each persisted publish to the leader (``APPEND``); the leader appends it, routes it
  once durable (to its own subscribers and, as a ``FORWARD``, to every worker with one, this
  one included) and answers; only then does this worker acknowledge the publisher. So the order
  of a partition is the leader's order everywhere, and nothing unacknowledged is delivered;
* reads the log files directly for catch-up and replay (``LogView``: no lock, complete batches
  only), never beyond its *view* of the high watermark;
* keeps that view from what the leader tells it, in order on one link: the high watermark in
  ``HELLO`` and in each ``SYNCED`` answer, and the position of every persisted message it is
  forwarded. Every record of a partition at or above the view that matches a route of this
  worker is still to be forwarded here, so a catch-up that reads up to the view and then goes
  live neither misses nor repeats a record. A replay first asks the leader (``SYNC``): its
  history ends at the leader's high watermark as of after this worker's route was installed.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from meshmq.broker.message import Message
from meshmq.broker.persistence import Completion, LogAccess
from meshmq.config import LogSettings
from meshmq.log.view import LogView

if TYPE_CHECKING:
    from meshmq.cluster.mesh import Mesh

log = logging.getLogger("meshmq.remotelog")


class LeaderUnavailable(Exception):
    """The leader did not take a persisted publish (no link, or it refused)."""

    def __init__(self, reason_code: int, why: str) -> None:
        super().__init__(why)
        self.reason_code = reason_code


class Appended:
    """A persisted publish the leader made durable and routed."""

    __slots__ = ("offset", "partition", "receivers")

    def __init__(self, partition: int, offset: int, receivers: int) -> None:
        self.partition = partition
        self.offset = offset
        self.receivers = receivers


class RemoteLog(LogAccess):
    routes_locally = False

    def __init__(self, settings: LogSettings, data_dir: str, mesh: Mesh,
                 high_watermark: list[int]) -> None:
        super().__init__(settings)
        self.mesh = mesh
        self.commit_log = LogView(data_dir)
        self.high_watermark = list(high_watermark)

    def append(self, message: Message, client_id: str, done: Completion) -> bool:
        """Ask the leader to persist and route ``message``; ``done`` gets ``Appended`` or a
        ``LeaderUnavailable`` (never called synchronously)."""
        self.mesh.append(message, client_id, done)  # type: ignore[arg-type]
        return True

    def synced(self, high_watermark: list[int]) -> None:
        """The leader's high watermark, after everything it sent before."""
        view = self.high_watermark
        for partition, high in enumerate(high_watermark[:len(view)]):
            if high > view[partition]:
                view[partition] = high

    def close(self) -> None:
        self.commit_log.close()
