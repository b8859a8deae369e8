"""Worker side of the connector: owns this rank's store and bytes, moves blocks in and out.

Files: :mod:`.side` (``WorkerSide``: what vLLM's model runner calls, and ``AsyncLoader``, the engine
thread's end of the asynchronous loads), :mod:`.lifecycle` (a reset's clear, the graceful stop),
:mod:`.registration` (the store, copiers and load path built over the engine's caches), :mod:`.loader`
(one load's path on its loader thread, each load's facts for its receipt, and ``tokens_by_tier``,
the split of a load's tokens by planned tier that the scheduler's hit sources and receipts share),
:mod:`.syncload` (loads on the engine's thread, before the forward), :mod:`.saves` (saves after the forward),
:mod:`.copy` and :mod:`.batched` (engine blocks ↔ pages: host and batched CUDA paths),
:mod:`.layout` (the caches' shapes), :mod:`.identity` (the model's fingerprint in the namespace).

- ``register_kv_caches``: request AMX tile permission (:mod:`.registration`), detect the layout, build the
  namespace (with the identity fingerprint) and the rank's :class:`~kvtier.core.store.TieredStore`.
- ``start_load``: hand each load job to the :class:`~kvtier.integrations.vllm.worker.side.AsyncLoader`
  (returns at once), or, for a synchronous job (a cpu-tier hit within ``sync_load_max_bytes``),
  copy it here before the forward; ``finished_loads`` reports ended asynchronous loads (vLLM's
  ``get_finished``) and ``take_errors`` the blocks any load could not fill
  (``get_block_ids_with_load_errors``).  In a step that computes no tokens
  (``KVTierMetadata.no_forward``) with a load in flight, ``finished_loads`` first waits up to
  ``idle_step_wait_s`` for one to end, so an engine whose requests are all parked does not spin.
- ``save``: after the forward pass, copy each save job's full chunks out of the engine into cpu
  pages and publish them (a bounded memcpy on the engine's thread); disk writes then happen on
  the store's threads through its bounded queue (full: dropped and counted).  The copy is done
  when the call returns, so no save outlives the blocks it reads and vLLM may free them at once.
- ``worker_meta``: this rank's index changes for the scheduler's mirror (vLLM carries them).
- the eviction gate (:mod:`kvtier.core.gate`): ``worker_meta`` closes it before draining the
  changes; ``start_load`` opens it once the step's loads are pinned (an asynchronous job's cpu
  pages pinned on the engine's thread in ``AsyncLoader.submit``), so no page the scheduler
  planned from that drain leaves before its load pins it (vLLM's synchronous scheduling).
- a reset order (``KVTierMetadata.reset``): applied in ``start_load`` before the step's loads:
  the store is cleared (:meth:`~kvtier.core.store.TieredStore.clear`), loads started before it
  end failed (:class:`~kvtier.integrations.vllm.worker.side.AsyncLoader` compares the store's epoch),
  and the next report carries the order's epoch with a full snapshot.
- ``shutdown``: stop loading, write dirty DRAM chunks to disk within ``shutdown_flush_s``
  (what misses the deadline is counted and logged), stop the store.
"""
