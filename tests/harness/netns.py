"""Network namespaces for real partitions: each node (or client) in its own namespace, all
joined by veth pairs to a bridge in the root namespace; a cut takes a namespace's link down.

Layout of one ``NetworkLab`` (``<id>`` is random per lab, so labs of concurrent tests never
share a name; Linux interface names are at most 15 bytes)::

    root namespace:   bridge mq<id>b0 ── mq<id>h1 ── mq<id>h2 ── ...   (host ends of the veths)
    namespace mq<id>-n1:   lo, mq<id>n1  10.X.Y.1/24                     (the other end)
    namespace mq<id>-n2:   lo, mq<id>n2  10.X.Y.2/24

The subnet 10.X.Y.0/24 is drawn per lab. The bridge has no address unless ``attach_host()``
gives it one (then the test process, in the root namespace, reaches every namespace).

Faults:

* ``cut(ns)``: the host end of the namespace's veth goes down. Packets are dropped silently,
  nothing is reset: established TCP connections stall (and resume after ``heal`` if neither side
  gave up meanwhile), new ones time out. This is a real partition, which the proxy cannot give.
* ``partition([["n1"], ["n2", "n3"]])``: each group gets a bridge of its own; a namespace
  reaches only its group (``iptables``/``nft`` are not installed here, bridges are enough).
* ``heal()``: every link up and back on the main bridge.

``close()`` (or leaving the ``with`` block, failed or not) deletes every namespace, veth and
bridge the lab created, and only those. Needs root and ``ip`` (iproute2); ``unavailable()``
says why not, for a skip.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import TracebackType


class NetnsError(Exception):
    """An ``ip`` command failed: the message has the command and its error output."""


def unavailable() -> str | None:
    """Why this process cannot make network namespaces, or None if it can."""
    if shutil.which("ip") is None:
        return "network namespaces need the ip command (iproute2), which is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add), and this is not root"
    return None


def ip(*args: str) -> str:
    """Run ``ip args...``; its output, or ``NetnsError`` naming the command and the error."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


@dataclass
class Namespace:
    """A network namespace of a lab, with one address on the lab's subnet."""

    name: str
    short: str  # the name given to ``add`` (n1, client...)
    address: str
    host_end: str  # the veth end in the root namespace, on a bridge

    @property
    def launcher(self) -> tuple[str, ...]:
        """Prefix for a command that must run in this namespace (``ip netns exec`` execs it:
        the process keeps the pid ``Popen`` gave, so signals reach it)."""
        return ("ip", "netns", "exec", self.name)

    def run(self, *cmd: str, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*self.launcher, *cmd], capture_output=True, text=True,
                              timeout=timeout)


@dataclass
class NetworkLab:
    """Namespaces on one bridge; see the module docstring."""

    lab_id: str = field(default_factory=lambda: secrets.token_hex(3))
    namespaces: dict[str, Namespace] = field(default_factory=dict)
    bridges: list[str] = field(default_factory=list)
    subnet: ipaddress.IPv4Network = field(default_factory=lambda: ipaddress.IPv4Network(
        f"10.{secrets.randbelow(200) + 40}.{secrets.randbelow(256)}.0/24"))
    host_address: str | None = None

    @property
    def bridge(self) -> str:
        return f"mq{self.lab_id}b0"

    def open(self) -> NetworkLab:
        self._add_bridge(self.bridge)
        return self

    def _add_bridge(self, name: str) -> None:
        ip("link", "add", name, "type", "bridge")
        self.bridges.append(name)
        ip("link", "set", name, "up")

    def add(self, short: str) -> Namespace:
        """A new namespace named after ``short``, linked to the bridge, with the next address."""
        number = len(self.namespaces) + 1
        name = f"mq{self.lab_id}-{short}"
        host_end, inner_end = f"mq{self.lab_id}h{number}", f"mq{self.lab_id}n{number}"
        address = str(self.subnet.network_address + number)
        ip("netns", "add", name)
        namespace = Namespace(name, short, address, host_end)
        self.namespaces[short] = namespace  # from here on close() removes it
        ip("link", "add", host_end, "type", "veth", "peer", "name", inner_end)
        ip("link", "set", inner_end, "netns", name)
        ip("link", "set", host_end, "master", self.bridge)
        ip("link", "set", host_end, "up")
        ip("-n", name, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", inner_end)
        ip("-n", name, "link", "set", inner_end, "up")
        ip("-n", name, "link", "set", "lo", "up")
        return namespace

    def attach_host(self) -> str:
        """Give the bridge the subnet's last address, so the root namespace (the test process)
        reaches every namespace; returns that address."""
        if self.host_address is None:
            self.host_address = str(self.subnet.broadcast_address - 1)
            ip("addr", "add", f"{self.host_address}/{self.subnet.prefixlen}", "dev", self.bridge)
        return self.host_address

    def __getitem__(self, short: str) -> Namespace:
        return self.namespaces[short]

    # -- faults -------------------------------------------------------------------------------

    def cut(self, short: str) -> None:
        """Cut ``short`` off from every other namespace (and the host): its link goes down."""
        ip("link", "set", self.namespaces[short].host_end, "down")

    def partition(self, groups: Sequence[Sequence[str]]) -> None:
        """Each group on a bridge of its own; namespaces in no group keep the main bridge."""
        for i, group in enumerate(groups, start=1):
            bridge = f"mq{self.lab_id}b{i}"
            if bridge not in self.bridges:
                self._add_bridge(bridge)
            for short in group:
                ip("link", "set", self.namespaces[short].host_end, "master", bridge)

    def heal(self) -> None:
        """Every namespace back on the main bridge, every link up."""
        for namespace in self.namespaces.values():
            ip("link", "set", namespace.host_end, "master", self.bridge)
            ip("link", "set", namespace.host_end, "up")

    # -- clean-up -------------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Delete what the lab made; each step is tried even if an earlier one failed.
        Returns the errors (empty when all went)."""
        errors: list[str] = []
        for namespace in self.namespaces.values():
            for args in (("link", "del", namespace.host_end), ("netns", "del", namespace.name)):
                try:
                    ip(*args)
                except (NetnsError, subprocess.TimeoutExpired) as exc:
                    if "Cannot find device" not in str(exc):  # never made, or gone with its ns
                        errors.append(str(exc))
        for bridge in self.bridges:
            try:
                ip("link", "del", bridge)
            except (NetnsError, subprocess.TimeoutExpired) as exc:
                errors.append(str(exc))
        self.namespaces.clear()
        self.bridges.clear()
        return errors

    def __enter__(self) -> NetworkLab:
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        errors = self.close()
        if errors and exc is None:
            raise NetnsError("could not remove all of the lab: " + "; ".join(errors))


def leftovers(lab: NetworkLab) -> list[str]:
    """Namespaces and links of ``lab`` (by its id) that still exist: for a test of clean-up."""
    found = [line.split()[0] for line in ip("netns", "list").splitlines()
             if line.startswith(f"mq{lab.lab_id}-")]
    found += [line.split(": ")[1].split("@")[0] for line in ip("-o", "link").splitlines()
              if f"mq{lab.lab_id}" in line]
    return found
