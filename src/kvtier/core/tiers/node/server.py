"""The node pool's owner: ``kvtier node serve`` (:mod:`kvtier.cli.node`) runs :func:`serve`.

One process per host.  It creates (or, on a restart, takes over) the pool file, keeps the
placement state (:class:`~kvtier.core.tiers.node.index.PoolIndex`) and answers the engines'
messages (:mod:`~kvtier.core.tiers.node.protocol`) on a UNIX socket, one asyncio event loop, no
payload bytes.  Bounded: at most ``max_clients`` connections (one more is refused with one
sentence), one request in flight per connection, frames of at most
:data:`~kvtier.core.tiers.node.protocol.MAX_FRAME_BYTES`; leases end when their connection closes
and after ``lease_s``.

Presence: the owner keeps the pool's presence table (:mod:`~kvtier.core.tiers.node.presence`) and
writes its heartbeat every :data:`~kvtier.core.tiers.node.presence.HEARTBEAT_S` from the same event
loop (0 when it stops, and into a pool it replaces), so engines answer lookups from the pool
while this loop runs and ask over the socket otherwise.

Owner restart: the pool file is reused when its layout matches (same size and page bytes): the
epoch is bumped, generations continue above the pool's highest, and the committed values the
heads mark are indexed again (:meth:`~kvtier.core.tiers.node.index.PoolIndex.recover`), each in
its key space (:mod:`~kvtier.core.tiers.node.names`), so engines find it warm.  Values an owner
before key spaces published under a ``shared_secret`` (a MAC in the head's space 0: no engine
names them now) are dropped once, counted in a warning.  Two owners of one pool are refused
before either touches it (an exclusive ``flock`` on ``<pool>.lock``, which the kernel drops when
the owner dies).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import socket
import time
from pathlib import Path
from typing import NamedTuple

from kvtier.core import envelope
from kvtier.core.errors import UserError
from kvtier.core.tiers.node import protocol as p
from kvtier.core.tiers.node.index import Name, PoolIndex
from kvtier.core.tiers.node.names import NO_SPACE
from kvtier.core.tiers.node.pool import Pool, PoolError, create_pool, foreign_file, open_pool
from kvtier.core.tiers.node.presence import HEARTBEAT_S, PresenceTable
from kvtier.core.tiers.node.settings import socket_path_problem

log = logging.getLogger(__name__)


class ServeOptions(NamedTuple):
    """What ``kvtier node serve`` was given.

    Attributes:
        pool: the pool file (under /dev/shm or a hugetlbfs mount).
        node_gib: its size, GiB (2^30 bytes).
        socket: the UNIX socket engines connect to (their ``node_socket``).
        page_kib: bytes of one page, KiB (a value takes whole pages).
        lease_s: longest a lease lives without its connection closing, seconds.
        max_clients: connections served at once.
    """

    pool: Path
    node_gib: float
    socket: Path
    page_kib: int = 256
    lease_s: float = 30.0
    max_clients: int = 256


def lock_path(pool: Path) -> Path:
    """The lock file of ``pool``: ``<pool>.lock`` beside it."""
    return pool.with_name(pool.name + ".lock")


def lock_pool(pool: Path) -> tuple[int, bool]:
    """An exclusive ``flock`` on ``<pool>.lock`` (taken before the pool is touched, so a second owner
    started by mistake never recreates a live owner's pool); the lock's fd, and whether this call
    created the file (a start refused later removes it: a refusal leaves nothing it created).  The
    kernel drops the lock when the owner dies.

    Raises:
        UserError: another owner holds it, or it cannot be created (one sentence).
    """
    path = lock_path(pool)
    created = False
    try:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            created = True
        except FileExistsError:
            fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        raise UserError(f"cannot create the pool's lock file {path} ({exc.strerror}); check --pool's directory "
                        "permissions") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        if created:  # not reached in practice: a file this call created has no other holder
            path.unlink(missing_ok=True)
        raise UserError(f"another kvtier node owner serves the pool {pool}; stop it first or give another "
                        "--pool") from None
    return fd, created


def refuse_foreign_pool(path: Path) -> None:
    """Refuse a ``--pool`` path that holds something other than a kvtier node pool (never overwritten).

    Raises:
        UserError: it is not a regular file, or does not start with a kvtier pool header (one sentence).
    """
    try:
        why = foreign_file(path)
    except PoolError as exc:
        raise UserError(f"{exc}; check --pool") from None
    if why is not None:
        raise UserError(f"--pool {path} exists and {why}; kvtier never overwrites it: remove it yourself or "
                        "give another --pool path")


def take_pool(opts: ServeOptions) -> tuple[Pool, str]:
    """The pool file mapped for this owner (whose lock :func:`lock_pool` holds): the existing one
    when its layout matches, else (a kvtier pool of another layout or size) created anew; its epoch
    bumped.  With it, why it was created anew (``""``: the existing pool taken as it is).

    Raises:
        UserError: it cannot be created (one sentence).
    """
    total = int(opts.node_gib * (1 << 30))
    page_bytes = opts.page_kib << 10
    pool: Pool | None = None
    anew = "no pool file was there"
    if opts.pool.exists():
        try:
            pool = open_pool(opts.pool)
        except PoolError as exc:  # a kvtier pool (refuse_foreign_pool) of an older layout, or cut short
            log.warning("kvtier node: %s; creating the pool anew (its values are lost)", exc)
            anew = str(exc)
        size = opts.pool.stat().st_size
        if pool is not None and (pool.page_bytes != page_bytes or size != total):
            anew = (f"its size changed: it was made for --node-gib {size / (1 << 30):g} --page-kib "
                    f"{pool.page_bytes >> 10}, this start asks for --node-gib {opts.node_gib:g} --page-kib "
                    f"{opts.page_kib}")
            log.warning("kvtier node: the pool %s: %s; creating it anew (its values are lost; restart with the "
                        "old sizes to keep them)", opts.pool, anew)
            PresenceTable(pool.slots, pool.meta).beat(0)  # engines still mapping it stop reading its table
            pool.close()
            pool = None
    if pool is None:
        try:
            pool = create_pool(opts.pool, total, page_bytes)
        except (PoolError, ValueError) as exc:
            raise UserError(f"{exc}; check --pool, --node-gib and that the mount has that much room") from None
    else:
        anew = ""
    pool.set_epoch(pool.epoch + 1)
    return pool, anew


class Owner:
    """The owner's state and its message handler (one event loop)."""

    def __init__(self, pool: Pool, opts: ServeOptions, anew: str = "") -> None:
        """``anew``: why ``pool`` was created anew (:func:`take_pool`; ``""``: the existing pool)."""
        self.pool = pool
        self.opts = opts
        self.index = PoolIndex(pool.gens, pool.heads, PresenceTable(pool.slots, pool.meta), pool.page_bytes,
                               opts.lease_s)
        self.dropped_unspaced = 0  # values of a secret from before key spaces, dropped by recover
        recovered = self.index.recover(self._name_at)
        log.info("kvtier node: pool %s, %d pages of %d KiB, epoch %d, %d values taken back%s", pool.path,
                 pool.num_pages, opts.page_kib, pool.epoch, recovered, f" (created anew: {anew})" if anew else "")
        if self.dropped_unspaced:
            log.warning("kvtier node: %d values written under a shared_secret before the pool had key spaces "
                        "were dropped (no engine of this kvtier can name them: they would be recomputed)",
                        self.dropped_unspaced)
        self._next_conn = 1

    def _name_at(self, page: int, nbytes: int, space: int) -> Name | None:
        """The (namespace, pool name) a value's envelope header says, ``None`` when it is not taken
        back: unreadable, of another length than its head, or of a digest kind its key space
        cannot have (a MAC in space 0: an owner before key spaces published it; counted)."""
        if nbytes < envelope.FIXED_BYTES:
            return None
        try:
            head = envelope.decode_header(self.pool.value(page, envelope.FIXED_BYTES))
        except Exception:  # noqa: BLE001 - an unreadable header is a value not taken back
            return None
        if head.header_bytes + head.stored_bytes != nbytes:
            return None
        if (head.kind == envelope.KIND_MAC) != (space != NO_SPACE):
            self.dropped_unspaced += head.kind == envelope.KIND_MAC
            return None
        return bytes(head.namespace), bytes(head.key)

    def handle(self, conn: int, req: p.Request) -> p.Reply:
        """One request's reply (the index is only ever touched from the event loop)."""
        now = time.monotonic()
        ix = self.index
        if isinstance(req, p.Pin):
            ix.release(conn, req.release)
            return p.Pinned(ix.pin(conn, req.namespace, req.keys, now))
        if isinstance(req, p.Alloc):
            ix.release(conn, req.release)
            return p.Allocated(ix.alloc(conn, req.namespace, req.keys, req.value_bytes, now, req.space))
        if isinstance(req, p.Commit):
            ix.release(conn, req.abort)
            return p.Done(ix.commit(conn, req.leases))
        if isinstance(req, p.Lookup):
            return p.Found(ix.lookup(req.namespace, req.keys))
        if isinstance(req, p.Release):
            ix.release(conn, req.leases)
            return p.Done([])
        if isinstance(req, p.Delete):
            return p.Done(ix.delete(req.namespace, req.keys))
        if isinstance(req, p.Clear):
            return p.KeyList(ix.clear(req.namespace, req.space))
        if isinstance(req, p.Keys):
            return p.KeyList(ix.keys(req.namespace, req.space))
        if isinstance(req, p.Listing):
            return p.Listed(*ix.listing(req.namespaces, req.start, min(req.limit, 10_000)))
        if isinstance(req, p.Usage):
            return p.UsageReply(*ix.usage_of(conn))
        if isinstance(req, p.Stats):
            return p.StatsReply(ix.used_bytes(), self.pool.capacity_bytes, len(ix.values), len(ix.leases),
                                len(ix.clients), self.pool.epoch, ix.problem() if req.check else "")
        return p.Refused("a second hello on one connection")

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._next_conn
        self._next_conn += 1
        try:
            hello = p.REQUESTS.decode(await reader.readexactly(p.frame_length(await reader.readexactly(4))))
            if not isinstance(hello, p.Hello) or hello.version != p.VERSION:
                writer.write(p.frame(p.Refused(f"this node pool's owner speaks protocol version {p.VERSION}; run "
                                               "the same kvtier version on the engines and the owner")))
                return
            if len(self.index.clients) >= self.opts.max_clients:
                writer.write(p.frame(p.Refused(f"the node pool's owner serves {self.opts.max_clients} connections "
                                               "already; raise --max-clients")))
                return
            self.index.attach(conn, hello.client, time.monotonic())
            writer.write(p.frame(p.Welcome(str(self.pool.path), self.pool.pool_id, self.pool.epoch,
                                           self.opts.lease_s)))
            while True:
                await writer.drain()
                body = await reader.readexactly(p.frame_length(await reader.readexactly(4)))
                reply = self.handle(conn, p.REQUESTS.decode(body))
                if isinstance(reply, (p.Found, p.Pinned, p.Allocated, p.Done, p.KeyList)):
                    reply.usage = self.index.usage_of(conn)
                writer.write(p.frame(reply))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            log.debug("kvtier node: connection %d ended: %s", conn, exc)  # (msgspec's DecodeError is a ValueError)
        finally:
            self.index.drop(conn)
            writer.close()

    async def expiry(self) -> None:
        """End stalled engines' leases every quarter ``lease_s``, and beat every ``HEARTBEAT_S``."""
        every_s = max(self.opts.lease_s / 4, 0.05)
        next_s = time.monotonic() + every_s
        while True:
            self.index.table.beat()
            await asyncio.sleep(HEARTBEAT_S)
            if time.monotonic() >= next_s:
                next_s = time.monotonic() + every_s
                if n := self.index.expire(time.monotonic()):
                    log.info("kvtier node: %d leases expired (an engine stalled)", n)


def not_a_directory(path: Path) -> str:
    """Why ``path``, which is not a directory, cannot hold a file: ``does not exist`` or what it is."""
    if not path.exists():
        return "does not exist"
    return "is a file, not a directory" if path.is_file() else "exists and is not a directory"


def claim_socket(path: Path) -> None:
    """Remove a stale socket file at ``path`` (one nobody listens on: its owner died).

    Raises:
        UserError: a live owner answers on it, the path is something else than a socket (a file,
            a directory, a symbolic link: never removed), or the directory does not exist.
    """
    if not path.parent.is_dir():
        raise UserError(f"--socket {path}: directory {path.parent} {not_a_directory(path.parent)}; create it or "
                        "give another path")
    if path.is_symlink() or (path.exists() and not path.is_socket()):
        # only a socket file is ever removed (a stale one, below): never a file, directory or link
        what = "a symbolic link" if path.is_symlink() else "a directory" if path.is_dir() else "not a socket"
        raise UserError(f"--socket {path} exists and is {what}; remove it yourself or give another --socket path")
    if path.exists():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink(missing_ok=True)  # nobody listens: left by an owner that died
        else:
            raise UserError(f"another kvtier node owner listens on {path}; stop it first or give another --socket")
        finally:
            probe.close()


def bind_socket(path: Path) -> socket.socket:
    """A UNIX socket bound to ``path`` (claimed by :func:`claim_socket`), bound before the pool is
    taken so that a path that cannot be a socket is refused before anything is created.

    Raises:
        UserError: the path is too long, or the kernel refuses to bind it (one sentence).
    """
    if problem := socket_path_problem(str(path), "--socket"):
        raise UserError(problem)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot create the socket --socket {path} ({exc.strerror or exc}); give a path in a "
                        "writable directory, e.g. /dev/shm/kvtier-node/node.sock") from None
    return sock


async def _serve(opts: ServeOptions, ready: asyncio.Event | None = None) -> None:
    lock, created = lock_pool(opts.pool)
    sock: socket.socket | None = None
    try:
        refuse_foreign_pool(opts.pool)
        claim_socket(opts.socket)
        sock = bind_socket(opts.socket)
        pool, anew = take_pool(opts)
    except BaseException:
        if sock is not None:  # a refused start leaves nothing it created: the socket file,
            sock.close()
            opts.socket.unlink(missing_ok=True)
        if created:  # the pool's lock file (take_pool removes its own)
            lock_path(opts.pool).unlink(missing_ok=True)
        os.close(lock)
        raise
    owner = Owner(pool, opts, anew)
    server = await asyncio.start_unix_server(owner.connection, sock=sock)
    os.chmod(opts.socket, 0o660)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    expiry = asyncio.create_task(owner.expiry())
    log.info("kvtier node: serving %s on %s", opts.pool, opts.socket)
    print(f"kvtier node: serving the pool {opts.pool} ({pool.capacity_bytes / (1 << 30):.2f} GiB, "
          f"{pool.num_pages} pages) on {opts.socket}", flush=True)
    try:
        async with server:
            await stop.wait()
    finally:
        expiry.cancel()
        owner.index.table.beat(0)  # engines ask over the socket (and find nobody) from now on
        with contextlib.suppress(OSError):
            opts.socket.unlink()
        os.close(lock)


def serve(opts: ServeOptions) -> None:
    """Run the owner until SIGTERM/SIGINT.

    Raises:
        UserError: the pool cannot be created or is owned already, or the socket is taken.
    """
    asyncio.run(_serve(opts))
