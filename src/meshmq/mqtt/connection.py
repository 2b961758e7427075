"""Server side of one MQTT connection, sans I/O.

Theory of operation
-------------------
Feed bytes with ``receive_data()``; take decoded, validated packets from ``events_received()``;
write what ``data_to_send()`` returns. The broker answers events with ``send_*()`` calls.

States (compared by identity)::

    AWAIT_CONNECT --CONNECT--> CONNECTING --send_connack(success)--> CONNECTED
         |                          |                                    |
         +------- protocol error / failed CONNACK / DISCONNECT ---------> CLOSED

This object enforces every rule that needs only the bytes and this connection's state: first
packet is CONNECT (MQTT-3.1.0-1) and only once (MQTT-3.1.0-2), our maximum packet size (checked
from the fixed header, before the body is buffered), inbound topic aliases, topic names, the
receive maximum we granted, QoS/retain availability, server-only packet types, the session
expiry rule of DISCONNECT, and the rules of MQTT 3.1 (protocol name "MQIsdp", level 3: a client
id of 1 to 23 characters, no session present flag, a SUBACK that cannot refuse; otherwise it is
3.1.1). A violation never raises out of ``receive_data()``: it is stored in ``error``, the right
CONNACK or DISCONNECT is queued (5.0; 3.1/3.1.1 get a CONNACK only for return codes 1 and 2 and
are otherwise just closed), the state becomes CLOSED and later input is discarded. The I/O layer
closes the socket once it has written ``data_to_send()`` and sees ``closed`` (``local_close``
says why when the peer did nothing wrong). A CONNECT refused that way (an error in the same
bytes, before CONNACK) is withdrawn from the events: the broker never acts on it, and a late
``send_connack()`` on a CLOSED connection does nothing.

Outgoing topic aliases: the broker sets ``outgoing_alias_maximum`` before CONNACK; CONNACK
lowers it to the client's Topic Alias Maximum and, if that leaves any, makes
``outgoing_aliases`` (``aliases.py``) for the send path to use.

With ``max_events`` set, one ``receive_data()`` call parses at most that many packets and keeps
the rest; ``input_pending`` then asks the I/O layer to call ``receive_data(b"")`` again, e.g.
on the next loop turn, so one peer's large read cannot monopolise the event loop.
"""

from __future__ import annotations

from enum import Enum
from typing import Final

from meshmq.mqtt.aliases import OutgoingAliases
from meshmq.mqtt.codec import (
    CONNACK_REASON_CODES,
    DISCONNECT_REASON_CODES,
    encode_ack,
    encode_connack_5,
    encode_packet,
    frame_length_hint,
    parse_fixed_header,
)
from meshmq.mqtt.codec import decode_packet as _decode_packet
from meshmq.mqtt.errors import (
    InsufficientData,
    LocalProtocolError,
    NotConnect,
    RemoteProtocolError,
)
from meshmq.mqtt.packets import (
    MQTT_5,
    MQTT_31,
    MQTT_311,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    PacketWithProperties,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Unsuback,
)
from meshmq.mqtt.properties import Properties, PropertyId, get_property, pop_property
from meshmq.mqtt.reason_codes import ReasonCode, connack_code_311
from meshmq.mqtt.topics import validate_topic_name


class ConnectionState(Enum):
    AWAIT_CONNECT = 1
    CONNECTING = 2
    CONNECTED = 3
    CLOSED = 4


AWAIT_CONNECT: Final = ConnectionState.AWAIT_CONNECT
CONNECTING: Final = ConnectionState.CONNECTING
CONNECTED: Final = ConnectionState.CONNECTED
CLOSED: Final = ConnectionState.CLOSED

_CLIENT_FORBIDDEN: Final = frozenset(
    {PacketType.CONNACK, PacketType.SUBACK, PacketType.UNSUBACK, PacketType.PINGRESP}
)
# Enum members as module constants: reading an Enum class attribute costs several times a
# global lookup on CPython 3.11, and ``_accept`` compares every packet's type.
_PUBLISH: Final = PacketType.PUBLISH
_CONNECT: Final = PacketType.CONNECT
_PINGREQ: Final = PacketType.PINGREQ
_PUBREL: Final = PacketType.PUBREL
_DISCONNECT: Final = PacketType.DISCONNECT
_AUTH: Final = PacketType.AUTH
_PINGRESP: Final = b"\xd0\x00"
# The 3.1/3.1.1 CONNACKs, by session present and return code (0 to 5): four fixed bytes each.
_CONNACK_311: Final = tuple(
    tuple(encode_packet(Connack(present, code), MQTT_311) for code in range(6))
    for present in (False, True))
TOPIC_CACHE_SIZE: Final = 64  # validated topic names remembered per connection (see _fast_publish)
_PROBLEM_PROPS: Final = (PropertyId.REASON_STRING, PropertyId.USER_PROPERTY)
MAX_CLIENT_ID_31: Final = 23  # characters, MQTT 3.1 section 3.1
# CONNECT refusals a 3.1/3.1.1 client is told with a CONNACK return code (MQTT-3.1.2-2 and the
# 3.1 client id rule); any other error before CONNACK just closes (MQTT-3.1.4-1).
_CONNACK_311_REFUSALS: Final = frozenset(
    {ReasonCode.UNSUPPORTED_PROTOCOL_VERSION, ReasonCode.CLIENT_IDENTIFIER_NOT_VALID})
UNLIMITED: Final = 268_435_460
# Shared by every connection that has had no QoS 2 PUBLISH yet (most never do): an empty set
# per connection is 216 bytes. Never modified: ``_add_qos2`` gives a connection its own first.
_NO_IDS: Final[set[int]] = set()
_NO_TOPICS: Final[dict[bytes, str]] = {}
_NO_ALIASES: Final[dict[int, str]] = {}


# The events of a connection with none pending: shared, never appended to (``receive_data``
# gives a connection a list of its own first), so an idle client holds no list (56 bytes).
_NO_EVENTS: Final[list[Packet]] = []
# Shared empty lists for the input buffer and the output queue: never appended to (each is
# replaced by a list of its own when it gets something), so an idle connection owns neither
# (112 bytes and two objects the garbage collector walks, per connection).
_NO_BUFFER: Final[list[bytes]] = []
_NO_OUTPUT: Final[list[bytes]] = []


class ServerConnection:
    """Protocol state of one client connection, as seen by the broker."""

    __slots__ = (
        "_aliases_in",
        "_buffer",
        "_connect_expiry",
        "_events",
        "_more",
        "_need",
        "_out",
        "_pings_before_connack",
        "_qos1_in",
        "_qos2_in",
        "_topics",
        "client_max_packet_size",
        "client_receive_maximum",
        "client_topic_alias_maximum",
        "connect",
        "error",
        "local_close",
        "max_events",
        "max_packet_size",
        "max_qos",
        "max_topic_bytes",
        "max_topic_levels",
        "outgoing_alias_maximum",
        "outgoing_aliases",
        "pending_output",
        "problem_information",
        "receive_maximum",
        "retain_available",
        "state",
        "topic_alias_maximum",
        "version",
    )

    def __init__(
        self,
        *,
        max_packet_size: int = 1_048_576,
        receive_maximum: int = 65535,
        topic_alias_maximum: int = 65535,
        max_topic_levels: int = 128,
        max_topic_bytes: int = 65535,
        max_qos: int = 2,
        retain_available: bool = True,
        max_events: int = 0,
    ) -> None:
        self.state = AWAIT_CONNECT
        self._pings_before_connack = 0
        self.version = MQTT_311
        self.max_packet_size = max_packet_size
        self.receive_maximum = receive_maximum
        self.topic_alias_maximum = topic_alias_maximum
        self.max_topic_levels = max_topic_levels
        self.max_topic_bytes = max_topic_bytes
        self.max_qos = max_qos
        self.retain_available = retain_available
        self.max_events = max_events  # packets parsed per receive_data() call; 0 = all
        self.connect: Connect | None = None  # until CONNACK, which keeps only what it needs:
        self._connect_expiry = 0  # the CONNECT's Session Expiry Interval (MQTT-3.14.2-2)
        self.error: RemoteProtocolError | None = None
        self.local_close: str | None = None  # why we closed, when the peer did nothing wrong
        self.client_max_packet_size = UNLIMITED
        self.client_receive_maximum = 65535
        self.client_topic_alias_maximum = 0
        # Set by the broker before CONNACK (``mqtt.broker_topic_aliases``); CONNACK lowers it
        # to the client's Topic Alias Maximum and makes ``outgoing_aliases`` if it is not 0.
        self.outgoing_alias_maximum = 0
        self.outgoing_aliases: OutgoingAliases | None = None
        self.problem_information = True
        self._buffer: list[bytes] = _NO_BUFFER  # a partial packet's pieces
        self._need = 0
        self._more = False
        self._events: list[Packet] = _NO_EVENTS
        self._out: list[bytes] = _NO_OUTPUT  # frames queued; ``_queue`` appends
        # Bytes queued by ``send_frame`` and not yet taken by ``data_to_send`` (read it, never
        # set it): a plain attribute rather than a property, as it is read per delivery.
        self.pending_output = 0
        # raw topic -> topic name that passed every check; the inbound topic aliases. Shared
        # empty dicts until the first entry (``_remember_topic``, ``_resolve_alias``): an idle
        # connection never fills them.
        self._topics: dict[bytes, str] = _NO_TOPICS
        self._aliases_in: dict[int, str] = _NO_ALIASES
        self._qos1_in = 0
        self._qos2_in: set[int] = _NO_IDS  # its own set from the first QoS 2 PUBLISH on

    # ------------------------------------------------------------------ input

    @property
    def closed(self) -> bool:
        return self.state is CLOSED

    @property
    def input_pending(self) -> bool:
        """Parsing stopped at ``max_events`` with complete packets left: call
        ``receive_data(b"")`` (later, e.g. next loop turn) to parse the next slice."""
        return self._more and self.state is not CLOSED

    def receive_data(self, data: bytes) -> None:
        """Parse ``data``; then call ``events_received()`` and ``data_to_send()``."""
        if self.state is CLOSED:
            return
        self._more = False
        if self._buffer:
            self._buffer.append(data)
            self._need -= len(data)
            if self._need > 0:
                return
            data = b"".join(self._buffer)
            self._buffer = _NO_BUFFER
        pos = 0
        end = len(data)
        try:
            if self.state is AWAIT_CONNECT and data and data[0] != 0x10:
                raise NotConnect(data[0])  # MQTT-3.1.0-1: refused at its first byte
            limit = self.max_events or -1  # -1: never reached
            parsed = 0
            events = self._events
            if events is _NO_EVENTS:
                events = self._events = []
            add_event = events.append
            while pos < end:
                if parsed == limit:
                    self._buffer = [data[pos:end]]  # parsed on the next call
                    self._need = 0
                    self._more = True
                    return
                parsed += 1
                if pos + 1 < end and data[pos + 1] < 128:  # one length byte: no call needed
                    first = data[pos]
                    start = pos + 2
                    stop = start + data[pos + 1]
                    if stop > end:
                        self._keep_partial(data, pos, end)
                        return
                else:
                    try:
                        first, start, stop = parse_fixed_header(data, pos, end)
                    except InsufficientData:
                        self._keep_partial(data, pos, end)
                        return
                if stop - pos > self.max_packet_size:
                    self._too_large(stop - start)
                if first >> 4 == 3:
                    publish = self._fast_publish(first, data, start, stop)
                    if publish is not None:
                        add_event(publish)
                        pos = stop
                        continue
                elif first == 0x40 and stop - start == 2 and self.state is not AWAIT_CONNECT:
                    packet_id = (data[start] << 8) | data[start + 1]
                    if packet_id:  # a plain PUBACK: nothing to check beyond its packet id
                        add_event(Puback(packet_id, 0, {}))
                        pos = stop
                        continue
                packet = _decode_packet(first, data, start, stop, self.version)
                pos = stop
                self._accept(packet)
                if self.state is CLOSED:
                    return
        except RemoteProtocolError as exc:
            self._fail(exc)

    def _fast_publish(self, first: int, data: bytes, start: int, stop: int) -> Publish | None:
        """Decode the common PUBLISH in one go, or return None for the full decoder.

        Taken only when nothing can be wrong: the topic is one this connection already
        accepted (``_topics``, filled by ``_check_publish``, so no UTF-8 or topic-name check is
        needed), there are no properties, and QoS, retain and the receive maximum allow it.
        Anything else, errors included, goes through ``decode_packet`` and ``_accept``, so
        both paths give the same events and the same errors.
        """
        qos = (first >> 1) & 0x03
        if qos > self.max_qos or stop - start < 2:
            return None  # QoS 3 included: max_qos is at most 2
        if first & 0x09 and (  # DUP or RETAIN set
            (first & 0x08 and not qos) or (first & 0x01 and not self.retain_available)
        ):
            return None
        pos = start + 2 + ((data[start] << 8) | data[start + 1])
        if pos > stop:
            return None
        topic = self._topics.get(data[start + 2 : pos])
        if topic is None:
            return None
        if not qos:
            if self.version == MQTT_5:
                if pos >= stop or data[pos]:
                    return None  # properties (or a malformed end): the full decoder has them
                pos += 1
            return Publish(topic, data[pos:stop], 0, bool(first & 1), False, None, {})
        packet_id = (data[pos] << 8) | data[pos + 1] if pos + 2 <= stop else 0
        if not packet_id:
            return None
        pos += 2
        if self.version == MQTT_5:
            if pos >= stop or data[pos]:
                return None
            pos += 1
        if qos == 1:
            if self._qos1_in + len(self._qos2_in) >= self.receive_maximum:
                return None
            self._qos1_in += 1
        elif packet_id not in self._qos2_in:
            if self._qos1_in + len(self._qos2_in) >= self.receive_maximum:
                return None
            self._add_qos2(packet_id)
        return Publish(topic, data[pos:stop], qos, bool(first & 1), bool(first & 8), packet_id,
                       {})

    def _keep_partial(self, data: bytes, pos: int, end: int) -> None:
        hint = frame_length_hint(data, pos, end)
        if hint is None:
            self._need = 1
        else:
            if hint + 2 > self.max_packet_size:
                self._too_large(hint)  # refuse before buffering a huge body
            self._need = hint + 2 - (end - pos)  # approximate: header size >= 2
        self._buffer = [data[pos:end]]

    def _too_large(self, length: int) -> None:
        raise RemoteProtocolError(
            f"packet of {length} bytes exceeds maximum packet size {self.max_packet_size}",
            ReasonCode.PACKET_TOO_LARGE,
        )

    def receive_eof(self) -> None:
        """The peer closed its side; nothing more will arrive."""
        self.state = CLOSED

    def events_received(self) -> list[Packet]:
        """Packets received since the last call, in order; the broker must act on each."""
        events = self._events
        self._events = _NO_EVENTS
        return events

    def _accept(self, packet: Packet) -> None:
        # ``packet.type`` in each test (not a local) lets the type checker narrow ``packet``.
        if packet.type is _PUBLISH:
            if self.state is AWAIT_CONNECT:
                raise RemoteProtocolError("PUBLISH before CONNECT")  # MQTT-3.1.0-1
            self._check_publish(packet)
        elif packet.type is _CONNECT:
            self._on_connect(packet)
        elif self.state is AWAIT_CONNECT:
            raise RemoteProtocolError(f"{packet.type.name} before CONNECT")  # MQTT-3.1.0-1
        elif packet.type is _PINGREQ:
            if self.state is CONNECTING:
                # MQTT-3.2.0-1 (5.0 and 3.1.1): the first packet we send is the CONNACK; a
                # PINGREQ pipelined behind the CONNECT is answered after it (or never, if the
                # CONNACK refuses).
                self._pings_before_connack += 1
            else:
                self._queue(_PINGRESP)
            return
        elif packet.type is _PUBREL:
            self._qos2_in.discard(packet.packet_id)
        elif packet.type is _DISCONNECT:
            self._on_disconnect(packet)
        elif packet.type is _AUTH:
            raise RemoteProtocolError("AUTH without an authentication method")  # MQTT-4.12.0-1
        elif packet.type in _CLIENT_FORBIDDEN:
            raise RemoteProtocolError(f"a client must not send {packet.type.name}")
        self._events.append(packet)

    def _on_connect(self, packet: Connect) -> None:
        if self.state is not AWAIT_CONNECT:
            raise RemoteProtocolError("second CONNECT")  # MQTT-3.1.0-2
        self.version = packet.protocol_level
        self.connect = packet
        self.state = CONNECTING
        if self.version == MQTT_31 and not 1 <= len(packet.client_id) <= MAX_CLIENT_ID_31:
            # MQTT 3.1, section 3.1: a client id of 1 to 23 characters, else return code 2
            raise RemoteProtocolError(
                f"MQTT 3.1 client identifier must be 1 to {MAX_CLIENT_ID_31} characters,"
                f" got {len(packet.client_id)}", ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
        props = packet.properties
        if props:
            self.client_receive_maximum = get_property(props, PropertyId.RECEIVE_MAXIMUM, 65535)
            self.client_max_packet_size = get_property(
                props, PropertyId.MAXIMUM_PACKET_SIZE, UNLIMITED)
            self.client_topic_alias_maximum = get_property(
                props, PropertyId.TOPIC_ALIAS_MAXIMUM, 0)
            self.problem_information = get_property(
                props, PropertyId.REQUEST_PROBLEM_INFORMATION, 1) == 1
        if packet.will is not None:
            validate_topic_name(packet.will.topic, self.max_topic_levels)  # MQTT-3.1.3-11
            self._check_topic_bytes(packet.will.topic)
            if packet.will.qos > self.max_qos:
                raise RemoteProtocolError("will QoS not supported", ReasonCode.QOS_NOT_SUPPORTED)
            if packet.will.retain and not self.retain_available:
                raise RemoteProtocolError("retain not supported", ReasonCode.RETAIN_NOT_SUPPORTED)

    def _check_publish(self, packet: Publish) -> None:
        props = packet.properties
        if props:
            if PropertyId.SUBSCRIPTION_IDENTIFIER in props:
                # MQTT-3.3.4-6
                raise RemoteProtocolError("client PUBLISH with subscription identifier")
            alias = pop_property(props, PropertyId.TOPIC_ALIAS, None)
            if alias is not None:
                self._resolve_alias(packet, alias)
        topic = packet.topic
        if not topic:
            raise RemoteProtocolError("empty topic name", ReasonCode.TOPIC_NAME_INVALID)
        validate_topic_name(topic, self.max_topic_levels)  # MQTT-3.3.2-2
        self._check_topic_bytes(topic)
        self._remember_topic(topic)
        qos = packet.qos
        if qos > self.max_qos:
            raise RemoteProtocolError(f"QoS {qos} not supported", ReasonCode.QOS_NOT_SUPPORTED)
        if packet.retain and not self.retain_available:
            raise RemoteProtocolError("retain not supported", ReasonCode.RETAIN_NOT_SUPPORTED)
        if qos == 1:
            self._qos1_in += 1
        elif qos == 2:
            packet_id = packet.packet_id
            assert packet_id is not None  # a QoS 2 PUBLISH has one (decode_publish)
            if packet_id in self._qos2_in:
                return  # a resend of a message we still hold: not a new slot
            self._add_qos2(packet_id)
        else:
            return
        if self._qos1_in + len(self._qos2_in) > self.receive_maximum:
            raise RemoteProtocolError(
                "client exceeded our receive maximum", ReasonCode.RECEIVE_MAXIMUM_EXCEEDED
            )  # MQTT-3.3.4-7

    def _remember_topic(self, topic: str) -> None:
        """``topic`` passed every check: let ``_fast_publish`` skip them next time (strict
        UTF-8 decoding round-trips, so the encoded name is the raw topic field)."""
        topics = self._topics
        raw = topic.encode("utf-8")
        if topics is _NO_TOPICS:
            topics = self._topics = {}
        if raw not in topics:
            if len(topics) >= TOPIC_CACHE_SIZE:
                topics.clear()  # wholesale: no LRU bookkeeping per packet
            topics[raw] = topic

    def _check_topic_bytes(self, topic: str) -> None:
        """Our configured topic length limit (a server may refuse a topic, spec 4.7.3)."""
        limit = self.max_topic_bytes
        if len(topic) > limit // 4 and len(topic.encode("utf-8")) > limit:
            raise RemoteProtocolError(
                f"topic name longer than {limit} bytes", ReasonCode.TOPIC_NAME_INVALID
            )

    def _resolve_alias(self, packet: Publish, alias: int) -> None:
        if alias > self.topic_alias_maximum:
            raise RemoteProtocolError(
                f"topic alias {alias} above maximum {self.topic_alias_maximum}",
                ReasonCode.TOPIC_ALIAS_INVALID,
            )  # MQTT-3.3.2-9
        if packet.topic:
            if self._aliases_in is _NO_ALIASES:
                self._aliases_in = {}
            self._aliases_in[alias] = packet.topic
            return
        topic = self._aliases_in.get(alias)
        if topic is None:
            raise RemoteProtocolError(f"unknown topic alias {alias}")
        packet.topic = topic

    def _on_disconnect(self, packet: Disconnect) -> None:
        requested = get_property(packet.properties, PropertyId.SESSION_EXPIRY_INTERVAL)
        connect = self.connect  # (still here when the DISCONNECT came before our CONNACK)
        original = self._connect_expiry if connect is None else get_property(
            connect.properties, PropertyId.SESSION_EXPIRY_INTERVAL, 0)
        if requested and not original:
            # MQTT-3.14.2-2
            raise RemoteProtocolError("session expiry set on DISCONNECT after 0")
        self.state = CLOSED

    def _fail(self, exc: RemoteProtocolError) -> None:
        self.error = exc
        self._buffer = _NO_BUFFER
        code = exc.reason_code
        if self.state is AWAIT_CONNECT or self.state is CONNECTING:
            # The CONNECT is refused here: the broker must not act on it nor on what follows.
            self._events = _NO_EVENTS
            connect = self.connect
            if connect is not None and connect.protocol_level == MQTT_5:
                if code not in CONNACK_REASON_CODES:  # e.g. 0x94 from a PUBLISH sent early
                    code = ReasonCode.PROTOCOL_ERROR
                self._queue(encode_packet(Connack(False, code), MQTT_5))
            elif code in _CONNACK_311_REFUSALS:  # 3.1/3.1.1: other errors just close
                self._queue(encode_packet(Connack(False, connack_code_311(code)), MQTT_311))
        elif self.version == MQTT_5:
            if code not in DISCONNECT_REASON_CODES:  # e.g. 0x84 from a second CONNECT
                code = ReasonCode.PROTOCOL_ERROR
            self._queue(encode_packet(Disconnect(code), MQTT_5))
        self.state = CLOSED

    # ------------------------------------------------------------------ output

    def data_to_send(self) -> bytes:
        """Bytes to write to the socket now (possibly empty)."""
        if not self._out:
            return b""
        out = self._out
        self._out = _NO_OUTPUT
        self.pending_output = 0
        return out[0] if len(out) == 1 else b"".join(out)

    def packets_to_send(self) -> list[bytes]:
        """What ``data_to_send()`` would join, one encoded packet per item (possibly none), for
        a transport that frames each packet (WebSocket). The items may be shared with other
        connections (QoS 0 frames): never modify them."""
        out = self._out
        if not out:
            return []
        self._out = _NO_OUTPUT
        self.pending_output = 0
        return out

    def send_frame(self, frame: bytes) -> bool:
        """Queue an encoded packet; False if it exceeds the client's maximum packet size.

        A dropped PUBLISH must be treated by the caller as delivered (MQTT-3.1.2-25).
        """
        size = len(frame)
        if size > self.client_max_packet_size:
            return False
        out = self._out  # (``_queue`` inline: this runs per delivery)
        if out is _NO_OUTPUT:
            self._out = [frame]
        else:
            out.append(frame)
        self.pending_output += size
        return True

    def _queue(self, frame: bytes) -> None:
        """Queue a frame of our own (CONNACK, PINGRESP, DISCONNECT: never too large)."""
        if self._out is _NO_OUTPUT:
            self._out = [frame]
        else:
            self._out.append(frame)

    def send(self, packet: PacketWithProperties) -> bool:
        """Encode and queue ``packet`` for this client's protocol version."""
        if self.state is CLOSED:
            return False
        if not self.problem_information and packet.properties and packet.type not in (
            PacketType.PUBLISH, PacketType.CONNACK, PacketType.DISCONNECT
        ):
            for pid in _PROBLEM_PROPS:  # MQTT-3.1.2-29
                packet.properties.pop(pid, None)
        return self.send_frame(encode_packet(packet, self.version))

    def send_connack(
        self, reason_code: int = 0, session_present: bool = False,
        properties: Properties | bytes | None = None,
    ) -> None:
        """Answer the CONNECT; a failure code closes the connection. 5.0 ``properties`` may
        come as a block already encoded (``encode_properties``): a broker encodes the same
        answer for most CONNECTs.

        A no-op once the connection is CLOSED (a late verdict for a peer that already broke
        the protocol or went away: it was answered, if at all, when it failed).
        """
        if self.state is CLOSED:
            return
        if self.state is not CONNECTING:
            raise LocalProtocolError(f"CONNACK in state {self.state.name}")
        if self.version == MQTT_5:
            present = session_present and reason_code == 0
            if isinstance(properties, bytes):
                self._queue(encode_connack_5(present, reason_code, properties))
            else:
                packet = Connack(present, reason_code, properties or {})
                self._queue(encode_packet(packet, MQTT_5))
        else:  # 3.1 has no session present flag: that byte is reserved
            code = connack_code_311(reason_code)
            present = session_present and code == 0 and self.version == MQTT_311
            self._queue(_CONNACK_311[present][code])
        if reason_code >= 0x80:
            self.state = CLOSED
        else:
            self.state = CONNECTED
            if self._pings_before_connack:  # (after the CONNACK: ``_out`` is its own list)
                self._out.extend([_PINGRESP] * self._pings_before_connack)
                self._pings_before_connack = 0
            connect = self.connect
            if connect is not None:  # an idle connection need not hold its CONNECT packet
                self._connect_expiry = get_property(
                    connect.properties, PropertyId.SESSION_EXPIRY_INTERVAL, 0)
                self.connect = None
            # MQTT-3.1.2-26, -27: never above the client's maximum, none if it sent 0
            maximum = min(self.outgoing_alias_maximum, self.client_topic_alias_maximum)
            self.outgoing_alias_maximum = maximum
            if maximum:
                self.outgoing_aliases = OutgoingAliases(maximum)

    def send_puback(self, packet_id: int, reason_code: int = 0) -> None:
        """Acknowledge an incoming QoS 1 PUBLISH (frees one receive-maximum slot)."""
        if self._qos1_in:
            self._qos1_in -= 1
        if reason_code and self.version == MQTT_5:
            self.send(Puback(packet_id, reason_code))
        elif self.state is not CLOSED:  # 3.1.1, or success: the same four bytes either way
            self.send_frame(encode_ack(0x40, packet_id))

    def send_pubrec(self, packet_id: int, reason_code: int = 0) -> None:
        """First answer to an incoming QoS 2 PUBLISH; an error code ends the exchange."""
        if reason_code >= 0x80:
            self._qos2_in.discard(packet_id)
        self.send(Pubrec(packet_id, reason_code))

    def _add_qos2(self, packet_id: int) -> None:
        if self._qos2_in is _NO_IDS:
            self._qos2_in = set()
        self._qos2_in.add(packet_id)

    def send_pubcomp(self, packet_id: int, reason_code: int = 0) -> None:
        self._qos2_in.discard(packet_id)
        self.send(Pubcomp(packet_id, reason_code))

    def send_pubrel(self, packet_id: int, reason_code: int = 0) -> None:
        self.send(Pubrel(packet_id, reason_code))

    def send_suback(self, packet_id: int, reason_codes: list[int]) -> None:
        """Answer a SUBSCRIBE. A 3.1 client cannot be told a filter was refused: then the
        connection closes instead (``local_close`` says why; the I/O layer logs it)."""
        if self.version == MQTT_311:  # 3.1.1 knows only 0, 1, 2 and 0x80
            reason_codes = [code if code < 0x80 else 0x80 for code in reason_codes]
        elif self.version == MQTT_31 and self.state is CONNECTED:
            refused = [code for code in reason_codes if code >= 0x80]
            if refused:  # 3.1's SUBACK only grants a QoS: never pretend a refusal was granted
                self.local_close = (
                    f"MQTT 3.1 SUBACK cannot refuse a subscription (reason 0x{refused[0]:02X}):"
                    " closing the connection instead")
                self.state = CLOSED
                return
        self.send(Suback(packet_id, reason_codes))

    def send_unsuback(self, packet_id: int, reason_codes: list[int]) -> None:
        self.send(Unsuback(packet_id, reason_codes if self.version == MQTT_5 else []))

    def send_disconnect(self, reason_code: int, properties: Properties | None = None) -> None:
        """Tell a 5.0 client why we close (3.1.1 has no server DISCONNECT), then close."""
        if self.state is CONNECTED and self.version == MQTT_5:
            self._queue(encode_packet(Disconnect(reason_code, properties or {}), MQTT_5))
        self.state = CLOSED

    def statistics(self) -> dict[str, int]:
        return {
            "state": self.state.value,
            "qos1_in": self._qos1_in,
            "qos2_in": len(self._qos2_in),
            "aliases_in": len(self._aliases_in),
            "aliases_out": 0 if self.outgoing_aliases is None
            else self.outgoing_aliases.statistics()["aliases"],
            "pending_output": self.pending_output,
        }
