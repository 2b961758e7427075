"""The timer wheel of CONNECT deadlines and keep-alive checks (broker/deadlines.py), with an
injected clock: no event loop, no sleeping."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from meshmq.broker.deadlines import RESOLUTION, KeepAliveWheel, TimerWheel


@dataclass(eq=False)
class Conn:
    """What the wheel reads of a connection."""

    name: str
    last_read: float = 0.0
    keep_alive_limit: float = 0.0


def connected(wheel: KeepAliveWheel[Conn], name: str, keep_alive: int, now: float) -> Conn:
    conn = Conn(name, last_read=now, keep_alive_limit=keep_alive * 1.5)
    wheel.watch(conn)
    return conn


def accepted_then_connected(wheel: KeepAliveWheel[Conn], timeout: float, last_read: float,
                            limit: float) -> Conn:
    """A connection accepted at 0 with ``timeout`` to send CONNECT, CONNACKed after reading at
    ``last_read`` with a keep-alive limit of ``limit``."""
    conn = Conn("c")
    wheel.await_connect(conn, now=0.0, timeout=timeout)
    conn.last_read, conn.keep_alive_limit = last_read, limit
    wheel.watch(conn)
    return conn


def run_until(wheel: KeepAliveWheel[Conn], start: float, end: float,
              step: float = 0.01) -> dict[str, float]:
    """Check the wheel every ``step`` seconds, like a loop would; name -> when it expired."""
    expired: dict[str, float] = {}
    ticks = round((end - start) / step)
    for tick in range(ticks + 1):
        now = start + tick * step
        for conn in wheel.expired(now):
            expired[conn.name] = now
    return expired


def test_a_silent_client_expires_at_one_and_a_half_keep_alive_not_before() -> None:
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    connected(wheel, "silent", keep_alive=10, now=100.0)
    assert run_until(wheel, 100.0, 114.99) == {}
    when = run_until(wheel, 115.0, 120.0)["silent"]
    assert 115.0 <= when <= 115.0 + RESOLUTION  # MQTT-3.1.2-24, at most one slot late
    assert len(wheel) == 0


def test_a_client_that_reads_is_kept_and_expires_after_its_last_read() -> None:
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    talker = connected(wheel, "talker", keep_alive=4, now=0.0)  # limit 6 s
    for now in (2.0, 5.5, 11.0):  # a read every < 6 s: stamped only, the wheel is not told
        assert run_until(wheel, now - 2.0 if now > 2.0 else 0.0, now) == {}
        talker.last_read = now
    assert run_until(wheel, 11.0, 16.99) == {}
    assert 17.0 <= run_until(wheel, 17.0, 18.0)["talker"] <= 17.0 + RESOLUTION


def test_the_connect_deadline_is_absolute_and_discard_forgets() -> None:
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    waiting, gone = Conn("waiting"), Conn("gone")
    wheel.await_connect(waiting, now=0.0, timeout=10.0)
    wheel.await_connect(gone, now=0.0, timeout=10.0)
    waiting.last_read = 9.0  # bytes that are not a CONNECT do not buy time
    wheel.discard(gone)
    assert run_until(wheel, 0.0, 9.99) == {}
    assert set(run_until(wheel, 10.0, 10.5)) == {"waiting"}
    assert len(wheel) == 0


def test_connack_replaces_the_connect_deadline() -> None:
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    accepted_then_connected(wheel, timeout=2.0, last_read=1.0, limit=30.0)
    assert run_until(wheel, 0.0, 30.95, step=0.05) == {}
    assert "c" in run_until(wheel, 31.0, 31.5)


def test_an_earlier_connect_deadline_stays_and_files_the_keep_alive_check_when_due() -> None:
    """CONNACK within the CONNECT timeout, with a longer keep alive: no wheel work then; at
    the CONNECT deadline the connection is only filed again, and expires at its keep alive."""
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    conn = Conn("c")
    wheel.await_connect(conn, now=0.0, timeout=10.0)
    slots = dict(wheel._slot_of)
    conn.last_read, conn.keep_alive_limit = 0.5, 90.0
    wheel.watch(conn)
    assert wheel._slot_of == slots  # left where it was
    assert wheel.expired(10.0) == [] and wheel.next_due() == 90.5  # filed again, not expired
    assert run_until(wheel, 10.0, 90.45, step=0.05) == {}
    assert "c" in run_until(wheel, 90.5, 91.0)


def test_a_keep_alive_shorter_than_the_connect_deadline_moves_the_check_earlier() -> None:
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    accepted_then_connected(wheel, timeout=10.0, last_read=0.5, limit=3.0)
    assert wheel.next_due() == 3.5
    assert set(run_until(wheel, 0.0, 3.8)) == {"c"}


def test_excused_silence_restarts_when_the_broker_stopped_reading() -> None:
    """While the broker reads nobody (pause_input), a silent client is not its own fault."""
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    conn = connected(wheel, "held", keep_alive=2, now=0.0)
    assert wheel.expired(3.5, excused=True) == []
    assert conn.last_read == 3.5
    assert wheel.expired(6.4) == [] and wheel.expired(6.5 + RESOLUTION) == [conn]


def test_ten_thousand_idle_clients_cost_nothing_until_a_deadline_is_near() -> None:
    """Each idle client is looked at once per keep-alive period, not once per tick."""
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    conns = [connected(wheel, f"c{i}", keep_alive=60, now=i / 1000) for i in range(10_000)]
    assert wheel.next_due() is not None and wheel.next_due() >= 90.0  # type: ignore[operator]
    assert wheel.pop_due(89.99) == []  # nothing due: nothing touched
    for conn in conns:
        conn.last_read = 50.0  # every client spoke once
    assert wheel.expired(100.0) == [] and len(wheel) == 10_000  # re-filed, at 50 + 90 s
    assert wheel.next_due() == 140.0
    assert len(wheel.expired(140.0)) == 10_000


@given(st.lists(st.floats(0, 100, allow_nan=False), min_size=1, max_size=30),
       st.lists(st.floats(0, 0.7, allow_nan=False), min_size=1, max_size=400))
def test_never_early_and_at_most_one_slot_late(deadlines: list[float],
                                               steps: list[float]) -> None:
    wheel: TimerWheel[int] = TimerWheel()
    for item, deadline in enumerate(deadlines):
        wheel.add(item, deadline)
    now, previous = 0.0, 0.0
    for step in [*steps, 200.0]:
        now += step
        for item in wheel.pop_due(now):
            assert deadlines[item] <= now + 1e-9  # never early
            # Found at the first check after its slot ended, which is at most RESOLUTION late.
            assert previous < deadlines[item] + RESOLUTION + 1e-9
        previous = now
    assert len(wheel) == 0


def test_only_a_new_slot_asks_for_the_timer_and_a_storm_shares_slots() -> None:
    """``add``, ``await_connect`` and ``watch`` say True only when a slot was opened: the
    broker re-arms its one loop timer then (an existing slot already has it armed)."""
    wheel: KeepAliveWheel[Conn] = KeepAliveWheel()
    storm = [Conn(f"c{i}") for i in range(1000)]
    opened = [wheel.await_connect(conn, now=1.05 + i / 10_000, timeout=30.0)
              for i, conn in enumerate(storm)]
    assert opened.count(True) == 1 and opened[0]  # 0.1 s of accepts: one slot at 31.25 s
    assert wheel.next_due() == 31.25
    assert not wheel.await_connect(storm[0], now=1.1, timeout=30.0)  # filed there already
    storm[1].keep_alive_limit, storm[1].last_read = 15.0, 1.0  # CONNACK, keep alive 10 s
    assert wheel.watch(storm[1])  # due before the CONNECT deadline: a slot of its own
    assert [conn.name for conn in wheel.expired(16.0)] == ["c1"]  # silent for 15 s
    assert wheel.add(Conn("late"), 40.0) and not wheel.add(Conn("later"), 39.9)
    assert len(wheel.expired(31.25)) == 999  # no CONNECT in time, the same slot for all
