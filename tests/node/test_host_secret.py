"""The host-local secret of the metadata's Raft messages for nodes on loopback without
``cluster.secret_file`` (node/identity.py ``host_secret``)."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from meshmq.node.identity import host_secret
from meshmq.node.startup import StartupError


def test_the_first_node_draws_it_and_every_later_one_reads_the_same(tmp_path: Path) -> None:
    found: list[bytes] = []
    threads = [threading.Thread(target=lambda: found.append(host_secret(str(tmp_path))))
               for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(found)) == 1 and len(found[0]) == 64  # drawn once, however many race
    directory = tmp_path / f"meshmq-{os.getuid()}"
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert stat.S_IMODE((directory / "loopback.secret").stat().st_mode) == 0o600
    assert [p.name for p in directory.iterdir()] == ["loopback.secret"]  # no drafts left
    assert host_secret(str(tmp_path)) == found[0]


def test_a_directory_others_may_open_is_refused_with_its_name(tmp_path: Path) -> None:
    directory = tmp_path / f"meshmq-{os.getuid()}"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    with pytest.raises(StartupError, match=rf"^{directory}: must be a directory of this user"):
        host_secret(str(tmp_path))


def test_an_empty_secret_file_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / f"meshmq-{os.getuid()}"
    directory.mkdir(mode=0o700)
    (directory / "loopback.secret").write_text("")
    with pytest.raises(StartupError, match="is empty: remove it"):
        host_secret(str(tmp_path))
