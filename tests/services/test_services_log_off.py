"""The services layer on a broker whose commit log is off (``log.enabled = false``).

Services need the log for their requests, so with it off no dispatcher exists; the layer's
periodic checkpoint still runs and must find nothing to do instead of failing every few
seconds in the event loop's exception handler.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import uvloop

from meshmq.config import load_config
from meshmq.node.server import BrokerServer
from meshmq.services import layer


def test_the_checkpoint_timer_runs_cleanly_with_the_log_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(layer, "CHECKPOINT_INTERVAL", 0.01)
    config = load_config(overrides={
        "server.bind": "127.0.0.1", "server.port": 0, "server.data_dir": str(tmp_path / "data"),
        "server.log_level": "warning", "log.enabled": False,
    })
    failures: list[dict[str, object]] = []

    checkpoint = layer.ServicesLayer._checkpoint
    runs: list[None] = []
    three_ran = asyncio.Event()

    def counted(services: layer.ServicesLayer) -> None:
        try:
            checkpoint(services)  # (what it raises goes on to the loop's exception handler)
        finally:
            runs.append(None)
            if len(runs) == 3:
                three_ran.set()

    monkeypatch.setattr(layer.ServicesLayer, "_checkpoint", counted)

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: failures.append(context))
        server = BrokerServer(config)
        await server.start()
        try:
            services = server.services
            assert services is not None and services.host.persistence is None
            await asyncio.wait_for(three_ran.wait(), 10)  # each run arms the next
        finally:
            await server.stop()

    uvloop.run(scenario())
    assert failures == []
