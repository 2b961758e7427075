"""Access control lists: who may publish to and receive from which topics.

Rules file, one rule per line, ``SUBJECT ACCESS TOPIC``, fields separated by blanks::

    # subject        access      topic pattern
    user:alice       readwrite   devices/alice/#
    client:gateway-1 write       telemetry/#
    *                readwrite   devices/%u/#        # %u user name, %c client id
    *                deny        admin/#
    user:admin       readwrite   #
    user:monitor     read        $SYS/#

A line whose first non-blank character is ``#`` is a comment, and so is a fourth field that
starts with ``#``; a ``#`` in the third field is always the topic pattern (``#`` alone is every
topic). Subjects: ``user:NAME``, ``client:ID`` or ``*`` (anyone). Access: ``read``, ``write``,
``readwrite`` or ``deny``. The first rule whose subject matches the client, whose pattern
matches the topic and whose access is ``deny`` or covers the operation decides; when no rule
decides, the answer is deny (ACLs on means default deny).

Checks: PUBLISH needs write on its topic; SUBSCRIBE needs read on its filter, where a pattern
matches a filter only if it covers every topic the filter can match (``devices/alice/#`` covers
``devices/alice/+/temp``, not ``devices/#``), and a deny refuses it only when it covers the whole
filter; each delivery needs read on the message's topic, so a deny rule inside a broad allowed
filter still holds. Results are cached per client.

``$`` topics: a pattern starting with a wildcard never matches a topic or filter starting with
``$`` (MQTT-4.7.2-1), so ``#`` does not grant ``$SYS``; a rule naming ``$SYS/#`` does.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.topics import topic_matches, validate_topic_filter

ACCESS = {"read": (True, False), "write": (False, True), "readwrite": (True, True)}


class ACLFileError(Exception):
    """The ACL file is unreadable or a line is malformed (the message names file and line)."""


@dataclass(frozen=True, slots=True)
class Rule:
    kind: str  # "user", "client" or "*"
    name: str
    access: str  # read | write | readwrite | deny
    pattern: str

    def applies_to(self, username: str | None, client_id: str) -> bool:
        if self.kind == "*":
            return True
        return (username if self.kind == "user" else client_id) == self.name

    def pattern_for(self, username: str | None, client_id: str) -> str | None:
        if "%u" in self.pattern and username is None:
            return None  # a %u rule never matches an anonymous client
        return self.pattern.replace("%u", username or "").replace("%c", client_id)


def read_acl_file(path: str | os.PathLike[str]) -> list[Rule]:
    """The rules of the file at ``path``; ``ACLFileError`` naming file, line and what was
    expected if one line is malformed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ACLFileError(f"{path}: cannot read ACL file: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ACLFileError(f"{path}: cannot read ACL file: not UTF-8 text") from None
    rules = []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):  # a comment line
            continue
        rules.append(_parse_rule(stripped, f"{path}:{number}"))
    return rules


def _parse_rule(line: str, where: str) -> Rule:
    parts = line.split(maxsplit=3)
    if len(parts) < 3 or (len(parts) == 4 and not parts[3].startswith("#")):
        raise ACLFileError(f"{where}: expected 'SUBJECT ACCESS TOPIC' (then optionally"
                           f" '# comment'), got {line!r}")
    subject, access, pattern = parts[:3]
    if access not in (*ACCESS, "deny"):
        raise ACLFileError(f"{where}: expected access read, write, readwrite or deny,"
                           f" got {access!r}")
    try:
        validate_topic_filter(pattern)
    except RemoteProtocolError as exc:
        raise ACLFileError(f"{where}: expected a valid topic pattern: {exc}") from None
    if subject == "*":
        return Rule("*", "", access, pattern)
    kind, sep, name = subject.partition(":")
    if not sep or kind not in ("user", "client") or not name:
        raise ACLFileError(f"{where}: expected subject user:NAME, client:ID or *,"
                           f" got {subject!r}")
    return Rule(kind, name, access, pattern)


def filter_covered(pattern: str, topic_filter: str) -> bool:
    """True if every topic ``topic_filter`` can match is matched by ``pattern``."""
    pattern_levels = pattern.split("/")
    filter_levels = topic_filter.split("/")
    if topic_filter.startswith("$") != pattern.startswith("$") and pattern[:1] in "+#":
        return False
    for index, level in enumerate(pattern_levels):
        if level == "#":
            return True
        if index >= len(filter_levels):
            return False
        wanted = filter_levels[index]
        if wanted == "#" or (level != "+" and level != wanted):
            return False
    return len(pattern_levels) == len(filter_levels)


class AccessControl:
    """First-match-wins ACL evaluation with a per-client decision cache."""

    CACHE_LIMIT = 1024

    def __init__(self, rules: list[Rule]) -> None:
        self.rules = rules
        self._cache: dict[tuple[str, str | None], dict[tuple[str, bool], bool]] = {}

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> AccessControl:
        return cls(read_acl_file(path))

    def can_publish(self, username: str | None, client_id: str, topic: str) -> bool:
        return self._decide(username, client_id, topic, write=True, is_filter=False)

    def can_receive(self, username: str | None, client_id: str, topic: str) -> bool:
        return self._decide(username, client_id, topic, write=False, is_filter=False)

    def can_subscribe(self, username: str | None, client_id: str, topic_filter: str) -> bool:
        return self._decide(username, client_id, topic_filter, write=False, is_filter=True)

    def forget(self, username: str | None, client_id: str) -> None:
        """Drop the cached decisions of a client (call when its connection ends)."""
        self._cache.pop((client_id, username), None)

    def _decide(
        self, username: str | None, client_id: str, topic: str, write: bool, is_filter: bool
    ) -> bool:
        cache = self._cache.get((client_id, username))
        if cache is None:
            if len(self._cache) >= self.CACHE_LIMIT:
                self._cache.clear()
            cache = self._cache[(client_id, username)] = {}
        key = (topic, write) if not is_filter else ("\x00" + topic, write)
        decision = cache.get(key)
        if decision is None:
            if len(cache) >= self.CACHE_LIMIT:
                cache.clear()
            decision = cache[key] = self._evaluate(username, client_id, topic, write, is_filter)
        return decision

    def _evaluate(
        self, username: str | None, client_id: str, topic: str, write: bool, is_filter: bool
    ) -> bool:
        for rule in self.rules:
            if not rule.applies_to(username, client_id):
                continue
            pattern = rule.pattern_for(username, client_id)
            if pattern is None:
                continue
            if rule.access == "deny":
                # A deny covering the whole filter refuses the SUBSCRIBE; one covering part of
                # it is enforced on each delivery instead.
                hit = filter_covered(pattern, topic) if is_filter else topic_matches(pattern, topic)
                if hit:
                    return False
                continue
            can_read, can_write = ACCESS[rule.access]
            if not (can_write if write else can_read):
                continue
            if filter_covered(pattern, topic) if is_filter else topic_matches(pattern, topic):
                return True
        return False

