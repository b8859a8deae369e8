"""Sizing of one rank's tiers from the configuration, with start-up checks that name the field.

Sizes in the configuration are totals across tensor-parallel ranks; each rank gets total / TP.
"""

from __future__ import annotations

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES


def cpu_capacity_bytes(config: KVTierConfig, chunk_bytes: int, tp_size: int) -> int:
    """Bytes of the cpu tier of one rank (``cpu_gib`` × GiB / ``tp_size``), checked.

    Raises:
        ConfigError: the tier would hold less than one chunk, the disk tier less than one chunk
            file, or the host has less memory available than all ranks' cpu tiers together.
    """
    capacity = config.cpu_bytes_per_rank(tp_size)
    if capacity < chunk_bytes:
        need = chunk_bytes * tp_size / GiB
        raise ConfigError(f"cpu_gib={config.cpu_gib} gives each of {tp_size} rank(s) {capacity} bytes, less than one "
                          f"chunk of {chunk_bytes} bytes (every chunk passes through the cpu tier); set cpu_gib "
                          f"to at least {need:.6g}, better hundreds of chunks")
    disk = config.disk_bytes_per_rank(tp_size)
    if config.disk_path and 0 < disk < chunk_bytes + HEADER_BYTES:
        raise ConfigError(f"disk_gib={config.disk_gib} gives each rank {disk} bytes, less than one chunk file of "
                          f"{chunk_bytes + HEADER_BYTES} bytes; raise disk_gib or set it to 0 for no disk tier")
    available = available_memory()
    if available and capacity * tp_size > available:
        raise ConfigError(f"cpu_gib={config.cpu_gib} asks for {capacity * tp_size / GiB:.1f} GiB of DRAM but this "
                          f"host has {available / GiB:.1f} GiB available; lower cpu_gib (it is the total across "
                          "TP ranks)")
    return capacity


def available_memory() -> int:
    """Bytes of memory the kernel says can be allocated without swapping (MemAvailable), else 0."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
