"""Real ``kvtier node serve`` processes for the tests: the pool in /dev/shm, the socket in /tmp.

Faults are real: ``SIGKILL`` (:meth:`NodeServer.kill`), ``SIGSTOP``/``SIGCONT``
(:meth:`NodeServer.pause`), a restart on the same pool (:meth:`NodeServer.start` again).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kvtier.core.tiers.node import protocol as p
from kvtier.core.tiers.node.client import NodeClient
from kvtier.launch.localserver import stop_process
from tests.sigstop import stop_and_wait

SRC = str(Path(__file__).resolve().parents[1] / "src")


class NodeServer:
    """One pool owner (see the module docstring).

    Args:
        node_gib: the pool's size.
        page_kib: one page.
        lease_s: the owner's lease expiry.
        max_clients: connections the owner serves at once.
    """

    def __init__(self, log_dir: Path, node_gib: float = 0.0625, page_kib: int = 4, lease_s: float = 30.0,
                 max_clients: int = 256) -> None:
        tag = uuid.uuid4().hex[:10]
        self.pool = Path(f"/dev/shm/kvtier-test-{tag}")
        self.socket = f"/tmp/kvtier-node-{tag}.sock"
        self.log = log_dir / f"node-{tag}.log"
        self.args = ["--pool", str(self.pool), "--node-gib", str(node_gib), "--socket", self.socket,
                     "--page-kib", str(page_kib), "--lease-s", str(lease_s), "--max-clients", str(max_clients),
                     "--verbose"]
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> NodeServer:
        """Start the owner (again, on the same pool) and wait until it answers."""
        env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-c", "from kvtier.cli.main import app; app()", "node",
                                          "serve", *self.args], stdout=log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvtier node serve exited {self.proc.returncode}: {self.log.read_text()}")
            try:
                with socket.socket(socket.AF_UNIX) as s:
                    s.settimeout(1.0)
                    s.connect(self.socket)
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"kvtier node serve did not answer within {timeout_s} s: {self.log.read_text()}")

    def kill(self) -> None:
        """SIGKILL the owner (its socket file stays, as after a crash)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def pause(self) -> None:
        stop_and_wait(self.pid)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def stats(self) -> p.StatsReply:
        """The owner's numbers and its index checked (``problem``), asked on a connection of its own."""
        client = NodeClient(self.socket, 10.0, "test")
        try:
            reply, _, _ = client.call(p.Stats(check=True))
        finally:
            client.close()
        assert isinstance(reply, p.StatsReply)
        return reply

    def stop(self) -> None:
        stop_process(self.proc)
        self.pool.unlink(missing_ok=True)
        self.pool.with_name(self.pool.name + ".lock").unlink(missing_ok=True)
        Path(self.socket).unlink(missing_ok=True)
