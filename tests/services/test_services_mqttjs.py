"""The services' wire contract with plain MQTT.js (Node.js) clients, no meshmq code on the
client side: an MQTT.js caller served by a paho service worker, a paho caller served by an
MQTT.js service worker, and MQTT.js on both sides, on a node of two worker processes.

The scripts use only MQTT 5 as MQTT.js offers it: SUBSCRIBE ``$service/NAME`` at QoS 1 with the
user property ``credit``, a request published at QoS 1 with a Response Topic and Correlation
Data, a reply published to the Response Topic with the same Correlation Data. MQTT.js is
installed with npm once (tests/mqttjs.py); the tests skip, saying why, without node and npm.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from servicekit import Caller, PahoWorker, service_on

from conftest import WAIT, BrokerProcess, Client, connect_on
from mqttjs import mqttjs_dir, node_environment

pytestmark = pytest.mark.interop

RUN_TIMEOUT = 30
CONFIG = """
[log]
fsync = "interval"
"""

# A service worker: offers SERVICE with credit 2, answers each request with "js:" + payload on
# its Response Topic with its Correlation Data, prints what it saw; ends after COUNT requests
# once every reply is acknowledged.
SERVICE_WORKER = r"""
const mqtt = require("mqtt");
const [port, service, count, clientId] = [Number(process.argv[2]), process.argv[3],
                                          Number(process.argv[4]), process.argv[5]];
const client = mqtt.connect({host: "127.0.0.1", port, protocolVersion: 5, clientId,
                             reconnectPeriod: 0});
let served = 0, acked = 0;
const seen = [];
client.on("error", (error) => { console.log("ERROR " + error.message); process.exit(1); });
client.on("connect", (connack) => {
  const worker = ((connack.properties || {}).userProperties || {})["meshmq-worker"];
  client.subscribe("$service/" + service,
                   {qos: 1, properties: {userProperties: {credit: "2"}}}, (error, granted) => {
    if (error || granted[0].qos !== 1) {
      console.log("ERROR subscribe " + JSON.stringify(error || granted)); process.exit(1);
    }
    console.log("READY " + worker);
  });
});
client.on("message", (topic, payload, packet) => {
  const props = packet.properties || {};
  seen.push({topic, payload: payload.toString(), user: props.userProperties || {},
             correlation: props.correlationData ? props.correlationData.toString() : null});
  served += 1;
  client.publish(props.responseTopic, "js:" + payload.toString(),
                 {qos: 1, properties: {correlationData: props.correlationData}}, (error) => {
    if (error) { console.log("ERROR publish " + error.message); process.exit(1); }
    acked += 1;
    if (acked === count) {
      console.log("RESULT " + JSON.stringify(seen));
      client.end(false, () => process.exit(0));
    }
  });
});
"""

# A caller: subscribes to reply/CLIENTID, sends COUNT requests to SERVICE (correlation c0..,
# a user property of its own), prints every reply once COUNT have come.
CALLER = r"""
const mqtt = require("mqtt");
const [port, service, count, clientId] = [Number(process.argv[2]), process.argv[3],
                                          Number(process.argv[4]), process.argv[5]];
const replyTopic = "reply/" + clientId;
const client = mqtt.connect({host: "127.0.0.1", port, protocolVersion: 5, clientId,
                             reconnectPeriod: 0});
const replies = [];
const pubacks = [];
client.on("error", (error) => { console.log("ERROR " + error.message); process.exit(1); });
client.on("connect", () => client.subscribe(replyTopic, {qos: 1}, (error) => {
  if (error) { console.log("ERROR " + error.message); process.exit(1); }
  for (let i = 0; i < count; i++) {
    client.publish("$service/" + service, "job" + i, {qos: 1, properties: {
      responseTopic: replyTopic, correlationData: Buffer.from("c" + i),
      userProperties: {trace: "t" + i}}}, (error, packet) => {
      pubacks.push(error ? error.message : (packet && packet.reasonCode) || 0);
    });
  }
}));
client.on("message", (topic, payload, packet) => {
  const props = packet.properties || {};
  replies.push({topic, payload: payload.toString(), user: props.userProperties || {},
                correlation: props.correlationData ? props.correlationData.toString() : null});
  if (replies.length === count) {
    console.log("RESULT " + JSON.stringify({replies, pubacks}));
    client.end(false, () => process.exit(0));
  }
});
"""


@contextmanager
def run_node(script: str, tmp_path: Path, name: str, *args: object
             ) -> Iterator[subprocess.Popen[str]]:
    """``node`` running ``script`` with ``args``; killed on the way out if still running."""
    directory = mqttjs_dir()
    path = tmp_path / f"{name}.js"
    path.write_text(script)
    process = subprocess.Popen(["node", str(path), *(str(a) for a in args)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=node_environment(directory))
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def ready(process: subprocess.Popen[str]) -> str:
    """The script's READY line (its first), or the failure with all it printed."""
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    assert line.startswith("READY"), line + process.stdout.read()
    return line


def result(process: subprocess.Popen[str]) -> object:
    output, _ = process.communicate(timeout=RUN_TIMEOUT)
    assert process.returncode == 0, output
    return json.loads(output.split("RESULT ", 1)[1])


@pytest.fixture
def node(broker_factory: Callable[..., BrokerProcess]) -> BrokerProcess:
    return broker_factory(CONFIG, workers=2)


def test_an_mqttjs_caller_served_by_a_paho_service_worker(
        node: BrokerProcess, client_factory: Callable[..., Client], tmp_path: Path) -> None:
    service = service_on(0, 2, "js-caller")
    worker = PahoWorker(connect_on(client_factory, node, 1, "paho-sw"), service)
    assert worker.offer() == [1]
    with run_node(CALLER, tmp_path, "caller", node.port, service, 6, "js-caller") as caller:
        got = result(caller)
    assert isinstance(got, dict)
    assert got["pubacks"] == [0] * 6  # every request stored (PUBACK success)
    replies = {reply["correlation"]: reply for reply in got["replies"]}
    assert sorted(replies) == [f"c{i}" for i in range(6)]
    served = {s.correlation: s for s in worker.served}
    for i in range(6):
        reply = replies[f"c{i}"]
        assert reply["payload"] == f"done:job{i}" and reply["topic"] == "reply/js-caller"
        request = served[f"c{i}".encode()]
        assert reply["user"]["meshmq-request-id"] == request.request_id
        assert "meshmq-error" not in reply["user"]
        # the envelope as the paho worker got it, the caller's own property unaltered
        assert (request.sender, request.retry, request.dup) == ("js-caller", 0, False)
        assert request.user["trace"] == f"t{i}"
    assert len({s.request_id for s in worker.served}) == 6


def test_a_paho_caller_served_by_an_mqttjs_service_worker(
        node: BrokerProcess, client_factory: Callable[..., Client], tmp_path: Path) -> None:
    service = service_on(1, 2, "js-worker")
    with run_node(SERVICE_WORKER, tmp_path, "worker", node.port, service, 6,
                  "js-sw") as worker:
        ready(worker)
        caller = Caller(connect_on(client_factory, node, 0, "paho-caller"),
                        "reply/paho-caller")
        for i in range(6):
            caller.call(service, f"job{i}".encode(), f"c{i}".encode(),
                        user=[("trace", f"t{i}")])
        replies = {r.correlation: r for r in caller.collect(6, timeout=WAIT)}
        seen = result(worker)
    assert sorted(replies) == [f"c{i}".encode() for i in range(6)]
    assert isinstance(seen, list) and len(seen) == 6
    by_correlation = {request["correlation"]: request for request in seen}
    for i in range(6):
        request = by_correlation[f"c{i}"]
        user = request["user"]
        assert request["topic"] == f"$service/{service}"
        assert request["payload"] == f"job{i}"
        assert (user["meshmq-sender"], user["meshmq-retry"], user["meshmq-dup"]) == (
            "paho-caller", "0", "false")
        assert user["trace"] == f"t{i}"
        reply = replies[f"c{i}".encode()]
        assert reply.payload == f"js:job{i}".encode() and reply.error is None
        assert reply.request_id == user["meshmq-request-id"]


def test_mqttjs_on_both_sides(node: BrokerProcess, tmp_path: Path) -> None:
    service = service_on(0, 2, "js-both")
    with run_node(SERVICE_WORKER, tmp_path, "worker", node.port, service, 10,
                  "js-sw") as worker:
        ready(worker)
        with run_node(CALLER, tmp_path, "caller", node.port, service, 10,
                      "js-caller") as caller:
            got = result(caller)
        seen = result(worker)
    assert isinstance(got, dict) and isinstance(seen, list)
    assert sorted(r["payload"] for r in got["replies"]) == sorted(
        f"js:job{i}" for i in range(10))
    ids = {r["correlation"]: r["user"]["meshmq-request-id"] for r in got["replies"]}
    assert ids == {r["correlation"]: r["user"]["meshmq-request-id"] for r in seen}
    assert len(set(ids.values())) == 10  # each request once, with its own id
