"""The alerts ledger: which alerts were published, kept in one small JSON file.

Invariants
----------
* An alert is named by its key ``rule|device|window_start|window_end`` (UTC microseconds) and
  carries an id derived from that key (``alert_id``), so a replay computes the same id.
* Each key is in one of two states: ``pending`` (written before its PUBLISH is sent) and
  ``sent`` (written once the broker's PUBACK arrived). A key absent from the ledger has never
  been sent. A PUBACK with an error reason code proves the broker refused the message, so
  that key is removed again and a later run may retry it.
* ``streams`` maps a streaming query id (from its checkpoint) to the last micro-batch id whose
  alerts were all settled, so a replayed batch id is skipped without publishing anything.
* The file is only ever replaced whole (``write_json_atomically``: temporary file, fsync,
  rename, fsync of the directory), so a crash leaves the previous or the next version.
* One job at a time holds ``LEDGER.lock`` (``flock``); a second one is refused.

A ``pending`` key found at start-up means a run died between sending and hearing back: the
broker may or may not have the alert. It is not resent (at most once) unless the caller asks
for at-least-once, in which case the resent alert keeps its id so subscribers can drop it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from meshmq.pipeline.jobs.common import JobError, write_json_atomically

FORMAT = "meshmq-alerts-ledger"
VERSION = 1
PENDING = "pending"
SENT = "sent"


def alert_key(rule: str, device: str, window_start_us: int, window_end_us: int) -> str:
    return f"{rule}|{device}|{window_start_us}|{window_end_us}"


def alert_id(key: str) -> str:
    """32 hex digits, the same for the same (rule, device, window) on every run."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:32]


@dataclass
class AlertLedger:
    path: Path
    alerts: dict[str, dict[str, object]] = field(default_factory=dict)
    streams: dict[str, int] = field(default_factory=dict)
    _lock_fd: int | None = None

    @classmethod
    def open(cls, path: str | Path) -> AlertLedger:
        """Lock and load the ledger (an absent file is an empty ledger); ``close()`` after."""
        ledger = cls(Path(path))
        ledger.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(f"{ledger.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise JobError(f"{ledger.path}: in use by another alerts job") from None
        ledger._lock_fd = fd
        try:
            ledger._load()
        except JobError:
            ledger.close()
            raise
        return ledger

    def _load(self) -> None:
        try:
            document = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            raise JobError(f"{self.path}: unreadable alerts ledger ({exc}); it records which "
                           "alerts were sent, so it is not replaced: fix or remove it") from None
        if (not isinstance(document, dict) or document.get("format") != FORMAT
                or document.get("version") != VERSION):
            raise JobError(f"{self.path}: not a version {VERSION} alerts ledger")
        self.alerts = dict(document.get("alerts", {}))
        self.streams = {str(k): int(v) for k, v in document.get("streams", {}).items()}

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def save(self) -> None:
        write_json_atomically(self.path, {"format": FORMAT, "version": VERSION,
                                          "alerts": self.alerts, "streams": self.streams})

    # ------------------------------------------------------------ alert states

    def state(self, key: str) -> str | None:
        entry = self.alerts.get(key)
        return None if entry is None else str(entry["state"])

    def mark(self, keys: list[str], state: str, batch_id: int | None) -> None:
        now = datetime.now(UTC).isoformat(timespec="milliseconds")
        for key in keys:
            self.alerts[key] = {"id": alert_id(key), "state": state, "batch": batch_id,
                                "at": now}

    def forget(self, keys: list[str]) -> None:
        for key in keys:
            self.alerts.pop(key, None)

    # ------------------------------------------------------------ micro-batches

    def batch_settled(self, query_id: str | None, batch_id: int) -> bool:
        return query_id is not None and self.streams.get(query_id, -1) >= batch_id

    def settle_batch(self, query_id: str | None, batch_id: int) -> None:
        if query_id is not None:
            self.streams[query_id] = max(batch_id, self.streams.get(query_id, -1))
