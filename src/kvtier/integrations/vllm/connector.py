"""``KVTierConnector``: kvtier behind vLLM's v1 KV connector interface.

Enable it with::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_gib": 8,
                                      "disk_path": "/nvme/kvtier", "disk_gib": 200}}'

``kv_connector_extra_config`` is a :class:`~kvtier.core.config.KVTierConfig` (unknown keys are
rejected at start-up).  Roles: ``kv_both`` loads and saves, ``kv_producer`` only saves,
``kv_consumer`` only loads (a prefill and a decode instance hand KV over through a shared disk
tier).

What the connector declares to vLLM (vLLM 0.32–0.34, vllm/distributed/kv_transfer/kv_connector/v1/base.py;
the releases and how each was checked: :mod:`kvtier.integrations.vllm.compat`):

- ``SupportsHMA``: the hybrid KV cache manager stays on; a hybrid model's groups (full
  attention, sliding window, Mamba/linear-attention/conv state) are stored per group
  (:mod:`kvtier.integrations.vllm.scheduler.pages`), and a failed hybrid load is reported per request
  (``failed_recving``), the only way vLLM accepts with several groups.
- ``supports_sleep_mode() = False`` (vLLM 0.33+ asks): ``--enable-sleep-mode`` is refused at start-up.
- ``requires_kv_delivery = False``: a best-effort cache; a dropped save is a future miss.
- Loads are asynchronous (``get_num_new_matched_tokens`` returns ``(n, True)``), except a hit held
  whole in the cpu tier within ``sync_load_max_bytes`` per step: ``(n, False)``, copied in
  ``start_load_kv`` before the forward of the step that schedules the request (vLLM calls it
  before the forward when ``SchedulerOutput.has_sync_kv_loads``,
  vllm/v1/worker/kv_connector_model_runner_mixin.py).  Saves of full-attention pages are
  deferred (``async_saves``, the default): ``wait_for_save`` reserves the pages, records an event
  after the forward and returns; the copy runs on the worker's saver thread, ``request_finished``
  returns ``True`` for a request with such a save and its blocks are freed once every rank names
  it in ``finished_sending`` (``get_finished``); ``handle_preemptions`` waits for a preempted
  request's saves before the forward (:mod:`kvtier.integrations.vllm.worker.saves`).  Other saves
  end within their step.
- External hits are reported by source (``host`` for the cpu tier, ``disk``, and
  ``external_unspecified`` for the shared redis tier).

The scheduler-side and worker-side objects are separate and usually in separate processes; they
meet only through vLLM's own per-step messages (see the package docstring for the contract).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.tiers import registry
from kvtier.core.tiers.registry import hit_source
from kvtier.integrations.vllm.compat import require_supported
from kvtier.integrations.vllm.engine_config import engine_config
from kvtier.integrations.vllm.protocol import KVTierMetadata, KVTierWorkerMeta
from kvtier.integrations.vllm.scheduler.side import SchedulerSide
from kvtier.integrations.vllm.stats import KVTierPromMetrics, KVTierStats
from kvtier.integrations.vllm.worker.side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def _hit_sources() -> tuple[int, dict[str, CacheHitSource]]:
    """(registry generation, each registered tier's vLLM hit source), derived once per registration."""
    return registry.generation, {s.name: CacheHitSource(s.hit_source) for s in registry.specs()}


def _use_vllm_logging() -> None:
    """Route kvtier's log records through vLLM's handlers, so they carry vLLM's prefix and INFO
    lines (layout, namespace) are shown; without this only WARNING reaches stderr, unformatted."""
    kvtier_log = logging.getLogger("kvtier")
    vllm_log = logging.getLogger("vllm")
    if vllm_log.handlers and not kvtier_log.handlers:
        for handler in vllm_log.handlers:
            kvtier_log.addHandler(handler)
        kvtier_log.setLevel(logging.INFO)
        kvtier_log.propagate = False


_use_vllm_logging()


class KVTierConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by a kvtier :class:`~kvtier.core.store.TieredStore` per rank.

    Raises (at construction, i.e. engine start-up):
        ConfigError: a bad ``kv_connector_extra_config`` value, an explicit ``chunk_tokens`` not a
            multiple of every KV cache group's block size (``auto``, the default, is resolved from
            them: :func:`~kvtier.integrations.vllm.engine_config.engine_config`), or a model/parallelism
            kvtier does not handle, or a vLLM outside
            :data:`~kvtier.integrations.vllm.compat.SUPPORTED_VLLM`.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        load = transfer.kv_role in ("kv_both", "kv_consumer")
        save = transfer.kv_role in ("kv_both", "kv_producer")
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self._sources = _hit_sources()  # (registry generation, tier -> vLLM hit source)
        try:
            require_supported(vllm.__version__)  # a vLLM outside SUPPORTED_VLLM, in one sentence (compat.py)
            asked = KVTierConfig.from_dict(dict(transfer.kv_connector_extra_config or {}))
            # once per connector: chunk_tokens (auto, or an explicit value checked) resolved from
            # kv_cache_config's groups, which the scheduler and every worker get alike, and the role's
            # defaults (the workers' rescan interval, which the scheduler's idle refresh follows)
            self.kvtier_config = engine_config(asked, kv_cache_config, transfer.kv_role)
            if role == KVConnectorRole.SCHEDULER:
                self.scheduler_side = SchedulerSide(vllm_config, kv_cache_config, self.kvtier_config,
                                                    load=load, save=save)
                self._bind_scheduler_verbs(self.scheduler_side)
            else:
                self.worker_side = WorkerSide(vllm_config, kv_cache_config, self.kvtier_config)
                self._bind_worker_verbs(self.worker_side)
        except ConfigError as exc:
            # one line an operator can find in the engine's log, above vLLM's own traceback
            log.error("kvtier configuration error: %s", exc)
            raise ConfigError(str(exc)) from None
        if role == KVConnectorRole.SCHEDULER:
            sizes = sorted({int(g.kv_cache_spec.block_size) for g in kv_cache_config.kv_cache_groups})
            log.info("kvtier: chunk_tokens %d (%s; KV cache group block sizes %s tokens)",
                     self.kvtier_config.chunk_tokens,
                     "auto: the smallest multiple of every block size that is at least 128" if asked.chunk_tokens == "auto"
                     else "as configured", ", ".join(map(str, sizes)))
        if transfer.kv_load_failure_policy != "recompute":
            log.warning("kvtier: kv_load_failure_policy is %r; set it to \"recompute\" so that a failed "
                        "kvtier load is recomputed instead of failing the request", transfer.kv_load_failure_policy)

    # vLLM's per-step verbs that only forward, unchanged, to the role's side are that side's own
    # bound methods on this instance: vLLM calls the side directly, with no forwarding call per
    # step (issue 33).  The methods of the same names below stay the contract (vLLM's abstract
    # methods, their docstrings) and the answer of a connector of the other role.
    def _bind_scheduler_verbs(self, side: SchedulerSide) -> None:
        self.on_new_request = side.on_new_request  # type: ignore[method-assign]
        self.get_num_new_matched_tokens = side.get_num_new_matched_tokens  # type: ignore[method-assign]
        self.update_state_after_alloc = side.update_state_after_alloc  # type: ignore[method-assign]
        self.build_connector_meta = side.build_connector_meta  # type: ignore[method-assign]
        self.update_connector_output = side.update_connector_output  # type: ignore[method-assign]
        self.take_events = side.take_events  # type: ignore[method-assign]
        self.get_kv_connector_stats = side.stats  # type: ignore[method-assign]

    def _bind_worker_verbs(self, side: WorkerSide) -> None:
        self.get_block_ids_with_load_errors = side.take_errors  # type: ignore[method-assign]
        self.build_connector_worker_meta = side.worker_meta  # type: ignore[method-assign]
        self.get_kv_connector_stats = side.stats  # type: ignore[method-assign]

    @property
    def requires_kv_delivery(self) -> bool:
        return False

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """False: vLLM 0.33+ refuses ``--enable-sleep-mode`` with KVTierConnector at start-up
        (vllm/config/vllm.py); kvtier's worker threads copy into the KV cache that sleep unmaps, and
        sleep was never tested with kvtier.  vLLM 0.32 does not ask."""
        return False

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker_side is not None
        self.worker_side.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker_side.start_load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """``layerwise_loads``: this layer's copies only (:mod:`kvtier.integrations.vllm.worker.layerwise`);
        otherwise synchronous loads are whole when start_load_kv returns; asynchronous ones park the request."""
        if self.worker_side is not None and self.worker_side.layer_loads is not None:
            self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # saves copy whole chunks of all layers at once, in wait_for_save

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before this step's forward: wait for deferred saves of the requests vLLM preempted (their
        blocks are free again; vllm/v1/worker/gpu_model_runner.py calls this before the forward)."""
        if self.worker_side is not None and isinstance(kv_connector_metadata, KVTierMetadata) \
                and kv_connector_metadata.preempted:  # (most steps preempt nothing: no call)
            self.worker_side.handle_preemptions(kv_connector_metadata)

    def wait_for_save(self) -> None:
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVTierMetadata)
        self.worker_side.save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is None:
            return None, None
        sending, recving = self.worker_side.finished(finished_req_ids)
        return (sending or None), (recving or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished saves and loads, and (hybrid models) loads that failed whole: with several KV cache
        groups vLLM takes request-level failures only (``failed_recving``), never block ids."""
        if self.worker_side is None:
            return super().get_transfer_results(finished_req_ids)
        sending, recving, failed = self.worker_side.transfers(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_errors() if self.worker_side is not None else set()

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        return self.worker_side.worker_meta() if self.worker_side is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        # vLLM asks both sides: the workers' stats ride the model runner output, the scheduler's are
        # added in Scheduler.update_from_output (vllm/v1/core/sched/scheduler.py)
        if self.worker_side is not None:
            return self.worker_side.stats()
        return self.scheduler_side.stats() if self.scheduler_side is not None else None

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()

    # ---- scheduler side ----------------------------------------------------------------------
    def bind_kv_cache_manager(self, kv_cache_manager: KVCacheManager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler_side is not None:
            self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_connector_output(connector_output)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int):
        assert self.scheduler_side is not None
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0 or self.scheduler_side is None:
            return {}
        split = self.scheduler_side.hit_sources(request, num_external_tokens)
        out: dict[CacheHitSource, int] = {}
        if self._sources[0] != registry.generation:  # each tier's source is its registry record's
            self._sources = _hit_sources()
        sources = self._sources[1]
        for tier, n in split.items():
            if n:
                source = sources.get(tier) or CacheHitSource(hit_source(tier))  # an unknown tier: vLLM's fallback
                out[source] = out.get(source, 0) + n
        return out

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's KV events from kvtier's local tiers (``BlockStored`` / ``BlockRemoved`` with medium
        ``CPU`` or ``STORAGE``), when ``--kv-events-config`` enables them: vLLM publishes them after
        its own each step (vllm/v1/core/sched/scheduler.py ``update_from_output``);
        :mod:`kvtier.integrations.vllm.scheduler.events`, docs/vllm.md "KV events"."""
        return self.scheduler_side.take_events() if self.scheduler_side is not None else []

    def has_pending_push_work(self) -> bool:
        """Keep an idle engine stepping until the workers' gauges are true (pins released, the
        first report in), at most ``SETTLE_S`` seconds: :mod:`kvtier.integrations.vllm.scheduler.steps`."""
        return self.scheduler_side is not None and self.scheduler_side.settle.pending()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``True`` (vLLM holds the blocks until ``finished_sending``) when a deferred save of the
        request may still read them (:meth:`SchedulerSide.request_finished
        <kvtier.integrations.vllm.scheduler.side.SchedulerSide.request_finished>`).  Returns the
        request's receipt as ``kv_transfer_params["kvtier"]`` (issue 35, docs/receipts.md; completed
        in place later in the same ``update_from_output``: :class:`~kvtier.integrations.vllm.scheduler.requests.ReceiptDesk`)."""
        if self.scheduler_side is None:
            return False, None
        held, receipt = self.scheduler_side.request_finished(request)
        return held, {"kvtier": receipt}

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...],
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """``SupportsHMA``: vLLM calls this instead of :meth:`request_finished` (every group's
        blocks; held as :meth:`request_finished` says)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    def reset_cache(self) -> bool:
        """vLLM's external prefix-cache reset (``POST /reset_prefix_cache?reset_external=true``), on
        the scheduler side: clears the tiers ``reset_scope`` names for this engine's namespaces;
        ``True`` when done, ``False`` (logged) when a tier could not be cleared
        (:meth:`~kvtier.integrations.vllm.scheduler.side.SchedulerSide.reset_cache`, docs/vllm.md
        "Resetting the cache").  vLLM counts the base class's ``None`` as success: never ``None``."""
        if self.scheduler_side is None:
            log.warning("kvtier: reset_cache reached a worker-side connector; only the scheduler side resets")
            return False
        return self.scheduler_side.reset_cache()

    # ---- metrics -----------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierStats(data=dict(data)) if data is not None else KVTierStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
