"""Scheduler side of every model: turns :class:`~kvtier.integrations.vllm.groups.HybridPlan`
decisions into the pages of load and save jobs, from memory only (the mirror of the ranks'
indexes, the request's chunk keys, vLLM's per-group block tables and boundary-state hand-offs).

A dense model is a one-group plan (one full-attention group): its pages are its chunks, named
by the chunk key.  A hybrid model's page is named by ``group_key(chunk key, group)``: the prefix
up to and including that chunk, and the group.  Per request::

    lookup(chain, local, n)      hit = largest chunk boundary every group can resume at
                                 (HybridPlan.hit_tokens over the mirror)
    load_pages(...)              per group, the pages that resume it at the hit, into the block
                                 ids vLLM allocated for that group
    save_pages(...)              full / sliding pages of the chunks this step completes (sliding:
                                 only reachable ones), state pages from this step's hand-offs
"""

from __future__ import annotations

from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from typing import Any

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.registry import slowest
from kvtier.integrations.vllm.groups import GroupKind, HybridPlan, group_key
from kvtier.integrations.vllm.mirror import IndexMirror
from kvtier.integrations.vllm.protocol import PageMove


class GroupJobs:
    """Page planning for one engine.

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
        :meth:`~kvtier.integrations.vllm.remote.RemoteLookups.poll_pages` over :meth:`unheld_pages`.
        """
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
        pages = []
        for group in self.plan.groups:
            for cb in self.plan.pages_to_load(group, num_computed_tokens, hit, block_ids[group.index]):
                pages.append(PageMove(self._key(chain, group.index, cb.chunk), group.index, cb.chunk,
                                      cb.first_slot, cb.block_ids))
        return tuple(pages)

    def save_pages(self, chain: Sequence[bytes], start_chunk: int, end_chunk: int,
                   block_ids: Sequence[Sequence[int]], handoffs: Sequence[tuple[int, int, int]],
                   num_prompt_tokens: int) -> tuple[PageMove, ...]:
        """Pages of chunks ``[start_chunk, end_chunk)`` worth storing, and the state snapshots
        vLLM handed over this step (``(group, block id, boundary tokens)``) at boundaries
        ``≤ end_chunk × chunk_tokens``."""
        pages = []
        for group in self.plan.groups:
            if group.kind is GroupKind.STATE:
                continue
            for cb in self.plan.pages_to_store(group, start_chunk, end_chunk, block_ids[group.index],
                                               num_prompt_tokens):
                pages.append(PageMove(self._key(chain, group.index, cb.chunk), group.index, cb.chunk, 0, cb.block_ids))
        for cb in self.plan.state_pages(handoffs, end_chunk * self.C):
            pages.append(PageMove(self._key(chain, cb.group, cb.chunk), cb.group, cb.chunk, 0, cb.block_ids))
        return tuple(pages)


def handoffs_of(scheduler_output: Any, req_id: str) -> list[tuple[int, int, int]]:
    """vLLM's boundary-state hand-offs of ``req_id`` this step (``SchedulerOutput.kv_connector_block_state``)."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    offloads = getattr(state, "boundary_state_offloads", None) or {}
    return [tuple(h) for h in offloads.get(req_id, ())]  # type: ignore[misc]
