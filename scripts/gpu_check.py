"""kvtier's GPU copy path, checked with plain torch (no vLLM): bytes and GiB/s.

For each of vLLM's KV cache layouts on CUDA:

* ``kv-split``: one tensor per layer ``[2, num_blocks, block_size, kv_heads, head_size]`` — K/V
  split on a leading dimension, block dimension second (FlashAttention, vllm/v1/attention/
  backends/flash_attn.py ``get_kv_cache_shape``);
* ``blocks-first``: ``[num_blocks, 2, block_size, kv_heads, head_size]`` — block dimension first
  (FlashInfer's NHD layout);
* ``mla``: ``[num_blocks, block_size, 576]`` — one latent tensor per layer (MLA: 512 latent + 64
  rope dims, vllm/v1/attention/backends/mla/common.py);

the script fills the caches with random bytes on a *compute stream* (after a long dummy kernel,
so a copy that did not wait for it would read stale bytes), saves random blocks through kvtier's
copy path (:class:`kvtier.integrations.vllm.copy.BlockCopier`) into pages of kvtier's cpu tier
(:class:`kvtier.core.tiers.cpu.CpuTier`), loads them back into other blocks, and asserts byte
equality.  It times each direction and, in the same run, a plain ``copy_`` of the same number of
bytes between one contiguous device tensor and one pinned host tensor, and prints GiB/s for
both and their ratio.

Run on a CUDA machine: ``python scripts/gpu_check.py`` (torch only; well under a minute).
``--device cpu`` runs the same checks on the host (a smoke test of the script: no streams, no
pinning, and the GiB/s are host memcpy figures).  Exit status 0 when every layout round-trips.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from kvtier.core.tiers.base import Reservation
from kvtier.core.tiers.cpu import CpuTier
from kvtier.integrations.vllm.copy import BlockCopier, Span
from kvtier.integrations.vllm.layout import detect_layout

GiB = float(1 << 30)


@dataclass(frozen=True)
class LayoutResult:
    """One layout's outcome: bytes checked and GiB/s of kvtier's copies and of a plain copy_."""

    layout: str
    shape: tuple[int, ...]
    blocks: int
    bytes_per_direction: int
    save_gib_s: float
    load_gib_s: float
    plain_d2h_gib_s: float
    plain_h2d_gib_s: float
    equal: bool


def layer_shape(layout: str, num_blocks: int, block_size: int, kv_heads: int, head_size: int) -> tuple[int, ...]:
    """The per-layer cache shape of ``layout`` (see the module docstring)."""
    if layout == "kv-split":
        return (2, num_blocks, block_size, kv_heads, head_size)
    if layout == "blocks-first":
        return (num_blocks, 2, block_size, kv_heads, head_size)
    if layout == "mla":
        return (num_blocks, block_size, 576)
    raise ValueError(f"unknown layout {layout!r}")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy(device: torch.device) -> None:
    """Queue a long kernel on the current stream (CUDA only), so unordered copies would race it."""
    if device.type == "cuda":
        torch.cuda._sleep(50_000_000)


def _timed(fn: object, device: torch.device, repeats: int) -> float:
    """Best wall time of ``repeats`` calls of ``fn`` (seconds), each synchronized."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def check_layout(layout: str, device: torch.device, args: argparse.Namespace, rng: np.random.Generator) -> LayoutResult:
    """Round-trip random blocks of ``layout`` through the copy path and the cpu tier; time it."""
    shape = layer_shape(layout, args.num_blocks, args.block_size, args.kv_heads, args.head_size)
    dtype = torch.bfloat16
    caches = {f"layers.{i}.attn": torch.zeros(shape, dtype=dtype, device=device) for i in range(args.layers)}
    kv_layout = detect_layout(caches, args.num_blocks, f"check-{layout}")
    bpc = args.blocks_per_chunk
    num_chunks = args.chunks
    blocks = rng.choice(args.num_blocks // 2, size=num_chunks * bpc, replace=False)
    targets = rng.choice(np.arange(args.num_blocks // 2, args.num_blocks), size=num_chunks * bpc, replace=False)
    tier = CpuTier(num_chunks * kv_layout.chunk_bytes(bpc), kv_layout.chunk_bytes(bpc))
    copier = BlockCopier(kv_layout, caches, bpc)
    compute = torch.cuda.Stream(device) if device.type == "cuda" else None

    # the compute stream writes the blocks after a long kernel; the save must wait for it
    if compute is not None:
        compute.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(compute) if compute is not None else _nullcontext():
        _busy(device)
        for kv in caches.values():
            kv.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    keys = [bytes([i]) * 16 for i in range(num_chunks)]
    reserved = [tier.reserve(k) for k in keys]
    pages = [r.buffer for r in reserved if isinstance(r, Reservation)]
    assert len(pages) == len(keys), f"the cpu tier refused a page: {reserved}"
    spans = [Span(p, 0, blocks[i * bpc:(i + 1) * bpc].tolist()) for i, p in enumerate(pages)]
    with torch.cuda.stream(compute) if compute is not None else _nullcontext():
        copier.save(spans)  # issued from the compute stream: ordered after the writes above
        for k in keys:
            tier.commit(k)
    _sync(device)
    loads = [Span(tier.view(k), 0, targets[i * bpc:(i + 1) * bpc].tolist()) for i, k in enumerate(keys)]
    copier.load(loads)
    _sync(device)
    dim = kv_layout.block_dim
    src_idx = torch.as_tensor(blocks, device=device)
    dst_idx = torch.as_tensor(targets, device=device)
    equal = all(torch.equal(kv.index_select(dim, src_idx).view(torch.int16), kv.index_select(dim, dst_idx).view(torch.int16))
                for kv in caches.values())

    nbytes = num_chunks * kv_layout.chunk_bytes(bpc)
    save_s = _timed(lambda: copier.save(spans), device, args.repeats)
    load_s = _timed(lambda: copier.load(loads), device, args.repeats)
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.zero_()  # fault the pages in before timing
    dev.zero_()
    d2h_s = _timed(lambda: host.copy_(dev, non_blocking=pin), device, args.repeats)
    h2d_s = _timed(lambda: dev.copy_(host, non_blocking=pin), device, args.repeats)
    return LayoutResult(layout, shape, len(blocks), nbytes, nbytes / save_s / GiB, nbytes / load_s / GiB,
                        nbytes / d2h_s / GiB, nbytes / h2d_s / GiB, equal)


class _nullcontext:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--num-blocks", type=int, default=512, help="engine blocks per layer")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (CUDA default 16)")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--blocks-per-chunk", type=int, default=16, help="chunk_tokens / block_size")
    parser.add_argument("--chunks", type=int, default=8, help="chunks round-tripped per layout")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (best is reported)")
    parser.add_argument("--layouts", default="kv-split,blocks-first,mla")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device visible to torch; run with --device cpu for a smoke test", file=sys.stderr)
        return 2
    if args.chunks * args.blocks_per_chunk > args.num_blocks // 2:
        print("--chunks x --blocks-per-chunk must be at most half of --num-blocks", file=sys.stderr)
        return 2
    rng = np.random.default_rng(0)
    results = [check_layout(name, device, args, rng) for name in args.layouts.split(",")]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "host"
    print(f"device: {name}; torch {torch.__version__}; {args.layers} layers, bf16; "
          f"GiB/s best of {args.repeats}; plain = one contiguous copy_ of the same bytes "
          f"({'pinned host' if device.type == 'cuda' else 'unpinned host'})")
    print(f"{'layout':<13}{'bytes':>12}{'save GiB/s':>12}{'plain D2H':>11}{'ratio':>7}"
          f"{'load GiB/s':>12}{'plain H2D':>11}{'ratio':>7}  bytes equal")
    for r in results:
        print(f"{r.layout:<13}{r.bytes_per_direction:>12}{r.save_gib_s:>12.2f}{r.plain_d2h_gib_s:>11.2f}"
              f"{r.save_gib_s / r.plain_d2h_gib_s:>7.2f}{r.load_gib_s:>12.2f}{r.plain_h2d_gib_s:>11.2f}"
              f"{r.load_gib_s / r.plain_h2d_gib_s:>7.2f}  {r.equal}")
    if args.json is not None:
        args.json.write_text(json.dumps({"device": name, "results": [asdict(r) for r in results]}, indent=1) + "\n")
    return 0 if all(r.equal for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
