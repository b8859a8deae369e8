"""The node tier from a configuration: its preflight check and factory (the hooks of its plug-in
object, :data:`kvtier.core.tiers.builtin.NODE`), and :class:`NodeGuardedTier`."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.breaker import BreakerState, CircuitBreaker
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.node.client import NodeClient, client_name
from kvtier.core.tiers.node.settings import node_settings
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.core.tiers.sharedvalue import shared_secret

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import TierContext


def check(config: KVTierConfig) -> list[tuple[str, str]]:
    """The owner's socket and the shared secret, read as start-up would: ``(config key, sentence)``
    when the socket is not one, or the secret file cannot be read (:func:`shared_secret`, as
    :func:`from_config` reads it).  A missing socket is not refused (engines start before their owner
    and re-attach)."""
    settings = node_settings(config)
    path = settings.node_socket
    if not path:
        return []
    try:
        shared_secret(config)
    except ConfigError as exc:
        return [("shared_secret_file", str(exc)), *_socket_problems(path)]
    return _socket_problems(path)


def _socket_problems(path: str) -> list[tuple[str, str]]:
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if not os.path.isdir(os.path.dirname(path)):
            return [("node_socket", (f"the directory of node_socket {path} does not exist; mount the node pool's "
                                     "volume there or fix the path"))]
        return []
    except OSError as exc:
        return [("node_socket", f"node_socket {path} cannot be read ({exc.strerror}); fix its permissions")]
    if not stat.S_ISSOCK(mode):
        return [("node_socket", (f"node_socket {path} is not a socket; give the path kvtier node serve --socket "
                                 "listens on"))]
    return []


class NodeGuardedTier(GuardedTier):
    """:class:`~kvtier.core.tiers.guarded.GuardedTier` over :class:`~kvtier.core.tiers.node.tier.NodeTier`
    whose presence batches are answered on the caller's thread from the pool's presence table
    (:mod:`~kvtier.core.tiers.node.presence`: array reads, no I/O, nothing to wait for) while the
    owner beats and the breaker is closed; otherwise as :class:`GuardedTier` (the owner asked on
    the wrapper's threads, under the deadline)."""

    inner: NodeTier

    def contains_now(self, keys: Sequence[ChunkKey]) -> list[bool] | None:
        """Which of ``keys`` the pool holds, answered now on this thread; ``None`` when only the
        owner can answer (:meth:`contains_many` then asks it).  The scheduler's lookups
        (:class:`~kvtier.integrations.vllm.scheduler.remote.RemoteLookups`) take this first."""
        if self._closed or self.breaker.state is not BreakerState.CLOSED:
            return None  # the owner failed calls lately: no promise of a load it may not serve
        t0 = time.perf_counter()
        found = self.inner.contains_now(keys)
        if found is not None:
            self.metrics.observe("lookup", time.perf_counter() - t0)
            self.wire.looked_up(len(keys), sum(found))
        return found

    def contains_many(self, keys: Sequence[ChunkKey], fault: list[str] | None = None) -> list[bool]:
        found = self.contains_now(keys) if keys else None
        return found if found is not None else super().contains_many(keys, fault)


def from_config(ctx: TierContext) -> GuardedTier | None:
    """The node tier behind :class:`~kvtier.core.tiers.guarded.GuardedTier`, or ``None`` without
    ``node_socket``.  The owner need not be up: until it answers, every call is a miss."""
    config = ctx.config
    settings = node_settings(config)
    if not settings.node_socket:
        return None
    client = NodeClient(settings.node_socket, settings.node_timeout_s, client_name(f"ns={ctx.namespace.hex()[:8]}"))
    inner = NodeTier(client, ctx.namespace, shared_secret(config), config.shared_transfer_deadline_s)
    return NodeGuardedTier(inner, config.shared_deadline_s, config.shared_transfer_deadline_s, config.io_threads,
                       config.shared_queue_depth,
                       CircuitBreaker(settings.node_breaker_failures, settings.node_breaker_probe_s),
                       registry=ctx.registry, where=settings.node_socket,
                       clear_deadline_s=config.shared_transfer_deadline_s)
