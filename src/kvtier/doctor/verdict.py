"""Turn the meters and the allocation into checks and one verdict.

Checks, in the order of the operator's guide § "Offload doesn't help — root causes" and the
how-to's "one-line checklist" (helping = hit rate ↑, TTFT p50 ↓, p99 tail bounded):

- counters lower in the second scrape (files swapped, server restarted) → ``inconclusive``;
- no prompt tokens between scrapes, or a sample too small to judge (fewer than
  :data:`MIN_SAMPLE_TOKENS` prompt tokens, or fewer than :data:`MIN_SAMPLE_REQUESTS` requests in
  the TTFT histogram; kvtier's thresholds) → ``inconclusive``;
- more hits than queries between the scrapes (impossible) → ``inconclusive``;
- prefix caching off (root cause 3) → problem;
- reuse near zero (root cause 2; how-to meter 1) → problem.  Reuse counts GPU prefix-cache hits
  plus the connector's external hits, since vLLM counts a token served from offload only as the
  latter.  "Near zero" is kvtier's
  threshold :data:`NO_REUSE_HIT_RATE`;
- offload size ≠ expected, and 1/TP of it in particular (root cause 4: sized per GPU) → problem;
- each of kvtier's shared tiers (redis, s3), judged even without traffic: breaker open → problem (every
  lookup misses and every write is skipped until the server answers); half-open, writes
  skipped, or lookups past ``shared_deadline_s`` between the scrapes → warning; else ok with
  its hit rate and read latency (docs/shared-tier.md, docs/s3.md);
- the local tiers' chunk writes failed (a full or unwritable disk) → problem; saves dropped with no
  failed local write → warning, put down to a shared tier that skipped writes (down, or refusing
  kvtier) as far as its skipped writes go, else to the top tier's room and the write queues;
  corrupt chunks → warning, all between the scrapes and judged even without traffic
  (:mod:`kvtier.doctor.faults`);
- offload configured but no external hits (root cause 5: cold cache, or tier too small) → warning;
- with kvtier's receipt metrics: the miss reasons ranked, each with its action, the size that holds
  a tier's working set when its evictions lead, the prefill saved per tier
  (:func:`kvtier.doctor.causes.cause_checks`; an older kvtier: one line saying they are absent);
- TTFT p99 more than :data:`TAIL_RATIO` × p50 (how-to meter 3: thrash tail) → warning (kvtier's
  heuristic threshold, not from the documents).

Verdict: ``problem`` if any problem, else ``warning`` if any warning, else ``healthy``
(``inconclusive`` when the traffic cannot be judged, unless a configuration problem was found).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kvtier.core.tiers.registry import specs
from kvtier.doctor.causes import cause_checks
from kvtier.doctor.faults import fault_checks
from kvtier.doctor.meters import Allocation, Controls, Meters, SharedTier

Level = Literal["ok", "warning", "problem"]
NO_REUSE_HIT_RATE = 0.05
TAIL_RATIO = 10.0
SIZE_TOLERANCE = 0.05
MIN_SAMPLE_TOKENS = 1000
MIN_SAMPLE_REQUESTS = 5


@dataclass(frozen=True)
class Check:
    level: Level
    message: str


@dataclass
class Diagnosis:
    """Checks in order and the overall verdict."""

    checks: list[Check] = field(default_factory=list)
    verdict: str = "healthy"


def _size_check(alloc: Allocation, expect_gib: float | None, tp: int) -> Check | None:
    if expect_gib is None:
        return None
    if alloc.gib is None:
        return Check("problem", f"Expected a {expect_gib:g} GiB offload tier, but the server reports none.")

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= SIZE_TOLERANCE * max(b, 1e-9)

    # say which number is compared: kvtier's tiers together, or vLLM's --kv-offloading-size
    if alloc.tiers_gib:
        what = " + ".join(f"{tier} {gib:g}" for tier, gib in alloc.tiers_gib.items()) + f" = {alloc.gib:g} GiB"
        what = f"kvtier tiers {what}" if len(alloc.tiers_gib) > 1 else f"kvtier tier {what}"
    else:
        what = f"{alloc.gib:g} GiB (--kv-offloading-size)"
    if close(alloc.gib, expect_gib):
        return Check("ok", f"Offload {what} matches --expect-offload-gib {expect_gib:g} (total across TP).")
    if tp > 1 and close(alloc.gib, expect_gib / tp):
        return Check("problem", f"Offload {what} = expected {expect_gib:g} / TP {tp}: the size was set per GPU "
                     f"(SGLang habit); vLLM and kvtier read it as the total, set {expect_gib:g}.")
    if tp > 1 and close(alloc.gib, expect_gib * tp):
        return Check("problem", f"Offload {what} = expected {expect_gib:g} × TP {tp}: the total was multiplied by "
                     "TP once too often.")
    return Check("problem", f"Offload {what}, but --expect-offload-gib is {expect_gib:g}"
                 f"{' (compare it with cpu_gib + disk_gib)' if len(alloc.tiers_gib) > 1 else ''}.")


def shared_summary(shared: SharedTier) -> str:
    """A shared tier's numbers between the scrapes in words: hit rate (the tier the scheduler asks),
    read latency and throughput, skipped writes, failed calls."""
    parts = []
    if shared.asked:
        rate = "-" if shared.hit_rate is None else f"{shared.hit_rate:.1%}"
        parts.append(f"hit rate {rate} ({shared.hit_chunks:,.0f} / {shared.lookup_chunks:,.0f} chunks asked)")
    if shared.read_latency_s is not None:
        speed = "" if shared.read_gib_per_s is None else f", {shared.read_gib_per_s:.2f} GiB/s"
        parts.append(f"read latency {shared.read_latency_s * 1000:.1f} ms per load ({shared.reads:,.0f} reads{speed})")
    else:
        parts.append("no reads")
    parts.append(f"{shared.skipped_writes:,.0f} writes skipped, {shared.errors:,.0f} failed calls")
    return ", ".join(parts)


def breaker_causes(tier: str) -> str:
    """Why a shared tier's breaker opens and where to read which it was: the metrics carry no error
    kind, the engine log's warning does (:meth:`kvtier.core.tiers.guarded.GuardedTier._fault`)."""
    return ("likely the server is down or unreachable (stopped, network, firewall, a wrong URL; a node pool: its "
            "owner, kvtier node serve, stopped), or it refuses kvtier's credentials (a changed Redis password or "
            "ACL user: AuthenticationError; wrong or expired S3 keys); kvtier check on the engine's config probes "
            "it and says which (reachable, unreachable or auth failed), and the engine log's warning \"kvtier "
            f"{tier or '<tier>'} tier (...): <op> failed (<error>)\" names the error")


def _shared_checks(shared: SharedTier) -> list[Check]:
    """A shared tier's lines: its state, then what went wrong between the scrapes."""
    seen = shared_summary(shared)
    name = shared.label
    checks = []
    if shared.breaker == "open":
        checks.append(Check("problem", f"{name}: circuit breaker open: lookups miss and writes are "
                            f"skipped until the server answers again ({seen}); {breaker_causes(shared.tier)}."))
    elif shared.breaker != "closed":
        checks.append(Check("warning", f"{name}: circuit breaker half-open, probing a server that "
                            f"failed ({seen})."))
    if shared.skipped_writes > 0 and shared.breaker == "closed":
        checks.append(Check("warning", f"{name}: {shared.skipped_writes:,.0f} chunk writes skipped "
                            f"between the scrapes (a write failed, or the tier's queue was full; "
                            f"{shared.errors:,.0f} failed calls): other replicas will not find those prefixes."))
    if shared.timed_out_lookups > 0:
        checks.append(Check("warning", f"{name}: {shared.timed_out_lookups:,.0f} lookups passed "
                            "shared_deadline_s and were answered from the local tiers: a slow server or network."))
    if not checks:
        checks.append(Check("ok", f"{name}: breaker closed, {seen}."))
    return checks


def _cannot_judge(meters: Meters) -> str | None:
    """Why the traffic between the scrapes cannot be judged, or None when it can."""
    if meters.went_backwards:
        lower = ", ".join(meters.went_backwards)
        if meters.interval_s is not None:  # two scrapes of --url, in order: only a restart lowers a counter
            return (f"Counters went backwards ({lower}): the server restarted (or its counters were reset) between "
                    "the two scrapes; measure again once it has run a while.")
        return (f"Counters went backwards ({lower}): the files are in the wrong order "
                "(give BEFORE then AFTER) or the server restarted between the scrapes; measure again.")
    longer = ("use a longer --interval" if meters.interval_s is not None else
              "record the two snapshots further apart (--from-files has no --interval)")
    if meters.queries <= 0:
        return f"No prompt tokens between the scrapes: run under load or {longer}."
    if meters.hits > meters.queries or meters.external_hits > meters.external_queries:
        return "More hits than queries between the scrapes, which vLLM cannot report: the scrapes do not match."
    if meters.queries < MIN_SAMPLE_TOKENS or 0 < meters.ttft_requests < MIN_SAMPLE_REQUESTS:
        return (f"Too small a sample to judge ({meters.queries:,.0f} prompt tokens, {meters.ttft_requests:,.0f} "
                f"requests; at least {MIN_SAMPLE_TOKENS:,} tokens and {MIN_SAMPLE_REQUESTS} requests needed): "
                f"run under load or {longer}.")
    return None


def diagnose(meters: Meters, alloc: Allocation, cache_config: dict[str, str], expect_gib: float | None,
             tp: int) -> Diagnosis:
    """All checks for one pair of scrapes."""
    d = Diagnosis()
    add = d.checks.append
    if cache_config.get("enable_prefix_caching") == "False":
        add(Check("problem", "Prefix caching is off (--no-enable-prefix-caching): offload has nothing to hit."))
    size = _size_check(alloc, expect_gib, tp)
    if size:
        add(size)
    shared_tiers = meters.shared_tiers or ((meters.shared,) if meters.shared is not None else ())
    if meters.faults is not None:  # failed writes, dropped saves, corrupt chunks: judged without traffic too
        d.checks.extend(Check(level, message) for level, message in fault_checks(meters.faults, shared_tiers))
    for shared in shared_tiers:
        d.checks.extend(_shared_checks(shared))
    if meters.pins is not None and (meters.pins.chunks or meters.pins.refused):
        pinned = f"{meters.pins.chunks:,.0f} chunks ({meters.pins.bytes / 2**20:,.1f} MiB) of the cpu tier pinned by requests"
        if meters.pins.refused:
            add(Check("warning", f"Pins: {meters.pins.refused:,.0f} chunk pins refused between the scrapes: "
                      f"pin_max_share of the cpu tier is pinned already ({pinned}); raise pin_max_share or cpu_gib, "
                      "or pin less (kv_transfer_params kvtier_pin_s)."))
        else:
            add(Check("ok", f"Pins: {pinned}."))
    if meters.controls is not None:
        d.checks.extend(_control_checks(meters.controls, _events_scope(alloc, shared_tiers)))
    why_not = _cannot_judge(meters)
    if why_not:
        add(Check("warning", why_not))
        d.verdict = "problem" if any(c.level == "problem" for c in d.checks) else "inconclusive"
        return d
    reuse = meters.reuse_rate or 0.0
    if reuse < NO_REUSE_HIT_RATE:
        add(Check("problem", f"Only {reuse:.1%} of prompt tokens were reused (GPU prefix cache + offload): "
                  "almost no reuse, so offload cannot help (check that traffic shares prefixes)."))
    else:
        add(Check("ok", f"{reuse:.1%} of prompt tokens reused: {meters.hit_rate or 0:.1%} from the GPU prefix "
                  f"cache, {meters.external_hits / meters.queries:.1%} from the offload tier."))
    if alloc.gib:
        if meters.external_queries <= 0:
            add(Check("warning", "Offload is configured but the connector was not asked for any tokens."))
        elif meters.external_hits <= 0:
            add(Check("warning", "Offload is configured but served no hits yet: cold cache (measure steady state) "
                      "or a tier smaller than the warm set."))
        else:
            add(Check("ok", f"Offload tier served {meters.external_hits:,.0f} tokens "
                      f"({meters.external_hit_rate or 0:.1%} of tokens asked of it)."))
    if meters.causes is not None:  # why the rest missed, from the requests' receipts (issue 35)
        d.checks.extend(Check(level, message) for level, message in cause_checks(meters.causes, tp))
    p50, p99 = meters.ttft_p50_s, meters.ttft_p99_s
    if p50 and p99 and p99 > TAIL_RATIO * p50:
        add(Check("warning", f"TTFT p99 {p99:.3f} s is over {TAIL_RATIO:g}× p50 {p50:.3f} s: a fat miss tail "
                  "(offload thrash or prefill bursts)."))
    levels = {c.level for c in d.checks}
    d.verdict = "problem" if "problem" in levels else "warning" if "warning" in levels else "healthy"
    return d


def _events_scope(alloc: Allocation, shared: tuple[SharedTier, ...]) -> str:
    """What a router learns from kvtier's KV events on this server, in words: the chunks of its
    local tiers that have a vLLM ``medium`` and a capacity (``kvtier_capacity_bytes`` above 0), and
    that its shared tiers are never announced (docs/vllm.md "KV events")."""
    announced = [s.name for s in specs() if s.medium and alloc.tiers_gib.get(s.name, 0.0) > 0]
    what = (f"routers learn kvtier's {' and '.join(announced)} chunks" if announced
            else "routers learn the chunks of kvtier's local tiers")
    names = [t.tier for t in shared if t.tier]
    if names:
        what += f"; shared tier {', '.join(names)} never announced: reachable from every engine"
    return what


def _control_checks(c: Controls, events_scope: str) -> list[Check]:
    """KV events and tenant quotas (:class:`kvtier.doctor.meters.Controls`): what is on (``events_scope``:
    :func:`_events_scope`), and the largest tenants' bytes (labels are digests of their cache_salt, never
    the salt).  Engines that disagree, or an impossible setting, are a warning each (never an "ok")."""
    out = [Check("warning", problem) for problem in c.problems]
    out.append(Check("ok", f"KV events: on ({events_scope})." if c.events_enabled else
                     "KV events: off (start vLLM with --kv-events-config so cache-aware routers see kvtier's tiers; "
                     "a kv_producer never announces them: it loads nothing)."))
    if not c.quotas_on:
        out.append(Check("ok", "Tenant quotas: off (one tenant's burst can evict every other tenant's KV; "
                         "set tenant_quotas to guarantee each cache_salt a share)."))
        return out
    largest = ", ".join(f"{label} {used / 2**20:,.1f} MiB" for label, used in list(c.tenants.items())[:4])
    default = f"default share {c.quota_default_share:g}" if c.quota_default_share > 0 else "no default share"
    no_salt = f", no-salt share {c.quota_no_salt_share:g}" if c.quota_no_salt_share > 0 else ""
    out.append(Check("ok", f"Tenant quotas: {default}, {c.quota_salts} salt(s) with "
                     f"their own share{no_salt}; {c.quota_evictions:,.0f} evictions chosen by the quotas between the scrapes"
                     + (f"; largest tenants (bytes summed over the local tiers): {largest}." if largest else ".")))
    return out
