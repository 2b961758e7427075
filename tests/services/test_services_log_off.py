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

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: failures.append(context))
        server = BrokerServer(config)
        await server.start()
        try:
            services = server.services
            assert services is not None and services.host.persistence is None
            timers = [services._checkpointer]  # (kept: each run arms a new one)
            for _ in range(2000):  # until three checkpoints have run
                if services._checkpointer is not timers[-1]:
                    timers.append(services._checkpointer)
                if len(timers) > 3:
                    break
                await asyncio.sleep(0.005)
            assert len(timers) > 3, "the checkpoint timer did not run again"
        finally:
            await server.stop()

    uvloop.run(scenario())
    assert failures == []
