"""The wire contract of services (docs/services.md): topics, envelope properties, request ids.

What a plain MQTT client sees, in one place:

* a **service worker** offers service NAME by subscribing to ``$service/NAME`` (MQTT 3.1.1:
  ``$service/NAME/#``), taking at most as many requests at once as its Receive Maximum allows,
  or fewer with the SUBSCRIBE user property ``credit`` = N;
* a **caller** publishes a request to ``$service/NAME`` with a Response Topic and Correlation
  Data (MQTT 5), or to ``$service/NAME/call/REPLY/TOPIC`` (any version: the rest of the topic
  is the reply topic, which also serves as the correlation);
* a request reaches one service worker with the caller's properties unaltered plus the
  envelope: ``meshmq-request-id``, ``meshmq-sender``, ``meshmq-retry``, ``meshmq-dup``; a 3.1.1
  service worker, which has no properties, gets the envelope in the topic:
  ``$service/NAME/REQUEST-ID/RETRY/DUP/SENDER`` (DUP ``0`` or ``1``, SENDER percent-encoded);
* the service worker replies on the Response Topic with the Correlation Data, or (any
  version) on ``$service/NAME/reply/REQUEST-ID``;
* the caller gets one reply, with ``meshmq-request-id``; an error reply carries
  ``meshmq-error`` (and its kind as payload); a caller that used the topic envelope gets its
  error replies on ``REPLY/TOPIC/meshmq-error``.

A request id is ``PARTITION-OFFSET``: where the request is stored in the commit log, unique for
the life of the log, and the partition tells any worker which dispatcher a reply belongs to.
"""

from __future__ import annotations

from typing import Final, NamedTuple
from urllib.parse import quote

from meshmq.broker.message import SERVICE_PREFIX
from meshmq.mqtt.properties import Properties, PropertyId, get_property

REQUEST_ID = "meshmq-request-id"
SENDER = "meshmq-sender"
RETRY = "meshmq-retry"
DUP = "meshmq-dup"
ERROR = "meshmq-error"
CREDIT = "credit"  # SUBSCRIBE user property: the most requests a service worker takes at once
# On a stored request whose caller used the topic envelope: its error replies go to a topic
# of their own (a 3.1.1 caller sees no properties). Never delivered to a service worker.
TOPIC_ENVELOPE = "meshmq-envelope"
ERROR_LEVEL = "meshmq-error"  # the level added to such a caller's reply topic for errors
ENVELOPE_NAMES = frozenset({REQUEST_ID, SENDER, RETRY, DUP, ERROR, TOPIC_ENVELOPE})

# The error kinds an error reply carries (``meshmq-error``).
TIMEOUT = "timeout"  # the last attempt's service worker did not reply in time
WORKER_LOST = "worker-lost"  # the last attempt's service worker disconnected or died
NO_RESPONDERS = "no-responders"  # no service worker took it within the wait allowed
NOT_AUTHORIZED = "not-authorized"  # the caller may not call this service
UNAVAILABLE = "unavailable"  # the broker cannot take requests (no commit log)

_USER: Final = PropertyId.USER_PROPERTY
_RESPONSE_TOPIC: Final = PropertyId.RESPONSE_TOPIC
_CORRELATION: Final = PropertyId.CORRELATION_DATA


class ServiceTopic(NamedTuple):
    """A topic (or filter) on ``$service/`` understood: what it asks for, or why not."""

    kind: str  # "call", "reply", "offer" or "invalid"
    service: str = ""
    rest: str = ""  # call: the reply topic (topic envelope; "" for MQTT 5); reply: request id
    problem: str = ""


def service_topic(service: str) -> str:
    """The topic requests for ``service`` are published and stored on."""
    return SERVICE_PREFIX + service


def parse_publish(topic: str) -> ServiceTopic:
    """A PUBLISH topic under ``$service/``: a call (``$service/NAME``, or with the topic
    envelope ``$service/NAME/call/REPLY...``), a reply by request id
    (``$service/NAME/reply/ID``), or invalid (the problem in words)."""
    levels = topic[len(SERVICE_PREFIX):].split("/")
    name = levels[0]
    if not name:
        return ServiceTopic("invalid", problem="no service name after $service/")
    if len(levels) == 1:
        return ServiceTopic("call", name)
    if levels[1] == "call" and len(levels) > 2 and all(levels[2:]):
        return ServiceTopic("call", name, "/".join(levels[2:]))
    if levels[1] == "reply" and len(levels) == 3 and parse_request_id(levels[2]) is not None:
        return ServiceTopic("reply", name, levels[2])
    return ServiceTopic("invalid", name, problem=(
        f"expected $service/{name}, $service/{name}/call/REPLY-TOPIC or "
        f"$service/{name}/reply/REQUEST-ID, got {topic!r}"))


def parse_filter(topic_filter: str) -> ServiceTopic:
    """A SUBSCRIBE filter under ``$service/``: an offer (``$service/NAME`` or
    ``$service/NAME/#``) or invalid."""
    levels = topic_filter[len(SERVICE_PREFIX):].split("/")
    name = levels[0]
    if name and name not in ("+", "#") and (
            len(levels) == 1 or (len(levels) == 2 and levels[1] == "#")):
        return ServiceTopic("offer", name)
    return ServiceTopic("invalid", problem=(
        f"a service is offered with $service/NAME (or $service/NAME/#), got {topic_filter!r}"))


def request_id(partition: int, offset: int) -> str:
    return f"{partition}-{offset}"


def parse_request_id(text: str) -> tuple[int, int] | None:
    """(partition, offset) of a request id, or None if ``text`` is not one."""
    partition, sep, offset = text.partition("-")
    if not sep or not partition.isdigit() or not offset.isdigit():
        return None
    return int(partition), int(offset)


def user_value(properties: Properties, name: str) -> str | None:
    """The last value of user property ``name`` (None: absent)."""
    if _USER not in properties:
        return None
    values = [value for key, value in get_property(properties, _USER) or () if key == name]
    return values[-1] if values else None


def parse_credit(properties: Properties) -> int | None:
    """The ``credit`` a SUBSCRIBE asks for (None: none); ValueError if it is not a positive
    integer."""
    value = user_value(properties, CREDIT)
    if value is None:
        return None
    if not value.strip().isdigit() or int(value) < 1:
        raise ValueError(f"{CREDIT} must be a positive integer, got {value!r}")
    return int(value)


def with_users(properties: Properties, extra: list[tuple[str, str]],
               drop: frozenset[str] = frozenset()) -> Properties:
    """``properties`` with ``extra`` user properties after the publisher's own (those named in
    ``drop`` removed first)."""
    pairs = [pair for pair in get_property(properties, _USER) or () if pair[0] not in drop]
    return {**properties, _USER: pairs + extra}


def stored_request(properties: Properties, reply_topic: str) -> Properties:
    """The properties a request is stored with: as published (MQTT 5 envelope), or, for the
    topic envelope, the reply topic as both Response Topic and Correlation Data and the mark
    that sends its errors to a topic of their own."""
    if not reply_topic:
        return properties
    stored = {key: value for key, value in properties.items() if key not in (
        _RESPONSE_TOPIC, _CORRELATION)}
    stored[_RESPONSE_TOPIC] = reply_topic
    stored[_CORRELATION] = reply_topic.encode("utf-8")
    return with_users(stored, [(TOPIC_ENVELOPE, "1")], frozenset({TOPIC_ENVELOPE}))


def delivered_request(properties: Properties, request: str, sender: str, retry: int,
                      dup: bool) -> Properties:
    """A stored request's properties as a service worker gets them: the caller's, unaltered,
    then the envelope."""
    return with_users(properties, [
        (REQUEST_ID, request), (SENDER, sender), (RETRY, str(retry)),
        (DUP, "true" if dup else "false")], frozenset({TOPIC_ENVELOPE}))


def delivered_topic_envelope(service: str, request: str, retry: int, dup: bool,
                             sender: str) -> str:
    """The topic a 3.1.1 service worker gets a request on (the envelope in its levels)."""
    return (f"{SERVICE_PREFIX}{service}/{request}/{retry}/{int(dup)}/"
            f"{quote(sender, safe='')}")


def reply_topic_of(properties: Properties) -> str | None:
    return get_property(properties, _RESPONSE_TOPIC)


def correlation_of(properties: Properties) -> bytes | None:
    return get_property(properties, _CORRELATION)


def reply_properties(published: Properties, request: str,
                     correlation: bytes | None) -> Properties:
    """A reply as the caller gets it: the service worker's properties (the envelope names
    removed: only the broker sets them), the request's Correlation Data (a reply by request
    id, from a 3.1.1 worker say, may have none) and ``meshmq-request-id``."""
    properties = with_users(published, [(REQUEST_ID, request)], ENVELOPE_NAMES)
    properties.pop(_RESPONSE_TOPIC, None)
    if correlation is not None:
        properties[_CORRELATION] = correlation
    return properties


def error_properties(correlation: bytes | None, request: str | None, kind: str) -> Properties:
    """An error reply's properties (``request``: None for a request never stored)."""
    pairs = [(ERROR, kind)] if request is None else [(REQUEST_ID, request), (ERROR, kind)]
    properties: Properties = {_USER: pairs}
    if correlation is not None:
        properties[_CORRELATION] = correlation
    return properties
