"""The rest of the admin API against a node of 2 workers: sessions (offline, subscriptions, log
cursors, delete), subscriptions and topic match, retained messages (list, delete), the commit
log (partitions, segments, the slowest cursors), all correct across workers."""

from __future__ import annotations

from admin_http import ADMIN, PERSISTENT, get, http, metrics, offline_session, total

from conftest import wait_for


def test_offline_session_cursor_lag_and_delete(broker_factory, client_factory) -> None:
    broker = broker_factory(ADMIN, workers=2)
    port = broker.port_of("admin")
    offline_session(broker, client_factory, "sleeper", "log/#")
    publisher = client_factory("writer")
    publisher.connect(broker.port)
    for number in range(7):
        publisher.publish("log/a", f"m{number}", qos=1)  # persisted (log.persist_filters = #)

    offline = get(broker, "/api/v1/sessions?state=offline")["data"]
    assert [row["client_id"] for row in offline] == ["sleeper"]
    assert offline[0]["online"] is False and offline[0]["expiry_interval"] == 3600
    detail = get(broker, "/api/v1/sessions/sleeper")
    assert [s["filter"] for s in detail["subscription_list"]] == ["log/#"]
    lags = {row["partition"]: row["lag"] for row in detail["cursor"] if row["lag"]}
    assert list(lags.values()) == [7]  # one partition holds log/a
    (partition,) = lags
    slowest = get(broker, "/api/v1/log/cursors")["data"][0]
    assert slowest["client_id"] == "sleeper" and slowest["lag"] == 7
    samples = metrics(broker)
    assert total(samples, "meshmq_catchup_lag_messages", partition=str(partition)) == 7
    assert total(samples, "meshmq_sessions", state="offline") == 1
    row = next(r for r in get(broker, "/api/v1/log/partitions")["data"]
               if r["partition"] == partition)
    assert row["lag"] == 7 and row["high_watermark"] == row["next_offset"] == 7
    assert row["leader"] == partition % 2 and row["size_bytes"] > 0
    segments = get(broker, f"/api/v1/log/partitions/{partition}/segments")["data"]
    assert segments[0]["base_offset"] == 0 and sum(s["size_bytes"] for s in segments) > 0

    match = http(port, "POST", "/api/v1/subscriptions/match", body=b'{"topic": "log/a"}',
                 headers={"Content-Type": "application/json"})
    assert [r["client_id"] for r in match.body["data"]] == ["sleeper"]

    assert http(port, "DELETE", "/api/v1/sessions/sleeper").status == 200
    assert http(port, "GET", "/api/v1/sessions/sleeper").status == 404
    assert http(port, "DELETE", "/api/v1/sessions/sleeper").status == 404
    back = client_factory("sleeper")
    flags, _, _ = back.connect(broker.port, clean_start=False, properties=PERSISTENT)
    assert not flags.session_present  # it is gone, on whichever worker held it


def test_subscriptions_topics_and_match_across_workers(broker_factory, client_factory) -> None:
    broker = broker_factory(ADMIN, workers=2)
    clients = []
    for number in range(6):  # the kernel spreads them over both workers
        client = client_factory(f"s{number}")
        client.connect(broker.port)
        client.subscribe(f"plant/{number % 3}/#", qos=number % 2)
        clients.append(client)
    clients[0].subscribe("$share/g/plant/+/temp")
    subscriptions = get(broker, "/api/v1/subscriptions?limit=100")
    assert subscriptions["total"] == 7
    shared = [r for r in subscriptions["data"] if r["group"]]
    assert shared == [{"client_id": "s0", "filter": "$share/g/plant/+/temp", "group": "g",
                       "topic_filter": "plant/+/temp", "qos": 0, "subscription_id": None}]
    topics = {r["filter"]: r["subscribers"] for r in get(broker, "/api/v1/topics")["data"]}
    assert topics["plant/1/#"] == 2 and topics["$share/g/plant/+/temp"] == 1
    reply = http(broker.port_of("admin"), "POST", "/api/v1/subscriptions/match",
                 body=b'{"topic": "plant/1/temp"}')
    assert sorted(r["client_id"] for r in reply.body["data"]) == ["s0", "s1", "s4"]
    mine = get(broker, "/api/v1/subscriptions?client_id=s4")["data"]
    assert [r["filter"] for r in mine] == ["plant/1/#"]


def test_retained_list_and_delete_across_owners(broker_factory, client_factory) -> None:
    broker = broker_factory(ADMIN, workers=2)
    publisher = client_factory("retainer")
    publisher.connect(broker.port)
    for number in range(8):  # the topics' owners are both workers (their partitions' leaders)
        publisher.publish(f"r/{number}", f"value {number}", qos=1, retain=True)
    publisher.publish("r/bin", b"\xff\x00", qos=1, retain=True)
    listed = get(broker, "/api/v1/retained?filter=r/%23")
    assert listed["total"] == 9
    by_topic = {row["topic"]: row for row in listed["data"]}
    assert by_topic["r/3"]["payload"] == "value 3" and by_topic["r/3"]["encoding"] == "utf-8"
    assert by_topic["r/bin"] == {"topic": "r/bin", "qos": 1, "size": 2, "payload": "/wA=",
                                 "encoding": "base64", "truncated": False}
    assert get(broker, "/api/v1/retained?filter=r/3")["total"] == 1

    assert http(broker.port_of("admin"), "DELETE", "/api/v1/retained?topic=r/3").status == 200
    wait_for(lambda: get(broker, "/api/v1/retained?filter=r/%23")["total"] == 8,
             what="r/3 cleared at its owner")
    reader = client_factory("reader")
    reader.connect(broker.port)
    reader.subscribe("r/#", qos=1)
    seen = {reader.expect().topic for _ in range(8)}
    assert "r/3" not in seen and len(seen) == 8
    publisher.publish("r/barrier", b"after", qos=1)  # arrives after anything retained
    assert reader.expect().topic == "r/barrier"
