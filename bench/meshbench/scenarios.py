"""The scenario suite: what each scenario runs, in its full and ``--quick`` sizes.

Every throughput scenario keeps about ``IN_FLIGHT`` deliveries outstanding end to end: each
publisher may be at most ``lead`` messages ahead of the slowest subscriber that hears it (and,
at QoS 1, has at most ``window`` unacknowledged publishes), so neither broker is measured with
an ever-growing backlog in socket buffers, and the drain after the window is short.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from meshbench.brokers import INFLIGHT, LOSSLESS_MESHMQ
from meshbench.secure import PASSWORD, USERNAME

IN_FLIGHT = 10_000  # deliveries outstanding end to end in throughput scenarios
STORM_RATE = 2000  # storm: messages/s of the established QoS 1 stream
CONCURRENCY = 64  # idle and storm: handshakes in flight (connect() to CONNACK)
# An idle scenario's connect phase lasts about half a second, so one run is at the mercy of
# half a second of a shared machine: each runs 3 times by default, alternating brokers.
IDLE_REPEATS = 3
TWO_WORKERS: dict[str, object] = {"server.workers": 2}
LOG_OFF: dict[str, object] = {"log.enabled": False, **LOSSLESS_MESHMQ}
LOG_ON: dict[str, object] = {"log.enabled": True, "log.fsync": "always", **LOSSLESS_MESHMQ}
# The log on with fsync every second: a PUBACK once the record is written to the OS.
LOG_INTERVAL: dict[str, object] = {**LOG_ON, "log.fsync": "interval",
                                   "log.fsync_interval_ms": 1000}


@dataclass(frozen=True)
class Timing:
    warmup: float  # seconds of traffic before the measured window
    duration: float  # seconds measured
    drain: float  # seconds without progress after which missing messages are counted


FULL = Timing(warmup=2.0, duration=10.0, drain=10.0)
QUICK = Timing(warmup=0.5, duration=1.5, drain=5.0)


@dataclass(frozen=True)
class Scenario:
    """One workload. ``reference``: a meshmq-only variant is compared with Mosquitto's figures
    from that scenario (e.g. meshmq with its commit log on against Mosquitto, which has none)."""

    name: str
    title: str
    mode: str  # throughput | latency | idle | storm (loadgen --mode)
    topology: str = "fanin"  # fanin | fanout | pairs
    pubs: int = 1
    subs: int = 1
    stalled: int = 0
    qos: int = 0
    rate: float = 0.0  # latency: messages/s in total
    conns: int = 0  # idle: connections; storm: clients connecting during the window
    size: int = 64
    meshmq: dict[str, object] = field(default_factory=dict)
    brokers: tuple[str, ...] = ("meshmq", "mosquitto")
    reference: str | None = None
    protocol: int | None = None  # MQTT level for this scenario (None: the run's --protocol)
    auth: bool = False  # both brokers with a password file; every client logs in
    tls: bool = False  # both brokers with a TLS 1.3 listener and the same certificate
    broker_cpus: str | None = None  # taskset list for this scenario's broker (None: the run's)
    loadgen_unpinned: bool = False  # the load generator shares the broker's CPUs (workers)
    repeats: int = 1  # runs per broker unless --repeat says otherwise (figures are medians)

    def receivers_per_message(self) -> int:
        return self.subs if self.topology in ("fanin", "fanout") else 1

    def lead(self) -> int:
        """Messages a publisher may be ahead of its slowest subscriber."""
        return max(1, IN_FLIGHT // (self.pubs * self.receivers_per_message()))

    def window(self) -> int:
        return min(INFLIGHT, self.lead())

    def loadgen_args(self, timing: Timing, protocol: int) -> list[str]:
        args = ["--mode", self.mode, "--protocol", str(self.protocol or protocol),
                "--drain", str(timing.drain)]
        if self.auth:
            args += ["--username", USERNAME, "--password", PASSWORD]
        if self.tls:
            args.append("--tls")
        if self.mode in ("idle", "storm"):
            args += ["--conns", str(self.conns), "--concurrency", str(CONCURRENCY)]
        if self.mode == "idle":
            return args
        args += [
            "--topology", self.topology, "--pubs", str(self.pubs), "--subs", str(self.subs),
            "--stalled", str(self.stalled), "--qos", str(self.qos), "--size", str(self.size),
            "--warmup", str(timing.warmup), "--duration", str(timing.duration),
            "--lead", str(self.lead()), "--window", str(self.window()),
        ]
        if self.mode in ("latency", "storm"):
            args += ["--rate", str(self.rate)]
        return args


def suite(quick: bool = False) -> list[Scenario]:
    """Every scenario, in run order; ``quick`` shrinks the big connection counts."""
    fanout_subs = 1000
    idle_conns = 2000 if quick else 10_000
    return [
        Scenario("fanin_qos0", "fan-in QoS 0 (10 pub -> 1 wildcard sub)", "throughput",
                 pubs=10, subs=1, qos=0),
        Scenario("fanin_qos1", "fan-in QoS 1, log off", "throughput", pubs=10, subs=1, qos=1,
                 meshmq=LOG_OFF),
        Scenario("fanin_qos1_log", "fan-in QoS 1, meshmq log on (fsync always)", "throughput",
                 pubs=10, subs=1, qos=1, meshmq=LOG_ON, brokers=("meshmq",),
                 reference="fanin_qos1"),
        Scenario("fanin_qos1_log_interval", "fan-in QoS 1, meshmq log on (fsync interval)",
                 "throughput", pubs=10, subs=1, qos=1, meshmq=LOG_INTERVAL,
                 brokers=("meshmq",), reference="fanin_qos1"),
        Scenario("fanout_qos0", f"fan-out QoS 0 (1 pub -> {fanout_subs} subs)", "throughput",
                 topology="fanout", pubs=1, subs=fanout_subs, qos=0),
        Scenario("pairs_qos1", "100 pub/sub pairs QoS 1, log off", "throughput",
                 topology="pairs", pubs=100, subs=100, qos=1, meshmq=LOG_OFF),
        Scenario("pairs_qos1_log", "100 pairs QoS 1, meshmq log on (fsync always)",
                 "throughput", topology="pairs", pubs=100, subs=100, qos=1, meshmq=LOG_ON,
                 brokers=("meshmq",), reference="pairs_qos1"),
        Scenario("pairs_qos1_log_interval", "100 pairs QoS 1, meshmq log on (fsync interval)",
                 "throughput", topology="pairs", pubs=100, subs=100, qos=1,
                 meshmq=LOG_INTERVAL, brokers=("meshmq",), reference="pairs_qos1"),
        Scenario("latency_qos0", "latency QoS 0 at 10k msg/s", "latency", pubs=1, subs=1,
                 qos=0, rate=10_000),
        Scenario("latency_qos1", "latency QoS 1 at 10k msg/s, log off", "latency", pubs=1,
                 subs=1, qos=1, rate=10_000, meshmq=LOG_OFF),
        Scenario("latency_qos1_log", "latency QoS 1 at 10k msg/s, meshmq log on (fsync always)",
                 "latency", pubs=1, subs=1, qos=1, rate=10_000, meshmq=LOG_ON,
                 brokers=("meshmq",), reference="latency_qos1"),
        Scenario("latency_qos1_log_interval",
                 "latency QoS 1 at 10k msg/s, meshmq log on (fsync interval)", "latency",
                 pubs=1, subs=1, qos=1, rate=10_000, meshmq=LOG_INTERVAL, brokers=("meshmq",),
                 reference="latency_qos1"),
        Scenario("latency8_qos1", "latency QoS 1 at 10k msg/s from 8 pairs, log off",
                 "latency", topology="pairs", pubs=8, subs=8, qos=1, rate=10_000,
                 meshmq=LOG_OFF),
        Scenario("latency8_qos1_log",
                 "latency QoS 1 at 10k msg/s from 8 pairs, meshmq log on (fsync always)",
                 "latency", topology="pairs", pubs=8, subs=8, qos=1, rate=10_000,
                 meshmq=LOG_ON, brokers=("meshmq",), reference="latency8_qos1"),
        Scenario("latency8_qos1_log_syncfs",
                 "the same with log.syncfs_min_partitions = 2 (one syncfs a turn)", "latency",
                 topology="pairs", pubs=8, subs=8, qos=1, rate=10_000,
                 meshmq={**LOG_ON, "log.syncfs_min_partitions": 2}, brokers=("meshmq",),
                 reference="latency8_qos1"),
        Scenario("idle", f"{idle_conns:,} idle connections", "idle", conns=idle_conns,
                 repeats=IDLE_REPEATS),
        Scenario("idle_v5", f"{idle_conns:,} idle connections, MQTT 5.0", "idle",
                 conns=idle_conns, protocol=5, repeats=IDLE_REPEATS),
        Scenario("idle_auth", f"{idle_conns:,} idle connections, password file", "idle",
                 conns=idle_conns, auth=True, repeats=IDLE_REPEATS),
        Scenario("idle_auth_v5", f"{idle_conns:,} idle connections, password file, MQTT 5.0",
                 "idle", conns=idle_conns, auth=True, protocol=5, repeats=IDLE_REPEATS),
        Scenario("idle_tls", f"{idle_conns:,} idle connections, TLS 1.3", "idle",
                 conns=idle_conns, tls=True, repeats=IDLE_REPEATS),
        Scenario("idle_workers2", f"{idle_conns:,} idle connections, meshmq 2 workers", "idle",
                 conns=idle_conns, meshmq=TWO_WORKERS, brokers=("meshmq",), reference="idle",
                 broker_cpus="0,1", loadgen_unpinned=True, repeats=IDLE_REPEATS),
        Scenario("stalled", "fan-in QoS 0 with a 2nd subscriber that stops reading",
                 "throughput", pubs=10, subs=1, stalled=1, qos=0),
        Scenario("storm_qos1", f"QoS 1 stream at {STORM_RATE:,} msg/s while {idle_conns:,}"
                 " clients connect", "storm", pubs=1, subs=1, qos=1, rate=STORM_RATE,
                 conns=idle_conns, meshmq=LOG_OFF),
        Scenario("storm_qos1_workers2", "the same, meshmq 2 workers", "storm", pubs=1, subs=1,
                 qos=1, rate=STORM_RATE, conns=idle_conns, meshmq={**LOG_OFF, **TWO_WORKERS},
                 brokers=("meshmq",), reference="storm_qos1", broker_cpus="0,1",
                 loadgen_unpinned=True),
    ]


def select(scenarios: list[Scenario], names: list[str] | None) -> list[Scenario]:
    """The scenarios named (in suite order), plus the references they need."""
    if not names:
        return scenarios
    known = {s.name for s in scenarios}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown scenario {unknown[0]!r}; known: {', '.join(sorted(known))}")
    wanted = set(names)
    wanted |= {s.reference for s in scenarios if s.name in wanted and s.reference}
    return [s for s in scenarios if s.name in wanted]
