"""What the broker keeps across restarts: persistent sessions and retained messages.

Translates between the broker's objects and the JSON entries of the ``StateStore``
(state/store.py). A session is stored while its expiry interval is non-zero: its expiry, user
name, will, subscriptions, the time it went offline and its cursor into the commit log (the
first offset per partition it may still need, ``Session.log_cursor()``). Cursors of connected
sessions are checkpointed every ``CHECKPOINT_SECONDS``; after a crash a session resumes from
its last checkpoint, and messages it may already have received come again with DUP set.

``$SYS/`` retained messages are never stored: they describe one run of the node (uptime,
counters), so a restart must not serve the previous run's values. Any found in a state written
by an older version are dropped on restore.
"""

from __future__ import annotations

import logging
import shutil
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from meshmq.broker.message import Message
from meshmq.broker.router import SYS_PREFIX
from meshmq.broker.session import Session
from meshmq.broker.snapshot import (
    SessionSnapshot,
    SnapshotError,
    message_from_json,
    message_to_json,
    options_to_json,
    will_to_json,
)
from meshmq.state.store import COMPACT_BYTES, Done, State, StateError, StateStore

if TYPE_CHECKING:
    import asyncio

    from meshmq.broker.retained import RetainedStore
    from meshmq.config import BrokerConfig

log = logging.getLogger("meshmq.state")

CHECKPOINT_SECONDS = 1.0


def _remove_directories(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


class KeeperHost(Protocol):
    """What the keeper needs from the broker it serves (broker.py)."""

    config: BrokerConfig  # ``server.data_dir``
    loop: asyncio.AbstractEventLoop
    sessions: dict[str, Session]  # every session here, by client id
    retained_store: RetainedStore[Message]  # the retained messages this router stores

    def restore_session(self, snapshot: SessionSnapshot) -> None:
        """Rebuild a stored session at start-up (lifecycle.py)."""


class StateKeeper:
    """Journals session and retained changes; restores them at start-up."""

    def __init__(self, broker: KeeperHost, index: int = 0, count: int = 1) -> None:
        self.broker = broker
        self.index = index  # this router among the node's ``count`` workers
        self.count = count
        self.store = StateStore(broker.config.server.data_dir, broker.loop, state_directory(index))
        self.stored: set[str] = set()  # client ids with a stored session
        self._cursors: dict[str, list[int] | None] = {}
        self._timer: Any = None

    # ------------------------------------------------------------------ start and stop

    def restore(self) -> None:
        """Load the state, rebuild sessions and retained messages, compact the files.

        State left by workers that no longer exist (``server.workers`` was lowered) is merged
        in by the worker whose index they fold onto; their directories are removed once the
        merged snapshot is on disk.
        """
        state = self.store.load()
        orphans = self._merge_orphans(state)
        broker = self.broker
        now = broker.loop.time()
        past_run = [topic for topic in state["retained"] if topic.startswith(SYS_PREFIX)]
        for topic in past_run:  # stored by an older version: the values of a past run
            del state["retained"][topic]
        if past_run:
            log.info("state: dropped the $SYS values of a past run retained=%d", len(past_run))
        for topic, data in state["retained"].items():
            try:
                message = message_from_json(topic, data, now)
            except (SnapshotError, ValueError, KeyError, TypeError) as error:
                raise StateError(f"{self.store.directory}: bad retained message {topic!r} "
                                 f"({error!r})") from None
            if message is not None:
                broker.retained_store.set(topic, message)
        for client_id, record in state["sessions"].items():
            self.stored.add(client_id)
            try:
                snapshot = SessionSnapshot.from_record(client_id, record)
            except SnapshotError as error:
                raise StateError(f"{self.store.directory}: {error}") from None
            broker.restore_session(snapshot)
        if state["sessions"] or state["retained"]:
            log.info("state restored sessions=%d retained=%d", len(state["sessions"]),
                     len(state["retained"]))
        self.store.compact(self.snapshot(), partial(_remove_directories, orphans))
        self._timer = broker.loop.call_later(CHECKPOINT_SECONDS, self._checkpoint)

    def _merge_orphans(self, state: State) -> list[Path]:
        data_dir = Path(self.broker.config.server.data_dir)
        orphans = []
        for path in sorted(data_dir.glob("state-*")):
            index = path.name.removeprefix("state-")
            if not index.isdigit() or not path.is_dir():
                continue
            if int(index) < self.count or int(index) % self.count != self.index:
                continue
            store = StateStore(data_dir, self.broker.loop, path.name)
            found = store.load()
            store.close()
            for client_id, record in found["sessions"].items():
                mine = state["sessions"].get(client_id)
                if mine is None or (record.get("detached_at") or 0) > (
                        mine.get("detached_at") or 0):
                    state["sessions"][client_id] = record
            for topic, data in found["retained"].items():  # their owners get them (workers)
                state["retained"].setdefault(topic, data)
            log.info("state merged from %s sessions=%d", path.name, len(found["sessions"]))
            orphans.append(path)
        return orphans

    def close(self) -> None:
        """A clean stop: one last snapshot of everything, then close the files."""
        if self._timer is not None:
            self._timer.cancel()
        self.store.compact(self.snapshot())
        self.store.close()

    def snapshot(self) -> State:
        broker = self.broker
        sessions = {}
        for client_id in self.stored:
            session = broker.sessions.get(client_id)
            if session is not None:
                sessions[client_id] = self._session_record(session)
        now = broker.loop.time()
        retained = {topic: message_to_json(m, now) for topic, m in broker.retained_store.items()
                    if not topic.startswith(SYS_PREFIX)}  # a run's values stay with the run
        return {"sessions": sessions, "retained": retained}

    @staticmethod
    def _session_record(session: Session) -> dict[str, Any]:
        return SessionSnapshot.of(session).record()

    # ------------------------------------------------------------------ changes

    def connected(self, session: Session) -> None:
        client_id = session.client_id
        if session.expiry_interval:
            self.stored.add(client_id)
            self.store.write({"op": "session", "client_id": client_id,
                              **self._session_record(session)})
        elif client_id in self.stored:
            self.ended(session)

    def detached(self, session: Session) -> None:
        if session.client_id in self.stored:
            self.store.write({"op": "session", "client_id": session.client_id,
                              "expiry": session.expiry_interval, "will": will_to_json(session.will),
                              "detached_at": session.detached_at, "cursor": session.log_cursor()})

    def ended(self, session: Session) -> None:
        if session.client_id in self.stored:
            self.stored.discard(session.client_id)
            self._cursors.pop(session.client_id, None)
            self.store.write({"op": "end", "client_id": session.client_id})

    def subscriptions(self, session: Session, filters: list[str], done: Done) -> None:
        """Journal the current options of ``filters`` (None: removed); ``done`` once durable."""
        if session.client_id not in self.stored:
            return done()
        subs = session.subscriptions
        self.store.write({"op": "subs", "client_id": session.client_id, "subs": {
            f: options_to_json(subs[f]) if f in subs else None for f in filters
        }}, done)

    def retained(self, topic: str, message: Message | None, done: Done | None = None) -> None:
        if topic.startswith(SYS_PREFIX):  # kept in memory for this run only
            if done is not None:
                done()
            return
        now = self.broker.loop.time()
        self.store.write({"op": "retain", "topic": topic, "message": None if message is None
                          else message_to_json(message, now)}, done)

    def _checkpoint(self) -> None:
        """Journal the log cursors of connected stored sessions that moved; compact if big."""
        broker = self.broker
        for client_id in self.stored:
            session = broker.sessions.get(client_id)
            if session is None or session.client is None:
                continue
            cursor = session.log_cursor()
            if cursor != self._cursors.get(client_id):
                self._cursors[client_id] = cursor
                self.store.write({"op": "session", "client_id": client_id, "cursor": cursor})
        if self.store.journal_bytes > COMPACT_BYTES:
            self.store.compact(self.snapshot())
        self._timer = broker.loop.call_later(CHECKPOINT_SECONDS, self._checkpoint)


def state_directory(index: int) -> str:
    """The state directory of worker ``index`` under ``data_dir`` (``state`` for worker 0 and
    for a single-process node)."""
    return "state" if index == 0 else f"state-{index}"
