"""Request/reply between the worker processes of a node: the services' frames over the mesh.

The services layer (services/layer.py) reaches the node's other workers through an object with
the methods below (its ``ServiceLinks``), and hears from them through the ``ServiceEvents`` it
is given as ``events``; this module knows the layer only as those methods (``cluster/`` does
not import ``services/``; node/server.py joins the two). Frames (cluster/codec.py):
``SERVICE_OFFER`` and ``SERVICE_SYNC`` to a service's dispatcher, ``SERVICE_REQUEST`` from it,
``SERVICE_REPLY`` to it, answered by ``SERVICE_REPLIED`` on the same link (a reply asked on a
link that drops gets no answer: the asker hears ``None`` and sends it again on the next link).
Who dispatches a service is the leader of its partition (cluster/leaders.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from meshmq.broker.wire import decode_message, encode_message
from meshmq.cluster.codec import (
    FrameType,
    Hello,
    ServiceOffer,
    ServiceOfferEntry,
    ServiceReplied,
    ServiceReply,
    ServiceRequest,
    ServiceSync,
)

if TYPE_CHECKING:
    from meshmq.broker.message import Message
    from meshmq.cluster.leaders import Leadership
    from meshmq.cluster.mesh import Mesh

Expected = tuple[str, bytes | None] | None


class ServiceEvents(Protocol):
    """What the services layer does with what comes from the other workers."""

    def on_link_up(self, process: int) -> None: ...

    def on_link_down(self, process: int) -> None: ...

    def on_offer(self, process: int, service: str, client_id: str, serial: int,
                 capacity: int) -> None: ...

    def on_sync(self, process: int, offers: list[ServiceOfferEntry]) -> None: ...

    def on_request(self, process: int, service: str, client_id: str, serial: int,
                   request_id: str, retry: int, dup: bool, message: Message) -> None: ...

    def on_reply(self, process: int, service: str, request_id: str, client_id: str,
                 retry: int, message: Message, expected: Expected,
                 answer: Callable[[str], None]) -> None: ...


class MeshServiceLinks:
    """The services' frames on one worker's mesh (see the module docstring)."""

    def __init__(self, mesh: Mesh, leadership: Leadership) -> None:
        self.mesh = mesh
        self.leadership = leadership
        self.me = leadership.worker.index
        self.events: ServiceEvents | None = None  # the services layer (set before linking)
        self._next = 1
        # replies sent, by frame id: (peer, link, answer)
        self._pending: dict[int, tuple[int, int, Callable[[str | None], None]]] = {}
        mesh.handle(FrameType.SERVICE_OFFER, self._on_offer)
        mesh.handle(FrameType.SERVICE_SYNC, self._on_sync)
        mesh.handle(FrameType.SERVICE_REQUEST, self._on_request)
        mesh.handle(FrameType.SERVICE_REPLY, self._on_reply)
        mesh.handle(FrameType.SERVICE_REPLIED, self._on_replied)
        mesh.on_link_up.append(self._link_up)
        mesh.on_link_down.append(self._link_down)

    # ------------------------------------------------------------------ what the layer asks

    def leader_of(self, partition: int) -> int:
        return self.leadership.leader_of(partition)

    def linked(self, process: int) -> bool:
        return process in self.mesh.peers

    def send_offer(self, process: int, service: str, client_id: str, serial: int,
                   capacity: int) -> bool:
        return self.mesh.send(process, ServiceOffer(service, client_id, serial,
                                                    capacity).encode())

    def send_sync(self, process: int, offers: list[ServiceOfferEntry]) -> bool:
        return self.mesh.send(process, ServiceSync(offers).encode())

    def send_request(self, process: int, service: str, client_id: str, serial: int,
                     request_id: str, retry: int, dup: bool, message: Message) -> bool:
        body = encode_message(message, self.mesh.io.now(), positioned=False)
        return self.mesh.send(process, ServiceRequest(service, client_id, serial, request_id,
                                                      retry, dup, body).encode())

    def send_reply(self, process: int, service: str, request_id: str, client_id: str,
                   retry: int, message: Message, expected: Expected,
                   answer: Callable[[str | None], None]) -> bool:
        link = self.mesh.incarnation(process)
        if link is None:
            return False
        frame_id = self._next
        self._next += 1
        body = encode_message(message, self.mesh.io.now(), positioned=False)
        if not self.mesh.send(process, ServiceReply(frame_id, service, request_id, client_id,
                                                    retry, expected, body).encode(), link):
            return False
        self._pending[frame_id] = (process, link, answer)
        return True

    # ------------------------------------------------------------------ what comes in

    def _layer(self) -> ServiceEvents:
        events = self.events
        assert events is not None  # node/server.py sets it before the mesh links
        return events

    def _link_up(self, peer: int, hello: Hello) -> None:
        self._layer().on_link_up(peer)

    def _link_down(self, peer: int) -> None:
        """Replies asked on the dropped link get no answer: their askers resend them."""
        for frame_id in [f for f, (p, _, _) in self._pending.items() if p == peer]:
            _, _, answer = self._pending.pop(frame_id)
            answer(None)
        self._layer().on_link_down(peer)

    def _on_offer(self, peer: int, frame: ServiceOffer) -> None:
        self._layer().on_offer(peer, frame.service, frame.client_id, frame.serial,
                               frame.capacity)

    def _on_sync(self, peer: int, frame: ServiceSync) -> None:
        self._layer().on_sync(peer, frame.offers)

    def _on_request(self, peer: int, frame: ServiceRequest) -> None:
        message = decode_message(frame.message, self.mesh.io.now())
        self._layer().on_request(peer, frame.service, frame.client_id, frame.serial,
                                 frame.request, frame.retry, frame.dup, message)

    def _on_reply(self, peer: int, frame: ServiceReply) -> None:
        link = self.mesh.incarnation(peer)
        message = decode_message(frame.message, self.mesh.io.now())

        def answer(verdict: str) -> None:  # on the link the reply came on, or not at all
            self.mesh.send(peer, ServiceReplied(frame.frame_id, verdict).encode(), link)

        self._layer().on_reply(peer, frame.service, frame.request, frame.client_id,
                               frame.retry, message, frame.expected, answer)

    def _on_replied(self, peer: int, frame: ServiceReplied) -> None:
        pending = self._pending.get(frame.frame_id)
        if pending is None or pending[0] != peer or pending[1] != self.mesh.incarnation(peer):
            return
        del self._pending[frame.frame_id]
        pending[2](frame.verdict)
