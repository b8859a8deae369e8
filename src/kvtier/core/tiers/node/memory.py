"""The node tier's :class:`~kvtier.core.tiers.base.RegistersMemory` capability: host regions it reads
from and writes into, registered as pinned host memory for GPU copies (``cudaHostRegister``,
:mod:`kvtier.core.pinned`), the mapped pool first (:meth:`PoolMemory.pin_host_memory`).

A pool mapped again (its owner recreated it: another pool id) is a new region: the tier pins it
when its pool was pinned before.  Without CUDA (the CPU backend) nothing is registered and the
reason is one sentence; the engine copies straight from the mapped pages either way.
"""

from __future__ import annotations

import logging
import threading
import weakref

import numpy as np

from kvtier.core import pinned
from kvtier.core.tiers.node import protocol as p
from kvtier.core.tiers.node.client import NodeClient
from kvtier.core.tiers.node.pool import Pool

log = logging.getLogger(__name__)


class PoolMemory:
    """Registered regions of one tier (a base of :class:`~kvtier.core.tiers.node.tier.NodeTier`,
    which sets ``client``)."""

    client: NodeClient

    def __init__(self) -> None:
        self._regions: dict[int, tuple[int, weakref.finalize]] = {}  # address -> (bytes, its unregistration)
        self._regions_lock = threading.Lock()
        self.pin_pool = False  # pin every pool this tier maps (asked by pin_host_memory)

    def register_memory(self, region: np.ndarray) -> str | None:
        """Pin ``region`` (a contiguous host array that stays mapped while registered); ``None``
        once pinned (or already here), else one sentence saying why not."""
        start = int(region.ctypes.data)
        with self._regions_lock:
            if start in self._regions:
                return None
        why = pinned.register_host(region)
        if why is not None:
            return why
        done = weakref.finalize(self, pinned.unregister_host, pinned.registered_pieces(region))
        done.atexit = False  # not at interpreter exit, when CUDA may be torn down already
        with self._regions_lock:
            self._regions[start] = (int(region.nbytes), done)
        return None

    def unregister_memory(self, region: np.ndarray) -> bool:
        """Unpin a region :meth:`register_memory` pinned; ``False`` if it did not."""
        with self._regions_lock:
            found = self._regions.pop(int(region.ctypes.data), None)
        if found is None:
            return False
        found[1]()
        return True

    def registered_memory(self) -> list[tuple[int, int]]:
        """``(address, bytes)`` of each region pinned through this tier."""
        with self._regions_lock:
            return [(start, nbytes) for start, (nbytes, _) in self._regions.items()]

    def pin_pool_memory(self, pool: Pool) -> str | None:
        """Pin ``pool``'s pages (``None`` once pinned, else why not); asks the same of every pool
        mapped later."""
        self.pin_pool = True
        why = self.register_memory(pool.data)
        if why is not None:
            log.warning("kvtier: the node pool %s is not pinned (%s); GPU copies from it are staged", pool.path, why)
        return why

    def pin_host_memory(self) -> bool:
        """Register the mapped pool as pinned host memory (and every pool mapped later); whether it
        is.  Maps it first (one message to the owner); the owner away: ``False``."""
        try:
            _, pool, _ = self.client.call(p.Stats())
        except ConnectionError as exc:
            log.warning("kvtier: the node pool is not pinned (%s)", exc)
            self.pin_pool = True
            return False
        return self.pin_pool_memory(pool) is None
