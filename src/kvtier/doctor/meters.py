"""The three meters between two scrapes, and the offload size vLLM actually allocated.

Meters (how-to § "How to tell it's helping — three meters, in order"):

1. prefix-cache hit rate = Δ``prefix_cache_hits`` / Δ``prefix_cache_queries`` (the GPU cache),
   and the reuse rate, which adds the tokens the connector served (``external_prefix_cache_hits``);
2. TTFT p50 and 3. TTFT p99 from the deltas of the ``time_to_first_token_seconds`` buckets,
   interpolated linearly inside a bucket exactly as Prometheus' ``histogram_quantile`` does;

plus the external (connector) hit rate Δ``external_prefix_cache_hits`` / Δ``…_queries`` (operator's
guide § "Validating": ``external_prefix_cache_hits_total`` must rise).  Rates are None when their
denominator did not move between the scrapes.  With kvtier's shared tiers (redis, s3),
:class:`SharedTier` per tier: its hit rate, lookups past the deadline, failed calls, skipped writes,
mean read latency and read throughput between the scrapes, and the breaker state at the second one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtier.core.tiers.registry import tier_rank
from kvtier.doctor.causes import Causes, causes_between, counter_delta
from kvtier.doctor.faults import LocalFaults, faults_between
from kvtier.doctor.quantile import histogram_quantile
from kvtier.doctor.snapshot import Snapshot

GIB = 1 << 30


@dataclass(frozen=True)
class SharedTier:
    """One of kvtier's shared tiers (redis, s3, ...) between two scrapes; ``breaker_state`` is the
    second scrape's gauge (summed over ranks: 0 closed everywhere, 1 per half-open rank, 2 per open
    rank).  The lookup numbers are the scheduler's (``kvtier_shared_lookup_*``): it asks the first
    shared tier of ``tiers`` only (src/kvtier/integrations/vllm/scheduler/remote.py), so they are zero for
    the others."""

    lookup_chunks: float
    hit_chunks: float
    timed_out_lookups: float
    skipped_lookups: float
    errors: float
    skipped_calls: float
    skipped_writes: float
    breaker_state: float
    tier: str = ""
    reads: float = 0.0
    """Read batches (one load's parallel reads) the workers made that returned."""
    read_seconds: float = 0.0
    read_bytes: float = 0.0
    loaded_tokens: float = 0.0
    """Prompt tokens the tier served into the engine (``kvtier_loaded_tokens{tier}``)."""
    asked: bool = True
    """Whether the scheduler's lookups go to this tier (the first shared tier)."""

    @property
    def hit_rate(self) -> float | None:
        """Chunks found in the shared tier / chunks the scheduler asked it about."""
        return self.hit_chunks / self.lookup_chunks if self.lookup_chunks > 0 else None

    @property
    def read_latency_s(self) -> float | None:
        """Mean seconds of one read batch between the scrapes (None without reads)."""
        return self.read_seconds / self.reads if self.reads > 0 else None

    @property
    def read_gib_per_s(self) -> float | None:
        """Payload GiB/s of the reads between the scrapes (None without read time)."""
        return self.read_bytes / GIB / self.read_seconds if self.read_seconds > 0 else None

    @property
    def label(self) -> str:
        return f"Shared tier ({self.tier})" if self.tier else "Shared tier"

    @property
    def breaker(self) -> str:
        if self.breaker_state <= 0:
            return "closed"
        return "half-open (probing)" if self.breaker_state < 2 else "open"


def shared_tiers(before: Snapshot, after: Snapshot) -> tuple[SharedTier, ...]:
    """Every shared tier ``after`` shows (its ``kvtier_<tier>_breaker_state`` gauge), in the
    registry's order (an unregistered tier first); the scheduler's lookups go to the first.  A
    counter lower in ``after`` (a restart) counts from zero."""
    def shared(name: str) -> float:
        return counter_delta(after.shared.get(name, 0.0), before.shared.get(name, 0.0))

    out = []
    for i, tier in enumerate(sorted(after.tiers_wire, key=lambda t: (tier_rank(t), t))):
        now, then = after.tiers_wire[tier], before.tiers_wire.get(tier, {})

        def wire(name: str, now: dict[str, float] = now, then: dict[str, float] = then) -> float:
            return counter_delta(now.get(name, 0.0), then.get(name, 0.0))

        first = i == 0
        loaded = counter_delta(after.kvtier_loaded.get(tier, 0.0), before.kvtier_loaded.get(tier, 0.0))
        out.append(SharedTier(shared("kvtier_shared_lookup_chunks") if first else 0.0,
                              shared("kvtier_shared_lookup_hit_chunks") if first else 0.0,
                              shared("kvtier_shared_lookups_timed_out") if first else 0.0,
                              shared("kvtier_shared_lookups_skipped") if first else 0.0,
                              wire("errors"), wire("skipped_calls"), wire("skipped_writes"),
                              now.get("breaker_state", 0.0), tier, wire("reads"), wire("read_seconds"),
                              wire("read_bytes"), loaded, first))
    return tuple(out)


def shared_tier(before: Snapshot, after: Snapshot) -> SharedTier | None:
    """The first shared tier's meters (:func:`shared_tiers`), None when ``after`` shows none."""
    found = shared_tiers(before, after)
    return found[0] if found else None


@dataclass(frozen=True)
class Pins:
    """Requests' TTL pins in the cpu tier at the second scrape, and pins refused between the scrapes."""

    chunks: float
    bytes: float
    refused: float


def pins_of(before: Snapshot, after: Snapshot) -> Pins | None:
    """The :class:`Pins` of ``after`` (refusals since ``before``); None when the server exports none."""
    if "kvtier_ttl_pinned_chunks" not in after.pins:
        return None
    refused_after = after.pins.get("kvtier_ttl_pin_refused_chunks", 0.0)
    refused = refused_after - before.pins.get("kvtier_ttl_pin_refused_chunks", 0.0)
    return Pins(after.pins["kvtier_ttl_pinned_chunks"], after.pins.get("kvtier_ttl_pinned_bytes", 0.0),
                refused if refused >= 0 else refused_after)


@dataclass(frozen=True)
class Controls:
    """What the operator turned on, at the second scrape: KV events, tenant quotas (default share,
    salts with their own share, the share of requests without a salt), evictions the quotas chose between the scrapes, and the bytes of
    the largest tenants (label -> bytes, summed over the local tiers and ranks).

    The settings are one value each, never a sum over data-parallel engines: when engines disagree
    or a value is impossible (NaN, infinite, a share outside [0, 1], a salt count that is not a
    whole number >= 0, events not 0/1) it is named in ``problems`` and the first engine's value is
    shown."""

    events_enabled: bool
    quota_default_share: float
    quota_salts: int
    quota_evictions: float
    tenants: dict[str, float]
    problems: tuple[str, ...] = ()
    quota_no_salt_share: float = 0.0
    """``no_salt_share`` (else ``default_share``) of ``tenant_quotas``; 0 when none or not reported."""

    @property
    def quotas_on(self) -> bool:
        """Whether the quotas give any tenant a share (a default share, a listed salt, or the
        requests without a salt: ``tenant_quotas`` with only ``no_salt_share`` is on)."""
        return self.quota_default_share > 0 or self.quota_salts > 0 or self.quota_no_salt_share > 0


_SETTING_RULES = {
    "kvtier_kv_events_enabled": ("0 or 1", lambda v: v in (0.0, 1.0)),
    "kvtier_tenant_quota_default_share": ("a share from 0 to 1", lambda v: 0.0 <= v <= 1.0),
    "kvtier_tenant_quota_salts": ("a whole number >= 0", lambda v: v >= 0 and float(v).is_integer()),
    "kvtier_tenant_quota_no_salt_share": ("a share from 0 to 1", lambda v: 0.0 <= v <= 1.0),
}


def _setting(values: list[float], name: str, problems: list[str]) -> float:
    """One setting's value from its per-engine ``values`` (rules: :data:`_SETTING_RULES`); appends a
    sentence to ``problems`` when they disagree or one is impossible, and then returns 0 for an
    impossible first value (so it is never shown as a plausible setting)."""
    if not values:
        return 0.0
    what, ok = _SETTING_RULES[name]
    bad = [v for v in values if not math.isfinite(v) or not ok(v)]
    if bad:
        problems.append(f"{name} = {bad[0]:g} is impossible (must be {what}); the scrape or the server is wrong.")
    distinct = sorted({v for v in values if math.isfinite(v)})
    if len(distinct) > 1:
        problems.append(f"{name} differs between engines ({', '.join(f'{v:g}' for v in distinct)}): "
                        "start every data-parallel engine with the same kvtier configuration.")
    first = values[0]
    return first if math.isfinite(first) and ok(first) else 0.0


def controls_of(before: Snapshot, after: Snapshot) -> Controls | None:
    """The :class:`Controls` of ``after``; None when the server does not say (an older kvtier)."""
    s = after.settings
    if "kvtier_kv_events_enabled" not in s:
        return None
    problems: list[str] = []
    events = _setting(s["kvtier_kv_events_enabled"], "kvtier_kv_events_enabled", problems)
    share = _setting(s.get("kvtier_tenant_quota_default_share", []), "kvtier_tenant_quota_default_share", problems)
    salts = _setting(s.get("kvtier_tenant_quota_salts", []), "kvtier_tenant_quota_salts", problems)
    no_salt = _setting(s.get("kvtier_tenant_quota_no_salt_share", []), "kvtier_tenant_quota_no_salt_share", problems)
    c = after.controls
    evictions = c.get("kvtier_quota_evictions", 0.0) - before.controls.get("kvtier_quota_evictions", 0.0)
    return Controls(events > 0, share, int(salts),
                    evictions if evictions >= 0 else c.get("kvtier_quota_evictions", 0.0),
                    dict(sorted(after.tenants.items(), key=lambda item: -item[1])), tuple(problems), no_salt)


@dataclass(frozen=True)
class Meters:
    """What happened between two scrapes ``interval_s`` seconds apart (None when unknown, e.g. two
    recorded files).  Tokens are prompt tokens.  ``went_backwards`` names the counters that were
    lower in the second scrape (files swapped, or a server restart): their deltas are then the
    second scrape's values and cannot be trusted as an interval's traffic."""

    interval_s: float | None
    queries: float
    hits: float
    external_queries: float
    external_hits: float
    ttft_requests: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    lifetime_hit_rate: float | None
    went_backwards: tuple[str, ...] = ()
    loaded_tokens_by_tier: dict[str, float] = field(default_factory=dict)
    """kvtier only: prompt tokens each tier (cpu, disk) served into the engine between the scrapes."""
    shared: SharedTier | None = None
    """kvtier's first shared tier (the one the scheduler asks), None when the server has none."""
    shared_tiers: tuple[SharedTier, ...] = ()
    """Every shared tier the server reports (redis, s3, ...), the first one being :attr:`shared`."""
    pins: Pins | None = None
    """kvtier's requests' TTL pins, None when the server reports none."""
    controls: Controls | None = None
    """kvtier's KV events and tenant quotas, None when the server does not say."""
    causes: Causes | None = None
    """kvtier's miss reasons, sizes and prefill saved from the receipts' metrics
    (:mod:`kvtier.doctor.causes`); None when kvtier is not the connector."""
    faults: LocalFaults | None = None
    """kvtier's failed writes, dropped saves and corrupt chunks (:mod:`kvtier.doctor.faults`)."""

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None

    @property
    def reuse_rate(self) -> float | None:
        """Share of prompt tokens not recomputed: (GPU prefix-cache hits + external hits) / queries.

        vLLM counts a token served by the connector as an external hit, not a prefix-cache hit
        (its ``prompt_tokens_cached`` is the sum of both), so with offload this is the meter
        that says whether anything is reused."""
        return (self.hits + self.external_hits) / self.queries if self.queries > 0 else None

    @property
    def external_hit_rate(self) -> float | None:
        return self.external_hits / self.external_queries if self.external_queries > 0 else None


def measure(before: Snapshot, after: Snapshot, interval_s: float | None) -> Meters:
    """Deltas of ``after`` over ``before``.  A counter that went down (swapped files or a restart)
    is named in ``went_backwards`` and its delta is ``after``'s value."""
    backwards: list[str] = []

    def delta(name: str) -> float:
        d = after.counter(name) - before.counter(name)
        if d < 0:
            backwards.append(name)
        return d if d >= 0 else after.counter(name)

    buckets = {le: after.ttft_buckets[le] - before.ttft_buckets.get(le, 0.0) for le in after.ttft_buckets}
    if any(v < 0 for v in buckets.values()):
        backwards.append("vllm:time_to_first_token_seconds")
        buckets = dict(after.ttft_buckets)
    lifetime_q = after.counter("vllm:prefix_cache_queries")
    return Meters(
        interval_s=interval_s,
        queries=delta("vllm:prefix_cache_queries"),
        hits=delta("vllm:prefix_cache_hits"),
        external_queries=delta("vllm:external_prefix_cache_queries"),
        external_hits=delta("vllm:external_prefix_cache_hits"),
        ttft_requests=buckets.get(math.inf, 0.0),
        ttft_p50_s=histogram_quantile(0.5, buckets),
        ttft_p99_s=histogram_quantile(0.99, buckets),
        lifetime_hit_rate=after.counter("vllm:prefix_cache_hits") / lifetime_q if lifetime_q > 0 else None,
        went_backwards=tuple(backwards),
        loaded_tokens_by_tier={tier: (value - before.kvtier_loaded.get(tier, 0.0)
                                      if value >= before.kvtier_loaded.get(tier, 0.0) else value)
                               for tier, value in sorted(after.kvtier_loaded.items())},
        shared=shared_tier(before, after),
        shared_tiers=shared_tiers(before, after),
        pins=pins_of(before, after),
        controls=controls_of(before, after),
        causes=causes_between(before.causes, after.causes, after.kvtier_capacity, frozenset(after.tiers_wire))
        if after.kvtier_capacity else None,
        faults=faults_between(before.faults, after.faults),
    )


@dataclass(frozen=True)
class Allocation:
    """The KV offload tier the server reports.  ``gib`` is the TP-wide total, None when none is set.
    ``backend``: ``native`` / ``lmcache`` (vLLM's --kv-offloading-* flags) or ``kvtier``."""

    gib: float | None
    backend: str | None
    detail: str
    tiers_gib: dict[str, float] = field(default_factory=dict)
    """kvtier only: capacity per tier (``cpu``, ``disk``), GiB summed over ranks; ``gib`` is their sum."""
    used_gib: dict[str, float] = field(default_factory=dict)
    """kvtier only: bytes held per tier now, GiB summed over ranks."""

    @property
    def compared(self) -> str:
        """What ``gib`` is, in words: the number compared with ``--expect-offload-gib``."""
        if self.tiers_gib:
            return "kvtier " + " + ".join(sorted(self.tiers_gib)) + " tiers together, total across TP ranks"
        return "--kv-offloading-size (total across TP ranks)" if self.gib is not None else "nothing"


def allocation(snap: Snapshot) -> Allocation:
    """Read the offload size from ``vllm:cache_config_info`` (flags) or ``kvtier_capacity_bytes``."""
    raw = snap.cache_config.get("kv_offloading_size", "None")
    if raw not in ("None", ""):
        try:
            gib = float(raw)
        except ValueError:
            gib = None
        if gib is not None:
            backend = snap.cache_config.get("kv_offloading_backend", "native")
            return Allocation(gib, backend, f"vllm:cache_config_info kv_offloading_size={raw} ({backend})")
    if snap.kvtier_capacity:
        tiers = {tier: value / GIB for tier, value in sorted(snap.kvtier_capacity.items())}
        used = {tier: snap.kvtier_usage.get(tier, 0.0) / GIB for tier in tiers}
        parts = " + ".join(f"{tier} {gib:g} GiB" for tier, gib in tiers.items())
        return Allocation(sum(tiers.values()), "kvtier", f"kvtier_capacity_bytes: {parts}", tiers, used)
    return Allocation(None, None, "no KV offload tier reported (cache_config_info kv_offloading_size=None)")


def recorded_after(before: Snapshot, after: Snapshot) -> bool:
    """Whether ``before`` was plainly recorded after ``after`` (two recordings given in the wrong
    order): the same server process (equal ``process_start_time_seconds``, so no restart between
    them) and every counter of ``after`` at or below ``before``'s, one strictly below.  Without
    both start times a restart cannot be told from a swap, and this is ``False``."""
    if before.process_start_s is None or before.process_start_s != after.process_start_s:
        return False
    names = set(before.counters) | set(after.counters)
    lower = [n for n in names if after.counter(n) < before.counter(n)]
    return bool(lower) and all(after.counter(n) <= before.counter(n) for n in names)
