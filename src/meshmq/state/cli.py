"""``meshmq state verify|repair [--data-dir DIR]``: check and repair the broker's saved state.

``verify`` only reads, without the lock, so it works while a broker runs. ``repair`` takes the
lock of every state directory, so it refuses while a broker runs. ``--data-dir`` defaults to
``./data``, as ``meshmq serve`` does. ``check.py`` does the work; this module parses
options and prints.

Exit status: 0 clean (or repaired); 1 problems found (``verify``) or left after ``repair``; 2 bad
usage, a directory that holds no state, or (``repair``) a state directory in use. Errors are
one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

from meshmq.config import ServerConfig
from meshmq.log.render import payload_text
from meshmq.state.check import (
    DirectoryCheck,
    StateDirectoryError,
    StateProblem,
    StateRepair,
    StateReport,
    repair,
    verify,
)

PROG = "meshmq state"
PREVIEW_BYTES = 80  # of a bad line, in the text report


def add_state_command(commands: Any) -> None:
    """Register ``state`` and its actions on the ``meshmq`` subcommand parser."""
    state = commands.add_parser(
        "state", help="verify and repair the saved sessions and retained messages",
        description="Verify and repair the broker's state (persistent sessions, retained "
                    "messages) under its data_dir: DIR/state and, with workers, DIR/state-N.")
    actions = state.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    default = ServerConfig().data_dir
    common.add_argument("-d", "--data-dir", default=default, metavar="DIR",
                        help=f"the broker's data_dir, or one state directory in it (default "
                             f"{default}, as for meshmq serve)")
    common.add_argument("--json", action="store_true", help="machine-readable JSON output")
    actions.add_parser("verify", parents=[common],
                       help="check the snapshots and every journal line (exit 1 on problems)")
    fix = actions.add_parser("repair", parents=[common],
                             help="cut out bad journal lines, keeping a copy (the broker must "
                                  "be stopped)")
    fix.add_argument("--dry-run", action="store_true", help="print what would be done")
    state.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    """Run one ``meshmq state`` action; returns the exit status."""
    try:
        return _ACTIONS[args.action](args)
    except StateDirectoryError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1


def _verify(args: argparse.Namespace) -> int:
    report = verify(args.data_dir)
    print((verify_json if args.json else verify_text)(report).rstrip("\n"))
    return 0 if report.clean else 1


def _repair(args: argparse.Namespace) -> int:
    report = repair(args.data_dir, dry_run=args.dry_run)
    print((repair_json if args.json else repair_text)(report).rstrip("\n"))
    return 0 if report.succeeded else 1


_ACTIONS: dict[str, Callable[[argparse.Namespace], int]] = {
    "verify": _verify, "repair": _repair,
}


# -- rendering --------------------------------------------------------------------------------


def _plural(count: int, word: str, words: str = "") -> str:
    return f"{count} {word if count == 1 else words or word + 's'}"


def describe(problem: StateProblem) -> str:
    where = str(problem.path) if problem.line is None else f"{problem.path}:{problem.line}"
    shown = f": {_preview(problem.text)}" if problem.text else ""
    return f"{where}: {problem.detail}{shown}"


def _preview(text: bytes) -> str:
    cut = len(text) > PREVIEW_BYTES
    return payload_text(text[:PREVIEW_BYTES]) + ("..." if cut else "")


def _directory_line(check: DirectoryCheck) -> str:
    journal = (f"{check.journal.name}: {_plural(check.lines_applied, 'line')} applied"
               if check.journal is not None else "no journal")
    use = " (in use)" if check.in_use else ""
    return (f"{check.path}{use}: generation {check.generation}, "
            f"{_plural(check.sessions, 'session')}, "
            f"{_plural(check.retained, 'retained message')}; {journal}")


def verify_text(report: StateReport) -> str:
    lines = []
    for check in report.directories:
        lines.append(_directory_line(check))
        lines += [f"problem: {describe(p)}" for p in check.problems]
        lines += [f"note: {path}: {detail}" for path, detail in check.notes]
    count = _plural(len(report.problems), "problem") if report.problems else "clean"
    directories = _plural(len(report.directories), "state directory", "state directories")
    lines.append(f"verify: {count} ({directories})")
    return "\n".join(lines) + "\n"


def _problem_json(problem: StateProblem) -> dict[str, object]:
    return {"path": str(problem.path), "kind": problem.kind, "line": problem.line,
            "detail": problem.detail, "text": payload_text(problem.text)}


def verify_json(report: StateReport) -> str:
    return json.dumps({
        "data_dir": str(report.data_dir), "clean": report.clean,
        "directories": [_directory_json(check) for check in report.directories],
    })


def _directory_json(check: DirectoryCheck) -> dict[str, object]:
    return {"path": str(check.path), "in_use": check.in_use, "generation": check.generation,
            "sessions": check.sessions, "retained": check.retained,
            "journal": None if check.journal is None else str(check.journal),
            "lines_applied": check.lines_applied,
            "problems": [_problem_json(p) for p in check.problems],
            "notes": [{"path": str(path), "detail": detail} for path, detail in check.notes]}


def _repair_lines(report: StateRepair) -> Iterable[str]:
    verb = "would cut" if report.dry_run else "cut"
    for problem in report.cut:
        yield f"{problem.path}:{problem.line}: {verb} out ({problem.kind}): " + _preview(
            problem.text)
    for path in report.removed:
        yield f"{path}: {'would remove' if report.dry_run else 'removed'} a leftover temporary file"
    for problem in report.unrepairable:
        yield (f"cannot repair: {describe(problem)}; restore it from a backup, or move its "
               "directory away to start without those sessions and retained messages")
    yield from (f"the journal as it was: {path}" for path in report.kept)


def repair_text(report: StateRepair) -> str:
    lines = list(_repair_lines(report))
    lost = _plural(len(report.cut), "line")
    if not report.cut and not report.removed and not report.unrepairable:
        lines.append("repair: nothing to do (verify is clean)")
    elif report.dry_run:
        lines.append(f"repair --dry-run: nothing changed; a repair would cut {lost}")
    else:
        after = "clean" if report.after is not None and report.after.clean else "NOT clean"
        lines.append(f"repair: cut {lost} from {_plural(len(report.kept), 'journal')}; verify "
                     f"is now {after}")
        if report.after is not None:
            lines += [f"problem: {describe(p)}" for p in report.after.problems]
    return "\n".join(lines) + "\n"


def repair_json(report: StateRepair) -> str:
    return json.dumps({
        "dry_run": report.dry_run, "succeeded": report.succeeded,
        "cut": [_problem_json(p) for p in report.cut],
        "removed": [str(path) for path in report.removed],
        "unrepairable": [_problem_json(p) for p in report.unrepairable],
        "kept": [str(path) for path in report.kept],
        "clean_after": None if report.after is None else report.after.clean,
        "problems_after": [] if report.after is None else [
            _problem_json(p) for p in report.after.problems],
    })
