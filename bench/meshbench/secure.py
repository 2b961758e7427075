"""Credentials and certificates for the scenarios with a password file or TLS.

Both brokers get the same ones, each in its own format:

* a password file with one user, ``USERNAME`` / ``PASSWORD``: meshmq's (``user:$argon2id$...``,
  written by ``meshmq passwd add --password-stdin``) and Mosquitto's (``mosquitto_passwd -b``,
  PBKDF2-SHA512, its default). Every load generator client connects with that one credential:
  a fleet sharing a credential, or a reconnect storm of clients the broker has seen before.
* a self-signed certificate and key (ECDSA P-256, made with the ``openssl`` command) that both
  brokers serve on a TLS 1.3 listener.

Mosquitto, started as root, drops to the ``mosquitto`` user before it reads these files, so
they and their directory are made readable by everyone (throwaway benchmark secrets).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from meshbench import BenchError

USERNAME = "bench"
PASSWORD = "bench-secret-0123"


@dataclass(frozen=True)
class Certificate:
    certfile: Path
    keyfile: Path


def _run(cmd: list[str], what: str, stdin: str | None = None) -> None:
    done = subprocess.run(cmd, input=stdin, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BenchError(f"{what} failed: {(done.stderr or done.stdout).strip()[-300:]}")


def _readable(workdir: Path, *paths: Path) -> None:
    workdir.chmod(0o755)
    for path in paths:
        path.chmod(0o644)


def meshmq_password_file(workdir: Path) -> Path:
    path = workdir / "meshmq.passwd"
    _run([sys.executable, "-m", "meshmq", "passwd", "add", str(path), USERNAME,
          "--password-stdin"], "meshmq passwd add", PASSWORD + "\n")
    return path


def mosquitto_password_file(workdir: Path) -> Path:
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        raise BenchError("mosquitto_passwd not found (Debian package mosquitto)")
    path = workdir / "mosquitto.passwd"
    _run([tool, "-c", "-b", str(path), USERNAME, PASSWORD], "mosquitto_passwd")
    _readable(workdir, path)
    return path


def certificate(workdir: Path) -> Certificate:
    tool = shutil.which("openssl")
    if tool is None:
        raise BenchError("openssl not found (Debian package openssl)")
    cert = Certificate(workdir / "bench-cert.pem", workdir / "bench-key.pem")
    _run([tool, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
          "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1", "-keyout", str(cert.keyfile),
          "-out", str(cert.certfile)], "openssl req")
    _readable(workdir, cert.certfile, cert.keyfile)
    return cert

