"""``KVTierConnector``: kvtier behind vLLM's v1 KV connector interface, what vLLM calls each step
(enable it, the contract and what it declares to vLLM: :mod:`kvtier.integrations.vllm.connector_base`,
with the set-up and the verbs vLLM reaches on the role's side itself); and the metrics it sends
each step: :class:`KVTierStats` (the payload), :class:`KVTierPromMetrics` (what feeds the
``kvtier_*`` collectors in vLLM's ``/metrics``), :func:`store_report` (a worker's per-step report
of its store's snapshot, vLLM-free).  The metrics' names and meaning: :mod:`kvtier.integrations.vllm.stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.core.codecstats import CodecNumbers
from kvtier.core.stats import StoreStats, TierStats, WireStats
from kvtier.core.tiers import registry
from kvtier.core.tiers.registry import hit_source
from kvtier.integrations.vllm.connector_base import KVTierConnectorBase, KVTierPromSetup, hit_sources
from kvtier.integrations.vllm.protocol import KVTierMetadata
from kvtier.integrations.vllm.stats_table import GHOST_PREFIX, TENANT_PREFIX, rank0_only

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.request import Request

    from kvtier.integrations.vllm.worker.side import WorkerSide


class KVTierConnector(KVTierConnectorBase):
    """vLLM v1 KV connector backed by a kvtier :class:`~kvtier.core.store.TieredStore` per rank
    (construction, its errors and the verbs off a request's steps: :class:`KVTierConnectorBase
    <kvtier.integrations.vllm.connector_base.KVTierConnectorBase>`)."""

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished saves and loads, and (hybrid models) loads that failed whole: with several KV cache
        groups vLLM takes request-level failures only (``failed_recving``), never block ids."""
        if self.worker_side is None:
            return super().get_transfer_results(finished_req_ids)
        sending, recving, failed = self.worker_side.transfers(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This step's :class:`KVTierStats`: a worker's :func:`worker_stats`, or the scheduler's counters
        (:meth:`SchedulerSide.stats <kvtier.integrations.vllm.scheduler.side.SchedulerSide.stats>`; ``None``
        when nothing changed).  vLLM asks both sides every step: the workers' stats ride the model
        runner output, the scheduler's are added in Scheduler.update_from_output
        (vllm/v1/core/sched/scheduler.py)."""
        if self.worker_side is not None:
            return worker_stats(self.worker_side)
        data = self.scheduler_side.stats() if self.scheduler_side is not None else None
        return KVTierStats(data=data) if data is not None else None

    # ---- scheduler side ----------------------------------------------------------------------
    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        if num_external_tokens == 0 or self.scheduler_side is None:
            return {}
        split = self.scheduler_side.hit_sources(request, num_external_tokens)
        out: dict[CacheHitSource, int] = {}
        if self._sources[0] != registry.generation:  # each tier's source is its registry record's
            self._sources = hit_sources()
        sources = self._sources[1]
        for tier, n in split.items():
            if n:
                source = sources.get(tier) or CacheHitSource(hit_source(tier))  # an unknown tier: vLLM's fallback
                out[source] = out.get(source, 0) + n
        return out

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

    # ---- metrics -----------------------------------------------------------------------------
    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVTierStats(data=dict(data)) if data is not None else KVTierStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]],
                           ) -> KVConnectorPromMetrics | None:
        return KVTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


@dataclass
class KVTierStats(KVConnectorStats):
    """One interval's kvtier numbers: ``data = {"counters": {...}, "gauges": {...}}``.

    Counters are increments over the interval; gauges are the latest values of one rank, so
    :meth:`aggregate` (which vLLM uses across ranks) sums both.
    """

    data: dict[str, Any] = field(default_factory=lambda: {"counters": {}, "gauges": {}})

    def __post_init__(self) -> None:
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def aggregate(self, other: KVConnectorStats) -> KVTierStats:
        for part in ("counters", "gauges"):
            mine = self.data[part]
            for name, value in other.data.get(part, {}).items():
                mine[name] = mine.get(name, 0) + value
        if observed := other.data.get("observations"):  # histograms' observations: every rank's
            mine_obs = self.data.setdefault("observations", {})
            for name, values in observed.items():
                mine_obs[name] = [*mine_obs.get(name, []), *values]
        return self

    def reduce(self) -> dict[str, int | float]:
        return {name: round(v, 4) if isinstance(v, float) else v for name, v in self.data["counters"].items() if v}

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["gauges"] and not self.data.get("observations")


class KVTierPromMetrics(KVTierPromSetup):
    """Feeds the ``kvtier_*`` collectors (registered with vLLM's metric classes at start-up by
    :class:`~kvtier.integrations.vllm.connector_base.KVTierPromSetup`) from each step's payload."""

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        base = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        counters = transfer_stats_data.get("counters", {})
        if engine_idx not in self._created:  # every child once, up front: a scrape shows zeros
            self._created.add(engine_idx)
            for prom_name, _help, label in self._counter_table.values():
                self._counters[prom_name].labels(*base, *label)
        for key, value in counters.items():
            entry = self._counter_table.get(key)
            if entry is not None and value:
                self._counters[entry[0]].labels(*base, *entry[2]).inc(value)
        gauges = transfer_stats_data.get("gauges", {})
        for key, value in gauges.items():
            if key in self._gauge_table:
                prom_name, _help, tier = self._gauge_table[key]
                self._gauges[prom_name].labels(*base, *([tier] if tier else [])).set(value)
        if "dirty_bytes" in gauges:  # the workers' report (every step): its tenants replace the last ones
            self._observe_tenants(gauges, base, engine_idx)
        for name, values in transfer_stats_data.get("observations", {}).items():
            if name.startswith(GHOST_PREFIX):
                child = self._ghost_distance.labels(*base, name.removeprefix(GHOST_PREFIX))
                for value in values:
                    child.observe(value)

    def _observe_tenants(self, gauges: dict[str, Any], base: list[str], engine_idx: int) -> None:
        now: dict[tuple[str, str], float] = {}
        for key, value in gauges.items():
            if key.startswith(TENANT_PREFIX):
                tier, _, label = key.removeprefix(TENANT_PREFIX).partition("|")
                now[(tier, label)] = value
        for labels in self._tenant_children.get(engine_idx, set()) - set(now):  # left the top: bounded
            try:
                self._tenants.remove(*base, *labels)
            except (KeyError, AttributeError):  # a metric class without remove: zero it instead
                self._tenants.labels(*base, *labels).set(0)
        for labels, value in now.items():
            self._tenants.labels(*base, *labels).set(value)
        self._tenant_children[engine_idx] = set(now)


def ghost_observations(distances: list[tuple[str, int]]) -> dict[str, list[float]]:
    """A store's ghost-hit distances (:meth:`~kvtier.core.store.TieredStore.take_ghost_distances`)
    as the payload's ``observations`` (``ghost_hit_distance_bytes|<tier>`` -> list of bytes)."""
    out: dict[str, list[float]] = {}
    for tier, distance in distances:
        out.setdefault(GHOST_PREFIX + tier, []).append(float(distance))
    return out


def worker_stats(side: WorkerSide) -> KVTierStats | None:
    """A worker's stats for one step (``None`` before its caches are registered): the change of its
    store's snapshot since the last step and its usage (:func:`store_report`), the deferred saves'
    counters' change, ``chunk_tokens`` (rank 0), the ghost hits' distances, from
    :meth:`WorkerSide.stats <kvtier.integrations.vllm.worker.side.WorkerSide.stats>`.

    Sent every step, even unchanged: vLLM sums one step's reports over the tensor-parallel
    ranks, so a rank that skipped an unchanged report would drop out of the summed gauges."""
    numbers = side.stats()
    if numbers is None:
        return None
    snapshot, before, saver_counters, distances = numbers
    counters, gauges = store_report(snapshot, before, side.tp_rank)
    counters |= saver_counters
    if side.tp_rank == 0:  # vLLM sums the ranks' gauges: one rank reports the engine's chunk size
        gauges["chunk_tokens"] = side.chunk_tokens
    data: dict[str, Any] = {"counters": counters, "gauges": gauges}
    if distances:  # kvtier_ghost_hit_distance_bytes{tier}
        data["observations"] = ghost_observations(distances)
    return KVTierStats(data=data)


# ---- the workers' per-step report of their store's snapshot (vLLM-free; no table lookup) -------
_NO_TIER = TierStats()
_NO_WIRE = WireStats()
_NO_CODEC = CodecNumbers()

_per_step: tuple[int, frozenset[str], list[registry.TierSpec]] = (-1, frozenset(), [])
"""(registry generation, :func:`rank0_only`, the records) as last derived: the worker's per-step
stats ask the registry nothing while no tier was registered since."""


def _registered() -> tuple[int, frozenset[str], list[registry.TierSpec]]:
    global _per_step
    if _per_step[0] != (generation := registry.generation):
        _per_step = (generation, frozenset(rank0_only()), registry.specs())
    return _per_step


_last: tuple[StoreStats | None, dict[str, float]] = (None, {})
"""The last snapshot :func:`store_counters` read, and its values: the next step's ``before``."""


def store_values(s: StoreStats) -> dict[str, float]:
    """Every :func:`store_counter_readers` value of ``s``, read in one pass (what the worker's
    per-step report diffs; equal to calling each reader)."""
    specs, top = _registered()[2], ""
    out: dict[str, float] = {}
    loaded, unfilled, tiers = s.loaded_tokens, s.unfilled_tokens, s.tiers
    for spec in specs:
        t = spec.name
        top = top or (t if spec.top else "")  # registry.top_tier() (the first top tier), without a call
        stats = tiers.get(t) or _NO_TIER
        out[f"loaded_tokens_{t}"] = loaded.get(t, 0)
        out[f"unfilled_tokens_{t}"] = unfilled.get(t, 0)
        out[f"reset_chunks_{t}"] = stats.reset_chunks
        if not spec.shared:
            out[f"evictions_{t}"] = stats.evictions
            out[f"quota_evictions_{t}"] = stats.quota_evictions
        if not spec.top:
            codec = stats.codec or _NO_CODEC
            out[f"codec_bytes_before_{t}"] = codec.encoded_bytes
            out[f"codec_bytes_after_{t}"] = codec.stored_bytes
            out[f"codec_seconds_{t}"] = codec.encode_seconds + codec.decode_seconds
            out[f"decrypt_failures_{t}"] = codec.decrypt_failures
            if not spec.shared:
                out[f"{t}_write_errors"] = stats.write_errors
        if spec.shared:
            wire = stats.wire or _NO_WIRE
            out[f"{t}_errors"] = sum(wire.errors.values())
            out[f"{t}_skipped_calls"] = sum(wire.skipped_calls.values())
            out[f"{t}_skipped_writes"] = wire.skipped_writes
            out[f"{t}_reads"] = wire.calls.get("read", 0)
            out[f"{t}_read_seconds"] = wire.seconds.get("read", 0.0)
            out[f"{t}_read_bytes"] = wire.bytes.get("read", 0)
    out.update(reloaded_tokens=s.reloaded_tokens, saved_tokens=s.saved_tokens, load_failed_blocks=s.load_failed_blocks,
               rerouted_chunks=s.rerouted_chunks, ttl_pin_chunks=s.ttl_pin_chunks,
               ttl_pin_refused_chunks=s.ttl_pin_refused_chunks, dropped_saves=s.dropped_saves,
               corrupt_chunks=sum(t.corrupt_chunks for t in tiers.values()),
               flush_missed_chunks=s.flush_missed_chunks,
               load_bytes=s.transfer_bytes[f"{top}_to_engine"], load_seconds=s.transfer_seconds[f"{top}_to_engine"],
               save_bytes=s.transfer_bytes[f"engine_to_{top}"], save_seconds=s.transfer_seconds[f"engine_to_{top}"])
    return out


def store_counters(now: StoreStats, before: StoreStats | None, tp_rank: int = 0) -> dict[str, float]:
    """The :func:`store_counter_readers` that changed from ``before`` (``None``: the store's start)
    to ``now``, without the :func:`rank0_only` ones on other ranks than ``tp_rank`` 0.  Reads each
    snapshot once (:func:`store_values`; ``before``'s values are kept from the call that read it
    as ``now``), no call per counter: this runs at every engine step."""
    global _last
    rank0 = _registered()[1] if tp_rank else frozenset()
    last, last_values = _last
    old = {} if before is None else last_values if before is last else store_values(before)
    new = store_values(now)
    _last = (now, new)
    return {name: delta for name, value in new.items()
            if name not in rank0 and (delta := value - old.get(name, 0))}


def store_gauges(s: StoreStats) -> dict[str, float]:
    """The :func:`gauges` of one rank, read from its store's snapshot."""
    out: dict[str, float] = {"dirty_bytes": s.dirty_bytes}
    for spec in _registered()[2]:
        t = spec.name
        stats = s.tiers.get(t) or _NO_TIER
        if spec.shared:
            if stats.wire is not None:
                out[f"{t}_breaker_state"] = stats.wire.breaker_state
            out[f"usage_bytes_{t}"] = stats.used_bytes
            continue
        out.update({f"{TENANT_PREFIX}{t}|{label}": used for label, used in stats.tenant_used_bytes.items()})
        out.update({f"usage_bytes_{t}": stats.used_bytes, f"capacity_bytes_{t}": stats.capacity_bytes,
                    f"pinned_chunks_{t}": stats.pinned_chunks, f"pinned_bytes_{t}": stats.pinned_chunks * s.chunk_bytes})
        if spec.top:
            out.update({f"ttl_pinned_chunks_{t}": stats.ttl_pinned_chunks,
                        f"ttl_pinned_bytes_{t}": stats.ttl_pinned_chunks * s.chunk_bytes})
    return out


def store_report(now: StoreStats, before: StoreStats | None, tp_rank: int = 0) -> tuple[dict[str, float], dict[str, float]]:
    """One step's :func:`store_counters` and :func:`store_gauges` of ``now``, in one call (the worker's report)."""
    return store_counters(now, before, tp_rank), store_gauges(now)
