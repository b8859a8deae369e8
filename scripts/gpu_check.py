"""kvtier's GPU copy path, checked with plain torch (no vLLM): exact bytes and GiB/s per direction.

For each of vLLM's KV cache layouts on CUDA:

* ``kv-split``: one tensor per layer ``[2, num_blocks, block_size, kv_heads, head_size]`` — K/V
  split on a leading dimension, block dimension second (FlashAttention, vllm/v1/attention/
  backends/flash_attn.py ``get_kv_cache_shape``);
* ``blocks-first``: ``[num_blocks, 2, block_size, kv_heads, head_size]`` — block dimension first
  (FlashInfer's NHD layout);
* ``mla``: ``[num_blocks, block_size, 576]`` — one latent tensor per layer (MLA: 512 latent + 64
  rope dims, vllm/v1/attention/backends/mla/common.py);

and for each engine page size (vLLM's ``page_size_bytes``: one block of one layer; 16 KiB to 2 MiB by
default, set through the tokens per block; small pages are where per-block copies collapse,
vLLM#57555), the script:

1. fills the caches with random bytes on a *compute stream* after a long dummy kernel, and saves
   random blocks through kvtier's copy path (:class:`kvtier.integrations.vllm.worker.copy.BlockCopier`,
   built on that stream as vLLM's engine thread builds it) into pages of kvtier's cpu tier
   (:class:`kvtier.core.tiers.cpu.tier.CpuTier`, its pool registered as pinned memory), issued from the
   compute stream: a save that did not wait for the writes would read stale bytes;
2. zeroes the target blocks on the compute stream after another long kernel (as vLLM zeroes newly
   allocated blocks) and loads the pages into them: a load that did not wait would be zeroed over;
3. asserts the loaded blocks equal the saved ones byte for byte;
4. times each direction (best of ``--repeats``) and, in the same run, a plain ``copy_`` of the same
   number of bytes between one contiguous device tensor and one pinned host tensor, and reports
   GiB/s, the ratio to the plain copy and the fraction of the link's peak.

The peak is read from the device's PCIe link (``/sys/bus/pci/devices/<bus id>/max_link_speed`` and
``max_link_width`` for torch's ``pci_bus_id``, else ``nvidia-smi``); where neither answers it is an
assumed PCIe Gen5 x16 (32 GT/s x 16 lanes, 128b/130b: 63.0 GB/s per direction, PCI-SIG PCIe 5.0
base specification), stated as assumed in the output.

Run on a CUDA machine: ``python scripts/gpu_check.py --json gpu_check.json`` (torch only; well under
a minute on an H200).  ``--device cpu`` runs the same checks on the host (a smoke test of the
script: no streams, no pinning, and the GiB/s are host memcpy figures).  Exit status 0 when every
layout round-trips at every page size, 1 when one does not, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_runner

from kvtier.core.tiers.base import Reservation
from kvtier.core.tiers.cpu.tier import CpuTier
from kvtier.integrations.vllm.worker.copy import BlockCopier, Span
from kvtier.integrations.vllm.worker.layout import detect_layout

GiB = float(1 << 30)
KiB = 1 << 10
ASSUMED_PEAK_GB_S = 32e9 * 16 * 128 / 130 / 8 / 1e9  # PCIe Gen5 x16, one direction, after 128b/130b coding
DEFAULT_PAGES_KIB = "16,32,64,128,256,512,1024,2048"
LAYOUTS = ("kv-split", "blocks-first", "mla")
MAX_PAGE_KIB = 1 << 20
"""Largest --pages-kib (1 GiB): one block of one layer; vLLM's defaults are 16 KiB to 2 MiB."""
MAX_MIB = 1 << 16
"""Largest --mib (64 GiB per direction): the caches hold about twice that on the device."""
MODES = ("copy", "runner", "all")
BUDGET_S = 300.0
"""The whole GPU run must end within this (issue 37: a GPU is lent for minutes, start-up included)."""
ESTIMATE_GB_S = 10.0
"""Bytes per second assumed by the printed estimate (a low bound for PCIe; the host is slower)."""


@dataclass(frozen=True)
class Result:
    """One layout at one page size: bytes checked and GiB/s of kvtier's copies and of a plain copy_."""

    layout: str
    page_bytes: int
    block_tokens: int
    chunk_bytes: int
    shape: tuple[int, ...]
    blocks: int
    bytes_per_direction: int
    save_gib_s: float
    load_gib_s: float
    plain_d2h_gib_s: float
    plain_h2d_gib_s: float
    pinned: bool
    staged_runs: int
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


def token_bytes(layout: str, kv_heads: int, head_size: int) -> int:
    """Bytes of one token of one layer in ``layout`` (bf16)."""
    return 576 * 2 if layout == "mla" else 2 * kv_heads * head_size * 2


def pcie_peak(device: torch.device) -> tuple[float, str]:
    """The device's PCIe peak per direction (GiB/s) and where the figure comes from."""
    if device.type != "cuda":
        return 0.0, "none (host run)"
    props = torch.cuda.get_device_properties(device)
    bus = getattr(props, "pci_bus_id", None)
    domain = getattr(props, "pci_domain_id", 0)
    dev = getattr(props, "pci_device_id", None)
    if bus is not None and dev is not None:
        sysfs = Path(f"/sys/bus/pci/devices/{domain:04x}:{bus:02x}:{dev:02x}.0")
        try:
            speed = float(re.findall(r"[\d.]+", (sysfs / "max_link_speed").read_text())[0])
            width = int((sysfs / "max_link_width").read_text().strip())
            return _link_gib_s(speed, width), f"{sysfs}: {speed:g} GT/s x{width}"
        except (OSError, IndexError, ValueError):
            pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=pcie.link.gen.max,pcie.link.width.max", "--format=csv,noheader",
                                  "-i", str(device.index or 0)], check=False, capture_output=True, text=True, timeout=10).stdout
            gen, width = (int(x) for x in out.strip().split(","))
            speed = {1: 2.5, 2: 5.0, 3: 8.0, 4: 16.0, 5: 32.0, 6: 64.0}[gen]
            return _link_gib_s(speed, width), f"nvidia-smi: PCIe Gen{gen} x{width}"
        except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
            pass
    return ASSUMED_PEAK_GB_S * 1e9 / GiB, "assumed PCIe Gen5 x16 (63.0 GB/s, PCIe 5.0 base specification)"


def _link_gib_s(gt_s: float, lanes: int) -> float:
    """Payload GiB/s of a PCIe link per direction (128b/130b coding from Gen3 on, 8b/10b before)."""
    coding = 128 / 130 if gt_s >= 8 else 8 / 10
    return gt_s * 1e9 * lanes * coding / 8 / GiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _busy(device: torch.device) -> None:
    """Queue a long kernel on the current stream (CUDA only), so unordered copies would race it."""
    if device.type == "cuda":
        torch.cuda._sleep(50_000_000)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Best wall time of ``repeats`` calls of ``fn`` (seconds), each synchronized."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


@contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    with torch.cuda.stream(stream) if stream is not None else nullcontext():
        yield


def check(layout: str, page_target: int, device: torch.device, args: argparse.Namespace,
          rng: np.random.Generator) -> Result:
    """Round-trip random blocks of ``layout`` with pages of about ``page_target`` bytes; time it."""
    per_token = token_bytes(layout, args.kv_heads, args.head_size)
    block_tokens = max(1, round(page_target / per_token))
    bpc = max(1, args.chunk_tokens // block_tokens)
    chunk_bytes = args.layers * bpc * block_tokens * per_token
    chunks = max(1, (args.mib << 20) // chunk_bytes)
    moved = chunks * bpc
    num_blocks = 2 * moved + 1  # saved blocks, loaded-into blocks, one never touched
    shape = layer_shape(layout, num_blocks, block_tokens, args.kv_heads, args.head_size)
    caches = {f"layers.{i}.attn": torch.zeros(shape, dtype=torch.bfloat16, device=device) for i in range(args.layers)}
    kv_layout = detect_layout(caches, num_blocks, f"check-{layout}")
    assert kv_layout.chunk_bytes(bpc) == chunk_bytes
    order = rng.permutation(2 * moved)
    blocks, targets = order[:moved], order[moved:]
    tier = CpuTier(chunks * chunk_bytes, chunk_bytes)
    pinned = tier.pin_host_memory() if device.type == "cuda" else False
    compute = torch.cuda.Stream(device) if device.type == "cuda" else None
    batched = {"auto": None, "batched": True, "host": False}[args.path]
    with _on(compute):  # the engine thread builds the copier: its compute stream is the current one
        copier = BlockCopier(kv_layout, caches, bpc, batched=batched)

    if compute is not None:
        compute.wait_stream(torch.cuda.current_stream(device))
    with _on(compute):
        _busy(device)
        for kv in caches.values():
            kv.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    keys = [i.to_bytes(16, "little") for i in range(chunks)]
    reserved = [tier.reserve(k) for k in keys]
    pages = [r.buffer for r in reserved if isinstance(r, Reservation)]
    assert len(pages) == len(keys), f"the cpu tier refused a page: {reserved}"
    spans = [Span(p, 0, blocks[i * bpc:(i + 1) * bpc].tolist()) for i, p in enumerate(pages)]
    with _on(compute):
        copier.save(spans)  # issued from the compute stream: ordered after the writes above
    for k in keys:
        tier.commit(k)
    loads = [Span(tier.view(k), 0, targets[i * bpc:(i + 1) * bpc].tolist()) for i, k in enumerate(keys)]
    dim = kv_layout.block_dim
    dst_idx = torch.as_tensor(targets, device=device)
    with _on(compute):  # vLLM zeroes newly allocated blocks on the compute stream before a load fills them
        _busy(device)
        for kv in caches.values():
            kv.index_fill_(dim, dst_idx, 0)
    copier.load(loads)  # from this thread, as a loader thread does
    _sync(device)
    src_idx = torch.as_tensor(blocks, device=device)
    equal = all(torch.equal(kv.index_select(dim, src_idx).view(torch.int16),
                            kv.index_select(dim, dst_idx).view(torch.int16)) for kv in caches.values())

    nbytes = chunks * chunk_bytes
    save_s = _timed(lambda: copier.save(spans), device, args.repeats)
    load_s = _timed(lambda: copier.load(loads), device, args.repeats)
    pin = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host.zero_()  # fault the pages in before timing
    dev.zero_()
    d2h_s = _timed(lambda: host.copy_(dev, non_blocking=pin), device, args.repeats)
    h2d_s = _timed(lambda: dev.copy_(host, non_blocking=pin), device, args.repeats)
    staged = copier.batched.staged_runs if copier.batched is not None else 0
    result = Result(layout, kv_layout.block_bytes, block_tokens, chunk_bytes, shape, moved, nbytes,
                    nbytes / save_s / GiB, nbytes / load_s / GiB, nbytes / d2h_s / GiB, nbytes / h2d_s / GiB,
                    pinned, staged, equal)
    return result


def run_runner(layout: str, page_target: int, device: torch.device, args: argparse.Namespace,
               rng: np.random.Generator) -> tuple[gpu_runner.RunnerResult, float, float]:
    """The runner mode (:mod:`gpu_runner`) over ``layout`` with pages of about ``page_target`` bytes."""
    per_token = token_bytes(layout, args.kv_heads, args.head_size)
    block_tokens = max(1, round(page_target / per_token))
    bpc = max(1, args.chunk_tokens // block_tokens)
    chunk_bytes = args.layers * bpc * block_tokens * per_token
    chunks = max(1, (args.runner_mib << 20) // chunk_bytes)
    num_blocks = 2 * chunks * bpc + 1
    shape = layer_shape(layout, num_blocks, block_tokens, args.kv_heads, args.head_size)
    caches = {f"layers.{i}.attn": torch.zeros(shape, dtype=torch.bfloat16, device=device) for i in range(args.layers)}
    out = gpu_runner.measure(layout, caches, num_blocks, block_tokens, bpc * block_tokens, chunks, args.repeats,
                             device, rng)
    del caches
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _runner_table(rows: list[tuple[gpu_runner.RunnerResult, float, float]], peak: float) -> list[str]:
    lines = [f"{'layout':<13}{'page KiB':>9}{'blocked us':>11}{'save GiB/s':>11}{'ratio':>7}{'load GiB/s':>11}"
             f"{'ratio':>7}" + (f"{'load/peak':>10}" if peak else "") + f"{'TTFT ms':>9}{'layerwise':>10}{'cut':>6}"
             f"{'endpoint':>9}{'ratio':>7}{'disk+copy':>10}{'bounced':>8}  held equal"]
    for r, d2h, h2d in rows:
        plain_d2h, plain_h2d = r.bytes_per_direction / d2h / GiB, r.bytes_per_direction / h2d / GiB
        lines.append(f"{r.layout:<13}{r.page_bytes / KiB:>9.1f}{r.blocked_us:>11.1f}{r.save_gib_s:>11.2f}"
                     f"{r.save_gib_s / plain_d2h:>7.2f}{r.load_gib_s:>11.2f}{r.load_gib_s / plain_h2d:>7.2f}"
                     + (f"{r.load_gib_s / peak:>10.2f}" if peak else "")
                     + f"{r.ttft_whole_ms:>9.2f}{r.ttft_layerwise_ms:>10.2f}{r.ttft_cut:>6.0%}"
                     f"{r.endpoint_gib_s:>9.2f}{r.endpoint_gib_s / plain_h2d:>7.2f}{r.endpoint_load_gib_s:>10.2f}"
                     f"{r.endpoint_bounced_runs:>8}  {r.held_steps:>4} {r.equal}")
    return lines


def estimate_s(args: argparse.Namespace, pages: list[int], layouts: list[str]) -> float:
    """A rough upper estimate of the run's seconds: bytes moved at :data:`ESTIMATE_GB_S` plus 2 s per check."""
    checks = len(pages) * len(layouts)
    moved = 0.0
    if args.mode in ("copy", "all"):
        moved += checks * (args.repeats + 1) * 4 * (args.mib << 20)  # save, load, plain both ways
    if args.mode in ("runner", "all"):
        moved += checks * (6 * args.repeats + 4) * 2 * (args.runner_mib << 20)  # + the device endpoint's loads
    return moved / (ESTIMATE_GB_S * 1e9) + 2.0 * checks * (2 if args.mode == "all" else 1)


def check_and_free(layout: str, page_target: int, device: torch.device, args: argparse.Namespace,
                   rng: np.random.Generator) -> Result:
    """:func:`check`, then give its device memory back (its tensors died with its frame)."""
    result = check(layout, page_target, device, args, rng)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def _table(results: list[Result], peak: float) -> list[str]:
    lines = [f"{'layout':<13}{'page KiB':>9}{'chunk MiB':>10}{'save GiB/s':>11}{'plain D2H':>10}{'ratio':>7}"
             f"{'load GiB/s':>11}{'plain H2D':>10}{'ratio':>7}" + (f"{'save/peak':>10}{'load/peak':>10}" if peak else "")
             + "  pinned staged equal"]
    for r in results:
        peaks = f"{r.save_gib_s / peak:>10.2f}{r.load_gib_s / peak:>10.2f}" if peak else ""
        lines.append(f"{r.layout:<13}{r.page_bytes / KiB:>9.1f}{r.chunk_bytes / (1 << 20):>10.1f}"
                     f"{r.save_gib_s:>11.2f}{r.plain_d2h_gib_s:>10.2f}{r.save_gib_s / r.plain_d2h_gib_s:>7.2f}"
                     f"{r.load_gib_s:>11.2f}{r.plain_h2d_gib_s:>10.2f}{r.load_gib_s / r.plain_h2d_gib_s:>7.2f}"
                     f"{peaks}  {r.pinned!s:>6} {r.staged_runs:>6} {r.equal}")
    return lines


def _check_args(args: argparse.Namespace) -> tuple[str | None, torch.device | None, list[int]]:
    """One sentence naming the one flag that is wrong (or None), the device, and the page sizes in bytes."""
    try:
        device = torch.device(args.device)
    except RuntimeError:
        return f"--device {args.device!r} is not a device; give cuda, cuda:N or cpu.", None, []
    if device.type not in ("cuda", "cpu"):
        return f"--device {args.device!r} is not a device this script checks; give cuda, cuda:N or cpu.", None, []
    if device.type == "cuda" and not torch.cuda.is_available():
        return "no CUDA device visible to torch; run with --device cpu for a smoke test", None, []
    for flag, value in (("--layers", args.layers), ("--kv-heads", args.kv_heads), ("--head-size", args.head_size),
                        ("--chunk-tokens", args.chunk_tokens), ("--mib", args.mib), ("--repeats", args.repeats),
                        ("--runner-mib", args.runner_mib)):
        if value <= 0:
            return f"{flag} must be positive, got {value}.", None, []
    if args.mib > MAX_MIB:
        return f"--mib must be at most {MAX_MIB} (64 GiB per direction), got {args.mib}.", None, []
    pages: list[int] = []
    for text in args.pages_kib.split(","):
        try:
            kib = float(text)
        except ValueError:
            return f"--pages-kib has {text!r}, not a number of KiB; give e.g. --pages-kib 16,256.", None, []
        if not 0 < kib <= MAX_PAGE_KIB:
            return ((f"--pages-kib has {text!r}: each page size must be above 0 and at most {MAX_PAGE_KIB} KiB "
                    "(1 GiB)."), None, [])
        if args.layers * kib * KiB > args.mib * (1 << 20):
            return ((f"--pages-kib has {text!r}: one page per layer ({args.layers} layers) is more than the "
                    f"--mib {args.mib} MiB moved per direction; lower --pages-kib or raise --mib."), None, [])
        pages.append(int(kib * KiB))
    unknown = [name for name in args.layouts.split(",") if name not in LAYOUTS]
    if unknown:
        return f"unknown layout {unknown[0]!r} in --layouts; choose from {', '.join(LAYOUTS)}", None, []
    if args.json is not None:
        problem = _writable(args.json)
        if problem:
            return problem, None, []
    return None, device, pages


def _writable(path: Path) -> str | None:
    """Why ``--json path`` cannot be written (one sentence), or None; tried now, not after the run."""
    existed = path.exists()
    try:
        with path.open("a"):
            pass
    except OSError as exc:
        return f"--json {str(path)!r} cannot be written ({exc.strerror}); give a writable file path."
    if not existed:
        path.unlink()
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test")
    parser.add_argument("--layers", type=int, default=32, help="attention layers, one cache tensor each (default 32)")
    parser.add_argument("--kv-heads", type=int, default=8,
                        help="KV heads per layer in kv-split and blocks-first (default 8; mla has one latent)")
    parser.add_argument("--head-size", type=int, default=128,
                        help="head size, elements, in kv-split and blocks-first (default 128; mla: 576 latent dims)")
    parser.add_argument("--pages-kib", default=DEFAULT_PAGES_KIB,
                        help="engine page sizes (one block of one layer), KiB, comma-separated, each at most "
                             f"{MAX_PAGE_KIB} KiB (1 GiB) and with --layers pages at most --mib; rounded to whole "
                             "tokens per block (the table shows the sizes used)")
    parser.add_argument("--chunk-tokens", type=int, default=256, help="tokens per kvtier chunk (page of the cpu tier)")
    parser.add_argument("--mib", type=int, default=256,
                        help=f"MiB moved per direction per measurement (at most {MAX_MIB})")
    parser.add_argument("--repeats", type=int, default=5, help="timed repetitions (best is reported)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS),
                        help="KV cache layouts to check, comma-separated, from kv-split (FlashAttention), "
                             "blocks-first (FlashInfer NHD) and mla (default: all three)")
    parser.add_argument("--path", choices=("auto", "batched", "host"), default="auto",
                        help="copy path: auto (batched on CUDA, per block on the host), or force one")
    parser.add_argument("--mode", choices=MODES, default="copy",
                        help="copy: the copy path alone; runner: kvtier's worker side driven as vLLM's GPU model "
                             "runner drives a connector (deferred saves, loads, layer-wise loads); all: both")
    parser.add_argument("--runner-mib", type=int, default=64,
                        help="MiB per direction per runner measurement (one request's chunks; default 64)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0) and 2
    problem, device, pages = _check_args(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    assert device is not None
    layouts = args.layouts.split(",")
    rng = np.random.default_rng(0)
    guess = estimate_s(args, pages, layouts)
    print(f"estimated run time at most about {guess:.0f} s ({len(pages) * len(layouts)} checks, mode {args.mode})")
    if guess > BUDGET_S and device.type == "cuda":
        print(f"the estimate is over the {BUDGET_S:.0f} s budget of a lent GPU; lower --mib, --runner-mib or "
              "--repeats, or give fewer --pages-kib.", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    results = [check_and_free(name, page, device, args, rng) for page in pages for name in layouts] \
        if args.mode in ("copy", "all") else []
    runs = [run_runner(name, page, device, args, rng) for page in pages for name in layouts] \
        if args.mode in ("runner", "all") else []
    peak, peak_source = pcie_peak(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "host"
    measured: list[Result] | list[gpu_runner.RunnerResult] = results or [r for r, _, _ in runs]
    rounded = sorted({(r.layout, asked, r.page_bytes) for asked, r in zip(
        [p for p in pages for _ in layouts], measured, strict=True) if r.page_bytes != asked})
    if rounded:
        print("page sizes rounded to whole tokens per block: " + ", ".join(
            f"{layout} {asked / KiB:g} -> {got / KiB:.1f} KiB" for layout, asked, got in rounded))
    print(f"device: {name}; torch {torch.__version__}; {args.layers} layers, bf16, {args.chunk_tokens}-token chunks; "
          f"{args.mib if results else args.runner_mib} MiB per direction, GiB/s best of {args.repeats}; plain = one contiguous copy_ of the same "
          f"bytes ({'pinned host' if device.type == 'cuda' else 'unpinned host'})")
    if peak:
        print(f"PCIe peak per direction: {peak:.1f} GiB/s ({peak_source})")
    if device.type != "cuda":
        print("host run: every GiB/s below is a host memcpy figure (no GPU, no PCIe link), a smoke test only")
    if results:
        for line in _table(results, peak):
            print(line)
    if runs:
        print("runner: kvtier's worker side driven as vLLM's GPU model runner (blocked = engine thread in "
              "wait_for_save per save call; ratio = kvtier / plain copy_; TTFT = start_load_kv to the last "
              "layer's op, whole vs layer-wise loads; endpoint = copy into the blocks from the pinned landing "
              "buffers a disk read without a cpu page lands in, disk+copy = that whole load through the loader, "
              "bounced = runs staged through a bounce buffer; held = steps until finished_sending)")
        for line in _runner_table(runs, peak):
            print(line)
    big = [r for r in results if r.page_bytes >= 256 * KiB]
    if big and device.type == "cuda":
        worst = min(min(r.save_gib_s / r.plain_d2h_gib_s, r.load_gib_s / r.plain_h2d_gib_s) for r in big)
        print(f"worst ratio to the plain copy_ at pages >= 256 KiB: {worst:.2f} (issue 23 asks >= 0.9)")
    equal = all(r.equal for r in results) and all(r.equal for r, _, _ in runs)
    print(f"{len(results) + len(runs)} checks in {time.perf_counter() - t0:.1f} s; bytes equal after the round "
          f"trip: {equal}")
    if args.json is not None:
        try:
            args.json.write_text(json.dumps({"device": name, "torch": torch.__version__, "pcie_peak_gib_s": peak,
                                             "gib_s_are": "device copies" if device.type == "cuda" else "host memcpy",
                                             "pcie_peak_source": peak_source, "args": {k: str(v) for k, v in
                                                                                       vars(args).items()},
                                             "results": [asdict(r) for r in results],
                                             "runner": [{**asdict(r), "plain_d2h_s": d2h, "plain_h2d_s": h2d}
                                                        for r, d2h, h2d in runs]}, indent=1) + "\n")
        except OSError as exc:  # checked up front; only a path that changed during the run gets here
            print(f"--json {str(args.json)!r} cannot be written ({exc.strerror}); the results above stand.",
                  file=sys.stderr)
            return 2
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
