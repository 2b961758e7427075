"""The metadata agreed by Raft: pysyncobj behind ``MetadataStore`` (cluster/metadata.py).

Theory of operation
-------------------
Each node runs one Raft voter (in its own process: cluster/metaproc.py). pysyncobj keeps the
log and elects the leader; every voter applies the committed log to a ``MetaState``
(cluster/metastate.py) in pysyncobj's own thread. This module turns that into coroutines on
the caller's event loop: a write is submitted to pysyncobj (a follower passes it to the
leader), and pysyncobj's answer, which comes on its thread, settles a future on the loop with
``call_soon_threadsafe``. Nothing here blocks the loop on a commit.

Reads go through the log: ``read()`` commits a barrier and copies the state right after the
barrier applies, so a leader that was cut off, or a follower that lags, cannot answer with an
old state (linearizable, at the cost of one commit, about a millisecond here).

Retries and outcomes. Every write carries a request id that the state machine remembers, so
resubmitting it is safe: if it applied already, the state machine answers what it answered
then. A write is resubmitted while the deadline (``RaftSettings.request_timeout``) allows when
pysyncobj says it did not apply (no leader known, the leader changed before it took it, the
entry was replaced by a new leader's) and when the outcome is unknown (a follower lost the
leader's answer). At the deadline the caller gets ``NoQuorum`` if this node sees no leader
or no majority, else ``Timeout``; both mean "may still apply" (metadata.py).

Guards for pysyncobj's weak spots:

* A leader cut off from the majority does not step down by itself in Raft without
  CheckQuorum: pysyncobj's ``leaderFallbackTimeout`` (30 s by default) is set to the maximum
  election timeout, so a leader that heard from no majority for that long becomes a follower;
  and a leader that is not connected to a majority takes no write at all (it is not even put
  in its log). Raft itself keeps an entry of a cut-off leader from being committed; these
  keep the writer from waiting on one, and stop the old leader from answering as one.
* No PreVote: a voter that restarts campaigns when its election timeout passes before it has
  heard from the leader, which deposes a healthy leader. A voter that starts again on its
  files waits a dial retry more before its first campaign (long enough to connect and hear
  the leader; a new cluster's voters, with no files, do not wait);
  a voter that is only partly cut off can still force elections (liveness, never safety;
  docs/cluster.md).
* The unclean-crash start-up hang (upstream issue 197) and the unsynced journal:
  cluster/raftdisk.py.
* The whole log in memory: log compaction is on (a dump every ``compaction_entries`` entries
  or ``compaction_seconds``), written in this process (no fork: a fork that outlives a killed
  parent could replace the dump under its successor).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import threading
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated
from pysyncobj.monotonic import monotonic
from pysyncobj.syncobj import SyncObjException
from pysyncobj.tcp_connection import CONNECTION_STATE
from pysyncobj.transport import TCPTransport

from meshmq.cluster.metadata import (
    CasResult,
    Change,
    Json,
    Member,
    MetadataError,
    NoQuorum,
    NotLeader,
    Timeout,
    View,
    WatchCallback,
    drop_member,
    members_of,
    put_member,
)
from meshmq.cluster.metastate import Command, MetaState, Op
from meshmq.cluster.raftdisk import (
    DUMP,
    JOURNAL,
    JournalRef,
    RaftFilesError,
    check_files,
    durable_journals,
)
from meshmq.cluster.raftvoters import (
    CHANGE_TIMEOUT,
    STATUS_TIMEOUT,
    Choice,
    VoterStatus,
    ask,
    choose_voters,
    parse_status,
    read_voters,
    write_voters,
)

log = logging.getLogger("meshmq.metadata")

RETRY_FIRST = 0.02  # seconds before a write that did not apply is submitted again
RETRY_MAX = 0.4
DIAL_TIMEOUT = 1.0  # a dial of another voter not through by then is made again
_STATE_NAMES = {0: "follower", 1: "candidate", 2: "leader"}
_NOT_APPLIED = {FAIL_REASON.QUEUE_FULL, FAIL_REASON.MISSING_LEADER, FAIL_REASON.DISCARDED,
                FAIL_REASON.NOT_LEADER, FAIL_REASON.REQUEST_DENIED}
_UNKNOWN = {FAIL_REASON.LEADER_CHANGED, FAIL_REASON.UNKNOWN_OUTCOME}


class MetaStartError(MetadataError):
    """The metadata service cannot start; the message is one line, ``exit_status`` the
    process's exit status (2: its settings are wrong)."""

    def __init__(self, message: str, exit_status: int = 1) -> None:
        super().__init__(message)
        self.exit_status = exit_status


@dataclass(frozen=True, slots=True)
class RaftSettings:
    """Raft's timing; docs/cluster.md says why these values."""

    heartbeat: float = 0.1  # appendEntriesPeriod: the leader's beat
    election_min: float = 0.6  # raftMinTimeout
    election_max: float = 1.5  # raftMaxTimeout
    connection_timeout: float = 3.5  # a link silent this long is closed (>= election_max)
    connection_retry: float = 0.5  # between dials of a voter that is not linked
    compaction_entries: int = 1000  # compact the log past this many entries...
    compaction_seconds: float = 60.0  # ... or this long after the last compaction
    request_timeout: float = 5.0  # a request's deadline (the bounded wait for a majority)
    # TCP keepalive (idle s, probe interval s, probes): a link whose peer is cut off is ended
    # in about 4 s, also between followers, which send each other nothing
    keepalive: tuple[int, int, int] = (1, 1, 3)

    @property
    def leader_fallback(self) -> float:
        """A leader that heard from no majority this long steps down: as long as a follower
        waits before it campaigns, so a loaded machine's slow answers do not depose a leader
        the followers still hear."""
        return self.election_max


@dataclass(frozen=True, slots=True)
class RaftStatus:
    """A snapshot of this voter, for logs, tests and ``status`` requests."""

    address: str
    state: str  # follower, candidate or leader
    leader: str | None
    term: int
    has_quorum: bool  # connected to a majority of voters (itself included)
    commit_index: int
    applied: int
    voters: tuple[str, ...]

    def to_json(self) -> dict[str, Json]:
        return {"address": self.address, "state": self.state, "leader": self.leader,
                "term": self.term, "has_quorum": self.has_quorum,
                "commit_index": self.commit_index, "applied": self.applied,
                "voters": list(self.voters)}


class _Replicated(SyncObjConsumer):  # (pysyncobj has no type hints)
    """The replicated state machine, as pysyncobj sees it. ``apply`` runs on every voter in
    log order, in pysyncobj's thread; ``changed`` is told each change, under ``lock``."""

    def __init__(self, changed: Any) -> None:
        self.changed = changed
        self.lock = threading.Lock()
        super().__init__()
        self.state = MetaState()

    @replicated
    def apply(self, wire: tuple[Any, ...]) -> tuple[bool, int, str | None]:
        command = Command.from_wire(wire)
        with self.lock:
            result, change = self.state.apply(command)
            if change is not None:
                self.changed(change)
        return result.ok, result.version, result.conflict

    def view(self) -> View:
        with self.lock:
            return self.state.view()

    # A snapshot holds plain data only (metastate.py), not this class.
    def _serialize(self) -> dict[str, Any]:
        with self.lock:
            return {"state": self.state.to_plain()}

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self.lock:
            self.state = MetaState.from_plain(data["state"])
            self.changed(self.state.reset_change())


class _Transport(TCPTransport):
    """pysyncobj's TCP transport, which syncs the journal before each message it sends
    (cluster/raftdisk.py: nothing is acknowledged or counted before it is on disk), with a
    deadline on dials. pysyncobj looks at a link's
    timeout only when its socket has an event, and a dial to a host that is cut off has none
    until the kernel gives up on its SYNs (two minutes): after a partition heals, the voters
    would stay apart that long. A dial not through within ``DIAL_TIMEOUT`` is dropped and
    made again at the next retry. (A link that stalls once up is ended by TCP keepalive:
    ``RaftSettings.keepalive``.)"""

    def __init__(self, journal: JournalRef, on_voters: Any, syncobj: Any, self_node: Any,
                 other_nodes: Any) -> None:
        self._journal = journal
        self._on_voters = on_voters
        self._dial_started: dict[Any, float] = {}
        super().__init__(syncobj, self_node, other_nodes)

    def send(self, node: Any, message: Any) -> bool:
        self._journal.sync_pending()
        return bool(super().send(node, message))

    def _onTick(self) -> None:  # pysyncobj's name; called by its thread each tick
        super()._onTick()
        self._journal.sync_pending()  # a voter alone sends nothing, and commits at next tick
        self._on_voters(self._syncObj)
        now = monotonic()
        for node, connection in list(self._connections.items()):
            if connection.state != CONNECTION_STATE.CONNECTING:
                self._dial_started.pop(node, None)
            elif now - self._dial_started.setdefault(node, now) > DIAL_TIMEOUT:
                self._dial_started.pop(node, None)
                connection.disconnect()


class _Resends(logging.Filter):
    """pysyncobj logs at CRITICAL each time a follower is sent entries it has already applied
    ("state machine may have diverged"). They are the same entries (their predecessor's index
    and term matched, and Raft's log matching then makes them equal), and pysyncobj resends
    overlapping ranges to every follower that lags a little: the line would fill the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("truncating already-applied log entries")


logging.getLogger("pysyncobj.syncobj").addFilter(_Resends())


class RaftWatch:
    def __init__(self, store: RaftStore, callback: WatchCallback,
                 loop: asyncio.AbstractEventLoop) -> None:
        self.store = store
        self.callback = callback
        self.loop = loop
        self.cancelled = False

    def deliver(self, change: Change) -> None:
        """From any thread."""
        try:
            self.loop.call_soon_threadsafe(self._run, change)
        except RuntimeError:  # the loop is closed: nobody to tell
            self.cancelled = True

    def _run(self, change: Change) -> None:
        if not self.cancelled:
            self.callback(change)

    def cancel(self) -> None:
        self.cancelled = True
        self.store._drop_watch(self)


class RaftStore:
    """A ``MetadataStore`` backed by this node's Raft voter. ``start()`` it on the loop that
    will use it; ``close()`` it at the end."""

    def __init__(self, address: str, peers: Sequence[str], directory: Path, secret: bytes,
                 settings: RaftSettings | None = None, bind: str | None = None) -> None:
        if not secret:
            raise MetaStartError("the metadata service needs the cluster secret: Raft messages "
                                 "are pickles, and only authenticated ones may be read", 2)
        self.address = address
        self.seeds = tuple(peer for peer in peers if peer != address)
        self.voters: tuple[str, ...] = tuple(sorted((address, *self.seeds)))  # as applied
        self._voters_written: frozenset[str] | None = None
        self._chosen: frozenset[str] | None = None  # the set started with, until the dump loads
        self._join: asyncio.Task[None] | None = None
        self.directory = directory
        self.settings = settings or RaftSettings()
        self._secret = secret
        self._bind = bind
        self._requests = f"{uuid.uuid4().hex[:12]}-"  # request ids: unique per process start
        self._next_request = 0
        self._watches: set[RaftWatch] = set()
        self._replicated = _Replicated(self._changed)
        self._syncobj: SyncObj | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- start and stop ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Check the files, start the voter and wait until it listens."""
        self._loop = asyncio.get_running_loop()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            repaired = check_files(self.directory)
        except RaftFilesError as error:
            raise MetaStartError(str(error)) from None
        except OSError as error:
            raise MetaStartError(f"metadata directory {self.directory}: "
                                 f"{error.strerror or error}", 2) from None
        if repaired:
            log.warning("metadata start: %s", repaired)
        rejoining = (self.directory / JOURNAL).exists()
        choice = await self._choose_voters()
        if choice.source != "the voters this node knows" or choice.join_via is not None:
            log.info("metadata voters from %s: %s", choice.source, ",".join(sorted(choice.voters)))
        self._save_voters(choice.voters)
        self._chosen = choice.voters
        conf = self._conf()
        try:
            conf.validate()
        except AssertionError:
            raise MetaStartError(f"Raft settings pysyncobj refuses: {self.settings} (the "
                                 "minimum election timeout must exceed 3 heartbeats, the "
                                 "maximum the minimum, the link timeout the maximum)", 2) from None
        with durable_journals() as journal:
            self._syncobj = SyncObj(self.address, sorted(choice.voters - {self.address}), conf,
                                    consumers=[self._replicated],
                                    transportClass=functools.partial(
                                        _Transport, journal, self._voters_seen))
        if rejoining or choice.join_via is not None:  # a new cluster has no leader to disrupt
            self._delay_first_campaign()
        if choice.join_via is not None:
            self._join = asyncio.create_task(self._ask_to_join(choice.join_via))
        try:
            await asyncio.to_thread(self._syncobj.waitBinded)
        except SyncObjException:
            self._syncobj.destroy()
            raise MetaStartError(f"cannot listen for Raft on {self._bind or self.address}: "
                                 "the port is in use or the address is not this host's (a "
                                 "node's metadata voter listens on its cluster port + 1)"
                                 ) from None
        log.info("metadata voter started address=%s voters=%s", self.address,
                 ",".join(self.voters))

    async def _choose_voters(self) -> Choice:
        """raftvoters.py: ask the voters this node knows, all at once, and choose."""
        known = read_voters(self.directory) or frozenset(self.seeds)
        others = sorted(known - {self.address})

        async def status_of(address: str) -> VoterStatus | None:
            try:
                answer = await asyncio.to_thread(ask, address, ["status"], self._secret,
                                                 STATUS_TIMEOUT)
                return parse_status(answer)
            except (OSError, KeyError, TypeError, AttributeError):
                return None

        answers = await asyncio.gather(*(status_of(address) for address in others))
        return choose_voters(self.address, known,
                             [status for status in answers if status is not None])

    async def _ask_to_join(self, via: str) -> None:
        """Ask ``via`` (then any voter) to add this voter, until this voter is in a leader's
        set (the change is in the leader's log once the leader's beats reach it)."""
        delay = RETRY_FIRST
        while self._syncobj is not None:
            status = self.status()
            if status.leader is not None and status.leader != self.address:
                log.info("metadata voter joined address=%s leader=%s voters=%s",
                         self.address, status.leader, ",".join(status.voters))
                return
            targets = [via, *(v for v in self.voters if v not in (via, self.address))]
            for target in targets:
                try:
                    answer = await asyncio.to_thread(ask, target, ["add", self.address],
                                                     self._secret, CHANGE_TIMEOUT)
                except OSError as error:
                    log.debug("metadata join through %s: %s", target, error)
                    continue
                log.info("metadata join through %s: %s", target, answer)
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _voters_seen(self, syncobj: Any) -> None:
        """pysyncobj's thread, each tick: keep ``voters`` and the voter file current."""
        others = getattr(syncobj, "_SyncObj__otherNodes", None)
        if others is None:
            return
        voters = frozenset({self.address, *(node.address for node in list(others))})
        chosen = self._chosen
        if chosen is not None and not getattr(syncobj, "_SyncObj__needLoadDumpFile", False):
            # pysyncobj just loaded its dump, whose voter set can be older than the file's
            # (it does not replay the changes its journal holds past the dump)
            self._chosen = None
            if voters != chosen:
                log.info("metadata voters %s from the voter file, not %s from the dump",
                         ",".join(sorted(chosen)), ",".join(sorted(voters)))
                syncobj._SyncObj__updateClusterConfiguration(sorted(chosen - {self.address}))
                voters = chosen
        if voters != self._voters_written:
            log.info("metadata voters now %s", ",".join(sorted(voters)))
            self._save_voters(voters)

    def _save_voters(self, voters: frozenset[str]) -> None:
        try:
            write_voters(self.directory, voters)
        except OSError as error:
            log.error("metadata voter file %s not written: %s", self.directory, error)
            return
        self._voters_written = voters
        self.voters = tuple(sorted(voters))

    # -- membership -------------------------------------------------------------------------------

    async def remove_voter(self, address: str) -> str:
        """Take ``address`` out of the voter set (a node forgotten for good), through this
        voter (a follower passes it to the leader). Answers what happened, in words."""
        if address == self.address:
            raise MetadataError("a voter cannot remove itself: use leave()")
        if address not in self.voters:
            return f"{address} is not a voter"
        return await self._remove(address)

    async def leave(self) -> str:
        """Take this voter out of the set: hand the leadership on if it has it, then ask
        another voter to remove it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_timeout
        while True:
            syncobj = self._running()
            others = [v for v in self.voters if v != self.address]
            if not others:
                return "this was the only voter"
            if syncobj._isLeader():
                syncobj.transferLeadership()
            else:
                for target in others:
                    try:
                        answer = await asyncio.to_thread(ask, target, ["remove", self.address],
                                                         self._secret, CHANGE_TIMEOUT)
                    except OSError:
                        continue
                    if str(answer).startswith("SUCCESS"):
                        return f"removed by {target}"
            if loop.time() >= deadline:
                raise self._deadline_error(maybe_applied=True)
            await asyncio.sleep(0.1)

    async def _remove(self, address: str) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_timeout
        while True:
            future: asyncio.Future[tuple[int, Any, View | None]] = loop.create_future()
            self._running().removeNodeFromCluster(address, callback=functools.partial(
                self._answered, loop, future, False))
            code, _, _ = await self._answer_by(future, deadline)
            if code == FAIL_REASON.SUCCESS:
                return f"removed {address}"
            if loop.time() + RETRY_MAX >= deadline:
                raise self._deadline_error(maybe_applied=code in _UNKNOWN)
            await asyncio.sleep(RETRY_MAX)

    def _running(self) -> SyncObj:
        syncobj = self._syncobj
        if syncobj is None:
            raise MetadataError("the metadata service is stopped")
        return syncobj

    def _conf(self) -> SyncObjConf:
        settings = self.settings
        return SyncObjConf(
            password=self._secret,
            appendEntriesUseBatch=False,  # a commit in ~1 ms instead of ~100 ms
            appendEntriesPeriod=settings.heartbeat,
            raftMinTimeout=settings.election_min,
            raftMaxTimeout=settings.election_max,
            leaderFallbackTimeout=settings.leader_fallback,
            connectionTimeout=settings.connection_timeout,
            connectionRetryTime=settings.connection_retry,
            commandsWaitLeader=False,  # no leader: answered at once, retried here
            dynamicMembershipChange=True,  # voters join and leave: raftvoters.py
            journalFile=str(self.directory / JOURNAL),
            fullDumpFile=str(self.directory / DUMP),
            logCompactionMinEntries=settings.compaction_entries,
            logCompactionMinTime=settings.compaction_seconds,
            useFork=False,
            bindAddress=self._bind,
            bindRetryTime=0.2,
            maxBindRetries=10,
            onStateChanged=self._state_changed,
            tcp_keepalive=settings.keepalive,
        )

    def _delay_first_campaign(self) -> None:
        # pysyncobj has no setting for it: its first election deadline is set in __init__,
        # and its thread ticks 0.1 s after, so moving the deadline here comes first. Drawn
        # at random, as election timeouts are, so that voters restarted together do not
        # split their votes.
        assert self._syncobj is not None
        deadline = "_SyncObj__raftElectionDeadline"
        settings = self.settings
        if hasattr(self._syncobj, deadline):
            setattr(self._syncobj, deadline, monotonic() + settings.connection_retry
                    + random.uniform(settings.election_min, settings.election_max))

    async def close(self) -> None:
        syncobj, self._syncobj = self._syncobj, None
        if self._join is not None:
            self._join.cancel()
        if syncobj is not None:
            await asyncio.to_thread(syncobj.destroy_synchronous)

    # -- MetadataStore ----------------------------------------------------------------------------

    async def read(self) -> View:
        _, view = await self._submit(Command(Op.BARRIER), read=True)
        assert view is not None
        return view

    async def cas(self, key: str, expected: int, value: Json,
                  guards: Mapping[str, int] | None = None, request: str = "") -> CasResult:
        """``request``: the write's id, when the caller retries it itself (the local
        protocol's clients do); one is drawn otherwise."""
        result, _ = await self._submit(Command.set(key, expected, value, guards,
                                                   request or self._request_id()))
        return result

    async def delete(self, key: str, expected: int,
                     guards: Mapping[str, int] | None = None, request: str = "") -> CasResult:
        result, _ = await self._submit(Command.delete(key, expected, guards,
                                                      request or self._request_id()))
        return result

    def watch(self, callback: WatchCallback) -> RaftWatch:
        watch = RaftWatch(self, callback, asyncio.get_running_loop())
        with self._replicated.lock:  # no change between the reset and the first delta
            watch.deliver(self._replicated.state.reset_change())
            self._watches.add(watch)
        return watch

    async def add_member(self, member: Member) -> int:
        return await put_member(self, member)

    async def remove_member(self, node_id: str) -> int:
        return await drop_member(self, node_id)

    async def members(self) -> dict[str, Member]:
        return members_of(await self.read())

    def view_nowait(self) -> View:
        """What this voter has applied: possibly behind the leader, never ahead."""
        return self._replicated.view()

    def status(self) -> RaftStatus:
        syncobj = self._syncobj
        if syncobj is None:
            return RaftStatus(self.address, "stopped", None, 0, False, 0, 0, ())
        leader = syncobj._getLeader()
        state = "leader" if syncobj._isLeader() else (
            "follower" if leader is not None else "candidate or follower")
        return RaftStatus(self.address, state, None if leader is None else str(leader),
                          syncobj.raftCurrentTerm, syncobj.hasQuorum, syncobj.raftCommitIndex,
                          syncobj.raftLastApplied, self.voters)

    # -- submitting -------------------------------------------------------------------------------

    def _request_id(self) -> str:
        self._next_request += 1
        return f"{self._requests}{self._next_request}"

    async def _submit(self, command: Command, read: bool = False
                      ) -> tuple[CasResult, View | None]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.request_timeout
        delay = RETRY_FIRST
        maybe_applied = False  # an attempt whose outcome is unknown: no NotLeader then
        while True:
            syncobj = self._running()
            # A leader that is not connected to a majority puts nothing in its log.
            if not (syncobj._isLeader() and not syncobj.hasQuorum):
                future: asyncio.Future[tuple[int, Any, View | None]] = loop.create_future()
                self._replicated.apply(command.to_wire(), callback=functools.partial(
                    self._answered, loop, future, read))
                code, answer, view = await self._answer_by(future, deadline)
                if code == FAIL_REASON.SUCCESS:
                    ok, version, conflict = answer
                    return CasResult(ok, version, conflict), view
                if code in _UNKNOWN:
                    maybe_applied = True
                elif code not in _NOT_APPLIED:
                    raise MetadataError(f"pysyncobj answered with failure code {code}")
            if loop.time() + delay >= deadline:
                raise self._deadline_error(maybe_applied)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX)

    async def _answer_by(self, future: asyncio.Future[tuple[int, Any, View | None]],
                         deadline: float) -> tuple[int, Any, View | None]:
        """pysyncobj's answer, or ``Timeout``/``NoQuorum`` at ``deadline`` (it may apply)."""
        try:
            async with asyncio.timeout_at(deadline):
                return await future
        except TimeoutError:
            raise self._deadline_error(maybe_applied=True) from None

    def _answered(self, loop: asyncio.AbstractEventLoop,
                  future: asyncio.Future[tuple[int, Any, View | None]], read: bool,
                  answer: Any, code: int) -> None:
        """pysyncobj's answer, in its thread: for a read, copy the state now (right after the
        barrier applied), then hand the answer to the loop."""
        view = self._replicated.view() if read and code == FAIL_REASON.SUCCESS else None
        try:
            loop.call_soon_threadsafe(_settle, future, (code, answer, view))
        except RuntimeError:
            pass  # the loop is closed: nobody waits

    def _deadline_error(self, maybe_applied: bool) -> MetadataError:
        status = self.status()
        wait = self.settings.request_timeout
        if status.leader is None or not status.has_quorum:
            return NoQuorum(f"no majority of the {len(status.voters)} metadata voters "
                            f"reachable within {wait:.1f} s (leader: {status.leader or 'none'}, "
                            f"this voter: {status.state}): nothing can be agreed until one "
                            "is back")
        if not maybe_applied:
            return NotLeader(f"the request was not taken within {wait:.1f} s", status.leader)
        return Timeout(f"no answer within {wait:.1f} s (leader: {status.leader})")

    # -- pysyncobj's thread -----------------------------------------------------------------------

    def _changed(self, change: Change) -> None:
        for watch in list(self._watches):
            watch.deliver(change)

    def _drop_watch(self, watch: RaftWatch) -> None:
        with self._replicated.lock:
            self._watches.discard(watch)

    def _state_changed(self, old: int, new: int) -> None:
        syncobj = self._syncobj
        term = syncobj.raftCurrentTerm if syncobj is not None else "?"
        log.info("metadata voter %s: %s -> %s term=%s", self.address,
                 _STATE_NAMES.get(old, old), _STATE_NAMES.get(new, new), term)


def _settle(future: asyncio.Future[tuple[int, Any, View | None]],
            outcome: tuple[int, Any, View | None]) -> None:
    if not future.done():
        future.set_result(outcome)
