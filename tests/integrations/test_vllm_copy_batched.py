"""The batched copy path (CUDA's), its device-independent parts on the host: the block/page span
mapping (``plan_batches``), the batched gather/scatter itself on host tensors against the per-block
host path, and the direct-or-staged decision.  Streams and pinning need a GPU: ``scripts/gpu_check.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.integrations.vllm.worker.batched import HostRun, Span, direct_host_copy, plan_batches
from kvtier.integrations.vllm.worker.copy import BlockCopier
from kvtier.integrations.vllm.worker.layout import detect_layout

NUM_BLOCKS = 24
LAYOUTS = {  # per-layer shape with NUM_BLOCKS somewhere (as in test_vllm_copy.py)
    "blocks-first": (NUM_BLOCKS, 2, 4, 16),
    "kv-split": (2, NUM_BLOCKS, 4, 2, 8),
    "mla": (NUM_BLOCKS, 4, 24),
}


def _place(spans, num_layers: int, bpc: int, block_bytes: int, max_batch_bytes: int):
    """Where every (span, layer, block) byte goes by the plan: page byte -> (span, layer, j)."""
    plans = plan_batches(spans, num_layers, bpc, block_bytes, max_batch_bytes)
    ids = [(s, j) for s, (_f, n) in enumerate(spans) for j in range(n)]  # the concatenated block order
    placed = {}
    for plan in plans:
        # the buffer's rows: row -> (span, layer, j)
        row_of = {}
        for layer in range(num_layers):
            for pos, row in zip(plan.blocks, plan.rows[layer]):
                assert int(row) not in row_of, "two blocks share a buffer row"
                row_of[int(row)] = (*ids[pos][:1], layer, ids[pos][1])
        assert sorted(row_of) == list(range(plan.buffer_bytes // block_bytes))  # the buffer is dense
        for run in plan.runs:
            assert run.nbytes % block_bytes == 0 and run.buffer_offset % block_bytes == 0
            for k in range(run.nbytes // block_bytes):
                span, layer, j = row_of[run.buffer_offset // block_bytes + k]
                assert span == run.span
                page_slot = run.page_offset // block_bytes + k
                placed[(span, page_slot)] = (layer, j)
    return plans, placed


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.data())
def test_plan_puts_every_block_of_every_layer_in_its_page_slot(num_layers, bpc, data):
    spans = data.draw(st.lists(st.integers(0, bpc).flatmap(
        lambda first: st.tuples(st.just(first), st.integers(0, bpc - first))), max_size=6))
    block_bytes = data.draw(st.sampled_from([2, 8, 48]))
    max_batch = data.draw(st.integers(1, 3 * num_layers * bpc * block_bytes))
    plans, placed = _place(spans, num_layers, bpc, block_bytes, max_batch)
    want = {(s, layer * bpc + first + j): (layer, j)
            for s, (first, n) in enumerate(spans) for layer in range(num_layers) for j in range(n)}
    assert placed == want  # page slot (layer, first_slot + j) holds block j of that layer, nothing else
    assert sum(p.blocks.size for p in plans) == sum(n for _f, n in spans)
    for p in plans:  # a batch stays within the budget unless it is one span
        assert p.buffer_bytes <= max_batch or len({r.span for r in p.runs}) == 1


def test_a_whole_page_is_one_host_copy_and_a_partial_span_one_per_layer():
    (plan,) = plan_batches([(0, 4), (1, 2)], num_layers=3, blocks_per_chunk=4, block_bytes=10)
    assert plan.runs[0] == HostRun(0, 0, 0, 3 * 4 * 10)  # the whole page, in one copy
    assert plan.runs[1:] == (HostRun(1, 10, 120, 20), HostRun(1, 50, 140, 20), HostRun(1, 90, 160, 20))
    assert plan.buffer_bytes == 3 * 6 * 10
    assert plan.blocks.tolist() == [0, 1, 2, 3, 4, 5]
    assert plan.rows.tolist() == [[0, 1, 2, 3, 12, 13], [4, 5, 6, 7, 14, 15], [8, 9, 10, 11, 16, 17]]


def test_batches_split_on_the_budget_and_skip_empty_spans():
    plans = plan_batches([(0, 2), (0, 0), (0, 2), (0, 2)], num_layers=2, blocks_per_chunk=2, block_bytes=8,
                         max_batch_bytes=64)
    assert [sorted({r.span for r in p.runs}) for p in plans] == [[0, 2], [3]]
    assert [p.blocks.tolist() for p in plans] == [[0, 1, 2, 3], [4, 5]]  # positions in the block order
    (alone,) = plan_batches([(0, 2)], 2, 2, 8, max_batch_bytes=1)  # larger than the budget: a batch of its own
    assert alone.buffer_bytes == 32


@pytest.mark.parametrize("bad", [(3, 2), (-1, 1), (0, 5)])
def test_a_span_past_its_page_is_refused(bad):
    with pytest.raises(ValueError, match="do not fit a page of 4 slots"):
        plan_batches([bad], 2, 4, 8)


def _random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Random bytes seen as ``dtype`` (any bit pattern: the copy moves bytes, never values)."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), generator=gen, dtype=torch.uint8)
    return raw.view(dtype)


@pytest.mark.parametrize("name", sorted(LAYOUTS))
@pytest.mark.parametrize("max_batch_bytes", [1, 4096, 1 << 30])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_batched_path_matches_the_per_block_path_on_host_tensors(name: str, max_batch_bytes: int,
                                                                 dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    src = {f"layer.{i}": _random_cache(LAYOUTS[name], dtype, gen) for i in range(3)}
    layout = detect_layout(src, NUM_BLOCKS, "TEST")
    bpc = 4
    spans = [(0, [7, 1, 9, 3]), (2, [5, 11]), (0, [20, 21, 22, 23]), (1, [0])]

    def pages():
        return [np.zeros(layout.chunk_bytes(bpc), dtype=np.uint8) for _ in spans]

    want, got = pages(), pages()
    BlockCopier(layout, src, bpc, batched=False).save([Span(p, f, b) for p, (f, b) in zip(want, spans)])
    batched = BlockCopier(layout, src, bpc, batched=True, max_batch_bytes=max_batch_bytes)
    assert batched.batched is not None
    batched.save([Span(p, f, b) for p, (f, b) in zip(got, spans)])
    for w, g in zip(want, got):
        np.testing.assert_array_equal(g, w)  # same bytes in the same slots, untouched slots still zero
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    targets = [(0, [2, 4, 6, 8]), (2, [10, 12]), (0, [13, 14, 15, 16]), (1, [17])]
    BlockCopier(layout, dst, bpc, batched=True, max_batch_bytes=max_batch_bytes).load(
        [Span(p.copy(), f, b) for p, (f, b) in zip(got, targets)])  # private copies, outside any pinned region
    dim = layout.block_dim
    for k, t in src.items():
        for (_f, s_ids), (_g, d_ids) in zip(spans, targets):
            for s, d in zip(s_ids, d_ids):
                assert torch.equal(dst[k].select(dim, d).view(torch.uint8), t.select(dim, s).view(torch.uint8))
        untouched = sorted(set(range(NUM_BLOCKS)) - {d for _g, ids in targets for d in ids})
        assert not dst[k].view(torch.uint8).index_select(dim, torch.tensor(untouched)).any()
    assert batched.batched.staged_runs == 0  # host tensors: every copy is direct


def test_batched_load_reads_a_read_only_page():
    src = {"l": torch.arange(NUM_BLOCKS * 8, dtype=torch.float32).view(NUM_BLOCKS, 8)}
    layout = detect_layout(src, NUM_BLOCKS, "TEST")
    page = np.zeros(layout.chunk_bytes(2), dtype=np.uint8)
    BlockCopier(layout, src, 2, batched=True).save([Span(page, 0, [3, 4])])
    page.flags.writeable = False  # e.g. an immutable staged copy the store hands out
    dst = {"l": torch.zeros_like(src["l"])}
    BlockCopier(layout, dst, 2, batched=True).load([Span(page, 0, [0, 1])])
    assert torch.equal(dst["l"][:2], src["l"][3:5])


def test_only_a_pinned_page_is_a_direct_dma_on_cuda():
    assert direct_host_copy(on_cuda=True, page_pinned=True)
    assert not direct_host_copy(on_cuda=True, page_pinned=False)  # staged through the pinned buffer
    assert direct_host_copy(on_cuda=False, page_pinned=False)  # host tensors: a plain copy
