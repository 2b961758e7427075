"""User names proven by the transport: a verified client certificate's CN (``tls.cert_username``).

The TLS layer knows who the peer is before any MQTT byte arrives; the broker authenticates the
CONNECT. They meet here: ``ClientProtocol`` replaces the CONNECT of such a connection by a
``CertifiedConnect`` (user name = the certificate's CN, password dropped), and
``CertificateAuthenticator`` accepts a ``CertifiedConnect`` without a password check, passing
every other CONNECT to the password authenticator. Only ``certify()`` creates a
``CertifiedConnect``, never the codec, so no bytes a client sends can forge one. Everything after
authentication (ACLs, ``%u``) sees the CN as the user name.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from meshmq.broker.authn import ConnectAuthenticator
from meshmq.config import AuthConfig
from meshmq.mqtt.packets import Connect

log = logging.getLogger("meshmq.auth")


class CertifiedConnect(Connect):
    """A CONNECT whose user name a verified client certificate proved."""

    __slots__ = ()


def certify(packet: Connect, username: str) -> CertifiedConnect:
    """``packet`` with ``username`` as its user name and no password, marked as proven."""
    values = {name: getattr(packet, name) for name in Connect.FIELDS}
    values.update(username=username, password=None)
    return CertifiedConnect(**values)


class CertificateAuthenticator:
    """Wraps the broker's authenticator: certified CONNECTs pass, the rest go to ``inner``."""

    def __init__(self, inner: ConnectAuthenticator) -> None:
        self.inner = inner

    def check(self, packet: Connect, done: Callable[[int], None]) -> int | None:
        if isinstance(packet, CertifiedConnect):
            log.debug("certificate user name accepted user=%s", packet.username)
            return 0
        return self.inner.check(packet, done)

    def reload(self, auth: AuthConfig) -> None:
        self.inner.reload(auth)

    def close(self) -> None:
        self.inner.close()
