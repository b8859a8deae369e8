"""The adaptive policy's state (:class:`AdaptiveState`, the base of
:class:`~kvtier.core.policies.adaptive.AdaptivePolicy`) and what runs off the request's path: its set-up, the
sampling rate (``SHADOW_KEYS``, set again when the tier doubles or halves or the tiers below it change), the
re-ranking of every chunk when the ordering switches, and what an operator reads (``mode``, ``switches``,
``shadow_keys``).  What runs on every access and once per engine step (insert, touch, remove, victim, the
shadows' replay) is :mod:`kvtier.core.policies.adaptive`'s, which says why and how the policy works.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from itertools import count
from typing import Any

from kvtier.core.policies.base import EvictionPolicy
from kvtier.core.policies.orderings import (
    DECAY,
    MARGIN,
    MODES,
    NO_PENDING,
    SAMPLE_BITS,
    SIGNIFICANCE,
    Node,
    Shadows,
    ordering_rank,
)

SHADOW_KEYS = 2048  # sampled keys per shadow, at most
PENDING_MAX = 1024
"""Sampled accesses recorded for the shadows' replay at most: the next one replays them first."""


class AdaptiveState(EvictionPolicy):
    """What :class:`~kvtier.core.policies.adaptive.AdaptivePolicy` holds, set up here (``guard``: the LRU
    guard's shadow; ``pending_max``: sampled accesses recorded before a replay), with its cold verbs."""

    def __init__(self, guard: bool = True, pending_max: int = PENDING_MAX) -> None:
        self._clock = 0  # insertions so far: the unit of age
        self._nodes: dict[Any, Node] = {}
        self._children: dict[Any, int] = {}
        self._heap: list[tuple[float, int, int, Any]] = []
        self._seq = count()
        self._uses: dict[Any, tuple[int, int]] = {}  # key -> (uses, clock of last use), recent
        self._old_uses: dict[Any, tuple[int, int]] = {}
        self._long_uses: dict[Any, int] = {}  # key -> uses, over FREQUENCY_HISTORY
        self._old_long_uses: dict[Any, int] = {}
        self._mode, self._scale, self._stale = 0, 1, False
        self._run: tuple[Any, int] = (None, 0)
        self._runs = 0  # request runs inserted (a run: chunks inserted in prompt order)
        self._shadows = Shadows(DECAY, MARGIN, SIGNIFICANCE)
        # sampled accesses not replayed yet: (key, time, uses, gap, long_uses, depth, lucky, capacity, scale)
        self.pending: list[tuple[Any, int, int, int, int, int, bool, int, int]] = []
        self._pending_capacity = NO_PENDING  # the smallest shadows' size among ``pending`` (see Shadows.may_switch)
        self._pending_max = max(1, pending_max)
        self._threshold = 1 << SAMPLE_BITS  # sample every key while the tier is small
        self._sampled_n = 1  # tracked chunks when the sampling rate was last set
        self._switches, self._guarded = 0, guard
        self._below = 0  # chunks the tiers below hold: they take this tier's victims
        self._active = 0  # the ordering the tier uses: the selector's, or LRU while the guard holds
        self._ghost: dict[Any, tuple[int, int, int, Any]] = {}  # full LRU shadow: key -> its live heap entry
        self._ghost_heap: list[tuple[int, int, int, Any]] = []
        self._deficit = 0  # LRU shadow's hits minus the tier's, floored at -len(self)
        self._accesses = 0
        self._outside: dict[Any, None] = {}  # resident chunks the LRU shadow no longer holds, oldest first
        self.hits = 0  # accesses to resident chunks (touches)
        self.lru_hits = 0  # accesses the full LRU shadow would have hit

    @property
    def mode(self) -> str:
        """The ordering the selector chose (the guard overrides its victims when the budget is spent)."""
        self.settle()
        return MODES[self._mode]

    @property
    def switches(self) -> int:
        """Times the selector changed the ordering so far."""
        self.settle()
        return self._switches

    @property
    def shadow_keys(self) -> int:
        """Sampled keys the largest shadow holds now (about SHADOW_KEYS at most)."""
        self.settle()
        return max(len(shadow.nodes) for shadow in self._shadows.shadows)

    def set_capacity_below(self, chunks: int) -> None:
        """The tiers below this one hold ``chunks`` chunks and take its victims (write-back).  The shadows
        then replay the stack's reach (this tier's size plus ``chunks``), so the selector picks an ordering
        for what the stack keeps, not for this tier alone: a victim is not lost, it moves down, and an
        ordering that pays in a lone tier (quarantine of unproven chunks) can cost the stack more first
        reuses than it saves."""
        self._below = max(0, int(chunks))
        self._resample(max(len(self._nodes), 1))

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def keys(self) -> Iterable[Any]:
        return self._nodes.keys()

    def _rebuild(self) -> None:
        """Rank every chunk again (the ordering switched, or the tier doubled or halved: a new scale)."""
        self._stale = False
        n = max(len(self._nodes), 1)
        if n > 2 * self._scale or n * 2 < self._scale:
            self._scale = n
            self._resample(n)
        mode, scale, children, seq = self._active, self._scale, self._children, self._seq
        heap = []
        for key, node in self._nodes.items():
            node.rank = ordering_rank(mode, node.time, node.uses, node.gap, node.mru, scale, node.long_uses)
            if key not in children:
                node.seq = s = next(seq)
                heap.append((node.rank, -node.depth, s, key))
        heapq.heapify(heap)
        self._heap = heap

    def _resample(self, n: int) -> None:
        """Sampling rate for ``n`` tracked chunks: shadows hold at most about SHADOW_KEYS keys, also while a
        tier fills without evicting (no victim asked yet)."""
        self._sampled_n = n
        threshold = min(1 << SAMPLE_BITS, (SHADOW_KEYS << SAMPLE_BITS) // (n + self._below))
        if threshold != self._threshold:
            self.settle()  # the pending accesses were sampled at the old rate
            self._threshold = threshold
            capacity = max(1, ((len(self._nodes) + self._below) * threshold) >> SAMPLE_BITS)  # the shadows' size
            self._shadows.resample(threshold, capacity, self._scale + self._below)
