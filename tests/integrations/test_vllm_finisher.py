"""A synchronous load's bookkeeping runs on the finisher's thread while the forward computes
(:mod:`kvtier.integrations.vllm.worker.finisher`), and the step looks the same from outside.

The worker side of a real vLLM config over real tensors and a real cpu-tier store, no engine: each
test drives the calls vLLM's worker makes in one step (``start_load_kv`` → ``wait_for_save`` →
``build_connector_worker_meta`` → stats).  What a step shows outside (no pin left, the loaded tokens
counted, the request's facts in the step's report, the copy exact) is checked after the step's
report, as the scheduler and ``/metrics`` see it; the :class:`Finisher` itself runs real threads.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtier.integrations.vllm.protocol import KVTierMetadata, LoadJob, PageMove, SaveJob
from kvtier.integrations.vllm.worker import finisher as finisher_module
from kvtier.integrations.vllm.worker.finisher import Finisher
from kvtier.integrations.vllm.worker.side import WorkerSide
from tests.integrations.vllm_helpers import one_layer_worker

BLOCK, CHUNK, NUM_BLOCKS = 16, 64, 32  # 4 blocks per chunk
LAYER = "model.layers.0.self_attn.attn"
CHUNKS = 3


def _worker(model: Path) -> tuple[WorkerSide, torch.Tensor]:
    return one_layer_worker(model, {"chunk_tokens": CHUNK, "cpu_gib": 0.01}, BLOCK, NUM_BLOCKS, LAYER)


def _pages(first_block: int, missing: int = 0) -> tuple[PageMove, ...]:
    """The chunks' pages into blocks ``first_block..``; the last ``missing`` keys were never saved."""
    keys = [bytes([i]) * 16 for i in range(1, CHUNKS + 1 - missing)] + [bytes([0xEE - i]) * 16 for i in range(missing)]
    per = CHUNK // BLOCK
    return tuple(PageMove(k, 0, c, 0, tuple(range(first_block + c * per, first_block + (c + 1) * per)))
                 for c, k in enumerate(keys))


def _report_step(worker: WorkerSide, meta: KVTierMetadata):
    """The rest of the step after ``start_load_kv``: the saves, then the report and the stats."""
    worker.save(meta)
    report = worker.worker_meta()
    stats = worker.stats()
    return report, stats


@pytest.fixture
def engine(tiny_model: Path):
    """A worker side whose cpu tier holds the chunks of blocks 1..12, and its KV cache tensor."""
    worker, cache = _worker(tiny_model)
    step = KVTierMetadata(saves=[SaveJob("saved", _pages(1))])
    worker.start_load(step)
    _report_step(worker, step)
    yield worker, cache
    worker.shutdown()


def test_a_synchronous_load_is_exact_and_its_bookkeeping_is_in_the_steps_report(engine) -> None:
    """The copy is done when ``start_load`` returns (the forward may read the blocks); the unpin,
    the counters and the request's facts are done on the finisher's thread, and they are all in
    the step's report: no pin left, the loaded tokens counted, the facts of the request shipped."""
    worker, cache = engine
    threads: list[str] = []
    real_finish = worker.loader.path.finish

    def finish(*args, **kwargs):  # the real finish, told which thread ran it
        threads.append(threading.current_thread().name)
        return real_finish(*args, **kwargs)

    worker.loader.path.finish = finish
    before = worker.store.stats()
    job = LoadJob("hit", _pages(17), 0, CHUNKS * CHUNK, ("cpu",) * CHUNKS, sync=True)
    meta = KVTierMetadata(loads=[job])
    worker.start_load(meta)
    assert worker.take_errors() == set()
    n = CHUNKS * CHUNK // BLOCK
    assert torch.equal(cache[17:17 + n], cache[1:1 + n])  # copied before the forward, bit for bit
    report, stats = _report_step(worker, meta)
    assert threads == ["kvtier-finish"]
    snapshot = stats[0]
    assert snapshot.tiers["cpu"].pinned_chunks == 0
    assert snapshot.loaded_tokens.get("cpu", 0) - before.loaded_tokens.get("cpu", 0) == CHUNKS * CHUNK
    assert report is not None and "hit" in report.ranks[0].facts
    worker.store.check_integrity(expect_idle=True)


def test_a_short_synchronous_load_reports_its_unfilled_blocks_before_the_forward(engine) -> None:
    """The blocks a load could not fill are known when ``start_load`` returns (vLLM's load errors of
    the same step), as :meth:`LoadPath.finish` would report them; the bookkeeping still lands in
    the step's report (the facts say where the load came up short)."""
    worker, _cache = engine
    pages = _pages(17, missing=1)
    job = LoadJob("short", pages, 0, CHUNKS * CHUNK, ("cpu",) * CHUNKS, sync=True)
    meta = KVTierMetadata(loads=[job])
    worker.start_load(meta)
    assert worker.take_errors() == set(pages[-1].block_ids)
    report, stats = _report_step(worker, meta)
    facts = report.ranks[0].facts["short"]
    assert facts.unfilled == {"cpu": CHUNK}
    assert facts.miss is not None and facts.miss[0] == (CHUNKS - 1) * CHUNK
    assert stats[0].tiers["cpu"].pinned_chunks == 0
    worker.store.check_integrity(expect_idle=True)


def test_the_finisher_runs_in_order_survives_a_failure_and_is_bounded(caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """In order, on one thread; a raising call is logged and the next still runs; past
    ``MAX_PENDING`` waiting, or once closed, the caller runs it; a join gives up after its bound."""
    finisher = Finisher("test-finish")
    ran: list[tuple[int, str]] = []
    gate = threading.Event()

    def note(i: int) -> None:
        ran.append((i, threading.current_thread().name))

    def boom() -> None:
        raise RuntimeError("bookkeeping failed")

    finisher.submit(gate.wait, 10.0)  # holds the thread until the gate opens
    monkeypatch.setattr(finisher_module, "MAX_PENDING", 3)
    with caplog.at_level(logging.ERROR, logger=finisher_module.__name__):
        finisher.submit(boom)
        finisher.submit(note, 1)
        finisher.submit(note, 2)  # the fourth waiting: runs here, at once
        assert ran == [(2, threading.current_thread().name)]
        t0 = time.monotonic()
        assert not finisher.join(0.2)  # the gate is shut: the join gives up after its bound
        assert 0.15 <= time.monotonic() - t0 < 5.0
        gate.set()
        assert finisher.join(5.0)
    assert ran[1:] == [(1, "test-finish")]
    assert "bookkeeping failed" in caplog.text
    finisher.close()
    finisher.submit(note, 3)  # closed: here
    assert ran[-1] == (3, threading.current_thread().name)
