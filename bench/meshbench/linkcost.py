"""The mesh link's cost per message: the same publish → subscribe traffic delivered on one
worker (local) and across the link between two workers (forwarded).

The C load generator cannot choose its worker (the kernel spreads connections by a hash of the
addresses), so this scenario has its own client, in Python, that can: it connects with MQTT 5.0,
reads the ``meshmq-worker`` user property of the CONNACK, and disconnects and connects again
until the connection lands on the worker it wants. It only needs to be accurate, not fast: the
figure is the broker's CPU time per delivered message, read from /proc per worker process at the
edges of the measured window, and the client's own speed only sets the rate (reported).

Traffic: ``pairs`` publishers, each with one subscriber of its own topic ``bench/link/<i>``,
QoS 0, 64-byte payloads carrying (publisher index, magic, sequence) like the C load generator's.
Each publisher stays at most ``lead`` messages ahead of its subscriber (about 10,000 messages
in flight in all, like the suite). Before the traffic starts, each publisher sends probe
messages until its subscriber hears one, so the subscription is known on the publisher's
worker (routes cross the link asynchronously) and no message is lost to that race. After the
window, publishing stops and the subscribers drain; a message missing, duplicated or foreign
fails the run.

Cases (``CASES``): ``single``: one worker (``server.workers = 1``, no mesh); ``local``: two
workers, publishers and subscribers all on worker 0; ``forwarded``: two workers, publishers on
worker 0 and subscribers on worker 1, so every message crosses the link once (encoded, written,
read, decoded, delivered); ``spread``: two workers, pair i entirely on worker i % 2, so the load
is shared and nothing crosses (the best case for workers). forwarded - local, in broker CPU µs
per message, is the link's cost.
"""

from __future__ import annotations

import selectors
import shutil
import socket
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from meshbench import BenchError
from meshbench.brokers import LOSSLESS_MESHMQ, ProcStats, RunningBroker, host_cpu, start_meshmq
from meshbench.placed import (
    connect_placed,
    publish_packet,
    read_varint,
    recv_packet,
    subscribe_packet,
)
from meshbench.scenarios import IN_FLIGHT

MAGIC = 0x4D514C47  # "MQLG", as bench/loadgen.c
PROBE = 0x50524F42  # "PROB": a probe message, not counted
PAYLOAD = struct.Struct("<IIQ")  # publisher index, magic, sequence (native order, as loadgen)
SIZE = 64
CHUNK = 256  # messages encoded per send
DRAIN_QUIET = 2.0  # seconds without a delivery after which the drain stops


@dataclass(frozen=True)
class LinkCase:
    name: str
    workers: int
    publishers_on: int | None  # worker index (None: wherever they land)
    subscribers_on: int | None
    title: str
    spread: bool = False  # pair i on worker i % workers instead (both ends on one worker)

    def worker_of(self, role: str, pair: int) -> int | None:
        """Where pair ``pair``'s publisher (role "p") or subscriber ("s") must land."""
        if self.spread:
            return pair % self.workers
        return self.publishers_on if role == "p" else self.subscribers_on


CASES = (
    LinkCase("single", 1, None, None, "1 worker (no mesh)"),
    LinkCase("local", 2, 0, 0, "2 workers, publisher and subscriber on worker 0"),
    LinkCase("forwarded", 2, 0, 1, "2 workers, publisher on worker 0, subscriber on worker 1"),
    LinkCase("spread", 2, None, None, "2 workers, pair i on worker i % 2 (all local)", True),
)


# ---------------------------------------------------------------------------- the traffic


class Subscriber:
    __slots__ = ("buf", "dups", "foreign", "gaps", "index", "next_seq", "probed", "received",
                 "sock", "worker")

    def __init__(self, index: int, sock: socket.socket, worker: int | None) -> None:
        self.index = index
        self.sock = sock
        self.worker = worker
        self.buf = b""
        self.next_seq = 0
        self.received = 0  # valid messages
        self.dups = self.gaps = self.foreign = 0
        self.probed = False

    def feed(self, data: bytes) -> None:
        """Parse every complete PUBLISH and check its sequence."""
        buf = self.buf + data if self.buf else data
        size = len(buf)
        pos = 0
        unpack = PAYLOAD.unpack_from
        index = self.index
        while size - pos >= 2:
            length, mult, at = 0, 1, pos + 1
            while at < size:
                byte = buf[at]
                at += 1
                length += (byte & 0x7F) * mult
                mult *= 128
                if byte < 0x80:
                    break
            else:
                break
            end = at + length
            if end > size:
                break
            first = buf[pos]
            pos = end
            if first >> 4 != 3:
                continue  # SUBACK and the like
            at += 2 + (buf[at] << 8 | buf[at + 1])
            if first & 0x06:
                at += 2  # packet id (we subscribe at QoS 0, so never)
            plen = buf[at]  # the property length: one byte unless 128 or more
            if plen < 0x80:
                at += 1 + plen
            else:
                plen, at = read_varint(buf, at)
                at += plen
            if end - at < PAYLOAD.size:
                self.foreign += 1
                continue
            pub, magic, seq = unpack(buf, at)
            if magic == PROBE and pub == index:
                self.probed = True
            elif magic != MAGIC or pub != index:
                self.foreign += 1
            elif seq == self.next_seq:
                self.next_seq = seq + 1
                self.received += 1
            elif seq < self.next_seq:
                self.dups += 1
            else:
                self.gaps += seq - self.next_seq
                self.next_seq = seq + 1
                self.received += 1
        self.buf = buf[pos:]


class Publisher:
    __slots__ = ("frame", "generated", "index", "out", "seq_at", "sock", "worker")

    def __init__(self, index: int, sock: socket.socket, worker: int | None, topic: str) -> None:
        self.index = index
        self.sock = sock
        self.worker = worker
        payload = PAYLOAD.pack(index, MAGIC, 0) + bytes(SIZE - PAYLOAD.size)
        self.frame = publish_packet(topic, payload)
        self.seq_at = len(self.frame) - SIZE + 8
        self.generated = 0
        self.out = memoryview(b"")

    def probe(self) -> None:
        payload = PAYLOAD.pack(self.index, PROBE, 0) + bytes(SIZE - PAYLOAD.size)
        self.sock.setblocking(True)
        self.sock.sendall(self.frame[:len(self.frame) - SIZE] + payload)
        self.sock.setblocking(False)

    def refill(self, count: int) -> None:
        frame, step, seq_at = self.frame, len(self.frame), self.seq_at
        chunk = bytearray(frame * count)
        pack = struct.Struct("<Q").pack_into
        seq = self.generated
        for offset in range(seq_at, seq_at + step * count, step):
            pack(chunk, offset, seq)
            seq += 1
        self.generated = seq
        self.out = memoryview(chunk)

    def flush(self) -> bool:
        """Write what is pending; True when all of it went."""
        while self.out:
            try:
                sent = self.sock.send(self.out)
            except BlockingIOError:
                return False
            self.out = self.out[sent:]
        return True


@dataclass
class Sample:
    t: float
    delivered: int
    generated: int
    client_cpu: float
    broker: dict[int, ProcStats]
    host: tuple[float, float]


def _broker_sample(broker: RunningBroker) -> dict[int, ProcStats]:
    if broker.workers:
        return broker.worker_stats()
    return {0: broker.stats()}


def run_case(case: LinkCase, *, warmup: float, duration: float, pairs: int = 4,
             cpus: str | None = None) -> dict[str, object]:
    """Start meshmq for ``case``, place the clients, measure a window; return the outcome."""
    workdir = Path(tempfile.mkdtemp(prefix="meshbench-link-"))
    settings: dict[str, object] = {"server.workers": case.workers, "log.enabled": False,
                                   **LOSSLESS_MESHMQ}
    try:
        broker = start_meshmq(workdir, settings, cpus)
        try:
            return _traffic(case, broker, warmup, duration, pairs)
        finally:
            broker.stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _traffic(case: LinkCase, broker: RunningBroker, warmup: float, duration: float,
             pairs: int) -> dict[str, object]:
    problems: list[str] = []
    lead = max(1, IN_FLIGHT // pairs)
    subs: list[Subscriber] = []
    pubs: list[Publisher] = []
    attempts = 0
    for i in range(pairs):  # subscribers first: their routes reach the other worker meanwhile
        sock, worker, tries, pending = connect_placed(broker.port, f"s{i}", case.worker_of("s", i))
        attempts += tries
        sock.sendall(subscribe_packet(f"bench/link/{i}"))
        first, body = recv_packet(sock, pending)
        if first >> 4 != 9 or body[-1] >= 0x80:
            raise BenchError(f"SUBACK refused or missing: {first:#x} {body.hex()}")
        sub = Subscriber(i, sock, worker)
        if pending:
            sub.feed(bytes(pending))
        subs.append(sub)
    for i in range(pairs):
        sock, worker, tries, _ = connect_placed(broker.port, f"p{i}", case.worker_of("p", i))
        attempts += tries
        pubs.append(Publisher(i, sock, worker, f"bench/link/{i}"))
    selector = selectors.DefaultSelector()
    for sub in subs:
        sub.sock.setblocking(False)
        selector.register(sub.sock, selectors.EVENT_READ, sub)
    for pub in pubs:
        pub.sock.setblocking(False)

    def read_ready(timeout: float) -> None:
        for key, _ in selector.select(timeout):
            sub = key.data
            if sub is None:
                continue  # a publisher's socket can take more: the main loop writes
            try:
                data = sub.sock.recv(1 << 20)
            except BlockingIOError:
                continue
            if not data:
                raise BenchError(f"the broker closed subscriber {sub.index}")
            sub.feed(data)

    # Probes until every subscriber hears its publisher: the route is in place everywhere.
    deadline = time.monotonic() + 10.0
    while not all(s.probed for s in subs):
        if time.monotonic() > deadline:
            raise BenchError("probe messages did not arrive within 10 s")
        for pub, sub in zip(pubs, subs, strict=True):
            if not sub.probed:
                pub.probe()
        read_ready(0.02)

    def sample() -> Sample:
        return Sample(time.monotonic(), sum(s.received for s in subs),
                      sum(p.generated for p in pubs), time.process_time(),
                      _broker_sample(broker), host_cpu())

    start = time.monotonic()
    window_at, end_at = start + warmup, start + warmup + duration
    s0: Sample | None = None
    s1: Sample | None = None
    writing: set[int] = set()
    while s1 is None:
        now = time.monotonic()
        if s0 is None and now >= window_at:
            s0 = sample()
        elif s0 is not None and now >= end_at:
            s1 = sample()
            break
        for pub, sub in zip(pubs, subs, strict=True):
            if not pub.out:
                allowed = lead - (pub.generated - sub.next_seq)
                if allowed > 0:
                    pub.refill(min(allowed, CHUNK))
            done = pub.flush()
            if not done and pub.index not in writing:
                selector.register(pub.sock, selectors.EVENT_WRITE, None)
                writing.add(pub.index)
            elif done and pub.index in writing:
                selector.unregister(pub.sock)
                writing.discard(pub.index)
        read_ready(min(0.01, max(0.0, (end_at if s0 else window_at) - now)))
    for pub in pubs:  # the rest of what was generated, then drain
        if pub.index in writing:
            selector.unregister(pub.sock)
        pub.sock.setblocking(True)
        pub.sock.sendall(pub.out)
        pub.out = memoryview(b"")
    quiet_since, last = time.monotonic(), -1
    while any(s.next_seq < p.generated for s, p in zip(subs, pubs, strict=True)):
        total = sum(s.received for s in subs)
        if total != last:
            quiet_since, last = time.monotonic(), total
        elif time.monotonic() - quiet_since > DRAIN_QUIET:
            break
        read_ready(0.05)
    selector.close()
    for conn in [*pubs, *subs]:
        try:
            conn.sock.setblocking(True)
            conn.sock.sendall(b"\xe0\x00")
        except OSError:
            pass
        conn.sock.close()

    missing = sum(max(0, p.generated - s.next_seq) + s.gaps
                  for s, p in zip(subs, pubs, strict=True))
    dups = sum(s.dups for s in subs)
    foreign = sum(s.foreign for s in subs)
    if missing or dups or foreign:
        problems.append(f"{missing} missing, {dups} duplicated, {foreign} foreign messages")
    if not broker.alive():
        problems.append(f"meshmq died: {broker.log_tail(5)}")
    elif broker.workers and not broker.workers_alive():
        problems.append("a worker was restarted during the run")
    for role, conns in (("p", pubs), ("s", subs)):
        wanted = [case.worker_of(role, c.index) for c in conns]
        landed = [c.worker for c in conns]
        if any(w is not None and w != got for w, got in zip(wanted, landed, strict=True)):
            problems.append(f"{role} clients on workers {landed}, wanted {wanted}")
    assert s0 is not None and s1 is not None
    figures = _figures(s0, s1)
    return {"ok": not problems, "problems": problems, "case": case.name,
            "workers": case.workers, "figures": figures,
            "counts": {"published": sum(p.generated for p in pubs),
                       "delivered": sum(s.received for s in subs), "missing": missing,
                       "duplicates": dups, "foreign": foreign,
                       "delivered_window": s1.delivered - s0.delivered,
                       "connect_attempts": attempts, "pairs": pairs, "lead": lead},
            "placement": {"publishers": [p.worker for p in pubs],
                          "subscribers": [s.worker for s in subs]}}


def _figures(s0: Sample, s1: Sample) -> dict[str, float]:
    wall = max(s1.t - s0.t, 1e-9)
    delivered = s1.delivered - s0.delivered
    per = 1e6 / delivered if delivered else 0.0
    figures: dict[str, float] = {"rate": delivered / wall}
    total_cpu = total_wait = 0.0
    for index in sorted(s0.broker.keys() & s1.broker.keys()):
        cpu = s1.broker[index].cpu_s - s0.broker[index].cpu_s
        total_cpu += cpu
        total_wait += s1.broker[index].wait_s - s0.broker[index].wait_s
        figures[f"worker{index}_cpu_pct"] = 100.0 * cpu / wall
        figures[f"worker{index}_us_per_msg"] = cpu * per
        figures[f"worker{index}_syscalls_per_msg"] = (
            s1.broker[index].syscalls - s0.broker[index].syscalls) * per / 1e6
        figures[f"worker{index}_wakeups_per_msg"] = (
            s1.broker[index].wakeups - s0.broker[index].wakeups) * per / 1e6
    figures["broker_cpu_pct"] = 100.0 * total_cpu / wall
    figures["broker_wait_pct"] = 100.0 * total_wait / wall
    figures["broker_us_per_msg"] = total_cpu * per
    client = s1.client_cpu - s0.client_cpu
    figures["client_cpu_pct"] = 100.0 * client / wall
    figures["client_us_per_msg"] = client * per
    figures["host_busy_pct"] = 100.0 * (s1.host[0] - s0.host[0]) / wall
    figures["host_steal_pct"] = 100.0 * (s1.host[1] - s0.host[1]) / wall
    return figures
