"""Cluster nodes on one machine: each node is a Linux network namespace with its own address on a private bridge.

Services on a node bind and advertise the node's address and find each other through the registry exactly as on
separate machines, and a node's link can be cut and restored to see what a real network partition does (no
reset, no error: packets just stop). Needs root and iproute2. Every name carries a per-run tag, so concurrent
runs never collide, and ``Network.close`` removes all of it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import secrets
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tinker_atropos.processes import child_preexec

SUBNET_PREFIX = "10.213"  # a private /16; each network takes one free /24 of it
BRIDGE = "br0"  # inside the hub namespace, so its name is private to the run
_CLONE_NEWNET = 0x40000000


class NetnsError(RuntimeError):
    """An ``ip`` command failed; the message has its stderr."""


def ip(*args: str) -> str:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result.stdout


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here (not root, no iproute2, a sandbox), or None when they can."""
    if os.geteuid() != 0:
        return "not root"
    probe = f"ta{os.getpid()}probe{secrets.token_hex(2)}"
    try:
        ip("netns", "add", probe)
    except (OSError, NetnsError) as error:
        return f"cannot create a network namespace: {error}"
    ip("netns", "del", probe)
    return None


def _setns(namespace_fd: int) -> None:
    if ctypes.CDLL("libc.so.6", use_errno=True).setns(namespace_fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


@dataclass(frozen=True)
class Node:
    """One "machine": a namespace with one link (named after the node) to the bridge in ``hub``."""

    name: str
    namespace: str
    address: str
    hub: str

    def popen(
        self, args: Sequence[str], log_path: Path, environment: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """Run a command on the node, with ``environment`` added to ours. ``ip netns exec`` execs it in place,
        so the child keeps the parent-death signal of ``child_preexec`` and never outlives this process."""
        with open(log_path, "ab") as log:
            return subprocess.Popen(
                ["ip", "netns", "exec", self.namespace, *args],
                env={**os.environ, **(environment or {})},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=child_preexec,
            )

    @contextlib.contextmanager
    def entered(self) -> Iterator[None]:
        """Move the calling thread onto the node meanwhile (a network namespace is per thread): sockets it opens
        and children it starts belong to the node, e.g. an ``EmbeddedValkey`` bound to the node's address."""
        with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{self.namespace}") as node:
            _setns(node.fileno())
            try:
                yield
            finally:
                _setns(home.fileno())

    def cut(self) -> None:
        """Pull the node's cable at the bridge: its processes keep running but no packet gets in or out."""
        ip("-n", self.hub, "link", "set", self.name, "down")

    def restore(self) -> None:
        ip("-n", self.hub, "link", "set", self.name, "up")


class Network:
    """A bridge in a namespace of its own ("hub"), a link to it from this namespace (so that this process and
    a human's ``tinker-atropos status`` reach the nodes), and the nodes added with ``add_node``."""

    def __init__(self) -> None:
        self.tag = f"ta{os.getpid()}x{secrets.token_hex(2)}"  # also the host link's name: <= 15 characters
        self.hub = f"{self.tag}-hub"
        self.subnet = _free_subnet()
        self.nodes: list[Node] = []
        self._namespaces: list[str] = []
        try:
            self._add_namespace(self.hub)
            ip("-n", self.hub, "link", "add", BRIDGE, "type", "bridge")
            ip("-n", self.hub, "link", "set", BRIDGE, "up")
            ip("link", "add", self.tag, "type", "veth", "peer", "name", "host", "netns", self.hub)
            ip("-n", self.hub, "link", "set", "host", "master", BRIDGE, "up")
            ip("addr", "add", f"{self.subnet}.1/24", "dev", self.tag)
            ip("link", "set", self.tag, "up")
        except BaseException:
            self.close()
            raise

    def _add_namespace(self, name: str) -> None:
        ip("netns", "add", name)
        self._namespaces.append(name)

    def add_node(self, name: str) -> Node:
        node = Node(name, f"{self.tag}-{name}", f"{self.subnet}.{len(self.nodes) + 2}", self.hub)
        self._add_namespace(node.namespace)
        ip(
            "-n",
            self.hub,
            "link",
            "add",
            name,
            "type",
            "veth",
            "peer",
            "name",
            "eth0",
            "netns",
            node.namespace,
        )
        ip("-n", self.hub, "link", "set", name, "master", BRIDGE, "up")
        ip("-n", node.namespace, "addr", "add", f"{node.address}/24", "dev", "eth0")
        ip("-n", node.namespace, "link", "set", "eth0", "up")
        ip("-n", node.namespace, "link", "set", "lo", "up")
        self.nodes.append(node)
        return node

    def leftovers(self) -> list[str]:
        """Namespaces and links of this network that still exist (empty after ``close``)."""
        left = [n for n in ip("netns", "list").split() if n.startswith(f"{self.tag}-")]
        with contextlib.suppress(NetnsError):
            ip("link", "show", self.tag)
            left.append(self.tag)
        return left

    def close(self) -> None:
        """Delete the host link, end whatever still runs on a node, then delete the namespaces: the veths and
        the bridge go with them. Safe to call twice or after a partial setup."""
        with contextlib.suppress(NetnsError):  # at once, unlike the kernel's clean-up of a deleted namespace
            ip("link", "del", self.tag)
        for namespace in reversed(self._namespaces):
            with contextlib.suppress(NetnsError):
                for pid in ip("netns", "pids", namespace).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
            with contextlib.suppress(NetnsError):
                ip("netns", "del", namespace)
        self._namespaces.clear()


def _free_subnet() -> str:
    """A /24 of SUBNET_PREFIX that no address or route of this machine uses yet (another run may hold one)."""
    taken = ip("-4", "-o", "addr") + ip("-4", "route")
    free = [n for n in range(256) if f"{SUBNET_PREFIX}.{n}." not in taken]
    if not free:
        raise NetnsError(f"every /24 of {SUBNET_PREFIX}.0.0/16 is in use")
    return f"{SUBNET_PREFIX}.{random.choice(free)}"
