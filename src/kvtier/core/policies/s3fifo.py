"""S3-FIFO: scan- and one-hit-wonder-resistant eviction from three FIFO queues.

Source: Juncheng Yang, Yazhuo Zhang, Ziyue Qiu, Yao Yue, K. V. Rashmi, "FIFO queues are all you
need for cache eviction", SOSP 2023 (https://jasony.me/publication/sosp23-s3fifo.pdf).  This is our
own implementation of the algorithm as the paper describes it::

    new key ──► S (small FIFO, ~10 % of entries) ──head, used again?──► yes: M tail
                                                  └──────────────────► no:  evict, key to G
    key found in G (ghost FIFO, keys only) ──► M (main FIFO, ~90 %)
    M head: used since insert/reinsert? yes: back to M tail with freq-1;  no: evict

Each key has a frequency capped at 3 (the paper's two bits).  A burst of chunks used once (a
scan, or one-shot prompts) passes through S and leaves without displacing M, which holds the
chunks that were reused — LRU instead lets every new chunk push the oldest reused one out.

Adapting to the kvtier contract: the policy is never told the tier's capacity, so "S is over its
10 %" is judged against the number of tracked keys when a victim is asked for (the tier is full
then), and G holds at most 90 % as many keys as are tracked.  ``victim`` performs the paper's
lazy moves (S→M promotion, M reinsertion); they reorder internal queues only, never change the
tracked set, and a repeated ``victim`` call returns the same key until the next mutation.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvtier.core.policies.base import Evictable, EvictionPolicy, always_evictable

SMALL_SHARE = 0.1
"""Share of entries for S (the paper's default, found to generalise across its traces)."""
MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO (Yang et al., SOSP'23).  O(1) amortised per operation."""

    name = "s3fifo"

    def __init__(self, small_share: float = SMALL_SHARE) -> None:
        self.small_share = small_share
        self._small: OrderedDict[Any, None] = OrderedDict()
        self._main: OrderedDict[Any, None] = OrderedDict()
        self._ghost: OrderedDict[Any, None] = OrderedDict()
        self._freq: dict[Any, int] = {}
        self._pending: Any | None = None  # victim already chosen, valid until the next mutation

    def insert(self, key: Any, parent: Any | None) -> None:
        if key in self._freq:
            self.touch([key])
            return
        self._pending = None
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, keys: Sequence[Any]) -> None:
        freq = self._freq
        for key in keys:
            f = freq.get(key)
            if f is not None and f < MAX_FREQ:
                freq[key] = f + 1
                self._pending = None

    def remove(self, key: Any) -> None:
        if self._freq.pop(key, None) is None:
            return
        self._pending = None
        if key in self._small:
            del self._small[key]
            self._ghost[key] = None
            limit = max(1, int(len(self._freq) * (1 - self.small_share)))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def victim(self, evictable: Evictable = always_evictable) -> Any | None:
        if self._pending is not None and evictable(self._pending):
            return self._pending
        key = None
        if len(self._small) >= self.small_share * len(self._freq):
            key = self._from_small(evictable)
        if key is None:
            key = self._from_main(evictable)
        if key is None:  # M was all pinned: any evictable key of S will do
            key = next((k for k in self._small if evictable(k)), None)
        self._pending = key
        return key

    def _from_small(self, evictable: Evictable) -> Any | None:
        small, main, freq = self._small, self._main, self._freq
        for _ in range(len(small)):
            key = next(iter(small))
            if freq[key] > 0:  # reused while in S: promote, forgetting the count (paper)
                del small[key]
                main[key] = None
                freq[key] = 0
            elif evictable(key):
                return key
            else:  # pinned: look past it
                small.move_to_end(key)
        return None

    def _from_main(self, evictable: Evictable) -> Any | None:
        main, freq = self._main, self._freq
        # Each pass lowers every frequency, so after MAX_FREQ + 1 passes one is 0.
        for _ in range(len(main) * (MAX_FREQ + 1)):
            key = next(iter(main))
            if freq[key] == 0 and evictable(key):
                return key
            if freq[key] > 0:
                freq[key] -= 1
            main.move_to_end(key)
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq

    def keys(self) -> Iterable[Any]:
        return self._freq.keys()
