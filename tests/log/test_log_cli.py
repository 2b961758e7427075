"""``meshmq log ls|dump|tail|verify|repair`` over logs written by the real engine and broker.

Expected values come from the engine (``CommitLog.read`` on the pristine log) or from parsing
the files with the batch layout of ``docs/log-format.md``, never from the tool's own output.
Most runs call the CLI's ``main`` in-process (fast); the exit-status, ``--follow`` and broker
tests run the real ``meshmq`` command as a subprocess.
"""

from __future__ import annotations

import base64
import io
import json
import re
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
from contextlib import redirect_stderr, redirect_stdout
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paho.mqtt.packettypes import PacketTypes

from conftest import WAIT, props, start_broker, wait_for
from meshmq.cli import main
from meshmq.log.commit_log import CommitLog
from meshmq.log.config import LogConfig
from meshmq.log.errors import CorruptSegment
from meshmq.log.inspect import iso_timestamp, parse_timestamp, summarize_segment
from meshmq.log.reader import LogDirectory
from meshmq.log.record import Record
from meshmq.log.render import payload_text
from meshmq.log.verify import verify
from meshmq.mqtt.codec import encode_properties
from meshmq.mqtt.properties import PropertyId

T0 = 1_700_000_000_000
CONFIG = LogConfig(partitions=2, segment_bytes=3_000, index_interval_bytes=300)
TOPICS = ["d/0/t", "d/1/t", "d/2/x", "e/0/t", "$SYS/x"]
PROPS = encode_properties({PropertyId.CONTENT_TYPE: "text/plain",
                           PropertyId.USER_PROPERTY: [("k", "v")]})
HEADER = struct.Struct(">BIIHQIQQI")  # the batch header of docs/log-format.md


# -- helpers ----------------------------------------------------------------------------------


def cli(*args: str) -> tuple[int, str, str]:
    """Run ``meshmq log ARGS`` in-process; (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["log", *args])
        except SystemExit as exc:  # argparse usage errors
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


def run_meshmq(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "meshmq", "log", *args], capture_output=True,
                          text=True, timeout=60, stdin=subprocess.DEVNULL, cwd=cwd)


def json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines()]


def make_records(count: int, start: int = 0) -> list[Record]:
    return [Record.new(TOPICS[i % len(TOPICS)], b"v%03d" % i, T0 + i * 1000, qos=i % 3,
                       retain=i % 4 == 0, properties=PROPS if i % 2 else b"",
                       client_id=f"c{i % 3}") for i in range(start, start + count)]


def read_all(data_dir: Path, partitions: int = 2) -> dict[int, list[Record]]:
    """Every record, read through the engine (opens and closes the log)."""
    with CommitLog(data_dir, LogConfig(partitions=partitions)) as log:
        return {p: log.read(p, log.earliest_offset(p), max_bytes=1 << 30)
                for p in range(partitions)}


def batches_of(path: Path) -> list[tuple[int, int, int, int]]:
    """(position, length, first offset, last offset) of every batch, parsed as documented."""
    data, found, position = path.read_bytes(), [], 0
    while position + HEADER.size <= len(data):
        _, length, _, _, base, delta, _, _, _ = HEADER.unpack_from(data, position)
        found.append((position, length, base, base + delta))
        position += length
    return found


def segment_files(data_dir: Path, partition: int) -> list[Path]:
    return sorted((data_dir / "log" / str(partition)).glob("*.log"))


def snapshot(data_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(data_dir)): p.read_bytes()
            for p in sorted(data_dir.rglob("*")) if p.is_file()}


def flip_bit(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0x08
    path.write_bytes(bytes(data))


def iso(ms: int) -> str:
    """The expected rendering of a timestamp, computed here with datetime."""
    moment = datetime(1970, 1, 1, tzinfo=UTC) + timedelta(milliseconds=ms)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{ms % 1000:03d}Z"


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, dict[int, list[Record]]]:
    """A closed 2-partition log of 200 records in batches of 5, several segments each, and
    every record as the engine reads it back."""
    data_dir = tmp_path / "data"
    with CommitLog(data_dir, CONFIG) as log:
        records = make_records(200)
        for i in range(0, len(records), 5):
            log.append_many(records[i:i + 5], T0 + i * 1000)
    stored = read_all(data_dir)
    assert all(len(segment_files(data_dir, p)) >= 2 for p in range(2))
    return data_dir, stored


# -- ls -------------------------------------------------------------------------------------


def test_ls_lists_partitions_segments_offsets_and_totals(written) -> None:
    data_dir, stored = written
    code, out, err = cli("ls", "--data-dir", str(data_dir), "--json")
    assert (code, err) == (0, "")
    listing = json.loads(out)
    assert listing["partitions"] == 2 and listing["in_use"] is False
    assert listing["records"] == 200
    with CommitLog(data_dir, CONFIG) as log:
        bases = {p: log.partition(p).segment_base_offsets() for p in range(2)}
    for entry in listing["partition_list"]:
        p, records = entry["partition"], stored[entry["partition"]]
        assert (entry["earliest_offset"], entry["next_offset"]) == (0, records[-1].offset + 1)
        assert entry["records"] == len(records)
        assert [s["base_offset"] for s in entry["segment_list"]] == bases[p]
        for segment, path in zip(entry["segment_list"], segment_files(data_dir, p),
                                 strict=True):
            inside = [r for r in records if segment["base_offset"] <= r.offset
                      < segment["next_offset"]]
            assert segment["size_bytes"] == path.stat().st_size
            assert segment["records"] == len(inside)
            assert segment["first_timestamp"] == iso(inside[0].timestamp_ms)
            assert segment["last_timestamp"] == iso(max(r.timestamp_ms for r in inside))
        assert entry["size_bytes"] == sum(p.stat().st_size for p in segment_files(data_dir, p))

    code, text, _ = cli("ls", "-d", str(data_dir / "log"))  # the log directory itself
    assert code == 0
    for p in range(2):
        assert (f"partition {p}: earliest offset 0, next offset {stored[p][-1].offset + 1}, "
                f"{len(stored[p])} records") in text
    assert "2 partitions" in text and "200 records" in text


# -- dump -----------------------------------------------------------------------------------


def test_dump_json_has_every_field_of_every_record(written) -> None:
    data_dir, stored = written
    code, out, err = cli("dump", "-d", str(data_dir), "--json")
    assert (code, err) == (0, "")
    dumped = json_lines(out)
    expected = [(p, r) for p in range(2) for r in stored[p]]
    assert len(dumped) == len(expected) == 200
    for obj, (p, record) in zip(dumped, expected, strict=True):
        assert (obj["partition"], obj["offset"], obj["timestamp_ms"]) == (
            p, record.offset, record.timestamp_ms)
        assert obj["timestamp"] == iso(record.timestamp_ms)
        assert (obj["topic"], obj["qos"], obj["retain"], obj["client_id"]) == (
            record.topic, record.qos, record.retain, record.client_id)
        assert obj["message_id"].replace("-", "") == record.message_id.hex()
        assert base64.b64decode(obj["payload"]) == record.payload
        assert base64.b64decode(obj["properties_raw"]) == record.properties
        if record.properties:
            assert obj["properties"] == {"content_type": "text/plain",
                                         "user_property": [["k", "v"]]}


def test_dump_text_escapes_what_is_not_printable_and_offers_payload_modes(
        tmp_path: Path) -> None:
    payload = "café".encode() + b" \xff\x00\x1b[31m\n\\"
    with CommitLog(tmp_path, LogConfig(partitions=1)) as log:
        log.append("a b/c", 1, True, PROPS, payload, "dev\t1", T0 + 123)
        message_id = log.read(0, 0)[0].message_id
    code, out, _ = cli("dump", "-d", str(tmp_path))
    assert code == 0
    line = out.rstrip("\n")
    assert "\n" not in line and "\x1b" not in line and "\x00" not in line
    assert line.startswith(f"p=0 offset=0 {iso(T0 + 123)} ")
    assert 'topic="a b/c" qos=1 retain=1 client=dev\\t1 ' in line
    hexid = message_id.hex()
    assert f"id={hexid[:8]}-{hexid[8:12]}-{hexid[12:16]}-{hexid[16:20]}-{hexid[20:]}" in line
    assert "props={content_type=text/plain, k:v}" in line
    assert line.endswith(f"size={len(payload)} payload=café \\xff\\x00\\x1b[31m\\n\\\\")
    for mode, shown in (("hex", payload.hex()),
                        ("base64", base64.b64encode(payload).decode())):
        assert cli("dump", "-d", str(tmp_path), "--payload", mode)[1].rstrip().endswith(
            f"payload={shown}")
    none = cli("dump", "-d", str(tmp_path), "--payload", "none")[1]
    assert "payload=" not in none and f"size={len(payload)}" in none
    assert "payload" not in json.loads(cli("dump", "-d", str(tmp_path), "--json",
                                           "--payload", "none")[1])


def dumped_keys(data_dir: Path, *args: str) -> list[tuple[int, int]]:
    code, out, err = cli("dump", "-d", str(data_dir), "--json", "--payload", "none", *args)
    assert (code, err) == (0, "")
    return [(obj["partition"], obj["offset"]) for obj in json_lines(out)]


def keys(stored: dict[int, list[Record]], keep) -> list[tuple[int, int]]:
    return [(p, r.offset) for p in sorted(stored) for r in stored[p] if keep(p, r)]


def test_dump_filters(written) -> None:
    data_dir, stored = written
    assert dumped_keys(data_dir, "--topic", "d/+/t") == keys(
        stored, lambda p, r: r.topic in ("d/0/t", "d/1/t"))
    assert dumped_keys(data_dir, "--topic", "#") == keys(  # '#' never matches $-topics
        stored, lambda p, r: not r.topic.startswith("$"))
    assert dumped_keys(data_dir, "-t", "$SYS/#", "-t", "e/#") == keys(
        stored, lambda p, r: r.topic in ("$SYS/x", "e/0/t"))
    assert dumped_keys(data_dir, "--from-offset", "50") == keys(stored, lambda p, r:
                                                                r.offset >= 50)
    assert dumped_keys(data_dir, "--partition", "1", "-p", "1") == keys(stored,
                                                                        lambda p, r: p == 1)
    assert dumped_keys(data_dir, "--limit", "7") == keys(stored, lambda p, r: True)[:7]
    assert dumped_keys(data_dir, "--limit", "0") == []
    cut = T0 + 120_500  # between the records written at T0 + 120 s and T0 + 121 s
    expected = keys(stored, lambda p, r: r.timestamp_ms >= cut)
    assert dumped_keys(data_dir, "--from-timestamp", str(cut)) == expected
    assert dumped_keys(data_dir, "--from-timestamp", iso(cut)) == expected
    assert dumped_keys(data_dir, "--from-timestamp", iso(cut).replace("Z", "+01:00")) == keys(
        stored, lambda p, r: r.timestamp_ms >= cut - 3_600_000)
    combined = dumped_keys(data_dir, "-p", "0", "-t", "d/#", "--from-offset", "10",
                           "--limit", "4")
    assert combined == keys(stored, lambda p, r: p == 0 and r.topic.startswith("d/")
                            and r.offset >= 10)[:4]


# -- tail -------------------------------------------------------------------------------------


def test_tail_prints_the_last_records_of_each_partition(written) -> None:
    data_dir, stored = written
    code, out, _ = cli("tail", "-d", str(data_dir), "-n", "3", "--json")
    assert code == 0
    assert [(o["partition"], o["offset"]) for o in json_lines(out)] == [
        (p, r.offset) for p in range(2) for r in stored[p][-3:]]
    code, out, _ = cli("tail", "-d", str(data_dir), "-n", "4", "-t", "e/0/t", "-p", "0")
    lines = out.splitlines()
    expected = [r for r in stored[0] if r.topic == "e/0/t"][-4:]
    assert [int(re.search(r" offset=(\d+) ", line)[1]) for line in lines] == [
        r.offset for r in expected]
    assert cli("tail", "-d", str(data_dir), "-n", "0")[1] == ""
    everything = json_lines(cli("tail", "-d", str(data_dir), "-n", "1000", "--json")[1])
    assert len(everything) == 200  # across every segment


class LineReader:
    """Collects a subprocess's stdout lines on a thread, for wait_for."""

    def __init__(self, stream: io.TextIOBase) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(stream,), daemon=True)
        self._thread.start()

    def _run(self, stream: io.TextIOBase) -> None:
        for line in stream:
            self.lines.append(line)

    def join(self) -> None:
        self._thread.join(WAIT)


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT],
                         ids=["SIGTERM", "SIGINT"])
def test_tail_follow_prints_appended_records_across_segments(written,
                                                             stop_signal: int) -> None:
    data_dir, stored = written
    segments_before = [len(segment_files(data_dir, p)) for p in range(2)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "meshmq", "log", "tail", "-d", str(data_dir), "-n", "1",
         "--follow", "--interval", "0.05", "--json", "--payload", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        reader = LineReader(proc.stdout)
        wait_for(lambda: len(reader.lines) >= 2, what="the last record of each partition")
        with CommitLog(data_dir, CONFIG) as log:  # the broker's role: append while it follows
            new = make_records(120, start=200)
            added = [key for i in range(0, 120, 5) for key in log.append_many(new[i:i + 5], T0)]
        wait_for(lambda: len(reader.lines) >= 122, what="the 120 appended records")
        segments_after = [len(segment_files(data_dir, p)) for p in range(2)]
        assert all(a > b for a, b in zip(segments_after, segments_before, strict=True))
        proc.send_signal(stop_signal)
        assert proc.wait(WAIT) == 0
        reader.join()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    followed = [(o["partition"], o["offset"]) for o in json_lines("".join(reader.lines))]
    assert followed[:2] == [(p, stored[p][-1].offset) for p in range(2)]
    assert sorted(followed[2:]) == sorted(added)
    for p in range(2):  # in offset order within a partition, with nothing missed
        offsets = [o for q, o in followed[2:] if q == p]
        assert offsets == list(range(stored[p][-1].offset + 1, stored[p][-1].offset + 1
                                     + len(offsets)))
    assert proc.stderr.read() == ""


# -- verify -----------------------------------------------------------------------------------


def damage(data_dir: Path, kind: str) -> dict:
    """Damage the log in one way; return what a correct verify must report."""
    if kind == "flip":  # a payload byte of the 3rd batch of partition 0's first (sealed) segment
        path = segment_files(data_dir, 0)[0]
        position, length, first, last = batches_of(path)[2]
        flip_bit(path, position + length - 2)
        return {"path": path, "position": position, "kind": "corrupt", "lost": [first, last],
                "length": length}
    if kind == "torn":  # the end of partition 1's last batch never reached the disk
        path = segment_files(data_dir, 1)[-1]
        position, length, first, _ = batches_of(path)[-1]
        with open(path, "r+b") as file:
            file.truncate(position + length - 7)
        return {"path": path, "position": position, "kind": "tail", "lost": [first, None],
                "length": length - 7}
    if kind == "index":
        path = segment_files(data_dir, 0)[1].with_suffix(".index")
        path.unlink()
        return {"path": path, "position": None, "kind": "index", "lost": None, "length": 0}
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["flip", "torn", "index"])
def test_verify_reports_each_damage_where_it_is(written, kind: str) -> None:
    data_dir, _ = written
    code, out, _ = cli("verify", "-d", str(data_dir))
    assert code == 0 and out.startswith("verify: clean (2 partitions")
    expected = damage(data_dir, kind)
    code, out, err = cli("verify", "-d", str(data_dir), "--json")
    assert (code, err) == (1, "")
    report = json.loads(out)
    assert report["clean"] is False
    problems = [p for p in report["problems"] if p["kind"] != "index" or kind == "index"]
    assert len(problems) == 1, report["problems"]
    problem = problems[0]
    assert problem["path"] == str(expected["path"])
    assert (problem["position"], problem["kind"]) == (expected["position"], expected["kind"])
    assert (problem["lost_offsets"], problem["length"]) == (expected["lost"],
                                                            expected["length"])
    code, text, _ = cli("verify", "-d", str(data_dir))
    partition = expected["path"].parent.name
    where = f"problem: partition {partition}, {expected['path'].name}"
    if expected["position"] is not None:
        where += f", byte {expected['position']}: "
    assert code == 1 and where in text
    assert {"flip": "checksum mismatch", "torn": "torn tail", "index": "missing"}[kind] in text
    assert text.splitlines()[-1].startswith("verify: ")


def test_verify_reads_a_live_log_and_tolerates_a_write_in_progress(written) -> None:
    data_dir, stored = written
    with CommitLog(data_dir, CONFIG) as log:  # holds the lock, as a broker does
        last = segment_files(data_dir, 0)[-1]
        whole = last.read_bytes()
        batch = whole[batches_of(last)[-1][0]:]
        with open(last, "ab") as file:  # half of a batch: a write in progress
            file.write(batch[: len(batch) // 2])
        code, out, _ = cli("verify", "-d", str(data_dir))
        assert code == 0 and "write in progress" in out
        code, out, _ = cli("ls", "-d", str(data_dir), "--json")
        assert code == 0 and json.loads(out)["in_use"] is True
        assert json.loads(out)["records"] == 200
        code, out, err = cli("dump", "-d", str(data_dir), "--json", "-p", "0")
        assert (code, err) == (0, "")
        assert len(json_lines(out)) == len(stored[0])
        code, out, _ = cli("repair", "-d", str(data_dir))
        assert code == 2  # refused: the log is open
        with open(last, "r+b") as file:
            file.truncate(len(whole))
        assert log.read(0, 0, max_bytes=1 << 30) == stored[0]


def test_readers_tolerate_segments_deleted_by_retention(tmp_path: Path) -> None:
    config = LogConfig(partitions=1, segment_bytes=1_000, retention_bytes=3_000)
    stop = threading.Event()
    with CommitLog(tmp_path, config) as log:
        log.append_many(make_records(50), T0)

        def churn() -> None:
            n = 0
            while not stop.is_set():
                log.append_many(make_records(10, start=n), T0)
                log.enforce_retention(T0)
                n += 10

        writer = threading.Thread(target=churn)
        writer.start()
        try:
            for args in (["ls"], ["dump", "--payload", "none"], ["tail", "-n", "20"],
                         ["verify"]) * 5:
                code, _, err = cli(*args, "-d", str(tmp_path))
                assert (code, err) == (0, ""), (args, err)
        finally:
            stop.set()
            writer.join()


def test_a_segment_deleted_after_listing_is_skipped(written) -> None:
    data_dir, _ = written
    log = LogDirectory.locate(data_dir)
    listed = log.segments(0)
    listed[0].path.unlink()  # what retention does between a listing and a read
    assert listed[0].read() is None
    assert summarize_segment(listed[0]).vanished
    code, out, err = cli("dump", "-d", str(data_dir), "-p", "0", "--json")
    assert (code, err) == (0, "") and json_lines(out)[0]["offset"] == listed[1].base_offset


# -- repair -----------------------------------------------------------------------------------


def surviving(stored: dict[int, list[Record]], lost: dict[int, set[int]]) -> dict:
    return {p: [r for r in records if r.offset not in lost.get(p, set())]
            for p, records in stored.items()}


@pytest.mark.parametrize("kinds", [["flip"], ["torn"], ["index"], ["flip", "torn", "index"]])
def test_repair_fixes_the_damage_and_the_engine_reads_every_surviving_record(
        written, kinds: list[str]) -> None:
    data_dir, stored = written
    expected = [damage(data_dir, kind) for kind in kinds]
    damaged = snapshot(data_dir)
    if "flip" in kinds:  # the damage is real: reads fail before repair (on a copy: opening
        copy = data_dir.parent / "copy"  # the log would rebuild indexes and cut torn tails)
        shutil.copytree(data_dir, copy)
        with CommitLog(copy, CONFIG) as log, pytest.raises(CorruptSegment):
            log.read(0, 0, max_bytes=1 << 30)
    code, out, err = cli("repair", "-d", str(data_dir), "--json")
    assert (code, err) == (0, ""), out
    report = json.loads(out)
    assert report["succeeded"] and report["clean_after"]
    lost: dict[int, set[int]] = {}
    for exp in expected:
        if exp["lost"] is None:
            continue
        partition = int(exp["path"].parent.name)
        first, last = exp["lost"]
        last = stored[partition][-1].offset if last is None else last
        lost.setdefault(partition, set()).update(range(first, last + 1))
    reported = [offsets for action in report["actions"] for offsets in action["lost_offsets"]]
    assert sorted(reported, key=str) == sorted([e["lost"] for e in expected if e["lost"]],
                                               key=str)
    assert report["bytes_lost"] == sum(e["length"] for e in expected)
    assert read_all(data_dir) == surviving(stored, lost)
    for exp in expected:  # every damaged file kept, byte for byte
        backups = list(exp["path"].parent.glob(f"repair-backup-*/{exp['path'].name}"))
        original = damaged.get(str(exp["path"].relative_to(data_dir)))
        if original is None:  # the deleted index: nothing to keep
            assert backups == []
        else:
            assert [b.read_bytes() for b in backups] == [original]
    assert cli("verify", "-d", str(data_dir))[0] == 0
    assert cli("repair", "-d", str(data_dir))[1] == "repair: nothing to do (verify is clean)\n"


def test_repair_text_names_the_lost_offsets_and_bytes(written) -> None:
    data_dir, _ = written
    exp = damage(data_dir, "flip")
    code, out, _ = cli("repair", "-d", str(data_dir), "--dry-run")
    first, last = exp["lost"]
    assert code == 0
    assert (f"partition 0, {exp['path'].name}: would remove {exp['length']} bytes at byte "
            f"{exp['position']} (checksum mismatch") in out
    assert f"offsets {first}-{last} lost" in out
    assert "nothing changed" in out.splitlines()[-1]
    code, out, _ = cli("repair", "-d", str(data_dir))
    assert code == 0 and f"removed {exp['length']} bytes" in out
    assert out.splitlines()[-1].endswith("verify is now clean")


def test_repair_dry_run_and_no_backup(written) -> None:
    data_dir, _ = written
    damage(data_dir, "flip")
    damage(data_dir, "torn")
    before = snapshot(data_dir)
    assert cli("repair", "-d", str(data_dir), "--dry-run")[0] == 0
    assert snapshot(data_dir) == before  # nothing written, nothing created
    assert cli("repair", "-d", str(data_dir), "--no-backup")[0] == 0
    assert not list(data_dir.rglob("repair-backup-*"))
    assert not list(data_dir.rglob("*.repair-tmp"))
    assert sum(len(r) for r in read_all(data_dir).values()) < 200


def test_repair_is_refused_while_the_log_is_open(written) -> None:
    data_dir, _ = written
    damage(data_dir, "torn")
    with CommitLog(data_dir, CONFIG):
        before = snapshot(data_dir)
        result = run_meshmq("repair", "-d", str(data_dir))
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "in use" in result.stderr
        assert result.stderr.startswith("meshmq log: error: ")
        assert snapshot(data_dir) == before


def test_repair_rewrites_a_segment_corrupt_in_several_places(written) -> None:
    data_dir, stored = written
    path = segment_files(data_dir, 0)[0]
    batches = batches_of(path)
    for position, length, _, _ in (batches[1], batches[4]):
        flip_bit(path, position + length // 2)
    flip_bit(path, batches[-2][0] + 1)  # a batch length: the walk must find the next batch
    assert cli("repair", "-d", str(data_dir))[0] == 0
    lost = {o for b in (batches[1], batches[4], batches[-2]) for o in range(b[2], b[3] + 1)}
    assert read_all(data_dir) == surviving(stored, {0: lost})


def test_a_leftover_of_an_interrupted_repair_is_ignored_then_removed(written) -> None:
    data_dir, stored = written
    segment = segment_files(data_dir, 0)[0]
    leftover = segment.parent / f".{segment.name}.repair-tmp"  # a crash before the rename
    leftover.write_bytes(segment.read_bytes()[:100])
    code, out, _ = cli("verify", "-d", str(data_dir))
    assert code == 0 and "leftover of an interrupted repair" in out
    assert read_all(data_dir) == stored  # the broker's engine ignores it
    assert cli("repair", "-d", str(data_dir))[0] == 0
    assert not leftover.exists()


def test_overlapping_segments_are_reported_not_repaired(written) -> None:
    data_dir, _ = written
    first, second = segment_files(data_dir, 0)[:2]
    copy = first.parent / f"{int(second.stem) - 5:020d}.log"  # a stray copy, misnamed
    shutil.copy(second, copy)
    code, out, _ = cli("verify", "-d", str(data_dir))
    assert code == 1 and f"{copy.name}: segment starts at offset {int(copy.stem)}" in out
    before = snapshot(data_dir)
    code, out, _ = cli("repair", "-d", str(data_dir))
    assert code == 1 and "cannot repair: " in out and "verify is now NOT clean" in out
    assert snapshot(data_dir) == before


# -- the real command: errors and exit statuses ---------------------------------------------


def test_a_directory_without_a_log_is_one_line_and_status_2(tmp_path: Path) -> None:
    missing = run_meshmq("ls", "-d", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr == f"meshmq log: error: {tmp_path / 'nope'}: no such directory\n"
    empty = run_meshmq("verify", "-d", str(tmp_path))
    assert empty.returncode == 2 and empty.stderr.count("\n") == 1
    assert "no commit log here" in empty.stderr
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "meta.json").write_text("{not json")
    bad_meta = run_meshmq("dump", "-d", str(tmp_path))
    assert bad_meta.returncode == 2 and bad_meta.stderr.count("\n") == 1
    assert "meta.json is unreadable" in bad_meta.stderr


@pytest.mark.parametrize("args, message", [
    (["dump", "-p", "2"], "partition 2 does not exist (the log has 2: 0-1)"),
    (["dump", "--from-timestamp", "yesterday"], "--from-timestamp: not a timestamp"),
    (["tail", "--topic", "a/#/b"], "--topic: '#' must be the whole last level"),
    (["dump", "--topic", "$share/g/a"], "--topic: use a plain filter"),
])
def test_bad_option_values_are_one_line_and_status_2(written, args, message: str) -> None:
    data_dir, _ = written
    code, out, err = cli(*args, "-d", str(data_dir))
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and err.startswith(f"meshmq log: error: {message}")


def test_usage_errors_exit_2(written) -> None:
    data_dir, _ = written
    assert cli("dump", "-d", str(data_dir), "--limit", "-1")[0] == 2
    assert cli("dump", "-d", str(data_dir), "--payload", "utf16")[0] == 2


def test_the_data_dir_defaults_to_the_one_serve_uses(written) -> None:
    data_dir, _ = written
    assert data_dir.name == "data"
    listed = run_meshmq("ls", cwd=data_dir.parent)
    assert (listed.returncode, listed.stderr) == (0, "")
    assert listed.stdout.startswith("log data/log (not in use): 2 partitions")
    damage(data_dir, "torn")
    checked = run_meshmq("verify", cwd=data_dir.parent)
    assert checked.returncode == 1 and "torn tail" in checked.stdout


# -- a log written by a real broker ---------------------------------------------------------


@pytest.mark.slow
def test_a_log_written_by_the_broker(tmp_path: Path, client_factory) -> None:
    config = "[log]\npartitions = 2\nsegment_bytes = 1024\n"
    broker = start_broker(tmp_path, config)
    try:
        client = client_factory("pub1")
        client.connect(broker.port)
        for i in range(40):
            client.publish(f"fleet/d{i % 4}/temp", f"{20 + i / 10:.1f}", qos=1,
                           properties=props(PacketTypes.PUBLISH, UserProperty=[("seq", str(i))]))
        data_dir = broker.data_dir
        code, out, err = cli("ls", "-d", str(data_dir), "--json")  # while the broker runs
        assert (code, err) == (0, "")
        assert json.loads(out)["in_use"] is True and json.loads(out)["records"] == 40
        code, out, err = cli("dump", "-d", str(data_dir), "--json", "-t", "fleet/d1/+")
        dumped = json_lines(out)
        assert (code, err) == (0, "")
        assert sorted(int(o["properties"]["user_property"][0][1]) for o in dumped) == list(
            range(1, 40, 4))
        assert {(o["topic"], o["client_id"], o["qos"]) for o in dumped} == {
            ("fleet/d1/temp", "pub1", 1)}
        seq1 = next(o for o in dumped if o["properties"]["user_property"] == [["seq", "1"]])
        assert base64.b64decode(seq1["payload"]) == b"20.1"
        assert cli("verify", "-d", str(data_dir))[0] == 0
        assert run_meshmq("repair", "-d", str(data_dir)).returncode == 2
        client.publish("fleet/after", "x", qos=1)  # the broker was not disturbed
    finally:
        broker.stop()

    path = segment_files(data_dir, 0)[0]  # sealed, no index entries: checked at start-up
    position, length, first, last = batches_of(path)[1]
    flip_bit(path, position + length - 1)
    refused = subprocess.run(
        [sys.executable, "-m", "meshmq", "serve", "--config", str(tmp_path / "broker" /
         "meshmq.toml"), "--bind", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)],
        capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "meshmq log verify" in refused.stderr

    code, out, _ = cli("repair", "-d", str(data_dir))
    lost = f"offset {first}" if first == last else f"offsets {first}-{last}"
    assert code == 0 and f"{lost} lost" in out
    (tmp_path / "broker" / "port").unlink()
    restarted = start_broker(tmp_path, config)  # starts on the repaired log
    restarted.stop()
    stored = read_all(data_dir)
    assert sum(len(records) for records in stored.values()) == 41 - (last - first + 1)
    assert all(first > r.offset or r.offset > last for r in stored[0])


# -- parsers: properties ----------------------------------------------------------------------


@given(st.integers(0, 253_402_300_799_999))
def test_timestamps_round_trip_through_iso_and_milliseconds(ms: int) -> None:
    assert iso_timestamp(ms) == iso(ms)
    assert parse_timestamp(iso_timestamp(ms)) == ms
    assert parse_timestamp(str(ms)) == ms


_ESCAPE = re.compile(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|n|r|t|\\)")


def unescape(text: str) -> bytes:
    """Undo payload_text, as a reader of the output would."""
    out, pos = bytearray(), 0
    for match in _ESCAPE.finditer(text):
        out += text[pos:match.start()].encode()
        code = match[1]
        if code[0] == "x":
            out.append(int(code[1:], 16))
        elif code[0] in "uU":
            out += chr(int(code[1:], 16)).encode("utf-8", "surrogatepass")
        else:
            out += {"n": b"\n", "r": b"\r", "t": b"\t", "\\": b"\\"}[code]
        pos = match.end()
    return bytes(out + text[pos:].encode())


@given(st.binary(max_size=64) | st.text(max_size=32).map(lambda t: t.encode("utf-8",
                                                                              "surrogatepass")))
def test_text_payloads_are_printable_and_unambiguous(payload: bytes) -> None:
    shown = payload_text(payload)
    assert shown.isprintable()
    assert unescape(shown) == payload


def _segment_bytes(directory: Path) -> tuple[Path, bytes, list[tuple[int, int, int, int]]]:
    path = segment_files(directory, 0)[0]
    return path, path.read_bytes(), batches_of(path)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One sealed segment of 12 batches (module-wide: hypothesis copies it per example)."""
    directory = tmp_path_factory.mktemp("pristine")
    with CommitLog(directory, LogConfig(partitions=1)) as log:
        for i in range(12):
            log.append_many(make_records(3, start=3 * i), T0)
    return directory


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_verify_keeps_exactly_the_batches_the_damage_spares(pristine: Path, data) -> None:
    _, original, batches = _segment_bytes(pristine)
    with tempfile.TemporaryDirectory() as scratch:
        copy = Path(scratch) / "data"
        shutil.copytree(pristine, copy)
        path = segment_files(copy, 0)[0]
        if data.draw(st.booleans(), label="truncate"):
            cut = data.draw(st.integers(1, len(original) - 1), label="cut")
            path.write_bytes(original[:cut])
            spared = [b for b in batches if b[0] + b[1] <= cut]
            damaged_bytes = cut not in {b[0] + b[1] for b in batches}
        else:
            at = data.draw(st.integers(0, len(original) - 1), label="byte")
            bit = data.draw(st.integers(0, 7), label="bit")
            damaged = bytearray(original)
            damaged[at] ^= 1 << bit
            path.write_bytes(bytes(damaged))
            spared = [b for b in batches if not b[0] <= at < b[0] + b[1]]
            damaged_bytes = True  # every bit of a batch is checked by something
        report = verify(LogDirectory.locate(copy), live=False)
        check = report.segments[0]
        kept = b"".join(path.read_bytes()[start:end] for start, end in check.keep)
        assert kept == b"".join(original[b[0]:b[0] + b[1]] for b in spared)
        assert check.records == 3 * len(spared)
        assert bool(check.data_problems) == damaged_bytes
