"""Publish → subscribe traffic whose clients each connect to a chosen broker port: the cluster
benchmark's message loads (``bench/cluster_cost.py``).

A load is a list of ``Flow``: one publisher on one port and its subscribers, each on a port of
its own choosing (the same node, another node of the cluster, or the one broker of a
single-broker run). The clients are ``endpoints``' MQTT 5.0 publisher and subscriber (64-byte
numbered payloads, every message checked: missing, duplicated or foreign fails the run; at QoS
1 every publish must be acknowledged, every delivery is acknowledged), driven by one selector
loop in this process, as ``linkcost`` drives them: the C load generator speaks to one port only.
The client's own speed only sets the rate; the figure is the brokers' CPU time per delivered
message, read from /proc for every broker process at the edges of the measured window.

Flow control as the suite's: a publisher is at most ``lead`` messages ahead of the slowest of
its subscribers (about ``IN_FLIGHT`` deliveries in flight in all) and, at QoS 1, has at most
``WINDOW`` publishes unacknowledged. Before the window, each publisher sends probes until every
one of its subscribers has heard one, so routes are in place on every node.
"""

from __future__ import annotations

import selectors
import time
from collections.abc import Callable
from dataclasses import dataclass

from meshbench import BenchError
from meshbench.brokers import ProcStats, host_cpu
from meshbench.endpoints import Publisher, Subscriber
from meshbench.placed import connect_placed, recv_packet, subscribe_packet
from meshbench.scenarios import IN_FLIGHT

CHUNK = 256  # messages encoded per refill
DRAIN_QUIET = 2.0  # seconds without progress after which the drain stops
WINDOW = 1024  # QoS 1: publishes a publisher leaves unacknowledged
PROBE_TIMEOUT = 15.0
QUIET_STEP = 0.25  # seconds between two reads of the brokers' CPU while waiting for calm
QUIET_CPU = 0.01  # CPU seconds a broker may use in a step and count as quiet (4% of a CPU)
QUIET_TIMEOUT = 20.0

Sampler = Callable[[], dict[str, ProcStats]]  # broker name (a node) -> its figures so far


@dataclass(frozen=True)
class Flow:
    """One publisher on ``publisher_port`` publishing on ``topic``, heard by one subscriber on
    each of ``subscriber_ports``. ``where``: the node names of those ports, for the record."""

    topic: str
    publisher_port: int
    subscriber_ports: tuple[int, ...]
    where: tuple[str, ...] = ()


@dataclass
class Sample:
    t: float
    delivered: int
    client_cpu: float
    brokers: dict[str, ProcStats]
    host: tuple[float, float]


class Traffic:
    """The clients of one run: ``probe()``, ``measure()``, ``drain()``, ``close()``, then
    ``outcome()``."""

    def __init__(self, flows: list[Flow], qos: int, sampler: Sampler) -> None:
        self.flows = flows
        self.qos = qos
        self.sampler = sampler
        deliveries = sum(len(flow.subscriber_ports) for flow in flows)
        self.lead = max(1, IN_FLIGHT // max(1, deliveries))
        self.window = min(WINDOW, self.lead)
        self.pubs: list[Publisher] = []
        self.subs: list[list[Subscriber]] = []  # per flow
        self.writing: set[int] = set()
        self.selector = selectors.DefaultSelector()
        try:
            self._connect()
        except BaseException:
            self.close()
            raise

    def _connect(self) -> None:
        for index, flow in enumerate(self.flows):  # subscribers first: routes spread meanwhile
            ends = []
            for n, port in enumerate(flow.subscriber_ports):
                sock, _worker, _tries, pending = connect_placed(port, f"s{index}-{n}", None)
                sock.sendall(subscribe_packet(flow.topic, self.qos))
                first, body = recv_packet(sock, pending)
                if first >> 4 != 9 or body[-1] >= 0x80:
                    sock.close()
                    raise BenchError(f"SUBACK refused or missing: {first:#x} {body.hex()}")
                sub = Subscriber(index, sock, None)
                if pending:
                    sub.feed(bytes(pending))
                ends.append(sub)
                sock.setblocking(False)
                self.selector.register(sock, selectors.EVENT_READ, sub)
            self.subs.append(ends)
        for index, flow in enumerate(self.flows):
            sock, _worker, _tries, _ = connect_placed(flow.publisher_port, f"p{index}", None)
            pub = Publisher(index, sock, None, flow.topic, self.qos)
            self.pubs.append(pub)
            sock.setblocking(False)
            if self.qos:  # its PUBACKs
                self.selector.register(sock, selectors.EVENT_READ, pub)

    def _want_write(self, pub: Publisher, wanted: bool) -> None:
        if wanted == (pub.index in self.writing):
            return
        if wanted:
            self.writing.add(pub.index)
        else:
            self.writing.discard(pub.index)
        events = (selectors.EVENT_WRITE if wanted else 0) | (
            selectors.EVENT_READ if self.qos else 0)
        if not events:
            self.selector.unregister(pub.sock)
        elif wanted and not self.qos:
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
        if self.qos:
            for ends in self.subs:
                for sub in ends:
                    if sub.acks:
                        sub.flush_acks()

    def probe(self) -> None:
        """Probes until every subscriber has heard its publisher: every route is in place."""
        deadline = time.monotonic() + PROBE_TIMEOUT
        while not all(sub.probed for ends in self.subs for sub in ends):
            if time.monotonic() > deadline:
                raise BenchError(f"probe messages did not arrive within {PROBE_TIMEOUT:.0f} s")
            for pub, ends in zip(self.pubs, self.subs, strict=True):
                if not all(sub.probed for sub in ends):
                    pub.probe()
            self.read_ready(0.05)

    def sample(self) -> Sample:
        return Sample(time.monotonic(), self.delivered(), time.process_time(), self.sampler(),
                      host_cpu())

    def delivered(self) -> int:
        return sum(sub.received for ends in self.subs for sub in ends)

    def measure(self, warmup: float, duration: float) -> tuple[Sample, Sample]:
        """Publish as fast as the lead (and at QoS 1 the window) allows; the samples at the
        window's edges."""
        start = time.monotonic()
        window_at, end_at = start + warmup, start + warmup + duration
        s0: Sample | None = None
        qos, lead, window = self.qos, self.lead, self.window
        while True:
            now = time.monotonic()
            if s0 is None and now >= window_at:
                s0 = self.sample()
            elif s0 is not None and now >= end_at:
                return s0, self.sample()
            for pub, ends in zip(self.pubs, self.subs, strict=True):
                if not pub.out:
                    slowest = min(sub.next_seq for sub in ends)
                    allowed = lead - (pub.generated - slowest)
                    if qos:
                        allowed = min(allowed, window - pub.in_flight())
                    if allowed > 0:
                        pub.refill(min(allowed, CHUNK))
                self._want_write(pub, not pub.flush())
            self.read_ready(min(0.01, max(0.0, (end_at if s0 else window_at) - now)))

    def drain(self) -> None:
        """Send the rest of what was generated, then read until every message (and at QoS 1
        every PUBACK) is in, or nothing moved for ``DRAIN_QUIET`` seconds."""
        for pub in self.pubs:
            self._want_write(pub, False)
            pub.sock.setblocking(True)
            pub.sock.sendall(pub.out)
            pub.sock.setblocking(False)
            pub.out = memoryview(b"")
        quiet_since, last = time.monotonic(), -1

        def pending() -> bool:
            return (any(sub.next_seq < pub.generated
                        for pub, ends in zip(self.pubs, self.subs, strict=True) for sub in ends)
                    or any(pub.in_flight() for pub in self.pubs))

        while pending():
            progress = self.delivered() + sum(pub.acked for pub in self.pubs)
            if progress != last:
                quiet_since, last = time.monotonic(), progress
            elif time.monotonic() - quiet_since > DRAIN_QUIET:
                break
            self.read_ready(0.05)

    def close(self) -> None:
        self.selector.close()
        every: list[Publisher | Subscriber] = [*self.pubs,
                                               *(sub for ends in self.subs for sub in ends)]
        for end in every:
            try:
                end.sock.setblocking(True)
                end.sock.sendall(b"\xe0\x00")  # DISCONNECT, normal
            except OSError:
                pass
            end.sock.close()

    def outcome(self, s0: Sample, s1: Sample) -> dict[str, object]:
        """Figures and counts of the run; any miss fails it."""
        problems: list[str] = []
        missing = dups = foreign = 0
        for pub, ends in zip(self.pubs, self.subs, strict=True):
            for sub in ends:
                missing += max(0, pub.generated - sub.next_seq) + sub.gaps
                dups += sub.dups
                foreign += sub.foreign
        if missing or dups or foreign:
            problems.append(f"{missing} missing, {dups} duplicated, {foreign} foreign messages")
        for pub in self.pubs:
            problems += pub.problems()
        counts = {"published": sum(p.generated for p in self.pubs),
                  "delivered": self.delivered(), "missing": missing, "duplicates": dups,
                  "foreign": foreign, "delivered_window": s1.delivered - s0.delivered,
                  "publishers": len(self.pubs),
                  "subscribers": sum(len(ends) for ends in self.subs), "lead": self.lead}
        if self.qos:
            counts |= {"window": self.window, "acked": sum(p.acked for p in self.pubs)}
        return {"ok": not problems, "problems": problems, "qos": self.qos,
                "figures": figures(s0, s1), "counts": counts,
                "placement": [{"topic": f.topic, "where": list(f.where)} for f in self.flows]}


def figures(s0: Sample, s1: Sample) -> dict[str, float]:
    """Delivered msg/s; broker CPU µs per delivered message, in all and per broker (node);
    the brokers' CPU and run-queue wait, the client's CPU and the whole machine's, in % of a
    CPU over the window."""
    wall = max(s1.t - s0.t, 1e-9)
    delivered = s1.delivered - s0.delivered
    per = 1e6 / delivered if delivered else 0.0
    out: dict[str, float] = {"rate": delivered / wall}
    total_cpu = total_wait = 0.0
    for name in sorted(s0.brokers.keys() & s1.brokers.keys()):
        cpu = s1.brokers[name].cpu_s - s0.brokers[name].cpu_s
        total_cpu += cpu
        total_wait += s1.brokers[name].wait_s - s0.brokers[name].wait_s
        out[f"{name}_cpu_pct"] = 100.0 * cpu / wall
        out[f"{name}_us_per_msg"] = cpu * per
    out["broker_cpu_pct"] = 100.0 * total_cpu / wall
    out["broker_wait_pct"] = 100.0 * total_wait / wall
    out["broker_us_per_msg"] = total_cpu * per
    client = s1.client_cpu - s0.client_cpu
    out["client_cpu_pct"] = 100.0 * client / wall
    out["host_busy_pct"] = 100.0 * (s1.host[0] - s0.host[0]) / wall
    out["host_steal_pct"] = 100.0 * (s1.host[1] - s0.host[1]) / wall
    return out


def await_quiet(sampler: Sampler) -> float:
    """Until every broker is idle (under ``QUIET_CPU`` in a ``QUIET_STEP``): a run before this
    one may leave work behind (thousands of clients' disconnects, queues to drop) that would
    count as this run's CPU. Returns the seconds waited; a broker still busy after
    ``QUIET_TIMEOUT`` is left so (the CPU of a shared machine's other work is not the broker's,
    so this only ends early on a broker that truly spins)."""
    start = time.monotonic()
    before = sampler()
    while time.monotonic() - start < QUIET_TIMEOUT:
        time.sleep(QUIET_STEP)
        after = sampler()
        if all(after[name].cpu_s - before[name].cpu_s < QUIET_CPU
               for name in before.keys() & after.keys()):
            break
        before = after
    return time.monotonic() - start


def run_flows(flows: list[Flow], qos: int, sampler: Sampler, warmup: float,
              duration: float) -> dict[str, object]:
    """Wait until the brokers are idle; connect, probe, measure a window, drain, close; the
    outcome (``ok`` False on a miss)."""
    waited = await_quiet(sampler)
    traffic = Traffic(flows, qos, sampler)
    try:
        traffic.probe()
        s0, s1 = traffic.measure(warmup, duration)
        traffic.drain()
    finally:
        traffic.close()
    return {**traffic.outcome(s0, s1), "quiet_wait_s": round(waited, 2)}
