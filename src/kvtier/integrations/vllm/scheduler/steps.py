"""What the scheduler side keeps across engine steps, one object each per engine: the mirror of
every rank's index (:class:`IndexMirror`, from the ranks' reports), this step's budget of
synchronous loads (:class:`SyncBudget`), the deferred saves still running (:class:`DeferredSaves`)
and whether an idle engine should keep stepping (:class:`Settle`); each step is begun
(:func:`begin_step`) and its reports folded (:func:`fold_reports`) in one call.  One request's state is
:mod:`~kvtier.integrations.vllm.scheduler.requests`'.

Design (why each exists, what vLLM does around it): docs/scheduler.md § The mirror, § Synchronous
loads, § Deferred saves, § Settling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.tiers.factory import shared_configured
from kvtier.core.tiers.registry import spec, tier_rank, top_tier
from kvtier.integrations.vllm.protocol import KVTierWorkerMeta, RankReport

log = logging.getLogger(__name__)


class IndexMirror:
    """Key → tier per rank, for ``tp_size`` ranks.

    Args:
        tp_size: tensor-parallel ranks whose reports are expected (> 0).
    """

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self.ranks: list[dict[bytes, str]] = [{} for _ in range(tp_size)]  # key -> tier, per rank (read by the
        # dense lookup, PagePlanner.lookup, in one pass; changed only by apply and reset)
        self._snapshotted = [False] * tp_size
        self.key_root: bytes | None = None
        self.broken = False
        self.namespaces: list[bytes] = [b""] * tp_size
        self.epoch = 0  # resets so far (reset); older reports are dropped
        self.ready = False
        """Every rank sent its first snapshot and all agree on the key root (kept by :meth:`apply`,
        which alone changes either: read at every ask, it is an attribute, not a property)."""

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
            self.broken, self.ready = True, False
            log.error("kvtier: tensor-parallel rank %d chains chunk keys from another namespace than rank 0 "
                      "(different model files or settings per rank?); kvtier loads are off for this engine", rank)
        if report.namespace:
            self.namespaces[rank] = report.namespace
        index = self.ranks[rank]
        if report.full:
            index.clear()
            self._snapshotted[rank] = True
            self.ready = all(self._snapshotted) and not self.broken
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
            for key in self.ranks[0]:
                tier = self.tier(key)
                if tier is not None:
                    held.setdefault(tier, []).append(key)
        self.epoch = epoch
        for index in self.ranks:
            index.clear()
        return held

    def tier(self, key: bytes) -> str | None:
        """Tier of ``key`` if every rank holds it (the slowest of theirs), else ``None``."""
        if not self.ready:
            return None
        if self.tp_size == 1:
            return self.ranks[0].get(key)
        tiers = [r.get(key) for r in self.ranks]
        if None in tiers:
            return None
        return max(tiers, key=tier_rank)


def bytes_per_token(kv_cache_config: Any) -> int:
    """KV bytes one token takes in one rank's engine cache, every layer of every group
    (``kv_cache_spec.page_size_bytes`` is one layer's block): what a synchronous load copies per token."""
    total = 0
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        total += -(-int(spec.page_size_bytes) * len(group.layer_names) // int(spec.block_size))
    return max(total, 1)


def sync_tiers(config: KVTierConfig) -> frozenset[str]:
    """The tiers a synchronous load reads: the top (cpu) tier, and with ``sync_shared_loads`` the first
    shared tier when it answers from this host's memory (``answers_now``: the node pool, whose pin is
    one local round trip, bounded on the engine's thread by ``shared_deadline_s``)."""
    shared = shared_configured(config)
    if config.sync_shared_loads and shared and "answers_now" in spec(shared[0]).capabilities:
        return frozenset({top_tier(), shared[0]})
    return frozenset({top_tier()})


class SyncBudget:
    """This step's bytes for synchronous loads, promised to the requests answered ``(n, False)``.

    Args:
        step_bytes: ``sync_load_max_bytes`` (0: synchronous loads off).
        bytes_per_token: :func:`bytes_per_token` of the engine.
        tiers: the tiers a synchronous load reads (:func:`sync_tiers`; a chunk elsewhere loads asynchronously).
        chunk_tokens: tokens per chunk.
    """

    def __init__(self, step_bytes: int, bytes_per_token: int, tiers: frozenset[str], chunk_tokens: int) -> None:
        self.step_bytes = step_bytes
        self.bytes_per_token = bytes_per_token
        self.tiers = tiers
        self.chunk_tokens = chunk_tokens
        self.left_bytes = step_bytes  # this step's budget not yet promised
        self.promised: dict[str, int] = {}
        """Requests answered ``(n, False)`` this step -> bytes promised (empty: nothing to give back or take)."""

    @classmethod
    def of(cls, config: KVTierConfig, kv_cache_config: Any, on: bool) -> SyncBudget:
        """The engine's budget: ``sync_load_max_bytes`` when ``on`` (one full-attention KV cache group,
        loads enabled), over :func:`sync_tiers`; ``config.chunk_tokens`` resolved."""
        return cls(int(config.sync_load_max_bytes) if on else 0, bytes_per_token(kv_cache_config),
                   sync_tiers(config), int(config.chunk_tokens))

    def offer(self, req_id: str, tiers: list[str], num_computed_tokens: int, hit: int) -> bool:
        """Promise the load of tokens ``[num_computed_tokens, hit)`` to ``req_id`` in this step when
        every chunk to load is in :attr:`tiers` (by the plan) and its copy fits what is left."""
        if not self.step_bytes:
            return False
        need = (hit - num_computed_tokens) * self.bytes_per_token
        if need > self.left_bytes:
            return False
        first = num_computed_tokens // self.chunk_tokens  # every chunk from there in a tier read synchronously
        if not self.tiers.issuperset(tiers[first:]):
            return False
        self.left_bytes -= need
        self.promised[req_id] = need
        return True

    def give_back(self, req_id: str) -> bool:
        """Take back ``req_id``'s promise (asked again, not allocated, or finished); whether it had one."""
        promised = self.promised.pop(req_id, None)
        if promised is None:
            return False
        self.left_bytes += promised
        return True

    def taken(self, req_id: str) -> bool:
        """``req_id``'s load job was built: whether it was promised this step (a synchronous load)."""
        return self.promised.pop(req_id, None) is not None

    def new_step(self) -> None:
        """The next step's budget, whole."""
        self.left_bytes = self.step_bytes
        self.promised.clear()


class DeferredSaves:
    """Deferred save jobs not yet reported ended by every rank (design: docs/scheduler.md § Deferred saves).

    Args:
        tp_size: tensor-parallel ranks, each of which reports every job.
    """

    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size
        self._next = 0
        self._open: dict[int, tuple[str, set[int]]] = {}  # seq -> (request, ranks yet to report it)
        self.by_req: dict[str, set[int]] = {}
        """Requests with a deferred save not yet reported ended by every rank -> its open numbers."""
        self._held: set[str] = set()  # finished and held, for the next step's metadata

    def ship(self, req_id: str) -> int:
        """A deferred save job of ``req_id`` is shipped: its number."""
        seq, self._next = self._next, self._next + 1
        self._open[seq] = (req_id, set(range(self.tp_size)))
        self.by_req.setdefault(req_id, set()).add(seq)
        return seq

    def ended(self, rank: int, seqs: Iterable[int]) -> None:
        """``rank`` reports the jobs ``seqs`` ended (numbers not open any more are ignored)."""
        for seq in seqs:
            entry = self._open.get(seq)
            if entry is None:
                continue
            req_id, ranks = entry
            ranks.discard(rank)
            if not ranks:
                del self._open[seq]
                left = self.by_req.get(req_id)
                if left is not None:
                    left.discard(seq)
                    if not left:
                        del self.by_req[req_id]

    def running(self, req_id: str) -> bool:
        """A deferred save of ``req_id`` has not been reported ended by every rank."""
        return bool(self.by_req.get(req_id))

    def forget(self, req_id: str) -> None:
        """Drop ``req_id``'s numbers (preempted: the workers wait for its saves in ``handle_preemptions``)."""
        for seq in self.by_req.pop(req_id, ()):
            self._open.pop(seq, None)

    def finish(self, req_id: str) -> bool:
        """``request_finished``: True (hold the blocks; named in the next ``held``) when a save runs."""
        running = self.running(req_id)
        self.forget(req_id)
        if running:
            self._held.add(req_id)
        return running

    def take_held(self) -> frozenset[str]:
        """The requests held since the last call (for this step's metadata)."""
        held, self._held = frozenset(self._held), set()
        return held


SETTLE_S = 10.0  # longest an idle engine keeps stepping for kvtier, seconds
IDLE_STEP_S = 0.01  # pause of a step taken only to settle, seconds


class Settle:
    """Whether the engine should keep stepping for kvtier's sake (design: docs/scheduler.md § Settling).

    Args:
        settle_s: longest the engine steps with no scheduled work, seconds.
        clock: monotonic clock (seconds).
        more: other work that wants steps (the KV events still to publish,
            :meth:`~kvtier.integrations.vllm.scheduler.events.KVEventTracker.pending`), within the same bound.
    """

    def __init__(self, settle_s: float = SETTLE_S, clock: Callable[[], float] = time.monotonic,
                 more: Callable[[], bool] | None = None) -> None:
        self.settle_s = settle_s
        self._more = more
        self._clock = clock
        self._reported = False
        self._busy: set[int] = set()  # ranks whose last report said busy
        self._idle_since: float | None = None  # first step with no scheduled work, after the last busy one
        self._gave_up = False

    def observe(self, meta: object) -> None:
        """Fold one step's worker → scheduler metadata (any type; only kvtier's is read)."""
        if not isinstance(meta, KVTierWorkerMeta):
            return
        for rank, report in meta.ranks.items():
            self._reported = True
            if report.busy:
                self._busy.add(rank)
            else:
                self._busy.discard(rank)

    def wanted(self) -> bool:
        """The workers' numbers are not settled yet: the first report is missing or a rank is busy."""
        return not self._reported or bool(self._busy) or (self._more is not None and self._more())

    def pending(self) -> bool:
        """``has_pending_push_work``: settle wanted and the idle window not spent."""
        if not self.wanted():
            return False
        if self._idle_since is not None and self._clock() - self._idle_since > self.settle_s:
            if not self._gave_up:
                self._gave_up = True
                what = ("no worker has reported yet" if not self._reported
                        else f"ranks {sorted(self._busy)} still report pinned chunks" if self._busy
                        else "KV events still wait to be published")
                log.warning("kvtier: %s %.0f s after the engine went idle; kvtier's gauges may be stale until "
                            "the next request", what, self.settle_s)
            return False
        return True

    def step(self, idle: bool) -> None:
        """Called once per engine step: ``idle`` when the step scheduled no token and kvtier knows
        of no request (none waiting for a load either).  A step taken only to settle pauses
        :data:`IDLE_STEP_S` so that settling does not spin a core; a step with work never does."""
        if not idle:
            self._idle_since = None
            self._gave_up = False
            return
        if self._idle_since is None:
            self._idle_since = self._clock()
        if self.wanted() and not self._gave_up:
            time.sleep(IDLE_STEP_S)


def begin_step(sync: SyncBudget, settle: Settle, deferred: DeferredSaves, preempted: Iterable[str],
               idle: bool) -> frozenset[str]:
    """The engine-wide state at a step's start (``build_connector_meta``), in one call: the requests
    held since the last step (returned, for this step's metadata), the ``preempted`` requests' deferred
    saves forgotten (the workers wait for them in ``handle_preemptions``, before the forward),
    :meth:`Settle.step` (``idle``: no token scheduled and no request known) and the synchronous
    loads' budget whole again."""
    held = deferred.take_held()
    for req_id in preempted:
        deferred.forget(req_id)
    settle.step(idle)
    sync.new_step()
    return held


def fold_reports(meta: object, mirror: IndexMirror, settle: Settle, deferred: DeferredSaves) -> None:
    """One step's worker → scheduler metadata (any type; only kvtier's is read) into the engine-wide
    state: settling, then each rank's index changes into the mirror and its ended deferred saves."""
    settle.observe(meta)
    if isinstance(meta, KVTierWorkerMeta):
        for rank in sorted(meta.ranks):
            mirror.apply(rank, meta.ranks[rank])
            deferred.ended(rank, meta.ranks[rank].saves_ended)
