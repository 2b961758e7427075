"""Which node a data directory belongs to: ``data_dir/cluster.json``.

A node of a cluster keeps its node id and its cluster's id next to its data. At start
(``prepare_identity``, before the supervisor forks) the file is checked against the
configuration: a data directory written by another node, or by a node without a cluster
(and the other way round), is refused with one line naming the key, exit status 2 — its
partitions, sessions and retained messages would otherwise be served as another node's. A
new cluster node writes the file; the first node of a cluster (no ``cluster.seeds``) draws the
cluster's id, a joining one learns it from the first node it links with, and its workers write
it then (``store_cluster_id``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from meshmq.cluster.nodelink import new_cluster_id
from meshmq.config import BrokerConfig
from meshmq.node.startup import BAD_CONFIGURATION, StartupError

IDENTITY_FILE = "cluster.json"


def _path(data_dir: str) -> Path:
    return Path(data_dir) / IDENTITY_FILE


def read_identity(data_dir: str) -> dict[str, Any] | None:
    """The identity file's contents, or None when there is none."""
    path = _path(data_dir)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StartupError(f"server.data_dir: cannot read {path}: {exc.strerror or exc}",
                           BAD_CONFIGURATION) from None
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not isinstance(data.get("node_id"), str) or \
                not isinstance(data.get("cluster_id", ""), str):
            raise ValueError("not a node identity")
    except ValueError:
        raise StartupError(f"server.data_dir: {path} is damaged (expected "
                           '{"node_id": ..., "cluster_id": ...})', BAD_CONFIGURATION) from None
    return data


def _write(data_dir: str, node_id: str, cluster_id: str) -> None:
    path = _path(data_dir)
    tmp = path.with_suffix(f".json.{os.getpid()}.tmp")  # (every worker may write it)
    tmp.write_text(json.dumps({"node_id": node_id, "cluster_id": cluster_id}) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)


def prepare_identity(config: BrokerConfig) -> str:
    """Check (or write) the data directory's identity against the configuration; return the
    cluster id known so far ("" until a joining node learns it). ``StartupError`` (exit
    status 2) for a data directory of another node or cluster."""
    data_dir, cluster = config.server.data_dir, config.cluster
    found = read_identity(data_dir)
    if not cluster.enabled:
        if found is not None:
            raise StartupError(
                f"cluster.node_id: {data_dir} holds the data of cluster node "
                f"{found['node_id']!r}; start it with cluster.node_id = {found['node_id']!r}"
                " (or give this node another server.data_dir)", BAD_CONFIGURATION)
        return ""
    if found is not None:
        if found["node_id"] != cluster.node_id:
            raise StartupError(
                f"cluster.node_id: {data_dir} holds the data of node {found['node_id']!r}, not"
                f" {cluster.node_id!r} (a node's id is stable for its life; give this node"
                " another server.data_dir)", BAD_CONFIGURATION)
        return str(found.get("cluster_id", ""))
    cluster_id = "" if cluster.seeds else new_cluster_id()  # the first node of a cluster
    _write(data_dir, cluster.node_id, cluster_id)
    return cluster_id


def store_cluster_id(data_dir: str, node_id: str, cluster_id: str) -> None:
    """The node learned its cluster's id (from a node, or as agreed in the metadata, which
    may replace one learned before): keep it (every worker may; they learn the same)."""
    found = read_identity(data_dir)
    if found is None or found.get("cluster_id") != cluster_id:
        _write(data_dir, node_id, cluster_id)


def read_secret(config: BrokerConfig) -> bytes:
    """The cluster's shared secret (``cluster.secret_file``: its bytes, trailing whitespace
    and newlines dropped; empty without the key). ``StartupError`` (exit status 2) for a file
    that cannot be read or holds nothing."""
    path = config.cluster.secret_file
    if not path:
        return b""
    try:
        secret = Path(path).read_bytes().rstrip()
    except OSError as exc:
        raise StartupError(f"cluster.secret_file: cannot read {path}: {exc.strerror or exc}",
                           BAD_CONFIGURATION) from None
    if not secret:
        raise StartupError(f"cluster.secret_file: {path} is empty", BAD_CONFIGURATION)
    return secret


def raft_secret(config: BrokerConfig) -> bytes:
    """The secret the metadata's Raft messages are authenticated with: the cluster secret,
    or, for a node on a loopback address without one, this user's host-local secret
    (``host_secret``): pysyncobj's messages are pickles, which no one else may send."""
    return read_secret(config) or host_secret()


HOST_SECRET_DIR = "meshmq-{uid}"  # under the temporary directory: /tmp/meshmq-0


def host_secret(root: str | None = None) -> bytes:
    """A secret every node this user runs on this host shares, and no other user can read:
    ``/tmp/meshmq-<uid>/loopback.secret`` (the directory mode 0700 and owned by this user,
    the file 0600), drawn by the first node that needs it. ``StartupError`` naming the
    directory when another user owns it or it is open to others."""
    import secrets
    import tempfile

    directory = Path(root or tempfile.gettempdir()) / HOST_SECRET_DIR.format(uid=os.getuid())
    path = directory / "loopback.secret"
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        info = directory.lstat()
        if info.st_uid != os.getuid() or info.st_mode & 0o077 or not directory.is_dir():
            raise StartupError(
                f"{directory}: must be a directory of this user that no one else may open "
                "(it holds the metadata's secret for nodes on a loopback address without "
                "cluster.secret_file); remove it, or set cluster.secret_file",
                BAD_CONFIGURATION)
        if not path.exists():
            drawn = directory / f".loopback.{os.getpid()}.{secrets.token_hex(4)}"
            with open(drawn, "x") as out:
                os.fchmod(out.fileno(), 0o600)
                out.write(secrets.token_hex(32))
                out.flush()
                os.fsync(out.fileno())
            try:
                os.link(drawn, path)  # atomic: the first node's secret wins
            except FileExistsError:
                pass
            finally:
                drawn.unlink()
        secret = path.read_bytes().strip()
    except OSError as exc:
        raise StartupError(f"{path}: {exc.strerror or exc} (the metadata's secret for nodes "
                           "on a loopback address without cluster.secret_file)",
                           BAD_CONFIGURATION) from None
    if not secret:
        raise StartupError(f"{path} is empty: remove it", BAD_CONFIGURATION)
    return secret
