"""A node killed (or hung) under QoS 1 traffic: how long until the others report it, and
whether the publishes on the surviving nodes stop meanwhile (the cluster benchmark's failover
part).

Three nodes with the metadata on (``cluster.metadata = true``: a Raft voter per node, a
controller, partitions assigned round robin), each with its commit log on (the defaults:
``fsync = "always"``, so a PUBACK waits for the fsync). Once every node sees every partition
assigned, the victim is chosen: by default the controller's node (the worst case: the
controller must move too), or another node.

Traffic: on each surviving node, one MQTT 5.0 publisher per partition (``PARTITIONS``), each on
a topic that falls in that partition (``bench/fail/<node>/<n>``, crc32 as the log's
partitioner), paced to ``rate`` QoS 1 publishes a second with at most ``MAX_IN_FLIGHT``
unacknowledged; each topic has a QoS 1 subscriber on the other surviving node and one on the
victim (so the publishing nodes route to the node that dies). Each PUBACK's arrival is timed
(PUBACKs come in the order of the publishes, MQTT-4.6.0-2, so the k-th acknowledges the k-th
publish), and so is each delivery to the surviving subscribers.

After ``baseline`` seconds, the fault: ``kill`` sends SIGKILL to the victim's supervisor (its
workers and voter die with it; on one machine the kernel closes their sockets, so the others
see the links close at once), ``stop`` sends SIGSTOP to every process of the node (a host that
hangs or is cut off: its sockets stay open and only the heartbeats can tell, docs/cluster.md,
Liveness; give ``observe`` more than the 12 s after which a silent link is closed). A thread
polls ``GET /api/v1/cluster`` on each survivor every ``ADMIN_POLL`` seconds: **reported down**
is the first answer in which the victim has no link left (what ``meshmq cluster status`` shows
as ``down``, and its partitions as ``offline``), **suspected** the first with it suspected,
**controller moved** the first whose controller record has a higher epoch (when the victim was
the controller). The traffic goes on for ``observe`` seconds after the fault; then the victim
is killed (if stopped), the publishers stop, and everything sent must be acknowledged and
delivered to the surviving subscribers.

Figures: those times from the fault (``t_kill`` in the code, either fault); per publisher, the
longest gap between two PUBACKs after the fault against the longest before it (the pacing and
fsync jitter), and the longest publish-to-PUBACK time of a publish sent after the fault; the
same gap for deliveries. Topics whose partition the metadata assigns to the victim are
reported apart: their publishes are appended by the victim (docs/cluster.md, Partitions
across nodes), so after the fault they are refused (PUBACK 0x80: the partition is offline)
or, when the victim hung with appends in flight, their outcome is unknown and the broker
closes the publisher's connection; **refused at** is the time from the fault to the first
such refusal or close, per publisher. For those topics what the victim acknowledged but had
not yet forwarded when it died is counted (**waiting**: it comes after the victim's restart,
cluster/nodecatchup.py, which this benchmark does not do); the other topics must see every
publish acknowledged and delivered.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import selectors
import signal
import statistics
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from meshbench import BenchError
from meshbench.brokers import LOSSLESS_MESHMQ
from meshbench.cluster import POLL, Cluster, ClusterNode, partitions_settled, start_cluster
from meshbench.endpoints import Publisher, Subscriber
from meshbench.placed import connect_placed, recv_packet, subscribe_packet

PARTITIONS = 8  # log.partitions, the default
MAX_IN_FLIGHT = 64  # per publisher
SETTLE_TIMEOUT = 60.0
DRAIN_QUIET = 5.0
ADMIN_POLL = 0.02  # seconds between two status reads by the watcher thread
# kill -9 of the supervisor; SIGSTOP of every process of the node; SIGSTOP, then SIGCONT
FAULTS = ("kill", "stop", "pause")
RECOVER = 10.0  # pause: seconds of traffic after the SIGCONT


def topic_in_partition(node: str, partition: int) -> str:
    """A topic ``bench/fail/<node>/<n>`` whose records go to ``partition`` (crc32 of the whole
    topic modulo the partitions, as ``meshmq.log.partitioner`` with ``key_level`` unset)."""
    n = 0
    while zlib.crc32(f"bench/fail/{node}/{n}".encode()) % PARTITIONS != partition:
        n += 1
    return f"bench/fail/{node}/{n}"


@dataclass
class Paced:
    """A publisher, its pace, and the times of its publishes and PUBACKs."""

    pub: Publisher
    node: str
    topic: str
    partition: int
    interval: float
    next_at: float = 0.0
    sent_at: list[float] = field(default_factory=list)  # per QoS 1 publish, in order
    acked_at: list[float] = field(default_factory=list)  # per PUBACK, in order
    victim_led: bool = False  # its partition is led by the node that fails
    refused_at: float | None = None  # the first PUBACK with an error code, or the close
    closed: bool = False  # the broker closed it (an unknown outcome)

    def due(self, now: float) -> bool:
        return (not self.closed and now >= self.next_at
                and self.pub.in_flight() < MAX_IN_FLIGHT)

    def send(self, now: float) -> None:
        self.pub.refill(1)
        self.sent_at.append(now)
        # the next slot, not a burst after a stall: a paced device does not catch up
        self.next_at = max(self.next_at + self.interval, now)


@dataclass
class Heard:
    """A subscriber, the node it is on, and the times of its deliveries."""

    sub: Subscriber
    node: str
    times: list[float] = field(default_factory=list)
    closed: bool = False
    # pause: the publisher's count at the SIGCONT, and when a message published after it came
    after_seq: int | None = None
    resumed_at: float | None = None


class Watcher(threading.Thread):
    """Polls each survivor's ``/api/v1/cluster``; keeps (time, node, answer or error)."""

    def __init__(self, survivors: list[ClusterNode]) -> None:
        super().__init__(daemon=True)
        self.survivors = survivors
        self.seen: list[tuple[float, str, dict | None, float]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for node in self.survivors:
                asked = time.monotonic()
                try:
                    answer: dict | None = node.admin(timeout=2.0)
                except OSError:
                    answer = None
                self.seen.append((time.monotonic(), node.name, answer,
                                  time.monotonic() - asked))
            self.stopping.wait(ADMIN_POLL)


def first_time(seen: list[tuple[float, str, dict | None, float]], node: str, after: float,
               test: object) -> float | None:
    """The first answer of ``node`` at or after ``after`` for which ``test(answer)`` holds:
    its time (when the answer arrived), else None."""
    for t, name, answer, _latency in seen:
        if name == node and t >= after and answer is not None and test(answer):  # type: ignore[operator]
            return t
    return None


def victim_row(answer: dict, victim: str) -> dict:
    return next((row for row in answer.get("nodes", []) if row["node_id"] == victim), {})


def gaps(times: list[float], kill: float) -> tuple[float, float]:
    """(longest gap between consecutive times before ``kill``, longest one ending after it)."""
    before = after = 0.0
    for earlier, later in itertools.pairwise(times):
        if later <= kill:
            before = max(before, later - earlier)
        else:
            after = max(after, later - earlier)
    return before, after


def run_failover(workdir: Path, cpus: str | None, *, baseline: float = 3.0,
                 observe: float = 8.0, rate: float = 100.0, kill: str = "controller",
                 fault: str = "kill",
                 settings: dict[str, object] | None = None) -> dict[str, object]:
    """Start the cluster, run the traffic, fail the victim (``fault``: ``kill`` or ``stop``);
    the figures (``ok`` False when a publish on a survivor was lost or never acknowledged)."""
    if fault not in FAULTS:
        raise ValueError(f"fault: {fault!r} is not one of {', '.join(FAULTS)}")
    cluster = start_cluster(workdir, 3, {**LOSSLESS_MESHMQ, **(settings or {})}, cpus,
                            metadata=True)
    try:
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while not partitions_settled(cluster, PARTITIONS):
            if time.monotonic() > deadline:
                raise BenchError("the metadata did not assign every partition within "
                                 f"{SETTLE_TIMEOUT:.0f} s")
            time.sleep(POLL * 5)
        state = cluster.nodes[0].admin()["metadata"]
        controller = state["controller"]
        if kill == "controller":
            victim = cluster.by_name(controller["node"])
        else:
            victim = next(n for n in cluster.nodes if n.name != controller["node"])
        return _observe(cluster, victim, state, baseline, observe, rate, fault)
    finally:
        cluster.stop()


def _observe(cluster: Cluster, victim: ClusterNode, state: dict, baseline: float,
             observe: float, rate: float, fault: str) -> dict[str, object]:
    survivors = [n for n in cluster.nodes if n is not victim]
    led_by_victim = sorted(int(p) for p, a in state["partitions"].items()
                           if a["leader"] == victim.name)
    selector = selectors.DefaultSelector()
    paced: list[Paced] = []
    heard: list[list[Heard]] = []
    sockets = []
    try:
        for node in survivors:
            other = next(n for n in survivors if n is not node)
            for partition in range(PARTITIONS):
                index = len(paced)
                topic = topic_in_partition(node.name, partition)
                ends = []
                for where in (other, victim):
                    sock, _w, _t, pending = connect_placed(where.port, f"f{index}{where.name}",
                                                           None)
                    sockets.append(sock)
                    sock.sendall(subscribe_packet(topic, 1))
                    first, body = recv_packet(sock, pending)
                    if first >> 4 != 9 or body[-1] >= 0x80:
                        raise BenchError(f"SUBACK refused or missing: {first:#x}")
                    end = Heard(Subscriber(index, sock, None), where.name)
                    if pending:
                        end.sub.feed(bytes(pending))
                    sock.setblocking(False)
                    selector.register(sock, selectors.EVENT_READ, end)
                    ends.append(end)
                heard.append(ends)
                sock, _w, _t, _ = connect_placed(node.port, f"f{index}p", None)
                sockets.append(sock)
                publisher = Publisher(index, sock, None, topic, 1)
                sock.setblocking(False)
                selector.register(sock, selectors.EVENT_READ, publisher)
                paced.append(Paced(publisher, node.name, topic, partition, 1.0 / rate,
                                   victim_led=partition in led_by_victim))
        _probe(selector, paced, heard)
        watcher = Watcher(survivors)
        watcher.start()
        start = time.monotonic()
        for p in paced:  # spread the publishers over one interval
            p.next_at = start + p.interval * p.pub.index / len(paced)
        _run(selector, paced, heard, until=start + baseline)
        t_kill = time.monotonic()
        if fault == "kill":
            victim.proc.kill()  # SIGKILL; reaped after the window, so this loop never waits
        else:  # every process of the node (supervisor, workers, voter): a host that hangs
            for pid in victim.pids:
                os.kill(pid, signal.SIGSTOP)
        _run(selector, paced, heard, until=t_kill + observe)
        t_resume: float | None = None
        if fault == "pause":  # the node wakes up: its links were closed as dead meanwhile
            for p, ends in zip(paced, heard, strict=True):
                for end in ends:
                    if end.node == victim.name:
                        end.after_seq = p.pub.generated
            t_resume = time.monotonic()
            for pid in victim.pids:
                os.kill(pid, signal.SIGCONT)
            _run(selector, paced, heard, until=t_resume + RECOVER)
        watcher.stopping.set()
        watcher.join(timeout=10)
        if fault != "kill":  # SIGKILL ends a stopped process; its children may not be told
            for pid in victim.pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        victim.kill()  # before the drain: the victim's subscribers then read end of file
        _drain(selector, paced, heard)
    finally:
        selector.close()
        for sock in sockets:
            try:
                sock.setblocking(True)
                sock.sendall(b"\xe0\x00")
            except OSError:
                pass
            sock.close()
    outcome = _outcome(cluster, victim, state, led_by_victim, paced, heard, watcher, t_kill,
                       must_go_down=fault != "pause" or observe > 12.0)
    if t_resume is not None:
        _resumed(outcome, cluster, victim, heard, watcher, t_resume)
    return {"fault": fault, **outcome}


def _resumed(outcome: dict[str, object], cluster: Cluster, victim: ClusterNode,
             heard: list[list[Heard]], watcher: Watcher, t_resume: float) -> None:
    """pause: when the survivors saw the victim linked again, and when each of its
    subscribers got a message published after the SIGCONT (none within ``RECOVER`` s fails
    the run: the node came back but its subscribers are cut off)."""
    figures: dict[str, float | None] = outcome["figures"]  # type: ignore[assignment]
    problems: list[str] = outcome["problems"]  # type: ignore[assignment]
    relinked = [first_time(watcher.seen, node.name, t_resume,
                           lambda a: victim_row(a, victim.name).get("linked", 0)
                           >= cluster.workers)
                for node in cluster.nodes if node is not victim]
    figures["relinked_s"] = _worst([None if t is None else t - t_resume for t in relinked])
    on_victim = [end for ends in heard for end in ends if end.node == victim.name]
    late = [end for end in on_victim if end.resumed_at is None]
    figures["victim_subscribers_resumed_s"] = (
        None if late else max(float(end.resumed_at) - t_resume  # type: ignore[arg-type]
                              for end in on_victim))
    if figures["relinked_s"] is None:
        problems.append(f"the survivors did not see {victim.name} linked again within "
                        f"{RECOVER:.0f} s of its SIGCONT")
    if late:
        problems.append(f"{len(late)} of the {len(on_victim)} subscribers on {victim.name} got "
                        f"no message published after its SIGCONT within {RECOVER:.0f} s")
    outcome["resumed_subscribers"] = len(on_victim) - len(late)
    # what the paused node's subscribers missed (expected: routing is live, nothing is kept
    # for a node whose link was closed as dead; docs/cluster.md, Limits)
    figures["victim_subscribers_missed"] = sum(end.sub.gaps for end in on_victim)
    outcome["victim_subscribers_received"] = sum(end.sub.received for end in on_victim)
    outcome["ok"] = not problems


def _probe(selector: selectors.BaseSelector, paced: list[Paced],
           heard: list[list[Heard]]) -> None:
    deadline = time.monotonic() + 15.0
    while not all(end.sub.probed for ends in heard for end in ends):
        if time.monotonic() > deadline:
            raise BenchError("probe messages did not arrive within 15 s")
        for p, ends in zip(paced, heard, strict=True):
            if not all(end.sub.probed for end in ends):
                p.pub.probe()
                p.sent_at.append(time.monotonic())  # a probe is a QoS 1 publish too
        _read(selector, paced, heard, 0.05)


def _read(selector: selectors.BaseSelector, paced: list[Paced], heard: list[list[Heard]],
          timeout: float) -> None:
    for key, _events in selector.select(timeout):
        end = key.data
        try:
            data = key.fileobj.recv(1 << 20)  # type: ignore[union-attr]
        except BlockingIOError:
            continue
        except ConnectionError:
            data = b""
        now = time.monotonic()
        if isinstance(end, Heard):
            if not data:
                end.closed = True  # the victim's subscribers: their node is gone
                selector.unregister(key.fileobj)
                continue
            before = end.sub.received
            end.sub.feed(data)
            end.times.extend([now] * (end.sub.received - before))
            if (end.after_seq is not None and end.resumed_at is None
                    and end.sub.next_seq > end.after_seq):
                end.resumed_at = now
            _flush_acks(end)
        else:
            p = paced[end.index]
            if not data:
                if not p.victim_led:
                    raise BenchError(f"the broker closed publisher {end.index}")
                p.closed = True  # its partition's leader failed with appends in flight
                p.refused_at = p.refused_at or now
                selector.unregister(key.fileobj)
                continue
            before, refused = end.acked, end.refused
            end.feed(data)
            p.acked_at.extend([now] * (end.acked - before))
            if end.refused > refused and p.refused_at is None:
                p.refused_at = now


def _run(selector: selectors.BaseSelector, paced: list[Paced], heard: list[list[Heard]],
         until: float) -> None:
    while True:
        now = time.monotonic()
        if now >= until:
            return
        for p in paced:
            if p.due(now):
                p.send(now)
            if not p.closed:
                p.pub.flush()
        soonest = min(p.next_at for p in paced)
        _read(selector, paced, heard, max(0.0, min(soonest - time.monotonic(), 0.005)))
        for ends in heard:
            for end in ends:
                _flush_acks(end)


def _flush_acks(end: Heard) -> None:
    """Write a subscriber's pending PUBACKs; one on the killed node just stops."""
    if end.sub.acks and not end.closed:
        try:
            end.sub.flush_acks()
        except OSError:
            end.closed = True


def _drain(selector: selectors.BaseSelector, paced: list[Paced],
           heard: list[list[Heard]]) -> None:
    quiet_since, last = time.monotonic(), -1
    while any((p.pub.in_flight() or p.pub.out) and not p.closed for p in paced) or any(
            end.sub.next_seq < p.pub.generated
            for p, ends in zip(paced, heard, strict=True) for end in ends if not end.closed):
        for p in paced:
            if not p.closed:
                p.pub.flush()
        progress = sum(p.pub.acked for p in paced) + sum(
            end.sub.received for ends in heard for end in ends)
        if progress != last:
            quiet_since, last = time.monotonic(), progress
        elif time.monotonic() - quiet_since > DRAIN_QUIET:
            return
        _read(selector, paced, heard, 0.05)


def _outcome(cluster: Cluster, victim: ClusterNode, state: dict, led_by_victim: list[int],
             paced: list[Paced], heard: list[list[Heard]], watcher: Watcher,
             t_kill: float, must_go_down: bool = True) -> dict[str, object]:
    """The figures; ``must_go_down``: fail the run unless the survivors reported the victim
    down (not for a pause shorter than the 12 s after which a silent link is closed)."""
    problems = [p for p in cluster.problems() if not p.startswith(f"{victim.name} ")]
    old_epoch = int(state["controller"]["epoch"])
    was_controller = state["controller"]["node"] == victim.name
    reported: dict[str, dict[str, float | None]] = {}
    for node in (n for n in cluster.nodes if n is not victim):
        down = first_time(watcher.seen, node.name, t_kill,
                          lambda a: not victim_row(a, victim.name).get("linked", 0))
        suspected = first_time(watcher.seen, node.name, t_kill,
                               lambda a: victim_row(a, victim.name).get("suspected"))
        moved = first_time(watcher.seen, node.name, t_kill, lambda a: (
            ((a.get("metadata") or {}).get("controller") or {}).get("epoch", 0) > old_epoch))
        reported[node.name] = {"down_s": None if down is None else down - t_kill,
                               "suspected_s": None if suspected is None else suspected - t_kill,
                               "controller_moved_s": None if moved is None else moved - t_kill}
    polls = [latency for t, _n, answer, latency in watcher.seen if answer is not None]
    failed_polls = sum(1 for _t, _n, answer, _l in watcher.seen if answer is None)
    final = watcher.seen[-1][2] if watcher.seen and watcher.seen[-1][2] else {}
    per_pub: list[dict[str, Any]] = []
    for p, ends in zip(paced, heard, strict=True):
        before, after = gaps(p.acked_at, t_kill)
        acked = len(p.acked_at)
        latencies_after = [a - s for s, a in zip(p.sent_at, p.acked_at, strict=False)
                           if s >= t_kill]
        latencies_before = [a - s for s, a in zip(p.sent_at, p.acked_at, strict=False)
                            if s < t_kill]
        survivor = next(end for end in ends if end.node != victim.name)
        d_before, d_after = gaps(survivor.times, t_kill)
        missing = max(0, p.pub.generated - survivor.sub.next_seq) + survivor.sub.gaps
        waiting = 0  # stored by the victim, its FORWARD lost with it: comes after its restart
        if p.victim_led:  # refused or unknown after the fault
            stored = p.pub.acked - p.pub.refused  # (PUBACKs in publish order, refusals last)
            delivered = survivor.sub.next_seq - survivor.sub.gaps
            waiting, missing = max(0, stored - delivered), 0
            if p.refused_at is not None and p.refused_at < t_kill:
                problems.append(f"{p.topic}: refused before the fault")
        elif p.pub.in_flight():
            problems.append(f"{p.topic}: {p.pub.in_flight()} publishes never acknowledged")
        if missing or survivor.sub.dups:
            problems.append(f"{p.topic}: {missing} missing, {survivor.sub.dups} duplicated on "
                            f"the surviving subscriber")
        problems += [f"{p.topic}: {text}" for text in p.pub.problems()
                     if "unacknowledged" not in text
                     and not (p.victim_led and "error code" in text)
                     and not (p.closed and "other than PUBACK" in text)]  # (DISCONNECT 0x80)
        per_pub.append({
            "node": p.node, "topic": p.topic, "partition": p.partition,
            "partition_led_by_victim": p.partition in led_by_victim,
            "published": p.pub.generated, "acked": acked, "refused": p.pub.refused,
            "closed": p.closed,
            "refused_s": None if p.refused_at is None else p.refused_at - t_kill,
            "waiting_for_leader": waiting,
            "ack_gap_before_s": before, "ack_gap_after_s": after,
            "ack_latency_p50_before_s": _median(latencies_before),
            "ack_latency_max_after_s": max(latencies_after, default=None),
            "delivery_gap_before_s": d_before, "delivery_gap_after_s": d_after,
        })
    figures: dict[str, float | None] = {
        "down_s": _worst([r["down_s"] for r in reported.values()]),
        "suspected_s": _worst([r["suspected_s"] for r in reported.values()]),
        "controller_moved_s": (_worst([r["controller_moved_s"] for r in reported.values()])
                               if was_controller else None),
        "ack_gap_before_s": max(r["ack_gap_before_s"] for r in per_pub),
        "ack_gap_after_s": max(r["ack_gap_after_s"] for r in per_pub),
        "ack_latency_max_after_s": _worst([r["ack_latency_max_after_s"] for r in per_pub]),
        "delivery_gap_before_s": max(r["delivery_gap_before_s"] for r in per_pub),
        "delivery_gap_after_s": max(r["delivery_gap_after_s"] for r in per_pub),
        "admin_poll_p50_s": _median(polls), "admin_poll_max_s": max(polls, default=None),
        # the victim's partitions: the time until each of their publishers was told
        "victim_partitions_refused_s": _worst([r["refused_s"] for r in per_pub
                                               if r["partition_led_by_victim"]]),
        # acknowledged by the victim, not delivered before it died (sent again after its
        # restart: cluster/nodecatchup.py; not restarted here)
        "victim_partitions_waiting": sum(r["waiting_for_leader"] for r in per_pub),
    }
    for led in (True, False):
        rows = [r for r in per_pub if r["partition_led_by_victim"] is led]
        key = "victim_partitions" if led else "other_partitions"
        figures[f"ack_gap_after_{key}_s"] = max(
            (float(r["ack_gap_after_s"]) for r in rows), default=None)
    if must_go_down and figures["down_s"] is None:
        problems.append("no survivor reported the killed node down before the end")
    return {"ok": not problems, "problems": problems, "victim": victim.name,
            "victim_was_controller": was_controller, "controller_before": state["controller"],
            "controller_after": (final.get("metadata") or {}).get("controller"),
            "partitions_led_by_victim": led_by_victim, "reported": reported,
            "admin_polls": len(polls), "admin_polls_failed": failed_polls,
            "figures": figures, "publishers": per_pub}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _worst(values: list[float | None]) -> float | None:
    """The largest, or None when any is None (not observed)."""
    if any(v is None for v in values) or not values:
        return None
    return max(v for v in values if v is not None)
