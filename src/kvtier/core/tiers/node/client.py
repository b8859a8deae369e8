"""An engine's connection to the node pool's owner, and its mapping of the pool.

Blocking, one request in flight (a lock), each send and receive bounded by ``timeout_s``, and by
what is left of a call's ``deadline`` when it has one (the wait for the lock too: a read on the
caller's thread, :class:`~kvtier.core.tiers.split.BoundsItself`).  Any fault (no owner, a timeout,
a closed connection, a refusal) closes the connection and raises :class:`NodeUnavailable`
(:class:`NodeTimeout` for a wait that ran out); the next call connects again (re-attach), and maps
the pool again if the owner recreated it (another pool id).  Releases of read leases are queued here and ride on
the next ``pin`` or ``alloc`` (or a ``release`` once :data:`RELEASE_BATCH` are queued): a read's
verify-and-copy half touches no socket.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvtier.core.tiers.node import protocol as p
from kvtier.core.tiers.node.pool import Pool, PoolError, open_pool

RELEASE_BATCH = 256
"""Queued releases that are sent on their own rather than with the next request."""
USAGE_MAX_AGE_S = 5.0
"""Oldest the owner's word on this engine's count (``usage``) may be when it is read before it is
asked again, in the background (:meth:`NodeClient.usage_now`).  The owner counts the values of a
writer gone (a connection closed by a fault) for the oldest live writer, which learns it only from
a reply: without asking, an engine that sends nothing (idle, or serving hits from the presence
table and its own tiers) reported a stale count, and the engines' sum differed from the pool's."""


class NodeUnavailable(ConnectionError):
    """The node pool's owner did not answer (dead, stalled, refusing); one sentence."""


class NodeTimeout(NodeUnavailable, TimeoutError):
    """A wait of a call ran out (the owner stalled, or the connection busy past the deadline)."""


class NodeClient:
    """See the module docstring.

    Args:
        socket_path: the owner's UNIX socket (``node_socket``).
        timeout_s: bound of each connect, send and receive, seconds.
        client: a name for the owner's logs (host, pid, role).
    """

    def __init__(self, socket_path: str, timeout_s: float, client: str) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.client = client
        self.pool: Pool | None = None
        self.epoch = 0
        self.attached = 0  # connections made (1 = first; more = re-attached)
        self.usage = (0, 0)  # (bytes, values) this connection is counted for, as of the owner's last reply
        self.usage_at = time.monotonic()  # when that reply came
        self.usage_max_age_s = USAGE_MAX_AGE_S
        self._asking = threading.Lock()  # held while a background usage request is under way (one at a time)
        self._closed = False  # closed by its tier: no background request connects it again
        self.on_map: Callable[[Pool | None, Pool], None] | None = None  # told of each pool mapped (pinning)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._releases: list[int] = []
        self._conn_serial = 0  # bumps per connection: a lease of an older one is never released on a newer

    @property
    def serial(self) -> int:
        """The current connection's serial (leases are valid only on the connection that took them)."""
        return self._conn_serial

    def release_later(self, serial: int, leases: list[int]) -> None:
        """Queue ``leases`` (taken on connection ``serial``) for release with the next request."""
        with self._lock:
            if serial == self._conn_serial and self._sock is not None:
                self._releases.extend(leases)

    def take_releases(self) -> list[int]:
        """The queued releases (the caller sends them in its request; the lock is held)."""
        out, self._releases = self._releases, []
        return out

    def call(self, build: p.Request | Callable[[list[int]], p.Request], deadline: float | None = None,
             during: Callable[[], None] | None = None) -> tuple[p.Reply, Pool, int]:
        """Send the request ``build`` returns (a message, or a function of the queued releases
        returning one) and return ``(reply, pool, connection serial)``.  With ``deadline`` (a
        ``time.perf_counter()`` value) every wait (the lock, connecting, each send and receive)
        ends by it too; ``during()``, if given, runs once the request is sent, before its answer
        is read (its own time counts against the deadline; if it raises, the connection is closed
        and the exception passes).

        Raises:
            NodeUnavailable: no answer within ``timeout_s`` (or by ``deadline``: :class:`NodeTimeout`), or a refusal.
        """
        if not self._lock.acquire(timeout=-1 if deadline is None else max(deadline - time.perf_counter(), 0.0)):
            raise NodeTimeout(f"the connection to the node pool's owner at {self.socket_path} was busy "
                              "past the deadline")
        try:
            for attempt in (0, 1):
                fresh = self._sock is None
                try:
                    sock, pool = self._connected(deadline)
                    request = build if isinstance(build, msgspec.Struct) else build(self.take_releases())
                    self._bound(sock, deadline)
                    sock.sendall(p.frame(request))
                    if during is not None:
                        run, during = during, None
                        try:
                            run()
                        except BaseException:
                            self._close()  # an answer nobody reads must not be taken for the next call's
                            raise
                    reply = self._recv(sock, deadline)
                    break
                except TimeoutError as exc:
                    self._close()
                    raise NodeTimeout(f"the node pool's owner at {self.socket_path} did not answer "
                                      f"({exc.__class__.__name__}: {exc})") from None
                except ConnectionError as exc:
                    self._close()
                    if fresh or attempt or isinstance(exc, NodeUnavailable):
                        raise NodeUnavailable(f"the node pool's owner at {self.socket_path} did not answer "
                                              f"({exc.__class__.__name__}: {exc})") from None
                    # a connection to an owner that has gone (restarted): connect again at once, once
                except (OSError, ValueError, msgspec.DecodeError) as exc:
                    self._close()
                    raise NodeUnavailable(f"the node pool's owner at {self.socket_path} did not answer "
                                          f"({exc.__class__.__name__}: {exc})") from None
            if isinstance(reply, p.Refused):
                self._close()
                raise NodeUnavailable(f"the node pool's owner at {self.socket_path} refused: {reply.reason}")
            if isinstance(reply, (p.Found, p.Pinned, p.Allocated, p.Done, p.KeyList)):
                self.usage, self.usage_at = reply.usage, time.monotonic()
            elif isinstance(reply, p.UsageReply):
                self.usage, self.usage_at = (reply.used_bytes, reply.num_values), time.monotonic()
            return reply, pool, self._conn_serial
        finally:
            self._lock.release()

    def _bound(self, sock: socket.socket, deadline: float | None) -> None:
        """Each wait on ``sock`` from now ends within ``timeout_s`` and by ``deadline``.

        Raises:
            TimeoutError: the deadline has passed."""
        if deadline is None:
            if sock.gettimeout() != self.timeout_s:  # a call with a deadline left its own
                sock.settimeout(self.timeout_s)
            return
        left = deadline - time.perf_counter()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        sock.settimeout(min(self.timeout_s, left))

    def usage_now(self) -> tuple[int, int]:
        """``usage`` without waiting; when the owner's word is older than ``usage_max_age_s``, it is
        asked again on a thread of its own (one ``usage`` message within ``timeout_s``, one at a
        time; a fault is left to the next call), so a reader sees it from its next read on."""
        if not self._closed and time.monotonic() - self.usage_at > self.usage_max_age_s \
                and self._asking.acquire(blocking=False):
            try:
                threading.Thread(target=self._ask_usage, name="kvtier-node-usage", daemon=True).start()
            except BaseException:
                self._asking.release()
                raise
        return self.usage

    def _ask_usage(self) -> None:
        try:
            self.call(p.Usage())
        except NodeUnavailable:
            self.usage_at = time.monotonic()  # not asked again before the next max age
        finally:
            self._asking.release()

    def flush(self) -> None:
        """Send the queued releases now (a best effort: a fault leaves them to the lease expiry)."""
        with self._lock:
            if not self._releases or self._sock is None:
                return
        try:
            self.call(lambda rel: p.Release(rel))
        except NodeUnavailable:
            pass

    def _recv(self, sock: socket.socket, deadline: float | None = None) -> p.Reply:
        self._bound(sock, deadline)
        n = p.frame_length(p.recv_exactly(sock, 4))
        self._bound(sock, deadline)
        return p.REPLIES.decode(p.recv_exactly(sock, n))

    def _connected(self, deadline: float | None = None) -> tuple[socket.socket, Pool]:
        if self._sock is not None and self.pool is not None:
            return self._sock, self.pool
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            self._bound(sock, deadline)
            sock.connect(self.socket_path)
            sock.sendall(p.frame(p.Hello(p.VERSION, self.client)))
            welcome = self._recv(sock, deadline)
            if isinstance(welcome, p.Refused):
                raise NodeUnavailable(f"the node pool's owner at {self.socket_path} refused: {welcome.reason}")
            if not isinstance(welcome, p.Welcome):
                raise NodeUnavailable(f"expected a welcome, got {type(welcome).__name__}")
            if self.pool is None or self.pool.pool_id != welcome.pool_id:
                try:
                    pool = open_pool(Path(welcome.pool_path))
                except PoolError as exc:
                    raise NodeUnavailable(str(exc)) from None
                if pool.pool_id != welcome.pool_id:
                    raise NodeUnavailable(f"the pool file {welcome.pool_path} is not the one its owner serves "
                                          "(recreated meanwhile)")
                old, self.pool = self.pool, pool  # the old mapping, if any, goes with its last view
                if self.on_map is not None:
                    self.on_map(old, pool)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self.epoch = welcome.epoch
        self.attached += 1
        self._conn_serial += 1
        self._releases = []  # leases of the old connection ended with it
        self.usage, self.usage_at = (0, 0), time.monotonic()  # a new connection is counted afresh
        return sock, self.pool

    def _close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
                self._releases = []

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._close()


def client_name(role: str) -> str:
    """``host:pid:role``, how an engine names itself to the owner (its logs)."""
    return f"{socket.gethostname()}:{os.getpid()}:{role}"
