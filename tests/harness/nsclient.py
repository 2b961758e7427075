"""An MQTT client driven over stdin, to run inside a network namespace (``ip netns exec``).

A test in the root namespace cannot open a socket in another namespace, so it starts this
script there (``NsClient``) and sends it one command per line; each command answers with one
JSON line on stdout. One connection per process, kept across commands, so a test can show what
an established TCP connection does through a cut (it stalls, then goes on after the heal):

    connect HOST PORT CLIENT_ID TIMEOUT   -> {"ok": true} | {"ok": false, "error": "..."}
    publish TOPIC PAYLOAD TIMEOUT         -> QoS 1; {"ok": true, "reason": 0}, or
                                             {"ok": false, "error": "timeout"} (still pending)
    puback TIMEOUT                        -> wait for the PUBACK of the pending publish
    quit

Every wait is bounded by the TIMEOUT given; nothing sleeps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: rawclient

from meshmq.mqtt.packets import Puback, Publish
from rawclient import ConnectionClosed, RawClient

SCRIPT = Path(__file__).resolve()


def main() -> None:
    client: RawClient | None = None
    pending: int | None = None  # packet id of the publish whose PUBACK has not come
    for line in sys.stdin:
        command, *args = line.split()
        try:
            if command == "quit":
                break
            if command == "connect":
                host, port, client_id, timeout = args
                client = RawClient(int(port), 5, host=host, timeout=float(timeout))
                connack = client.connect(client_id, timeout=float(timeout))
                answer: dict[str, object] = {"ok": connack.reason_code == 0,
                                             "reason": connack.reason_code}
            elif command in ("publish", "puback"):
                assert client is not None, "not connected"
                if command == "publish":
                    topic, payload, timeout = args
                    pending = client.next_packet_id()
                    client.send(Publish(topic, payload.encode(), 1, packet_id=pending))
                else:
                    (timeout,) = args
                answer = wait_puback(client, pending, float(timeout))
                if answer["ok"]:
                    pending = None
            else:
                answer = {"ok": False, "error": f"unknown command {command}"}
        except (OSError, ConnectionClosed, AssertionError) as exc:
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


def wait_puback(client: RawClient, packet_id: int | None, timeout: float) -> dict[str, object]:
    try:
        ack = client.recv_type(Puback, timeout)
    except TimeoutError:
        return {"ok": False, "error": "timeout"}
    return {"ok": ack.packet_id == packet_id, "reason": ack.reason_code}


class NsClient:
    """This script running in a namespace (``launcher``), from the test's side."""

    def __init__(self, launcher: tuple[str, ...]) -> None:
        self.proc = subprocess.Popen([*launcher, sys.executable, str(SCRIPT)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, *command: object) -> dict[str, object]:
        """Send one command; its answer (the script bounds every wait by the given timeout)."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(str(part) for part in command) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise ConnectionClosed(f"nsclient exited with {self.proc.wait()}")
        return json.loads(answer)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


if __name__ == "__main__":
    main()
