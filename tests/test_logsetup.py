"""Log lines: text with key=value fields, or one JSON object per line."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator

import pytest

from meshmq.logsetup import configure_logging, kv, log_kv


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_lines(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("info", "text")
    log = logging.getLogger("meshmq.server")
    log.info("listening", extra=kv(host="0.0.0.0", port=1883))
    log_kv(log, logging.WARNING, "queue full", client_id="a b", dropped=3, note="")
    log.debug("not shown")
    log.info("plain %s", "message")
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3
    stamp = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"
    assert re.fullmatch(stamp + r" INFO meshmq\.server listening host=0\.0\.0\.0 port=1883",
                        lines[0])
    assert lines[1].endswith(' WARNING meshmq.server queue full client_id="a b" dropped=3 note=""')
    assert lines[2].endswith(" INFO meshmq.server plain message")


def test_json_lines(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("debug", "json")
    log = logging.getLogger("meshmq.broker")
    log.debug("client connected", extra=kv(client_id="c1", version=5))
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = capsys.readouterr().err.splitlines()
    first = json.loads(lines[0])
    assert first["level"] == "debug" and first["logger"] == "meshmq.broker"
    assert (first["msg"], first["client_id"], first["version"]) == ("client connected", "c1", 5)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    second = json.loads(lines[1])  # the traceback stays inside the one object
    assert len(lines) == 2 and "ValueError: boom" in second["exc"]


def test_configure_twice_keeps_one_handler() -> None:
    configure_logging("info", "text")
    configure_logging("warning", "json")
    root = logging.getLogger()
    assert len(root.handlers) == 1 and root.level == logging.WARNING


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        configure_logging("loud", "text")
    with pytest.raises(ValueError):
        configure_logging("info", "xml")
