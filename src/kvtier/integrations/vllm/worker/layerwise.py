"""Layer-wise synchronous loads (config ``layerwise_loads``, off by default until measured on a GPU).

A synchronous load (a cpu-tier hit copied in ``start_load_kv``, before the forward of the step
that schedules the request) normally copies every layer before ``start_load_kv`` returns, so
the whole transfer precedes the forward.  Layer by layer, ``start_load_kv`` pins the pages (the
load's errors are known then, as before) and issues one copy per layer; on CUDA each copy is
queued on its layer copier's streams and ends in an event, and ``wait_for_layer_load(layer)``
makes the engine's current (compute) stream wait for that layer's event only, on the device:
layer *i*'s attention waits for layer *i*'s bytes while later layers still cross the link (vLLM's
connector API, vllm/distributed/kv_transfer/kv_connector/v1/base.py ``wait_for_layer_load``;
LMCache, SGLang HiCache and FlexKV#272 load this way).  On the host the copies are plain memcpys,
done when issued, through the same calls.  A load's pages stay pinned, and its counters wait,
until its last layer's copy has ended: :meth:`LayerLoads.poll` (each step, never blocking) or
:meth:`LayerLoads.drain` (shutdown; bounded) end it.

Only a dense model (one full-attention KV cache group) loads layer by layer; hybrid models keep
their groups' rules (whole loads).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvtier.integrations.vllm.protocol import PageMove
from kvtier.integrations.vllm.worker.copy import BlockCopier, GroupCopiers, Span
from kvtier.integrations.vllm.worker.loader import load_runs

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class _Issued:
    """One load's layer copies in flight: their last event, and what to run once it has completed."""

    last: Any
    done: Callable[[], object]


class LayerLoads:
    """Per-layer copiers over one full-attention group, and the events of this step's layer copies.

    Args:
        copiers: the engine's copiers (one group).
        group: that group's index.
    """

    def __init__(self, copiers: GroupCopiers, group: int) -> None:
        whole = copiers.copiers[group]
        self.group = group
        self.names = whole.layout.layer_names
        self.slot_bytes = whole.blocks_per_chunk * whole.layout.block_bytes  # one layer's part of a page
        # one copier per layer, built here on the engine's thread (CUDA: its compute stream is captured)
        self.layers = [BlockCopier(dataclasses.replace(whole.layout, layer_names=(name,)), {name: kv},
                                   whole.blocks_per_chunk, batched=whole.batched is not None)
                       for name, kv in zip(whole.layout.layer_names, whole.layers)]
        self.device = whole.device
        self._events: dict[str, Any] = {}  # this step's layer -> event its copies end with (CUDA)
        self._issued: list[_Issued] = []

    def issue(self, moves: Sequence[tuple[PageMove, np.ndarray]], done: Callable[[], object]) -> None:
        """Queue every layer's copies of ``moves`` (page, buffer) in layer order; ``done`` runs once
        the last has ended (:meth:`poll`).  On the host each copy is done when this returns."""
        last = None
        for index, (name, layer) in enumerate(zip(self.names, self.layers)):
            lo = index * self.slot_bytes
            if layer.runs is not None:  # host caches of a few runs a block: one memmove per run, done here
                load_runs(layer, [(buffer[lo:lo + self.slot_bytes], page.first_slot, page.block_ids)
                                  for page, buffer in moves])
                continue
            spans = [Span(buffer[lo:lo + self.slot_bytes], page.first_slot, page.block_ids) for page, buffer in moves]
            last = layer.load(spans, wait=False)
            if last is not None:
                self._events[name] = last
        self._issued.append(_Issued(last, done))

    def wait_layer(self, name: str) -> None:
        """The engine's current stream waits (on the device) for ``name``'s copies of this step."""
        event = self._events.pop(name, None)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def poll(self) -> None:
        """End the loads whose last copy completed (never blocks); layer events not waited for are dropped."""
        self._events.clear()
        left = []
        for item in self._issued:
            if item.last is None or item.last.query():
                item.done()
            else:
                left.append(item)
        self._issued = left

    def drain(self, timeout_s: float) -> None:
        """End every load, waiting for their copies at most ``timeout_s`` in all (shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._issued and time.monotonic() < deadline:
            self.poll()
            if self._issued:
                time.sleep(0.001)
        if self._issued:
            log.warning("kvtier: %d layer-wise loads still copying at shutdown", len(self._issued))
