"""The record-batch codec: round trips, torn prefixes, flipped bits, bad input."""

from __future__ import annotations

import os
import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshmq.log.errors import CorruptBatch, IncompleteBatch
from meshmq.log.record import (
    FORMAT_VERSION,
    HEADER_SIZE,
    MESSAGE_ID_BYTES,
    RECORD_PREFIX_SIZE,
    UNASSIGNED_OFFSET,
    BatchBuilder,
    MessageIds,
    Record,
    decode_batch,
    decode_batches,
    encode_batch,
    message_id_timestamp,
    new_message_id,
    read_batch_header,
    verify_batch,
)

LENGTH_FIELD_BITS = range(8, 40)  # bytes 1-4 of the batch: batch_length


@st.composite
def record_lists(draw: st.DrawFn, max_records: int = 8, max_payload: int = 64) -> list[Record]:
    count = draw(st.integers(1, max_records))
    offset = draw(st.integers(0, 2**48))
    timestamp = draw(st.integers(0, 2**42))
    records = []
    for _ in range(count):
        records.append(Record(
            offset=offset,
            timestamp_ms=timestamp + draw(st.integers(-1000, 10**6)) if records else timestamp,
            topic=draw(st.text(max_size=20)),
            qos=draw(st.integers(0, 2)),
            retain=draw(st.booleans()),
            properties=draw(st.binary(max_size=16)),
            payload=draw(st.binary(max_size=max_payload)),
            client_id=draw(st.text(max_size=12)),
            message_id=draw(st.binary(min_size=16, max_size=16)),
        ))
        offset += draw(st.integers(1, 1000))
    return records


@given(record_lists())
def test_round_trip(records: list[Record]) -> None:
    batch = encode_batch(records)
    decoded, end = decode_batch(batch)
    assert decoded == records
    assert end == len(batch)


@given(record_lists(), st.integers(0, 2**40))
def test_base_offset_assigns_dense_offsets_without_touching_the_input(
        records: list[Record], base: int) -> None:
    originals = [r.offset for r in records]
    decoded, _ = decode_batch(encode_batch(records, base_offset=base))
    assert [r.offset for r in decoded] == list(range(base, base + len(records)))
    assert [r.offset for r in records] == originals


@given(record_lists(max_records=3), record_lists(max_records=3), st.binary(max_size=8))
def test_batches_decode_from_any_position(first: list[Record], second: list[Record],
                                          junk: bytes) -> None:
    a, b = encode_batch(first), encode_batch(second)
    buf = junk + a + b
    records, pos = decode_batch(buf, len(junk))
    assert records == first
    records, pos = decode_batch(buf, pos)
    assert (records, pos) == (second, len(buf))
    for view in (bytearray(buf), memoryview(buf)):
        assert decode_batch(view, len(junk) + len(a)) == (second, len(buf))


@given(record_lists(max_records=4, max_payload=40))
@settings(max_examples=40)
def test_every_truncated_prefix_is_incomplete(records: list[Record]) -> None:
    batch = encode_batch(records)
    for cut in range(len(batch)):
        with pytest.raises(IncompleteBatch):
            decode_batch(batch[:cut])


@given(record_lists(max_records=3, max_payload=24))
@settings(max_examples=25)
def test_every_single_bit_flip_is_detected(records: list[Record]) -> None:
    batch = encode_batch(records)
    for bit in range(len(batch) * 8):
        damaged = bytearray(batch)
        damaged[bit // 8] ^= 1 << (bit % 8)
        expected = (CorruptBatch, IncompleteBatch) if bit in LENGTH_FIELD_BITS else CorruptBatch
        with pytest.raises(expected):
            decode_batch(bytes(damaged))


@given(st.binary(max_size=200))
def test_random_bytes_raise_only_batch_errors(data: bytes) -> None:
    with pytest.raises((CorruptBatch, IncompleteBatch)):
        decode_batch(data)


@given(st.binary(min_size=HEADER_SIZE - 9, max_size=300))
def test_random_bytes_with_a_valid_checksum_raise_only_corrupt_batch(tail: bytes) -> None:
    """Structure checks behind the CRC never leak another exception."""
    body = tail
    batch = struct.pack(">BII", FORMAT_VERSION, 9 + len(body), zlib.crc32(body)) + body
    with pytest.raises(CorruptBatch):
        decode_batch(batch)


def test_header_fields_are_where_the_format_says() -> None:
    records = [Record.new("t", b"p1", 5000, message_id=bytes(16)),
               Record.new("t", b"p2", 4000, message_id=bytes(16))]
    batch = encode_batch(records, base_offset=42)
    magic, length, crc = struct.unpack_from(">BII", batch, 0)
    assert (magic, length, crc) == (FORMAT_VERSION, len(batch), zlib.crc32(batch[9:]))
    header = read_batch_header(batch)
    assert (header.base_offset, header.last_offset, header.record_count) == (42, 43, 2)
    assert (header.first_timestamp, header.max_timestamp) == (5000, 5000)
    assert verify_batch(batch) == header
    assert len(batch) == HEADER_SIZE + 2 * (RECORD_PREFIX_SIZE + 1 + 2)


@pytest.mark.parametrize("change, message", [
    (lambda r: setattr(r, "qos", 3), "QoS"),
    (lambda r: setattr(r, "message_id", b"short"), "16 bytes"),
    (lambda r: setattr(r, "topic", "x" * 70000), "out of range"),
    (lambda r: setattr(r, "timestamp_ms", -5), "out of range"),
])
def test_unrepresentable_records_raise_value_error(change, message: str) -> None:
    record = Record.new("t", b"", 0)
    change(record)
    with pytest.raises(ValueError, match=message):
        encode_batch([record], base_offset=0)


def test_offsets_must_increase_and_timestamps_stay_close() -> None:
    with pytest.raises(ValueError, match="at least one"):
        encode_batch([])
    a, b = Record.new("t", b"", 0), Record.new("t", b"", 0)
    a.offset = b.offset = 7
    with pytest.raises(ValueError, match="strictly increase"):
        encode_batch([a, b])
    late = Record.new("t", b"", 2**31)
    with pytest.raises(ValueError, match="24 days"):
        encode_batch([Record.new("t", b"", 0), late], base_offset=0)


def test_decode_batches_skips_records_below_min_offset() -> None:
    records = [Record.new("t", bytes([i]), 1000 + i) for i in range(6)]
    data = encode_batch(records[:3], base_offset=10) + encode_batch(records[3:], base_offset=13)
    assert [r.offset for r in decode_batches(data, 12)] == [12, 13, 14, 15]


def test_message_ids_are_time_ordered_and_unique() -> None:
    ids = [new_message_id(1_700_000_000_000 + i // 10) for i in range(1000)]
    assert all(len(i) == 16 for i in ids)
    assert len(set(ids)) == len(ids)
    assert message_id_timestamp(ids[0]) == 1_700_000_000_000
    stamps = [message_id_timestamp(i) for i in ids]
    assert stamps == sorted(stamps)
    assert new_message_id(1) < new_message_id(2)


def test_ids_of_one_millisecond_count_up_from_a_random_start() -> None:
    """One random draw per millisecond, then a count: ids of one process never repeat, and
    a new millisecond (or another generator: another process) starts somewhere else."""
    ids = MessageIds()
    first = [ids.draw(7) for _ in range(1000)]
    assert all(len(i) == MESSAGE_ID_BYTES and message_id_timestamp(i) == 7 for i in first)
    assert len({i[6:10] for i in first}) == 1  # the millisecond's random bytes
    counts = [int.from_bytes(i[10:], "big") for i in first]
    assert counts == list(range(counts[0], counts[0] + 1000))
    assert counts[0] < 2**47  # so that 2**47 more in the same millisecond still fit
    later = ids.draw(8)
    assert message_id_timestamp(later) == 8 and later > first[-1]
    others = MessageIds()  # seeded from os.urandom like every process's
    assert not {others.draw(7) for _ in range(1000)} & set(first)


def test_new_records_are_unassigned_with_a_fresh_id() -> None:
    record = Record.new("a/b", b"x", 123, qos=1, retain=True, client_id="c")
    assert record.offset == UNASSIGNED_OFFSET
    assert message_id_timestamp(record.message_id) == 123


def test_a_forked_process_draws_message_ids_of_its_own() -> None:
    """A node's workers are forked from one process: ids they draw in the same millisecond
    must differ (a partition leader recognises a resend by its id)."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # the child: one id, to the parent, then out at once
        os.write(write_end, new_message_id(1_000))
        os._exit(0)
    os.close(write_end)
    theirs = os.read(read_end, 16)
    os.close(read_end)
    os.waitpid(child, 0)
    ours = new_message_id(1_000)
    assert len(theirs) == 16 and theirs != ours


@given(record_lists(), st.integers(0, 2**40))
def test_a_batch_built_a_record_at_a_time_is_the_batch_encode_batch_makes(
        records: list[Record], base: int) -> None:
    """The broker encodes each publish as it comes (BatchBuilder) and the partition seals the
    batch once it has offsets: the bytes must be exactly those of encode_batch."""
    builder = BatchBuilder()
    assert builder.base_offset == UNASSIGNED_OFFSET
    for i, record in enumerate(records):
        assert builder.add(record.topic.encode(), record.client_id.encode(), record.properties,
                           record.payload, record.qos, record.retain, record.message_id,
                           record.timestamp_ms) == i
    head, body, header = builder.seal(base)
    expected = encode_batch(records, base_offset=base)
    assert head + body == expected
    assert header == read_batch_header(expected)
    assert builder.size == len(expected) and builder.count == len(records)
    assert builder.base_offset == base
    assert builder.payload_bytes == sum(len(r.payload) for r in records)


def test_a_record_the_batch_cannot_hold_leaves_the_built_batch_unchanged() -> None:
    builder = BatchBuilder()
    builder.add(b"t", b"c", b"", b"first", 1, False, bytes(16), 1_000)
    size = builder.size
    with pytest.raises(ValueError, match="QoS"):
        builder.add(b"t", b"c", b"", b"x", 3, False, bytes(16), 1_000)
    with pytest.raises(ValueError, match="16 bytes"):
        builder.add(b"t", b"c", b"", b"x", 1, False, bytes(3), 1_000)
    with pytest.raises(ValueError, match="out of range"):
        builder.add(b"t", b"c", b"", b"x", 1, False, bytes(16), 1_000 + 2**40)
    assert (builder.count, builder.size) == (1, size)
    head, body, _ = builder.seal(7)
    [record], _ = decode_batch(head + body)
    assert (record.offset, record.payload) == (7, b"first")
    with pytest.raises(ValueError, match="at least one record"):
        BatchBuilder().seal(0)
