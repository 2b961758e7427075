"""Log lines that people and machines can read.

Text: ``2026-11-22T10:00:00.123Z INFO meshmq.server listening host=0.0.0.0 port=1883``.
JSON: one object per line, ``{"ts": ..., "level": ..., "logger": ..., "msg": ..., <fields>}``.

Structured fields travel in ``extra={"kv": {...}}``; ``kv(**fields)`` builds that dict and
``log_kv(logger, level, msg, **fields)`` does the call::

    log.info("listening", extra=kv(host=cfg.bind, port=port))
    log_kv(log, logging.INFO, "listening", host=cfg.bind, port=port)

In a worker process of a multi-process node (``server.workers`` > 1) ``set_worker(index)`` makes
every line say which worker wrote it: ``worker=1`` at the end of a text line, a ``"worker"`` key
in JSON. The supervisor's own lines carry no worker.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

LEVELS = ("debug", "info", "warning", "error")

_worker: int | None = None  # this process's worker index (set_worker); None = not a worker


def set_worker(index: int | None) -> None:
    """Tag every later log line of this process with ``worker=index`` (None: no tag)."""
    global _worker
    _worker = index


def kv(**fields: Any) -> dict[str, dict[str, Any]]:
    """``extra=`` argument carrying structured key=value fields for one log record."""
    return {"kv": fields}


def log_kv(logger: logging.Logger, level: int, msg: str, **fields: Any) -> None:
    """Log ``msg`` at ``level`` with ``fields`` appended as key=value pairs."""
    logger.log(level, msg, extra={"kv": fields}, stacklevel=2)


def _timestamp(record: logging.LogRecord) -> str:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{stamp}.{int(record.msecs):03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "kv", None)
    return fields if isinstance(fields, dict) else {}


def _text_value(value: Any) -> str:
    text = value if isinstance(value, str) else str(value)
    if text == "" or any(c.isspace() or c in '"=' for c in text):
        return json.dumps(text)
    return text


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = [_timestamp(record), record.levelname, record.name, record.getMessage()]
        parts.extend(f"{key}={_text_value(value)}" for key, value in _fields(record).items())
        if _worker is not None:
            parts.append(f"worker={_worker}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JSONFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if _worker is not None:
            entry["worker"] = _worker
        for key, value in _fields(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send all logs to stderr at ``level`` (debug|info|warning|error) as ``fmt`` (text|json)."""
    if level not in LEVELS:
        raise ValueError(f"log level must be one of {'|'.join(LEVELS)}, got {level!r}")
    if fmt not in ("text", "json"):
        raise ValueError(f"log format must be text or json, got {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JSONFormatter() if fmt == "json" else _TextFormatter())
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
