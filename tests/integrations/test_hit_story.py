"""One disk-tier hit read as a story (issue 33, its first "Done when"): scripts/hit_story.py
profiles one kvtier disk hit through a real in-process vLLM engine on every thread, from
``add_request`` to the step that returns the first token, and counts the kvtier source files that
run and the calls from one kvtier file into another (the moves).

The engine test is a ratchet: the counts may only go down.  The profiler's own counting is
checked first, without an engine, on a two-file package written here."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "hit_story.py"

# Measured with the script's defaults (808-token prompt, 6 chunks of 128 tokens loaded from disk,
# 2 engine steps) on a 2-core machine at load 6-10: at aa01ead 31 files, 5 threads, 608-613 moves
# over 6 runs (2,155-2,161 kvtier calls); after this round's splits (0145c67) 36 files and 755-759
# moves: the vLLM integration's side packages spread one step's calls over more, smaller files
# (scheduler/side.py, pages.py, sync.py, worker/side.py, copy.py, stats_table.py: +4 files, +14
# moves), and policies/adaptive.py, split under 400 lines, calls its shadow orderings in
# policies/orderings.py 132 times per hit.  idle_step_wait_s 1.0 and disk_io buffered fix the engine
# steps and the read path; what still varies is the loader's wait for the chunks read ahead
# (integrations/vllm/worker/loader.py ``_copy_as_ready``: a poll every 2 ms, 3 moves into
# core/handles.py each, and 2 more when it finds chunks to copy), so the bound allows 19 more polls
# than the most seen.  Issue 33's rebuild (an index and a mover in place of the store's seven files)
# is done at <= 12 files and <= a quarter of aa01ead's moves (152): lower these numbers as the code
# gets there (the slack can go with the poll), never raise them for a change of the hit path.
# The store as index + mover (core/index.py, upkeep.py, mover.py in place of top, lower, promotion,
# shared): 36 files, 653 moves (one run, 2,151 kvtier calls); the store's own moves fell from
# ~170 (store -> top 51, top -> cpu 60, ...) to ~70 (index -> cpu tier 66 is most of them).
# With the request context, the blob verbs and the eviction gate merged on top (7c4923f): 39 files,
# 700 moves (2 runs, 2,216 kvtier calls).  Raised, honestly, for three files that joined the disk
# hit: core/sinks.py (the store's counters are now one sink of the request's events: store -> sinks
# 4, mover -> sinks 3, sinks -> stats 5), core/tiers/disk/reads.py (the disk tier's reads, split
# out of tier.py for the variable-length blob verbs) and core/codecs.py (the read judges the
# header's codec chain, once per chunk).  Still far from issue 33's <= 12 files.
# The hit path made short (branch hitpath, 4500988): 39 -> 37 files, 700 -> 374 moves (one run,
# 2,216 -> 1,408 kvtier calls).  core/tiers/registry.py (275 calls) and worker/layout.py left the
# hit: what is derived from the tier records is derived once per registration (registry.generation);
# stats_table -> stats 112 -> 0 (the per-step readers read a tier's numbers themselves);
# adaptive -> orderings 132 -> 24 (one call replays every shadow); index -> cpu tier 66 -> 24 (the
# cpu tier's contains is its page map's C membership test); a dense lookup asks the mirror once.
# With the cache receipts (issue 35, receipts branch): 43 files, 750 moves (one run, 2,015 kvtier
# calls).  Raised, honestly, for four files the receipts put on the disk hit: core/ghosts.py (the
# story's disk hit is a ghost hit: the cpu tier evicted the prompt, and its promotion finds the
# ghost), integrations/vllm/worker/facts.py (each load's facts for its receipt), and on the
# scheduler's side integrations/vllm/scheduler/receipts.py (what vLLM counts at admission) and
# core/receipt.py (the receipts of the requests that finish within the window).
# All merged (receipts + hitpath + codecs + node, e13a034): 43 files, 436 moves (one run, 1,813 kvtier
# calls): the receipts' four files, and core/codecstats.py (the read counts its codec's bytes and
# seconds) and core/receiptsinks.py (the scheduler ships its receipt sinks' drops) joined the hit.
# With deferred saves merged (issue 37, 0a6a383): 44 files, 456 moves (one run, 1,852 calls):
# integrations/vllm/scheduler/deferred.py (the scheduler asks whether a finishing request's save
# is still running) joined the hit.
# Lowered on branch hitstory (d6beff8): 37 files, 378 moves (one run, 1,204 kvtier calls, from 1,852).
# Left the hit: scheduler/deferred.py and settle.py (merged into requests.py and steps.py, with sync.py),
# scheduler/reset.py, core/policies/base.py (the adaptive policy's victim search inlined: 29 calls of its
# callbacks), core/codecstats.py and core/tiers/base.py (the per-step tier stats keep the codec counters
# found once and ask wire stats of shared tiers only), core/receiptsinks.py (asked only with sinks),
# integrations/vllm/cache_groups.py (a dense load asks no window).  Moves: the adaptive policy's shadow
# replay is recorded on the load and replayed once per step in one call (adaptive -> orderings 24 -> 8),
# the change feed's drain asks each key's tier in changes.py itself (24 moves), the per-step stats read
# the snapshot in one pass (stats_table: 620 calls -> 34).
# At 0db4b7d (the per-step stats find the top tier without core/tiers/registry.py): 36 files, 376 moves
# (one run, 1,186 calls).
# Lowered on branch hitcost3 (6867fa0): 35 files, 351 moves (two runs, 947 kvtier calls, load 2.6-4.1),
# from 36 files and 355 moves at main 0f97927 (measured in the same lock hold).  Left the hit:
# core/keys.py (the scheduler's key memo gives the hit request its chunk keys, found by vLLM's block
# hashes, and its root and tenant come from a cache: requests -> keys 2 -> 0, requests -> tenant
# 1 -> 0); prepare_load calls the mover only with spills to queue (store -> mover 4 -> 3).
# Lowered on branch hitfiles (421f423): 32 files, 342 moves (one run, 975 kvtier calls, load 5-6), from
# 35 and 351 at main d72f224 (measured at the start of the branch).  Left the hit: core/codecs.py (a
# chain's ids and passthrough are attributes derived once: reads -> codecs 12 -> 0),
# integrations/vllm/scheduler/pages.py (PagePlanner moved to mirror.py, with the mirror it reads; the
# plan arithmetic, HybridPlan, stays in pages.py and a dense hit does not ask it), core/upkeep.py (the
# per-step verbs: eviction gate, pin_resident, TTL expiry, tier_stats, joined the change feed in
# core/changes.py: store -> upkeep 9 -> 0, store -> changes 4 -> 13).
# Then (85495e8): 31 files, 328 moves (one run, 969 calls, load 6.6).  core/tiers/disk/chunkio.py left
# the hit: a read's I/O (read_chunk, the buffered serial/split read) is reads.py's, the shared aligned
# buffers readchoice.py's (reads -> chunkio 6, chunkio -> reads 6, chunkio -> readchoice 12 became
# reads -> readchoice 14); chunkio.py keeps the tier's I/O settings and the writes.
# Lowered on branch moves33 (d584560): 31 files, 248 moves (2 runs, 906 kvtier calls, load 4.6-5.4), from
# 327 at main 57a714e (measured at the start of the branch, load 1).  A load's per-chunk calls between files
# became one call per load or per run of chunks read from below: the promotion reserves, frees and commits
# its cpu pages, takes its policy victims and inserts, and takes and adds its ghosts in one call each
# (index -> cpu tier 24 -> 6, index -> adaptive 22 -> 6, index -> ghosts 12 -> 1, index -> stats 6 -> 1),
# the disk tier's indexed() is its dict's C membership test and contains_many() answers a load's chain at
# once (index -> disk tier 12 -> 1, changes -> disk tier 8 -> 2), the envelope checks a read's header in one
# call (reads -> envelope 18 -> 6), and the step's policy settle runs in changes.py (changes -> index 2 -> 0).
# Lowered on branch files_core (3bd71f1): 29 files, 243 moves (one run, 958 kvtier calls, load 3-5), from 31 and
# 248 at main 783b5c0 (measured at the start of the branch, load 0.5).  The core split by step phase, not by
# noun: core/stats.py left the hit (the store's counters, StoreCounters, are counted in core/sinks.py, where the
# events arrive: sinks -> stats 5 -> 0), and core/changes.py left it (the change feed's drain, the eviction gate,
# pin_resident, may_free_page and tier_stats are Index's own in core/index.py, with a load's path; changes.py keeps
# the index's state and its set-up, IndexState, and the feed's rare verbs; store -> changes 13 became store -> index).
# Lowered on branch files_tiers: 29 files, 242 moves (load 3-8), from 31 and 252 at main 783b5c0 (measured at
# the start of the branch, load 2.3).  A split by step phase instead of by noun: core/tiers/disk/reads.py left the
# hit (DiskTier's hit calls and the verified read's I/O are disk/tier.py's; its set-up, writes and accounting
# moved to disk/files.py, reads off the hit stay in reads.py: reads -> disk/tier 6 -> 0), and core/tenant.py left
# it (the record check each verified read runs, with RecordedTenant, is core/envelope.py's, whose writing half
# went down to core/sealing.py: disk/tier -> envelope 6 -> 12, -> tenant 6 -> 0).
# Lowered on branch files_sched (issue 33's split by step phase, the scheduler's area): 29 files, 241 moves
# (one run at 427e7a2, 966 kvtier calls, load 6-11), from 31 and 248 at main 783b5c0 (load 0.6).  Left the
# hit: integrations/vllm/scheduler/mirror.py (IndexMirror joined steps.py, what the scheduler keeps across
# steps; PagePlanner joined requests.py, a request's path) and integrations/vllm/protocol.py (tokens_by_tier,
# the one split of a hit's tokens by tier, moved to core/receipt.py, which the receipt runs anyway; the
# scheduler computes a load's blocks where it sets them, without LoadJob.block_ids).  Moves: each step is begun
# and its reports folded in one call into steps.py (begin_step, fold_reports), not five (side -> steps 16 -> 11
# with the mirror's calls; the scheduler's area 41 -> 34).
# Lowered on branch files_worker (issue 33's split by step phase, the worker's area): 29 files, 223 moves at
# 7a85bf6 (945 kvtier calls, load 6.4) and 222 at 38aaf2b (944 calls, load 9.3), from 31 and 248 at main 783b5c0 (measured at the start of the
# branch, load 0.6).  Left the hit: integrations/vllm/worker/saves.py (the step asks the saver its counts,
# in-flight jobs and ended jobs only when its version counter moved; a step with no save job and the gate
# already open calls nothing: side -> saves 8 -> 0) and worker/facts.py (a load's facts are the loader's:
# FactsBook and load_facts in loader.py, save_facts in saves.py; the engine thread's loads moved to
# worker/syncload.py to keep loader.py under 400 lines).  connector -> worker/side 20 -> 12: one call for
# get_finished / get_transfer_results, none for wait_for_layer_load without layerwise loads or
# handle_preemptions without a preempted request; side -> store 12 -> 10 (the side tracks the eviction
# gate it alone moves), side -> stats_table 4 -> 2 (store_report).
# Main 9040276, the four files33 branches merged: 23 files, 204 moves (2 runs, 946 kvtier calls, load 2.2-2.7).
# Lowered on branch files34 (statistics, receipts, policies, the scheduler's per-request files): 22 files, 192-196
# moves (2 runs, 925-932 kvtier calls, load 4-6), from 23 and 207 at main d55f263 (measured at the start of the
# branch, load 2.6).  Left the hit: core/receipt.py (the receipt's shape only: tokens_by_tier joined the per-step
# readers in integrations/vllm/stats_table.py, vLLM-free for the worker; the receipt desk fills a response dict
# with msgspec.to_builtins and reads a computed miss from WHOLLY_SERVED, Receipt.computed_miss's rule as a
# value; receipt_counters sits beside its one caller in scheduler/receipts.py).  Moves: the adaptive policy's
# Node is a msgspec Struct built in C (adaptive -> orderings 8 -> 2), IndexMirror.ready an attribute, the dense
# lookup reads the mirror's maps in PagePlanner.lookup (side -> steps 11 -> 10, requests -> steps 1 -> 0).
# Lowered on branch files35: 22 files, 169 moves (two runs, 822 kvtier calls each, load 3.2-5.3), from 22 and
# 192 at main 126f537 (measured at the start of the branch, 845 calls, load 2.1).  vLLM's per-step verbs that only
# forwarded, unchanged, to the role's side are the side's bound methods on the connector instance, bound at
# construction (connector -> scheduler/side 14 -> 2, -> worker/side 12 -> 6: what is left translates, e.g.
# start_load_kv fetches the step's metadata); the mover reads a load's chunk count as len(handle.keys)
# (mover -> handles 5 -> 0).  No file left: connector.py still runs vLLM's no-op hooks and translating verbs and
# its build_kv_connector_stats classmethod each step.
# Main 0ec151b, files35 and hit36 merged: 22 files, 167 moves (818 kvtier calls, load 1.3): hit36's fewer calls
# per load's bookkeeping (loader.finish, store.prepare_load/complete_load, sinks.engine_load) on top of files35.
# Lowered on branch files37: 21 files, 147 moves (2 runs, 795 kvtier calls, load 2.9-3.0), from 22 and 167 at
# main 6c52b24 (measured at its start, load 2.1).  core/handles.py left the hit: the loader watches the load's
# read-ahead future itself and the index and store read len(handle.keys) (-> handles 9 -> 0); the store's
# change-feed and gate verbs (drain_changes, gate_evictions, pin_resident, dirty_bytes, ...) are the index's
# bound methods, with no forwarding call (store -> index 14 -> 7); take_ghost_distances asks the ghost lists
# nothing on a step without ghost hits (store -> ghosts 2 -> 0); the read-ahead thread advances its handle's
# ahead_from itself (mover -> index 7 -> 5).  A read-ahead poll no longer moves (it waits on
# the future in concurrent.futures), so the slack is what still varies: the loader's copies of ready chunks
# (loader -> copy, one per batch it finds, at most one per chunk: 4 more than the 2 seen) and the disk-io
# threads whose first read builds their aligned buffers (-> readchoice, 1-2), with a margin; and, on a loaded CI
# host, an engine step or two more while the disk reads run (each step's get_finished crosses connector -> worker
# side -> loader): 30 in all.
# Lowered on branch sched33: 21 files, 137 moves (2 runs, 781 kvtier calls, load 4.4-6.2), from 147 at main
# a757de8 (measured at its start, load 0.9-2.5).  The scheduler side makes no call that has nothing to do:
# the sync budget is asked to give back or take a promise only while it holds one (SyncBudget.promised),
# a finishing request's deferred saves only when one is open (DeferredSaves.by_req), the receipt desk
# finishes only with receipts pending or sinks, a re-allocation records no admission, pin_seconds parses
# only a request naming kvtier_pin_s, a request's chain is made and extended in one call (RequestState.keys,
# its tenant a field): side -> steps 10 -> 5, -> requests 8 -> 5, -> receipts 7 -> 5.  No file left: the
# scheduler's hit still runs side.py, steps.py, requests.py and receipts.py (see docs/architecture.md).
# Lowered on branch work33 (issue 33's split by step phase, the worker's and the statistics' files): 20 files,
# 146 moves (2 runs, 781 kvtier calls each, load 5-7.5), from 21 and 147 at main a757de8 (measured at its start,
# 791 calls, load 0.7).  integrations/vllm/stats_table.py left the hit (the table of names, cold): the worker's
# per-step report of its store's snapshot (store_report, store_values, store_counters, store_gauges) moved to
# stats.py, beside the payload it fills, which the worker's stats() imported already (side -> stats_table 2
# became side -> stats 2); tokens_by_tier moved to worker/loader.py, vLLM-free on every load's path (loader ->
# stats_table 1 -> 0; the scheduler's side and receipts call it there, 1 each).  worker/copy.py stays: the
# loader thread's path (loader.py, 397 lines) has no room for the host copy's ~100 hot lines.
# Lowered on branch disk33: 20 files, 127 moves (2 runs, 779 kvtier calls, load 4.8-7.6), from 21 and 146 at
# main a757de8 (measured at its start, 788 calls, load 0.9-2.4).  core/readchoice.py left the hit, split by
# step phase: the serial/split ReadChooser moved into disk/tier.py beside the buffered read that runs its
# begin/end per chunk, the aligned buffers and O_DIRECT reads to disk/chunkio.py, and a read's header block
# comes from ChunkIO.read_headers made at set-up, so a disk-io thread's first read builds nothing
# (disk/tier -> readchoice 13-14 -> 0); Envelope.open_header also checks the tenant record and returns the
# RecordedTenant the read keeps once verified (disk/tier -> envelope 12 -> 6).  The slack keeps its 30 (the
# 1-2 moves of the aligned buffers' set-up are gone; the rest above still varies).
# Lowered on branch work33b: 20 files, 132 moves (2 runs, 764 kvtier calls each, load 4.9-5.1), from 136 at main
# b2687fa (measured at its start, 771 calls, load 4.9).  The worker asks its loader only what changed: the
# loader's outcomes (AsyncLoader.take) and the facts book (FactsBook.take) have version counters, as the
# saver's, so a step with no load ended or no facts added takes nothing (side -> loader 4 -> 2); a job with
# no page resident in the cpu tier at submit pinned nothing and registers no release callback (loader ->
# store cancel_load 1 -> 0, store -> index release 1 -> 0).  worker/copy.py stays on the hit (see work33).
# Lowered on branch pol33: 19 files, 138 moves (2 runs, 733 kvtier calls, load 3.9-6), from 21 and 147 at main a757de8
# (measured at its start, 791 calls, load 1.3).  The policy and the index split by step phase: policies/orderings.py
# left the hit (the shadows' replay is adaptive.replay, in the policy's file; the policy's state, set-up and re-ranking
# went to a cold base, policies/adaptive_state.py: adaptive -> orderings 2 -> 0), core/ghosts.py left it (a promotion
# lists its victims' ghosts in Index._evict_many: index -> ghosts 1 -> 0), and the victim search asks the index's pins
# by membership (evict(n, held=pins)) instead of calling may_free_page per candidate (adaptive -> index 6 -> 0).
# Lowered on branch sink33 (the store's area): 20 files, 142 moves (2 runs, 789 kvtier calls, load 4.4-4.7), from 21
# and 147 at main a757de8 (measured at its start, load 1.9).  core/store.py left the hit: the store's request-path
# verbs (prepare_load, complete_load, cancel_load, stats, take_ghost_distances) are the mover's, bound on the store
# at construction as the index's change-feed verbs are (store -> mover 3 -> 0: the worker calls mover.py, which
# plans, reads and reports a load), and TieredStore.epoch reads the index's count in C (loader -> store 2 -> 0).
# Lowered on branch sched33b: 20 files, 137 moves (2 runs, 780 kvtier calls, load 4.3-4.9), from 21 and 136 at main
# 158b5bb (measured at its start, load 3.7-4.3; the one move more is a disk-io thread's first aligned buffer,
# disk/tier -> readchoice 1 -> 2).  integrations/vllm/scheduler/receipts.py left the hit: a request's receipt facts,
# build_receipt and the ReceiptDesk joined requests.py (a request's path to its receipt); to fit three files of
# 400 lines, SyncBudget joined SchedulerSide in side.py, the engine's KeyMemo and PagePlanner joined steps.py, and
# the cold code left the hot files (setup.py: start-up checks, the sync budget's settings, shutdown; pins.py;
# reset.forget_mirror; the design notes for docs/scheduler.md).  The scheduler's moves are as many (15): side ->
# steps 5 -> 6, -> requests 5 -> 8, -> receipts 5 -> 0, requests -> steps 0 -> 1 (KeyMemo.known), offer none.
# Merged on main (sched33, work33, disk33, work33b): 19 files, 112 moves (752 kvtier calls, load 2.2).
# Lowered on branch work33c: 19 files, 108 moves (2 runs, 752 kvtier calls each, load 3.0-3.5), from 112 at main
# 41b79d0 (measured at its start, 752 calls, load 2.0).  The loader is split by thread: its engine thread's end
# (AsyncLoader: the pool, submit, abort, take, wait_ended) is in worker/side.py beside its one caller, one load's
# path on a loader thread is loader.py's LoadPath, which reports into its Outcomes (side -> loader 5 -> 2:
# job_keys, FactsBook.take); moved_bytes is a free function in loader.py (loader -> copy 3 -> 2).  A reset's clear
# and the graceful stop moved to the cold worker/lifecycle.py.  worker/copy.py stays on the hit: with the host
# copy moved in (load_runs, _load_adjacent, _address, the one-group path), loader.py measured 449 lines (18 files,
# 106 moves).
# Merged on main (sched33, work33, disk33, work33b, pol33, sink33, sched33b, work33c): 15 files, 94 moves
# (691 kvtier calls, load 0.7).
# Lowered on branch copy34: 14 files, 92 moves (2 runs, 691 kvtier calls each, load 1.9-4.6), from 15 and 94 at main
# e54b764 (measured at its start, 691 calls, load 1.6).  worker/copy.py left the hit: the load half of the host copy
# (load_pages, load_runs, _load_adjacent, _address) is loader.py's, beside the load that runs it (loader -> copy
# 2 -> 0); copy.py keeps the set-up (HostRuns), save, the CUDA/copyto load and the run-by-run loop of other layouts.
# Room in loader.py (396 lines): Outcomes moved to the cold worker/outcomes.py, the design text to docs/architecture.md.
# Lowered on branch sinks34: 14 files, 84 moves (2 runs, 689 kvtier calls, load 4.8-5.7), from 15 and 94 (691 calls)
# at main e54b764 measured at its start.  core/sinks.py left the hit: what a hit's events run is counted in
# core/mover.py, where they are made (StoreCounters' load counts and snapshot, CountersSink, Tee, RequestRecord.emit;
# sinks.py keeps their state and the events off a load's path), the index takes the counters as context.Counts
# (no import circle), RequestRecord is a msgspec Struct made in C, and the mover's cold half is mover_state.py
# (mover -> sinks 9 -> 0, index -> sinks 1 -> 0, loader -> sinks 1 -> 0; index -> mover 1: evicted).
# Merged on main (copy34, sinks34): 13 files, 82 moves (689 kvtier calls, load 3.6-4.0).
# Lowered on branch stats34: 14 files (2 runs, 96 moves, 642 kvtier calls each, load 2.6-5.8), from 15 files, 94 moves and
# 691 calls at main e54b764.  integrations/vllm/stats.py left the hit: what runs each step on the stats payload
# (KVTierStats, KVTierPromMetrics.observe, the workers' store_report) is connector.py's, with what vLLM calls each step;
# the cold code went to connector_base.py.  The sides report vLLM-free numbers and the connector sends them as
# KVTierStats: worker/side -> stats 2 became connector -> worker/side 2, and connector -> scheduler/side stats 2 is new
# (vLLM called the scheduler side's bound stats before); MEASURED_MOVES stays at main's 94 (the bound is not raised).
# Merged on main (copy34, sinks34, stats34): 12 files, 84 moves (695 kvtier calls, load 3.1-3.5): issue 33's
# bound of 12 files is met; the moves are 14 % of aa01ead's 608.
# Branch tail33 (scripts/full_hit.py's FULL_HIT_THREADS table only, no hit-path change): 12 files, 84 moves (701 calls, load 2.3-3.1).
# Lowered on branch own33: 12 files, 83 moves (1 run, 695 kvtier calls, load 3-4), from main 1d9496a's 12 files,
# 84 moves (~701 calls): the lookup sets its receipt's ask itself (ReceiptFacts.ask's two fields: scheduler/side ->
# requests one move fewer); the rest of issue 33's own-time cuts (fewer cold frames in a hit's finish) are inside files.
# Merged on main 7ce3c36 (own33, node38, tail33): 12 files, 83 moves (695 calls, load 0.9, quiet).
# Branch faults56 (per-cause fault log lines, s3 short causes, the breaker's "reachable again": off the hit path):
# 12 files, 83 moves (2 runs, 696 calls, load 2.4-4.6).
# Branch doctor56 (doctor's advice and node serve's messages, no hit-path change): 12 files, 83 moves (696 calls, load 1.4-2.3).
MAX_FILES = 12
MEASURED_MOVES = 83
SLACK_MOVES = 30


def load_script():
    spec = importlib.util.spec_from_file_location("hit_story", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["hit_story"] = module
    spec.loader.exec_module(module)
    return module


def test_the_profiler_counts_files_moves_and_threads_as_its_docstring_says(tmp_path: Path) -> None:
    """A package of two files: ``a.run`` calls ``b.double`` twice (two moves) and its own ``a.one``
    once (a kvtier → kvtier call in the same file, no move); ``b.double`` calls ``b.one`` (same
    file).  ``a.run`` runs once on the main thread and once on a thread started after
    ``install``; a file outside the package calls nothing that counts."""
    hit_story = load_script()
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text("from pkg import b\n\ndef one():\n    return 1\n\n"
                                  "def run():\n    return b.double(1) + b.double(2) + one()\n")
    (package / "b.py").write_text("def one():\n    return 1\n\ndef double(x):\n    return 2 * x * one()\n")
    sys.path.insert(0, str(tmp_path))
    try:
        from pkg import a  # type: ignore[import-not-found]

        profiler = hit_story.KvtierCallProfiler(package)
        profiler.install()
        started = threading.Event()
        go = threading.Event()

        def worker() -> None:
            started.set()
            go.wait(10)
            a.run()

        thread = threading.Thread(target=worker, name="story-worker")
        thread.start()
        started.wait(10)
        profiler.arm()
        try:
            assert a.run() == 7
            go.set()
            thread.join(10)
        finally:
            profiler.disarm()
        a.run()  # after the window: not counted
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("pkg", "pkg.a", "pkg.b"):
            sys.modules.pop(name, None)
    report = profiler.report()
    assert report["files"] == {"a.py": 2 * 2, "b.py": 2 * 4}  # run + one; double ×2 + one ×2, per thread
    assert report["moves_by_pair"] == {"a.py -> b.py": 2 * 2}
    assert report["moves"] == 4
    assert report["kvtier_to_kvtier_calls"] == 2 * 5  # every call but run's own entry
    assert report["entry_calls"] == 2  # run, from the test (main) and from worker (thread)
    assert sorted(name.split(" (")[0] for name in report["threads"]) == ["MainThread", "story-worker"]
    assert "story-worker" not in report["threads_not_profiled"]


@pytest.mark.engine
@pytest.mark.shares_cpu
def test_one_disk_hit_runs_at_most_todays_files_and_moves(tmp_path: Path) -> None:
    out = tmp_path / "story.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), "--workdir", str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    story = json.loads(out.read_text())
    package = Path(story["kvtier_dir"]).resolve()
    assert package == (ROOT / "src" / "kvtier").resolve(), "the script measured another kvtier than this tree's"

    hit = story["hit"]
    assert hit["disk_hit"] and hit["kvtier_loaded_tokens_total{disk}"] == hit["loadable_tokens"] == 768, hit
    assert hit["kvtier_loaded_tokens_total{cpu}"] == 0

    files = story["files"]
    connector = story["connector_file"]  # the file of the class kv_connector names, found by the script
    assert connector.endswith(".py") and connector in files, f"the connector ({connector}) did not run: {sorted(files)}"
    disk_tier = [f for f in files if re.search(r"(^|/)tiers/disk(\.py$|/)", f)]
    assert disk_tier, f"no disk tier module ran: {sorted(files)}"
    # the reads run on the loader's threads: a profiler that saw only the main thread would find one
    assert story["num_threads"] >= 2 and story["threads_not_profiled"] == [], story["threads"]

    assert story["num_files"] <= MAX_FILES, f"{story['num_files']} kvtier files ran (at most {MAX_FILES}): {files}"
    bound = MEASURED_MOVES + SLACK_MOVES
    assert story["moves"] <= bound, f"{story['moves']} file-to-file moves (at most {bound}): {story['moves_by_pair']}"
