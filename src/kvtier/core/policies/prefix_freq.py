"""kvtier's default: prefix-aware, frequency-ranked eviction with an adaptive quarantine.

Why.  In chat traffic most chunks are never used again (a conversation that does not come back),
and the ones that are come back after a think time that is often longer than an LRU tier keeps
anything.  LRU then thrashes: every new chunk pushes out a chunk that had already proven useful.
Three ideas fix most of that, each from the literature, combined here for prefix-chained KV:

1. **Quarantine the unproven** (the admission idea of 2Q, Johnson & Shasha, VLDB'94, and
   S3-FIFO, Yang et al., SOSP'23): a chunk that has never been reused is evicted before any
   proven one, unless the proven one has gone unused for ``QUARANTINE`` tier-sizes of insertions.
   A ghost list remembers evicted keys (16-byte keys, no KV), so a chunk that comes back is
   proven from then on.
2. **Rank proven chunks by use count** (frequency with recency, like LRFU, Lee et al., IEEE
   ToC 2001): a chunk used ``u`` times keeps its place ``BONUS × min(u, MAX_USES)`` tier-sizes of
   insertions longer than recency alone would give it.  Counts survive eviction in a bounded
   history, so a conversation's fifth turn is recognised even if its chunks were evicted.
3. **Leaves first** (radix-tree caches, SGLang): a chunk with resident children is never the
   victim, and chunks used by one request at the same moment leave tail first.

Adaptive quarantine.  Quarantine wins when the tier is small relative to reuse distances and
loses when it is large enough for LRU to catch first reuses (which quarantine gives up).  The
policy measures both sides online, in insertions (``n`` = chunks tracked):

- ``first``: first reuses of a chunk within ``n`` insertions of its arrival (LRU would likely
  have kept it; quarantine forgoes these),
- ``proven``: reuses of a proven chunk between ``n`` and ``3n`` insertions after its last use
  (LRU would likely have dropped it; quarantine keeps these),

each counted whether the chunk was still resident or came back from the ghost list, with
exponential forgetting, and quarantines only while ``proven > first``.  When it does not
quarantine, no bonus applies either, and the policy is tail-first LRU with leaves first.

Ordering is one lazy-deletion heap keyed by (rank, -depth), rank = time of last use +
``n × offset(class, regime)``; it is rebuilt when the regime switches (a handful of times per
trace) or the tier doubles while filling.  ``victim`` drops stale heap entries and may rebuild
(bookkeeping only: the tracked set does not change, and for one predicate it returns the same
key until the next mutation); pinned leaves are looked past and put back.

Owners should offer every full chunk of each request: ``touch`` the resident ones (also those
the engine itself served) and ``insert`` the missing ones in prompt order, as the simulator does.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from itertools import count
from typing import Any

from kvtier.core.policies.base import Evictable, EvictionPolicy, always_evictable, heap_victim

QUARANTINE = 5.0
"""While quarantining, a never-reused chunk ranks as if last used this many tier-sizes earlier."""
BONUS = 1.0
"""While quarantining, each use moves a proven chunk this many tier-sizes later (up to MAX_USES)."""
MAX_USES = 7
GHOST = 3.0
"""Evicted keys remembered, in tier-sizes (keys only)."""
HISTORY = 8.0
"""Use counts remembered, in tier-sizes (keys only)."""
WINDOW = 4.0
"""Proven reuses count towards quarantine between ``n`` and ``WINDOW × n`` insertions of age."""
FORGET = 4.0
"""The regime counters forget with a time constant of this many tier-sizes of observations."""

_OFFSETS = {
    False: (0.0,) * (MAX_USES + 1),
    True: (-QUARANTINE,) + tuple(BONUS * uses for uses in range(1, MAX_USES + 1)),
}
"""Per use-count class, how many tier-sizes later than its last use a chunk ranks, by regime."""


class _Node:
    """Per tracked chunk: one object, so an insert or eviction touches one dict entry."""

    __slots__ = ("cls", "depth", "last", "parent", "rank", "time")

    def __init__(self, time: int, last: int, cls: int, depth: int, parent: Any | None) -> None:
        self.time = time  # ordering time: clock of last use (shared by one request's chain)
        self.last = last  # clock of last use, for ages
        self.cls = cls  # min(uses, MAX_USES)
        self.rank = 0.0  # rank of its live heap entry
        self.depth = depth  # chunk index in its prompt
        self.parent = parent


class PrefixFrequencyPolicy(EvictionPolicy):
    """See the module docstring.  O(log n) amortised per operation."""

    name = "prefix-freq"

    def __init__(self) -> None:
        self._clock = 0  # insertions so far: the unit of age
        self._nodes: dict[Any, _Node] = {}
        self._children: dict[Any, int] = {}  # key -> tracked children (only counts > 0)
        self._heap: list[tuple[float, int, int, Any]] = []  # (rank, -depth, seq, key), leaves
        self._seq = count()  # ties never compare keys (they need not be orderable)
        self._uses: dict[Any, int] = {}  # use counts, recent generation
        self._old_uses: dict[Any, int] = {}  # use counts, previous generation
        self._ghost: OrderedDict[Any, int] = OrderedDict()  # evicted key -> clock of last use
        self._first = 0.0
        self._proven = 0.0
        self._observed = 0  # observations since the counters were last halved
        self.quarantine = False  # plain LRU until there is evidence either way
        self._offsets = _OFFSETS[False]
        self._scale = 1  # the n that ranks were computed with
        self._stale = False  # ranks must be recomputed (regime switched)
        self._run: tuple[Any, int] = (None, 0)  # last inserted key and its ordering time

    # -- mutations ---------------------------------------------------------------------------
    def insert(self, key: Any, parent: Any | None) -> None:
        nodes = self._nodes
        if key in nodes:
            self.touch([key])
            return
        self._clock = clock = self._clock + 1
        n = len(nodes) + 1
        uses = self._uses_of(key)
        last = self._ghost.pop(key, None)
        if last is not None:  # came back after eviction: that is a use
            self._observe(uses == 0, clock - last, n)
            uses += 1
            self._remember(key, uses, n)
        # Chunks inserted in prompt order by one request share one time, so depth breaks the tie.
        run_key, run_time = self._run
        time = run_time if parent is not None and parent == run_key else clock
        self._run = (key, time)
        up = nodes.get(parent) if parent is not None else None
        node = nodes[key] = _Node(time, clock, min(uses, MAX_USES), up.depth + 1 if up else 0, parent)
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        self._rank_and_queue(key, node)

    def touch(self, keys: Sequence[Any]) -> None:
        nodes = self._nodes
        n = len(nodes)
        clock = self._clock
        for key in keys:
            node = nodes.get(key)
            if node is not None:
                uses = self._uses_of(key)
                self._observe(uses == 0, clock - node.last, n)
                self._remember(key, uses + 1, n)
                node.last = node.time = clock
                node.cls = min(uses + 1, MAX_USES)
                self._rank_and_queue(key, node)
        if len(self._heap) > 2 * n + self.heap_slack:
            self._heap = self.compact_heap(self._heap, self._stale_entry)

    def remove(self, key: Any) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        ghost = self._ghost
        ghost[key] = node.last
        if len(ghost) > GHOST * max(len(self._nodes), 1):
            ghost.popitem(last=False)
        parent = node.parent
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                up = self._nodes.get(parent)
                if up is not None:  # became a leaf: a candidate again
                    heapq.heappush(self._heap, (up.rank, -up.depth, next(self._seq), parent))

    # -- queries -----------------------------------------------------------------------------
    def victim(self, evictable: Evictable = always_evictable) -> Any | None:
        if self._stale or len(self._nodes) > 2 * self._scale:
            self._rebuild()
        best = heap_victim(self._heap, self._stale_entry, evictable)
        if best is None and self._nodes:
            # Every leaf pinned, or no leaf at all (only if an owner passed inconsistent parents).
            best = self._scan(evictable)
        return best

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def keys(self) -> Iterable[Any]:
        return self._nodes.keys()

    # -- internals ---------------------------------------------------------------------------
    def _stale_entry(self, entry: tuple[Any, ...]) -> bool:
        """A heap entry of a chunk re-ranked, evicted, or with children now."""
        node = self._nodes.get(entry[3])
        return node is None or node.rank != entry[0] or entry[3] in self._children

    def _rank_and_queue(self, key: Any, node: _Node) -> None:
        node.rank = rank = node.time + self._scale * self._offsets[node.cls]
        if key not in self._children:
            heapq.heappush(self._heap, (rank, -node.depth, next(self._seq), key))

    def _rebuild(self) -> None:
        """Re-rank every chunk for the current regime and size."""
        self._stale = False
        self._offsets = offsets = _OFFSETS[self.quarantine]
        self._scale = scale = max(len(self._nodes), 1)
        children, seq = self._children, self._seq
        heap = []
        for key, node in self._nodes.items():
            node.rank = node.time + scale * offsets[node.cls]
            if key not in children:
                heap.append((node.rank, -node.depth, next(seq), key))
        heapq.heapify(heap)
        self._heap = heap

    def _scan(self, evictable: Evictable) -> Any | None:
        """Slow path when no leaf may go: rank every key, leaves first (never in the simulator)."""
        nodes = self._nodes
        order = sorted(nodes, key=lambda k: (k in self._children, nodes[k].rank, -nodes[k].depth))
        return next((k for k in order if evictable(k)), None)

    def _uses_of(self, key: Any) -> int:
        uses = self._uses.get(key)
        return self._old_uses.get(key, 0) if uses is None else uses

    def _remember(self, key: Any, uses: int, n: int) -> None:
        """Record a use count.  Two generations of HISTORY/2 × n keys each: a key not updated for
        a whole generation is forgotten (cheaper than a strict LRU of counts)."""
        self._uses[key] = uses
        if len(self._uses) > HISTORY / 2 * n:
            self._old_uses, self._uses = self._uses, {}

    def _observe(self, first_use: bool, age: int, n: int) -> None:
        """Count one reuse towards the regime test (see the module docstring)."""
        if self._clock <= WINDOW * n:
            return  # proven reuses this old cannot have happened yet: no fair comparison
        self._observed += 1
        if self._observed >= FORGET * n:  # forget: halve both sides every FORGET × n observations
            self._observed = 0
            self._first /= 2
            self._proven /= 2
        if first_use:
            if age <= n:
                self._first += 1
        elif n < age <= WINDOW * n:
            self._proven += 1
        quarantine = self._proven > self._first
        if quarantine != self.quarantine:
            self.quarantine = quarantine
            self._offsets = _OFFSETS[quarantine]
            self._stale = True
