"""Shared fixtures: a real broker process on an ephemeral port, and paho-mqtt client helpers."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from hypothesis import settings
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.packets import Connect
from rawclient import RawClient

WAIT = 10.0  # seconds any condition may take before a test fails

# Property tests run on loaded 2-core machines next to broker processes and a JVM: a per-example
# deadline would measure the machine, not the code.
settings.register_profile("meshmq", deadline=None)
settings.load_profile("meshmq")


def wait_for(condition: Callable[[], object], timeout: float = WAIT, what: str = "condition"):
    """Poll ``condition`` until it returns a truthy value; fail the test on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.01)


@dataclass
class BrokerProcess:
    """A ``meshmq serve`` subprocess listening on 127.0.0.1 at ``port``."""

    proc: subprocess.Popen
    port: int
    data_dir: Path
    log_path: Path
    ports: dict[str, int] = field(default_factory=dict)  # listener name (tcp, tls, ws, wss) -> port

    def port_of(self, listener: str) -> int:
        """The port of listener ``tcp``, ``tls``, ``ws`` or ``wss`` (from the port file)."""
        return self.ports[listener]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=WAIT)


def start_broker(tmp_path: Path, config: str = "", name: str = "broker",
                 bind: str = "127.0.0.1", workers: int = 1) -> BrokerProcess:
    """Start a broker with ``config`` (TOML text, merged after the defaults) and wait for it.

    Clients always connect to 127.0.0.1; ``bind`` only changes what the broker listens on.
    ``workers`` is ``server.workers`` (1 unless a test is about workers).
    """
    workdir = tmp_path / name
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "port"
    port_file.unlink(missing_ok=True)  # a restart must not read the previous run's port
    config_file = workdir / "meshmq.toml"
    config_file.write_text(config)
    log_path = workdir / "broker.log"
    cmd = [
        sys.executable, "-m", "meshmq", "serve", "--config", str(config_file),
        "--bind", bind, "--port", "0", "--data-dir", str(workdir / "data"),
        "--log-level", "debug", "--port-file", str(port_file), "--workers", str(workers),
    ]
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT)
    broker = BrokerProcess(proc, 0, workdir / "data", log_path)

    def ready() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"broker exited with {proc.returncode}:\n{broker.log()}")
        return port_file.exists() and port_file.read_text().strip() != ""

    try:
        wait_for(ready, what="broker to listen")
        first, *named = port_file.read_text().split()  # the TCP port, then name=port lines
        broker.port = int(first)
        broker.ports = {name: int(port) for name, port in (line.split("=") for line in named)}
    except BaseException:  # never leave a broker running behind a failed start
        proc.kill()
        proc.wait()
        raise
    return broker


async def _connect_one(port: int, index: int, version: int, gate: asyncio.Semaphore,
                       held: list[asyncio.StreamWriter]) -> int:
    """CONNECT one client and keep its socket open; return the CONNACK reason code."""
    async with gate:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(encode_packet(Connect(f"storm-{index}", version, keep_alive=600), version))
        header = await reader.readexactly(4)  # CONNACK: 2-byte fixed header, flags, code
        held.append(writer)
        if version == 5:
            await reader.readexactly(header[1] - 2)  # the properties
        return header[3]


async def connect_storm(port: int, count: int, version: int, in_flight: int = 200) -> Counter[int]:
    """``count`` clients CONNECT, ``in_flight`` handshakes at a time, and all stay connected
    until the last is answered; the CONNACK reason codes, counted."""
    gate = asyncio.Semaphore(in_flight)
    held: list[asyncio.StreamWriter] = []
    try:
        codes = await asyncio.gather(*(_connect_one(port, i, version, gate, held)
                                       for i in range(count)))
    finally:
        for writer in held:
            writer.close()
    return Counter(codes)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    proc = start_broker(tmp_path)
    yield proc
    proc.stop()


@pytest.fixture
def broker_factory(tmp_path: Path) -> Iterator[Callable[..., BrokerProcess]]:
    started: list[BrokerProcess] = []

    def factory(config: str = "", name: str = "broker", workers: int = 1) -> BrokerProcess:
        proc = start_broker(tmp_path, config, name, workers=workers)
        started.append(proc)
        return proc

    yield factory
    for proc in started:
        proc.stop()


@dataclass
class Client:
    """A paho-mqtt client running its network loop in a thread, with queues to wait on."""

    paho: mqtt.Client
    version: int
    messages: queue.Queue = field(default_factory=queue.Queue)
    connacks: queue.Queue = field(default_factory=queue.Queue)
    subacks: queue.Queue = field(default_factory=queue.Queue)
    unsubacks: queue.Queue = field(default_factory=queue.Queue)
    disconnects: queue.Queue = field(default_factory=queue.Queue)
    acked: queue.Queue = field(default_factory=queue.Queue)

    def connect(self, port: int, clean_start: bool = True, properties: Properties | None = None,
                keepalive: int = 60, expect_success: bool = True):
        if self.version == 5:
            self.paho.connect("127.0.0.1", port, keepalive=keepalive, clean_start=clean_start,
                              properties=properties)
        else:
            self.paho.connect("127.0.0.1", port, keepalive=keepalive)
        self.paho.loop_start()
        flags, reason, props = self.connacks.get(timeout=WAIT)
        if expect_success:
            assert not reason.is_failure, f"CONNACK refused: {reason}"
        return flags, reason, props

    def subscribe(self, topic, qos: int = 0, options=None, properties=None):
        if self.version == 5:
            opts = options or mqtt.SubscribeOptions(qos=qos)
            self.paho.subscribe(topic if isinstance(topic, list) else [(topic, opts)],
                                properties=properties)
        else:
            self.paho.subscribe(topic if isinstance(topic, list) else [(topic, qos)])
        return self.subacks.get(timeout=WAIT)

    def unsubscribe(self, topic, properties=None):
        self.paho.unsubscribe(topic, properties=properties)
        return self.unsubacks.get(timeout=WAIT)

    def publish(self, topic: str, payload: bytes | str = b"", qos: int = 0, retain: bool = False,
                properties: Properties | None = None, wait: bool = True) -> mqtt.MQTTMessageInfo:
        info = self.paho.publish(topic, payload, qos=qos, retain=retain, properties=properties)
        if wait and qos:
            info.wait_for_publish(timeout=WAIT)
            assert info.is_published()
        return info

    def expect(self, timeout: float = WAIT) -> mqtt.MQTTMessage:
        return self.messages.get(timeout=timeout)

    def expect_none(self, timeout: float = 0.5) -> None:
        """Assert no message arrives within ``timeout`` (use after a barrier message)."""
        try:
            msg = self.messages.get(timeout=timeout)
        except queue.Empty:
            return
        pytest.fail(f"unexpected message on {msg.topic}: {msg.payload!r}")

    def disconnect(self, properties: Properties | None = None, reasoncode=None) -> None:
        self.paho.disconnect(reasoncode=reasoncode, properties=properties)
        self.paho.loop_stop()


@pytest.fixture
def client_factory() -> Iterator[Callable[..., Client]]:
    clients: list[Client] = []

    def factory(client_id: str = "", version: int = 5, **kwargs) -> Client:
        protocol = mqtt.MQTTv5 if version == 5 else mqtt.MQTTv311
        # No silent reconnects behind a test's back (e.g. after a session takeover).
        kwargs.setdefault("reconnect_on_failure", False)
        extra = {} if version == 5 else {"clean_session": kwargs.pop("clean_session", True)}
        paho = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=protocol,
                           **extra, **kwargs)
        client = Client(paho, version)
        paho.on_connect = lambda c, u, flags, rc, props: client.connacks.put((flags, rc, props))
        paho.on_message = lambda c, u, msg: client.messages.put(msg)
        paho.on_subscribe = lambda c, u, mid, rcs, props: client.subacks.put(rcs)
        paho.on_unsubscribe = lambda c, u, mid, rcs, props: client.unsubacks.put(rcs)
        paho.on_disconnect = lambda c, u, flags, rc, props: client.disconnects.put(rc)
        paho.on_publish = lambda c, u, mid, rc, props: client.acked.put((mid, rc))
        clients.append(client)
        return client

    yield factory
    for client in clients:
        try:
            client.paho.disconnect()
        except Exception:
            pass
        client.paho.loop_stop()


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """One local SparkSession for the whole test run (start-up costs ~10 s).

    Every test module under ``tests/pipeline`` sets ``pytestmark =
    pytest.mark.xdist_group("spark")`` so that, with ``pytest -n 2 --dist loadgroup``, all Spark
    tests run in the same worker and share this session. It lives here, not in a
    ``tests/pipeline/conftest.py``: a second conftest module would shadow this one for the
    ``from conftest import ...`` lines of the other test modules.
    """
    pytest.importorskip("pyspark")
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    session = (
        SparkSession.builder.master("local[2]")
        .appName("meshmq-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.sql.session.timeZone", "UTC")
        # Test data is small: C1-only JIT and a serial GC halve JVM start-up on 2 busy cores.
        .config("spark.driver.extraJavaOptions", "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def raw_factory() -> Iterator[Callable[..., RawClient]]:
    """``raw_factory(port, version=5)`` -> a connected-socket ``RawClient``, closed at teardown."""
    made: list[RawClient] = []

    def factory(port: int, version: int = 5, **kwargs) -> RawClient:
        raw = RawClient(port, version, **kwargs)
        made.append(raw)
        return raw

    yield factory
    for raw in made:
        raw.close()


def props(packet_type: int = PacketTypes.PUBLISH, **values) -> Properties:
    """Build paho Properties, e.g. ``props(PacketTypes.CONNECT, SessionExpiryInterval=60)``."""
    result = Properties(packet_type)
    for name, value in values.items():
        setattr(result, name, value)
    return result


__all__ = ["WAIT", "BrokerProcess", "Client", "asks_positions", "props", "split_position",
           "start_broker", "threading", "wait_for"]


Pairs = list[tuple[str, str]]
POSITIONS_PAIR = ("meshmq-positions", "true")  # a CONNECT asking for log positions (replay.md)


def asks_positions(**values) -> Properties:
    """CONNECT properties asking for log positions on delivery, plus ``values`` (e.g.
    ``SessionExpiryInterval=60``)."""
    return props(PacketTypes.CONNECT, UserProperty=[POSITIONS_PAIR], **values)


def split_position(pairs: Pairs | None) -> tuple[Pairs, tuple[int, int] | None]:
    """For a client that asked for log positions (``asks_positions``): separate the
    ``meshmq-partition``/``meshmq-offset`` user properties, which come last, after the
    publisher's own; return (own pairs, (partition, offset)), or (pairs, None) if absent."""
    pairs = list(pairs or [])
    if [name for name, _ in pairs[-2:]] != ["meshmq-partition", "meshmq-offset"]:
        return pairs, None
    return pairs[:-2], (int(pairs[-2][1]), int(pairs[-1][1]))


def worker_of(connack_props: object) -> int:
    pairs = dict(getattr(connack_props, "UserProperty", []) or [])
    return int(pairs.get("meshmq-worker", 0))  # a single-process node: always "worker 0"


def connect_on(client_factory: Callable[..., Client], broker: BrokerProcess, worker: int,
               client_id: str = "", clean_start: bool = True, expiry: int = 0,
               **kwargs: object) -> Client:
    """A 5.0 client connected to ``worker`` (new connections until one lands there)."""
    for _ in range(64):
        client = client_factory(client_id, **kwargs)
        connect_props = props(PacketTypes.CONNECT, SessionExpiryInterval=expiry) if expiry else None
        _, _, connack = client.connect(broker.port, clean_start=clean_start,
                                       properties=connect_props)
        if worker_of(connack) == worker:
            return client
        client.disconnect()
    pytest.fail(f"no connection landed on worker {worker} in 64 tries")
