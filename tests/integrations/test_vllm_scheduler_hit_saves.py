"""A hit's loaded chunks are not saved again (issue 33: the hit path costs what its copy costs), in
vLLM's real ``Scheduler`` driven step by step as ``test_vllm_scheduler.py`` drives it.

Before, every full hit shipped a save job naming every chunk it had just loaded; the workers then
found each one held and stored nothing (``Index.plan_store`` passes a held chunk by), at ~8 µs per
chunk on both sides.  These prove the save jobs no longer carry the loaded chunks (synchronous and
asynchronous loads), that a prompt extending a loaded prefix still saves its new chunks, that a
load which failed a block has the chunks from there saved once recomputed, that chunks loaded from a
shared tier are still offered for saving (the load may not have promoted them into a cpu page), and
that a TTL-pinned request still ships its save job (the job is what pins its prompt's chunks).
"""

from __future__ import annotations

from pathlib import Path

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request, RequestStatus

from tests.integrations.test_vllm_scheduler import (
    BLOCK,
    CHUNK,
    PROMPT,
    PROMPT_BYTES,
    _computed_and_saved,
    _keys,
    _meta,
    _parked,
    _report,
    _reported,
    _request,
    _scheduler,
    _step_output,
)

LONGER = PROMPT + list(range(1000, 1300))  # 699 tokens: chunks 0-2 as PROMPT's, then chunks 3 and 4


def _saved(step: object) -> list[tuple[str, int]]:
    return [(job.req_id, p.chunk) for job in _meta(step).saves for p in job.pages]


def test_a_synchronous_full_hit_ships_no_save_and_an_extension_saves_only_its_new_chunks(tiny_model: Path) -> None:
    scheduler = _scheduler(tiny_model, sync_load_max_bytes=PROMPT_BYTES * 2)
    hit = _request("h", max_tokens=1)
    _reported(scheduler, [hit])
    step = scheduler.schedule()
    (load,) = _meta(step).loads
    assert load.sync and load.hit_tokens == 3 * CHUNK and step.num_scheduled_tokens == {"h": len(PROMPT) - 3 * CHUNK}
    assert _saved(step) == []  # chunks 0-2 were loaded from the tiers: nothing to save (before: [0, 1, 2])
    scheduler.update_from_output(step, _step_output(step, [hit]))
    assert list(hit.output_token_ids) == [7] and hit.is_finished()
    assert scheduler.reset_prefix_cache()  # vLLM forgets; the tiers (the mirror) still hold chunks 0-2

    longer = _request("x", prompt=LONGER)  # its first 3 chunks are the hit's: loaded, then 3 and 4 computed
    scheduler.add_request(longer)
    step = scheduler.schedule()
    (load,) = _meta(step).loads
    assert load.req_id == "x" and load.sync and load.hit_tokens == 3 * CHUNK
    assert _saved(step) == [("x", 3), ("x", 4)]
    assert [p.key for job in _meta(step).saves for p in job.pages] == _keys(longer, 5)[3:]


def test_an_asynchronous_hit_saves_its_new_chunks_only_once_its_load_reported(tiny_model: Path) -> None:
    scheduler = _scheduler(tiny_model)  # sync loads off: the hit parks until the workers report it loaded
    request = _request("a", prompt=LONGER)
    parked = _parked(scheduler, request)  # the workers hold chunks 0-2
    (load,) = _meta(parked).loads
    assert not load.sync and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and _saved(parked) == []
    scheduler.update_from_output(parked, _step_output(parked, [], finished_recving={"a"}))
    resumed = scheduler.schedule()
    assert resumed.num_scheduled_tokens == {"a": len(LONGER) - 3 * CHUNK}
    assert _saved(resumed) == [("a", 3), ("a", 4)]  # not 0-2 (before: [0, 1, 2, 3, 4])


def test_an_asynchronous_load_that_failed_a_block_has_the_chunks_from_there_saved_once_recomputed(
        tiny_model: Path) -> None:
    scheduler = _scheduler(tiny_model)
    request = _request("d")
    parked = _parked(scheduler, request)
    (load,) = _meta(parked).loads
    bad = load.pages[1].block_ids[0]  # chunk 1 did not arrive: vLLM keeps chunk 0, recomputes 1 and 2
    scheduler.update_from_output(parked, _step_output(parked, [], finished_recving={"d"}, invalid_block_ids={bad}))
    resumed = scheduler.schedule()
    assert resumed.num_scheduled_tokens == {"d": len(PROMPT) - CHUNK}
    # the save names every chunk again (the workers pass chunk 0 by: held), as before this change
    assert _saved(resumed) == [("d", 0), ("d", 1), ("d", 2)]


def test_a_pinned_full_hit_still_ships_its_save_job_which_pins_the_prompt(tiny_model: Path) -> None:
    scheduler = _scheduler(tiny_model, sync_load_max_bytes=PROMPT_BYTES)
    params = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": {"kvtier_pin_s": 30}})
    params.update_from_generation_config({}, 0)
    pinned = Request(request_id="p", prompt_token_ids=list(PROMPT), sampling_params=params, pooling_params=None,
                     mm_features=None, block_hasher=get_request_block_hasher(BLOCK, sha256))
    _reported(scheduler, [pinned])
    step = scheduler.schedule()
    (load,) = _meta(step).loads
    assert load.sync and load.hit_tokens == 3 * CHUNK
    (save,) = _meta(step).saves
    assert save.pin_s == 30.0 and [p.chunk for p in save.pages] == [0, 1, 2] and save.pin_chunks == 3


def test_chunks_loaded_from_a_shared_tier_are_still_offered_for_saving(tiny_model: Path) -> None:
    """Chunks 0-1 in the cpu tier, chunk 2 in the shared redis tier (as the workers' report names
    it): the save after the load skips chunks 0-1 only; a redis chunk the load could not promote
    into a cpu page is stored locally by that save, as before."""
    scheduler = _scheduler(tiny_model)
    request = _request("r")
    scheduler.add_request(request)
    first = scheduler.schedule()
    scheduler.update_from_output(first, _step_output(first, [], kv_connector_worker_meta=_report(
        [(k, "redis" if c == 2 else "cpu") for c, k in enumerate(_keys(request, 3))], full=True)))
    parked = scheduler.schedule()
    (load,) = _meta(parked).loads
    assert load.tiers == ("cpu", "cpu", "redis") and not load.sync
    scheduler.update_from_output(parked, _step_output(parked, [], finished_recving={"r"}))
    resumed = scheduler.schedule()
    assert resumed.num_scheduled_tokens == {"r": len(PROMPT) - 3 * CHUNK}
    assert _saved(resumed) == [("r", 2)]


def test_a_save_job_names_the_chunks_vllms_own_cache_served_for_the_cpu_tier_to_touch(tiny_model: Path) -> None:
    """``SaveJob.touch_chunks``: a prompt computed with nothing cached touches nothing; one whose first 3
    chunks vLLM's own prefix cache served (PROMPT's, computed just before) ships those 3 for the workers to
    touch in the cpu tier's policy where it holds them (a use, as a load's; before: they kept their old rank)."""
    scheduler = _scheduler(tiny_model)
    step, saved = _computed_and_saved(scheduler, "h")
    assert [p.chunk for p in saved] == [0, 1, 2]
    scheduler.update_from_output(step, _step_output(step, [], kv_connector_worker_meta=_report(
        [(p.key, "cpu") for p in saved])))
    longer = _request("x", prompt=LONGER)
    scheduler.add_request(longer)
    step = scheduler.schedule()
    assert _meta(step).loads == [] and step.num_scheduled_tokens == {"x": len(LONGER) - 3 * CHUNK}  # vLLM's hit
    (job,) = _meta(step).saves
    assert [p.chunk for p in job.pages] == [0, 1, 2, 3, 4] and job.touch_chunks == 3
