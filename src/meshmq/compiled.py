"""Which of meshmq's modules run compiled (mypyc, built by setup.py when the install had a C
compiler) and which as plain Python; ``meshmq --version`` says it."""

from __future__ import annotations

import importlib

# The modules that setup.py compiles; the Makefile reads this list too (one module a line).
HOT_PATH = (
    "meshmq.mqtt.packets",
    "meshmq.mqtt.codec",
    "meshmq.mqtt.connection",
    "meshmq.broker.publishes",
    "meshmq.broker.session",
    "meshmq.broker.router",
    "meshmq.broker.message",
    "meshmq.broker.persistence",
    "meshmq.broker.trie",
    "meshmq.broker.broker",
    "meshmq.broker.interfaces",
    "meshmq.broker.local",
    "meshmq.broker.transport.protocol",
    "meshmq.log.record",
    "meshmq.log.files",
    "meshmq.log.index",
    "meshmq.log.partitioner",
    "meshmq.log.writer",
    "meshmq.log.partition",
    "meshmq.log.segment",
    "meshmq.log.commit_log",
    # the connect path: accepting a socket, the CONNECT, its session, the CONNACK
    "meshmq.mqtt.reason_codes",
    "meshmq.broker.connects",
    "meshmq.broker.lifecycle",
    "meshmq.broker.deadlines",
    "meshmq.broker.keeper",
    "meshmq.broker.ratelimit",
    "meshmq.broker.authn",
    "meshmq.broker.transport.admission",
    "meshmq.broker.transport.stream",
    "meshmq.broker.transport.listeners",
)


def compiled_modules() -> list[str]:
    """The modules of the hot path that were imported from a compiled extension."""
    return [name for name in HOT_PATH
            if not (importlib.import_module(name).__file__ or "").endswith(".py")]


def describe() -> str:
    """"compiled hot path (20 of 20 modules)" or "pure Python"."""
    count = len(compiled_modules())
    if not count:
        return "pure Python"
    return f"compiled hot path ({count} of {len(HOT_PATH)} modules)"
