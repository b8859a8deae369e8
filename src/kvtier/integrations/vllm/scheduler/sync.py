"""Synchronous loads: a hit held whole in the cpu tier, copied before the forward of the very step
that schedules the request, within ``sync_load_max_bytes`` per step.

``get_num_new_matched_tokens`` answers ``(n, False)`` for such a hit (vLLM then calls
``start_load_kv`` before that step's forward, ``SchedulerOutput.has_sync_kv_loads``,
vllm/v1/worker/kv_connector_model_runner_mixin.py), with one full-attention KV cache group only:
vLLM takes a synchronous load's failures as block ids, which it refuses with several groups
(``Scheduler._handle_invalid_blocks``).  The worker reports the blocks it could not fill as
``invalid_block_ids`` of that step's output (:func:`check_sync_load`); no ``finished_recving``
follows.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier.integrations.vllm.scheduler.requests import RequestState

log = logging.getLogger(__name__)


def bytes_per_token(kv_cache_config: Any) -> int:
    """KV bytes one token takes in one rank's engine cache, every layer of every group
    (``kv_cache_spec.page_size_bytes`` is one layer's block): what a synchronous load copies per token."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += -(-int(spec.page_size_bytes) * len(group.layer_names) // int(spec.block_size))
    return max(total, 1)


class SyncBudget:
    """This step's bytes for synchronous loads, promised to the requests answered ``(n, False)``.

    Args:
        step_bytes: ``sync_load_max_bytes`` (0: synchronous loads off).
        bytes_per_token: :func:`bytes_per_token` of the engine.
        top_tier: the cpu tier's name (a chunk elsewhere loads asynchronously).
        chunk_tokens: tokens per chunk.
    """

    def __init__(self, step_bytes: int, bytes_per_token: int, top_tier: str, chunk_tokens: int) -> None:
        self.step_bytes = step_bytes
        self.bytes_per_token = bytes_per_token
        self.top_tier = top_tier
        self.chunk_tokens = chunk_tokens
        self.left_bytes = step_bytes  # this step's budget not yet promised
        self._promised: dict[str, int] = {}  # requests answered (n, False) this step -> bytes promised

    def offer(self, req_id: str, tiers: list[str], num_computed_tokens: int, hit: int) -> bool:
        """Promise the load of tokens ``[num_computed_tokens, hit)`` to ``req_id`` in this step when
        every chunk to load is in the cpu tier (by the mirror) and its copy fits what is left."""
        if not self.step_bytes:
            return False
        need = (hit - num_computed_tokens) * self.bytes_per_token
        if need > self.left_bytes:
            return False
        if not all(t == self.top_tier for t in tiers[num_computed_tokens // self.chunk_tokens:]):
            return False
        self.left_bytes -= need
        self._promised[req_id] = need
        return True

    def give_back(self, req_id: str) -> bool:
        """Take back ``req_id``'s promise (asked again, not allocated, or finished); whether it had one."""
        promised = self._promised.pop(req_id, None)
        if promised is None:
            return False
        self.left_bytes += promised
        return True

    def taken(self, req_id: str) -> bool:
        """``req_id``'s load job was built: whether it was promised this step (a synchronous load)."""
        return self._promised.pop(req_id, None) is not None

    def new_step(self) -> None:
        """The next step's budget, whole."""
        self.left_bytes = self.step_bytes
        self._promised.clear()


def check_sync_load(req_id: str, state: RequestState, invalid: set[int]) -> None:
    """One step output after ``state``'s synchronous load: the blocks it could not fill come back as
    that output's ``invalid_block_ids``; vLLM recomputes the running request from the first one and
    the worker did not save the chunks from there, so they are saved again once recomputed."""
    bad = [chunk for chunk, blocks in state.sync_pages if invalid and not invalid.isdisjoint(blocks)]
    if bad:
        log.info("kvtier: request %s: its synchronous load came up short; vLLM recomputes from chunk %d",
                 req_id, min(bad))
        state.saved_chunks = min(state.saved_chunks, min(bad))
        state.sync_outputs_left = 1
    state.sync_outputs_left -= 1
    if not state.sync_outputs_left:
        state.sync_pages = ()
