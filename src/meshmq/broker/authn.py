"""Authentication of CONNECT credentials, without blocking the event loop.

``check()`` answers at once when it can (anonymous rules, overload, credentials verified before:
the password file's cache, ``PasswordVerifier.verified``) and otherwise runs the slow argon2id
verification in a small thread pool, calling ``done(reason_code)`` back on the loop. So a
reconnect storm of known devices costs the loop a keyed hash per CONNECT, and only credentials
not seen since the file was loaded cost an argon2 verification (about 30 ms of a pool thread).
CONNECTs with the same credentials as a verification in flight wait for its answer instead of
starting their own (a fleet sharing one credential, restarting together, costs one argon2 run,
not one per device up to ``MAX_PENDING`` and then Server busy for the rest).
While a check is pending the broker holds the connection's later packets (see
``ClientProtocol.hold``), so nothing a client pipelines behind CONNECT runs unauthenticated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from meshmq.auth.passwords import PasswordFileError, PasswordVerifier
from meshmq.config import AuthConfig
from meshmq.mqtt.packets import Connect
from meshmq.mqtt.reason_codes import ReasonCode

log = logging.getLogger("meshmq.auth")

MAX_PENDING = 256  # concurrent verifications; beyond this a CONNECT gets Server Busy


class ConnectAuthenticator(Protocol):
    """What the broker asks of its authenticator (``Authenticator``, or the certificate
    authenticator wrapped around it)."""

    def check(self, packet: Connect, done: Callable[[int], None]) -> int | None: ...
    def reload(self, auth: AuthConfig) -> None: ...
    def close(self) -> None: ...


class Authenticator:
    """Decides whether a CONNECT may proceed: 0 = yes, else the CONNACK reason code."""

    def __init__(self, auth: AuthConfig, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.allow_anonymous = auth.allow_anonymous
        self.verifier = (
            PasswordVerifier.from_file(auth.password_file) if auth.password_file else None
        )
        self.pending = 0  # verifications in the pool (``MAX_PENDING`` at most)
        # (user name, credentials token) -> the answers waiting for that verification
        self._in_flight: dict[tuple[str, bytes | None], list[Callable[[int], None]]] = {}
        self._pool: ThreadPoolExecutor | None = None
        if self.verifier is not None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="meshmq-auth")
            log.info("password file loaded users=%d anonymous=%s", len(self.verifier),
                     self.allow_anonymous)

    def check(self, packet: Connect, done: Callable[[int], None]) -> int | None:
        """Return a reason code now, or None after arranging ``done(code)`` on the loop."""
        verifier = self.verifier
        if packet.username is None or verifier is None:
            return 0 if self.allow_anonymous else ReasonCode.NOT_AUTHORIZED
        username, password = packet.username, packet.password
        if verifier.verified(username, password):
            return 0
        key = (username, None if password is None else verifier.token(username, password))
        waiting = self._in_flight.get(key)
        if waiting is not None:  # the same credentials are being verified: wait for that
            waiting.append(done)
            return None
        if self.pending >= MAX_PENDING:
            return ReasonCode.SERVER_BUSY
        self.pending += 1
        self._in_flight[key] = [done]
        future = self.loop.run_in_executor(self._pool, verifier.verify, username, password)
        future.add_done_callback(lambda f: self._finish(f, key))
        return None

    def _finish(
        self, future: Future[bool] | asyncio.Future[bool], key: tuple[str, bytes | None]
    ) -> None:
        self.pending -= 1
        ok = not future.cancelled() and future.exception() is None and future.result()
        for done in self._in_flight.pop(key, ()):
            done(0 if ok else ReasonCode.BAD_USER_NAME_OR_PASSWORD)

    def reload(self, auth: AuthConfig) -> None:
        """SIGHUP: re-read the password file, or read the one ``auth`` now names (or drop it);
        on error keep the users loaded before. Pending checks finish with the old users."""
        self.allow_anonymous = auth.allow_anonymous
        if not auth.password_file:
            if self.verifier is not None:
                log.info("password file no longer used: no users")
            self.verifier = None
            return
        try:
            verifier = PasswordVerifier.from_file(auth.password_file)
        except PasswordFileError as error:
            log.error("password file not reloaded, keeping the previous users: %s", error)
            return
        self.verifier = verifier
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="meshmq-auth")
        log.info("password file reloaded users=%d", len(verifier))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
