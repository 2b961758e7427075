"""``meshmq pub`` and ``meshmq sub``: small command-line clients built on paho-mqtt.

Options follow mosquitto_pub/mosquitto_sub where they can: ``-h``/``-H``/``--host`` is the
host (so help is ``--help`` only), ``-p`` port, ``-q`` QoS, ``-V 311|5``, ``-u``/``-P``/``-i``,
and for TLS ``--cafile``/``--tls-use-os-certs``, ``--cert``/``--key``, ``--insecure``. mosquitto
has no WebSocket client; here ``--ws`` (and ``--ws-path``) speaks MQTT over WebSocket, over TLS
when a TLS option is given too. The default port is the broker's default for that listener.
Exit status: 0 done, 1 the broker refused or the connection failed (one line on stderr),
2 bad usage (the sub-command's usage and one line).

``pub`` reports a message the broker did not take (how: ``meshmq.clientlink``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from meshmq.broker.message import OFFSET_PROPERTY, PARTITION_PROPERTY, POSITIONS_PROPERTY
from meshmq.broker.replay import REPLAY_PROPERTY, ReplayError, parse_replay
from meshmq.clientlink import DEFAULT_WS_PATH, TIMEOUT, ClientError, ClientLink

EXPIRY_NEVER = 0xFFFFFFFF


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
    history = sub.add_argument_group("the commit log (5.0; docs/replay.md)")
    history.add_argument("--from", dest="replay", metavar="WHERE", type=_replay_value,
                         help="deliver the stored history first: 'earliest', a time "
                              "(2026-11-23T10:00:00Z, or Unix milliseconds) or offsets "
                              "(3=1200,5=17: partition 3 from offset 1200...)")
    history.add_argument("--positions", action="store_true",
                         help="print where each message is in the log, 'PARTITION:OFFSET ' "
                              "before it ('-:-' for one that is not stored)")
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


def _replay_value(text: str) -> str:
    """``--from``: the ``meshmq-replay`` value it asks for (checked as the broker would)."""
    value = text.strip()
    if value.lower() in ("earliest", "latest"):
        replay = value.lower()
    elif "=" in value:
        replay = f"offsets:{value}"
    else:
        replay = f"timestamp:{value}"
    try:
        parse_replay(replay)
    except ReplayError as error:
        raise argparse.ArgumentTypeError(
            f"expected earliest, a time or PARTITION=OFFSET,...: {error}") from None
    return replay


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
        link = ClientLink(args)
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
        link.check_size(args.topic, payload, args.qos, args.retain)
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


def _wait_published(link: ClientLink, info: mqtt.MQTTMessageInfo, deadline: float) -> None:
    try:
        while not info.is_published():
            if link.closed.is_set():
                raise link.refused()
            if time.monotonic() > deadline:
                raise ClientError(f"publish not acknowledged within {TIMEOUT:g} s")
            info.wait_for_publish(0.05)
    except (ValueError, RuntimeError) as exc:  # paho: the connection is gone
        if link.closed.wait(TIMEOUT):  # the broker closed it: say why, as above
            raise link.refused() from None
        raise ClientError(f"publish failed: {exc}") from None


def _sub(args: argparse.Namespace) -> int:
    _check_common(args)
    if args.persistent and not args.client_id:
        args.parser.error("-c/--persistent needs a client id (-i)")
    if args.session_expiry is not None and args.mqtt_version != "5":
        args.parser.error("-x/--session-expiry needs -V 5")
    for flag, given in (("--from", args.replay), ("--positions", args.positions)):
        if given and args.mqtt_version != "5":
            args.parser.error(f"{flag} needs -V 5")

    # Messages are acknowledged only once printed, and with -C the DISCONNECT is queued right
    # after the last wanted message's acknowledgement (from the callback, so before anything
    # read later is acknowledged): a persistent session keeps the messages after COUNT. paho
    # sends PUBREC as soon as a QoS 2 PUBLISH arrives, so for -C with QoS 2 on 5.0 we also ask
    # the broker for one message in flight at a time (Receive Maximum 1).
    try:
        link = ClientLink(args, clean=not args.persistent, manual_ack=True)
    except ClientError as error:
        return _fail("sub", error)
    finished = threading.Event()
    received = 0

    def on_message(client: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        nonlocal received
        if finished.is_set():
            return
        text = msg.payload.decode("utf-8", errors="replace")
        line = f"{msg.topic} {text}" if args.verbose else text
        if args.positions:
            line = f"{_position(msg)} {line}"
        try:
            print(line, flush=True)
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
                     receive_maximum=1 if args.count and args.qos == 2 else None,
                     user=[(POSITIONS_PROPERTY, "true")] if args.positions else None)
        options = None
        if args.replay is not None:
            options = Properties(PacketTypes.SUBSCRIBE)
            options.UserProperty = [(REPLAY_PROPERTY, args.replay)]
        try:  # queued before the network thread starts: SUBSCRIBE goes right after CONNECT
            link.client.subscribe([(topic, args.qos) for topic in args.topic],
                                  properties=options)
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


def _position(msg: mqtt.MQTTMessage) -> str:
    """'PARTITION:OFFSET' from a message's log position user properties ('-:-': none)."""
    pairs = dict(getattr(msg.properties, "UserProperty", None) or [])
    return f"{pairs.get(PARTITION_PROPERTY, '-')}:{pairs.get(OFFSET_PROPERTY, '-')}"


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's exit flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
