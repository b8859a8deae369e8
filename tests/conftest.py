"""Shared fixtures for the kvtier test suite.

Redis: one standalone server and one 3-master Cluster per test session, real ``redis-server``
processes on 127.0.0.1 (tests/redis_servers.py), stopped when the session ends.  Tests that fault
a server (kill, pause, restart) start their own with ``redis_factory``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.redis_servers import RedisClusterServers, RedisServer


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisClusterServers]:
    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., RedisServer]]:
    """Start private redis-servers for one test (stopped afterwards, whatever the test did to them)."""
    started: list[RedisServer] = []

    def start(**kwargs: object) -> RedisServer:
        server = RedisServer(tmp_path / f"srv{len(started)}", **kwargs)  # type: ignore[arg-type]
        started.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in started:
            server.stop()


@pytest.fixture
def key_prefix() -> str:
    """A key prefix no other test uses, so tests sharing a server never see each other's chunks."""
    return f"test-{uuid.uuid4().hex[:12]}:"
