"""Ctrl-C during a job: stop Spark cleanly instead of breaking the Py4J connection.

PySpark's own SIGINT handler calls into the JVM from inside the signal handler, while the
main thread is usually blocked in another JVM call (an action, ``awaitTermination``): Py4J
then fails with a "reentrant call" and a page of traces. ``Interrupts`` replaces it while a
job runs: the first Ctrl-C only sets a flag and, from a new thread (its own Py4J
connection), cancels the running Spark jobs and stops the streaming queries; the blocked
call returns or fails, and ``Interrupts.installed()`` turns the outcome into
``KeyboardInterrupt`` for the caller to report. A second Ctrl-C raises at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

_current: Interrupts | None = None


class Interrupts:
    def __init__(self) -> None:
        self.requested = threading.Event()
        self.session: Any = None

    def handler(self, _signum: int, _frame: FrameType | None) -> None:
        if self.requested.is_set():
            raise KeyboardInterrupt
        self.requested.set()
        threading.Thread(target=self._stop_spark, name="meshmq-interrupt", daemon=True).start()

    def _stop_spark(self) -> None:
        session = self.session
        if session is None:
            return
        try:
            session.sparkContext.setLogLevel("OFF")  # the aborted tasks' traces are expected
            for query in session.streams.active:
                query.stop()
            session.sparkContext.cancelAllJobs()
        except Exception:  # the session may be going away already
            pass

    @contextmanager
    def installed(self) -> Iterator[Interrupts]:
        """Handle SIGINT as above inside the block (main thread only)."""
        global _current
        previous = signal.signal(signal.SIGINT, self.handler)
        _current = self
        try:
            yield self
        except Exception:
            if self.requested.is_set():
                raise KeyboardInterrupt from None  # the job failed because we cancelled it
            raise
        finally:
            _current = None
            signal.signal(signal.SIGINT, previous)
        if self.requested.is_set():
            raise KeyboardInterrupt


def adopt_session(session: Any) -> None:
    """Called once a SparkSession exists: take SIGINT back from PySpark's handler."""
    if _current is not None and threading.current_thread() is threading.main_thread():
        _current.session = session
        signal.signal(signal.SIGINT, _current.handler)


def interrupt_requested() -> bool:
    """Whether Ctrl-C was pressed during the running job (for steps Spark does not run)."""
    return _current is not None and _current.requested.is_set()
