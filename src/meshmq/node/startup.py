"""Why a node did not start: ``StartupError``, the line to log and the process's exit status.

A node starts in one of two places: ``serve`` (server.py: a single process, or one worker) and
the supervisor of a node of workers (supervisor.py: its checks before it forks). Both stop on
the same errors and report them the same way: what start-up raised becomes a ``StartupError``
(``starting``, with the table in ``startup_error``), and the caller logs its one line and exits
with its status. The node's own errors (``DataDirError``, ``ReservationError``, ``AdminError``)
are ``StartupError``s already; the layers below raise their own, which are translated here.

Exit status 2: something the configuration names cannot be used as it is (the password, ACL or
TLS files, ``server.data_dir``, the log settings): fix it and start again. 1: anything else (a
port in use, a damaged commit log or state, the mesh, another broker on the directory).
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from meshmq.auth.acl import ACLFileError
from meshmq.auth.passwords import PasswordFileError
from meshmq.broker.transport.certificates import TLSConfigError
from meshmq.broker.transport.listeners import ListenerError
from meshmq.cluster.sockets import MeshError
from meshmq.config import BrokerConfig, listen_address, split_listen
from meshmq.log.errors import LogConfigError, LogError
from meshmq.state.files import StateError

BAD_CONFIGURATION = 2
CANNOT_START = 1

# Errors of the layers below whose message is the whole line, and their exit status.
_AS_THEY_ARE: tuple[tuple[type[Exception], int], ...] = (
    (PasswordFileError, BAD_CONFIGURATION),
    (ACLFileError, BAD_CONFIGURATION),
    (TLSConfigError, BAD_CONFIGURATION),
    (LogConfigError, BAD_CONFIGURATION),
    (ListenerError, CANNOT_START),
    (MeshError, CANNOT_START),
)


class StartupError(Exception):
    """Start-up stopped: ``str(error)`` is the one line to log, ``exit_status`` the status
    the process exits with."""

    def __init__(self, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.exit_status = exit_status


class DataDirError(StartupError):
    """``server.data_dir`` cannot be used; the message is one line naming the path and why
    (exit status 2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, BAD_CONFIGURATION)


def prepare_data_dir(data_dir: str) -> None:
    """Create ``data_dir`` if missing and check that this process can write in it.

    Raises ``DataDirError``. Called before anything opens a file there, so a bad directory
    is one clear line, not a failure deep in the state store.
    """
    path = Path(data_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise DataDirError(f"server.data_dir: {data_dir} is a file, not a directory") from None
    except NotADirectoryError:
        blocker = next((parent for parent in path.parents if parent.exists()), path)
        raise DataDirError(f"server.data_dir: cannot create {data_dir}: {blocker} is a file,"
                           " not a directory") from None
    except OSError as exc:
        raise DataDirError(f"server.data_dir: cannot create {data_dir}:"
                           f" {exc.strerror or exc}") from None
    try:  # the only honest test of "writable": write (root passes every mode bit check)
        with tempfile.TemporaryFile(dir=path, prefix=".meshmq-write-check-"):
            pass
    except OSError as exc:
        raise DataDirError(f"server.data_dir: {data_dir} is not writable:"
                           f" {exc.strerror or exc}") from None


class BindError(StartupError):
    """A bind host does not resolve; the message is one line naming its key (exit status
    2)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, BAD_CONFIGURATION)


def check_bind_hosts(config: BrokerConfig) -> None:
    """Resolve every address the node will listen on, once, before anything starts.

    Raises ``BindError``: a name that does not resolve is a configuration error naming the
    key to fix, not a listener failing with the resolver's bare error number (``Unknown error
    -2``). A temporary resolver failure is reported the same way, its reason in the line: the
    node cannot listen until the name resolves.
    """
    for key, host in _bind_hosts(config):
        try:
            socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise BindError(f"{key}: cannot resolve {host!r} ({exc.strerror})") from None


def _bind_hosts(config: BrokerConfig) -> list[tuple[str, str]]:
    """(key, host) of each address listened on: server.bind (or its default), the enabled
    listeners' own binds, the admin listener's host."""
    hosts = [("server.bind", listen_address(config))]
    for name in ("tls", "ws", "wss"):
        section = getattr(config, name)
        if section.enabled and section.bind:
            hosts.append((f"{name}.bind", section.bind))
    if config.admin.listen:
        hosts.append(("admin.listen", split_listen(config.admin.listen)[0]))
    return hosts


def startup_error(exc: Exception, data_dir: str) -> StartupError | None:
    """``exc``, raised while starting a node on ``data_dir``, as a ``StartupError``; None when
    start-up does not expect it (a bug: let it propagate, with its traceback)."""
    if isinstance(exc, StartupError):
        return exc
    for kind, status in _AS_THEY_ARE:
        if isinstance(exc, kind):
            return StartupError(str(exc), status)
    if isinstance(exc, LogError):
        return log_unusable(exc, data_dir)
    if isinstance(exc, StateError):
        return StartupError(f"cannot read the broker state: {exc}", CANNOT_START)
    if isinstance(exc, OSError):  # not from a listener: those raise ListenerError
        return _os_error(exc, data_dir)
    return None


@contextmanager
def starting(data_dir: str) -> Iterator[None]:
    """Run start-up steps: what they raise that start-up expects comes out as a
    ``StartupError`` (``startup_error``), anything else as it is."""
    try:
        yield
    except Exception as exc:
        error = startup_error(exc, data_dir)
        if error is None or error is exc:
            raise
        raise error from exc


def log_unusable(exc: LogError, data_dir: str) -> StartupError:
    """The commit log cannot be opened: the line names what to run next."""
    status = BAD_CONFIGURATION if isinstance(exc, LogConfigError) else CANNOT_START
    return StartupError(f"cannot open the commit log: {exc} ({exc.remedy(data_dir)})", status)


def _os_error(exc: OSError, data_dir: str) -> StartupError:
    """An ``OSError`` that escaped start-up: a file in the data directory (status 2, as a bad
    data_dir) or other."""
    filename = exc.filename if isinstance(exc.filename, str) else None
    reason = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError) and filename and not Path(filename).is_dir():
        reason = "a file is where a directory should be"  # what mkdir(exist_ok=True) says
    if filename is None:
        return StartupError(f"cannot start: {reason}", CANNOT_START)
    inside = Path(filename).absolute().is_relative_to(Path(data_dir).absolute())
    if inside:
        return StartupError(f"server.data_dir: cannot use {filename}: {reason}",
                            BAD_CONFIGURATION)
    return StartupError(f"cannot start: {filename}: {reason}", CANNOT_START)
