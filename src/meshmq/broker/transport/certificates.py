"""Server-side TLS: building the SSLContext, reloading it on SIGHUP, explaining failures.

Theory of operation
-------------------
``ServerCertificates`` holds the context every new TLS handshake uses (the ``tls`` and ``wss``
listeners share it). Each accepted connection's ``TLSLayer`` (``tls.py``) wraps its
``SSLObject`` from the context current at accept, so swapping ``context`` is all a reload
needs: handshakes that start afterwards use the new certificate, established connections keep
the SSL state they were created with and are not disturbed.
A reload that fails (missing file, bad PEM, key not matching) is logged and changes nothing.

Defaults are modern: TLS 1.2 or newer (``tls.min_version``), OpenSSL's secure cipher list,
server cipher preference, no compression, no renegotiation. With ``tls.cafile`` the server asks
for a client certificate and verifies it against those CAs; ``tls.require_client_cert`` makes
it mandatory (mutual TLS), and ``tls.cert_username`` turns the verified certificate's subject
CN into the client's user name (``client_username``).
"""

from __future__ import annotations

import hashlib
import logging
import ssl
from pathlib import Path

from meshmq.config import TLSConfig

log = logging.getLogger("meshmq.tls")

_MIN_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
_OPTIONS = ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE | ssl.OP_NO_RENEGOTIATION


class TLSConfigError(Exception):
    """A certificate, key or CA file cannot be used; the message is one line naming the key."""


def _read(key: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"{key}: cannot read {path!r}: {exc.strerror or exc}") from None


def _encrypted_key() -> bytes:
    raise TLSConfigError("tls.keyfile: the private key is encrypted; give an unencrypted key")


def build_server_context(cfg: TLSConfig) -> ssl.SSLContext:
    """A server SSLContext from ``cfg``; ``TLSConfigError`` (one line) if a file is unusable."""
    cert_pem = _read("tls.certfile", cfg.certfile)
    if b"-----BEGIN CERTIFICATE-----" not in cert_pem:
        raise TLSConfigError(f"tls.certfile: no PEM certificate in {cfg.certfile!r}")
    key_key, key_path = ("tls.keyfile", cfg.keyfile) if cfg.keyfile else ("tls.certfile",
                                                                          cfg.certfile)
    if b"PRIVATE KEY-----" not in _read(key_key, key_path):
        raise TLSConfigError(f"{key_key}: no PEM private key in {key_path!r}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _MIN_VERSIONS[cfg.min_version]
    context.options |= _OPTIONS
    try:
        context.load_cert_chain(cfg.certfile, cfg.keyfile or None, password=_encrypted_key)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TLSConfigError(
                f"{key_key}: the private key does not match the certificate in tls.certfile"
            ) from None
        raise TLSConfigError(f"tls.certfile: cannot load certificate and key: {exc}") from None
    if cfg.cafile:
        if b"-----BEGIN CERTIFICATE-----" not in _read("tls.cafile", cfg.cafile):
            raise TLSConfigError(f"tls.cafile: no PEM certificate in {cfg.cafile!r}")
        try:
            context.load_verify_locations(cafile=cfg.cafile)
        except ssl.SSLError as exc:
            raise TLSConfigError(
                f"tls.cafile: no usable CA certificate in {cfg.cafile!r}: {exc.reason or exc}"
            ) from None
        context.verify_mode = ssl.CERT_REQUIRED if cfg.require_client_cert else ssl.CERT_OPTIONAL
    return context


def fingerprint(certfile: str) -> str:
    """SHA-256 of the first certificate in ``certfile`` (as ``openssl x509 -fingerprint``)."""
    text = Path(certfile).read_text(errors="replace")
    start = text.index("-----BEGIN CERTIFICATE-----")
    end = text.index("-----END CERTIFICATE-----", start) + len("-----END CERTIFICATE-----")
    digest = hashlib.sha256(ssl.PEM_cert_to_DER_cert(text[start:end])).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


class ServerCertificates:
    """The SSLContext new handshakes use; ``reload()`` re-reads the files (SIGHUP)."""

    def __init__(self, cfg: TLSConfig) -> None:
        self.cfg = cfg
        self.context = build_server_context(cfg)
        self.reloads = 0
        log.info("tls certificate loaded certfile=%s sha256=%s client_certs=%s",
                 cfg.certfile, fingerprint(cfg.certfile), self.client_certs)

    @property
    def client_certs(self) -> str:
        if not self.cfg.cafile:
            return "no"
        return "required" if self.cfg.require_client_cert else "optional"

    def reload(self, cfg: TLSConfig | None = None) -> bool:
        """Build a new context from the files (those ``cfg`` names, when given: the
        configuration changed); keep the old one (and log why) on failure."""
        cfg = cfg or self.cfg
        try:
            context = build_server_context(cfg)
            digest = fingerprint(cfg.certfile)
        except (TLSConfigError, OSError, ValueError) as exc:
            log.error("tls reload failed, keeping the current certificate: %s", exc)
            return False
        self.cfg = cfg
        self.context = context
        self.reloads += 1
        log.info("tls certificate reloaded certfile=%s sha256=%s", self.cfg.certfile, digest)
        return True


def client_username(ssl_object: ssl.SSLObject | None) -> str | None:
    """The subject CN of the peer's *verified* certificate, or None (no cert, no CN)."""
    if ssl_object is None:
        return None
    cert = ssl_object.getpeercert()
    if not cert:  # None: no certificate; {}: not verified (never with a cafile set)
        return None
    for rdn in cert.get("subject", ()):
        # typeshed's ssl stub gives every certificate field one union (str, pairs, tuples of
        # pairs), so it cannot say that "subject" holds RDNs of (name, value) pairs.
        for name, value in rdn:  # type: ignore[str-unpack]
            if name == "commonName" and value:
                return str(value)
    return None


# OpenSSL reason -> what an operator should read into it
_HINTS = {
    "WRONG_VERSION_NUMBER": "not a TLS client (plain MQTT on a TLS port?)",
    "HTTP_REQUEST": "not a TLS client (plain HTTP on a TLS port?)",
    "HTTPS_PROXY_REQUEST": "not a TLS client (an HTTP proxy request)",
    "UNKNOWN_PROTOCOL": "not a TLS client",
    "RECORD_LAYER_FAILURE": "not a TLS client",
    "PACKET_LENGTH_TOO_LONG": "not a TLS client",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "client certificate required, none sent",
    "CERTIFICATE_VERIFY_FAILED": "client certificate not trusted (not signed by tls.cafile,"
                                 " expired or invalid)",
    "TLSV1_ALERT_UNKNOWN_CA": "the client does not trust the server certificate",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the client rejected the server certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the client rejected the server certificate",
    "UNSUPPORTED_PROTOCOL": "the client offers only TLS versions below tls.min_version",
    "TLSV1_ALERT_PROTOCOL_VERSION": "no TLS version in common",
    "NO_SHARED_CIPHER": "no cipher suite in common",
    "UNEXPECTED_EOF_WHILE_READING": "the peer left during the handshake",
}


def describe_handshake_error(exc: BaseException) -> str:
    """One short phrase for a failed server handshake, for the log line."""
    if isinstance(exc, ssl.SSLError):
        reason = exc.reason or type(exc).__name__
        hint = _HINTS.get(reason)
        return f"{reason}: {hint}" if hint else str(reason)
    if isinstance(exc, TimeoutError):
        return "timeout: no complete handshake in time"
    if isinstance(exc, ConnectionError | EOFError):
        return "closed: the peer left during the handshake"
    return f"{type(exc).__name__}: {exc}"
