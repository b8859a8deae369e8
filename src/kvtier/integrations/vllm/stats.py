"""kvtier numbers in vLLM's own ``/metrics``, through vLLM's connector metrics hooks: what each
exported metric means.  The code is where it runs; this module names it (its names are
importable from here, cold: nothing here runs on a request's steps).

Path of a number: the worker-side connector fills a :class:`KVTierStats` each step
(``get_kv_connector_stats``, :func:`~kvtier.integrations.vllm.connector.worker_stats`) with
:func:`store_report`, the change of its store's snapshot in one pass; vLLM sums the ranks' stats
with :meth:`KVTierStats.aggregate`, ships them to the front-end process, and calls
:meth:`KVTierPromMetrics.observe`, whose collectors were created with vLLM's metric classes
(:class:`~kvtier.integrations.vllm.connector_base.KVTierPromSetup`) and so land in the same registry
as ``vllm:prefix_cache_*`` and ``vllm:external_prefix_cache_*``.  All three run every step, so they
are :mod:`kvtier.integrations.vllm.connector`'s, with what vLLM calls each step.  The table of names
(payload → metric, and how each is read from the store), read when the collectors are created:
:mod:`kvtier.integrations.vllm.stats_table`.

Exported (Prometheus adds ``_total`` to counters; ``tier`` is a registered tier's name, and
the per-tier series follow the registry, :mod:`kvtier.core.tiers.registry`; with the built-in
tiers: cpu, disk, redis):

- ``kvtier_loaded_tokens_total{tier}``: tokens copied from kvtier into the engine, labelled with
  the tier the scheduler's plan named for their chunk: the source vLLM was told at admission
  (``get_external_cache_hit_sources``).  A model whose every layer has a sliding window needs no
  KV for a hit's tokens before its last window: they count as loaded with the tier of the chunk
  after them, whose pages the load copies (``kvtier_transfer_bytes_total{load}`` says what moved).  ``kvtier_unfilled_tokens_total{tier}``: tokens vLLM
  admitted as kvtier hits that no load filled (request aborted before its load began, a chunk
  gone or corrupt, ``load_wait_s`` passed), by planned tier.  Per tier, loaded + unfilled equals
  ``vllm:prompt_tokens_cached_by_source_total`` of the tier's hit source, and over all tiers
  ``vllm:external_prefix_cache_hits_total``, exactly (neither counts re-admissions after
  preemption).  ``kvtier_rerouted_chunks_total``: chunks a load read from another tier than
  planned (evicted or promoted in between); the store's own ``kvtier_load_hit_chunks{tier}``
  (``kvtier.core.metrics``) counts chunks by the tier they were actually read from.
- ``kvtier_reloaded_tokens_total``: tokens loaded into requests resumed after a preemption
  (vLLM reports those as preempted hits, apart from its external hits).
- ``kvtier_saved_tokens_total``: tokens newly written into kvtier.
- ``kvtier_load_failed_blocks_total``: blocks reported to vLLM as failed loads (recomputed).
- ``kvtier_transfer_seconds_total{direction}`` and ``kvtier_transfer_bytes_total{direction}``,
  ``direction`` = ``load`` (kvtier → engine) or ``save`` (engine → kvtier).
- ``kvtier_evictions_total{tier}``, ``kvtier_dropped_saves_total``, ``kvtier_corrupt_chunks_total``.
- ``kvtier_disk_write_errors_total``: chunk writes to the disk tier that failed (a full or
  read-only directory, an I/O error); those chunks were not stored.
- ``kvtier_usage_bytes{tier}``, ``kvtier_capacity_bytes{tier}``: summed over ranks.
- ``kvtier_pinned_chunks{tier}``, ``kvtier_pinned_bytes{tier}``: chunks held by loads or disk
  writes in flight (zero when idle: a leaked pin shows); ``kvtier_dirty_bytes``: bytes in DRAM not
  yet on the disk tier (the restart-loss window when the stop is not graceful).
- ``kvtier_ttl_pinned_chunks{tier}``, ``kvtier_ttl_pinned_bytes{tier}``: chunks requests pinned
  with a TTL (``kv_transfer_params`` ``kvtier_pin_s``) that has not passed, cpu tier;
  ``kvtier_ttl_pin_chunks_total`` (pins made or renewed) and ``kvtier_ttl_pin_refused_chunks_total``
  (refused: ``pin_max_share`` reached).
- Tenant quotas (``tenant_quotas``, :mod:`kvtier.core.quota`): ``kvtier_tenant_usage_bytes{tier,
  tenant}`` (bytes per tenant, labelled by a 12-hex-digit digest of its ``cache_salt``, ``no-salt``,
  at most ``top_tenants`` of them, then ``other`` and ``unknown``: bounded, never a salt in clear;
  summed over ranks), ``kvtier_quota_evictions_total{tier}`` (evictions whose victim the quotas
  chose); the scheduler's ``kvtier_tenant_quota_default_share``, ``kvtier_tenant_quota_salts``
  and ``kvtier_tenant_quota_no_salt_share`` (0, 0 and 0 without quotas) and ``kvtier_kv_events_enabled`` (1 with ``--kv-events-config``), sent
  once, for ``kvtier doctor``.
- Receipts (issue 35; the scheduler side, from each finished request's receipt,
  :class:`~kvtier.integrations.vllm.scheduler.requests.ReceiptDesk`): ``kvtier_served_tokens_total{tier}``,
  prompt tokens served by source, ``tier`` = ``engine`` (vLLM's own prefix cache) or a kvtier
  tier; ``kvtier_missed_tokens_total{reason,tier}``, prompt tokens computed, by the receipt's miss
  reason and the tier it names (``none``: no tier).  Over a run, served + missed = the finished
  requests' prompt tokens, and each equals the sum over their receipts exactly.
- ``kvtier_ghost_hit_distance_bytes{tier}`` (histogram, workers' side): per ghost hit, the bytes the
  tier evicted between evicting the chunk and its being wanted again (:mod:`kvtier.core.ghosts`).
- ``kvtier_receipts_dropped_total{sink}``: receipts the scheduler's receipt log (``log``) or trace
  spans (``otlp``) dropped: queue full, emitted after close, a failed write
  (:func:`kvtier.core.receiptsinks.receipt_counters`).
- ``kvtier_chunk_tokens``: tokens per chunk the engine runs with (``chunk_tokens``, ``auto``
  resolved from the KV cache groups' block sizes; rank 0 reports it, so the sum is the value).
- ``kvtier_flush_missed_chunks_total``: dirty chunks a graceful stop could not write in time.
- Resets (vLLM's ``/reset_prefix_cache?reset_external=true``): ``kvtier_resets_total`` (asked of
  the scheduler side), ``kvtier_reset_failures_total`` (answered ``False``: a tier not cleared
  whole), ``kvtier_reset_chunks_total{tier}`` (chunks the workers' stores removed, all ranks).
- KV events (scheduler side, with ``--kv-events-config``; :mod:`kvtier.integrations.vllm.scheduler.events`):
  ``kvtier_kv_events_stored_total``, ``kvtier_kv_events_removed_total`` (chunks announced held /
  gone), ``kvtier_kv_events_dropped_total`` (removals dropped past the backlog),
  ``kvtier_kv_events_seconds_total`` (scheduler time spent on them: their cost).
- Shared tier (workers' side, from each store's snapshot ``TierStats.wire``; summed over ranks):
  ``kvtier_redis_errors_total`` (calls that failed), ``kvtier_redis_skipped_calls_total`` (not
  made: breaker open or queue full), ``kvtier_redis_skipped_writes_total`` (chunks not written),
  ``kvtier_redis_breaker_state`` (0 closed; 1 half-open, 2 open, per rank);
  ``kvtier_redis_reads_total``, ``kvtier_redis_read_seconds_total``, ``kvtier_redis_read_bytes_total``
  (read batches that returned, their seconds and payload bytes: the mean read latency).  Every
  shared tier has these under its own name (``kvtier_s3_*``).
- Shared tier (scheduler side, :meth:`RemoteLookups.counters
  <kvtier.integrations.vllm.scheduler.remote.RemoteLookups.counters>`): ``kvtier_shared_lookups_total``
  (sent), ``kvtier_shared_lookups_answered_total``, ``kvtier_shared_lookups_timed_out_total``,
  ``kvtier_shared_lookups_superseded_total`` (replaced by a newer lookup, or dropped with the
  request, before the answer was read: sent = answered + superseded + pending),
  ``kvtier_shared_lookups_skipped_total``, ``kvtier_shared_lookup_chunks_total`` and
  ``kvtier_shared_lookup_hit_chunks_total`` (their ratio is the shared tier's hit rate),
  ``kvtier_shared_lookups_pending`` (sent, answer not read yet).

Token counts are reported by tensor-parallel rank 0 only (every rank moves the same tokens);
bytes, seconds, evictions, dropped saves, corrupt chunks, write errors and usage are summed over ranks.
"""

from __future__ import annotations

from kvtier.integrations.vllm.connector import (
    KVTierPromMetrics,
    KVTierStats,
    ghost_observations,
    store_counters,
    store_gauges,
    store_report,
    store_values,
)
from kvtier.integrations.vllm.stats_table import (
    LABELS,
    TENANT_GAUGE,
    TENANT_PREFIX,
    counters,
    gauges,
    rank0_only,
    store_counter_readers,
)

__all__ = ["LABELS", "TENANT_GAUGE", "TENANT_PREFIX", "KVTierPromMetrics", "KVTierStats", "counters", "gauges",
           "ghost_observations", "rank0_only", "store_counter_readers", "store_counters", "store_gauges",
           "store_report", "store_values"]
