"""A tier as one typed object: the :class:`TierPlugin` protocol that mypy checks, and
:class:`PluginDefaults`, which a plug-in may derive from for the hooks it does not need.

The registry (:mod:`kvtier.core.tiers.registry`) keeps one :class:`~kvtier.core.tiers.registry.TierSpec`
per tier with the facts it needs without importing the tier (name, order, hit source, ...) and the
``"module:attribute"`` of its plug-in object, imported on first use (so ``redis`` and ``obstore``
stay optional until a configuration asks for their tier).  Once imported the object is checked
against :class:`TierPlugin` (:func:`kvtier.core.tiers.factory.plugin`; its settings model by
:func:`~kvtier.core.tiers.registry.settings_model`, which the configuration reads), and every hook
after that is a typed call: no string names a function.

The operator verbs (``kvtier purge``, a reset from outside the stores, the reachability probe) are
written once, in :mod:`kvtier.core.purge`, over the blob-store verbs a plug-in's
:meth:`TierPlugin.blobs` returns (:mod:`kvtier.core.tiers.blobs`): a tier that offers ``list``,
``stat`` and ``delete`` gets all three with no code of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

from kvtier.core.config import KVTierConfig

if TYPE_CHECKING:  # (annotations only: the CLI's start-up imports no prometheus_client)
    from prometheus_client import CollectorRegistry

    from kvtier.core.tiers.base import Tier
    from kvtier.core.tiers.blobs import BlobStore


class TierContext(NamedTuple):
    """What a tier's :meth:`TierPlugin.build` gets: the configuration and the facts of one rank's store.

    Attributes:
        config: the kvtier configuration.
        namespace: 16-byte namespace digest (a tier never returns another namespace's chunks).
        chunk_bytes: payload bytes of one chunk.
        tp_size: tensor-parallel size (local capacities are totals / ``tp_size``).
        registry: prometheus registry for the tier's own metrics.
        engine_namespaces: the 16-byte namespace digests of every tensor-parallel rank of the engine,
            ``namespace`` among them (what the engine's local tiers together may evict); ``()`` when
            unknown, taken as ``(namespace,)``.
    """

    config: KVTierConfig
    namespace: bytes
    chunk_bytes: int
    tp_size: int
    registry: CollectorRegistry
    engine_namespaces: tuple[bytes, ...] = ()


@runtime_checkable
class TierPlugin(Protocol):
    """What kvtier asks of a tier, apart from its data path (:class:`~kvtier.core.tiers.base.Tier`).

    Attributes:
        settings: the pydantic model of the tier's configuration keys (documentation, the audit's
            per-tier key list, the tools' flags: :mod:`kvtier.core.tiersettings`); ``None`` if it
            has none.
    """

    settings: type[Any] | None

    def build(self, ctx: TierContext) -> Tier | None:
        """The tier of one rank's store built from ``ctx``; ``None`` when the configuration does
        not ask for it.

        Raises:
            ConfigError: the configuration asks for it but it cannot start (one sentence).
        """
        ...

    def configured(self, config: KVTierConfig) -> bool:
        """Whether ``config`` asks for the tier (it is in ``tiers`` already), without building it."""
        ...

    def check(self, config: KVTierConfig) -> list[tuple[str, str]]:
        """The preflight: ``(config key, sentence)`` per thing start-up would refuse, read the way
        start-up reads it (files, environment)."""
        ...

    def advice(self, config: KVTierConfig) -> list[tuple[str, str]]:
        """``(config key, sentence)`` per exposure a configuration the tier starts with leaves (e.g.
        plain HTTP beyond this host without a shared secret), from the configuration alone (no
        file, no network); the pre-flight reports each as a warning."""
        ...

    def state_dir(self, config: KVTierConfig) -> Path | None:
        """A directory that outlives the process as the tier's chunks do, where the scheduler may
        keep small files about them (the KV events' journal); ``None`` if it has none."""
        ...

    def blobs(self, config: KVTierConfig, deadline_s: float | None = None) -> BlobStore | None:
        """The tier's storage seen from outside any engine, every namespace of it, as a blob store
        (:class:`~kvtier.core.tiers.blobs.BlobStore`): what ``kvtier purge``, a reset and the probe
        run over.  ``None`` when ``config`` names no storage of the tier (or the tier lives only in
        an engine's processes, as the cpu tier does).

        Args:
            config: the configuration naming the storage (a directory, a server, a bucket).
            deadline_s: cap on each request's timeouts, seconds (the probe's); ``None``: the
                configuration's own.

        Raises:
            UserError: the storage is named wrongly (not a directory, a bad password file), one sentence.
            StorageFailed: it does not answer (:class:`~kvtier.core.tiers.blobs.StorageFailed`).
        """
        ...


class PluginDefaults:
    """Defaults for the hooks a plug-in does not need: asked for whenever it is in ``tiers``, no
    settings, no check, no advice, no state directory, no storage outside the engines."""

    settings: type[Any] | None = None

    def configured(self, config: KVTierConfig) -> bool:
        """Always (the tier is in ``tiers``)."""
        return True

    def check(self, config: KVTierConfig) -> list[tuple[str, str]]:
        """Nothing to check."""
        return []

    def advice(self, config: KVTierConfig) -> list[tuple[str, str]]:
        """Nothing to advise."""
        return []

    def state_dir(self, config: KVTierConfig) -> Path | None:
        """No state directory."""
        return None

    def blobs(self, config: KVTierConfig, deadline_s: float | None = None) -> BlobStore | None:
        """No storage outside the engines."""
        return None
