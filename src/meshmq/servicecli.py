"""``meshmq call`` and ``meshmq worker``: services from the shell (docs/services.md).

``meshmq call SERVICE -m TEXT`` calls a service and prints the reply's payload; exit status 1
with one line on stderr (``meshmq call: no-responders``) when the call fails. ``meshmq worker
SERVICE --exec COMMAND`` serves a service: each request runs COMMAND with the request's payload
on its standard input, and its standard output is the reply (a non-zero exit status replies
with the user property ``error``); without a command it echoes the payload. Both use
meshmq.client: a list of brokers (``-b host:port,host:port``), reconnects and resends.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import ssl
import sys
from typing import Any

from meshmq.client import Client, ConnectFailed, Request, ServiceError, ServiceWorker


def add_service_commands(commands: Any) -> None:
    call = commands.add_parser("call", help="call a service and print its reply",
                               add_help=False, description=(
                                   "Call a service through the broker (request/reply on "
                                   "$service/NAME) and print the reply's payload."))
    _common(call)
    call.add_argument("service", help="the service's name")
    body = call.add_mutually_exclusive_group(required=True)
    body.add_argument("-m", "--message", help="request payload text (sent as UTF-8)")
    body.add_argument("-f", "--file", metavar="FILE", help="request payload read from FILE")
    body.add_argument("-n", "--null-message", action="store_true", help="empty payload")
    call.add_argument("-t", "--timeout", type=float, default=30.0, metavar="SECONDS",
                      help="give up after SECONDS without a reply (default 30)")
    call.add_argument("-v", "--verbose", action="store_true",
                      help="print the request id before the payload")
    call.set_defaults(run=_call, parser=call)

    worker = commands.add_parser("worker", help="serve a service from a command",
                                 add_help=False, description=(
                                     "Offer a service through the broker: each request runs "
                                     "--exec COMMAND (payload on stdin, reply from stdout); "
                                     "without one, echo the payload."))
    _common(worker)
    worker.add_argument("service", help="the service's name")
    worker.add_argument("-e", "--exec", dest="command", metavar="COMMAND",
                        help="the command run per request, split like a shell does (default: "
                             "echo the payload)")
    worker.add_argument("--credit", type=int, default=1, metavar="N",
                        help="requests run at once (default 1)")
    worker.add_argument("-C", "--count", type=int, default=0, metavar="COUNT",
                        help="exit after serving COUNT requests")
    worker.set_defaults(run=_worker, parser=worker)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--help", action="help", help="show this help and exit")
    parser.add_argument("-H", "-h", "--host", default="127.0.0.1",
                        help="broker host (default 127.0.0.1)")
    parser.add_argument("-p", "--port", type=int, default=1883, help="broker port (default 1883)")
    parser.add_argument("-b", "--brokers", metavar="HOST:PORT,...",
                        help="brokers to try in turn (instead of -H/-p)")
    parser.add_argument("-u", "--username")
    parser.add_argument("-P", "--password")
    parser.add_argument("-i", "--client-id", default=None,
                        help="client identifier (default: a random one)")
    parser.add_argument("--cafile", metavar="FILE",
                        help="TLS: PEM CA certificates to verify the broker's certificate with")


def _client(args: argparse.Namespace, clean: bool) -> Client:
    if args.password is not None and args.username is None:
        args.parser.error("-P/--password needs -u/--username")
    context = None
    if args.cafile is not None:
        try:
            context = ssl.create_default_context(cafile=args.cafile)
        except OSError as error:
            raise ConnectFailed(f"cannot load --cafile {args.cafile}: {error}") from None
    brokers = args.brokers or f"{args.host}:{args.port}"
    try:
        return Client(brokers, args.client_id, clean_start=clean,
                      session_expiry=0 if clean else 3600, username=args.username,
                      password=args.password, ssl=context)
    except ValueError as error:
        args.parser.error(str(error))
        raise  # (error exits)


def _call(args: argparse.Namespace) -> int:
    if args.file is not None:
        try:
            with open(args.file, "rb") as handle:
                payload = handle.read()
        except OSError as error:
            return _fail("call", f"cannot read {args.file}: {error.strerror or error}")
    else:
        payload = b"" if args.null_message else args.message.encode()

    async def main() -> int:
        client = _client(args, clean=True)
        try:
            await client.start()
            reply = await client.call(args.service, payload, timeout=args.timeout)
        except (ConnectFailed, ServiceError) as error:
            return _fail("call", str(error))
        finally:
            await client.close()
        if args.verbose:
            sys.stdout.write(f"{reply.request_id} ")
        sys.stdout.buffer.write(reply.payload + b"\n")
        sys.stdout.flush()
        return 0

    return asyncio.run(main())


def _worker(args: argparse.Namespace) -> int:
    try:
        command = shlex.split(args.command) if args.command else []
    except ValueError as error:
        args.parser.error(f"--exec: {error}")
    if args.credit < 1:
        args.parser.error("--credit must be at least 1")

    async def run(request: Request) -> bytes:
        if not command:
            return request.payload
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
        output, _ = await process.communicate(request.payload)
        if process.returncode:
            raise RuntimeError(f"{command[0]} exited with status {process.returncode}")
        return output

    async def main() -> int:
        client = _client(args, clean=False)
        done = asyncio.Event()
        served = 0

        async def handler(request: Request) -> bytes:
            nonlocal served
            try:
                return await run(request)
            finally:
                served += 1
                if args.count and served >= args.count:
                    done.set()

        try:
            await client.start()
        except ConnectFailed as error:
            return _fail("worker", str(error))
        worker = ServiceWorker(client, args.service, handler, args.credit)
        task = asyncio.create_task(worker.run())
        waiter = asyncio.create_task(done.wait())
        try:
            finished, _ = await asyncio.wait({task, waiter},
                                             return_when=asyncio.FIRST_COMPLETED)
            if task in finished and task.exception() is not None:
                return _fail("worker", str(task.exception()))
            await client.flush()  # the last replies acknowledged: their requests complete
            return 0
        finally:
            task.cancel()
            waiter.cancel()
            await client.close()

    try:
        return asyncio.run(main())
    except KeyboardInterrupt:
        return 0


def _fail(command: str, why: str) -> int:
    print(f"meshmq {command}: {why}", file=sys.stderr)
    return 1
