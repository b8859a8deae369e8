"""Pipelined ``SET key value EX ttl NX`` whose values go on the wire as (header, payload) pieces.

redis-py packs each argument as one piece, so a value made of a 64-byte header and a caller's
payload would first have to be joined into one buffer: a copy of every byte written.  Here the
RESP framing is written by hand (``$<len>\\r\\n`` + header + payload + ``\\r\\n``), so the server
receives one bulk string, stores one value written by one command (header and payload can never
be evicted separately), and the payload is sent straight from the caller's memory.

The commands of one call go out back to back on one connection and the replies are read after
the last one (no barrier between batches: the server buffers its replies).  Headers may be
produced while the earlier chunks are on the wire: the writer waits for the ``ready`` semaphore
(one release per header) before sending each chunk.

Standalone servers only (a Cluster pipeline routes keys per node; the tier keeps redis-py's
pipeline there).  Source of the framing: the RESP2 spec, https://redis.io/docs/latest/develop/reference/protocol-spec/
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

CRLF = b"\r\n"


class WriteAbandoned(Exception):
    """The caller stopped producing headers (it gave up or failed); the connection was dropped."""


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
        tail = b""
        for i, (rk, payload) in enumerate(zip(rkeys, payloads, strict=True)):
            if not ready.acquire(timeout=wait_s) or abandoned():
                raise WriteAbandoned(f"header {i} of {len(rkeys)} not ready")
            header = headers[i]
            head = b"%b*6\r\n$3\r\nSET\r\n%b$%d\r\n%b" % (tail, _bulk(rk), len(header) + payload.nbytes, header)
            conn.send_packed_command([head, payload], check_health=False)
            tail = ex
        conn.send_packed_command([tail], check_health=False)
        return [conn.read_response() is not None for _ in rkeys]
    except BaseException:
        conn.disconnect()  # a half-sent command or unread replies: the socket is out of step
        raise
    finally:
        pool.release(conn)
