"""``meshmq pub`` and ``meshmq sub``: small command-line clients built on paho-mqtt.

Options follow mosquitto_pub/mosquitto_sub where they can: ``-h``/``-H``/``--host`` is the
host (so help is ``--help`` only), ``-p`` port, ``-q`` QoS, ``-V 311|5``, ``-u``/``-P``/``-i``.
Exit status: 0 done, 1 the broker refused or the connection failed (one line on stderr),
2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

TIMEOUT = 10.0  # seconds to wait for CONNACK, SUBACK, a publish acknowledgement, DISCONNECT
EXPIRY_NEVER = 0xFFFFFFFF


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
    parser.add_argument("-p", "--port", type=_count(1, 65535), default=1883,
                        help="broker port (default 1883)")
    parser.add_argument("-q", "--qos", type=int, choices=(0, 1, 2), default=0,
                        help="QoS (default 0)")
    parser.add_argument("-V", "--mqtt-version", choices=("311", "5"), default="5",
                        help="protocol version (default 5)")
    parser.add_argument("-u", "--username")
    parser.add_argument("-P", "--password")
    parser.add_argument("-i", "--client-id", default="",
                        help="client identifier (default: empty, the broker assigns one on 5.0)")


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


class _Link:
    """A paho client with its network thread and the events a command waits on."""

    def __init__(self, args: argparse.Namespace, clean: bool = True, manual_ack: bool = False):
        self.args = args
        self.v5 = args.mqtt_version == "5"
        extra: dict[str, Any] = {} if self.v5 else {"clean_session": clean}
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2, client_id=args.client_id,
            protocol=mqtt.MQTTv5 if self.v5 else mqtt.MQTTv311,
            reconnect_on_failure=False, manual_ack=manual_ack, **extra,
        )
        if args.username is not None:
            self.client.username_pw_set(args.username, args.password)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = self._on_disconnect
        self.connack = threading.Event()
        self.closed = threading.Event()
        self.refusal: Any = None
        self.close_reason: Any = None
        self._opened = False
        self._started = False
        self._disconnecting = False

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        if reason.is_failure:
            self.refusal = reason
        self.connack.set()

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any,
                       props: Any) -> None:
        self.close_reason = reason
        self.closed.set()
        self.connack.set()

    def connect(self, clean: bool = True, expiry: int | None = None,
                receive_maximum: int | None = None) -> None:
        """Open the TCP connection and send CONNECT, or raise ClientError.

        Packets queued between this and ``start()`` follow CONNECT in that order.
        """
        where = f"{self.args.host}:{self.args.port}"
        try:
            if self.v5:
                props = None
                if expiry or receive_maximum:
                    props = Properties(PacketTypes.CONNECT)
                    if expiry:
                        props.SessionExpiryInterval = expiry
                    if receive_maximum:
                        props.ReceiveMaximum = receive_maximum
                self.client.connect(self.args.host, self.args.port, clean_start=clean,
                                    properties=props)
            else:
                self.client.connect(self.args.host, self.args.port)
            self._opened = True
        except (OSError, ValueError) as exc:
            reason = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            raise ClientError(f"cannot connect to {where}: {reason}") from None

    def start(self) -> None:
        """Start the network thread and wait for a successful CONNACK, or raise ClientError."""
        where = f"{self.args.host}:{self.args.port}"
        self.client.loop_start()
        self._started = True
        if not self.connack.wait(TIMEOUT):
            raise ClientError(f"no CONNACK from {where} within {TIMEOUT:g} s")
        if self.refusal is not None:
            raise ClientError(f"connection refused: {self.refusal}")
        if self.closed.is_set():
            raise ClientError(f"connection to {where} closed before CONNACK")

    def lost(self) -> ClientError:
        return ClientError(f"connection lost: {self.close_reason}")

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
    if args.password is not None and args.username is None:
        args.parser.error("-P/--password needs -u/--username")
    if args.file is not None:
        try:
            with open(args.file, "rb") as handle:
                payload = handle.read()
        except OSError as exc:
            return _fail("pub", ClientError(f"cannot read {args.file}: {exc.strerror or exc}"))
    else:
        payload = b"" if args.null_message else args.message.encode()

    link = _Link(args)
    refused: dict[int, Any] = {}

    def on_publish(client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        if reason.is_failure:
            refused[mid] = reason

    link.client.on_publish = on_publish
    try:
        link.connect()
        link.start()
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
    except ClientError as error:
        return _fail("pub", error)
    finally:
        link.close()
    return 0


def _wait_published(link: _Link, info: mqtt.MQTTMessageInfo, deadline: float) -> None:
    try:
        while not info.is_published():
            if link.closed.is_set():
                raise link.lost()
            if time.monotonic() > deadline:
                raise ClientError(f"publish not acknowledged within {TIMEOUT:g} s")
            info.wait_for_publish(0.05)
    except (ValueError, RuntimeError) as exc:
        raise ClientError(f"publish failed: {exc}") from None


def _sub(args: argparse.Namespace) -> int:
    if args.password is not None and args.username is None:
        args.parser.error("-P/--password needs -u/--username")
    if args.persistent and not args.client_id:
        args.parser.error("-c/--persistent needs a client id (-i)")
    if args.session_expiry is not None and args.mqtt_version != "5":
        args.parser.error("-x/--session-expiry needs -V 5")

    # Messages are acknowledged only once printed, and with -C the DISCONNECT is queued right
    # after the last wanted message's acknowledgement (from the callback, so before anything
    # read later is acknowledged): a persistent session keeps the messages after COUNT. paho
    # sends PUBREC as soon as a QoS 2 PUBLISH arrives, so for -C with QoS 2 on 5.0 we also ask
    # the broker for one message in flight at a time (Receive Maximum 1).
    link = _Link(args, clean=not args.persistent, manual_ack=True)
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
