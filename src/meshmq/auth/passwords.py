"""Password files: one ``user:$argon2id$...`` line per user, as ``meshmq passwd`` writes them.

Verification is deliberately slow (argon2id), so the broker runs ``verify()`` in a worker thread,
never on its event loop. An in-memory cache of verified credentials (per user, a BLAKE2 digest
of the password keyed with a secret drawn at load time, never the password itself) spares
reconnect storms the argon2 cost: ``verified()`` answers from it in microseconds, so the broker
asks it first, on the loop, and only sends a miss to the thread pool. The cache belongs to one
loaded file: a reload starts empty, so a changed or removed password is never accepted from it.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
import threading
from pathlib import Path

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError, VerifyMismatchError

# OWASP's argon2id minimum: 19 MiB, 2 passes, 1 lane (about 30 ms per verification here).
HASHER = PasswordHasher(time_cost=2, memory_cost=19_456, parallelism=1)
CACHE_LIMIT = 65_536  # users remembered (about 150 bytes each); the oldest is forgotten first


class PasswordFileError(Exception):
    """The password file is unreadable or has a malformed line (the message says which)."""


def read_password_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Parse ``path`` into {user: hash}; blank lines and ``#`` comments are skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise PasswordFileError(f"{path}: cannot read password file: {exc.strerror}") from None
    users: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        user, sep, digest = line.partition(":")
        if not sep or not user or not digest.startswith("$argon2"):
            raise PasswordFileError(f"{path}:{number}: expected 'user:$argon2id$...'")
        users[user] = digest
    return users


def write_password_file(path: str | os.PathLike[str], users: dict[str, str]) -> None:
    """Replace ``path`` atomically with ``users`` (mode 0600)."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent or ".", prefix=f".{target.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for user in sorted(users):
                handle.write(f"{user}:{users[user]}\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def hash_password(password: str) -> str:
    return HASHER.hash(password)


class PasswordVerifier:
    """Checks user name and password against a loaded password file; thread-safe."""

    def __init__(self, users: dict[str, str]) -> None:
        self._users = users
        self._key = secrets.token_bytes(32)
        self._verified: dict[str, bytes] = {}
        self._lock = threading.Lock()

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> PasswordVerifier:
        return cls(read_password_file(path))

    def __len__(self) -> int:
        return len(self._users)

    def verified(self, username: str | None, password: bytes | None) -> bool:
        """True if these credentials were verified since the file was loaded (fast: a keyed
        hash and a lookup, fit for the event loop). False says nothing: call ``verify()``."""
        if username is None or password is None:
            return False
        known = self._verified.get(username)
        return known is not None and hmac.compare_digest(known, self._token(username, password))

    def verify(self, username: str | None, password: bytes | None) -> bool:
        """True if the user exists and the password matches (slow: call off the loop)."""
        if username is None or password is None:
            return False
        digest = self._users.get(username)
        if digest is None:
            _burn_time(password)  # an unknown user costs as much as a wrong password
            return False
        if self.verified(username, password):
            return True
        try:
            HASHER.verify(digest, password)
        except (VerifyMismatchError, VerificationError, InvalidHashError):
            return False
        token = self._token(username, password)
        with self._lock:
            verified = self._verified
            verified.pop(username, None)  # re-inserted last: the newest
            if len(verified) >= CACHE_LIMIT:
                del verified[next(iter(verified))]
            verified[username] = token
        return True

    def token(self, username: str, password: bytes) -> bytes:
        """The keyed digest that stands for these credentials (the cache's entry; the key of a
        verification in flight): not reversible, and different for every loaded file."""
        return self._token(username, password)

    def _token(self, username: str, password: bytes) -> bytes:
        return hashlib.blake2b(password, key=self._key, person=username.encode()[:16],
                               digest_size=32).digest()


_DUMMY_HASH: list[str] = []


def _burn_time(password: bytes) -> None:
    if not _DUMMY_HASH:
        _DUMMY_HASH.append(HASHER.hash(secrets.token_hex(16)))
    try:
        HASHER.verify(_DUMMY_HASH[0], password)
    except VerificationError:
        pass
