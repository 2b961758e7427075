"""How fast an offline session catches up on a partition another node leads, beside one its
own node leads (docs/benchmarks.md, "A cluster of three nodes on one machine").

Two nodes with the metadata on (cluster/remotelog.py): a persistent QoS 0 subscriber on n1
goes offline, ``--messages`` 64-byte messages are published to one topic, and the subscriber
comes back; the figure is the time from its CONNECT to the last message, and the records per
second. The topic's partition is led by n1 (``local``: read from its own log) or by n2
(``remote``: read from n2 over the link, ``LOG_READ``). Run:

    .venv/bin/python bench/remote_catchup.py [--messages 20000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

sys.path.insert(0, str(Path(__file__).parent))
from meshbench.cluster import start_cluster

from meshmq.log.partitioner import Partitioner

PARTITIONS = 8
WINDOW = 200  # QoS 1 publishes in flight
QOS = 0  # the subscription's: the replayed records go out at QoS 0, so the client (paho, in
# Python) is not what limits the rate (at QoS 1 it acknowledges each: about 3,000 a second)


def topics_for_partitions(partitions: int) -> dict[int, str]:
    partitioner, found, index = Partitioner(partitions, None), {}, 0
    while len(found) < partitions:
        found.setdefault(partitioner.partition_for(f"bench/{index}"), f"bench/{index}")
        index += 1
    return found


def client(client_id: str, port: int, clean: bool) -> tuple[mqtt.Client, queue.Queue]:
    got: queue.Queue = queue.Queue()
    paho = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                       protocol=mqtt.MQTTv5)
    paho.max_inflight_messages_set(WINDOW)
    paho.on_message = lambda c, u, message: got.put(message.payload)
    connected: queue.Queue = queue.Queue()
    paho.on_connect = lambda c, u, flags, reason, props: connected.put(reason)
    properties = Properties(PacketTypes.CONNECT)
    properties.SessionExpiryInterval = 600
    paho.connect("127.0.0.1", port, clean_start=clean, properties=properties)
    paho.loop_start()
    connected.get(timeout=30)
    return paho, got


def publish(port: int, topic: str, count: int) -> None:
    paho, _ = client("bench-pub", port, True)
    infos = [paho.publish(topic, b"x" * 64, qos=1) for _ in range(count)]
    for info in infos:
        info.wait_for_publish(timeout=60)
    paho.disconnect()
    paho.loop_stop()


def one_round(ports: dict[str, int], topic: str, messages: int, name: str) -> float:
    subscriber, got = client(name, ports["n1"], False)
    subscribed: queue.Queue = queue.Queue()
    subscriber.on_subscribe = lambda c, u, mid, codes, props: subscribed.put(codes)
    subscriber.subscribe(topic, qos=QOS)
    subscribed.get(timeout=30)
    subscriber.disconnect()
    subscriber.loop_stop()
    publish(ports["n2"], topic, messages)
    started = time.monotonic()
    back, got = client(name, ports["n1"], False)
    for _ in range(messages):
        got.get(timeout=120)
    elapsed = time.monotonic() - started
    back.disconnect()
    back.loop_stop()
    return elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="remote-catchup-") as workdir:
        cluster = start_cluster(Path(workdir), 2, {"server.workers": 1,
                                                   "log.fsync": "interval"}, None,
                                metadata=True)
        try:
            state = cluster.nodes[0].admin()["metadata"]["partitions"]
            leaders = {int(p): a["leader"] for p, a in state.items()}
            topics = topics_for_partitions(PARTITIONS)
            cases = {"local": next(topics[p] for p, n in leaders.items() if n == "n1"),
                     "remote": next(topics[p] for p, n in leaders.items() if n == "n2")}
            ports = {node.name: node.port for node in cluster.nodes}
            times: dict[str, list[float]] = {case: [] for case in cases}
            for round_ in range(args.repeat):
                for case, topic in cases.items():  # alternating: the machine's drift shared
                    times[case].append(one_round(ports, topic, args.messages,
                                                 f"reader-{case}-{round_}"))
            for case, found in times.items():
                best = statistics.median(found)
                print(f"{case:7s} {args.messages} records in {best:.2f} s (median of "
                      f"{len(found)}): {args.messages / best:,.0f} records/s; "
                      f"runs {', '.join(f'{t:.2f}' for t in found)}")
            ratio = statistics.median(times["remote"]) / statistics.median(times["local"])
            print(f"remote / local time: {ratio:.2f}x")
        finally:
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
