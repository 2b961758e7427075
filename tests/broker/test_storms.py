"""Connection storms: thousands of clients connecting at once, with the default configuration.

A fleet reconnects all at once after an outage or a restart. With ``make serve`` defaults every
client of such a storm must get in (``limits.connect_burst``), the broker must not run out of
file descriptors at the usual soft limit of 1024, and clients whose credentials were verified
before must not queue behind argon2 verifications of others.
"""

from __future__ import annotations

import asyncio
import resource
import select
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import connect_storm, start_broker
from meshmq.auth.passwords import hash_password, write_password_file
from meshmq.mqtt.packets import Connack, Connect, Disconnect, Pingreq, Pingresp
from rawclient import RawClient

STORM = 3000  # clients: three times the old default burst, CI-sized (a few seconds)


@pytest.fixture
def low_file_limit() -> Iterator[None]:
    """Start brokers with the common soft limit of 1024 descriptors; the test itself may use
    the hard limit for its clients."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < STORM + 256:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {STORM + 256}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("version", [4, 5])
def test_a_storm_of_3000_clients_all_get_in_with_the_defaults(tmp_path: Path, low_file_limit,
                                                               version: int) -> None:
    broker = start_broker(tmp_path, "", f"storm{version}")  # no configuration: the defaults
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # for this test's own clients
    try:
        codes = asyncio.run(connect_storm(broker.port, STORM, version))
        assert codes == Counter({0: STORM}), f"CONNACK codes {dict(codes)}"
        assert "why='connect rate'" not in broker.log()
    finally:
        broker.stop()


def test_known_credentials_do_not_wait_behind_argon2(tmp_path: Path) -> None:
    """A device whose password was verified before connects at once even while the pool is
    busy verifying a queue of others (here wrong passwords, about 30 ms of argon2 each: each
    a different one, as the same credentials in flight share one verification)."""
    passwords = tmp_path / "passwords"
    write_password_file(passwords, {"fleet": hash_password("s3cret"), "other": hash_password("x")})
    broker = start_broker(tmp_path, f'[auth]\npassword_file = "{passwords}"\n', "auth")
    try:
        with RawClient(broker.port, 5) as first:  # verified once: now cached
            assert first.connect("dev-0", username="fleet", password=b"s3cret").reason_code == 0
        queued = [RawClient(broker.port, 5) for _ in range(16)]
        for index, raw in enumerate(queued):
            raw.send(Connect(f"bad-{index}", 5, username="other", password=b"wrong-%d" % index))
        assert queued[0].recv_type(Connack).reason_code == 0x86  # the pool is at work
        with RawClient(broker.port, 5) as known:
            assert known.connect("dev-1", username="fleet", password=b"s3cret").reason_code == 0
            answered = 1 + sum(1 for raw in queued[1:] if select.select([raw.sock], [], [], 0)[0])
        # Before the cache was asked on the loop, dev-1 queued behind all 15 in the pool.
        assert answered < 10, f"{answered} of 16 slow verifications finished first"
        for raw in queued[1:]:
            assert raw.recv_type(Connack).reason_code == 0x86
        for raw in queued:
            raw.close()
    finally:
        broker.stop()


def test_silent_clients_are_dropped_at_one_and_a_half_keep_alive(broker) -> None:
    """200 clients with Keep Alive 2 s go silent: each is closed (5.0: DISCONNECT 0x8D) 3 s
    after its CONNACK, not before and at most a wheel slot (0.25 s) plus scheduling later;
    a client that pings meanwhile stays (MQTT-3.1.2-24)."""
    pinger = RawClient(broker.port, 5)
    assert pinger.connect("pinger", keep_alive=2).reason_code == 0
    silent: dict[RawClient, float] = {}
    for index in range(200):
        raw = RawClient(broker.port, 5)
        assert raw.connect(f"silent-{index}", keep_alive=2).reason_code == 0
        silent[raw] = time.monotonic()  # the broker counts from just before this CONNACK
    closed: dict[RawClient, float] = {}
    next_ping = time.monotonic() + 1.0
    while len(closed) < len(silent) and time.monotonic() < next_ping + 10:
        if time.monotonic() >= next_ping:
            pinger.send(Pingreq())
            pinger.recv_type(Pingresp)
            next_ping += 1.0
        open_ = [raw.sock for raw in silent if raw not in closed]
        ready, _, _ = select.select(open_, [], [], max(0.0, next_ping - time.monotonic()))
        for raw in silent:
            if raw.sock in ready and raw not in closed and raw.closed(timeout=1):
                closed[raw] = time.monotonic()
    assert len(closed) == len(silent), f"{len(silent) - len(closed)} silent clients still open"
    late = [closed[raw] - since for raw, since in silent.items()]
    assert min(late) >= 3.0 - 0.05, f"closed after {min(late):.2f} s, before 1.5 x 2 s"
    assert max(late) <= 3.0 + 0.25 + 0.75, f"closed after {max(late):.2f} s"
    assert all([(type(p), p.reason_code) for p in raw.packets()] == [(Disconnect, 0x8D)]
               for raw in silent)
    pinger.send(Pingreq())  # the barrier: it is still served
    pinger.recv_type(Pingresp)
    for raw in silent:
        raw.close()
    pinger.close()
