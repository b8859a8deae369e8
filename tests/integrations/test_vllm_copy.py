"""Layout detection, the block copy path, the scheduler's index mirror and the identity
fingerprint, on real tensors, stores and files (no engine): the copy must round-trip any layout
whose block dimension is not the first."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.keys import Namespace, chunk_keys, request_root
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
from kvtier.integrations.vllm.protocol import KVTierWorkerMeta, RankReport
from kvtier.integrations.vllm.scheduler.pages import HybridPlan
from kvtier.integrations.vllm.scheduler.reset import forget_mirror
from kvtier.integrations.vllm.scheduler.steps import IndexMirror, PagePlanner
from kvtier.integrations.vllm.worker.copy import BlockCopier, Span
from kvtier.integrations.vllm.worker.layout import detect_layout
from kvtier.integrations.vllm.worker.loader import load_runs
from kvtier.integrations.vllm.worker.registration import key_root

NUM_BLOCKS = 12
# name -> per-layer shape with NUM_BLOCKS somewhere, and where the blocks are
LAYOUTS = {
    "cpu [blocks, heads, block, 2*head]": ((NUM_BLOCKS, 2, 16, 128), 0),
    "flash [2, blocks, block, heads, head]": ((2, NUM_BLOCKS, 16, 2, 64), 1),
    "mla [blocks, block, latent]": ((NUM_BLOCKS, 16, 96), 0),
}


def planned(mirror: IndexMirror, chain: list) -> list[str]:
    """The tier of each chunk of the hit the scheduler plans from ``mirror`` for a prompt one token
    longer than ``chain``'s 4-token chunks (``PagePlanner.lookup``, a one-group dense plan)."""
    plan = HybridPlan([GroupSpec(0, GroupKind.FULL, 4, ("layer",))], 4, 0)
    _hit, tiers = PagePlanner(plan, mirror).lookup([bytes(k) for k in chain], 0, 4 * len(chain) + 1)
    return tiers


@pytest.mark.parametrize("path", ["memmove", "copyto"])
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_blocks_round_trip_through_pages(name: str, path: str) -> None:
    """Saved blocks load back byte for byte into other blocks, through the loader's memmove runs
    (``load_runs``, every layout here is a few runs a block) and through ``BlockCopier.load``."""
    shape, block_dim = LAYOUTS[name]
    gen = torch.Generator().manual_seed(0)
    src = {f"layer.{i}": torch.randn(*shape, generator=gen, dtype=torch.float32) for i in range(3)}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    layout = detect_layout(src, NUM_BLOCKS, "TEST")
    assert layout.block_dim == block_dim
    assert layout.num_layers == 3
    k = 4  # blocks per chunk
    pages = [np.zeros(layout.chunk_bytes(k), dtype=np.uint8) for _ in range(2)]
    # chunk 0 <- blocks 7,1,9,3 ; chunk 1 <- blocks 5,11 into slots 2,3 (a partial chunk)
    BlockCopier(layout, src, k).save([Span(pages[0], 0, [7, 1, 9, 3]), Span(pages[1], 2, [5, 11])])
    assert pages[1][: layout.block_bytes].sum() == 0  # untouched slots stay as they were
    # load into other blocks of a fresh cache: 7->0, 1->2, 9->4, 3->6, 5->8, 11->10
    copier = BlockCopier(layout, dst, k)
    spans = [Span(pages[0], 0, [0, 2, 4, 6]), Span(pages[1], 2, [8, 10])]
    if path == "memmove":
        assert copier.runs is not None
        load_runs(copier, [(span.page, span.first_slot, span.block_ids) for span in spans])
    else:
        copier.load(spans)
    for name_, t in src.items():
        for s, d in [(7, 0), (1, 2), (9, 4), (3, 6), (5, 8), (11, 10)]:
            assert torch.equal(dst[name_].select(block_dim, d), t.select(block_dim, s))
        for d in (1, 3, 5, 7, 9, 11):
            assert not dst[name_].select(block_dim, d).any()


def test_a_load_from_read_only_pages_is_the_same_and_a_bad_span_moves_nothing() -> None:
    """The memmove path takes a page's address from its buffer (a writable page) or numpy's ctypes
    view (a read-only one, e.g. a staged copy): both load the same bytes; a block id out of range
    or a page too short raises before the first byte moves."""
    shape, block_dim = LAYOUTS["flash [2, blocks, block, heads, head]"]
    gen = torch.Generator().manual_seed(1)
    src = {f"layer.{i}": torch.randn(*shape, generator=gen, dtype=torch.float32) for i in range(3)}
    layout = detect_layout(src, NUM_BLOCKS, "TEST")
    page = np.zeros(layout.chunk_bytes(2), dtype=np.uint8)
    BlockCopier(layout, src, 2).save([Span(page, 0, [3, 8])])
    frozen = page.copy()
    frozen.flags.writeable = False
    loaded = []
    for source in (page, frozen):
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        copier = BlockCopier(layout, dst, 2)
        assert copier.runs is not None  # the memmove path
        load_runs(copier, [(source, 0, [1, 6])])
        loaded.append(dst)
        for name, t in src.items():
            assert torch.equal(dst[name].select(block_dim, 1), t.select(block_dim, 3))
            assert torch.equal(dst[name].select(block_dim, 6), t.select(block_dim, 8))
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in src)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    copier = BlockCopier(layout, dst, 2)
    with pytest.raises(ValueError, match="block ids must lie in"):
        load_runs(copier, [(page, 0, [1]), (page, 1, [NUM_BLOCKS])])
    with pytest.raises(ValueError, match="does not fit a contiguous page"):
        load_runs(copier, [(page, 0, [1]), (page[:-1], 0, [2])])
    assert not any(t.any() for t in dst.values())  # neither moved a byte


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_a_load_on_the_engines_thread_moves_the_same_bytes_as_memmove(name: str) -> None:
    """``hold_gil`` (a synchronous load, on the engine's thread) moves each run with a slice
    assignment of flat memoryviews instead of ``ctypes.memmove``: from writable and read-only pages,
    into partial spans, the caches end byte for byte the same; a bad span moves nothing either way."""
    shape, _block_dim = LAYOUTS[name]
    gen = torch.Generator().manual_seed(2)
    src = {f"layer.{i}": torch.randn(*shape, generator=gen, dtype=torch.float32) for i in range(3)}
    layout = detect_layout(src, NUM_BLOCKS, "TEST")
    pages = [np.zeros(layout.chunk_bytes(4), dtype=np.uint8) for _ in range(2)]
    BlockCopier(layout, src, 4).save([Span(pages[0], 0, [7, 1, 9, 3]), Span(pages[1], 1, [5, 11, 2])])
    frozen = pages[1].copy()
    frozen.flags.writeable = False
    spans = [(pages[0], 0, [0, 2, 4, 6]), (frozen, 1, [8, 10, 11])]
    loaded = []
    for hold_gil in (False, True):
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        copier = BlockCopier(layout, dst, 4)
        assert copier.runs is not None and copier.runs.layer_views is not None
        load_runs(copier, spans, hold_gil=hold_gil)
        loaded.append(dst)
        with pytest.raises(ValueError, match="block ids must lie in"):
            load_runs(copier, [(pages[0], 0, [1]), (pages[0], 1, [NUM_BLOCKS])], hold_gil=hold_gil)
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in src)
    assert all(loaded[1][k].any() for k in src)  # (bytes moved: the comparison is not of two empty caches)


@pytest.mark.parametrize("hold_gil", [False, True])
def test_adjacent_blocks_load_as_one_run_and_land_where_each_belongs(hold_gil: bool) -> None:
    """vLLM's CPU layout (a block is one run, block ``b + 1`` follows ``b``): consecutive block ids
    of a span move as one run per layer (``_load_adjacent``); runs broken by a gap, a descending id
    or a span's end land byte for byte where each block belongs, and no other block is written."""
    shape, block_dim = LAYOUTS["cpu [blocks, heads, block, 2*head]"]
    gen = torch.Generator().manual_seed(3)
    src = {f"layer.{i}": torch.randn(*shape, generator=gen, dtype=torch.float32) for i in range(3)}
    layout = detect_layout(src, NUM_BLOCKS, "TEST")
    pages = [np.zeros(layout.chunk_bytes(4), dtype=np.uint8) for _ in range(2)]
    BlockCopier(layout, src, 4).save([Span(pages[0], 0, [7, 1, 9, 3]), Span(pages[1], 1, [5, 11, 2])])
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    copier = BlockCopier(layout, dst, 4)
    assert copier.runs is not None and copier.runs.run_bytes == copier.runs.block_stride == layout.block_bytes
    load_runs(copier, [(pages[0], 0, [3, 4, 5, 8]), (pages[1], 1, [11, 10, 0])], hold_gil=hold_gil)
    moved = [(7, 3), (1, 4), (9, 5), (3, 8), (5, 11), (11, 10), (2, 0)]
    for name, t in src.items():
        for s, d in moved:
            assert torch.equal(dst[name].select(block_dim, d), t.select(block_dim, s)), (name, s, d)
        for d in set(range(NUM_BLOCKS)) - {d for _, d in moved}:
            assert not dst[name].select(block_dim, d).any(), (name, d)


def test_layout_errors_are_one_sentence() -> None:
    with pytest.raises(ConfigError, match="no dimension"):
        detect_layout({"a": torch.zeros(3, 4)}, 12, "TEST")
    with pytest.raises(ConfigError, match="uniform"):
        detect_layout({"a": torch.zeros(12, 4), "b": torch.zeros(12, 5)}, 12, "TEST")


def _store(tmp_path: Path, rank: int = 0) -> TieredStore:
    ns = Namespace(model="m", kv_dtype="float32", num_layers=1, num_kv_heads=1, head_size=8, layout="test",
                   chunk_tokens=4, tp_size=2, tp_rank=rank)
    cfg = KVTierConfig.from_dict({"chunk_tokens": 4, "cpu_gib": 1 / 1024, "disk_path": str(tmp_path), "disk_gib": 0.01})
    return TieredStore(cfg, ns, chunk_bytes=64)


def _report(store: TieredStore, root: bytes) -> RankReport:
    delta = store.drain_changes()
    return RankReport(root, [(bytes(k), t) for k, t in delta.changes], delta.full)


def test_mirror_merges_ranks_through_vllm_worker_metadata(tmp_path: Path) -> None:
    """Two ranks' change feeds, merged by KVTierWorkerMeta.aggregate as vLLM does, give one view:
    a chunk counts only when both ranks hold it; its tier is the slower one."""
    stores = [_store(tmp_path / f"disk{r}", r) for r in range(2)]
    root = key_root(stores[0].namespace)
    assert root == key_root(stores[1].namespace)  # ranks name chunks alike
    chain = chunk_keys(request_root(root), list(range(16)), 4)
    mirror = IndexMirror(tp_size=2)

    def step() -> None:
        meta = KVTierWorkerMeta({0: _report(stores[0], root)})
        merged = meta.aggregate(KVTierWorkerMeta({1: _report(stores[1], root)}))
        assert isinstance(merged, KVTierWorkerMeta) and set(merged.ranks) == {0, 1}
        for rank, report in merged.ranks.items():
            mirror.apply(rank, report)

    assert planned(mirror, chain) == []  # not ready before the first snapshots
    stores[0].put(chain[:3], [bytes([i]) * 64 for i in range(3)])
    stores[1].put(chain[:2], [bytes([i]) * 64 for i in range(2)])
    step()
    assert mirror.ready
    assert planned(mirror, chain) == ["cpu", "cpu"]  # rank 1 holds only two
    stores[1].put(chain[2:4], [bytes([i]) * 64 for i in range(2)])
    stores[0].flush_dirty(5.0)
    stores[0].index.evict_top(chain[0])  # rank 0 keeps chunk 0 on disk only
    step()
    assert planned(mirror, chain) == ["disk", "cpu", "cpu"]
    stores[0].index.evict_below("disk", chain[0])
    step()
    assert planned(mirror, chain) == []  # chunk 0 gone from rank 0: nothing after it is usable
    for store in stores:
        store.close()


def test_mirror_plans_nothing_from_before_a_reset_until_the_ranks_report_their_cleared_stores(tmp_path: Path) -> None:
    """The scheduler's side of a reset: the mirror empties at once, drops the ranks' reports sent
    before they applied the order (their stores still held the chunks), and takes the first
    report of the new epoch, a full snapshot of the cleared store, plus what was saved after."""
    store = _store(tmp_path / "disk", 0)
    root = key_root(store.namespace)
    chain = chunk_keys(request_root(root), list(range(16)), 4)
    mirror = IndexMirror(tp_size=1)
    store.put(chain[:3], [bytes([i]) * 64 for i in range(3)])
    mirror.apply(0, _report(store, root))
    assert planned(mirror, chain) == ["cpu"] * 3

    held = forget_mirror(mirror, epoch=1)

    assert held == {"cpu": chain[:3]}  # what the reset hook hands on (BlockRemoved, later)
    assert planned(mirror, chain) == [] and mirror.ready  # a miss, not "ask again": the order needs a step to ship
    store.put(chain[3:4], [bytes([3]) * 64])
    mirror.apply(0, _report(store, root))  # sent before the rank applied the order (epoch 0)
    assert planned(mirror, chain) == []
    store.flush()  # chunk 3's disk write done: its cpu page is free again for the saves below
    store.clear(["cpu", "disk"])  # the rank applies the order ...
    store.put(chain[:2], [bytes([i]) * 64 for i in range(2)])  # ... and saves what this step recomputed
    report = _report(store, root)
    assert report.full
    mirror.apply(0, dataclasses.replace(report, epoch=1))
    assert planned(mirror, chain) == ["cpu", "cpu"]
    store.close()


def test_mirror_refuses_ranks_that_disagree_on_the_key_root() -> None:
    mirror = IndexMirror(tp_size=2)
    mirror.apply(0, RankReport(b"a" * 16, [(b"k" * 16, "cpu")], True))
    mirror.apply(1, RankReport(b"b" * 16, [(b"k" * 16, "cpu")], True))
    assert mirror.broken and not mirror.ready
    assert planned(mirror, [b"k" * 16]) == []


def test_identity_fingerprint_follows_weights_tokenizer_and_config(tmp_path: Path) -> None:
    from kvtier.integrations.vllm.worker.identity import model_fingerprint
    from kvtier.launch.testmodel import GEOMETRIES, write_model
    from kvtier.launch.testmodel_weights import write_weights

    model = write_model(tmp_path / "m", "tiny", weights="random", seed=0)
    base = model_fingerprint(str(model))
    assert base == model_fingerprint(str(model))  # deterministic
    write_weights(model, GEOMETRIES["tiny"], seed=1)  # same names, shapes, size; other values
    reseeded = model_fingerprint(str(model))
    assert reseeded != base
    tok = model / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<unk>"', '"<UNK>"', 1))
    assert model_fingerprint(str(model)) != reseeded
    assert model_fingerprint("no/such-model") == model_fingerprint("no/such-model")  # unresolved: name only


def test_effective_config_digest_follows_overrides_and_is_stable(tmp_path: Path) -> None:
    from vllm.config import ModelConfig

    from kvtier.integrations.vllm.worker.identity import effective_config_digest
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    plain = effective_config_digest(ModelConfig(model=str(model), dtype="float32"))
    assert plain == effective_config_digest(ModelConfig(model=str(model), dtype="float32"))  # same config, same digest
    overridden = ModelConfig(model=str(model), dtype="float32", hf_overrides={"rms_norm_eps": 0.9})
    assert effective_config_digest(overridden) != plain
    assert effective_config_digest(ModelConfig(model=str(model), dtype="bfloat16")) != plain
