"""Run ``meshmq serve`` where it must *not* start, and see how it stops.

``conftest.start_broker`` fails a test when the broker exits; a test about a refused start-up
needs the opposite: the exit status and what the broker logged. ``serve_until_exit`` runs the
same command line on the same data directory (``tmp_path/<name>/data``) and waits for the
process to end (a broker that starts instead never ends: the test fails on the timeout).
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

START_TIMEOUT = 60.0


def serve_until_exit(tmp_path: Path, name: str = "broker", config: str = "",
                     workers: int = 1) -> subprocess.CompletedProcess[str]:
    """``meshmq serve`` on ``tmp_path/name/data`` until it exits; its status and output."""
    workdir = tmp_path / name
    workdir.mkdir(parents=True, exist_ok=True)
    config_file = workdir / "refused.toml"
    config_file.write_text(config)
    cmd = [sys.executable, "-m", "meshmq", "serve", "--config", str(config_file),
           "--bind", "127.0.0.1", "--port", "0", "--data-dir", str(workdir / "data"),
           "--log-level", "debug", "--workers", str(workers)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=START_TIMEOUT,
                          stdin=subprocess.DEVNULL)


def quoted_command(output: str, prefix: str) -> list[str]:
    """The command between backquotes in ``output`` that starts with ``prefix``, split as a
    shell would (so a test runs exactly what an operator would paste)."""
    found = re.search(rf"`({re.escape(prefix)}[^`]*)`", output)
    assert found, f"no `{prefix}...` in:\n{output}"
    return shlex.split(found.group(1))


def run_pasted(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run a pasted ``meshmq ...`` command line with this interpreter's meshmq."""
    assert command[0] == "meshmq", command
    return subprocess.run([sys.executable, "-m", "meshmq", *command[1:]], capture_output=True,
                          text=True, timeout=START_TIMEOUT, cwd=cwd, stdin=subprocess.DEVNULL)
