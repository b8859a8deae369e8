"""Scheduler side of the connector: decides what each step loads and saves, from memory only.

Files, split by step phase: on every step and every hit, :mod:`.side` (``SchedulerSide``: what
vLLM's scheduler calls, and this step's budget of synchronous loads), :mod:`.requests` (one request's
path: its ``RequestState``, chunk keys, receipt facts, and its receipt once finished) and
:mod:`.steps` (what the scheduler keeps across steps: the chunk-key memo, the ranks' indexes
mirrored from their reports and the pages of a hit, load and save planned from them,
``PagePlanner``, deferred saves, an idle engine's last steps); elsewhere, :mod:`.pages` (the
per-group plan arithmetic a hybrid model's pages take), :mod:`.remote` (shared-tier lookups off the
scheduler's thread), :mod:`.events` (vLLM KV events), :mod:`.reset` (external resets),
:mod:`.setup` (once per engine: start-up checks, the sync budget's settings, shutdown) and
:mod:`.pins` (a request's TTL pin ask).  Design notes: docs/scheduler.md.  Nothing
here imports torch or does I/O on the scheduler's thread.

Every model takes one path: a dense model is a one-group plan
(:class:`~.steps.PagePlanner` over :class:`~.pages.HybridPlan`), its pages are its chunks.  Per request::

    get_num_new_matched_tokens(req, local)   hash the prompt's full chunks (cached per request),
        look the pages up in the mirror of every rank's index -> hit = the largest chunk
        boundary every group can resume at (capped so ≥ 1 prompt token is computed), and the
        tier of each chunk (the slowest of its pages'); returns (hit - local, True): vLLM
        allocates the blocks and parks the request in WAITING_FOR_REMOTE_KVS.  A hit whose
        chunks to load are all in the cpu tier (or the node pool: ``setup.sync_tiers``) and fit what is left of this step's
        ``sync_load_max_bytes`` (one full-attention group only) returns (hit - local, False)
        instead: vLLM schedules the request's tail in this very step and the workers copy the
        chunks in start_load_kv before its forward (a synchronous load).  No file, socket
        or network I/O.  Before the workers' first report it answers None ("ask next step").
        With a shared tier (``redis_url``), the pages no local tier holds are asked about in
        the background (:mod:`~kvtier.integrations.vllm.scheduler.remote`); None while that runs, at most
        ``shared_deadline_s``, then the pages found there join the hit.
    get_external_cache_hit_sources           the hit split by planned tier (tokens_by_tier)
    update_state_after_alloc(req, blocks, n) n > 0: queue a LoadJob: the pages that resume every
                                             group at the hit, and the planned tier per chunk
    build_connector_meta(step)               ship queued loads; for every scheduled request
                                             whose computed tokens complete new full chunks
                                             this step, a SaveJob with those chunks' pages
    update_connector_output(out)             fold each rank's index changes into the mirror
    request_finished(req)                    forget the request; True (vLLM holds its blocks
                                             until the ranks name it in finished_sending) when
                                             a deferred save (async_saves) may still read them
    (pins)                                   a request whose kv_transfer_params carry
                                             ``kvtier_pin_s`` gets its prompt's chunks pinned in
                                             the cpu tier by the workers as they save them
                                             (SaveJob.pin_s; TieredStore.ttl_pin)
    reset_cache()                            vLLM's external prefix-cache reset: see below

An asynchronous load job always ends with the request in ``finished_recving`` (the worker reports
it whether the load succeeded, came up short or failed).  A synchronous one never does: its
missing blocks (a chunk evicted since the mirror said it was there; the worker pins what it finds
before copying) come back as ``invalid_block_ids`` of its own step, vLLM recomputes the running
request from the first one (``_handle_invalid_blocks`` on ``self.running``), the worker did not
save that step's chunks from there, and the scheduler saves them again once recomputed.  With one KV cache group, missing blocks are
reported through ``get_block_ids_with_load_errors`` in the same step or earlier, so vLLM (policy
``recompute``) keeps the valid prefix and recomputes the rest (vllm/v1/core/sched/scheduler.py:
``_update_requests_with_invalid_blocks``, ``_update_waiting_for_remote_kv``); with several,
vLLM takes no block ids and a load that cannot deliver every page fails whole
(``failed_recving``).  The number of groups chooses; the path is the same.

Hit attribution: vLLM asks for the hit's sources at admission, from this plan; the load job
carries the plan's tier per chunk and the workers label their loaded-token counters with it
(:class:`~kvtier.core.stats.StoreStats` ``loaded_tokens``, ``unfilled_tokens``), so the two agree
per tier exactly.
"""
