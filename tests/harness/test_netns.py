"""A real partition with network namespaces: a client in one namespace reaches a broker in
another; a cut makes the broker unreachable (new connections time out, an established one
stalls without being reset); after the heal the stalled connection goes on and new ones work.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from netns import NetworkLab, leftovers, unavailable
from nodes import start_nodes
from nsclient import NsClient

from conftest import wait_for

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")

CUT_TIMEOUT = 0.5  # how long a client in the cut waits to see that nothing comes


def test_a_cut_makes_the_broker_unreachable_until_healed(tmp_path: Path) -> None:
    with NetworkLab() as lab:
        broker_ns, client_ns = lab.add("broker"), lab.add("client")
        with start_nodes(tmp_path, 1, bind=broker_ns.address,
                         launchers=[broker_ns.launcher]) as nodes:
            host, port = nodes[0].address()
            held, probe = NsClient(client_ns.launcher), NsClient(client_ns.launcher)
            try:
                assert held.ask("connect", host, port, "held", 5) == {"ok": True, "reason": 0}
                assert held.ask("publish", "netns/a", "before", 5)["ok"]

                lab.cut("broker")
                # The established connection stalls: no PUBACK, and no reset either.
                assert held.ask("publish", "netns/a", "during", CUT_TIMEOUT) == {
                    "ok": False, "error": "timeout"}
                answer = probe.ask("connect", host, port, "probe", CUT_TIMEOUT)
                assert not answer["ok"] and "timed out" in str(answer["error"]), answer

                lab.heal()
                # TCP retransmits what the cut held: the PUBACK comes on the same connection.
                assert held.ask("puback", 10)["ok"]
                wait_for(lambda: probe.ask("connect", host, port, "probe", 2)["ok"],
                         what="a new connection after the heal")
            finally:
                held.close()
                probe.close()
    assert leftovers(lab) == []
