"""The demo without Spark: its work directory (each run starts from a clean slate, a
directory it did not make is refused, a running broker's data is never removed), the fleet it
simulates (no two devices draw the same line) and the devices' paced publishing."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import start_broker
from meshmq.pipeline.jobs.common import JobError
from meshmq.pipeline.jobs.demo import MARKER, prepare_workdir
from meshmq.pipeline.jobs.demo_fleet import BAD_PAYLOADS, FleetPublisher, fleet_payloads
from meshmq.pipeline.logdir import LogDirectory


def previous_run(workdir: Path) -> None:
    """What a run leaves behind, plus the user's rules and a file of their own."""
    for name in ("data/log", "telemetry/aggregates", "telemetry/_checkpoints", "report"):
        (workdir / name).mkdir(parents=True)
    (workdir / "telemetry/_checkpoints/alerts.ledger.json").write_text("{}")
    for name in ("broker.log", "broker.port", "report/report.html", "rules.toml", "notes"):
        (workdir / name).write_text("x")
    (workdir / MARKER).write_text("")


def test_a_new_run_clears_the_previous_one_and_keeps_the_rules(tmp_path: Path) -> None:
    previous_run(tmp_path)
    prepare_workdir(tmp_path, own_broker=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "notes", "rules.toml"]


def test_with_a_running_broker_its_data_dir_is_left_alone(tmp_path: Path) -> None:
    previous_run(tmp_path)
    prepare_workdir(tmp_path, own_broker=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == [MARKER, "data", "notes",
                                                          "rules.toml"]


@pytest.mark.parametrize("existing", [[], ["rules.toml"]])
def test_a_new_or_empty_directory_becomes_a_demo_directory(tmp_path: Path,
                                                           existing: list[str]) -> None:
    workdir = tmp_path / "demo"
    workdir.mkdir()
    for name in existing:
        (workdir / name).write_text("x")
    prepare_workdir(workdir, own_broker=True)
    assert (workdir / MARKER).is_file()
    assert (workdir / "rules.toml").exists() == bool(existing)


def test_a_directory_the_demo_did_not_make_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious").write_text("x")
    refused = (f"demo: {tmp_path} holds files the demo did not write (data, no .meshmq-demo): "
               "give an empty or new --workdir")
    with pytest.raises(JobError, match=re.escape(refused)):
        prepare_workdir(tmp_path, own_broker=True)
    assert (tmp_path / "data" / "precious").exists() and not (tmp_path / MARKER).exists()


def test_a_broker_still_running_on_the_demo_data_is_refused(tmp_path: Path) -> None:
    broker = start_broker(tmp_path, name="demo")  # data in tmp_path/demo/data
    try:
        (tmp_path / "demo" / MARKER).write_text("")
        running = f"demo: a broker is still running on {tmp_path / 'demo' / 'data'}: stop it"
        with pytest.raises(JobError, match=re.escape(running)):
            prepare_workdir(tmp_path / "demo", own_broker=True)
        assert (tmp_path / "demo" / "data" / "log" / "meta.json").is_file()
    finally:
        broker.stop()


def test_no_two_devices_draw_the_same_line_and_the_story_holds() -> None:
    readings = 20
    fleet = fleet_payloads(6, readings, 15, now=1_714_521_600.0)
    series: dict[str, dict[str, list[float]]] = {}
    for topic, payloads in fleet.items():
        documents = [json.loads(p) for p in payloads[:readings]]
        series[topic] = {f: [d[f] for d in documents] for f in ("temp", "humidity", "battery")}
    for name in ("temp", "humidity", "battery"):
        lines = [tuple(values[name]) for values in series.values()]
        assert len(set(lines)) == len(lines), name
    assert max(series["devices/sensor-00/telemetry"]["temp"]) > 30  # runs hot
    assert series["devices/sensor-01/telemetry"]["battery"][-1] < 15  # runs down
    assert fleet["devices/sensor-05/telemetry"][readings:] == list(BAD_PAYLOADS)
    stamps = [json.loads(p)["ts"] for p in fleet["devices/sensor-03/telemetry"][:readings]]
    assert stamps == sorted(stamps) and 1_714_521_600 - 15 * readings <= stamps[0]
    assert stamps[-1] < 1_714_521_600


def test_devices_publish_everything_spread_over_the_time_given(tmp_path: Path) -> None:
    broker = start_broker(tmp_path)
    try:
        fleet = {f"devices/d{i}/telemetry": [b'{"v": %d}' % n for n in range(5)]
                 for i in range(3)}
        began = time.monotonic()
        assert FleetPublisher("127.0.0.1", broker.port, fleet, over=1.0).wait() == 15
        assert time.monotonic() - began >= 1.0 * 4 / 5  # the last of 5 goes out at 4/5 s
        log = LogDirectory.open(broker.data_dir)
        assert sum(log.next_offset(p) for p in range(log.partitions)) == 15  # all acked
    finally:
        broker.stop()
