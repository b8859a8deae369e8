"""A toy tier from outside kvtier: chunks in a Python dict, in this process's memory.

It exists to prove that a tier is a plug-in (issue 20 item 1): this module, the registration
module :mod:`tests.dict_tier_plugin` (named in ``tier_modules``) and one conformance harness
(``tests/core/tier_harness.py``) are all it takes; no kvtier module names it.

Settings: ``dict_capacity_mib``, the tier's size in MiB per rank (the store evicts from it with
its eviction policy, as from the disk tier); given flat in ``kv_connector_extra_config``
(``{"dict_capacity_mib": 8}``), as a built-in tier's keys are, or nested
(``{"tier_settings": {"dict": {"dict_capacity_mib": 8}}}``).  ``dict_storage``, a name: the tier
keeps its values in a module-level area of that name that outlives the tier (as a directory
outlives a disk tier), and its plug-in offers that area as a blob store (``list``, ``stat``,
``delete``: :class:`DictBlobs`), so ``kvtier purge``, a reset from outside the stores and the
probe work on it with no code of their own (tests/core/test_blob_verbs.py).  Its settings fields
are marked for the tools too, so ``kvtier bench-store`` and ``kvtier size`` take ``--dict-storage``
and ``--dict-capacity-mib`` with no edit in kvtier.cli (tests/cli/test_tool_flags_of_a_plugin_tier.py).  Without it each tier
keeps a private dict.

The tier is an :class:`~kvtier.core.tiers.envelopetier.EnvelopeTier`: it only stores and loads
whole values (:meth:`DictTier.load`, :meth:`DictTier.store`), and kvtier writes every value as an
envelope (namespace, chunk key, the tenant record of the request it was written for, the digest)
and verifies it on every read; so the blob verbs (``get``, ``read_into``, ``get_range``), tenant
records and corruption handling come with no code here.  Each value also keeps when it was written.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from kvtier.core import envelope
from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ChunkFormatError
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.base import PutResult, TierUsage
from kvtier.core.tiers.blobs import LIST_BATCH, BlobRef, BlobStat, ValueHeader
from kvtier.core.tiers.envelopetier import EnvelopeTier
from kvtier.core.tiers.factory import TierContext
from kvtier.core.tiers.plugin import PluginDefaults, TierPlugin
from kvtier.core.tiers.probe import ProbeState
from kvtier.core.tiers.registry import TierSpec

NAME = "dict"


class DictSettings(BaseModel):
    """The dict tier's keys in ``tier_settings.dict``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dict_capacity_mib: float = Field(64.0, gt=0, description="Tier size in MiB per rank.", json_schema_extra={
        "tools": {"bench-store": {"help": "The dict tier's size in MiB (default 64)."},
                  "size": {"help": "The dict tier's size in MiB per rank, for the recipe."}}})
    dict_storage: str | None = Field(None, min_length=1, description=(
        "Name of a module-level area the values outlive the tier in (and purge, reset and probe reach)."),
        json_schema_extra={"tools": {"purge": {"help": "The dict tier's storage area (its dict_storage).",
                                               "metavar": "NAME", "target": "the area the engines use",
                                               "empty": "give the area the engines use (their dict_storage)"},
                                     "bench-store": {"help": "Also measure the dict tier in this area.",
                                                     "metavar": "NAME", "target": "the area to measure"},
                                     "size": {"help": "Add the dict tier on this area to the kvtier recipe.",
                                              "metavar": "NAME", "target": "the area the tier uses"}}})


@dataclass
class _Value:
    data: bytes  # the whole envelope
    written_s: float


_lock = threading.Lock()
_AREAS: dict[str, dict[bytes, dict[ChunkKey, _Value]]] = {}
"""Storage name -> namespace -> chunk key -> value (``dict_storage``)."""


class DictTier(EnvelopeTier):
    """Chunks as envelopes in a dict; a local tier with a fixed capacity (see the module docstring).

    Args:
        capacity_bytes: stored bytes (headers included) the tier holds at most.
        namespace: 16-byte namespace digest.
        data: the area's dict for this namespace (``dict_storage``), or ``None`` for a private one.
    """

    name = NAME
    shared = False

    def __init__(self, capacity_bytes: int, namespace: bytes, data: dict[ChunkKey, _Value] | None = None) -> None:
        super().__init__(namespace)
        self.capacity_bytes = capacity_bytes
        self._data: dict[ChunkKey, _Value] = {} if data is None else data
        self._lock = _lock

    def contains(self, key: ChunkKey) -> bool:
        with self._lock:
            return key in self._data

    def load(self, key: ChunkKey) -> bytes | None:
        with self._lock:
            found = self._data.get(key)
        return None if found is None else found.data

    def store(self, key: ChunkKey, value: bytes) -> PutResult:
        with self._lock:
            if key in self._data:
                return PutResult.PRESENT
            if self._used() + len(value) > self.capacity_bytes:
                return PutResult.NO_ROOM
            self._data[key] = _Value(value, time.time())
        return PutResult.STORED

    def delete(self, key: ChunkKey) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def keys(self) -> list[ChunkKey]:
        with self._lock:
            return list(self._data)

    def usage(self) -> TierUsage:
        with self._lock:
            used = self._used()
            return TierUsage(used, self.capacity_bytes - used, self.capacity_bytes, len(self._data))

    def check(self) -> None:
        with self._lock:
            assert self._used() <= self.capacity_bytes, "dict tier over its capacity"

    def _used(self) -> int:
        return sum(len(v.data) for v in self._data.values())


class DictBlobs:
    """One ``dict_storage`` area as a blob store (:class:`kvtier.core.tiers.blobs.BlobStore`): the
    verbs ``kvtier purge``, a reset and the probe run over; nothing else of theirs is here."""

    verifies_values = False
    space = ""
    auth_fix = "nothing to fix: the area is in this process"
    address_key = "dict_storage"

    def __init__(self, storage: str) -> None:
        self.storage = storage
        self.where = f"dict:{storage}"

    def _area(self) -> dict[bytes, dict[ChunkKey, _Value]]:
        return _AREAS.setdefault(self.storage, {})

    def namespaces(self) -> list[bytes]:
        with _lock:
            return list(self._area())

    def list(self, namespaces: frozenset[bytes]) -> Iterator[list[BlobRef]]:
        for namespace in sorted(namespaces or self.namespaces()):
            with _lock:
                keys = list(self._area().get(namespace, {}))
            for i in range(0, len(keys), LIST_BATCH):
                yield [BlobRef(namespace, bytes(k), f"{self.where}/{namespace.hex()}/{k.hex()}")
                       for k in keys[i:i + LIST_BATCH]]

    def listing_problems(self) -> list[tuple[bytes, str]]:
        return []

    def _find(self, ref: BlobRef) -> _Value | None:
        return self._area().get(ref.namespace, {}).get(ChunkKey(ref.key))

    def stat(self, refs: Sequence[BlobRef], header: bool) -> list[BlobStat | None]:
        with _lock:
            found = [self._find(ref) for ref in refs]
        return [None if v is None else _stat(v, header) for v in found]

    def delete(self, refs: Sequence[BlobRef]) -> list[bool | str]:
        with _lock:
            return [self._area().get(ref.namespace, {}).pop(ChunkKey(ref.key), None) is not None for ref in refs]

    def before_reset(self, namespace: bytes) -> str | None:
        return None

    def ping(self) -> str:
        self.namespaces()
        return "LIST"

    def failure(self, exc: BaseException, left_s: float) -> tuple[ProbeState, str]:
        return "unreachable", str(exc)

    def close(self) -> None:
        pass


def _stat(value: _Value, header: bool) -> BlobStat:
    """A value's size and age, and with ``header`` what its envelope header says."""
    if not header:
        return BlobStat(len(value.data), value.written_s)
    try:
        head = envelope.decode_header(value.data)
    except ChunkFormatError as exc:
        return BlobStat(len(value.data), value.written_s, problem=f"not a kvtier value ({exc})")
    return BlobStat(len(value.data), value.written_s, ValueHeader(head.namespace, head.key, head.record))


class DictPlugin(PluginDefaults):
    """The dict tier's plug-in object (:class:`kvtier.core.tiers.plugin.TierPlugin`)."""

    settings = DictSettings

    def configured(self, config: KVTierConfig) -> bool:
        """The tier is asked for when ``tier_settings`` has an entry for it."""
        return NAME in config.tier_settings

    def build(self, ctx: TierContext) -> DictTier | None:
        """The dict tier of one rank, or ``None`` without its settings."""
        settings: DictSettings | None = ctx.config.settings_of(NAME) if self.configured(ctx.config) else None
        if settings is None:
            return None
        data = None
        if settings.dict_storage is not None:
            with _lock:
                data = _AREAS.setdefault(settings.dict_storage, {}).setdefault(ctx.namespace, {})
        return DictTier(int(settings.dict_capacity_mib * (1 << 20)), ctx.namespace, data)

    def blobs(self, config: KVTierConfig, deadline_s: float | None = None) -> DictBlobs | None:
        """The ``dict_storage`` area, or ``None`` without one (a private dict dies with its tier)."""
        settings: DictSettings | None = config.settings_of(NAME) if self.configured(config) else None
        return None if settings is None or settings.dict_storage is None else DictBlobs(settings.dict_storage)


PLUGIN: TierPlugin = DictPlugin()
"""Checked by mypy against the protocol here, and at run time when the registry imports it."""

SPEC = TierSpec(NAME, 15, False, "external_unspecified", "tests.dict_tier:PLUGIN",
                keys=("dict_capacity_mib", "dict_storage"))
"""The tier's registry record: between disk (10) and redis (20) in the default order."""
