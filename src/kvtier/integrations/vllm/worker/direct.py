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
from collections.abc import Sequence
from itertools import chain, pairwise

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
        runs: the one group's host layout (``BlockCopier.runs``).
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
        # one block per page (vLLM's CPU block of 128 tokens, a 128-token chunk): every page's runs are
        # one block's, layer by layer (a block's runs are maximal, so none merge): its payload offsets
        # are the same for every page, and each target is its layer's view at the block's offset
        pairs = list(zip(runs.cache_offsets.tolist(), runs.page_offsets.tolist()))
        self._one_block = [(view, co) for view in self._layers for co, _po in pairs] if blocks_per_chunk == 1 else None
        self._one_block_offsets = [layer * block_bytes + po for layer in range(len(self._layers)) for _co, po in pairs]
        # where those runs tile the page in order (each block's runs C-ordered, the page its layers' blocks
        # back to back: vLLM's CPU backend), a page's scatter is the template and the block's offset alone
        # (Scatter.tiled: no run built or walked before the copy)
        n = runs.run_bytes
        self._tiles = self._one_block if self._one_block is not None and page_bytes == len(self._one_block) * n \
            and self._one_block_offsets == list(range(0, page_bytes, n)) else None

    @classmethod
    def of(cls, store: TieredStore, copiers: GroupCopiers) -> DirectTargets | None:
        """The targets for this engine, or ``None`` where direct reads do not apply (module docstring)."""
        if len(copiers.copiers) != 1 or not reads_into_blocks(store):
            return None
        (group, copier), = copiers.copiers.items()
        runs = copier.runs
        if runs is None or copiers.group_page_bytes[group] != store.chunk_bytes:
            return None
        return cls(runs, copier.blocks_per_chunk, copier.layout.block_bytes, store.chunk_bytes)

    def scatter(self, first_slot: int, block_ids: tuple[int, ...]) -> Scatter:
        """The runs of one page whose slots ``first_slot..`` go to ``block_ids`` (:meth:`scatters` of one page).

        Raises:
            ValueError: a block id outside the cache, or slots past the page."""
        return self.scatters([(first_slot, block_ids)])[0]

    def scatters(self, pages: Sequence[tuple[int, Sequence[int]]]) -> list[Scatter]:
        """Per page ``(first slot, block ids)``, the runs whose slots ``first slot..`` go to the
        blocks, in payload order, a run that follows the one before in the payload and in the same
        layer merged into it (blocks with consecutive ids: one copy each instead of one per block).
        Every page's runs in one numpy pass (a per-page pass cost ~60 µs a page, a 4,000-token hit
        ~2 ms, in the load's path); pages of one block each from a per-block template instead
        (:meth:`_one_block_scatters`: half the pass's time).

        Raises:
            ValueError: a block id outside the cache, or slots past a page (no scatter built)."""
        runs, bpc, num = self.runs, self.blocks_per_chunk, len(pages)
        if self._one_block is not None and all(f == 0 and len(b) == 1 for f, b in pages):
            return self._one_block_scatters([b[0] for _f, b in pages])
        counts = np.fromiter((len(b) for _, b in pages), dtype=np.int64, count=num)
        first = np.fromiter((f for f, _ in pages), dtype=np.int64, count=num)
        if num and (int(first.min()) < 0 or int((first + counts).max()) > bpc):
            raise ValueError(f"blocks at slots {first.tolist()} (counts {counts.tolist()}) do not fit a page of "
                             f"{bpc} slots")
        total = int(counts.sum())
        blocks = np.fromiter(chain.from_iterable(b for _, b in pages), dtype=np.int64, count=total)
        if total and (int(blocks.min()) < 0 or int(blocks.max()) >= runs.num_blocks):
            raise ValueError(f"block ids must lie in [0, {runs.num_blocks}), got {blocks.tolist()}")
        layers, per = len(self._layers), len(runs.page_offsets)
        page = np.repeat(np.arange(num, dtype=np.int64), counts)  # per block
        slot = first[page] + np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
        # [page][layer][slot]: each page's payload order (a stable sort keeps its slots ascending)
        order = np.argsort((page[:, None] * layers + np.arange(layers, dtype=np.int64)[None, :]).ravel(),
                           kind="stable")
        entry, layer = order // layers, order % layers
        src = (((layer * bpc + slot[entry]) * self.block_bytes)[:, None] + runs.page_offsets).ravel()
        dst = ((blocks[entry] * runs.block_stride)[:, None] + runs.cache_offsets).ravel()
        layer, page = np.repeat(layer, per), np.repeat(page[entry], per)
        step = runs.run_bytes
        starts = np.flatnonzero(np.concatenate(([True], (np.diff(src) != step) | (np.diff(dst) != step)
                                                | (np.diff(layer) != 0) | (np.diff(page) != 0))))[:len(src)]
        sizes = np.diff(np.append(starts, len(src))) * step
        views = self._layers
        targets = [views[lay][at:at + size] for lay, at, size in
                   zip(layer[starts].tolist(), dst[starts].tolist(), sizes.tolist())]
        offsets = src[starts].tolist()
        bounds = np.searchsorted(page[starts], np.arange(num + 1)).tolist()
        # runs ascending and within the page by construction: built without Scatter's per-run checks
        return [Scatter.built(self.page_bytes, offsets[b0:b1], targets[b0:b1]) for b0, b1 in pairwise(bounds)]

    def _one_block_scatters(self, blocks: list[int]) -> list[Scatter]:
        """:meth:`scatters` of pages of one block each (``_one_block``): no numpy pass, one slice per run
        (a 4,000-token hit's 1,488 runs: 0.4-0.7 ms in an engine through the general pass).

        Raises:
            ValueError: a block id outside the cache."""
        runs, template, offsets, n = self.runs, self._one_block, self._one_block_offsets, self.runs.run_bytes
        assert template is not None
        if blocks and (min(blocks) < 0 or max(blocks) >= runs.num_blocks):
            raise ValueError(f"block ids must lie in [0, {runs.num_blocks}), got {blocks}")
        stride, page_bytes = runs.block_stride, self.page_bytes
        out = []
        for block in blocks:
            at = block * stride
            out.append(Scatter.built(page_bytes, offsets, [view[at + co:at + co + n] for view, co in template]))
        return out

    def into(self, job: LoadJob) -> Into:
        """``prepare_load``'s ``into`` for ``job``: every chunk the shared tier reads goes to its
        blocks.  Pages of one block each whose runs tile the page (vLLM's CPU backend) get a
        :meth:`Scatter.tiled` over the block: nothing built per run before the copy takes each
        (a 4,000-token hit's 744 runs: 0.3 ms in an engine as built lists, 2026-12-06).  Otherwise the
        plan gets each such chunk's scatter without its runs (:meth:`Scatter.later`); every page's
        runs are built at once (:meth:`scatters`) when the first is needed: while the node tier's pin
        is in flight (:meth:`~kvtier.core.tiers.node.tier.NodeTier.while_fetching`), off the index's
        lock; a load the cpu tier serves whole builds none."""
        pages = job.pages
        if self._tiles is not None and all(p.first_slot == 0 and len(p.block_ids) == 1 for p in pages) \
                and all(0 <= p.block_ids[0] < self.runs.num_blocks for p in pages):
            tiles, stride, n = self._tiles, self.runs.block_stride, self.runs.run_bytes
            return lambda pos: Scatter.tiled(tiles, pages[pos].block_ids[0] * stride, n) if pos < len(pages) else None
        built: list[Scatter] = []

        def runs(pos: int) -> tuple[list[int], list[memoryview]]:
            if not built:
                built.extend(self.scatters([(p.first_slot, p.block_ids) for p in pages]))
            return built[pos].offsets, built[pos].targets

        def into(pos: int) -> Scatter | None:
            if pos >= len(pages):
                return None
            return Scatter.later(self.page_bytes, lambda: runs(pos))
        return into
