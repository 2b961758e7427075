"""Decode record batches straight into Arrow columns (``pyarrow.RecordBatch`` of ``SCHEMA``).

Theory of operation
-------------------
Records have variable-length fields, so finding where each one starts is a sequential walk;
that walk is the only per-record Python code. ``ColumnBuilder.add_batch`` steps through a
verified log batch reading just the four lengths of each record, and keeps the start positions
of the records it wants: those inside the requested offset range whose topic passes the
``topics`` filters (the filter is one dict lookup per record, cached per topic). Rejected
records are never decoded any further.

Everything else is vectorised with numpy over the read buffer (``READ_CHUNK_BYTES`` of the
segment, holding many log batches): the 37-byte record prefixes are gathered into one matrix
and sliced into big-endian integer columns; topics, client ids and payloads are gathered out
of the buffer by one index computed from their (start, end) positions, so each becomes one
Arrow binary/string array without a Python object per value; message ids are hex-encoded through a
256-entry table. Only a property block other than "none" is decoded in Python
(``properties.py``). Strings are validated as UTF-8 by Arrow; a failure is ``CorruptLog``.

Arrow's schema must equal what Spark derives from ``SCHEMA`` (``ARROW_SCHEMA``), field names
and nullability included, or Spark refuses the batch.
"""

from __future__ import annotations

import struct

import numpy as np
import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema

from meshmq.log.errors import CorruptBatch, IncompleteBatch
from meshmq.log.record import HEADER_SIZE, RECORD_PREFIX_SIZE, BatchHeader, decode_batch
from meshmq.pipeline.errors import CorruptLog
from meshmq.pipeline.options import TopicFilter
from meshmq.pipeline.properties import properties_map
from meshmq.pipeline.schema import SCHEMA

ARROW_SCHEMA = to_arrow_schema(SCHEMA, timezone="UTC")
_PROPERTIES_TYPE = ARROW_SCHEMA.field("properties").type
_TIMESTAMP_TYPE = pa.timestamp("us", tz="UTC")
_LENGTHS = struct.Struct(">HHII")  # topic, client id, properties, payload: prefix bytes 25..37
_DELTA = struct.Struct(">I")  # offset delta: prefix bytes 0..4
_CACHE_LIMIT = 65_536  # distinct topics remembered per task
_PREFIX_COLUMNS = np.arange(RECORD_PREFIX_SIZE)
_HEX = np.frombuffer(b"".join(b"%02x" % i for i in range(256)), np.uint8).reshape(256, 2)


class ColumnBuilder:
    """Accumulates the wanted records of one log partition; see the module doc."""

    def __init__(self, partition: int, topics: TopicFilter | None) -> None:
        self.partition = partition
        self.topics = topics
        self._topic_cache: dict[bytes, bool] = {}
        self._pieces: list[pa.RecordBatch] = []
        self._rows = 0
        self.nbytes = 0  # Arrow bytes of the pieces decoded so far
        self._data = b""
        self._path = ""  # the segment file, for errors
        self._positions: list[int] = []  # record starts in self._data
        self._batches: list[tuple[int, int, int]] = []  # (base offset, first ts, records kept)
        self._places: list[tuple[int, int]] = []  # (start in self._data, start in the file)

    def __len__(self) -> int:
        return self._rows + len(self._positions)

    def add_batch(self, header: BatchHeader, data: bytes, at: int, start: int, end: int,
                  path: str = "", position: int = 0) -> None:
        """Keep the records of the batch at ``data[at:]`` whose offsets lie in ``[start, end)``
        and whose topic passes the filter. ``path``/``position`` name the batch in the
        ``CorruptLog`` raised if its records do not fit it."""
        if data is not self._data:
            self._finish_buffer()
            self._data, self._path = data, path
        kept = len(self._positions)
        whole = start <= header.base_offset and header.last_offset < end
        stop: int | None
        if whole and self.topics is None:
            stop = self._walk_all(data, at + HEADER_SIZE, header.record_count)
        else:
            stop = self._walk_some(data, at + HEADER_SIZE, header, start, end)
        if stop is not None and stop != at + header.batch_length:
            raise CorruptLog(path, position, "record lengths disagree with the batch length")
        self._batches.append((header.base_offset, header.first_timestamp,
                              len(self._positions) - kept))
        self._places.append((at, position))

    def _walk_all(self, data: bytes, p: int, count: int) -> int:
        lengths, keep = _LENGTHS.unpack_from, self._positions.append
        for _ in range(count):
            tl, cl, pl, yl = lengths(data, p + 25)
            keep(p)
            p += RECORD_PREFIX_SIZE + tl + cl + pl + yl
        return p

    def _walk_some(self, data: bytes, p: int, header: BatchHeader, start: int,
                   end: int) -> int | None:
        """Like ``_walk_all`` with the range and topic checks; None if it stopped early."""
        lengths, delta_of, keep = _LENGTHS.unpack_from, _DELTA.unpack_from, self._positions.append
        cache, wanted = self._topic_cache, self._wanted
        base, filtering = header.base_offset, self.topics is not None
        for _ in range(header.record_count):
            tl, cl, pl, yl = lengths(data, p + 25)
            offset = base + delta_of(data, p)[0]
            if offset >= end:
                return None
            if offset >= start:
                if not filtering:
                    keep(p)
                else:
                    raw = data[p + RECORD_PREFIX_SIZE : p + RECORD_PREFIX_SIZE + tl]
                    ok = cache.get(raw)
                    if ok is None:
                        ok = wanted(raw)
                    if ok:
                        keep(p)
            p += RECORD_PREFIX_SIZE + tl + cl + pl + yl
        return p

    def _wanted(self, raw_topic: bytes) -> bool:
        """Decode and filter a topic not seen before (cached either way)."""
        assert self.topics is not None
        try:
            ok = self.topics.matches(raw_topic.decode("utf-8"))
        except UnicodeDecodeError:
            ok = True  # keep it: decoding the column reports the corruption with its place
        if len(self._topic_cache) >= _CACHE_LIMIT:
            self._topic_cache.clear()
        self._topic_cache[raw_topic] = ok
        return ok

    def _finish_buffer(self) -> None:
        """Decode the records kept from the current buffer into one Arrow piece."""
        if self._positions:
            try:
                piece = _decode(self.partition, self._data, self._positions, self._batches)
            except (pa.ArrowInvalid, IndexError, ValueError) as exc:
                raise self._locate_damage(str(exc)) from None
            self._pieces.append(piece)
            self._rows += piece.num_rows
            self.nbytes += piece.nbytes
        self._positions, self._batches, self._places = [], [], []

    def _locate_damage(self, reason: str) -> CorruptLog:
        """The error naming the first batch of the buffer whose records do not decode."""
        for at, position in self._places:
            try:
                decode_batch(self._data, at)  # the engine's full check, record by record
            except (CorruptBatch, IncompleteBatch) as exc:
                return CorruptLog(self._path, position, str(exc))
        return CorruptLog(self._path, self._places[0][1], f"malformed record: {reason}")

    def build(self) -> pa.RecordBatch:
        """Every kept record as one ``RecordBatch``; the builder starts empty again."""
        self._finish_buffer()
        pieces, self._pieces, self._rows, self.nbytes = self._pieces, [], 0, 0
        if not pieces:
            return pa.RecordBatch.from_pylist([], schema=ARROW_SCHEMA)
        return pieces[0] if len(pieces) == 1 else pa.concat_batches(pieces)


def _decode(partition: int, data: bytes, positions: list[int],
            batches: list[tuple[int, int, int]]) -> pa.RecordBatch:
    buf = np.frombuffer(data, np.uint8)
    starts = np.array(positions, np.int64)
    count = len(positions)
    prefix = buf[starts[:, None] + _PREFIX_COLUMNS]  # one row of 37 bytes per record

    def field(first: int, width: int, kind: str) -> np.ndarray:
        return np.ascontiguousarray(prefix[:, first : first + width]).view(kind).ravel()

    bases, first_ts, kept = (np.array(column, np.int64) for column in zip(*batches, strict=True))
    offsets = np.repeat(bases, kept) + field(0, 4, ">u4")
    millis = np.repeat(first_ts, kept) + field(4, 4, ">i4")
    flags = prefix[:, 8]
    topic_start = starts + RECORD_PREFIX_SIZE
    client_start = topic_start + field(25, 2, ">u2")
    props_start = client_start + field(27, 2, ">u2")
    payload_start = props_start + field(29, 4, ">u4")
    payload_end = payload_start + field(33, 4, ">u4")
    columns = [
        pa.repeat(pa.scalar(partition, pa.int32()), count),
        pa.array(offsets, pa.int64()),
        pa.array(millis * 1000, _TIMESTAMP_TYPE),
        _slices(buf, topic_start, client_start, pa.string()),
        pa.array((flags & 3).astype(np.int32), pa.int32()),
        pa.array((flags & 4) != 0, pa.bool_()),
        _slices(buf, payload_start, payload_end, pa.binary()),
        _slices(buf, client_start, props_start, pa.string()),
        _hex(prefix[:, 9:25]),
        _properties(data, props_start, payload_start),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=ARROW_SCHEMA)


def _slices(buf: np.ndarray, begin: np.ndarray, end: np.ndarray, kind: pa.DataType) -> pa.Array:
    """One binary/string array of the byte ranges ``buf[begin[i]:end[i]]``."""
    lengths = (end - begin).astype(np.int32)
    value_offsets = np.zeros(len(begin) + 1, np.int32)
    np.cumsum(lengths, out=value_offsets[1:])
    # Byte j of the values comes from buf[j + shift], shift being constant within a slice.
    shifts = np.repeat((begin - value_offsets[:-1]).astype(np.int32), lengths)
    values = buf[shifts + np.arange(value_offsets[-1], dtype=np.int32)]
    array = pa.Array.from_buffers(kind, len(begin), [None, pa.py_buffer(value_offsets),
                                                     pa.py_buffer(values)])
    array.validate(full=True)  # UTF-8 for strings
    return array


def _hex(message_ids: np.ndarray) -> pa.Array:
    chars = _HEX[message_ids].reshape(-1)
    value_offsets = np.arange(0, len(message_ids) * 32 + 1, 32, dtype=np.int32)
    return pa.Array.from_buffers(pa.string(), len(message_ids), [
        None, pa.py_buffer(value_offsets), pa.py_buffer(np.ascontiguousarray(chars))])


def _properties(data: bytes, begin: np.ndarray, end: np.ndarray) -> pa.Array:
    """The ``properties`` map column; only blocks other than b"" and b"\\x00" are decoded."""
    lengths = end - begin
    special = np.flatnonzero((lengths > 1) | ((lengths == 1) & (np.frombuffer(
        data, np.uint8)[np.minimum(begin, len(data) - 1)] != 0)))
    counts = np.zeros(len(begin), np.int32)
    keys: list[str] = []
    values: list[str] = []
    for i in special.tolist():
        props = properties_map(data[begin[i] : end[i]])
        counts[i] = len(props)
        keys.extend(props)
        values.extend(props.values())
    map_offsets = np.zeros(len(begin) + 1, np.int32)
    np.cumsum(counts, out=map_offsets[1:])
    return pa.MapArray.from_arrays(pa.array(map_offsets), pa.array(keys, pa.string()),
                                   pa.array(values, pa.string()), type=_PROPERTIES_TYPE)
