"""The eviction gate: when the top tier may let a chunk go, so that a planned hit is still there when pinned.

A store's index is mirrored elsewhere (vLLM's scheduler, :mod:`kvtier.core.changes`): the mirror
learns of a change at a drain and plans loads from it; the plan is pinned later
(``TieredStore.prepare_load`` on the engine's thread, the step after the drain).  A chunk that
leaves the cpu tier between that drain and that pin was planned as a hit and is gone: the load
comes up short (``kvtier_unfilled_tokens_total``) and vLLM recomputes it.  The soak of
``scripts/attribution_check.py`` caught two such paths at ``c948028`` (docs/architecture.md, "Plan
and pin"): a write-back tier's writer thread finishing a spill ahead (``TopTier.written``,
``evict_after``), and a loader thread's promotion taking a page (``Promoter.buffer_locked`` →
``TopTier.free_page``), 0.5 and 8 ms after the drain; a staged copy dropped when its write
ends (``TopTier.release_staged``) is a third.

The gate closes that window.  While **closed** (from the drain until the next step's planned
loads are pinned, :meth:`TieredStore.gate_evictions <kvtier.core.store.TieredStore.gate_evictions>`):

- ``TopTier.free_page`` takes only a page that is already free; it evicts nothing (a promotion
  then reads into a private buffer, as it does when every page is pinned; a save's chunks are
  dropped and counted, as when the cpu tier is full);
- a spill ahead evicts nothing;
- a chunk written by a spill ahead (``evict_after``) and a staged copy whose last write ended stay
  held; their leaving is :meth:`deferred <EvictionGate.later>` and happens when the gate opens.

While **open** everything is as without a gate.  A store nobody gates is always open.

Bounds: one deferred action per chunk (a dict keyed by chunk), so at most the chunks the top tier
holds; nothing waits on the gate (a thread that finds it closed takes the free-page-only path).

All methods need the store's lock.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.keys import ChunkKey


class EvictionGate:
    """Whether the top tier may let chunks go now (``closed``), and what waits for it to open.

    ``closed`` and ``deferred`` are plain attributes: the store flips the gate twice per engine
    step by attribute alone and calls :meth:`run_deferred` only when something waits, so the gate
    costs the hit path no call (``tests/integrations/test_hit_story.py`` counts them)."""

    def __init__(self) -> None:
        self.closed = False
        self.deferred: dict[ChunkKey, Callable[[ChunkKey], None]] = {}  # chunk -> its leaving, in order

    def later(self, key: ChunkKey, action: Callable[[ChunkKey], None]) -> None:
        """Run ``action(key)`` now if open, else when the gate next opens (the last action per chunk)."""
        if self.closed:
            self.deferred[key] = action
        else:
            action(key)

    def run_deferred(self) -> None:
        """The gate is open: run what waited for it, in the order it was deferred."""
        later, self.deferred = self.deferred, {}
        for key, action in later.items():
            action(key)
