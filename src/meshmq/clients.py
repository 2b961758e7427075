"""``meshmq pub`` and ``meshmq sub``: small command-line clients built on paho-mqtt.

Options follow mosquitto_pub/mosquitto_sub where they can: ``-h``/``-H``/``--host`` is the
host (so help is ``--help`` only), ``-p`` port, ``-q`` QoS, ``-V 311|5``, ``-u``/``-P``/``-i``,
and for TLS ``--cafile``/``--tls-use-os-certs``, ``--cert``/``--key``, ``--insecure``. mosquitto
has no WebSocket client; here ``--ws`` (and ``--ws-path``) speaks MQTT over WebSocket, over TLS
when a TLS option is given too. The default port is the broker's default for that listener.
Exit status: 0 done, 1 the broker refused or the connection failed (one line on stderr),
2 bad usage.

``pub`` reports a message the broker did not take. With 5.0 the CONNACK gives the broker's
Maximum Packet Size, and a bigger PUBLISH is not sent at all (MQTT-3.2.2-15); otherwise the
broker closes the connection, which QoS 1/2 notice while waiting for the acknowledgement. QoS 0
has none, so ``pub`` follows its publishes with an UNSUBSCRIBE (of nothing: its session is
new) and waits for the UNSUBACK, which the broker sends only once it has handled what came
before.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
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
EXPIRY_NEVER = 0xFFFFFFFF
# (TLS, WebSocket) -> default port: the broker's default for that listener (docs/configuration.md)
DEFAULT_PORTS = {(False, False): 1883, (True, False): 8883, (False, True): 8083,
                 (True, True): 8084}
DEFAULT_WS_PATH = "/mqtt"


class ClientError(Exception):
    """A one-line reason why a command-line client failed."""


def add_client_commands(commands: Any) -> None:
    """Add the ``pub`` and ``sub`` subcommands to an argparse subparsers object."""
    pub = commands.add_parser("pub", help="publish a message", add_help=False,
                              description="Publish a message and wait until it is acknowledged.")
    _common(pub)
    pub.add_argument("-t", "--topic", required=True, help="topic to publish to")
    body = pub.add_mutually_exclusive_group(required=True)
    body.add_argument("-m", "--message", help="payload text (sent as UTF-8)")
    body.add_argument("-f", "--file", metavar="FILE", help="payload read from FILE")
    body.add_argument("-n", "--null-message", action="store_true", help="empty payload")
    pub.add_argument("-r", "--retain", action="store_true", help="set the retain flag")
    pub.add_argument("--repeat", type=_count(1), default=1, metavar="N",
                     help="publish the message N times (default 1)")
    pub.set_defaults(run=_pub, parser=pub)

    sub = commands.add_parser("sub", help="subscribe and print messages", add_help=False,
                              description="Subscribe and print each payload on its own line.")
    _common(sub)
    sub.add_argument("-t", "--topic", action="append", required=True,
                     help="topic filter (repeat for several)")
    sub.add_argument("-C", "--count", type=_count(1), default=0, metavar="COUNT",
                     help="exit after COUNT messages")
    sub.add_argument("-v", "--verbose", action="store_true", help="print 'topic payload'")
    sub.add_argument("-c", "--persistent", action="store_true",
                     help="persistent session (clean start/clean session off); needs -i")
    sub.add_argument("-x", "--session-expiry", type=_count(0, EXPIRY_NEVER), metavar="SECONDS",
                     help=f"session expiry interval, 5.0 only (default {EXPIRY_NEVER} with -c, "
                          "else 0)")
    sub.set_defaults(run=_sub, parser=sub)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--help", action="help", help="show this help and exit")
    parser.add_argument("-H", "-h", "--host", default="127.0.0.1",
                        help="broker host (default 127.0.0.1)")
    parser.add_argument("-p", "--port", type=_count(1, 65535),
                        help="broker port (default 1883; TLS 8883, --ws 8083, both 8084)")
    parser.add_argument("-q", "--qos", type=int, choices=(0, 1, 2), default=0,
                        help="QoS (default 0)")
    parser.add_argument("-V", "--mqtt-version", choices=("311", "5"), default="5",
                        help="protocol version (default 5)")
    parser.add_argument("-u", "--username")
    parser.add_argument("-P", "--password")
    parser.add_argument("-i", "--client-id", default="",
                        help="client identifier (default: empty, the broker assigns one on 5.0)")
    tls = parser.add_argument_group("TLS (on with --cafile or --tls-use-os-certs)")
    tls.add_argument("--cafile", metavar="FILE",
                     help="PEM CA certificates to verify the broker's certificate with")
    tls.add_argument("--tls-use-os-certs", action="store_true",
                     help="verify the broker's certificate with the system's CA certificates")
    tls.add_argument("--cert", metavar="FILE", help="PEM client certificate (mutual TLS)")
    tls.add_argument("--key", metavar="FILE",
                     help="PEM private key of --cert (default: in the --cert file)")
    tls.add_argument("--insecure", action="store_true",
                     help="do not check that the broker's certificate names the host")
    ws = parser.add_argument_group("WebSocket")
    ws.add_argument("--ws", action="store_true",
                    help="MQTT over WebSocket (over TLS with a TLS option)")
    ws.add_argument("--ws-path", metavar="PATH",
                    help=f"HTTP path of the WebSocket endpoint (default {DEFAULT_WS_PATH})")


def _check_common(args: argparse.Namespace) -> None:
    """Exit with the command's usage (status 2) if the options shared by pub and sub clash."""
    fail = args.parser.error
    if args.password is not None and args.username is None:
        fail("-P/--password needs -u/--username")
    tls = args.cafile is not None or args.tls_use_os_certs
    for flag, given in (("--cert", args.cert), ("--key", args.key),
                        ("--insecure", args.insecure)):
        if given and not tls:
            fail(f"{flag} needs --cafile or --tls-use-os-certs")
    if args.key is not None and args.cert is None:
        fail("--key needs --cert")
    if args.ws_path is not None:
        if not args.ws:
            fail("--ws-path needs --ws")
        if not args.ws_path.startswith("/"):
            fail(f"--ws-path must start with '/', got {args.ws_path!r}")


def _count(low: int, high: int | None = None) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f"between {low} and {high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
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


class _Link:
    """A paho client with its network thread and the events a command waits on."""

    def __init__(self, args: argparse.Namespace, clean: bool = True, manual_ack: bool = False):
        """Set up the client the options describe, or raise ClientError (certificates)."""
        self.args = args
        self.v5 = args.mqtt_version == "5"
        context = _tls_context(args)
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
        self.max_packet_size = getattr(props, "MaximumPacketSize", None)
        self.connack.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any,
                       props: Any) -> None:
        self.close_reason = reason
        self.closed_by_broker = flags.is_disconnect_packet_from_server
        self.closed.set()
        self.connack.set()

    def connect(self, clean: bool = True, expiry: int | None = None,
                receive_maximum: int | None = None) -> None:
        """Open the connection (TLS and WebSocket handshakes included) and send CONNECT, or
        raise ClientError.

        Packets queued between this and ``start()`` follow CONNECT in that order.
        """
        try:
            if self.v5:
                props = None
                if expiry or receive_maximum:
                    props = Properties(PacketTypes.CONNECT)
                    if expiry:
                        props.SessionExpiryInterval = expiry
                    if receive_maximum:
                        props.ReceiveMaximum = receive_maximum
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
        if self.closed.is_set():
            raise ClientError(f"connection to {self.where} closed before CONNACK")

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


def _fail(command: str, error: ClientError) -> int:
    print(f"meshmq {command}: {error}", file=sys.stderr)
    return 1


def _pub(args: argparse.Namespace) -> int:
    _check_common(args)
    if args.file is not None:
        try:
            with open(args.file, "rb") as handle:
                payload = handle.read()
        except OSError as exc:
            return _fail("pub", ClientError(f"cannot read {args.file}: {exc.strerror or exc}"))
    else:
        payload = b"" if args.null_message else args.message.encode()

    try:
        link = _Link(args)
    except ClientError as error:
        return _fail("pub", error)
    refused: dict[int, Any] = {}

    def on_publish(client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        if reason.is_failure:
            refused[mid] = reason

    link.client.on_publish = on_publish
    try:
        link.connect()
        link.start()
        _check_size(link, args, payload)
        try:
            infos = [link.client.publish(args.topic, payload, qos=args.qos, retain=args.retain)
                     for _ in range(args.repeat)]
        except ValueError as exc:  # paho checks the topic name
            raise ClientError(f"cannot publish to {args.topic!r}: {exc}") from None
        deadline = time.monotonic() + TIMEOUT
        for info in infos:
            _wait_published(link, info, deadline)
            if info.mid in refused:
                raise ClientError(f"publish refused: {refused[info.mid]}")
        if args.qos == 0:
            link.confirm(args.topic, deadline)
    except ClientError as error:
        return _fail("pub", error)
    finally:
        link.close()
    return 0


def _check_size(link: _Link, args: argparse.Namespace, payload: bytes) -> None:
    """Raise ClientError, sending nothing, if the PUBLISH is over the broker's Maximum Packet
    Size (5.0 CONNACK; MQTT-3.2.2-15: the client must not send it). paho does not check."""
    limit = link.max_packet_size
    if limit is None:
        return
    packet = Publish(args.topic, payload, args.qos, args.retain,
                     packet_id=1 if args.qos else None)  # no properties: paho sends none
    try:
        size = len(encode_packet(packet, MQTT_5))
    except LocalProtocolError:  # over MQTT's own limit of 256 MB
        size = limit + 1
    if size > limit:
        raise ClientError(f"message refused: the PUBLISH would be {size} bytes, over the "
                          f"broker's maximum packet size of {limit} bytes (from its CONNACK)")


def _wait_published(link: _Link, info: mqtt.MQTTMessageInfo, deadline: float) -> None:
    try:
        while not info.is_published():
            if link.closed.is_set():
                raise link.refused()
            if time.monotonic() > deadline:
                raise ClientError(f"publish not acknowledged within {TIMEOUT:g} s")
            info.wait_for_publish(0.05)
    except (ValueError, RuntimeError) as exc:
        raise ClientError(f"publish failed: {exc}") from None


def _sub(args: argparse.Namespace) -> int:
    _check_common(args)
    if args.persistent and not args.client_id:
        args.parser.error("-c/--persistent needs a client id (-i)")
    if args.session_expiry is not None and args.mqtt_version != "5":
        args.parser.error("-x/--session-expiry needs -V 5")

    # Messages are acknowledged only once printed, and with -C the DISCONNECT is queued right
    # after the last wanted message's acknowledgement (from the callback, so before anything
    # read later is acknowledged): a persistent session keeps the messages after COUNT. paho
    # sends PUBREC as soon as a QoS 2 PUBLISH arrives, so for -C with QoS 2 on 5.0 we also ask
    # the broker for one message in flight at a time (Receive Maximum 1).
    try:
        link = _Link(args, clean=not args.persistent, manual_ack=True)
    except ClientError as error:
        return _fail("sub", error)
    finished = threading.Event()
    received = 0

    def on_message(client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        nonlocal received
        if finished.is_set():
            return
        text = msg.payload.decode("utf-8", errors="replace")
        try:
            print(f"{msg.topic} {text}" if args.verbose else text, flush=True)
        except OSError:  # the reader went away (e.g. `| head -1`)
            _silence_stdout()
            finished.set()
            return
        client.ack(msg.mid, msg.qos)
        received += 1
        if args.count and received >= args.count:
            link.disconnect()
            finished.set()

    subacked = threading.Event()
    granted: list[Any] = []

    def on_subscribe(client: Any, userdata: Any, mid: int, reasons: list[Any],
                     props: Any) -> None:
        granted.extend(reasons)
        subacked.set()

    link.client.on_message = on_message
    link.client.on_subscribe = on_subscribe
    expiry = args.session_expiry
    if expiry is None and args.persistent:
        expiry = EXPIRY_NEVER
    try:
        link.connect(clean=not args.persistent, expiry=expiry,
                     receive_maximum=1 if args.count and args.qos == 2 else None)
        try:  # queued before the network thread starts: SUBSCRIBE goes right after CONNECT
            link.client.subscribe([(topic, args.qos) for topic in args.topic])
        except ValueError as exc:  # paho checks the topic filters
            raise ClientError(f"cannot subscribe: {exc}") from None
        link.start()
        # A resumed session may deliver (and finish -C) before the SUBACK arrives.
        deadline = time.monotonic() + TIMEOUT
        while not (subacked.is_set() or finished.is_set()):
            if link.closed.is_set():
                raise link.lost()
            if time.monotonic() > deadline:
                raise ClientError(f"no SUBACK within {TIMEOUT:g} s")
            subacked.wait(0.05)
        for topic, reason in zip(args.topic, granted, strict=False):
            if reason.is_failure:
                raise ClientError(f"subscription to {topic!r} refused: {reason}")
        while not finished.wait(0.1):
            if link.closed.is_set() and not finished.is_set():
                raise link.lost()
    except ClientError as error:
        return _fail("sub", error)
    except KeyboardInterrupt:
        pass
    finally:
        link.close()
    return 0


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's exit flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
