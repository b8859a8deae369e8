"""kvtier's vLLM integration: :class:`KVTierConnector`, a vLLM v1 KV connector.

Load it with::

    python -m vllm.entrypoints.openai.api_server --model MODEL --shutdown-timeout 30 \\
        --kv-transfer-config '{"kv_connector": "KVTierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"cpu_gib": 4, "disk_path": "/nvme/kvtier", "disk_gib": 100}}'

Contract: who owns what (anchor: vLLM's ``vllm/v1/kv_offload/`` and ``OffloadingConnector``)
------------------------------------------------------------------------------------------------

- **Workers own the bytes and the index.**  Each tensor-parallel worker rank owns one
  :class:`~kvtier.core.store.TieredStore` (its KV heads of every chunk: cpu pages, disk files,
  the index and the eviction policy over them) and does every transfer: engine ↔ cpu pages,
  cpu ↔ disk, on its own threads.
- **The scheduler owns a mirror and the plan.**  The scheduler-side connector keeps an in-memory
  mirror of which chunk keys each rank holds and in which tier
  (:class:`~kvtier.integrations.vllm.scheduler.steps.IndexMirror`; one view for all ranks: a chunk counts
  only when every rank holds it).  It answers ``get_num_new_matched_tokens`` from the mirror with
  no I/O, and plans loads and saves into the connector metadata vLLM ships to the workers each step.
- **One channel, vLLM's own.**  Scheduler → workers: ``KVTierMetadata`` (load and save jobs).
  Workers → scheduler: ``KVTierWorkerMeta`` from ``build_connector_worker_meta`` (each rank's
  index changes from :meth:`TieredStore.drain_changes`, merged over ranks by vLLM), received in
  ``update_connector_output``; load completions through ``get_finished`` and failed blocks through
  ``get_block_ids_with_load_errors``.  No socket, no pickle of ours, no second channel.
- **The mirror is a hint, the store is the truth.**  A chunk evicted after the mirror saw it makes
  the load come up short; the worker reports the missing blocks and vLLM recomputes them
  (``kv_load_failure_policy: recompute``).  Stale mirror → recompute, never wrong KV.
- **Loads are asynchronous.**  The request waits in ``WAITING_FOR_REMOTE_KVS`` while a worker
  thread reads/verifies disk chunks and copies into the request's blocks; the engine keeps
  stepping the other requests.  **Saves** copy out of the engine's blocks at the end of the step
  that computed them (bounded memcpy); disk writes run on the store's threads behind a bounded
  queue (full: dropped and counted).
- **Restart keeps the hot set.**  A graceful stop (connector ``shutdown()``: ``LLM`` deleted,
  SIGTERM to the api_server with ``--shutdown-timeout N``) writes dirty DRAM chunks to disk within
  ``shutdown_flush_s``; the default ``write-through`` mode bounds what a hard kill loses to the
  disk write queue (``kvtier_dirty_bytes`` shows it).  A restarted worker reports its disk index
  in its first step, before the first request is admitted.

The connector class is imported lazily (PEP 562 ``__getattr__``) so that modules of this package
that tools import, such as :mod:`kvtier.integrations.vllm.preflight` (``kvtier check``), do not import
vLLM and torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KVTierConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVTierConnector":
        from kvtier.integrations.vllm.connector import KVTierConnector

        return KVTierConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
