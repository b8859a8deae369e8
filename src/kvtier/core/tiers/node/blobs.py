"""The node pool as a blob store (:mod:`kvtier.core.tiers.blobs`): what ``kvtier purge``, a reset from
outside the engines and the reachability probe of ``kvtier check`` run over (:mod:`kvtier.core.purge`).

Values are named ``<namespace hex>:<pool name hex>`` (the pool name: the chunk key in its
secret's key space, :mod:`~kvtier.core.tiers.node.names`).  The owner says each value's key space,
so a reset from outside removes only this configuration's, and names them by their chunk keys
(the other spaces' keep their pool names).  :meth:`NodeBlobs.list` pages through the
owner's index (``listing`` messages); :meth:`NodeBlobs.stat` pins each value and reads its header
straight from the mapped pool (never the payload); :meth:`NodeBlobs.delete` sends ``delete``.  The
age of a value is when its owner published it (unknown for a value a restarted owner took back).
Every call is bounded by ``node_timeout_s``; a failure is :class:`~kvtier.core.tiers.blobs.StorageFailed`.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kvtier.core import envelope
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.blobs import LIST_BATCH, BlobRef, BlobStat, StorageFailed, ValueHeader
from kvtier.core.tiers.node import protocol as p
from kvtier.core.tiers.node.client import NodeClient, NodeUnavailable, client_name
from kvtier.core.tiers.node.names import PoolNames, space_hex
from kvtier.core.tiers.node.pool import Pool
from kvtier.core.tiers.node.settings import node_settings
from kvtier.core.tiers.sharedvalue import shared_secret

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.probe import ProbeState


def open_blobs(config: KVTierConfig, deadline_s: float | None = None) -> NodeBlobs | None:
    """The pool behind ``node_socket`` (connected on first use); ``None`` without it."""
    settings = node_settings(config)
    if not settings.node_socket:
        return None
    timeout_s = settings.node_timeout_s if deadline_s is None else min(settings.node_timeout_s, deadline_s)
    return NodeBlobs(NodeClient(settings.node_socket, timeout_s, client_name("tools")), config)


class NodeBlobs:
    """Every namespace's values in one host's pool (see the module docstring)."""

    verifies_values = False
    auth_fix = "the node pool takes no credentials: check node_socket's permissions"
    address_key = "node_socket"
    kind = "node pool"  # a host's pool behind a UNIX socket, not a network server
    reach_fix = "run its owner (kvtier node serve --socket at that path) on this host"

    def __init__(self, client: NodeClient, config: KVTierConfig | None = None) -> None:
        """``config``: whose key space :attr:`space` is (``None``: the space of no secret)."""
        self.client = client
        self._config = config
        self._names: PoolNames | None = None  # this configuration's (read on first use)
        self.where = client.socket_path
        self._listed: dict[str, tuple[int, float]] = {}  # name -> (value bytes, written at) as last listed

    def _own(self) -> PoolNames:
        """This configuration's pool names and key space.

        Raises:
            StorageFailed: the secret file cannot be read.
        """
        if self._names is None:
            try:
                self._names = PoolNames(None if self._config is None else shared_secret(self._config))
            except ConfigError as exc:
                raise StorageFailed(str(exc)) from None
        return self._names

    @property
    def space(self) -> str:
        """This configuration's key space (its ``shared_secret``'s, :func:`~kvtier.core.tiers.node.names.space_hex`),
        ``""`` without one.

        Raises:
            StorageFailed: the secret file cannot be read.
        """
        return space_hex(self._own().space)

    def _call(self, request: p.Request) -> p.Reply:
        try:
            return self.client.call(request)[0]
        except NodeUnavailable as exc:
            raise StorageFailed(f"{exc}; check node_socket and that kvtier node serve runs") from None

    def namespaces(self) -> builtins.list[bytes]:
        """None without listing: they show up in :meth:`list`."""
        return []

    def list(self, namespaces: frozenset[bytes]) -> Iterator[builtins.list[BlobRef]]:
        start, more = 0, True
        while more:
            reply = self._call(p.Listing(sorted(namespaces), start, LIST_BATCH))
            assert isinstance(reply, p.Listed)
            more = reply.more
            start += len(reply.values)
            own = self._own()
            mine = own.keys_of([v[1] for v in reply.values if v[4] == own.space])[::-1]
            batch = []
            for ns, pool_name, nbytes, written_s, space in reply.values:
                name = f"{ns.hex()}:{pool_name.hex()}"
                self._listed[name] = (nbytes, written_s)
                batch.append(BlobRef(ns, mine.pop() if space == own.space else pool_name, name, space_hex(space)))
            if batch:
                yield batch

    def listing_problems(self) -> builtins.list[tuple[bytes, str]]:
        return []

    def stat(self, refs: Sequence[BlobRef], header: bool) -> builtins.list[BlobStat | None]:
        out: list[BlobStat | None] = []
        for ref in refs:
            if not header and ref.name in self._listed:
                nbytes, written_s = self._listed[ref.name]
                out.append(BlobStat(nbytes, written_s or None))
                continue
            reply, pool, serial = self._pin(ref)
            pin = reply.leases[0]
            if pin is None:
                out.append(None)
                continue
            lease, page, nbytes, _gen = pin
            try:
                if not header:
                    out.append(BlobStat(nbytes, None))
                    continue
                try:
                    head = envelope.decode_header(bytes(pool.value(page, min(nbytes, envelope.FIXED_BYTES))))
                except Exception:  # noqa: BLE001 - a value whose header cannot be read is kept and named
                    head = None
                if head is None or head.namespace != ref.namespace or head.key != _pool_name(ref):
                    out.append(BlobStat(nbytes, None, problem=f"{ref.name} is not a kvtier value of this name "
                                                              "(its header differs); kept"))
                else:
                    out.append(BlobStat(nbytes, None, ValueHeader(head.namespace, head.key, head.record)))
            finally:
                self.client.release_later(serial, [lease])
        return out

    def _pin(self, ref: BlobRef) -> tuple[p.Pinned, Pool, int]:
        try:
            reply, pool, serial = self.client.call(lambda rel: p.Pin(ref.namespace, [_pool_name(ref)], rel))
        except NodeUnavailable as exc:
            raise StorageFailed(f"{exc}; check node_socket and that kvtier node serve runs") from None
        assert isinstance(reply, p.Pinned)
        return reply, pool, serial

    def delete(self, refs: Sequence[BlobRef]) -> builtins.list[bool | str]:
        out: list[bool | str] = []
        for ref in refs:
            reply = self._call(p.Delete(ref.namespace, [_pool_name(ref)]))
            assert isinstance(reply, p.Done)
            out.append(reply.ok[0])
        return out

    def before_reset(self, namespace: bytes) -> str | None:
        """Nothing to mark: the values go at once."""
        return None

    def ping(self) -> str:
        self.client.call(p.Stats())
        return "STATS"

    def failure(self, exc: BaseException, left_s: float) -> tuple[ProbeState, str]:
        return "unreachable", str(exc).split(" (", 1)[-1].rstrip(")") if "(" in str(exc) else str(exc)

    def close(self) -> None:
        self.client.flush()
        self.client.close()


def _pool_name(ref: BlobRef) -> bytes:
    """The pool name of a listed value (its :class:`BlobRef` name's second half)."""
    return bytes.fromhex(ref.name.rpartition(":")[2])
