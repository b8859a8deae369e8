"""``KVTierConnectorBase``: what :class:`~kvtier.integrations.vllm.connector.KVTierConnector`, kvtier behind
vLLM's v1 KV connector interface, does outside a request's steps: start-up (the config, the role's
side, the verbs bound on the instance), the contract's verbs that vLLM reaches on the side itself,
shutdown, resets; and :class:`KVTierPromSetup`, the ``kvtier_*`` collectors' creation.  Cold: what
every step runs is :mod:`kvtier.integrations.vllm.connector`'s.

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
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.ghosts import DISTANCE_BUCKETS_BYTES
from kvtier.core.tiers import registry
from kvtier.integrations.vllm.compat import require_supported
from kvtier.integrations.vllm.engine_config import engine_config
from kvtier.integrations.vllm.protocol import KVTierWorkerMeta
from kvtier.integrations.vllm.scheduler.side import SchedulerSide
from kvtier.integrations.vllm.stats_table import GHOST_DISTANCE, LABELS, TENANT_GAUGE, counters, gauges
from kvtier.integrations.vllm.worker.side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def hit_sources() -> tuple[int, dict[str, CacheHitSource]]:
    """(registry generation, each registered tier's vLLM hit source), derived once per registration."""
    return registry.generation, {s.name: CacheHitSource(s.hit_source) for s in registry.specs()}


def prefix_reuse_off(vllm_config: VllmConfig) -> bool:
    """Whether this engine runs with prefix caching off; if so, say (WARNING, once per engine) that
    kvtier loads nothing into it.  A hit kvtier loads is a cached prefix: the engine then computes
    only the rest of the prompt over it.  vLLM turns prefix caching off where that is unsupported or
    wrong: MLA on the CPU backend without AMX (vllm/platforms/cpu.py: its CPU MLA path gives other
    tokens over a cached prefix), non-causal attention layers (vllm/v1/engine/core.py), RISC-V CPUs
    (vllm/engine/arg_utils.py), batch invariance on some backends, models whose KV is not a function
    of the prefix alone (vllm/model_executor/models/config.py).  An operator's
    ``--no-enable-prefix-caching`` is taken the same way: vLLM's own offload has nothing to hit then
    either (``kvtier audit``'s rule prefix-caching-off-with-offload).  Saves go on (the KV is right;
    another engine of the fleet may load it)."""
    if vllm_config.cache_config.enable_prefix_caching:
        return False
    model = vllm_config.model_config
    why = ("vLLM turned it off for this model (MLA on the CPU backend)"
           if model is not None and getattr(model, "use_mla", False) else
           "--no-enable-prefix-caching, or vLLM turned it off for this model (see vLLM's log above)")
    log.warning("kvtier: this engine runs with prefix caching off (%s), so it cannot compute over a prefix "
                "kvtier would load: kvtier loads nothing into it and only saves; turn prefix caching on "
                "(--enable-prefix-caching) where the model and backend support it", why)
    return True


def use_vllm_logging() -> None:
    """Route kvtier's log records through vLLM's handlers, so they carry vLLM's prefix and INFO
    lines (layout, namespace) are shown; without this only WARNING reaches stderr, unformatted.
    Idempotent (the first connector made in a process does it)."""
    kvtier_log = logging.getLogger("kvtier")
    vllm_log = logging.getLogger("vllm")
    if vllm_log.handlers and not kvtier_log.handlers:
        for handler in vllm_log.handlers:
            kvtier_log.addHandler(handler)
        kvtier_log.setLevel(logging.INFO)
        kvtier_log.propagate = False


class KVTierConnectorBase(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector backed by a kvtier :class:`~kvtier.core.store.TieredStore` per rank: the
    set-up and the verbs off a request's steps (the class vLLM loads is its subclass
    :class:`~kvtier.integrations.vllm.connector.KVTierConnector`).

    Raises (at construction, i.e. engine start-up):
        ConfigError: a bad ``kv_connector_extra_config`` value, an explicit ``chunk_tokens`` not a
            multiple of every KV cache group's block size (``auto``, the default, is resolved from
            them: :func:`~kvtier.integrations.vllm.engine_config.engine_config`), or a model/parallelism
            kvtier does not handle, or a vLLM outside
            :data:`~kvtier.integrations.vllm.compat.SUPPORTED_VLLM`.
    """

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        use_vllm_logging()
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = self._kv_transfer_config
        load = transfer.kv_role in ("kv_both", "kv_consumer") and not (
            role == KVConnectorRole.SCHEDULER and prefix_reuse_off(vllm_config))
        save = transfer.kv_role in ("kv_both", "kv_producer")
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        self._sources = hit_sources()  # (registry generation, tier -> vLLM hit source)
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
            max_len, chunk = getattr(vllm_config.model_config, "max_model_len", None), int(self.kvtier_config.chunk_tokens)
            if isinstance(max_len, int) and chunk >= max_len:  # (chunk_tokens is resolved: engine_config)
                log.warning("kvtier: chunk_tokens %d is not below max_model_len %d: no prompt holds a whole chunk "
                            "before its last token, so kvtier stores and loads nothing; lower chunk_tokens (auto: "
                            "the smallest multiple of every block size that is at least 128) or raise max_model_len",
                            chunk, max_len)
        if transfer.kv_load_failure_policy != "recompute" and role == KVConnectorRole.SCHEDULER:  # once per engine
            log.warning("kvtier: kv_load_failure_policy is %r; set it to \"recompute\" so that a failed "
                        "kvtier load is recomputed instead of failing the request", transfer.kv_load_failure_policy)

    # vLLM's per-step verbs that only forward, unchanged, to the role's side are that side's own
    # bound methods on this instance: vLLM calls the side directly, with no forwarding call per
    # step (issue 33).  The methods of the same names below stay the contract (vLLM's abstract
    # methods, their docstrings) and the answer of a connector of the other role.  The stats are
    # the connector's own (``get_kv_connector_stats``): the sides report plain numbers, vLLM-free.
    def _bind_scheduler_verbs(self, side: SchedulerSide) -> None:
        self.on_new_request = side.on_new_request  # type: ignore[method-assign]
        self.get_num_new_matched_tokens = side.get_num_new_matched_tokens  # type: ignore[method-assign]
        self.update_state_after_alloc = side.update_state_after_alloc  # type: ignore[method-assign]
        self.build_connector_meta = side.build_connector_meta  # type: ignore[method-assign]
        self.update_connector_output = side.update_connector_output  # type: ignore[method-assign]
        self.take_events = side.take_events  # type: ignore[method-assign]

    def _bind_worker_verbs(self, side: WorkerSide) -> None:
        self.get_block_ids_with_load_errors = side.take_errors  # type: ignore[method-assign]
        self.build_connector_worker_meta = side.worker_meta  # type: ignore[method-assign]

    # ---- worker side -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build this rank's tiers over vLLM's caches (:meth:`WorkerSide.register_kv_caches`).

        Raises:
            ConfigError: a tier refuses to start (a disk directory that is not writable, ``disk_gib``
                that fits only by counting another namespace's files, a reset it cannot apply), said
                as the constructor says its refusals: one ``kvtier configuration error`` line in the log.
        """
        assert self.worker_side is not None
        try:
            self.worker_side.register_kv_caches(kv_caches)
        except ConfigError as exc:  # a tier's refusal: the line an operator finds above vLLM's traceback
            log.error("kvtier configuration error: %s", exc)
            raise ConfigError(str(exc)) from None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is None:
            return None, None
        sending, recving = self.worker_side.finished(finished_req_ids)
        return (sending or None), (recving or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_errors() if self.worker_side is not None else set()

    def build_connector_worker_meta(self) -> KVTierWorkerMeta | None:
        return self.worker_side.worker_meta() if self.worker_side is not None else None

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


class KVTierPromSetup(KVConnectorPromMetrics):
    """Registers the ``kvtier_*`` collectors with vLLM's metric classes, once, at start-up (what
    feeds them each step is its subclass :class:`~kvtier.integrations.vllm.connector.KVTierPromMetrics`;
    the table of names: :mod:`kvtier.integrations.vllm.stats_table`)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        extra_config = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        registry.import_tier_modules(tuple(extra_config.get("tier_modules", ())))  # this process's registry
        self._counter_table = counters()
        self._gauge_table = gauges()
        self._counters: dict[str, Any] = {}
        for prom_name, help_text, _ in self._counter_table.values():
            if prom_name not in self._counters:
                names = LABELS.get(prom_name, ())
                extra = [names] if isinstance(names, str) else list(names)
                self._counters[prom_name] = self._counter_cls(name=prom_name, documentation=help_text,
                                                              labelnames=labelnames + extra)
        self._gauges: dict[str, Any] = {}
        for prom_name, help_text, tier in self._gauge_table.values():
            if prom_name not in self._gauges:
                self._gauges[prom_name] = self._gauge_cls(name=prom_name, documentation=help_text,
                                                          labelnames=labelnames + (["tier"] if tier else []),
                                                          multiprocess_mode="mostrecent")  # type: ignore[call-arg]
        self._tenants: Any = self._gauge_cls(name=TENANT_GAUGE, documentation=(  # type: ignore[call-arg]
            "Bytes held per tenant (12-hex-digit cache_salt digest; the top_tenants largest, then other and "
            "unknown), by tier (all ranks); with tenant_quotas."), labelnames=labelnames + ["tier", "tenant"],
            multiprocess_mode="mostrecent")
        self._tenant_children: dict[int, set[tuple[str, str]]] = {}
        self._created: set[int] = set()  # engines whose counter children exist
        self._ghost_distance: Any = self._histogram_cls(
            name=GHOST_DISTANCE, documentation=("Bytes a kvtier tier evicted between evicting a chunk and that chunk "
                                                "being wanted again (ghost hits), by tier (all ranks)."),
            labelnames=labelnames + ["tier"], buckets=list(DISTANCE_BUCKETS_BYTES))
        # Create every labelled child up front so a scrape shows zeros, not absence.
        for engine_idx in per_engine_labelvalues:
            self.observe({"counters": {}, "gauges": {}}, engine_idx)
