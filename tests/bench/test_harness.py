"""The benchmark harness (bench/): build the C load generator, run tiny scenarios against a real
meshmq process on an ephemeral port, and check that its counts validate, that a real loss is
caught, and that the figures and profile summaries are computed as documented."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from meshbench import appendcost, linkcost, placement, profiling, report, workers  # noqa: E402
from meshbench.brokers import host_io_stall, proc_stats, toml_text  # noqa: E402
from meshbench.build import build_loadgen  # noqa: E402
from meshbench.endpoints import MAGIC, PAYLOAD, SIZE, Publisher, Subscriber  # noqa: E402
from meshbench.placed import publish_packet  # noqa: E402
from meshbench.runner import Context, run_one  # noqa: E402
from meshbench.scenarios import LOG_OFF, LOG_ON, Scenario, Timing  # noqa: E402

TINY = Timing(warmup=0.2, duration=0.5, drain=1.0)


@pytest.fixture(scope="module")
def loadgen() -> Path:
    if shutil.which("gcc") is None:
        pytest.skip("no C compiler (gcc) to build bench/loadgen.c")
    return build_loadgen()


def context(loadgen: Path, protocol: int = 4) -> Context:
    # Not pinned: the test suite runs beside other tests, and pinning is the benchmark's job.
    return Context(loadgen=loadgen, timing=TINY, protocol=protocol, broker_cpus=None,
                   loadgen_cpus=None)


@pytest.mark.parametrize("protocol", [4, 5])
def test_fanin_qos1_every_message_arrives_once(loadgen: Path, protocol: int) -> None:
    scenario = Scenario("tiny_fanin_qos1", "tiny", "throughput", pubs=3, subs=1, qos=1,
                        meshmq=LOG_OFF)
    outcome = run_one(scenario, "meshmq", context(loadgen, protocol))
    assert outcome["ok"], outcome["problems"]
    lg = outcome["loadgen"]
    assert lg["published"] > 0
    assert lg["received"] == lg["valid"] == lg["expected"] == lg["published"]
    assert lg["acked"] == lg["published"]
    assert lg["missing"] == lg["duplicates"] == lg["unacked"] == 0
    figures = outcome["figures"]
    assert figures["rate"] > 0
    assert figures["per_cpu"] > 0
    assert 0 < figures["broker_cpu_pct"] <= 200
    assert figures["broker_wait_pct"] >= 0  # time runnable but without a CPU


def test_fanin_qos1_with_the_log_on(loadgen: Path) -> None:
    scenario = Scenario("tiny_log", "tiny", "throughput", pubs=2, subs=1, qos=1, meshmq=LOG_ON)
    outcome = run_one(scenario, "meshmq", context(loadgen, protocol=5))
    assert outcome["ok"], outcome["problems"]
    assert outcome["loadgen"]["valid"] == outcome["loadgen"]["published"] > 0


def test_fanout_qos0_counts_each_delivery(loadgen: Path) -> None:
    scenario = Scenario("tiny_fanout", "tiny", "throughput", topology="fanout", pubs=1, subs=20)
    outcome = run_one(scenario, "meshmq", context(loadgen))
    assert outcome["ok"], outcome["problems"]
    lg = outcome["loadgen"]
    assert lg["expected"] == 20 * lg["published"] > 0
    assert lg["valid"] + lg["missing"] == lg["expected"]


def test_a_message_the_broker_never_delivers_fails_validation(loadgen: Path,
                                                                tmp_path: Path) -> None:
    acl = tmp_path / "acl"
    acl.write_text("* deny bench/in/1\n* readwrite bench/#\n")  # publisher 1 goes nowhere
    scenario = Scenario("tiny_loss", "tiny", "throughput", pubs=3, subs=1, qos=1,
                        meshmq={**LOG_OFF, "auth.acl_file": str(acl)})
    outcome = run_one(scenario, "meshmq", context(loadgen))
    assert not outcome["ok"]
    lg = outcome["loadgen"]
    assert lg["missing"] > 0
    assert lg["valid"] + lg["missing"] == lg["expected"]
    assert any("missing" in p for p in outcome["problems"])


def test_latency_is_measured_at_the_paced_rate(loadgen: Path) -> None:
    scenario = Scenario("tiny_latency", "tiny", "latency", pubs=1, subs=1, qos=0, rate=2000)
    outcome = run_one(scenario, "meshmq", context(loadgen))
    assert outcome["ok"], outcome["problems"]
    lg = outcome["loadgen"]
    assert lg["latency_samples"] > 0
    assert 0 < lg["publish_rate"] < 1.2 * 2000  # paced, not flat out
    figures = outcome["figures"]
    assert 0 < figures["p50_us"] <= figures["p99_us"] <= figures["p999_us"] <= figures["max_us"]


def test_idle_connections_measure_broker_memory(loadgen: Path) -> None:
    scenario = Scenario("tiny_idle", "tiny", "idle", conns=200)
    outcome = run_one(scenario, "meshmq", context(loadgen))
    assert outcome["ok"], outcome["problems"]
    assert outcome["loadgen"]["alive"] == 200
    figures = outcome["figures"]
    assert figures["connect_rate"] > 0
    assert 0 < figures["rss_per_conn_kb"] < 1000


def test_a_stalled_subscriber_is_not_counted_against_the_others(loadgen: Path) -> None:
    scenario = Scenario("tiny_stalled", "tiny", "throughput", pubs=2, subs=1, stalled=1)
    outcome = run_one(scenario, "meshmq", context(loadgen))
    assert outcome["ok"], outcome["problems"]
    assert outcome["figures"]["rate"] > 0


def test_loadgen_refuses_bad_arguments_with_one_line(loadgen: Path) -> None:

    done = subprocess.run([str(loadgen), "--port", "1", "--qos", "2"], capture_output=True,
                          text=True, check=False)
    assert done.returncode == 2
    assert done.stdout.strip() == "error --qos: must be 0 or 1"


def test_table_ratios_medians_and_floors() -> None:
    def run(**figures: float) -> dict[str, object]:
        return {"ok": True, "problems": [], "figures": figures}

    results: report.Results = {
        "fanin_qos0": {"meshmq": [run(rate=30.0), run(rate=10.0), run(rate=20.0)],
                       "mosquitto": [run(rate=50.0)]},
        "fanin_qos1": {"mosquitto": [run(rate=8.0)]},
        "fanin_qos1_log": {"meshmq": [run(rate=2.0)]},
        "idle": {"meshmq": [run(rss_per_conn_kb=13.0)], "mosquitto": [run(rss_per_conn_kb=1.0)]},
    }
    rows = {(r["scenario"], r["figure"]): r
            for r in report.table_rows(results, {"fanin_qos1_log": "fanin_qos1"})}
    fanin = rows["fanin_qos0", "rate"]
    assert (fanin["meshmq"], fanin["mosquitto"], fanin["ratio"], fanin["met"]) == (20, 50, 0.4,
                                                                                  False)
    logged = rows["fanin_qos1_log", "rate"]  # compared with Mosquitto's fan-in QoS 1
    assert (logged["mosquitto"], logged["ratio"]) == (8.0, 0.25)
    assert rows["idle", "rss_per_conn_kb"]["met"] is False  # 13 KB > the 12 KB floor
    assert ("fanout_qos0", "rate") not in rows


def test_the_health_table_shows_the_machines_steal_and_io_stall(tmp_path: Path) -> None:
    pressure = tmp_path / "io"
    pressure.write_text("some avg10=18.24 avg60=13.61 avg300=9.82 total=303205646\n"
                        "full avg10=14.70 avg60=9.47 avg300=6.65 total=210256912\n")
    assert host_io_stall(str(pressure)) == 210.256912  # seconds, from microseconds
    assert host_io_stall(str(tmp_path / "no-such-file")) is None  # a kernel without PSI
    pressure.write_text("some avg10=0.00 avg60=0.00 avg300=0.00 total=12\n")  # no "full"
    assert host_io_stall(str(pressure)) is None
    figures = {"broker_cpu_pct": 55.0, "host_steal_pct": 0.5, "host_io_stall_pct": 14.3}
    table = report.render_health({"latency_qos1_log": {"meshmq": [
        {"ok": True, "problems": [], "figures": figures}]}})
    header, _, row = table.splitlines()[:3]
    assert header.split()[-6:] == ["steal", "%", "I/O", "stall", "%", "problems"]
    assert row.split()[-2:] == ["0.50", "14.3"]  # (no problems: the last cell is empty)


def test_profile_summary_ranks_threads_self_and_inclusive_time(tmp_path: Path) -> None:
    main = "thread (11): MainThread;main (/x/src/meshmq/cli.py:10)"
    read = "read (/x/src/meshmq/broker/protocol.py"
    raw = tmp_path / "raw.txt"
    raw.write_text(
        f"{main};{read}:5);decode (/x/src/meshmq/mqtt/codec.py:7) 5\n"
        f"{main};{read}:6) 2\n"
        f"{main};write (/x/src/meshmq/broker/protocol.py:9) 1\n"
        "thread (12): LogWriter;Thread._bootstrap (/usr/lib/python3.11/threading.py:1002);"
        "_run (/x/src/meshmq/log/writer.py:180) 2\n"
    )
    summary = profiling.summarise(raw)
    assert summary["samples"] == 10
    assert summary["threads"] == [["MainThread", 80.0], ["LogWriter", 20.0]]
    assert summary["self"] == [
        ["meshmq/mqtt/codec.py:decode", 50.0], ["meshmq/broker/protocol.py:read", 20.0],
        ["meshmq/log/writer.py:_run", 20.0], ["meshmq/broker/protocol.py:write", 10.0],
    ]
    assert summary["inclusive"][0] == ["meshmq/broker/protocol.py:read", 70.0]
    assert ["meshmq/log/writer.py:_run", 20.0] in summary["inclusive"]
    names = [name for name, _ in summary["inclusive"]]
    assert "meshmq/cli.py:main" not in names  # the start-up chains are left out
    assert "threading.py:Thread._bootstrap" not in names


def test_meshmq_settings_become_toml_tables() -> None:
    text = toml_text({"log.enabled": False, "log.fsync": "always", "limits.connect_rate": 0})
    assert text == '[log]\nenabled = false\nfsync = "always"\n\n[limits]\nconnect_rate = 0\n\n'


def test_proc_stats_reads_this_process() -> None:
    import os

    stats = proc_stats(os.getpid())
    assert stats.rss_kb > 1000
    assert stats.cpu_s > 0


def test_two_workers_are_measured_as_one_node(loadgen: Path) -> None:
    load = Scenario("tiny_workers", "tiny", "throughput", topology="pairs", pubs=6, subs=6,
                    qos=1, meshmq=LOG_OFF)
    outcome = workers.run_scaling(load, 2, context(loadgen), pin=False)
    assert outcome["ok"], outcome["problems"]
    lg = outcome["loadgen"]
    assert lg["valid"] == lg["expected"] == lg["published"] > 0
    figures = outcome["figures"]
    assert figures["rate"] > 0 and figures["broker_us_per_msg"] > 0
    assert figures["loadgen_us_per_msg"] > 0
    per_worker = figures["worker0_cpu_pct"] + figures["worker1_cpu_pct"]
    assert per_worker > 0
    assert abs(figures["broker_cpu_pct"] - per_worker) <= 5  # the supervisor does nothing
    place = outcome["placement"]
    assert place["complete"]
    assert sum(place["publishers_per_worker"]) == sum(place["subscribers_per_worker"]) == 6
    assert 0 <= place["crossing_pairs"] <= 6


def test_link_cost_client_lands_where_it_asks() -> None:
    case = next(c for c in linkcost.CASES if c.name == "forwarded")
    outcome = linkcost.run_case(case, warmup=0.2, duration=0.5, pairs=2)
    assert outcome["ok"], outcome["problems"]
    assert outcome["placement"] == {"publishers": [0, 0], "subscribers": [1, 1]}
    counts = outcome["counts"]
    assert counts["delivered"] == counts["published"] > counts["delivered_window"] > 0
    figures = outcome["figures"]
    assert figures["worker0_us_per_msg"] > 0 and figures["worker1_us_per_msg"] > 0
    assert figures["broker_us_per_msg"] == pytest.approx(
        figures["worker0_us_per_msg"] + figures["worker1_us_per_msg"])


def test_connack_worker_property_is_read() -> None:
    from meshbench.placed import connack_worker

    body = (b"\x00\x00\x1e!\x04\x00'\x00\x10\x00\x00\"\xff\xff&\x00\rmeshmq-worker"
            b"\x00\x011")
    assert connack_worker(body) == 1
    assert connack_worker(b"\x00\x00\x03\x21\x04\x00") is None  # a single broker: none
    with pytest.raises(ValueError):
        connack_worker(b"\x00\x87\x00")  # refused


def test_placement_and_link_cost_arithmetic() -> None:
    fanin = placement.summarise("fanin", 4, 1, [0, 0, 1, 1, 1], 2)
    assert fanin["publishers_per_worker"] == [2, 2]
    assert fanin["crossing_fraction"] == 0.5
    pairs = placement.summarise("pairs", 3, 3, [0, 1, 1, 0, 1, 0], 2)
    assert (pairs["crossing_pairs"], pairs["complete"]) == (1, True)  # pair 2: 1 -> 0
    rows = [{"case": "local", "broker_us_per_msg": 6.0},
            {"case": "forwarded", "broker_us_per_msg": 17.0, "worker0_us_per_msg": 7.0,
             "worker1_us_per_msg": 10.0}]
    cost = workers.link_cost(rows)
    assert (cost["total_us"], cost["sender_us"], cost["receiver_us"]) == (11.0, 7.0, 10.0)


def test_pairs_with_the_log_on_validate_on_two_workers(loadgen: Path) -> None:
    load = replace(workers.select_loads(["pairs_qos1_log"])[0], pubs=6, subs=6)
    assert load.meshmq["log.enabled"] and load.meshmq["log.fsync"] == "always"
    outcome = workers.run_scaling(load, 2, context(loadgen), pin=False)
    assert outcome["ok"], outcome["problems"]
    lg = outcome["loadgen"]
    assert lg["valid"] == lg["expected"] == lg["published"] == lg["acked"] > 0
    assert lg["missing"] == lg["duplicates"] == 0  # per pair, every sequence number in order
    assert outcome["log_bytes"] >= SIZE * lg["published"]  # every publish went through the log
    figures = outcome["figures"]
    assert figures["worker0_us_per_msg"] + figures["worker1_us_per_msg"] == pytest.approx(
        figures["broker_us_per_msg"], rel=0.25)  # the supervisor does next to nothing
    place = outcome["placement"]
    assert len(place["pair_workers"]) == 6
    leaders = [appendcost.leader_of_topic(f"bench/pair/{i}", 2) for i in range(6)]
    off_leader = sum(1 for (pub, _), lead in zip(place["pair_workers"], leaders, strict=True)
                     if pub != lead)
    assert place["appending_fraction"] == off_leader / 6


def test_append_cost_puts_the_publisher_off_the_leader() -> None:
    case = next(c for c in appendcost.CASES if c.name == "append")
    outcome = linkcost.run_case(case, warmup=0.2, duration=0.5, pairs=2)
    assert outcome["ok"], outcome["problems"]
    leaders = [appendcost.leader_of_topic(case.topic(i), 2) for i in range(2)]
    assert outcome["placement"] == {"publishers": [1 - lead for lead in leaders],
                                    "subscribers": leaders}
    counts = outcome["counts"]
    assert counts["delivered"] == counts["published"] > counts["delivered_window"] > 0
    assert counts["acked"] == counts["qos1_sent"] >= counts["published"]  # probes too
    assert outcome["log_bytes"] >= SIZE * counts["published"]
    figures = outcome["figures"]
    assert figures["worker0_us_per_msg"] > 0 and figures["worker1_us_per_msg"] > 0


def test_floor_is_checked_on_the_two_worker_msg_rate_ratio() -> None:
    def runs(rate: float) -> list[dict[str, object]]:
        return [{"ok": True, "problems": [], "figures": {"rate": rate}}]

    rows = {r["load"]: r for r in workers.scaling_rows({
        "pairs_qos1": {1: runs(100.0), 2: runs(120.0)},
        "pairs_qos1_log": {1: runs(100.0), 2: runs(170.0)},
        "pairs_qos1_log_interval": {1: runs(100.0), 2: runs(150.0)},
    })}
    assert (rows["pairs_qos1"]["floor"], rows["pairs_qos1"]["floor_met"]) == (None, None)
    assert (rows["pairs_qos1_log"]["floor"], rows["pairs_qos1_log"]["floor_met"]) == (1.6, True)
    assert rows["pairs_qos1_log_interval"]["floor_met"] is False
    table = workers.render_scaling(list(rows.values())).splitlines()
    assert table[3].split()[-3:] == ["1.6x", "yes", "ok"]
    assert table[4].split()[-3:] == ["1.6x", "NO", "ok"]
    costs = appendcost.append_cost([{"case": "leader", "broker_us_per_msg": 18.0},
                                    {"case": "append", "broker_us_per_msg": 30.5}])
    assert (costs["append_us"], costs["append_back_us"]) == (12.5, None)


def test_placed_publisher_checks_every_puback() -> None:
    here, there = socket.socketpair()
    with here, there:
        pub = Publisher(0, here, None, "t", qos=1)
        pub.refill(3)  # packet ids 1, 2, 3
        assert pub.in_flight() == 3
        acks = (b"\x40\x02\x00\x01"  # success, short form
                b"\x40\x03\x00\x02\x87"  # 0x87 not authorized
                b"\x40\x02\x00\x09"  # an id never sent
                b"\xe0\x00")  # DISCONNECT
        for i in range(len(acks)):  # a byte at a time: frames split anywhere
            pub.feed(acks[i:i + 1])
        assert (pub.acked, pub.refused, pub.unexpected, pub.other) == (2, 1, 1, 1)
        assert pub.in_flight() == 1
        assert len(pub.problems()) == 4


def test_placed_subscriber_acknowledges_qos1_deliveries() -> None:
    here, there = socket.socketpair()
    with here, there:
        sub = Subscriber(3, here, None)
        frames = b"".join(
            publish_packet("t/3", PAYLOAD.pack(3, MAGIC, seq) + bytes(SIZE - PAYLOAD.size),
                           qos=1, packet_id=0x0100 + seq) for seq in range(2))
        for i in range(len(frames)):
            sub.feed(frames[i:i + 1])
        assert (sub.received, sub.next_seq, sub.gaps, sub.dups, sub.foreign) == (2, 2, 0, 0, 0)
        assert bytes(sub.acks) == b"\x40\x02\x01\x00\x40\x02\x01\x01"
        sub.flush_acks()
        assert there.recv(100) == b"\x40\x02\x01\x00\x40\x02\x01\x01"
        assert not sub.acks


@pytest.mark.parametrize("protocol", [4, 5])
def test_connect_cost_python_mode_connects_every_client_without_sockets(protocol: int) -> None:
    """``connect_cost.py --python`` drives the tcp listener's protocol with a stand-in
    transport: each of its clients must get a CONNACK (the script checks) and be connected."""

    done = subprocess.run(
        [sys.executable, str(BENCH / "connect_cost.py"), "--python", "--conns", "300",
         "--protocol", str(protocol)], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    version = "5.0" if protocol == 5 else "3.1.1"
    assert f"meshmq's Python per connection (MQTT {version}, no sockets):" in done.stdout
    assert "(best of 5 x 300)" in done.stdout


@pytest.mark.parametrize("log", ["on", "off"])
def test_publish_cost_delivers_and_acknowledges_every_message_in_order(log: str) -> None:
    """``publish_cost.py`` drives publishers and a subscriber through the tcp listener's
    protocol with stand-in transports; it fails unless every message was acknowledged to its
    publisher and delivered once, in order, to the subscriber."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "publish_cost.py"), "--messages", "2000", "--repeat", "1",
         "--log", log], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"log {log}, 10 publishers x 8 a turn, 2,000 messages:" in done.stdout
    assert "us of CPU per message (best of 1)" in done.stdout


def test_publish_cost_fails_when_a_delivery_is_lost() -> None:
    done = subprocess.run(
        [sys.executable, str(BENCH / "publish_cost.py"), "--messages", "2000", "--repeat", "1",
         "--seed-loss"], capture_output=True, text=True, check=False, timeout=120)
    assert done.returncode != 0
    assert "due" in done.stderr  # publisher N: got S, S-1 due


def test_run_refuses_a_repeat_below_one() -> None:
    done = subprocess.run([sys.executable, str(BENCH / "run.py"), "--repeat", "0", "--list"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--repeat must be at least 1" in done.stderr
