"""ACL rule evaluation: first match wins, substitution, filter coverage, default deny."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshmq.auth.acl import AccessControl, ACLFileError, filter_covered, read_acl_file

RULES = """
# subject        access     pattern
*                deny       admin/#         # nobody, whatever comes later
user:alice       readwrite  devices/alice/#
client:gw-1      write      telemetry/#
*                readwrite  home/%u/#
*                read       clients/%c/inbox
*                read       broadcast/#
"""


@pytest.fixture
def acl(tmp_path: Path) -> AccessControl:
    path = tmp_path / "acl"
    path.write_text(RULES)
    return AccessControl.from_file(path)


@pytest.mark.parametrize(
    ("user", "client", "topic", "write", "allowed"),
    [
        ("alice", "a1", "devices/alice/t", True, True),
        ("alice", "a1", "devices/bob/t", True, False),  # default deny
        ("bob", "gw-1", "telemetry/x", True, True),
        ("bob", "gw-1", "telemetry/x", False, False),  # write-only rule does not give read
        ("bob", "b1", "home/bob/lamp", True, True),
        ("bob", "b1", "home/alice/lamp", True, False),
        (None, "anon", "home//lamp", True, False),  # %u never matches an anonymous client
        ("carol", "c9", "clients/c9/inbox", False, True),
        ("carol", "c9", "clients/c8/inbox", False, False),
        ("alice", "a1", "admin/reset", True, False),  # deny listed first wins
        ("alice", "a1", "broadcast/news", False, True),
        ("alice", "a1", "broadcast/news", True, False),
    ],
)
def test_topic_decisions(acl, user, client, topic, write, allowed) -> None:
    check = acl.can_publish if write else acl.can_receive
    assert check(user, client, topic) is allowed
    assert check(user, client, topic) is allowed  # cached answer is the same


@pytest.mark.parametrize(
    ("topic_filter", "allowed"),
    [
        ("devices/alice/#", True),
        ("devices/alice/+/temp", True),
        ("devices/#", False),  # wider than the rule
        ("broadcast/#", True),
        ("admin/#", False),
        ("#", False),
    ],
)
def test_subscribe_needs_a_covering_read_rule(acl, topic_filter: str, allowed: bool) -> None:
    assert acl.can_subscribe("alice", "a1", topic_filter) is allowed


def test_partial_deny_is_enforced_per_delivery(tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text("* deny data/secret/#\n* read data/#\n")
    acl = AccessControl.from_file(path)
    assert acl.can_subscribe("u", "c", "data/#")
    assert acl.can_receive("u", "c", "data/public")
    assert not acl.can_receive("u", "c", "data/secret/key")
    assert not acl.can_subscribe("u", "c", "data/secret/#")


@pytest.mark.parametrize(
    ("pattern", "topic_filter", "covered"),
    [("#", "a/b", True), ("a/#", "a", True), ("a/+", "a/b", True), ("a/+", "a/+", True),
     ("a/+", "a/#", False), ("a/b", "a/+", False), ("+/b", "a/b/c", False), ("#", "$SYS/x", False)],
)
def test_filter_covered(pattern: str, topic_filter: str, covered: bool) -> None:
    assert filter_covered(pattern, topic_filter) is covered


@pytest.mark.parametrize(
    "line", ["user:alice readwrite", "who:alice read a", "user: read a", "* maybe a/b"]
)
def test_malformed_rules_name_file_and_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "acl"
    path.write_text(f"# ok\n{line}\n")
    with pytest.raises(ACLFileError, match=f"{path}:2"):
        read_acl_file(path)
