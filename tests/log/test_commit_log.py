"""CommitLog: meta.json, partitioning, appends and reads across partitions, locking."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.errors import LogConfigError, LogDirectoryLocked
from meshmq.log.partitioner import Partitioner
from meshmq.log.record import Record

SRC = Path(__file__).resolve().parents[2] / "src"
T0 = 1_700_000_000_000
TOPICS = ["devices/42/temperature", "a/b", "", "ünïcödé/topic", "$SYS/x", "devices/7/gps"]


def test_partitioner_uses_crc32_of_the_topic() -> None:
    partitioner = Partitioner(8)
    assert partitioner.partition_for("devices/42/temperature") == 6  # crc32 = 1823188350
    for topic in TOPICS:
        assert partitioner.partition_for(topic) == zlib.crc32(topic.encode("utf-8")) % 8


def test_partitioner_key_level_hashes_one_level() -> None:
    partitioner = Partitioner(8, key_level=1)
    assert partitioner.key_for("devices/42/temperature") == "42"
    assert partitioner.partition_for("devices/42/temperature") == zlib.crc32(b"42") % 8
    assert partitioner.partition_for("devices/42/gps") == partitioner.partition_for(
        "devices/42/temperature")
    assert partitioner.partition_for("flat") == zlib.crc32(b"flat") % 8  # too few levels


@pytest.mark.parametrize("seed", ["0", "1", "12345"])
def test_partitioner_is_stable_across_processes(seed: str) -> None:
    code = (
        "import json, sys; from meshmq.log.partitioner import Partitioner; "
        "p = Partitioner(8); print(json.dumps([p.partition_for(t) for t in json.loads("
        "sys.argv[1])]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-c", code, json.dumps(TOPICS)], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [Partitioner(8).partition_for(t) for t in TOPICS]


def test_meta_json_records_format_and_partition_count(tmp_path: Path) -> None:
    CommitLog(tmp_path, LogConfig(partitions=3)).close()
    meta = json.loads((tmp_path / "log" / "meta.json").read_text())
    assert meta["format"] == "meshmq-log" and meta["format_version"] == 1
    assert meta["partitions"] == 3
    assert sorted(p.name for p in (tmp_path / "log").iterdir() if p.is_dir()) == ["0", "1", "2"]


def test_opening_with_another_partition_count_is_an_error(tmp_path: Path) -> None:
    CommitLog(tmp_path, LogConfig(partitions=3)).close()
    with pytest.raises(LogConfigError, match="created with 3 partitions"):
        CommitLog(tmp_path, LogConfig(partitions=4))
    CommitLog(tmp_path, LogConfig(partitions=3)).close()  # the failed open released the lock


def test_unknown_format_version_is_an_error(tmp_path: Path) -> None:
    CommitLog(tmp_path, LogConfig(partitions=1)).close()
    meta_path = tmp_path / "log" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(LogConfigError, match="version 99"):
        CommitLog(tmp_path, LogConfig(partitions=1))


def test_a_second_open_of_the_same_directory_is_refused(tmp_path: Path) -> None:
    with CommitLog(tmp_path, LogConfig(partitions=1)), pytest.raises(LogDirectoryLocked):
        CommitLog(tmp_path, LogConfig(partitions=1))


def test_append_routes_by_topic_and_reads_back(tmp_path: Path) -> None:
    with CommitLog(tmp_path, LogConfig(partitions=4)) as log:
        results = [log.append(t, 1, True, b"\x01\x02", b"p-" + t.encode(), "client", T0)
                   for t in TOPICS]
        for topic, (partition, offset) in zip(TOPICS, results, strict=True):
            assert partition == log.partition_for(topic)
            record = log.read(partition, offset, 1)[0]
            assert (record.topic, record.payload, record.qos, record.retain) == (
                topic, b"p-" + topic.encode(), 1, True)
            assert (record.properties, record.client_id, record.timestamp_ms) == (
                b"\x01\x02", "client", T0)


def test_append_many_batches_per_partition_in_input_order(tmp_path: Path) -> None:
    records = [Record.new(f"devices/{i % 5}/t", b"%d" % i, T0 + i) for i in range(100)]
    with CommitLog(tmp_path, LogConfig(partitions=4)) as log:
        results = log.append_many(records)
        for partition in range(4):
            mine = [(o, r) for (p, o), r in zip(results, records, strict=True) if p == partition]
            assert [o for o, _ in mine] == list(range(len(mine)))
            stored = log.read(partition, 0)
            assert [r.payload for r in stored] == [r.payload for _, r in mine]
        assert log.statistics().records == 100


def test_reopen_gives_identical_reads(tmp_path: Path) -> None:
    config = LogConfig(partitions=2, segment_bytes=1_000)
    with CommitLog(tmp_path, config) as log:
        log.append_many([Record.new(f"t/{i % 3}", bytes(50), T0 + i) for i in range(300)])
        before = [log.read(p, 0, max_bytes=10**7) for p in range(2)]
        stats = log.statistics()
    with CommitLog(tmp_path, config) as log:
        assert [log.read(p, 0, max_bytes=10**7) for p in range(2)] == before
        assert log.statistics() == stats
        assert all(log.partition(p).recovery.clean_shutdown for p in range(2))


def test_offsets_timestamps_and_retention(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_bytes=1_000, retention_ms=10_000)
    with CommitLog(tmp_path, config) as log:
        for i in range(100):
            log.append("t", 0, False, b"", bytes(40), "c", T0 + i * 100)
        assert log.offset_for_timestamp(0, T0 + 250) == 3
        assert (log.earliest_offset(0), log.next_offset(0)) == (0, 100)
        assert log.enforce_retention(T0 + 9_900 + 10_000) > 0
        assert log.earliest_offset(0) > 0
        log.flush()
        log.flush([0])


def _reference_reader():
    """The reader printed in docs/log-format.md, executed as documented."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "log-format.md").read_text()
    section = doc[doc.index("### Reference reader"):]
    code = section[section.index("```python") + len("```python"):]
    namespace: dict[str, object] = {}
    exec(code[: code.index("```")], namespace)
    return namespace["read_partition"]


def test_the_documented_reader_reads_what_the_log_wrote(tmp_path: Path) -> None:
    read_partition = _reference_reader()
    config = LogConfig(partitions=2, segment_bytes=3_000, index_interval_bytes=500)
    records = [Record.new(f"d/{i % 3}/t", b"%d" % i, T0 + i, qos=i % 3, retain=i % 2 == 0,
                          properties=b"\x01\x01" * (i % 2), client_id=f"c{i}")
               for i in range(400)]
    with CommitLog(tmp_path, config) as log:
        for i in range(0, len(records), 10):
            log.append_many(records[i : i + 10])
        for partition in range(2):
            stored = log.read(partition, 0, max_bytes=10**8)
            external = list(read_partition(tmp_path / "log", partition))
            assert external == [
                (r.offset, r.timestamp_ms, r.topic, r.qos, r.retain, r.properties, r.payload,
                 r.client_id, r.message_id) for r in stored]
            assert len(log.partition(partition).segment_base_offsets()) > 1


def test_key_level_routes_a_device_to_one_partition(tmp_path: Path) -> None:
    with CommitLog(tmp_path, LogConfig(partitions=8, key_level=1)) as log:
        partitions = {log.append(f"devices/42/{kind}", 0, False, b"", b"", "", T0)[0]
                      for kind in ("temp", "gps", "battery")}
        assert partitions == {zlib.crc32(b"42") % 8}
