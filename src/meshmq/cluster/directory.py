"""Sessions across a node's workers: each client id has an owner that knows where its session is.

Theory of operation
-------------------
``Directory`` is the core's ``SessionDirectory`` (broker/interfaces.py) for one worker of
several. A client may connect to any worker (the kernel chooses); its session lives, and is
journaled, where it last connected. Client id ``c`` is *owned* by worker ``crc32(c) mod N``
(cluster/leaders.py), which keeps the directory entry: which worker holds ``c``'s session.

* **Claim.** A CONNECT for ``c`` on worker ``w``: ``w`` asks ``c``'s owner (``CLAIM``; the owner
  may be ``w`` itself). The owner handles one claim per client id at a time, in arrival order.
  If another worker ``h`` holds the session, the owner asks it (``RELEASE``, naming ``w``): ``h``
  disconnects its connection with DISCONNECT 0x8E, as a takeover on one worker does, and hands
  the session over (or ends it, for a clean start), leaving a stand-in that sends ``w``
  whatever is routed to the session meanwhile (cluster/moving.py). The owner records ``w`` as
  the holder and answers ``w`` with what ``h`` handed over (``CLAIMED``). Two connections for one
  client id at once: the later claim takes the session from the earlier one, as on one broker.
* **Settle.** ``w`` installs the session, announces its routes and tells each worker that
  handed it over (``SETTLED``), which drops its stand-in. The hand-over is two-phase: until
  ``SETTLED`` arrives, the old holder keeps the session it exported (in the stand-in). If no
  ``SETTLED`` comes within ``SETTLE_TIMEOUT`` or the link to ``w`` drops (its claim timed out
  and the late answer was dropped, or ``w`` died), the old holder takes the session back:
  installed offline, journaled and registered with the owner again, so the next claim finds
  it. A session is never dropped on the hope that someone else has it.
* **Register.** Sessions that exist without a claim (restored at start-up, assigned client
  ids, made while the owner was down) are reported to their owners (``REGISTER``); so are
  sessions that end. A worker sends the whole list it holds for a peer each time that peer
  links (``complete``); an owner serves claims only once every linked peer has (or after
  ``ANSWER_TIMEOUT``), so a restarted owner rebuilds its entries before it answers.
* **Two copies.** A worker that was down when its session moved comes back with a stale copy;
  the owner remembers both holders, and the next claim takes both: the newest (most recently
  detached) wins, as ``adopt`` decides.
* **Owner down.** A claim whose owner is not linked asks every linked worker instead.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from meshmq.cluster.codec import (
    Claim,
    Claimed,
    Deliver,
    FrameType,
    Hello,
    Register,
    Release,
    Settled,
)
from meshmq.cluster.mesh import ANSWER_TIMEOUT
from meshmq.cluster.moving import SETTLE_TIMEOUT, MovedSession

if TYPE_CHECKING:
    from meshmq.broker.message import Message
    from meshmq.broker.session import Session
    from meshmq.cluster.leaders import Leadership
    from meshmq.cluster.mesh import Mesh
    from meshmq.cluster.timers import Timer

log = logging.getLogger("meshmq.directory")

CLAIM_NONE, CLAIM_SESSION = 0, 1
Answer = Callable[[int, list[int], list[bytes]], None]  # (status, holders, sessions)
Held = tuple["Message", int, bool, "list[int] | None", "tuple[str, str] | None"]


class SessionHost(Protocol):
    """What the directory needs from the broker it serves."""

    sessions: dict[str, Session]

    def release_session(self, client_id: str, clean_start: bool) -> Session | None:
        """Disconnect ``client_id``'s connection here (0x8E) and give its session up (routes
        stay, for the stand-in), or end it (``clean_start``: None)."""

    def export_session(self, session: Session) -> bytes: ...

    def adopt_sessions(self, blobs: list[bytes]) -> list[Session]:
        """Install handed-over sessions (the most recently detached one wins)."""

    def drop_session(self, session: Session) -> None:
        """Forget a stand-in and its routes."""

    def supersede(self, client_id: str) -> None:
        """A connection for ``client_id`` waiting for its CONNACK here lost the session to a
        newer one elsewhere: it must not go on."""

    def take_back_session(self, blob: bytes) -> bool:
        """A session this router handed over was never confirmed by its new holder: install
        it again, offline (expiry from now, journaled), unless a newer session for that
        client id is here already. True if installed."""

    def forwarded_in(self) -> bool:
        """Is the router delivering a message another worker forwarded (right now)?"""

    def encode_message(self, message: Message) -> bytes: ...

    def decode_message(self, body: bytes) -> Message: ...


class RemoteSessions(Protocol):
    """Sessions held by other nodes of a cluster (cluster/nodesessions.py)."""

    def wanted(self) -> bool:
        """Are other nodes linked (a session may be there)?"""

    def fetch(self, client_id: str, done: Callable[[list[tuple[int, bytes]]], None]) -> None:
        """Ask every linked node for ``client_id``'s session: ``done`` with (node, session)
        for each that handed one over, once all answered or the deadline passed."""

    def settle(self, client_id: str, nodes: list[int], done: Callable[[], None]) -> None:
        """The sessions ``nodes`` handed over are in place here, their routes everywhere:
        they drop their stand-ins; ``done`` once they did (or the deadline passed)."""


class Directory:
    """This worker's side of the session directory (see the module docstring)."""

    def __init__(self, host: SessionHost, leadership: Leadership, mesh: Mesh,
                 defer: Callable[[Callable[[], None]], object]) -> None:
        self.host = host
        self.defer = defer  # run a callback on a later loop turn (answers are never synchronous)
        # a CONNECT here, before it claims its session (cluster/takeover.py: the other nodes)
        self.on_claim: Callable[[str, bool], None] | None = None
        self.remote: RemoteSessions | None = None  # other nodes' sessions (nodesessions.py)
        self.leadership = leadership
        self.mesh = mesh
        self.holders: dict[str, int] = {}  # client id -> worker holding its session (owned ids)
        self.extra: dict[str, set[int]] = {}  # more holders of one client id (stale copies)
        self._busy: dict[str, deque[Callable[[], None]]] = {}  # claims waiting, per client id
        self._complete: set[int] = set()  # peers whose full registration arrived since linking
        self._waiting_complete: list[Callable[[], None]] = []
        self._claiming: dict[str, int] = {}  # claims of ours in flight, per client id
        self._held: dict[str, list[Held]] = {}  # DELIVERs for sessions on their way here
        self._pending_settle: dict[str, set[int]] = {}  # client id -> workers to tell SETTLED
        self._stand_ins: dict[str, MovedSession] = {}
        self._complete_timer: Timer | None = None
        self._restored = False  # the broker's own sessions are restored (and registered)
        self.counters = {"claims": 0, "claims_remote": 0, "handed_over": 0, "stand_ins": 0,
                         "taken_back": 0}
        for frame_type, handler in (
                (FrameType.CLAIM, self._on_claim), (FrameType.RELEASE, self._on_release),
                (FrameType.REGISTER, self._on_register), (FrameType.DELIVER, self._on_deliver),
                (FrameType.SETTLED, self._on_settled)):
            mesh.handle(frame_type, handler)
        mesh.on_link_up.append(self._on_link_up)
        mesh.on_link_down.append(self._on_link_down)

    @property
    def me(self) -> int:
        return self.leadership.worker.index

    # ------------------------------------------------------------------ the core's interface

    @property
    def alone(self) -> bool:
        return not self.mesh.linked and not (self.remote is not None and self.remote.wanted())

    def claim(self, client_id: str, clean_start: bool,
              done: Callable[[list[Session]], None]) -> bool:
        if self.on_claim is not None:  # (other nodes close their connections of this id)
            self.on_claim(client_id, clean_start)
        remote = self.remote  # the session may be on another node (cluster/nodesessions.py)
        if remote is not None and (clean_start or not remote.wanted()):
            remote = None
        if not self.mesh.linked and remote is None:
            return False
        self.counters["claims"] += 1
        claiming = self._claiming
        claiming[client_id] = claiming.get(client_id, 0) + 1  # two CONNECTs of one id here

        def answered(status: int, holders: list[int], sessions: list[bytes]) -> None:
            if remote is None:
                return adopt(holders, sessions, [])
            remote.fetch(client_id, partial(adopt, holders, sessions))

        def adopt(holders: list[int], sessions: list[bytes],
                  fetched: list[tuple[int, bytes]]) -> None:
            left = claiming.pop(client_id, 1) - 1
            if left > 0:
                claiming[client_id] = left
            self.drop_moved(client_id)  # a stand-in left here is not the session
            blobs = sessions + [blob for _, blob in fetched]
            adopted = self.host.adopt_sessions(blobs) if blobs else []
            for holder in holders:  # a stand-in waits for our SETTLED
                self._pending_settle.setdefault(client_id, set()).add(holder)
            if not fetched or remote is None:
                return done(adopted)
            # The nodes that handed it over drop their stand-ins once our routes are in
            # place everywhere (nothing routed meanwhile is lost), and the CONNACK waits for
            # them (nothing routed afterwards comes twice).
            nodes = [peer for peer, _ in fetched]
            self.mesh.barrier(lambda: remote.settle(client_id, nodes, lambda: done(adopted)))

        self._claim_local(client_id, clean_start, answered)
        return True

    def claim_here(self, client_id: str, done: Callable[[list[Session]], None]) -> None:
        """Gather ``client_id``'s session from this node's workers onto this one, with no
        connection for it (another node asks for it: cluster/nodesessions.py); ``done``
        with what was adopted, on a later loop turn."""
        if not self.mesh.linked:
            self.defer(partial(done, []))
            return
        claiming = self._claiming
        claiming[client_id] = claiming.get(client_id, 0) + 1

        def answered(status: int, holders: list[int], sessions: list[bytes]) -> None:
            left = claiming.pop(client_id, 1) - 1
            if left > 0:
                claiming[client_id] = left
            self.drop_moved(client_id)
            adopted = self.host.adopt_sessions(sessions) if sessions else []
            for holder in holders:
                self._pending_settle.setdefault(client_id, set()).add(holder)
            self.settled(client_id, adopted)
            done(adopted)

        self._claim_local(client_id, False, answered)

    def _claim_local(self, client_id: str, clean_start: bool, answered: Answer) -> None:
        """Take ``client_id``'s session from the node's other workers: its owner knows."""
        if not self.mesh.linked:
            self.defer(partial(answered, CLAIM_NONE, [], []))
            return
        owner = self.leadership.owner_of_client(client_id)
        if owner == self.me:
            def answer_later(status: int, holders: list[int], sessions: list[bytes]) -> None:
                self.defer(partial(answered, status, holders, sessions))

            self._serve_claim(self.me, client_id, clean_start, answer_later)
        elif not self.mesh.request(owner, lambda request_id: Claim(
                request_id, client_id, clean_start).encode(),
                partial(self._claimed, client_id, owner, answered), timeout=CLAIM_TIMEOUT):
            self._claim_everywhere(client_id, clean_start, answered)  # the owner is down
        else:
            self.counters["claims_remote"] += 1

    def settled(self, client_id: str, adopted: list[Session]) -> None:
        """The adopted sessions are in place (their routes queued): deliver what came for
        them meanwhile, and tell the workers that handed them over."""
        held = self._held.pop(client_id, [])
        session = self.host.sessions.get(client_id)
        if session is not None and not isinstance(session, MovedSession):
            now = self.mesh.io.now()
            for message, qos, retain, ids, group in held:
                session.deliver(message, qos, retain, ids, now, group)
        frame = Settled(client_id).encode()
        for holder in self._pending_settle.pop(client_id, set()):
            self.mesh.send(holder, frame)  # after our routes (queued first)

    def created(self, session: Session) -> None:
        self._register([session.client_id], [])

    def ended(self, session: Session) -> None:
        self._register([], [session.client_id])

    # ------------------------------------------------------------------ claims (claimant)

    def _claimed(self, client_id: str, owner: int, answered: Answer,
                 frame: Claimed | None) -> None:
        if frame is None:  # the owner is stopped, stuck or gone: start afresh here
            log.warning("claim of client_id=%s unanswered by its owner, worker %d, within "
                        "%.0f s: going on with a new session", client_id, owner, CLAIM_TIMEOUT)
            return answered(CLAIM_NONE, [], [])
        answered(frame.status, frame.holders, frame.sessions)

    def _claim_everywhere(self, client_id: str, clean_start: bool, answered: Answer) -> None:
        holders: list[int] = []
        sessions: list[bytes] = []

        def on_answer(peer: int, frame: Claimed | None, late: bool) -> None:
            if frame is None or not frame.sessions:
                return
            if late:
                log.warning("session handed over after the claim timed out, dropped "
                            "client_id=%s", client_id)
                return
            holders.extend(frame.holders)
            sessions.extend(frame.sessions)

        self.mesh.ask_all(lambda request_id: Release(request_id, client_id, clean_start,
                                                     self.me).encode(), on_answer,
                          lambda: answered(CLAIM_SESSION if sessions else CLAIM_NONE,
                                           holders, sessions),
                          f"claim of client_id={client_id}")

    # ------------------------------------------------------------------ claims (owner)

    def _on_claim(self, peer: int, frame: Claim) -> None:
        link = self.mesh.incarnation(peer)  # the answer goes on this link or nowhere

        def answer(status: int, holders: list[int], sessions: list[bytes]) -> None:
            self.mesh.send(peer, Claimed(frame.request_id, status, holders, sessions).encode(),
                           link)

        self._serve_claim(peer, frame.client_id, frame.clean_start, answer)

    def _serve_claim(self, claimant: int, client_id: str, clean_start: bool,
                     answer: Answer) -> None:
        """One claim at a time per client id; each once every peer has registered."""
        waiting = self._busy.get(client_id)
        job = partial(self._take, claimant, client_id, clean_start, answer)
        if waiting is not None:
            waiting.append(job)
            return
        self._busy[client_id] = deque()
        self._when_complete(job)

    def _take(self, claimant: int, client_id: str, clean_start: bool, answer: Answer) -> None:
        holders = {self.holders.get(client_id), *self.extra.pop(client_id, ())}
        holders -= {None, claimant}
        log.debug("claim client_id=%s by worker %d clean=%s holders=%s", client_id, claimant,
                  clean_start, sorted(h for h in holders if h is not None))
        handed: list[int] = []
        sessions: list[bytes] = []
        waiting = [len(holders)]

        def one(holder: int, frame: Claimed | None) -> None:
            if frame is not None and frame.sessions:
                handed.append(holder)
                sessions.extend(frame.sessions)
            waiting[0] -= 1
            if waiting[0] == 0:
                finish()

        def finish() -> None:
            self.holders[client_id] = claimant
            answer(CLAIM_SESSION if sessions else CLAIM_NONE, handed, sessions)
            self._next_claim(client_id)

        if not holders:
            return finish()
        for holder in sorted(h for h in holders if h is not None):
            if holder == self.me:
                self._release_here(client_id, clean_start, claimant, partial(one, holder))
            elif not self.mesh.request(holder, lambda request_id: Release(
                    request_id, client_id, clean_start, claimant).encode(),
                    partial(one, holder), timeout=RELEASE_TIMEOUT):
                one(holder, None)  # down: a copy it may still have comes back registered

    def _next_claim(self, client_id: str) -> None:
        waiting = self._busy.get(client_id)
        if waiting:
            waiting.popleft()()
        else:
            self._busy.pop(client_id, None)

    # ------------------------------------------------------------------ releasing (holder)

    def _on_release(self, peer: int, frame: Release) -> None:
        link = self.mesh.incarnation(peer)

        def answer(frame_: Claimed | None, request_id: int = frame.request_id) -> None:
            assert frame_ is not None
            self.mesh.send(peer, Claimed(request_id, frame_.status, frame_.holders,
                                         frame_.sessions).encode(), link)

        self._release_here(frame.client_id, frame.clean_start, frame.to, answer)

    def _release_here(self, client_id: str, clean_start: bool, to: int,
                      answer: Callable[[Claimed | None], None]) -> None:
        host = self.host
        if isinstance(host.sessions.get(client_id), MovedSession):
            return answer(Claimed(0, CLAIM_NONE, [], []))  # it lives elsewhere already
        if self._claiming.get(client_id):
            host.supersede(client_id)
        session = host.release_session(client_id, clean_start)
        log.debug("release client_id=%s to worker %d clean=%s handed=%s", client_id, to,
                  clean_start, session is not None)
        if session is None:
            return answer(Claimed(0, CLAIM_NONE, [], []))
        blob = host.export_session(session)
        self.counters["handed_over"] += 1
        if to != self.me:
            self._stand_in(session, to, blob)
        answer(Claimed(0, CLAIM_SESSION, [self.me], [blob]))

    # ------------------------------------------------------------------ stand-ins

    def _stand_in(self, session: Session, peer: int, blob: bytes) -> None:
        """Put a ``MovedSession`` where ``session`` was (cluster/moving.py), keeping the
        session handed over (``blob``) until ``peer`` confirms it with SETTLED."""
        client_id = session.client_id
        mesh = self.mesh
        stub = MovedSession(session, peer, partial(self._deliver_moved, peer, client_id),
                            partial(self._covered, peer), blob)
        stub.timer = mesh.call_at(mesh.io.now() + SETTLE_TIMEOUT,
                                  partial(self._unsettled, client_id, stub))
        self.host.sessions[client_id] = stub
        self.counters["stand_ins"] += 1
        self._stand_ins[client_id] = stub

    def _unsettled(self, client_id: str, stub: MovedSession) -> None:
        if self._stand_ins.get(client_id) is stub:
            self._take_back(client_id, stub, f"no SETTLED within {SETTLE_TIMEOUT:.0f} s")

    def _take_back(self, client_id: str, stub: MovedSession, why: str) -> None:
        """The hand-over to ``stub.peer`` was never confirmed: the session comes back here."""
        self._drop_stand_in(client_id, stub)
        if self.host.take_back_session(stub.blob):
            self.counters["taken_back"] += 1
            log.warning("session handed to worker %d taken back client_id=%s: %s", stub.peer,
                        client_id, why)
            self._register([client_id], [])

    def _covered(self, peer: int, message: Message) -> bool:
        """Will ``peer`` get this message anyway (a publish made here that a plain route of
        the peer matches: it is forwarded after the session's hand-over on the same link)?"""
        if self.host.forwarded_in():
            return False  # delivered where it landed: never forwarded again
        return peer in self.mesh.routes.plain_peers(message.topic)

    def _deliver_moved(self, peer: int, client_id: str, message: Message, qos: int,
                       retain: bool, ids: list[int] | None, group: tuple[str, str] | None
                       ) -> None:
        self.mesh.send(peer, Deliver(client_id, qos, retain, ids or [], group,
                                     self.host.encode_message(message)).encode())

    def claiming(self, client_id: str) -> bool:
        """Is a claim of ``client_id``'s session by this worker in flight?"""
        return bool(self._claiming.get(client_id))

    def hold(self, client_id: str, message: Message, qos: int, retain: bool,
             ids: list[int] | None, group: tuple[str, str] | None) -> None:
        """A message for a session on its way here: delivered once it is adopted."""
        self._held.setdefault(client_id, []).append((message, qos, retain, ids, group))

    def _on_deliver(self, peer: int, frame: Deliver) -> None:
        message = self.host.decode_message(frame.message)
        ids = frame.subscription_ids or None
        if self._claiming.get(frame.client_id):  # on its way here: deliver once adopted
            self.hold(frame.client_id, message, frame.qos, frame.retain, ids, frame.group)
            return
        session = self.host.sessions.get(frame.client_id)
        if session is not None:
            session.deliver(message, frame.qos, frame.retain, ids, self.mesh.io.now(),
                            frame.group)

    def _on_settled(self, peer: int, frame: Settled) -> None:
        stub = self.host.sessions.get(frame.client_id)
        if isinstance(stub, MovedSession) and stub.peer == peer:
            self._drop_stand_in(frame.client_id, stub)

    def _drop_stand_in(self, client_id: str, stub: MovedSession) -> None:
        if stub.timer is not None:
            stub.timer.cancel()
        if self._stand_ins.get(client_id) is stub:
            del self._stand_ins[client_id]
        if self.host.sessions.get(client_id) is stub:
            del self.host.sessions[client_id]
            self.host.drop_session(stub)

    def drop_moved(self, client_id: str) -> None:
        """A connection for ``client_id`` is being accepted here: a stand-in left for it is
        not a session."""
        stub = self.host.sessions.get(client_id)
        if isinstance(stub, MovedSession):
            self._drop_stand_in(client_id, stub)

    # ------------------------------------------------------------------ registration

    def _register(self, added: list[str], removed: list[str]) -> None:
        per_owner: dict[int, tuple[list[str], list[str]]] = {}
        for client_id in added:
            per_owner.setdefault(self.leadership.owner_of_client(client_id), ([], []))[0].append(
                client_id)
        for client_id in removed:
            per_owner.setdefault(self.leadership.owner_of_client(client_id), ([], []))[1].append(
                client_id)
        for owner, (plus, minus) in per_owner.items():
            if owner == self.me:
                self._apply_register(self.me, plus, minus)
            else:
                self.mesh.send(owner, Register(plus, minus).encode())

    def restored(self) -> None:
        """The sessions restored at start-up are here: register them with their owners."""
        self._restored = True
        mine = [c for c, s in self.host.sessions.items() if not isinstance(s, MovedSession)]
        self._register([c for c in mine if self.leadership.owner_of_client(c) == self.me], [])
        for peer in list(self.mesh.peers):
            self._send_registration(peer)

    def _send_registration(self, peer: int) -> None:
        owned = [c for c, s in self.host.sessions.items() if not isinstance(s, MovedSession)
                 and self.leadership.owner_of_client(c) == peer]
        self.mesh.send(peer, Register(owned, [], complete=True).encode())

    def _on_register(self, peer: int, frame: Register) -> None:
        self._apply_register(peer, frame.added, frame.removed)
        if frame.complete:
            self._complete.add(peer)
            self._check_complete()

    def _apply_register(self, holder: int, added: list[str], removed: list[str]) -> None:
        for client_id in added:
            current = self.holders.get(client_id)
            if current is None or current == holder:
                self.holders[client_id] = holder
            else:
                self.extra.setdefault(client_id, set()).add(holder)
        for client_id in removed:
            if self.holders.get(client_id) == holder:
                del self.holders[client_id]
            extra = self.extra.get(client_id)
            if extra is not None:
                extra.discard(holder)
                if not extra:
                    del self.extra[client_id]

    def _on_link_up(self, peer: int, hello: Hello) -> None:
        if self._restored:
            self._send_registration(peer)

    def _on_link_down(self, peer: int) -> None:
        self._complete.discard(peer)
        for client_id, stub in list(self._stand_ins.items()):
            if stub.peer == peer:
                self._take_back(client_id, stub, "the link to it dropped before SETTLED")
        self._check_complete()

    def _when_complete(self, job: Callable[[], None]) -> None:
        """Run ``job`` once every linked peer has sent its full registration."""
        if set(self.mesh.peers) <= self._complete:
            job()
            return
        self._waiting_complete.append(job)
        if len(self._waiting_complete) == 1:
            self._complete_timer = self.mesh.call_at(
                self.mesh.io.now() + ANSWER_TIMEOUT, partial(self._check_complete, True))

    def _check_complete(self, overdue: bool = False) -> None:
        if not self._waiting_complete:
            return
        if overdue or set(self.mesh.peers) <= self._complete:
            if overdue:
                log.warning("claims served before every worker registered its sessions")
            elif self._complete_timer is not None:
                self._complete_timer.cancel()
            self._complete_timer = None
            jobs, self._waiting_complete = self._waiting_complete, []
            for job in jobs:
                job()

    def statistics(self) -> dict[str, Any]:
        return {"directory_entries": len(self.holders), **self.counters}


CLAIM_TIMEOUT = ANSWER_TIMEOUT  # a stopped or stuck owner holds a CONNECT back this long
RELEASE_TIMEOUT = 0.8 * ANSWER_TIMEOUT  # an owner waits this long for a holder, so that its
# answer (without the session, then) still reaches the claimant in time
