"""A node's metadata service: its Raft voter in a process of its own, serving the node's
workers over a local socket.

Theory of operation
-------------------
cluster.md: "Raft lives in its own process per node (forked by the supervisor like a worker)":
a worker's event loop can stall (start-up index reads, GC) long enough to lose Raft
heartbeats, and the supervisor stays thread-free. ``MetaService`` runs the node's voter
(cluster/raftstore.py) and listens on an abstract unix socket (``socket_name``; nothing on
disk) for the workers' clients (cluster/metaclient.py), speaking cluster/metaproto.py.

Who may connect. An abstract socket's name is visible to every local user, so each
connection is checked with the kernel's peer credentials before a byte of it is read, as the
mesh checks its links (cluster/sockets.py ``refuse_peer``): the peer must run as this user and
be a worker of this node (a child of our supervisor), this process, or the supervisor itself.
``trust_user`` (for trying the service by hand from a shell) accepts any process of this user.

Addresses. The voter listens for Raft on ``raft_address`` (what the other voters dial;
``bind`` if the local address differs). By default it is the node's cluster address with the
port plus one (``raft_address_for``), so ``cluster.listen`` stays enough to start a node.

Run by hand::

    python -m meshmq.cluster.metaproc serve --node-id n1 --raft 127.0.0.1:7884 \\
        --peer 127.0.0.1:7886 --peer 127.0.0.1:7888 --data-dir /tmp/n1 \\
        --socket meshmq-meta-n1 --secret-file secret --trust-user
    python -m meshmq.cluster.metaproc cas --socket meshmq-meta-n1 greeting 0 '"hello"'
    python -m meshmq.cluster.metaproc read --socket meshmq-meta-n1
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import struct
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshmq.broker.transport.layer import stream_transport
from meshmq.cluster.metadata import MetadataError, Watch
from meshmq.cluster.metaproto import (
    FrameDecoder,
    ProtocolError,
    change_to_json,
    encode,
    error_to_json,
    result_to_json,
    view_to_json,
)
from meshmq.cluster.raftstore import MetaStartError, RaftSettings, RaftStore
from meshmq.cluster.sockets import refuse_peer

log = logging.getLogger("meshmq.metadata")

RAFT_PORT_OFFSET = 1  # the Raft port by default: the cluster port + 1
MAX_IN_FLIGHT = 256  # requests of one connection being answered; beyond, it is not read
MAX_BUFFERED = 64 * 1024 * 1024  # bytes waiting for a slow client; beyond, it is dropped
_CREDENTIALS = struct.Struct("3i")


def raft_address_for(cluster_address: str) -> str:
    """The default Raft address of a node whose cluster address is ``cluster_address``."""
    host, _, port = cluster_address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"{cluster_address!r}: expected host:port with a port below 65535")
    return f"{host}:{int(port) + RAFT_PORT_OFFSET}"


def socket_name_for(token: str) -> str:
    """The abstract socket of a node's metadata service (``token``: the node's, random per
    start, as the mesh's link sockets: cluster/spec.py)."""
    return f"\0meshmq-{token}-meta"


def _abstract(name: str) -> str:
    return name if name.startswith("\0") else "\0" + name


class MetaService:
    """See the module docstring. ``serve(stop)`` runs until ``stop`` is set."""

    def __init__(self, node_id: str, raft_address: str, peers: Sequence[str], data_dir: Path,
                 socket_name: str, secret: bytes, settings: RaftSettings | None = None,
                 bind: str | None = None, trust_user: bool = False) -> None:
        self.node_id = node_id
        self.socket_name = _abstract(socket_name)
        self.trust_user = trust_user
        self.leaving = False  # asked to leave the cluster: see ``_answer``
        self.store = RaftStore(raft_address, peers, data_dir / "raft", secret, settings, bind)
        self._sessions: set[_Session] = set()
        self._group: asyncio.TaskGroup | None = None
        self._requests: set[asyncio.Task[None]] = set()

    async def serve(self, stop: asyncio.Event) -> None:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(self.socket_name)
        except OSError as error:
            sock.close()
            raise MetaStartError(f"cannot listen on the metadata socket "
                                 f"{self.socket_name[1:]!r}: {error.strerror or error}") from None
        sock.listen(64)
        sock.setblocking(False)
        await self.store.start()
        server = await loop.create_unix_server(lambda: _Session(self), sock=sock)
        log.info("metadata service ready node=%s raft=%s socket=%s", self.node_id,
                 self.store.address, self.socket_name[1:])
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                await stop.wait()
                server.close()
                for session in list(self._sessions):
                    session.close()
                for request in list(self._requests):  # their clients are gone: do not wait
                    request.cancel()
        finally:
            self._group = None
            await self.store.close()
            log.info("metadata service stopped node=%s", self.node_id)

    def refuse(self, sock: socket.socket | None) -> str | None:
        """Why the process at the other end of ``sock`` may not use this service (None: it
        may); see the module docstring."""
        if sock is None:
            return "is unknown (no socket to ask)"
        pid, uid, _ = _CREDENTIALS.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size))
        if uid == os.getuid() and (self.trust_user or pid == os.getppid()):
            return None
        return refuse_peer(sock)

    # -- requests ---------------------------------------------------------------------------------

    def dispatch(self, session: _Session, message: dict[str, Any]) -> None:
        if self._group is None:
            return  # stopping
        session.in_flight += 1
        task = self._group.create_task(self._handle(session, message))
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _handle(self, session: _Session, message: dict[str, Any]) -> None:
        ident = message.get("id")
        try:
            reply = await self._answer(session, message)
        except MetadataError as error:
            reply = {"error": error_to_json(error)}
        except (KeyError, TypeError, ValueError) as error:
            reply = {"error": {"type": "error", "message": f"bad request: {error}",
                               "hint": None}}
        except Exception as error:  # one request's failure must not stop the service
            log.exception("metadata request failed op=%r", message.get("op"))
            reply = {"error": {"type": "error", "message": f"internal error: {error!r}",
                               "hint": None}}
        session.in_flight -= 1
        session.send({"id": ident, **reply})

    async def _answer(self, session: _Session, message: dict[str, Any]) -> dict[str, Any]:
        op = message.get("op")
        store = self.store
        if op == "read":
            return {"view": view_to_json(await store.read())}
        if op in ("cas", "delete"):
            key, expected = _string(message, "key"), message["expected"]
            guards, request = message.get("guards") or {}, message.get("request") or ""
            if not (isinstance(expected, int) and expected >= 0):
                raise ValueError("expected: a version (an integer >= 0)")
            if not (isinstance(guards, dict) and all(isinstance(v, int) for v in guards.values())):
                raise ValueError("guards: an object of key -> version")
            if not isinstance(request, str):
                raise ValueError("request: a string")
            if op == "cas":
                result = await store.cas(key, expected, message.get("value"), guards, request)
            else:
                result = await store.delete(key, expected, guards, request)
            return {"result": result_to_json(result)}
        if op == "watch":
            session.start_watch()
            return {"watching": True}
        if op == "status":
            return {"status": {"node_id": self.node_id, **store.status().to_json()}}
        if op == "leave":
            self.leaving = True  # the node's agent stops writing its member record
            await store.remove_member(self.node_id)
            return {"done": await store.leave()}
        if op == "remove_voter":
            return {"done": await store.remove_voter(_string(message, "address"))}
        raise ValueError(f"unknown op {op!r}")


def _string(message: dict[str, Any], name: str) -> str:
    value = message[name]
    if not isinstance(value, str):
        raise ValueError(f"{name}: a string")
    return value


class _Session(asyncio.Protocol):
    """One client connection."""

    def __init__(self, service: MetaService) -> None:
        self.service = service
        self.decoder = FrameDecoder()
        self.transport: asyncio.Transport | None = None
        self.watch: Watch | None = None
        self._in_flight = 0
        self.paused = False

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, count: int) -> None:
        """Bounded: a client with too many requests waiting is not read until some end."""
        self._in_flight = count
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if count >= MAX_IN_FLIGHT and not self.paused:
            self.paused = True
            transport.pause_reading()
        elif count < MAX_IN_FLIGHT // 2 and self.paused:
            self.paused = False
            transport.resume_reading()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        stream = stream_transport(transport)
        why = self.service.refuse(stream.get_extra_info("socket"))
        if why is not None:
            log.error("metadata client refused: the process at the other end %s", why)
            stream.abort()
            return
        self.transport = stream
        self.service._sessions.add(self)
        self.send({"hello": self.service.node_id})

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return  # refused: nothing is read
        try:
            messages = self.decoder.feed(data)
        except ProtocolError as error:
            log.error("metadata client dropped: %s", error)
            self.transport.abort()
            return
        for message in messages:
            self.service.dispatch(self, message)

    def start_watch(self) -> None:
        if self.watch is None:
            self.watch = self.service.store.watch(
                lambda change: self.send({"change": change_to_json(change)}))

    def send(self, message: dict[str, Any]) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if transport.get_write_buffer_size() > MAX_BUFFERED:
            log.warning("metadata client dropped: it reads too slowly (%d bytes waiting)",
                        transport.get_write_buffer_size())
            transport.abort()
            return
        transport.write(encode(message))

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.service._sessions.discard(self)
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        self.transport = None


# -- command line ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m meshmq.cluster.metaproc",
                                     description="A node's metadata service, by hand.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the service")
    serve.add_argument("--node-id", required=True)
    serve.add_argument("--raft", required=True, help="host:port the other voters dial")
    serve.add_argument("--peer", action="append", default=[], help="another voter's host:port")
    serve.add_argument("--bind", help="host:port to listen on for Raft (default: --raft)")
    serve.add_argument("--data-dir", required=True, type=Path)
    serve.add_argument("--socket", required=True, help="the abstract socket's name")
    serve.add_argument("--secret-file", required=True, type=Path)
    serve.add_argument("--trust-user", action="store_true",
                       help="accept clients of this user that are not this node's workers")
    serve.add_argument("--election", type=_timeouts, default=None, metavar="MIN,MAX",
                       help="election timeouts in seconds (default: "
                            f"{RaftSettings().election_min},{RaftSettings().election_max})")
    for name in ("read", "status", "watch"):
        commands.add_parser(name).add_argument("--socket", required=True)
    cas = commands.add_parser("cas", help="compare-and-set KEY from version EXPECTED")
    cas.add_argument("--socket", required=True)
    cas.add_argument("key")
    cas.add_argument("expected", type=int)
    cas.add_argument("value", help="JSON")
    delete = commands.add_parser("delete")
    delete.add_argument("--socket", required=True)
    delete.add_argument("key")
    delete.add_argument("expected", type=int)
    return parser


def _timeouts(text: str) -> tuple[float, float]:
    low, _, high = text.partition(",")
    try:
        pair = float(low), float(high)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN,MAX in seconds") from None
    if not 0 < pair[0] < pair[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 < MIN < MAX")
    return pair


def run_service(service: MetaService) -> int:
    """Run ``service`` until SIGTERM or SIGINT, in this (forked) process: the supervisor's
    entry point (``os._exit(run_service(MetaService(...)))``). The exit status: 0, or
    ``MetaStartError.exit_status`` after its one line is logged."""

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await service.serve(stop)

    try:
        asyncio.run(serve())
    except MetaStartError as error:
        log.error("%s", error)
        return error.exit_status
    return 0


def _service(args: argparse.Namespace) -> MetaService:
    try:
        secret = args.secret_file.read_bytes().rstrip()
    except OSError as error:
        raise MetaStartError(f"--secret-file: cannot read {args.secret_file}: "
                             f"{error.strerror or error}", 2) from None
    settings = RaftSettings()
    if args.election is not None:
        low, high = args.election  # pysyncobj wants 3 beats or more within the minimum
        settings = dataclasses.replace(settings, election_min=low, election_max=high,
                                       heartbeat=min(settings.heartbeat, low / 4))
    return MetaService(args.node_id, args.raft, args.peer, args.data_dir, args.socket,
                       secret, settings, bind=args.bind, trust_user=args.trust_user)


async def _client(args: argparse.Namespace) -> None:
    from meshmq.cluster.metaclient import MetaClient  # the client side only when asked for

    client = MetaClient(args.socket)
    await client.connect()
    try:
        if args.command == "read":
            view = await client.read()
            print(json.dumps({"version": view.version, "entries": {
                key: {"value": entry.value, "version": entry.version}
                for key, entry in sorted(view.entries.items())}}, indent=2))
        elif args.command == "status":
            print(json.dumps(await client.status(), indent=2))
        elif args.command == "cas":
            print(await client.cas(args.key, args.expected, json.loads(args.value)))
        elif args.command == "delete":
            print(await client.delete(args.key, args.expected))
        elif args.command == "watch":
            client.watch(lambda change: print(change, flush=True))
            await asyncio.Event().wait()
    finally:
        await client.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        if args.command == "serve":
            return run_service(_service(args))
        asyncio.run(_client(args))
    except MetaStartError as error:
        log.error("%s", error)
        return error.exit_status
    except MetadataError as error:
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
