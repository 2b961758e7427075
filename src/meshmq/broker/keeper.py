"""What the broker keeps across restarts: persistent sessions and retained messages.

Translates between the broker's objects and the JSON entries of the ``StateStore``
(statestore.py). A session is stored while its expiry interval is non-zero: its expiry, user
name, will, subscriptions, the time it went offline and its cursor into the commit log (the
first offset per partition it may still need, ``Session.log_cursor()``). Cursors of connected
sessions are checkpointed every ``CHECKPOINT_SECONDS``; after a crash a session resumes from
its last checkpoint, and messages it may already have received come again with DUP set.

``$SYS/`` retained messages are never stored: they describe one run of the node (uptime,
counters), so a restart must not serve the previous run's values. Any found in a state written
by an older version are dropped on restore.
"""

from __future__ import annotations

import base64
import logging
import shutil
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshmq.broker.message import Message
from meshmq.broker.router import SYS_PREFIX
from meshmq.broker.session import Session, Subscription
from meshmq.broker.statestore import COMPACT_BYTES, Done, State, StateStore
from meshmq.mqtt.codec import decode_properties, encode_properties
from meshmq.mqtt.packets import SubscriptionOptions, Will
from meshmq.mqtt.properties import PacketKind, PropertyId

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker

log = logging.getLogger("meshmq.state")

CHECKPOINT_SECONDS = 1.0


def _remove_directories(paths: list[Path]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def wall_ms() -> int:
    return int(time.time() * 1000)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def will_to_json(will: Will | None) -> dict[str, Any] | None:
    if will is None:
        return None
    return {"topic": will.topic, "payload": _b64(will.payload), "qos": will.qos,
            "retain": will.retain, "properties": _b64(encode_properties(will.properties))}


def will_from_json(data: dict[str, Any] | None) -> Will | None:
    if data is None:
        return None
    block = _unb64(data["properties"])
    props, _ = decode_properties(block, 0, len(block), PacketKind.WILL)
    return Will(data["topic"], _unb64(data["payload"]), data["qos"], data["retain"], props)


def options_to_json(subscription: Subscription) -> list[Any]:
    o = subscription.options
    return [o.qos, o.no_local, o.retain_as_published, o.retain_handling,
            subscription.subscription_id]


def options_from_json(data: list[Any]) -> Subscription:
    qos, no_local, rap, handling, sub_id = data
    return Subscription(SubscriptionOptions(qos, no_local, rap, handling), sub_id)


def message_to_json(message: Message) -> dict[str, Any]:
    props = {k: v for k, v in message.properties.items() if k != PropertyId.MESSAGE_EXPIRY_INTERVAL}
    expiry = message.properties.get(PropertyId.MESSAGE_EXPIRY_INTERVAL)
    return {"payload": _b64(message.payload), "qos": message.qos, "sender": message.sender,
            "properties": _b64(encode_properties(props)), "stored_at": wall_ms(),
            "expiry": expiry, "position": message.position}


def message_from_json(topic: str, data: dict[str, Any], loop_now: float) -> Message | None:
    block = _unb64(data["properties"])
    props, _ = decode_properties(block, 0, len(block), PacketKind.PUBLISH)
    expiry = data.get("expiry")
    if expiry is not None:
        remaining = expiry - (wall_ms() - data["stored_at"]) // 1000
        if remaining <= 0:
            return None  # expired while the broker was down
        props[PropertyId.MESSAGE_EXPIRY_INTERVAL] = remaining
    message = Message(topic, _unb64(data["payload"]), data["qos"], True, props, data["sender"],
                      loop_now)
    if data.get("position"):
        message.position = tuple(data["position"])  # type: ignore[assignment]
    return message


class StateKeeper:
    """Journals session and retained changes; restores them at start-up."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        worker = broker.worker
        self.store = StateStore(broker.config.server.data_dir, broker.loop,
                                "state" if worker is None else worker.state_directory)
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
            message = message_from_json(topic, data, now)
            if message is not None:
                broker.router.retained.set(topic, message)
        for client_id, record in state["sessions"].items():
            self.stored.add(client_id)
            broker.restore_session(
                client_id, record.get("expiry", 0), record.get("username"),
                will_from_json(record.get("will")),
                {f: options_from_json(o) for f, o in record.get("subs", {}).items()},
                record.get("cursor"), record.get("detached_at"),
            )
        if state["sessions"] or state["retained"]:
            log.info("state restored sessions=%d retained=%d", len(state["sessions"]),
                     len(state["retained"]))
        self.store.compact(self.snapshot(), partial(_remove_directories, orphans))
        self._timer = broker.loop.call_later(CHECKPOINT_SECONDS, self._checkpoint)

    def _merge_orphans(self, state: State) -> list[Path]:
        data_dir = Path(self.broker.config.server.data_dir)
        worker = self.broker.worker
        orphans = []
        for path in sorted(data_dir.glob("state-*")):
            index = path.name.removeprefix("state-")
            if not index.isdigit() or not path.is_dir():
                continue
            if worker is not None and (int(index) < worker.count
                                       or int(index) % worker.count != worker.index):
                continue
            store = StateStore(data_dir, self.broker.loop, path.name)
            found = store.load()
            store.close()
            for client_id, record in found["sessions"].items():
                mine = state["sessions"].get(client_id)
                if mine is None or (record.get("detached_at") or 0) > (
                        mine.get("detached_at") or 0):
                    state["sessions"][client_id] = record
            if worker is None or worker.is_leader:
                for topic, data in found["retained"].items():
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
        retained = {topic: message_to_json(m) for topic, m in broker.router.retained.items()
                    if not topic.startswith(SYS_PREFIX)}  # a run's values stay with the run
        return {"sessions": sessions, "retained": retained}

    def _session_record(self, session: Session) -> dict[str, Any]:
        return {
            "expiry": session.expiry_interval, "username": session.username,
            "will": will_to_json(session.will), "detached_at": session.detached_at,
            "cursor": session.log_cursor(),
            "subs": {f: options_to_json(s) for f, s in session.subscriptions.items()},
        }

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
        self.store.write({"op": "retain", "topic": topic,
                          "message": None if message is None else message_to_json(message)}, done)

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
