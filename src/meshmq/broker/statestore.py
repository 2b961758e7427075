"""Durable broker state on disk: a JSON snapshot plus an append-only, fsynced journal.

Theory of operation
-------------------
The broker's own state (persistent sessions with their subscriptions, wills and log cursors,
and retained messages) is small next to the commit log but must survive ``kill -9``. It lives
in ``data_dir/state``:

* ``snapshot.json`` — the whole state at some moment, with its ``generation`` number;
* ``journal-<generation>.jsonl`` — one JSON object per line for each change since that
  snapshot, in order. Every change is a *set* (a session's record, one subscription, one
  retained topic), so applying a line twice gives the same state.

``write(entry, done)`` queues a line for a background thread, which writes everything waiting,
fsyncs once (group commit) and then runs the ``done`` callbacks on the event loop. The broker
sends SUBACK, UNSUBACK and the PUBACK of a retained message only from ``done``: what it
acknowledges is on disk. Other changes (cursors, detach times) are written the same way without
waiting.

``compact(state)`` (at start-up, at a clean stop, and when the journal grows past
``COMPACT_BYTES``) writes a new snapshot atomically (temporary file, fsync, rename, fsync the
directory) with the next generation, switches to a new journal and deletes the old one. A crash
at any point leaves either the old snapshot with its whole journal or the new snapshot.

``load()`` reads the snapshot and applies its journal; a torn last line (a crash mid-write) is
dropped, while a damaged line before the end is an error naming the file and line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import queue
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger("meshmq.state")

FORMAT_VERSION = 1
COMPACT_BYTES = 64 * 1024 * 1024
State = dict[str, dict[str, Any]]  # {"sessions": {client id: record}, "retained": {topic: m}}
Done = Callable[[], None]


class StateError(Exception):
    """The state directory cannot be read (the message names the file and the problem)."""


def empty_state() -> State:
    return {"sessions": {}, "retained": {}}


def apply(state: State, entry: dict[str, Any]) -> None:
    """Apply one journal entry to ``state`` (idempotent)."""
    op = entry["op"]
    sessions = state["sessions"]
    if op == "session":
        record = sessions.setdefault(entry["client_id"], {"subs": {}})
        for key in ("expiry", "username", "will", "detached_at", "cursor"):
            if key in entry:
                record[key] = entry[key]
    elif op == "end":
        sessions.pop(entry["client_id"], None)
    elif op == "subs":
        record = sessions.setdefault(entry["client_id"], {"subs": {}})
        subs = record.setdefault("subs", {})
        for topic_filter, options in entry["subs"].items():
            if options is None:
                subs.pop(topic_filter, None)
            else:
                subs[topic_filter] = options
    elif op == "retain":
        if entry["message"] is None:
            state["retained"].pop(entry["topic"], None)
        else:
            state["retained"][entry["topic"]] = entry["message"]
    else:
        raise ValueError(f"unknown state operation {op!r}")


class StateStore:
    """Owns ``data_dir/state`` and the thread that writes it."""

    def __init__(self, data_dir: str | Path, loop: asyncio.AbstractEventLoop,
                 name: str = "state") -> None:
        self.directory = Path(data_dir) / name
        self.directory.mkdir(parents=True, exist_ok=True)
        self.loop = loop
        self.generation = 0
        self._journal: Any = None
        self._journal_bytes = 0
        self._queue: queue.Queue[tuple[str, Any, Done | None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.failed: Exception | None = None

    # ------------------------------------------------------------------ start-up

    def load(self) -> State:
        """Read the snapshot and replay its journal; then start the writer thread."""
        state = empty_state()
        snapshot = self.directory / "snapshot.json"
        if snapshot.exists():
            try:
                data = json.loads(snapshot.read_text())
                if data.get("version") != FORMAT_VERSION:
                    raise StateError(f"{snapshot}: unknown state format {data.get('version')!r}")
                self.generation = int(data["generation"])
                state = {"sessions": data["sessions"], "retained": data["retained"]}
            except (ValueError, KeyError, TypeError) as error:
                raise StateError(f"{snapshot}: not a meshmq state snapshot ({error})") from None
        journal = self._journal_path(self.generation)
        if journal.exists():
            self._replay(journal, state)
        self._journal = open(journal, "ab")  # noqa: SIM115 - owned by this object
        self._journal_bytes = self._journal.tell()
        self._thread = threading.Thread(target=self._run, name="meshmq-state", daemon=True)
        self._thread.start()
        return state

    def _replay(self, journal: Path, state: State) -> None:
        data = journal.read_bytes()
        lines = data.split(b"\n")
        good = 0
        for number, line in enumerate(lines, 1):
            if not line:
                good += 1
                continue
            try:
                apply(state, json.loads(line))
            except (ValueError, KeyError, TypeError) as error:
                if number == len(lines):  # the torn last line of a crash mid-write
                    log.warning("state journal: dropped a torn last line file=%s", journal)
                    with open(journal, "r+b") as handle:
                        handle.truncate(sum(len(x) + 1 for x in lines[: number - 1]))
                    return
                raise StateError(f"{journal}:{number}: damaged journal line ({error})") from None
            good += 1

    def _journal_path(self, generation: int) -> Path:
        return self.directory / f"journal-{generation}.jsonl"

    # ------------------------------------------------------------------ changes

    def write(self, entry: dict[str, Any], done: Done | None = None) -> None:
        """Journal ``entry``; ``done`` runs on the loop once it is fsynced."""
        self._queue.put(("line", json.dumps(entry, separators=(",", ":")), done))

    def compact(self, state: State, done: Done | None = None) -> None:
        """Replace snapshot and journal by a snapshot of ``state`` (serialised now)."""
        text = json.dumps({
            "version": FORMAT_VERSION, "sessions": state["sessions"],
            "retained": state["retained"],
        }, separators=(",", ":"))
        self._queue.put(("snapshot", text, done))

    @property
    def journal_bytes(self) -> int:
        return self._journal_bytes

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._journal is not None:
            self._journal.close()
            self._journal = None

    # ------------------------------------------------------------------ writer thread

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            group = [item]
            while True:
                try:
                    group.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = None in group
            callbacks: list[Done] = []
            lines: list[str] = []
            for work in group:
                if work is None:
                    continue
                kind, payload, done = work
                if kind == "line":
                    lines.append(payload)
                else:
                    self._flush(lines)
                    lines = []
                    self._snapshot(payload)
                if done is not None:
                    callbacks.append(done)
            self._flush(lines)
            if callbacks and self.failed is None:
                try:
                    self.loop.call_soon_threadsafe(_run_all, callbacks)
                except RuntimeError:
                    pass  # the loop is closed: nobody is waiting any more
            if stop:
                return

    def _flush(self, lines: list[str]) -> None:
        if not lines or self.failed is not None:
            return
        data = ("\n".join(lines) + "\n").encode()
        try:
            self._journal.write(data)
            self._journal.flush()
            os.fsync(self._journal.fileno())
        except OSError as error:
            self._fail(error)
            return
        self._journal_bytes += len(data)

    def _snapshot(self, text: str) -> None:
        if self.failed is not None:
            return
        generation = self.generation + 1
        body = text[:-1] + f',"generation":{generation}}}'
        tmp = self.directory / "snapshot.json.tmp"
        try:
            with open(tmp, "w") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            new_journal = open(self._journal_path(generation), "wb")  # noqa: SIM115
            os.fsync(new_journal.fileno())
            os.replace(tmp, self.directory / "snapshot.json")
            directory = os.open(self.directory, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as error:
            self._fail(error)
            return
        old = self._journal_path(self.generation)
        self._journal.close()
        self._journal = new_journal
        self._journal_bytes = 0
        self.generation = generation
        old.unlink(missing_ok=True)

    def _fail(self, error: OSError) -> None:
        log.error("state store write failed; acknowledgements that need it stop error=%r",
                  str(error))
        self.failed = error


def _run_all(callbacks: list[Done]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:
            log.exception("state store callback raised")
