"""``meshmq pub`` and ``meshmq sub`` against a real broker, for both protocol versions."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import wait_for


def meshmq(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "meshmq", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.mark.parametrize("version", ["311", "5"])
def test_pub_reaches_sub(broker, client_factory, version: str) -> None:
    port = str(broker.port)
    sub = meshmq("sub", "-p", port, "-t", "cli/#", "-q", "1", "-C", "2", "-v", "-V", version,
                 "-i", f"cli-sub-{version}")
    probe = client_factory("probe", 5)
    probe.connect(broker.port)
    probe.subscribe("cli/#", qos=1)
    wait_for(lambda: f"subscribed client_id=cli-sub-{version}" in broker.log(),
             what="meshmq sub to subscribe")
    for payload in ("one", "two"):
        pub = meshmq("pub", "-p", port, "-t", "cli/x", "-m", payload, "-q", "1", "-V", version)
        assert pub.wait(timeout=30) == 0, pub.stderr.read()
        assert probe.expect().payload == payload.encode()
    out, err = sub.communicate(timeout=30)
    assert sub.returncode == 0, err
    assert out.splitlines() == ["cli/x one", "cli/x two"]


def test_pub_to_closed_port_fails_with_one_line(tmp_path) -> None:
    import socket

    with socket.socket() as sock:  # a port that is certainly closed: bound, never listening
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
        pub = meshmq("pub", "-p", port, "-t", "x", "-m", "y")
        assert pub.wait(timeout=30) == 1
    err = pub.stderr.read().strip().splitlines()
    assert len(err) == 1 and "cannot connect" in err[0]
