"""The node pool that ``bench compare``'s ``kvtier-node`` arm shares between its replicas.

The arm's N servers on this host name one ``kvtier node serve`` owner (docs/node.md) as their
``node_socket``, as the engines of one GPU node would.  The comparison starts a fresh owner for
every run of the arm (a new pool file, so no run starts warm), with the pool and its socket in a
private directory under ``/dev/shm`` and the owner's log beside the run's server logs
(``<arm>[-run<k>].node.log``); it stops the owner and removes the pool after the run
(:func:`run_owner`).  The pool's size is the arm's ``node_gib`` (``bench compare --node-gib``, or
the key in ``--kvtier-config``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

from kvtier.bench.arms import ArmSpec
from kvtier.core.errors import ServerStartError
from kvtier.launch.localserver import stop_process, wait_until_answers

POOL_ROOT = Path("/dev/shm")
"""Where pools are made: memory-backed on Linux (docs/node.md, "Memory")."""
DEFAULT_NODE_GIB = 1.0
"""The pool's size when neither ``--node-gib`` nor the config's ``node_gib`` says."""
DEFAULT_PAGE_KIB = 256
"""``kvtier node serve --page-kib``'s default (kvtier.cli.node)."""


@dataclasses.dataclass(frozen=True)
class NodePool:
    """Where the ``kvtier-node`` arm's replicas find their pool, and its size.

    Attributes:
        dir: a private directory under :data:`POOL_ROOT` holding the pool file and the socket.
        node_gib: the pool's size, GiB (2^30 bytes).
        page_kib: one page, KiB.
    """

    dir: Path
    node_gib: float = DEFAULT_NODE_GIB
    page_kib: int = DEFAULT_PAGE_KIB

    @classmethod
    def make(cls, node_gib: float, page_kib: int = DEFAULT_PAGE_KIB, root: Path = POOL_ROOT) -> NodePool:
        """A pool of ``node_gib`` GiB in a new directory ``<root>/kvtier-bench-<random>`` (mode 0700).

        Raises:
            ServerStartError: ``root`` is missing or the directory cannot be made (one sentence).
        """
        path = root / f"kvtier-bench-{secrets.token_hex(4)}"
        try:
            path.mkdir(mode=0o700)
        except OSError as exc:
            raise ServerStartError(f"the kvtier-node arm cannot make its pool directory {path} ({exc.strerror}); "
                                   f"it needs a writable {root} (shared memory)") from None
        return cls(path, node_gib, page_kib)

    @property
    def socket(self) -> str:
        """The owner's socket, every replica's ``node_socket``."""
        return str(self.dir / "node.sock")

    @property
    def pool_path(self) -> Path:
        return self.dir / "pool"

    def extra_config(self) -> dict[str, Any]:
        """The node tier's keys for ``kv_connector_extra_config``."""
        return {"node_socket": self.socket, "node_gib": self.node_gib}

    def remove(self) -> None:
        """Remove the directory and whatever is left in it."""
        shutil.rmtree(self.dir, ignore_errors=True)


def serves_pool(arm: ArmSpec, pool: NodePool | None) -> bool:
    """Whether ``arm``'s servers name ``pool``'s socket (the ``kvtier-node`` arm made with it)."""
    extra = (arm.kv_transfer_config or {}).get("kv_connector_extra_config") or {}
    return pool is not None and extra.get("node_socket") == pool.socket


class LocalNode:
    """One ``kvtier node serve`` on ``pool`` (a subprocess in a session of its own), its output in
    ``log_path``.  Start with :meth:`start`; :meth:`stop` ends it and deletes the pool file."""

    def __init__(self, pool: NodePool, log_path: Path) -> None:
        self.pool = pool
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def argv(self) -> list[str]:
        """The owner's command line (this interpreter's kvtier)."""
        from kvtier.core.tiers.node.settings import TIER  # ``kvtier node`` is named after its tier

        return [sys.executable, "-m", "kvtier.cli.main", TIER, "serve", "--pool", str(self.pool.pool_path),
                "--node-gib", f"{self.pool.node_gib:g}", "--socket", self.pool.socket,
                "--page-kib", str(self.pool.page_kib)]

    def start(self, timeout_s: float = 60.0) -> Self:
        """Start the owner and wait until it answers a ``STATS``.

        Raises:
            ServerStartError: it exited (e.g. the pool does not fit in ``/dev/shm``) or did not
                answer within ``timeout_s``; one line naming its log and its last lines.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (_src_root(), os.environ.get("PYTHONPATH"))
                                                            if p)}
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, start_new_session=True)
        try:  # stopped on any way out but success (a SIGTERM raising SystemExit in the wait included)
            wait_until_answers(self._proc, self.answers, timeout_s, "kvtier node serve", self.log_path, log_lines=3)
            return self
        except BaseException:
            self.stop()
            raise

    def answers(self) -> bool:
        """Whether the owner answers one ``STATS`` within a second."""
        from kvtier.core.tiers.node import protocol as p
        from kvtier.core.tiers.node.client import NodeClient, NodeUnavailable

        client = NodeClient(self.pool.socket, 1.0, "bench")
        try:
            reply, _, _ = client.call(p.Stats())
            return isinstance(reply, p.StatsReply)
        except NodeUnavailable:
            return False
        finally:
            client.close()

    def stop(self) -> None:
        """Stop the owner (SIGTERM, then SIGKILL after 10 s) and delete the pool, its lock and socket."""
        proc, self._proc = self._proc, None
        stop_process(proc)
        for path in (self.pool.pool_path, self.pool.pool_path.with_name("pool.lock"), Path(self.pool.socket)):
            path.unlink(missing_ok=True)


def _src_root() -> str:
    """The directory this kvtier is imported from (so the owner runs the same code as the bench)."""
    return str(Path(__file__).resolve().parents[2])


@contextlib.contextmanager
def run_owner(arm: ArmSpec, pool: NodePool | None, log_path: Path) -> Iterator[None]:
    """A fresh owner on ``pool`` for one run of ``arm`` when the arm's servers name it
    (:func:`serves_pool`), logging to ``log_path``, stopped (its pool deleted) on exit; nothing for
    any other arm.

    Raises:
        ServerStartError: the owner did not start (see :meth:`LocalNode.start`).
    """
    if pool is None or not serves_pool(arm, pool):
        yield
        return
    owner = LocalNode(pool, log_path).start()
    try:
        yield
    finally:
        owner.stop()
