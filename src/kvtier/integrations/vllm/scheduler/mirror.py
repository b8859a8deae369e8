"""The scheduler's in-memory mirror of every rank's store index.

Fed only by the :class:`~kvtier.integrations.vllm.protocol.RankReport` s that vLLM carries back
from the workers each step; read by ``get_num_new_matched_tokens`` without any I/O.

- One view for all tensor-parallel ranks: a chunk is available only when **every** rank holds
  it (each rank stores its own KV heads of it).  Its tier, for vLLM's hit-source metrics, is the
  slowest tier any rank holds it in (the registry's order, :func:`~kvtier.core.tiers.registry.slowest`).
- The mirror is ready once every rank has sent its first full snapshot (sent at the first step
  after start-up, so a restarted engine knows its disk tier before its first request is admitted).
- All ranks must chain keys from the same root; a rank reporting another root disables loads
  (logged once) rather than risk loading under the wrong keys.
- Each rank's store namespace digest (its report's ``namespace``) is kept for the shared tier,
  whose keys carry it (:mod:`kvtier.integrations.vllm.scheduler.remote`).
- A reset (:meth:`IndexMirror.reset`) empties every rank's view at once and raises the mirror's
  epoch: reports of an older epoch (sent before the rank applied the reset order) are dropped, so
  nothing held before the reset is planned as a hit again; a rank's first report of the new epoch
  is a full snapshot of its cleared store.
- The mirror may lag the stores by a step or more (evictions happen meanwhile): a mirror hit is a
  promise the worker checks; a chunk gone since is reported as a load error and recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from collections.abc import Set as AbstractSet

from kvtier.core.tiers.registry import tier_rank
from kvtier.integrations.vllm.protocol import RankReport

log = logging.getLogger(__name__)



class IndexMirror:
    """Key → tier per rank, for ``tp_size`` ranks.

    Args:
        tp_size: tensor-parallel ranks whose reports are expected (> 0).
    """

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._ranks: list[dict[bytes, str]] = [{} for _ in range(tp_size)]
        self._snapshotted = [False] * tp_size
        self.key_root: bytes | None = None
        self.broken = False
        self.namespaces: list[bytes] = [b""] * tp_size
        self.epoch = 0  # resets so far (reset); older reports are dropped

    @property
    def ready(self) -> bool:
        """Every rank sent its first snapshot and all agree on the key root."""
        return all(self._snapshotted) and not self.broken

    def apply(self, rank: int, report: RankReport) -> None:
        """Fold one rank's report in (in step order)."""
        if not 0 <= rank < self.tp_size:
            log.warning("kvtier: report from tensor-parallel rank %d of %d ignored", rank, self.tp_size)
            return
        if report.epoch < self.epoch:
            return  # the rank has not applied the reset yet: its news is of the store before it
        if self.key_root is None:
            self.key_root = report.key_root
        elif report.key_root != self.key_root and not self.broken:
            self.broken = True
            log.error("kvtier: tensor-parallel rank %d chains chunk keys from another namespace than rank 0 "
                      "(different model files or settings per rank?); kvtier loads are off for this engine", rank)
        if report.namespace:
            self.namespaces[rank] = report.namespace
        index = self._ranks[rank]
        if report.full:
            index.clear()
            self._snapshotted[rank] = True
        for key, tier in report.changes:
            if tier is None:
                index.pop(key, None)
            else:
                index[key] = tier

    def reset(self, epoch: int) -> dict[str, list[bytes]]:
        """Forget every rank's view and drop reports older than ``epoch`` from now on.

        Returns:
            what the mirror held, by tier (a chunk held by every rank, in the slowest of its tiers):
            what the scheduler had planned hits from until now.
        """
        held: dict[str, list[bytes]] = {}
        if self.ready:
            for key in self._ranks[0]:
                tier = self.tier(key)
                if tier is not None:
                    held.setdefault(tier, []).append(key)
        self.epoch = epoch
        for index in self._ranks:
            index.clear()
        return held

    def leading(self, keys: Sequence[bytes], first: int, shared: AbstractSet[bytes] = frozenset(),
                shared_tier: str = "") -> tuple[int, list[str]]:
        """A dense model's lookup (:meth:`~kvtier.integrations.vllm.scheduler.pages.PagePlanner.lookup`)
        in one call: ``end``, the end of the run of ``keys`` held from ``first`` on (every rank's
        local tiers, or ``shared`` in the shared tier ``shared_tier``), and the :meth:`tier` of each
        of ``keys[:end]`` (``""`` where none holds it, before ``first``); ``(0, [])`` when the run is empty."""
        tier = self._ranks[0].get if self.tp_size == 1 and self.ready else self.tier
        held = [tier(key) or (shared_tier if key in shared else None) for key in keys]
        end = first
        while end < len(keys) and held[end] is not None:
            end += 1
        return (end, [t or "" for t in held[:end]]) if end > first else (0, [])

    def tier(self, key: bytes) -> str | None:
        """Tier of ``key`` if every rank holds it (the slowest of theirs), else ``None``."""
        if not self.ready:
            return None
        if self.tp_size == 1:
            return self._ranks[0].get(key)
        tiers = [r.get(key) for r in self._ranks]
        if None in tiers:
            return None
        return max(tiers, key=tier_rank)
