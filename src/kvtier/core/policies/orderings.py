"""The orderings the adaptive policy (:mod:`kvtier.core.policies.adaptive`) chooses among, and
the sampled shadow cache that replays one of them.

Each ordering is a rank per chunk (:func:`ordering_rank`), lowest evicted first, ties to the deeper
chunk (tail first); ``n`` is the tier's size in chunks:

- ``lru``: time of last use.
- ``quarantine``: time of last use, minus ``QUARANTINE × n`` if the chunk was never used before
  (within the remembered history), plus ``min(uses, MAX_USES) × n`` otherwise: one-hit chunks
  leave first, proven ones stay longer the more they were used (2Q, VLDB'94; S3-FIFO, SOSP'23;
  LRFU, IEEE ToC 2001).  This is what the earlier default ``prefix-freq`` did when quarantining.
- ``quarantine-long``: the same with a longer memory (``MEMORY``).
- ``bip``: bimodal insertion (Qureshi et al. 2007): a chunk that arrives goes to the *bottom*
  (evicted before anything that has been used while resident) except one request run in
  ``BIP_LUCKY``; a used chunk goes to the top.  A cycling working set then keeps a stable part
  resident instead of evicting each chunk just before its reuse.
- ``frequency``: time of last use, plus ``FREQUENCY_BONUS × min(uses, MAX_USES) × n`` with uses
  counted over a long, bounded history (:data:`~kvtier.core.policies.adaptive.FREQUENCY_HISTORY`
  tier-sizes of keys), minus ``QUARANTINE × n`` if never used there: LFU with LRU among equals and
  aging by forgetting
  (LRFU, IEEE ToC 2001; the long-window frequency of TinyLFU, Einziger et al., ACM ToS 2017,
  kept as exact counts of keys rather than a count-min sketch).  It keeps a hot set whose
  members return after more tier-sizes than the other orderings remember (a batch job's hot
  prompts among scan-once documents).

A :class:`Shadow` holds one ordering's replay over the sampled keys only (:func:`sample_hash` below the
sampling threshold; keys and a few integers, no KV) and counts its hits; :class:`Shadows` holds all of them,
their pairwise wins and the selection rule; :class:`Node` is a chunk's record, in the real tier and in the
shadows alike.  This module runs off the request's path (set-up, a resample, a heap compaction now and then,
whether a victim must wait for the replay): the replay itself, once per engine step, is the policy's own
(:func:`kvtier.core.policies.adaptive.replay`), with the state it changes.
"""

from __future__ import annotations

import heapq
from typing import Any

import msgspec

MODES = ("lru", "quarantine", "quarantine-long", "bip", "frequency")
QUARANTINE = 5.0
"""``quarantine``: a never-used chunk ranks as if last used this many tier-sizes earlier."""
MAX_USES = 7
BIP_LUCKY = 32
"""``bip``: one request run in this many is inserted at the top instead of the bottom."""
MEMORY = (8.0, 32.0)
"""``quarantine`` / ``quarantine-long``: a chunk counts as used before if its previous use lies
within this many tier-sizes of insertions."""
FREQUENCY_BONUS = 16.0
"""``frequency``: each prior use ranks a chunk this many tier-sizes later (up to MAX_USES)."""

HASH_MIX = 0x9E3779B97F4A7C15
HASH_MASK = (1 << 64) - 1
SAMPLE_BITS = 24
"""A key's sample hash (:func:`sample_hash`) is this many bits: sampled when below the threshold."""

DECAY = 8.0
"""Shadow hit counts halve every this many shadow-sizes of sampled accesses."""
MARGIN = 0.05
SIGNIFICANCE = 9.0
"""A shadow must lead the current mode's shadow by MARGIN of its hits, and by more than
``sqrt(SIGNIFICANCE × discordant)`` (three standard deviations of a paired sign test), to switch
the tier to its ordering.  ``discordant``: sampled accesses on which exactly one of the two
shadows hit (decayed like the hits).  Every shadow replays the same sampled keys, so their hit
counts are strongly correlated; under "no difference" the lead is a sum of ±1 over the
discordant accesses, variance = their count (McNemar, Psychometrika 1947), not the sum of both
hit counts that treating them as independent Poisson counts gives: a real lead of a few percent
clears it within a short trace.  Three sigma, not two, because the test is repeated at every
sampled access; on independent uniform draws (every ordering equal) it switched in 1 stream of
20, once, over 60 tier-sizes of traffic each (tests/core/test_policies_adaptive.py)."""

NO_PENDING = 1 << 62
"""The smallest shadows' size of no pending sampled access (above any real one)."""


def ordering_rank(mode: int, time: int, uses: int, gap: int, mru: bool, scale: int, long_uses: int) -> float:
    if mode == 0:
        return time
    if mode < 3:
        if uses and gap <= MEMORY[mode - 1] * scale:
            return time + scale * min(uses, MAX_USES)
        return time - scale * QUARANTINE
    if mode == 3:
        return time if mru else -1.0 - time
    if long_uses:
        return time + scale * FREQUENCY_BONUS * min(long_uses, MAX_USES)
    return time - scale * QUARANTINE


class Node(msgspec.Struct, eq=False, gc=False):
    """A chunk's record (a Struct: built in C, so a policy's insert runs no Python function here;
    ``gc=False``: it holds ints and a key, never a cycle)."""

    time: int  # clock of last use, shared by one request's chain
    uses: int  # prior uses (remembered ones)
    gap: int  # insertions between the previous use and the last one
    long_uses: int  # prior uses within the long history (``frequency``)
    depth: int
    parent: Any  # its parent's key (None: chunk 0)
    mru: bool  # bip: used while resident, or inserted by a lucky run
    rank: float = 0.0
    seq: int = -1  # seq of its live heap entry: older entries are stale


class Shadow:
    """One ordering replayed over the sampled keys only; counts its hits (the replay of one access
    is :func:`~kvtier.core.policies.adaptive.replay`'s loop, all shadows at once)."""

    def __init__(self, mode: int) -> None:
        self.mode = mode
        self.nodes: dict[Any, Node] = {}
        self.heap: list[tuple[float, int, int, Any]] = []
        self.hits = 0.0

    def shrink(self, capacity: int) -> None:
        nodes, heap = self.nodes, self.heap
        while len(nodes) > capacity and heap:
            _, _, s, key = heapq.heappop(heap)
            node = nodes.get(key)
            if node is not None and node.seq == s:
                del nodes[key]
        if len(heap) > 4 * len(nodes) + 64:  # drop stale entries now and then
            self.heap = [e for e in heap if (n := nodes.get(e[3])) is not None and n.seq == e[2]]
            heapq.heapify(self.heap)

    def resample(self, threshold: int, capacity: int, scale: int) -> None:
        """Keep only keys still sampled under ``threshold``; re-rank for ``scale``."""
        self.nodes = {k: v for k, v in self.nodes.items() if sample_hash(k) < threshold}
        self.heap = []
        for key, node in self.nodes.items():
            node.rank = ordering_rank(self.mode, node.time, node.uses, node.gap, node.mru, scale, node.long_uses)
            self.heap.append((node.rank, -node.depth, node.seq, key))
        heapq.heapify(self.heap)
        self.shrink(capacity)


class Shadows:
    """One :class:`Shadow` per ordering (``MODES``), their pairwise wins and the selection rule
    (``decay``, ``margin``, ``significance``: the adaptive policy passes :data:`DECAY`, :data:`MARGIN`,
    :data:`SIGNIFICANCE`)."""

    def __init__(self, decay: float, margin: float, significance: float) -> None:
        self.shadows = [Shadow(m) for m in range(len(MODES))]
        self.wins = [[0.0] * len(MODES) for _ in MODES]  # [a][b]: sampled accesses a hit and b missed
        self.sampled = 0  # sampled accesses since the last decay
        self.decay, self.margin, self.significance = decay, margin, significance

    def may_switch(self, mode: int, k: int, smallest_capacity: int) -> bool:
        """Whether :func:`~kvtier.core.policies.adaptive.replay` of ``k`` pending sampled accesses, the
        smallest shadows' size among them ``smallest_capacity``, could change the ordering from ``mode``
        (if not, the tier's victim is the same before and after the replay, which can wait).

        Without a decay, ``k`` accesses change each shadow's hits by at most ``k``, and the lead
        of shadow ``b`` over the current one (``L``) by ``a - c``, where ``a`` / ``c`` accesses hit
        in only one of the two, which adds ``a + c`` to their discordant count ``D``.  A switch
        to ``b`` needs ``L > margin × current`` (so ``L0 + k > margin × current0``) and
        ``L² > significance × D`` with ``L > 0``; ``(L0 + a)² − significance × (D0 + a)`` is convex
        in ``a``, so over ``0 ≤ a ≤ k`` it is largest at ``a = 0`` or ``a = k`` (``|L| ≤ D``
        always).  A decay within the pending accesses: assume it could."""
        if self.sampled + k >= self.decay * smallest_capacity:
            return True
        current, wins, s = self.shadows[mode].hits, self.wins, self.significance
        for b, shadow in enumerate(self.shadows):
            if b == mode:
                continue
            lead = shadow.hits - current
            if lead + k <= self.margin * current:
                continue
            d = wins[b][mode] + wins[mode][b]
            if (lead + k) ** 2 > s * (d + k) or (lead > 0 and lead * lead > s * d):
                return True
        return False

    def resample(self, threshold: int, capacity: int, scale: int) -> None:
        """:meth:`Shadow.resample` of every shadow."""
        for shadow in self.shadows:
            shadow.resample(threshold, capacity, scale)


def sample_hash(key: Any) -> int:
    return ((hash(key) * HASH_MIX) & HASH_MASK) >> (64 - SAMPLE_BITS)
