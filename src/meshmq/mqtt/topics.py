"""Topic names and topic filters (MQTT 5.0 sections 4.7, 4.8.2): validation and matching.

Pure functions, no I/O. ``validate_topic_name`` runs on every inbound PUBLISH, so it does one
C-level ``in``/``count`` scan per rule and no regex or splitting. Matching for routing lives in
``meshmq.broker.trie``; ``topic_matches`` here is the reference (and retained-message) matcher.
"""

from __future__ import annotations

from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.reason_codes import ReasonCode

SHARE_PREFIX = "$share/"
MAX_TOPIC_BYTES = 65535
# A code point is at most 4 UTF-8 bytes, so strings this short never need encoding to measure.
_SAFE_CHARS = MAX_TOPIC_BYTES // 4


def _too_long(text: str) -> bool:
    """True if ``text`` encodes to more than 65535 UTF-8 bytes (MQTT-1.5.4-1 string limit)."""
    if len(text) <= _SAFE_CHARS:
        return False
    return len(text.encode("utf-8", "surrogatepass")) > MAX_TOPIC_BYTES


def validate_topic_name(topic: str, max_levels: int = 128) -> None:
    """Return if ``topic`` may be published to; else raise 0x90 for the caller to send.

    An empty name with a topic alias is legal but is the caller's business, not this check's.
    """
    if not topic:
        raise RemoteProtocolError("empty topic name", ReasonCode.TOPIC_NAME_INVALID)
    if "+" in topic or "#" in topic:  # MQTT-3.3.2-2
        raise RemoteProtocolError(
            f"wildcard in topic name {topic!r}", ReasonCode.TOPIC_NAME_INVALID
        )
    if "\x00" in topic:  # MQTT-4.7.3-2
        raise RemoteProtocolError("U+0000 in topic name", ReasonCode.TOPIC_NAME_INVALID)
    if _too_long(topic):  # MQTT-4.7.3-3
        raise RemoteProtocolError("topic name too long", ReasonCode.TOPIC_NAME_INVALID)
    if topic.count("/") >= max_levels:
        raise RemoteProtocolError(
            f"topic name has more than {max_levels} levels", ReasonCode.TOPIC_NAME_INVALID
        )


def _invalid_filter(why: str, topic_filter: str) -> RemoteProtocolError:
    """Build the 0x8F error the caller raises (and puts in its SUBACK/UNSUBACK)."""
    return RemoteProtocolError(f"{why}: {topic_filter!r}", ReasonCode.TOPIC_FILTER_INVALID)


def _check_wildcards(plain: str, topic_filter: str) -> None:
    """Raise unless every '#' and '+' in the plain (non-shared) filter occupies a whole level."""
    if "#" in plain and (  # MQTT-4.7.1-1: '#' alone, and only as the last level
        plain.count("#") != 1 or not (plain == "#" or plain.endswith("/#"))
    ):
        raise _invalid_filter("'#' must be the whole last level", topic_filter)
    if "+" in plain:  # MQTT-4.7.1-2: '+' fills a whole level
        for level in plain.split("/"):
            if level != "+" and "+" in level:
                raise _invalid_filter("'+' must occupy a whole level", topic_filter)


def _strip_share(topic_filter: str) -> str:
    """Return the filter inside ``$share/{name}/``; raise if the share name or filter is bad."""
    name, sep, plain = topic_filter[len(SHARE_PREFIX) :].partition("/")
    if not sep or not name:  # MQTT-4.8.2-1: ShareName is at least one character
        raise _invalid_filter("shared subscription needs $share/{name}/{filter}", topic_filter)
    if "+" in name or "#" in name:  # MQTT-4.8.2-2: no '/', '+' or '#' in ShareName
        raise _invalid_filter("wildcard in share name", topic_filter)
    if not plain:
        raise _invalid_filter("shared subscription without a filter", topic_filter)
    return plain


def validate_topic_filter(topic_filter: str, max_levels: int = 128) -> None:
    """Return if ``topic_filter`` (plain or ``$share/``) is subscribable; else raise 0x8F.

    The caller then splits a valid filter with ``parse_shared_filter``.
    """
    if not topic_filter:  # MQTT-4.7.3-1
        raise _invalid_filter("empty topic filter", topic_filter)
    if "\x00" in topic_filter:  # MQTT-4.7.3-2
        raise _invalid_filter("U+0000 in topic filter", topic_filter)
    if _too_long(topic_filter):  # MQTT-4.7.3-3
        raise _invalid_filter("topic filter too long", topic_filter)
    plain = topic_filter
    if topic_filter.startswith(SHARE_PREFIX):
        plain = _strip_share(topic_filter)
    _check_wildcards(plain, topic_filter)
    if plain.count("/") >= max_levels:
        raise _invalid_filter(f"more than {max_levels} levels", topic_filter)


def parse_shared_filter(topic_filter: str) -> tuple[str | None, str]:
    """Split a validated filter into (share name, plain filter); (None, filter) if not shared.

    The caller indexes the plain filter and keys shared entries by the share name.
    """
    if not topic_filter.startswith(SHARE_PREFIX):
        return None, topic_filter
    name, _, plain = topic_filter[len(SHARE_PREFIX) :].partition("/")
    return name, plain


def has_wildcard(topic_filter: str) -> bool:
    """True if the filter contains '+' or '#' (the caller may refuse it with 0xA2)."""
    return "+" in topic_filter or "#" in topic_filter


def topic_matches(topic_filter: str, topic: str) -> bool:
    """True if the plain (non-shared) ``topic_filter`` matches the topic name ``topic``.

    Reference semantics: '+' matches exactly one level (possibly empty), '#' matches the parent
    level and any number of child levels, and a filter starting with a wildcard never matches
    a topic starting with '$' (MQTT-4.7.2-1).
    """
    if topic[:1] == "$" and topic_filter[:1] in ("+", "#"):  # MQTT-4.7.2-1
        return False
    filter_levels = topic_filter.split("/")
    topic_levels = topic.split("/")
    depth = len(topic_levels)
    for index, level in enumerate(filter_levels):
        if level == "#":  # MQTT-4.7.1-1: also matches the parent ("sport/#" ~ "sport")
            return True
        if index >= depth:
            return False
        if level != "+" and level != topic_levels[index]:
            return False
    return len(filter_levels) == depth
