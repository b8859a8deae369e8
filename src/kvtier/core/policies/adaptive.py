"""kvtier's default: one resident set, several ways to order it, and the tier follows whichever ordering its own
miniature replays say would have hit most on the traffic seen lately.

Why. No single ordering wins everywhere (docs/simulate.md has the tables): LRU is hard to beat when reuses
come back within a tier's lifetime; it thrashes when most chunks are used once (chat: new conversations that
never return; batch scans), where quarantining unproven chunks wins; and both collapse to nothing when a
working set cycles just above the tier's size, where only an ordering that lets new arrivals go first keeps a
stable part of the set. An operator cannot know which regime their traffic is in, and it changes over a day.

How. *Set dueling* (Qureshi et al., "Adaptive insertion policies for high performance caching", ISCA 2007)
with *spatially sampled* shadow caches (Waldspurger et al., "Efficient MRC construction with SHARDS", FAST
2015): a key is sampled when a hash of it falls below ``rate`` (at most ``SHADOW_KEYS`` sampled keys per tier:
``rate = min(1, SHADOW_KEYS / n)``, ``n`` = chunks tracked); for each ordering a shadow of ``rate × n`` slots
replays the sampled keys only (keys and a few integers, no KV) and counts its hits; the hit counts decay by
half every ``DECAY`` shadow-sizes of sampled accesses. The real tier uses the ordering whose shadow leads
beyond noise (``MARGIN``, ``SIGNIFICANCE``: a paired sign test on the accesses where the two shadows disagree;
LRU until one leads). The orderings (``MODES``: ``lru``, ``quarantine``, ``quarantine-long``, ``bip``,
``frequency``) are ranks per chunk, lowest evicted first, ties to the deeper chunk (tail first); what each
ranks by, and where it wins: :mod:`kvtier.core.policies.orderings`.

The prefix constraint holds in every mode: a chunk with resident children is never the victim (leaves first,
as radix-tree caches: SGLang, NeurIPS 2024). Shadows ignore it (their sampled keys rarely include a parent),
which is why they only choose the ordering.

Costs: O(log n) per operation in the real tier, plus, per sampled access, O(log SHADOW_KEYS) in each of the
five shadows; victim rebuilds the heap when the mode switches or the tier doubles. The shadows' replay is off
the request's path: a sampled access is recorded (at most ``PENDING_MAX``) and replayed in bulk, in order, by
:meth:`AdaptivePolicy.settle` (:func:`replay`; the store: once per engine step, ``Index.gate_evictions``).
Decisions are a replay at every access's: what depends on the shadows settles first (``victim`` if the pending
accesses could switch the mode, ``Shadows.may_switch``; a new sampling rate; ``mode``, ``switches``,
``shadow_keys``). Owners should offer every full chunk of each request: ``touch`` the resident ones and
``insert`` the missing ones in prompt order, as the simulator does.

This module is what runs on every access and once per step; the policy's state, set-up, re-ranking and
resampling, and what an operator reads, are :mod:`kvtier.core.policies.adaptive_state`'s.
"""

from __future__ import annotations

import heapq
from collections.abc import Container, Iterable, Sequence
from itertools import chain
from typing import Any

from kvtier.core.policies.adaptive_state import AdaptiveState
from kvtier.core.policies.base import Evictable, always_evictable
from kvtier.core.policies.orderings import (
    BIP_LUCKY,
    FREQUENCY_BONUS,
    HASH_MASK,
    HASH_MIX,
    MAX_USES,
    MEMORY,
    NO_PENDING,
    QUARANTINE,
    SAMPLE_BITS,
    Node,
    Shadows,
    ordering_rank,
)

FREQUENCY_HISTORY = 128.0
"""``frequency`` counts uses over this many tier-sizes of keys, at least half as many (keys only)."""
HISTORY = 32.0
"""Use counts are remembered for this many tier-sizes of keys, at least half as many (keys only)."""
_SHIFT = 64 - SAMPLE_BITS  # sample_hash(key) == ((hash(key) * HASH_MIX) & HASH_MASK) >> _SHIFT

GUARD_SHARE = 0.0008
"""The guard's allowance grows by this share of the tier's accesses (0.08 %: 0.08 point)..."""
GUARD_CREDIT = 16
"""...from this many hits (room for the selector's first trial on a short trace).  The tier's hits never
trail its full LRU shadow's by more than the allowance plus one (docs/simulate.md, "The guard")."""


def replay(shadows: Shadows, mode: int, accesses: list[tuple[Any, int, int, int, int, int, bool, int, int]],
           seq: Any) -> tuple[int, int]:
    """Replay the recorded sampled ``accesses`` (``(key, time, uses, gap, long_uses, depth, lucky, capacity,
    scale)``), in order, in every shadow of ``shadows``, each as one access of the real tier would (its rank
    in each ordering inlined: ``ordering_rank``'s); returns the ordering the tier should use from now on
    (``mode``, the current one, unless another leads beyond noise) and how many times it changed on the way.
    The policy's :meth:`AdaptivePolicy.settle`, once per engine step."""
    switches, push, pop = 0, heapq.heappush, heapq.heappop
    all_shadows, wins = shadows.shadows, shadows.wins
    for key, time, uses, gap, long_uses, depth, lucky, capacity, scale in accesses:
        hits = []
        cold = time - scale * QUARANTINE  # each mode's rank, once per access (bip's: a used chunk)
        warm = time + scale * min(uses, MAX_USES) if uses else cold
        ranks = (time, warm if uses and gap <= MEMORY[0] * scale else cold, warm if uses and gap <= MEMORY[1] * scale
                 else cold, time, time + scale * FREQUENCY_BONUS * min(long_uses, MAX_USES) if long_uses else cold)
        for shadow in all_shadows:
            nodes = shadow.nodes
            node = nodes.get(key)
            if node is not None:
                shadow.hits += 1
                node.time, node.uses, node.gap, node.long_uses, node.mru = time, uses, gap, long_uses, True
                hits.append(True)
            else:
                node = nodes[key] = Node(time, uses, gap, long_uses, depth, None, lucky)
                hits.append(False)
            mode_ = shadow.mode  # (only bip's rank depends on mru: -1 - time for a chunk neither used nor lucky)
            node.rank = rank = ranks[mode_] if mode_ != 3 or node.mru else -1.0 - time
            node.seq = s = next(seq)
            heap = shadow.heap
            push(heap, (rank, -node.depth, s, key))
            if len(nodes) > capacity:
                while len(nodes) > capacity and heap:
                    _, _, s, gone = pop(heap)
                    old = nodes.get(gone)
                    if old is not None and old.seq == s:
                        del nodes[gone]
            if len(heap) > 4 * len(nodes) + 64:
                shadow.shrink(capacity)
        if any(hits) and not all(hits):
            for a, hit in enumerate(hits):
                if hit:
                    row = wins[a]
                    for b, other in enumerate(hits):
                        if not other:
                            row[b] += 1
        shadows.sampled += 1
        if shadows.sampled >= shadows.decay * capacity:
            shadows.sampled = 0
            for shadow in all_shadows:
                shadow.hits /= 2
            for row in wins:
                for b in range(len(row)):
                    row[b] /= 2
        best, top = 0, all_shadows[0].hits
        for m in range(1, len(all_shadows)):
            if all_shadows[m].hits > top:
                best, top = m, all_shadows[m].hits
        if best == mode:
            continue
        current = all_shadows[mode].hits
        lead = top - current
        if lead > shadows.margin * current and lead * lead > shadows.significance * (wins[best][mode] + wins[mode][best]):
            mode = best
            switches += 1
    return mode, switches

class AdaptivePolicy(AdaptiveState):
    """See the module docstring.  ``mode`` is the ordering in use (one of ``MODES``); its state, set-up and
    cold verbs: :class:`~kvtier.core.policies.adaptive_state.AdaptiveState`."""

    name = "adaptive"

    def settle(self) -> None:
        """Replay the recorded sampled accesses in every shadow, in order, in one call (:func:`replay`),
        switching the tier's ordering where the selector would have (the store: once per engine step)."""
        if not self.pending:
            return
        pending, self.pending, self._pending_capacity = self.pending, [], NO_PENDING
        mode, switches = replay(self._shadows, self._mode, pending, self._seq)
        if switches:  # as a switch at the access itself: the next victim re-ranks every chunk
            self._mode = self._active = mode
            self._switches += switches
            self._stale = True

    # -- mutations ---------------------------------------------------------------------------
    def insert(self, key: Any, parent: Any | None) -> None:
        nodes = self._nodes
        if key in nodes:
            self.touch([key])
            return
        self._clock = clock = self._clock + 1
        run_key, run_time = self._run
        up = nodes.get(parent) if parent is not None else None
        if parent is not None and parent == run_key:
            time = run_time
        else:
            time = clock
            self._runs += 1
        self._run = (key, time)
        uses, gap, long_uses = self._count(key, clock)
        depth = up.depth + 1 if up else 0
        lucky = self._runs % BIP_LUCKY == 0
        node = nodes[key] = Node(time, uses, gap, long_uses, depth, parent, lucky)
        if parent is not None:
            self._children[parent] = self._children.get(parent, 0) + 1
        active = self._active  # lru (the usual ordering) ranks by time alone: no call on the hot path
        node.rank = rank = time if active == 0 else ordering_rank(active, time, uses, gap, lucky, self._scale, long_uses)
        if key not in self._children:
            node.seq = s = next(self._seq)
            heapq.heappush(self._heap, (rank, -depth, s, key))
        if self._guarded:  # the full LRU shadow (keys only, as many as the tier holds): see _over_budget
            ghost_time = time
            if up is not None:
                above = self._ghost.get(parent)
                if above is not None and above[0] < time:
                    ghost_time = above[0]  # a chunk is never more recent than its prefix
            ghost_hit = key in self._ghost
            self._ghost[key] = entry = (ghost_time, -depth, next(self._seq), key)  # (time, -depth, seq, key)
            heapq.heappush(self._ghost_heap, entry)
            self._outside.pop(key, None)
            self._trim_ghost()
            self._accesses += 1
            self.lru_hits += ghost_hit
            self._deficit = max(-len(nodes), self._deficit + ghost_hit)  # banked gains pay for one tier-size of losses
        if len(nodes) > 2 * self._sampled_n:  # a tier that fills without evicting
            self._resample(len(nodes))
        if ((hash(key) * HASH_MIX) & HASH_MASK) >> _SHIFT < self._threshold:  # sample_hash: record for settle()
            capacity = max(1, ((len(nodes) + self._below) * self._threshold) >> SAMPLE_BITS)  # the shadows' size
            self.pending.append((key, time, uses, gap, long_uses, depth, lucky, capacity, self._scale + self._below))
            self._pending_capacity = min(self._pending_capacity, capacity)
            if len(self.pending) >= self._pending_max:
                self.settle()

    def touch(self, keys: Sequence[Any]) -> None:
        # The hit path: insert's steps per resident key in one loop, in order; a settle() may switch the ordering.
        nodes, children, heap, seq, push = self._nodes, self._children, self._heap, self._seq, heapq.heappush
        clock, threshold, guarded, scale = self._clock, self._threshold, self._guarded, self._scale + self._below
        n = max(len(nodes), 1)
        long_limit, uses_limit, floor = FREQUENCY_HISTORY / 2 * n, HISTORY / 2 * n, -len(nodes)
        long_d, old_long, uses_d, old_uses = self._long_uses, self._old_long_uses, self._uses, self._old_uses
        turn = len(long_d) + len(keys) > long_limit or len(uses_d) + len(keys) > uses_limit  # a generation may end
        ghost, outside, missing, lru_hits, deficit = self._ghost, self._outside, 0, 0, self._deficit
        capacity = max(1, ((len(nodes) + self._below) * threshold) >> SAMPLE_BITS)  # the shadows' size
        active, pending, ghost_heap = self._active, self.pending, self._ghost_heap
        for key in keys:
            node = nodes.get(key)
            if node is None:
                missing += 1
                continue
            long_uses = long_d.get(key) or old_long.get(key, 0)  # (counts held are >= 1, (uses, last) pairs truthy)
            long_d[key] = long_uses + 1
            uses, last = uses_d.get(key) or old_uses.get(key, (0, -(1 << 62)))
            uses_d[key] = (uses + 1, clock)
            if turn:
                if len(long_d) > long_limit:
                    self._old_long_uses, self._long_uses = old_long, long_d = long_d, {}
                if len(uses_d) > uses_limit:
                    self._old_uses, self._uses = old_uses, uses_d = uses_d, {}
            gap = clock - last
            node.uses, node.gap, node.long_uses, node.time, node.mru = uses, gap, long_uses, clock, True
            depth = node.depth
            node.rank = rank = clock if active == 0 else \
                ordering_rank(active, clock, uses, gap, True, self._scale, long_uses)
            if key not in children:
                node.seq = s = next(seq)
                push(heap, (rank, -depth, s, key))
            if guarded:
                ghost_hit = key in ghost
                ghost[key] = entry = (clock, -depth, next(seq), key)
                push(ghost_heap, entry)
                if not ghost_hit:  # (a key the shadow holds is never outside it; only a miss grows it)
                    outside.pop(key, None)
                if len(ghost) > -floor or len(ghost_heap) > 2 * len(ghost) + 64:
                    self._trim_ghost()
                    ghost_heap = self._ghost_heap
                lru_hits += ghost_hit
            if ((hash(key) * HASH_MIX) & HASH_MASK) >> _SHIFT < threshold:  # sample_hash, inlined
                pending.append((key, clock, uses, gap, long_uses, depth, False, capacity, scale))
                self._pending_capacity = min(self._pending_capacity, capacity)
                if len(pending) >= self._pending_max:
                    self.settle()
                    active, pending = self._active, self.pending
        if len(heap) > 2 * len(nodes) + self.heap_slack:  # a touched leaf is queued again: stale ones dropped
            self._heap = self.compact_heap(
                heap, lambda e: (nd := nodes.get(e[3])) is None or nd.seq != e[2] or e[3] in children)
        if guarded and (hits := len(keys) - missing):  # each access's max(floor, deficit + ghost_hit - 1), in
            self._accesses, self.hits = self._accesses + hits, self.hits + hits  # one: its steps are <= 0
            self.lru_hits += lru_hits
            self._deficit = max(floor, deficit + lru_hits - hits)

    def remove(self, key: Any) -> None:
        node = self._nodes.pop(key, None)
        if node is None:
            return
        if self._guarded:
            self._outside.pop(key, None)
            self._trim_ghost()
        parent = node.parent
        if parent is not None:
            left = self._children[parent] - 1
            if left:
                self._children[parent] = left
            else:
                del self._children[parent]
                up = self._nodes.get(parent)
                if up is not None:  # became a leaf: a candidate again
                    up.seq = s = next(self._seq)
                    heapq.heappush(self._heap, (up.rank, -up.depth, s, parent))

    # -- queries -----------------------------------------------------------------------------
    def victim(self, evictable: Evictable = always_evictable, held: Container[Any] = ()) -> Any | None:
        """The base's ``victim``; a key in ``held`` (the owner's pins, asked by membership: no call per candidate)
        never goes, and ``evictable`` is asked only when it is not ``always_evictable``."""
        ask = evictable is not always_evictable
        if self.pending and self._shadows.may_switch(self._mode, len(self.pending), self._pending_capacity):
            self.settle()
        if self._stale or len(self._nodes) > 2 * self._scale:
            self._rebuild()
        nodes, children = self._nodes, self._children

        if self._guarded and self._over_budget():  # the oldest outside the shadow (a chunk leaves it after its
            # children); none outside: the tier holds what the shadow holds, so the shadow's least recent, as in LRU
            for key in chain(self._outside, (self._shadow_oldest(),)):
                if key in nodes and key not in children and key != self._run[0] and key not in held \
                        and (not ask or evictable(key)):
                    return key

        # The chunk inserted last is the parent of the next one of its prompt: evicting it before that one
        # arrives would leave a chunk that can never be served (its prefix is gone): it goes last.
        last, heap, pinned, best = self._run[0], self._heap, [], None
        while heap:  # base.heap_victim, inlined (the hit path's evictions: no call per entry)
            entry = heap[0]
            key = entry[3]
            node = nodes.get(key)
            if node is None or node.seq != entry[2] or key in children:  # re-queued, evicted, or gained children
                heapq.heappop(heap)
            elif key != last and key not in held and (not ask or evictable(key)):
                best = key
                break
            else:  # pinned by a transfer in flight (or the last chunk inserted): kept
                pinned.append(heapq.heappop(heap))
        for entry in pinned:
            heapq.heappush(heap, entry)
        if best is None and last in nodes and last not in children and last not in held and (not ask or evictable(last)):
            best = last
        if best is None and nodes:
            order = sorted(nodes, key=lambda k: (k in children, nodes[k].rank, -nodes[k].depth))
            best = next((k for k in order if k not in held and (not ask or evictable(k))), None)
        return best

    def evict(self, num_chunks: int, evictable: Evictable = always_evictable, held: Container[Any] = ()) -> list[Any]:
        victims: list[Any] = []  # (the base class's loop, here: a promotion's victims are one call into this file)
        while len(victims) < num_chunks and (key := self.victim(evictable, held)) is not None:
            self.remove(key)
            victims.append(key)
        return victims

    def insert_many(self, pairs: Iterable[tuple[Any, Any | None]]) -> None:
        for key, parent in pairs:  # (the base class's loop, here for the same reason)
            self.insert(key, parent)

    # -- internals ---------------------------------------------------------------------------
    def _over_budget(self) -> bool:
        """Whether evicting a chunk the LRU shadow still holds could break the bound.

        ``deficit`` (the shadow's hits minus the tier's) plus ``len(outside)`` (resident chunks the shadow
        has dropped) only grows, by one, when the tier evicts a chunk the shadow holds; every access the
        shadow hits and the tier misses is paid by one chunk outside the shadow (docs/simulate.md, "The
        guard").  So while it would pass the allowance the victim comes from outside the shadow, and the
        deficit never exceeds ``GUARD_SHARE × accesses + GUARD_CREDIT + 1``."""
        allowance = GUARD_SHARE * self._accesses + GUARD_CREDIT
        if self._below:  # above write-back tiers: what this tier keeps apart from LRU shapes theirs too
            allowance *= len(self._nodes) / (len(self._nodes) + self._below)
        return self._deficit + len(self._outside) + 1 > allowance

    def _shadow_oldest(self) -> Any | None:
        ghost, heap = self._ghost, self._ghost_heap  # the LRU shadow's least recent key, stale entries dropped
        while heap and ((entry := ghost.get(heap[0][3])) is None or entry[2] != heap[0][2]):
            heapq.heappop(heap)
        return heap[0][3] if heap else None

    def _trim_ghost(self) -> None:
        ghost, heap, n, pop = self._ghost, self._ghost_heap, len(self._nodes), heapq.heappop
        nodes, outside = self._nodes, self._outside
        while len(ghost) > n and heap:
            _, _, s, key = pop(heap)
            entry = ghost.get(key)
            if entry is not None and entry[2] == s:
                del ghost[key]
                if key in nodes:
                    outside[key] = None
        if len(heap) > 2 * len(ghost) + 64:  # drop stale entries now and then
            self._ghost_heap = [e for e in heap if (g := ghost.get(e[3])) is not None and g[2] == e[2]]
            heapq.heapify(self._ghost_heap)

    def _count(self, key: Any, clock: int) -> tuple[int, int, int]:
        """(prior uses, insertions since the previous use, prior uses in the long history) of
        ``key``, then count this use.  Remembered for HISTORY/2 to HISTORY tier-sizes of keys,
        and FREQUENCY_HISTORY/2 to FREQUENCY_HISTORY (two generations each)."""
        n = max(len(self._nodes), 1)
        long_uses = self._long_uses[key] if key in self._long_uses else self._old_long_uses.get(key, 0)
        self._long_uses[key] = long_uses + 1
        if len(self._long_uses) > FREQUENCY_HISTORY / 2 * n:
            self._old_long_uses, self._long_uses = self._long_uses, {}
        uses, last = self._uses[key] if key in self._uses else self._old_uses.get(key, (0, -(1 << 62)))
        self._uses[key] = (uses + 1, clock)
        if len(self._uses) > HISTORY / 2 * n:
            self._old_uses, self._uses = self._uses, {}
        return uses, clock - last, long_uses
