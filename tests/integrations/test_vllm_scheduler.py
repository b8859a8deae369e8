"""kvtier's scheduler side inside vLLM's real ``Scheduler``, driven step by step without an engine.

vLLM's own connector unit tests drive the scheduler with fabricated model-runner outputs
(vllm tests/v1/kv_connector/unit/utils.py: ``create_scheduler``, ``create_model_runner_output``);
these do the same for KVTierConnector: the workers' index reports (``KVTierWorkerMeta``) and the
loads' outcomes (``finished_recving``, ``invalid_block_ids``) are what a worker would send, and
vLLM's scheduler, KV cache manager and block pool are the real ones.  What the engine tests
prove with a model (exact bytes), these prove about the plan, in milliseconds: admission waits
for the first report, a mirror hit parks the request and loads exactly its blocks, the hit is
attributed per tier as vLLM counts it, an abort mid-load leaks no block, a failed block is
recomputed and never loaded again, saves follow the computed chunks, and a reset drops every hit;
a cpu-tier hit within ``sync_load_max_bytes`` is scheduled in the step that plans it (a synchronous
load), disk hits and hits past the step's budget park, and a synchronous load's failed block is
recomputed by the running request and its chunks saved again.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvtier.integrations.vllm.protocol import KVTierMetadata, KVTierWorkerMeta, RankReport
from kvtier.integrations.vllm.scheduler.requests import RequestChain

BLOCK = 16  # engine block size: a 128-token chunk spans 8 blocks
CHUNK = 128
NUM_BLOCKS = 200
ROOT = bytes(range(16))  # the key root a worker would report (any 16 bytes: the scheduler chains from it)
PROMPT = list(range(1, 400))  # 399 tokens: 3 full chunks, the last token always computed by the engine


@pytest.fixture
def scheduler(tiny_model: Path) -> Iterator[Scheduler]:
    yield _scheduler(tiny_model)


def _scheduler(model: Path, max_batched_tokens: int = 1024, reset_scope: str = "cpu",
               sliding_window: int | None = None, prefix_caching: bool = True, window_only: bool = False,
               **extra: Any) -> Scheduler:
    """A real vLLM Scheduler with KVTierConnector.  Synchronous loads are off unless ``extra`` sets
    ``sync_load_max_bytes``: the tests of the asynchronous path park cpu-tier hits.  ``window_only``: the
    ``sliding_window`` group alone (a model whose every layer has a window: Mistral-7B-v0.1).  ``prefix_caching``:
    vLLM's ``enable_prefix_caching`` (vLLM turns it off itself for some models: MLA on the CPU backend)."""
    extra = {"sync_load_max_bytes": 0, **extra}
    model_config = ModelConfig(model=str(model), dtype="float32", seed=0, max_model_len=4096)
    config = VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_batched_tokens,
                                         max_model_len=4096, enable_chunked_prefill=True, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"cpu_gib": 0.05, "reset_scope": reset_scope, **extra}),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = NUM_BLOCKS
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                               FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32))]
    if sliding_window is not None:  # a hybrid model: a second group of sliding-window layers
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"], SlidingWindowSpec(
            block_size=BLOCK, num_kv_heads=1, head_size=16, dtype=torch.float32, sliding_window=sliding_window)))
    groups = groups[1:] if window_only else groups
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
    init_none_hash(sha256)
    return Scheduler(vllm_config=config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(config), block_size=BLOCK)


def _request(req_id: str, prompt: list[int] = PROMPT, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens)
    params.update_from_generation_config({}, 0)
    return Request(request_id=req_id, prompt_token_ids=list(prompt), sampling_params=params, pooling_params=None,
                   mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))


def _keys(request: Request, num_chunks: int) -> list[bytes]:
    return RequestChain(request, ROOT, CHUNK).upto(request.all_token_ids, num_chunks)


def _report(changes: list[tuple[bytes, str | None]], full: bool = False, epoch: int = 0) -> KVTierWorkerMeta:
    return KVTierWorkerMeta({0: RankReport(ROOT, changes, full, namespace=b"n" * 16, epoch=epoch)})


def _step_output(scheduler_output: Any, running: list[Request], **connector: Any) -> ModelRunnerOutput:
    """What the workers return for a step: a sampled token (7, never the EOS 0) for each scheduled
    request whose prompt is computed by this step (none for a partial prefill), and ``connector``'s
    fields (worker metadata, finished and failed loads)."""
    scheduled = [r for r in running if r.request_id in scheduler_output.num_scheduled_tokens]
    ids = [r.request_id for r in scheduled]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[7] if r.num_computed_tokens >= r.num_tokens else [] for r in scheduled],
                             kv_connector_output=KVConnectorOutput(**connector) if connector else None)


def _meta(scheduler_output: Any) -> KVTierMetadata:
    meta = scheduler_output.kv_connector_metadata
    assert isinstance(meta, KVTierMetadata)
    return meta


def _parked(scheduler: Scheduler, request: Request) -> Any:
    """Admit ``request`` while the workers' first report says its 3 chunks are in the cpu tier:
    the step that parks it in WAITING_FOR_REMOTE_KVS with its load job."""
    scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.update_from_output(first, _step_output(first, [], kv_connector_worker_meta=_report(
        [(k, "cpu") for k in _keys(request, 3)], full=True)))
    return scheduler.schedule()


def _free_blocks(scheduler: Scheduler) -> int:
    return scheduler.kv_cache_manager.block_pool.free_block_queue.num_free_blocks


def _connector_requests(scheduler: Scheduler) -> dict[str, Any]:
    """The scheduler side's request states (``SchedulerSide.requests``), and those with a load in flight."""
    side = scheduler.connector.scheduler_side  # type: ignore[union-attr]
    return {"requests": dict(side.requests),
            "loading": {r: s.loading_blocks for r, s in side.requests.items() if s.loading_blocks is not None}}


def test_admission_waits_for_the_first_report_then_loads_the_mirror_hit_per_tier(scheduler: Scheduler) -> None:
    request = _request("a")
    scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {} and request.status == RequestStatus.WAITING  # no report yet: ask again

    keys = _keys(request, 3)
    scheduler.update_from_output(first, _step_output(first, [], kv_connector_worker_meta=_report(
        [(keys[0], "cpu"), (keys[1], "cpu"), (keys[2], "disk")], full=True)))
    second = scheduler.schedule()
    stats = scheduler.make_stats()
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and second.num_scheduled_tokens == {}
    assert _meta(second).no_forward  # nothing to compute: a worker may wait for the load (idle_step_wait_s)
    (load,) = _meta(second).loads
    blocks = scheduler.kv_cache_manager.get_block_ids("a")[0]
    assert load.req_id == "a" and load.hit_tokens == 3 * CHUNK and load.first_token == 0
    assert load.tiers == ("cpu", "cpu", "disk")
    assert [p.key for p in load.pages] == keys
    assert [list(p.block_ids) for p in load.pages] == [list(blocks[i * 8:(i + 1) * 8]) for i in range(3)]
    assert stats is not None and stats.connector_prefix_cache_stats is not None
    assert stats.connector_prefix_cache_stats.hits == 3 * CHUNK
    assert {str(getattr(k, "value", k)): v for k, v in stats.connector_prefix_cache_stats.hits_by_source.items()} \
        == {"host": 2 * CHUNK, "disk": CHUNK}

    scheduler.update_from_output(second, _step_output(second, [], finished_recving={"a"}))
    third = scheduler.schedule()
    assert request.status == RequestStatus.RUNNING
    assert third.num_scheduled_tokens == {"a": len(PROMPT) - 3 * CHUNK}  # only the tail is computed
    assert _meta(third).loads == [] and not _meta(third).no_forward  # a step that computes never waits


def test_an_engine_with_prefix_caching_off_loads_nothing_it_cannot_compute_over_and_still_saves(
        tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    # vLLM turns prefix caching off where a cached prefix is computed over wrongly (MLA on the CPU
    # backend: a DeepSeek-V2-shaped model gave other tokens over a loaded prefix); a load is one
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        scheduler = _scheduler(tiny_model, prefix_caching=False)
    assert any("prefix caching off" in r.getMessage() and "loads nothing" in r.getMessage() for r in caplog.records)
    held, new = _request("held"), _request("new", prompt=list(range(500, 899)))
    scheduler.add_request(held)
    first = scheduler.schedule()
    scheduler.update_from_output(first, _step_output(first, [], kv_connector_worker_meta=_report(
        [(k, "cpu") for k in _keys(held, 3)], full=True)))  # its 3 chunks in the cpu tier: a hit with it on
    scheduler.add_request(new)
    second = scheduler.schedule()
    assert _meta(second).loads == [] and not _meta(second).no_forward
    assert second.num_scheduled_tokens == {"held": len(PROMPT), "new": 399}  # every token computed
    saved = {p.key for save in _meta(second).saves for p in save.pages}
    assert set(_keys(new, 3)) <= saved  # the KV it computes is kept for engines that can load it


def test_a_chunk_no_prompt_can_hold_is_said_at_start_up(tiny_model: Path, caplog: pytest.LogCaptureFixture) -> None:
    """chunk_tokens not below max_model_len: no prompt holds a whole chunk before its last token, so
    kvtier does nothing; a length probe found every hit 0 with nothing in the log (only audit said so)."""
    with caplog.at_level(logging.WARNING, logger="kvtier"):
        _scheduler(tiny_model, chunk_tokens=4096)  # max_model_len 4096
        said = [r.getMessage() for r in caplog.records if "is not below max_model_len" in r.getMessage()]
        assert said == [("kvtier: chunk_tokens 4096 is not below max_model_len 4096: no prompt holds a whole chunk "
                        "before its last token, so kvtier stores and loads nothing; lower chunk_tokens (auto: the "
                        "smallest multiple of every block size that is at least 128) or raise max_model_len")]
        caplog.clear()
        _scheduler(tiny_model, chunk_tokens=2048)
        assert not [r for r in caplog.records if "is not below max_model_len" in r.getMessage()]


def test_a_miss_loads_nothing_and_saves_each_chunk_once_as_chunked_prefill_computes_it(tiny_model: Path) -> None:
    scheduler = _scheduler(tiny_model, max_batched_tokens=200)
    request = _request("b")
    scheduler.add_request(request)
    steps = [scheduler.schedule()]
    scheduler.update_from_output(steps[0], _step_output(steps[0], [request],
                                                        kv_connector_worker_meta=_report([], full=True)))
    saved: list[bytes] = []
    for _ in range(4):
        step = scheduler.schedule()
        assert _meta(step).loads == []
        saved.extend(p.key for save in _meta(step).saves for p in save.pages)
        scheduler.update_from_output(step, _step_output(step, [request]))
        steps.append(step)
    assert [s.num_scheduled_tokens.get("b", 0) for s in steps[1:3]] == [200, len(PROMPT) - 200]
    assert saved == _keys(request, 3)  # chunk 0 after the first 200 tokens, chunks 1-2 after the rest, once each


def test_an_abort_while_loading_frees_every_block_once_the_load_reports(scheduler: Scheduler) -> None:
    request = _request("c")
    parked = _parked(scheduler, request)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and _meta(parked).loads
    held = NUM_BLOCKS - 1 - _free_blocks(scheduler)
    assert held == 3 * CHUNK // BLOCK  # the blocks the load fills (the tail gets its blocks when it runs)

    scheduler.finish_requests("c", RequestStatus.FINISHED_ABORTED)
    # the load is still running on the workers: its blocks may not be reused until it reports
    assert NUM_BLOCKS - 1 - _free_blocks(scheduler) == held
    scheduler.update_from_output(parked, _step_output(parked, [], finished_recving={"c"}))
    scheduler.schedule()
    assert _free_blocks(scheduler) == NUM_BLOCKS - 1
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert _connector_requests(scheduler) == {"requests": {}, "loading": {}}  # its state went with it


def test_a_block_that_failed_to_load_is_recomputed_from_the_valid_prefix_and_never_loaded_again(
        scheduler: Scheduler) -> None:
    request = _request("d")
    parked = _parked(scheduler, request)
    (load,) = _meta(parked).loads
    bad = load.pages[1].block_ids[0]  # the first block of chunk 1 did not arrive
    scheduler.update_from_output(parked, _step_output(parked, [], finished_recving={"d"}, invalid_block_ids={bad}))
    resumed = scheduler.schedule()
    assert request.status == RequestStatus.RUNNING
    assert resumed.num_scheduled_tokens == {"d": len(PROMPT) - CHUNK}  # chunk 0 kept, the rest recomputed
    assert _meta(resumed).loads == []
    # vLLM asks again (e.g. after a preemption): the same answer would fail the same way
    side = scheduler.connector.scheduler_side  # type: ignore[union-attr]
    assert side.get_num_new_matched_tokens(request, 0) == (0, False)


def test_an_external_reset_drops_every_hit_the_mirror_held(scheduler: Scheduler) -> None:
    request = _request("e", max_tokens=1)
    scheduler.add_request(request)
    first = scheduler.schedule()
    keys = _keys(request, 3)
    scheduler.update_from_output(first, _step_output(first, [], kv_connector_worker_meta=_report(
        [(k, "cpu") for k in keys], full=True)))
    assert scheduler.reset_prefix_cache(reset_connector=True) is True
    step = scheduler.schedule()
    meta = _meta(step)
    assert meta.loads == [] and step.num_scheduled_tokens == {"e": len(PROMPT)}  # computed in full: a miss
    assert meta.reset is not None and meta.reset.epoch == 1 and meta.reset.tiers == ("cpu",)
    # reports the workers sent before they applied the order do not bring the hits back
    scheduler.update_from_output(step, _step_output(step, [request], kv_connector_worker_meta=_report(
        [(k, "cpu") for k in keys])))
    side = scheduler.connector.scheduler_side  # type: ignore[union-attr]
    again = _request("f")
    assert side.get_num_new_matched_tokens(again, 0) == (0, False)
    # once a rank applied the order (its report carries the new epoch), its chunks count again
    scheduler.update_from_output(step, _step_output(step, [request], kv_connector_worker_meta=_report(
        [(k, "cpu") for k in keys], full=True, epoch=1)))
    assert side.get_num_new_matched_tokens(again, 0) == (3 * CHUNK, True)


@pytest.mark.parametrize(("asked", "pin_s"), [(30, 30.0), (1e9, 3600.0), (-1, 0.0), ("30", 0.0), (True, 0.0)])
def test_a_requests_pin_rides_its_save_jobs_checked_and_capped(tiny_model: Path, asked: Any, pin_s: float) -> None:
    scheduler = _scheduler(tiny_model)
    params = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {"kvtier_pin_s": asked}})
    params.update_from_generation_config({}, 0)
    request = Request(request_id="p", prompt_token_ids=list(PROMPT), sampling_params=params, pooling_params=None,
                      mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.update_from_output(first, _step_output(first, [request], kv_connector_worker_meta=_report([], full=True)))
    (save,) = _meta(scheduler.schedule()).saves
    assert save.pin_s == pin_s and save.pin_chunks == len(PROMPT) // CHUNK  # the prompt's full chunks


def _computed_and_saved(scheduler: Scheduler, req_id: str) -> tuple[Any, list[Any]]:
    """Run request ``req_id`` (PROMPT) to its end, kvtier holding nothing (the workers' first report
    empty): its last step and the pages every step's save jobs carried."""
    request = _request(req_id)
    scheduler.add_request(request)
    step = scheduler.schedule()
    scheduler.update_from_output(step, _step_output(step, [request], kv_connector_worker_meta=_report([], full=True)))
    saved = []
    while request.status != RequestStatus.FINISHED_LENGTH_CAPPED:
        step = scheduler.schedule()
        saved += [p for job in _meta(step).saves for p in job.pages]
        scheduler.update_from_output(step, _step_output(step, [request]))
    return step, saved


def test_a_hybrid_model_saves_every_groups_pages_and_loads_only_the_window_it_resumes_with(tiny_model: Path) -> None:
    """One job shape for every model: with a full-attention and a sliding-window group (window 64
    tokens = 4 blocks), the saves carry both groups' pages of every chunk, and a load after vLLM's
    own cache was reset fills every full-attention block of the hit but only the sliding-window
    blocks of the last window before it: the blocks vLLM itself allocates for that group."""
    scheduler = _scheduler(tiny_model, sliding_window=64)
    step, saved = _computed_and_saved(scheduler, "h")
    assert sorted((p.group, p.chunk) for p in saved) == [(g, c) for g in (0, 1) for c in range(3)]
    scheduler.update_from_output(step, _step_output(step, [], kv_connector_worker_meta=_report(
        [(p.key, "cpu") for p in saved])))
    assert scheduler.reset_prefix_cache() is True  # vLLM's own cache forgets; kvtier's mirror does not

    again = _request("h2")
    scheduler.add_request(again)
    (load,) = _meta(scheduler.schedule()).loads
    full_blocks, window_blocks = scheduler.kv_cache_manager.get_block_ids("h2")
    assert load.hit_tokens == 3 * CHUNK and again.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [b for p in load.pages if p.group == 0 for b in p.block_ids] == list(full_blocks)
    (window,) = [p for p in load.pages if p.group == 1]
    assert (window.chunk, window.first_slot) == (2, 4)  # the last 64 tokens before the hit: slots 4..7 of chunk 2
    assert list(window.block_ids) == [b for b in window_blocks if b != 0]  # 0 is vLLM's null block


def test_a_window_only_models_hit_counts_the_tokens_before_its_window_with_the_tier_it_loads_from(
        tiny_model: Path) -> None:
    """Every layer windowed (64 tokens): a hit needs the KV of the last window alone, so its earlier
    chunks have no page to load; vLLM skips their tokens because of the load, so the hit's sources
    name the tier the load reads (host: the cpu tier), every token of it (none "unspecified"), as the
    loaded tokens the workers count from the same planned tiers (a probe of a Mistral-shaped model
    counted 128 of 384 hit tokens as ``external_unspecified`` and loaded 256)."""
    scheduler = _scheduler(tiny_model, sliding_window=64, window_only=True)
    step, saved = _computed_and_saved(scheduler, "w")
    # chunk 0's page left the cpu tier (or was never saved: in an engine a window's blocks are freed
    # soon after its prefill); the hit does not need it
    assert sorted(p.chunk for p in saved) == [0, 1, 2]
    scheduler.update_from_output(step, _step_output(step, [], kv_connector_worker_meta=_report(
        [(p.key, "cpu") for p in saved if p.chunk > 0])))
    assert scheduler.reset_prefix_cache() is True
    again = _request("w2")
    scheduler.add_request(again)
    (load,) = _meta(scheduler.schedule()).loads
    stats = scheduler.make_stats()
    assert load.hit_tokens == 3 * CHUNK and {p.chunk for p in load.pages} == {2}  # the last window's blocks
    assert load.tiers == ("cpu", "cpu", "cpu")
    assert stats is not None and stats.connector_prefix_cache_stats is not None
    assert {str(getattr(k, "value", k)): v for k, v in stats.connector_prefix_cache_stats.hits_by_source.items()} \
        == {"host": 3 * CHUNK}


def test_after_an_idle_gap_a_lookup_waits_one_step_for_the_workers_rescan(tiny_model: Path, tmp_path: Path) -> None:
    """An idle engine runs no step, so what the workers' disk rescans found meanwhile (files another
    engine or ``kvtier purge`` removed) waits in their change feeds.  After a gap longer than
    ``disk_rescan_s`` the first lookup of a request asks again once; the one step that takes brings
    the news, and the request is planned from it: a purged prefix is not reported as a hit
    (docs/purge.md).  A request admitted without a gap is planned at once."""
    scheduler = _scheduler(tiny_model, disk_path=str(tmp_path / "disk"), disk_gib=0.01)
    side = scheduler.connector.scheduler_side  # type: ignore[union-attr]
    assert side._refresh_after_s == 2.0  # the engine's rescan interval when disk_rescan_s is unset
    warm = _request("warm")
    scheduler.add_request(warm)
    first = scheduler.schedule()
    purged, kept = _request("purged"), _request("kept", prompt=[t + 1000 for t in PROMPT])
    pk, kk = _keys(purged, 3), _keys(kept, 3)
    scheduler.update_from_output(first, _step_output(first, [], kv_connector_worker_meta=_report(
        [(k, "disk") for k in pk + kk], full=True)))
    step = scheduler.schedule()
    scheduler.update_from_output(step, _step_output(step, [warm], kv_connector_worker_meta=_report([])))

    side._last_report_s -= 10.0  # the engine then idles 10 s (longer than a rescan) ...
    scheduler.add_request(purged)
    asked = scheduler.schedule()
    assert "purged" not in asked.num_scheduled_tokens and _meta(asked).loads == []  # ... so it asks again
    assert purged.status == RequestStatus.WAITING
    # the step brings what the workers' rescan found while idle: the purged prefix's files are gone
    scheduler.update_from_output(asked, _step_output(asked, [warm], kv_connector_worker_meta=_report(
        [(k, None) for k in pk])))
    planned = scheduler.schedule()
    assert _meta(planned).loads == [] and planned.num_scheduled_tokens.get("purged") == len(PROMPT)  # a miss
    scheduler.update_from_output(planned, _step_output(planned, [warm, purged], kv_connector_worker_meta=_report([])))

    scheduler.add_request(kept)  # no idle gap: planned from the mirror at once, its files still there
    (load,) = _meta(scheduler.schedule()).loads
    assert load.req_id == "kept" and load.hit_tokens == 3 * CHUNK and load.tiers == ("disk",) * 3


PROMPT_BYTES = 3 * CHUNK * 2 * 16 * 4  # the 3 chunks' KV: K and V, 1 head of 16 float32 values per token


def _reported(scheduler: Scheduler, requests: list[Request], tier_of: Any = lambda chunk: "cpu") -> None:
    """The workers' first report: the 3 chunks of each request held in ``tier_of(chunk)``."""
    for request in requests:
        scheduler.add_request(request)
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {}
    scheduler.update_from_output(first, _step_output(first, [], kv_connector_worker_meta=_report(
        [(k, tier_of(c)) for r in requests for c, k in enumerate(_keys(r, 3))], full=True)))


def test_a_cpu_tier_hit_within_the_budget_is_loaded_and_computed_in_the_step_that_schedules_it(
        tiny_model: Path) -> None:
    """``(n, False)``: no WAITING_FOR_REMOTE_KVS step; the tail runs in the same step as the load job
    (``has_sync_kv_loads``: vLLM calls start_load_kv before that step's forward), the hit counted as
    vLLM's ``host`` source, and no ``finished_recving`` is needed for the request to finish."""
    scheduler = _scheduler(tiny_model, sync_load_max_bytes=PROMPT_BYTES)
    request = _request("s")
    _reported(scheduler, [request])
    step = scheduler.schedule()
    stats = scheduler.make_stats()
    assert request.status == RequestStatus.RUNNING and step.has_sync_kv_loads
    assert step.num_scheduled_tokens == {"s": len(PROMPT) - 3 * CHUNK}  # the tail only, this very step
    (load,) = _meta(step).loads
    blocks = scheduler.kv_cache_manager.get_block_ids("s")[0]
    assert load.sync and (load.first_token, load.hit_tokens) == (0, 3 * CHUNK)
    assert [b for p in load.pages for b in p.block_ids] == list(blocks[:3 * CHUNK // BLOCK])
    assert stats is not None and stats.connector_prefix_cache_stats is not None
    assert {str(getattr(k, "value", k)): v for k, v in stats.connector_prefix_cache_stats.hits_by_source.items()} \
        == {"host": 3 * CHUNK}
    scheduler.update_from_output(step, _step_output(step, [request]))
    assert list(request.output_token_ids) == [7]  # its first token from the step that loaded it
    assert _connector_requests(scheduler)["loading"] == {}


@pytest.mark.parametrize(("budget", "tier_of", "why"), [
    (PROMPT_BYTES, lambda chunk: "disk" if chunk == 2 else "cpu", "a chunk on disk"),
    (PROMPT_BYTES - 1, lambda chunk: "cpu", "one byte over the budget"),
    (0, lambda chunk: "cpu", "sync loads off")])
def test_a_hit_on_disk_or_over_the_budget_loads_asynchronously(tiny_model: Path, budget: int, tier_of: Any,
                                                               why: str) -> None:
    scheduler = _scheduler(tiny_model, sync_load_max_bytes=budget)
    request = _request("w")
    _reported(scheduler, [request], tier_of)
    step = scheduler.schedule()
    (load,) = _meta(step).loads
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not load.sync, why
    assert step.num_scheduled_tokens == {} and not step.has_sync_kv_loads


def test_the_budget_is_per_step_and_shared_by_the_requests_it_schedules(tiny_model: Path) -> None:
    """Budget for one and a half prompts: of two hits admitted in one step, the first loads
    synchronously and the second parks; in the next step the budget is whole again."""
    scheduler = _scheduler(tiny_model, sync_load_max_bytes=PROMPT_BYTES * 3 // 2)
    first, second = _request("x1"), _request("x2", prompt=[t + 1000 for t in PROMPT])
    _reported(scheduler, [first, second])
    step = scheduler.schedule()
    assert {(j.req_id, j.sync) for j in _meta(step).loads} == {("x1", True), ("x2", False)}
    assert first.status == RequestStatus.RUNNING and second.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    scheduler.update_from_output(step, _step_output(step, [first]))
    third = _request("x3", prompt=[t + 2000 for t in PROMPT])
    side = scheduler.connector.scheduler_side  # type: ignore[union-attr]
    side.mirror.apply(0, _report([(k, "cpu") for k in _keys(third, 3)]).ranks[0])
    scheduler.add_request(third)
    step = scheduler.schedule()
    assert [(j.req_id, j.sync) for j in _meta(step).loads] == [("x3", True)]


def test_a_synchronous_load_that_failed_a_block_is_recomputed_and_its_chunks_saved_again(tiny_model: Path) -> None:
    """The worker reports the block of chunk 1 it could not fill as a load error of the same step:
    vLLM keeps chunk 0 and recomputes the rest in the running request; the scheduler then saves
    chunks 1 and 2 (the load's step saved none: its chunks were loaded from the tiers)."""
    scheduler = _scheduler(tiny_model, sync_load_max_bytes=PROMPT_BYTES)
    request = _request("f")
    _reported(scheduler, [request])
    step = scheduler.schedule()
    (load,) = _meta(step).loads
    assert load.sync
    assert _meta(step).saves == []  # chunks 0-2 are being loaded from the tiers: not saved again
    bad = load.pages[1].block_ids[0]
    scheduler.update_from_output(step, _step_output(step, [request], invalid_block_ids={bad}))
    assert list(request.output_token_ids) == []  # vLLM discards the token sampled over the unfilled block
    again = scheduler.schedule()
    assert again.num_scheduled_tokens == {"f": len(PROMPT) - CHUNK} and _meta(again).loads == []
    assert [p.chunk for job in _meta(again).saves for p in job.pages] == [1, 2]
    scheduler.update_from_output(again, _step_output(again, [request]))
    assert list(request.output_token_ids) == [7]


def test_a_salted_requests_saves_carry_its_tenant_and_the_first_stats_say_quotas_and_events(tiny_model: Path) -> None:
    """Tenant quotas (issue 22 item 5) key a chunk by its request's ``cache_salt``: the save jobs
    carry the salt's digest (never the salt) to the workers' stores, whose quotas choose victims by
    it (tests/core/test_store_quotas.py); the scheduler's first stats tell /metrics (and kvtier
    doctor) that quotas are on and KV events off."""
    from kvtier.core.quota import salt_digest

    scheduler = _scheduler(tiny_model, tenant_quotas={"default_share": 0.25, "salts": {"tenant-a": 0.5}})
    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({}, 0)
    salted = Request(request_id="a", prompt_token_ids=list(PROMPT), sampling_params=params, pooling_params=None,
                     mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256), cache_salt="tenant-a")
    plain = _request("plain", prompt=[t + 1000 for t in PROMPT])
    scheduler.add_request(salted)
    scheduler.add_request(plain)
    first = scheduler.schedule()
    outputs = scheduler.update_from_output(first, _step_output(first, [salted, plain],
                                                               kv_connector_worker_meta=_report([], full=True)))
    stats = [o.scheduler_stats for o in outputs.values() if o.scheduler_stats is not None]
    gauges = stats[0].kv_connector_stats["gauges"]
    assert gauges == {"kv_events_enabled": 0.0, "tenant_quota_default_share": 0.25, "tenant_quota_salts": 1.0,
                      "tenant_quota_no_salt_share": 0.25}  # no_salt_share unset: the default share
    saves = {save.req_id: save for save in _meta(scheduler.schedule()).saves}
    assert saves["a"].tenant is not None and saves["a"].tenant.salt == salt_digest("tenant-a")
    assert saves["plain"].tenant is not None and saves["plain"].tenant.salt == b""  # the unsalted tenant
    second = scheduler.connector.get_kv_connector_stats()  # type: ignore[union-attr]
    assert second is None or "tenant_quota_default_share" not in second.data["gauges"]  # sent once


def test_the_connector_resolves_the_engine_config_once_and_its_side_takes_it_as_is(tiny_model: Path,
                                                                                     tmp_path: Path) -> None:
    """``chunk_tokens: auto`` and the role's defaults are applied once, by the connector
    (``engine_config``): the scheduler side runs with that very object, and refuses a config whose
    chunk size is still ``auto`` rather than resolving it a second time."""
    from kvtier.core.config import KVTierConfig
    from kvtier.integrations.vllm.engine_config import ENGINE_RESCAN_S
    from kvtier.integrations.vllm.scheduler.side import SchedulerSide

    scheduler = _scheduler(tiny_model, chunk_tokens="auto", disk_path=str(tmp_path / "disk"), disk_gib=0.01)
    connector = scheduler.connector
    side = connector.scheduler_side  # type: ignore[union-attr]
    assert side.config is connector.kvtier_config  # type: ignore[union-attr]
    assert side.config.chunk_tokens == CHUNK  # auto over 16-token blocks: 128
    assert side.config.disk_rescan_s == ENGINE_RESCAN_S  # the role's default, applied in the same call
    with pytest.raises(TypeError, match="engine_config"):
        SchedulerSide(connector._vllm_config, connector._kv_cache_config,  # type: ignore[union-attr]
                      KVTierConfig.from_dict({"cpu_gib": 0.05}), load=True, save=True)
