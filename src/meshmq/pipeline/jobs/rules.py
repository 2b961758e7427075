"""Alert rules: a small TOML file of thresholds over the telemetry aggregates.

```toml
[[rule]]
name = "too-hot"               # letters, digits, "-", "_", "."; unique; ends the alert topic
field = "temp"                 # the telemetry field
op = ">"                       # >, >=, <, <=
threshold = 30                 # a finite number
stat = "max"                   # optional: min, max or mean (default: max for > and >=,
                               #   min for < and <=, i.e. "any reading crossed the line")
topics = "devices/+/telemetry" # optional: MQTT filters (a string, comma-separated, or a list)
```

``load_rules`` checks everything and raises ``RulesError`` with one line naming the file, the
rule and the key.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from meshmq.pipeline.jobs.common import JobError, parse_filters

OPERATORS = (">", ">=", "<", "<=")
STATS = ("min", "max", "mean")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_KEYS = {"name", "field", "op", "threshold", "stat", "topics"}


class RulesError(JobError):
    """The rules file is unreadable or a rule is invalid (one line, names the rule and key)."""


@dataclass(frozen=True)
class Rule:
    name: str
    field: str
    op: str
    threshold: float
    stat: str
    topics: tuple[str, ...] = ()

    @property
    def rising(self) -> bool:
        """True for > and >= (the worst value in a window is the largest)."""
        return self.op.startswith(">")

    def describe(self) -> str:
        where = f" on {','.join(self.topics)}" if self.topics else ""
        return f"{self.name}: {self.stat}({self.field}) {self.op} {self.threshold:g}{where}"


def load_rules(path: str | Path) -> list[Rule]:
    """Read and check a rules file; at least one rule is required."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RulesError(f"{path}: cannot read rules: {exc}") from None
    return parse_rules(text, str(path))


def parse_rules(text: str, origin: str = "rules") -> list[Rule]:
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RulesError(f"{origin}: invalid TOML: {exc}") from None
    unknown = sorted(set(document) - {"rule"})
    if unknown:
        raise RulesError(f"{origin}: unknown table or key {unknown[0]!r} (expected [[rule]])")
    entries = document.get("rule", [])
    if not isinstance(entries, list) or not entries:
        raise RulesError(f"{origin}: no rules (add at least one [[rule]] table)")
    rules: list[Rule] = []
    for number, entry in enumerate(entries, start=1):
        rule = _parse_rule(entry, f"{origin}: rule {number}")
        if any(existing.name == rule.name for existing in rules):
            raise RulesError(f"{origin}: rule {number}: duplicate name {rule.name!r}")
        rules.append(rule)
    return rules


def _parse_rule(entry: object, where: str) -> Rule:
    if not isinstance(entry, dict):
        raise RulesError(f"{where}: expected a [[rule]] table")
    name = entry.get("name")
    if isinstance(name, str):
        where = f"{where} ({name!r})"
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise RulesError(f"{where}: unknown key {unknown[0]!r}")
    for key in ("name", "field", "op", "threshold"):
        if key not in entry:
            raise RulesError(f"{where}: missing key {key!r}")
    if not isinstance(name, str) or not _NAME.match(name):
        raise RulesError(f"{where}: name must be 1-64 letters, digits, '-', '_' or '.', "
                         f"got {name!r}")
    field = entry["field"]
    if not isinstance(field, str) or not field:
        raise RulesError(f"{where}: field must be a non-empty string, got {field!r}")
    op = entry["op"]
    if op not in OPERATORS:
        raise RulesError(f"{where}: op must be one of {', '.join(OPERATORS)}, got {op!r}")
    threshold = entry["threshold"]
    if (isinstance(threshold, bool) or not isinstance(threshold, int | float)
            or not math.isfinite(threshold)):
        raise RulesError(f"{where}: threshold must be a finite number, got {threshold!r}")
    stat = entry.get("stat", "max" if op.startswith(">") else "min")
    if stat not in STATS:
        raise RulesError(f"{where}: stat must be one of {', '.join(STATS)}, got {stat!r}")
    return Rule(name, field, op, float(threshold), stat, _parse_topics(entry, where))


def _parse_topics(entry: dict[str, object], where: str) -> tuple[str, ...]:
    topics = entry.get("topics", "")
    if isinstance(topics, list) and all(isinstance(t, str) for t in topics):
        topics = ",".join(topics)
    if not isinstance(topics, str):
        raise RulesError(f"{where}: topics must be a string or a list of strings")
    try:
        return parse_filters(topics, "topics")
    except JobError as exc:
        raise RulesError(f"{where}: {exc}") from None
