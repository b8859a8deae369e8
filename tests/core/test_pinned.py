"""Pinned host memory bookkeeping (``kvtier.core.pinned``) and the cpu tier's registration decision,
on this host: the range logic is device independent; registration itself needs CUDA
(``scripts/gpu_check.py`` reports ``pinned`` per run)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kvtier.core import pinned
from kvtier.core.tiers.cpu.tier import CpuTier


def test_regions_cover_only_ranges_inside_one_registration():
    regions = pinned.PinnedRegions()
    regions.add(4096, 8192)
    regions.add(12288, 4096)  # adjacent, registered separately
    assert regions.covers(4096, 8192) and regions.covers(8000, 100) and regions.covers(12288, 4096)
    assert not regions.covers(4000, 200)  # starts before
    assert not regions.covers(12000, 1000)  # spans two registrations: one copy never does
    assert not regions.covers(20000, 1)
    with pytest.raises(ValueError, match="overlaps"):
        regions.add(8192, 4096)
    with pytest.raises(ValueError, match="positive size"):
        regions.add(0, 0)
    assert regions.remove(4096) and not regions.remove(4096)
    assert not regions.covers(8000, 100) and len(regions) == 1


def test_registration_is_split_into_bounded_page_aligned_pieces():
    assert pinned.register_ranges(0, 10 << 30, max_bytes=4 << 30) == [(0, 4 << 30), (4 << 30, 4 << 30),
                                                                      (8 << 30, 2 << 30)]
    assert pinned.register_ranges(8192, 10000, max_bytes=5000) == [(8192, 4096), (12288, 4096), (16384, 1808)]
    assert pinned.register_ranges(0, 0) == []
    with pytest.raises(ValueError, match="4096-byte page"):
        pinned.register_ranges(0, 10, max_bytes=100)


def test_an_array_is_pinned_only_inside_a_recorded_region():
    pool = np.zeros(8 * 4096, dtype=np.uint8)
    start = pool.ctypes.data
    assert not pinned.is_pinned(pool[4096:8192])
    pinned.REGIONS.add(start, pool.nbytes)
    try:
        assert pinned.is_pinned(pool[4096:8192]) and pinned.is_pinned(pool)
        assert not pinned.is_pinned(np.zeros(16, dtype=np.uint8))  # a private buffer elsewhere
    finally:
        pinned.REGIONS.remove(start)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this host has CUDA: gpu_check.py checks registration there")
def test_without_cuda_the_cpu_tier_stays_pageable_and_says_why(caplog):
    tier = CpuTier(4 * 4096, 4096)
    with caplog.at_level(logging.WARNING, logger="kvtier.core.tiers.cpu.tier"):
        assert tier.pin_host_memory() is False
    assert not tier.pinned and len(pinned.REGIONS) == 0
    assert "no CUDA device is visible to torch" in caplog.text
    assert tier.pool.ctypes.data % 4096 == 0  # still page aligned for O_DIRECT
