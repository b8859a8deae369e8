"""Wrappers around a tier: cross-cutting behaviour without touching the tier (pebble's ``vfs``
and ``errorfs``, foyer's I/O engines).

- :class:`TierWrapper`: forwards every call to ``inner`` (the blob verbs ``get``, ``read_into``,
  ``get_range`` included); the base of the others.  Optional
  capabilities (:mod:`kvtier.core.tiers.base` protocols: rescan, generation, exact usage, pages)
  are forwarded too, so a wrapped tier has exactly its inner tier's (a wrapper is never a
  :class:`~kvtier.core.tiers.base.StagingTier`: the store's top tier is never wrapped).
- :class:`FaultyTier`: injects faults from a small list of :class:`Fault` rules, for tests and
  drills: an unreachable backend (``error``), a value that fails verification (``corrupt``), a
  short value (``truncate``), a slow call (``delay``).  Each injected fault returns what the
  contract says the tier returns for it (``MISS``/``CORRUPT``/``FAILED``), so what is tested is
  how the *callers* (the store, the engine integration) handle it.
- :class:`SlowTier`: a fixed delay per operation (a :class:`FaultyTier` of ``delay`` rules).
- :class:`~kvtier.core.tiers.guarded.GuardedTier` (its own module): deadlines, a circuit breaker
  and latency metrics for any remote tier.

:func:`unwrap` gives the innermost tier (tests that reach into a tier's storage).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvtier.core.keys import ChunkKey
from kvtier.core.stats import WireStats
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import ClearResult, GetResult, PutResult, Tier, TierUsage, writers

Op = Literal["contains", "get", "put", "delete"]
FaultKind = Literal["error", "raise", "corrupt", "truncate", "delay"]



MissWhy = dict[ChunkKey, str]
"""A read's per-key reasons for its ``MISS`` results, filled by wrappers that know one
(:class:`~kvtier.core.tiers.guarded.GuardedTier`: ``deadline``, ``breaker_open``, ``load_failed``;
:class:`FaultyTier`: ``load_failed``); a key not in it missed for the tier's own reason (absent)."""


def get_explained(tier: Tier, keys: Sequence[ChunkKey], dsts: Sequence[memoryview], records: TenantRecords | None,
                  why: MissWhy | None) -> list[GetResult]:
    """``tier.get_many(keys, dsts, records)``, asking a wrapper (:class:`TierWrapper`) to put in
    ``why`` the reason of each ``MISS`` it caused (a bare tier is asked without it)."""
    if why is not None and isinstance(tier, TierWrapper):
        return tier.get_many(keys, dsts, records, why=why)
    return tier.get_many(keys, dsts, records)

class TierWrapper(Tier):
    """A tier that forwards every call to ``inner`` (see the module docstring).

    ``name``, ``shared``, ``corrupt`` and ``write_errors`` are the inner tier's (plus what a
    subclass counts itself); other attributes, e.g. a capability's, are read from ``inner``.
    """

    def __init__(self, inner: Tier) -> None:
        super().__init__()
        self.inner = inner
        self.name = inner.name
        self.shared = inner.shared
        self._own_corrupt = 0
        self._own_write_errors = 0

    # counters: the inner tier's plus the faults this wrapper injected
    @property  # type: ignore[override]
    def corrupt(self) -> int:
        return self.inner.corrupt + self._own_corrupt

    @corrupt.setter
    def corrupt(self, value: int) -> None:  # Tier.__init__ sets it
        self._own_corrupt = value

    @property  # type: ignore[override]
    def write_errors(self) -> int:
        return self.inner.write_errors + self._own_write_errors

    @write_errors.setter
    def write_errors(self, value: int) -> None:
        self._own_write_errors = value

    def __getattr__(self, name: str) -> Any:
        # only reached for attributes this class lacks: a capability of the inner tier (scan,
        # adopt, generation, usage_exact, num_pages, path...), so protocol checks see the inner's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def contains(self, key: ChunkKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.inner.contains_many(keys)

    def indexed(self, key: ChunkKey) -> bool:
        return self.inner.indexed(key)

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        return self.get_many([key], [dst], records)[0]

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview],
                 records: TenantRecords | None = None, why: MissWhy | None = None) -> list[GetResult]:
        """The inner tier's; ``why`` (a wrapper's own output, :func:`get_explained`) reaches an inner wrapper."""
        return get_explained(self.inner, keys, dsts, records, why)

    def get(self, key: ChunkKey, records: TenantRecords | None = None) -> bytes | None:
        return self.inner.get(key, records)

    def read_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> int | None:
        return self.inner.read_into(key, dst, records)

    def get_range(self, key: ChunkKey, offset: int, length: int) -> bytes | None:
        return self.inner.get_range(key, offset, length)

    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        return self.put_many([key], [data], [tenant])[0]

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                 tenants: Sequence[Writer | None] | None = None) -> list[PutResult]:
        return self.inner.put_many(keys, datas, tenants)

    def delete(self, key: ChunkKey) -> bool:
        return self.delete_many([key])[0]

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        return self.inner.delete_many(keys)

    def keys(self) -> list[ChunkKey]:
        return self.inner.keys()

    def usage(self) -> TierUsage:
        return self.inner.usage()

    def stored_bytes(self, payload_bytes: int) -> int:
        return self.inner.stored_bytes(payload_bytes)

    def check(self) -> None:
        self.inner.check()

    def wire_stats(self) -> WireStats | None:
        return self.inner.wire_stats()

    def clear(self) -> ClearResult:
        return self.inner.clear()

    def close(self) -> None:
        self.inner.close()


def unwrap(tier: Tier) -> Tier:
    """The innermost tier under any wrappers."""
    while isinstance(tier, TierWrapper):
        tier = tier.inner
    return tier


@dataclass(frozen=True)
class Fault:
    """One fault rule of a :class:`FaultyTier`.

    Attributes:
        op: the operation it applies to (``contains``, ``get``, ``put``, ``delete``).
        kind: ``error`` (the backend cannot be reached: ``contains`` says absent, ``get`` is a
            ``MISS``, ``put`` is ``FAILED`` and counted in ``write_errors``, ``delete`` says
            ``False``; the inner tier is not called); ``raise`` (the call raises
            ``ConnectionError``, as a remote client does when its server is gone: what
            :class:`~kvtier.core.tiers.guarded.GuardedTier` counts as a failure); ``corrupt`` (``get`` only: the value failed
            verification: ``CORRUPT``, counted in ``corrupt``, and the inner tier forgets the key,
            as the contract says a tier does); ``truncate`` (``get``: the stored value is short,
            a ``MISS``, ``None`` from a blob verb; ``put``: the inner tier is given the data without its last half, so later
            reads of the full length miss); ``delay`` (wait ``delay_s`` seconds, then call the
            inner tier).
        keys: the keys it applies to; ``None`` for every key.
        times: how many calls (per key) it applies to; ``None`` for every call.
        delay_s: seconds of a ``delay`` fault.

    Raises:
        ValueError: a kind the op cannot have, or a negative delay.
    """

    op: Op
    kind: FaultKind
    keys: frozenset[ChunkKey] | None = None
    times: int | None = None
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if self.kind == "corrupt" and self.op != "get":
            raise ValueError("a corrupt fault applies to get (a value fails verification when it is read)")
        if self.kind == "truncate" and self.op not in ("get", "put"):
            raise ValueError("a truncate fault applies to get or put")
        if self.delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {self.delay_s}")


class FaultyTier(TierWrapper):
    """``inner`` with the faults of ``rules`` injected (see :class:`Fault`); the first rule that
    matches a call's op and key decides.  :attr:`injected` counts faults injected, by kind.
    Thread-safe."""

    def __init__(self, inner: Tier, rules: Sequence[Fault] = ()) -> None:
        super().__init__(inner)
        self.rules = list(rules)
        self.injected: dict[str, int] = {}
        self._used: dict[tuple[int, ChunkKey], int] = {}
        self._lock = threading.Lock()

    def _fault(self, op: Op, key: ChunkKey) -> Fault | None:
        rule = self._match(op, key)
        if rule is not None and rule.kind == "raise":
            raise ConnectionError(f"injected fault: {op} of chunk {key.hex()} cannot reach the backend")
        return rule

    def _match(self, op: Op, key: ChunkKey) -> Fault | None:
        with self._lock:
            for i, rule in enumerate(self.rules):
                if rule.op != op or (rule.keys is not None and key not in rule.keys):
                    continue
                used = self._used.get((i, key), 0)
                if rule.times is not None and used >= rule.times:
                    continue
                self._used[(i, key)] = used + 1
                self.injected[rule.kind] = self.injected.get(rule.kind, 0) + 1
                return rule
        return None

    def contains_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        out = []
        for key in keys:
            rule = self._fault("contains", key)
            if rule is not None and rule.kind == "delay":
                time.sleep(rule.delay_s)
            out.append(False if rule is not None and rule.kind == "error" else self.inner.contains(key))
        return out

    def get_many(self, keys: Sequence[ChunkKey], dsts: Sequence[memoryview],
                 records: TenantRecords | None = None, why: MissWhy | None = None) -> list[GetResult]:
        out = []
        for key, dst in zip(keys, dsts, strict=True):
            rule = self._fault("get", key)
            kind = rule.kind if rule is not None else None
            if rule is not None and kind == "delay":
                time.sleep(rule.delay_s)
            if kind in ("error", "truncate"):
                if why is not None:
                    why[key] = "load_failed"
                out.append(GetResult.MISS)
            elif kind == "corrupt":
                self.inner.delete(key)  # a tier forgets a value that failed verification
                with self._lock:
                    self._own_corrupt += 1
                out.append(GetResult.CORRUPT)
            else:
                out.append(self.inner.get_into(key, dst, records))
        return out

    def _blob_miss(self, key: ChunkKey) -> bool:
        """A ``get`` rule applied to a blob verb: whether the read is a miss (``error``,
        ``truncate``, ``corrupt``: counted and the key forgotten, as for ``get_many``)."""
        rule = self._fault("get", key)
        if rule is None:
            return False
        if rule.kind == "delay":
            time.sleep(rule.delay_s)
            return False
        if rule.kind == "corrupt":
            self.inner.delete(key)
            with self._lock:
                self._own_corrupt += 1
        return True

    def get(self, key: ChunkKey, records: TenantRecords | None = None) -> bytes | None:
        return None if self._blob_miss(key) else self.inner.get(key, records)

    def read_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> int | None:
        return None if self._blob_miss(key) else self.inner.read_into(key, dst, records)

    def get_range(self, key: ChunkKey, offset: int, length: int) -> bytes | None:
        return None if self._blob_miss(key) else self.inner.get_range(key, offset, length)

    def put_many(self, keys: Sequence[ChunkKey], datas: Sequence[memoryview | bytes],
                 tenants: Sequence[Writer | None] | None = None) -> list[PutResult]:
        out = []
        for key, data, tenant in zip(keys, datas, writers(tenants, len(keys)), strict=True):
            rule = self._fault("put", key)
            kind = rule.kind if rule is not None else None
            if rule is not None and kind == "delay":
                time.sleep(rule.delay_s)
            if kind == "error":
                with self._lock:
                    self._own_write_errors += 1
                out.append(PutResult.FAILED)
            elif kind == "truncate":
                view = memoryview(data).cast("B")
                out.append(self.inner.put(key, view[:view.nbytes // 2], tenant))
            else:
                out.append(self.inner.put(key, data, tenant))
        return out

    def delete_many(self, keys: Sequence[ChunkKey]) -> list[bool]:
        out = []
        for key in keys:
            rule = self._fault("delete", key)
            if rule is not None and rule.kind == "delay":
                time.sleep(rule.delay_s)
            out.append(False if rule is not None and rule.kind == "error" else self.inner.delete(key))
        return out


class SlowTier(FaultyTier):
    """``inner`` with a fixed delay before every call of each op (seconds; 0 = none)."""

    def __init__(self, inner: Tier, get_s: float = 0.0, put_s: float = 0.0, contains_s: float = 0.0,
                 delete_s: float = 0.0) -> None:
        delays: dict[Op, float] = {"get": get_s, "put": put_s, "contains": contains_s, "delete": delete_s}
        super().__init__(inner, [Fault(op, "delay", delay_s=s) for op, s in delays.items() if s > 0])
