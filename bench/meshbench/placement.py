"""Which worker of a meshmq node serves each of the load generator's connections.

With ``server.workers`` above 1 the kernel spreads connections over the workers' listening
sockets (SO_REUSEPORT, a hash of the addresses), so where a client lands is chance. The load
generator cannot read meshmq's ``meshmq-worker`` CONNACK property, so this reads it from the
outside instead: /proc/net/tcp gives each socket's ports by inode, /proc/<pid>/fd which process
holds which inode. The load generator opens its connections in order (publishers, then
subscribers, then stalled subscribers) on consecutive descriptors, so sorting its sockets by
descriptor gives them in that order.
"""

from __future__ import annotations

from meshbench.brokers import socket_inodes


def tcp_ports() -> dict[int, tuple[int, int]]:
    """inode -> (local port, remote port) of every TCP socket in this network namespace."""
    table: dict[int, tuple[int, int]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                next(f)
                for line in f:
                    parts = line.split()
                    # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
                    if len(parts) < 10:
                        continue
                    local = int(parts[1].rsplit(":", 1)[1], 16)
                    remote = int(parts[2].rsplit(":", 1)[1], 16)
                    inode = int(parts[9])
                    if inode:
                        table[inode] = (local, remote)
        except OSError:
            continue
    return table


def client_workers(client_pid: int, port: int, workers: dict[int, int]) -> list[int]:
    """For each TCP connection of process ``client_pid`` to ``port``, in descriptor order, the
    index of the worker that serves it (-1: not found)."""
    table = tcp_ports()
    by_client_port: dict[int, int] = {}  # the client's port -> worker index
    for index, pid in workers.items():
        for inode in socket_inodes(pid).values():
            ports = table.get(inode)
            if ports is not None and ports[0] == port:
                by_client_port[ports[1]] = index
    found = []
    for _fd, inode in sorted(socket_inodes(client_pid).items()):
        ports = table.get(inode)
        if ports is not None and ports[1] == port:
            found.append(by_client_port.get(ports[0], -1))
    return found


def summarise(topology: str, pubs: int, subs: int, served_by: list[int],
              count: int) -> dict[str, object]:
    """What the placement means for routing. ``served_by`` lists the workers of the
    publishers, then of the subscribers; ``count`` is the number of workers.

    * fan-in (every subscriber hears every publisher): the fraction of deliveries whose
      publisher is on another worker than the subscriber (they cross the link);
    * pairs: how many pairs have their publisher and subscriber on different workers, and
      each pair's (publisher's worker, subscriber's worker).
    """
    publishers, subscribers = served_by[:pubs], served_by[pubs:pubs + subs]
    out: dict[str, object] = {
        "publishers_per_worker": [publishers.count(w) for w in range(count)],
        "subscribers_per_worker": [subscribers.count(w) for w in range(count)],
        "complete": len(served_by) >= pubs + subs and -1 not in served_by[:pubs + subs],
    }
    if topology == "pairs":
        out["pair_workers"] = [[p, s] for p, s in zip(publishers, subscribers, strict=False)]
        crossing = sum(1 for p, s in zip(publishers, subscribers, strict=False) if p != s)
        out["crossing_pairs"] = crossing
        out["crossing_fraction"] = crossing / max(1, min(len(publishers), len(subscribers)))
    else:
        pairs = [(p, s) for p in publishers for s in subscribers]
        out["crossing_fraction"] = (sum(1 for p, s in pairs if p != s) / len(pairs)
                                    if pairs else 0.0)
    return out
