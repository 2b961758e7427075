"""The admin API's OpenAPI 3.1 description, served at ``/api/v1/openapi.json``.

Written by hand next to the handlers (api.py); tests/node/test_admin_api.py checks that every
route the application serves is described here and every path described here is served.
"""

from __future__ import annotations

from typing import Any

from meshmq import __version__


def _param(name: str, where: str, description: str, schema: dict[str, Any] | None = None,
           required: bool = False) -> dict[str, Any]:
    return {"name": name, "in": where, "description": description,
            "required": required or where == "path", "schema": schema or {"type": "string"}}


PAGING = [
    _param("offset", "query", "rows to skip", {"type": "integer", "minimum": 0}),
    _param("limit", "query", "rows to return (1-1000, default 100)",
           {"type": "integer", "minimum": 1, "maximum": 1000}),
    _param("sort", "query", "field to sort by; -field: descending"),
]
CLIENT_ID = _param("client_id", "path", "the client id (URL-encoded)")
ERROR = {"description": "error", "content": {"application/json": {"schema": {
    "$ref": "#/components/schemas/Error"}}}}


def _op(summary: str, params: list[dict[str, Any]] | None = None, *errors: int,
        body: dict[str, Any] | None = None, content: str = "application/json"
        ) -> dict[str, Any]:
    responses: dict[str, Any] = {"200": {"description": "OK", "content": {content: {}}}}
    responses.update({str(code): ERROR for code in (401, *errors)})
    operation: dict[str, Any] = {"summary": summary, "parameters": params or [],
                                 "responses": responses}
    if body is not None:
        operation["requestBody"] = {"required": True, "content": {
            "application/json": {"schema": body}}}
    return operation


SPEC: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "meshmq admin API", "version": __version__,
             "description": "Operations API of a meshmq node (docs/operations.md). Every"
             " request carries 'Authorization: Bearer <admin.api_key>'."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {"Error": {"type": "object", "required": ["error", "status"],
                              "properties": {"error": {"type": "string"},
                                             "status": {"type": "integer"}}}},
    },
    "security": [{"bearer": []}],
    "paths": {
        "/metrics": {"get": _op("Prometheus metrics of the whole node (auth only with"
                                " admin.metrics_auth)", content="text/plain")},
        "/api/v1/openapi.json": {"get": _op("This description")},
        "/api/v1/node": {"get": _op("Status, version, uptime, workers, listeners and the"
                                    " configuration (secrets masked)")},
        "/api/v1/overview": {"get": _op("Node totals for the dashboard (rates come from two"
                                        " polls)")},
        "/api/v1/services": {"get": _op(
            "Services: requests, replies, retries, timeouts, late replies, errors by kind,"
            " in flight, service workers and round trip (mean, p50, p99)", PAGING, 400)},
        "/api/v1/cluster": {"get": _op("The cluster as this node sees it: the other nodes, how"
                                       " many of this node's workers are linked to each, and"
                                       " whether any suspects it; each node's figures and"
                                       " the sums (stats); with the metadata on, its members,"
                                       " controller and partitions (metadata) and this node's"
                                       " Raft voter (raft: state, leader, term, voters)")},
        "/api/v1/cluster/forget/{node_id}": {"post": _op(
            "Drop a node that is gone for good: every node stops dialing it (it is a member"
            " again if it links again)",
            [_param("node_id", "path", "the node's id")], 400, 404, 409, 503)},
        "/api/v1/cluster/leave": {"post": _op(
            "This node leaves the cluster: the others drop it, then it stops (exit 0)", [],
            400, 503)},
        "/api/v1/clients": {"get": _op(
            "Connected clients of every worker", [
                _param("client_id", "query", "substring of the client id"),
                _param("username", "query", "substring of the user name"),
                _param("peer", "query", "substring of the peer address"),
                _param("protocol", "query", "3.1, 3.1.1 or 5.0"), *PAGING], 400)},
        "/api/v1/clients/{client_id}": {
            "get": _op("One connected client, with its session", [CLIENT_ID], 404),
            "delete": _op("Kick: DISCONNECT 0x98 (5.0) and close; the session stays",
                          [CLIENT_ID], 404),
        },
        "/api/v1/sessions": {"get": _op(
            "Sessions (online and offline)", [
                _param("state", "query", "all (default), online or offline"),
                _param("client_id", "query", "substring of the client id"),
                _param("username", "query", "substring of the user name"), *PAGING], 400)},
        "/api/v1/sessions/{client_id}": {
            "get": _op("One session: subscriptions and log cursor", [CLIENT_ID], 404),
            "delete": _op("Delete an offline session (no will); 409 while connected",
                          [CLIENT_ID], 404, 409),
        },
        "/api/v1/subscriptions": {"get": _op(
            "Subscriptions of every session", [
                _param("client_id", "query", "substring of the client id"),
                _param("filter", "query", "substring of the topic filter"), *PAGING], 400)},
        "/api/v1/subscriptions/match": {"post": _op(
            "The subscriptions a publish on a topic reaches", PAGING, 400,
            body={"type": "object", "required": ["topic"],
                  "properties": {"topic": {"type": "string"}}})},
        "/api/v1/topics": {"get": _op(
            "Subscribed topic filters with their subscriber counts",
            [_param("filter", "query", "substring of the topic filter"), *PAGING], 400)},
        "/api/v1/retained": {
            "get": _op("Retained messages matching a filter",
                       [_param("filter", "query", "topic filter (default #)"), *PAGING], 400),
            "delete": _op("Clear one topic's retained message",
                          [_param("topic", "query", "the topic", required=True)], 400, 404),
        },
        "/api/v1/log/partitions": {"get": _op(
            "Commit log partitions: leader, offsets, size, segments, retention", PAGING, 400)},
        "/api/v1/log/partitions/{partition}/segments": {"get": _op(
            "The segment files of one partition",
            [_param("partition", "path", "partition number", {"type": "integer"})], 400, 404)},
        "/api/v1/log/cursors": {"get": _op(
            "Sessions reading from the log, the slowest first", PAGING, 400)},
    },
}
