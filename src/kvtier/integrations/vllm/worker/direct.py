"""Node-tier hits read straight from the shared pool's pages into the engine's KV blocks (issue 38).

Without this, a chunk the node tier holds is read into a cpu page first (a promotion: copied out
of the pool and verified) and then copied from that page into the blocks, as a cpu hit is: two
copies where a cpu hit pays one.  With it, the loader hands ``prepare_load`` an ``into``
(:data:`~kvtier.core.handles.Into`) that gives each node-tier chunk a
:class:`~kvtier.core.tiers.node.readcopy.Scatter` over its blocks: the tier copies each block's
runs out of the pool, layer by layer, hashing each run from the block right after its copy, in
payload order (:func:`~kvtier.core.tiers.node.readcopy.scatter_hashed`: what is verified is what
is served), then checks once for the batch that no page was reused under its pin.  A chunk whose digest or generation check fails ends the load's
prefix there: its blocks (whatever they hold) and every later one are reported to vLLM as load
errors and recomputed, as any failed load's are (:mod:`~kvtier.integrations.vllm.worker.loader`).

Such a chunk is not promoted into the cpu tier: the pool is host DRAM already, so a later hit on
it is again a one-copy load from the pool; promoting would put the second copy back on the load
(or, after it, a copy the engine does not need to serve that hit).

Where: one full-attention KV cache group (a dense model) whose blocks are host memory copied by
``memmove`` runs (:class:`~kvtier.integrations.vllm.worker.copy.HostRuns`: vLLM's CPU backend),
and a node tier the store reaches directly or behind its :class:`~kvtier.core.tiers.guarded.GuardedTier`
only (its wrapper hands the destination through unchanged).  Elsewhere (CUDA blocks, hybrid models,
the redis and s3 tiers) a shared hit is read into a page as before.

::

    payload (the page, as saved)     [layer 0: slot 0 | slot 1 | ...][layer 1: slot 0 | ...] ...
    slot s of layer l                 runs r = 0..R-1 of run_bytes each (HostRuns.page_offsets)
    goes to (a view of layer l)       block_ids[s - first_slot] * block_stride + cache_offsets[r]
"""

from __future__ import annotations

import ctypes

import numpy as np

from kvtier.core.handles import Into
from kvtier.core.store import TieredStore
from kvtier.core.tiers.guarded import GuardedTier
from kvtier.core.tiers.node.readcopy import Scatter
from kvtier.core.tiers.node.tier import NodeTier
from kvtier.integrations.vllm.protocol import LoadJob
from kvtier.integrations.vllm.worker.copy import GroupCopiers, HostRuns


def reads_into_blocks(store: TieredStore) -> bool:
    """Whether the store's shared tier is a node tier that takes a :class:`Scatter` (bare, or behind
    its guard alone)."""
    shared = store.index.shared
    if not shared:
        return False
    tier = shared[0].tier
    return isinstance(tier, NodeTier) or (isinstance(tier, GuardedTier) and isinstance(tier.inner, NodeTier))


class DirectTargets:
    """Builds each node-tier chunk's :class:`Scatter` over its engine blocks (see the module docstring).

    Args:
        runs: the one group's host layout (``BlockCopier._runs``).
        blocks_per_chunk: slots in a page.
        block_bytes: bytes of one block of one layer.
        page_bytes: bytes of one page (the payload).
    """

    def __init__(self, runs: HostRuns, blocks_per_chunk: int, block_bytes: int, page_bytes: int) -> None:
        self.runs = runs
        self.blocks_per_chunk = blocks_per_chunk
        self.block_bytes = block_bytes
        self.page_bytes = page_bytes
        # each layer's blocks as one flat writable byte view, from its first byte to its last block's last run
        span = (runs.num_blocks - 1) * runs.block_stride + int(runs.cache_offsets.max()) + runs.run_bytes
        self._layers = [memoryview((ctypes.c_char * span).from_address(int(a))).cast("B")
                        for a in runs.layer_addresses]

    @classmethod
    def of(cls, store: TieredStore, copiers: GroupCopiers) -> DirectTargets | None:
        """The targets for this engine, or ``None`` where direct reads do not apply (module docstring)."""
        if len(copiers.copiers) != 1 or not reads_into_blocks(store):
            return None
        (group, copier), = copiers.copiers.items()
        runs = copier._runs
        if runs is None or copiers.group_page_bytes[group] != store.chunk_bytes:
            return None
        return cls(runs, copier.blocks_per_chunk, copier.layout.block_bytes, store.chunk_bytes)

    def scatter(self, first_slot: int, block_ids: tuple[int, ...]) -> Scatter:
        """The runs of one page whose slots ``first_slot..`` go to ``block_ids``, in payload order, a
        run that follows the one before in the payload and in the same layer merged into it (blocks
        with consecutive ids: one copy each instead of one per block).

        Raises:
            ValueError: a block id outside the cache, or slots past the page."""
        runs, n = self.runs, len(block_ids)
        if first_slot < 0 or first_slot + n > self.blocks_per_chunk:
            raise ValueError(f"{n} blocks at slot {first_slot} do not fit a page of {self.blocks_per_chunk} slots")
        blocks = np.asarray(block_ids, dtype=np.int64)
        if n and (int(blocks.min()) < 0 or int(blocks.max()) >= runs.num_blocks):
            raise ValueError(f"block ids must lie in [0, {runs.num_blocks}), got {block_ids}")
        if not n:
            return Scatter(self.page_bytes, [], [])
        layers, per = len(self._layers), len(runs.page_offsets)
        slots = np.arange(first_slot, first_slot + n, dtype=np.int64)
        # [layer][slot][run]: the payload's own order, so offsets ascend
        src = (((np.arange(layers, dtype=np.int64)[:, None] * self.blocks_per_chunk + slots[None, :])
                * self.block_bytes)[:, :, None] + runs.page_offsets).ravel()
        dst = np.broadcast_to((blocks * runs.block_stride)[None, :, None] + runs.cache_offsets,
                              (layers, n, per)).ravel()
        layer = np.repeat(np.arange(layers), n * per)
        step = runs.run_bytes
        starts = np.flatnonzero(np.concatenate(([True], (np.diff(src) != step) | (np.diff(dst) != step)
                                                | (np.diff(layer) != 0))))
        sizes = np.diff(np.append(starts, len(src))) * step
        views = self._layers
        return Scatter(self.page_bytes, src[starts].tolist(),
                       [views[lay][at:at + size] for lay, at, size in
                        zip(layer[starts].tolist(), dst[starts].tolist(), sizes.tolist())])

    def into(self, job: LoadJob) -> Into:
        """``prepare_load``'s ``into`` for ``job``: every chunk the shared tier reads goes to its blocks."""
        pages = job.pages
        return lambda pos: self.scatter(pages[pos].first_slot, pages[pos].block_ids) if pos < len(pages) else None
