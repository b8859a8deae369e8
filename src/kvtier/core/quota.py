"""Tenant quotas: each ``cache_salt``'s guaranteed share of a local tier (issue 22 item 5).

A **tenant** is a request's ``cache_salt`` (:class:`~kvtier.core.tenant.TenantId` ``.salt``, a
16-byte BLAKE3 digest; requests without a salt are one tenant, the empty digest).  With
``tenant_quotas`` configured, every tenant has a **share** of each local tier (the cpu tier, the
disk tier): ``floor(share × the tier's chunks)`` chunks are its **guarantee**.  When a tenant
needs a page and the tier is full (:meth:`TenantLedger.victim`):

1. a tenant holding its share or more evicts its own chunks first (the policy's order among them);
2. otherwise, or when none of its own may go, the victim is the policy's first chunk of another
   tenant that holds **more** than its guarantee (or whose tenant is unknown: a chunk another
   process wrote, a promotion of a chunk saved before the ledger knew it);
   a tenant under its share takes its own chunks only when no such chunk is left;
3. nothing else: a chunk of a tenant at or below its guarantee is never evicted for another
   tenant.

A tenant without a share (not listed, and no ``default_share``; or unknown) is best effort: its
chunks are evicted in the policy's order for anyone, and it takes the policy's first chunk that
may go (its own, or one above its tenant's guarantee).  When no chunk qualifies the save finds no room (counted in ``dropped_saves``).

So for every tenant U and every save by another tenant, U's chunks after it are at least
``min(U's chunks before, U's guarantee)``; a tenant may use more than its share while the tier
has room or others sit above theirs.  Evictions in which the quota chose another victim than the
policy alone would have are counted (``quota_evictions``).  Rule after LMCache's per-salt
isolation (``IsolatedLRU``) and the issue's "Done when" (issue 22 item 5).

Shares: :class:`QuotaSettings` (config key ``tenant_quotas``).  Salts are the operator's own and
given in clear in the configuration; outside it they appear only as :func:`tenant_label` (the
first 12 hex digits of the salt's digest), in metrics at most ``top_tenants`` of them plus
``other``, so that their number stays bounded.
"""

from __future__ import annotations

import difflib
import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvtier.core.keys import ChunkKey
from kvtier.core.policies.base import EvictionPolicy
from kvtier.core.tenant import TenantId

NO_SALT = b""
"""The tenant key of requests without a ``cache_salt`` (they are one tenant)."""
OTHER_LABEL = "other"
"""The metric label of every tenant past the ``top_tenants`` largest."""
NO_SALT_LABEL = "no-salt"
"""The metric label of requests without a ``cache_salt``."""
UNKNOWN_LABEL = "unknown"
"""The metric label of chunks whose tenant is not known (another process wrote them)."""
LABEL_HEX_DIGITS = 12
MAX_TOP_TENANTS = 64
"""Most tenants named in the metrics (``top_tenants``): keeps the number of series bounded."""


def tenant_label(salt_digest: bytes) -> str:
    """The label of a tenant in metrics and tools: the first 12 hex digits of its salt's digest
    (:class:`~kvtier.core.tenant.TenantId` ``.salt``), or :data:`NO_SALT_LABEL`.  An operator gets
    a salt's label with ``python -c "from kvtier.core.quota import salt_digest,
    tenant_label; print(tenant_label(salt_digest('SALT')))"``."""
    return salt_digest.hex()[:LABEL_HEX_DIGITS] if salt_digest else NO_SALT_LABEL


def salt_digest(cache_salt: str) -> bytes:
    """The tenant key of ``cache_salt`` (:meth:`TenantId.of`'s salt digest)."""
    return TenantId.of(cache_salt, None).salt


def _share_error(value: object) -> str | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return "must be a number above 0 and at most 1 (a share of each tier), e.g. 0.25"
    if not 0 < value <= 1:
        return "is out of range: a share must be above 0 and at most 1 of each tier, e.g. 0.25"
    return None


class QuotaSettings(BaseModel):
    """``tenant_quotas``: each tenant's guaranteed share of every local tier (see module docstring).

    Attributes:
        default_share: the share of a tenant not listed in ``salts`` (0 < share <= 1); unset: such a
            tenant has no share (best effort: no guarantee, and its chunks go in the policy's order).
        salts: ``cache_salt`` -> share, overriding ``default_share`` for that tenant.
        no_salt_share: the share of requests without a ``cache_salt`` (one tenant); unset:
            ``default_share``.
        top_tenants: tenants labelled by name in metrics (the largest by bytes, 1 to
            :data:`MAX_TOP_TENANTS`); the rest are summed under ``other``.

    Guaranteed shares (``salts`` and the no-salt tenant's: ``no_salt_share``, or ``default_share``
    when it is unset) sum to at most 1: guarantees past the tier could not all be kept.  Salts are
    non-blank text.  Raises ``ValueError`` (one sentence) otherwise.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    default_share: float | None = Field(None, description=(
        "Share of each local tier guaranteed to a tenant (cache_salt) not listed in salts, above 0 and at most 1; "
        "unset = such tenants have no share (best effort)."))
    salts: dict[str, float] = Field(default_factory=dict, repr=False, description=(
        "Per-cache_salt shares overriding default_share, e.g. {tenant-a: 0.5}; the salts appear in metrics and "
        "dumps only as 12-hex-digit digests."))
    no_salt_share: float | None = Field(None, description=(
        "Share of requests without a cache_salt (one tenant); unset = default_share (or none)."))
    top_tenants: int = Field(8, ge=1, le=MAX_TOP_TENANTS, description=(
        "Tenants labelled by digest in the per-tenant metrics (the largest; 1 to 64); the rest are summed as "
        "'other'."))

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, values: object) -> object:
        if not isinstance(values, (Mapping, QuotaSettings)):  # pydantic turns only ValueError into its error
            raise ValueError(  # noqa: TRY004
                'tenant_quotas must be a mapping of its keys to values, e.g. {"default_share": 0.2, '
                '"salts": {"tenant-a": 0.5}}')
        if isinstance(values, Mapping):
            known = list(cls.model_fields)
            for key in values:
                if key not in known:
                    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
                    hint = f" (did you mean {close[0]!r}?)" if close else ""
                    raise ValueError(f"unknown key {key!r}{hint}; tenant_quotas takes {', '.join(known)}")
        return values

    @field_validator("default_share", "no_salt_share", mode="before")
    @classmethod
    def _share(cls, value: object) -> object:
        problem = None if value is None else _share_error(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("salts", mode="before")
    @classmethod
    def _salts(cls, value: object) -> object:
        if not isinstance(value, Mapping):
            return value  # pydantic's own sentence: a mapping of salt to share
        for salt, share in value.items():
            if not isinstance(salt, str) or not salt.strip():
                raise ValueError("tenant_quotas.salts has an empty, blank or non-text salt; give each cache_salt "
                                 "as the non-blank text requests send")
            problem = _share_error(share)
            if problem:
                raise ValueError(f"the share {share!r} of a salt {problem}")
        return value

    @field_validator("top_tenants", mode="before")
    @classmethod
    def _top_tenants(cls, value: object) -> object:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() \
                or not 1 <= value <= MAX_TOP_TENANTS:
            raise ValueError(f"must be a whole number from 1 to {MAX_TOP_TENANTS} (tenants named in the metrics; "
                             "the limit keeps the number of series bounded), e.g. 8")
        return int(value)

    @model_validator(mode="after")
    def _sum(self) -> QuotaSettings:
        listed = sum(self.salts.values()) + self.no_salt_guarantee
        if listed > 1 + 1e-9:
            parts = [f"salts {sum(self.salts.values()):g}"] if self.salts else []
            if self.no_salt_share is not None:
                parts.append(f"no_salt_share {self.no_salt_share:g}")
            elif self.default_share is not None:
                parts.append(f"no_salt_share {self.default_share:g} inherited from default_share")
            raise ValueError(f"the guaranteed shares sum to {listed:g}, over 1 ({' + '.join(parts)}); lower them "
                             "so their sum is at most 1, as each is a guaranteed share of the same tier")
        return self

    @property
    def no_salt_guarantee(self) -> float:
        """The share requests without a ``cache_salt`` are guaranteed: ``no_salt_share``, else
        ``default_share``; 0 when neither is set."""
        share = self.no_salt_share if self.no_salt_share is not None else self.default_share
        return share or 0.0

    def turns_nothing_on(self) -> bool:
        """Whether no tenant gets a share (no ``default_share``, ``no_salt_share`` or ``salts``)."""
        return self.default_share is None and self.no_salt_share is None and not self.salts

    def shares(self) -> dict[bytes, float]:
        """Tenant key (salt digest, :data:`NO_SALT` for none) -> share, for the listed tenants."""
        out = {salt_digest(salt): share for salt, share in self.salts.items()}
        if self.no_salt_share is not None:
            out[NO_SALT] = self.no_salt_share
        return out

    def public(self) -> dict[str, object]:
        """The settings with each salt replaced by its :func:`tenant_label` (safe to export)."""
        return {"default_share": self.default_share, "no_salt_share": self.no_salt_share,
                "top_tenants": self.top_tenants,
                "salts": {tenant_label(salt_digest(s)): v for s, v in sorted(self.salts.items())}}


class TenantLedger:
    """Who owns each chunk of one tier, per-tenant counts, and the quota's victim choice.

    Args:
        settings: the configured quotas.
        capacity_chunks: chunks the tier holds at most (guarantees are ``floor(share × this)``).

    Not thread-safe: the owner (the store, under its lock) serialises calls.
    """

    def __init__(self, settings: QuotaSettings, capacity_chunks: int) -> None:
        self.settings = settings
        self.capacity_chunks = capacity_chunks
        self._shares = settings.shares()
        self.owner: dict[ChunkKey, bytes] = {}
        self.chunks: Counter[bytes] = Counter()
        self.quota_evictions = 0

    def share(self, tenant: bytes) -> float | None:
        """``tenant``'s configured share of the tier (``None``: it has none, best effort)."""
        return self._shares.get(tenant, self.settings.default_share)

    def guarantee(self, tenant: bytes) -> int:
        """Chunks of the tier no other tenant's save may take from ``tenant`` (0 without a share)."""
        share = self.share(tenant)
        return int(share * self.capacity_chunks + 1e-9) if share is not None else 0

    def add(self, key: ChunkKey, tenant: bytes | None) -> None:
        """``key`` entered the tier for ``tenant`` (``None``: unknown, tracked by no tenant)."""
        self.remove(key)
        if tenant is not None:
            self.owner[key] = tenant
            self.chunks[tenant] += 1

    def remove(self, key: ChunkKey) -> None:
        """``key`` left the tier (unknown keys are ignored)."""
        tenant = self.owner.pop(key, None)
        if tenant is not None:
            self.chunks[tenant] -= 1
            if self.chunks[tenant] <= 0:
                del self.chunks[tenant]

    def clear(self) -> None:
        self.owner.clear()
        self.chunks.clear()

    def above_guarantee(self, key: ChunkKey) -> bool:
        """Whether evicting ``key`` leaves its tenant at or above its guarantee (an unknown
        tenant has none)."""
        tenant = self.owner.get(key)
        return tenant is None or self.chunks[tenant] > self.guarantee(tenant)

    def victim(self, policy: EvictionPolicy, evictable: Callable[[ChunkKey], bool],
               tenant: bytes | None) -> ChunkKey | None:
        """The chunk to evict so that ``tenant`` (``None``: unknown, e.g. a spill ahead of time)
        gets a page, by the rules of the module docstring; ``None`` if no chunk may go.  Counts
        ``quota_evictions`` when it is not the policy's own first choice.  Does not evict."""
        plain = policy.victim(evictable)
        if plain is None:
            return None
        owner = self.owner

        def own(key: ChunkKey) -> bool:
            return tenant is not None and owner.get(key) == tenant

        def own_victim() -> ChunkKey | None:
            return plain if own(plain) else policy.victim(lambda k: own(k) and evictable(k))

        if tenant is None or self.share(tenant) is None:  # no share: the policy's order among what may go
            chosen = plain if own(plain) or self.above_guarantee(plain) else \
                policy.victim(lambda k: (own(k) or self.above_guarantee(k)) and evictable(k))
            if chosen is not None and chosen != plain:
                self.quota_evictions += 1
            return chosen
        at_share = self.chunks[tenant] >= self.guarantee(tenant)
        chosen = own_victim() if at_share else None  # 1. at its share: its own first
        if chosen is None:  # 2. a chunk of another tenant above its guarantee (or of no known tenant)
            chosen = plain if not own(plain) and self.above_guarantee(plain) else \
                policy.victim(lambda k: not own(k) and self.above_guarantee(k) and evictable(k))
        if chosen is None and not at_share:  # 3. under its share, nobody above theirs: its own
            chosen = own_victim()
        if chosen is not None and chosen != plain:
            self.quota_evictions += 1
        return chosen

    def usage_by_label(self, chunk_bytes: int, unknown_chunks: int = 0) -> dict[str, int]:
        """Bytes held per tenant label: the ``top_tenants`` largest by name, the rest summed as
        :data:`OTHER_LABEL`, chunks of no known tenant as :data:`UNKNOWN_LABEL` (bounded: at most
        ``top_tenants + 2`` labels)."""
        ranked = sorted(self.chunks.items(), key=lambda item: (-item[1], item[0]))
        top = self.settings.top_tenants
        out = {tenant_label(t): n * chunk_bytes for t, n in ranked[:top]}
        rest = sum(n for _t, n in ranked[top:])
        if rest:
            out[OTHER_LABEL] = rest * chunk_bytes
        if unknown_chunks > 0:
            out[UNKNOWN_LABEL] = unknown_chunks * chunk_bytes
        return out

    def check(self, keys: Iterable[ChunkKey]) -> None:
        """Assert the counts match the owners and every owned key is held (``keys``: the tier's)."""
        held = set(keys)
        stray = [k for k in self.owner if k not in held]
        assert not stray, f"tenant ledger tracks {len(stray)} chunks the tier does not hold"
        assert Counter(self.owner.values()) == self.chunks, "tenant ledger counts disagree with its owners"


def tenant_stats(ledger: TenantLedger | None, num_chunks: int, chunk_bytes: int) -> dict[str, Any]:
    """A tier's per-tenant bytes and quota evictions for its :class:`~kvtier.core.stats.TierStats`
    (empty without quotas)."""
    if ledger is None:
        return {}
    return {"tenant_used_bytes": ledger.usage_by_label(chunk_bytes, num_chunks - len(ledger.owner)),
            "quota_evictions": ledger.quota_evictions}
