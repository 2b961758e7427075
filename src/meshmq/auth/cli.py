"""``meshmq passwd add|rm|ls FILE [USER]``: manage a password file of argon2id hashes."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path
from typing import Any

from meshmq.auth.passwords import (
    PasswordFileError,
    hash_password,
    read_password_file,
    write_password_file,
)


def add_passwd_command(commands: Any) -> None:
    passwd = commands.add_parser("passwd", help="manage a password file (argon2id hashes)")
    actions = passwd.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="add a user or change a password")
    add.add_argument("file")
    add.add_argument("user")
    add.add_argument("--password-stdin", action="store_true",
                     help="read the password from standard input (for scripts)")
    remove = actions.add_parser("rm", help="remove a user")
    remove.add_argument("file")
    remove.add_argument("user")
    listing = actions.add_parser("ls", help="list users")
    listing.add_argument("file")
    passwd.set_defaults(run=_passwd)


def _passwd(args: argparse.Namespace) -> int:
    try:
        return _ACTIONS[args.action](args)
    except PasswordFileError as exc:
        print(f"meshmq passwd: {exc}", file=sys.stderr)
        return 1


def _load(path: str, must_exist: bool) -> dict[str, str]:
    if not must_exist and not Path(path).exists():
        return {}
    return read_password_file(path)


def _add(args: argparse.Namespace) -> int:
    if ":" in args.user or not args.user.strip():
        print("meshmq passwd: a user name must be non-empty and contain no ':'", file=sys.stderr)
        return 2
    if not args.password_stdin and not sys.stdin.isatty():
        # getpass would fall back to reading standard input and fail at its end (EOFError).
        print("meshmq passwd: standard input is not a terminal, so there is no one to ask for"
              " the password; give it on standard input with --password-stdin",
              file=sys.stderr)
        return 2
    users = _load(args.file, must_exist=False)
    password = _read_password(args.password_stdin)
    if not password:
        return 2
    users[args.user] = hash_password(password)
    write_password_file(args.file, users)
    return 0


def _read_password(from_stdin: bool) -> str:
    """The password, or "" after printing why there is none."""
    if from_stdin:
        password = sys.stdin.readline().rstrip("\r\n")
    else:
        try:
            password = getpass.getpass("Password: ")
            if password != getpass.getpass("Repeat password: "):
                print("meshmq passwd: passwords differ", file=sys.stderr)
                return ""
        except EOFError:  # end of input (Ctrl-D) at the prompt
            print("\nmeshmq passwd: no password given", file=sys.stderr)
            return ""
    if not password:
        print("meshmq passwd: empty password refused", file=sys.stderr)
    return password


def _remove(args: argparse.Namespace) -> int:
    users = _load(args.file, must_exist=True)
    if users.pop(args.user, None) is None:
        print(f"meshmq passwd: no user {args.user!r} in {args.file}", file=sys.stderr)
        return 1
    write_password_file(args.file, users)
    return 0


def _list(args: argparse.Namespace) -> int:
    for user in sorted(_load(args.file, must_exist=True)):
        print(user)
    return 0


_ACTIONS = {"add": _add, "rm": _remove, "ls": _list}
