"""Plain queries over one router's state, for the operations plane (node/admin/).

Every function here reads (or, for ``kick`` and ``delete_session``, changes) what this router
holds, in JSON-ready dicts, and nothing else: no I/O, no knowledge of other workers. The node's
admin listener asks every worker the same question over the mesh and merges the answers
(node/admin/views.py); a single-process node asks only itself. Nothing here is called on the
message path: the counters it reads are the ones the broker keeps anyway.
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

from meshmq.mqtt.reason_codes import ReasonCode
from meshmq.mqtt.topics import parse_shared_filter, topic_matches

if TYPE_CHECKING:
    from meshmq.broker.broker import Broker
    from meshmq.broker.client import ClientHandle
    from meshmq.broker.message import Message
    from meshmq.broker.session import Session

PROTOCOLS = {3: "3.1", 4: "3.1.1", 5: "5.0"}
PREVIEW = 256  # payload bytes shown of a retained message


def _connected(broker: Broker) -> list[ClientHandle]:
    """Connections past CONNECT whose session is theirs (not closing)."""
    return [c for c in broker.clients
            if c.session is not None and not c.gone and not c.closing
            and c.session.client is c]


def client_row(client: ClientHandle) -> dict[str, Any]:
    session = client.session
    assert session is not None
    return {
        "client_id": client.client_id,
        "username": session.username,
        "peer": client.peer,
        "protocol": PROTOCOLS.get(client.conn.version, str(client.conn.version)),
        "connected_at": round(client.connected_at, 3),
        "inflight": len(session.inflight),
        "queued": len(session.queue),
        "subscriptions": len(session.subscriptions),
    }


def clients(broker: Broker) -> list[dict[str, Any]]:
    """The connected clients of this router."""
    return [client_row(client) for client in _connected(broker)]


def subscription_rows(session: Session) -> list[dict[str, Any]]:
    rows = []
    for topic_filter, sub in session.subscriptions.items():
        group, plain = parse_shared_filter(topic_filter)
        rows.append({"client_id": session.client_id, "filter": topic_filter,
                     "group": group, "topic_filter": plain, "qos": sub.options.qos,
                     "subscription_id": sub.subscription_id})
    return rows


def session_row(session: Session) -> dict[str, Any]:
    return {
        "client_id": session.client_id,
        "online": session.client is not None,
        "username": session.username,
        "expiry_interval": session.expiry_interval,
        "offline_since": None if session.detached_at is None else session.detached_at / 1000,
        "subscriptions": len(session.subscriptions),
        "inflight": len(session.inflight),
        "queued": len(session.queue),
        "queued_bytes": session.queued_bytes,
        "dropped": session.dropped,
        "catching_up": session.catchup is not None,
    }


def sessions(broker: Broker) -> list[dict[str, Any]]:
    return [session_row(session) for session in broker.sessions.values()]


def cursor(broker: Broker, session: Session) -> list[dict[str, int]] | None:
    """Per partition: where the session's catch-up reads, and how far behind the high
    watermark that is; None when it reads nothing from the log."""
    catchup, log = session.catchup, broker.persistence
    if catchup is None or log is None:
        return None
    high = log.high_watermark
    return [{"partition": p, "offset": offset, "lag": max(0, high[p] - offset)}
            for p, offset in enumerate(catchup.cursor())]


def session_detail(broker: Broker, client_id: str) -> dict[str, Any] | None:
    session = broker.sessions.get(client_id)
    if session is None:
        return None
    detail = session_row(session)
    detail["subscription_list"] = subscription_rows(session)
    detail["cursor"] = cursor(broker, session)
    client = session.client
    if client is not None and client in broker.clients:
        detail["connection"] = client_row(client)
    return detail


def kick(broker: Broker, client_id: str) -> bool:
    """Disconnect ``client_id`` if it is connected here (5.0: DISCONNECT 0x98, administrative
    action); its session stays, as after any disconnection. False: not connected here."""
    for client in _connected(broker):
        if client.client_id == client_id:
            client.close_reason = "kicked by the admin API"
            client.conn.send_disconnect(ReasonCode.ADMINISTRATIVE_ACTION)  # MQTT-3.14.2-1
            client.close()
            return True
    return False


def delete_session(broker: Broker, client_id: str) -> str:
    """Remove an offline session (no will: the operator asked): ``deleted``, ``online`` (a
    client holds it: kick it first) or ``absent``."""
    session = broker.sessions.get(client_id)
    if session is None:
        return "absent"
    if session.client is not None:
        return "online"
    session.will = None
    broker.lifecycle.end_session(session, broker.loop.time())
    return "deleted"


def subscriptions(broker: Broker) -> list[dict[str, Any]]:
    return [row for session in broker.sessions.values() for row in subscription_rows(session)]


def matching(broker: Broker, topic: str) -> list[dict[str, Any]]:
    """The subscriptions here that a publish on ``topic`` matches."""
    return [row for session in broker.sessions.values() for row in subscription_rows(session)
            if topic_matches(row["topic_filter"], topic)]


def retained_row(message: Message) -> dict[str, Any]:
    payload = message.payload
    try:
        text: str | None = payload[:PREVIEW].decode("utf-8")
    except UnicodeDecodeError:
        text = None
    return {
        "topic": message.topic, "qos": message.qos, "size": len(payload),
        "payload": text if text is not None
        else base64.b64encode(payload[:PREVIEW]).decode("ascii"),
        "encoding": "utf-8" if text is not None else "base64",
        "truncated": len(payload) > PREVIEW,
    }


def retained(broker: Broker, topic_filter: str) -> list[dict[str, Any]]:
    """The retained messages this router stores (with workers: the topics it owns)."""
    return [retained_row(m) for m in broker.local_retained.matching(topic_filter)
            if not m.topic.startswith("$SYS/")]


def counters(broker: Broker) -> dict[str, Any]:
    """This router's counters and gauges, as kept by the broker (read, never copied)."""
    online = dropped = inflight = queued = queued_bytes = catching_up = subscribed = 0
    for session in broker.sessions.values():  # one pass per scrape
        online += session.client is not None
        subscribed += len(session.subscriptions)
        dropped += session.dropped
        inflight += len(session.inflight)
        queued += len(session.queue)
        queued_bytes += session.queued_bytes
        catching_up += session.catchup is not None
    router = broker.router
    return {
        "connections": len(_connected(broker)),
        "sessions_online": online,
        "sessions_offline": len(broker.sessions) - online,
        "dropped_queue_full": dropped + broker.counters.ended_drops,
        "inflight": inflight, "queued": queued, "queued_bytes": queued_bytes,
        "catching_up": catching_up,
        "subscriptions": subscribed,
        "shared_groups": len(router.shared),
        "retained": broker.local_retained.count(),
        "routed": list(router.routed_qos), "delivered": list(router.delivered_qos),
        "counters": broker.counters.as_dict(),
        "connect_refused_rate": broker.connect_limiter.statistics()["connect_refused_rate"]
        if broker.connect_limiter is not None else 0,
        "time": time.time(),
    }
