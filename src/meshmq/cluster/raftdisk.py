"""The Raft node's files: a journal that reaches the disk, and a check before each start.

Files, in the node's Raft directory (``<data_dir>/raft/``)::

    journal        pysyncobj's log (records written through an mmap)
    journal.meta   term, vote and commit index (pysyncobj's pickle)
    dump           the state at the last log compaction (gzip pickle)

What reaches the disk. pysyncobj writes log records into an mmap and never syncs it, and
writes its term and vote with a rename but no fsync: a kill -9 loses none of it (the page
cache survives the process), a power loss can. A voter that forgets a record it acknowledged,
or a vote it gave, can let Raft lose a committed entry, and a lost epoch could be handed out
twice. ``DurableJournal`` closes that: the records written since the last sync are synced
(msync) before this voter sends any message (``sync_pending``, called by the Raft transport:
cluster/raftstore.py), so before it acknowledges them to a leader and, as a leader, before
it sends them (it counts itself in the majority that commits them); term and vote are
fsynced (file, then directory) as they are written, before any message that depends on them.
One sync covers every record a message carries (group commit), which matters because
pysyncobj sends a lagging follower overlapping ranges again and again.

The start-up check (upstream pysyncobj issue 197). After an unclean stop, ``journal.meta``
can name a commit index past the last record the journal holds: the meta file and the mmap
reach the disk by different paths, in any order, and a kill -9 in the middle of a compaction
(the journal is cleared, then its kept records written again) leaves the journal short too.
pysyncobj then waits for records it will never get: the node does not become ready, and as a
leader it does not commit until its log passes the stale index. ``check_files`` runs before
the node starts: it lowers the stored commit index to what the journal and the dump hold (the
commit index is only a cache: the leader sends it again) and says so in the log. A journal it
cannot parse stops the start with a message naming the file, instead of a silent hang.
"""

from __future__ import annotations

import gzip
import logging
import os
import pickle
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pysyncobj.syncobj
from pysyncobj.journal import FileJournal, MetaStorer, createJournal

log = logging.getLogger("meshmq.metadata")

JOURNAL = "journal"
DUMP = "dump"
_HEADER = 24 + 8 + 4 + 4  # pysyncobj's journal header: name, version, format, end offset


class RaftFilesError(Exception):
    """The node's Raft files cannot be used as they are; the message names the file."""


def check_files(directory: Path) -> str | None:
    """Make ``directory``'s Raft files safe to start from (see the module docstring); what
    was changed, in one line, or None."""
    journal_path = directory / JOURNAL
    if not journal_path.exists():
        return None
    last = _last_journal_index(journal_path)
    dumped = _dump_index(directory / DUMP)
    available = max(last, dumped)
    storer = MetaStorer(str(journal_path) + ".meta")
    meta = storer.getMeta()
    stored = meta.get("raftCommitIndex", 1)
    if stored <= available:
        return None
    meta["raftCommitIndex"] = available
    _DurableMetaStorer(storer.getPath()).storeMeta(meta)
    return (f"raft commit index lowered from {stored} to {available}: the journal ends at "
            f"{last} and the dump at {dumped} (an unclean stop); the leader sends it again")


def _last_journal_index(path: Path) -> int:
    """The index of the journal's last record (0: none), read the way pysyncobj reads it."""
    data = path.read_bytes()
    if len(data) < _HEADER:
        return 0
    if not data.startswith(b"PYSYNCOBJ"):
        raise RaftFilesError(f"{path}: not a pysyncobj journal")
    end = struct.unpack_from("<I", data, _HEADER - 4)[0]
    if end > len(data):
        raise RaftFilesError(f"{path}: its header says it ends at byte {end} but it holds "
                             f"{len(data)}: remove the node's raft directory to rejoin empty, "
                             "only while a majority of the other voters is healthy")
    offset, index = _HEADER, 0
    while offset < end:
        size = struct.unpack_from("<I", data, offset)[0]
        if size < 16 or offset + 8 + size > end:
            raise RaftFilesError(f"{path}: a broken record at byte {offset}")
        index = struct.unpack_from("<Q", data, offset + 4)[0]
        offset += size + 8
    return index


def _dump_index(path: Path) -> int:
    """The log index the dump was taken at (0: no dump)."""
    if not path.exists():
        return 0
    try:
        with gzip.open(path, "rb") as dump:
            data = pickle.load(dump)
        return int(data[1][1])  # (state, last applied entry, the one before, cluster)
    except (OSError, EOFError, pickle.UnpicklingError, IndexError, TypeError, ValueError):
        raise RaftFilesError(f"{path}: not a readable pysyncobj dump") from None


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DurableMetaStorer(MetaStorer):
    """pysyncobj's meta file, fsynced before the rename and the directory after it."""

    def storeMeta(self, meta: dict[str, Any]) -> None:
        path = self.getPath()
        with open(path + ".tmp", "wb") as out:
            out.write(pickle.dumps(meta, 2))
            out.flush()
            os.fsync(out.fileno())
        os.replace(path + ".tmp", path)
        fsync_directory(Path(path).parent)


class DurableJournal(FileJournal):  # (pysyncobj has no type hints: FileJournal is Any)
    """pysyncobj's file journal, synced as the module docstring says."""

    def __init__(self, journal_file: str) -> None:
        self.dirty = False
        super().__init__(journal_file)
        self._FileJournal__metaStorer = _DurableMetaStorer(journal_file + ".meta")

    def sync_pending(self) -> None:
        """Sync what was written since the last call (nothing to do: no system call)."""
        if self.dirty:
            self.dirty = False
            self.flush()

    def add(self, command: bytes, idx: int, term: int) -> None:
        super().add(command, idx, term)
        self.dirty = True

    def clear(self) -> None:
        super().clear()
        self.dirty = True

    def deleteEntriesFrom(self, entryFrom: int) -> None:
        super().deleteEntriesFrom(entryFrom)
        self.dirty = True

    def deleteEntriesTo(self, entryTo: int) -> None:
        super().deleteEntriesTo(entryTo)
        self.sync_pending()  # a compaction is not followed by a send: sync it now


class JournalRef:
    """The journal a SyncObj being built got (for its transport, built right after it)."""

    journal: DurableJournal | None = None

    def sync_pending(self) -> None:
        if self.journal is not None:
            self.journal.sync_pending()


_factory_lock = threading.Lock()


@contextmanager
def durable_journals() -> Iterator[JournalRef]:
    """While inside, a SyncObj being built gets a ``DurableJournal``, which the ``JournalRef``
    yielded then names. pysyncobj builds its journal in ``SyncObj.__init__`` with its module's
    ``createJournal`` and offers no hook (pinned pysyncobj version: pyproject.toml)."""
    ref = JournalRef()

    def create(journal_file: str | None) -> Any:
        if journal_file is None:
            return createJournal(None)
        ref.journal = DurableJournal(journal_file)
        return ref.journal

    with _factory_lock:
        pysyncobj.syncobj.createJournal = create
        try:
            yield ref
        finally:
            pysyncobj.syncobj.createJournal = createJournal
