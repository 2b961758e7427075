"""Admission: CIDR allow/deny per listener, max connections per listener and per source IP.

Property tests for the CIDR parser and the admission bookkeeping (no I/O), then a real broker:
refused connections get the documented answer while an honest client elsewhere is unaffected.
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tlscerts import make_pki, tls_section

from conftest import WAIT, BrokerProcess, start_broker, wait_for
from meshmq.broker.transport.admission import (
    MAX_REFUSING,
    Admission,
    NetworkRules,
    Ticket,
    Verdict,
    parse_networks,
    peer_address,
)
from meshmq.config import ConfigError, load_config
from meshmq.mqtt.codec import decode_packet, encode_packet, parse_fixed_header
from meshmq.mqtt.packets import Connack, Connect
from rawclient import RawClient

# ---------------------------------------------------------------------------- the CIDR parser

networks = st.one_of(
    st.builds(lambda a, p: ipaddress.ip_network(f"{a}/{p}", strict=False),
              st.ip_addresses(v=4), st.integers(0, 32)),
    st.builds(lambda a, p: ipaddress.ip_network(f"{a}/{p}", strict=False),
              st.ip_addresses(v=6), st.integers(0, 128)),
)


@given(st.lists(networks, max_size=6), st.sampled_from([",", ", ", " , ", ",\t"]))
def test_network_lists_round_trip(items, separator) -> None:
    assert parse_networks(separator.join(str(n) for n in items)) == tuple(items)


@given(st.text(max_size=80))
def test_any_text_parses_or_gives_one_line_naming_the_item(text) -> None:
    try:
        parsed = parse_networks(text)
    except ValueError as exc:
        message = str(exc)
        assert "\n" not in message and "is not an IP network" in message
        return
    assert all(isinstance(n, ipaddress.IPv4Network | ipaddress.IPv6Network) for n in parsed)


@given(st.lists(st.sampled_from(["", " ", "\t"]), max_size=4))
def test_empty_items_are_ignored(blanks) -> None:
    assert parse_networks(",".join([*blanks, "10.0.0.0/8", *blanks])) == (
        ipaddress.ip_network("10.0.0.0/8"),)


def test_host_bits_and_bare_addresses() -> None:
    assert parse_networks("10.1.2.3/8, ::1") == (
        ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("::1/128"))


def test_rules_deny_wins_and_empty_allow_means_any() -> None:
    rules = NetworkRules.parse("127.0.0.0/8", "127.0.0.2")
    assert rules.permits(peer_address("127.0.0.1"))
    assert not rules.permits(peer_address("127.0.0.2"))  # in both: deny wins
    assert not rules.permits(peer_address("10.0.0.1"))  # outside the allow list
    assert NetworkRules.parse("", "10.0.0.0/8").permits(peer_address("192.0.2.1"))
    assert NetworkRules().permits(peer_address("2001:db8::1"))
    # an IPv4 client reaching a dual-stack socket shows up as ::ffff:a.b.c.d
    assert not NetworkRules.parse("", "192.0.2.0/24").permits(peer_address("::ffff:192.0.2.7"))


@pytest.mark.parametrize("key", ["server.allow", "tls.deny", "ws.allow", "wss.deny"])
def test_a_bad_cidr_is_a_one_line_config_error(key) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides={key: "10.0.0.0/8, 10.0.0.0/33"})
    assert str(info.value) == (f"{key}: '10.0.0.0/33' is not an IP network (CIDR such as"
                               " 10.0.0.0/8 or 2001:db8::/32)")


# ---------------------------------------------------------------------------- bookkeeping

hosts = st.sampled_from(["10.0.0.1", "10.0.0.2", "::ffff:10.0.0.1", "192.0.2.9"])
operations = st.lists(st.one_of(st.tuples(st.sampled_from(["admit", "ticket", "admitted"]),
                                          hosts),
                                st.tuples(st.just("release"), st.integers(0, 50))), max_size=80)


@given(operations, st.integers(0, 4), st.integers(0, 3), st.integers(0, 3))
def test_admission_counts_stay_consistent(ops, max_connections, per_ip, max_refusing) -> None:
    admission = Admission(NetworkRules.parse("", "192.0.2.0/24"), max_connections, per_ip,
                          max_refusing)
    held = []
    for op, arg in ops:
        if op == "admit":
            decision = admission.admit(arg)
            if arg == "192.0.2.9":
                assert decision.verdict is Verdict.DENIED and decision.ticket is None
            if decision.ticket is not None:
                held.append(decision.ticket)
        elif op in ("ticket", "admitted"):  # admit() only on a refusal; "admitted": the
            counts = (admission.active, admission.refusing,  # tcp listener's accept path
                      dict(admission.per_ip), dict(admission.counters))
            ticket = admission.ticket(arg) if op == "ticket" else admission.admitted(arg)
            if ticket is None:  # nothing counted; admit() refuses it and says why
                assert counts == (admission.active, admission.refusing, admission.per_ip,
                                  admission.counters)
                decision = admission.admit(arg)
                assert decision.verdict is not Verdict.ADMITTED and decision.why
                ticket = decision.ticket
            if ticket is not None:
                held.append(ticket)
        elif held:
            release(admission, held.pop(arg % len(held)))
        assert admission.active == sum(admission.per_ip.values())
        assert all(count > 0 for count in admission.per_ip.values())
        assert not max_connections or admission.active <= max_connections
        assert not per_ip or all(count <= per_ip for count in admission.per_ip.values())
        assert 0 <= admission.refusing <= max_refusing
        assert "::ffff:10.0.0.1" not in admission.per_ip  # counted as 10.0.0.1
    for ticket in held:
        release(admission, ticket)
    assert (admission.active, admission.refusing, admission.per_ip) == (0, 0, {})


def release(admission: Admission, held: Ticket | str) -> None:
    """A ticket is released twice (the second call changes nothing); a key from ``admitted``
    once, as its holder must."""
    if isinstance(held, str):
        admission.release(held)
    else:
        held.release()
        held.release()


# ---------------------------------------------------------------------------- a real broker


def wait_log(broker: BrokerProcess, *parts: str) -> str:
    def line() -> str | None:
        return next((text for text in broker.log().splitlines()
                     if all(part in text for part in parts)), None)

    return wait_for(line, what=f"a log line with {parts}")


def closed_without_a_word(port: int) -> tuple[bool, int]:
    """Connect, send CONNECT, and see whether the broker closes with no answer at all."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as sock:
        local = sock.getsockname()[1]
        try:
            sock.sendall(encode_packet(Connect("refused"), 5))
            answer = sock.recv(100)
        except (ConnectionResetError, BrokenPipeError):
            answer = b""
    return answer == b"", local


def read_to_end(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def honest_round_trip(port: int, client_factory, client_id: str, transport: str = "tcp") -> None:
    client = client_factory(client_id, 5, transport=transport)
    if transport == "websockets":
        client.paho.ws_set_options(path="/mqtt")
    client.connect(port)
    client.subscribe(f"honest/{client_id}", qos=1)
    client.publish(f"honest/{client_id}", b"still served", qos=1)
    assert client.expect().payload == b"still served"
    client.disconnect()


def test_cidr_allow_list_refuses_at_accept(tmp_path, client_factory) -> None:
    broker = start_broker(tmp_path, '[server]\nallow = "10.0.0.0/8"\n'
                                    "[ws]\nenabled = true\nport = 0\n", "cidr")
    try:
        closed, local = closed_without_a_word(broker.port)
        assert closed
        wait_log(broker, f"connection refused at accept listener=tcp peer=127.0.0.1:{local} ",
                 "why=\"address not allowed by the listener's CIDR rules\"")
        honest_round_trip(broker.port_of("ws"), client_factory, "ws-honest", "websockets")
    finally:
        broker.stop()


def test_cidr_deny_wins_over_allow(tmp_path, client_factory) -> None:
    broker = start_broker(tmp_path, '[server]\nallow = "127.0.0.0/8"\n'
                                    '[ws]\nenabled = true\nport = 0\ndeny = "127.0.0.1/32"\n'
                                    'allow = "127.0.0.0/8"\n', "deny")
    try:
        honest_round_trip(broker.port, client_factory, "tcp-allowed")
        closed, local = closed_without_a_word(broker.port_of("ws"))
        assert closed
        wait_log(broker, f"connection refused at accept listener=ws peer=127.0.0.1:{local} ")
    finally:
        broker.stop()


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory):
    """tcp: at most 3 connections; ws: at most 2 per IP; tls: at most 2; wss: no limit."""
    directory = tmp_path_factory.mktemp("limited")
    pki = make_pki(directory / "pki")
    config = ("[server]\nmax_connections = 3\n"
              "[ws]\nenabled = true\nport = 0\nmax_connections_per_ip = 2\n"
              + tls_section(pki, max_connections=2)
              + "[wss]\nenabled = true\nport = 0\n")
    broker = start_broker(directory, config, "limited")
    yield broker, pki
    broker.stop()


def test_a_refused_client_still_sending_reads_its_connack_then_an_orderly_end(
        limited, raw_factory) -> None:
    """Refused over a limit, a client that pipelined more after its CONNECT must read the
    CONNACK 0x97 and then the end of the stream, not a reset (broker/transport/linger.py): the
    refusal closes gracefully like every other close."""
    broker, _ = limited
    held = [raw_factory(broker.port, 5) for _ in range(3)]
    for number, raw in enumerate(held):
        assert raw.connect(f"pipelined-held-{number}").reason_code == 0
    connect = encode_packet(Connect(client_id="pipelined-refused"), 5)
    pingreqs = b"\xc0\x00" * 100_000  # 200 kB behind the CONNECT, below the linger bound
    with socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT) as sock:
        sock.sendall(connect + pingreqs)
        received = b""
        while chunk := sock.recv(65536):  # a reset raises ConnectionResetError here
            received += chunk
    first, start, stop = parse_fixed_header(received, 0, len(received))
    connack = decode_packet(first, received[:stop], start, stop, 5)
    assert isinstance(connack, Connack) and connack.reason_code == 0x97
    assert received[stop:] == b""  # nothing but the CONNACK, then EOF
    for raw in held:
        raw.close()


def test_max_connections_per_listener(limited, raw_factory, client_factory) -> None:
    broker, _ = limited
    held = [raw_factory(broker.port, 5) for _ in range(3)]
    for number, raw in enumerate(held):
        assert raw.connect(f"held-{number}").reason_code == 0
    v5 = raw_factory(broker.port, 5)
    assert v5.connect("one-too-many").reason_code == 0x97  # Quota exceeded
    assert v5.closed()
    v311 = raw_factory(broker.port, 4)
    assert v311.connect("one-too-many-311").reason_code == 3  # Server unavailable
    assert v311.closed()
    wait_log(broker, "connection refused listener=tcp", "why='max_connections 3 reached'",
             "CONNACK 0x97 (3.1.1: 3)")
    honest_round_trip(broker.port_of("ws"), client_factory, "ws-during-limit", "websockets")
    for raw in held:  # held connections were never disturbed
        raw.send_bytes(b"\xc0\x00")  # PINGREQ
        assert raw.recv().type == 13  # PINGRESP
    held[0].close()

    def slot_freed() -> bool:
        probe = RawClient(broker.port, 5)
        try:
            return probe.connect("after-release").reason_code == 0
        finally:
            probe.close()

    wait_for(slot_freed, what="a slot freed by a closed connection")


def test_max_connections_per_ip_over_websocket(limited, client_factory) -> None:
    broker, _ = limited
    port = broker.port_of("ws")
    first = client_factory("ws-1", 5, transport="websockets")
    second = client_factory("ws-2", 5, transport="websockets")
    third = client_factory("ws-3", 5, transport="websockets")
    for client in (first, second, third):
        client.paho.ws_set_options(path="/mqtt")
    first.connect(port)
    second.connect(port)
    _, reason, _ = third.connect(port, expect_success=False)
    assert reason.value == 0x97
    wait_log(broker, "connection refused listener=ws", "max_connections_per_ip 2 reached")
    honest_round_trip(broker.port, client_factory, "tcp-during-ws-limit")
    first.disconnect()
    second.disconnect()


def test_max_connections_over_tls(limited, client_factory) -> None:
    broker, pki = limited
    port = broker.port_of("tls")
    clients = []
    for number in range(3):
        client = client_factory(f"tls-{number}", 5)
        client.paho.tls_set_context(pki.client_context())
        clients.append(client)
    clients[0].connect(port)
    clients[1].connect(port)
    _, reason, _ = clients[2].connect(port, expect_success=False)
    assert reason.value == 0x97  # the refusal travels over TLS too
    wait_log(broker, "connection refused listener=tls", "max_connections 2 reached")
    for client in clients[:2]:
        client.disconnect()


def test_surplus_connections_beyond_the_refusal_cap_close_at_accept(tmp_path) -> None:
    broker = start_broker(tmp_path, "[server]\nmax_connections = 1\n"
                                    "[mqtt]\nconnect_timeout = 30\n", "cap")
    sockets: list[socket.socket] = []
    try:
        admitted = RawClient(broker.port, 5)
        assert admitted.connect("the-one").reason_code == 0
        for _ in range(MAX_REFUSING):  # surplus connections that say nothing: held, bounded
            sockets.append(socket.create_connection(("127.0.0.1", broker.port), timeout=WAIT))
        wait_for(lambda: broker.log().count("why='max_connections 1 reached': CONNACK 0x97")
                 >= MAX_REFUSING, what="every surplus connection to be seen")
        closed, local = closed_without_a_word(broker.port)
        assert closed  # the cap is reached: closed at accept, nothing read
        wait_log(broker, f"connection refused at accept listener=tcp peer=127.0.0.1:{local} ",
                 "max_connections 1 reached")
        sockets[0].sendall(encode_packet(Connect("held"), 5))  # a held one gets its answer
        answer = read_to_end(sockets[0])
        first, start, stop = parse_fixed_header(answer, 0, len(answer))
        connack = decode_packet(first, answer[:stop], start, stop, 5)
        assert isinstance(connack, Connack) and connack.reason_code == 0x97
        admitted.send_bytes(b"\xc0\x00")
        assert admitted.recv().type == 13  # the admitted client never noticed
        admitted.close()
    finally:
        for sock in sockets:
            sock.close()
        broker.stop()


def test_bad_cidr_stops_meshmq_serve_with_one_line(tmp_path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text('[ws]\nenabled = true\nallow = "10.0.0.0/8, 300.0.0.0/8"\n')
    result = subprocess.run(
        [sys.executable, "-m", "meshmq", "serve", "--config", str(config), "--port", "0",
         "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == ("meshmq: error: ws.allow: '300.0.0.0/8' is not an IP network"
                             " (CIDR such as 10.0.0.0/8 or 2001:db8::/32)\n")
