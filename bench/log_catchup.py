"""A persistent subscriber catching up on N messages (default 1M) from the commit log.

    .venv/bin/python bench/log_catchup.py [--messages 1000000] [--payload 64] [--fsync interval]

1. Starts ``meshmq serve`` (pinned to CPU 0 when ``taskset`` exists) on an ephemeral port with a
   temporary data dir.
2. A 3.1.1 client with a persistent session (clean session = 0) subscribes to ``bench/#`` at
   QoS 1 and disconnects.
3. A publisher pipelines N QoS 1 publishes (window 1,000) and counts the PUBACKs: the messages
   are in the log, and the offline session holds only a cursor, not copies (broker RSS is
   sampled to show it).
4. The subscriber reconnects and reads all N messages, acknowledging each; the rate is the
   catch-up speed, checked for completeness and per-publisher order.

The clients are small raw-socket loops (pinned to CPU 1) with pre-encoded packets, so they cost
little next to the broker; their CPU time is printed beside the broker's.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TOPIC = b"bench/catchup"


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def frame(first: int, body: bytes) -> bytes:
    return bytes([first]) + varint(len(body)) + body


def utf8(text: bytes) -> bytes:
    return struct.pack("!H", len(text)) + text


def connect_packet(client_id: bytes, clean: bool) -> bytes:
    flags = 0x02 if clean else 0x00
    return frame(0x10, utf8(b"MQTT") + bytes([4, flags]) + struct.pack("!H", 600) + utf8(client_id))


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Conn:
    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()

    def frames(self):
        """Yield (packet type, body) for every complete frame received by one recv()."""
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf = self.buf
        buf += chunk
        pos = 0
        end = len(buf)
        while end - pos >= 2:
            length = 0
            shift = 0
            i = pos + 1
            while True:
                if i >= end:
                    break
                byte = buf[i]
                length |= (byte & 0x7F) << shift
                shift += 7
                i += 1
                if not byte & 0x80:
                    break
            else:
                break
            if byte & 0x80 or i + length > end:
                break
            yield buf[pos], bytes(buf[i:i + length])
            pos = i + length
        del buf[:pos]

    def expect(self, packet_type: int) -> bytes:
        while True:
            for first, body in self.frames():
                if first >> 4 == packet_type:
                    return body


def subscribe_then_leave(port: int) -> None:
    conn = Conn(port)
    conn.sock.sendall(connect_packet(b"catchup-sub", clean=True))
    conn.expect(2)
    conn.sock.close()
    conn = Conn(port)
    conn.sock.sendall(connect_packet(b"catchup-sub", clean=False))
    conn.expect(2)
    conn.sock.sendall(frame(0x82, struct.pack("!H", 1) + utf8(b"bench/#") + b"\x01"))
    conn.expect(9)
    conn.sock.sendall(b"\xe0\x00")
    conn.sock.close()


def publish_all(port: int, count: int, payload_size: int) -> float:
    conn = Conn(port)
    conn.sock.sendall(connect_packet(b"catchup-pub", clean=True))
    conn.expect(2)
    window = 1000
    pad = b"x" * max(0, payload_size - 12)
    started = time.perf_counter()
    sent = acked = 0
    while acked < count:
        batch = []
        while sent < count and sent - acked < window:
            packet_id = sent % 65535 + 1
            body = utf8(TOPIC) + struct.pack("!H", packet_id) + b"%012d" % sent + pad
            batch.append(frame(0x32, body))
            sent += 1
        if batch:
            conn.sock.sendall(b"".join(batch))
        for first, _ in conn.frames():
            if first >> 4 == 4:
                acked += 1
    elapsed = time.perf_counter() - started
    conn.sock.sendall(b"\xe0\x00")
    conn.sock.close()
    return elapsed


def catch_up(port: int, count: int) -> tuple[float, int, int]:
    conn = Conn(port)
    started = time.perf_counter()
    conn.sock.sendall(connect_packet(b"catchup-sub", clean=False))
    received = 0
    expected = 0
    out_of_order = 0
    while received < count:
        acks = []
        for first, body in conn.frames():
            if first >> 4 != 3:
                continue
            topic_length = (body[0] << 8) | body[1]
            start = 2 + topic_length
            acks.append(b"\x40\x02" + body[start:start + 2])
            sequence = int(body[start + 2:start + 14])
            if sequence != expected:
                out_of_order += 1
            expected = sequence + 1
            received += 1
        if acks:
            conn.sock.sendall(b"".join(acks))
    elapsed = time.perf_counter() - started
    conn.sock.sendall(b"\xe0\x00")
    conn.sock.close()
    return elapsed, received, out_of_order


def pin(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() > 1 else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--payload", type=int, default=64, help="payload bytes (>= 12)")
    parser.add_argument("--fsync", default="interval", choices=["always", "interval", "never"])
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity") and os.cpu_count() and os.cpu_count() > 1:
        os.sched_setaffinity(0, {1})
    with tempfile.TemporaryDirectory(prefix="meshmq-catchup-") as tmp:
        config = Path(tmp) / "meshmq.toml"
        config.write_text(f'[log]\nfsync = "{args.fsync}"\n')
        port_file = Path(tmp) / "port"
        broker = subprocess.Popen(
            [*pin(0), sys.executable, "-m", "meshmq", "serve", "--config", str(config),
             "--bind", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
             "--data-dir", str(Path(tmp) / "data"), "--log-level", "warning"],
        )
        try:
            deadline = time.monotonic() + 30
            while not port_file.exists():
                if broker.poll() is not None or time.monotonic() > deadline:
                    print("broker did not start", file=sys.stderr)
                    return 1
                time.sleep(0.05)
            port = int(port_file.read_text().split()[0])
            subscribe_then_leave(port)
            rss_before = rss_kb(broker.pid)
            fill = publish_all(port, args.messages, args.payload)
            rss_offline = rss_kb(broker.pid)
            cpu_before = cpu_seconds(broker.pid)
            own_before = resource.getrusage(resource.RUSAGE_SELF)
            seconds, received, disorder = catch_up(port, args.messages)
            own_after = resource.getrusage(resource.RUSAGE_SELF)
            broker_cpu = cpu_seconds(broker.pid) - cpu_before
            client_cpu = (own_after.ru_utime + own_after.ru_stime
                          - own_before.ru_utime - own_before.ru_stime)
            log_bytes = sum(f.stat().st_size for f in (Path(tmp) / "data" / "log").rglob("*.log"))
        finally:
            broker.terminate()
            broker.wait(30)
    n = args.messages
    print(f"messages                 {n:,} x {args.payload} B payload, QoS 1, "
          f"log fsync={args.fsync}")
    print(f"fill (publish, durable)  {fill:8.2f} s  {n / fill:10,.0f} msg/s")
    print(f"catch-up (offline sub)   {seconds:8.2f} s  {n / seconds:10,.0f} msg/s  "
          f"{log_bytes / seconds / 1e6:6.1f} MB/s of log")
    print(f"received / out of order  {received:,} / {disorder}")
    print(f"broker CPU during catch-up {broker_cpu:.1f} s, client CPU {client_cpu:.1f} s")
    print(f"broker RSS: idle {rss_before / 1024:.0f} MiB, with {n:,} messages waiting for the "
          f"offline session {rss_offline / 1024:.0f} MiB (a cursor, not copies)")
    return 0 if received == n and not disorder else 1


if __name__ == "__main__":
    sys.exit(main())
