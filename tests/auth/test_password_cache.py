"""The password file's cache of verified credentials (auth/passwords.py), no broker needed."""

from __future__ import annotations

from meshmq.auth.passwords import PasswordVerifier, hash_password


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
