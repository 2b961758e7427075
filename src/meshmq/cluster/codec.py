"""The link protocol between routers: frames, their encoding, and a sans-I/O frame reader.

Theory of operation
-------------------
A link is a byte stream (a unix socket between workers of one node; later TCP between hosts).
Each frame is ``length (u32, big endian) | type (u8) | body``, where ``length`` counts the type
byte and the body and is at most ``MAX_FRAME``. Integers are big endian; a string is
``u16 length | UTF-8``; a byte string is ``u32 length | bytes``; a list is ``u32 count | items``.

Every frame type is a dataclass below, with its ``encode()`` and ``decode(body)`` written
once; the fields are those of broker/wire.py (``Writer``/``Reader``), and a message travels as
its one body (broker/wire.py ``encode_message``), opaque here. The hot frame is ``FORWARD``: a
publish routed by one router for the subscribers of another. Its message body is encoded once
per publish and shared by every peer it goes to; only the short list of shared-subscription
groups the receiver must serve differs per peer. Every other frame is control traffic (routes,
requests and their replies).

``FrameReader.feed()`` takes bytes as they arrive and returns complete ``(type, body)`` pairs;
a frame over ``MAX_FRAME``, an unknown type or a body that does not decode is a ``LinkError``:
the link is closed and re-established, never half-understood.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from enum import IntEnum
from typing import NamedTuple

from meshmq.broker.wire import Reader, WireError
from meshmq.broker.wire import Writer as _WireWriter

MAX_FRAME = 512 * 1024 * 1024  # far above any MQTT packet (256 MB) plus its envelope

_HEADER = struct.Struct(">IB")

LinkError = WireError  # a peer sent bytes that are not the link protocol: the link is closed
GroupKey = tuple[str, str]  # (share name, filter)


class FrameType(IntEnum):
    HELLO = 1  # index, count, token, the high watermark of each partition the sender leads
    ROUTES = 2  # route changes: (added, group, filter)*
    FORWARD = 3  # a publish for the receiver's subscribers, and the shared groups it serves
    APPEND = 4  # request to a partition's leader: persist and route these publishes
    RETAIN = 5  # request to a topic's owner: store (and maybe route) this retained message
    REPLY = 6  # answer to RETAIN
    QUERY_RETAINED = 7  # request to a topic's owner: retained messages matching these filters
    RETAINED = 8  # answer to QUERY_RETAINED
    CLAIM = 9  # to a client id's owner: a client connected here, hand its session over
    CLAIMED = 10  # answer to CLAIM or RELEASE
    SYNC = 11  # request to a leader: your high watermarks, after everything sent before
    SYNCED = 12  # answer to SYNC
    STATS = 13  # a worker's counters, for the node's $SYS totals
    BARRIER = 14  # request: answer once everything sent before is applied (routes)
    BARRIER_DONE = 15  # answer to BARRIER, with the sender's high watermarks
    DELIVER = 16  # a message for one session that moved to the receiver (cluster/moving.py)
    SETTLED = 17  # a session handed over to the sender is in place: drop its stand-in
    RELEASE = 18  # from a client id's owner to the holder: hand the session over to a worker
    REGISTER = 19  # to client ids' owners: sessions the sender now holds or no longer holds
    APPENDED = 20  # answers to APPEND
    ADMIN = 21  # request from the admin listener's worker: answer this query (node/admin)
    ADMIN_ANSWER = 22  # answer to ADMIN
    LINK_HELLO = 23  # first frame on a link between nodes, both ways: who, which cluster, nonce
    LINK_AUTH = 24  # proof of the cluster secret, over both nonces (cluster/nodelink.py)
    PING = 25  # a link between nodes is alive (sent when it is otherwise quiet)
    MEMBERS = 26  # the nodes the sender knows, with the address each is dialed at
    RETAIN_SYNC = 27  # retained messages (or clears) with their stamps, for another node's store
    NODE_STATS = 28  # a node's $SYS totals, for the other nodes' cluster figures
    FORGET = 29  # a node left the cluster (or is gone for good): stop dialing it, drop it
    TAKEOVER = 30  # a client id connected on the sender's node: close older connections of it
    FORWARD_ACK = 31  # the count of FORWARD and RETAIN_SYNC frames handled on this link
    SERVICE_OFFER = 32  # to a service's dispatcher: a service worker here offers it (or not)
    SERVICE_SYNC = 33  # on each link: every offer here for the receiver's services, and holdings
    SERVICE_REQUEST = 34  # from a dispatcher: an attempt for a service worker connected there
    SERVICE_REPLY = 35  # to a dispatcher: a service worker's reply (answered: SERVICE_REPLIED)
    SERVICE_REPLIED = 36  # answer to SERVICE_REPLY: what the reply turned out to be
    SESSION_FETCH = 37  # to another node: a client connected here, hand its session over
    SESSION_PART = 38  # answer to SESSION_FETCH (a session, maybe in parts) or to a settle
    SESSION_MOVED = 39  # a session that crossed: settled (request), or a message for it
    NODE_APPEND = 40  # to a partition's leader node: store these publishes (with leader epochs)
    NODE_APPENDED = 41  # answer to NODE_APPEND: where each was stored, or why not (a hint)
    FORWARD_AT = 42  # a FORWARD of a record of a partition the sender's node leads, and its place
    FETCH = 43  # to a partition's leader node, after it restarted: send again what came after
    LOG_READ = 44  # to a partition's leader node: its high watermarks, or records from an offset
    LOG_DATA = 45  # answer to LOG_READ
    SESSION_OWNER = 46  # to a client id's owner (node, then worker): an epoch for its CONNECT
    SESSION_OWNED = 47  # answer to SESSION_OWNER


KNOWN_TYPES = frozenset(int(t) for t in FrameType)


# ---------------------------------------------------------------------- encoding


class Writer(_WireWriter):
    """Builds one frame: the fields of broker/wire.py, then ``frame()`` adds the header."""

    __slots__ = ()

    def frame(self, frame_type: FrameType) -> bytes:
        body = b"".join(self.parts)
        return _HEADER.pack(len(body) + 1, frame_type) + body


RELAYED = 1 << 31  # in a FORWARD's group count: a shared message passed on, not routed


def forward_frame(groups: list[GroupKey], body: bytes, relayed: bool = False) -> bytes:
    """FORWARD: the groups (name, filter) the receiver serves, then the message body (encoded
    once for every peer, broker/wire.py). ``relayed``: a shared group's message passed on by
    a router whose group had no member left (the top bit of the group count)."""
    if not groups and not relayed:
        return _HEADER.pack(len(body) + 5, FrameType.FORWARD) + b"\x00\x00\x00\x00" + body
    writer = Writer().u32(len(groups) | (RELAYED if relayed else 0))
    for name, topic_filter in groups:
        writer.text(name).text(topic_filter)
    head = b"".join(writer.parts)
    return _HEADER.pack(len(head) + len(body) + 1, FrameType.FORWARD) + head + body


# ---------------------------------------------------------------------- frames
#
# One dataclass per frame type: ``encode()`` gives the whole frame (header included) and
# ``decode(body)`` reads a body back, raising ``LinkError`` on anything malformed (a body that
# ends early, trailing bytes, bad UTF-8). A message travels as its encoded body (``bytes``:
# see ``encode_message``), decoded by whoever delivers it.

Highs = dict[int, int]  # partition -> high watermark, for the partitions the sender leads
RouteChange = tuple[bool, str, str]  # (added, group or "", filter)


def _write_highs(writer: Writer, highs: Highs) -> Writer:
    writer.u32(len(highs))
    for partition, high in sorted(highs.items()):
        writer.u32(partition).u64(high)
    return writer


def _read_highs(reader: Reader) -> Highs:
    return {reader.u32(): reader.u64() for _ in range(reader.u32())}


def _rest(body: bytes, reader: Reader) -> bytes:
    """The message body that ends a frame (it runs to the end: checked when decoded)."""
    return body[reader.pos:]


@dataclass(frozen=True, slots=True)
class Hello:
    """First frame on a link, both ways: who the sender is, and the high watermark of each
    partition it leads."""

    index: int
    count: int
    token: str
    highs: Highs

    def encode(self) -> bytes:
        writer = Writer().u16(self.index).u16(self.count).text(self.token)
        return _write_highs(writer, self.highs).frame(FrameType.HELLO)

    @classmethod
    def decode(cls, body: bytes) -> Hello:
        reader = Reader(body)
        frame = cls(reader.u16(), reader.u16(), reader.text(), _read_highs(reader))
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class Routes:
    """Filters that gained their first or lost their last subscriber at the sender."""

    changes: list[RouteChange]

    def encode(self) -> bytes:
        writer = Writer().u32(len(self.changes))
        for added, group, topic_filter in self.changes:
            writer.u8(added).text(group).text(topic_filter)
        return writer.frame(FrameType.ROUTES)

    @classmethod
    def decode(cls, body: bytes) -> Routes:
        reader = Reader(body)
        changes = [(bool(reader.u8()), reader.text(), reader.text())
                   for _ in range(reader.u32())]
        reader.end()
        return cls(changes)


@dataclass(frozen=True, slots=True)
class Forward:
    """A publish for the receiver's subscribers, and the shared groups it must serve.

    The hot frame: ``forward_frame()`` builds it from a body encoded once for every peer."""

    groups: list[GroupKey]
    message: bytes
    relayed: bool = False  # passed on once already: not passed on again

    def encode(self) -> bytes:
        return forward_frame(self.groups, self.message, self.relayed)

    @classmethod
    def decode(cls, body: bytes) -> Forward:
        if body[:4] == b"\x00\x00\x00\x00":  # no groups: the hot case
            return cls([], body[4:])
        reader = Reader(body)
        count = reader.u32()
        groups = [(reader.text(), reader.text()) for _ in range(count & ~RELAYED)]
        return cls(groups, _rest(body, reader), bool(count & RELAYED))


class AppendEntry(NamedTuple):
    """One publish of an APPEND. ``message_id`` is the record's id, drawn by the requester;
    ``resend``: a publish resent after an answer that never came, which carries its first
    attempt's id, so that the leader recognises a message it stored already
    (cluster/partitions.py)."""

    request_id: int
    client_id: str  # the publisher's
    message_id: bytes  # 16 bytes (log/record.py)
    resend: bool
    message: bytes  # its body (broker/wire.py)


_ENTRY = struct.Struct(">Q16s?H")  # request id, message id, resend, client id length
_ANSWER = struct.Struct(">QBIQIB")  # request id, status, partition, offset, receivers, local?
_COUNT = struct.Struct(">I")
# A named tuple from a tuple of its fields, without its Python-level ``__new__`` (hot paths:
# ``new_named(AppendEntry, (request_id, client_id, message_id, resend, body))``).
new_named = tuple.__new__


@dataclass(frozen=True, slots=True)
class Append:
    """Request to a partition's leader: persist these publishes, route each once durable (the
    appends of one loop turn for one leader travel together). Hot: one entry per persisted
    publish that crosses, so its encoding is written with one ``struct`` per field group."""

    entries: list[AppendEntry]

    def encode(self) -> bytes:
        parts = [_COUNT.pack(len(self.entries))]
        append, entry, count = parts.append, _ENTRY.pack, _COUNT.pack
        for request_id, client_id, message_id, resend, message in self.entries:
            sender = client_id.encode("utf-8")
            append(entry(request_id, message_id, resend, len(sender)))
            append(sender)
            append(count(len(message)))
            append(message)
        body = b"".join(parts)
        return _HEADER.pack(len(body) + 1, FrameType.APPEND) + body

    @classmethod
    def decode(cls, body: bytes) -> Append:
        try:
            (number,) = _COUNT.unpack_from(body, 0)
            pos, size, entries = 4, len(body), []
            unpack_entry, unpack_count = _ENTRY.unpack_from, _COUNT.unpack_from
            for _ in range(number):
                request_id, message_id, resend, length = unpack_entry(body, pos)
                pos += 27
                client_id = body[pos:pos + length].decode("utf-8")
                pos += length
                (length,) = unpack_count(body, pos)
                pos += 4
                if pos + length > size:
                    raise WireError("body ends early")
                message = body[pos:pos + length]
                pos += length
                entries.append(new_named(AppendEntry, (request_id, client_id, message_id,
                                                       resend, message)))
        except struct.error:
            raise WireError("body ends early") from None
        except UnicodeDecodeError:
            raise WireError("string is not UTF-8") from None
        if pos != size:
            raise WireError("trailing bytes after the body")
        return cls(entries)


class AppendAnswer(NamedTuple):
    """One publish of an APPEND: stored (status 0) at ``partition``/``offset`` and routed to
    ``receivers`` by the leader, or refused with reason code ``status``. ``local``: the
    leader did not forward it to the requester, which delivers it to its own subscribers,
    serving these shared groups (None: nothing to deliver there, or it was forwarded)."""

    request_id: int
    status: int
    partition: int = 0
    offset: int = 0
    receivers: int = 0
    local: list[GroupKey] | None = None


@dataclass(frozen=True, slots=True)
class Appended:
    """Answers to APPEND entries (those of one loop turn for one requester travel together);
    as hot as ``Append``, and written the same way."""

    answers: list[AppendAnswer]

    def encode(self) -> bytes:
        parts = [_COUNT.pack(len(self.answers))]
        append, answer = parts.append, _ANSWER.pack
        for request_id, status, partition, offset, receivers, local in self.answers:
            append(answer(request_id, status, partition, offset, receivers, local is not None))
            if local == []:  # the common case: the requester's plain subscribers only
                append(b"\x00\x00\x00\x00")
            elif local is not None:
                writer = Writer().u32(len(local))
                for name, topic_filter in local:
                    writer.text(name).text(topic_filter)
                append(writer.bytes())
        body = b"".join(parts)
        return _HEADER.pack(len(body) + 1, FrameType.APPENDED) + body

    @classmethod
    def decode(cls, body: bytes) -> Appended:
        try:
            (number,) = _COUNT.unpack_from(body, 0)
            pos, answers, unpack = 4, [], _ANSWER.unpack_from
            for _ in range(number):
                request_id, status, partition, offset, receivers, has_local = unpack(body, pos)
                pos += 26
                local: list[GroupKey] | None = None
                if has_local:
                    if body[pos:pos + 4] == b"\x00\x00\x00\x00":  # the common case
                        local = []
                        pos += 4
                    else:
                        reader = Reader(body, pos)
                        local = [(reader.text(), reader.text()) for _ in range(reader.u32())]
                        pos = reader.pos
                answers.append(new_named(AppendAnswer, (request_id, status, partition, offset,
                                                        receivers, local)))
        except struct.error:
            raise WireError("body ends early") from None
        if pos != len(body):
            raise WireError("trailing bytes after the body")
        return cls(answers)


@dataclass(frozen=True, slots=True)
class Retain:
    """Request to a topic's owner: store (empty payload: clear) this retained message. With
    ``migrate`` (a copy from a worker that owned the topic under another worker count) only if
    the owner has none for that topic."""

    request_id: int
    migrate: bool
    message: bytes

    def encode(self) -> bytes:
        writer = Writer().u64(self.request_id).u8(self.migrate)
        writer.parts.append(self.message)
        return writer.frame(FrameType.RETAIN)

    @classmethod
    def decode(cls, body: bytes) -> Retain:
        reader = Reader(body)
        return cls(reader.u64(), bool(reader.u8()), _rest(body, reader))


@dataclass(frozen=True, slots=True)
class Reply:
    """Answer to APPEND or RETAIN: 0 or a reason code, where it was stored, receivers."""

    request_id: int
    status: int
    partition: int = 0
    offset: int = 0
    receivers: int = 0

    def encode(self) -> bytes:
        return (Writer().u64(self.request_id).u8(self.status).u32(self.partition)
                .u64(self.offset).u32(self.receivers).frame(FrameType.REPLY))

    @classmethod
    def decode(cls, body: bytes) -> Reply:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.u8(), reader.u32(), reader.u64(), reader.u32())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class QueryRetained:
    """Request: the retained messages the receiver owns that match these filters."""

    request_id: int
    filters: list[str]

    def encode(self) -> bytes:
        writer = Writer().u64(self.request_id).u16(len(self.filters))
        for topic_filter in self.filters:
            writer.text(topic_filter)
        return writer.frame(FrameType.QUERY_RETAINED)

    @classmethod
    def decode(cls, body: bytes) -> QueryRetained:
        reader = Reader(body)
        request_id = reader.u64()
        filters = [reader.text() for _ in range(reader.u16())]
        reader.end()
        return cls(request_id, filters)


@dataclass(frozen=True, slots=True)
class Retained:
    """Answer to QUERY_RETAINED: (index of the filter, encoded message) pairs."""

    request_id: int
    found: list[tuple[int, bytes]]

    def encode(self) -> bytes:
        writer = Writer().u64(self.request_id).u32(len(self.found))
        for index, message in self.found:
            writer.u16(index).blob(message)
        return writer.frame(FrameType.RETAINED)

    @classmethod
    def decode(cls, body: bytes) -> Retained:
        reader = Reader(body)
        request_id = reader.u64()
        found = [(reader.u16(), reader.blob()) for _ in range(reader.u32())]
        reader.end()
        return cls(request_id, found)


@dataclass(frozen=True, slots=True)
class Claim:
    """A connection for ``client_id`` arrived at the sender: to the client id's owner, which
    has the worker holding the session hand it over (or end it, with ``clean_start``)."""

    request_id: int
    client_id: str
    clean_start: bool

    def encode(self) -> bytes:
        return (Writer().u64(self.request_id).text(self.client_id).u8(self.clean_start)
                .frame(FrameType.CLAIM))

    @classmethod
    def decode(cls, body: bytes) -> Claim:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.text(), bool(reader.u8()))
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class Release:
    """From a client id's owner to the worker holding the session: disconnect it and hand
    the session over for worker ``to`` (or end it, with ``clean_start``)."""

    request_id: int
    client_id: str
    clean_start: bool
    to: int

    def encode(self) -> bytes:
        return (Writer().u64(self.request_id).text(self.client_id).u8(self.clean_start)
                .u16(self.to).frame(FrameType.RELEASE))

    @classmethod
    def decode(cls, body: bytes) -> Release:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.text(), bool(reader.u8()), reader.u16())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class Claimed:
    """Answer to CLAIM or RELEASE: ``status`` (CLAIM_*), the workers that held the session and
    the sessions they handed over (normally one; two after a crash in a hand-over)."""

    request_id: int
    status: int
    holders: list[int]
    sessions: list[bytes]

    def encode(self) -> bytes:
        writer = Writer().u64(self.request_id).u8(self.status).u16(len(self.holders))
        for holder in self.holders:
            writer.u16(holder)
        writer.u32(len(self.sessions))
        for session in self.sessions:
            writer.blob(session)
        return writer.frame(FrameType.CLAIMED)

    @classmethod
    def decode(cls, body: bytes) -> Claimed:
        reader = Reader(body)
        request_id, status = reader.u64(), reader.u8()
        holders = [reader.u16() for _ in range(reader.u16())]
        sessions = [reader.blob() for _ in range(reader.u32())]
        reader.end()
        return cls(request_id, status, holders, sessions)


@dataclass(frozen=True, slots=True)
class Register:
    """To a client id's owner: sessions the sender now holds (or no longer holds). With
    ``complete``: every session the sender restored has been listed."""

    added: list[str]
    removed: list[str]
    complete: bool = False

    def encode(self) -> bytes:
        writer = Writer().u8(self.complete).u32(len(self.added))
        for client_id in self.added:
            writer.text(client_id)
        writer.u32(len(self.removed))
        for client_id in self.removed:
            writer.text(client_id)
        return writer.frame(FrameType.REGISTER)

    @classmethod
    def decode(cls, body: bytes) -> Register:
        reader = Reader(body)
        complete = bool(reader.u8())
        added = [reader.text() for _ in range(reader.u32())]
        removed = [reader.text() for _ in range(reader.u32())]
        reader.end()
        return cls(added, removed, complete)


@dataclass(frozen=True, slots=True)
class Sync:
    """Request to a partition leader: your high watermarks, after everything sent before."""

    request_id: int

    def encode(self) -> bytes:
        return Writer().u64(self.request_id).frame(FrameType.SYNC)

    @classmethod
    def decode(cls, body: bytes) -> Sync:
        reader = Reader(body)
        frame = cls(reader.u64())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class Synced:
    """Answer to SYNC: the high watermark of each partition the sender leads."""

    request_id: int
    highs: Highs

    def encode(self) -> bytes:
        return _write_highs(Writer().u64(self.request_id), self.highs).frame(FrameType.SYNCED)

    @classmethod
    def decode(cls, body: bytes) -> Synced:
        reader = Reader(body)
        frame = cls(reader.u64(), _read_highs(reader))
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class Stats:
    """A worker's counters, for the node's ``$SYS`` totals."""

    values: dict[str, int]

    def encode(self) -> bytes:
        return _counters(Writer(), self.values).frame(FrameType.STATS)

    @classmethod
    def decode(cls, body: bytes) -> Stats:
        reader = Reader(body)
        values = _read_counters(reader)
        reader.end()
        return cls(values)


def _counters(writer: Writer, values: dict[str, int]) -> Writer:
    """Counters: their names, then their values (none below 0)."""
    writer.u16(len(values))
    for name in values:
        writer.text(name)
    writer.offsets([max(0, int(v)) for v in values.values()])
    return writer


def _read_counters(reader: Reader) -> dict[str, int]:
    names = [reader.text() for _ in range(reader.u16())]
    values = reader.offsets()
    if len(values) != len(names):
        raise LinkError("stats: names and values differ in number")
    return dict(zip(names, values, strict=True))


@dataclass(frozen=True, slots=True)
class Barrier:
    """Request: answer once everything sent before (route changes above all) is applied;
    ``nodes``: and once the other nodes linked to the receiver have applied its node's routes
    (cluster/mesh.py)."""

    request_id: int
    nodes: bool = False

    def encode(self) -> bytes:
        return Writer().u64(self.request_id).u8(self.nodes).frame(FrameType.BARRIER)

    @classmethod
    def decode(cls, body: bytes) -> Barrier:
        reader = Reader(body)
        frame = cls(reader.u64(), bool(reader.u8()))
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class BarrierDone:
    """Answer to BARRIER, with the high watermarks of the partitions the sender leads."""

    request_id: int
    highs: Highs

    def encode(self) -> bytes:
        return _write_highs(Writer().u64(self.request_id), self.highs).frame(
            FrameType.BARRIER_DONE)

    @classmethod
    def decode(cls, body: bytes) -> BarrierDone:
        reader = Reader(body)
        frame = cls(reader.u64(), _read_highs(reader))
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class Deliver:
    """A message for one session that moved to the receiver (cluster/moving.py)."""

    client_id: str
    qos: int
    retain: bool
    subscription_ids: list[int]
    group: GroupKey | None
    message: bytes

    def encode(self) -> bytes:
        name, topic_filter = self.group or ("", "")
        writer = (Writer().text(self.client_id).u8(self.qos).u8(self.retain)
                  .offsets(self.subscription_ids).text(name).text(topic_filter))
        writer.parts.append(self.message)
        return writer.frame(FrameType.DELIVER)

    @classmethod
    def decode(cls, body: bytes) -> Deliver:
        reader = Reader(body)
        client_id, qos, retain = reader.text(), reader.u8(), bool(reader.u8())
        ids = reader.offsets()
        name, topic_filter = reader.text(), reader.text()
        if qos > 2:
            raise LinkError("deliver: bad QoS")
        group = (name, topic_filter) if name else None
        return cls(client_id, qos, retain, ids, group, _rest(body, reader))


@dataclass(frozen=True, slots=True)
class Settled:
    """A session handed over to the sender is in place, its routes sent: drop the stand-in."""

    client_id: str

    def encode(self) -> bytes:
        return Writer().text(self.client_id).frame(FrameType.SETTLED)

    @classmethod
    def decode(cls, body: bytes) -> Settled:
        reader = Reader(body)
        frame = cls(reader.text())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class Admin:
    """Request: answer the operations plane's ``query`` (a name) with ``args`` (JSON)."""

    request_id: int
    query: str
    args: bytes

    def encode(self) -> bytes:
        return (Writer().u64(self.request_id).text(self.query).blob(self.args)
                .frame(FrameType.ADMIN))

    @classmethod
    def decode(cls, body: bytes) -> Admin:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.text(), reader.blob())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class AdminAnswer:
    """Answer to ADMIN: the result as JSON (opaque here, as a message body is)."""

    request_id: int
    result: bytes

    def encode(self) -> bytes:
        return Writer().u64(self.request_id).blob(self.result).frame(FrameType.ADMIN_ANSWER)

    @classmethod
    def decode(cls, body: bytes) -> AdminAnswer:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.blob())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class LinkHello:
    """First frame on a link between nodes, both ways (cluster/nodelink.py): the protocol
    version, the cluster's id (empty while the sender has none yet), the node, its
    incarnation (drawn at each start), the sending worker and the node's worker count, and a
    fresh nonce the peer's LINK_AUTH must cover."""

    version: int
    cluster_id: str
    node_id: str
    incarnation: int
    worker: int
    workers: int
    nonce: bytes
    address: str  # the sender node's address (cluster.advertise), for the others to dial

    def encode(self) -> bytes:
        return (Writer().u16(self.version).text(self.cluster_id).text(self.node_id)
                .u64(self.incarnation).u16(self.worker).u16(self.workers).blob(self.nonce)
                .text(self.address).frame(FrameType.LINK_HELLO))

    @classmethod
    def decode(cls, body: bytes) -> LinkHello:
        reader = Reader(body)
        frame = cls(reader.u16(), reader.text(), reader.text(), reader.u64(), reader.u16(),
                    reader.u16(), reader.blob(), reader.text())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class LinkAuth:
    """The sender's proof that it knows the cluster secret: an HMAC over both nonces and both
    identities (cluster/nodelink.py)."""

    mac: bytes

    def encode(self) -> bytes:
        return Writer().blob(self.mac).frame(FrameType.LINK_AUTH)

    @classmethod
    def decode(cls, body: bytes) -> LinkAuth:
        reader = Reader(body)
        frame = cls(reader.blob())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class Ping:
    """A link between nodes is alive; sent when nothing else was for a while."""

    def encode(self) -> bytes:
        return Writer().frame(FrameType.PING)

    @classmethod
    def decode(cls, body: bytes) -> Ping:
        Reader(body).end()
        return cls()


@dataclass(frozen=True, slots=True)
class Members:
    """The nodes the sender knows (itself included): node id and the address it is dialed
    at, so that a node joining through one seed finds the others."""

    members: list[tuple[str, str]]

    def encode(self) -> bytes:
        writer = Writer().u32(len(self.members))
        for node_id, address in self.members:
            writer.text(node_id).text(address)
        return writer.frame(FrameType.MEMBERS)

    @classmethod
    def decode(cls, body: bytes) -> Members:
        reader = Reader(body)
        members = [(reader.text(), reader.text()) for _ in range(reader.u32())]
        reader.end()
        return cls(members)


@dataclass(frozen=True, slots=True)
class ForwardAck:
    """From the accepting end of a link between nodes: it has handled the link's first
    ``count`` FORWARD and RETAIN_SYNC frames (cluster/resend.py)."""

    count: int

    def encode(self) -> bytes:
        return Writer().u64(self.count).frame(FrameType.FORWARD_ACK)

    @classmethod
    def decode(cls, body: bytes) -> ForwardAck:
        reader = Reader(body)
        count = reader.u64()
        reader.end()
        return cls(count)


@dataclass(frozen=True, slots=True)
class Takeover:
    """A CONNECT for ``client_id`` on the sender's node with ``stamp`` (its owner epoch, else
    the sender's wall time in ns: cluster/sessionowner.py): a
    connection of that client id on the receiver's node that is older is closed with
    DISCONNECT 0x8E, and with ``clean_start`` its session ends (cluster/takeover.py)."""

    client_id: str
    clean_start: bool
    stamp: int

    def encode(self) -> bytes:
        return Writer().text(self.client_id).u8(self.clean_start).u64(self.stamp).frame(
            FrameType.TAKEOVER)

    @classmethod
    def decode(cls, body: bytes) -> Takeover:
        reader = Reader(body)
        client_id, clean_start, stamp = reader.text(), bool(reader.u8()), reader.u64()
        reader.end()
        return cls(client_id, clean_start, stamp)


@dataclass(frozen=True, slots=True)
class Forget:
    """Node ``node_id`` left the cluster (``meshmq cluster leave``) or an operator removed it
    (``meshmq cluster forget``): the receiver stops dialing it and drops it from its members
    until it links again itself."""

    node_id: str

    def encode(self) -> bytes:
        return Writer().text(self.node_id).frame(FrameType.FORGET)

    @classmethod
    def decode(cls, body: bytes) -> Forget:
        reader = Reader(body)
        node_id = reader.text()
        reader.end()
        return cls(node_id)


@dataclass(frozen=True, slots=True)
class NodeStats:
    """A node's ``$SYS`` totals (its statistics owner's), sent to the other nodes every
    ``mqtt.sys_interval`` for the cluster's figures (cluster/nodestats.py)."""

    node_id: str
    values: dict[str, int]

    def encode(self) -> bytes:
        return _counters(Writer().text(self.node_id), self.values).frame(FrameType.NODE_STATS)

    @classmethod
    def decode(cls, body: bytes) -> NodeStats:
        reader = Reader(body)
        node_id = reader.text()
        values = _read_counters(reader)
        reader.end()
        return cls(node_id, values)


@dataclass(frozen=True, slots=True)
class RetainSync:
    """Retained messages for the receiver's node: ``(topic, stamp, node, body)`` entries, a
    body of None being a clear. Sent by a topic's owner to the other nodes when a client of
    its node changes it, and all of them when a link to a node comes up; passed on by the
    receiving worker to the topic's owner in its node, which keeps the newest by stamp
    (cluster/noderetained.py)."""

    entries: list[tuple[str, int, str, bytes | None]]

    def encode(self) -> bytes:
        writer = Writer().u32(len(self.entries))
        for topic, stamp, node_id, body in self.entries:
            writer.text(topic).u64(stamp).text(node_id).u8(body is not None)
            if body is not None:
                writer.blob(body)
        return writer.frame(FrameType.RETAIN_SYNC)

    @classmethod
    def decode(cls, body: bytes) -> RetainSync:
        reader = Reader(body)
        entries = []
        for _ in range(reader.u32()):
            topic, stamp, node_id = reader.text(), reader.u64(), reader.text()
            entries.append((topic, stamp, node_id, reader.blob() if reader.u8() else None))
        reader.end()
        return cls(entries)


# ---------------------------------------------------------------------- appends across nodes


class NodeAppendEntry(NamedTuple):
    """One publish of a NODE_APPEND: for ``partition``, whose leader the sender takes the
    receiver's node to be at ``leader_epoch`` (cluster/nodeappends.py)."""

    request_id: int
    partition: int
    leader_epoch: int
    client_id: str  # the publisher's
    message_id: bytes  # 16 bytes, drawn by the sender (log/record.py)
    resend: bool  # a resend after an unknown outcome: the leader looks its id up first
    message: bytes  # its body (broker/wire.py)


@dataclass(frozen=True, slots=True)
class NodeAppend:
    """Request to a partition's leader node: persist these publishes and route each once
    durable (those of one loop turn for one node travel together)."""

    entries: list[NodeAppendEntry]

    def encode(self) -> bytes:
        writer = Writer().u32(len(self.entries))
        for request_id, partition, epoch, client_id, message_id, resend, body in self.entries:
            writer.u64(request_id).u32(partition).u32(epoch).text(client_id)
            writer.blob(message_id).u8(resend).blob(body)
        return writer.frame(FrameType.NODE_APPEND)

    @classmethod
    def decode(cls, body: bytes) -> NodeAppend:
        reader = Reader(body)
        entries = []
        for _ in range(reader.u32()):
            request_id, partition, epoch = reader.u64(), reader.u32(), reader.u32()
            client_id, message_id = reader.text(), reader.blob()
            entries.append(NodeAppendEntry(request_id, partition, epoch, client_id, message_id,
                                           bool(reader.u8()), reader.blob()))
        reader.end()
        return cls(entries)


class NodeAppendAnswer(NamedTuple):
    """The outcome of one NODE_APPEND entry: ``status`` 0, stored at ``offset`` and routed to
    ``receivers``; ``NOT_LEADER``, not stored: the receiver's node does not lead the partition
    at that epoch, and ``hint_node``/``hint_epoch`` say who does as far as it knows (``""``:
    nobody yet); ``OUTCOME_UNKNOWN``: perhaps stored (inside the leader node, the link to the
    partition's worker dropped); or a reason code (0x80 and up): refused, not stored."""

    request_id: int
    status: int
    offset: int = 0
    receivers: int = 0
    hint_node: str = ""
    hint_epoch: int = 0


NOT_LEADER = 1  # NodeAppendAnswer.status: not stored, ask the hinted leader
OUTCOME_UNKNOWN = 2  # ... perhaps stored


@dataclass(frozen=True, slots=True)
class NodeAppended:
    """Answers to NODE_APPEND entries, on the link the request came on."""

    answers: list[NodeAppendAnswer]

    def encode(self) -> bytes:
        writer = Writer().u32(len(self.answers))
        for request_id, status, offset, receivers, hint_node, hint_epoch in self.answers:
            writer.u64(request_id).u8(status).u64(offset).u32(receivers)
            writer.text(hint_node).u32(hint_epoch)
        return writer.frame(FrameType.NODE_APPENDED)

    @classmethod
    def decode(cls, body: bytes) -> NodeAppended:
        reader = Reader(body)
        answers = [NodeAppendAnswer(reader.u64(), reader.u8(), reader.u64(), reader.u32(),
                                    reader.text(), reader.u32()) for _ in range(reader.u32())]
        reader.end()
        return cls(answers)


@dataclass(frozen=True, slots=True)
class ForwardAt:
    """A FORWARD between nodes of a record of a partition led by the sender's node, with its
    place in that partition (``partition``, ``offset``): the receiver remembers the last place
    it got per partition, to ask for what came after should the leader node restart
    (cluster/catchup.py). The message body itself carries no position."""

    partition: int
    offset: int
    forward: Forward

    def encode(self) -> bytes:
        return forward_at_frame((self.partition, self.offset), self.forward.groups,
                                self.forward.message, self.forward.relayed)

    @classmethod
    def decode(cls, body: bytes) -> ForwardAt:
        if len(body) < 12:
            raise LinkError("FORWARD_AT ends early")
        partition, offset = _PLACE.unpack_from(body, 0)
        return cls(partition, offset, Forward.decode(body[12:]))


_PLACE = struct.Struct(">IQ")


def forward_at_frame(place: tuple[int, int] | None, groups: list[GroupKey], body: bytes,
                     relayed: bool = False) -> bytes:
    """FORWARD_AT: the record's place (partition, offset), then a FORWARD's body; without a
    place, a plain FORWARD."""
    inner = forward_frame(groups, body, relayed)
    if place is None:
        return inner
    return (_HEADER.pack(len(inner) - 4 + 12, FrameType.FORWARD_AT)
            + _PLACE.pack(*place) + inner[5:])


@dataclass(frozen=True, slots=True)
class Fetch:
    """To a partition's leader node that restarted: node ``node_id`` got each partition's
    records up to ``after`` (inclusive) before the restart; the leader forwards it again the
    records after that which match its routes, up to where its log ended when it started."""

    node_id: str
    partitions: list[tuple[int, int]]  # (partition, the last offset got)

    def encode(self) -> bytes:
        writer = Writer().text(self.node_id).u32(len(self.partitions))
        for partition, after in self.partitions:
            writer.u32(partition).u64(after)
        return writer.frame(FrameType.FETCH)

    @classmethod
    def decode(cls, body: bytes) -> Fetch:
        reader = Reader(body)
        node_id = reader.text()
        partitions = [(reader.u32(), reader.u64()) for _ in range(reader.u32())]
        reader.end()
        return cls(node_id, partitions)


# ---------------------------------------------------------------------- reading another node's log

READ_HIGHS = 0  # LOG_READ: the high watermarks (and earliest offsets) of the node's partitions
READ_RECORDS = 1  # LOG_READ: records of one partition from an offset
DATA_OK = 0
DATA_OUT_OF_RANGE = 1  # LOG_DATA: the offset is below the earliest kept (``earliest`` says it)
DATA_NOT_LEADER = 2  # LOG_DATA: the receiver's node does not lead that partition


@dataclass(frozen=True, slots=True)
class LogRead:
    """To a node that leads partitions (cluster/remotelog.py): ``READ_HIGHS``: the high
    watermark and earliest offset of each partition it leads (and, ``timestamp_ms`` >= 0, the
    first offset stored at or after it), as of after everything sent to it before;
    ``READ_RECORDS``: records of ``partition`` from ``offset``, at most ``max_records``."""

    request_id: int
    kind: int
    partition: int = 0
    offset: int = 0
    max_records: int = 0
    timestamp_ms: int = -1

    def encode(self) -> bytes:
        return (Writer().u64(self.request_id).u8(self.kind).u32(self.partition)
                .u64(self.offset).u32(self.max_records).u64(self.timestamp_ms + 1)
                .frame(FrameType.LOG_READ))

    @classmethod
    def decode(cls, body: bytes) -> LogRead:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.u8(), reader.u32(), reader.u64(), reader.u32(),
                    reader.u64() - 1)
        reader.end()
        if frame.kind > READ_RECORDS:
            raise LinkError("log read: bad kind")
        return frame


PartitionEnds = tuple[int, int, int, int]  # partition, high watermark, earliest, at timestamp


@dataclass(frozen=True, slots=True)
class LogData:
    """Answer to LOG_READ: ``status``; for ``READ_HIGHS`` one ``PartitionEnds`` per partition
    the node leads (the offset at the timestamp: -1 if none); for ``READ_RECORDS`` the
    partition's ends and ``batches``, log record batches as a segment holds them."""

    request_id: int
    status: int
    ends: list[PartitionEnds]
    batches: bytes = b""

    def encode(self) -> bytes:
        writer = Writer().u64(self.request_id).u8(self.status).u32(len(self.ends))
        for partition, high, earliest, at in self.ends:
            writer.u32(partition).u64(high).u64(earliest).u64(at + 1)
        return writer.blob(self.batches).frame(FrameType.LOG_DATA)

    @classmethod
    def decode(cls, body: bytes) -> LogData:
        reader = Reader(body)
        request_id, status = reader.u64(), reader.u8()
        ends = [(reader.u32(), reader.u64(), reader.u64(), reader.u64() - 1)
                for _ in range(reader.u32())]
        batches = reader.blob()
        reader.end()
        return cls(request_id, status, ends, batches)


@dataclass(frozen=True, slots=True)
class SessionOwner:
    """To the owner of ``client_id``'s session (the leader node of its partition, there its
    owner worker; cluster/sessionowner.py): a CONNECT of it is claiming the session, give it
    the next owner epoch."""

    request_id: int
    client_id: str

    def encode(self) -> bytes:
        return Writer().u64(self.request_id).text(self.client_id).frame(FrameType.SESSION_OWNER)

    @classmethod
    def decode(cls, body: bytes) -> SessionOwner:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.text())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class SessionOwned:
    """Answer to SESSION_OWNER: the claim's owner epoch (0: the owner could not give one)."""

    request_id: int
    epoch: int

    def encode(self) -> bytes:
        return Writer().u64(self.request_id).u64(self.epoch).frame(FrameType.SESSION_OWNED)

    @classmethod
    def decode(cls, body: bytes) -> SessionOwned:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.u64())
        reader.end()
        return frame


# ---------------------------------------------------------------------- services
#
# Request/reply between the worker processes of a node (services/layer.py): a service worker
# is connected to one process, its service dispatched by the leader of the service's partition.

ServiceHolding = list[tuple[str, int]]  # (request id, retry) a service worker holds
ServiceOfferEntry = tuple[str, str, int, int, ServiceHolding]  # service, client, serial, credit


@dataclass(frozen=True, slots=True)
class ServiceOffer:
    """To a service's dispatcher: service worker ``client_id`` (offer ``serial``) offers
    ``service`` with ``capacity`` requests at once (0: withdrawn)."""

    service: str
    client_id: str
    serial: int
    capacity: int

    def encode(self) -> bytes:
        return (Writer().text(self.service).text(self.client_id).u64(self.serial)
                .u32(self.capacity).frame(FrameType.SERVICE_OFFER))

    @classmethod
    def decode(cls, body: bytes) -> ServiceOffer:
        reader = Reader(body)
        frame = cls(reader.text(), reader.text(), reader.u64(), reader.u32())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class ServiceSync:
    """Sent on each new link: every offer the sender has for the receiver's services, each
    with the requests its service worker holds (what it was given and has not answered)."""

    offers: list[ServiceOfferEntry]

    def encode(self) -> bytes:
        writer = Writer().u32(len(self.offers))
        for service, client_id, serial, capacity, holding in self.offers:
            writer.text(service).text(client_id).u64(serial).u32(capacity).u32(len(holding))
            for request_id, retry in holding:
                writer.text(request_id).u32(retry)
        return writer.frame(FrameType.SERVICE_SYNC)

    @classmethod
    def decode(cls, body: bytes) -> ServiceSync:
        reader = Reader(body)
        offers = []
        for _ in range(reader.u32()):
            service, client_id, serial, capacity = (reader.text(), reader.text(), reader.u64(),
                                                    reader.u32())
            holding = [(reader.text(), reader.u32()) for _ in range(reader.u32())]
            offers.append((service, client_id, serial, capacity, holding))
        reader.end()
        return cls(offers)


@dataclass(frozen=True, slots=True)
class ServiceRequest:
    """From a dispatcher: attempt ``retry`` of request ``request`` for service worker
    ``client_id`` (offer ``serial``) connected to the receiver; the message as it is to be
    delivered (envelope included), encoded as broker/wire.py does."""

    service: str
    client_id: str
    serial: int
    request: str  # the request's id (services/envelope.py)
    retry: int
    dup: bool
    message: bytes

    def encode(self) -> bytes:
        writer = (Writer().text(self.service).text(self.client_id).u64(self.serial)
                  .text(self.request).u32(self.retry).u8(self.dup))
        writer.parts.append(self.message)
        return writer.frame(FrameType.SERVICE_REQUEST)

    @classmethod
    def decode(cls, body: bytes) -> ServiceRequest:
        reader = Reader(body)
        service, client_id, serial = reader.text(), reader.text(), reader.u64()
        request, retry, dup = reader.text(), reader.u32(), reader.u8()
        if dup > 1:
            raise LinkError("service request: bad dup flag")
        return cls(service, client_id, serial, request, retry, bool(dup),
                   _rest(body, reader))


@dataclass(frozen=True, slots=True)
class ServiceReply:
    """To a dispatcher: a reply to ``request`` from service worker ``client_id``'s
    attempt ``retry`` (-1: not known), recognised here by (response topic, correlation data),
    or (``expected`` set) by its request id only, and then to be checked against the request.
    ``service`` is empty when not known here."""

    frame_id: int  # this frame's id, for its answer
    service: str
    request: str  # the request's id (services/envelope.py)
    client_id: str
    retry: int
    expected: tuple[str, bytes | None] | None
    message: bytes

    def encode(self) -> bytes:
        writer = (Writer().u64(self.frame_id).text(self.service).text(self.request)
                  .text(self.client_id).u32(self.retry + 1))
        if self.expected is None:
            writer.u8(0)
        else:
            topic, correlation = self.expected
            writer.u8(1 if correlation is None else 2).text(topic)
            if correlation is not None:
                writer.blob(correlation)
        writer.parts.append(self.message)
        return writer.frame(FrameType.SERVICE_REPLY)

    @classmethod
    def decode(cls, body: bytes) -> ServiceReply:
        reader = Reader(body)
        frame_id, service, request = reader.u64(), reader.text(), reader.text()
        client_id, retry, kind = reader.text(), reader.u32() - 1, reader.u8()
        expected: tuple[str, bytes | None] | None = None
        if kind > 2:
            raise LinkError("service reply: bad expectation kind")
        if kind:
            topic = reader.text()
            expected = (topic, reader.blob() if kind == 2 else None)
        return cls(frame_id, service, request, client_id, retry, expected,
                   _rest(body, reader))


@dataclass(frozen=True, slots=True)
class ServiceReplied:
    """Answer to SERVICE_REPLY: ``verdict`` (accepted, routed, late, unknown, mismatch or
    refused: services/dispatcher.py)."""

    frame_id: int
    verdict: str

    def encode(self) -> bytes:
        return (Writer().u64(self.frame_id).text(self.verdict)
                .frame(FrameType.SERVICE_REPLIED))

    @classmethod
    def decode(cls, body: bytes) -> ServiceReplied:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.text())
        reader.end()
        return frame


# ---------------------------------------------------------------------- sessions across nodes
#
# cluster/nodesessions.py: a CONNECT with Clean Start 0 fetches its session from the node that
# holds it; the session crosses in parts of at most ``nodesessions.PART_BYTES`` each.

SESSION_NONE, SESSION_HANDED, SESSION_SETTLED = 0, 1, 2  # SessionPart.status
MOVED_SETTLE, MOVED_DELIVER = 0, 1  # SessionMoved.kind


@dataclass(frozen=True, slots=True)
class SessionFetch:
    """To another node: a client connected on the sender's node with ``stamp`` (as in
    TAKEOVER) and Clean Start 0: hand its session over if the receiver's node holds it
    (and no newer connection of it is there)."""

    request_id: int
    client_id: str
    stamp: int

    def encode(self) -> bytes:
        return (Writer().u64(self.request_id).text(self.client_id).u64(self.stamp)
                .frame(FrameType.SESSION_FETCH))

    @classmethod
    def decode(cls, body: bytes) -> SessionFetch:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.text(), reader.u64())
        reader.end()
        return frame


@dataclass(frozen=True, slots=True)
class SessionPart:
    """Answer to SESSION_FETCH (``status`` SESSION_HANDED: the session's hand-over bytes,
    ``part`` of ``parts`` frames; SESSION_NONE: not here) or to a SESSION_MOVED settle
    (SESSION_SETTLED: the stand-in is gone and its routes withdrawn everywhere)."""

    request_id: int
    status: int
    part: int
    parts: int
    chunk: bytes

    def encode(self) -> bytes:
        return (Writer().u64(self.request_id).u8(self.status).u32(self.part).u32(self.parts)
                .blob(self.chunk).frame(FrameType.SESSION_PART))

    @classmethod
    def decode(cls, body: bytes) -> SessionPart:
        reader = Reader(body)
        frame = cls(reader.u64(), reader.u8(), reader.u32(), reader.u32(), reader.blob())
        reader.end()
        if frame.status > SESSION_SETTLED:
            raise LinkError("session part: bad status")
        if frame.part >= max(frame.parts, 1):
            raise LinkError("session part: part out of range")
        return frame


@dataclass(frozen=True, slots=True)
class SessionMoved:
    """A session that crossed to another node. ``kind`` MOVED_SETTLE (a request, from the
    node that took it: it is in place there, drop the stand-in) or MOVED_DELIVER (from the
    stand-in, on the link the session went: a message routed to it meanwhile, with its
    ``qos``, ``retain``, ``subscription_ids``, ``group`` and ``body``)."""

    kind: int
    request_id: int
    client_id: str
    qos: int = 0
    retain: bool = False
    subscription_ids: list[int] = field(default_factory=list)
    group: GroupKey | None = None
    body: bytes = b""

    def encode(self) -> bytes:
        name, topic_filter = self.group or ("", "")
        return (Writer().u8(self.kind).u64(self.request_id).text(self.client_id).u8(self.qos)
                .u8(self.retain).offsets(self.subscription_ids).text(name).text(topic_filter)
                .blob(self.body).frame(FrameType.SESSION_MOVED))

    @classmethod
    def decode(cls, body: bytes) -> SessionMoved:
        reader = Reader(body)
        kind, request_id, client_id = reader.u8(), reader.u64(), reader.text()
        qos, retain, ids = reader.u8(), bool(reader.u8()), reader.offsets()
        name, topic_filter = reader.text(), reader.text()
        message = reader.blob()
        reader.end()
        if kind > MOVED_DELIVER:
            raise LinkError("session moved: bad kind")
        if qos > 2:
            raise LinkError("session moved: bad QoS")
        group = (name, topic_filter) if name else None
        return cls(kind, request_id, client_id, qos, retain, ids, group, message)


Frame = (Hello | Routes | Forward | Append | Appended | Retain | Reply | QueryRetained
         | Retained | Claim | Release | Claimed | Register | Sync | Synced | Stats | Barrier
         | BarrierDone | Deliver | Settled | Admin | AdminAnswer | LinkHello | LinkAuth | Ping
         | Members | RetainSync | NodeStats | Forget | Takeover | ForwardAck | ServiceOffer
         | ServiceSync | ServiceRequest | ServiceReply | ServiceReplied | SessionFetch
         | SessionPart | SessionMoved | NodeAppend | NodeAppended | ForwardAt | Fetch
         | LogRead | LogData | SessionOwner | SessionOwned)

FRAMES: dict[int, type[Frame]] = {
    FrameType.HELLO: Hello, FrameType.ROUTES: Routes, FrameType.FORWARD: Forward,
    FrameType.APPEND: Append, FrameType.APPENDED: Appended, FrameType.RETAIN: Retain,
    FrameType.REPLY: Reply,
    FrameType.QUERY_RETAINED: QueryRetained, FrameType.RETAINED: Retained,
    FrameType.CLAIM: Claim, FrameType.RELEASE: Release, FrameType.CLAIMED: Claimed,
    FrameType.REGISTER: Register, FrameType.SYNC: Sync, FrameType.SYNCED: Synced,
    FrameType.STATS: Stats, FrameType.BARRIER: Barrier, FrameType.BARRIER_DONE: BarrierDone,
    FrameType.DELIVER: Deliver, FrameType.SETTLED: Settled,
    FrameType.ADMIN: Admin, FrameType.ADMIN_ANSWER: AdminAnswer,
    FrameType.LINK_HELLO: LinkHello, FrameType.LINK_AUTH: LinkAuth, FrameType.PING: Ping,
    FrameType.MEMBERS: Members, FrameType.RETAIN_SYNC: RetainSync,
    FrameType.NODE_STATS: NodeStats, FrameType.FORGET: Forget, FrameType.TAKEOVER: Takeover,
    FrameType.FORWARD_ACK: ForwardAck,
    FrameType.SERVICE_OFFER: ServiceOffer,
    FrameType.SERVICE_SYNC: ServiceSync, FrameType.SERVICE_REQUEST: ServiceRequest,
    FrameType.SERVICE_REPLY: ServiceReply, FrameType.SERVICE_REPLIED: ServiceReplied,
    FrameType.SESSION_FETCH: SessionFetch, FrameType.SESSION_PART: SessionPart,
    FrameType.SESSION_MOVED: SessionMoved,
    FrameType.NODE_APPEND: NodeAppend, FrameType.NODE_APPENDED: NodeAppended,
    FrameType.FORWARD_AT: ForwardAt, FrameType.FETCH: Fetch,
    FrameType.LOG_READ: LogRead, FrameType.LOG_DATA: LogData,
    FrameType.SESSION_OWNER: SessionOwner, FrameType.SESSION_OWNED: SessionOwned,
}


def decode_frame(frame_type: int, body: bytes) -> Frame:
    """The frame of ``frame_type`` in ``body`` (``LinkError`` if it does not decode)."""
    frame_class = FRAMES.get(frame_type)
    if frame_class is None:  # a peer's type byte, even when no FrameReader checked it
        raise LinkError(f"unknown frame type {frame_type}")
    return frame_class.decode(body)


# ---------------------------------------------------------------------- the stream


class FrameReader:
    """Splits a byte stream into ``(type, body)`` frames (sans-I/O). A frame longer than
    ``max_frame`` is a ``LinkError`` as soon as its header is read (the mesh keeps it small
    until the peer's HELLO has arrived)."""

    __slots__ = ("_buffer", "max_frame")

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buffer = bytearray()
        self.max_frame = max_frame

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        buffer = self._buffer
        if buffer:
            buffer += data
            source: bytes | bytearray = buffer
        else:
            source = data  # the common case: slice the bytes as they came, one copy per frame
        frames = []
        pos = 0
        size = len(source)
        unpack = _HEADER.unpack_from
        known = KNOWN_TYPES
        max_frame = self.max_frame
        while size - pos >= 5:
            length, frame_type = unpack(source, pos)
            if length < 1 or length > max_frame:
                raise LinkError(f"frame length {length} out of range")
            if frame_type not in known:
                raise LinkError(f"unknown frame type {frame_type}")
            end = pos + 4 + length
            if end > size:
                break
            frames.append((frame_type, bytes(source[pos + 5:end])))
            pos = end
        if source is buffer:
            if pos:
                del buffer[:pos]
        elif pos < size:
            buffer += data[pos:]
        return frames
