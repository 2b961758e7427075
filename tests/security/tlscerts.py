"""Certificates for TLS tests, made with trustme: a CA, a server certificate, client certificates.

    pki = make_pki(tmp_path / "pki")
    config = tls_section(pki, cafile=True, require_client_cert=True)  # TOML text
    cert, key = pki.client("device-1")           # subject CN = device-1
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass
class PKI:
    directory: Path
    ca: trustme.CA
    ca_file: Path
    cert_file: Path  # server certificate for 127.0.0.1 / localhost
    key_file: Path

    def client(self, common_name: str) -> tuple[Path, Path]:
        """A client certificate (and its key) signed by this CA, subject CN = ``common_name``."""
        leaf = self.ca.issue_cert(f"{common_name}.clients.example", common_name=common_name)
        cert = self.directory / f"{common_name}.crt"
        key = self.directory / f"{common_name}.key"
        leaf.cert_chain_pems[0].write_to_path(str(cert))
        leaf.private_key_pem.write_to_path(str(key))
        return cert, key

    def client_context(self, cert: tuple[Path, Path] | None = None) -> ssl.SSLContext:
        """A client SSLContext trusting this CA, presenting ``cert`` if given."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if cert is not None:
            context.load_cert_chain(str(cert[0]), str(cert[1]))
        return context


def make_pki(directory: Path) -> PKI:
    directory.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    pki = PKI(directory, ca, directory / "ca.pem", directory / "server.crt",
              directory / "server.key")
    ca.cert_pem.write_to_path(str(pki.ca_file))
    server.cert_chain_pems[0].write_to_path(str(pki.cert_file))
    server.private_key_pem.write_to_path(str(pki.key_file))
    return pki


def tls_section(pki: PKI, *, listen: bool = True, cafile: bool = False, **keys: object) -> str:
    """TOML for ``[tls]`` with ``pki``'s server certificate; ``listen``: a listener on port 0."""
    lines = ["[tls]", f"enabled = {'true' if listen else 'false'}", "port = 0",
             f'certfile = "{pki.cert_file}"', f'keyfile = "{pki.key_file}"']
    if cafile:
        lines.append(f'cafile = "{pki.ca_file}"')
    for key, value in keys.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, str):
            lines.append(f'{key} = "{value}"')
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"
