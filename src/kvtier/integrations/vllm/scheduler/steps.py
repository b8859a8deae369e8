"""The scheduler's per-step pieces besides the plans: the synchronous loads' budget
(:class:`SyncBudget`) and keeping an idle engine stepping (:class:`Settle`).

**Synchronous loads**: a hit held whole in the cpu tier (and the node pool: :func:`sync_tiers`),
copied before the forward of the very step that schedules the request, within
``sync_load_max_bytes`` per step.

``get_num_new_matched_tokens`` answers ``(n, False)`` for such a hit (vLLM then calls
``start_load_kv`` before that step's forward, ``SchedulerOutput.has_sync_kv_loads``,
vllm/v1/worker/kv_connector_model_runner_mixin.py), with one full-attention KV cache group only:
vLLM takes a synchronous load's failures as block ids, which it refuses with several groups
(``Scheduler._handle_invalid_blocks``).  The worker reports the blocks it could not fill as
``invalid_block_ids`` of that step's output (:func:`check_sync_load`); no ``finished_recving``
follows.

**Settling**: keep an idle engine stepping until the workers' numbers are true: pins released,
first report in.

vLLM moves a connector's numbers (``KVConnectorStats``, the worker → scheduler metadata) only on
engine steps, and an engine with no request does not step.  Without help, the gauges of
``/metrics`` freeze at the last busy step: ``kvtier_pinned_chunks`` kept showing the pins of disk
writes still in flight when the last request ended (read 5 and 2 for over a minute after a run),
and ``kvtier_capacity_bytes`` read 0 after boot until the first request.

vLLM 0.32 keeps the engine loop stepping while the scheduler-side connector's
``has_pending_push_work()`` is true (vllm/v1/core/sched/scheduler.py ``Scheduler.has_requests``;
vLLM's Mooncake store connector uses it the same way, to release its pinned saves).  kvtier says
so while

- no worker has reported yet since start (one step delivers the first full snapshot of each
  rank's index and its capacities), or
- a worker's last report said it was busy (chunks pinned by loads or disk writes in flight), or
- KV events wait to be published (vLLM publishes a connector's events only on steps:
  :mod:`kvtier.integrations.vllm.scheduler.events`, rate-limited after a restart),

and at most :data:`SETTLE_S` seconds from the step where the engine ran out of scheduled work,
so a pin that never ends (a bug) cannot keep the engine spinning.  Steps taken only to settle
sleep :data:`IDLE_STEP_S` in :meth:`Settle.step`, so settling costs about 100 empty steps a
second for as long as the disk writes take.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.tiers.factory import shared_configured
from kvtier.core.tiers.registry import spec, top_tier
from kvtier.integrations.vllm.protocol import KVTierWorkerMeta
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


def sync_tiers(config: KVTierConfig) -> frozenset[str]:
    """The tiers a synchronous load reads: the top (cpu) tier, and with ``sync_shared_loads`` the first
    shared tier when it answers from this host's memory (``answers_now``: the node pool, whose pin is
    one local round trip, bounded on the engine's thread by ``shared_deadline_s``)."""
    shared = shared_configured(config)
    if config.sync_shared_loads and shared and "answers_now" in spec(shared[0]).capabilities:
        return frozenset({top_tier(), shared[0]})
    return frozenset({top_tier()})


class SyncBudget:
    """This step's bytes for synchronous loads, promised to the requests answered ``(n, False)``.

    Args:
        step_bytes: ``sync_load_max_bytes`` (0: synchronous loads off).
        bytes_per_token: :func:`bytes_per_token` of the engine.
        tiers: the tiers a synchronous load reads (:func:`sync_tiers`; a chunk elsewhere loads asynchronously).
        chunk_tokens: tokens per chunk.
    """

    def __init__(self, step_bytes: int, bytes_per_token: int, tiers: frozenset[str], chunk_tokens: int) -> None:
        self.step_bytes = step_bytes
        self.bytes_per_token = bytes_per_token
        self.tiers = tiers
        self.chunk_tokens = chunk_tokens
        self.left_bytes = step_bytes  # this step's budget not yet promised
        self._promised: dict[str, int] = {}  # requests answered (n, False) this step -> bytes promised

    @classmethod
    def of(cls, config: KVTierConfig, kv_cache_config: Any, on: bool) -> SyncBudget:
        """The engine's budget: ``sync_load_max_bytes`` when ``on`` (one full-attention KV cache group,
        loads enabled), over :func:`sync_tiers`; ``config.chunk_tokens`` resolved."""
        return cls(int(config.sync_load_max_bytes) if on else 0, bytes_per_token(kv_cache_config),
                   sync_tiers(config), int(config.chunk_tokens))

    def offer(self, req_id: str, tiers: list[str], num_computed_tokens: int, hit: int) -> bool:
        """Promise the load of tokens ``[num_computed_tokens, hit)`` to ``req_id`` in this step when
        every chunk to load is in :attr:`tiers` (by the plan) and its copy fits what is left."""
        if not self.step_bytes:
            return False
        need = (hit - num_computed_tokens) * self.bytes_per_token
        if need > self.left_bytes:
            return False
        first = num_computed_tokens // self.chunk_tokens  # every chunk from there in a tier read synchronously
        if not self.tiers.issuperset(tiers[first:]):
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


SETTLE_S = 10.0  # longest an idle engine keeps stepping for kvtier, seconds
IDLE_STEP_S = 0.01  # pause of a step taken only to settle, seconds


class Settle:
    """Whether the engine should keep stepping for kvtier's sake (see the module docstring).

    Args:
        settle_s: longest the engine steps with no scheduled work, seconds.
        clock: monotonic clock (seconds).
        more: other work that wants steps (the KV events still to publish,
            :meth:`~kvtier.integrations.vllm.scheduler.events.KVEventTracker.pending`), within the same bound.
    """

    def __init__(self, settle_s: float = SETTLE_S, clock: Callable[[], float] = time.monotonic,
                 more: Callable[[], bool] | None = None) -> None:
        self.settle_s = settle_s
        self._more = more
        self._clock = clock
        self._reported = False
        self._busy: set[int] = set()  # ranks whose last report said busy
        self._idle_since: float | None = None  # first step with no scheduled work, after the last busy one
        self._gave_up = False

    def observe(self, meta: object) -> None:
        """Fold one step's worker → scheduler metadata (any type; only kvtier's is read)."""
        if not isinstance(meta, KVTierWorkerMeta):
            return
        for rank, report in meta.ranks.items():
            self._reported = True
            if report.busy:
                self._busy.add(rank)
            else:
                self._busy.discard(rank)

    def wanted(self) -> bool:
        """The workers' numbers are not settled yet: the first report is missing or a rank is busy."""
        return not self._reported or bool(self._busy) or (self._more is not None and self._more())

    def pending(self) -> bool:
        """``has_pending_push_work``: settle wanted and the idle window not spent."""
        if not self.wanted():
            return False
        if self._idle_since is not None and self._clock() - self._idle_since > self.settle_s:
            if not self._gave_up:
                self._gave_up = True
                what = ("no worker has reported yet" if not self._reported
                        else f"ranks {sorted(self._busy)} still report pinned chunks" if self._busy
                        else "KV events still wait to be published")
                log.warning("kvtier: %s %.0f s after the engine went idle; kvtier's gauges may be stale until "
                            "the next request", what, self.settle_s)
            return False
        return True

    def step(self, idle: bool) -> None:
        """Called once per engine step: ``idle`` when the step scheduled no token and kvtier knows
        of no request (none waiting for a load either).  A step taken only to settle pauses
        :data:`IDLE_STEP_S` so that settling does not spin a core; a step with work never does."""
        if not idle:
            self._idle_since = None
            self._gave_up = False
            return
        if self._idle_since is None:
            self._idle_since = self._clock()
        if self.wanted() and not self._gave_up:
            time.sleep(IDLE_STEP_S)
