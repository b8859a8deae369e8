"""The eviction gate: when the top tier may let a chunk go, so that a planned hit is still there when pinned.

A store's index is mirrored elsewhere (vLLM's scheduler, :mod:`kvtier.core.changes`): the mirror
learns of a change at a drain and plans loads from it; the plan is pinned later
(``TieredStore.prepare_load`` on the engine's thread, the step after the drain).  A chunk that
leaves the cpu tier between that drain and that pin was planned as a hit and is gone: the load
comes up short (``kvtier_unfilled_tokens_total``) and vLLM recomputes it.  The soak of
``scripts/attribution_check.py`` caught two such paths at ``c948028`` (docs/architecture.md, "Plan
and pin"): a write-back tier's writer thread finishing a spill ahead (a write with
``evict_after``), and a loader thread's promotion taking a page (an eviction to make room), 0.5 and
8 ms after the drain; a staged copy dropped when its last write ends is a third.

The gate closes that window.  The index (:class:`~kvtier.core.index.Index`) holds one and decides
with it in one place, :meth:`Index.may_free_page <kvtier.core.index.Index.may_free_page>` (may
this chunk's page be freed now).  While **closed** (from the drain until the next step's planned
loads are pinned, :meth:`TieredStore.gate_evictions <kvtier.core.store.TieredStore.gate_evictions>`)
it answers no for every chunk, so:

- a page is taken only if already free; nothing is evicted (a promotion then reads into a
  private buffer, as when every page is pinned; a save's chunks are dropped and counted, as when
  the cpu tier is full);
- a spill ahead evicts and plans nothing;
- a chunk written by a spill ahead (``evict_after``) and a staged copy whose last write ended stay
  held; their leaving is deferred (:attr:`EvictionGate.deferred`) and happens when the gate opens
  (:meth:`IndexUpkeep.let_go <kvtier.core.upkeep.IndexUpkeep.let_go>`, which checks again that the
  chunk may go and that every write-back tier holds it).

While **open** everything is as without a gate.  A store nobody gates is always open.

Bounds: at most one deferred entry per chunk (a dict keyed by chunk), so at most the chunks the
top tier holds; nothing waits on the gate (a thread that finds it closed takes the free-page-only
path).
"""

from __future__ import annotations

from kvtier.core.keys import ChunkKey


class EvictionGate:
    """Whether the top tier may let chunks go now (``closed``), and whose leaving waits for it to open.

    Plain attributes, read and set under the index's lock: the store flips the gate twice per
    engine step by attribute alone, so the gate costs the hit path no call
    (``tests/integrations/test_hit_story.py`` counts them)."""

    def __init__(self) -> None:
        self.closed = False
        self.deferred: dict[ChunkKey, None] = {}  # chunks whose leaving waits for the gate, in order

    def take(self) -> list[ChunkKey]:
        """The deferred chunks, in the order they were deferred; none are left deferred."""
        keys, self.deferred = list(self.deferred), {}
        return keys
