"""``meshmq cluster dev | status | leave | forget``: try a cluster on one machine, see how one
stands, take a node out of it."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import quote


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
    dev.add_argument("--admin-port", type=int, default=18083, metavar="N",
                     help="admin listener of the first node, the others on the next ones, "
                     "API key 'dev' (default 18083; 0: none)")
    dev.add_argument("--no-metadata", dest="metadata", action="store_false",
                     help="run no metadata voters (cluster.metadata = false): each node "
                     "keeps its own log of every partition, and the cluster ports go up by "
                     "one (by default the voters run on the cluster port + 1, so they go up "
                     "by two, and the log's partitions are led across the nodes)")
    dev.add_argument("--metadata", dest="metadata", action="store_true",
                     help=argparse.SUPPRESS)  # the default now; kept for old scripts
    dev.set_defaults(run=_dev)
    status = actions.add_parser(
        "status", help="a node's view of the cluster: members, links, suspected nodes",
        description="Ask a node's admin API (its [admin] listener) how the cluster stands.")
    _admin_arguments(status)
    status.add_argument("--json", action="store_true", help="print the answer as JSON")
    status.set_defaults(run=_status)
    leave = actions.add_parser(
        "leave", help="take the node out of the cluster: the others drop it, then it stops",
        description="The node whose admin listener is named leaves the cluster: every other "
        "node drops it from its members and stops dialing it, then the node stops (exit 0). "
        "Started again later, it joins again through its seeds.")
    _admin_arguments(leave)
    leave.set_defaults(run=_leave)
    forget = actions.add_parser(
        "forget", help="drop a node that is gone for good (asked of any other node)",
        description="Drop NODE, which is down and will not come back, from every node's "
        "members: none dials it any more. If it ever links again, it is a member again.")
    forget.add_argument("node_id", metavar="NODE", help="the node id to drop")
    _admin_arguments(forget)
    forget.set_defaults(run=_forget)


def _admin_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--admin", required=True, metavar="URL",
                        help="the node's admin listener, e.g. http://127.0.0.1:18083")
    parser.add_argument("--api-key", required=True, metavar="KEY", help="admin.api_key")


def _dev(args: argparse.Namespace) -> int:
    if not 1 <= args.nodes <= 20:
        print("meshmq cluster dev: error: --nodes must be between 1 and 20", file=sys.stderr)
        return 2
    from meshmq.node.devcluster import run_dev_cluster

    return run_dev_cluster(args.nodes, args.dir, args.port, args.cluster_port, args.workers,
                           args.admin_port, args.metadata)


def _ask(args: argparse.Namespace, action: str, path: str, method: str = "GET"
         ) -> dict[str, Any] | None:
    """The admin API's JSON answer; None after printing a one-line error."""
    url = args.admin.rstrip("/") + path
    request = urllib.request.Request(url, method=method,
                                     headers={"Authorization": f"Bearer {args.api_key}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            result: dict[str, Any] = json.load(answer)
            return result
    except urllib.error.HTTPError as exc:
        try:
            reason = json.load(exc).get("error") or exc.reason
        except (ValueError, OSError):
            reason = exc.reason
        print(f"meshmq cluster {action}: error: {url}: HTTP {exc.code} {reason}",
              file=sys.stderr)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"meshmq cluster {action}: error: {url}: {exc}", file=sys.stderr)
    return None


def _leave(args: argparse.Namespace) -> int:
    answer = _ask(args, "leave", "/api/v1/cluster/leave", "POST")
    if answer is None:
        return 1
    print(f"node {answer['leaving']} is leaving the cluster and stopping")
    return 0


def _forget(args: argparse.Namespace) -> int:
    answer = _ask(args, "forget", f"/api/v1/cluster/forget/{quote(args.node_id, safe='')}",
                  "POST")
    if answer is None:
        return 1
    print(f"node {answer['forgotten']} dropped from the cluster")
    return 0


def _status(args: argparse.Namespace) -> int:
    state = _ask(args, "status", "/api/v1/cluster")
    if state is None:
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
    lines += _figures(state.get("stats") or {})
    metadata = state.get("metadata")
    if not metadata:
        lines += ["", "metadata: off (each node keeps its own log of every partition; "
                  "cluster.metadata = true leads the partitions across the nodes)"
                  if not state.get("metadata_configured")
                  else "metadata: not reached yet (its voters have not agreed on a state)"]
        return "\n".join(lines)
    controller = metadata.get("controller")
    lines += ["", "metadata: version {} controller {}".format(
        metadata["version"],
        f"{controller['node']} (epoch {controller['epoch']})" if controller else "(none yet)")]
    raft = state.get("raft")
    if raft:
        lines.append("raft voters: {} (leader {}, this node's voter: {}, term {})".format(
            " ".join(raft["voters"] or ()), raft["leader"] or "none", raft["state"],
            raft["term"]))
    down = {node["node_id"] for node in state["nodes"] if not node["linked"]}
    lines.append(f"{'partition':<10} {'leader':<16} {'worker':<7} {'epoch':<6} state")
    for partition, assignment in sorted(metadata["partitions"].items(),
                                        key=lambda item: int(item[0])):
        leader = assignment["leader"]
        health = "offline (its leader is down)" if leader in down else "online"
        lines.append(f"{partition:<10} {leader:<16} {assignment['worker']:<7} "
                     f"{assignment['leader_epoch']:<6} {health}")
    return "\n".join(lines)


FIGURES = (("clients_connected", "clients"), ("subscriptions", "subscriptions"),
           ("messages_received", "received"), ("messages_sent", "sent"),
           ("retained", "retained"))


def _figures(stats: dict[str, Any]) -> list[str]:
    """Each node's $SYS figures and the cluster's sums (as of the last mqtt.sys_interval)."""
    if not stats.get("nodes"):
        return []
    lines = ["", f"{'figures':<16} " + " ".join(f"{title:>13}" for _, title in FIGURES)]
    rows = [*stats["nodes"].items(), ("cluster", stats.get("totals", {}))]
    for name, values in rows:
        lines.append(f"{name:<16} " + " ".join(f"{values.get(key, 0):>13}"
                                               for key, _ in FIGURES))
    return lines
