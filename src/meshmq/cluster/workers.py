"""A node's worker: the broker core of one process joined to the mesh of the node's workers.

Theory of operation
-------------------
``server.workers = N`` runs N processes (node/supervisor.py); each runs one broker core
(``broker/``) and this module joins it to its peers. The core only knows its interfaces
(broker/interfaces.py); here each gets its cluster version:

* ``Peers``: the ``Mesh`` itself (routes, forwarding, shared groups, barriers);
* ``PartitionLog``: ``PartitionedLog`` (partition ``p`` led by worker ``p mod N``);
* ``RetainedMessages``: ``OwnedRetained`` (a topic's owner is its partition's leader);
* ``SessionDirectory``: ``Directory`` (a client id's owner knows where its session is);
* ``NodeStatistics``: ``MeshStatistics`` (worker 0 adds up ``$SYS``).

Start-up order: link to every peer (``start``), then the broker restores its state, then
``started`` registers the restored sessions and hands retained messages this worker no longer
owns to their owners. Only then does the worker serve clients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from meshmq.broker.message import Message
    from meshmq.broker.router import Router
    from meshmq.cluster.codec import Forward
    from meshmq.cluster.mesh import Mesh


def join_router(mesh: Mesh, router: Router, decode: Callable[[bytes, float], Message],
                on_position: Callable[[tuple[int, int]], None]) -> None:
    """Make ``mesh`` the router's peers, and deliver what peers forward to the router.

    ``on_position``: a forwarded message's place in the log (the partition leader's order,
    which moves this worker's view of that partition's high watermark)."""
    router.peers = mesh

    def forwarded(peer: int, frame: Forward) -> None:
        now = mesh.io.now()
        message = decode(frame.message, now)
        if message.position is not None:
            on_position(message.position)
        router.deliver_forwarded(message, frame.groups, now)

    mesh.on_forward = forwarded
