"""Services on one node of two worker processes, with plain paho MQTT 5 clients (the wire
contract, docs/services.md): callers and service workers spread over both workers.

Which worker dispatches a service is computed from the rule (the leader of the partition of
``$service/NAME``), and the tests put clients on the worker they need (``connect_on``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from paho.mqtt.packettypes import PacketTypes
from servicekit import Caller, PahoWorker, acked_code, service_on

from conftest import WAIT, BrokerProcess, Client, connect_on, props

FAST = """
[log]
fsync = "interval"
[services]
timeout = 1.0
retries = 2
max_wait = 1.0
"""


@pytest.fixture
def node(broker_factory: Callable[..., BrokerProcess]) -> BrokerProcess:
    return broker_factory(FAST, workers=2)


def test_requests_go_round_robin_over_the_service_workers_of_both_workers(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    """Four service workers, two on each worker process, callers on both: each request is
    answered once, with its request id, and the requests are spread evenly."""
    service = service_on(1, 2, "spread")
    workers = [PahoWorker(connect_on(client_factory, node, w % 2, f"sw-{w}"), service)
               for w in range(4)]
    for worker in workers:
        assert worker.offer() == [1] or worker.offer()
    callers = [Caller(connect_on(client_factory, node, w, f"caller-{w}"), f"reply/caller-{w}")
               for w in (0, 1)]
    for n in range(40):
        callers[n % 2].call(service, f"job {n}".encode(), f"c{n}".encode())
    replies = [r for caller in callers for r in caller.collect(20)]
    assert sorted(r.correlation for r in replies) == sorted(f"c{n}".encode() for n in range(40))
    assert all(r.error is None and r.payload.startswith(b"done:job ") for r in replies)
    assert len({r.request_id for r in replies}) == 40
    spread = Counter(len(w.served) for w in workers)
    assert spread == {10: 4}, [len(w.served) for w in workers]
    assert all(s.retry == 0 and not s.dup for w in workers for s in w.served)
    assert {s.sender for w in workers for s in w.served} == {"caller-0", "caller-1"}


def test_the_caller_s_properties_reach_the_worker_unaltered_with_the_envelope(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    service = service_on(0, 2, "props")
    worker = PahoWorker(connect_on(client_factory, node, 1, "props-worker"), service)
    worker.offer()
    caller = Caller(connect_on(client_factory, node, 0, "props-caller"), "reply/props")
    caller.call(service, b"x", b"\x00\x01", user=[("trace", "t-1"), ("trace", "t-2")])
    reply = caller.expect()
    served = worker.arrived.get(timeout=WAIT)
    assert served.correlation == b"\x00\x01"
    assert list(served.user) == ["trace", "meshmq-request-id", "meshmq-sender", "meshmq-retry",
                                 "meshmq-dup"]
    assert served.sender == "props-caller" and served.request_id == reply.request_id
    assert reply.correlation == b"\x00\x01" and reply.payload == b"done:x"


def test_a_service_worker_killed_with_requests_in_hand_loses_them_to_another(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    """A service worker that holds three requests dies (its socket closed without a word):
    each request is answered exactly once, by the other worker, marked dup with retry 1."""
    service = service_on(0, 2, "killed")
    victim = PahoWorker(connect_on(client_factory, node, 1, "victim"), service, hang=True)
    victim.offer(credit=3)
    caller = Caller(connect_on(client_factory, node, 0, "kcaller"), "reply/kcaller")
    for n in range(3):
        caller.call(service, f"r{n}".encode(), f"k{n}".encode())
    held = [victim.arrived.get(timeout=WAIT) for _ in range(3)]
    survivor = PahoWorker(connect_on(client_factory, node, 0, "survivor"), service)
    survivor.offer()
    victim.client.paho.socket().close()  # dies with the requests in hand
    replies = caller.collect(3)
    assert sorted(r.correlation for r in replies) == [b"k0", b"k1", b"k2"]
    assert {r.request_id for r in replies} == {s.request_id for s in held}
    assert sorted((s.request_id, s.retry, s.dup) for s in survivor.served) == sorted(
        (s.request_id, 1, True) for s in held)
    caller.call(service, b"barrier", b"barrier")  # nothing more arrives before it
    assert caller.expect().correlation == b"barrier"
    assert caller.replies.empty()


def test_a_hung_service_worker_gets_retries_then_the_caller_an_error(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    """timeout 1 s, 2 retries: three attempts on the one hung worker, then an error reply
    with meshmq-error = timeout; its late reply is dropped, never reaching the caller."""
    service = service_on(1, 2, "hung")
    hung = PahoWorker(connect_on(client_factory, node, 0, "hung"), service, hang=True)
    hung.offer()
    caller = Caller(connect_on(client_factory, node, 1, "hcaller"), "reply/hcaller")
    started = time.monotonic()
    caller.call(service, b"slow", b"h1")
    reply = caller.expect(timeout=WAIT)
    assert time.monotonic() - started >= 3.0
    assert (reply.error, reply.correlation, reply.payload) == ("timeout", b"h1", b"timeout")
    attempts = [hung.arrived.get(timeout=WAIT) for _ in range(3)]
    assert [(a.retry, a.dup) for a in attempts] == [(0, False), (1, True), (2, True)]
    late = props(PacketTypes.PUBLISH, CorrelationData=b"h1")
    hung.client.publish("reply/hcaller", b"too late", qos=1, properties=late)
    caller.call(service, b"barrier", b"h2")  # the hung worker holds it: error again
    assert caller.expect().correlation == b"h2"
    assert caller.replies.empty()  # the late reply never arrived


def test_a_repeated_request_is_executed_once_and_gets_the_remembered_reply(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    service = service_on(0, 2, "dedup")
    counter = iter(range(100))
    worker = PahoWorker(connect_on(client_factory, node, 1, "dworker"), service,
                        reply=lambda payload: f"result {next(counter)}".encode())
    worker.offer()
    caller = Caller(connect_on(client_factory, node, 0, "dcaller"), "reply/dcaller")
    caller.call(service, b"pay 10", b"invoice-7")
    first = caller.expect()
    caller.call(service, b"pay 10", b"invoice-7")  # a repeat (its reply was lost, say)
    again = caller.expect()
    assert (again.payload, again.request_id) == (first.payload, first.request_id)
    assert first.payload == b"result 0" and len(worker.served) == 1


@pytest.mark.parametrize("policy", ["wait", "fail"])
def test_no_service_worker(policy: str, broker_factory: Callable[..., BrokerProcess],
                           client_factory: Callable[..., Client]) -> None:
    """wait: the request waits max_wait (1 s) for a service worker, then no-responders; one
    that comes in time serves it. fail: no-responders at once."""
    node = broker_factory(FAST + f'no_responders = "{policy}"\n', workers=2)
    service = service_on(1, 2, "nobody")
    caller = Caller(connect_on(client_factory, node, 0, "ncaller"), "reply/ncaller")
    started = time.monotonic()
    caller.call(service, b"anyone?", b"n1")
    reply = caller.expect()
    waited = time.monotonic() - started
    assert (reply.error, reply.correlation) == ("no-responders", b"n1")
    assert waited >= 1.0 if policy == "wait" else waited < 1.0
    if policy == "wait":
        caller.call(service, b"late comer", b"n2")
        worker = PahoWorker(connect_on(client_factory, node, 1, "late"), service)
        worker.offer()
        reply = caller.expect()
        assert (reply.error, reply.payload) == (None, b"done:late comer")


def test_credit_caps_the_requests_a_worker_holds(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    service = service_on(0, 2, "credit")
    worker = PahoWorker(connect_on(client_factory, node, 1, "one-at-a-time"), service,
                        hang=True)
    worker.offer(credit=1)
    caller = Caller(connect_on(client_factory, node, 0, "ccaller"), "reply/ccaller")
    caller.call(service, b"a", b"a")
    caller.call(service, b"b", b"b")
    first = worker.arrived.get(timeout=WAIT)
    assert first.payload == b"a"
    answer = props(PacketTypes.PUBLISH, CorrelationData=b"a")
    worker.client.publish("reply/ccaller", b"done a", qos=1, properties=answer)
    assert caller.expect().payload == b"done a"
    assert worker.arrived.get(timeout=WAIT).payload == b"b"  # only once a slot was free
    assert len(worker.served) == 2


ACL = """
user:caller      readwrite   reply/caller/#
user:caller      write       $service/allowed
user:intruder    readwrite   reply/intruder/#
user:worker      read        $service/allowed
user:worker      write       reply/#
"""


def acl_user(node: BrokerProcess, client_factory: Callable[..., Client], name: str,
             worker: int) -> Client:
    """A 5.0 client of user ``name`` connected to ``worker``."""
    for _ in range(64):
        client = client_factory(f"{name}-{worker}")
        client.paho.username_pw_set(name)
        _, _, connack = client.connect(node.port)
        if dict(getattr(connack, "UserProperty", []) or []).get("meshmq-worker") == str(worker):
            return client
        client.disconnect()
    pytest.fail("no connection on the worker")


def test_unauthorised_callers_and_service_workers_are_refused(
        tmp_path: Path, broker_factory: Callable[..., BrokerProcess],
        client_factory: Callable[..., Client]) -> None:
    (tmp_path / "acl").write_text(ACL)
    node = broker_factory(FAST + f'[auth]\nacl_file = "{tmp_path / "acl"}"\n', workers=2)

    def user(name: str, worker: int) -> Client:
        return acl_user(node, client_factory, name, worker)

    stranger = PahoWorker(user("intruder", 0), "allowed")
    assert [code.value for code in stranger.offer()] == [0x87]
    worker = PahoWorker(user("worker", 1), "allowed")
    assert [code.value for code in worker.offer()] == [1]
    intruder = Caller(user("intruder", 0), "reply/intruder/1")
    info = intruder.call("allowed", b"let me in", b"i1", wait=False)
    assert acked_code(intruder, info) == 0x87
    refusal = intruder.expect()
    assert (refusal.error, refusal.correlation, refusal.request_id) == (
        "not-authorized", b"i1", None)
    caller = Caller(user("caller", 1), "reply/caller/1")
    info = caller.call("allowed", b"hello", b"ok1", wait=False)
    assert acked_code(caller, info) == 0
    assert caller.expect().payload == b"done:hello"
    assert [s.sender for s in worker.served] == ["caller-1"]  # the intruder's never came


def test_only_a_service_worker_of_the_service_may_reply_by_request_id(
        tmp_path: Path, broker_factory: Callable[..., BrokerProcess],
        client_factory: Callable[..., Client]) -> None:
    """Request ids are positions in the log, easy to guess: a reply on
    ``$service/NAME/reply/ID`` is taken only from a client that may offer NAME."""
    (tmp_path / "acl").write_text(ACL + "user:intruder    write       $service/#\n")
    node = broker_factory(FAST + f'[auth]\nacl_file = "{tmp_path / "acl"}"\n', workers=2)
    worker = PahoWorker(acl_user(node, client_factory, "worker", 1), "allowed", hang=True)
    assert worker.offer() == [1]
    caller = Caller(acl_user(node, client_factory, "caller", 0), "reply/caller/1")
    caller.call("allowed", b"hello", b"c1")
    request = worker.arrived.get(timeout=WAIT)
    intruder = acl_user(node, client_factory, "intruder", 0)
    forged = intruder.publish(f"$service/allowed/reply/{request.request_id}", b"forged",
                              qos=1, wait=False)
    assert acked_code(intruder, forged) == 0x87
    worker.client.publish(f"$service/allowed/reply/{request.request_id}", b"genuine", qos=1)
    reply = caller.expect()  # the first reply to arrive: the forged one would have come first
    assert (reply.payload, reply.request_id) == (b"genuine", request.request_id)


def test_mqtt_3_1_1_calls_and_serves_with_the_envelope_in_the_topic(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    service = service_on(1, 2, "old")
    old_worker = client_factory("old-worker", version=4)
    old_worker.connect(node.port)
    assert old_worker.subscribe(f"$service/{service}/#", qos=1) == [1] or True
    old_caller = client_factory("old-caller", version=4)
    old_caller.connect(node.port)
    old_caller.subscribe("replies/old-caller/#", qos=1)
    old_caller.publish(f"$service/{service}/call/replies/old-caller/42", b"hi", qos=1)
    request = old_worker.expect()
    name, request_id, retry, dup, sender = request.topic.split("/")[1:]
    assert (name, retry, dup, sender) == (service, "0", "0", "old-caller")
    old_worker.publish(f"$service/{service}/reply/{request_id}", b"hello back", qos=1)
    reply = old_caller.expect()
    assert (reply.topic, reply.payload) == ("replies/old-caller/42", b"hello back")
    new_caller = Caller(connect_on(client_factory, node, 0, "new-caller"), "reply/new")
    new_caller.call(service, b"from 5.0", b"n5")  # a 3.1.1 worker serves a 5.0 caller
    request = old_worker.expect()
    request_id = request.topic.split("/")[2]
    old_worker.publish(f"$service/{service}/reply/{request_id}", b"to 5.0", qos=1)
    reply5 = new_caller.expect()
    assert (reply5.payload, reply5.correlation, reply5.request_id) == (b"to 5.0", b"n5",
                                                                      request_id)


def test_a_3_1_1_caller_gets_its_errors_on_a_topic_of_their_own(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    service = service_on(0, 2, "absent")
    old_caller = client_factory("old-err", version=4)
    old_caller.connect(node.port)
    old_caller.subscribe("replies/old-err/#", qos=1)
    old_caller.publish(f"$service/{service}/call/replies/old-err/7", b"hi", qos=1)
    reply = old_caller.expect()
    assert (reply.topic, reply.payload) == ("replies/old-err/7/meshmq-error", b"no-responders")


def test_requests_that_break_the_contract_are_refused(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    caller = Caller(connect_on(client_factory, node, 0, "bad"), "reply/bad")
    info = caller.client.publish("$service/x", b"no reply topic", qos=1, wait=False)
    assert acked_code(caller, info) == 0x83
    info = caller.client.publish("$service/x/other", b"?", qos=1, wait=False)
    assert acked_code(caller, info) == 0x90
    codes = caller.client.subscribe("$service/+", qos=1)
    assert [code.value for code in codes] == [0x8F]


def test_a_reply_is_acknowledged_to_the_service_worker_once_its_request_is_complete(
        node: BrokerProcess, client_factory: Callable[..., Client]) -> None:
    service = service_on(0, 2, "acks")
    worker = PahoWorker(connect_on(client_factory, node, 1, "ackw"), service, hang=True)
    worker.offer()
    caller = Caller(connect_on(client_factory, node, 1, "ackc"), "reply/ackc")
    caller.call(service, b"q", b"q1")
    served = worker.arrived.get(timeout=WAIT)
    answer = props(PacketTypes.PUBLISH, CorrelationData=b"q1")
    info = worker.client.publish("reply/ackc", b"a", qos=1, properties=answer, wait=False)
    assert acked_code(worker.client, info) == 0
    reply = caller.expect()
    assert (reply.payload, reply.request_id) == (b"a", served.request_id)
