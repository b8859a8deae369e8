"""The disk tier from a configuration: whether it is asked for, its preflight check, its state
directory and its factory (the hooks of its plug-in object, :data:`kvtier.core.tiers.builtin.DISK`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvtier.core.codecsettings import envelope_args, load_keyring
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.disk.check import disk_path_problem, foreign_files_problem
from kvtier.core.tiers.disk.tier import DiskTier

if TYPE_CHECKING:
    from kvtier.core.config import KVTierConfig
    from kvtier.core.tiers.factory import TierContext


def configured(config: KVTierConfig) -> bool:
    """Whether ``config`` asks for a disk tier (``disk_path`` and ``disk_gib`` > 0)."""
    return bool(config.disk_path) and config.disk_gib > 0


def state_dir(config: KVTierConfig) -> Path | None:
    """``disk_path`` when ``config`` asks for a disk tier (the registry record's ``state_dir``): the
    scheduler keeps its KV-event journal there, beside the namespace directories, which no rescan
    or reset reads (:mod:`kvtier.integrations.vllm.scheduler.events`)."""
    return Path(config.disk_path) if configured(config) and config.disk_path else None


def check(config: KVTierConfig) -> list[tuple[str, str]]:
    """The directory ``disk_path`` checked for ``disk_gib`` as start-up checks it
    (:func:`kvtier.core.tiers.disk.check.disk_path_problem`: a file, a kernel filesystem, not
    writable, too little free space), creating nothing: ``(config key, sentence)``, or nothing."""
    if not configured(config):
        return []
    assert config.disk_path is not None
    problem = disk_path_problem(Path(config.disk_path), config.disk_gib)
    if problem is not None:
        return [(problem[0], f"kvtier config: {problem[1]}")]
    try:
        load_keyring(config.encryption)  # the master key files and variables, read as start-up reads them
    except ConfigError as exc:
        return [("encryption", str(exc))]
    return []


def from_config(ctx: TierContext) -> DiskTier | None:
    """The disk tier of one rank, or ``None`` without ``disk_path``/``disk_gib``.

    Raises:
        ConfigError: the directory is unfit (:func:`check`), ``disk_gib`` does not fit in its free space plus
            what this engine's own namespace directories hold (other namespaces' files are never evicted:
            :func:`~kvtier.core.tiers.disk.check.foreign_files_problem`), or a shard directory is not writable.
        OSError: the directory cannot be created.
    """
    config = ctx.config
    capacity = config.disk_bytes_per_rank(ctx.tp_size)
    if not config.disk_path or capacity <= 0:
        return None
    for _key, message in check(config):
        raise ConfigError(message)
    foreign = foreign_files_problem(Path(config.disk_path), config.disk_gib, ctx.engine_namespaces or (ctx.namespace,))
    if foreign is not None:
        raise ConfigError(f"kvtier config: {foreign}")
    return DiskTier(config.disk_path, ctx.namespace, capacity, fsync=config.disk_fsync, io=config.disk_io,
                    io_threads=config.io_threads, codec_args=envelope_args(config, "disk"))
