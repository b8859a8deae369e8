"""The Redis server that ``bench compare``'s ``kvtier-redis`` arm shares between its replicas.

``--redis auto`` starts a private ``redis-server`` on 127.0.0.1 (a free port, no persistence, its
files and log under the report directory) for the whole comparison and stops it at the end;
``--redis URL`` uses a server the operator runs, checked with one ``PING`` before any vLLM server
starts.  Every run of an arm whose connector config has a ``redis_url`` gets its own key prefix
(``<its prefix>bench-<id>-run<k>:``) and those keys are deleted after the run, so no run starts
warm and no key outside the run's prefix is ever touched.
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import Self

import redis

from kvtier.bench.arms import ArmSpec
from kvtier.core.config import redact_url
from kvtier.core.errors import ServerStartError
from kvtier.launch.localserver import stop_process, wait_until_answers

HOST = "127.0.0.1"
DEFAULT_KEY_PREFIX = "kvtier:"
"""``redis_key_prefix``'s default (kvtier.core.config.KVTierConfig)."""


def _client(url: str, timeout_s: float) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)


def check_redis_url(url: str, timeout_s: float = 3.0) -> None:
    """One ``PING`` to the server at ``url``.

    Raises:
        ValueError: the URL is not ``redis://`` / ``rediss://``, or no Redis answered within
            ``timeout_s`` seconds (the message names the URL with its password redacted).
    """
    shown = redact_url(url)
    if not url.startswith(("redis://", "rediss://")):
        raise ValueError(f"--redis {shown} must be 'auto' or a redis:// or rediss:// URL, e.g. redis://127.0.0.1:6379/0")
    try:
        _client(url, timeout_s).ping()
    except (redis.RedisError, OSError, ValueError) as exc:
        raise ValueError(f"no Redis answered PING at {shown} ({type(exc).__name__}); start one there, fix the URL, "
                         "or use --redis auto") from None


class LocalRedis:
    """A private ``redis-server`` on 127.0.0.1 for one comparison (``--redis auto``).

    Attributes:
        port: its TCP port; url: ``redis://127.0.0.1:PORT/0``; log_path: its log file.
    """

    def __init__(self, workdir: Path, port: int) -> None:
        self.dir = workdir
        self.port = port
        self.url = f"redis://{HOST}:{port}/0"
        self.log_path = workdir / "redis-server.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, workdir: Path, timeout_s: float = 15.0) -> LocalRedis:
        """Start one and wait for its ``PING``.

        Raises:
            ServerStartError: ``redis-server`` is not installed, exited, or did not answer in time.
        """
        from kvtier.launch.serve import free_port

        binary = shutil.which("redis-server")
        if binary is None:
            raise ServerStartError("--redis auto needs redis-server on PATH (Debian: apt-get install -y redis-server), "
                                   "or pass --redis redis://HOST:PORT/DB of a running server")
        workdir.mkdir(parents=True, exist_ok=True)
        server = cls(workdir, free_port())
        args = [binary, "--bind", HOST, "--port", str(server.port), "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--dir", str(workdir), "--loglevel", "warning"]
        with open(server.log_path, "ab") as log:
            server._proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        try:  # stopped on any way out but success (a SIGTERM raising SystemExit in the wait included)
            wait_until_answers(server._proc, server._pings, timeout_s, "redis-server", server.log_path)
            return server
        except BaseException:
            server.stop()
            raise

    def _pings(self) -> bool:
        try:
            return bool(_client(self.url, 1.0).ping())
        except redis.RedisError:
            return False

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        proc, self._proc = self._proc, None
        stop_process(proc)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_tag() -> str:
    """A short random id that keeps one comparison's keys apart from any other's."""
    return secrets.token_hex(4)


def with_run_prefix(arm: ArmSpec, tag: str, repeat: int) -> tuple[ArmSpec, str | None, str | None]:
    """The arm with a key prefix of its own for run ``repeat``, the prefix and the URL (both ``None``
    when the arm's connector has no ``redis_url``: it is returned unchanged)."""
    config = arm.kv_transfer_config or {}
    extra = config.get("kv_connector_extra_config") or {}
    url = extra.get("redis_url")
    if not url:
        return arm, None, None
    prefix = f"{extra.get('redis_key_prefix', DEFAULT_KEY_PREFIX)}bench-{tag}-{arm.name}-run{repeat}:"
    new = {**config, "kv_connector_extra_config": {**extra, "redis_key_prefix": prefix}}
    return dataclasses.replace(arm, kv_transfer_config=new), prefix, str(url)


def delete_prefix(url: str, prefix: str, timeout_s: float = 10.0) -> int:
    """Delete every key under ``prefix`` (``SCAN`` + ``UNLINK``); the number deleted.

    Raises:
        redis.RedisError: the server did not answer (the keys then expire at ``redis_ttl_s``).
    """
    client = _client(url, timeout_s)
    deleted = 0
    batch: list[bytes] = []
    for key in client.scan_iter(match=f"{prefix}*".encode(), count=1000):
        batch.append(key)
        if len(batch) >= 1000:
            deleted += int(client.unlink(*batch))
            batch.clear()
    if batch:
        deleted += int(client.unlink(*batch))
    return deleted
