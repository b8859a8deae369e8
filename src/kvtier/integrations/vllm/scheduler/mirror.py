"""The scheduler's in-memory mirror of every rank's store index, and the pages of load and save
jobs planned from it (:class:`PagePlanner`, over the engine's
:class:`~kvtier.integrations.vllm.scheduler.pages.HybridPlan`).

Fed only by the :class:`~kvtier.integrations.vllm.protocol.RankReport` s that vLLM carries back
from the workers each step; read by ``get_num_new_matched_tokens`` without any I/O.

- One view for all tensor-parallel ranks: a chunk is available only when **every** rank holds
  it (each rank stores its own KV heads of it).  Its tier, for vLLM's hit-source metrics, is the
  slowest tier any rank holds it in (the registry's order, :func:`~kvtier.core.tiers.registry.slowest`).
- The mirror is ready once every rank has sent its first full snapshot (sent at the first step
  after start-up, so a restarted engine knows its disk tier before its first request is admitted).
- All ranks must chain keys from the same root; a rank reporting another root disables loads
  (logged once) rather than risk loading under the wrong keys.
- Each rank's store namespace digest (its report's ``namespace``) is kept for the shared tier,
  whose keys carry it (:mod:`kvtier.integrations.vllm.scheduler.remote`).
- A reset (:meth:`IndexMirror.reset`) empties every rank's view at once and raises the mirror's
  epoch: reports of an older epoch (sent before the rank applied the reset order) are dropped, so
  nothing held before the reset is planned as a hit again; a rank's first report of the new epoch
  is a full snapshot of its cleared store.
- The mirror may lag the stores by a step or more (evictions happen meanwhile): a mirror hit is a
  promise the worker checks; a chunk gone since is reported as a load error and recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.registry import slowest, tier_rank
from kvtier.integrations.vllm.cache_groups import NULL_BLOCK, GroupKind
from kvtier.integrations.vllm.protocol import PageMove, RankReport
from kvtier.integrations.vllm.scheduler.pages import HybridPlan, group_key

log = logging.getLogger(__name__)



class IndexMirror:
    """Key → tier per rank, for ``tp_size`` ranks.

    Args:
        tp_size: tensor-parallel ranks whose reports are expected (> 0).
    """

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._ranks: list[dict[bytes, str]] = [{} for _ in range(tp_size)]
        self._snapshotted = [False] * tp_size
        self.key_root: bytes | None = None
        self.broken = False
        self.namespaces: list[bytes] = [b""] * tp_size
        self.epoch = 0  # resets so far (reset); older reports are dropped

    @property
    def ready(self) -> bool:
        """Every rank sent its first snapshot and all agree on the key root."""
        return all(self._snapshotted) and not self.broken

    def apply(self, rank: int, report: RankReport) -> None:
        """Fold one rank's report in (in step order)."""
        if not 0 <= rank < self.tp_size:
            log.warning("kvtier: report from tensor-parallel rank %d of %d ignored", rank, self.tp_size)
            return
        if report.epoch < self.epoch:
            return  # the rank has not applied the reset yet: its news is of the store before it
        if self.key_root is None:
            self.key_root = report.key_root
        elif report.key_root != self.key_root and not self.broken:
            self.broken = True
            log.error("kvtier: tensor-parallel rank %d chains chunk keys from another namespace than rank 0 "
                      "(different model files or settings per rank?); kvtier loads are off for this engine", rank)
        if report.namespace:
            self.namespaces[rank] = report.namespace
        index = self._ranks[rank]
        if report.full:
            index.clear()
            self._snapshotted[rank] = True
        for key, tier in report.changes:
            if tier is None:
                index.pop(key, None)
            else:
                index[key] = tier

    def reset(self, epoch: int) -> dict[str, list[bytes]]:
        """Forget every rank's view and drop reports older than ``epoch`` from now on.

        Returns:
            what the mirror held, by tier (a chunk held by every rank, in the slowest of its tiers):
            what the scheduler had planned hits from until now.
        """
        held: dict[str, list[bytes]] = {}
        if self.ready:
            for key in self._ranks[0]:
                tier = self.tier(key)
                if tier is not None:
                    held.setdefault(tier, []).append(key)
        self.epoch = epoch
        for index in self._ranks:
            index.clear()
        return held

    def leading(self, keys: Sequence[bytes], first: int, shared: AbstractSet[bytes] = frozenset(),
                shared_tier: str = "") -> tuple[int, list[str]]:
        """A dense model's lookup (:meth:`PagePlanner.lookup`)
        in one call: ``end``, the end of the run of ``keys`` held from ``first`` on (every rank's
        local tiers, or ``shared`` in the shared tier ``shared_tier``), and the :meth:`tier` of each
        of ``keys[:end]`` (``""`` where none holds it, before ``first``); ``(0, [])`` when the run is empty."""
        tier = self._ranks[0].get if self.tp_size == 1 and self.ready else self.tier
        held = [tier(key) or (shared_tier if key in shared else None) for key in keys]
        end = first
        while end < len(keys) and held[end] is not None:
            end += 1
        return (end, [t or "" for t in held[:end]]) if end > first else (0, [])

    def tier(self, key: bytes) -> str | None:
        """Tier of ``key`` if every rank holds it (the slowest of theirs), else ``None``."""
        if not self.ready:
            return None
        if self.tp_size == 1:
            return self._ranks[0].get(key)
        tiers = [r.get(key) for r in self._ranks]
        if None in tiers:
            return None
        return max(tiers, key=tier_rank)


class PagePlanner:
    """The pages of one engine's load and save jobs, keyed, from the mirror (the plan arithmetic:
    :mod:`kvtier.integrations.vllm.scheduler.pages`).

    Args:
        plan: the engine's per-group plan.
        mirror: the scheduler's mirror of the ranks' indexes.
    """

    def __init__(self, plan: HybridPlan, mirror: IndexMirror) -> None:
        self.plan = plan
        self.mirror = mirror
        self.C = plan.chunk_tokens
        self.dense = not plan.is_hybrid

    def _key(self, chain: Sequence[bytes], group: int, chunk: int) -> bytes:
        if self.dense:  # one full-attention group: the chunk key itself (the namespace tells it apart)
            return bytes(chain[chunk])
        return bytes(group_key(ChunkKey(chain[chunk]), group))

    def parent_of(self, chain: Sequence[bytes], page: PageMove) -> bytes:
        """Key of the page before ``page`` in its group's chain (``b""`` for chunk 0 and for the
        pages of groups that are not full attention)."""
        full = any(g.index == page.group and g.kind is GroupKind.FULL for g in self.plan.groups)
        return self._key(chain, page.group, page.chunk - 1) if full and page.chunk > 0 else b""

    def lookup(self, chain: Sequence[bytes], num_computed_tokens: int, num_tokens: int,
               shared: AbstractSet[bytes] = frozenset(), shared_tier: str = "") -> tuple[int, list[str]]:
        """The hit (tokens, 0 if none beyond ``num_computed_tokens``) and, per chunk before it,
        the slowest tier any of its pages is held in (for vLLM's hit-source metrics; ``""`` for
        a chunk kvtier does not hold before the engine's own hit).

        ``shared``: page keys the shared tier ``shared_tier`` holds for every rank, from
        :meth:`~kvtier.integrations.vllm.scheduler.remote.RemoteLookups.poll_pages` over :meth:`unheld_pages`.
        """
        if self.dense:  # one full-attention group: its pages are the chain's chunks, asked in one call
            keys = [bytes(key) for key in chain[:min(len(chain), max(0, num_tokens - 1) // self.C)]]
            end, tiers = self.mirror.leading(keys, num_computed_tokens // self.C, shared, shared_tier)
            return end * self.C, tiers

        def tier(group: int, chunk: int) -> str | None:
            if chunk >= len(chain):
                return None
            key = self._key(chain, group, chunk)
            return self.mirror.tier(key) or (shared_tier if key in shared else None)

        hit = self.plan.hit_tokens(lambda g, c: tier(g, c) is not None, num_computed_tokens, num_tokens)
        tiers = []
        for c in range(hit // self.C):
            held = [tier(g.index, c) for g in self.plan.groups]
            tiers.append(slowest([t for t in held if t]) if any(held) else "")
        return hit, tiers

    def unheld_pages(self, chain: Sequence[bytes], num_computed_tokens: int, num_tokens: int) -> list[bytes]:
        """Keys of the pages a hit beyond ``num_computed_tokens`` could use that no rank's local
        tiers hold (every group, every chunk up to the last one vLLM lets a connector load):
        what the scheduler asks the shared tier about."""
        first = num_computed_tokens // self.C
        limit = min(len(chain), max(0, num_tokens - 1) // self.C)
        return [key for c in range(first, limit) for g in self.plan.groups
                if self.mirror.tier(key := self._key(chain, g.index, c)) is None]

    def load_pages(self, chain: Sequence[bytes], block_ids: Sequence[Sequence[int]], num_computed_tokens: int,
                   hit: int) -> tuple[PageMove, ...]:
        """Pages resuming every group at ``hit`` (``block_ids``: ``KVCacheBlocks.get_block_ids()``)."""
        if self.dense:  # one group: HybridPlan.pages_to_load's pages without a ChunkBlocks each (the hit path)
            ids, bs = block_ids[0], self.plan.groups[0].block_size
            k, lo, end = self.C // bs, num_computed_tokens // bs, hit // self.C
            if len(ids) >= hit // bs and NULL_BLOCK not in ids[lo:end * k]:
                return tuple(PageMove(bytes(chain[c]), 0, c, max(c * k, lo) - c * k,
                                      tuple(ids[max(c * k, lo):(c + 1) * k])) for c in range(lo // k, end))
        loads = [cb for g in self.plan.groups
                 for cb in self.plan.pages_to_load(g, num_computed_tokens, hit, block_ids[g.index])]
        return tuple(PageMove(self._key(chain, cb.group, cb.chunk), cb.group, cb.chunk, cb.first_slot, cb.block_ids)
                     for cb in loads)

    def save_pages(self, chain: Sequence[bytes], start_chunk: int, end_chunk: int,
                   block_ids: Sequence[Sequence[int]], handoffs: Sequence[tuple[int, int, int]],
                   num_prompt_tokens: int) -> tuple[PageMove, ...]:
        """Pages of chunks ``[start_chunk, end_chunk)`` worth storing, and the state snapshots
        vLLM handed over this step (``(group, block id, boundary tokens)``) at boundaries
        ``≤ end_chunk × chunk_tokens``."""
        plan = self.plan
        stored = [cb for g in plan.groups if g.kind is not GroupKind.STATE
                  for cb in plan.pages_to_store(g, start_chunk, end_chunk, block_ids[g.index], num_prompt_tokens)]
        stored += plan.state_pages(handoffs, end_chunk * self.C)
        return tuple(PageMove(self._key(chain, cb.group, cb.chunk), cb.group, cb.chunk, 0, cb.block_ids)
                     for cb in stored)
