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

``load()`` reads the snapshot and applies its journal. Bytes after the journal's last newline
are a write a crash interrupted (the writer writes whole lines and fsyncs before acknowledging
anything): a whole entry there is applied and gets its newline; anything else is cut off,
after the journal as it was is kept in ``repair-backup-<UTC time>/`` beside it (the commit
log's ``backup.py``), and the warning names the copy. A damaged
line before the end is an error naming the file, the line and ``meshmq state verify|repair``
(``check.py``). The files and their reading are in ``files.py``.

While a store is loaded it holds the flock on ``.lock`` in its directory: a second broker on the
same directory, or a ``meshmq state repair``, is refused instead of interleaving writes.
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

from meshmq.log.backup import cut_file
from meshmq.log.locks import LOCK_FILE, acquire
from meshmq.state.files import (
    FORMAT_VERSION,
    SNAPSHOT_FILE,
    State,
    StateError,
    empty_state,
    journal_name,
    read_snapshot,
    scan_journal,
    state_tool,
)

log = logging.getLogger("meshmq.state")

COMPACT_BYTES = 64 * 1024 * 1024
Done = Callable[[], None]


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
        self._lock_fd: int | None = None
        self.failed: Exception | None = None

    # ------------------------------------------------------------------ start-up

    def load(self) -> State:
        """Read the snapshot and replay its journal; then start the writer thread.

        Raises ``StateError`` (naming the file and what to run) when the files are damaged or
        another process has the directory open; call ``close()`` when done.
        """
        self._lock_fd = acquire(self.directory / LOCK_FILE)
        if self._lock_fd is None:
            raise StateError(f"{self.directory} is in use by another process (a broker, or "
                             "`meshmq state repair`)")
        try:
            state = self._read()
        except BaseException:
            self._unlock()
            raise
        self._journal = open(self._journal_path(self.generation), "ab")  # noqa: SIM115
        self._journal_bytes = self._journal.tell()
        self._thread = threading.Thread(target=self._run, name="meshmq-state", daemon=True)
        self._thread.start()
        return state

    def _read(self) -> State:
        state = empty_state()
        snapshot = self.directory / SNAPSHOT_FILE
        if snapshot.exists():
            try:
                self.generation, state = read_snapshot(snapshot)
            except StateError as error:
                raise StateError(f"{error}; `{state_tool('verify', self.directory)}` says "
                                 "what survives") from None
        journal = self._journal_path(self.generation)
        if journal.exists():
            self._replay(journal, state)
        return state

    def _replay(self, journal: Path, state: State) -> None:
        scan = scan_journal(journal.read_bytes(), state)
        if scan.damaged:
            first = scan.damaged[0]
            raise StateError(
                f"{journal}:{first.number}: damaged journal line ({first.reason}); "
                f"`{state_tool('verify', self.directory)}` lists the damage, "
                f"`{state_tool('repair', self.directory)}` sets the damaged lines aside and "
                "keeps every good one")
        if scan.bad:  # the torn end of a crash mid-write: never acknowledged
            try:
                kept = cut_file(journal, scan.keep())
            except OSError as error:  # never cut what could not be kept
                raise StateError(f"{journal}: its torn last line was not cut off, as no copy "
                                 f"of the journal could be kept ({error})") from None
            log.warning("state journal: cut a torn last line (%d bytes) file=%s kept=%s",
                        scan.size - scan.bad[0].start, journal, kept)
        elif scan.unterminated:  # a whole entry whose newline a crash kept from the disk
            with open(journal, "ab") as handle:
                handle.write(b"\n")

    def _journal_path(self, generation: int) -> Path:
        return self.directory / journal_name(generation)

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
        self._unlock()

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

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
        tmp = self.directory / f"{SNAPSHOT_FILE}.tmp"
        try:
            with open(tmp, "w") as handle:
                handle.write(body)
                handle.flush()
                os.fsync(handle.fileno())
            new_journal = open(self._journal_path(generation), "wb")  # noqa: SIM115
            os.fsync(new_journal.fileno())
            os.replace(tmp, self.directory / SNAPSHOT_FILE)
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
