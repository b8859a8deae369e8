"""Network namespaces as test "hosts": one for Redis, one per engine host, joined by veth pairs.

Host ``a`` reaches Redis at 10.211.1.1 (its own address 10.211.1.2), host ``b`` at 10.211.2.1
(its own 10.211.2.2).  These addresses exist only inside the namespaces; every namespace has its
own loopback, so a server bound to 127.0.0.1 in host ``a`` is reachable only from host ``a``.
Deleting a namespace deletes its veth ends.  Needs root and ``ip`` (iproute2); where the machine
cannot create a namespace the caller skips with the reason.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

REDIS_ADDRESS = {"a": "10.211.1.1", "b": "10.211.2.1"}
"""The redis namespace's address as seen from each host namespace."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def cannot_create() -> str | None:
    """Why this machine cannot create network namespaces (``None`` when it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root (make test runs as root in CI)"
    if not shutil.which("ip"):
        return "network namespaces need the ip command (iproute2)"
    probe = f"kvtprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30, check=False)
    if made.returncode != 0:
        return f"this machine cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30, check=False)
    return None


@contextmanager
def netns_hosts() -> Iterator[dict[str, str]]:
    """Create namespaces ``r`` (Redis), ``a`` and ``b`` with a veth pair from ``r`` to each host;
    yields ``{"r": name, "a": name, "b": name}`` and deletes them all afterwards."""
    tag = uuid.uuid4().hex[:6]
    names = {role: f"kvt{role}{tag}" for role in ("r", "a", "b")}
    created: list[str] = []
    try:
        for ns in names.values():
            _ip("netns", "add", ns)
            created.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for i, host in enumerate(("a", "b"), start=1):
            left, right = f"vr{host}{tag}", f"vh{host}{tag}"
            _ip("link", "add", left, "type", "veth", "peer", "name", right)
            _ip("link", "set", left, "netns", names["r"])
            _ip("link", "set", right, "netns", names[host])
            _ip("-n", names["r"], "addr", "add", f"10.211.{i}.1/24", "dev", left)
            _ip("-n", names[host], "addr", "add", f"10.211.{i}.2/24", "dev", right)
            _ip("-n", names["r"], "link", "set", left, "up")
            _ip("-n", names[host], "link", "set", right, "up")
        yield names
    finally:
        for ns in created:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)


def in_netns(ns: str, argv: list[str]) -> list[str]:
    """``argv`` run inside namespace ``ns`` (``ip netns exec`` execs it: same pid, same process group)."""
    return ["ip", "netns", "exec", ns, *argv]
