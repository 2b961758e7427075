"""The jobs as users start them, each in its own process (and so its own JVM): the README's
``meshmq pipeline demo``, and a job under ``spark-submit`` through ``jobs/submit.py``."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image
from test_jobs import publish_all, start_broker

import meshmq.pipeline.jobs.submit as submit_entry

pytestmark = [pytest.mark.xdist_group("spark"), pytest.mark.timeout(400)]

# Spark's log lines look like "26/11/23 15:42:34 INFO SparkContext: ..." (or our pattern).
LOG_LINE = re.compile(r"^(\d\d/\d\d/\d\d )?\d\d:\d\d:\d\d (TRACE|DEBUG|INFO|WARN)\b", re.M)


def spark_env() -> dict[str, str]:
    return {**os.environ, "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable}


@pytest.mark.slow
def test_demo_command_end_to_end(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "meshmq", "pipeline", "demo", "--workdir", str(workdir),
         "--devices", "3", "--readings", "24", "--master", "local[2]"],
        capture_output=True, text=True, timeout=380, env=spark_env(), stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "demo: 3 devices published 75 messages" in out  # 3 x 24 readings + 3 bad ones
    assert "telemetry: 75 records, 3 quarantined" in out
    published = re.search(r"alerts: (\d+) published", out)
    arrived = re.search(r"demo: (\d+) alerts arrived on alerts/#", out)
    assert published and arrived and int(published.group(1)) == int(arrived.group(1)) > 0
    page = workdir / "report" / "report.html"
    assert f"demo: the report is {page}" in out
    assert '<img src="report.png"' in page.read_text()
    assert f"<tr><th>Alerts fired</th><td>{published.group(1)} (" in page.read_text()
    with Image.open(workdir / "report" / "report.png") as image:
        assert image.format == "PNG" and image.height > 1000
    assert not LOG_LINE.search(result.stderr), result.stderr[-3000:]  # quiet by default
    assert "log level" not in result.stderr and "log4j" not in result.stderr
    assert "[Stage " in result.stderr  # Spark's progress bar
    port = int((workdir / "broker.port").read_text().split()[0])
    assert f"started a broker on 127.0.0.1:{port}" in out
    with pytest.raises(ConnectionRefusedError):  # and stopped it
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


@pytest.mark.slow
def test_a_job_under_spark_submit(tmp_path: Path) -> None:
    broker = start_broker(tmp_path)
    try:
        messages = [(f"site{i % 2}/meter/{i}", b"%d" % i) for i in range(12)]
        publish_all(broker.port, messages)
        spark_submit = Path(sys.executable).with_name("spark-submit")
        result = subprocess.run(
            [str(spark_submit), "--master", "local[2]", "--conf", "spark.ui.enabled=false",
             submit_entry.__file__, "archive", "--data-dir", str(broker.data_dir),
             "--output", str(tmp_path / "archive")],
            capture_output=True, text=True, timeout=380, env=spark_env(),
            stdin=subprocess.DEVNULL)
    finally:
        broker.stop()
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == f"archive: 12 records in {tmp_path / 'archive'}"
    rows = pq.read_table(tmp_path / "archive").to_pylist()
    assert sorted((r["topic"], r["payload"]) for r in rows) == sorted(messages)
    assert {str(r["topic_root"]) for r in rows} == {"site0", "site1"}
