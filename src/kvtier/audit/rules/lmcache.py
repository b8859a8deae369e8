"""LMCache environment: size consistency and known LMCache bugs."""

from __future__ import annotations

import math

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule

_LM = ("LMCacheConnectorV1", "LMCacheMPConnector")


def _uses_lmcache(c: ServeConfig) -> bool:
    return any(c.uses(n) for n in _LM)


@rule("lmcache-size-mismatch", "error", "LMCACHE_MAX_LOCAL_CPU_SIZE disagrees with --kv-offloading-size",
      "Make LMCACHE_MAX_LOCAL_CPU_SIZE = --kv-offloading-size / (TP × PP), or drop one of them.",
      'LMCache configuration reference (docs.lmcache.ai/api_reference/configurations.html: '
      'max_local_cpu_size, GB per worker) and vLLM vllm/config/cache.py kv_offloading_size '
      '(total across TP)', locate="LMCACHE_MAX_LOCAL_CPU_SIZE")
def lmcache_size_mismatch(c: ServeConfig) -> str | None:
    total = c.number("--kv-offloading-size")
    raw = c.env.get("LMCACHE_MAX_LOCAL_CPU_SIZE")
    if total is None or raw is None:
        return None
    try:
        per_rank = float(raw)
    except ValueError:
        return f"LMCACHE_MAX_LOCAL_CPU_SIZE={raw!r} is not a number."
    if not math.isfinite(per_rank):
        return f"LMCACHE_MAX_LOCAL_CPU_SIZE={raw!r} is not a finite size in GB."
    if not math.isfinite(total):
        return None  # kv-offloading-size-invalid reports it
    ranks = c.tp * c.pp
    if abs(per_rank * ranks - total) > 0.02 * total:
        return (f"LMCACHE_MAX_LOCAL_CPU_SIZE={per_rank:g} per rank × {ranks} ranks = {per_rank * ranks:g} GiB, "
                f"but --kv-offloading-size says {total:g} GiB; the scheduler will miscount slots.")
    return None


@rule("lmcache-env-without-connector", "warning", "LMCACHE_* set but no LMCache connector",
      "Add --kv-transfer-config '{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_both\"}' (or "
      "--kv-offloading-backend lmcache), or drop the LMCACHE_* variables.",
      'LMCache configuration reference (docs.lmcache.ai/api_reference/configurations.html): '
      'LMCACHE_* variables are read only by an LMCache connector', locate="LMCACHE_")
def lmcache_env_without_connector(c: ServeConfig) -> str | None:
    names = sorted(k for k in c.env if k.startswith("LMCACHE_"))
    if names and not _uses_lmcache(c) and (c.flags or c.positionals):
        return f"{', '.join(names)} are set but vLLM is not using LMCache, so they do nothing."
    return None


@rule("lmcache-size-unset", "warning", "LMCache tier size not set",
      "Set LMCACHE_MAX_LOCAL_CPU_SIZE (GiB per rank) from kvtier size, or --kv-offloading-size (total).",
      'LMCache configuration reference (docs.lmcache.ai/api_reference/configurations.html: '
      'max_local_cpu_size default)', locate="LMCacheConnectorV1")
def lmcache_size_unset(c: ServeConfig) -> str | None:
    explicit = (c.kv_transfer_config or {}).get("kv_connector") == "LMCacheConnectorV1"
    sized = ("LMCACHE_MAX_LOCAL_CPU_SIZE" in c.env or "LMCACHE_CONFIG_FILE" in c.env
             or c.has("--kv-offloading-size") or "lmcache.max_local_cpu_size" in c.connector_extra)
    if explicit and not sized:
        return "LMCacheConnectorV1 runs with LMCache's default CPU size, not a size computed for this workload."
    return None


@rule("lmcache-local-cpu-off", "error", "LMCache local CPU backend off / use_hot=False",
      "Keep LMCACHE_LOCAL_CPU=True (the default) and never set use_hot=False.",
      'LMCache/LMCache#2942 (LocalCPUBackend.allocate() deadlock; closed by the stale bot, fix '
      'PR LMCache/LMCache#3006 closed unmerged)',
      locate="LMCACHE_")
def lmcache_local_cpu_off(c: ServeConfig) -> str | None:
    off = [k for k in ("LMCACHE_LOCAL_CPU", "LMCACHE_USE_HOT") if c.env_true(k) is False]
    if off:
        return f"{', '.join(off)}=False: LocalCPUBackend.allocate() can deadlock when the staging buffer fills."
    return None


@rule("lmcache-disk-async-loading", "error", "LMCache disk tier with async loading",
      "Set LMCACHE_ENABLE_ASYNC_LOADING=False on a disk tier (DRAM-only is the simpler default).",
      'LMCache/LMCache#2502 (LocalDiskBackend crashes vLLM under burst allocation; closed '
      'not_planned)',
      locate="LMCACHE_ENABLE_ASYNC_LOADING")
def lmcache_disk_async(c: ServeConfig) -> str | None:
    if c.env.get("LMCACHE_LOCAL_DISK") and c.env_true("LMCACHE_ENABLE_ASYNC_LOADING"):
        return "LMCACHE_LOCAL_DISK with LMCACHE_ENABLE_ASYNC_LOADING=True crashes vLLM under burst allocation."
    return None
