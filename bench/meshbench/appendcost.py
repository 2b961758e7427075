"""The per-message cost of forwarding a persisted publish to the worker that leads its
partition: QoS 1 publishes on persisted topics, from a publisher on the worker that leads the
topic's partition and from one on a worker that does not.

A persisted publish (commit log on, ``log.persist_filters`` matching, QoS 1) is appended by the
worker that leads its partition (partition p on worker p mod N). A publish taken by another
worker goes there in an ``APPEND`` link frame (batched per loop turn); the leader appends it,
routes it once durable to its own subscribers and as a ``FORWARD`` to the other workers with
one, and answers ``APPENDED``; the publisher's worker then delivers it to its own subscribers
and sends the PUBACK (docs/workers.md, "Partition leaders: the commit log").

The traffic is ``linkcost``'s placed client at QoS 1 (publishes and subscriptions), on topics
``bench/append/<i>``, with the commit log on and ``log.fsync = "always"`` (the default
policy). Each client is placed relative to the leader of its pair's topic, as
``leader_of_topic`` says, so the cases keep their meaning when leadership moves.

Cases (``CASES``): ``single``: one worker (no mesh); ``leader``: two workers, publisher and
subscriber on the topic's leader (nothing crosses); ``append``: the publisher on a worker that
does not lead, the subscriber on the leader (APPEND and APPENDED cross); ``append_back``:
publisher and subscriber on the same worker, which does not lead (APPEND and APPENDED cross,
and the publisher's worker delivers).
append - leader, in broker CPU µs per message, is the cost of forwarding an append.
"""

from __future__ import annotations

import enum
import zlib
from dataclasses import dataclass

from meshbench.scenarios import LOG_ON


def leader_of_topic(topic: str, workers: int, partitions: int = 8) -> int:
    """The worker that leads the partition ``topic``'s records go to, on a node of ``workers``
    workers: partition p is led by worker p mod N (src/meshmq/cluster/leaders.py), and a
    topic's partition is ``zlib.crc32(topic) % partitions`` (src/meshmq/log/partitioner.py;
    ``partitions`` is the node's ``log.partitions``, default 8, and the key is the whole topic
    while ``log.key_level`` is unset, as in these runs)."""
    return zlib.crc32(topic.encode("utf-8")) % partitions % workers


class Where(enum.Enum):
    LEADER = "leader"  # on the worker that leads the topic's partition
    OTHER = "other"  # on a worker that does not (the next one)


@dataclass(frozen=True)
class AppendCase:
    name: str
    workers: int
    publisher: Where | None  # None: wherever it lands (one worker)
    subscriber: Where | None
    title: str
    qos: int = 1

    def settings(self) -> dict[str, object]:
        return dict(LOG_ON)

    def topic(self, pair: int) -> str:
        return f"bench/append/{pair}"

    def worker_of(self, role: str, pair: int) -> int | None:
        where = self.publisher if role == "p" else self.subscriber
        if where is None:
            return None
        leader = leader_of_topic(self.topic(pair), self.workers)
        return leader if where is Where.LEADER else (leader + 1) % self.workers


CASES = (
    AppendCase("single", 1, None, None, "1 worker (no mesh), log on"),
    AppendCase("leader", 2, Where.LEADER, Where.LEADER,
               "2 workers, publisher and subscriber on the topic's leader"),
    AppendCase("append", 2, Where.OTHER, Where.LEADER,
               "2 workers, publisher on a worker that does not lead, subscriber on the leader"),
    AppendCase("append_back", 2, Where.OTHER, Where.OTHER,
               "2 workers, publisher and subscriber on a worker that does not lead"),
)


def _figure(row: dict[str, object] | None, name: str) -> float | None:
    value = None if row is None else row.get(name)
    return float(value) if isinstance(value, int | float) else None


def append_cost(rows: list[dict[str, object]]) -> dict[str, float | None]:
    """Broker µs per message: append - leader (forwarding the append and its reply) and
    append_back - leader (the same plus the FORWARD back), with the per-case figures."""
    by = {str(r["case"]): r for r in rows}
    leader = _figure(by.get("leader"), "broker_us_per_msg")
    append = _figure(by.get("append"), "broker_us_per_msg")
    back = _figure(by.get("append_back"), "broker_us_per_msg")
    return {
        "append_us": append - leader if append is not None and leader is not None else None,
        "append_back_us": back - leader if back is not None and leader is not None else None,
        "leader_us": leader,
        "single_us": _figure(by.get("single"), "broker_us_per_msg"),
        "append_total_us": append,
        "append_back_total_us": back,
    }


def paired_append_costs(results: dict[str, list[dict[str, object]]]) -> list[float]:
    """append - leader broker µs per message of each repetition (run close together)."""
    leader, append = results.get("leader", []), results.get("append", [])
    return [float(a["figures"]["broker_us_per_msg"]) - float(x["figures"]["broker_us_per_msg"])  # type: ignore[index]
            for x, a in zip(leader, append, strict=False)]
