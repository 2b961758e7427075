"""The handshake of a link between two nodes: who is at the other end, and proof of the secret.

Theory of operation
-------------------
A link between nodes is a TCP connection from one worker of a node to another node's cluster
port (cluster/tcplinks.py; any worker of the accepting node may take it). Before anything else
both ends send ``LINK_HELLO``: the protocol version, the cluster's id (empty while the sender
has none yet), its node id and incarnation (drawn at each start, so a restarted peer is seen as
new), its worker index and count, and a fresh random nonce. Each end then proves it knows the
cluster's shared secret with ``LINK_AUTH``: an HMAC-SHA256, keyed by the secret, over a fixed
label, its own node id, worker and nonce, and the nonce the other end sent. The proof covers
the other end's fresh nonce, so it cannot be replayed on another link, and its own identity, so
it cannot be passed off as another node's. Until the other end's ``LINK_AUTH`` has checked out,
the link carries nothing else (cluster/mesh.py enforces it, with a frame size cap and a
deadline). A node without a secret (listening on loopback only: config.py requires one
otherwise) proves knowledge of the empty secret: anyone on the host could join, as anyone on
the host can reach a loopback port.

Cluster id. A node keeps the id of the cluster it belongs to in its data directory
(node/identity.py). The first node of a cluster, started with no seeds, draws it; a node that
has none yet adopts the id of the first node it links with that has one (the node's
identity file keeps it from then on). Nodes started together, each naming the others as
seeds, have none until one is given to them (they link all the same: the id only guards
against nodes of different clusters meeting). A node that meets one of another cluster refuses
the link, naming both ids.

``check_hello`` and ``link_mac`` are pure functions; the mesh calls them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from meshmq.cluster.codec import LinkError

if TYPE_CHECKING:
    from meshmq.cluster.codec import LinkHello

PROTOCOL_VERSION = 1
NONCE_BYTES = 16
_LABEL = b"meshmq node link v1\0"


@dataclass(slots=True)
class NodeIdentity:
    """This node as other nodes see it. ``cluster_id`` is empty until it is known; the mesh
    sets it when it learns it (``adopt``), and the node's identity file keeps it."""

    node_id: str
    incarnation: int
    secret: bytes = b""
    cluster_id: str = ""
    address: str = ""  # what other nodes dial to reach this one (cluster.advertise)

    @classmethod
    def new(cls, node_id: str, secret: bytes, cluster_id: str = "", address: str = ""
            ) -> NodeIdentity:
        return cls(node_id, int.from_bytes(os.urandom(8), "big"), secret, cluster_id, address)


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def new_cluster_id() -> str:
    return uuid.uuid4().hex


def link_mac(secret: bytes, node_id: str, worker: int, own_nonce: bytes,
             their_nonce: bytes) -> bytes:
    """The proof that the sender (``node_id``, ``worker``) knows ``secret``, bound to both
    nonces of this link."""
    data = b"".join((_LABEL, node_id.encode("utf-8"), b"\0", worker.to_bytes(2, "big"),
                     own_nonce, their_nonce))
    return hmac.new(secret, data, hashlib.sha256).digest()


def check_mac(secret: bytes, hello: LinkHello, own_nonce: bytes, mac: bytes) -> bool:
    """Does ``mac`` prove that the sender of ``hello`` knows ``secret``?"""
    expected = link_mac(secret, hello.node_id, hello.worker, hello.nonce, own_nonce)
    return hmac.compare_digest(expected, mac)


def check_hello(identity: NodeIdentity, hello: LinkHello) -> str:
    """The cluster id this link agrees on ("" while neither end has one); ``LinkError`` (the
    link is refused) for a peer that cannot be linked."""
    if hello.version != PROTOCOL_VERSION:
        raise LinkError(f"node {hello.node_id!r} speaks link protocol version "
                        f"{hello.version}, this node {PROTOCOL_VERSION}")
    if hello.node_id == identity.node_id:
        if hello.incarnation == identity.incarnation:
            raise LinkError("a link to this node itself (its own address among the seeds?)")
        raise LinkError(f"another node also calls itself {hello.node_id!r}: node ids must be "
                        "unique")
    if len(hello.nonce) != NONCE_BYTES:
        raise LinkError(f"node {hello.node_id!r} sent a {len(hello.nonce)}-byte nonce")
    ours, theirs = identity.cluster_id, hello.cluster_id
    if ours and theirs and ours != theirs:
        raise LinkError(f"node {hello.node_id!r} belongs to cluster {theirs}, this node to "
                        f"{ours}")
    return ours or theirs
