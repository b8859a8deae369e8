"""Pipelined ``SET``/``GET`` batches on one standalone connection without redis-py's copies.

**SET**: ``SET key value EX ttl NX`` whose values go on the wire as (header, payload) pieces.

redis-py packs each argument as one piece, so a value made of a 64-byte header and a caller's
payload would first have to be joined into one buffer: a copy of every byte written.  Here the
RESP framing is written by hand (``$<len>\\r\\n`` + header + payload + ``\\r\\n``), so the server
receives one bulk string, stores one value written by one command (header and payload can never
be evicted separately), and the payload is sent straight from the caller's memory.

The commands of one call go out back to back on one connection and the replies are read after
the last one (no barrier between batches: the server buffers its replies).  Headers may be
produced while the earlier chunks are on the wire: the writer waits for the ``ready`` semaphore
(one release per header) before sending each chunk.

**GET**: redis-py's pure-Python reply parser reads a large value 64 KiB at a time into a
``BytesIO`` and copies it out again (several ms of client CPU per 4 MiB value); :func:`get_many`
reads each reply's length line itself and receives the value with ``recv_into`` straight into a
buffer the tier hands out (one copy, done by the kernel).  The tier verifies it and copies the
payload into the caller's buffer on the caller's thread, so a read given up at the deadline never
writes into memory the caller has taken back.

Standalone servers only (a Cluster pipeline routes keys per node; the tier keeps redis-py's
pipeline there).  Connections come from the client's pool and go back to it; after any error the
connection is dropped (its socket may be mid-reply).  Source of the framing: the RESP2 spec, https://redis.io/docs/latest/develop/reference/protocol-spec/
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.core.tiers.split import WriteAbandoned

CRLF = b"\r\n"
SMALL_BYTES = 64 << 10
"""Payloads shorter than this are joined with the framing around them (one send, not two)."""


class ReplyError(Exception):
    """The server answered a command with an error, or with bytes that are not a RESP reply."""


def _bulk(arg: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


def set_many(client: Any, rkeys: Sequence[bytes], headers: Sequence[bytes],
             payloads: Sequence[memoryview], ttl_s: int, ready: threading.Semaphore,
             abandoned: Callable[[], bool], wait_s: float) -> list[bool]:
    """Send ``SET rkeys[i] headers[i]+payloads[i] EX ttl_s NX`` for every ``i`` on one connection of
    ``client``'s pool, then read the replies; whether each value was created (``False``: the key
    was present).

    ``headers`` may still be filling when this starts: ``ready`` is released once per header
    appended (in order); this waits at most ``wait_s`` for each one and stops when ``abandoned()``.

    Raises:
        WriteAbandoned: a header did not come in time or the caller abandoned the call.
        redis.RedisError / OSError: the server or the network failed (the connection is dropped).
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    ex = b"".join((CRLF, _bulk(b"EX"), _bulk(str(ttl_s).encode()), _bulk(b"NX")))
    try:
        small = bytearray()  # framing and small payloads, sent together before the next large payload
        for i, rk in enumerate(rkeys):
            if not ready.acquire(timeout=wait_s) or abandoned():
                raise WriteAbandoned(f"header {i} of {len(rkeys)} not ready")
            header, payload = headers[i], payloads[i]  # a payload a codec changes is ready with its header
            small += b"*6\r\n$3\r\nSET\r\n%b$%d\r\n%b" % (_bulk(rk), len(header) + payload.nbytes, header)
            if payload.nbytes < SMALL_BYTES:
                small += payload
            else:
                conn.send_packed_command([bytes(small), payload], check_health=False)
                small.clear()
            small += ex
            if len(small) >= SMALL_BYTES:
                conn.send_packed_command([bytes(small)], check_health=False)
                small.clear()
        if small:
            conn.send_packed_command([bytes(small)], check_health=False)
        return [conn.read_response() is not None for _ in rkeys]
    except BaseException:
        conn.disconnect()  # a half-sent command or unread replies: the socket is out of step
        raise
    finally:
        pool.release(conn)


class _Replies:
    """Reads RESP replies from a socket: short lines through a small buffer, bulk values straight
    into the caller's buffer (``recv_into``)."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.buf = bytearray(1 << 16)
        self.start = self.end = 0

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buf):  # keep the unread part, at the front
            self.buf[:self.end - self.start] = self.buf[self.start:self.end]
            self.start, self.end = 0, self.end - self.start
        n = self.sock.recv_into(memoryview(self.buf)[self.end:])
        if not n:
            raise ConnectionError("the server closed the connection mid-reply")
        self.end += n

    def line(self) -> bytes:
        while (i := self.buf.find(CRLF, self.start, self.end)) < 0:
            if self.end - self.start > 1024:
                raise ReplyError("a reply line longer than 1 KiB: not a RESP reply")
            self._fill()
        out = bytes(self.buf[self.start:i])
        self.start = i + 2
        return out

    def read_into(self, view: memoryview) -> None:
        have = min(self.end - self.start, view.nbytes)
        view[:have] = self.buf[self.start:self.start + have]
        self.start += have
        while have < view.nbytes:
            n = self.sock.recv_into(view[have:])
            if not n:
                raise ConnectionError("the server closed the connection mid-value")
            have += n

    def bulk(self, take_buffer: Callable[[int], bytearray | memoryview]) -> memoryview | None:
        """One bulk-string reply into ``take_buffer(length)`` (at least ``length`` bytes); ``None`` for nil."""
        line = self.line()
        kind = line[:1]
        if kind == b"-":
            raise ReplyError(line[1:].decode("utf-8", "replace"))
        if kind == b"_" or line == b"$-1":  # nil (RESP3 / RESP2)
            return None
        if kind != b"$":
            raise ReplyError(f"expected a bulk string, got {line[:20]!r}")
        length = int(line[1:])
        value = memoryview(take_buffer(length))[:length]
        self.read_into(value)
        if self.line() != b"":
            raise ReplyError("a bulk string not followed by CRLF")
        return value


def get_many(client: Any, rkeys: Sequence[bytes], take_buffer: Callable[[int], bytearray | memoryview]) -> list[memoryview | None]:
    """``GET`` every key of ``rkeys`` on one connection of ``client``'s pool; each value (a view of a
    buffer from ``take_buffer(length)``) or ``None`` where the key is absent.

    Raises:
        ReplyError: an error reply (e.g. a key of another type) or bytes that are not RESP.
        redis.RedisError / OSError: the server or the network failed (the connection is dropped).
    """
    pool = client.connection_pool
    conn = pool.get_connection()
    try:
        conn.send_packed_command(conn.pack_commands([("GET", rk) for rk in rkeys]), check_health=False)
        replies = _Replies(conn._sock)  # the parser's own buffer is empty: get_connection checked
        return [replies.bulk(take_buffer) for _ in rkeys]
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)
