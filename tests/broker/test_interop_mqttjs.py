"""Interoperability with MQTT.js (Node.js), a strict client for the broker's topic aliases.

MQTT.js resolves incoming topic aliases itself when it sends a Topic Alias Maximum, and treats
an alias used before it was defined, or above its maximum, as a protocol error (it disconnects
and emits ``error``). Optional: the test installs ``mqtt`` with npm into a cache directory under
``~/.cache`` once, and skips with the reason if node, npm or the package cannot be had
(tests/mqttjs.py).
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from mqttjs import mqttjs_dir

pytestmark = pytest.mark.interop

RUN_TIMEOUT = 15

SUBSCRIBER = r"""
const mqtt = require("mqtt");
const [port, count] = [Number(process.argv[2]), Number(process.argv[3])];
const client = mqtt.connect({host: "127.0.0.1", port, protocolVersion: 5, clientId: "mqttjs",
                             properties: {topicAliasMaximum: 2}, reconnectPeriod: 0});
const got = [];
let aliased = 0;
client.on("error", (error) => { console.log("ERROR " + error.message); process.exit(1); });
client.on("connect", () => client.subscribe("js/#", {qos: 1}, (error) => {
  if (error) { console.log("ERROR " + error.message); process.exit(1); }
  console.log("READY");
}));
client.on("message", (topic, payload, packet) => {
  if (packet.topic.length === 0) aliased += 1;
  got.push([topic, payload.toString()]);
  if (got.length === count) {
    console.log("RESULT " + JSON.stringify({got, aliased}));
    client.end(false, () => process.exit(0));
  }
});
"""


def test_mqttjs_resolves_every_broker_alias(broker, client_factory, tmp_path):
    """MQTT.js with Topic Alias Maximum 2 receives a workload that fills both aliases and then
    remaps one to a busy topic: no alias error, every message on its own topic, in order, and
    most of them carried by an alias."""
    directory = mqttjs_dir()
    script = tmp_path / "subscriber.js"
    script.write_text(SUBSCRIBER)
    sent = [("js/cold-a", "a"), ("js/cold-b", "b")] + [("js/busy", str(i)) for i in range(20)]
    sent += [("js/cold-a", "a again")]
    environment = {**os.environ, "NODE_PATH": str(directory / "node_modules")}
    node = subprocess.Popen(["node", str(script), str(broker.port), str(len(sent))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=environment)
    try:
        assert node.stdout is not None
        ready = node.stdout.readline().strip()
        assert ready == "READY", ready + node.stdout.read()
        pub = client_factory("js-pub", 5)
        pub.connect(broker.port)
        for index, (topic, payload) in enumerate(sent):
            pub.publish(topic, payload, qos=index % 2)
        output, _ = node.communicate(timeout=RUN_TIMEOUT)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
    assert node.returncode == 0, output
    result = json.loads(output.split("RESULT ", 1)[1])
    assert [tuple(pair) for pair in result["got"]] == sent
    assert result["aliased"] >= 15  # the busy topic rode on an alias after taking one over
