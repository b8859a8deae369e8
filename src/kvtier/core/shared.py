"""The store's asynchronous path to its shared tier: lookups that never block the caller.

A shared tier (redis) is never asked during :meth:`TieredStore.lookup`: the engine's scheduler
must not wait on the network.  :class:`SharedLookups` sends one pipelined presence batch for the
part of a chain beyond the local hit, on the tier's own threads, and hands back a
:class:`~kvtier.core.handles.PendingLookup` whose ``poll()`` says "ask again" until the answer is in
or ``deadline_s`` has passed (vLLM's ``get_num_new_matched_tokens`` may answer ``(None, False)``
for that).  At most ``queue_depth`` lookups are in flight; more are answered from local tiers
alone and counted in ``shared_lookups_skipped``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from kvtier.core.handles import PendingLookup
from kvtier.core.keys import ChunkKey
from kvtier.core.lower import LowerTier
from kvtier.core.stats import StoreCounters


class SharedLookups:
    """Background presence checks in one shared tier (see the module docstring).

    Args:
        lower: the shared tier and its threads.
        deadline_s: the longest a lookup may take before it counts as a miss.
        queue_depth: lookups in flight at most.
        counters: the store's.
    """

    def __init__(self, lower: LowerTier, deadline_s: float, queue_depth: int,
                 counters: StoreCounters) -> None:
        self.lower = lower
        self.deadline_s = deadline_s
        self.queue_depth = queue_depth
        self._counters = counters
        self._in_flight = 0
        self._lock = threading.Lock()

    def leading_present(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the shared tier holds (one pipelined batch; blocks up to the
        tier's deadline; a fault is 0)."""
        present = self.lower.tier.contains_many(keys)
        return next((i for i, hit in enumerate(present) if not hit), len(present))

    def lookup(self, chain: Sequence[ChunkKey], local_chunks: int) -> PendingLookup:
        """Continue a lookup of ``chain`` whose first ``local_chunks`` chunks were found locally."""
        with self._lock:
            if self._in_flight >= self.queue_depth:
                self._counters.shared_skipped()
                return PendingLookup(local_chunks, len(chain))
            self._in_flight += 1
        rest = list(chain[local_chunks:])

        def remote() -> int:
            try:
                found = self.leading_present(rest)
                if found:
                    self._counters.found(self.lower.name, found)
                return found
            finally:
                with self._lock:
                    self._in_flight -= 1

        future = self.lower.submit(remote)
        return PendingLookup(local_chunks, len(chain), future,  # type: ignore[arg-type]
                             time.monotonic() + self.deadline_s)
