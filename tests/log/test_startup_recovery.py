"""A broker starting on a damaged commit log (real processes, real files).

A torn tail, as a crash leaves it, is cut automatically, but never silently: the file as it was
is kept beside the log and the warning names it. Damage followed by good records stops the
start-up with an error that names the ``meshmq log repair`` command to paste, and that command
makes the broker start again.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

from conftest import start_broker
from failedstart import quoted_command, run_pasted, serve_until_exit
from meshmq.log.record import Record, encode_batch, peek_batch_header
from meshmq.mqtt.packets import Puback, Publish
from rawclient import RawClient

CONFIG = "[log]\npartitions = 1\n"
MESSAGES = 12


def publish_one_by_one(port: int) -> None:
    """QoS 1 publishes, each acknowledged before the next: one batch each in the log."""
    with RawClient(port) as client:
        client.connect("writer")
        for n in range(MESSAGES):
            client.send(Publish("plant/line1/temp", b"reading-%02d" % n, 1, packet_id=n + 1))
            assert client.recv_type(Puback).packet_id == n + 1


def active_segment(data_dir: Path) -> Path:
    return sorted((data_dir / "log" / "0").glob("*.log"))[-1]


def killed_after_publishing(tmp_path: Path) -> Path:
    """The data directory of a broker that stored ``MESSAGES`` acknowledged publishes and was
    killed with -9."""
    broker = start_broker(tmp_path, CONFIG)
    publish_one_by_one(broker.port)
    broker.stop(signal.SIGKILL)
    return broker.data_dir


def batch_positions(data: bytes) -> list[int]:
    """Where the batches start; they end at the zeros preallocated after them (magic 0)."""
    positions, position = [], 0
    while position < len(data) and data[position] != 0:
        positions.append(position)
        position += peek_batch_header(data, position).batch_length
    return positions


def written_end(data: bytes) -> int:
    last = batch_positions(data)[-1]
    return last + peek_batch_header(data, last).batch_length


def test_a_torn_tail_is_cut_at_start_up_and_the_file_kept(tmp_path: Path) -> None:
    segment = active_segment(killed_after_publishing(tmp_path))
    data = segment.read_bytes()
    good, preallocated = data[: written_end(data)], len(data) - written_end(data)
    assert preallocated > 100 and data[len(good):] == bytes(preallocated)
    torn_write = encode_batch([Record.new("plant/line1/temp", b"never acknowledged", 1)],
                              base_offset=MESSAGES)[:-9]  # a crash in the middle of a write
    crashed = good + torn_write + bytes(preallocated - len(torn_write))  # into the zeros
    segment.write_bytes(crashed)

    restarted = start_broker(tmp_path, CONFIG)
    restarted.stop()
    warning = re.search(r"WARNING .*cut (\d+) bytes of torn or corrupt tail at byte (\d+) .*"
                        r"the last (\d+) of them zeros.* the file as it was is kept in (\S+)",
                        restarted.log())
    assert warning, restarted.log()
    assert (int(warning[1]), int(warning[2])) == (preallocated, len(good))
    assert int(warning[1]) - int(warning[3]) == len(torn_write)
    kept = Path(warning[4])
    assert kept.parent.parent == segment.parent and kept.parent.name.startswith("repair-backup-")
    assert kept.read_bytes() == crashed
    assert segment.read_bytes() == good  # every acknowledged record is still there (closed)


def test_a_kill_leaves_zeros_that_a_restart_reads_as_the_end_of_the_log(tmp_path: Path) -> None:
    segment = active_segment(killed_after_publishing(tmp_path))
    data = segment.read_bytes()
    assert len(batch_positions(data)) == MESSAGES and data[written_end(data)] == 0

    restarted = start_broker(tmp_path, CONFIG)
    with RawClient(restarted.port) as client:  # the log goes on right after the last record
        client.connect("writer")
        client.send(Publish("plant/line1/temp", b"after the restart", 1, packet_id=1))
        assert client.recv_type(Puback).packet_id == 1
    restarted.stop()
    assert "torn" not in restarted.log() and "repair-backup" not in restarted.log()
    data = segment.read_bytes()
    assert len(batch_positions(data)) == MESSAGES + 1 and written_end(data) == len(data)


def test_damage_before_good_records_stops_the_broker_naming_log_repair(tmp_path: Path) -> None:
    data_dir = killed_after_publishing(tmp_path)
    segment = active_segment(data_dir)
    data = bytearray(segment.read_bytes())
    second = batch_positions(bytes(data))[1]
    data[second + 50] ^= 0x20  # bit rot in the second batch; ten good batches follow
    segment.write_bytes(bytes(data))

    refused = serve_until_exit(tmp_path, config=CONFIG)
    assert refused.returncode == 1, refused.stderr
    assert "cannot open the commit log" in refused.stderr
    assert f"corrupt record batch at byte {second}" in refused.stderr
    repair = quoted_command(refused.stderr, "meshmq log repair")
    assert repair[-2:] == ["--data-dir", str(data_dir.resolve())]
    assert quoted_command(refused.stderr, "meshmq log verify")[-1] == repair[-1]

    repaired = run_pasted(repair, cwd=tmp_path)  # run from elsewhere, as an operator might
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "offset 1 lost" in repaired.stdout
    assert repaired.stdout.splitlines()[-1].endswith("verify is now clean")
    start_broker(tmp_path, CONFIG).stop()  # starts again
