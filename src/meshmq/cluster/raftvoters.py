"""Who votes in the metadata's Raft: joining through a seed, leaving, and the voter file.

Theory of operation
-------------------
The voter set is not fixed at start. pysyncobj changes it one voter at a time through its
log (``dynamicMembershipChange``: Raft's single-server change, applied as soon as an entry is
in a voter's log), and answers two requests on its Raft port, authenticated with the cluster
secret like every Raft message: ``status`` (its leader and the voters it knows) and
``add``/``remove`` (a voter passes them to the leader).

**Choosing the voters at start** (``choose_voters``, pure). A node asks the voters it knows
(its voter file, else its seeds: the Raft port of each seed's cluster address) for their
status, all at once with a short deadline:

* an answer that names a leader is the cluster as it is: the node takes that voter set, and
  if it is not in it (a new node; a node that left or was forgotten and comes back), it asks
  that voter to add it, and starts only once the change is in the leader's log;
* no answer with a leader: a new cluster forming (its nodes are starting together) or the
  others are down. The node starts with what it knows: its voter file, else itself and its
  seeds. Nodes that list each other as seeds (the configuration contract's way) thus start
  with the same set.

A voter that joins waits a heartbeat or so before its first campaign (raftstore.py), so the
leader reaches it first: without PreVote, a campaign of the newcomer would depose a healthy
leader.

**The voter file** (``<data_dir>/raft/voters``, JSON, written atomically and fsynced). pysyncobj
stores the voter set in its dump but does not replay the changes in its journal when it
starts again, so a voter restarted after a change would start with the set it was first given.
Each tick of pysyncobj's thread compares its set with the last one written and writes the file
when it changed; the next start begins from it.

**Leaving** (``meshmq cluster leave``, or ``forget`` of a dead node). A voter cannot remove
itself in pysyncobj: the leaving node hands its leadership on if it has it, then asks another
voter to remove it. ``forget`` asks this node's voter to remove the dead one. Each removal
shrinks the majority, so a cluster of 3 that loses one node for good and forgets it goes on
with 2 of 2 (and then must not lose another).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOTERS = "voters"  # the file's name in the Raft directory
STATUS_TIMEOUT = 1.0  # seconds: how long a start waits for the voters it knows to answer
CHANGE_TIMEOUT = 5.0  # seconds for an add or a remove to be in the leader's log
_PARTNER = "partner_node_status_server_"


@dataclass(frozen=True, slots=True)
class VoterStatus:
    """What a voter answered: its own address, its leader (None: none known), its voters
    (itself included)."""

    address: str
    leader: str | None
    voters: frozenset[str]


def parse_status(answer: Mapping[str, Any]) -> VoterStatus:
    """pysyncobj's ``status`` answer, read."""
    address = str(answer["self"].address if hasattr(answer["self"], "address")
                  else answer["self"])
    leader = answer.get("leader")
    leader_address = None if leader is None else str(getattr(leader, "address", leader))
    partners = {key[len(_PARTNER):] for key in answer if key.startswith(_PARTNER)}
    return VoterStatus(address, leader_address, frozenset({address, *partners}))


@dataclass(frozen=True, slots=True)
class Choice:
    """The voters to start with, and the voter to ask for this node's addition (None: it is
    a voter already, or no cluster answered)."""

    voters: frozenset[str]
    join_via: str | None
    source: str  # for the log: where the set came from


def choose_voters(me: str, known: Iterable[str], answers: Sequence[VoterStatus]) -> Choice:
    """See the module docstring. ``known``: the voter file's set, else the seeds' Raft
    addresses; ``answers``: the status answers that came in time."""
    for status in answers:
        if status.leader is not None:
            if me in status.voters:
                return Choice(status.voters, None, f"the cluster as {status.address} knows it")
            return Choice(status.voters | {me}, status.address,
                          f"joining through {status.address}")
    return Choice(frozenset({me, *known}), None, "the voters this node knows")


def read_voters(directory: Path) -> frozenset[str] | None:
    """The voter file's set (None: no file, or one that cannot be read: then the seeds)."""
    try:
        value = json.loads((directory / VOTERS).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        return None
    return frozenset(value)


def write_voters(directory: Path, voters: Iterable[str]) -> None:
    """Replace the voter file: written beside, fsynced, renamed, and the directory fsynced."""
    path = directory / VOTERS
    temporary = path.with_suffix(".tmp")
    with open(temporary, "w") as out:
        json.dump(sorted(voters), out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, path)
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def ask(address: str, command: list[str], secret: bytes, timeout: float) -> Any:
    """Send one of pysyncobj's requests (``["status"]``, ``["add", voter]``, ``["remove",
    voter]``) to the voter at ``address`` and wait for its answer; blocking (run it in a
    thread). Raises ``OSError`` when the voter does not answer."""
    from pysyncobj.utility import TcpUtility, UtilityException

    try:
        answer = TcpUtility(password=secret, timeout=timeout).executeCommand(address, command)
    except UtilityException as error:
        raise OSError(f"{address}: {error}") from None
    if answer is None:
        raise OSError(f"{address}: no answer")
    return answer
