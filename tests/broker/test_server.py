"""Starting a node: a data directory that cannot be used is one line naming it, exit status 2,
with one worker and with two (the supervisor checks it before forking)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

WORKERS = [1, 2]


def serve(data_dir: Path, workers: int, prefix: list[str] | None = None,
          ) -> subprocess.CompletedProcess[str]:
    """``meshmq serve`` on an ephemeral port with ``data_dir``; it must stop by itself."""
    return subprocess.run(
        [*(prefix or []), sys.executable, "-m", "meshmq", "serve", "--port", "0",
         "--bind", "127.0.0.1", "--data-dir", str(data_dir), "--workers", str(workers)],
        capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
    )


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    """The only line on stderr (INFO lines would be fine, but a bad start has none)."""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and " ERROR " in lines[0], result.stderr
    return lines[0]


def a_file(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "data"
    path.write_text("not a directory")
    return path, f"server.data_dir: {path} is a file, not a directory"


def under_a_file(tmp_path: Path) -> tuple[Path, str]:
    blocker = tmp_path / "plain-file"
    blocker.write_text("")
    path = blocker / "data"
    return path, f"server.data_dir: cannot create {path}: {blocker} is a file, not a directory"


def a_file_where_the_state_goes(tmp_path: Path) -> tuple[Path, str]:
    path = tmp_path / "data"
    path.mkdir()
    (path / "state").write_text("")  # worker 0 and a single process keep their state here
    return path, f"server.data_dir: cannot use {path / 'state'}:" \
                 " a file is where a directory should be"


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("bad", [a_file, under_a_file, a_file_where_the_state_goes])
def test_a_bad_data_dir_is_one_line_naming_it_and_exit_2(
    tmp_path: Path, bad: Callable[[Path], tuple[Path, str]], workers: int,
) -> None:
    data_dir, expected = bad(tmp_path)
    result = serve(data_dir, workers)
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert expected in line
    if workers > 1 and bad is not a_file_where_the_state_goes:
        assert " meshmq.supervisor " in line  # checked once, before any worker exists


def private_read_only_mount() -> list[str] | None:
    """A command prefix that runs a command in a private mount namespace where the directory
    given as the prefix's first argument is a read-only tmpfs (so even root cannot write
    there), or None if this machine allows neither ``unshare -m`` nor ``unshare -rm``."""
    if shutil.which("unshare") is None:
        return None
    script = 'mount -t tmpfs -o ro,size=64k meshmq-test "$0" && exec "$@"'
    for unshare in (["unshare", "-m"], ["unshare", "-rm"]):  # as root; as a user (userns)
        probe = subprocess.run([*unshare, "sh", "-c", script, "/tmp", "true"],
                               capture_output=True, timeout=30)
        if probe.returncode == 0:
            return [*unshare, "sh", "-c", script]
    return None


@pytest.mark.parametrize("workers", WORKERS)
def test_a_data_dir_that_is_not_writable_is_one_line_and_exit_2(
    tmp_path: Path, workers: int,
) -> None:
    """Tests run as root, for whom a chmod'ed directory stays writable: the data dir is a
    read-only filesystem instead, mounted in a mount namespace of the broker's own."""
    prefix = private_read_only_mount()
    if prefix is None:
        pytest.skip("cannot mount a read-only filesystem here (needs `unshare -m` as root or"
                    " user namespaces for `unshare -rm`), and a chmod'ed directory is no test"
                    " for root")
    data_dir = tmp_path / "read-only"
    data_dir.mkdir()
    result = serve(data_dir, workers, [*prefix, str(data_dir)])
    assert result.returncode == 2, result.stderr
    line = one_error_line(result)
    assert f"server.data_dir: {data_dir} is not writable: Read-only file system" in line
    if workers > 1:
        assert " meshmq.supervisor " in line
