"""vLLM's GPU model runner without vLLM: ``scripts/gpu_check.py --mode runner``.

Builds a KV cache in one of vLLM's layouts (see gpu_check.py), kvtier's worker side over it
(:meth:`kvtier.integrations.vllm.worker.side.WorkerSide.over`: the cpu tier, the copiers, the
loader, the saver thread, as ``register_kv_caches`` builds them), and drives it step by step as
vllm/v1/worker/gpu_model_runner.py ``execute_model`` and
vllm/v1/worker/kv_connector_model_runner_mixin.py call a connector:
``handle_preemptions`` → ``bind_connector_metadata`` / ``start_load_kv`` → per layer
``wait_for_layer_load`` + an attention-sized op on the compute stream (reading that layer's
blocks) + ``save_kv_layer`` → ``wait_for_save`` → ``get_finished`` → ``build_connector_worker_meta``.
On CUDA the caches live on the device and the steps run on a compute stream (the engine
thread's current stream); on the host (``--device cpu``) the same calls run on host tensors.

Per layout and page size it measures:

- **blocked**: the engine thread's time in ``wait_for_save`` per save call (a deferred save:
  reserve, record an event, queue), mean over the repeats, microseconds;
- **save / load GiB/s**: a deferred save's bytes over the time from ``wait_for_save`` to the saver
  having copied them; a synchronous load's bytes over ``start_load_kv`` (whole loads) on a
  synchronized device; each beside a plain pinned ``copy_`` of the same bytes (gpu_check.py);
- **TTFT-like**: from ``start_load_kv`` to the last layer's op done, whole loads vs
  ``layerwise_loads``, with the op sized so that its time over all layers equals the load's
  (a partial hit whose load and tail compute are of the same size: issue 37's bar is -30 %);
- **endpoint**: the device endpoint (:mod:`gpu_endpoint`): chunks read from a disk tier without a
  cpu page land in pinned landing buffers and are copied from there into the blocks: that copy's
  GiB/s beside the plain pinned ``copy_``, a whole disk load's GiB/s, the runs the CUDA path had
  to bounce (0 when every copy went straight from the landing buffer);
- **equal**: every loaded block equals its saved block byte for byte, in every layer (every load).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import gpu_endpoint
import numpy as np
import torch

from kvtier.core.config import KVTierConfig
from kvtier.core.keys import Namespace, chunk_keys
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.cache_groups import GroupKind, GroupSpec
from kvtier.integrations.vllm.protocol import KVTierMetadata, LoadJob, PageMove, SaveJob
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.layout import detect_layout
from kvtier.integrations.vllm.worker.loader import LoadPath
from kvtier.integrations.vllm.worker.registration import Registered
from kvtier.integrations.vllm.worker.side import WorkerSide

GiB = float(1 << 30)
STEP_LIMIT = 2000  # steps a held request may take to be reported in finished_sending, at most


@dataclass(frozen=True)
class RunnerResult:
    """One layout at one page size, driven as vLLM's runner drives a connector."""

    layout: str
    page_bytes: int
    chunks: int
    bytes_per_direction: int
    blocked_us: float
    save_gib_s: float
    load_gib_s: float
    ttft_whole_ms: float
    ttft_layerwise_ms: float
    held_steps: int
    endpoint_gib_s: float
    endpoint_load_gib_s: float
    endpoint_pinned: bool
    endpoint_bounced_runs: int
    equal: bool

    @property
    def ttft_cut(self) -> float:
        """Share of the TTFT-like time layer-wise loads remove (0.3 = 30 % shorter)."""
        return 1 - self.ttft_layerwise_ms / self.ttft_whole_ms if self.ttft_whole_ms else 0.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Runner:
    """kvtier's worker side over ``caches``, and the model runner's calls, step by step."""

    def __init__(self, caches: dict[str, torch.Tensor], num_blocks: int, block_tokens: int, chunk_tokens: int,
                 chunks: int, repeats: int, device: torch.device) -> None:
        self.caches, self.device = caches, device
        self.names = list(caches)
        self.block_tokens, self.chunk_tokens = block_tokens, chunk_tokens
        self.bpc = chunk_tokens // block_tokens
        layout = detect_layout(caches, num_blocks, "runner")
        group = GroupSpec(index=0, kind=GroupKind.FULL, block_size=block_tokens, layer_names=tuple(self.names),
                          window_tokens=0, page_bytes=layout.block_bytes)
        self.copiers = GroupCopiers((group,), chunk_tokens, {0: layout}, caches)
        pages = chunks * (repeats + 2)
        self.config = KVTierConfig(chunk_tokens=chunk_tokens, tiers=("cpu",), io_threads=2, idle_step_wait_s=0.001,
                                   cpu_gib=pages * self.copiers.page_bytes / GiB, async_saves=True)
        namespace = Namespace("gpu-check-runner", str(layout.dtype), layout.num_layers, 1, layout.block_bytes,
                              layout.describe(), chunk_tokens=chunk_tokens)
        store = TieredStore(self.config, namespace, self.copiers.page_bytes)
        if device.type == "cuda":
            store.cpu.pin_host_memory()
        path = LoadPath(store, self.copiers, chunk_tokens, partial=True)  # on config.io_threads loader threads
        self.sides = {lw: WorkerSide.over(self.config.model_copy(update={"layerwise_loads": lw}), (group,),
                                          Registered(layout, self.copiers, store, path, namespace))
                      for lw in (False, True)}
        self.store = store
        self._seq = 0
        self._root = b"\x00" * 16

    def close(self) -> None:
        layered = self.sides[True]
        if layered.layer_loads is not None:
            layered.layer_loads.drain(10.0)
        if layered.saver is not None:
            layered.saver.close(10.0)
        self.sides[False].shutdown()  # the store they share is closed once

    # ---- one engine step, as gpu_model_runner.execute_model calls a connector ---------------
    def step(self, side: WorkerSide, meta: KVTierMetadata, op: Any = None) -> tuple[float, set[str]]:
        """One step; returns (seconds in wait_for_save, finished_sending)."""
        side.handle_preemptions(meta)
        side.start_load(meta)  # bind_connector_metadata + start_load_kv
        for index, name in enumerate(self.names):
            side.wait_for_layer_load(name)
            if op is not None:
                op(index)  # the layer's attention, on the compute stream
            # save_kv_layer: kvtier saves whole chunks in wait_for_save
        t0 = time.perf_counter()
        side.save(meta)  # wait_for_save
        blocked = time.perf_counter() - t0
        sending = side.finished_saves()  # get_finished
        side.finished_loads(set())
        side.worker_meta()  # build_connector_worker_meta
        return blocked, sending

    def pages(self, tag: int, blocks: np.ndarray) -> tuple[PageMove, ...]:
        tokens = list(range(tag * 1_000_000, tag * 1_000_000 + blocks.size * self.block_tokens))
        keys = chunk_keys(self._root, tokens, self.chunk_tokens)
        return tuple(PageMove(bytes(k), 0, c, 0, tuple(int(b) for b in blocks[c * self.bpc:(c + 1) * self.bpc]))
                     for c, k in enumerate(keys))

    def save(self, side: WorkerSide, req: str, pages: tuple[PageMove, ...]) -> tuple[float, float, int]:
        """A request that computes ``pages`` and finishes in that step: (blocked s, copy s, held steps)."""
        self._seq += 1
        t0 = time.perf_counter()
        blocked, _ = self.step(side, KVTierMetadata(saves=[SaveJob(req, pages, seq=self._seq)]))
        assert side.saver is not None
        side.saver.wait_for([req], 60.0)
        copy_s = time.perf_counter() - t0
        steps = 0  # request_finished said True: vLLM steps on, the request named in a held set
        held = frozenset({req})
        while steps < STEP_LIMIT:
            steps += 1
            _, sending = self.step(side, KVTierMetadata(held=held, no_forward=True))
            held = frozenset()
            if req in sending:
                break
        return blocked, copy_s, steps

    def load(self, side: WorkerSide, req: str, pages: tuple[PageMove, ...], op: Any) -> float:
        """A synchronous cpu-tier load of ``pages`` then the forward: seconds to the last op done."""
        job = LoadJob(req, pages, 0, len(pages) * self.chunk_tokens, ("cpu",) * len(pages), sync=True)
        _sync(self.device)
        t0 = time.perf_counter()
        self.step(side, KVTierMetadata(loads=[job]), op)
        _sync(self.device)
        return time.perf_counter() - t0


def _best(fn: Any, repeats: int) -> float:
    return min(fn() for _ in range(repeats))


def _plain(nbytes: int, device: torch.device, repeats: int) -> tuple[float, float]:
    """Seconds of one plain ``copy_`` of ``nbytes`` device → pinned host and back (best of ``repeats``)."""
    pin = device.type == "cuda"
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)
    dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)

    def timed(fn: Any) -> float:
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        return time.perf_counter() - t0

    return (_best(lambda: timed(lambda: host.copy_(dev, non_blocking=pin)), repeats),
            _best(lambda: timed(lambda: dev.copy_(host, non_blocking=pin)), repeats))


def measure(name: str, caches: dict[str, torch.Tensor], num_blocks: int, block_tokens: int, chunk_tokens: int,
            chunks: int, repeats: int, device: torch.device, rng: np.random.Generator,
            ) -> tuple[RunnerResult, float, float]:
    """Drive the worker side over ``caches`` (see the module docstring); the result and the plain
    copy's D2H and H2D seconds for the same bytes."""
    cuda = device.type == "cuda"
    compute = torch.cuda.Stream(device) if cuda else None
    ctx = torch.cuda.stream(compute) if compute is not None else _Null()
    with ctx:  # the engine thread's current stream: the copiers capture it, the steps run on it
        runner = Runner(caches, num_blocks, block_tokens, chunk_tokens, chunks, repeats, device)
        try:
            return _measure(name, runner, caches, chunks, repeats, device, rng)
        finally:
            runner.close()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _measure(name: str, runner: Runner, caches: dict[str, torch.Tensor], chunks: int, repeats: int,
             device: torch.device, rng: np.random.Generator) -> tuple[RunnerResult, float, float]:
    cuda = device.type == "cuda"
    bpc = runner.bpc
    moved = chunks * bpc
    order = rng.permutation(2 * moved)
    src, dst = order[:moved], order[moved:]
    layout = runner.copiers.copiers[0].layout
    dim = layout.block_dim
    dst_idx = torch.as_tensor(dst, device=device)
    src_idx = torch.as_tensor(src, device=device)
    if cuda:
        torch.cuda._sleep(50_000_000)  # the writes below come late: a save that did not wait reads stale bytes
    for kv in caches.values():
        kv.view(torch.int16).random_(-(1 << 15), (1 << 15) - 1)
    whole, layered = runner.sides[False], runner.sides[True]
    blocked, copies, held = [], [], []
    for r in range(repeats):  # fresh chunks each time: every save copies
        b, c, h = runner.save(whole, f"save-{r}", runner.pages(r, src))
        blocked.append(b)
        copies.append(c)
        held.append(h)
    nbytes = chunks * runner.copiers.page_bytes
    loads = runner.pages(0, dst)  # the keys of save 0, into other blocks

    def zero() -> None:
        if cuda:
            torch.cuda._sleep(20_000_000)  # zeroed late: a load that did not wait for it is zeroed over
        for kv in caches.values():
            kv.index_fill_(dim, dst_idx, 0)

    def equal() -> bool:
        _sync(device)
        return all(torch.equal(kv.index_select(dim, src_idx).view(torch.int16),
                               kv.index_select(dim, dst_idx).view(torch.int16)) for kv in caches.values())

    ok = True
    load_s = float("inf")
    for r in range(repeats):
        zero()
        load_s = min(load_s, runner.load(whole, f"load-{r}", loads, None))
        ok = ok and equal()
    last = layout.block_shape[-1]
    weight = torch.ones(last, last, dtype=layout.dtype, device=device)
    reps = [1]

    def op(index: int) -> None:  # attention-sized: reads the layer's loaded blocks, a matmul over them
        kv = caches[runner.names[index]]
        rows = kv.index_select(dim, dst_idx).reshape(-1, last)
        for _ in range(reps[0]):
            rows = rows @ weight if rows.is_floating_point() else rows
        rows.sum()

    _sync(device)
    t0 = time.perf_counter()
    for i in range(len(runner.names)):
        op(i)
    _sync(device)
    reps[0] = max(1, round(load_s / max(time.perf_counter() - t0, 1e-6)))  # compute ≈ load, all layers
    ttft = {}
    for lw, side in ((False, whole), (True, layered)):
        best = float("inf")
        for r in range(repeats):
            zero()
            best = min(best, runner.load(side, f"ttft-{lw}-{r}", loads, op))
            ok = ok and equal()
        ttft[lw] = best
    ep = gpu_endpoint.measure_endpoint(runner, loads, zero, equal, repeats, lambda: _sync(device))
    d2h, h2d = _plain(nbytes, device, repeats)
    result = RunnerResult(name, layout.block_bytes, chunks, nbytes, 1e6 * sum(blocked) / len(blocked),
                          nbytes / min(copies) / GiB, nbytes / load_s / GiB, 1e3 * ttft[False], 1e3 * ttft[True],
                          max(held), nbytes / ep.copy_s / GiB, nbytes / ep.load_s / GiB, ep.pinned, ep.bounced_runs,
                          ok and ep.equal)
    return result, d2h, h2d
