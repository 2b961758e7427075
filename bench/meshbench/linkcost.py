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

The same traffic runs at QoS 1 for ``appendcost`` (persisted publishes): publishes and
subscriptions at QoS 1, each publisher at most ``WINDOW`` publishes unacknowledged, every
PUBACK checked (``endpoints``). A case is anything shaped like ``PlacedCase``: its node's
settings, each pair's topic, and where each client must land.

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
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from meshbench import BenchError
from meshbench.brokers import (
    ProcStats,
    RunningBroker,
    commit_log_bytes,
    host_cpu,
    start_meshmq,
)
from meshbench.endpoints import SIZE, Publisher, Subscriber
from meshbench.placed import connect_placed, recv_packet, subscribe_packet
from meshbench.scenarios import IN_FLIGHT, LOG_OFF

CHUNK = 256  # messages encoded per send
DRAIN_QUIET = 2.0  # seconds without a delivery after which the drain stops
WINDOW = 1024  # QoS 1: publishes a publisher leaves unacknowledged (meshmq's receive maximum)


class PlacedCase(Protocol):
    """What ``run_case`` needs of a case (``LinkCase`` here, ``appendcost.AppendCase``)."""

    name: str
    workers: int
    qos: int  # of the publishes and of the subscriptions

    def settings(self) -> dict[str, object]:
        """meshmq settings of the node (``server.workers`` is added)."""
        ...

    def topic(self, pair: int) -> str: ...

    def worker_of(self, role: str, pair: int) -> int | None:
        """Where pair ``pair``'s publisher (role "p") or subscriber ("s") must land (None:
        wherever it lands)."""
        ...


@dataclass(frozen=True)
class LinkCase:
    name: str
    workers: int
    publishers_on: int | None  # worker index (None: wherever they land)
    subscribers_on: int | None
    title: str
    spread: bool = False  # pair i on worker i % workers instead (both ends on one worker)
    qos: int = 0

    def settings(self) -> dict[str, object]:
        return dict(LOG_OFF)

    def topic(self, pair: int) -> str:
        return f"bench/link/{pair}"

    def worker_of(self, role: str, pair: int) -> int | None:
        if self.spread:
            return pair % self.workers
        return self.publishers_on if role == "p" else self.subscribers_on


CASES = (
    LinkCase("single", 1, None, None, "1 worker (no mesh)"),
    LinkCase("local", 2, 0, 0, "2 workers, publisher and subscriber on worker 0"),
    LinkCase("forwarded", 2, 0, 1, "2 workers, publisher on worker 0, subscriber on worker 1"),
    LinkCase("spread", 2, None, None, "2 workers, pair i on worker i % 2 (all local)", True),
)


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


def run_case(case: PlacedCase, *, warmup: float, duration: float, pairs: int = 4,
             cpus: str | None = None) -> dict[str, object]:
    """Start meshmq for ``case``, place the clients, measure a window; return the outcome."""
    workdir = Path(tempfile.mkdtemp(prefix="meshbench-link-"))
    settings: dict[str, object] = {"server.workers": case.workers, **case.settings()}
    try:
        broker = start_meshmq(workdir, settings, cpus)
        try:
            traffic = Traffic(case, broker, pairs)
            try:
                traffic.probe()
                s0, s1 = traffic.measure(warmup, duration)
                traffic.drain()
            finally:
                traffic.close()
            outcome = traffic.outcome(s0, s1)
        finally:
            broker.stop()
        outcome["log_bytes"] = persisted = commit_log_bytes(workdir)
        published = sum(p.generated for p in traffic.pubs)
        if settings.get("log.enabled") and persisted < published * SIZE:
            outcome["ok"] = False
            outcome["problems"].append(  # type: ignore[union-attr]
                f"the commit log holds {persisted} bytes for {published} persisted messages")
        return outcome
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class Traffic:
    """The placed clients of one run, driven by one selector loop: ``probe()``, ``measure()``,
    ``drain()``, ``close()``, then ``outcome()``."""

    def __init__(self, case: PlacedCase, broker: RunningBroker, pairs: int) -> None:
        self.case = case
        self.broker = broker
        self.lead = max(1, IN_FLIGHT // pairs)
        self.window = min(WINDOW, self.lead)
        self.subs: list[Subscriber] = []
        self.pubs: list[Publisher] = []
        self.attempts = 0
        self.writing: set[int] = set()  # publishers registered for EVENT_WRITE
        self.selector = selectors.DefaultSelector()
        self._connect(pairs)

    def _connect(self, pairs: int) -> None:
        case = self.case
        for i in range(pairs):  # subscribers first: their routes reach the other worker meanwhile
            sock, worker, tries, pending = connect_placed(self.broker.port, f"s{i}",
                                                          case.worker_of("s", i))
            self.attempts += tries
            sock.sendall(subscribe_packet(case.topic(i), case.qos))
            first, body = recv_packet(sock, pending)
            if first >> 4 != 9 or body[-1] >= 0x80:
                raise BenchError(f"SUBACK refused or missing: {first:#x} {body.hex()}")
            sub = Subscriber(i, sock, worker)
            if pending:
                sub.feed(bytes(pending))
            self.subs.append(sub)
        for i in range(pairs):
            sock, worker, tries, _ = connect_placed(self.broker.port, f"p{i}",
                                                    case.worker_of("p", i))
            self.attempts += tries
            self.pubs.append(Publisher(i, sock, worker, case.topic(i), case.qos))
        for sub in self.subs:
            sub.sock.setblocking(False)
            self.selector.register(sub.sock, selectors.EVENT_READ, sub)
        for pub in self.pubs:
            pub.sock.setblocking(False)
            if case.qos:  # its PUBACKs
                self.selector.register(pub.sock, selectors.EVENT_READ, pub)

    def _want_write(self, pub: Publisher, wanted: bool) -> None:
        if wanted == (pub.index in self.writing):
            return
        if wanted:
            self.writing.add(pub.index)
        else:
            self.writing.discard(pub.index)
        events = (selectors.EVENT_WRITE if wanted else 0) | (
            selectors.EVENT_READ if self.case.qos else 0)
        if not events:
            self.selector.unregister(pub.sock)
        elif wanted and not self.case.qos:
            self.selector.register(pub.sock, events, None)
        else:
            self.selector.modify(pub.sock, events, pub)

    def read_ready(self, timeout: float) -> None:
        for key, events in self.selector.select(timeout):
            end = key.data
            if end is None or not events & selectors.EVENT_READ:
                continue  # a publisher's socket can take more: the main loop writes
            try:
                data = end.sock.recv(1 << 20)
            except BlockingIOError:
                continue
            if not data:
                kind = "subscriber" if isinstance(end, Subscriber) else "publisher"
                raise BenchError(f"the broker closed {kind} {end.index}")
            end.feed(data)
        for sub in self.subs:
            if sub.acks:
                sub.flush_acks()

    def probe(self) -> None:
        """Probes until every subscriber hears its publisher: the route is in place
        everywhere."""
        deadline = time.monotonic() + 10.0
        while not all(s.probed for s in self.subs):
            if time.monotonic() > deadline:
                raise BenchError("probe messages did not arrive within 10 s")
            for pub, sub in zip(self.pubs, self.subs, strict=True):
                if not sub.probed:
                    pub.probe()
            self.read_ready(0.02)

    def sample(self) -> Sample:
        return Sample(time.monotonic(), sum(s.received for s in self.subs),
                      sum(p.generated for p in self.pubs), time.process_time(),
                      _broker_sample(self.broker), host_cpu())

    def measure(self, warmup: float, duration: float) -> tuple[Sample, Sample]:
        """Publish as fast as the lead (and at QoS 1 the window) allows; the samples at the
        edges of the window."""
        start = time.monotonic()
        window_at, end_at = start + warmup, start + warmup + duration
        s0: Sample | None = None
        qos, lead, window = self.case.qos, self.lead, self.window
        while True:
            now = time.monotonic()
            if s0 is None and now >= window_at:
                s0 = self.sample()
            elif s0 is not None and now >= end_at:
                return s0, self.sample()
            for pub, sub in zip(self.pubs, self.subs, strict=True):
                if not pub.out:
                    allowed = lead - (pub.generated - sub.next_seq)
                    if qos:
                        allowed = min(allowed, window - pub.in_flight())
                    if allowed > 0:
                        pub.refill(min(allowed, CHUNK))
                self._want_write(pub, not pub.flush())
            self.read_ready(min(0.01, max(0.0, (end_at if s0 else window_at) - now)))

    def drain(self) -> None:
        """The rest of what was generated, then read until every message (and at QoS 1 every
        PUBACK) is in, or nothing moved for ``DRAIN_QUIET`` seconds."""
        for pub in self.pubs:
            self._want_write(pub, False)
            pub.sock.setblocking(True)
            pub.sock.sendall(pub.out)
            pub.sock.setblocking(False)
            pub.out = memoryview(b"")
        quiet_since, last = time.monotonic(), -1
        while (any(s.next_seq < p.generated for s, p in zip(self.subs, self.pubs, strict=True))
               or any(p.in_flight() for p in self.pubs)):
            progress = sum(s.received for s in self.subs) + sum(p.acked for p in self.pubs)
            if progress != last:
                quiet_since, last = time.monotonic(), progress
            elif time.monotonic() - quiet_since > DRAIN_QUIET:
                break
            self.read_ready(0.05)

    def close(self) -> None:
        self.selector.close()
        for end in [*self.pubs, *self.subs]:
            try:
                end.sock.setblocking(True)
                end.sock.sendall(b"\xe0\x00")
            except OSError:
                pass
            end.sock.close()

    def outcome(self, s0: Sample, s1: Sample) -> dict[str, object]:
        """Figures, counts and placement of the run; any miss fails it."""
        case, broker, pubs, subs = self.case, self.broker, self.pubs, self.subs
        problems: list[str] = []
        missing = sum(max(0, p.generated - s.next_seq) + s.gaps
                      for s, p in zip(subs, pubs, strict=True))
        dups = sum(s.dups for s in subs)
        foreign = sum(s.foreign for s in subs)
        if missing or dups or foreign:
            problems.append(f"{missing} missing, {dups} duplicated, {foreign} foreign messages")
        for pub in pubs:
            problems += pub.problems()
        if not broker.alive():
            problems.append(f"meshmq died: {broker.log_tail(5)}")
        elif broker.workers and not broker.workers_alive():
            problems.append("a worker was restarted during the run")
        for role, ends in (("p", pubs), ("s", subs)):
            wanted = [case.worker_of(role, e.index) for e in ends]
            landed = [e.worker for e in ends]
            if any(w is not None and w != got for w, got in zip(wanted, landed, strict=True)):
                problems.append(f"{role} clients on workers {landed}, wanted {wanted}")
        counts = {"published": sum(p.generated for p in pubs),
                  "delivered": sum(s.received for s in subs), "missing": missing,
                  "duplicates": dups, "foreign": foreign,
                  "delivered_window": s1.delivered - s0.delivered,
                  "connect_attempts": self.attempts, "pairs": len(pubs), "lead": self.lead}
        if case.qos:
            counts |= {"window": self.window, "acked": sum(p.acked for p in pubs),
                       "qos1_sent": sum(p.sent for p in pubs)}
        return {"ok": not problems, "problems": problems, "case": case.name,
                "workers": case.workers, "qos": case.qos, "figures": _figures(s0, s1),
                "counts": counts,
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
