"""Estimated prefill time saved by cache hits (a first-order model; pass your own figures).

For each token served from a tier instead of recomputed::

    saved = 1 / prefill_tokens_per_s                      (engine tier: the KV is already in HBM)
    saved = 1 / prefill_tokens_per_s - bytes_per_token / cpu_bytes_per_s            (cpu tier)
    saved = 1 / prefill_tokens_per_s - bytes_per_token / disk_bytes_per_s
                                     - bytes_per_token / cpu_bytes_per_s            (disk tier,
                                                              read to host, then over PCIe)
    saved = 1 / prefill_tokens_per_s - bytes_per_token / shared_bytes_per_s
                                     - bytes_per_token / cpu_bytes_per_s          (shared tier)

and each request that a tier serves pays that tier's latency once (``*_latency_ms``).

Prefill cost is taken as linear in tokens (it is not: attention grows with context, so long
prompts save more than this says), transfers are not overlapped with compute, and a negative
figure means loading is slower than recomputing on that tier.

Defaults and their sources (GB = 10^9 bytes):

- ``cpu_gb_per_s = 64``: PCIe Gen5 x16, one direction (NVIDIA H100 datasheet: "PCIe Gen5
  128 GB/s", i.e. 64 GB/s each way).  Pinned host-to-device copies reach less; measure yours
  with ``kvtier bench-store`` and pass it.
- ``disk_gb_per_s = 7``: one PCIe Gen4 NVMe SSD, sequential read (Samsung 990 PRO datasheet:
  up to 7,450 MB/s).
- ``shared_gb_per_s = 1.25``: one 10 Gb/s Ethernet link (10GBASE-T line rate, IEEE 802.3an)
  between the host and a Redis/Valkey server.
- ``disk_latency_ms = 0.1``: one NVMe read round trip (order of 100 µs; Samsung 990 PRO datasheet
  random-read figures); ``shared_latency_ms = 0.5``: one network round trip to Redis in a data
  centre plus the server's work; ``cpu_latency_ms = 0``.
- ``prefill_tokens_per_s = 20000``: an 8B-parameter model on one H100 at ~30 % of peak:
  prefill costs about 2 × parameters FLOPs per token (Kaplan et al., "Scaling Laws for Neural
  Language Models", 2020, section 2.1), 989 TFLOPS dense BF16 (NVIDIA H100 SXM datasheet):
  0.3 × 989e12 / (2 × 8e9) ≈ 18,500 tokens/s, rounded.  Measure yours (TTFT of uncached
  prompts, ``kvtier bench``) and pass it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFILL_TOKENS_PER_S = 20_000.0
DEFAULT_CPU_GB_PER_S = 64.0
DEFAULT_DISK_GB_PER_S = 7.0
DEFAULT_SHARED_GB_PER_S = 1.25
DEFAULT_DISK_LATENCY_MS = 0.1
DEFAULT_SHARED_LATENCY_MS = 0.5

MAX_PREFILL_TOKENS_PER_S = 1e9
"""Fastest prefill accepted, tokens/s: 50,000 times the H100 default above; a larger (or
infinite) speed makes recomputing free, so every tier would show as worthless."""
MAX_GB_PER_S = 100_000.0
"""Widest tier bandwidth accepted, GB/s (100 TB/s, 20 times an H200's HBM at 4.8 TB/s, NVIDIA's
datasheet); a larger (or infinite) one makes loads free."""
MAX_LATENCY_MS = 3_600_000.0
"""Longest per-request tier latency accepted, ms (one hour)."""


@dataclass(frozen=True)
class Throughputs:
    """Prefill speed (tokens/s), tier-to-engine bandwidths (GB/s, 10^9 bytes/s) and per-request
    latency of each tier (ms)."""

    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S
    cpu_gb_per_s: float = DEFAULT_CPU_GB_PER_S
    disk_gb_per_s: float = DEFAULT_DISK_GB_PER_S
    shared_gb_per_s: float = DEFAULT_SHARED_GB_PER_S
    cpu_latency_ms: float = 0.0
    disk_latency_ms: float = DEFAULT_DISK_LATENCY_MS
    shared_latency_ms: float = DEFAULT_SHARED_LATENCY_MS

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "cpu_gb_per_s", "disk_gb_per_s", "shared_gb_per_s"):
            most = MAX_PREFILL_TOKENS_PER_S if name == "prefill_tokens_per_s" else MAX_GB_PER_S
            if not 0 < getattr(self, name) <= most:  # nan fails every comparison
                raise ValueError(f"--{name.replace('_', '-')} must be positive and at most {most:,.0f} (a larger one "
                                 f"makes that cost free), got {getattr(self, name)}")
        for name in ("cpu_latency_ms", "disk_latency_ms", "shared_latency_ms"):
            if not 0 <= getattr(self, name) <= MAX_LATENCY_MS:
                raise ValueError(f"--{name.replace('_', '-')} must be finite, >= 0 and at most {MAX_LATENCY_MS:,.0f} "
                                 f"(an hour), got {getattr(self, name)}")


@dataclass(frozen=True)
class TimeSaved:
    """Seconds of prefill saved over the whole trace, per serving tier."""

    engine_s: float
    cpu_s: float
    disk_s: float
    shared_s: float = 0.0

    @property
    def offload_s(self) -> float:
        """What the cpu, disk and shared tiers add beyond the engine's own cache."""
        return self.cpu_s + self.disk_s + self.shared_s

    @property
    def total_s(self) -> float:
        return self.engine_s + self.offload_s


def time_saved(engine_tokens: int, cpu_tokens: int, disk_tokens: int, kv_bytes_per_token: float,
               rates: Throughputs, shared_tokens: int = 0, loads: tuple[int, int, int] = (0, 0, 0)) -> TimeSaved:
    """Prefill seconds saved by tokens served from each tier (see the module docstring).

    Args:
        engine_tokens, cpu_tokens, disk_tokens, shared_tokens: prompt tokens served by each tier.
        kv_bytes_per_token: KV bytes per token (all layers, K and V).
        rates: prefill speed, bandwidths and latencies.
        loads: requests served by the cpu, disk and shared tier (each pays its latency once).
    """
    recompute = 1.0 / rates.prefill_tokens_per_s
    cpu_load = kv_bytes_per_token / (rates.cpu_gb_per_s * 1e9)
    disk_load = kv_bytes_per_token / (rates.disk_gb_per_s * 1e9) + cpu_load
    shared_load = kv_bytes_per_token / (rates.shared_gb_per_s * 1e9) + cpu_load
    cpu_n, disk_n, shared_n = loads
    return TimeSaved(engine_tokens * recompute,
                     cpu_tokens * (recompute - cpu_load) - cpu_n * rates.cpu_latency_ms / 1e3,
                     disk_tokens * (recompute - disk_load) - disk_n * rates.disk_latency_ms / 1e3,
                     shared_tokens * (recompute - shared_load) - shared_n * rates.shared_latency_ms / 1e3)
