"""Compile bench/loadgen.c with the system C compiler, once per source version.

The binary goes to ``$XDG_CACHE_HOME/meshmq-bench`` (default ``~/.cache/meshmq-bench``) under a
name that carries a hash of the source, compiler and flags, so an edited loadgen.c is rebuilt
and nothing compiled is ever committed.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from meshbench import BenchError

SOURCE = Path(__file__).resolve().parents[1] / "loadgen.c"
CFLAGS = ("-O2", "-Wall", "-Wextra", "-std=gnu11")
LIBS = ("-lm", "-lssl", "-lcrypto")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "meshmq-bench"


def build_loadgen(cc: str = "gcc") -> Path:
    """Return the path of a loadgen binary built from the current source (building it if
    needed); raise ``BenchError`` when no compiler is found or the build fails."""
    compiler = shutil.which(cc)
    if compiler is None:
        raise BenchError(f"C compiler {cc!r} not found: install gcc (apt-get install gcc)")
    source = SOURCE.read_bytes()
    digest = hashlib.sha256(source + "\0".join((compiler, *CFLAGS, *LIBS)).encode())
    binary = cache_dir() / f"loadgen-{digest.hexdigest()[:16]}"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_name(f"{binary.name}.{os.getpid()}.tmp")
    cmd = [compiler, *CFLAGS, "-o", str(partial), str(SOURCE), *LIBS]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        raise BenchError(f"building the load generator failed: {done.stderr.strip()}")
    os.replace(partial, binary)  # concurrent builds of the same source agree on the result
    for old in binary.parent.glob("loadgen-*"):
        if old != binary and not old.name.endswith(".tmp"):
            old.unlink(missing_ok=True)  # built from an older loadgen.c
    return binary
