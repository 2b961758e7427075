"""Text and JSON renderings for ``meshmq log``: records, ``ls``, ``verify`` and ``repair``.

Text output is for people and never writes a raw control character to the terminal: topics,
client ids and text payloads go through ``safe_text``. Bytes that are not UTF-8 and ASCII
controls become ``\\xNN`` (``\\n``, ``\\r``, ``\\t`` for those three), every other character
Python does not call printable (C1 controls, bidi overrides, separators) ``\\uNNNN``, and a
backslash ``\\\\``: the escaping is unambiguous and reversible. JSON output is one object per
line for records (payload and raw properties in base64) and one object for the other commands.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from dataclasses import asdict

from meshmq.log.inspect import SegmentSummary, iso_timestamp
from meshmq.log.record import Record
from meshmq.log.repair import RepairAction, RepairReport
from meshmq.log.verify import Note, Problem, VerifyReport, format_range
from meshmq.mqtt.codec import decode_properties
from meshmq.mqtt.errors import MQTTError
from meshmq.mqtt.properties import PacketKind, PropertyId

PAYLOAD_MODES = ("text", "hex", "base64", "none")
_ESCAPES = {"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


# -- records ----------------------------------------------------------------------------------


def safe_text(text: str) -> str:
    """``text`` with nothing that could act on a terminal; surrogate escapes become ``\\xNN``."""
    if text.isprintable() and "\\" not in text:
        return text
    return "".join(_escape(c) for c in text)


def _escape(char: str) -> str:
    if char.isprintable() and char != "\\":
        return char
    if char in _ESCAPES:
        return _ESCAPES[char]
    code = ord(char)
    if code < 0x80:  # an ASCII control character: the same byte in UTF-8
        return f"\\x{code:02x}"
    if 0xDC80 <= code <= 0xDCFF:  # a byte that was not UTF-8 (surrogateescape)
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def payload_text(payload: bytes) -> str:
    return safe_text(payload.decode("utf-8", "surrogateescape"))


def _field(text: str) -> str:
    """A topic or client id for a space-separated line: quoted when it holds spaces or '"'."""
    shown = safe_text(text)
    if shown and " " not in shown and '"' not in shown and "=" not in shown:
        return shown
    return '"' + shown.replace('"', '\\"') + '"'


def message_id_text(message_id: bytes) -> str:
    """The 128-bit id in UUID layout (8-4-4-4-12 hex); plain hex if it is not 16 bytes."""
    h = message_id.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if len(h) == 32 else h


def decode_stored_properties(raw: bytes) -> tuple[dict[str, object], str | None]:
    """The MQTT 5 property block as {name: value} (binary values in base64), and an error
    text when the stored bytes are not a property block (the log keeps them opaque)."""
    if not raw:
        return {}, None
    try:
        props, end = decode_properties(raw, 0, len(raw), PacketKind.PUBLISH)
    except (MQTTError, ValueError, IndexError) as exc:
        return {}, f"undecodable property block: {exc}"
    if end != len(raw):
        return {}, f"undecodable property block: {len(raw) - end} stray bytes"
    named: dict[str, object] = {}
    for pid, value in props.items():
        named[PropertyId(pid).name.lower()] = _json_value(value)
    return named, None


def _json_value(value: object) -> object:
    if isinstance(value, bytes):
        return base64.b64encode(value).decode("ascii")
    if isinstance(value, list):
        return [_json_value(v) for v in value]
    if isinstance(value, tuple):
        return [_json_value(v) for v in value]
    return value


def _properties_text(raw: bytes) -> str:
    named, error = decode_stored_properties(raw)
    if error is not None:
        return f"props=0x{raw.hex()}"
    if not named:
        return ""
    parts = []
    for name, value in named.items():
        if name == "user_property" and isinstance(value, list):  # [[name, value], ...]
            parts += [f"{_field(k)}:{_field(v)}" for k, v in value]
        else:
            parts.append(f"{name}={_field(str(value))}")
    return "props={" + ", ".join(parts) + "}"


def record_line(partition: int, record: Record, payload_mode: str = "text") -> str:
    """One record on one line; the payload (in ``payload_mode``) comes last."""
    parts = [
        f"p={partition}", f"offset={record.offset}", iso_timestamp(record.timestamp_ms),
        f"topic={_field(record.topic)}", f"qos={record.qos}",
        f"retain={int(record.retain)}", f"client={_field(record.client_id)}",
        f"id={message_id_text(record.message_id)}",
    ]
    properties = _properties_text(record.properties)
    if properties:
        parts.append(properties)
    parts.append(f"size={len(record.payload)}")
    if payload_mode == "text":
        parts.append(f"payload={payload_text(record.payload)}")
    elif payload_mode == "hex":
        parts.append(f"payload={record.payload.hex()}")
    elif payload_mode == "base64":
        parts.append(f"payload={base64.b64encode(record.payload).decode('ascii')}")
    return " ".join(parts)


def record_json(partition: int, record: Record, payload_mode: str = "text") -> str:
    """One record as one JSON object; ``payload`` is base64 (absent with mode ``none``)."""
    properties, error = decode_stored_properties(record.properties)
    obj: dict[str, object] = {
        "partition": partition, "offset": record.offset,
        "timestamp": iso_timestamp(record.timestamp_ms), "timestamp_ms": record.timestamp_ms,
        "topic": record.topic, "qos": record.qos, "retain": record.retain,
        "client_id": record.client_id, "message_id": message_id_text(record.message_id),
        "properties": properties,
        "properties_raw": base64.b64encode(record.properties).decode("ascii"),
        "payload_size": len(record.payload),
    }
    if error is not None:
        obj["properties_error"] = error
    if payload_mode != "none":
        obj["payload"] = base64.b64encode(record.payload).decode("ascii")
    return json.dumps(obj, ensure_ascii=False)


# -- ls -----------------------------------------------------------------------------------------


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024 or unit == "GiB":
            break
    return f"{value:.1f} {unit}"


def partition_totals(summaries: list[SegmentSummary]) -> dict[str, int]:
    """earliest/next offset as the broker computes them, records, bytes, segments."""
    return {
        "earliest_offset": summaries[0].segment.base_offset if summaries else 0,
        "next_offset": summaries[-1].next_offset if summaries else 0,
        "records": sum(s.records for s in summaries),
        "size_bytes": sum(s.size for s in summaries),
        "segments": len(summaries),
    }


def _segment_note(summary: SegmentSummary, last: bool, live: bool) -> str | None:
    if summary.unreadable_at is None:
        return None
    if last and live:
        return (f"{summary.segment.path.name}: write in progress at byte "
                f"{summary.unreadable_at}")
    return (f"{summary.segment.path.name}: unreadable from byte {summary.unreadable_at} "
            f"({summary.unreadable_reason}); run `meshmq log verify`")


def ls_text(path: str, live: bool, partitions: dict[int, list[SegmentSummary]]) -> str:
    totals = [partition_totals(s) for s in partitions.values()]
    state = "a broker has it open" if live else "not in use"
    lines = [f"log {path} ({state}): {len(partitions)} partitions, "
             f"{sum(t['segments'] for t in totals)} segments, "
             f"{sum(t['records'] for t in totals)} records, "
             f"{_size(sum(t['size_bytes'] for t in totals))}"]
    for (partition, summaries), total in zip(partitions.items(), totals, strict=True):
        lines += ["", f"partition {partition}: earliest offset {total['earliest_offset']}, "
                      f"next offset {total['next_offset']}, {total['records']} records, "
                      f"{total['segments']} segments, {_size(total['size_bytes'])}"]
        lines += _segment_table(summaries, live)
    return "\n".join(lines) + "\n"


def _segment_table(summaries: list[SegmentSummary], live: bool) -> list[str]:
    if not summaries:
        return []
    rows = [("BASE OFFSET", "BYTES", "RECORDS", "FIRST TIMESTAMP", "LAST TIMESTAMP", "INDEX")]
    notes = []
    for i, s in enumerate(summaries):
        rows.append((str(s.segment.base_offset), str(s.size), str(s.records),
                     iso_timestamp(s.first_timestamp), iso_timestamp(s.max_timestamp),
                     "-" if s.index_entries is None else str(s.index_entries)))
        note = _segment_note(s, i + 1 == len(summaries), live)
        if note:
            notes.append(f"  ! {note}")
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[c].rjust(widths[c]) if c in (0, 1, 2, 5) else row[c].ljust(widths[c])
                 for c in range(len(row))]
        lines.append("  " + "  ".join(cells).rstrip())
    return lines + notes


def ls_json(path: str, live: bool, partitions: dict[int, list[SegmentSummary]]) -> str:
    listing = []
    for partition, summaries in partitions.items():
        entry: dict[str, object] = {"partition": partition, **partition_totals(summaries)}
        entry["segment_list"] = [_segment_json(s, i + 1 == len(summaries), live)
                                 for i, s in enumerate(summaries)]
        listing.append(entry)
    totals = [partition_totals(summaries) for summaries in partitions.values()]
    totals_of = {key: sum(t[key] for t in totals) for key in ("segments", "records",
                                                               "size_bytes")}
    return json.dumps({"log_dir": path, "in_use": live, "partitions": len(partitions),
                       **totals_of, "partition_list": listing})


def _segment_json(s: SegmentSummary, last: bool, live: bool) -> dict[str, object]:
    return {
        "base_offset": s.segment.base_offset, "file": s.segment.path.name,
        "size_bytes": s.size, "batches": s.batches, "records": s.records,
        "next_offset": s.next_offset,
        "first_timestamp": iso_timestamp(s.first_timestamp) if s.records else None,
        "last_timestamp": iso_timestamp(s.max_timestamp) if s.records else None,
        "index_entries": s.index_entries, "note": _segment_note(s, last, live),
    }


# -- verify and repair ----------------------------------------------------------------------


def verify_text(report: VerifyReport) -> str:
    lines = [f"problem: {p.describe()}" for p in report.problems]
    lines += [f"note: {n.describe()}" for n in report.notes]
    checked = (f"{report.log.partitions} partitions, {len(report.segments)} segments, "
               f"{report.records} records, {report.size_bytes} bytes checked")
    count = len(report.problems)
    verdict = "clean" if not count else f"{count} problem{'s' if count > 1 else ''}"
    lines.append(f"verify: {verdict} ({checked})")
    return "\n".join(lines) + "\n"


def _problem_json(problem: Problem | Note) -> dict[str, object]:
    fields = asdict(problem)  # tuples become lists, as JSON has them
    fields["path"] = str(problem.path)
    return fields


def verify_json(report: VerifyReport) -> str:
    return json.dumps({
        "log_dir": str(report.log.path), "in_use": report.live, "clean": report.clean,
        "partitions": report.log.partitions, "segments": len(report.segments),
        "records": report.records, "size_bytes": report.size_bytes,
        "problems": [_problem_json(p) for p in report.problems],
        "notes": [_problem_json(n) for n in report.notes],
    })


def _action_lines(action: RepairAction, dry_run: bool) -> Iterable[str]:
    where = f"partition {action.partition}, {action.path.name}"

    def verb(done: str, would: str) -> str:
        return would if dry_run else done

    if action.kind == "remove":
        yield f"{where}: {verb('removed', 'would remove')} a leftover temporary file"
        return
    if action.kind == "unrepairable":
        for p in action.problems:
            yield f"cannot repair: {p.describe()}"
        return
    for p in action.problems:
        if p.kind in ("corrupt", "tail"):
            lost = f"; {format_range(p.lost_offsets)} lost" if p.lost_offsets else ""
            yield (f"{where}: {verb('removed', 'would remove')} {p.length} bytes at byte "
                   f"{p.position} ({p.reason}){lost}")
    reasons = "; ".join(f"{p.path.name} {p.detail}" for p in action.problems
                        if p.kind == "index")
    yield (f"{where}: {verb('rebuilt', 'would rebuild')} .index and .timeindex"
           + (f" ({reasons})" if reasons else ""))


def repair_text(report: RepairReport) -> str:
    lines = [line for a in report.actions for line in _action_lines(a, report.dry_run)]
    lines += [f"backup of the damaged files: {path}" for path in report.backups]
    lost = [format_range(r) for a in report.actions for r in a.lost_offsets]
    summary = f"{report.bytes_lost} bytes" + (f", {', '.join(lost)}" if lost else "")
    if not report.actions:
        lines.append("repair: nothing to do (verify is clean)")
    elif report.dry_run:
        lines.append(f"repair --dry-run: nothing changed; a repair would lose {summary}")
    else:
        after = "clean" if report.after is not None and report.after.clean else "NOT clean"
        fixed = sum(a.kind in ("rewrite", "rebuild") for a in report.actions)
        lines.append(f"repair: {fixed} segments fixed, lost {summary}; verify is now {after}")
        if report.after is not None:
            lines += [f"problem: {p.describe()}" for p in report.after.problems]
    return "\n".join(lines) + "\n"


def repair_json(report: RepairReport) -> str:
    return json.dumps({
        "dry_run": report.dry_run, "succeeded": report.succeeded,
        "bytes_lost": report.bytes_lost,
        "actions": [{"kind": a.kind, "partition": a.partition, "path": str(a.path),
                     "bytes_lost": a.bytes_lost, "lost_offsets": [list(r) for r in
                                                                  a.lost_offsets],
                     "problems": [_problem_json(p) for p in a.problems]}
                    for a in report.actions],
        "backups": [str(path) for path in report.backups],
        "clean_after": None if report.after is None else report.after.clean,
        "problems_after": [] if report.after is None else [
            _problem_json(p) for p in report.after.problems],
    })
