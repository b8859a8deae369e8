"""A toy tier from outside kvtier: chunks in a Python dict, in this process's memory.

It exists to prove that a tier is a plug-in (issue 20 item 1): this module, the registration
module :mod:`tests.dict_tier_plugin` (named in ``tier_modules``) and one conformance harness
(``tests/core/tier_harness.py``) are all it takes; no kvtier module names it.

Settings: ``dict_capacity_mib``, the tier's size in MiB per rank (the store evicts from it with
its eviction policy, as from the disk tier); given flat in ``kv_connector_extra_config``
(``{"dict_capacity_mib": 8}``), as a built-in tier's keys are, or nested
(``{"tier_settings": {"dict": {"dict_capacity_mib": 8}}}``).
"""

from __future__ import annotations

import threading

from pydantic import BaseModel, ConfigDict, Field

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import ChunkKey
from kvtier.core.tenant import TenantRecords, Writer
from kvtier.core.tiers.base import GetResult, PutResult, Tier, TierUsage
from kvtier.core.tiers.factory import TierContext
from kvtier.core.tiers.registry import TierSpec

NAME = "dict"


class DictSettings(BaseModel):
    """The dict tier's keys in ``tier_settings.dict``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dict_capacity_mib: float = Field(gt=0, description="Tier size in MiB per rank.")


class DictTier(Tier):
    """Chunks as ``bytes`` in a dict; a local tier with a fixed capacity (see the module docstring)."""

    name = NAME
    shared = False

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self._data: dict[ChunkKey, bytes] = {}
        self._lock = threading.Lock()

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._data

    def get_into(self, key: ChunkKey, dst: memoryview, records: TenantRecords | None = None) -> GetResult:
        with self._lock:
            value = self._data.get(key)
        if value is None or len(value) != memoryview(dst).nbytes:
            return GetResult.MISS
        memoryview(dst).cast("B")[:] = value
        return GetResult.HIT

    def put(self, key: ChunkKey, data: memoryview | bytes, tenant: Writer | None = None) -> PutResult:
        value = bytes(data)
        with self._lock:
            if key in self._data:
                return PutResult.PRESENT
            if sum(map(len, self._data.values())) + len(value) > self.capacity_bytes:
                return PutResult.NO_ROOM
            self._data[key] = value
        return PutResult.STORED

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._data)

    def usage(self) -> TierUsage:
        with self._lock:
            used = sum(map(len, self._data.values()))
            return TierUsage(used, self.capacity_bytes - used, self.capacity_bytes, len(self._data))

    def check(self) -> None:
        with self._lock:
            assert sum(map(len, self._data.values())) <= self.capacity_bytes, "dict tier over its capacity"


def configured(config: KVTierConfig) -> bool:
    """The tier is asked for when ``tier_settings`` has an entry for it."""
    return NAME in config.tier_settings


def from_config(ctx: TierContext) -> DictTier | None:
    """The dict tier of one rank, or ``None`` without its settings."""
    settings: DictSettings | None = ctx.config.settings_of(NAME) if configured(ctx.config) else None
    return None if settings is None else DictTier(int(settings.dict_capacity_mib * (1 << 20)))


SPEC = TierSpec(NAME, 15, False, "external_unspecified", "tests.dict_tier:from_config", "tests.dict_tier:configured",
                "tests.dict_tier:DictSettings", keys=("dict_capacity_mib",))
"""The tier's registry record: between disk (10) and redis (20) in the default order."""
