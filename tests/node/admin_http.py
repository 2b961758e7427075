"""Real HTTP to a broker's admin listener (stdlib only), and a broker started with one."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from paho.mqtt.packettypes import PacketTypes
from prometheus_client.parser import text_string_to_metric_families

from conftest import BrokerProcess, props, wait_for

KEY = "s3cret-key"
ADMIN = f"""
[admin]
listen = "127.0.0.1:0"
api_key = "{KEY}"
"""
PERSISTENT = props(PacketTypes.CONNECT, SessionExpiryInterval=3600)  # a CONNECT's properties
RESTARTED = re.compile(r"worker restarted index=(\d+) pid=(\d+)")


@dataclass
class Reply:
    status: int
    body: Any  # parsed JSON, or the text when it is not JSON
    headers: dict[str, str]


def http(port: int, method: str, path: str, key: str | None = KEY,
         body: bytes | None = None, headers: dict[str, str] | None = None) -> Reply:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=body,
                                     method=method, headers=dict(headers or {}))
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            status, raw, got = response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as error:
        status, raw, got = error.code, error.read(), dict(error.headers)
    try:
        parsed: Any = json.loads(raw)
    except ValueError:
        parsed = raw.decode("utf-8", "replace")
    return Reply(status, parsed, got)


def get(broker: BrokerProcess, path: str, **kwargs: Any) -> Any:
    """GET ``path``; it must answer 200; its JSON."""
    reply = http(broker.port_of("admin"), "GET", path, **kwargs)
    assert reply.status == 200, (path, reply.status, reply.body)
    return reply.body


def metrics(broker: BrokerProcess, key: str | None = None) -> dict[tuple[str, tuple], float]:
    """/metrics parsed: (sample name, sorted labels) -> value."""
    reply = http(broker.port_of("admin"), "GET", "/metrics", key=key)
    assert reply.status == 200, reply.body
    assert reply.headers["Content-Type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(reply.body):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: dict[tuple[str, tuple], float], name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    wanted = set(labels.items())
    return sum(value for (sample, got), value in samples.items()
               if sample == name and wanted <= set(got))


def worker_of(broker: BrokerProcess, client_id: str) -> int:
    """The worker index that holds connected ``client_id`` (from the admin API)."""
    return wait_for(lambda: _worker_of(broker, client_id), what=f"{client_id} listed")[0]


def _worker_of(broker: BrokerProcess, client_id: str) -> tuple[int] | None:
    reply = http(broker.port_of("admin"), "GET",
                 f"/api/v1/clients/{urllib.request.quote(client_id, safe='')}")
    return (reply.body["worker"],) if reply.status == 200 else None


def offline_session(broker: BrokerProcess, client_factory: Any, client_id: str,
                    topic_filter: str) -> None:
    """A persistent session of ``client_id`` subscribed to ``topic_filter`` at QoS 1, its
    client gone: once the API lists it offline."""
    client = client_factory(client_id)
    client.connect(broker.port, clean_start=False, properties=PERSISTENT)
    client.subscribe(topic_filter, qos=1)
    client.disconnect()
    wait_for(lambda: any(row["client_id"] == client_id for row in get(
        broker, "/api/v1/sessions?state=offline")["data"]), what=f"{client_id} offline")
