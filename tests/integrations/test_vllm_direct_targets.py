""":class:`~kvtier.integrations.vllm.worker.direct.DirectTargets` builds every page's runs of a load
in one pass (issue 38): each page's runs, expanded back into single runs, are exactly its slots'
runs in payload order ([layer][slot][run]) at their blocks' addresses; runs merge within a page
and a layer only, never across pages (consecutive block ids that continue into the next page)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.integrations.vllm.worker.copy import HostRuns
from kvtier.integrations.vllm.worker.direct import DirectTargets

LAYERS, NUM_BLOCKS, SLOTS, BLOCK_BYTES = 3, 20, 4, 48
SPLIT = (2, NUM_BLOCKS, 3, 8)
"""A layer's cache as [K/V, block, tokens, bytes]: a block is two runs of 24 bytes, none adjacent to
the next slot's in the page."""
WHOLE = (NUM_BLOCKS, 6, 8)
"""[block, tokens, bytes]: a block is one run of 48 bytes, so consecutive blocks are one run."""


def _targets(shape: tuple[int, ...] = SPLIT) -> tuple[DirectTargets, HostRuns]:
    host = [np.zeros(shape, np.uint8) for _ in range(LAYERS)]
    runs = HostRuns(host, shape.index(NUM_BLOCKS), NUM_BLOCKS)
    return DirectTargets(runs, SLOTS, BLOCK_BYTES, LAYERS * SLOTS * BLOCK_BYTES), runs


def _expected(runs: HostRuns, first_slot: int, block_ids: tuple[int, ...]) -> list[tuple[int, int]]:
    """(payload offset, cache address) of each single run, payload order, computed plainly."""
    block_bytes = len(runs.page_offsets) * runs.run_bytes
    return [((layer * SLOTS + first_slot + j) * block_bytes + int(po),
             int(runs.layer_addresses[layer]) + block * runs.block_stride + int(co))
            for layer in range(LAYERS) for j, block in enumerate(block_ids)
            for po, co in zip(runs.page_offsets, runs.cache_offsets)]


def _singles(runs: HostRuns, scatter: object) -> list[tuple[int, int]]:
    out = []
    for at, view in zip(scatter.offsets, scatter.targets):  # type: ignore[attr-defined]
        address = np.frombuffer(view, np.uint8).ctypes.data
        out += [(at + k, address + k) for k in range(0, view.nbytes, runs.run_bytes)]
    return out


@pytest.mark.parametrize("shape", [SPLIT, WHOLE])
def test_every_page_gets_its_own_runs_in_payload_order(shape: tuple[int, ...]) -> None:
    targets, runs = _targets(shape)
    pages = [(1, (5, 6, 7)), (0, (8, 9, 10, 11)), (0, ()), (2, (3, 19)), (0, (12,))]
    scatters = targets.scatters(pages)
    assert len(scatters) == len(pages)
    for (first_slot, block_ids), scatter in zip(pages, scatters):
        assert scatter.nbytes == targets.page_bytes
        assert _singles(runs, scatter) == _expected(runs, first_slot, block_ids)
        assert scatter.offsets == sorted(scatter.offsets)
    assert targets.scatter(2, (3, 19)).offsets == scatters[3].offsets  # one page alone: the same runs
    runs_of = [len(s.targets) for s in scatters]
    if shape == WHOLE:  # blocks 5..7 and 8..11: one run per layer each; block 8 does not join page 0's run
        assert runs_of == [LAYERS, LAYERS, 0, 2 * LAYERS, LAYERS]
        assert [v.nbytes for v in scatters[1].targets] == [4 * BLOCK_BYTES] * LAYERS
    else:  # no two runs adjacent in both the page and the cache: one per block half
        assert runs_of == [2 * LAYERS * len(b) for _, b in pages]


@pytest.mark.parametrize("pages", [[(3, (1, 2))], [(-1, (1,))], [(0, (NUM_BLOCKS,))], [(0, (1,)), (0, (-1,))]])
def test_slots_past_a_page_or_blocks_outside_the_cache_are_refused(pages: list[tuple[int, tuple[int, ...]]]) -> None:
    targets, _ = _targets()
    with pytest.raises(ValueError):
        targets.scatters(pages)


@pytest.mark.parametrize("shape", [SPLIT, WHOLE])
def test_pages_of_one_block_each_get_the_runs_the_general_pass_gives(shape: tuple[int, ...]) -> None:
    """One slot per page (vLLM's CPU blocks of 128 tokens, 128-token chunks): the runs come from a
    per-block template, no numpy pass; they are the general pass's, run for run, and a block id
    outside the cache is refused there too."""
    host = [np.zeros(shape, np.uint8) for _ in range(LAYERS)]
    runs = HostRuns(host, shape.index(NUM_BLOCKS), NUM_BLOCKS)
    one = DirectTargets(runs, 1, BLOCK_BYTES, LAYERS * BLOCK_BYTES)
    general = DirectTargets(runs, 1, BLOCK_BYTES, LAYERS * BLOCK_BYTES)
    general._one_block = None  # the numpy pass
    pages = [(0, (b,)) for b in (7, 0, NUM_BLOCKS - 1, 8)]
    fast, slow = one.scatters(pages), general.scatters(pages)
    for (_, (block,)), a, b in zip(pages, fast, slow):
        assert a.nbytes == b.nbytes == LAYERS * BLOCK_BYTES
        assert a.offsets == b.offsets
        assert _singles(runs, a) == _singles(runs, b)
        assert [v.nbytes for v in a.targets] == [v.nbytes for v in b.targets]
        assert all(not v.readonly for v in a.targets)
    with pytest.raises(ValueError):
        one.scatters([(0, (NUM_BLOCKS,))])
    with pytest.raises(ValueError):
        one.scatters([(0, (-1,))])
