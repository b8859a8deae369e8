"""Memory of common accelerators, for the HBM KV budget.

``memory_gib`` is the total device memory as the driver reports it (``nvidia-smi`` "Total", in
MiB / 1024) where that figure is known, otherwise the datasheet capacity read as GiB.  The
activation / CUDA-graph overhead default comes from the how-to's worked example: an 80 GB card
at ``--gpu-memory-utilization 0.90`` with ~40 GB of weights leaves ~28 GB of KV, i.e. 72 − 40 − 28
= ~4 GB of overhead ("a few GB of activation overhead", how-to § "The sizing math").
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_OVERHEAD_GIB = 4.0
"""Per-GPU activation + CUDA graph + allocator overhead assumed outside the KV cache (GiB)."""

MAX_GPU_MEMORY_GIB = 2048.0
"""Largest memory of one GPU accepted (GiB): ~7× the largest part sold (288 GB HBM3E on B300 / MI355X,
their datasheets), so a figure above it is a unit mistake (MiB or bytes given as GiB)."""

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default ``--gpu-memory-utilization`` (``CacheConfig.gpu_memory_utilization``)."""


@dataclass(frozen=True)
class GPU:
    """One accelerator model: its name, memory in GiB, and where that number comes from."""

    name: str
    memory_gib: float
    source: str


GPUS: tuple[GPU, ...] = (
    GPU("H100", 81559 / 1024, "nvidia-smi total 81559 MiB (H100 80GB HBM3)"),
    GPU("H200", 143771 / 1024, "nvidia-smi total 143771 MiB (H200 141GB HBM3e)"),
    GPU("H20", 96.0, "datasheet 96 GB HBM3"),
    GPU("B200", 180.0, "DGX B200 datasheet: 1,440 GB for 8 GPUs"),
    GPU("A100-80GB", 81920 / 1024, "nvidia-smi total 81920 MiB"),
    GPU("A100-40GB", 40960 / 1024, "nvidia-smi total 40960 MiB"),
    GPU("L40S", 46068 / 1024, "nvidia-smi total 46068 MiB (48 GB GDDR6)"),
    GPU("L4", 23034 / 1024, "nvidia-smi total 23034 MiB (24 GB GDDR6)"),
    GPU("MI300X", 192.0, "datasheet 192 GB HBM3"),
)


def find_gpu(name: str) -> GPU | None:
    """The GPU whose name matches ``name`` case-insensitively (``A100`` means the 80 GB part)."""
    wanted = name.strip().upper().replace(" ", "")
    if wanted == "A100":
        wanted = "A100-80GB"
    for gpu in GPUS:
        if gpu.name.upper() == wanted:
            return gpu
    return None
