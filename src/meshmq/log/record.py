"""Records and the record-batch codec: plain functions over bytes, no I/O.

Theory of operation
-------------------
A ``Record`` is one persisted MQTT publish. Records are written in *record batches*: a
43-byte header, then the records, each a 37-byte fixed prefix followed by four variable-length
fields. All integers are big-endian. ``docs/log-format.md`` is the byte-level reference.

Batch header (``BATCH_HEADER``)::

    0  magic              u8   FORMAT_VERSION (1)
    1  batch_length       u32  bytes in the whole batch, header included
    5  crc                u32  zlib.crc32 of bytes [9, batch_length)
    9  attributes         u16  0 (reserved)
    11 base_offset        u64  offset of the first record
    19 last_offset_delta  u32  last record's offset - base_offset
    23 first_timestamp    u64  first record's timestamp (ms since the epoch)
    31 max_timestamp      u64  largest record timestamp in the batch
    39 record_count       u32

Record prefix (``RECORD_PREFIX``): offset_delta u32, timestamp_delta i32 (record timestamp -
first_timestamp), flags u8 (bits 0-1 QoS, bit 2 retain), message_id 16 bytes, then the lengths
topic u16, client_id u16, properties u32, payload u32; the four fields follow in that order.

Invariants checked by ``decode_batch`` (a violation is ``CorruptBatch``, never another error):
the magic is known; ``HEADER_SIZE <= batch_length <= MAX_BATCH_BYTES``; the CRC matches;
attributes are 0; records exactly fill the batch; offset deltas start at 0 and strictly
increase up to ``last_offset_delta``; timestamps agree with the header; strings are UTF-8.
A buffer that ends inside the batch is ``IncompleteBatch``.
"""

from __future__ import annotations

import mmap
import os
import random
import struct
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final, NamedTuple

from meshmq.log.errors import CorruptBatch, IncompleteBatch

FORMAT_VERSION: Final = 1  # the magic byte of every batch written by this module
MAX_BATCH_BYTES: Final = 1 << 30  # a longer length field is corruption, not a torn tail
UNASSIGNED_OFFSET: Final = -1  # the offset of a record the partition has not appended yet
NO_TIMESTAMP: Final = -1  # max_timestamp of something that holds no records
MESSAGE_ID_BYTES: Final = 16

BATCH_HEADER: Final = struct.Struct(">BIIHQIQQI")
HEADER_SIZE: Final = BATCH_HEADER.size  # 43
CRC_START: Final = 9  # the CRC covers everything from this byte of the batch to its end
_PREFIX: Final = struct.Struct(">BII")  # magic, batch_length, crc
_HEADER_TAIL: Final = struct.Struct(">HQIQQI")  # the header fields the CRC covers
RECORD_PREFIX: Final = struct.Struct(">IiB16sHHII")
RECORD_PREFIX_SIZE: Final = RECORD_PREFIX.size  # 37
_RETAIN_FLAG: Final = 0x04
_QOS_MASK: Final = 0x03
_VALID_FLAGS: Final = frozenset({0, 1, 2, 4, 5, 6})  # QoS 0-2, optionally with retain
_I32: Final = (-(1 << 31), (1 << 31) - 1)
_TIMESTAMP_SPREAD: Final = _I32[1]  # timestamps in one batch are i32 deltas from the first


@dataclass(slots=True)
class Record:
    """One persisted publish. ``offset`` is ``UNASSIGNED_OFFSET`` until a partition appends it.

    ``properties`` is the already-encoded MQTT 5 property block; the log stores it verbatim.
    """

    offset: int
    timestamp_ms: int
    topic: str
    qos: int
    retain: bool
    properties: bytes
    payload: bytes
    client_id: str
    message_id: bytes

    @classmethod
    def new(
        cls,
        topic: str,
        payload: bytes,
        timestamp_ms: int,
        *,
        qos: int = 0,
        retain: bool = False,
        properties: bytes = b"",
        client_id: str = "",
        message_id: bytes | None = None,
    ) -> Record:
        """Build a record to append; a fresh message id is drawn when none is given."""
        if message_id is None:
            message_id = new_message_id(timestamp_ms)
        return cls(
            UNASSIGNED_OFFSET, timestamp_ms, topic, qos, retain,
            properties, payload, client_id, message_id,
        )


class BatchHeader(NamedTuple):
    """The fixed header of one record batch, as ``read_batch_header`` found it."""

    batch_length: int
    crc: int
    attributes: int
    base_offset: int
    last_offset_delta: int
    first_timestamp: int
    max_timestamp: int
    record_count: int

    @property
    def last_offset(self) -> int:
        return self.base_offset + self.last_offset_delta


def new_message_id(now_ms: int) -> bytes:
    """A 128-bit id that sorts by time: 48-bit big-endian milliseconds, then 80 bits that are
    unique to the id (``MessageIds``). Ids of one process are unique and increase; those of
    different processes are unique with overwhelming probability."""
    return _ids.draw(now_ms)


class MessageIds:
    """The ids' low 80 bits: in each new millisecond 32 random bits, and a count that starts
    at a random number below 2**47 (so 2**47 ids in one millisecond cannot overflow its 48
    bits) and goes up by one per id. So ids of one process never repeat, and two processes'
    ids in the same millisecond collide with a probability of 2**-79 per millisecond in which
    both drew some. One random draw per millisecond, not one per id, and the count is a small
    integer: a 128-bit integer per id cost about a tenth of a persisted message's log
    overhead. The generator is seeded once from ``os.urandom`` (a system call per message
    cost ~4% of the broker's time); ids need uniqueness, not secrecy.

    A draw is atomic when compiled (no Python code runs inside it, so the GIL is never given
    up). As Python, a thread switch can come only at the calls of a new millisecond: a thread
    that draws meanwhile still sees the previous millisecond and goes on with its count, and
    the millisecond is recorded last, once its prefix and count are in place."""

    def __init__(self) -> None:
        self.random = random.Random(os.urandom(32))
        self.ms = -1
        self.prefix = b""  # this millisecond's 6 time bytes and 4 random ones
        self.count = 0

    def reseed(self) -> None:
        """A forked process (a node's workers) draws from a sequence of its own: ids drawn in
        the same millisecond by two workers must not be the same."""
        self.random.seed(os.urandom(32))
        self.ms = -1

    def draw(self, now_ms: int) -> bytes:
        if now_ms != self.ms:
            prefix = ((now_ms & 0xFFFF_FFFF_FFFF).to_bytes(6, "big")
                      + self.random.getrandbits(32).to_bytes(4, "big"))
            count = self.random.getrandbits(47)
            self.prefix, self.count, self.ms = prefix, count, now_ms
        count = self.count
        self.count = count + 1
        return self.prefix + count.to_bytes(6, "big")


_ids: Final = MessageIds()
os.register_at_fork(after_in_child=_ids.reseed)


def wall_clock_ms() -> int:
    """Milliseconds since the epoch: the default ``now_ms`` wherever one is optional."""
    return time.time_ns() // 1_000_000


def message_id_timestamp(message_id: bytes) -> int:
    """The millisecond timestamp embedded in a message id from ``new_message_id``."""
    return int.from_bytes(message_id[:6], "big")


# -- encoding ---------------------------------------------------------------------------------


class BatchBuilder:
    """One record batch encoded a record at a time, before its base offset is known.

    ``add`` encodes a record at once (its offset delta is its index in the batch); ``seal``
    gives the batch its base offset, header and CRC once the partition assigns it. So a batch
    of a loop turn's publishes is encoded as they arrive and the writer only adds 43 bytes and
    a checksum: no per-record work is left for it. ``size`` is the encoded length so far,
    header included; ``base_offset`` is ``UNASSIGNED_OFFSET`` until sealed.
    """

    __slots__ = ("base_offset", "count", "first_timestamp", "max_timestamp", "parts",
                 "payload_bytes", "size")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.count = 0
        self.size = HEADER_SIZE
        self.payload_bytes = 0
        self.first_timestamp = self.max_timestamp = NO_TIMESTAMP
        self.base_offset = UNASSIGNED_OFFSET

    def add(self, topic: bytes, client_id: bytes, properties: bytes, payload: bytes,
            qos: int, retain: bool, message_id: bytes, timestamp_ms: int,
            delta: int | None = None) -> int:
        """Encode one record (``topic`` and ``client_id`` UTF-8 already); return its index.

        ``delta``: its offset delta when not its index (``encode_batch`` of records with
        offsets of their own). Raises ``ValueError`` for what the format cannot hold, and then
        the batch is unchanged.
        """
        index = self.count
        if not index:
            self.first_timestamp = self.max_timestamp = timestamp_ms
        if not 0 <= qos <= 2:
            raise ValueError(f"QoS must be 0, 1 or 2, not {qos}")
        if len(message_id) != MESSAGE_ID_BYTES:
            raise ValueError("message_id must be exactly 16 bytes")
        try:
            prefix = _pack_record_prefix(
                index if delta is None else delta, timestamp_ms - self.first_timestamp,
                qos | _RETAIN_FLAG if retain else qos, message_id, len(topic), len(client_id),
                len(properties), len(payload))
        except struct.error as exc:
            if not index:
                self.first_timestamp = self.max_timestamp = NO_TIMESTAMP
            raise ValueError(f"record field out of range: {exc}") from None
        if timestamp_ms > self.max_timestamp:
            self.max_timestamp = timestamp_ms
        self.parts += (prefix, topic, client_id, properties, payload)
        self.count = index + 1
        self.size += RECORD_PREFIX_SIZE + len(topic) + len(client_id) + len(properties) + len(
            payload)
        self.payload_bytes += len(payload)
        return index

    def add_record(self, record: Record, delta: int | None = None) -> int:
        """``add`` for a ``Record`` (its offset is not used unless passed as ``delta``)."""
        return self.add(record.topic.encode("utf-8"), record.client_id.encode("utf-8"),
                        record.properties, record.payload, record.qos, record.retain,
                        record.message_id, record.timestamp_ms, delta)

    def seal(self, base_offset: int, last_delta: int | None = None
             ) -> tuple[bytes, bytes, BatchHeader]:
        """The batch's header and body (write them one after the other) and its parsed header,
        with offsets from ``base_offset``; ``ValueError`` for an empty or oversized batch."""
        count = self.count
        if not count:
            raise ValueError("a record batch needs at least one record")
        if self.size > MAX_BATCH_BYTES:
            raise ValueError(f"record batch of {self.size} bytes exceeds {MAX_BATCH_BYTES}")
        last = count - 1 if last_delta is None else last_delta
        tail = _pack_header_tail(base_offset, last, self.first_timestamp, self.max_timestamp,
                                 count)
        body = b"".join(self.parts)
        crc = zlib.crc32(body, zlib.crc32(tail))
        self.base_offset = base_offset
        return (_PREFIX.pack(FORMAT_VERSION, self.size, crc) + tail, body,
                BatchHeader(self.size, crc, 0, base_offset, last, self.first_timestamp,
                            self.max_timestamp, count))


_pack_record_prefix: Final = RECORD_PREFIX.pack


def encode_batch(records: Sequence[Record], base_offset: int | None = None) -> bytes:
    """Encode ``records`` as one batch; append the result to a segment as it is.

    With ``base_offset`` the records get offsets ``base_offset + i`` and their own ``offset``
    fields are ignored (they are not modified); without it their offsets must strictly
    increase. Raises ``ValueError`` for a record the format cannot hold (empty batch, QoS
    outside 0-2, message id not 16 bytes, oversized field, timestamps more than ~24 days apart).
    """
    if not records:
        raise ValueError("a record batch needs at least one record")
    base = records[0].offset if base_offset is None else base_offset
    builder = BatchBuilder()
    last_delta = -1
    for i, record in enumerate(records):
        delta = i if base_offset is not None else record.offset - base
        if delta <= last_delta:
            raise ValueError(f"record offsets must strictly increase (at index {i})")
        last_delta = delta
        if not _I32[0] <= record.timestamp_ms - (
                builder.first_timestamp if i else record.timestamp_ms) <= _I32[1]:
            raise ValueError("record timestamps in one batch must lie within ~24 days")
        builder.add_record(record, delta)
    header, body, _ = builder.seal(base, last_delta)
    return header + body


def _pack_header_tail(base: int, last_delta: int, first_ts: int, max_ts: int, n: int) -> bytes:
    try:
        return _HEADER_TAIL.pack(0, base, last_delta, first_ts, max_ts, n)
    except struct.error as exc:
        raise ValueError(f"batch header field out of range: {exc}") from None


def split_batches(records: Sequence[Record],
                  target_bytes: int) -> Iterator[tuple[int, Sequence[Record]]]:
    """Split ``records`` into runs (start index, records) that ``encode_batch`` accepts, each
    of about ``target_bytes`` (a single larger record gets a run of its own)."""
    start, size, first_ts = 0, 0, records[0].timestamp_ms if records else 0
    for i, record in enumerate(records):
        record_size = RECORD_PREFIX_SIZE + len(record.topic) + len(record.client_id) + len(
            record.properties) + len(record.payload)
        spread = abs(record.timestamp_ms - first_ts)
        if i > start and (size + record_size > target_bytes or spread > _TIMESTAMP_SPREAD):
            yield start, records[start:i]
            start, size, first_ts = i, 0, record.timestamp_ms
        size += record_size
    if records:
        yield start, records[start:]


# -- decoding ---------------------------------------------------------------------------------

# What the header readers take: a batch in memory or in a mapped segment file.
Buffer = bytes | bytearray | memoryview | mmap.mmap


def peek_batch_header(buf: Buffer, pos: int = 0) -> BatchHeader:
    """Parse the 43-byte header at ``buf[pos:]``; the rest of the batch may lie beyond ``buf``.

    Raises ``IncompleteBatch`` when ``buf`` ends inside the header and ``CorruptBatch`` for a
    bad magic or an impossible length. The CRC is not checked.
    """
    available = len(buf) - pos
    if available < 1:
        raise IncompleteBatch("no bytes left for a record batch")
    if buf[pos] != FORMAT_VERSION:
        raise CorruptBatch(f"unknown batch magic {buf[pos]}")
    if available < CRC_START:
        raise IncompleteBatch("record batch header is cut short")
    _, length, _ = _PREFIX.unpack_from(buf, pos)
    if not HEADER_SIZE <= length <= MAX_BATCH_BYTES:
        raise CorruptBatch(f"impossible batch length {length}")
    if available < HEADER_SIZE:
        raise IncompleteBatch("record batch header is cut short")
    return BatchHeader(length, *BATCH_HEADER.unpack_from(buf, pos)[2:])


def read_batch_header(buf: Buffer, pos: int = 0) -> BatchHeader:
    """Like ``peek_batch_header``, but the whole batch must be in ``buf``.

    ``IncompleteBatch`` means: read more bytes, or (at the end of a file) treat it as torn.
    """
    header = peek_batch_header(buf, pos)
    if header.batch_length > len(buf) - pos:
        raise IncompleteBatch(
            f"record batch of {header.batch_length} bytes has only {len(buf) - pos}"
        )
    return header


def verify_batch(buf: Buffer, pos: int = 0) -> BatchHeader:
    """Parse the header at ``pos`` and check the CRC and header consistency, not the records.

    This is what recovery runs over every batch; ``decode_batch`` does it too.
    """
    header = read_batch_header(buf, pos)
    with memoryview(buf) as view:
        crc = zlib.crc32(view[pos + CRC_START : pos + header.batch_length])
    if crc != header.crc:
        raise CorruptBatch(f"checksum mismatch (stored {header.crc:#010x}, computed {crc:#010x})")
    _check_header(header)
    return header


def _check_header(header: BatchHeader) -> None:
    if header.attributes != 0:
        raise CorruptBatch(f"unsupported batch attributes {header.attributes:#06x}")
    if header.record_count < 1 or header.last_offset_delta < header.record_count - 1:
        raise CorruptBatch("record count disagrees with the offset range")
    body = header.batch_length - HEADER_SIZE
    if body < header.record_count * RECORD_PREFIX_SIZE:
        raise CorruptBatch("batch too short for its record count")
    if header.max_timestamp < header.first_timestamp:
        raise CorruptBatch("max timestamp precedes first timestamp")


def decode_batch(buf: bytes | bytearray | memoryview, pos: int = 0) -> tuple[list[Record], int]:
    """Decode the batch at ``buf[pos:]``; return its records and the position after it.

    Raises only ``IncompleteBatch`` (the buffer ends inside the batch) and ``CorruptBatch``
    (anything else wrong with the bytes).
    """
    header = verify_batch(buf, pos)
    end = pos + header.batch_length
    data, start = (buf, pos) if isinstance(buf, bytes) else (bytes(buf[pos:end]), 0)
    try:  # on bytes, every field below is a slice: bytes, no memoryview pinning the buffer
        records = _decode_records(data, start + HEADER_SIZE, start + header.batch_length,
                                  header)
    except (struct.error, UnicodeDecodeError, ValueError) as exc:
        raise CorruptBatch(f"malformed record: {exc}") from None
    return records, end


def _decode_records(buf: bytes, p: int, end: int, header: BatchHeader) -> list[Record]:
    records: list[Record] = []
    append, unpack, make = records.append, RECORD_PREFIX.unpack_from, Record
    base, first_ts = header.base_offset, header.first_timestamp
    previous, max_ts = -1, first_ts
    for _ in range(header.record_count):
        if p + RECORD_PREFIX_SIZE > end:
            raise CorruptBatch("record runs past the end of its batch")
        delta, ts_delta, flags, message_id, tl, cl, pl, yl = unpack(buf, p)
        a = p + RECORD_PREFIX_SIZE + tl  # end of topic
        b = a + cl  # end of client id
        c = b + pl  # end of properties
        p = c + yl  # end of payload: the next record
        if p > end or delta <= previous or flags not in _VALID_FLAGS:
            raise CorruptBatch("record fields disagree with the batch")
        previous = delta
        timestamp = first_ts + ts_delta
        if timestamp > max_ts:
            max_ts = timestamp
        append(make(base + delta, timestamp, buf[a - tl : a].decode(), flags & _QOS_MASK,
                    flags >= _RETAIN_FLAG, buf[b:c], buf[c:p], buf[a:b].decode(), message_id))
    _check_decoded(records, p, end, previous, max_ts, header)
    return records


def _check_decoded(records: list[Record], p: int, end: int, last_delta: int, max_ts: int,
                   header: BatchHeader) -> None:
    if p != end:
        raise CorruptBatch(f"{end - p} stray bytes after the last record")
    if records[0].offset != header.base_offset or last_delta != header.last_offset_delta:
        raise CorruptBatch("record offsets disagree with the batch header")
    if records[0].timestamp_ms != header.first_timestamp or max_ts != header.max_timestamp:
        raise CorruptBatch("record timestamps disagree with the batch header")


def decode_batches(buf: bytes | bytearray | memoryview, min_offset: int = 0) -> list[Record]:
    """Decode every batch in ``buf`` (as ``LogSegment.read`` returns them), dropping records
    below ``min_offset``. Raises ``CorruptBatch`` or ``IncompleteBatch`` like ``decode_batch``.
    """
    records: list[Record] = []
    pos = 0
    while pos < len(buf):
        batch, pos = decode_batch(buf, pos)
        if batch[0].offset >= min_offset:
            records += batch
        else:
            records += (r for r in batch if r.offset >= min_offset)
    return records


def whole_batches(data: bytes, start_offset: int, max_records: int | None) -> tuple[int, int]:
    """Length of the run of whole batches at the start of ``data``, and how many of their
    records are at or after ``start_offset``; stops once ``max_records`` is reached."""
    position = count = 0
    while position < len(data) and (max_records is None or count < max_records):
        try:
            header = read_batch_header(data, position)
        except (CorruptBatch, IncompleteBatch):
            break  # the decoder reports damage; here we only look for a cut point
        count += header.last_offset - max(header.base_offset, start_offset) + 1
        position += header.batch_length
    return position, count


ZERO_CHECK_BYTES: Final = 1 << 20  # ``all_zero`` compares this much at a time


def all_zero(buf: Buffer, start: int, end: int) -> bool:
    """Whether bytes ``[start, end)`` of ``buf`` are all 0 (true when the range is empty).

    A segment's writer preallocates space that reads as zeros until it is written; no batch
    starts with a 0 byte (the magic is ``FORMAT_VERSION``), so where the batches stop and only
    zeros follow is the end of the written data, not damage (``docs/log-format.md``).
    """
    end = min(end, len(buf))
    while start < end:
        stop = min(end, start + ZERO_CHECK_BYTES)
        if bytes(buf[start:stop]).count(0) != stop - start:
            return False
        start = stop
    return True


def zero_tail_start(buf: Buffer, start: int, end: int) -> int:
    """Where the run of zeros that ends ``buf[start:end]`` begins (``end`` when the last byte is
    not 0): the end of what was written into preallocated space, torn or not."""
    end = min(end, len(buf))
    while end > start:
        begin = max(start, end - ZERO_CHECK_BYTES)
        kept = len(bytes(buf[begin:end]).rstrip(b"\0"))
        if kept:
            return begin + kept
        end = begin
    return start


def find_verified_batch(buf: bytes | mmap.mmap, start: int,
                        accept: Callable[[BatchHeader], bool]) -> int | None:
    """Position of the first batch at or after ``start`` that passes ``verify_batch`` and
    ``accept`` (recovery uses it to tell a corrupt tail from corruption in the middle)."""
    magic = bytes([FORMAT_VERSION])
    candidate = buf.find(magic, start)
    while candidate >= 0:
        try:
            if accept(verify_batch(buf, candidate)):
                return candidate
        except (CorruptBatch, IncompleteBatch):
            pass
        candidate = buf.find(magic, candidate + 1)
    return None
