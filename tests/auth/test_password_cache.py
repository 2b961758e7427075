"""The password file's cache of verified credentials (auth/passwords.py), no broker needed."""

from __future__ import annotations

import asyncio
from pathlib import Path

from meshmq.auth.passwords import PasswordVerifier, hash_password, write_password_file
from meshmq.broker.authn import MAX_PENDING, Authenticator
from meshmq.config import AuthConfig
from meshmq.mqtt.packets import Connect
from meshmq.mqtt.reason_codes import ReasonCode


def test_only_credentials_verified_before_are_answered_from_the_cache() -> None:
    users = {"fleet": hash_password("s3cret"), "other": hash_password("x")}
    verifier = PasswordVerifier(users)
    assert not verifier.verified("fleet", b"s3cret")  # never verified: ask argon2
    assert verifier.verify("fleet", b"s3cret")
    assert verifier.verified("fleet", b"s3cret")
    assert not verifier.verified("fleet", b"s3cret!")  # another password is not the cached one
    assert not verifier.verified("other", b"s3cret")  # nor is another user
    assert not verifier.verified("fleet", None) and not verifier.verified(None, b"s3cret")
    assert not verifier.verify("fleet", b"wrong")
    assert verifier.verified("fleet", b"s3cret")  # a failed attempt does not evict it


def test_a_reloaded_file_starts_with_an_empty_cache() -> None:
    """After SIGHUP the new file's verifier is asked: a changed password is not taken from
    what the old file verified."""
    old = PasswordVerifier({"fleet": hash_password("old")})
    assert old.verify("fleet", b"old")
    new = PasswordVerifier({"fleet": hash_password("new")})
    assert not new.verified("fleet", b"old")
    assert not new.verify("fleet", b"old")


class CountingVerifier(PasswordVerifier):
    """A real verifier (argon2 and all) that counts the verifications it runs."""

    def __init__(self, users: dict[str, str]) -> None:
        super().__init__(users)
        self.runs: list[tuple[str | None, bytes | None]] = []

    def verify(self, username: str | None, password: bytes | None) -> bool:
        self.runs.append((username, password))
        return super().verify(username, password)


def test_a_fleet_sharing_new_credentials_costs_one_verification(tmp_path: Path) -> None:
    """300 CONNECTs with the same credentials, not verified yet, arriving together (a fleet
    restarting after the broker did): one argon2 run answers them all, and none is told
    Server busy although they are more than ``MAX_PENDING``. Other credentials in flight at
    the same time get their own run, and no password is not the empty password."""
    passwords = tmp_path / "passwords"
    write_password_file(passwords, {"fleet": hash_password("s3cret"), "nopw": hash_password("")})

    async def run() -> tuple[CountingVerifier, dict[str, list[int | None]]]:
        authenticator = Authenticator(AuthConfig(password_file=str(passwords)),
                                      asyncio.get_running_loop())
        verifier = CountingVerifier({"fleet": hash_password("s3cret"),
                                     "nopw": hash_password("")})
        authenticator.verifier = verifier
        answers: dict[str, list[int | None]] = {}
        waiting = 0
        finished = asyncio.Event()

        def ask(kind: str, packet: Connect) -> None:
            nonlocal waiting

            def done(code: int) -> None:
                nonlocal waiting
                answers[kind].append(code)
                waiting -= 1
                if not waiting:
                    finished.set()

            answers.setdefault(kind, [])
            code = authenticator.check(packet, done)
            if code is None:
                waiting += 1
            else:
                answers[kind].append(code)

        for index in range(MAX_PENDING + 44):
            ask("fleet", Connect(f"dev-{index}", 5, username="fleet", password=b"s3cret"))
        for index in range(3):
            ask("wrong", Connect(f"bad-{index}", 5, username="fleet", password=b"wrong"))
            ask("no password", Connect(f"np-{index}", 5, username="nopw", password=None))
            ask("empty password", Connect(f"ep-{index}", 5, username="nopw", password=b""))
        await asyncio.wait_for(finished.wait(), 30)
        authenticator.close()
        return verifier, answers

    verifier, answers = asyncio.run(run())
    assert answers["fleet"] == [0] * (MAX_PENDING + 44)  # all in, none told Server busy (0x89)
    assert answers["wrong"] == [ReasonCode.BAD_USER_NAME_OR_PASSWORD] * 3
    assert answers["no password"] == [ReasonCode.BAD_USER_NAME_OR_PASSWORD] * 3
    assert answers["empty password"] == [0] * 3
    assert sorted(verifier.runs, key=repr) == sorted(
        [("fleet", b"s3cret"), ("fleet", b"wrong"), ("nopw", None), ("nopw", b"")], key=repr)
