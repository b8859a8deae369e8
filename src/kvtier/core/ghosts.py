"""Ghost lists: the keys a tier recently lost, and why, so that a miss can say ``evicted`` rather
than ``new`` (issue 35).

A :class:`GhostList` per local tier remembers the last ``limit`` keys the tier let go of (evicted,
removed from outside by a purge or another engine, dropped by a reset, failed verification) and,
for a save that never got in, why (``not_admitted``, ``save_dropped``, ``quota``).  It is the
"ghost" queue of ARC (Megiddo & Modha, FAST 2003: B1/B2) and S3-FIFO (Yang et al., SOSP 2023: the
ghost FIFO G): keys only, no values, so a tier of ``n`` chunks keeps ``n`` keys more (about 100
bytes each).  ``limit`` is the tier's capacity in chunks (1x), so the list remembers about as many
chunks as the tier holds.

No lock, no threads, no I/O: the index calls it under its own lock (:mod:`kvtier.core.index`).  A load's
promotion runs none of it unless it finds a ghost (``Ghosts.take``): the index lists its victims' ghosts
itself, with ``GhostList.add``'s steps (``Index._evict_many``), for the reason ``IndexUpkeep.top_loss`` gives.

**Distance.** The list counts the bytes the tier evicted (``evicted_bytes``, only real evictions).
When a key is asked for again (saved again, or promoted back from a lower tier) while its ghost is
still listed, that is a *ghost hit*, and ``evicted_bytes - at`` (the bytes the tier evicted after
this key and before it was wanted again) is its *distance*: a tier larger by that many bytes would
have kept it (for an LRU-like order; Mattson et al., IBM Systems Journal 1970, stack distance).
``kvtier doctor`` sizes a tier from these distances: capacity + a high quantile of the distance
holds the working set.  Exported as ``kvtier_ghost_hit_distance_bytes{tier}``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from kvtier.core.keys import ChunkKey
from kvtier.core.receipt import MissReason

DISTANCE_BUCKETS_BYTES: tuple[float, ...] = tuple(float(64 << (10 + 2 * i)) for i in range(15))
"""Buckets of ``kvtier_ghost_hit_distance_bytes``: 64 KiB × 4^i, up to 16 TiB."""

PENDING_DISTANCES = 4096
"""Ghost-hit distances kept between two drains (:meth:`Ghosts.take_distances`) at most; more are dropped."""

EVICTION_REASONS = frozenset({"evicted", "quota"})
"""Ghost reasons of a real eviction (the only ones with a distance)."""


class Ghost(NamedTuple):
    """Why a tier lost a key: ``reason`` about ``tier`` (the tier the reason names: a write-back
    victim the disk's admission refused is the cpu tier's ghost with ``("not_admitted", "disk")``),
    ``at`` the list's ``evicted_bytes`` when it was added, ``seq`` the order it was added in over
    all of the store's lists (the latest loss is the one that made the key unavailable)."""

    reason: MissReason
    tier: str
    at: int
    seq: int


class GhostList:
    """One tier's recently lost keys (see the module docstring).

    Args:
        name: the tier's name.
        limit: keys kept at most (the tier's capacity in chunks); at least 1.
        stored_bytes: bytes one chunk takes in the tier (what an eviction frees).
    """

    def __init__(self, name: str, limit: int, stored_bytes: int) -> None:
        self.name = name
        self.limit = max(int(limit), 1)
        self.stored_bytes = stored_bytes
        self.evicted_bytes = 0
        self.keys: OrderedDict[ChunkKey, Ghost] = OrderedDict()

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.keys

    def add(self, key: ChunkKey, reason: MissReason, seq: int, tier: str | None = None) -> None:
        """Remember that the tier lost ``key`` for ``reason`` (an eviction also counts its bytes; the same steps
        as ``Index._evict_many``'s for a promotion's victims)."""
        if reason in EVICTION_REASONS:
            self.evicted_bytes += self.stored_bytes
        keys = self.keys
        keys.pop(key, None)
        keys[key] = Ghost(reason, self.name if tier is None else tier, self.evicted_bytes, seq)
        if len(keys) > self.limit:
            keys.popitem(last=False)

    def mark(self, key: ChunkKey, reason: MissReason, tier: str) -> None:
        """Change the reason of ``key``'s ghost if it is listed as ``evicted`` (a write-back
        victim's write was dropped: it went nowhere)."""
        ghost = self.keys.get(key)
        if ghost is not None and ghost.reason == "evicted":
            self.keys[key] = ghost._replace(reason=reason, tier=tier)

    def get(self, key: ChunkKey) -> Ghost | None:
        return self.keys.get(key)

    def take(self, key: ChunkKey) -> tuple[Ghost, int | None] | None:
        """Forget ``key`` (it is wanted again); its ghost and distance in bytes (``None`` for a
        loss that was not an eviction), or ``None`` when it is not listed."""
        ghost = self.keys.pop(key, None)
        if ghost is None:
            return None
        return ghost, (self.evicted_bytes - ghost.at if ghost.reason in EVICTION_REASONS else None)


class Ghosts:
    """Every local tier's :class:`GhostList` of one store, and the ghost hits' distances since
    the last drain.  Called under the index's lock.

    Args:
        lists: one per local tier, top tier first.
        observe: ``observe(tier, distance_bytes)`` on each ghost hit of an eviction (the store's
            ``kvtier_ghost_hit_distance_bytes`` histogram); ``None``: none.
    """

    def __init__(self, lists: Iterable[GhostList], observe: Callable[[str, float], None] | None = None) -> None:
        self.lists = {g.name: g for g in lists}
        self.observe = observe
        self.seq = 0
        self.hits: dict[str, int] = dict.fromkeys(self.lists, 0)
        self.distances: list[tuple[str, int]] = []  # (tier, bytes) since the last take_distances

    def add(self, name: str, key: ChunkKey, reason: MissReason, tier: str | None = None) -> None:
        """Tier ``name`` lost ``key`` for ``reason`` (about ``tier``, default ``name``)."""
        ghosts = self.lists.get(name)
        if ghosts is not None:
            self.seq += 1
            ghosts.add(key, reason, self.seq, tier)

    def add_many(self, name: str, keys: Sequence[ChunkKey], reason: MissReason) -> None:
        """:meth:`add` for each of ``keys`` (only the last ``limit`` are kept anyway)."""
        ghosts = self.lists.get(name)
        if ghosts is None:
            return
        for key in keys[-ghosts.limit:]:
            self.seq += 1
            ghosts.add(key, reason, self.seq)

    def take(self, name: str, key: ChunkKey) -> Ghost | None:
        """``key`` is back in tier ``name`` (promoted into it): forget its ghost there, counting a
        ghost hit and its distance."""
        ghosts = self.lists.get(name)
        got = ghosts.take(key) if ghosts is not None else None
        if got is None:
            return None
        ghost, distance = got
        self._hit(name, distance)
        return ghost

    def take_all(self, key: ChunkKey) -> Ghost | None:
        """``key`` is saved again: forget it in every list (each a ghost hit); the latest loss, or
        ``None`` when no list remembers it (it is ``new``)."""
        latest: Ghost | None = None
        for name, ghosts in self.lists.items():
            got = ghosts.take(key)
            if got is not None:
                ghost, distance = got
                self._hit(name, distance)
                if latest is None or ghost.seq > latest.seq:
                    latest = ghost
        return latest

    def latest(self, key: ChunkKey, names: Iterable[str] | None = None) -> Ghost | None:
        """The latest loss of ``key`` over the lists ``names`` (all: ``None``), forgetting nothing."""
        found = (self.lists[n].get(key) for n in (self.lists if names is None else names) if n in self.lists)
        return max((g for g in found if g is not None), key=lambda g: g.seq, default=None)

    def _hit(self, name: str, distance: int | None) -> None:
        self.hits[name] += 1
        if distance is None:
            return
        if self.observe is not None:
            self.observe(name, distance)
        if len(self.distances) < PENDING_DISTANCES:
            self.distances.append((name, distance))

    def take_distances(self) -> list[tuple[str, int]]:
        """Ghost hits' ``(tier, distance bytes)`` since the last call."""
        out, self.distances = self.distances, []
        return out

