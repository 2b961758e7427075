"""Fuzzing harness for the MQTT codec and the per-connection state machine.

Theory of operation
-------------------
A *case* is a protocol version, a byte stream and the cut points at which the stream is fed
to the target, plus a seed for the broker-like driver's choices. Cases come from
``generate_case()``: a random run of well-formed client packets (so the fuzzer gets past
CONNECT), mutated by a few byte-level operators that MQTT parsers are sensitive to (bit flips,
"interesting" bytes in length fields, insertions, deletions, duplicated and spliced ranges,
truncation).

Two targets check each case:

* ``check_codec`` decodes the stream frame by frame: the only exceptions allowed are
  ``InsufficientData`` and ``RemoteProtocolError``; every packet that decodes must re-encode
  without error and decode back to an equal packet.
* ``check_connection`` feeds the stream to a ``ServerConnection`` in the case's chunks while a
  ``Driver`` answers events as the broker would (CONNACK, acks, SUBACK, outgoing publishes with
  topic aliases). After every chunk it checks the invariants in ``_check_invariants``; after
  the stream it checks that feeding the same bytes in one chunk gave the same events and
  error. Any other exception, a broken invariant or a case that takes longer than
  ``CASE_SECONDS`` is a failure (a hang).

``run_fuzzer`` runs both targets on fresh cases until its time budget is spent. On a failure it
shrinks the case (drop chunks of bytes while the same failure remains), writes it as JSON for
``tests/fuzz/corpus/`` and raises ``FuzzFailure`` naming the seed, so the run can be repeated
with ``MESHMQ_FUZZ_SEED``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from meshmq.mqtt.codec import decode_frames, decode_packet, encode_packet, parse_fixed_header
from meshmq.mqtt.connection import CLOSED, CONNECTED, ServerConnection
from meshmq.mqtt.errors import InsufficientData, RemoteProtocolError
from meshmq.mqtt.packets import (
    MQTT_5,
    MQTT_311,
    Auth,
    Connack,
    Connect,
    Disconnect,
    Packet,
    PacketType,
    Pingreq,
    Pingresp,
    Puback,
    Pubcomp,
    Publish,
    Pubrec,
    Pubrel,
    Suback,
    Subscribe,
    SubscriptionOptions,
    Unsuback,
    Unsubscribe,
    Will,
)
from meshmq.mqtt.properties import PropertyId
from meshmq.mqtt.topics import validate_topic_name

CASE_SECONDS = 2.0  # one case taking longer than this is a hang
CORPUS = Path(__file__).parent / "corpus"

# What a client may legitimately make the connection hand to the broker.
_CLIENT_EVENTS = frozenset({
    PacketType.CONNECT, PacketType.PUBLISH, PacketType.PUBACK, PacketType.PUBREC,
    PacketType.PUBREL, PacketType.PUBCOMP, PacketType.SUBSCRIBE, PacketType.UNSUBSCRIBE,
    PacketType.DISCONNECT,
})
_TOPICS = ["a", "a/b", "$SYS/x", "sensors/d1/temp", "é/ü", "", "a/+", "#", "a\x00b", "x" * 300]
_INTERESTING = [0x00, 0x01, 0x02, 0x7F, 0x80, 0x81, 0xFF, 0x10, 0x20, 0x30, 0x32, 0x34, 0x62,
                0x82, 0xC0, 0xE0, 0xF0, 0x26, 0x23, 0x0B]


class FuzzFailure(AssertionError):
    """A case broke the codec or the state machine; the message says how to replay it."""


@dataclass
class Case:
    version: int
    data: bytes
    cuts: list[int] = field(default_factory=list)  # feed boundaries, ascending, inside data
    driver_seed: int = 0
    max_packet_size: int = 4096
    receive_maximum: int = 4
    note: str = ""
    max_qos: int = 2
    retain_available: bool = True
    max_events: int = 0  # the connection's per-call parsing budget (0 = unlimited)

    def chunks(self) -> list[bytes]:
        bounds = [0, *(c for c in self.cuts if 0 < c < len(self.data)), len(self.data)]
        return [self.data[a:b] for a, b in itertools.pairwise(bounds) if b > a]

    def to_json(self) -> str:
        return json.dumps({
            "note": self.note, "version": self.version, "data": self.data.hex(),
            "cuts": self.cuts, "driver_seed": self.driver_seed,
            "max_packet_size": self.max_packet_size, "receive_maximum": self.receive_maximum,
            "max_qos": self.max_qos, "retain_available": self.retain_available,
            "max_events": self.max_events,
        }, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Case:
        raw = json.loads(text)
        return cls(raw["version"], bytes.fromhex(raw["data"]), list(raw["cuts"]),
                   raw["driver_seed"], raw["max_packet_size"], raw["receive_maximum"],
                   raw.get("note", ""), raw.get("max_qos", 2), raw.get("retain_available", True),
                   raw.get("max_events", 0))

    def replace(self, data: bytes, cuts: list[int]) -> Case:
        """The same settings with other bytes (for shrinking)."""
        return Case(self.version, data, cuts, self.driver_seed, self.max_packet_size,
                    self.receive_maximum, self.note, self.max_qos, self.retain_available,
                    self.max_events)


# ---------------------------------------------------------------------------- generation


def _text(rng: random.Random) -> str:
    return rng.choice(["", "c", "dev-1", "ü", "x" * rng.randint(0, 40)])


def _props(rng: random.Random, pairs: list[tuple[int, object]]) -> dict:
    return {pid: value for pid, value in pairs if pid and rng.random() < 0.3}


def random_packet(rng: random.Random, version: int) -> Packet:
    """One client-side packet, well formed for ``version`` (topics may still be invalid)."""
    v5 = version == MQTT_5
    kind = rng.randrange(12)
    topic = rng.choice(_TOPICS)
    if kind <= 3:
        qos = rng.randint(0, 2)
        props = _props(rng, [
            (PropertyId.TOPIC_ALIAS, rng.randint(1, 3)),
            (PropertyId.TOPIC_ALIAS, rng.randint(1, 6)),
            (PropertyId.MESSAGE_EXPIRY_INTERVAL, rng.randint(0, 10)),
            (PropertyId.SUBSCRIPTION_IDENTIFIER, [1]) if rng.random() < 0.1 else (0, None),
            (PropertyId.USER_PROPERTY, [("k", "v")]),
            (PropertyId.CONTENT_TYPE, "t"),
        ]) if v5 else {}
        return Publish(topic, rng.randbytes(rng.randint(0, 30)), qos, rng.random() < 0.2,
                       qos > 0 and rng.random() < 0.2, rng.randint(1, 6) if qos else None, props)
    if kind == 4:
        ack = rng.choice([Puback, Pubrec, Pubcomp])
        if v5 and rng.random() < 0.3:
            return ack(rng.randint(1, 6), 0x80 if ack is not Pubcomp else 0x92,
                       {PropertyId.REASON_STRING: "r", PropertyId.USER_PROPERTY: [("a", "b")]})
        return ack(rng.randint(1, 6))
    if kind == 5:
        return Pubrel(rng.randint(1, 6))
    if kind == 6:
        opts = SubscriptionOptions(rng.randint(0, 2), v5 and rng.random() < 0.3, False,
                                   rng.randint(0, 2) if v5 else 0)
        filters = [(rng.choice(["a/#", "+/b", "$share/g/a", "#", topic or "t"]), opts)
                   for _ in range(rng.randint(1, 3))]
        props = _props(rng, [(PropertyId.SUBSCRIPTION_IDENTIFIER, [rng.randint(1, 9)])])
        return Subscribe(rng.randint(1, 6), filters, props if v5 else {})
    if kind == 7:
        return Unsubscribe(rng.randint(1, 6), [rng.choice(["a/#", "x"])])
    if kind == 8:
        return Pingreq()
    if kind == 9 and rng.random() < 0.5:
        return Disconnect(rng.choice([0, 4]) if v5 else 0, _props(rng, [
            (PropertyId.SESSION_EXPIRY_INTERVAL, rng.randint(0, 5))]) if v5 else {})
    if kind == 10 and v5:
        return Auth(0x19)
    if kind == 10:
        return rng.choice([Connack(), Suback(1, [0]), Unsuback(1), Pingresp()])
    return random_connect(rng, version)


def random_connect(rng: random.Random, version: int) -> Connect:
    v5 = version == MQTT_5
    will = None
    if rng.random() < 0.3:
        will = Will(rng.choice(_TOPICS), b"w", rng.randint(0, 2), rng.random() < 0.3,
                    _props(rng, [(PropertyId.WILL_DELAY_INTERVAL, 1)]) if v5 else {})
    props = _props(rng, [
        (PropertyId.RECEIVE_MAXIMUM, rng.randint(1, 3)),
        (PropertyId.TOPIC_ALIAS_MAXIMUM, rng.randint(0, 4)),
        (PropertyId.MAXIMUM_PACKET_SIZE, rng.randint(1, 200)),
        (PropertyId.SESSION_EXPIRY_INTERVAL, rng.randint(0, 100)),
        (PropertyId.REQUEST_PROBLEM_INFORMATION, rng.randint(0, 1)),
    ]) if v5 else {}
    username = rng.choice([None, "u"])
    password = b"p" if (username is not None or v5) and rng.random() < 0.5 else None
    return Connect(_text(rng), version, rng.random() < 0.8, rng.randint(0, 120), username,
                   password, will, props)


def _mutate(rng: random.Random, data: bytearray, donor: bytes) -> None:
    if not data:
        data.extend(rng.randbytes(rng.randint(1, 8)))
        return
    op = rng.randrange(8)
    pos = rng.randrange(len(data))
    if op == 0:
        data[pos] ^= 1 << rng.randrange(8)
    elif op == 1:
        data[pos] = rng.choice(_INTERESTING)
    elif op == 2:
        data[pos:pos] = rng.randbytes(rng.randint(1, 6))
    elif op == 3:
        del data[pos:pos + rng.randint(1, 8)]
    elif op == 4:
        end = min(len(data), pos + rng.randint(1, 16))
        data[pos:pos] = data[pos:end]
    elif op == 5 and donor:
        start = rng.randrange(len(donor))
        data[pos:pos] = donor[start:start + rng.randint(1, 32)]
    elif op == 6:
        del data[pos:]
    else:
        data[pos:pos + 4] = rng.choice([b"\xff\xff\xff\x7f", b"\x80\x80\x80\x80\x01", b"\x00"])


def generate_case(rng: random.Random) -> Case:
    """A fresh case: a valid CONNECT, a run of packets, then 0-6 mutations and random cuts."""
    version = rng.choice([MQTT_311, MQTT_5])
    packets: list[Packet] = [random_connect(rng, version)]
    packets += [random_packet(rng, version) for _ in range(rng.randint(0, 12))]
    stream = bytearray(b"".join(encode_packet(p, version) for p in packets))
    donor = b"".join(encode_packet(random_packet(rng, version), version) for _ in range(3))
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3, 6])):
        _mutate(rng, stream, donor)
    data = bytes(stream)
    cuts = sorted(rng.sample(range(1, len(data)), max(0, min(len(data) - 1,
                                                                rng.randint(0, 6)))))
    return Case(version, data, cuts, rng.randrange(2**32), rng.choice([64, 4096]),
                rng.randint(1, 4), "", rng.choice([0, 1, 2, 2]), rng.random() < 0.8,
                rng.choice([0, 0, 1, 2, 3]))


# ---------------------------------------------------------------------------- codec target


def check_codec(case: Case) -> None:
    """Decoding raises only the documented errors; whatever decodes round-trips."""
    for version in (MQTT_311, MQTT_5):
        data = case.data
        pos, end = 0, len(data)
        while pos < end:
            try:
                first, start, stop = parse_fixed_header(data, pos, end)
                packet = decode_packet(first, data, start, stop, version)
            except (InsufficientData, RemoteProtocolError):
                break
            pos = stop
            again = decode_frames(encode_packet(packet, version), version)
            if again != [packet]:
                raise FuzzFailure(f"round trip changed {packet!r} into {again!r}")


# ---------------------------------------------------------------------------- connection target


class Driver:
    """Answers a connection's events the way the broker does, with seeded choices."""

    def __init__(self, conn: ServerConnection, seed: int) -> None:
        self.conn = conn
        self.rng = random.Random(seed)
        self.events: list[Packet] = []
        self.pending_connect = False

    def handle(self, events: list[Packet]) -> None:
        conn, rng = self.conn, self.rng
        for packet in events:
            self.events.append(packet)
            if conn.closed:
                continue
            ptype = packet.type
            if ptype is PacketType.CONNECT:
                if rng.random() < 0.1:
                    conn.send_connack(rng.choice([0x80, 0x86, 0x87, 0x9F]))
                else:
                    conn.outgoing_alias_maximum = rng.randint(0, 3)
                    conn.send_connack(0, rng.random() < 0.5)
            elif ptype is PacketType.PUBLISH:
                self._on_publish(packet)  # type: ignore[arg-type]
            elif ptype is PacketType.PUBREL:
                conn.send_pubcomp(packet.packet_id)  # type: ignore[union-attr]
            elif ptype is PacketType.PUBREC:
                conn.send_pubrel(packet.packet_id)  # type: ignore[union-attr]
            elif ptype is PacketType.SUBSCRIBE:
                conn.send_suback(packet.packet_id,  # type: ignore[union-attr]
                                 [rng.choice([0, 1, 2, 0x87, 0x97]) for _ in packet.subscriptions])  # type: ignore[union-attr]
            elif ptype is PacketType.UNSUBSCRIBE:
                conn.send_unsuback(packet.packet_id, [0] * len(packet.topic_filters))  # type: ignore[union-attr]
        if not conn.closed and rng.random() < 0.05:
            conn.send_disconnect(0x96)

    def _on_publish(self, packet: Publish) -> None:
        conn, rng = self.conn, self.rng
        if packet.qos == 1 and rng.random() < 0.2:
            conn.send(Puback(packet.packet_id, 0x97, {PropertyId.REASON_STRING: "quota"}))  # type: ignore[arg-type]
        elif packet.qos == 1:
            conn.send_puback(packet.packet_id, rng.choice([0, 0, 0x10, 0x97]))  # type: ignore[arg-type]
        elif packet.qos == 2:
            conn.send_pubrec(packet.packet_id, rng.choice([0, 0, 0x97]))  # type: ignore[arg-type]
        if conn.state is not CONNECTED:
            return
        outgoing = Publish(packet.topic, packet.payload, min(packet.qos, 1), False, False,
                           rng.randint(1, 65535) if packet.qos else None, {})
        aliases = conn.outgoing_aliases  # as broker/session.py uses it
        alias = 0 if aliases is None else aliases.lookup(packet.topic)
        if alias:
            outgoing.properties[PropertyId.TOPIC_ALIAS] = abs(alias)
            if alias > 0:
                outgoing.topic = ""
        if not conn.send(outgoing) and alias < 0:
            aliases.not_sent(-alias)  # type: ignore[union-attr]


def _check_output(conn: ServerConnection, out: bytes, what: str) -> list[Packet]:
    """What we send must be valid MQTT for the client's version."""
    try:
        packets = decode_frames(out, conn.version)
    except (InsufficientData, RemoteProtocolError) as exc:
        raise FuzzFailure(f"{what}: the server sent bytes that do not decode: {exc!r}") from None
    for packet in packets:
        if packet.type is PacketType.PUBLISH:
            size = len(encode_packet(packet, conn.version))
            if size > conn.client_max_packet_size:
                raise FuzzFailure(f"sent a {size}-byte PUBLISH above the client's maximum")
    return packets


def _check_invariants(conn: ServerConnection, events: list[Packet], seen_connect: bool,
                      out: bytes, read: int) -> bool:
    """Invariants after one chunk; returns whether a CONNECT has been handed out so far."""
    if conn.error is not None and conn.state is not CLOSED:
        raise FuzzFailure(f"error {conn.error!r} recorded but state is {conn.state.name}")
    for index, packet in enumerate(events):
        if packet.type not in _CLIENT_EVENTS:
            raise FuzzFailure(f"{packet.type.name} handed to the broker")
        if packet.type is PacketType.CONNECT:
            if seen_connect or index:
                raise FuzzFailure("a CONNECT that is not the first event")
            seen_connect = True
        elif not seen_connect:
            raise FuzzFailure(f"{packet.type.name} handed to the broker before CONNECT")
        if packet.type is PacketType.PUBLISH:
            _check_publish_event(conn, packet)  # type: ignore[arg-type]
    stats = conn.statistics()
    if not conn.closed and stats["qos1_in"] + stats["qos2_in"] > conn.receive_maximum:
        raise FuzzFailure(f"receive maximum {conn.receive_maximum} exceeded: {stats}")
    buffered = sum(len(chunk) for chunk in conn._buffer)
    if not conn.closed and buffered > max(conn.max_packet_size + 5, read):  # partial or rest
        raise FuzzFailure(f"{buffered} bytes buffered above max packet size")
    packets = _check_output(conn, out, "output")
    if conn.version == MQTT_311 and any(p.type is PacketType.DISCONNECT for p in packets):
        raise FuzzFailure("a 3.1.1 client was sent a DISCONNECT")
    return seen_connect


def _check_publish_event(conn: ServerConnection, packet: Publish) -> None:
    try:
        validate_topic_name(packet.topic, conn.max_topic_levels)
    except RemoteProtocolError as exc:
        raise FuzzFailure(f"PUBLISH with invalid topic handed out: {exc}") from None
    if PropertyId.TOPIC_ALIAS in packet.properties:
        raise FuzzFailure("topic alias left in a PUBLISH handed out")
    if packet.qos > conn.max_qos:
        raise FuzzFailure("QoS above max_qos handed out")
    if packet.retain and not conn.retain_available:
        raise FuzzFailure("retained PUBLISH handed out though retain is unavailable")
    if PropertyId.SUBSCRIPTION_IDENTIFIER in packet.properties:
        raise FuzzFailure("client PUBLISH with a subscription identifier handed out")


def _new_connection(case: Case) -> ServerConnection:
    return ServerConnection(max_packet_size=case.max_packet_size,
                            receive_maximum=case.receive_maximum, topic_alias_maximum=4,
                            max_topic_levels=8, max_topic_bytes=256, max_qos=case.max_qos,
                            retain_available=case.retain_available, max_events=case.max_events)


def run_connection(case: Case) -> tuple[list[Packet], int | None]:
    """Feed the case chunk by chunk with a driver; check invariants; return (events, error)."""
    conn = _new_connection(case)
    driver = Driver(conn, case.driver_seed)
    seen_connect = False
    started = time.monotonic()
    for read in case.chunks():
        chunk = read
        while True:  # one read, then its later slices while parsing stops at max_events
            was_closed = conn.closed
            conn.receive_data(chunk)
            events = conn.events_received()
            if was_closed and events:
                raise FuzzFailure("events after the connection was CLOSED")
            if case.max_events and len(events) > case.max_events:
                raise FuzzFailure(f"{len(events)} events from one call, max {case.max_events}")
            driver.handle(events)
            seen_connect = _check_invariants(conn, events, seen_connect, conn.data_to_send(),
                                             len(read))
            if time.monotonic() - started > CASE_SECONDS:
                raise FuzzFailure(f"case took more than {CASE_SECONDS} s (hang)")
            if not conn.input_pending:
                break
            chunk = b""
    conn.receive_eof()
    if conn.state is not CLOSED:
        raise FuzzFailure("not CLOSED after EOF")
    return driver.events, None if conn.error is None else conn.error.reason_code


def parse_only(case: Case, chunks: list[bytes]) -> tuple[list[Packet], int | None, bytes]:
    """Feed ``chunks`` with nobody answering; return (events, error code, output).

    Events are taken once, at the end, as a broker still deciding on the CONNECT would: a
    CONNECT refused by a later error is withdrawn however the bytes were split.
    """
    conn = _new_connection(case)
    for chunk in chunks:
        conn.receive_data(chunk)
        while conn.input_pending:
            conn.receive_data(b"")
    events = conn.events_received()
    return events, None if conn.error is None else conn.error.reason_code, conn.data_to_send()


def check_connection(case: Case) -> None:
    """Chunked feeding with a driver, plus chunking invariance of what is parsed."""
    run_connection(case)
    chunked = parse_only(case, case.chunks())
    whole = parse_only(case, [case.data])
    if chunked != whole:
        raise FuzzFailure(f"chunked feeding differs from one chunk: {chunked!r} != {whole!r}")


class _Hang(BaseException):
    """Raised by the watchdog inside a case that runs too long."""


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (main thread only; elsewhere, no watchdog)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: object) -> None:
        raise _Hang

    previous = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_case(case: Case) -> None:
    """Both targets; any exception other than ``FuzzFailure`` is reported as a crash, and a
    case still running after ``2 * CASE_SECONDS`` as a hang."""
    try:
        with _watchdog(2 * CASE_SECONDS):
            check_codec(case)
            check_connection(case)
    except FuzzFailure:
        raise
    except _Hang:
        raise FuzzFailure(f"hang: case still running after {2 * CASE_SECONDS} s") from None
    except Exception as exc:
        raise FuzzFailure(f"crash: {exc!r}") from exc


# ---------------------------------------------------------------------------- driver loop


def _signature(case: Case) -> str | None:
    try:
        check_case(case)
    except FuzzFailure as exc:
        return str(exc).split(":")[0]
    return None


def shrink(case: Case) -> Case:
    """Remove byte ranges (and cuts) while the case still fails the same way."""
    want = _signature(case)
    best = case
    size = max(1, len(best.data) // 2)
    while size >= 1:
        start = 0
        while start < len(best.data):
            data = best.data[:start] + best.data[start + size:]
            cuts = [c if c < start else c - size
                    for c in best.cuts if not start <= c < start + size]
            trial = best.replace(data, sorted({c for c in cuts if 0 < c < len(data)}))
            if _signature(trial) == want:
                best = trial
            else:
                start += size
        size //= 2
    return best


def run_fuzzer(seconds: float, seed: int, out_dir: Path) -> int:
    """Check fresh cases for ``seconds``; return how many ran. Raises ``FuzzFailure``."""
    rng = random.Random(seed)
    deadline = time.monotonic() + seconds
    count = 0
    while time.monotonic() < deadline:
        case = generate_case(rng)
        try:
            check_case(case)
        except FuzzFailure as exc:
            small = shrink(case)
            small.note = f"found by seed {seed}: {exc}"[:300]
            out_dir.mkdir(parents=True, exist_ok=True)
            path = out_dir / f"crash-{seed}-{count}.json"
            path.write_text(small.to_json())
            raise FuzzFailure(
                f"{exc}\n  seed: MESHMQ_FUZZ_SEED={seed} (case {count})\n"
                f"  shrunk case written to {path} (copy it into {CORPUS}/ to keep it)\n"
                f"  data: {small.data.hex()} cuts={small.cuts} version={small.version}"
            ) from exc
        count += 1
    return count
