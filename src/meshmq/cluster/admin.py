"""The operations plane's questions across the mesh: every worker answers for itself.

Theory of operation
-------------------
The worker that serves the admin listener (worker 0, node/admin/) asks every linked peer the
same question, one ``ADMIN`` request each (``ask``). A query is a name and JSON arguments; each
peer runs it through ``answer`` (set by the node: node/admin/views.py, which reads the peer's
broker through broker/queries.py) and sends the result back as JSON in ``ADMIN_ANSWER``. The
request layer (requests.py) gives ids and deadlines: a peer that is down, restarting, or does
not answer within ``timeout`` counts as missing (None), so one stuck worker cannot hold an HTTP
request or a Prometheus scrape back. A query that fails on a peer is logged there and answered
with an error, never by closing the link.

Nothing here runs on the message path: requests are control frames, answered between the
frames a peer sent before (so an answer is also a barrier for them).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from meshmq.cluster.codec import Admin, AdminAnswer, FrameType

if TYPE_CHECKING:
    from meshmq.cluster.mesh import Mesh

log = logging.getLogger("meshmq.mesh")

ADMIN_TIMEOUT = 2.0  # seconds a peer may take to answer one query
Answer = Callable[[str, dict[str, Any]], Any]  # (query, args) -> a JSON-ready result


class QueryFailed(Exception):
    """A peer ran the query and it raised; the message says what (logged on that peer)."""


class MeshAdmin:
    """One worker's side of the admin queries: it answers its peers, and may ask them."""

    def __init__(self, mesh: Mesh, loop: asyncio.AbstractEventLoop) -> None:
        self.mesh = mesh
        self.loop = loop
        self.answer: Answer | None = None  # set by the node's composition root
        mesh.handle(FrameType.ADMIN, self._on_admin)

    def _on_admin(self, peer: int, frame: Admin) -> None:
        result: dict[str, Any]
        try:
            if self.answer is None:
                raise QueryFailed("this worker serves no admin queries")
            result = {"ok": self.answer(frame.query, json.loads(frame.args))}
        except Exception as exc:  # a failing query must not take the link down
            log.exception("admin query %r from worker %d failed", frame.query, peer)
            result = {"error": f"{type(exc).__name__}: {exc}"}
        body = json.dumps(result, separators=(",", ":")).encode()
        self.mesh.send(peer, AdminAnswer(frame.request_id, body).encode())

    async def ask(self, peers: Iterable[int], query: str, args: dict[str, Any],
                  timeout: float = ADMIN_TIMEOUT) -> dict[int, Any]:
        """``query`` on each of ``peers``; their results by peer. A peer that is not linked,
        drops its link or misses ``timeout`` is absent from the result; one whose query raised
        maps to a ``QueryFailed``."""
        payload = json.dumps(args, separators=(",", ":")).encode()
        waiting: dict[int, asyncio.Future[AdminAnswer | None]] = {}
        for peer in peers:
            future: asyncio.Future[AdminAnswer | None] = self.loop.create_future()

            def answered(frame: AdminAnswer | None,
                         future: asyncio.Future[AdminAnswer | None] = future) -> None:
                if not future.done():
                    future.set_result(frame)

            def request(request_id: int) -> bytes:
                return Admin(request_id, query, payload).encode()

            if self.mesh.request(peer, request, answered, timeout):
                waiting[peer] = future
        results: dict[int, Any] = {}
        for peer, future in waiting.items():
            frame = await future
            if frame is None:
                continue
            body = json.loads(frame.result)
            results[peer] = body["ok"] if "ok" in body else QueryFailed(body.get("error", "?"))
        return results
