"""Belady's offline optimum, with the prefix constraint respected (simulator-only).

Belady's MIN (L. A. Belady, "A study of replacement algorithms for a virtual-storage computer",
IBM Systems Journal 5(2), 1966) evicts the resident item whose next use lies farthest in the
future; with bypass (a new item may be the victim itself) it maximises hits on any fixed access
sequence.  It needs the future, so it exists only in the simulator.

Prefix constraint.  A chunk only hits if every chunk before it hits, and keys are chained, so
every request that uses a chunk also uses its parent: ``next_use(parent) <= next_use(child)``.
Ties are broken towards the **deeper** chunk, so MIN never evicts a chunk while a descendant
stays, and a chunk inserted right after its parent was bypassed (evicted on arrival) ranks at
least as far as that parent and is bypassed too.  The cache therefore stays prefix-closed, every resident access is a prefix hit,
and on the cpu tier alone (no engine tier, no disk) no online policy can count more hits
(tests/simulate/test_belady.py checks this with hypothesis).  With an engine tier in front or a
disk tier behind, MIN per tier is a strong reference, not a proven optimum of the whole stack.

"Next use" counts only positions that can hit (``lookup_limits``): a prompt's last block, which
the engine recomputes anyway, is not a use.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.core.policies.base import Evictable, always_evictable
from kvtier.simulate.replay import OfflinePolicy, lookup_limits
from kvtier.simulate.trace import Trace


class TraceOracle:
    """The future of a trace: for each chunk id, the requests that can hit it, and its depth.

    Build once per trace; every :class:`BeladyPolicy` on that trace shares it (read-only)."""

    def __init__(self, trace: Trace) -> None:
        uses: dict[int, list[int]] = {}
        depth: dict[int, int] = {}
        for r, (keys, limit) in enumerate(zip(trace.chunk_keys, lookup_limits(trace))):
            for j, key in enumerate(keys):
                depth.setdefault(key, j)
                if j < limit:
                    uses.setdefault(key, []).append(r)
        self.uses = uses
        self.depth = depth
        self.never = trace.num_requests  # later than every request: "not used again"


class BeladyPolicy(OfflinePolicy):
    """Farthest-next-use eviction, deeper chunk first on ties.

    Each insert/touch pushes one heap entry; stale entries are dropped lazily by ``victim``
    (bookkeeping only: the tracked set and the answer do not change)."""

    name = "belady"

    def __init__(self, oracle: TraceOracle) -> None:
        self._oracle = oracle
        self._now = 0
        self._cursor: dict[Any, int] = {}  # key -> index into oracle.uses[key] of its next use
        self._next: dict[Any, int] = {}  # tracked key -> priority pushed last
        self._heap: list[tuple[int, int, Any]] = []  # (-next_use, -depth, key)

    def advance(self, request_index: int) -> None:
        self._now = request_index

    def _push(self, key: Any) -> None:
        oracle = self._oracle
        uses = oracle.uses.get(key, ())
        i = self._cursor.get(key, 0)
        while i < len(uses) and uses[i] <= self._now:
            i += 1
        self._cursor[key] = i
        when = uses[i] if i < len(uses) else oracle.never
        self._next[key] = when
        heapq.heappush(self._heap, (-when, -oracle.depth.get(key, 0), key))

    def insert(self, key: Any, parent: Any | None) -> None:
        self._push(key)

    def touch(self, keys: Sequence[Any]) -> None:
        tracked = self._next
        for key in keys:
            if key in tracked:
                self._push(key)

    def remove(self, key: Any) -> None:
        self._next.pop(key, None)

    def victim(self, evictable: Evictable = always_evictable) -> Any | None:
        heap, tracked = self._heap, self._next
        while heap:
            neg_when, _, key = heap[0]
            if tracked.get(key) != -neg_when:
                heapq.heappop(heap)  # stale: removed, or pushed again since
                continue
            if evictable(key):
                return key
            break
        # Pinned keys at the top (never in the simulator): fall back to a full ordering.
        order = sorted(tracked, key=lambda k: (-tracked[k], -self._oracle.depth.get(k, 0)))
        return next((k for k in order if evictable(k)), None)

    def __len__(self) -> int:
        return len(self._next)

    def __contains__(self, key: object) -> bool:
        return key in self._next

    def keys(self) -> Iterable[Any]:
        return self._next.keys()
