"""What the index (:mod:`kvtier.core.index`) keeps for one tier below the top tier.

A :class:`LowerIndex` holds, for its tier: the eviction policy (local tiers only: a shared tier
evicts on its own), the admission policy, the pins of chunks being read or written, the tenant
ledger (``quota``, with ``tenant_quotas``, local tiers only), and the reset epoch at which the
tier was last cleared (:attr:`cleared_at`; the epoch itself is the index's, one counter).

It has no lock, no threads and no callbacks: the :class:`~kvtier.core.index.Index` calls it under
its own lock and notes every key a method returns in its change feed.  The tier's own key map
(``tier.contains``/``indexed``/``keys``/``usage``) is the record of what the tier holds; removing
an evicted chunk (``tier.delete``) happens here, under the index's lock, as the policy lets go of
it, so that the tier's usage and the policy never disagree.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

from kvtier.core.context import Counts
from kvtier.core.ghosts import Ghosts
from kvtier.core.keys import ChunkKey
from kvtier.core.policies import EvictionPolicy, make_policy
from kvtier.core.policies.admission import AdmissionPolicy, AdmitAll
from kvtier.core.quota import TenantLedger
from kvtier.core.tiers.base import ClearResult, ExactUsage, Generational, Tier

if TYPE_CHECKING:
    from kvtier.core.tiers.disk.scan import RescanResult

log = logging.getLogger("kvtier.core.store")


class LowerIndex:
    """One lower tier's placement state (see the module docstring).

    Args:
        tier: the tier.
        policy: eviction policy name (ignored for a shared tier).
        write_back: receive chunks on eviction from the top tier instead of at once.
        counters: the store's event counters (evictions).
    """

    def __init__(self, tier: Tier, policy: str, write_back: bool, counters: Counts) -> None:
        self.tier = tier
        self.name = tier.name
        self.shared = tier.shared
        self.write_back = write_back and not tier.shared
        self.policy: EvictionPolicy | None = None if tier.shared else make_policy(policy)
        self.admission: AdmissionPolicy = AdmitAll()  # the index sets the configured one
        self.quota: TenantLedger | None = None  # a local tier's tenant ledger, when quotas are configured
        self.pins: Counter[ChunkKey] = Counter()
        self.cleared_at = 0  # the index's epoch at this tier's last reset (a write planned before: dropped)
        self.ghosts: Ghosts | None = None  # the store's ghost lists (kvtier.core.ghosts), set by the index
        self._counters = counters
        self._generation = tier.generation if isinstance(tier, Generational) else 0
        if self.policy is not None:
            for key in tier.keys():  # noqa: SIM118 - a list, oldest first
                self.policy.insert(key, None)
            self.trim("at start-up")

    def holds(self, key: ChunkKey) -> bool:
        """Presence in a local tier (a shared tier is never asked synchronously)."""
        return not self.shared and self.tier.contains(key)

    def owner(self, key: ChunkKey) -> bytes | None:
        """The quota's tenant key of stored ``key`` (``None``: unknown, or no quotas)."""
        return self.quota.owner.get(key) if self.quota is not None else None

    def pin(self, key: ChunkKey) -> None:
        self.pins[key] += 1

    def unpin(self, key: ChunkKey) -> None:
        self.pins[key] -= 1
        if self.pins[key] <= 0:
            del self.pins[key]

    def forget(self, key: ChunkKey) -> None:
        """The tier dropped ``key`` (it failed verification, or another process removed it)."""
        if self.policy is not None:
            self.policy.remove(key)
        if self.quota is not None:
            self.quota.remove(key)

    def stored(self, key: ChunkKey, parent: ChunkKey | None, owner: bytes | None) -> None:
        """A write of ``key`` landed: track it."""
        if self.policy is not None:
            self.policy.insert(key, parent)
            if self.quota is not None:
                self.quota.add(key, owner)

    def evict(self, key: ChunkKey, quota: bool = False) -> None:
        """Drop ``key`` from the tier (an eviction, counted; ``quota``: the tenant quotas chose it)."""
        assert self.policy is not None
        self.tier.delete(key)
        self.forget(key)
        self._counters.evicted(self.name)
        if self.ghosts is not None:
            self.ghosts.add(self.name, key, "quota" if quota else "evicted")

    def make_room(self, size: int, tenant: bytes | None) -> tuple[bool, list[ChunkKey]]:
        """Evict until ``size`` more bytes fit; with quotas, victims chosen for ``tenant`` (the
        quota's tenant key of the chunk to write, ``None``: unknown).  Returns whether they fit
        and the keys evicted (gone even when they did not fit)."""
        evicted: list[ChunkKey] = []
        if self.policy is None:
            return True, evicted
        usage = self.tier.usage
        quota, policy, pins = self.quota, self.policy, self.pins

        def unpinned(key: ChunkKey) -> bool:
            return key not in pins

        while usage().used_bytes + size > usage().capacity_bytes:
            chose = quota.quota_evictions if quota is not None else 0
            victim = quota.victim(policy, unpinned, tenant) if quota is not None else policy.victim(unpinned)
            if victim is None:
                return False, evicted
            self.evict(victim, quota is not None and quota.quota_evictions != chose)
            evicted.append(victim)
        return True, evicted

    def trim(self, when: str) -> list[ChunkKey]:
        """Evict down to capacity when the tier holds more than it may (it was shrunk since, or
        other engines on its directory wrote more than this one may hold); returns the evicted keys."""
        assert self.policy is not None
        used = self.used_exact
        capacity = self.tier.usage().capacity_bytes
        before, evicted = used(), []
        while used() > capacity:
            victim = self.policy.victim()
            if victim is None:
                break
            self.evict(victim)
            evicted.append(victim)
        if evicted:
            # Chunks found at start-up beyond this tier's size: e.g. a directory shared with an
            # engine whose disk_gib is larger (each engine bounds the files it knows of).
            log.warning("kvtier: the %s tier held %.1f MiB %s, more than its %.1f MiB: evicted %d chunks "
                        "(%.1f MiB) to fit; other engines sharing this directory lose them too. Give every "
                        "engine on one directory the same size, or each its own directory",
                        self.name, before / 2**20, when, capacity / 2**20, len(evicted), (before - used()) / 2**20)
        return evicted

    def used_exact(self) -> int:
        """Bytes the tier holds, unclamped where it can say (:class:`~kvtier.core.tiers.base.ExactUsage`)."""
        tier = self.tier
        return tier.usage_exact() if isinstance(tier, ExactUsage) else tier.usage().used_bytes

    def adopt(self, found: RescanResult) -> tuple[list[ChunkKey], list[ChunkKey]]:
        """Take in a rescan (:meth:`~kvtier.core.tiers.base.Rescannable.scan`, read without the lock):
        adopted keys join the policy (then the tier is trimmed), removed ones leave it.  Returns
        ``(changed keys, evicted keys)``; the rescan's count is ``adopted + gone``."""
        assert self.policy is not None
        changed: list[ChunkKey] = []
        for key in found.adopted:
            if key not in self.policy:
                self.policy.insert(key, None)
            changed.append(key)
        for key in found.gone:  # removed from outside this engine: kvtier purge, or another engine's eviction
            self.forget(key)
            if self.ghosts is not None:
                self.ghosts.add(self.name, key, "purged")
            changed.append(key)
        evicted = self.trim("after adopting other engines' chunk files") if found.adopted else []
        return changed + evicted, evicted

    def lost_contents(self) -> bool:
        """Whether the tier lost its contents since last asked (a recreated directory); if so the
        policy and ledger now track only what the tier still indexes."""
        tier = self.tier
        generation = tier.generation if isinstance(tier, Generational) else 0
        if generation == self._generation or self.policy is None:
            return False
        self._generation = generation
        for key in list(self.policy.keys()):
            if not tier.indexed(key):
                self.forget(key)
        return True

    def clear(self, epoch: int) -> ClearResult:
        """A reset of this tier at the index's ``epoch``: writes planned before it are dropped,
        the tier is cleared (:meth:`~kvtier.core.tiers.base.Tier.clear`), the policy and ledger
        forget it.  Pins stay with their owners (a read in flight, dropped by the epoch)."""
        self.cleared_at = epoch
        result = self.tier.clear()
        if self.ghosts is not None:
            self.ghosts.add_many(self.name, result.keys, "reset")
        if self.policy is not None:
            for key in list(self.policy.keys()):
                self.policy.remove(key)
        if self.quota is not None:
            self.quota.clear()
        if isinstance(self.tier, Generational):
            self._generation = self.tier.generation  # cleared on purpose, not a vanished directory
        return result

    def check(self) -> None:
        """Assert the tier's accounting, usage ≤ capacity, that the policy tracks exactly the
        stored chunks (a chunk being written, pinned, is not tracked yet) and the ledger."""
        self.tier.check()
        if self.policy is None:
            return
        used = self.used_exact()
        capacity = self.tier.usage().capacity_bytes
        assert used <= capacity, f"{self.name} tier holds {used} bytes, more than its {capacity}"
        stored, tracked = set(self.tier.keys()), set(self.policy.keys())
        stray = tracked - stored
        assert not stray, f"{self.name} policy tracks {len(stray)} chunks that are not in the tier"
        untracked = stored - tracked - set(self.pins)
        assert not untracked, f"{self.name} tier holds {len(untracked)} chunks its eviction policy does not track"
        assert all(n > 0 for n in self.pins.values()), f"{self.name} has a pin count at or below 0"
        if self.quota is not None:
            self.quota.check(stored)
