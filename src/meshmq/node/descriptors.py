"""Descriptors: the open-files limit, and a descriptor table grown before a storm needs it.

Theory of operation
-------------------
Every connection is a descriptor. ``raise_file_limit`` lifts the soft limit on open files to the
hard one, so that a reconnect storm of a few thousand clients is not refused at accept (EMFILE).

Linux keeps a process's descriptors in a table that starts with 64 slots and doubles when a new
descriptor does not fit (``expand_files``). In a process with more than one thread (the broker
has its log writer, its state store and its password checks off the loop) every doubling
waits for an RCU grace period (``expand_fdtable`` calls ``synchronize_rcu`` when the table is
shared) while the thread that asked, here the event loop inside ``accept4``, sleeps. A storm
of 10,000 connections doubles the table 8 times; measured on a 2-core VM, each wait took 8 to
23 ms, the loop accepting and answering nothing meanwhile, and together they were a fifth of
the storm's time (``docs/benchmarks.md``, "The descriptor table"). A single-threaded server
such as Mosquitto never waits.

``reserve_descriptors`` therefore grows the table once, at start, before any thread exists
(so that growth waits for nothing): it takes the lowest free descriptor at or above the size
wanted and closes it again. The kernel never shrinks a table, so the slots stay; they cost
kernel memory (8 bytes each, not in RSS) and no descriptor stays open. The size is the open
files limit, at most ``RESERVED_DESCRIPTORS``; past that, a table still doubles as before.
"""

from __future__ import annotations

import fcntl
import logging
import os
import resource

log = logging.getLogger("meshmq.server")

RESERVED_DESCRIPTORS = 1 << 16  # slots grown at start: 512 KiB of kernel memory


def raise_file_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit; return it.

    Every connection is a descriptor, and the usual soft limit (1024) would refuse a reconnect
    storm of a few thousand clients at accept (EMFILE) whatever ``limits.connect_burst`` says;
    the hard limit is the administrator's real bound (``ulimit -Hn``, systemd LimitNOFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open files limit soft=%d hard=%d: %s", soft, hard, exc)
    return soft


def reserve_descriptors(limit: int) -> int:
    """Grow this process's descriptor table to ``min(limit, RESERVED_DESCRIPTORS)`` slots now
    (module docstring); return the size asked for, or 0 if the table could not be grown."""
    size = min(limit, RESERVED_DESCRIPTORS)
    if size < 1:
        return 0
    try:
        fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("cannot grow the descriptor table: %s", exc)
        return 0
    try:
        # The lowest free descriptor >= size - 1: never one in use (unlike dup2).
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, size - 1)
    except OSError as exc:  # e.g. every slot up to the limit is taken
        log.warning("cannot grow the descriptor table to %d: %s", size, exc)
        return 0
    finally:
        os.close(fd)
    os.close(high)
    return size
