"""Options of the meshmq data source: parsing, one-line errors, and Hypothesis properties of the
parsers (offset JSON, timestamps, topic filters, property blocks, micro-batch caps). No Spark."""

from __future__ import annotations

import json
import string

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmq.mqtt.codec import encode_properties
from meshmq.mqtt.properties import PropertyId
from meshmq.pipeline.errors import SourceOptionError
from meshmq.pipeline.options import (
    EARLIEST,
    LATEST,
    PositionSpec,
    Timestamp,
    parse_offsets,
    parse_options,
    parse_timestamp,
    parse_topics,
)
from meshmq.pipeline.properties import MALFORMED_KEY, properties_map
from meshmq.pipeline.stream import cap_offsets, offsets_from_json, offsets_to_json

pytestmark = pytest.mark.xdist_group("spark")


def test_defaults_follow_kafka() -> None:
    batch = parse_options({"path": "/d"}, streaming=False)
    assert batch.starting == PositionSpec(EARLIEST)
    assert batch.ending == PositionSpec(LATEST)
    assert batch.fail_on_data_loss is True
    assert batch.topics is None
    stream = parse_options({"path": "/d"}, streaming=True)
    assert stream.starting == PositionSpec(LATEST)


def test_offsets_json_mixes_offsets_with_earliest_and_latest() -> None:
    spec = parse_options({"path": "/d", "startingOffsets": '{"2": 40, "0": -2, "1": -1}'},
                         streaming=False).starting
    assert [spec.for_partition(p) for p in range(4)] == [EARLIEST, LATEST, 40, EARLIEST]


def test_timestamps_in_milliseconds_or_iso_8601() -> None:
    opts = parse_options({"path": "/d", "startingTimestamp": "2024-05-01T00:00:00Z",
                          "endingOffsetsByTimestamp": '{"1": 1714521600500}'}, streaming=False)
    assert opts.starting == PositionSpec(Timestamp(1714521600000))
    assert opts.ending.for_partition(1) == Timestamp(1714521600500)
    assert opts.ending.for_partition(0) == LATEST
    assert parse_timestamp("t", "2024-05-01T02:00:00+02:00") == 1714521600000
    assert parse_timestamp("t", "2024-05-01 00:00:00") == 1714521600000  # no zone: UTC


def test_option_names_are_case_insensitive() -> None:
    opts = parse_options({"PATH": "/d", "failondataloss": "False",
                          "MAXRECORDSPERTRIGGER": "10"}, streaming=True)
    assert (opts.path, opts.fail_on_data_loss, opts.max_records_per_trigger) == ("/d", False, 10)


@pytest.mark.parametrize(("options", "streaming", "names"), [
    ({}, False, "path"),
    ({"path": "/d", "startingOffset": "earliest"}, False, "startingoffset"),
    ({"path": "/d", "startingOffsets": "oldest"}, False, "startingOffsets"),
    ({"path": "/d", "startingOffsets": '{"zero": 1}'}, False, "'zero'"),
    ({"path": "/d", "startingOffsets": '{"0": -3}'}, False, "partition 0"),
    ({"path": "/d", "startingOffsets": '{"0": 1.5}'}, False, "partition 0"),
    ({"path": "/d", "startingOffsets": "[1, 2]"}, False, "startingOffsets"),
    ({"path": "/d", "startingOffsets": "earliest", "startingTimestamp": "5"}, False,
     "cannot be used together"),
    ({"path": "/d", "startingTimestamp": "yesterday"}, False, "startingTimestamp"),
    ({"path": "/d", "startingOffsetsByTimestamp": '{"0": true}'}, False, "partition 0"),
    ({"path": "/d", "endingOffsets": "latest"}, True, "batch"),
    ({"path": "/d", "maxRecordsPerTrigger": "10"}, False, "streaming"),
    ({"path": "/d", "maxRecordsPerTrigger": "0"}, True, "maxRecordsPerTrigger"),
    ({"path": "/d", "failOnDataLoss": "maybe"}, False, "failOnDataLoss"),
    ({"path": "/d", "topics": "a/#/b"}, False, "a/#/b"),
    ({"path": "/d", "topics": " , "}, False, "topics"),
    ({"path": "/d", "topics": "$share/g/a/b"}, False, "shared"),
])
def test_bad_options_get_one_line_errors_naming_them(options: dict[str, str], streaming: bool,
                                                     names: str) -> None:
    with pytest.raises(SourceOptionError) as caught:
        parse_options({k.lower(): v for k, v in options.items()}, streaming=streaming)
    message = str(caught.value)
    assert names.lower() in message.lower()
    assert "\n" not in message


def test_topic_filters_follow_mqtt_matching() -> None:
    topics = parse_topics("sensors/+/temp, alerts/#")
    assert topics.matches("sensors/d1/temp")
    assert topics.matches("alerts")  # '#' matches the parent level too
    assert topics.matches("alerts/x/y")
    assert not topics.matches("sensors/d1/temp/raw")
    assert not parse_topics("#").matches("$SYS/broker/uptime")  # MQTT-4.7.2-1
    assert parse_topics("$SYS/#").matches("$SYS/broker/uptime")


# -- Hypothesis: the parsers accept what they should and refuse the rest with one error type --

partition_numbers = st.integers(0, 1000)
offsets = st.integers(-2, 2**62)


@given(st.dictionaries(partition_numbers, offsets, max_size=6))
def test_offset_json_round_trips(wanted: dict[int, int]) -> None:
    spec = parse_offsets("startingOffsets", json.dumps({str(k): v for k, v in wanted.items()}),
                         EARLIEST)
    for partition in range(0, 1001, 50):
        assert spec.for_partition(partition) == wanted.get(partition, EARLIEST)
    for partition, offset in wanted.items():
        assert spec.for_partition(partition) == offset


@given(st.text(max_size=40))
def test_any_offsets_text_parses_or_is_refused_cleanly(text: str) -> None:
    try:
        spec = parse_offsets("startingOffsets", text, EARLIEST)
    except SourceOptionError as exc:
        assert "startingOffsets" in str(exc)
    else:
        assert isinstance(spec, PositionSpec)


@given(st.text(max_size=30))
def test_any_timestamp_text_parses_or_is_refused_cleanly(text: str) -> None:
    try:
        ms = parse_timestamp("startingTimestamp", text)
    except SourceOptionError as exc:
        assert "startingTimestamp" in str(exc)
    else:
        assert ms >= 0


@given(st.integers(0, 2**48))
def test_millisecond_timestamps_round_trip(ms: int) -> None:
    assert parse_timestamp("t", str(ms)) == ms


@given(st.text(alphabet=string.ascii_letters + "/+#$, ", max_size=30))
def test_any_topics_text_parses_or_is_refused_cleanly(text: str) -> None:
    try:
        topics = parse_topics(text)
    except SourceOptionError as exc:
        assert "topics" in str(exc)
    else:
        assert topics.filters


user_properties = st.lists(st.tuples(st.text(min_size=1, max_size=8).filter(
    lambda s: "\x00" not in s), st.text(max_size=8).filter(lambda s: "\x00" not in s)),
    max_size=4)


@given(user_properties, st.one_of(st.none(), st.binary(max_size=20)),
       st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_property_blocks_decode_to_string_pairs(pairs: list[tuple[str, str]],
                                                correlation: bytes | None,
                                                expiry: int | None) -> None:
    props: dict[int, object] = {}
    if pairs:
        props[PropertyId.USER_PROPERTY] = pairs
    if correlation is not None:
        props[PropertyId.CORRELATION_DATA] = correlation
    if expiry is not None:
        props[PropertyId.MESSAGE_EXPIRY_INTERVAL] = expiry
    expected = dict(pairs)
    if correlation is not None:
        expected["correlation_data"] = correlation.hex()
    if expiry is not None:
        expected["message_expiry"] = str(expiry)
    assert properties_map(encode_properties(props)) == expected


@given(st.binary(max_size=60))
def test_any_property_bytes_give_a_map_and_lose_nothing(block: bytes) -> None:
    result = properties_map(block)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in result.items())
    if MALFORMED_KEY in result and len(result) == 1:
        assert bytes.fromhex(result[MALFORMED_KEY]) == block


def test_empty_property_blocks_are_empty_maps() -> None:
    assert properties_map(b"") == {}  # MQTT 3.1.1 publishes, as docs/log-format.md allows
    assert properties_map(b"\x00") == {}  # what the broker writes for "no properties"


@given(st.dictionaries(st.integers(0, 7), st.tuples(st.integers(0, 10**6), st.integers(0, 10**4)),
                       min_size=1), st.integers(1, 10**5))
@settings(max_examples=200)
def test_micro_batch_caps_share_the_limit_and_always_progress(
        ranges: dict[int, tuple[int, int]], limit: int) -> None:
    start = {p: first for p, (first, _) in ranges.items()}
    end = {p: first + waiting for p, (first, waiting) in ranges.items()}
    capped = cap_offsets(start, end, limit)
    assert all(start[p] <= capped[p] <= end[p] for p in start)
    taken = sum(capped[p] - start[p] for p in start)
    assert taken == min(limit, sum(end[p] - start[p] for p in start))


@given(st.dictionaries(st.integers(0, 5), st.integers(0, 2**62)))
def test_stream_offsets_round_trip_through_json(value: dict[int, int]) -> None:
    full = {p: value.get(p, 0) for p in range(6)}
    encoded = json.loads(json.dumps(offsets_to_json(full)))
    assert offsets_from_json(encoded, 6) == full


@pytest.mark.parametrize("bad", [[1, 2], {"0": -1, "1": 0}, {"0": 1}, {"x": 1, "1": 2},
                                 {"0": True, "1": 2}, {"0": 1, "1": 2, "2": 3}])
def test_foreign_stream_offsets_are_refused(bad: object) -> None:
    with pytest.raises(Exception, match=r"meshmq offset|another log"):
        offsets_from_json(bad, 2)  # type: ignore[arg-type]


@pytest.mark.parametrize(("given", "path"), [
    ("/srv/meshmq", "/srv/meshmq"), ("file:///srv/mesh%20mq", "/srv/mesh mq"),
    ("file://localhost/srv/meshmq", "/srv/meshmq"), ("data", "data"),
])
def test_paths_may_be_plain_or_file_uris(given: str, path: str) -> None:
    assert parse_options({"path": given}, streaming=False).path == path


def test_remote_filesystems_are_refused() -> None:
    with pytest.raises(SourceOptionError, match="not hdfs"):
        parse_options({"path": "hdfs://namenode/meshmq"}, streaming=False)
