"""The dispatcher of one service, sans I/O: requests, offers, replies and time passed by hand.

Each test drives a ``Dispatcher`` (services/dispatcher.py) with the events its owner would
feed it and checks the actions it asks for: which worker gets which attempt, what is recorded,
what reaches the caller. The clock is a number the test moves.
"""

from __future__ import annotations

from collections import Counter

import pytest

from meshmq.broker.message import Message
from meshmq.mqtt.properties import PropertyId
from meshmq.services import envelope
from meshmq.services.dispatcher import (
    Commit,
    Deliver,
    Dispatcher,
    Note,
    Phase,
    Request,
    Respond,
    Verdict,
)
from meshmq.services.settings import FAIL, LEAST_LOADED, ServiceSettings

ME = 0


class Scene:
    """A dispatcher, its clock, and a record of what reached callers and workers."""

    def __init__(self, **settings: object) -> None:
        self.now = 100.0
        self.dispatcher = Dispatcher("billing", ServiceSettings(**settings), ME)  # type: ignore[arg-type]
        self.offset = 0
        self.delivered: list[Deliver] = []
        self.notes: list[Note] = []
        self.responded: list[Message] = []
        self.commits: list[Request] = []
        self.auto_commit = True

    def request(self, caller: str = "c1", correlation: bytes | None = None) -> Request:
        self.offset += 1
        if correlation is None:
            correlation = f"corr-{self.offset}".encode()
        message = Message("$service/billing", b"ask", 1, False, {
            PropertyId.RESPONSE_TOPIC: f"reply/{caller}",
            PropertyId.CORRELATION_DATA: correlation}, caller)
        request = Request(envelope.request_id(3, self.offset), self.offset, caller,
                          f"reply/{caller}", correlation, message, self.now)
        self.dispatcher.arrive(request, self.now)
        self.run()
        return request

    def run(self) -> None:
        """Carry out the dispatcher's actions (commits become durable at once unless told)."""
        while self.dispatcher.actions:
            actions, self.dispatcher.actions = self.dispatcher.actions, []
            for action in actions:
                if isinstance(action, Deliver):
                    self.delivered.append(action)
                elif isinstance(action, Note):
                    self.notes.append(action)
                elif isinstance(action, Commit):
                    self.commits.append(action.request)
                    if self.auto_commit:
                        self.dispatcher.committed(action.request.id, self.now)
                elif isinstance(action, Respond):
                    assert action.request.reply is not None
                    self.responded.append(action.request.reply)

    def offer(self, client_id: str, capacity: int = 10, serial: int = 1,
              process: int = ME) -> None:
        self.dispatcher.offer((process, client_id), serial, capacity, self.now)
        self.run()

    def reply(self, delivery: Deliver, payload: bytes = b"done") -> Verdict:
        request = delivery.request
        message = Message(request.reply_topic, payload, 1, False, {
            PropertyId.CORRELATION_DATA: request.correlation}, delivery.worker[1])
        verdict = self.dispatcher.reply(request.id, delivery.worker, delivery.retry, message,
                                        self.now)
        self.run()
        return verdict

    def advance(self, seconds: float) -> None:
        self.now += seconds
        self.dispatcher.expire(self.now)
        self.run()


def users(message: Message) -> dict[str, str]:
    return dict(message.properties.get(PropertyId.USER_PROPERTY, []))


def test_round_robin_spreads_requests_over_the_workers_with_credit() -> None:
    scene = Scene()
    for name in ("w1", "w2", "w3"):
        scene.offer(name)
    for _ in range(9):
        scene.request()
    assert Counter(d.worker[1] for d in scene.delivered) == {"w1": 3, "w2": 3, "w3": 3}
    assert [d.worker[1] for d in scene.delivered[:3]] == ["w1", "w2", "w3"]
    assert all(d.retry == 0 and not d.dup for d in scene.delivered)
    assert len(scene.notes) == 9  # every assignment is recorded


def test_a_worker_never_holds_more_than_its_credit() -> None:
    scene = Scene()
    scene.offer("small", capacity=1)
    first, second = scene.request(), scene.request()
    assert [d.request for d in scene.delivered] == [first]  # the second waits
    assert second.phase is Phase.QUEUED
    assert scene.reply(scene.delivered[0]) is Verdict.ACCEPTED
    assert [d.request for d in scene.delivered] == [first, second]
    assert [users(m)[envelope.REQUEST_ID] for m in scene.responded] == [first.id]


def test_least_loaded_gives_each_request_to_the_emptiest_worker() -> None:
    scene = Scene(dispatch=LEAST_LOADED)
    scene.offer("busy", capacity=4)
    scene.offer("idle", capacity=4)
    for _ in range(3):
        scene.request()
    scene.reply(scene.delivered[1])  # whoever got it is less loaded now
    lighter = scene.delivered[1].worker
    scene.request()
    assert scene.delivered[-1].worker == lighter


def test_an_attempt_that_times_out_goes_to_another_worker_then_fails_with_timeout() -> None:
    scene = Scene(timeout=5.0, retries=2)
    scene.offer("hung-1")
    scene.offer("hung-2")
    request = scene.request()
    scene.advance(5.0)
    scene.advance(5.0)
    assert [(d.worker[1], d.retry, d.dup) for d in scene.delivered] == [
        ("hung-1", 0, False), ("hung-2", 1, True), ("hung-1", 2, True)]
    assert not scene.responded
    scene.advance(5.0)
    assert request.phase is Phase.DONE
    (error,) = scene.responded
    assert users(error) == {envelope.REQUEST_ID: request.id, envelope.ERROR: "timeout"}
    assert error.topic == request.reply_topic
    assert error.properties[PropertyId.CORRELATION_DATA] == request.correlation
    assert scene.dispatcher.stats.timeouts == 3 and scene.dispatcher.stats.retries == 2


def test_a_late_reply_after_another_completed_is_dropped_and_counted() -> None:
    scene = Scene(timeout=1.0)
    scene.offer("slow")
    scene.offer("quick")
    scene.request()
    scene.advance(1.0)  # slow gave up on: quick gets it
    slow, quick = scene.delivered
    assert scene.reply(quick, b"quick") is Verdict.ACCEPTED
    assert scene.reply(slow, b"slow") is Verdict.LATE
    assert [m.payload for m in scene.responded] == [b"quick"]
    assert scene.dispatcher.stats.late_replies == 1


def test_a_hung_worker_fills_its_credit_and_gets_no_more() -> None:
    scene = Scene(timeout=1.0, retries=0, max_wait=30.0)
    scene.offer("hung", capacity=2)
    scene.request()
    scene.request()
    scene.advance(1.0)  # both given up: error replies, and the worker still holds them
    waiting = scene.request()
    assert len(scene.delivered) == 2 and waiting.phase is Phase.QUEUED
    scene.reply(scene.delivered[0])  # a late reply frees a slot
    assert scene.delivered[-1].request is waiting


def test_a_worker_that_goes_loses_its_requests_to_the_others() -> None:
    scene = Scene()
    scene.offer("a")
    scene.offer("b")
    requests = [scene.request() for _ in range(4)]
    scene.offer("a", capacity=0)  # withdrawn (disconnected)
    held_by_a = [d.request for d in scene.delivered[:4] if d.worker[1] == "a"]
    again = scene.delivered[4:]
    assert [d.request for d in again] == held_by_a
    assert all(d.worker[1] == "b" and d.dup and d.retry == 1 for d in again)
    assert all(r.phase is Phase.ASSIGNED for r in requests)


def test_a_repeat_gets_the_remembered_reply_not_a_second_execution() -> None:
    scene = Scene()
    scene.offer("w")
    first = scene.request("caller", b"same")
    scene.reply(scene.delivered[0], b"answer")
    scene.request("caller", b"same")  # the caller's repeat within the window
    assert len(scene.delivered) == 1
    assert [m.payload for m in scene.responded] == [b"answer", b"answer"]
    assert users(scene.responded[1])[envelope.REQUEST_ID] == first.id
    scene.request("other", b"same")  # another caller's correlation is its own
    assert len(scene.delivered) == 2
    assert scene.dispatcher.stats.duplicates == 1


def test_a_repeat_of_a_pending_request_is_answered_once_with_it() -> None:
    scene = Scene()
    scene.offer("w")
    scene.request("caller", b"same")
    scene.request("caller", b"same")
    assert len(scene.delivered) == 1
    scene.reply(scene.delivered[0])
    assert len(scene.responded) == 1


def test_the_window_ends_and_a_repeat_is_a_new_request() -> None:
    scene = Scene(dedup_window=10.0)
    scene.offer("w")
    scene.request("caller", b"same")
    scene.reply(scene.delivered[0])
    scene.advance(10.0)
    scene.request("caller", b"same")
    assert len(scene.delivered) == 2


def test_no_responders_wait_policy_waits_then_fails() -> None:
    scene = Scene(max_wait=3.0)
    request = scene.request()
    scene.advance(2.9)
    assert not scene.responded
    scene.advance(0.2)
    assert [users(m)[envelope.ERROR] for m in scene.responded] == ["no-responders"]
    assert request.phase is Phase.DONE


def test_no_responders_wait_policy_serves_a_worker_that_comes_in_time() -> None:
    scene = Scene(max_wait=3.0)
    request = scene.request()
    scene.advance(1.0)
    scene.offer("late-comer")
    assert [d.request for d in scene.delivered] == [request]


def test_no_responders_fail_policy_fails_at_once() -> None:
    scene = Scene(no_responders=FAIL)
    scene.request()
    assert [users(m)[envelope.ERROR] for m in scene.responded] == ["no-responders"]


def test_nothing_reaches_the_caller_before_the_completion_is_durable() -> None:
    scene = Scene()
    scene.auto_commit = False
    scene.offer("w")
    request = scene.request()
    scene.reply(scene.delivered[0])
    assert scene.commits == [request] and not scene.responded
    assert scene.reply(scene.delivered[0], b"again") is Verdict.LATE  # completing already
    scene.dispatcher.committed(request.id, scene.now)
    scene.run()
    assert len(scene.responded) == 1


def test_recovered_assignment_confirmed_by_its_holder_is_not_delivered_again() -> None:
    scene = Scene()
    request = Request("3-7", 7, "c", "reply/c", b"x", Message("$service/billing", b""),
                      scene.now)
    dispatcher = scene.dispatcher
    dispatcher.arrive(request, scene.now, recovering=True)
    dispatcher.recover_assign("3-7", 0, (1, "w"))  # held on worker process 1
    dispatcher.recovered(scene.now)
    scene.run()
    assert not scene.delivered
    dispatcher.sync(1, [("w", 5, 10, [("3-7", 0)])], scene.now)
    scene.run()
    assert not scene.delivered and request.phase is Phase.ASSIGNED and request.confirmed
    reply = Message("reply/c", b"ok", 1, False, {PropertyId.CORRELATION_DATA: b"x"}, "w")
    assert dispatcher.reply("3-7", (1, "w"), 0, reply, scene.now) is Verdict.ACCEPTED


def test_recovered_assignment_its_holder_lost_goes_again_marked_dup() -> None:
    scene = Scene()
    request = Request("3-7", 7, "c", "reply/c", b"x", Message("$service/billing", b""),
                      scene.now)
    dispatcher = scene.dispatcher
    dispatcher.arrive(request, scene.now, recovering=True)
    dispatcher.recover_assign("3-7", 0, (1, "w"))
    dispatcher.recovered(scene.now)
    dispatcher.sync(1, [("w", 5, 10, [])], scene.now)  # w is there but does not hold it
    scene.run()
    assert [(d.worker, d.retry, d.dup) for d in scene.delivered] == [((1, "w"), 1, True)]


def test_recovered_assignment_in_the_restarted_process_is_lost_with_it() -> None:
    scene = Scene()
    request = Request("3-7", 7, "c", "reply/c", b"x", Message("$service/billing", b""),
                      scene.now)
    dispatcher = scene.dispatcher
    dispatcher.arrive(request, scene.now, recovering=True)
    dispatcher.recover_assign("3-7", 0, (ME, "w"))
    dispatcher.recovered(scene.now)
    scene.offer("w2")
    assert [(d.worker[1], d.retry, d.dup) for d in scene.delivered] == [("w2", 1, True)]


def test_recovered_completion_is_routed_when_its_reply_is_resent() -> None:
    scene = Scene()
    request = Request("3-7", 7, "c", "reply/c", b"x", Message("$service/billing", b""),
                      scene.now)
    dispatcher = scene.dispatcher
    dispatcher.arrive(request, scene.now, recovering=True)
    stored = Message("reply/c", b"ok", 1)
    dispatcher.recover_completion("3-7", stored, "", ((1, "w"), 0), age=1.0, now=scene.now)
    dispatcher.recovered(scene.now)
    scene.run()
    assert not scene.responded and not scene.delivered
    resent = Message("reply/c", b"ok", 1, False, {PropertyId.CORRELATION_DATA: b"x"}, "w")
    assert dispatcher.reply("3-7", (1, "w"), 0, resent, scene.now) is Verdict.ROUTED
    scene.run()
    assert scene.responded == [stored]
    assert dispatcher.reply("3-7", (1, "w"), 0, resent, scene.now) is Verdict.LATE


@pytest.mark.parametrize(("process", "retry"), [(0, 0), (1, -1)])
def test_a_recovered_completion_resent_from_another_process_is_routed(
        process: int, retry: int) -> None:
    """The service worker reconnected to another process (or, a plain client, does not say
    its attempt) before resending the reply that completed the request: still that reply."""
    scene = Scene()
    request = Request("3-7", 7, "c", "reply/c", b"x", Message("$service/billing", b""),
                      scene.now)
    dispatcher = scene.dispatcher
    dispatcher.arrive(request, scene.now, recovering=True)
    stored = Message("reply/c", b"ok", 1)
    dispatcher.recover_completion("3-7", stored, "", ((1, "w"), 0), age=1.0, now=scene.now)
    dispatcher.recovered(scene.now)
    scene.run()
    resent = Message("reply/c", b"ok", 1, False, {PropertyId.CORRELATION_DATA: b"x"}, "w")
    assert dispatcher.reply("3-7", (1, "other"), 0, resent, scene.now) is Verdict.LATE
    assert dispatcher.reply("3-7", (process, "w"), retry, resent, scene.now) is Verdict.ROUTED
    scene.run()
    assert scene.responded == [stored]


def test_a_reply_recognised_by_id_must_match_the_request() -> None:
    scene = Scene()
    scene.offer("w")
    request = scene.request()
    delivery = scene.delivered[0]
    other = Message("elsewhere", b"", 1)
    assert scene.dispatcher.reply(request.id, delivery.worker, 0, other, scene.now,
                                  ("elsewhere", None)) is Verdict.MISMATCH
    assert request.phase is Phase.ASSIGNED


@pytest.mark.parametrize("policy", ["wait", "fail"])
def test_a_sync_without_an_offer_withdraws_it(policy: str) -> None:
    scene = Scene(no_responders=policy)
    scene.offer("w", process=1)
    scene.request()
    scene.dispatcher.sync(1, [], scene.now)
    scene.run()
    assert scene.dispatcher.gauges()["workers"] == 0
