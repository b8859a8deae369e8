"""The messages between an engine and the node pool's owner (:mod:`kvtier.core.tiers.node`),
msgspec msgpack frames on a UNIX socket: a 4-byte little-endian length, then the message.

They carry keys, page numbers, lengths and lease ids only, never a payload.  Every request gets
exactly one reply, so a connection has at most one request in flight and the owner's queue is
bounded by its ``max_clients``.  ``version`` is checked in :class:`Hello`: a client of another
protocol version is refused with one sentence.
"""

from __future__ import annotations

import socket
import struct

import msgspec

VERSION = 3
"""2: the pool carries the presence table (:mod:`~kvtier.core.tiers.node.presence`); 3: key spaces
(:mod:`~kvtier.core.tiers.node.names`): ``alloc``, ``keys`` and ``clear`` carry the engine's
space, ``listed`` each value's."""
MAX_FRAME_BYTES = 4 << 20
"""Largest message either side accepts (a batch of 100,000 keys is about 2 MiB)."""
_LEN = struct.Struct("<I")


class Hello(msgspec.Struct, tag="hello", array_like=True):
    version: int
    client: str


class Lookup(msgspec.Struct, tag="lookup", array_like=True):
    namespace: bytes
    keys: list[bytes]


class Pin(msgspec.Struct, tag="pin", array_like=True):
    namespace: bytes
    keys: list[bytes]
    release: list[int]


class Release(msgspec.Struct, tag="release", array_like=True):
    leases: list[int]


class Alloc(msgspec.Struct, tag="alloc", array_like=True):
    """Pages for values of ``namespace`` named ``keys`` (pool names), in key space ``space``."""

    namespace: bytes
    keys: list[bytes]
    value_bytes: list[int]
    release: list[int]
    space: int = 0


class Commit(msgspec.Struct, tag="commit", array_like=True):
    leases: list[int]
    abort: list[int]


class Delete(msgspec.Struct, tag="delete", array_like=True):
    namespace: bytes
    keys: list[bytes]


class Clear(msgspec.Struct, tag="clear", array_like=True):
    """Delete the values of ``namespace`` in key space ``space``; their pool names."""

    namespace: bytes
    space: int = 0


class Keys(msgspec.Struct, tag="keys", array_like=True):
    """The pool names of the values of ``namespace`` in key space ``space``."""

    namespace: bytes
    space: int = 0


class Usage(msgspec.Struct, tag="usage", array_like=True):
    pass


class Listing(msgspec.Struct, tag="listing", array_like=True):
    """Values of ``namespaces`` (every namespace: empty), ``limit`` from position ``start`` (the
    tools' blob store, :mod:`~kvtier.core.tiers.node.blobs`)."""

    namespaces: list[bytes]
    start: int
    limit: int


class Stats(msgspec.Struct, tag="stats", array_like=True):
    """The pool's numbers; with ``check``, also the index's first broken invariant (a walk over
    every value, 1.3 s on 262,144 values: tests and ``check`` only, never an engine's start)."""

    check: bool = False


Request = Hello | Lookup | Pin | Release | Alloc | Commit | Delete | Clear | Keys | Usage | Stats | Listing


class Welcome(msgspec.Struct, tag="welcome", array_like=True):
    pool_path: str
    pool_id: bytes
    epoch: int
    lease_s: float


# Each reply to a data request carries ``usage``: the (bytes, values) its connection is counted
# for (UsageReply), so an engine knows its usage without asking (Tier.usage does no I/O).


class Found(msgspec.Struct, tag="found", array_like=True):
    present: list[bool]
    usage: tuple[int, int] = (0, 0)


class Pinned(msgspec.Struct, tag="pinned", array_like=True):
    """Per key ``(lease, first page, value bytes, generation)``, or ``None`` when absent."""

    leases: list[tuple[int, int, int, int] | None]
    usage: tuple[int, int] = (0, 0)


PRESENT = 1
NO_ROOM = 2


class Allocated(msgspec.Struct, tag="allocated", array_like=True):
    """Per key ``(lease, first page, generation)``, or :data:`PRESENT` / :data:`NO_ROOM`."""

    grants: list[tuple[int, int, int] | int]
    usage: tuple[int, int] = (0, 0)


class Done(msgspec.Struct, tag="done", array_like=True):
    ok: list[bool]
    usage: tuple[int, int] = (0, 0)


class KeyList(msgspec.Struct, tag="keylist", array_like=True):
    keys: list[bytes]
    usage: tuple[int, int] = (0, 0)


class Listed(msgspec.Struct, tag="listed", array_like=True):
    """Per value ``(namespace, pool name, value bytes, written at: seconds since the epoch, 0
    unknown, key space)``; ``more``: whether values follow."""

    values: list[tuple[bytes, bytes, int, float, int]]
    more: bool


class UsageReply(msgspec.Struct, tag="usagereply", array_like=True):
    """What this client is counted for: the bytes and values it wrote that the pool still holds
    (plus, for the oldest live engine connection, one that pinned or allocated, the values whose
    writer is gone), so the sum over every
    engine on the host is the pool's usage, counted once."""

    used_bytes: int
    num_values: int


class StatsReply(msgspec.Struct, tag="statsreply", array_like=True):
    used_bytes: int
    capacity_bytes: int
    num_values: int
    leases: int
    clients: int
    epoch: int
    problem: str


class Refused(msgspec.Struct, tag="refused", array_like=True):
    reason: str


Reply = Welcome | Found | Pinned | Allocated | Done | KeyList | UsageReply | StatsReply | Refused | Listed

ENCODER = msgspec.msgpack.Encoder()
REQUESTS = msgspec.msgpack.Decoder(Request)
REPLIES = msgspec.msgpack.Decoder(Reply)


def frame(message: msgspec.Struct) -> bytes:
    """``message`` as one frame (length prefix and msgpack body)."""
    body = ENCODER.encode(message)
    return _LEN.pack(len(body)) + body


def frame_length(head: bytes) -> int:
    """The body length a 4-byte frame head announces.

    Raises:
        ValueError: more than :data:`MAX_FRAME_BYTES`.
    """
    (n,) = _LEN.unpack(head)
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {n} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    return n


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    """``n`` bytes from a blocking ``sock`` (its timeout bounds each wait).

    Raises:
        ConnectionError: the peer closed the connection.
        TimeoutError: the socket's timeout passed.
    """
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("the node pool's owner closed the connection")
        got += k
    return bytes(buf)
