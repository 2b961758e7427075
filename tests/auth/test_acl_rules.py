"""ACL rule evaluation: first match wins, substitution, filter coverage, default deny."""

from __future__ import annotations

from pathlib import Path

import pytest

from meshmq.auth.acl import AccessControl, ACLFileError, Rule, filter_covered, read_acl_file

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
    ("line", "expected"),
    [
        ("user:alice readwrite", "expected 'SUBJECT ACCESS TOPIC'"),
        ("user:alice readwrite # every topic", "expected 'SUBJECT ACCESS TOPIC'"),  # 4th field
        ("who:alice read a", "expected subject user:NAME, client:ID or *, got 'who:alice'"),
        ("user: read a", "expected subject user:NAME, client:ID or *, got 'user:'"),
        ("* maybe a/b", "expected access read, write, readwrite or deny, got 'maybe'"),
        ("* read a/#/b", "expected a valid topic pattern: '#' must be the whole last level"),
        ("* read #comment", "expected a valid topic pattern: '#' must be the whole last level"),
    ],
)
def test_malformed_rules_name_file_line_and_what_was_expected(
    tmp_path: Path, line: str, expected: str,
) -> None:
    path = tmp_path / "acl"
    path.write_text(f"# ok\n{line}\n")
    with pytest.raises(ACLFileError) as caught:
        read_acl_file(path)
    assert str(caught.value).startswith(f"{path}:2: {expected}")
    assert "\n" not in str(caught.value)


def test_hash_as_the_topic_is_every_topic_not_a_comment(tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text("user:alice readwrite #\n")
    acl = AccessControl.from_file(path)
    assert acl.can_publish("alice", "a1", "any/topic/at/all")
    assert acl.can_subscribe("alice", "a1", "#")
    assert not acl.can_publish("bob", "b1", "any/topic/at/all")


def test_comment_lines_and_trailing_comments(tmp_path: Path) -> None:
    path = tmp_path / "acl"
    path.write_text(
        "# a comment line\n"
        "   # an indented comment line\n"
        "\n"
        "user:alice  readwrite  #        # alice may use every topic\n"
        "user:bob    read       news/#   #no blank needed after the comment's '#'\n"
    )
    assert read_acl_file(path) == [
        Rule("user", "alice", "readwrite", "#"), Rule("user", "bob", "read", "news/#"),
    ]


def test_sys_topics_need_a_rule_naming_them(tmp_path: Path) -> None:
    """MQTT-4.7.2-1: a pattern starting with a wildcard does not match '$' topics, so '#'
    grants no $SYS; a monitoring user gets it from a rule naming $SYS."""
    path = tmp_path / "acl"
    path.write_text("user:admin readwrite #\nuser:monitor read $SYS/#\n")
    acl = AccessControl.from_file(path)
    assert not acl.can_subscribe("admin", "a", "$SYS/#")
    assert not acl.can_receive("admin", "a", "$SYS/broker/uptime")
    assert acl.can_subscribe("monitor", "m", "$SYS/#")
    assert acl.can_subscribe("monitor", "m", "$SYS/broker/+")
    assert acl.can_receive("monitor", "m", "$SYS/broker/uptime")
    assert not acl.can_subscribe("monitor", "m", "#")
    assert not acl.can_publish("monitor", "m", "$SYS/broker/uptime")  # read only


def test_the_example_in_security_md_loads_and_means_what_it_says(tmp_path: Path) -> None:
    docs = Path(__file__).resolve().parents[2] / "docs" / "security.md"
    section = docs.read_text().split("## ACL file format", 1)[1]
    path = tmp_path / "acl"
    path.write_text(section.split("```\n", 2)[1])
    acl = AccessControl.from_file(path)
    assert acl.can_subscribe("admin", "a", "#") and acl.can_publish("admin", "a", "x/y")
    assert not acl.can_subscribe("admin", "a", "$SYS/#")
    assert acl.can_subscribe("monitor", "m", "$SYS/#")
    assert acl.can_publish("bob", "b", "home/bob/lamp")
    assert not acl.can_publish("bob", "b", "admin/reset")
