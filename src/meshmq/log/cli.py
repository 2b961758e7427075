"""``meshmq log ls|dump|tail|verify|repair [--data-dir DIR]``: look into and repair a commit log.

``--data-dir`` defaults to ``./data``, as ``meshmq serve`` does.

``ls``, ``dump``, ``tail`` and ``verify`` only read, without the log's lock, so they work while
a broker runs on the directory. ``repair`` takes the lock, so it refuses while a broker runs.
``--json`` switches to machine output: one object per record (``dump``, ``tail``) or one
object per run (``ls``, ``verify``, ``repair``).

Exit status: 0 fine; 1 problems found (``verify``), damage met while reading (``dump``,
``tail``) or problems left after ``repair``; 2 bad usage, a directory that holds no log, or
(``repair``) a log in use. Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from itertools import islice
from typing import Any

from meshmq.config import ServerConfig
from meshmq.log.browse import Follower, Selection, dump_records, tail_partition
from meshmq.log.errors import LogDirectoryLocked, LogError
from meshmq.log.inspect import parse_timestamp, summarize_segment
from meshmq.log.reader import LogDirectory, LogDirectoryError
from meshmq.log.record import Record
from meshmq.log.render import (
    PAYLOAD_MODES,
    ls_json,
    ls_text,
    record_json,
    record_line,
    repair_json,
    repair_text,
    verify_json,
    verify_text,
)
from meshmq.log.repair import repair
from meshmq.log.verify import verify
from meshmq.mqtt.errors import MQTTError
from meshmq.mqtt.topics import parse_shared_filter, validate_topic_filter

PROG = "meshmq log"


class UsageError(Exception):
    """A bad option value: reported in one line, exit status 2."""


def add_log_command(commands: Any) -> None:
    """Register ``log`` and its actions on the ``meshmq`` subcommand parser."""
    log = commands.add_parser(
        "log", help="inspect, verify and repair the commit log",
        description="Inspect, verify and repair the commit log under a broker's data_dir.")
    actions = log.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    default = ServerConfig().data_dir
    common.add_argument("-d", "--data-dir", default=default, metavar="DIR",
                        help=f"the broker's data_dir, or its log directory (default {default}, "
                             "as for meshmq serve)")
    common.add_argument("--json", action="store_true", help="machine-readable JSON output")
    actions.add_parser("ls", parents=[common], help="partitions, segments, offsets, sizes")
    _add_record_options(actions.add_parser("dump", parents=[common],
                                           help="print records, with filters"), dump=True)
    _add_record_options(actions.add_parser("tail", parents=[common],
                                           help="print the last records; --follow for more"),
                        dump=False)
    actions.add_parser("verify", parents=[common],
                       help="check checksums, offsets and indexes (exit 1 on problems)")
    fix = actions.add_parser("repair", parents=[common],
                             help="fix what verify finds (the broker must be stopped)")
    fix.add_argument("--dry-run", action="store_true", help="print what would be done")
    fix.add_argument("--no-backup", action="store_true",
                     help="do not keep the damaged files in repair-backup-<time>/")
    log.set_defaults(run=run)


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, not {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, not {text}")
    return value


def _add_record_options(parser: argparse.ArgumentParser, *, dump: bool) -> None:
    parser.add_argument("-p", "--partition", type=_count, action="append", metavar="N",
                        help="only this partition (repeatable)")
    parser.add_argument("-t", "--topic", action="append", metavar="FILTER",
                        help="only topics matching this MQTT filter, + and # allowed "
                             "(repeatable)")
    parser.add_argument("--payload", choices=PAYLOAD_MODES, default="text",
                        help="payload as text (non-UTF-8 bytes escaped), hex, base64 or none; "
                             "JSON always has it in base64")
    if dump:
        parser.add_argument("--from-offset", type=_count, metavar="N",
                            help="start each partition at this offset")
        parser.add_argument("--from-timestamp", metavar="TIME",
                            help="start each partition at its first record at or after TIME "
                                 "(ISO 8601, UTC unless a zone is given, or ms since the epoch)")
        parser.add_argument("--limit", type=_count, metavar="N", help="print at most N records")
    else:
        parser.add_argument("-n", "--lines", type=_count, default=10, metavar="N",
                            help="records per partition (default 10)")
        parser.add_argument("-f", "--follow", action="store_true",
                            help="keep printing records as they are appended (until Ctrl-C "
                                 "or SIGTERM)")
        parser.add_argument("--interval", type=_seconds, default=0.2, metavar="SECONDS",
                            help="how often --follow polls the files (default 0.2)")


def run(args: argparse.Namespace) -> int:
    """Run one ``meshmq log`` action; returns the exit status."""
    try:
        log = LogDirectory.locate(args.data_dir)
        return _ACTIONS[args.action](args, log)
    except (UsageError, LogDirectoryError, LogDirectoryLocked) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader went away (``| head``): not an error
        _discard_stdout()
        return 0
    except KeyboardInterrupt:
        return 130
    except (LogError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


def _discard_stdout() -> None:
    """Drop what is still buffered for a closed pipe, so exiting does not complain."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


class _Warnings:
    """Prints reading problems on stderr and counts them (exit status 1)."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, message: str) -> None:
        self.count += 1
        print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


def _selection(args: argparse.Namespace, log: LogDirectory) -> Selection:
    partitions = tuple(dict.fromkeys(args.partition or range(log.partitions)))
    for partition in partitions:
        if partition >= log.partitions:
            raise UsageError(f"partition {partition} does not exist (the log has "
                             f"{log.partitions}: 0-{log.partitions - 1})")
    topics = tuple(args.topic or ())
    for topic_filter in topics:
        try:
            validate_topic_filter(topic_filter)
        except MQTTError as exc:
            raise UsageError(f"--topic: {exc}") from None
        if parse_shared_filter(topic_filter)[0] is not None:
            raise UsageError(f"--topic: use a plain filter, not {topic_filter!r}")
    from_timestamp = None
    if getattr(args, "from_timestamp", None) is not None:
        try:
            from_timestamp = parse_timestamp(args.from_timestamp)
        except ValueError as exc:
            raise UsageError(f"--from-timestamp: {exc}") from None
    return Selection(partitions, topics, getattr(args, "from_offset", None), from_timestamp)


def _renderer(args: argparse.Namespace) -> Callable[[int, Record], str]:
    render = record_json if args.json else record_line
    return lambda partition, record: render(partition, record, args.payload)


def _ls(args: argparse.Namespace, log: LogDirectory) -> int:
    partitions = {}
    for partition in range(log.partitions):
        summaries = [summarize_segment(s) for s in log.segments(partition)]
        partitions[partition] = [s for s in summaries if not s.vanished]
    live = log.is_locked()
    render = ls_json if args.json else ls_text
    print(render(str(log.path), live, partitions).rstrip("\n"))
    return 0


def _dump(args: argparse.Namespace, log: LogDirectory) -> int:
    selection = _selection(args, log)
    warn, render = _Warnings(), _renderer(args)
    records = dump_records(log, selection, live=log.is_locked(), warn=warn)
    for partition, record in islice(records, args.limit):
        print(render(partition, record))
    return 1 if warn.count else 0


def _tail(args: argparse.Namespace, log: LogDirectory) -> int:
    selection = _selection(args, log)
    warn, render = _Warnings(), _renderer(args)
    live = log.is_locked()
    cursors = []
    for partition in selection.partitions:
        records, cursor = tail_partition(log, partition, args.lines, selection, live=live,
                                         warn=warn)
        cursors.append(cursor)
        for record in records:
            print(render(partition, record))
    sys.stdout.flush()
    if args.follow:
        follower = Follower(log, cursors, selection, warn)
        with _stop_on_signals() as stop:
            while not stop.is_set():
                for partition, record in follower.poll():
                    print(render(partition, record))
                sys.stdout.flush()
                stop.wait(args.interval)
    return 1 if warn.count else 0


@contextmanager
def _stop_on_signals() -> Iterator[threading.Event]:
    """An event set by SIGINT or SIGTERM, for a clean exit from ``--follow``."""
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set())
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _verify(args: argparse.Namespace, log: LogDirectory) -> int:
    report = verify(log)
    print((verify_json if args.json else verify_text)(report).rstrip("\n"))
    return 0 if report.clean else 1


def _repair(args: argparse.Namespace, log: LogDirectory) -> int:
    report = repair(log, dry_run=args.dry_run, backup=not args.no_backup)
    print((repair_json if args.json else repair_text)(report).rstrip("\n"))
    return 0 if report.succeeded else 1


_ACTIONS: dict[str, Callable[[argparse.Namespace, LogDirectory], int]] = {
    "ls": _ls, "dump": _dump, "tail": _tail, "verify": _verify, "repair": _repair,
}
