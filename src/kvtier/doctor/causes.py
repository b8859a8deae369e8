"""Why the hit rate is what it is (issue 35 item 2): the miss reasons the requests' receipts
counted, ranked, each with the operator's action; the size that would hold a tier's working set
when its evictions lead; and the prefill seconds each tier saved.

Read from kvtier's receipt metrics (their sums equal the receipts'):

- ``kvtier_missed_tokens_total{reason,tier}``: prompt tokens not served from a cache, by the
  reason of the first chunk not served (:data:`kvtier.core.receipt.MissReason`) and the tier the
  reason is about;
- ``kvtier_served_tokens_total{tier}`` (and ``{tenant}`` when a kvtier exports one): prompt tokens
  each tier served;
- ``kvtier_ghost_hit_distance_bytes{tier}``: histogram, per chunk a tier evicted and was asked for
  again while its ghost list remembered it, the bytes the tier evicted in between (one rank's
  store: kvtier.core.ghosts); a tier larger by that many bytes would have kept it (Mattson et al.,
  "Evaluation techniques for storage hierarchies", IBM Systems Journal 1970: stack distance);
- ``kvtier_capacity_bytes{tier}`` (total across ranks);
- vLLM's ``vllm:request_prefill_time_seconds`` (sum: seconds from scheduling to first token,
  summed over requests; vllm/v1/metrics/stats.py) and ``vllm:prompt_tokens_by_source_total
  {source="local_compute"}`` (prompt tokens the engine computed): their ratio is the engine's
  measured prefill rate on this traffic.

No lock, no I/O: one scrape's series (:func:`cause_series`) and the deltas between two
(:func:`causes_between`).  The sentences are :func:`cause_checks`'.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.core.errors import ConfigError
from kvtier.core.receipt import NO_TIER, miss_tier_label
from kvtier.core.tiers.registry import spec
from kvtier.doctor.quantile import beyond_finite_buckets, histogram_quantile

MISSED = "kvtier_missed_tokens"
SERVED = "kvtier_served_tokens"
GHOST = "kvtier_ghost_hit_distance_bytes"
CAPACITY = "kvtier_capacity_bytes"
PREFILL = "vllm:request_prefill_time_seconds"
BY_SOURCE = "vllm:prompt_tokens_by_source"
SIZE_QUANTILE = 0.9
"""Quantile of the ghost-hit distances added to a tier's capacity to hold its working set (kvtier's
choice: a tier that size keeps 9 in 10 of the chunks it evicted and was asked for again)."""
MIN_CAUSE_SHARE = 0.10
"""Share of the missed tokens from which an actionable reason is a warning (kvtier's heuristic)."""
SHOWN_CAUSES = 5
"""Reasons listed at most, largest first."""
ALWAYS_WARN = frozenset({"corrupt", "load_failed", "breaker_open"})
"""Reasons that are a warning at any count: something is broken, not merely too small."""
GIB = float(1 << 30)
CheckLevel = Literal["ok", "warning"]

ACTIONS: dict[str, str] = {
    "evicted": "the {tier} tier evicted them before they were asked for again: size the {tier} tier up "
               "({key})",
    "new": "no tier of this engine had seen them (first use, or another tenant's or model's tokens): nothing a "
           "bigger cache would fix; if you expected reuse, check that requests share exact prefixes (same "
           "system prompt, chat template and cache_salt)",
    "partial_chunk": "prompt tails shorter than one chunk are always computed: if most prompts' shared part is "
                     "shorter than chunk_tokens, lower chunk_tokens",
    "not_admitted": "the {tier} tier's admission filter refused to store them: set admission all for {tier} "
                    "if these prefixes are reused",
    "save_dropped": "a full write queue dropped their saves: raise save_queue_depth (and io_threads), or give "
                    "the {tier} tier a faster device",
    "corrupt": "the {tier} tier held them and they failed verification: check the disk or the bucket "
               "(kernel log, SMART, the store's errors) and purge what is damaged (kvtier purge)",
    "load_failed": "reading or copying them failed: check the {tier} tier's device or server and the engine log",
    "deadline": "the shared tier ({tier}) answered after its deadline: check its latency (doctor's read latency "
                "line), or raise shared_deadline_s / shared_transfer_deadline_s",
    "breaker_open": "the shared tier's ({tier}) circuit breaker was open: the server failed or refused kvtier; "
                    "check that it is up and reachable and takes kvtier's password or keys (kvtier check says "
                    "which; the engine log names the error)",
    "reset": "a cache reset (POST /reset_prefix_cache?reset_external=true) removed them: expected after a reset; "
             "if nobody meant to reset, find who calls it",
    "purged": "kvtier purge removed them: expected after a purge",
    "quota": "their tenant's quota did not keep them: raise that tenant's share in tenant_quotas, or cpu_gib",
    "budget": "a load cap cut the load (load_wait_s passed, or the step's load budget): raise load_wait_s, or "
              "check the {tier} tier's read speed",
}
"""What the operator does about each :data:`kvtier.core.receipt.MissReason` (docs/doctor.md "Why the
hit rate is low"); ``{tier}`` is the tier the reason names, ``{key}`` its size key."""
INFORMATIONAL = frozenset({"new", "reset", "purged"})
"""Reasons that are no fault of the configuration: never a warning."""


@dataclass
class CauseSeries:
    """One scrape's receipt series (summed over engines and the labels not named)."""

    missed: dict[tuple[str, str], float] = field(default_factory=dict)
    """``(reason, tier) → tokens``."""
    served: dict[tuple[str, str], float] = field(default_factory=dict)
    """``(tier, tenant) → tokens``; tenant ``""`` when the series has no tenant label."""
    ghost: dict[str, dict[float, float]] = field(default_factory=dict)
    """``tier → le → cumulative count`` of the ghost-hit distances."""
    present: bool = False
    """Whether the scrape has ``kvtier_missed_tokens`` at all (a kvtier with receipts)."""
    prefill_seconds: float = 0.0
    computed_tokens: float = 0.0


def cause_series(families: Iterable[Any]) -> CauseSeries:
    """The receipt series of one parsed scrape (prometheus_client families); samples that are not
    finite or negative are left out."""
    out = CauseSeries()
    for family in families:
        if family.name not in (MISSED, SERVED, GHOST, PREFILL, BY_SOURCE):
            continue
        out.present = out.present or family.name == MISSED
        for s in family.samples:
            if s.name.endswith("_created") or not math.isfinite(s.value) or s.value < 0:
                continue
            labels = s.labels
            if family.name == MISSED and s.name.endswith("_total"):
                tier_label = miss_tier_label(labels.get("tier", ""))  # a reason about no tier: ""
                key = (labels.get("reason", "?"), "" if tier_label == NO_TIER else tier_label)
                out.missed[key] = out.missed.get(key, 0.0) + s.value
            elif family.name == SERVED and s.name.endswith("_total"):
                skey = (labels.get("tier", "?"), labels.get("tenant", ""))
                out.served[skey] = out.served.get(skey, 0.0) + s.value
            elif family.name == GHOST and s.name.endswith("_bucket"):
                tier = out.ghost.setdefault(labels.get("tier", "?"), {})
                le = float(labels["le"])
                tier[le] = tier.get(le, 0.0) + s.value
            elif family.name == PREFILL and s.name.endswith("_sum"):
                out.prefill_seconds += s.value
            elif family.name == BY_SOURCE and s.name.endswith("_total") and labels.get("source") == "local_compute":
                out.computed_tokens += s.value
    return out


@dataclass(frozen=True)
class Miss:
    """One reason's missed tokens between the scrapes."""

    reason: str
    tier: str
    tokens: float
    share: float
    """Of all missed tokens between the scrapes."""


@dataclass(frozen=True)
class TierSize:
    """What would hold a tier's working set: its capacity plus :data:`SIZE_QUANTILE` of the
    ghost-hit distances between the scrapes."""

    tier: str
    capacity_bytes: float
    """Total across ranks (``kvtier_capacity_bytes``)."""
    ghost_hits: float
    distance_bytes: float | None
    """The quantile of one rank's distances; None without ghost hits."""
    beyond_buckets: bool = False
    """The quantile is past the histogram's last finite bucket: the size is a lower bound."""

    def recommended_bytes(self, tp: int) -> float | None:
        """Capacity + ``tp`` × the distance (each rank's store evicts its share), total across
        ranks; None without ghost hits."""
        return None if self.distance_bytes is None else self.capacity_bytes + tp * self.distance_bytes


@dataclass(frozen=True)
class Saving:
    """Prefill a tier saved between the scrapes: its served tokens at the measured prefill rate."""

    tier: str
    tenant: str
    tokens: float
    seconds: float | None
    seconds_per_gib: float | None
    """Over the tier's capacity: what a GiB of it was worth on this traffic; None without capacity."""


@dataclass(frozen=True)
class Causes:
    """The receipts' view of the interval (:func:`causes_between`)."""

    present: bool
    """False: the server exports no miss reasons (kvtier older than receipts)."""
    missed_tokens: float = 0.0
    misses: tuple[Miss, ...] = ()
    """Largest first."""
    sizes: dict[str, TierSize] = field(default_factory=dict)
    """Per tier whose capacity is known and that has ghost-hit series."""
    prefill_tokens_per_s: float | None = None
    savings: tuple[Saving, ...] = ()
    per_tenant: bool = False
    """Whether ``savings`` are per tenant (the served series carry a ``tenant`` label)."""

    @property
    def leading(self) -> Miss | None:
        return self.misses[0] if self.misses else None


def counter_delta(now: float, then: float) -> float:
    """How much a counter rose from ``then`` to ``now``; ``now`` itself when it went down (the
    engine restarted and the counter started again)."""
    return now - then if now >= then else now


def causes_between(before: CauseSeries, after: CauseSeries, capacity_bytes: dict[str, float],
                   shared_tiers: frozenset[str] = frozenset()) -> Causes:
    """The deltas of ``after`` over ``before``; ``capacity_bytes``: ``after``'s tiers' capacities;
    ``shared_tiers``: the shared tiers the server has (their breaker gauges have a sample).

    The served series exist for every registered tier, so a tier the server does not have (no
    capacity, no breaker sample) that served nothing is left out of :attr:`Causes.savings`."""
    if not after.present:
        return Causes(present=False)
    missed = {k: counter_delta(v, before.missed.get(k, 0.0)) for k, v in after.missed.items()}
    total = sum(missed.values())
    ranked = sorted(((k, v) for k, v in missed.items() if v > 0), key=lambda kv: (-kv[1], kv[0]))
    misses = tuple(Miss(reason, tier, tokens, tokens / total) for (reason, tier), tokens in ranked)
    sizes: dict[str, TierSize] = {}
    for tier, buckets in after.ghost.items():
        then = before.ghost.get(tier, {})
        delta = {le: counter_delta(n, then.get(le, 0.0)) for le, n in buckets.items()}
        if any(n < 0 for n in delta.values()) or tier not in capacity_bytes:
            continue
        hits = delta.get(math.inf, 0.0)
        sizes[tier] = TierSize(tier, capacity_bytes[tier], hits, histogram_quantile(SIZE_QUANTILE, delta),
                               beyond_finite_buckets(SIZE_QUANTILE, delta))
    seconds = counter_delta(after.prefill_seconds, before.prefill_seconds)
    computed = counter_delta(after.computed_tokens, before.computed_tokens)
    rate = computed / seconds if seconds > 0 and computed > 0 else None
    per_tenant = any(tenant for _tier, tenant in after.served)
    savings = []
    configured = {tier for tier, capacity in capacity_bytes.items() if capacity > 0} | shared_tiers
    for (tier, tenant), value in sorted(after.served.items()):
        tokens = counter_delta(value, before.served.get((tier, tenant), 0.0))
        if tokens == 0 and tier not in configured:  # "redis 0.00 s" on a server without Redis
            continue
        saved = tokens / rate if rate else None
        capacity = capacity_bytes.get(tier, 0.0)
        per_gib = saved / (capacity / GIB) if saved is not None and capacity > 0 and not per_tenant else None
        savings.append(Saving(tier, tenant, tokens, saved, per_gib))
    return Causes(True, total, misses, sizes, rate, tuple(savings), per_tenant)


def _action(miss: Miss) -> str:
    tier = miss.tier or "?"
    return ACTIONS.get(miss.reason, "no action is known for this reason").format(tier=tier, key=_key(tier))


def _level(miss: Miss, first: bool) -> CheckLevel:
    if miss.reason in INFORMATIONAL:
        return "ok"
    if miss.reason in ALWAYS_WARN:
        return "warning"
    if miss.reason == "partial_chunk":
        return "warning" if first else "ok"
    return "warning" if miss.share >= MIN_CAUSE_SHARE else "ok"


def _key(tier: str) -> str:
    """The configuration key sizing ``tier`` (its registry record's ``*_gib`` key), else words."""
    try:
        record = spec(tier)
    except ConfigError:  # a tier this process has not registered (a plug-in of the server's)
        return f"the {tier} tier's capacity"
    keys = ("cpu_gib",) if record.top else record.keys  # the top tier's size is KVTierConfig's own key
    return next((k for k in keys if k.endswith("_gib")), f"the {tier} tier's capacity")


def _gib(n: float) -> str:
    return f"{n / GIB:,.3g} GiB"


def cause_checks(c: Causes, tp: int) -> list[tuple[CheckLevel, str]]:
    """``(level, sentence)`` of each line the doctor prints about the causes (levels as
    :class:`kvtier.doctor.verdict.Check`'s)."""
    if not c.present:
        absent = ("Miss reasons: not reported (a kvtier without request receipts: no kvtier_missed_tokens_total); "
                  "the checks above judge from the totals only.")
        return [("ok", absent)]
    out: list[tuple[CheckLevel, str]] = []
    if not c.misses:
        out.append(("ok", "Miss reasons: no prompt token missed kvtier between the scrapes."))
    for i, miss in enumerate(c.misses[:SHOWN_CAUSES]):
        where = f" ({miss.tier})" if miss.tier else ""
        line = (f"Miss reason #{i + 1}: {miss.reason}{where}, {miss.tokens:,.0f} tokens ({miss.share:.0%} of "
                f"{c.missed_tokens:,.0f} missed): {_action(miss)}.")
        out.append((_level(miss, i == 0), line))
    lead = c.leading
    if lead is not None and lead.reason == "evicted":
        out.append(("warning", _size_sentence(lead.tier, c.sizes.get(lead.tier), tp)))
    out.extend(_saving_checks(c))
    return out


def _size_sentence(tier: str, size: TierSize | None, tp: int) -> str:
    """What would hold ``tier``'s working set, in words (its evictions lead)."""
    recommended = size.recommended_bytes(tp) if size is not None else None
    if size is None or recommended is None:
        return (f"Evictions from the {tier} tier lead, but no ghost hit was recorded for it between the scrapes "
                "(kvtier_ghost_hit_distance_bytes): measure over a longer interval to get the size that holds "
                "the working set.")
    at_least = "at least " if size.beyond_buckets else ""
    times = f"TP {tp} × " if tp > 1 else ""
    return (f"Size: the {tier} tier is {_gib(size.capacity_bytes)}; {at_least}{_gib(recommended)} would hold its "
            f"working set ({_gib(size.capacity_bytes)} + {times}p{SIZE_QUANTILE * 100:.0f} of "
            f"{size.ghost_hits:,.0f} ghost hits' eviction distance {_gib(size.distance_bytes or 0.0)}); "
            f"set {_key(tier)} to it.")


def _saving_checks(c: Causes) -> list[tuple[CheckLevel, str]]:
    if not c.savings:
        return []
    if c.prefill_tokens_per_s is None:
        unknown = ("Prefill saved: unknown (vLLM's vllm:request_prefill_time_seconds and prompt tokens computed "
                   "did not move between the scrapes).")
        return [("ok", unknown)]
    parts = []
    for s in c.savings:
        who = f"{s.tenant} " if c.per_tenant else ""
        worth = f", {s.seconds_per_gib:,.2f} s per GiB" if s.seconds_per_gib is not None else ""
        parts.append(f"{who}{s.tier} {s.seconds or 0.0:,.2f} s ({s.tokens:,.0f} tokens{worth})")
    scope = "per tenant and tier" if c.per_tenant else "per tier only (the served tokens carry no tenant label)"
    saved = (f"Prefill saved between the scrapes, {scope}: {'; '.join(parts)}; at the engine's measured prefill "
             f"rate {c.prefill_tokens_per_s:,.0f} tokens/s (prompt tokens computed / request prefill seconds), "
             "a linear estimate.")
    return [("ok", saved)]

def causes_json(c: Causes | None, tp: int) -> dict[str, Any] | None:
    """``--json``'s ``causes`` (docs/doctor.md "JSON"); None when kvtier is not the connector."""
    if c is None:
        return None
    return {
        "reported": c.present, "missed_tokens": c.missed_tokens,
        "misses": [{"reason": m.reason, "tier": m.tier, "tokens": m.tokens, "share": m.share,
                    "action": _action(m)} for m in c.misses],
        "sizes": {t: {"capacity_bytes": s.capacity_bytes, "ghost_hits": s.ghost_hits,
                      f"distance_p{SIZE_QUANTILE * 100:.0f}_bytes": s.distance_bytes,
                      "recommended_bytes": s.recommended_bytes(tp), "at_least": s.beyond_buckets}
                  for t, s in c.sizes.items()},
        "prefill_tokens_per_s": c.prefill_tokens_per_s, "per_tenant": c.per_tenant,
        "prefill_saved": [{"tier": s.tier, "tenant": s.tenant or None, "tokens": s.tokens, "seconds": s.seconds,
                           "seconds_per_gib": s.seconds_per_gib} for s in c.savings],
    }
