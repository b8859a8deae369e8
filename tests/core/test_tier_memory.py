"""The ``RegistersMemory`` capability (kvtier.core.tiers.base): a tier registers host buffer regions
it reads into and writes from, so a GPU copies straight to and from them (issue 37).  The cpu tier
implements it (its page pool is registered through it: ``pin_host_memory``); its registry record
says so, and the conformance suite checks record and tier agree.  Registration is
``cudaHostRegister`` (kvtier.core.pinned): on a machine with a CUDA device the region is pinned and
unpinned again; without one the tier says why, registers nothing and keeps working."""

from __future__ import annotations

import mmap

import numpy as np

from kvtier.core import pinned
from kvtier.core.keys import ChunkKey
from kvtier.core.tiers.base import PutResult, RegistersMemory, capabilities
from kvtier.core.tiers.cpu.tier import CpuTier
from kvtier.core.tiers.registry import spec


def cuda_usable() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_the_cpu_tier_registers_memory_and_its_record_says_so():
    tier = CpuTier(4 * 4096, 4096)
    assert isinstance(tier, RegistersMemory)
    assert "registers_memory" in capabilities(tier) and "registers_memory" in spec("cpu").capabilities
    region = np.frombuffer(mmap.mmap(-1, 8192), dtype=np.uint8)  # a landing buffer outside the pool
    why = tier.register_memory(region)
    if cuda_usable():  # a GPU machine: pinned, listed, idempotent, unpinned again
        assert why is None and pinned.is_pinned(region)
        assert tier.register_memory(region) is None
        assert tier.registered_memory() == [(region.ctypes.data, 8192)]
        assert tier.pin_host_memory() and tier.pinned and pinned.is_pinned(tier.pool)
        assert (tier.pool.ctypes.data, tier.pool.nbytes) in tier.registered_memory()
        assert tier.unregister_memory(region) and not pinned.is_pinned(region)
        assert tier.unregister_memory(tier.pool) and not tier.pinned and not pinned.is_pinned(tier.pool)
    else:  # no device: one sentence why, nothing registered, the tier unchanged
        assert why in ("torch is not installed", "no CUDA device is visible to torch")
        assert tier.registered_memory() == [] and not pinned.is_pinned(region)
        assert not tier.pin_host_memory() and tier.registered_memory() == []
    assert not tier.unregister_memory(region)  # not (or no longer) registered here
    assert tier.put(ChunkKey(bytes(16)), b"x" * 4096) is PutResult.STORED  # the tier works either way
    assert tier.get(ChunkKey(bytes(16))) == b"x" * 4096


def test_the_cpu_tiers_pool_is_resident_once_the_tier_is_built():
    """Every page of the pool is faulted in at construction (``MAP_POPULATE`` on Linux), so the
    first save into a page is a plain copy: the process's resident set grows by the pool's size
    before any chunk is stored."""
    import psutil

    process = psutil.Process()
    pool_bytes = 64 << 20
    before = process.memory_info().rss
    tier = CpuTier(pool_bytes, 128 << 10)
    grown = process.memory_info().rss - before
    assert grown >= 0.95 * pool_bytes, f"the resident set grew {grown} bytes for a {pool_bytes}-byte pool"
    assert tier.pool.ctypes.data % mmap.PAGESIZE == 0
