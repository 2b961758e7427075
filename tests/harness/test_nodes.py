"""The harness's nodes: several ``meshmq serve`` on their own ports and data directories, each
paused and continued, killed and restarted on its data directory and port; a worker paused.
"""

from __future__ import annotations

from pathlib import Path

from checker import read_log
from nodes import process_state as state
from nodes import start_nodes

from meshmq.mqtt.packets import Connack, Connect, Puback
from rawclient import RawClient


def acknowledged(client: RawClient, payload: bytes) -> bool:
    ack = client.publish("nodes/a", payload, qos=1)
    return isinstance(ack, Puback) and ack.reason_code < 0x80


def test_nodes_pause_continue_kill_and_restart(tmp_path: Path) -> None:
    with start_nodes(tmp_path, 2, workers=2) as nodes:
        n1, n2 = nodes
        assert n1.port != n2.port and n1.data_dir != n2.data_dir
        assert len(set(n1.pids())) == 3  # the supervisor and two workers

        n1.pause()  # every process stopped: a CONNECT gets no answer, no close either
        assert {state(pid) for pid in n1.pids()} == {"T"}
        waiting = RawClient(n1.port)  # the kernel still accepts into the backlog
        waiting.send(Connect("waiting", 5))
        with RawClient(n2.port) as other:  # the other node is not affected
            assert other.connect("other").reason_code == 0
        waiting.recv_nothing(0.3)
        n1.resume()
        assert waiting.recv_type(Connack).reason_code == 0
        waiting.close()

        paused = n1.pause_worker(1)
        assert state(paused) == "T" and state(n1.worker_pids()[0]) != "T"
        n1.resume_worker(1)
        assert state(paused) != "T"

        with RawClient(n2.port) as client:
            client.connect("before")
            assert acknowledged(client, b"before:1")
        port = n2.port
        n2.kill()
        assert not n2.running()
        n2.restart()  # same data directory, same port
        assert n2.port == port and n2.runs == 2 and n2.log_path.name == "run-2.log"
        with RawClient(n2.port) as client:
            client.connect("after")
            assert acknowledged(client, b"after:1")
        assert [(r.publisher, r.seq) for r in read_log(n2.data_dir)] == [
            ("before", 1), ("after", 1)]
