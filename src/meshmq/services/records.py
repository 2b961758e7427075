"""The services' records in the commit log: requests, and their dispatchers' state changes.

A service's requests and its dispatcher's state share one partition, the partition of the
topic ``$service/NAME``, so that the dispatcher (that partition's leader) writes and reads them
in one order, and after a crash rebuilds its state by reading that partition from a checkpoint
(services/recovery.py). Both kinds of record are on the topic ``$service/NAME``:

* a **request** is the caller's publish as stored (its client id in the record);
* a **state record** has an empty client id, which no client can have (an empty CONNECT client
  id is replaced by an assigned one), and a user property ``meshmq-state`` naming its kind:

  =========  ==============================================================================
  ``assign``  ``meshmq-request-id`` was given to service worker ``meshmq-worker``
              (``PROCESS:CLIENT-ID``) as attempt ``meshmq-retry``; written without waiting
  ``done``    the request is complete: the payload is the reply (or error reply) the caller
              gets, as broker/wire.py encodes a message; ``meshmq-worker`` and
              ``meshmq-retry`` name the reply's attempt (none for an error, whose kind is in
              ``meshmq-error``); written, and durable, before the reply is routed
  =========  ==============================================================================

Using the request topic keeps the partition right whatever ``log.key_level`` says, without
teaching the log's partitioner about services; no client ever gets these records, because a
subscription to ``$service/NAME`` is an offer, not a route.
"""

from __future__ import annotations

from typing import NamedTuple

from meshmq.broker.message import SERVICE_PREFIX, Message
from meshmq.broker.wire import WireError, decode_message, encode_message
from meshmq.log.record import Record
from meshmq.mqtt.codec import decode_properties
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.properties import PacketKind, Properties, PropertyId, get_property
from meshmq.services import envelope
from meshmq.services.dispatcher import Request, WorkerKey

STATE = "meshmq-state"
WORKER = "meshmq-worker"
ASSIGN = "assign"
DONE = "done"
STATE_CLIENT = ""  # the client id of a state record (no client has it)


class StateRecord(NamedTuple):
    kind: str
    request_id: str
    retry: int
    worker: WorkerKey | None
    error: str
    reply: Message | None


def assign_record(request: Request) -> Message:
    """``request``'s current attempt, to record."""
    assert request.holder is not None
    return _state(request, ASSIGN, [(envelope.RETRY, str(request.retry)),
                                    (WORKER, _worker_text(request.holder))], b"")


def done_record(request: Request, now: float) -> Message:
    """``request``'s completion, to record: its reply, and whose attempt gave it."""
    assert request.reply is not None
    pairs = [(envelope.ERROR, request.error)]
    if request.completer is not None:
        worker, retry = request.completer
        pairs += [(envelope.RETRY, str(retry)), (WORKER, _worker_text(worker))]
    return _state(request, DONE, pairs, encode_message(request.reply, now, positioned=False))


def _state(request: Request, kind: str, pairs: list[tuple[str, str]], payload: bytes) -> Message:
    properties: Properties = {PropertyId.USER_PROPERTY: [
        (STATE, kind), (envelope.REQUEST_ID, request.id), *pairs]}
    return Message(request.message.topic, payload, 0, False, properties, None)


def _worker_text(worker: WorkerKey) -> str:
    return f"{worker[0]}:{worker[1]}"


def _worker_of(text: str) -> WorkerKey | None:
    process, sep, client_id = text.partition(":")
    return (int(process), client_id) if sep and process.isdigit() else None


def request_from(message: Message, service: str, partition: int, offset: int,
                 now: float) -> Request | None:
    """The request a stored publish on ``$service/NAME`` is (None: it has no response topic,
    which the caller's side refuses, so only a damaged record lacks one)."""
    properties = message.properties
    reply_topic = envelope.reply_topic_of(properties)
    if not reply_topic:
        return None
    return Request(
        envelope.request_id(partition, offset), offset, message.sender or "", reply_topic,
        envelope.correlation_of(properties), message, now,
        topic_envelope=envelope.user_value(properties, envelope.TOPIC_ENVELOPE) is not None)


class Replayed(NamedTuple):
    """One record of a service's partition, read back: a request or a state record."""

    service: str
    request: Request | None
    state: StateRecord | None
    timestamp_ms: int


def read_record(record: Record, partition: int, now: float) -> Replayed | None:
    """A record read back from a partition: a service's request or state record, or None
    (another topic's record, or one that cannot be read)."""
    if not record.topic.startswith(SERVICE_PREFIX):
        return None
    service = record.topic[len(SERVICE_PREFIX):]
    if not service or "/" in service:
        return None
    try:
        properties: Properties = {}
        if record.properties:
            properties, _ = decode_properties(record.properties, 0, len(record.properties),
                                              PacketKind.PUBLISH)
        if record.client_id != STATE_CLIENT:
            message = Message(record.topic, record.payload, record.qos, False, properties,
                              record.client_id, now)
            request = request_from(message, service, partition, record.offset, now)
            return Replayed(service, request, None, record.timestamp_ms)
        state = _read_state(properties, record.payload, now)
    except (RemoteProtocolError, WireError, ValueError):
        return None
    if state is None:
        return None
    return Replayed(service, None, state, record.timestamp_ms)


def _read_state(properties: Properties, payload: bytes, now: float) -> StateRecord | None:
    pairs = dict(get_property(properties, PropertyId.USER_PROPERTY) or ())
    kind = pairs.get(STATE)
    request_id = pairs.get(envelope.REQUEST_ID)
    if kind not in (ASSIGN, DONE) or request_id is None:
        return None
    retry_text = pairs.get(envelope.RETRY, "-1")
    retry = int(retry_text) if retry_text.lstrip("-").isdigit() else -1
    worker = _worker_of(pairs.get(WORKER, ""))
    reply = decode_message(payload, now) if kind == DONE else None
    return StateRecord(kind, request_id, retry, worker, pairs.get(envelope.ERROR, ""), reply)
