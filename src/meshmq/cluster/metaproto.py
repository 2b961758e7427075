"""The local protocol between a node's workers and its metadata service, sans-I/O.

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON, one object each
(values are JSON already; a frame is capped at ``MAX_FRAME``). The worker's client
(cluster/metaclient.py) sends requests, each with an ``id`` of its choosing; the service
(cluster/metaproc.py) first greets a client it accepts with ``{"hello": node id}`` (a
client sends nothing before: a connection closed without a greeting was refused, and nothing
sent on it was read), then answers each request once, in any order, with the same ``id``::

    {"id": 1, "op": "read"}                      -> {"id": 1, "view": VIEW}
    {"id": 2, "op": "cas", "key": "k", "expected": 0, "value": V,
     "guards": {"k2": 3}, "request": "c1-2"}     -> {"id": 2, "result": RESULT}
    {"id": 3, "op": "delete", "key": "k", "expected": 4, "guards": {}, "request": "c1-3"}
                                                 -> {"id": 3, "result": RESULT}
    {"id": 4, "op": "watch"}                     -> {"id": 4, "watching": true}, then
                                                    {"change": CHANGE} for each change
    {"id": 5, "op": "status"}                    -> {"id": 5, "status": {...}}
    any request that fails                       -> {"id": N, "error": ERROR}

    VIEW   = {"version": 7, "entries": {"k": [value, version], ...}}
    RESULT = {"ok": true, "version": 7, "conflict": null}
    CHANGE = {"version": 7, "reset": false, "entries": {"k": [value, version] | null}}
    ERROR  = {"type": "no_quorum" | "not_leader" | "timeout" | "error", "message": "...",
              "hint": "host:port" | null}

``request`` is the write's id for retries (a client that lost its connection sends the same
write again with the same id, and it applies at most once: cluster/metastate.py). Membership
is plain keys (``members/<node id>``), written with ``cas``.

``FrameDecoder.feed`` never raises at a peer's bytes except ``ProtocolError``, after which the
connection is closed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from meshmq.cluster.metadata import (
    CasResult,
    Change,
    Entry,
    MetadataError,
    NoQuorum,
    NotLeader,
    Timeout,
    View,
)

MAX_FRAME = 64 * 1024 * 1024
_LENGTH = 4


class ProtocolError(Exception):
    """The other end sent something that is not this protocol; close the connection."""


def encode(message: Mapping[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise ValueError(f"a metadata frame of {len(body)} bytes (at most {MAX_FRAME})")
    return len(body).to_bytes(_LENGTH, "big") + body


class FrameDecoder:
    """Bytes in, whole messages out."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[dict[str, Any]]:
        self._buffer += data
        messages = []
        while len(self._buffer) >= _LENGTH:
            size = int.from_bytes(self._buffer[:_LENGTH], "big")
            if size > MAX_FRAME:
                raise ProtocolError(f"a frame of {size} bytes (at most {MAX_FRAME})")
            if len(self._buffer) < _LENGTH + size:
                break
            body = bytes(self._buffer[_LENGTH:_LENGTH + size])
            del self._buffer[:_LENGTH + size]
            try:
                message = json.loads(body)
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise ProtocolError(f"a frame that is not JSON: {error}") from None
            if not isinstance(message, dict):
                raise ProtocolError("a frame that is not a JSON object")
            messages.append(message)
        return messages


# -- values -------------------------------------------------------------------------------------


def _entries_to_json(entries: Mapping[str, Entry | None]) -> dict[str, Any]:
    return {key: None if entry is None else [entry.value, entry.version]
            for key, entry in entries.items()}


def _entries_from_json(data: Any) -> dict[str, Entry | None]:
    if not isinstance(data, dict):
        raise ProtocolError("entries: expected an object")
    entries: dict[str, Entry | None] = {}
    for key, item in data.items():
        if item is None:
            entries[key] = None
        elif isinstance(item, list) and len(item) == 2 and isinstance(item[1], int):
            entries[key] = Entry(item[0], item[1])
        else:
            raise ProtocolError(f"entry {key!r}: expected [value, version] or null")
    return entries


def view_to_json(view: View) -> dict[str, Any]:
    return {"version": view.version, "entries": _entries_to_json(view.entries)}


def view_from_json(data: Any) -> View:
    if not isinstance(data, dict) or not isinstance(data.get("version"), int):
        raise ProtocolError("view: expected {version, entries}")
    entries = _entries_from_json(data.get("entries"))
    if any(entry is None for entry in entries.values()):
        raise ProtocolError("view: an entry of null")
    return View(data["version"], MappingProxyType(
        {key: entry for key, entry in entries.items() if entry is not None}))


def change_to_json(change: Change) -> dict[str, Any]:
    return {"version": change.version, "reset": change.reset,
            "entries": _entries_to_json(change.changed)}


def change_from_json(data: Any) -> Change:
    if not isinstance(data, dict) or not isinstance(data.get("version"), int):
        raise ProtocolError("change: expected {version, reset, entries}")
    return Change(data["version"], MappingProxyType(_entries_from_json(data.get("entries"))),
                  bool(data.get("reset")))


def result_to_json(result: CasResult) -> dict[str, Any]:
    return {"ok": result.ok, "version": result.version, "conflict": result.conflict}


def result_from_json(data: Any) -> CasResult:
    if not (isinstance(data, dict) and isinstance(data.get("ok"), bool)
            and isinstance(data.get("version"), int)):
        raise ProtocolError("result: expected {ok, version, conflict}")
    conflict = data.get("conflict")
    return CasResult(data["ok"], data["version"], conflict if isinstance(conflict, str) else None)


_ERROR_TYPES: dict[str, type[MetadataError]] = {
    "no_quorum": NoQuorum, "not_leader": NotLeader, "timeout": Timeout, "error": MetadataError}


def error_to_json(error: MetadataError) -> dict[str, Any]:
    kind = next((name for name, cls in _ERROR_TYPES.items() if type(error) is cls), "error")
    message = str(error)
    hint = error.hint if isinstance(error, NotLeader) else None
    if isinstance(error, NotLeader) and hint is not None:
        message = message.removesuffix(f" (leader: {hint})")
    return {"type": kind, "message": message, "hint": hint}


def error_from_json(data: Any) -> MetadataError:
    if not isinstance(data, dict):
        return MetadataError(f"the metadata service answered with an error: {data!r}")
    message = str(data.get("message", ""))
    kind = _ERROR_TYPES.get(str(data.get("type")), MetadataError)
    if kind is NotLeader:
        hint = data.get("hint")
        return NotLeader(message, hint if isinstance(hint, str) else None)
    return kind(message)
