"""``meshmq pub`` and ``meshmq sub``: small command-line clients built on paho-mqtt."""

from __future__ import annotations

import argparse
import sys
import threading
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

TIMEOUT = 10.0


def add_client_commands(commands: Any) -> None:
    pub = commands.add_parser("pub", help="publish one message", add_help=True)
    _common(pub)
    body = pub.add_mutually_exclusive_group(required=True)
    body.add_argument("-m", "--message", help="payload text")
    body.add_argument("-f", "--file", help="payload from a file")
    body.add_argument("-n", "--null-message", action="store_true", help="empty payload")
    pub.add_argument("-t", "--topic", required=True)
    pub.add_argument("-r", "--retain", action="store_true")
    pub.add_argument("--repeat", type=int, default=1, metavar="N")
    pub.set_defaults(run=_pub)

    sub = commands.add_parser("sub", help="subscribe and print messages")
    _common(sub)
    sub.add_argument("-t", "--topic", action="append", required=True)
    sub.add_argument("-C", "--count", type=int, default=0, help="exit after COUNT messages")
    sub.add_argument("-v", "--verbose", action="store_true", help="print 'topic payload'")
    sub.add_argument("-c", "--persistent", action="store_true", help="keep the session")
    sub.add_argument("-x", "--session-expiry", type=int, default=None, metavar="SECONDS")
    sub.set_defaults(run=_sub)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=1883)
    parser.add_argument("-q", "--qos", type=int, choices=(0, 1, 2), default=0)
    parser.add_argument("-V", "--mqtt-version", choices=("311", "5"), default="5")
    parser.add_argument("-u", "--username")
    parser.add_argument("-P", "--password")
    parser.add_argument("-i", "--client-id", default="")


def _client(args: argparse.Namespace, clean: bool = True) -> tuple[mqtt.Client, bool]:
    v5 = args.mqtt_version == "5"
    kwargs: dict[str, Any] = {} if v5 else {"clean_session": clean}
    client = mqtt.Client(
        CallbackAPIVersion.VERSION2, client_id=args.client_id,
        protocol=mqtt.MQTTv5 if v5 else mqtt.MQTTv311, **kwargs,
    )
    if args.username is not None:
        client.username_pw_set(args.username, args.password)
    return client, v5


def _connect(client: mqtt.Client, args: argparse.Namespace, v5: bool,
             clean: bool = True, expiry: int | None = None) -> str | None:
    """Connect and wait for CONNACK; return an error line or None."""
    done = threading.Event()
    result: list[Any] = []

    def on_connect(c: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        result.append(reason)
        done.set()

    client.on_connect = on_connect
    try:
        if v5:
            props = None
            if expiry is not None:
                props = Properties(PacketTypes.CONNECT)
                props.SessionExpiryInterval = expiry
            client.connect(args.host, args.port, clean_start=clean, properties=props)
        else:
            client.connect(args.host, args.port)
    except OSError as exc:
        return f"cannot connect to {args.host}:{args.port}: {exc.strerror or exc}"
    client.loop_start()
    if not done.wait(TIMEOUT):
        return "no CONNACK from the broker"
    if result[0].is_failure:
        return f"connection refused: {result[0]}"
    return None


def _pub(args: argparse.Namespace) -> int:
    client, v5 = _client(args)
    error = _connect(client, args, v5)
    if error is None:
        if args.file:
            with open(args.file, "rb") as handle:
                payload: bytes = handle.read()
        else:
            payload = b"" if args.null_message else args.message.encode()
        for _ in range(args.repeat):
            info = client.publish(args.topic, payload, qos=args.qos, retain=args.retain)
            info.wait_for_publish(TIMEOUT)
            if not info.is_published():
                error = "publish was not acknowledged"
                break
    client.disconnect()
    client.loop_stop()
    if error:
        print(f"meshmq pub: {error}", file=sys.stderr)
        return 1
    return 0


def _sub(args: argparse.Namespace) -> int:
    client, v5 = _client(args, clean=not args.persistent)
    received = 0
    finished = threading.Event()

    def on_message(c: Any, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        nonlocal received
        text = msg.payload.decode("utf-8", errors="replace")
        print(f"{msg.topic} {text}" if args.verbose else text, flush=True)
        received += 1
        if args.count and received >= args.count:
            finished.set()

    client.on_message = on_message
    expiry = args.session_expiry if args.session_expiry is not None else (
        0xFFFFFFFF if args.persistent else None)
    error = _connect(client, args, v5, clean=not args.persistent, expiry=expiry)
    if error:
        print(f"meshmq sub: {error}", file=sys.stderr)
        client.loop_stop()
        return 1
    for topic in args.topic:
        client.subscribe(topic, qos=args.qos)
    try:
        finished.wait()
    except KeyboardInterrupt:
        pass
    client.disconnect()
    client.loop_stop()
    return 0
