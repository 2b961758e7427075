"""Topic names and topic filters (spec 4.7, 4.8.2): validation, shared filters, matching."""

from __future__ import annotations

from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.reason_codes import ReasonCode

SHARE_PREFIX = "$share/"


def validate_topic_name(topic: str, max_levels: int = 128) -> None:
    """Raise ``RemoteProtocolError`` (0x90) unless ``topic`` may be published to."""
    if not topic:
        raise RemoteProtocolError("empty topic name", ReasonCode.TOPIC_NAME_INVALID)
    if "+" in topic or "#" in topic:
        # MQTT-3.3.2-2
        raise RemoteProtocolError("wildcard in topic name", ReasonCode.TOPIC_NAME_INVALID)
    if "\x00" in topic:
        # MQTT-4.7.3-2
        raise RemoteProtocolError("U+0000 in topic name", ReasonCode.TOPIC_NAME_INVALID)
    if len(topic) > 16383 and len(topic.encode("utf-8")) > 65535:
        # MQTT-4.7.3-3
        raise RemoteProtocolError("topic name too long", ReasonCode.TOPIC_NAME_INVALID)
    if topic.count("/") >= max_levels:
        raise RemoteProtocolError("too many topic levels", ReasonCode.TOPIC_NAME_INVALID)


def validate_topic_filter(topic_filter: str, max_levels: int = 128) -> None:
    """Raise ``RemoteProtocolError`` (0x8F) unless ``topic_filter`` is a valid filter."""
    def invalid(why: str) -> RemoteProtocolError:
        return RemoteProtocolError(f"{why}: {topic_filter!r}", ReasonCode.TOPIC_FILTER_INVALID)

    if not topic_filter:
        raise invalid("empty topic filter")  # MQTT-4.7.3-1
    if "\x00" in topic_filter:
        raise invalid("U+0000 in topic filter")
    if len(topic_filter.encode("utf-8")) > 65535:
        raise invalid("topic filter too long")
    plain = topic_filter
    if topic_filter.startswith(SHARE_PREFIX):
        name, sep, plain = topic_filter[len(SHARE_PREFIX):].partition("/")
        if not sep or not name or "+" in name or "#" in name:
            raise invalid("invalid share name")  # MQTT-4.8.2-1, -2
        if not plain:
            raise invalid("shared subscription without a filter")
    levels = plain.split("/")
    if len(levels) > max_levels:
        raise invalid("too many topic levels")
    last = len(levels) - 1
    for index, level in enumerate(levels):
        if "#" in level and (level != "#" or index != last):
            raise invalid("'#' must be the whole last level")  # MQTT-4.7.1-1
        if "+" in level and level != "+":
            raise invalid("'+' must be a whole level")  # MQTT-4.7.1-2


def parse_shared_filter(topic_filter: str) -> tuple[str | None, str]:
    """Split ``$share/{name}/{filter}`` into (name, filter); (None, filter) otherwise."""
    if not topic_filter.startswith(SHARE_PREFIX):
        return None, topic_filter
    name, _, plain = topic_filter[len(SHARE_PREFIX):].partition("/")
    return name, plain


def has_wildcard(topic_filter: str) -> bool:
    return "+" in topic_filter or "#" in topic_filter


def topic_matches(topic_filter: str, topic: str) -> bool:
    """Reference matcher for one (non-shared) filter and one topic name."""
    if topic.startswith("$") and topic_filter[:1] in ("+", "#"):
        return False  # MQTT-4.7.2-1
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    for index, level in enumerate(filter_levels):
        if level == "#":
            return True
        if index >= len(topic_levels):
            return False
        if level != "+" and level != topic_levels[index]:
            return False
    return len(filter_levels) == len(topic_levels)
