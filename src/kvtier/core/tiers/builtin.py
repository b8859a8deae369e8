"""The plug-in objects of the tiers shipped with kvtier (:class:`~kvtier.core.tiers.plugin.TierPlugin`),
named by their records in :data:`kvtier.core.tiers.registry.BUILTIN`.

This module is imported whenever a configuration is read (the settings models are part of the
plug-ins), so it imports only the settings models; each tier's own modules (and ``redis``,
``obstore``) are imported by the hooks that need them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.core.tiers.node.settings import NodeSettings
from kvtier.core.tiers.plugin import PluginDefaults
from kvtier.core.tiers.redis.settings import RedisSettings
from kvtier.core.tiers.s3.settings import S3Settings

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.base import Tier
    from kvtier.core.tiers.blobs import BlobStore
    from kvtier.core.tiers.factory import TierContext


class CpuPlugin(PluginDefaults):
    """The top tier: host memory of one rank's process; nothing outlives it."""

    def build(self, ctx: TierContext) -> Tier | None:
        from kvtier.core.tiers.cpu.tier import from_config

        return from_config(ctx)


class DiskPlugin(PluginDefaults):
    """The disk tier: chunk files under ``disk_path`` (:mod:`kvtier.core.tiers.disk.tier`)."""

    def build(self, ctx: TierContext) -> Tier | None:
        from kvtier.core.tiers.disk.factory import from_config

        return from_config(ctx)

    def configured(self, config: KVTierConfig) -> bool:
        return bool(config.disk_path) and config.disk_gib > 0

    def check(self, config: KVTierConfig) -> list[tuple[str, str]]:
        from kvtier.core.tiers.disk.factory import check

        return check(config)

    def state_dir(self, config: KVTierConfig) -> Path | None:
        from kvtier.core.tiers.disk.factory import state_dir

        return state_dir(config)

    def blobs(self, config: KVTierConfig, deadline_s: float | None = None) -> BlobStore | None:
        from kvtier.core.tiers.disk.blobs import open_blobs

        return open_blobs(config)


class RedisPlugin(PluginDefaults):
    """The redis tier: values on a Redis/Valkey server or Cluster (:mod:`kvtier.core.tiers.redis.tier`)."""

    settings: type[Any] | None = RedisSettings

    def build(self, ctx: TierContext) -> Tier | None:
        from kvtier.core.tiers.redis.factory import from_config

        return from_config(ctx)

    def configured(self, config: KVTierConfig) -> bool:
        from kvtier.core.tiers.redis.settings import redis_settings

        return bool(redis_settings(config).redis_url)

    def check(self, config: KVTierConfig) -> list[tuple[str, str]]:
        from kvtier.core.tiers.redis.factory import check

        return check(config)

    def blobs(self, config: KVTierConfig, deadline_s: float | None = None) -> BlobStore | None:
        from kvtier.core.tiers.redis.blobs import open_blobs

        return open_blobs(config, deadline_s)


class S3Plugin(PluginDefaults):
    """The s3 tier: objects in an S3-compatible bucket (:mod:`kvtier.core.tiers.s3.tier`)."""

    settings: type[Any] | None = S3Settings

    def build(self, ctx: TierContext) -> Tier | None:
        from kvtier.core.tiers.s3.factory import from_config

        return from_config(ctx)

    def configured(self, config: KVTierConfig) -> bool:
        from kvtier.core.tiers.s3.factory import configured

        return configured(config)

    def check(self, config: KVTierConfig) -> list[tuple[str, str]]:
        from kvtier.core.tiers.s3.factory import check

        return check(config)

    def advice(self, config: KVTierConfig) -> list[tuple[str, str]]:
        from kvtier.core.tiers.s3.factory import advice

        return advice(config)

    def blobs(self, config: KVTierConfig, deadline_s: float | None = None) -> BlobStore | None:
        from kvtier.core.tiers.s3.blobs import open_blobs

        return open_blobs(config, deadline_s)


class NodePlugin(PluginDefaults):
    """The node tier: this host's shared DRAM pool, owned by ``kvtier node serve``
    (:mod:`kvtier.core.tiers.node`)."""

    settings: type[Any] | None = NodeSettings

    def build(self, ctx: TierContext) -> Tier | None:
        from kvtier.core.tiers.node.factory import from_config

        return from_config(ctx)

    def configured(self, config: KVTierConfig) -> bool:
        from kvtier.core.tiers.node.settings import node_settings

        return bool(node_settings(config).node_socket)

    def check(self, config: KVTierConfig) -> list[tuple[str, str]]:
        from kvtier.core.tiers.node.factory import check

        return check(config)

    def blobs(self, config: KVTierConfig, deadline_s: float | None = None) -> BlobStore | None:
        from kvtier.core.tiers.node.blobs import open_blobs

        return open_blobs(config, deadline_s)


CPU = CpuPlugin()
DISK = DiskPlugin()
REDIS = RedisPlugin()
S3 = S3Plugin()
NODE = NodePlugin()
