"""Server-side TLS as a layer: ``ssl.SSLObject`` over memory BIOs between a socket and MQTT.

Theory of operation
-------------------
``TLSLayer`` is the ``asyncio.Protocol`` of the socket and the ``asyncio.Transport`` of what runs
above it (``ClientProtocol``, the ``Refuser``, or a ``WebSocketLayer`` for wss). OpenSSL does
the TLS; this module only moves bytes: socket -> ``incoming`` BIO -> ``SSLObject`` ->
plaintext up, and plaintext down -> ``SSLObject`` -> ``outgoing`` BIO -> socket. Doing it here
rather than with ``loop.start_tls`` gives three things the broker needs:

* the first byte is seen: anything but a TLS handshake record (0x16) is "not a TLS client"
  (0x10 is a plain MQTT CONNECT) and is closed with one log line naming the peer;
* every handshake failure (untrusted or missing client certificate, no common version, a
  client that does not trust us, timeout) is logged with the listener, the peer and the reason
  (asyncio and uvloop drop these silently), and the TLS alert is sent before closing;
* the SSLContext is picked when the connection is accepted, so a SIGHUP reload changes only
  later handshakes, and nothing needs a task or depends on when reading can be paused.

Closing (``close()``, e.g. after a DISCONNECT with a reason code) sends close_notify after the
last record, then the socket lingers (``linger.py``): FIN, the peer's further records are read
and dropped, within ``LINGER_SECONDS`` / ``LINGER_BYTES``, so the peer can still decrypt our
last packet while it is sending.

The layer above is created once the handshake is done, with the verified client certificate's
CN when ``tls.cert_username`` is on. Reading follows the layer above: while it has paused
reading (authentication in progress, rate limits), decrypted data stays in the ``SSLObject``
and is drained, on a later loop turn, when it resumes.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import Any

from meshmq.broker.transport.admission import Ticket
from meshmq.broker.transport.certificates import client_username, describe_handshake_error
from meshmq.broker.transport.layer import StackedLayer, stream_transport
from meshmq.broker.transport.linger import close_gracefully

log = logging.getLogger("meshmq.tls")

TLS_HANDSHAKE_RECORD = 0x16
READ_SIZE = 65536


class TLSLayer(StackedLayer, asyncio.Protocol, asyncio.Transport):
    """TLS for one accepted socket; ``make_inner(username)`` builds what runs above it."""

    def __init__(
        self, listener: str, context: ssl.SSLContext,
        make_inner: Callable[[str | None], asyncio.BaseProtocol], deadline: float,
        cert_username: bool, ticket: Ticket | None = None,
    ) -> None:
        asyncio.Transport.__init__(self)
        self.listener = listener
        self.make_inner = make_inner
        self.cert_username = cert_username
        self.ticket = ticket
        self.deadline = deadline
        self.incoming = ssl.MemoryBIO()
        self.outgoing = ssl.MemoryBIO()
        self.ssl = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        self.inner: Any = None
        self.below: asyncio.Transport | None = None
        self.peer = "?"
        self._first = True
        self._paused = False  # the layer above paused reading
        self._closing = False
        self._timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------------ the socket below

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.below = stream_transport(transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._timer = asyncio.get_running_loop().call_later(self.deadline, self._too_slow)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        if self._first:
            self._first = False
            if data[0] != TLS_HANDSHAKE_RECORD:
                what = " (plain MQTT on a TLS port?)" if data[0] == 0x10 else ""
                return self._fail(f"not a TLS client: first byte 0x{data[0]:02X}{what}")
        self.incoming.write(data)
        if self.inner is None and not self._handshake():
            return
        self._drain()

    def eof_received(self) -> bool:
        self.incoming.write_eof()
        if self.inner is None:
            if not self._closing:
                self._fail("closed: the peer left during the handshake")
            return False
        self._drain()
        return bool(self.inner.eof_received()) if not self._closing else False

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._cancel_timer()
        if self.ticket is not None:
            self.ticket.release()
        if self.inner is not None:
            self.inner.connection_lost(exc)

    # ------------------------------------------------------------------ handshake and reading

    def _handshake(self) -> bool:
        """Advance the handshake; True once done (the layer above then exists)."""
        try:
            self.ssl.do_handshake()
        except ssl.SSLWantReadError:
            self._flush()
            return False
        except (ssl.SSLError, OSError) as exc:
            self._fail(describe_handshake_error(exc))
            return False
        self._cancel_timer()
        self._flush()  # the server Finished, TLS 1.3 session tickets
        username = client_username(self.ssl) if self.cert_username else None
        cipher = self.ssl.cipher()  # None only before the handshake
        log.debug("TLS connection listener=%s peer=%s version=%s cipher=%s user=%s",
                  self.listener, self.peer, self.ssl.version(), cipher and cipher[0],
                  username or "-")
        self.inner = self.make_inner(username)
        self.inner.connection_made(self)
        return True

    def _drain(self) -> None:
        """Hand decrypted data up while the layer above reads."""
        while not self._paused and not self._closing:
            try:
                data = self.ssl.read(READ_SIZE)
            except (ssl.SSLWantReadError, ssl.SSLEOFError):
                break  # EOF without close_notify is common; eof_received() handles it
            except ssl.SSLZeroReturnError:  # close_notify: the peer is done
                self.inner.eof_received()
                self.close()
                break
            except (ssl.SSLError, OSError) as exc:
                log.info("TLS error listener=%s peer=%s error=%s", self.listener, self.peer,
                         describe_handshake_error(exc))
                self._closing = True
                if self.below is not None:  # (it is: data came through it)
                    self.below.abort()
                break
            if not data:
                break
            self.inner.data_received(data)
        self._flush()  # e.g. a TLS 1.3 KeyUpdate answer

    def _fail(self, why: str) -> None:
        log.info("TLS handshake failed listener=%s peer=%s error=%s", self.listener, self.peer,
                 why)
        self._flush()  # the alert tells the client why
        self._closing = True
        self._cancel_timer()
        if self.below is not None:
            self.below.close()

    def _too_slow(self) -> None:
        self._timer = None
        if self.inner is None and not self._closing:
            self._fail(f"timeout: no complete handshake in {self.deadline:g} s")

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _flush(self) -> None:
        data = self.outgoing.read()
        if data and self.below is not None and not self.below.is_closing():
            self.below.write(data)

    # ------------------------------------------------------------------ the transport above

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            return
        try:
            self.ssl.write(data)
        except ssl.SSLError as exc:
            log.info("TLS write failed listener=%s peer=%s error=%s", self.listener, self.peer,
                     describe_handshake_error(exc))
            self.abort()
            return
        self._flush()

    def writelines(self, list_of_data: Any) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        """Send close_notify after what was written, then close the socket gracefully
        (``linger.py``: FIN after our last record, the peer's further records dropped)."""
        if self._closing:
            return
        self._closing = True
        try:
            self.ssl.unwrap()
        except ssl.SSLError:
            pass  # SSLWantReadError: we do not wait for the peer's close_notify
        self._flush()
        if self.below is not None:
            close_gracefully(self.below)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        if name == "ssl_object":
            return self.ssl
        if name == "peercert":
            return self.ssl.getpeercert()
        if name == "cipher":
            return self.ssl.cipher()
        return self.below.get_extra_info(name, default) if self.below is not None else default

    def pause_reading(self) -> None:
        self._paused = True
        if self.below is not None:
            self.below.pause_reading()

    def resume_reading(self) -> None:
        if not self._paused:
            return
        self._paused = False
        if self.below is not None:
            self.below.resume_reading()
        # data already decrypted waits in the SSLObject: hand it up after the caller is done
        asyncio.get_running_loop().call_soon(self._drain_if_open)

    def _drain_if_open(self) -> None:
        if self.inner is not None and not self._closing:
            self._drain()

    def is_reading(self) -> bool:
        return not self._paused

