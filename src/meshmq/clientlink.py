"""The connection of ``meshmq pub`` and ``meshmq sub``: a paho client over TCP, TLS, WebSocket
or WebSocket over TLS, with its network thread and the events a command waits on.

A publish the broker does not take is reported, never passed over. With 5.0 the CONNACK gives
the broker's Maximum Packet Size, and a bigger PUBLISH is not sent at all (``check_size``);
otherwise the broker closes the connection (5.0: after a DISCONNECT saying why), which QoS 1/2
notice while waiting for the acknowledgement. QoS 0 has none, so ``confirm`` follows the
publishes with an UNSUBSCRIBE (of nothing: the session is new) and waits for the UNSUBACK,
which the broker sends only once it has handled what came before.
"""

from __future__ import annotations

import argparse
import ssl
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from meshmq.mqtt.codec import encode_packet
from meshmq.mqtt.errors import LocalProtocolError
from meshmq.mqtt.packets import MQTT_5, Publish

TIMEOUT = 10.0  # seconds to wait for CONNACK, SUBACK, a publish acknowledgement, DISCONNECT
# (TLS, WebSocket) -> default port: the broker's default for that listener (docs/configuration.md)
DEFAULT_PORTS = {(False, False): 1883, (True, False): 8883, (False, True): 8083,
                 (True, True): 8084}
DEFAULT_WS_PATH = "/mqtt"


class ClientError(Exception):
    """A one-line reason why a command-line client failed."""


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The SSLContext the TLS options ask for (None: no TLS), or raise ClientError."""
    if args.cafile is None and not args.tls_use_os_certs:
        return None
    try:
        context = ssl.create_default_context(cafile=args.cafile)
        if args.tls_use_os_certs and args.cafile is not None:
            context.load_default_certs()
    except OSError as exc:  # ssl.SSLError included
        raise ClientError(f"cannot load --cafile {args.cafile}: {_reason(exc)}") from None
    if args.cert is not None:
        try:
            context.load_cert_chain(args.cert, args.key)
        except OSError as exc:
            raise ClientError(f"cannot load --cert {args.cert}: {_reason(exc)}") from None
    context.check_hostname = not args.insecure  # paho then skips its own host name check
    return context


def _reason(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc) or type(exc).__name__


class ClientLink:
    """A paho client with its network thread and the events a command waits on."""

    def __init__(self, args: argparse.Namespace, clean: bool = True, manual_ack: bool = False):
        """Set up the client the options describe, or raise ClientError (certificates)."""
        self.args = args
        self.v5 = args.mqtt_version == "5"
        context = tls_context(args)
        self.port = args.port or DEFAULT_PORTS[context is not None, args.ws]
        self.where = self._url(context is not None)
        extra: dict[str, Any] = {} if self.v5 else {"clean_session": clean}
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=args.client_id,
            protocol=mqtt.MQTTv5 if self.v5 else mqtt.MQTTv311,
            transport="websockets" if args.ws else "tcp",
            reconnect_on_failure=False, manual_ack=manual_ack, **extra,
        )
        if args.ws:
            self.client.ws_set_options(path=args.ws_path or DEFAULT_WS_PATH)
        if context is not None:
            self.client.tls_set_context(context)
        if args.username is not None:
            self.client.username_pw_set(args.username, args.password)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.connack = threading.Event()
        self.closed = threading.Event()
        self.refusal: Any = None
        self.accepted = False  # a CONNACK took the connection
        self.close_reason: Any = None
        self.closed_by_broker = False  # a 5.0 DISCONNECT from the broker said why
        self.max_packet_size: int | None = None  # the broker's, from a 5.0 CONNACK
        self._opened = False
        self._started = False
        self._disconnecting = False

    def _url(self, tls: bool) -> str:
        """Where we connect, for messages: host:port, or a URL when not plain MQTT/TCP."""
        args = self.args
        if args.ws:
            return f"{'wss' if tls else 'ws'}://{args.host}:{self.port}" \
                   f"{args.ws_path or DEFAULT_WS_PATH}"
        return f"mqtts://{args.host}:{self.port}" if tls else f"{args.host}:{self.port}"

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            self.refusal = reason
        else:
            self.accepted = True
        self.max_packet_size = getattr(props, "MaximumPacketSize", None)
        self.connack.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any,
                       props: Any) -> None:
        self.close_reason = reason
        self.closed_by_broker = flags.is_disconnect_packet_from_server
        self.closed.set()
        self.connack.set()

    def connect(self, clean: bool = True, expiry: int | None = None,
                receive_maximum: int | None = None,
                user: list[tuple[str, str]] | None = None) -> None:
        """Open the connection (TLS and WebSocket handshakes included) and send CONNECT (5.0:
        with these user properties), or raise ClientError.

        Packets queued between this and ``start()`` follow CONNECT in that order.
        """
        try:
            if self.v5:
                props = None
                if expiry or receive_maximum or user:
                    props = Properties(PacketTypes.CONNECT)
                    if expiry:
                        props.SessionExpiryInterval = expiry
                    if receive_maximum:
                        props.ReceiveMaximum = receive_maximum
                    if user:
                        props.UserProperty = user
                self.client.connect(self.args.host, self.port, clean_start=clean,
                                    properties=props)
            else:
                self.client.connect(self.args.host, self.port)
            self._opened = True
        except (OSError, ValueError) as exc:  # ssl.SSLError and WebSocket errors included
            raise ClientError(f"cannot connect to {self.where}: {_reason(exc)}") from None

    def start(self) -> None:
        """Start the network thread and wait for a successful CONNACK, or raise ClientError."""
        self.client.loop_start()
        self._started = True
        if not self.connack.wait(TIMEOUT):
            raise ClientError(f"no CONNACK from {self.where} within {TIMEOUT:g} s")
        if self.refusal is not None:
            raise ClientError(f"connection refused: {self.refusal}")
        # Closed after a CONNACK that took it is no failure of start(): what followed the
        # CONNACK may have ended it already (meshmq sub -C N with N replayed messages).
        if self.closed.is_set() and not self.accepted:
            raise ClientError(f"connection to {self.where} closed before CONNACK")

    def check_size(self, topic: str, payload: bytes, qos: int, retain: bool) -> None:
        """Raise ClientError if this PUBLISH is over the broker's Maximum Packet Size (from a
        5.0 CONNACK; MQTT-3.2.2-15: the client must not send it). paho does not check."""
        limit = self.max_packet_size
        if limit is None:
            return
        packet = Publish(topic, payload, qos, retain,
                         packet_id=1 if qos else None)  # no properties: paho sends none
        try:
            size = len(encode_packet(packet, MQTT_5))
        except LocalProtocolError:  # over MQTT's own limit of 256 MB
            size = limit + 1
        if size > limit:
            raise ClientError(f"message refused: the PUBLISH would be {size} bytes, over the "
                              f"broker's maximum packet size of {limit} bytes (from its CONNACK)")

    def lost(self) -> ClientError:
        if self.closed_by_broker:
            return ClientError(f"the broker closed the connection: {self._broker_reason()}")
        return ClientError("connection lost")  # paho's own reason code says nothing more

    def refused(self) -> ClientError:
        """The connection closed while a publish waited: the broker did not take it."""
        if self.closed_by_broker:
            return ClientError(f"the broker refused the message and closed the connection: "
                               f"{self._broker_reason()}")
        why = "" if self.v5 else (" (MQTT 3.1.1 gives no reason: a message over the broker's"
                                  " maximum packet size is one)")
        return ClientError(f"the broker closed the connection instead of taking the message{why}")

    def _broker_reason(self) -> str:
        """The reason code of the broker's DISCONNECT: 'Packet too large (0x95)'."""
        return f"{self.close_reason} (0x{self.close_reason.value:02X})"

    def confirm(self, topic: str, deadline: float) -> None:
        """Wait until the broker has handled every packet sent so far (see the module's
        docstring), or raise ClientError: the connection closed meanwhile."""
        answered = threading.Event()
        self.client.on_unsubscribe = lambda *_: answered.set()
        self.client.unsubscribe(topic)  # MQTT-3.10.4-4: answered with an UNSUBACK
        while not answered.wait(0.05):
            if self.closed.is_set():
                raise self.refused()
            if time.monotonic() > deadline:
                raise ClientError(f"no answer from the broker within {TIMEOUT:g} s")

    def disconnect(self) -> None:
        """Queue a DISCONNECT (once); safe to call from a paho callback."""
        if not self._disconnecting:
            self._disconnecting = True
            self.client.disconnect()

    def close(self) -> None:
        """Disconnect (waiting briefly for the DISCONNECT to go out) and stop the thread."""
        if self._started:
            if not self.closed.is_set():
                self.disconnect()
                self.closed.wait(TIMEOUT)
            self.client.loop_stop()
        elif self._opened:
            self.client.disconnect()  # no network thread: written at once
