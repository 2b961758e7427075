"""Completions: joining callbacks that each report when their work is done."""

from __future__ import annotations

from collections.abc import Callable

Done = Callable[[], None]


def after_both(done: Done, first: Callable[[Done], None],
               second: Callable[[Done], None]) -> Done:
    """A call that starts ``first`` and ``second`` (each takes a completion) and runs
    ``done`` once both have completed."""
    def start() -> None:
        waiting = [2]

        def one_done() -> None:
            waiting[0] -= 1
            if waiting[0] == 0:
                done()

        first(one_done)
        second(one_done)
    return start
