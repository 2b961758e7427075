"""MQTT.js (Node.js) for the interoperability tests: the ``mqtt`` package installed with npm,
once, into a cache directory under ``~/.cache`` (``XDG_CACHE_HOME``).

Tests call ``mqttjs_dir()``, which skips the test, saying why, when node, npm or the package
cannot be had. Installs are serialised by a lock file: test processes running side by side
(pytest -n 2) would otherwise install into the same directory at once. ``make test`` runs this
module first (``python tests/mqttjs.py``) so that CI installs it before the tests start.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

MQTTJS_VERSION = "5.16.0"
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "meshmq-tests"
INSTALL_TIMEOUT = 180


class Unavailable(Exception):
    """MQTT.js cannot be had here; the message says why."""


def install() -> Path:
    """The directory holding ``node_modules/mqtt`` (installed now if it is not yet)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        raise Unavailable("node and npm are needed for the MQTT.js tests")
    directory = CACHE / f"mqttjs-{MQTTJS_VERSION}"
    marker = directory / "node_modules" / "mqtt" / "package.json"
    if marker.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"mqttjs-{MQTTJS_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another test process may be installing it
        if marker.exists():
            return directory
        try:
            result = subprocess.run(
                ["npm", "install", "--no-audit", "--no-fund", "--prefix", str(directory),
                 f"mqtt@{MQTTJS_VERSION}"],
                capture_output=True, text=True, timeout=INSTALL_TIMEOUT, check=False)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"npm install mqtt@{MQTTJS_VERSION} took over "
                              f"{INSTALL_TIMEOUT} s") from None
        if result.returncode != 0:
            raise Unavailable(f"npm install mqtt@{MQTTJS_VERSION} failed: "
                              f"{result.stderr.strip().splitlines()[-1:]}")
    return directory


def mqttjs_dir() -> Path:
    """``install()``, or skip the calling test with the reason."""
    import pytest

    try:
        return install()
    except Unavailable as why:
        pytest.skip(str(why))


def node_environment(directory: Path) -> dict[str, str]:
    """The environment a ``node`` script needs to ``require("mqtt")``."""
    return {**os.environ, "NODE_PATH": str(directory / "node_modules")}


if __name__ == "__main__":  # make test: install before the tests run (best effort)
    try:
        print(f"MQTT.js {MQTTJS_VERSION} in {install()}")
    except Unavailable as why:
        print(f"note: {why}; the MQTT.js tests will be skipped")
    sys.exit(0)
