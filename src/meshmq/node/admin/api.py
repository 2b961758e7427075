"""The admin API's handlers (``/api/v1/...``) and ``/metrics``.

Each handler asks the node's workers (views.py) and merges their answers: a client, a session
lives on one worker, so a list is the workers' lists concatenated and a lookup takes the one
worker that has it. Lists are paged (``offset``, ``limit``) and filtered by query parameters;
the answer is ``{"data": [...], "total": n, "offset": o, "limit": l}``. The description of
every endpoint is openapi.py, served at ``/api/v1/openapi.json``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

from aiohttp import web

from meshmq.cluster.metadata import MetadataError
from meshmq.config import redact_url
from meshmq.mqtt.errors import RemoteProtocolError
from meshmq.mqtt.topics import validate_topic_filter, validate_topic_name
from meshmq.node.admin import openapi
from meshmq.node.admin.metrics import NodeMetrics, render
from meshmq.node.admin.views import NodeViews

VIEWS = web.AppKey("views", NodeViews)
METRICS = web.AppKey("metrics", NodeMetrics)
MAX_LIMIT = 1000
CLIENT_FIELDS = ("client_id", "username", "peer", "protocol", "connected_at", "inflight",
                 "queued", "subscriptions")


class BadRequest(Exception):
    """A request the API cannot serve: its status and a one-line reason."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _int_param(request: web.Request, name: str, default: int, low: int, high: int) -> int:
    text = request.query.get(name)
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        raise BadRequest(f"{name} must be an integer, got {text!r}") from None
    if not low <= value <= high:
        raise BadRequest(f"{name} must be between {low} and {high}, got {value}")
    return value


def page(request: web.Request, rows: list[dict[str, Any]], key: str) -> web.Response:
    """Rows sorted (``sort``: a field, ``-field`` descending; default ``key``), then paged."""
    offset = _int_param(request, "offset", 0, 0, 2**31)
    limit = _int_param(request, "limit", 100, 1, MAX_LIMIT)
    sort = request.query.get("sort", key)
    field = sort.removeprefix("-")
    if rows and field not in rows[0]:
        raise BadRequest(f"cannot sort by {field!r}: choose from {', '.join(rows[0])}")
    rows.sort(key=lambda row: (row[field] is None, row[field]), reverse=sort.startswith("-"))
    return web.json_response({"data": rows[offset:offset + limit], "total": len(rows),
                              "offset": offset, "limit": limit})


def _contains(request: web.Request, row: dict[str, Any], *fields: str) -> bool:
    """Every given filter parameter is a substring of its field (case-insensitive)."""
    for field in fields:
        wanted = request.query.get(field)
        if wanted is not None and wanted.lower() not in str(row.get(field) or "").lower():
            return False
    return True


def _views(request: web.Request) -> NodeViews:
    return request.app[VIEWS]


# ---------------------------------------------------------------------- metrics and node


async def gather_metrics(views: NodeViews, metrics: NodeMetrics) -> dict[str, Any]:
    answers = await views.ask("metrics")
    totals = metrics.update(list(answers.values()))
    up = totals.setdefault("meshmq_worker_up", {})
    for index in range(views.workers):
        up.setdefault(str(index), 0)  # a worker that did not answer
    return totals


async def get_metrics(request: web.Request) -> web.Response:
    totals = await gather_metrics(_views(request), request.app[METRICS])
    return web.Response(body=render(totals), headers={
        "Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def get_cluster(request: web.Request) -> web.Response:
    """The cluster as this node sees it: per other node, how many of this node's workers are
    linked to it and whether any suspects it (docs/cluster.md)."""
    views = _views(request)
    answers = [a for a in (await views.ask("cluster")).values() if a is not None]
    if not answers:
        return web.json_response({"node_id": None, "cluster_id": None, "workers": views.workers,
                                  "nodes": []})
    nodes: dict[str, dict[str, Any]] = {}
    for answer in answers:
        for node in answer["nodes"]:
            row = nodes.setdefault(node["node_id"], {
                "node_id": node["node_id"], "address": node["address"], "linked": 0,
                "suspected": False})
            row["linked"] += int(node["linked"])
            row["suspected"] = row["suspected"] or node["suspected"]
    first = answers[0]
    return web.json_response({
        "node_id": first["node_id"],
        "cluster_id": next((a["cluster_id"] for a in answers if a["cluster_id"]), ""),
        "workers": views.workers, "nodes": sorted(nodes.values(), key=lambda n: n["node_id"]),
        "metadata": max((a.get("metadata") for a in answers if a.get("metadata")),
                        key=lambda m: m["version"], default=None),
        "metadata_configured": any(a.get("metadata_configured") for a in answers),
        "raft": await views.raft_status(),
        # per node and summed, as of the last $SYS interval (the node's worker 0 has them)
        "stats": next((a["stats"] for a in answers if a.get("stats")), {})})


async def post_forget(request: web.Request) -> web.Response:
    """Drop a node that is gone for good from this node's and the other nodes' members (they
    stop dialing it); a node that links again later is a member again (docs/cluster.md)."""
    views = _views(request)
    node_id = request.match_info["node_id"]
    state = (await views.ask("cluster")).get(views.index)
    if state is None:
        raise BadRequest("not a cluster node (no [cluster] section)")
    if node_id == state["node_id"]:
        raise BadRequest(f"{node_id!r} is this node: use POST /api/v1/cluster/leave")
    if not any(node["node_id"] == node_id for node in state["nodes"]):
        raise BadRequest(f"node {node_id!r} is not known here", 404)
    if any(node["node_id"] == node_id and node["linked"] for node in state["nodes"]):
        raise BadRequest(f"node {node_id!r} is linked: stop it first, or run "
                         "meshmq cluster leave on it", 409)
    try:
        await views.forget_in_metadata(node_id)
    except MetadataError as error:
        raise BadRequest(f"the metadata cannot drop {node_id!r} now (nothing changed): "
                         f"{error}", 503) from None
    await views.ask("forget", node_id=node_id)
    return web.json_response({"forgotten": node_id})


async def post_leave(request: web.Request) -> web.Response:
    """This node leaves the cluster: the others drop it from their members, then it stops
    (its supervisor gets SIGTERM, as from an operator: a clean stop, exit status 0)."""
    views = _views(request)
    state = (await views.ask("cluster")).get(views.index)
    if state is None:
        raise BadRequest("not a cluster node (no [cluster] section)")
    try:
        await views.leave_metadata()
    except MetadataError as error:
        raise BadRequest(f"the metadata cannot take this node out now (it keeps running): "
                         f"{error}", 503) from None
    await views.ask("forget", node_id=state["node_id"])
    loop = asyncio.get_running_loop()
    # (the answer goes out first; the FORGET frames are queued ahead of the links' close)
    loop.call_later(0.2, os.kill, os.getppid(), signal.SIGTERM)
    return web.json_response({"leaving": state["node_id"]})


async def get_node(request: web.Request) -> web.Response:
    views = _views(request)
    workers = await views.ask("worker")
    config = masked_config(views)
    return web.json_response({
        "status": "running" if len(workers) == views.workers else "degraded",
        "version": views.version(),
        "uptime": round(time.time() - min(w["started"] for w in workers.values()), 3),
        "workers": {"count": views.workers, "up": len(workers),
                    "list": list(workers.values())},
        "listeners": workers[views.index]["listeners"],
        "config": config,
    })


SECRET_WORDS = ("key", "password", "secret", "token", "authorization")


def masked_config(views: NodeViews) -> dict[str, dict[str, Any]]:
    """The configuration in force, secrets shown as ``***`` (file paths are not secrets)."""
    from dataclasses import asdict

    config = asdict(views.local.broker.config)
    for section in config.values():
        for name, value in section.items():
            secret = any(word in name for word in SECRET_WORDS) and not name.endswith("file")
            if secret and value:
                section[name] = "***"
            elif isinstance(value, str) and name.endswith("url"):  # (hooks.url) user:password@
                section[name] = redact_url(value)
    return config


async def get_overview(request: web.Request) -> web.Response:
    """The dashboard's figures: a few node totals, to turn into rates between two polls."""
    totals = await gather_metrics(_views(request), request.app[METRICS])

    def total(name: str) -> float:
        return sum(totals.get(name, {}).values())

    return web.json_response({
        "time": time.time(),
        "connections": total("meshmq_connections"),
        "received": total("meshmq_messages_received_total"),
        "delivered": total("meshmq_messages_delivered_total"),
        "bytes_in": total("meshmq_received_bytes_total"),
        "bytes_out": total("meshmq_sent_bytes_total"),
        "dropped": total("meshmq_messages_dropped_total"),
        "sessions": total("meshmq_sessions"),
        "subscriptions": total("meshmq_subscriptions"),
        "retained": total("meshmq_retained_messages"),
        "workers_up": total("meshmq_worker_up"),
    })


SERVICE_FIGURES = {"requests": "meshmq_service_requests_total",
                   "replies": "meshmq_service_replies_total",
                   "retries": "meshmq_service_retries_total",
                   "timeouts": "meshmq_service_timeouts_total",
                   "late_replies": "meshmq_service_late_replies_total",
                   "duplicates": "meshmq_service_duplicates_total",
                   "in_flight": "meshmq_service_in_flight",
                   "workers": "meshmq_service_workers"}


async def get_services(request: web.Request) -> web.Response:
    """Per service: its counters since the node started, its error replies by kind, and its
    round trip (mean, and p50/p99 as the upper bound of the histogram bucket they fall in)."""
    totals = await gather_metrics(_views(request), request.app[METRICS])
    rows: dict[str, dict[str, Any]] = {}

    def row(service: str) -> dict[str, Any]:
        return rows.setdefault(service, {
            "service": service, **dict.fromkeys(SERVICE_FIGURES, 0), "errors": 0,
            "error_kinds": "", "latency_count": 0, "latency_mean": None, "latency_p50": None,
            "latency_p99": None})

    for figure, name in SERVICE_FIGURES.items():
        for service, value in totals.get(name, {}).items():
            row(service)[figure] = value
    for key, value in sorted(totals.get("meshmq_service_errors_total", {}).items()):
        service, _, kind = key.partition("|")
        entry = row(service)
        entry["errors"] += value
        entry["error_kinds"] = f"{entry['error_kinds']} {kind}={value:g}".strip()
    buckets: dict[str, list[tuple[float, float]]] = {}
    for key, count in totals.get("meshmq_service_latency_seconds_bucket", {}).items():
        service, _, bound = key.rpartition("|")
        buckets.setdefault(service, []).append((float(bound), count))
    sums = totals.get("meshmq_service_latency_seconds_sum", {})
    for service, counts in buckets.items():
        counts.sort()
        observed = sum(count for _, count in counts)
        row(service).update({
            "latency_count": observed,
            "latency_mean": sums.get(service, 0.0) / observed if observed else None,
            "latency_p50": _quantile(counts, observed, 0.5),
            "latency_p99": _quantile(counts, observed, 0.99)})
    return page(request, list(rows.values()), "service")


def _quantile(counts: list[tuple[float, float]], observed: float, q: float) -> float | None:
    """The upper bound of the bucket holding quantile ``q`` (None: nothing observed; the
    last bucket has no bound: its lower one is given)."""
    if not observed:
        return None
    running, previous = 0.0, 0.0
    for bound, count in counts:
        running += count
        if running >= q * observed:
            return bound if bound != float("inf") else previous
        previous = bound
    return previous


async def get_openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi.SPEC)


# ---------------------------------------------------------------------- clients and sessions


async def get_clients(request: web.Request) -> web.Response:
    protocol = request.query.get("protocol")
    if protocol is not None and protocol not in ("3.1", "3.1.1", "5.0"):
        raise BadRequest(f"protocol must be 3.1, 3.1.1 or 5.0, got {protocol!r}")
    rows = [row for row in await _views(request).merged("clients")
            if _contains(request, row, "client_id", "username", "peer")
            and (protocol is None or row["protocol"] == protocol)]
    return page(request, rows, "client_id")


def _client_id(request: web.Request) -> str:
    client_id = request.match_info["client_id"]
    if len(client_id.encode("utf-8")) > 65535:
        raise BadRequest("client id longer than 65535 bytes")
    return client_id


async def get_client(request: web.Request) -> web.Response:
    client_id = _client_id(request)
    for index, detail in (await _views(request).ask("session", client_id=client_id)).items():
        if detail is not None and "connection" in detail:
            return web.json_response({"worker": index, **detail["connection"],
                                      "session": detail})
    raise BadRequest(f"client {client_id!r} is not connected", 404)


async def delete_client(request: web.Request) -> web.Response:
    """Kick: DISCONNECT 0x98 (5.0) and close; the session stays as after any disconnect."""
    client_id = _client_id(request)
    kicked = await _views(request).ask("kick", client_id=client_id)
    if not any(kicked.values()):
        raise BadRequest(f"client {client_id!r} is not connected", 404)
    return web.json_response({"kicked": client_id})


async def get_sessions(request: web.Request) -> web.Response:
    state = request.query.get("state", "all")
    if state not in ("all", "online", "offline"):
        raise BadRequest(f"state must be all, online or offline, got {state!r}")
    rows = [row for row in await _views(request).merged("sessions")
            if _contains(request, row, "client_id", "username")
            and (state == "all" or row["online"] == (state == "online"))]
    return page(request, rows, "client_id")


async def get_session(request: web.Request) -> web.Response:
    client_id = _client_id(request)
    for index, detail in (await _views(request).ask("session", client_id=client_id)).items():
        if detail is not None:
            detail.pop("connection", None)
            return web.json_response({"worker": index, **detail})
    raise BadRequest(f"no session {client_id!r}", 404)


async def delete_session(request: web.Request) -> web.Response:
    client_id = _client_id(request)
    outcomes = set((await _views(request).ask("delete_session", client_id=client_id)).values())
    if "online" in outcomes:
        raise BadRequest(f"client {client_id!r} is connected: kick it first"
                         " (DELETE /api/v1/clients/{id})", 409)
    if "deleted" not in outcomes:
        raise BadRequest(f"no session {client_id!r}", 404)
    return web.json_response({"deleted": client_id})


# ---------------------------------------------------------------------- topics and retained


async def get_subscriptions(request: web.Request) -> web.Response:
    rows = [row for row in await _views(request).merged("subscriptions")
            if _contains(request, row, "client_id", "filter")]
    return page(request, rows, "filter")


async def get_topics(request: web.Request) -> web.Response:
    """Subscribed topic filters with their subscriber counts."""
    counts: dict[str, int] = {}
    for row in await _views(request).merged("subscriptions"):
        counts[row["filter"]] = counts.get(row["filter"], 0) + 1
    rows = [{"filter": f, "subscribers": n} for f, n in counts.items()
            if _contains(request, {"filter": f}, "filter")]
    return page(request, rows, "filter")


async def _json_body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise BadRequest("the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    return body


def _topic(value: object, what: str = "topic") -> str:
    if not isinstance(value, str):
        raise BadRequest(f"{what} must be a string")
    try:
        validate_topic_name(value)
    except (ValueError, RemoteProtocolError):
        raise BadRequest(f"{value!r} is not a valid topic name") from None
    return value


async def post_match(request: web.Request) -> web.Response:
    """Which subscriptions (of which clients) a publish on ``topic`` would reach."""
    topic = _topic((await _json_body(request)).get("topic"))
    rows = await _views(request).merged("match", topic=topic)
    return page(request, rows, "client_id")


async def get_retained(request: web.Request) -> web.Response:
    topic_filter = request.query.get("filter", "#")
    try:
        validate_topic_filter(topic_filter)
    except (ValueError, RemoteProtocolError):
        raise BadRequest(f"{topic_filter!r} is not a valid topic filter") from None
    rows = await _views(request).merged("retained", filter=topic_filter)
    return page(request, rows, "topic")


async def delete_retained(request: web.Request) -> web.Response:
    topic = _topic(request.query.get("topic"), "the topic query parameter")
    views = _views(request)
    if not await views.merged("retained", filter=topic):
        raise BadRequest(f"no retained message on {topic!r}", 404)
    views.delete_retained(topic)
    return web.json_response({"deleted": topic})


# ---------------------------------------------------------------------- commit log


async def get_partitions(request: web.Request) -> web.Response:
    """Each partition from its leader, with ``lag``: how far the slowest session reading it
    from the log (any worker's) is behind its high watermark."""
    views = _views(request)
    rows = await views.merged("partitions")
    lag: dict[int, int] = {}
    for reader in await views.merged("cursors"):
        for position in reader["cursor"]:
            partition = position["partition"]
            lag[partition] = max(lag.get(partition, 0), position["lag"])
    for row in rows:
        row["lag"] = lag.get(row["partition"], 0)
    return page(request, rows, "partition")


async def get_segments(request: web.Request) -> web.Response:
    text = request.match_info["partition"]
    if not text.isdigit():
        raise BadRequest(f"partition must be a number, got {text!r}")
    partition = int(text)
    for rows in (await _views(request).ask("segments", partition=partition)).values():
        if rows is not None:
            return web.json_response({"partition": partition, "data": rows})
    raise BadRequest(f"no partition {partition} (or the commit log is off)", 404)


async def get_cursors(request: web.Request) -> web.Response:
    """The sessions reading from the log, the slowest first by default."""
    rows = await _views(request).merged("cursors")
    if "sort" not in request.query:
        rows.sort(key=lambda row: -row["lag"])
        return page_sorted(request, rows)
    return page(request, rows, "lag")


def page_sorted(request: web.Request, rows: list[dict[str, Any]]) -> web.Response:
    offset = _int_param(request, "offset", 0, 0, 2**31)
    limit = _int_param(request, "limit", 100, 1, MAX_LIMIT)
    return web.json_response({"data": rows[offset:offset + limit], "total": len(rows),
                              "offset": offset, "limit": limit})


def add_routes(app: web.Application) -> None:
    add = app.router
    add.add_get("/metrics", get_metrics)
    add.add_get("/api/v1/openapi.json", get_openapi)
    add.add_get("/api/v1/node", get_node)
    add.add_get("/api/v1/cluster", get_cluster)
    add.add_post("/api/v1/cluster/forget/{node_id}", post_forget)
    add.add_post("/api/v1/cluster/leave", post_leave)
    add.add_get("/api/v1/overview", get_overview)
    add.add_get("/api/v1/services", get_services)
    add.add_get("/api/v1/clients", get_clients)
    add.add_get("/api/v1/clients/{client_id:.+}", get_client)
    add.add_delete("/api/v1/clients/{client_id:.+}", delete_client)
    add.add_get("/api/v1/sessions", get_sessions)
    add.add_get("/api/v1/sessions/{client_id:.+}", get_session)
    add.add_delete("/api/v1/sessions/{client_id:.+}", delete_session)
    add.add_get("/api/v1/subscriptions", get_subscriptions)
    add.add_post("/api/v1/subscriptions/match", post_match)
    add.add_get("/api/v1/topics", get_topics)
    add.add_get("/api/v1/retained", get_retained)
    add.add_delete("/api/v1/retained", delete_retained)
    add.add_get("/api/v1/log/partitions", get_partitions)
    add.add_get("/api/v1/log/partitions/{partition}/segments", get_segments)
    add.add_get("/api/v1/log/cursors", get_cursors)
