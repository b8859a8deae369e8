"""What the worker's loader tells the scheduler about a load, for the request's receipt (issue 35):
a real store (cpu over disk), real tensors as the engine's KV cache, the scheduler's own page
planning, and no engine (the set-up of ``test_vllm_loader.py``).  The facts are taken as the
worker's step metadata takes them (``AsyncLoader.facts``, :mod:`~kvtier.integrations.vllm.worker.side`)."""

from __future__ import annotations

import time
from pathlib import Path

from kvtier.integrations.vllm.protocol import LoadJob, RequestFacts
from kvtier.integrations.vllm.scheduler.steps import IndexMirror, PagePlanner
from kvtier.integrations.vllm.worker.copy import GroupCopiers
from kvtier.integrations.vllm.worker.layout import detect_layout
from kvtier.integrations.vllm.worker.loader import LoadPath
from kvtier.integrations.vllm.worker.side import AsyncLoader
from tests.integrations.test_vllm_loader import BLOCK, CHUNK, NUM_BLOCKS, _caches, _setup


def _facts(store, plan, chain, tiers, wait_s: float = 5.0) -> RequestFacts:
    dst = _caches(1)
    layout = detect_layout(dst, NUM_BLOCKS, "TEST")
    loader = AsyncLoader(LoadPath(store, GroupCopiers(plan.groups, CHUNK, {0: layout}, dst), CHUNK, partial=True,
                                  wait_s=wait_s), threads=1)
    hit = len(tiers) * CHUNK
    pages = PagePlanner(plan, IndexMirror(1)).load_pages(chain, [[12] + list(range(13, 28))], BLOCK, hit)
    loader.submit(LoadJob("r", pages, BLOCK, hit, tiers))
    deadline = time.monotonic() + 20
    while "r" not in loader.take()[0]:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    facts = loader.facts.take()
    loader.shutdown()
    assert set(facts) == {"r"}
    return facts["r"]


def test_a_short_load_says_where_it_stopped_why_and_what_each_tier_cost(tmp_path: Path) -> None:
    store, plan, _, chain, where = _setup(tmp_path)  # chunk 0 on disk only (the cpu tier evicted it), 3 never saved
    facts = _facts(store, plan, chain, (where[0], where[1], where[2], "cpu"))
    assert facts.unfilled == {"cpu": CHUNK}
    assert facts.miss == (3 * CHUNK, "new", "")  # chunk 3 was never stored: no ghost list remembers it
    assert facts.below == (0, "evicted", "cpu")  # chunk 0 came from disk: the cpu tier had evicted it
    assert facts.load_s["disk"] > 0 and set(facts.load_s) == set(where[:3])
    store.close()


def test_a_load_that_stops_waiting_for_its_tail_is_cut_by_the_budget(tmp_path: Path) -> None:
    from kvtier.core.tiers.wrappers import SlowTier

    store, plan, _, chain, _ = _setup(tmp_path)
    for key in chain[:3]:  # every chunk on disk only
        if store.index.resident(key):
            store.index.evict_top(key)
    store.mover.tiers["disk"] = SlowTier(store.mover.tiers["disk"], get_s=0.4)  # each disk read 0.4 s
    store.mover.io_threads = 1  # one chunk before prepare_load returns, the rest read ahead
    facts = _facts(store, plan, chain[:3], ("disk", "disk", "disk"), wait_s=0.1)
    assert facts.miss is not None and facts.miss[1] == "budget", facts  # load_wait_s passed first
    assert facts.unfilled.get("disk", 0) >= CHUNK
    time.sleep(1.0)  # let the read-ahead finish before the store closes
    store.close()
