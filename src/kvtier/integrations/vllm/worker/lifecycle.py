"""A rank's turns outside the step: a reset order's clear of the store, and the graceful stop (loads, saves, store).

Both are rare (an operator's reset, the engine's shutdown) and run on the engine's thread from
:class:`~kvtier.integrations.vllm.worker.side.WorkerSide`: the step's own path stays in :mod:`.side`.
No vLLM import.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

from kvtier.core.config import KVTierConfig
from kvtier.core.store import TieredStore
from kvtier.integrations.vllm.process_exit import skip_exit_collection
from kvtier.integrations.vllm.protocol import ResetOrder
from kvtier.integrations.vllm.worker.layerwise import LayerLoads
from kvtier.integrations.vllm.worker.outcomes import Outcomes
from kvtier.integrations.vllm.worker.saves import SaveQueue
from kvtier.integrations.vllm.worker.shutdownflush import flush_line, flush_on_stop

log = logging.getLogger(__name__)


def clear_for_reset(store: TieredStore, order: ResetOrder, rank: str) -> None:
    """Clear ``order.tiers`` of ``store``; a tier that could not be cleared whole is logged (the
    scheduler has already answered vLLM)."""
    t0 = time.monotonic()
    results = store.clear(order.tiers)
    problems = [f"{tier}: {r.reason}" for tier, r in results.items() if not r.ok]
    log.info("kvtier: %s reset %d cleared %s in %.2f s%s", rank, order.epoch,
             ", ".join(f"{tier} ({len(r.keys)} chunks)" for tier, r in results.items()) or "nothing",
             time.monotonic() - t0, f"; not whole: {'; '.join(problems)}" if problems else "")


def stop_loads(pool: ThreadPoolExecutor, outcomes: Outcomes, timeout_s: float) -> None:
    """Cancel the loads ``pool`` has not started, wait up to ``timeout_s`` for running ones.  Idempotent."""
    pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with outcomes.lock:
            if not any(not f.cancelled() for f in outcomes.inflight.values()):
                break
        time.sleep(0.01)


def stop_rank(store: TieredStore, layer_loads: LayerLoads | None, saver: SaveQueue | None, config: KVTierConfig,
              rank: str) -> None:
    """After the loader stopped: drain the layerwise loads, close the deferred saves, flush dirty
    chunks to disk within ``shutdown_flush_s``, stop the store."""
    if layer_loads is not None:
        layer_loads.drain(config.load_wait_s)
    if saver is not None:  # deferred saves publish before the flush writes dirty chunks
        saver.close(config.shutdown_flush_s / 2)
    flushed = flush_on_stop(store, config.shutdown_flush_s)
    # logged with nothing dirty too, so that an operator can tell the graceful path ran
    log.log(*flush_line(flushed, rank, store.chunk_bytes, config.shutdown_flush_s))
    t1 = time.monotonic()
    store.close(timeout_s=max(config.shutdown_flush_s - flushed.seconds, 1.0))
    if time.monotonic() - t1 > 1.0:  # vLLM sends SIGTERM after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS (5)
        log.warning("kvtier: %s store close (queued writes, tier threads) took %.1f s", rank, time.monotonic() - t1)
    skip_exit_collection()  # the worker process exits within a second of the flush: process_exit
