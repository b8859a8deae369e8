"""Real redis-server processes for the tests, on 127.0.0.1 only: standalone and a 3-master Cluster.

``make test`` installs Debian's ``redis-server`` package when it is missing (Debian 12 ships
7.0, which has Cluster mode); the fixtures in tests/conftest.py start these servers and stop
them afterwards.  Faults are real: ``kill -9``, ``SIGSTOP``/``SIGCONT``, a restart with an empty
dataset, and :class:`DelayProxy`, a TCP proxy that delays every chunk of bytes (there is no
``tc netem`` on these machines).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from kvtier.launch.localserver import stop_process
from tests.sigstop import stop_and_wait

HOST = "127.0.0.1"


def redis_binaries() -> tuple[str, str]:
    """Paths of redis-server and redis-cli.

    Raises:
        RuntimeError: not installed (``make test`` installs them; by hand: apt-get install redis-server).
    """
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    if not server or not cli:
        raise RuntimeError("redis-server is not installed; run `make test` (it installs it) or "
                           "`apt-get install -y redis-server`")
    return server, cli


def free_port(bus_offset: int = 0) -> int:
    """A free TCP port on 127.0.0.1 (and ``port + bus_offset`` free too, for a Cluster bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if port + bus_offset > 65535:
            continue
        if bus_offset:
            with socket.socket() as s:
                try:
                    s.bind((HOST, port + bus_offset))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free port pair found on 127.0.0.1")


class RedisServer:
    """One redis-server process on 127.0.0.1 with no persistence (a restart comes back empty)."""

    def __init__(self, workdir: Path, port: int | None = None, cluster: bool = False,
                 extra: tuple[str, ...] = (), tls: TlsFiles | None = None) -> None:
        self.server_bin, _ = redis_binaries()
        self.port = port if port is not None else free_port(10000 if cluster else 0)
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cluster = cluster
        self.extra = extra
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{HOST}:{self.port}/0"

    def start(self) -> RedisServer:
        args = [self.server_bin, "--bind", HOST, "--port", str(self.port), "--save", "", "--appendonly", "no",
                "--dir", str(self.dir), "--protected-mode", "no", "--loglevel", "warning", *self.extra]
        if self.tls:  # TLS only: the plain port is closed
            args[args.index("--port") + 1] = "0"
            args += ["--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert), "--tls-key-file",
                     str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca), "--tls-auth-clients", "no"]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{self.port}.conf",
                     "--cluster-node-timeout", "5000", "--cluster-require-full-coverage", "no"]
        if self.cluster:  # a restarted cluster node must not remember a dead topology
            (self.dir / f"nodes-{self.port}.conf").unlink(missing_ok=True)
        with open(self.dir / "server.log", "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=self.dir)
        self.wait_ready()
        return self

    def client(self) -> redis.Redis:
        tls = {"ssl": True, "ssl_ca_certs": str(self.tls.ca)} if self.tls else {}
        return redis.Redis(host=HOST, port=self.port, socket_timeout=5, socket_connect_timeout=2, **tls)

    def wait_ready(self, timeout_s: float = 15.0) -> None:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited: "
                                   f"{(self.dir / 'server.log').read_text()[-500:]}")
            try:
                if self.client().ping():
                    return
            except (redis.AuthenticationError, redis.ResponseError):
                return  # it answered: a server with requirepass refuses PING before AUTH
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {self.port} did not answer PING within {timeout_s} s")

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def pause(self) -> None:
        assert self.proc is not None
        stop_and_wait(self.proc.pid)  # returns once nothing of the server runs

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        stop_process(self.proc)  # SIGCONT first: a paused server cannot handle SIGTERM
        self.proc = None


@dataclass(frozen=True)
class TlsFiles:
    """A CA and a server certificate for 127.0.0.1 made with the openssl command (PEM files)."""

    ca: Path
    cert: Path
    key: Path

    @classmethod
    def make(cls, directory: Path) -> TlsFiles:
        openssl = shutil.which("openssl")
        if not openssl:
            raise RuntimeError("openssl is not installed; run `make test` (it installs it) or apt-get install openssl")
        d = directory
        d.mkdir(parents=True, exist_ok=True)
        (d / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
        steps = [
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=kvtier test CA",
             "-keyout", "ca.key", "-out", "ca.crt"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
             "-out", "server.csr"],
            ["x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "san.cnf", "-out", "server.crt"],
        ]
        for step in steps:
            subprocess.run([openssl, *step], cwd=d, check=True, capture_output=True, timeout=60)
        return cls(d / "ca.crt", d / "server.crt", d / "server.key")


class RedisClusterServers:
    """Three masters on 127.0.0.1 joined by ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, workdir: Path) -> None:
        _, self.cli_bin = redis_binaries()
        self.nodes = [RedisServer(workdir, cluster=True) for _ in range(3)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        for node in self.nodes:
            node.start()
        addrs = [f"{HOST}:{n.port}" for n in self.nodes]
        out = subprocess.run([self.cli_bin, "--cluster", "create", *addrs, "--cluster-replicas", "0",
                              "--cluster-yes"], check=False, capture_output=True, text=True, timeout=60)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-400:]} {out.stderr[-400:]}")
        end = time.monotonic() + 30
        while time.monotonic() < end:
            states = [n.client().execute_command("CLUSTER", "INFO") for n in self.nodes]
            if all(b"cluster_state:ok" in (s if isinstance(s, bytes) else str(s).encode()) for s in states):
                return self
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok within 30 s")

    def node_of(self, rkey: bytes) -> RedisServer:
        """The master holding ``rkey``'s slot."""
        slot = int(self.nodes[0].client().execute_command("CLUSTER", "KEYSLOT", rkey))
        for start, end, master, *_replicas in self.nodes[0].client().execute_command("CLUSTER", "SLOTS"):
            if int(start) <= slot <= int(end):
                return self._by_port(int(master[1]))
        raise RuntimeError(f"no node serves slot {slot}")

    def _by_port(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


class DelayProxy:
    """A TCP proxy on 127.0.0.1 that forwards to ``target_port``, holding each chunk of bytes
    ``delay_s`` seconds in each direction, and passing the server's replies on at no more than
    ``reply_bytes_s`` bytes per second (a slow link for large values; small replies such as a
    lookup's pass at once).  Both settable while running.  Daemon threads; ``close()`` stops it."""

    def __init__(self, target_port: int, delay_s: float = 0.0, reply_bytes_s: float | None = None) -> None:
        self.target_port = target_port
        self.delay_s = delay_s
        self.reply_bytes_s = reply_bytes_s
        self.listener = socket.create_server((HOST, 0))
        self.port = self.listener.getsockname()[1]
        self._closed = False
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://{HOST}:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((HOST, self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self._socks += [client, upstream]
            for src, dst, replies in ((client, upstream, False), (upstream, client, True)):
                threading.Thread(target=self._pump, args=(src, dst, replies), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                if self.delay_s:
                    time.sleep(self.delay_s)
                view = memoryview(data)
                while replies and self.reply_bytes_s and len(view) > 4096:  # 4 KiB pieces at the rate
                    dst.sendall(view[:4096])
                    view = view[4096:]
                    time.sleep(4096 / self.reply_bytes_s)
                dst.sendall(view)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self.listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate`` until true or ``timeout_s`` passed; its last value."""
    end = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() > end:
            return False
        time.sleep(interval_s)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except OSError:
        return False
