"""``meshmq cluster dev | status``: try a cluster on one machine, and see how one stands."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def add_cluster_command(commands: Any) -> None:
    cluster = commands.add_parser(
        "cluster", help="run a local cluster for trying it, or show a cluster's state",
        description="Cluster tools (docs/cluster.md).")
    actions = cluster.add_subparsers(dest="action", metavar="ACTION", required=True)
    dev = actions.add_parser(
        "dev", help="run N nodes on 127.0.0.1 in the foreground (Ctrl-C stops them all)",
        description="Start a cluster of N nodes on 127.0.0.1, each a meshmq serve process "
        "with its own data directory and ports; Ctrl-C stops them all.")
    dev.add_argument("--nodes", type=int, default=3, metavar="N", help="nodes (default 3)")
    dev.add_argument("--dir", type=Path, default=Path("meshmq-cluster"), metavar="DIR",
                     help="where the nodes keep their data and logs (default ./meshmq-cluster)")
    dev.add_argument("--port", type=int, default=1883, metavar="N",
                     help="MQTT port of the first node; the others take the next ones")
    dev.add_argument("--cluster-port", type=int, default=7883, metavar="N",
                     help="cluster port of the first node; the others take the next ones")
    dev.add_argument("--workers", type=int, default=1, metavar="N",
                     help="worker processes per node (default 1)")
    dev.set_defaults(run=_dev)
    status = actions.add_parser(
        "status", help="a node's view of the cluster: members, links, suspected nodes",
        description="Ask a node's admin API (its [admin] listener) how the cluster stands.")
    status.add_argument("--admin", required=True, metavar="URL",
                        help="the node's admin listener, e.g. http://127.0.0.1:18083")
    status.add_argument("--api-key", required=True, metavar="KEY", help="admin.api_key")
    status.add_argument("--json", action="store_true", help="print the answer as JSON")
    status.set_defaults(run=_status)


def _dev(args: argparse.Namespace) -> int:
    if not 1 <= args.nodes <= 20:
        print("meshmq cluster dev: error: --nodes must be between 1 and 20", file=sys.stderr)
        return 2
    from meshmq.node.devcluster import run_dev_cluster

    return run_dev_cluster(args.nodes, args.dir, args.port, args.cluster_port, args.workers)


def _status(args: argparse.Namespace) -> int:
    url = args.admin.rstrip("/") + "/api/v1/cluster"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {args.api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            state = json.load(answer)
    except urllib.error.HTTPError as exc:
        print(f"meshmq cluster status: error: {url}: HTTP {exc.code} {exc.reason}",
              file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"meshmq cluster status: error: {url}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(state, indent=2))
        return 0
    print(render_status(state))
    return 0


def render_status(state: dict[str, Any]) -> str:
    """The admin API's ``/api/v1/cluster`` answer as text."""
    if not state.get("node_id"):
        return "not a cluster node (no [cluster] section)"
    cluster_id = state.get("cluster_id") or "(its id not known yet)"
    lines = [f"node {state['node_id']} of cluster {cluster_id}", "",
             f"{'node':<16} {'address':<24} {'links':<10} state"]
    for node in state["nodes"]:
        links = f"{node['linked']}/{state['workers']}"
        health = "suspected" if node["suspected"] else (
            "linked" if node["linked"] == state["workers"] else
            "down" if not node["linked"] else "partly linked")
        lines.append(f"{node['node_id']:<16} {node['address']:<24} {links:<10} {health}")
    metadata = state.get("metadata")
    if not metadata:
        return "\n".join(lines)
    controller = metadata.get("controller")
    lines += ["", "metadata: version {} controller {}".format(
        metadata["version"],
        f"{controller['node']} (epoch {controller['epoch']})" if controller else "(none yet)")]
    down = {node["node_id"] for node in state["nodes"] if not node["linked"]}
    lines.append(f"{'partition':<10} {'leader':<16} {'worker':<7} {'epoch':<6} state")
    for partition, assignment in sorted(metadata["partitions"].items(),
                                        key=lambda item: int(item[0])):
        leader = assignment["leader"]
        health = "offline (its leader is down)" if leader in down else "online"
        lines.append(f"{partition:<10} {leader:<16} {assignment['worker']:<7} "
                     f"{assignment['leader_epoch']:<6} {health}")
    return "\n".join(lines)
