"""What the scheduler side keeps across engine steps and requests, one object each per engine: the
chunk keys already computed (:class:`KeyMemo`), the mirror of every rank's index (:class:`IndexMirror`,
from the ranks' reports) and the pages of a hit, a load and a save planned from it
(:class:`PagePlanner`), the deferred saves still running (:class:`DeferredSaves`) and whether an idle
engine should keep stepping (:class:`Settle`); each step is begun (:func:`begin_step`) and its reports
folded (:func:`fold_reports`) in one call.  One request's state is
:mod:`~kvtier.integrations.vllm.scheduler.requests`'; this step's budget of synchronous loads,
:mod:`~kvtier.integrations.vllm.scheduler.side`'s ``SyncBudget``.

Design (why each exists, what vLLM does around it): docs/scheduler.md § Chunk keys, § The mirror,
§ Deferred saves, § Settling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from collections.abc import Set as AbstractSet
from itertools import islice, takewhile
from typing import Any, cast

from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.registry import slowest, tier_rank
from kvtier.integrations.vllm.cache_groups import NULL_BLOCK, GroupKind
from kvtier.integrations.vllm.protocol import KVTierWorkerMeta, PageMove, RankReport
from kvtier.integrations.vllm.scheduler.pages import HybridPlan, group_key

log = logging.getLogger(__name__)


KEY_MEMO_CHUNKS = 1 << 16
"""Chunk keys a :class:`KeyMemo` keeps (about 200 bytes each: ~13 MiB; past it the older half goes)."""

MEMO_HASH_ALGOS = frozenset({"sha256", "sha256_cbor"})
"""vLLM's ``prefix_caching_hash_algo`` values whose block hashes a :class:`KeyMemo` trusts: the
collision-resistant ones (vllm/config/cache.py warns that ``xxhash`` is not; with it, every key is hashed)."""


class KeyMemo:
    """Chunk keys already computed, found again by vLLM's block hash of the prefix each one ends.

    Why the memo exists and why its keys are the ones BLAKE3 would give: docs/scheduler.md § Chunk keys.

    Args:
        hash_block_size: tokens per vLLM block hash (``KVCacheConfig.hash_block_size``); ``None``
            or not dividing ``chunk_tokens``: the memo is off (:attr:`step` 0).
        chunk_tokens: tokens per chunk.
        hash_algo: vLLM's ``prefix_caching_hash_algo``; off unless one of :data:`MEMO_HASH_ALGOS`.
        limit: keys kept at most (:data:`KEY_MEMO_CHUNKS`).
    """

    def __init__(self, hash_block_size: int | None, chunk_tokens: int, hash_algo: str | None,
                 limit: int = KEY_MEMO_CHUNKS) -> None:
        usable = (hash_algo in MEMO_HASH_ALGOS and isinstance(hash_block_size, int) and hash_block_size > 0
                  and chunk_tokens % hash_block_size == 0)
        self.step = chunk_tokens // hash_block_size if usable and hash_block_size else 0
        self.limit = limit
        self._keys: dict[Any, tuple[bytes, bytes]] = {}  # vLLM block hash -> (root, chunk key)

    @classmethod
    def of_engine(cls, vllm_config: Any, kv_cache_config: Any, chunk_tokens: int) -> KeyMemo:
        """The memo of an engine: vLLM's ``KVCacheConfig.hash_block_size`` (set by the engine core
        before the scheduler is built) and ``CacheConfig.prefix_caching_hash_algo``."""
        return cls(getattr(kv_cache_config, "hash_block_size", None), chunk_tokens,
                   getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None))

    def known(self, root: bytes, block_hashes: Sequence[Any], start: int, end: int) -> list[bytes]:
        """Keys of chunks ``start ..`` up to ``end`` (exclusive) the memo holds for ``root``, up to the first it lacks."""
        step, out = self.step, []
        stop = min(end, len(block_hashes) // step if step else 0)  # each chunk's last block's hash, looked up in C
        for entry in map(self._keys.get, block_hashes[(start + 1) * step - 1:stop * step:step]) if stop > start else ():
            if entry is None or entry[0] != root:
                break
            out.append(entry[1])
        return out

    def add(self, root: bytes, block_hashes: Sequence[Any], start: int, keys: Sequence[bytes]) -> None:
        """Remember ``keys`` (of chunks ``start ..``) under ``root``, for the chunks vLLM has hashed."""
        if not self.step:
            return
        step, memo = self.step, self._keys
        for c, key in enumerate(keys, start):
            if (c + 1) * step > len(block_hashes):
                break
            memo[block_hashes[(c + 1) * step - 1]] = (root, key)
        if len(memo) > self.limit:  # the newer half stays (a dict keeps insertion order)
            self._keys = dict(islice(memo.items(), len(memo) - self.limit // 2, None))

    def __len__(self) -> int:
        return len(self._keys)


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
        self._woken = False  # a step owed to an order given while the engine was idle (a reset)

    def wake(self) -> None:
        """Step again in a fresh idle window: a reset's order and KV events go out only with a step."""
        self._woken, self._idle_since, self._gave_up = True, None, False

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
        """The workers' numbers are not settled (no report yet, a rank busy) or :meth:`wake` asked a step."""
        return self._woken or not self._reported or bool(self._busy) or (self._more is not None and self._more())

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
        self._woken = False
        if not idle:
            self._idle_since = None
            self._gave_up = False
            return
        if self._idle_since is None:
            self._idle_since = self._clock()
        if self.wanted() and not self._gave_up:
            time.sleep(IDLE_STEP_S)


def begin_step(settle: Settle, deferred: DeferredSaves, preempted: Iterable[str], idle: bool) -> frozenset[str]:
    """The engine-wide state at a step's start (``build_connector_meta``), in one call: the requests
    held since the last step (returned, for this step's metadata), the ``preempted`` requests' deferred
    saves forgotten (the workers wait for them in ``handle_preemptions``, before the forward),
    :meth:`Settle.step` (``idle``: no token scheduled and no request known)."""
    held = deferred.take_held()
    for req_id in preempted:
        deferred.forget(req_id)
    settle.step(idle)
    return held


def fold_reports(meta: object, mirror: IndexMirror, settle: Settle, deferred: DeferredSaves) -> None:
    """One step's worker → scheduler metadata (any type; only kvtier's is read) into the engine-wide
    state: settling, then each rank's index changes into the mirror and its ended deferred saves."""
    settle.observe(meta)
    if isinstance(meta, KVTierWorkerMeta):
        for rank in sorted(meta.ranks):
            mirror.apply(rank, meta.ranks[rank])
            deferred.ended(rank, meta.ranks[rank].saves_ended)


class PagePlanner:
    """The pages of one engine's load and save jobs, keyed, from the mirror (the plan arithmetic:
    :mod:`kvtier.integrations.vllm.scheduler.pages`).

    Args:
        plan: the engine's per-group plan.
        mirror: the scheduler's mirror of the ranks' indexes.
    """

    def __init__(self, plan: HybridPlan, mirror: IndexMirror) -> None:
        self.plan = plan
        self.mirror = mirror
        self.C = plan.chunk_tokens
        self.dense = not plan.is_hybrid

    def key(self, chain: Sequence[bytes], group: int, chunk: int) -> bytes:
        if self.dense:  # one full-attention group: the chunk key itself (the namespace tells it apart)
            return bytes(chain[chunk])
        return bytes(group_key(ChunkKey(chain[chunk]), group))

    def parent_of(self, chain: Sequence[bytes], page: PageMove) -> bytes:
        """Key of the page before ``page`` in its group's chain (``b""`` for chunk 0 and for the
        pages of groups that are not full attention)."""
        full = any(g.index == page.group and g.kind is GroupKind.FULL for g in self.plan.groups)
        return self.key(chain, page.group, page.chunk - 1) if full and page.chunk > 0 else b""

    def lookup(self, chain: Sequence[bytes], num_computed_tokens: int, num_tokens: int,
               shared: AbstractSet[bytes] = frozenset(), shared_tier: str = "") -> tuple[int, list[str]]:
        """The hit (tokens, 0 if none beyond ``num_computed_tokens``) and, per chunk before it,
        the slowest tier any of its pages is held in (for vLLM's hit-source metrics; ``""`` before the
        engine's own hit where kvtier holds none; in the hit, none kept: the next chunk's, below).

        ``shared``: page keys the shared tier ``shared_tier`` holds for every rank, from
        :meth:`~kvtier.integrations.vllm.scheduler.remote.RemoteLookups.poll_pages` over
        :func:`~kvtier.integrations.vllm.scheduler.remote.unheld_pages`.
        """
        if self.dense:  # one full-attention group: its pages are the chain's chunks, read in one pass
            keys = list(map(bytes, chain[:min(len(chain), max(0, num_tokens - 1) // self.C)]))
            mirror = self.mirror  # one rank: its map's C lookup (IndexMirror.tier's answer), else tier()
            held_in = mirror.ranks[0].get if mirror.tp_size == 1 and mirror.ready else mirror.tier
            # each chunk's tier, None (or "") where none holds it: mapped, counted and copied in C (the hit path)
            held = [held_in(key) or (shared_tier if key in shared else None) for key in keys] if shared \
                else list(map(held_in, keys))
            first = num_computed_tokens // self.C  # the run held from where the engine's hit ends
            end = first + len(list(takewhile(bool, held[first:])))
            if end <= first:
                return 0, []
            upto = held[:end]  # (a tier each from first on: the run; before it, "" where none held it)
            return end * self.C, cast("list[str]", upto) if all(upto[:first]) else [t or "" for t in upto]

        def tier(group: int, chunk: int) -> str | None:
            if chunk >= len(chain):
                return None
            key = self.key(chain, group, chunk)
            return self.mirror.tier(key) or (shared_tier if key in shared else None)

        hit = self.plan.hit_tokens(lambda g, c: tier(g, c) is not None, num_computed_tokens, num_tokens)
        tiers = [slowest([t for t in held if t]) if any(held) else ""
                 for held in ([tier(g.index, c) for g in self.plan.groups] for c in range(hit // self.C))]
        after = ""  # a chunk no group keeps KV for (every layer windowed): served by the next one held
        for c in range(len(tiers) - 1, num_computed_tokens // self.C - 1, -1):
            after = tiers[c] = tiers[c] or after
        return hit, tiers

    def load_pages(self, chain: Sequence[bytes], block_ids: Sequence[Sequence[int]], num_computed_tokens: int,
                   hit: int) -> tuple[PageMove, ...]:
        """Pages resuming every group at ``hit`` (``block_ids``: ``KVCacheBlocks.get_block_ids()``)."""
        if self.dense:  # one group: HybridPlan.pages_to_load's pages without a ChunkBlocks each (the hit path)
            ids, bs = block_ids[0], self.plan.groups[0].block_size
            k, lo, end = self.C // bs, num_computed_tokens // bs, hit // self.C
            if len(ids) >= hit // bs and NULL_BLOCK not in ids[lo:end * k]:
                return tuple(PageMove(bytes(chain[c]), 0, c, max(c * k, lo) - c * k,
                                      tuple(ids[max(c * k, lo):(c + 1) * k])) for c in range(lo // k, end))
        loads = [cb for g in self.plan.groups
                 for cb in self.plan.pages_to_load(g, num_computed_tokens, hit, block_ids[g.index])]
        return tuple(PageMove(self.key(chain, cb.group, cb.chunk), cb.group, cb.chunk, cb.first_slot, cb.block_ids)
                     for cb in loads)

    def save_pages(self, chain: Sequence[bytes], start_chunk: int, end_chunk: int,
                   block_ids: Sequence[Sequence[int]], handoffs: Sequence[tuple[int, int, int]],
                   num_prompt_tokens: int) -> tuple[PageMove, ...]:
        """Pages of chunks ``[start_chunk, end_chunk)`` worth storing, and the state snapshots
        vLLM handed over this step (``(group, block id, boundary tokens)``) at boundaries
        ``≤ end_chunk × chunk_tokens``."""
        plan = self.plan
        stored = [cb for g in plan.groups if g.kind is not GroupKind.STATE
                  for cb in plan.pages_to_store(g, start_chunk, end_chunk, block_ids[g.index], num_prompt_tokens)]
        stored += plan.state_pages(handoffs, end_chunk * self.C)
        return tuple(PageMove(self.key(chain, cb.group, cb.chunk), cb.group, cb.chunk, 0, cb.block_ids)
                     for cb in stored)
