"""Nodes on 127.0.0.1 linked into one cluster (``[cluster]``): real ``meshmq serve``
processes, each with its own ports and data directory, real paho clients.

``start_cluster`` starts the nodes together, each naming all the others as seeds, with the
metadata on (the default: the log's partitions are led across the nodes), on cluster ports
drawn with the next port free for the Raft voter. With ``metadata=False`` the first node
starts the cluster (no seeds), the others name it as their seed and learn the rest from it,
and each node's cluster port is ephemeral (``listen = "127.0.0.1:0"``): the supervisor picks
it and the port file says which (``cluster=PORT``).
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from nodes import Node, Nodes
from paho.mqtt.packettypes import PacketTypes

from conftest import Client, props, wait_for

SECRET = "correct horse battery staple\n"
PARTITIONS = 8  # the log's partitions by default


def cluster_config(tmp: Path, name: str, seeds: list[str], secret: str = SECRET,
                   extra: str = "") -> str:
    secret_file = tmp / f"{name}.secret"
    secret_file.write_text(secret)
    listed = ", ".join(f'"{seed}"' for seed in seeds)
    return (f'[cluster]\nnode_id = "{name}"\nlisten = "127.0.0.1:0"\nseeds = [{listed}]\n'
            f'secret_file = "{secret_file}"\n{extra}')


@contextmanager
def start_cluster(tmp: Path, count: int, workers: int = 2, extra: str = "",
                  metadata: bool = True) -> Iterator[Nodes]:
    """``count`` nodes of ``workers`` workers; yielded once every worker of every node has
    linked every other node. With the metadata (the default), the nodes start together, each
    naming all the others as seeds, on cluster ports drawn with their Raft port (+1) free,
    and are yielded once the controller has assigned every partition. Without it
    (``metadata = false``: each node keeps its own log), the first node starts the cluster
    and the others name it as their seed."""
    nodes = Nodes([])
    ports = free_port_pairs(count) if metadata else []
    try:
        for index in range(count):
            name = f"n{index + 1}"
            if metadata:
                seeds = [f"127.0.0.1:{port}" for port in ports if port != ports[index]]
                text = cluster_config(tmp, name, seeds, extra=extra).replace(
                    'listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{ports[index]}"', 1)
            else:
                seeds = [f"127.0.0.1:{nodes[0].ports['cluster']}"] if index else []
                text = cluster_config(tmp, name, seeds, extra="metadata = false\n" + extra)
            node = Node(name, tmp / name, text, workers)
            nodes.members.append(node)
            node.start()
        for node in nodes:
            wait_for(lambda node=node: linked(node) >= workers * (count - 1),
                     what=f"{node.name}'s workers to link every other node")
        if metadata:
            wait_for(lambda: len(set(re.findall(r"partition assigned partition=(\d+)",
                                                "".join(node.log() for node in nodes))))
                     == PARTITIONS, timeout=60, what="the controller to assign every partition")
        yield nodes
    finally:
        nodes.stop_all()


def linked(node: Node) -> int:
    """Links this node's workers dialed and finished (the log's ``linked node=`` lines)."""
    return len(set(re.findall(r"linked node=(\S+) .* worker=(\d+)$", node.log(), re.M)))


def connect(client_factory: Callable[..., Client], node: Node, client_id: str) -> Client:
    client = client_factory(client_id)
    client.connect(node.port)
    return client


def test_a_publish_on_any_node_reaches_every_subscriber_on_every_node_once(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    with start_cluster(tmp_path, 3) as nodes:
        subscribers = []
        for node in nodes:
            for n in range(2):  # two per node: the kernel may put them on either worker
                client = connect(client_factory, node, f"sub-{node.name}-{n}")
                client.subscribe("fleet/+/temp", qos=1)
                subscribers.append(client)
        publishers = [connect(client_factory, node, f"pub-{node.name}") for node in nodes]
        sent = []
        for round_ in range(5):
            for publisher, node in zip(publishers, nodes, strict=True):
                payload = f"{node.name}:{round_}"
                publisher.publish(f"fleet/{node.name}/temp", payload, qos=1)
                sent.append(payload.encode())
        for publisher, node in zip(publishers, nodes, strict=True):  # the barrier: last
            publisher.publish(f"fleet/{node.name}/temp", f"end:{node.name}", qos=1)
        for subscriber in subscribers:
            got: list[bytes] = []
            ends: set[bytes] = set()
            while len(ends) < len(nodes):
                payload = subscriber.expect().payload
                (ends.add if payload.startswith(b"end:") else got.append)(payload)
            assert sorted(got) == sorted(sent)  # each once: none lost, none twice
            subscriber.expect_none(0.2)


def test_shared_subscribers_across_nodes_get_each_message_once(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    with start_cluster(tmp_path, 3) as nodes:
        members = []
        for node in nodes:
            member = connect(client_factory, node, f"worker-{node.name}")
            member.subscribe("$share/jobs/jobs/#", qos=1)
            members.append(member)
        publisher = connect(client_factory, nodes[1], "dispatcher")
        for n in range(60):
            publisher.publish("jobs/run", f"{n}", qos=1)
        got: list[bytes] = []
        while len(got) < 60:
            for member in members:
                try:
                    got.append(member.expect(timeout=0.05).payload)
                except queue.Empty:  # that member has none now
                    continue
        assert sorted(got) == sorted(f"{n}".encode() for n in range(60))


def test_a_node_without_the_secret_is_refused(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    with start_cluster(tmp_path, 2, workers=1) as nodes:
        seed = f"127.0.0.1:{nodes[0].ports['cluster']}"
        stranger = Node("intruder", tmp_path / "intruder",
                        cluster_config(tmp_path, "intruder", [seed], secret="guess\n"))
        nodes.members.append(stranger)
        stranger.start()
        wait_for(lambda: "does not know the cluster secret" in nodes[0].log(),
                 what="the seed to refuse the stranger")
        spy = connect(client_factory, stranger, "spy")
        spy.subscribe("#", qos=1)
        inside = connect(client_factory, nodes[1], "inside")
        inside.subscribe("plans/#", qos=1)
        connect(client_factory, nodes[0], "ceo").publish("plans/q4", "secret", qos=1)
        assert inside.expect().payload == b"secret"  # the barrier: it has crossed the cluster
        spy.expect_none(0.3)
        assert linked(stranger) == 0


def test_a_killed_node_leaves_the_others_serving_each_other(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    with start_cluster(tmp_path, 3, workers=1) as nodes:
        subscriber = connect(client_factory, nodes[2], "sub")
        subscriber.subscribe("t", qos=1)
        publisher = connect(client_factory, nodes[0], "pub")
        publisher.publish("t", "before", qos=1)
        assert subscriber.expect().payload == b"before"
        nodes[1].kill()
        publisher.publish("t", "after", qos=1)
        assert subscriber.expect().payload == b"after"
        wait_for(lambda: "link to node lost node=n2" in nodes[0].log(),
                 what="n1 to see n2 gone")


def test_a_data_directory_of_another_node_is_refused(tmp_path: Path) -> None:
    node = Node("n1", tmp_path / "n1", cluster_config(tmp_path, "n1", []))
    node.start()
    node.stop()
    node.config = cluster_config(tmp_path, "n9", [])
    with pytest.raises(Exception, match="holds the data of node 'n1'"):
        node.start()
    assert node.proc is not None and node.proc.wait() == 2


ADMIN_KEY = "cluster-admin-key"


def test_cluster_status_shows_every_node_linked_and_a_dead_one_down(
        tmp_path: Path) -> None:
    admin = f'\n[admin]\nlisten = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n'
    with start_cluster(tmp_path, 3, workers=2, extra=admin) as nodes:
        url = f"http://127.0.0.1:{nodes[0].ports['admin']}"
        command = [sys.executable, "-m", "meshmq", "cluster", "status", "--admin", url,
                   "--api-key", ADMIN_KEY]
        shown = subprocess.run([*command, "--json"], capture_output=True, text=True,
                               timeout=30, check=True)
        state = json.loads(shown.stdout)
        assert state["node_id"] == "n1" and state["cluster_id"]
        assert [(n["node_id"], n["linked"]) for n in state["nodes"]] == [("n2", 2), ("n3", 2)]
        nodes[2].kill()

        def status() -> str:
            return subprocess.run(command, capture_output=True, text=True, timeout=30).stdout

        text = wait_for(lambda: (lambda t: t if re.search(r"^n3 .* down$", t, re.M) else "")(
            status()), timeout=30, what="n3 shown down")
        assert re.search(r"^n2\s+127\.0\.0\.1:\d+\s+2/2\s+linked$", text, re.M), text
        assert re.search(r"^n3\s+127\.0\.0\.1:\d+\s+0/2\s+down$", text, re.M), text


def free_runs(count: int, length: int) -> list[int]:
    """The first ports of ``count`` runs of ``length`` consecutive ports, each port free now
    (bound, then released): ``cluster dev`` gives node i the base port + i, so a run of
    separately chosen ports could collide with another test's listener on the next one."""
    starts: list[int] = []
    while len(starts) < count:
        first = random.randrange(20000, 32000)  # below the kernel's ephemeral range
        if any(abs(first - other) < length for other in starts):
            continue
        sockets = [socket.socket() for _ in range(length)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", first + offset))
        except OSError:
            continue
        else:
            starts.append(first)
        finally:
            for sock in sockets:
                sock.close()
    return starts


def test_cluster_dev_runs_nodes_that_route_to_each_other_and_stops_them_all(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """``cluster dev --no-metadata``: two nodes that route to each other, each with its own
    log of every partition (and ``cluster status`` says so); Ctrl-C stops them all."""
    mqtt_port, cluster_port, admin_port = free_runs(3, 2)
    dev = subprocess.Popen(
        [sys.executable, "-m", "meshmq", "cluster", "dev", "--nodes", "2", "--no-metadata",
         "--dir",
         str(tmp_path / "dev"), "--port", str(mqtt_port), "--cluster-port", str(cluster_port),
         "--admin-port", str(admin_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        logs = [tmp_path / "dev" / name / "node.log" for name in ("n1", "n2")]
        wait_for(lambda: all(log.exists() and "linked node=" in log.read_text()
                             for log in logs), timeout=30, what="the two nodes to link")
        subscriber = client_factory("dev-sub")
        subscriber.connect(mqtt_port + 1)
        subscriber.subscribe("dev/#", qos=1)
        publisher = client_factory("dev-pub")
        publisher.connect(mqtt_port)
        publisher.publish("dev/hello", "from n1", qos=1)
        assert subscriber.expect().payload == b"from n1"
        status = subprocess.run(  # the command it printed works as printed
            [sys.executable, "-m", "meshmq", "cluster", "status", "--admin",
             f"http://127.0.0.1:{admin_port}", "--api-key", "dev"],
            capture_output=True, text=True, timeout=30)
        assert re.search(r"^n2\s+127\.0\.0\.1:\d+\s+1/1\s+linked$", status.stdout, re.M), \
            status.stdout + status.stderr
        assert "metadata: off (each node keeps its own log" in status.stdout  # and says so
    finally:
        dev.send_signal(signal.SIGINT)
        output, _ = dev.communicate(timeout=60)
    assert dev.returncode == 0, output
    assert "2 nodes on 127.0.0.1" in output
    assert f"meshmq cluster status --admin http://127.0.0.1:{admin_port} --api-key dev" \
        in output


def acknowledged(client: Client, topic: str, payload: str | bytes, retain: bool = False
                 ) -> int:
    """A QoS 1 publish; its PUBACK's reason code (below 0x80: stored)."""
    info = client.paho.publish(topic, payload, qos=1, retain=retain)
    while True:
        mid, code = client.acked.get(timeout=30)
        if mid == info.mid:
            return code.value


def test_cluster_dev_leads_the_partitions_across_its_nodes(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """``cluster dev`` (the metadata on by default): the nodes run their voters (a secret
    drawn for them), the partitions are assigned to both nodes, and a publish on one reaches
    the other."""
    mqtt_port, cluster_port, admin_port = free_runs(3, 4)
    dev = subprocess.Popen(
        [sys.executable, "-m", "meshmq", "cluster", "dev", "--nodes", "2",
         "--dir", str(tmp_path / "dev"), "--port", str(mqtt_port), "--cluster-port",
         str(cluster_port), "--admin-port", str(admin_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def shown() -> str:
            return subprocess.run(
                [sys.executable, "-m", "meshmq", "cluster", "status", "--admin",
                 f"http://127.0.0.1:{admin_port}", "--api-key", "dev"],
                capture_output=True, text=True, timeout=30).stdout

        status = wait_for(lambda: (text := shown()) and len(re.findall(
            r"^\d+\s+n[12]\s+\d+\s+1\s+online$", text, re.M)) == 8 and text, timeout=60,
            what="the partitions to be assigned")
        assert {"n1", "n2"} == set(re.findall(r"^\d+\s+(n[12])\s", status, re.M)), status
        secret = tmp_path / "dev" / "cluster.secret"
        assert secret.stat().st_mode & 0o777 == 0o600
        subscriber = client_factory("dev-sub")
        subscriber.connect(mqtt_port + 1)
        subscriber.subscribe("dev/#", qos=1)
        publisher = client_factory("dev-pub")
        publisher.connect(mqtt_port)
        for number in range(16):  # topics over every partition; each stored (PUBACK < 0x80)
            wait_for(lambda number=number: acknowledged(publisher, f"dev/{number}", str(number))
                     < 0x80, timeout=30, what=f"dev/{number} to be stored")
        assert sorted(int(subscriber.expect().payload) for _ in range(16)) == list(range(16))
    finally:
        dev.send_signal(signal.SIGINT)
        output, _ = dev.communicate(timeout=60)
    assert dev.returncode == 0, output
    assert "partitions led across them (metadata on)" in output


LONG = os.environ.get("MESHMQ_FAULTS") == "1"


@pytest.mark.faults
@pytest.mark.skipif(not LONG, reason="the long fault suite runs with MESHMQ_FAULTS=1 "
                    "(docs/testing.md)")
def test_a_node_cut_off_is_suspected_declared_dead_and_relinked_after_the_heal(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """The links the others dial to n2 go through a proxy (n2 advertises it); a blackhole
    stalls them without closing anything, as a network partition does. Heartbeats make n1
    suspect n2, then close the link as dead; after the heal it links again and routes to n2,
    what was published meanwhile first; n3 is served throughout."""
    from proxy import Proxy

    nodes = Nodes([])
    try:
        off = "metadata = false\n"  # (the links' behaviour; the metadata's: test_metafaults)
        n1 = Node("n1", tmp_path / "n1", cluster_config(tmp_path, "n1", [], extra=off))
        nodes.members.append(n1)
        n1.start()
        seed = f"127.0.0.1:{n1.ports['cluster']}"
        holder: dict[str, Node] = {}
        proxy = Proxy(lambda: ("127.0.0.1", holder["n2"].ports["cluster"])).start()
        host, port = proxy.address()
        n2 = Node("n2", tmp_path / "n2", cluster_config(
            tmp_path, "n2", [seed], extra=f'advertise = "{host}:{port}"\n' + off))
        holder["n2"] = n2
        nodes.members.append(n2)
        n2.start()
        n3 = Node("n3", tmp_path / "n3", cluster_config(tmp_path, "n3", [seed], extra=off))
        nodes.members.append(n3)
        n3.start()
        for node in nodes:
            wait_for(lambda node=node: linked(node) >= 2, what=f"{node.name} to link")
        on_n2 = connect(client_factory, n2, "on-n2")
        on_n2.subscribe("t", qos=1)
        on_n3 = connect(client_factory, n3, "on-n3")
        on_n3.subscribe("t", qos=1)
        publisher = connect(client_factory, n1, "pub")
        publisher.publish("t", "before", qos=1)
        assert on_n2.expect().payload == b"before" and on_n3.expect().payload == b"before"
        proxy.blackhole()
        wait_for(lambda: "node suspected node=n2" in n1.log(), timeout=30,
                 what="n1 to suspect n2")
        wait_for(lambda: "node n2 silent" in n1.log(), timeout=30, what="n1 to drop n2")
        publisher.publish("t", "during", qos=1)
        assert on_n3.expect().payload == b"during"  # the others go on
        proxy.heal()
        wait_for(lambda: re.search(r"linked node=n2 .*\n(?!.*link to node lost node=n2)",
                                   n1.log().rsplit("node n2 silent", 1)[1]), timeout=30,
                 what="n1's new link to n2")
        publisher.publish("t", "after", qos=1)
        got = []
        while not got or got[-1] != b"after":  # routed to n2 again
            got.append(on_n2.expect().payload)
        # what n1 routed to n2 while it was cut off waited for it (cluster/resend.py); what
        # n2 had not acknowledged yet comes again (at least once)
        assert b"during" in got and set(got) <= {b"before", b"during", b"after"}, got
        proxy.close()
    finally:
        nodes.stop_all()


def free_port_pairs(count: int) -> list[int]:
    """``count`` ports P free now with P + 1 free too (a node's cluster port and its metadata
    voter's, the cluster port + 1), drawn below the kernel's ephemeral range (32768 and up
    here), where the connections of other tests running meanwhile do not take them."""
    found: list[int] = []
    while len(found) < count:
        port = random.randrange(20000, 32000)
        if any(abs(port - other) < 2 for other in found):
            continue
        probes = [socket.socket() for _ in range(2)]
        try:
            for offset, probe in enumerate(probes):
                probe.bind(("127.0.0.1", port + offset))
            found.append(port)
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    return found


def metadata(node: Node) -> dict:
    """The metadata as the node's admin API shows it (its members, controller, partitions)."""
    url = f"http://127.0.0.1:{node.ports['admin']}/api/v1/cluster"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    with urllib.request.urlopen(request, timeout=10) as answer:
        return json.load(answer).get("metadata") or {}


def start_metadata_cluster(tmp: Path, count: int = 3) -> Nodes:
    """``count`` nodes of 2 workers, each running a metadata voter (cluster.metadata) and an
    admin listener; the seeds of each name all the others."""
    ports = free_port_pairs(count)
    admin = f'\n[admin]\nlisten = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n'
    nodes = Nodes([])
    try:
        for index, port in enumerate(ports):
            name = f"n{index + 1}"
            seeds = [f"127.0.0.1:{other}" for other in ports if other != port]
            text = cluster_config(tmp, name, seeds, extra="metadata = true\n" + admin)
            text = text.replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"', 1)
            node = Node(name, tmp / name, text, workers=2)
            nodes.members.append(node)
            node.start()
    except BaseException:
        nodes.stop_all()
        raise
    return nodes


def test_the_metadata_agrees_on_members_a_controller_and_the_partitions(
        tmp_path: Path) -> None:
    """Three nodes whose seeds name each other run a metadata voter each (cluster.metadata):
    every node registers, the Raft leader's node becomes the controller and assigns every
    partition once; kill -9 of the controller's node: another takes over with a new epoch
    and moves nothing, and the dead node's partitions are reported offline."""
    nodes = start_metadata_cluster(tmp_path)
    try:
        def settled(node: Node) -> dict:
            found = metadata(node)
            done = len(found.get("members", {})) == 3 and len(found.get("partitions", {})) == 8
            return found if done else {}

        state = wait_for(lambda: settled(nodes[1]), timeout=60, what="the metadata to settle")
        assert sorted(state["members"]) == ["n1", "n2", "n3"]
        leaders = sorted(a["leader"] for a in state["partitions"].values())
        assert leaders == ["n1"] * 3 + ["n2"] * 3 + ["n3"] * 2
        assert all(a["leader_epoch"] == 1 for a in state["partitions"].values())
        first = state["controller"]
        victim = nodes[int(first["node"][1:]) - 1]
        survivor = next(node for node in nodes if node is not victim)
        victim.kill()

        def new_controller() -> dict:
            found = metadata(survivor)
            controller = found.get("controller") or {}
            return found if controller.get("epoch", 0) > first["epoch"] else {}

        after = wait_for(new_controller, timeout=60, what="another node to take control")
        assert after["controller"]["node"] != first["node"]
        assert after["partitions"] == state["partitions"]  # nothing moved
        shown = subprocess.run(
            [sys.executable, "-m", "meshmq", "cluster", "status", "--admin",
             f"http://127.0.0.1:{survivor.ports['admin']}", "--api-key", ADMIN_KEY],
            capture_output=True, text=True, timeout=30).stdout
        offline = re.findall(rf"^(\d+)\s+{victim.name}\s+\d+\s+1\s+offline", shown, re.M)
        assert len(offline) == sum(1 for a in state["partitions"].values()
                                   if a["leader"] == victim.name), shown
    finally:
        nodes.stop_all()


def test_with_metadata_a_node_joins_through_one_seed_leaves_and_a_dead_one_is_forgotten(
        tmp_path: Path) -> None:
    """The Raft voter set follows the members. n4, whose only seed is n1, joins a running
    3-node cluster as a fourth voter and member. ``meshmq cluster leave`` on n4 takes its
    voter and its member record out. n3 killed with -9 and ``forget``: 2 voters remain, who
    still agree (n4 comes back and joins again through them)."""
    nodes = start_metadata_cluster(tmp_path)
    admin = f'\n[admin]\nlisten = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n'

    def cli(node: Node, *action: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "meshmq", "cluster", *action, "--admin",
             f"http://127.0.0.1:{node.ports['admin']}", "--api-key", ADMIN_KEY],
            capture_output=True, text=True, timeout=60)

    def state(node: Node) -> dict:
        return json.loads(cli(node, "status", "--json").stdout)

    def settled(node: Node, members: list[str]) -> dict:
        found = state(node)
        metadata, raft = found.get("metadata") or {}, found.get("raft") or {}
        done = (sorted(metadata.get("members", {})) == members and raft.get("leader")
                and len(raft.get("voters") or ()) == len(members))
        return found if done else {}

    try:
        wait_for(lambda: settled(nodes[0], ["n1", "n2", "n3"]), timeout=60,
                 what="the first three to agree")
        port = free_port_pairs(1)[0]
        text = cluster_config(tmp_path, "n4", [f"127.0.0.1:{nodes[0].ports['cluster']}"],
                              extra="metadata = true\n" + admin)
        text = text.replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{port}"', 1)
        newcomer = Node("n4", tmp_path / "n4", text, workers=2)
        nodes.members.append(newcomer)
        newcomer.start()
        four = ["n1", "n2", "n3", "n4"]
        joined = wait_for(lambda: settled(nodes[1], four), timeout=60, what="n4 to join")
        assert f"127.0.0.1:{port + 1}" in joined["raft"]["voters"]
        assert "raft voters: " in cli(nodes[1], "status").stdout

        left = cli(newcomer, "leave")
        assert left.returncode == 0, left.stderr
        assert newcomer.proc is not None and newcomer.proc.wait(timeout=30) == 0
        wait_for(lambda: settled(nodes[0], ["n1", "n2", "n3"]), timeout=60,
                 what="n4 out of the voters and members")

        nodes[2].kill()
        wait_for(lambda: "link to node lost node=n3" in nodes[0].log(), what="n3 gone")
        forgot = cli(nodes[0], "forget", "n3")
        assert forgot.returncode == 0, forgot.stderr
        after = wait_for(lambda: settled(nodes[1], ["n1", "n2"]), timeout=60,
                         what="n3 out of the voters and members")
        assert f"127.0.0.1:{nodes[2].ports['cluster'] + 1}" not in after["raft"]["voters"]
        newcomer.start()  # two voters of two still agree: n4 joins through them
        wait_for(lambda: settled(nodes[0], ["n1", "n2", "n4"]), timeout=60,
                 what="n4 to join again")
    finally:
        nodes.stop_all()


def test_nodes_joining_one_by_one_take_the_partitions_nothing_was_written_to(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """n1 starts alone and leads every partition; one of them gets a record. n2 and n3 join
    through n1: the partitions never written move to them with the next leader epoch, until
    each node leads 2 or 3; the written one stays on n1. Every partition takes publishes on
    every node afterwards, and a subscriber gets them."""
    from test_cluster_partitions import topics_by_partition

    admin = f'\n[admin]\nlisten = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n'
    topics = topics_by_partition()
    nodes = Nodes([])
    try:
        first = Node("n1", tmp_path / "n1", cluster_config(tmp_path, "n1", [], extra=admin))
        nodes.members.append(first)
        first.start()
        wait_for(lambda: len(metadata(first).get("partitions", {})) == PARTITIONS,
                 timeout=60, what="n1 to lead every partition")
        early = connect(client_factory, first, "early")
        assert acknowledged(early, topics[5], "before the others") < 0x80
        seed = f"127.0.0.1:{first.ports['cluster']}"
        for name in ("n2", "n3"):
            node = Node(name, tmp_path / name, cluster_config(tmp_path, name, [seed],
                                                              extra=admin))
            nodes.members.append(node)
            node.start()

        def spread() -> dict:
            found = metadata(nodes[2]).get("partitions", {})
            counts = [sum(a["leader"] == node.name for a in found.values()) for node in nodes]
            return found if len(found) == PARTITIONS and sorted(counts) == [2, 3, 3] else {}

        placed = wait_for(spread, timeout=60, what="the unwritten partitions to spread")
        assert placed["5"]["leader"] == "n1" and placed["5"]["leader_epoch"] == 1
        assert placed["5"]["written"] is True
        for assignment in placed.values():  # (moved once or twice: n2 came before n3)
            assert (assignment["leader_epoch"] == 1) == (assignment["leader"] == "n1")
        subscriber = connect(client_factory, nodes[1], "sub")
        subscriber.subscribe("seq/#", qos=1)
        publishers = [connect(client_factory, node, f"pub-{node.name}") for node in nodes]
        for publisher in publishers:
            for topic in topics.values():
                wait_for(lambda publisher=publisher, topic=topic: acknowledged(
                    publisher, topic, "after") < 0x80, timeout=30,
                    what=f"{topic} stored")
        got = {subscriber.expect(timeout=30).topic for _ in range(3 * PARTITIONS)}
        assert got == set(topics.values())
    finally:
        nodes.stop_all()


@pytest.mark.parametrize("workers", [1, 2])
def test_a_persistent_session_gets_its_own_nodes_messages_after_other_nodes_ones(
        tmp_path: Path, client_factory: Callable[..., Client], workers: int) -> None:
    """Without the metadata each node keeps its own log: a message that crossed from another
    node is not at a place in this node's log, so it must not move a session's place in it.
    A subscriber on n2 that got 40 of n1's messages, then went offline while n2 took 3 on
    the same topic, gets those 3 when it comes back, and the 3 n1 took meanwhile."""
    with start_cluster(tmp_path, 2, workers=workers, metadata=False) as nodes:
        session = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
        subscriber = client_factory("keeper")
        subscriber.connect(nodes[1].port, clean_start=True, properties=session)
        subscriber.subscribe("plant/line", qos=1)
        far = connect(client_factory, nodes[0], "far")
        for n in range(40):
            far.publish("plant/line", f"far-{n}", qos=1)
        assert [subscriber.expect().payload for _ in range(40)] == [
            f"far-{n}".encode() for n in range(40)]
        subscriber.disconnect()
        near = connect(client_factory, nodes[1], "near")
        for n in range(3):
            near.publish("plant/line", f"near-{n}", qos=1)
            far.publish("plant/line", f"far-{40 + n}", qos=1)
        back = client_factory("keeper")
        back.connect(nodes[1].port, clean_start=False, properties=session)
        got = [back.expect().payload for _ in range(6)]
        assert sorted(got) == sorted([f"near-{n}".encode() for n in range(3)]
                                     + [f"far-{40 + n}".encode() for n in range(3)])
        assert [p for p in got if p.startswith(b"near")] == [b"near-0", b"near-1", b"near-2"]
        assert [p for p in got if p.startswith(b"far")] == [b"far-40", b"far-41", b"far-42"]


def retained_view(client_factory: Callable[..., Client], node: Node, name: str,
                  expected: dict[str, bytes] | None = None) -> dict[str, bytes]:
    """The retained messages a new subscriber of ``room/#`` on ``node`` gets: until they are
    exactly ``expected`` (if given), or until none came for a second."""
    client = connect(client_factory, node, name)
    try:
        client.subscribe("room/#", qos=1)
        got: dict[str, bytes] = {}
        while got != expected:
            try:
                message = client.expect(timeout=1.0)
            except queue.Empty:
                break
            assert message.retain  # (nothing but retained messages is published meanwhile)
            got[message.topic] = message.payload
        return got
    finally:
        client.disconnect()


def test_with_metadata_retained_messages_published_anywhere_are_served_everywhere(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """The partitions led across the nodes: retained QoS 1 publishes on each node, for topics
    of every partition (so most are appended by another node), are served by every node to
    a new subscriber, and a clear made on one node is seen by all."""
    with start_cluster(tmp_path, 3, workers=2) as nodes:
        expected: dict[str, bytes] = {}
        for index, node in enumerate(nodes):
            publisher = connect(client_factory, node, f"thermostat-{node.name}")
            for n in range(index * 8, index * 8 + 8):
                topic, payload = f"room/{n}/temp", f"{n}".encode()
                assert acknowledged(publisher, topic, payload, retain=True) < 0x80
                expected[topic] = payload
        polls = iter(range(1000))
        for node in nodes:
            wait_for(lambda node=node: retained_view(client_factory, node,
                                                     f"v{next(polls)}", expected) == expected,
                     what=f"{node.name} to serve the retained messages of every node")
        clearer = connect(client_factory, nodes[2], "clearer")
        assert acknowledged(clearer, "room/0/temp", b"", retain=True) < 0x80
        del expected["room/0/temp"]
        for node in nodes:
            wait_for(lambda node=node: retained_view(client_factory, node,
                                                     f"v{next(polls)}", expected) == expected,
                     what=f"{node.name} to drop the cleared message")


def test_retained_messages_are_one_store_for_the_cluster(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """A retained message published on one node is served by every node; a node killed with
    kill -9 and restarted serves what changed while it was away (cleared topics included),
    and what it changed itself before dying is served by the others. (Each node its own
    log: with the metadata on, a retained QoS 1 publish to a partition the dead node leads
    is refused, and the retained store is the subject here.)"""
    with start_cluster(tmp_path, 3, workers=2, metadata=False) as nodes:
        publisher = connect(client_factory, nodes[0], "thermostat")
        expected = {f"room/{n}/temp": f"{20 + n}".encode() for n in range(6)}
        for topic, payload in expected.items():
            publisher.publish(topic, payload, qos=1, retain=True)
        polls = iter(range(1000))
        for node in nodes:
            wait_for(lambda node=node: retained_view(client_factory, node,
                                                     f"v{next(polls)}", expected) == expected,
                     what=f"{node.name} to serve the retained messages published on n1")
        nodes[2].kill()
        publisher.publish("room/0/temp", "", qos=1, retain=True)  # cleared while n3 is away
        publisher.publish("room/1/temp", "30", qos=1, retain=True)
        changed = {**expected, "room/1/temp": b"30"}
        del changed["room/0/temp"]
        nodes[2].restart()
        wait_for(lambda: retained_view(client_factory, nodes[2], f"v{next(polls)}",
                                       changed) == changed,
                 what="n3, restarted, to serve what changed while it was away")
        # and it serves nothing more: no cleared message came back from its own copy
        assert retained_view(client_factory, nodes[2], "last-n3") == changed
        assert retained_view(client_factory, nodes[1], "last-n2") == changed


def test_sys_topics_and_cluster_status_show_each_node_and_the_sums(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    admin = (f'\n[admin]\nlisten = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n'
             '[mqtt]\nsys_interval = 1\n')
    with start_cluster(tmp_path, 3, workers=2, extra=admin) as nodes:
        clients = [connect(client_factory, nodes[1], f"on-n2-{n}") for n in range(3)]
        clients.append(connect(client_factory, nodes[2], "on-n3"))
        watcher = connect(client_factory, nodes[0], "watcher")  # 5 clients in all
        watcher.subscribe("$SYS/broker/cluster/#", qos=0)
        seen: dict[str, bytes] = {}

        def figures_are(wanted: dict[str, bytes]) -> bool:
            while True:
                try:
                    message = watcher.expect(timeout=0.2)
                except queue.Empty:
                    return all(seen.get(topic) == value for topic, value in wanted.items())
                seen[message.topic] = message.payload

        prefix = "$SYS/broker/cluster/"
        wait_for(lambda: figures_are({
            prefix + "clients/connected": b"5", prefix + "nodes": b"3",
            prefix + "nodes/n1/clients/connected": b"1",
            prefix + "nodes/n2/clients/connected": b"3",
            prefix + "nodes/n3/clients/connected": b"1"}), timeout=30,
            what="the cluster's figures on n1's $SYS")
        url = f"http://127.0.0.1:{nodes[0].ports['admin']}"
        command = [sys.executable, "-m", "meshmq", "cluster", "status", "--admin", url,
                   "--api-key", ADMIN_KEY]
        state = json.loads(subprocess.run([*command, "--json"], capture_output=True,
                                          text=True, timeout=30, check=True).stdout)
        assert state["stats"]["totals"]["clients_connected"] == 5
        assert sorted(state["stats"]["nodes"]) == ["n1", "n2", "n3"]
        text = subprocess.run(command, capture_output=True, text=True, timeout=30,
                              check=True).stdout
        assert re.search(r"^n2\s+3\s+0\s+\d+\s+\d+\s+\d+$", text, re.M), text
        assert re.search(r"^cluster\s+5\s+1\s+\d+", text, re.M), text  # the watcher's


@pytest.mark.faults
@pytest.mark.skipif(not LONG, reason="the long fault suite runs with MESHMQ_FAULTS=1 "
                    "(docs/testing.md; the short suite has leave and forget with the metadata)")
def test_a_node_leaves_and_a_dead_one_is_forgotten(tmp_path: Path) -> None:
    """``meshmq cluster leave`` on n3: the others drop it and it stops (exit 0). n2 killed
    with kill -9, then ``meshmq cluster forget n2`` on n1: dropped too; restarted, n2 links
    again and is a member again."""
    admin = f'\n[admin]\nlisten = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n'
    # (the links' members; with the metadata on, 2 voters of 2 left after n3's leave could
    # not agree to forget n2 once it is dead: see the metadata's test below)
    with start_cluster(tmp_path, 3, workers=2, extra=admin, metadata=False) as nodes:
        def cli(node: Node, *action: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "meshmq", "cluster", *action, "--admin",
                 f"http://127.0.0.1:{node.ports['admin']}", "--api-key", ADMIN_KEY],
                capture_output=True, text=True, timeout=30)

        def members(node: Node) -> list[str]:
            state = json.loads(cli(node, "status", "--json").stdout)
            return [n["node_id"] for n in state["nodes"]]

        left = cli(nodes[2], "leave")
        assert left.returncode == 0, left.stderr
        assert nodes[2].proc is not None and nodes[2].proc.wait(timeout=30) == 0
        for node in (nodes[0], nodes[1]):
            wait_for(lambda node=node: "n3" not in members(node),
                     what=f"{node.name} to drop n3")
        refused = cli(nodes[0], "forget", "n2")  # n2 is up: forgetting it is refused
        assert refused.returncode == 1 and "is linked" in refused.stderr, refused.stderr
        nodes[1].kill()
        wait_for(lambda: "link to node lost node=n2" in nodes[0].log(), what="n2 gone")
        forgot = cli(nodes[0], "forget", "n2")
        assert forgot.returncode == 0, forgot.stderr
        assert members(nodes[0]) == []
        unknown = cli(nodes[0], "forget", "n9")
        assert unknown.returncode == 1 and "not known" in unknown.stderr
        nodes[1].restart()
        wait_for(lambda: members(nodes[0]) == ["n2"], what="n2 a member again")


def test_a_node_joins_and_leaves_under_traffic_without_loss_elsewhere(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """Publishers on n1 and n2 send numbered QoS 1 messages all along; n3 joins, a subscriber
    there gets the traffic, then n3 leaves (``meshmq cluster leave``). The subscribers on n1
    and n2 get every message of each publisher once, in order, throughout."""
    import threading

    admin = f'\n[admin]\nlisten = "127.0.0.1:0"\napi_key = "{ADMIN_KEY}"\n'
    with start_cluster(tmp_path, 2, workers=2, extra=admin) as nodes:
        subscribers = {}
        for node in nodes:
            subscriber = connect(client_factory, node, f"sub-{node.name}")
            subscriber.subscribe("load/#", qos=1)
            subscribers[node.name] = subscriber
        stop = threading.Event()
        counts: dict[str, int] = {}
        failures: list[BaseException] = []

        def publish_all(node: Node) -> None:
            try:
                publisher = connect(client_factory, node, f"pub-{node.name}")
                number = 0
                while not stop.is_set():
                    publisher.publish(f"load/{node.name}", f"{node.name}:{number}", qos=1)
                    number += 1
                counts[node.name] = number
                publisher.publish(f"load/{node.name}", f"{node.name}:end", qos=1)
            except BaseException as error:  # reported by the test's thread
                failures.append(error)

        threads = [threading.Thread(target=publish_all, args=(node,)) for node in nodes]
        for thread in threads:
            thread.start()
        n3 = Node("n3", tmp_path / "n3", cluster_config(
            tmp_path, "n3", [f"127.0.0.1:{nodes[0].ports['cluster']}"], extra=admin), 2)
        nodes.members.append(n3)
        n3.start()
        wait_for(lambda: linked(n3) >= 2 * 2, what="n3's workers to link n1 and n2")
        joined = connect(client_factory, n3, "sub-n3")
        joined.subscribe("load/#", qos=1)
        heard = {joined.expect(timeout=30).payload.split(b":")[0] for _ in range(50)}
        assert heard  # the traffic reaches the node that joined
        left = subprocess.run(
            [sys.executable, "-m", "meshmq", "cluster", "leave", "--admin",
             f"http://127.0.0.1:{n3.ports['admin']}", "--api-key", ADMIN_KEY],
            capture_output=True, text=True, timeout=30)
        assert left.returncode == 0, left.stderr
        assert n3.proc is not None and n3.proc.wait(timeout=30) == 0
        for node in nodes.members[:2]:
            wait_for(lambda node=node: "n3" not in [row["node_id"] for row in json.loads(
                subprocess.run([sys.executable, "-m", "meshmq", "cluster", "status", "--json",
                                "--admin", f"http://127.0.0.1:{node.ports['admin']}",
                                "--api-key", ADMIN_KEY], capture_output=True, text=True,
                               timeout=30).stdout)["nodes"]], what=f"{node.name} to drop n3")
        stop.set()
        for thread in threads:
            thread.join(timeout=60)
        assert not failures, failures
        for name, subscriber in subscribers.items():
            seen: dict[str, list[int]] = {"n1": [], "n2": []}
            ended: set[str] = set()
            while ended != {"n1", "n2"}:
                source, number = subscriber.expect(timeout=30).payload.decode().split(":")
                if number == "end":
                    ended.add(source)
                else:
                    seen[source].append(int(number))
            for source, numbers in seen.items():
                assert numbers == list(range(counts[source])), (name, source, len(numbers))


def test_a_client_id_connecting_on_another_node_takes_over_its_connection(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """MQTT-3.1.4-3 across nodes: the older connection of a client id gets DISCONNECT 0x8E.
    With Clean Start 0 the session comes along to the new node (session present), and back;
    with Clean Start 1 it ends."""
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    with start_cluster(tmp_path, 2, workers=2) as nodes:
        first = client_factory("dev-1", 5)
        first.connect(nodes[0].port, clean_start=False, properties=session)
        first.subscribe("cmd/dev-1", qos=1)
        second = client_factory("dev-1", 5)
        flags, _, _ = second.connect(nodes[1].port, clean_start=False, properties=session)
        assert flags.session_present is True  # its session came from n1
        assert first.disconnects.get(timeout=10).value == 0x8E  # session taken over
        sender = connect(client_factory, nodes[0], "sender")
        sender.publish("cmd/dev-1", "while on n2", qos=1)  # its subscription came along
        assert second.expect().payload == b"while on n2"
        assert second.disconnects.empty()
        third = client_factory("dev-1", 5)  # back on n1: the session comes back from n2
        flags, _, _ = third.connect(nodes[0].port, clean_start=False, properties=session)
        assert flags.session_present is True
        assert second.disconnects.get(timeout=10).value == 0x8E
        sender.publish("cmd/dev-1", "back on n1", qos=1)
        got = third.expect()
        if got.payload == b"while on n2":  # its PUBACK (sent by paho after the message was
            assert got.dup  # handed over) had not reached n2 when the session moved: resent
            got = third.expect()
        assert got.payload == b"back on n1"
        clean = client_factory("dev-1", 5)  # a clean start on n2 ends n1's session
        clean.connect(nodes[1].port, clean_start=True)
        assert third.disconnects.get(timeout=10).value == 0x8E
        clean.disconnect()  # (its own session, expiry 0, ends with it)
        last = client_factory("dev-1", 5)

        def session_anywhere() -> bool:
            flags, _, _ = last.connect(nodes[0].port, clean_start=False, properties=session)
            last.disconnect()
            return bool(flags.session_present)

        assert session_anywhere() is False


def test_a_persistent_session_moves_to_the_node_its_client_reconnects_to(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """Sessions anywhere: a QoS 1 subscriber of n1 goes offline; what n1 (from its log, by
    the session's cursor) and n3 (copies that crossed) take for it meanwhile waits in its
    session; it reconnects to n2 and gets all of it there, session present; then what n3
    takes reaches it on n2 once."""
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    with start_cluster(tmp_path, 3, workers=2) as nodes:
        subscriber = client_factory("mover")
        subscriber.connect(nodes[0].port, clean_start=False, properties=session)
        subscriber.subscribe("fleet/#", qos=1)
        subscriber.disconnect()
        near = connect(client_factory, nodes[0], "near")
        far = connect(client_factory, nodes[2], "far")
        for n in range(5):
            near.publish("fleet/near", f"near-{n}", qos=1)
            far.publish("fleet/far", f"far-{n}", qos=1)
        back = client_factory("mover")
        flags, _, _ = back.connect(nodes[1].port, clean_start=False, properties=session)
        assert flags.session_present is True
        got = [back.expect().payload for _ in range(10)]
        assert [p for p in got if p.startswith(b"near")] == [f"near-{n}".encode()
                                                             for n in range(5)]
        assert [p for p in got if p.startswith(b"far")] == [f"far-{n}".encode()
                                                            for n in range(5)]
        for n in range(3):
            far.publish("fleet/far", f"live-{n}", qos=1)
        assert [back.expect().payload for _ in range(3)] == [b"live-0", b"live-1", b"live-2"]
        near.publish("fleet/near", "end-n1", qos=1)  # barriers from both other nodes: a
        far.publish("fleet/far", "end-n3", qos=1)  # copy through n1 would come before them
        ends = {back.expect().payload for _ in range(2)}
        assert ends == {b"end-n1", b"end-n3"}
        back.expect_none()


def test_inflight_messages_move_with_the_session_and_are_resent_with_dup(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """A subscriber on n1 takes three QoS 1 messages and acknowledges none; its connection
    is cut; it reconnects to n2 and gets the three again, with DUP set (MQTT-4.4.0-1)."""
    session = props(PacketTypes.CONNECT, SessionExpiryInterval=300)
    with start_cluster(tmp_path, 2, workers=1) as nodes:
        silent = client_factory("unacked", manual_ack=True)
        silent.connect(nodes[0].port, clean_start=False, properties=session)
        silent.subscribe("jobs/#", qos=1)
        sender = connect(client_factory, nodes[0], "sender")
        for n in range(3):
            sender.publish("jobs/run", f"job-{n}", qos=1)
        first = [silent.expect() for _ in range(3)]
        assert [m.payload for m in first] == [b"job-0", b"job-1", b"job-2"]
        assert not any(m.dup for m in first)
        silent.paho.socket().shutdown(socket.SHUT_RDWR)  # cut, no DISCONNECT, no PUBACK
        silent.paho.loop_stop()
        back = client_factory("unacked")
        flags, _, _ = back.connect(nodes[1].port, clean_start=False, properties=session)
        assert flags.session_present is True
        again = [back.expect() for _ in range(3)]
        assert [m.payload for m in again] == [b"job-0", b"job-1", b"job-2"]
        assert all(m.dup for m in again)
        sender.publish("jobs/run", "job-3", qos=1)  # and on from there, on n2
        latest = back.expect()
        assert (latest.payload, latest.dup) == (b"job-3", False)


def test_a_node_that_hangs_past_dead_gets_what_was_routed_to_it(
        tmp_path: Path, client_factory: Callable[..., Client]) -> None:
    """n2 frozen (SIGSTOP) longer than the 12 s after which n1 closes its link as dead: the
    messages n1 routed to n2's subscriber before and after that close were dropped, although
    the subscriber's connection and session survived the freeze. Now they wait for n2 and
    reach it, in order, when the link is up again (some may come twice). (Each node its own
    log: the topic's partition is not refused while the frozen node leads it.)"""
    with start_cluster(tmp_path, 2, workers=1, metadata=False) as nodes:
        subscriber = client_factory("frozen-sub")
        subscriber.connect(nodes[1].port, clean_start=True, keepalive=120)
        subscriber.subscribe("seq", qos=1)
        publisher = connect(client_factory, nodes[0], "pub")
        publisher.publish("seq", "0", qos=1)
        assert subscriber.expect().payload == b"0"  # routed from n1 to n2
        nodes[1].pause()
        try:
            sent = [str(n).encode() for n in range(1, 31)]
            for payload in sent:
                publisher.publish("seq", payload, qos=1)
            wait_for(lambda: "link to node lost node=n2" in nodes[0].log(), timeout=40,
                     what="n1 to close its link to the frozen n2 as dead")
            for n in range(31, 61):
                sent.append(str(n).encode())
                publisher.publish("seq", sent[-1], qos=1)
        finally:
            nodes[1].resume()
        got: list[bytes] = []
        while not set(sent) <= set(got):  # ("0" may come again: it was not acknowledged)
            got.append(subscriber.expect(timeout=30).payload)
        assert [payload for payload in dict.fromkeys(got) if payload != b"0"] == sent
        assert "resent to node=n2" in nodes[0].log()


def test_a_node_with_metadata_on_port_0_runs_its_voter_on_the_next_port(tmp_path: Path) -> None:
    """The voter listens on the cluster port + 1: with ``listen`` port 0 the supervisor draws a
    cluster port whose next one is free, so the voter starts and the node becomes controller."""
    node = Node("n1", tmp_path / "n1", cluster_config(tmp_path, "n1", [],
                                                      extra="metadata = true\n"))
    node.start()
    try:
        raft = node.ports["cluster"] + 1
        wait_for(lambda: f"raft=127.0.0.1:{raft}" in node.log(), what="the voter's address")
        wait_for(lambda: "controller node=n1 epoch=1" in node.log(), timeout=30,
                 what="n1 to claim the controller")
        with socket.create_connection(("127.0.0.1", raft), timeout=5):
            pass  # the voter listens there
    finally:
        node.stop()
