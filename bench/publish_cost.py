"""The broker's own CPU per QoS 1 message, publish to acknowledged delivery, in-process.

Usage::

    .venv/bin/python bench/publish_cost.py [--messages N] [--publishers P] [--turn K]
        [--log on|off|interval] [--repeat R]
    valgrind --tool=cachegrind --cache-sim=no .venv/bin/python bench/publish_cost.py ...

A single-process broker (``BrokerServer``, uvloop, the default configuration apart from the
log settings) in this process, with ``P`` publishers and one subscriber to ``bench/#`` at
QoS 1, all on the tcp listener's protocol with stand-in transports (no sockets): each loop
turn hands every publisher ``K`` PUBLISH packets in one read, as a socket read would, and
hands the subscriber the PUBACKs of everything delivered to it so far. It runs until ``N``
messages were delivered and acknowledged both ways, checks that every one was (in order per
publisher, no duplicates), and prints the process's CPU time per message (best of ``R``), counted
while the broker works only (the driver's building and checking of packets is left out).

What it measures: meshmq's Python (or compiled) code per message, with the log's real file
writes (and fsyncs under ``on``) but none of the sockets' system calls, so the log-on/log-off
ratio it prints is that of the code we can change. Under valgrind the instruction count is
the same from run to run, which a shared machine's CPU times are not: run it with two
message counts and divide the difference by the difference of the counts (the start-up
cancels), once per tree, to compare two trees to within a fraction of a percent.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import tempfile
import time

import uvloop
from meshbench.standin import StandInTransport

from meshmq.config import load_config
from meshmq.node.server import BrokerServer

TOPIC = "bench/in/{}"


def frames(data: bytes) -> list[tuple[int, bytes]]:
    """(first byte, body) of each MQTT packet in ``data`` (whole packets only)."""
    out, pos = [], 0
    while pos < len(data):
        first, length, shift, pos = data[pos], 0, 0, pos + 1
        while True:
            byte = data[pos]
            pos += 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        out.append((first, data[pos:pos + length]))
        pos += length
    return out


def packet(first: int, body: bytes) -> bytes:
    length, header = len(body), bytearray((first,))
    while True:
        byte, length = length & 0x7F, length >> 7
        header.append(byte | (0x80 if length else 0))
        if not length:
            return bytes(header) + body


def connect(client_id: str) -> bytes:
    name = client_id.encode()
    return packet(0x10, b"\x00\x04MQTT\x04\x02\x02\x58" + len(name).to_bytes(2, "big") + name)


def publish(topic: bytes, packet_id: int, payload: bytes) -> bytes:
    return packet(0x32, len(topic).to_bytes(2, "big") + topic + packet_id.to_bytes(2, "big")
                  + payload)


class Client:
    def __init__(self, factory: object, number: int, client_id: str) -> None:
        self.transport = StandInTransport(number, keep=True)
        protocol = factory()  # type: ignore[operator]
        protocol.connection_made(self.transport)
        self.protocol = protocol
        self.feed(connect(client_id))
        assert frames(self.transport.take())[0][0] == 0x20, "no CONNACK"

    def feed(self, data: bytes) -> None:
        (self.transport.protocol or self.protocol).data_received(data)  # type: ignore[union-attr]


async def one_run(args: argparse.Namespace) -> float:
    data_dir = tempfile.mkdtemp(prefix="meshmq-publish-cost-")
    log = {"off": {"log.enabled": False},
           "on": {"log.enabled": True, "log.fsync": "always"},
           "interval": {"log.enabled": True, "log.fsync": "interval"}}[args.log]
    server = BrokerServer(load_config(overrides={
        "server.bind": "127.0.0.1", "server.port": 0, "server.data_dir": data_dir,
        "server.log_level": "warning", "limits.connect_rate": 0,
        "session.max_inflight_messages": 65535, "session.max_queued_messages": 10_000_000,
        **log}))
    await server.start()
    from meshmq.broker.transport import listeners
    assert server.listeners is not None
    factory = listeners.TcpClientProtocol.for_listener(server.listeners.listeners[0])
    subscriber = Client(factory, 0, "cost-sub")
    subscriber.feed(packet(0x82, b"\x00\x01" + b"\x00\x07bench/#" + b"\x01"))
    await asyncio.sleep(0)
    assert frames(subscriber.transport.take())[0][0] == 0x90, "no SUBACK"
    publishers = [Client(factory, n + 1, f"cost-pub{n}") for n in range(args.publishers)]
    topics = [TOPIC.format(n).encode() for n in range(args.publishers)]
    payload = bytes(64)
    received = [0] * args.publishers  # the next sequence number expected from each publisher
    each = args.messages // args.publishers
    acked, delivered, total = 0, 0, each * args.publishers
    seeded_loss = total // 2 if args.seed_loss else -1
    bursts = [[b"".join(publish(topics[n], (first + i) % 65535 + 1,
                                (first + i).to_bytes(8, "big") + payload)
                        for i in range(min(args.turn, each - first)))
               for first in range(0, each, args.turn)] for n in range(args.publishers)]
    gc.collect()
    cpu = 0.0  # the broker's work only: the driver's own between the marks is left out
    turn = 0
    while delivered < total or acked < total:
        started = time.process_time()
        for n, client in enumerate(publishers):
            if turn < len(bursts[n]):
                client.feed(bursts[n][turn])
        turn += 1
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        cpu += time.process_time() - started
        for client in publishers:
            acked += sum(1 for first, _ in frames(client.transport.take()) if first == 0x40)
        acks = []
        for first, body in frames(subscriber.transport.take()):
            assert first & 0xF0 == 0x30, f"unexpected packet {first:#x}"
            topic_len = int.from_bytes(body[:2], "big")
            acks.append(packet(0x40, body[2 + topic_len:4 + topic_len]))
            if delivered == seeded_loss:  # (--seed-loss: the check must catch a lost one)
                seeded_loss = -1
                continue
            n = topics.index(body[2:2 + topic_len])
            sequence = int.from_bytes(body[4 + topic_len:12 + topic_len], "big")
            assert sequence == received[n], f"publisher {n}: got {sequence}, {received[n]} due"
            received[n] += 1
            delivered += 1
        if acks:
            started = time.process_time()
            subscriber.feed(b"".join(acks))
            cpu += time.process_time() - started
    assert sum(received) == total and acked == total
    for protocol in list(server.broker.clients if server.broker is not None else ()):
        protocol.closing = True  # (no sockets to close)
    await server.stop()
    return cpu / total


async def main_async(args: argparse.Namespace) -> None:
    best = min([await one_run(args) for _ in range(args.repeat)])
    print(f"log {args.log}, {args.publishers} publishers x {args.turn} a turn, "
          f"{args.messages:,} messages: {best * 1e6:.2f} us of CPU per message "
          f"(best of {args.repeat})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--publishers", type=int, default=10)
    parser.add_argument("--turn", type=int, default=8, help="PUBLISHes per publisher a turn")
    parser.add_argument("--log", choices=("on", "off", "interval"), default="on")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed-loss", action="store_true",
                        help="lose one delivery on purpose: the run must fail")
    args = parser.parse_args()
    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
