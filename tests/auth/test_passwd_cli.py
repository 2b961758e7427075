"""``meshmq passwd`` run as a real process without a terminal (what scripts and CI do)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


def passwd_without_terminal(*args: str, stdin: int | None = None,
                            text: str | None = None) -> subprocess.CompletedProcess[str]:
    """``meshmq passwd ARGS`` in a new session (no controlling terminal, so no /dev/tty for
    getpass either) with standard input from ``stdin`` or ``text``."""
    return subprocess.run([sys.executable, "-m", "meshmq", "passwd", *args],
                          stdin=stdin, input=text, capture_output=True, text=True, timeout=60,
                          start_new_session=True)


@pytest.mark.parametrize(("stdin", "text"), [
    (subprocess.DEVNULL, None),  # `< /dev/null`
    (None, "s3cret\ns3cret\n"),  # a pipe, without --password-stdin
])
def test_add_without_a_terminal_points_to_password_stdin(
    tmp_path: Path, stdin: int | None, text: str | None,
) -> None:
    path = tmp_path / "passwords"
    result = passwd_without_terminal("add", str(path), "alice", stdin=stdin, text=text)
    assert result.returncode == 2
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "--password-stdin" in lines[0], result.stderr
    assert lines[0].startswith("meshmq passwd: standard input is not a terminal")
    assert not path.exists()  # nothing written


def test_add_with_password_stdin_works_without_a_terminal(tmp_path: Path) -> None:
    path = tmp_path / "passwords"
    result = passwd_without_terminal("add", str(path), "alice", "--password-stdin",
                                     text="s3cret\n")
    assert result.returncode == 0, result.stderr
    listed = passwd_without_terminal("ls", str(path), stdin=subprocess.DEVNULL)
    assert listed.stdout.split() == ["alice"]


def test_empty_password_on_stdin_is_one_line_and_status_2(tmp_path: Path) -> None:
    path = tmp_path / "passwords"
    result = passwd_without_terminal("add", str(path), "alice", "--password-stdin",
                                     stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["meshmq passwd: empty password refused"]
    assert not path.exists()
