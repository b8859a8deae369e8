"""The stats payload's table: every counter and gauge the connector sends through vLLM, the
``kvtier_*`` metric it is exported as (name, help, labels), and how each is read from a store's
snapshot (:mod:`kvtier.core.stats`), derived once per tier registry generation.  Cold: read when
the metrics are set up, by ``kvtier doctor`` and the deploy files' alert rules (no vLLM import).
What runs each step on that payload, the worker's report of its store's snapshot
(:func:`~kvtier.integrations.vllm.connector.store_report`), is the connector's; the exported
metrics' meaning: :mod:`kvtier.integrations.vllm.stats`.
"""

from __future__ import annotations

from collections.abc import Callable

from kvtier.core.codecstats import CodecNumbers
from kvtier.core.receipt import MISS_REASONS, NO_TIER
from kvtier.core.stats import StoreStats, TierStats, WireStats
from kvtier.core.tiers import registry

_LOADED = "Tokens loaded from kvtier into the engine, by the tier the load's plan named (vLLM's hit source)."
_UNFILLED = ("Tokens vLLM admitted as kvtier hits that no load filled (aborted before the load, chunk gone or "
             "corrupt, load_wait_s passed), by planned tier.")
_EVICTED = "Chunks evicted from a kvtier tier."
_RESET = "Chunks removed from a kvtier tier by resets (all ranks)."
_QUOTA_EVICTED = "Evictions whose victim the tenant quotas chose instead of the eviction policy's own (all ranks)."
_RECEIPTS_DROPPED = ("Receipts a sink dropped, by sink (log: the receipt log, otlp: the trace spans): its queue full, "
                     "emitted after close, or a failed write.")
TENANT_GAUGE = "kvtier_tenant_usage_bytes"
TENANT_PREFIX = "tenant_usage_bytes|"
"""Payload gauges ``tenant_usage_bytes|<tier>|<tenant label>``: labels change with the traffic
(the ``top_tenants`` largest), so they are not in :func:`gauges`' fixed table."""

# tier-independent counters: name in the stats payload -> (prometheus name, help, label values)
_PLAIN_COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "reloaded_tokens": ("kvtier_reloaded_tokens", ("Tokens loaded from kvtier into requests resumed after "
                                                   "preemption (vLLM counts these apart from external hits)."), ()),
    "saved_tokens": ("kvtier_saved_tokens", "Tokens newly saved into kvtier.", ()),
    "load_failed_blocks": ("kvtier_load_failed_blocks", "Engine blocks whose kvtier load failed.", ()),
    "rerouted_chunks": ("kvtier_rerouted_chunks", ("Chunks a load read from another tier than the one its plan "
                        "named (evicted or promoted in between); their tokens keep the planned tier's label."), ()),
    "load_seconds": ("kvtier_transfer_seconds", "Seconds copying KV between engine and kvtier.", ("load",)),
    "save_seconds": ("kvtier_transfer_seconds", "Seconds copying KV between engine and kvtier.", ("save",)),
    "load_bytes": ("kvtier_transfer_bytes", "Bytes copied between engine and kvtier.", ("load",)),
    "save_bytes": ("kvtier_transfer_bytes", "Bytes copied between engine and kvtier.", ("save",)),
    "dropped_saves": ("kvtier_dropped_saves", ("Chunk saves given up by any tier: no room in the top tier, a write "
                      "queue full, or a write that failed (see *_skipped_writes, *_write_errors)."), ()),
    # deferred saves (async_saves; integrations/vllm/worker/saves.py SaveQueue)
    "deferred_save_waits": ("kvtier_deferred_save_waits", ("Deferred saves that found the save queue full: the "
                            "engine's thread waited for room (at most 2 s each; all ranks)."), ()),
    "deferred_save_wait_seconds": ("kvtier_deferred_save_wait_seconds", ("Seconds the engine's thread waited for "
                                   "room in a full save queue (all ranks)."), ()),
    "deferred_saves_dropped": ("kvtier_deferred_saves_dropped", ("Deferred saves dropped: the save queue stayed "
                               "full past the wait; their chunks were not saved (all ranks)."), ()),
    "deferred_saves_voided": ("kvtier_deferred_saves_voided", ("Deferred saves released unpublished: still copying "
                              "when their blocks were given back, so their pages may hold another request's KV "
                              "(all ranks)."), ()),
    "corrupt_chunks": ("kvtier_corrupt_chunks", "Chunks that failed verification and were recomputed.", ()),
    "flush_missed_chunks": ("kvtier_flush_missed_chunks", "Dirty chunks a graceful stop could not write to disk in time.",
                            ()),
    # requests' TTL pins (kv_transfer_params kvtier_pin_s; core/store.py ttl_pin)
    "ttl_pin_chunks": ("kvtier_ttl_pin_chunks", "Chunks requests pinned (or renewed) with a TTL (all ranks).", ()),
    "ttl_pin_refused_chunks": ("kvtier_ttl_pin_refused_chunks", ("TTL pins refused: pin_max_share of the cpu tier "
                               "was pinned already (all ranks)."), ()),
    # the scheduler's resets (integrations/vllm/scheduler/side.py reset_cache)
    "resets": ("kvtier_resets", "External prefix-cache resets vLLM asked of kvtier (reset_external=true).", ()),
    "reset_failures": ("kvtier_reset_failures", "Resets answered False: a tier could not be cleared whole.", ()),
    # the scheduler's KV events (integrations/vllm/scheduler/events.py)
    "kv_events_stored": ("kvtier_kv_events_stored", "Chunks announced held (vLLM BlockStored events kvtier published).",
                         ()),
    "kv_events_removed": ("kvtier_kv_events_removed", ("Chunks announced gone (one per chunk in vLLM BlockRemoved "
                          "events kvtier published)."), ()),
    "kv_events_seconds": ("kvtier_kv_events_seconds", ("Seconds the scheduler spent building kvtier's KV events "
                          "(learning chunks' block hashes, following the mirror, building the events)."), ()),
    "kv_events_dropped": ("kvtier_kv_events_dropped", ("Removals of chunks the event map forgot that did not fit the "
                          "backlog: a router may keep routing to them until they miss."), ()),
    # the scheduler's shared-tier lookups (integrations/vllm/scheduler/remote.py)
    "shared_lookups": ("kvtier_shared_lookups", "Shared-tier lookups the scheduler sent.", ()),
    "shared_lookups_answered": ("kvtier_shared_lookups_answered", "Shared-tier lookups answered (timed out included).",
                                ()),
    "shared_lookups_timed_out": ("kvtier_shared_lookups_timed_out", "Shared-tier lookups that passed shared_deadline_s.",
                                 ()),
    "shared_lookups_superseded": ("kvtier_shared_lookups_superseded", ("Shared-tier lookups replaced by a newer "
                                  "lookup for the same request (its local hit grew) or dropped with the request "
                                  "before their answer was read; sent = answered + superseded + pending."), ()),
    "shared_lookups_skipped": ("kvtier_shared_lookups_skipped", ("Shared-tier lookups not sent: shared_queue_depth "
                               "lookups in flight, or the tier not ready; each answered 0 chunks."), ()),
    "shared_lookup_chunks": ("kvtier_shared_lookup_chunks", "Chunks asked of the shared tier by answered lookups.", ()),
    "shared_lookup_hit_chunks": ("kvtier_shared_lookup_hit_chunks", ("Chunks found in the shared tier (every rank's "
                                 "value present) by answered lookups."), ()),
    "shared_lookup_sealed_away_chunks": ("kvtier_shared_lookup_sealed_away_chunks", (
        "Shared-tier values the scheduler's lookups answered absent because they are sealed under a master key "
        "this kvtier does not hold (another engine's, or rotated out): never offered, left on the server; each "
        "counted once (the last 16384 remembered per rank's tier)."), ()),
    # the scheduler's receipt sinks (kvtier.core.receiptsinks.receipt_counters)
    "receipts_dropped_log": ("kvtier_receipts_dropped", _RECEIPTS_DROPPED, ("log",)),
    "receipts_dropped_otlp": ("kvtier_receipts_dropped", _RECEIPTS_DROPPED, ("otlp",)),
}
LABELS: dict[str, str | tuple[str, ...]] = {
    "kvtier_loaded_tokens": "tier", "kvtier_unfilled_tokens": "tier", "kvtier_transfer_seconds": "direction",
    "kvtier_transfer_bytes": "direction", "kvtier_evictions": "tier", "kvtier_reset_chunks": "tier",
    "kvtier_quota_evictions": "tier", "kvtier_served_tokens": "tier",
    "kvtier_codec_bytes_before": "tier", "kvtier_codec_bytes_after": "tier", "kvtier_codec_seconds": "tier",
    "kvtier_decrypt_failures": "tier", "kvtier_missed_tokens": ("reason", "tier"),
    "kvtier_receipts_dropped": "sink"}
ENGINE = "engine"
"""The ``tier`` label of tokens vLLM's own prefix cache served (``kvtier_served_tokens``), as the receipt names them."""
_SERVED = ("Prompt tokens served from a cache, by source: engine (vLLM's own prefix cache) or the kvtier tier; "
           "sums equal the receipts' (over all sources: vLLM's cached tokens).")
_MISSED = ("Prompt tokens computed, by the reason their request's first chunk was not served (the receipt's miss; "
           "partial_chunk also when the whole prompt was served but its last token) and the tier it names.")
GHOST_DISTANCE = "kvtier_ghost_hit_distance_bytes"
GHOST_PREFIX = "ghost_hit_distance_bytes|"
"""Payload observations ``ghost_hit_distance_bytes|<tier>``: a list of distances, bytes (a histogram)."""
_CODEC = {  # a lower tier's codec chain (kvtier.core.codecstats): payload key -> (metric, help, reader)
    "codec_bytes_before": ("kvtier_codec_bytes_before", "Payload bytes into a lower tier's codec chain on write, by tier.",
                           lambda n: n.encoded_bytes),
    "codec_bytes_after": ("kvtier_codec_bytes_after", "Bytes a lower tier's codec chain stored on write, by tier.",
                          lambda n: n.stored_bytes),
    "codec_seconds": ("kvtier_codec_seconds", "Seconds in a lower tier's codec chain (encode and decode), by tier.",
                      lambda n: n.encode_seconds + n.decode_seconds),
    "decrypt_failures": ("kvtier_decrypt_failures", (
        "Encrypted values this engine's workers cannot open, by tier: each disk file sealed under a master key "
        "this kvtier does not hold, counted once when found (start-up scan with a key ring, rescan, or its first "
        "read) and never offered; each read of a value whose tag fails (another tenant's header, damaged: also "
        "corrupt) or that meets another key's value (a shared tier without a key ring); a miss, recomputed. Shared "
        "values the scheduler's lookups skip: kvtier_shared_lookup_sealed_away_chunks."),
                         lambda n: n.decrypt_failures),
}
_PLAIN_GAUGES: dict[str, tuple[str, str, str | None]] = {
    "chunk_tokens": ("kvtier_chunk_tokens", ("Tokens per kvtier chunk this engine runs with (chunk_tokens; auto "
                     "resolved from the KV cache groups' block sizes); reported by rank 0."), None),
    "dirty_bytes": ("kvtier_dirty_bytes", "Bytes in DRAM not yet on the disk tier: what a crash loses (all ranks).",
                    None),
    "shared_lookups_pending": ("kvtier_shared_lookups_pending", ("Shared-tier lookups sent whose answer the "
                               "scheduler has not read yet."), None),
    # what the scheduler runs with, sent once (kvtier doctor reads them)
    "kv_events_enabled": ("kvtier_kv_events_enabled", ("1 when kvtier publishes vLLM KV events "
                          "(--kv-events-config on, a role that loads), else 0."), None),
    "tenant_quota_default_share": ("kvtier_tenant_quota_default_share", ("tenant_quotas default_share (0: none "
                                   "set, without quotas or with salts-only quotas)."), None),
    "tenant_quota_salts": ("kvtier_tenant_quota_salts", "Salts given their own share in tenant_quotas.salts.", None),
    "tenant_quota_no_salt_share": ("kvtier_tenant_quota_no_salt_share", ("Share tenant_quotas guarantees requests "
                                   "without a cache_salt (no_salt_share, else default_share; 0: none)."), None),
}


_NO_TIER = TierStats()
_NO_WIRE = WireStats()


def _tier(s: StoreStats, tier: str) -> TierStats:
    """``s.tier(tier)`` (all zeros when the store has no such tier), read here: the readers below
    stay in this module."""
    return s.tiers.get(tier) or _NO_TIER


def _wire(s: StoreStats, tier: str) -> WireStats:
    """Shared tier ``tier``'s wire numbers (zeros when the store has none)."""
    return _tier(s, tier).wire or _NO_WIRE


def _counter_readers(name: str) -> dict[str, Callable[[StoreStats], float]]:
    return {f"loaded_tokens_{name}": lambda s: s.loaded_tokens.get(name, 0),
            f"unfilled_tokens_{name}": lambda s: s.unfilled_tokens.get(name, 0)}


def counters() -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Payload counter name -> (prometheus name, help, label values), for the registered tiers
    (:mod:`kvtier.core.tiers.registry`): ``loaded_tokens_<tier>`` for every tier,
    ``evictions_<tier>`` for local ones, ``<tier>_write_errors`` for local lower tiers,
    ``<tier>_errors`` / ``_skipped_calls`` / ``_skipped_writes`` for shared ones."""
    out: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for spec in registry.specs():
        t = spec.name
        out[f"loaded_tokens_{t}"] = ("kvtier_loaded_tokens", _LOADED, (t,))
        out[f"reset_chunks_{t}"] = ("kvtier_reset_chunks", _RESET, (t,))
        out[f"unfilled_tokens_{t}"] = ("kvtier_unfilled_tokens", _UNFILLED, (t,))
        if not spec.shared:
            out[f"evictions_{t}"] = ("kvtier_evictions", _EVICTED, (t,))
            out[f"quota_evictions_{t}"] = ("kvtier_quota_evictions", _QUOTA_EVICTED, (t,))
        if not spec.top:
            out.update({f"{key}_{t}": (metric, doc, (t,)) for key, (metric, doc, _read) in _CODEC.items()})
        if not spec.shared and not spec.top:
            out[f"{t}_write_errors"] = (f"kvtier_{t}_write_errors", (f"Chunk writes to the {t} tier that failed "
                                        "in its storage (full or read-only, I/O error); those chunks were not "
                                        "stored."), ())
        if spec.shared:
            out[f"{t}_errors"] = (f"kvtier_{t}_errors", (f"Shared-tier ({t}) calls that failed: timeout, "
                                  "connection, server error."), ())
            out[f"{t}_skipped_calls"] = (f"kvtier_{t}_skipped_calls", (f"Shared-tier ({t}) calls not made: "
                                         "breaker open or queue full."), ())
            out[f"{t}_skipped_writes"] = (f"kvtier_{t}_skipped_writes", (f"Chunks not written to the shared tier "
                                          f"({t}): breaker open, queue full or the write failed."), ())
            out[f"{t}_reads"] = (f"kvtier_{t}_reads", (f"Read batches (one load's parallel reads) the workers made "
                                 f"from the shared tier ({t}) that returned."), ())
            out[f"{t}_read_seconds"] = (f"kvtier_{t}_read_seconds", (f"Seconds the workers' read batches from the "
                                        f"shared tier ({t}) took: over kvtier_{t}_reads, the mean read latency."), ())
            out[f"{t}_read_bytes"] = (f"kvtier_{t}_read_bytes", f"Payload bytes read from the shared tier ({t}).", ())
    for t in (ENGINE, *(spec.name for spec in registry.specs())):  # the receipts' sums (scheduler side)
        out[f"served_tokens_{t}"] = ("kvtier_served_tokens", _SERVED, (t,))
    for reason in MISS_REASONS:
        for t in (NO_TIER, *(spec.name for spec in registry.specs())):
            out[f"missed_tokens_{reason}|{t}"] = ("kvtier_missed_tokens", _MISSED, (reason, t))
    return {**out, **_PLAIN_COUNTERS}


def gauges() -> dict[str, tuple[str, str, str | None]]:
    """Payload gauge name -> (prometheus name, help, ``tier`` label value or None), for the
    registered tiers: usage, capacity and pins of each local tier, the breaker and usage (what the engine
    wrote) of each shared one."""
    out: dict[str, tuple[str, str, str | None]] = {}
    for spec in registry.specs():
        t = spec.name
        if spec.shared:
            out[f"{t}_breaker_state"] = (f"kvtier_{t}_breaker_state", (f"Shared-tier ({t}) circuit breaker, summed "
                                         "over ranks: 0 closed everywhere; 1 half-open, 2 open per rank."), None)
            # a shared tier's usage is what this engine wrote (Tier.usage): summed over engines, each value once
            out[f"usage_bytes_{t}"] = ("kvtier_usage_bytes", "Bytes held by kvtier, by tier (all ranks).", t)
            continue
        out[f"usage_bytes_{t}"] = ("kvtier_usage_bytes", "Bytes held by kvtier, by tier (all ranks).", t)
        out[f"capacity_bytes_{t}"] = ("kvtier_capacity_bytes", "kvtier capacity in bytes, by tier (all ranks).", t)
        out[f"pinned_chunks_{t}"] = ("kvtier_pinned_chunks",
                                     "Chunks pinned by loads or disk writes in flight (all ranks).", t)
        out[f"pinned_bytes_{t}"] = ("kvtier_pinned_bytes", "Bytes of chunks pinned by loads or disk writes (all ranks).", t)
        if spec.top:
            out[f"ttl_pinned_chunks_{t}"] = ("kvtier_ttl_pinned_chunks",
                                             "Chunks pinned by requests with a TTL not yet passed (all ranks).", t)
            out[f"ttl_pinned_bytes_{t}"] = ("kvtier_ttl_pinned_bytes",
                                            "Bytes of chunks pinned by requests with a TTL (all ranks).", t)
    return {**out, **_PLAIN_GAUGES}


def store_counter_readers() -> dict[str, Callable[[StoreStats], float]]:
    """Every payload counter read from the store's snapshot (:mod:`kvtier.core.stats`), sent as
    the change between two snapshots."""
    top = registry.top_tier()
    out: dict[str, Callable[[StoreStats], float]] = {}
    for spec in registry.specs():
        t = spec.name
        out.update(_counter_readers(t))
        out[f"reset_chunks_{t}"] = lambda s, t=t: _tier(s, t).reset_chunks  # type: ignore[misc]
        if not spec.shared:
            out[f"evictions_{t}"] = lambda s, t=t: _tier(s, t).evictions  # type: ignore[misc]
            out[f"quota_evictions_{t}"] = lambda s, t=t: _tier(s, t).quota_evictions  # type: ignore[misc]
        if not spec.top:
            for key, (_metric, _doc, read) in _CODEC.items():
                out[f"{key}_{t}"] = lambda s, t=t, read=read: read(_tier(s, t).codec or CodecNumbers())  # type: ignore[misc]
        if not spec.shared and not spec.top:
            out[f"{t}_write_errors"] = lambda s, t=t: _tier(s, t).write_errors  # type: ignore[misc]
        if spec.shared:
            out[f"{t}_errors"] = lambda s, t=t: sum(_wire(s, t).errors.values())  # type: ignore[misc]
            out[f"{t}_skipped_calls"] = lambda s, t=t: sum(_wire(s, t).skipped_calls.values())  # type: ignore[misc]
            out[f"{t}_skipped_writes"] = lambda s, t=t: _wire(s, t).skipped_writes  # type: ignore[misc]
            out[f"{t}_reads"] = lambda s, t=t: _wire(s, t).calls.get("read", 0)  # type: ignore[misc]
            out[f"{t}_read_seconds"] = lambda s, t=t: _wire(s, t).seconds.get("read", 0.0)  # type: ignore[misc]
            out[f"{t}_read_bytes"] = lambda s, t=t: _wire(s, t).bytes.get("read", 0)  # type: ignore[misc]
    return {**out,
            "reloaded_tokens": lambda s: s.reloaded_tokens,
            "saved_tokens": lambda s: s.saved_tokens,
            "load_failed_blocks": lambda s: s.load_failed_blocks,
            "rerouted_chunks": lambda s: s.rerouted_chunks,
            "ttl_pin_chunks": lambda s: s.ttl_pin_chunks,
            "ttl_pin_refused_chunks": lambda s: s.ttl_pin_refused_chunks,
            "dropped_saves": lambda s: s.dropped_saves,
            "corrupt_chunks": lambda s: sum(t.corrupt_chunks for t in s.tiers.values()),  # s.corrupt_chunks
            "flush_missed_chunks": lambda s: s.flush_missed_chunks,
            "load_bytes": lambda s: s.transfer_bytes[f"{top}_to_engine"],
            "load_seconds": lambda s: s.transfer_seconds[f"{top}_to_engine"],
            "save_bytes": lambda s: s.transfer_bytes[f"engine_to_{top}"],
            "save_seconds": lambda s: s.transfer_seconds[f"engine_to_{top}"]}


def rank0_only() -> tuple[str, ...]:
    """Payload counters reported by rank 0 only.  Every rank moves the same tokens (its own KV
    heads of them), and vLLM sums the ranks' stats: token counters come from rank 0 only; bytes,
    seconds and store counters from every rank."""
    tiers = registry.available_tiers()
    return (*(f"loaded_tokens_{t}" for t in tiers), *(f"unfilled_tokens_{t}" for t in tiers), "reloaded_tokens",
            "saved_tokens", "load_failed_blocks", "rerouted_chunks")
