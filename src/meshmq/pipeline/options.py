"""Options of the ``meshmq`` data source, parsed once into a frozen ``ReadOptions``.

Spark hands options over as strings in a case-insensitive map. Every parser here raises
``SourceOptionError`` with a one-line message naming the option and the value it could not
use; unknown options are refused too, so that a typo (``startingOffset``) is not silently
ignored. The options, with Kafka's names where Kafka has one:

=============================  =================================================================
path                           a broker data_dir, or its ``log`` directory (required)
startingOffsets                ``earliest``, ``latest``, or JSON ``{"0": 42, "3": -2}``
endingOffsets                  (batch) ``latest``, ``earliest`` or JSON; exclusive
startingTimestamp              ms since the epoch or ISO-8601, for every partition
endingTimestamp                (batch) likewise; records strictly before it are read
startingOffsetsByTimestamp     JSON ``{"0": 1700000000000, "1": "2024-05-01T00:00:00Z"}``
endingOffsetsByTimestamp       (batch) likewise
topics                         comma-separated MQTT topic filters; others are skipped
maxRecordsPerTrigger           (streaming) at most this many offsets per micro-batch
failOnDataLoss                 ``true`` (default): a deleted range is an error; ``false``: warn
=============================  =================================================================

In offset JSON, ``-2`` means earliest and ``-1`` latest (as in Kafka); partitions left out
use the default: for starting, ``earliest`` in a batch read and ``latest`` in a streaming one
(Kafka's defaults); for ending, ``latest``. At most one of the three
starting options (and of the three ending ones) may be given.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from urllib.parse import unquote

from meshmq.mqtt.errors import MQTTError
from meshmq.mqtt.topics import parse_shared_filter, topic_matches, validate_topic_filter
from meshmq.pipeline.errors import SourceOptionError

EARLIEST = -2
LATEST = -1

KNOWN_OPTIONS = frozenset({
    "path", "paths", "startingoffsets", "endingoffsets", "startingtimestamp", "endingtimestamp",
    "startingoffsetsbytimestamp", "endingoffsetsbytimestamp", "topics",
    "maxrecordspertrigger", "failondataloss",
})
_SPELLING = {name.lower(): name for name in (
    "startingOffsets", "endingOffsets", "startingTimestamp", "endingTimestamp",
    "startingOffsetsByTimestamp", "endingOffsetsByTimestamp")}
STREAM_ONLY = ("maxrecordspertrigger",)
BATCH_ONLY = ("endingoffsets", "endingtimestamp", "endingoffsetsbytimestamp")


@dataclass(frozen=True, slots=True)
class Timestamp:
    """A position given as a time: the first offset whose record timestamp is >= ``ms``."""

    ms: int


Position = int | Timestamp  # an offset >= 0, EARLIEST, LATEST, or a Timestamp


@dataclass(frozen=True, slots=True)
class PositionSpec:
    """Where to start (or stop) in each partition: a default and per-partition overrides."""

    default: Position
    overrides: tuple[tuple[int, Position], ...] = ()
    option: str = field(default="", compare=False)  # the option it came from, for errors

    def for_partition(self, partition: int) -> Position:
        for number, position in self.overrides:
            if number == partition:
                return position
        return self.default

    def check_partitions(self, count: int) -> None:
        """Refuse overrides for partitions the log does not have."""
        for number, _ in self.overrides:
            if number >= count:
                raise SourceOptionError(
                    f"{self.option}: partition {number} does not exist (the log has {count}:"
                    f" 0..{count - 1})")


@dataclass(frozen=True, slots=True)
class TopicFilter:
    """The ``topics`` option: MQTT filters a record's topic must match one of."""

    filters: tuple[str, ...]

    def matches(self, topic: str) -> bool:
        return any(topic_matches(f, topic) for f in self.filters)


@dataclass(frozen=True, slots=True)
class ReadOptions:
    path: str
    starting: PositionSpec
    ending: PositionSpec = field(default_factory=lambda: PositionSpec(LATEST))
    topics: TopicFilter | None = None
    max_records_per_trigger: int | None = None
    fail_on_data_loss: bool = True


def parse_options(options: Mapping[str, str], *, streaming: bool) -> ReadOptions:
    """Parse Spark's option map for a batch (``streaming=False``) or a streaming read."""
    opts = {key.lower(): value for key, value in options.items()}
    unknown = sorted(set(opts) - KNOWN_OPTIONS)
    if unknown:
        raise SourceOptionError(f"unknown option {unknown[0]!r} for the meshmq source (known:"
                                " path, startingOffsets, endingOffsets, startingTimestamp,"
                                " endingTimestamp, startingOffsetsByTimestamp,"
                                " endingOffsetsByTimestamp, topics, maxRecordsPerTrigger,"
                                " failOnDataLoss)")
    for key in BATCH_ONLY if streaming else STREAM_ONLY:
        if key in opts:
            kind = "batch" if streaming else "streaming"
            name = _SPELLING.get(key, "maxRecordsPerTrigger")
            raise SourceOptionError(f"option {name!r} applies only to {kind} reads")
    default_start = LATEST if streaming else EARLIEST
    return ReadOptions(
        path=_parse_path(opts),
        starting=_parse_spec(opts, "starting", default_start),
        ending=_parse_spec(opts, "ending", LATEST),
        topics=parse_topics(opts["topics"]) if "topics" in opts else None,
        max_records_per_trigger=_parse_positive(opts, "maxrecordspertrigger"),
        fail_on_data_loss=parse_bool("failOnDataLoss", opts.get("failondataloss", "true")),
    )


def _parse_path(opts: dict[str, str]) -> str:
    path = opts.get("path")
    if not path and opts.get("paths"):
        paths = json.loads(opts["paths"]) if opts["paths"].startswith("[") else [opts["paths"]]
        if len(paths) != 1:
            raise SourceOptionError(f"the meshmq source reads one log, got {len(paths)} paths")
        path = paths[0]
    if not path:
        raise SourceOptionError(
            "no path: use .load(data_dir) or .option(\"path\", data_dir) with the broker's"
            " data_dir or its log directory")
    scheme, _, rest = path.partition("://")
    if not rest or "/" in scheme:
        return path
    if scheme.lower() != "file":
        raise SourceOptionError(f"path {path!r}: the meshmq source reads files on a local or"
                                " shared mount (file:// or a plain path), not " + scheme)
    return unquote(rest[rest.index("/"):]) if "/" in rest else path


def _parse_spec(opts: dict[str, str], which: str, default: Position) -> PositionSpec:
    names = (f"{which}offsets", f"{which}timestamp", f"{which}offsetsbytimestamp")
    given = [name for name in names if name in opts]
    if len(given) > 1:
        raise SourceOptionError(f"options {given[0]!r} and {given[1]!r} cannot be used together")
    if not given:
        return PositionSpec(default)
    name = _SPELLING[given[0]]
    value = opts[given[0]].strip()
    if name.endswith("ByTimestamp"):
        return PositionSpec(default, _parse_partition_json(name, value, _timestamp_entry), name)
    if name.endswith("Timestamp"):
        return PositionSpec(Timestamp(parse_timestamp(name, value)), (), name)
    return parse_offsets(name, value, default)


def parse_offsets(option: str, value: str, default: Position) -> PositionSpec:
    """``earliest``, ``latest`` or a JSON object of partition -> offset (-2/-1 allowed)."""
    word = value.strip().lower()
    if word == "earliest":
        return PositionSpec(EARLIEST, (), option)
    if word == "latest":
        return PositionSpec(LATEST, (), option)
    return PositionSpec(default, _parse_partition_json(option, value, _offset_entry), option)


def _parse_partition_json(option: str, value: str,
                          entry: Callable[[str, str, object], Position]
                          ) -> tuple[tuple[int, Position], ...]:
    try:
        parsed = json.loads(value)
    except ValueError:
        raise SourceOptionError(
            f"{option}: expected 'earliest', 'latest' or a JSON object like {{\"0\": 42}},"
            f" got {value!r}") from None
    if not isinstance(parsed, dict):
        raise SourceOptionError(f"{option}: expected a JSON object of partition -> value,"
                                f" got {value!r}")
    result = []
    for key, item in parsed.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise SourceOptionError(f"{option}: partition {key!r} is not a partition number")
        result.append((int(key), entry(option, key, item)))
    return tuple(sorted(result, key=lambda pair: pair[0]))


def _offset_entry(option: str, key: str, item: object) -> Position:
    if isinstance(item, bool) or not isinstance(item, int) or item < EARLIEST:
        raise SourceOptionError(f"{option}: offset for partition {key} must be an integer >= 0"
                                f" (or -2 earliest, -1 latest), got {item!r}")
    return item


def _timestamp_entry(option: str, key: str, item: object) -> Position:
    if isinstance(item, bool) or not isinstance(item, int | str):
        raise SourceOptionError(f"{option}: timestamp for partition {key} must be ms since the"
                                f" epoch or an ISO-8601 string, got {item!r}")
    return Timestamp(parse_timestamp(f"{option} (partition {key})", str(item)))


def parse_timestamp(option: str, value: str) -> int:
    """Milliseconds since the epoch from ``1714521600000`` or ``2024-05-01T00:00:00Z``
    (an ISO time without a zone is UTC)."""
    text = value.strip()
    if text.isascii() and text.isdigit():
        return int(text)
    try:
        moment = datetime.fromisoformat(text)
    except ValueError:
        raise SourceOptionError(f"{option}: expected ms since the epoch or an ISO-8601 time,"
                                f" got {value!r}") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    ms = int(moment.timestamp() * 1000)
    if ms < 0:
        raise SourceOptionError(f"{option}: {value!r} is before 1970")
    return ms


def parse_topics(value: str) -> TopicFilter:
    """Comma-separated MQTT topic filters (``+``/``#`` allowed, ``$share/`` not)."""
    filters = tuple(f.strip() for f in value.split(",") if f.strip())
    if not filters:
        raise SourceOptionError("topics: expected one or more MQTT topic filters, got nothing")
    for topic_filter in filters:
        try:
            validate_topic_filter(topic_filter)
        except MQTTError as exc:
            raise SourceOptionError(f"topics: {topic_filter!r} is not a valid MQTT topic filter"
                                    f" ({exc})") from None
        if parse_shared_filter(topic_filter)[0] is not None:
            raise SourceOptionError(f"topics: {topic_filter!r} is a shared subscription; give"
                                    " the plain filter")
    return TopicFilter(filters)


def parse_bool(option: str, value: str) -> bool:
    word = value.strip().lower()
    if word in ("true", "1", "yes"):
        return True
    if word in ("false", "0", "no"):
        return False
    raise SourceOptionError(f"{option}: expected true or false, got {value!r}")


def _parse_positive(opts: dict[str, str], key: str) -> int | None:
    if key not in opts:
        return None
    value = opts[key].strip()
    if not (value.isascii() and value.isdigit()) or int(value) < 1:
        raise SourceOptionError(f"maxRecordsPerTrigger: expected a positive integer, got"
                                f" {opts[key]!r}")
    return int(value)
