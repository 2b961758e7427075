"""The admin listener's fixed contract, over real HTTP against a real broker of 1 and 2 workers:
the API key, /metrics, the clients list, kick (DISCONNECT 0x98), the dashboard page, and a
JSON error with the right status for each kind of bad request."""

from __future__ import annotations

import json
import urllib.parse

import pytest
from admin_http import ADMIN, KEY, get, http, metrics, total, worker_of

from conftest import WAIT, wait_for

WORKERS = [1, 2]


def connect_on(broker, client_factory, worker: int, prefix: str, version: int = 5):
    """A connected client held by ``worker`` (the kernel spreads connections: try until one
    lands there)."""
    for number in range(64):
        client = client_factory(f"{prefix}-{number}", version=version)
        client.connect(broker.port)
        if worker_of(broker, f"{prefix}-{number}") == worker:
            return client
    pytest.fail(f"no connection landed on worker {worker}")


@pytest.mark.parametrize("workers", WORKERS)
def test_api_needs_the_key_and_says_so_in_json(broker_factory, workers: int) -> None:
    broker = broker_factory(ADMIN, workers=workers)
    port = broker.port_of("admin")
    for key in (None, "wrong"):
        reply = http(port, "GET", "/api/v1/clients", key=key)
        assert reply.status == 401
        assert reply.headers["WWW-Authenticate"] == "Bearer"
        assert reply.body["status"] == 401 and "Authorization: Bearer" in reply.body["error"]
    reply = http(port, "DELETE", "/api/v1/clients/anyone", key=None)
    assert reply.status == 401  # no kick without the key, whether or not the client exists
    assert http(port, "GET", "/api/v1/clients").status == 200
    # /metrics is open by default (admin.metrics_auth = false): Prometheus scrapes it as is
    assert http(port, "GET", "/metrics", key=None).status == 200


def test_metrics_auth_closes_metrics_too(broker_factory) -> None:
    broker = broker_factory(ADMIN + "metrics_auth = true\n")
    port = broker.port_of("admin")
    assert http(port, "GET", "/metrics", key=None).status == 401
    assert http(port, "GET", "/metrics").status == 200


@pytest.mark.parametrize("workers", WORKERS)
def test_clients_lists_the_clients_of_every_worker(broker_factory, client_factory,
                                                   workers: int) -> None:
    broker = broker_factory(ADMIN, workers=workers)
    held = {}
    for worker in range(workers):  # at least one client on each worker
        client = connect_on(broker, client_factory, worker, f"w{worker}")
        held[client.paho._client_id.decode()] = worker
    listed = get(broker, "/api/v1/clients?limit=1000")
    ids = {row["client_id"] for row in listed["data"]}
    assert set(held) <= ids and listed["total"] == len(ids)
    per_worker = {w["index"]: w["clients"] for w in get(broker, "/api/v1/node")["workers"]["list"]}
    assert sum(per_worker.values()) == len(ids)
    assert all(per_worker[worker] >= 1 for worker in range(workers))
    row = next(r for r in listed["data"] if r["client_id"] in held)
    assert row["protocol"] == "5.0" and row["peer"].startswith("127.0.0.1:")


@pytest.mark.parametrize("workers", WORKERS)
def test_kick_sends_disconnect_0x98_to_a_5_0_client_on_any_worker(
        broker_factory, client_factory, workers: int) -> None:
    broker = broker_factory(ADMIN, workers=workers)
    port = broker.port_of("admin")
    victim = connect_on(broker, client_factory, workers - 1, "victim")  # a peer of worker 0
    client_id = victim.paho._client_id.decode()
    reply = http(port, "DELETE", f"/api/v1/clients/{client_id}")
    assert reply.status == 200 and reply.body == {"kicked": client_id}
    reason = victim.disconnects.get(timeout=WAIT)
    assert reason.value == 0x98  # Administrative action
    wait_for(lambda: client_id not in {
        r["client_id"] for r in get(broker, "/api/v1/clients")["data"]}, what="kick applied")
    again = http(port, "DELETE", f"/api/v1/clients/{client_id}")
    assert again.status == 404 and client_id in again.body["error"]


def test_kick_closes_a_3_1_1_client(broker_factory, client_factory) -> None:
    broker = broker_factory(ADMIN)
    victim = client_factory("old-timer", version=4)
    victim.connect(broker.port)
    assert http(broker.port_of("admin"), "DELETE", "/api/v1/clients/old-timer").status == 200
    reason = victim.disconnects.get(timeout=WAIT)  # 3.1.1 has no server DISCONNECT: closed
    assert reason.is_failure


@pytest.mark.parametrize("workers", WORKERS)
def test_metrics_are_one_view_of_the_node(broker_factory, client_factory, workers: int) -> None:
    broker = broker_factory(ADMIN, workers=workers)
    subscriber = connect_on(broker, client_factory, 0, "sub")
    subscriber.subscribe("m/#", qos=1)
    publishers = [connect_on(broker, client_factory, w, f"pub{w}") for w in range(workers)]
    for number, publisher in enumerate(publishers):
        for _ in range(5):
            publisher.publish(f"m/{number}", b"12345", qos=1)
        publisher.publish(f"m/{number}", b"abc", qos=0)
    for _ in range(6 * workers):
        subscriber.expect()
    samples = metrics(broker)
    assert all(name.startswith("meshmq_") for name, _ in samples)
    assert total(samples, "meshmq_messages_received_total", qos="1") == 5 * workers
    assert total(samples, "meshmq_messages_received_total", qos="0") == workers
    payload = (25 + 3) * workers  # the MQTT bytes hold every PUBLISH's payload, and more
    assert total(samples, "meshmq_received_bytes_total") > payload
    assert total(samples, "meshmq_sent_bytes_total") > payload
    assert total(samples, "meshmq_messages_delivered_total") == 6 * workers
    connected = get(broker, "/api/v1/clients")["total"]  # connect_on's strays included
    assert total(samples, "meshmq_connections") == connected >= 1 + workers
    assert total(samples, "meshmq_sessions", state="online") == connected
    assert total(samples, "meshmq_subscriptions") == 1
    assert total(samples, "meshmq_worker_up") == workers
    assert total(samples, "meshmq_process_resident_memory_bytes") > 0
    assert total(samples, "meshmq_log_appends_total") == 5 * workers  # QoS 1 is persisted
    assert total(samples, "meshmq_log_fsync_seconds_count") >= 1
    if workers > 1:
        assert total(samples, "meshmq_mesh_frames_total", direction="out") > 0
    # a second scrape sees the same node: nothing counted twice by the first
    assert total(metrics(broker), "meshmq_messages_received_total") == 6 * workers


def test_dashboard_page_is_served_without_a_key(broker_factory) -> None:
    broker = broker_factory(ADMIN)
    reply = http(broker.port_of("admin"), "GET", "/", key=None)
    assert reply.status == 200 and "<title>meshmq" in reply.body
    assert "http://" not in reply.body and "https://" not in reply.body  # nothing from a CDN


@pytest.mark.parametrize("workers", WORKERS)
def test_bad_requests_get_the_right_status_and_a_json_error(
        broker_factory, client_factory, workers: int) -> None:
    broker = broker_factory(ADMIN, workers=workers)
    port = broker.port_of("admin")
    online = client_factory("here")
    online.connect(broker.port)
    cases = [
        ("GET", "/api/v1/clients?limit=0", None, 400, "limit"),
        ("GET", "/api/v1/clients?limit=5000", None, 400, "limit"),
        ("GET", "/api/v1/clients?offset=-1", None, 400, "offset"),
        ("GET", "/api/v1/clients?offset=abc", None, 400, "offset must be an integer"),
        ("GET", "/api/v1/clients?sort=nonsense", None, 400, "cannot sort by"),
        ("GET", "/api/v1/clients?protocol=4", None, 400, "protocol"),
        ("GET", "/api/v1/clients/nobody", None, 404, "nobody"),
        ("DELETE", "/api/v1/clients/nobody", None, 404, "not connected"),
        ("GET", "/api/v1/sessions?state=sleeping", None, 400, "state"),
        ("GET", "/api/v1/sessions/nobody", None, 404, "no session"),
        ("DELETE", "/api/v1/sessions/here", None, 409, "kick it first"),
        ("POST", "/api/v1/subscriptions/match", b"{not json", 400, "not valid JSON"),
        ("POST", "/api/v1/subscriptions/match", b"[1]", 400, "JSON object"),
        ("POST", "/api/v1/subscriptions/match", b'{"topic": "a/+"}', 400, "topic name"),
        ("GET", "/api/v1/retained?filter=a/%23/b", None, 400, "topic filter"),
        ("DELETE", "/api/v1/retained?topic=none/here", None, 404, "no retained"),
        ("DELETE", "/api/v1/retained", None, 400, "topic"),
        ("GET", "/api/v1/log/partitions/x/segments", None, 400, "number"),
        ("GET", "/api/v1/log/partitions/99/segments", None, 404, "no partition"),
        ("GET", "/api/v1/nothing-here", None, 404, "Not Found"),
        ("PUT", "/api/v1/clients", None, 405, "Method Not Allowed"),
    ]
    for method, path, body, status, words in cases:
        reply = http(port, method, path, body=body,
                     headers={"Content-Type": "application/json"} if body else None)
        assert reply.status == status, (method, path, reply.status, reply.body)
        assert reply.body["status"] == status and words in reply.body["error"], (path, reply.body)
    big = http(port, "POST", "/api/v1/subscriptions/match", body=b" " * 100_000)
    assert big.status == 413 and big.body["status"] == 413


def test_paging_sorting_and_filters(broker_factory, client_factory) -> None:
    broker = broker_factory(ADMIN)
    for name in ("alpha", "beta", "gamma", "delta"):
        client_factory(f"pg-{name}").connect(broker.port)
    client_factory("pg-old", version=4).connect(broker.port)
    first = get(broker, "/api/v1/clients?client_id=pg-&limit=2&sort=client_id")
    assert first["total"] == 5 and first["limit"] == 2
    assert [r["client_id"] for r in first["data"]] == ["pg-alpha", "pg-beta"]
    rest = get(broker, "/api/v1/clients?client_id=pg-&limit=2&offset=2&sort=client_id")
    assert [r["client_id"] for r in rest["data"]] == ["pg-delta", "pg-gamma"]
    desc = get(broker, "/api/v1/clients?client_id=pg-&sort=-client_id&limit=1")
    assert desc["data"][0]["client_id"] == "pg-old"
    old = get(broker, "/api/v1/clients?protocol=3.1.1")
    assert [r["client_id"] for r in old["data"]] == ["pg-old"]
    assert get(broker, "/api/v1/clients?client_id=GAMMA")["total"] == 1  # case-insensitive


def test_client_ids_with_slashes_and_unicode(broker_factory, client_factory) -> None:
    broker = broker_factory(ADMIN)
    client_id = "plant/7 ünïcode"
    victim = client_factory(client_id)
    victim.connect(broker.port)
    path = "/api/v1/clients/" + urllib.parse.quote(client_id, safe="")
    assert get(broker, path)["client_id"] == client_id
    assert http(broker.port_of("admin"), "DELETE", path).status == 200
    assert victim.disconnects.get(timeout=WAIT).value == 0x98


def test_admin_configuration_errors_exit_2(tmp_path) -> None:
    import subprocess
    import sys

    for text, words in [
        ('[admin]\nlisten = "127.0.0.1:0"\n', "admin.api_key: required"),
        ('[admin]\nlisten = "nowhere"\napi_key = "k"\n', "admin.listen: must be HOST:PORT"),
        ('[admin]\nlisten = "127.0.0.1:0"\napi_key = "k"\ncertfile = "/no/such.pem"\n',
         "admin.certfile: cannot load /no/such.pem"),
    ]:
        config = tmp_path / "bad.toml"
        config.write_text(text)
        done = subprocess.run(
            [sys.executable, "-m", "meshmq", "serve", "--config", str(config), "--port", "0",
             "--bind", "127.0.0.1", "--data-dir", str(tmp_path / "data")],
            capture_output=True, text=True, timeout=WAIT * 2)
        assert done.returncode == 2, (text, done.stderr)
        assert words in done.stderr, done.stderr


def test_openapi_is_served_and_describes_every_route(broker_factory) -> None:
    broker = broker_factory(ADMIN)
    spec = get(broker, "/api/v1/openapi.json")
    assert spec["openapi"].startswith("3.")
    from meshmq.node.admin.app import make_app

    app = make_app(None, None, None)  # type: ignore[arg-type]  # routes only
    served = {(route.method.lower(), route.resource.canonical)
              for route in app.router.routes() if route.method != "HEAD"
              and route.resource.canonical.startswith(("/api/", "/metrics"))}
    described = {(method, path)
                 for path, item in spec["paths"].items() for method in item}
    assert served == described
    assert json.dumps(spec)  # plain JSON


def test_masked_config_and_node_status(broker_factory) -> None:
    # a webhook receiver that is not there: its events are only dropped and counted
    broker = broker_factory(ADMIN + '[hooks]\nurl = "http://hook:pa55@127.0.0.1:9/x"\n'
                            'authorization = "Bearer hook-s3cret"\n')
    node = get(broker, "/api/v1/node")
    hooks = node["config"]["hooks"]
    assert hooks["authorization"] == "***" and hooks["url"] == "http://***@127.0.0.1:9/x"
    assert "hook-s3cret" not in json.dumps(node) and "pa55" not in json.dumps(node)
    assert node["status"] == "running" and node["workers"] == {
        "count": 1, "up": 1, "list": node["workers"]["list"]}
    assert node["config"]["admin"]["api_key"] == "***" and KEY not in json.dumps(node)
    assert node["listeners"][0]["name"] == "tcp" and node["listeners"][0]["port"] == broker.port
    assert node["uptime"] >= 0 and node["version"]


def test_https_with_admin_certfile(broker_factory, tmp_path) -> None:
    import ssl
    import urllib.request

    import trustme

    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    cert, key = tmp_path / "admin.pem", tmp_path / "admin.key"
    server.cert_chain_pems[0].write_to_path(str(cert))
    server.private_key_pem.write_to_path(str(key))
    broker = broker_factory(ADMIN + f'certfile = "{cert}"\nkeyfile = "{key}"\n')
    context = ssl.create_default_context()
    ca.configure_trust(context)
    request = urllib.request.Request(
        f"https://127.0.0.1:{broker.port_of('admin')}/api/v1/node",
        headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, context=context, timeout=WAIT) as response:
        assert json.loads(response.read())["status"] == "running"
    from http.client import HTTPException

    with pytest.raises((OSError, HTTPException)):  # no plain HTTP on it
        get(broker, "/api/v1/node")
