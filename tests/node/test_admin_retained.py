"""One definition of "retained messages" in the operations plane: the messages clients retained.

The ``$SYS/broker/...`` topics are retained too, but they are the broker's own figures: the
dashboard's Retained tab and ``GET /api/v1/retained`` never list them, so the overview's count,
``/metrics`` (``meshmq_retained_messages``) and ``$SYS/broker/retained messages/count`` must not
count them either (with 2 client messages the overview said 14 while the tab listed 2).
"""

from __future__ import annotations

import pytest
from admin_http import ADMIN, get, metrics, total

from conftest import wait_for

WORKERS = [1, 2]
SYS_EVERY = "\n[mqtt]\nsys_interval = 0.2\n"  # (seconds) so that a fresh $SYS set comes soon
COUNT_TOPIC = "$SYS/broker/retained messages/count"


def after_a_sys_publication(broker, client_factory) -> str:
    """Wait for a $SYS set published after this call (not the retained copy a subscription gets
    at once: that one may predate what the test did); the retained count it carried."""
    watcher = client_factory("sys-watcher")
    watcher.connect(broker.port)
    watcher.subscribe(COUNT_TOPIC, qos=0)
    while True:
        message = watcher.expect()
        if not message.retain:  # a live publication: the tick came after the subscription
            return message.payload.decode()


@pytest.mark.parametrize("workers", WORKERS)
def test_the_overview_counts_the_retained_messages_the_retained_tab_lists(
    broker_factory, client_factory, workers: int,
) -> None:
    broker = broker_factory(ADMIN + SYS_EVERY, workers=workers)
    publisher = client_factory("retainer")
    publisher.connect(broker.port)
    for topic in ("plant/1/state", "plant/2/state"):
        publisher.publish(topic, b"on", qos=1, retain=True)  # PUBACK: stored
    after_a_sys_publication(broker, client_factory)  # the $SYS topics are retained by now

    listed = get(broker, "/api/v1/retained")  # the Retained tab's query (filter #)
    assert listed["total"] == len(listed["data"]) == 2
    wait_for(lambda: get(broker, "/api/v1/overview")["retained"] == 2,
             what="the overview's retained count to be the 2 listed")
    assert total(metrics(broker), "meshmq_retained_messages") == 2


def test_the_sys_retained_count_leaves_out_the_sys_topics(broker_factory, client_factory) -> None:
    broker = broker_factory(ADMIN + SYS_EVERY)
    publisher = client_factory("retainer")
    publisher.connect(broker.port)
    for topic in ("plant/1/state", "plant/2/state"):
        publisher.publish(topic, b"on", qos=1, retain=True)
    after_a_sys_publication(broker, client_factory)
    assert after_a_sys_publication(broker, client_factory) == "2"
