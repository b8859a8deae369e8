"""Store-level faults of the s3 tier against a real ``rclone serve s3`` (tests/s3_servers.py).

``kill -9`` then a restart (the objects survive, as in a real bucket), ``SIGSTOP`` then
``SIGCONT``, and a server that answers every request with ``500``.  In every one: no wrong byte
is served, every lookup and load returns within the deadline (plus scheduling slack on a loaded
2-core machine), and hits resume once the server is back.
"""

from __future__ import annotations

import socket
import threading
import time

from ..redis_servers import wait_until
from .helpers import chain_of, make_store, payload, shared_prefix
from .tier_harness import s3_credentials_file

DEADLINE_S = 0.3
SLACK_S = 0.7  # thread scheduling on a shared, loaded test machine
FAULT_SETTINGS = {"shared_deadline_s": DEADLINE_S, "shared_transfer_deadline_s": DEADLINE_S,
                  "s3_timeout_s": 1.0, "s3_connect_timeout_s": 0.3, "s3_max_retries": 0,
                  "s3_breaker_failures": 2, "s3_breaker_probe_s": 0.5}


def host(url: str, bucket: str, creds, **settings):
    return make_store(None, cpu_chunks=32, s3_endpoint_url=url, s3_bucket=bucket, s3_allow_http=True,
                      s3_credentials_file=str(creds), **{**FAULT_SETTINGS, **settings})


def put_chain(store, chain):
    store.put(chain, [payload(k) for k in chain])
    return store.flush(10)


def timed_lookup(store, chain) -> tuple[int, float]:
    t0 = time.monotonic()
    n = shared_prefix(store, chain)
    return n, time.monotonic() - t0


def remote_load(store, chain, n):
    """Load ``n`` chunks; assert every delivered byte is right; returns (chunks, seconds)."""
    t0 = time.monotonic()
    handle = store.prepare_load(chain, max_chunks=n)
    seconds = time.monotonic() - t0
    assert [buf.tobytes() for buf in handle.buffers] == [payload(k) for k in chain[:handle.num_chunks]]
    store.complete_load(handle, True)
    return handle.num_chunks, seconds


def hits_resume(url, bucket, creds, chain) -> bool:
    """A fresh host (nothing cached locally) finds and loads the whole chain."""
    probe = host(url, bucket, creds)
    try:
        return timed_lookup(probe, chain)[0] == len(chain) and remote_load(probe, chain, len(chain))[0] == len(chain)
    finally:
        probe.close()


def seed(url, bucket, creds, chain) -> bool:
    """Write ``chain`` through a fresh host until a fresh host loads all of it (within 10 s).  Under load
    ``rclone serve s3`` answers an occasional PUT with 500 InternalError (seen once in CI, 6 December 2026);
    the tier counts it as a failed write and the chunk is not there.  That is the server's, not the fault
    these tests inject, so the set-up writes again rather than fail."""
    def attempt() -> bool:
        writer = host(url, bucket, creds)
        try:
            put_chain(writer, chain)
        finally:
            writer.close()
        return hits_resume(url, bucket, creds, chain)
    return wait_until(attempt, timeout_s=10)


def test_kill9_then_restart(s3_factory, tmp_path):
    server = s3_factory()
    bucket, creds = server.make_bucket(), s3_credentials_file(tmp_path, server)
    writer, reader = host(server.url, bucket, creds), host(server.url, bucket, creds)
    try:
        chain = chain_of(1, 4)
        assert seed(server.url, bucket, creds, chain)

        server.kill9()
        for _ in range(4):  # refused connections: misses, fast; the breaker opens
            n, seconds = timed_lookup(reader, chain)
            assert n == 0 and seconds < DEADLINE_S + SLACK_S
        got, seconds = remote_load(reader, chain, 4)
        assert got == 0 and seconds < DEADLINE_S + SLACK_S
        tier = reader.tier("s3")
        assert tier.breaker.num_opened >= 1
        put_chain(writer, chain_of(2, 3))  # writes while down are skipped and counted, never block
        assert writer.tier("s3").wire_stats().skipped_writes >= 1

        server.start()  # same port and directory: the objects are still there
        assert wait_until(lambda: timed_lookup(reader, chain)[0] == 4 and remote_load(reader, chain, 4)[0] == 4,
                          timeout_s=15)
    finally:
        writer.close()
        reader.close()


def test_sigstop_then_sigcont(s3_factory, tmp_path):
    server = s3_factory()
    bucket, creds = server.make_bucket(), s3_credentials_file(tmp_path, server)
    writer, reader = host(server.url, bucket, creds), host(server.url, bucket, creds)
    try:
        chain = chain_of(4, 4)
        assert seed(server.url, bucket, creds, chain)

        server.pause()  # long enough for the breaker to open
        try:
            paused_until = time.monotonic() + 3.0
            worst = 0.0
            while time.monotonic() < paused_until:
                n, seconds = timed_lookup(reader, chain)
                assert n == 0
                worst = max(worst, seconds)
                got, seconds = remote_load(reader, chain, 4)
                assert got == 0
                worst = max(worst, seconds)
            assert worst < DEADLINE_S + SLACK_S, f"a call took {worst:.2f} s while the server was paused"
        finally:
            server.resume()
        assert wait_until(lambda: timed_lookup(reader, chain)[0] == 4 and remote_load(reader, chain, 4)[0] == 4,
                          timeout_s=15)
    finally:
        writer.close()
        reader.close()


class Http500:
    """A TCP server on 127.0.0.1 that answers every HTTP request with ``500 Internal Server Error``
    and an S3 error body (an S3 server failing inside), for the breaker's sake."""

    BODY = b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code></Error>'

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2.0)
            try:
                head = b""
                while b"\r\n\r\n" not in head:
                    piece = conn.recv(65536)
                    if not piece:
                        return
                    head += piece
                self.requests += 1
                conn.sendall(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/xml\r\n"
                             b"Connection: close\r\nContent-Length: " + str(len(self.BODY)).encode() +
                             b"\r\n\r\n" + self.BODY)
            except OSError:
                return

    def close(self) -> None:
        self.listener.close()


def test_a_server_answering_500_is_a_miss_and_opens_the_breaker(tmp_path, s3_server):
    failing = Http500()
    creds = s3_credentials_file(tmp_path, s3_server)
    # the breaker stays open for the whole test (no half-open probe reaches the server meanwhile)
    store = host(failing.url, "kvtier-500", creds, s3_breaker_probe_s=60.0)
    try:
        chain = chain_of(9, 4)
        for _ in range(4):
            n, seconds = timed_lookup(store, chain)
            assert n == 0 and seconds < DEADLINE_S + SLACK_S
        stats = store.tier("s3").wire_stats()
        assert stats.errors["lookup"] >= 2 and stats.breaker_opened >= 1
        # requests of calls the deadline gave up on (the client's retries) may still arrive: wait
        # until none has for 0.5 s (the first failing calls opened the breaker, so none are new)
        asked, quiet_since, deadline = failing.requests, time.monotonic(), time.monotonic() + 10
        while time.monotonic() - quiet_since < 0.5 and time.monotonic() < deadline:
            time.sleep(0.05)
            if failing.requests != asked:
                asked, quiet_since = failing.requests, time.monotonic()
        assert timed_lookup(store, chain)[0] == 0
        assert failing.requests == asked  # the open breaker keeps calls off the failing server
    finally:
        store.close()
        failing.close()


def test_fault_lines_name_the_short_cause_and_a_new_cause_at_once(s3_factory, tmp_path, caplog):
    """A dead gateway is one line naming "connection refused to http://127.0.0.1:PORT" (not obstore's
    ~38-line Rust debug dump); a server back without the bucket is logged at once (within the 10 s
    of the last line) as ``HTTP 404 NoSuchBucket``; the breaker closing (a lookup answered) is one INFO
    line."""
    import logging

    from .. import s3_servers

    caplog.set_level(logging.INFO, logger="kvtier")
    server = s3_factory()
    bucket, creds = server.make_bucket(), s3_credentials_file(tmp_path, server)
    writer = host(server.url, bucket, creds)
    try:
        assert put_chain(writer, chain_of(1, 2))
        server.kill9()
        put_chain(writer, chain_of(2, 3))
        refused = [r.getMessage() for r in caplog.records if "connection refused" in r.getMessage()]
        assert refused and f"(connection refused to {server.url})" in refused[0], refused
        assert "Debug source" not in caplog.text and "RetryError" not in caplog.text
        assert all("\n" not in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)

        empty = s3_servers.S3Server(tmp_path / "no-buckets", port=server.port)  # same endpoint, the bucket gone
        empty.start()
        try:
            fresh = iter(range(10, 1000))

            def logged_no_bucket() -> bool:
                put_chain(writer, chain_of(next(fresh), 3))
                return "HTTP 404 NoSuchBucket" in caplog.text
            assert wait_until(logged_no_bucket, timeout_s=8)  # well within the 10 s of the refused line
            assert "reachable again" not in caplog.text  # every call failed: the breaker never closed
            assert wait_until(lambda: timed_lookup(writer, chain_of(next(fresh), 2)) is not None
                              and "reachable again after" in caplog.text, timeout_s=8)  # a lookup answered (404)
            back = [r for r in caplog.records if "reachable again after" in r.getMessage()]
            assert len(back) == 1 and back[0].levelno == logging.INFO and "s3 tier" in back[0].getMessage()
            assert "Debug source" not in caplog.text
        finally:
            empty.stop()
    finally:
        writer.close()
