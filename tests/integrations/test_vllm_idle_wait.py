"""A step that computes no tokens waits for a load instead of spinning (``idle_step_wait_s``).

The worker side (:class:`~kvtier.integrations.vllm.worker.side.WorkerSide`) of a real vLLM config over
real tensors, with a real store whose chunks live only in a real redis-server (started by
tests/redis_servers.py), and no engine: each test drives the calls vLLM's worker makes in one step
(``start_load_kv`` → ``get_finished``).  Pausing the server (``SIGSTOP``) holds a load in flight
for exactly as long as the test wants: a step with nothing to compute (``KVTierMetadata.no_forward``)
returns as soon as the load ends, with it reported in that same call, or after the bound with
nothing; a step that computes tokens, or one with no load in flight, never waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvtier.core.config import ConfigError, KVTierConfig
from kvtier.integrations.vllm.protocol import KVTierMetadata, LoadJob, PageMove, SaveJob
from kvtier.integrations.vllm.worker.side import WorkerSide
from tests.integrations.vllm_helpers import one_layer_worker
from tests.redis_servers import RedisServer

BLOCK, CHUNK, NUM_BLOCKS = 16, 64, 32  # 4 blocks per chunk
LAYER = "model.layers.0.self_attn.attn"
CHUNKS = 3


def _worker(model: Path, url: str, prefix: str, idle_step_wait_s: float) -> WorkerSide:
    """One rank's worker side: a cpu tier over a redis shared tier, registered on a fresh KV cache."""
    return one_layer_worker(model, {"chunk_tokens": CHUNK, "cpu_gib": 0.01, "redis_url": url,
                                    "redis_key_prefix": prefix, "shared_deadline_s": 10.0,
                                    "shared_transfer_deadline_s": 10.0, "redis_timeout_s": 10.0,
                                    "idle_step_wait_s": idle_step_wait_s}, BLOCK, NUM_BLOCKS, LAYER)[0]


def _pages(first_block: int) -> tuple[PageMove, ...]:
    keys = [bytes([i]) * 16 for i in range(1, CHUNKS + 1)]
    per = CHUNK // BLOCK
    return tuple(PageMove(k, 0, c, 0, tuple(range(first_block + c * per, first_block + (c + 1) * per)))
                 for c, k in enumerate(keys))


def _in_redis_only(worker: WorkerSide) -> LoadJob:
    """Save chunks from blocks 1.., write them to redis, drop the cpu tier: a load job of them
    into blocks 16.. (its reads go to the server)."""
    assert worker.store is not None
    worker.save(KVTierMetadata(saves=[SaveJob("saved", _pages(1))]))
    worker.store.flush()
    worker.store.clear(["cpu"])
    return LoadJob("r", _pages(16), 0, CHUNKS * CHUNK, ("redis",) * CHUNKS)


def _step(worker: WorkerSide, no_forward: bool, loads: list[LoadJob] | None = None) -> tuple[set[str], float]:
    """One engine step as vLLM's worker runs it: ``start_load_kv``, then ``get_finished``; returns
    the finished loads and how long ``get_finished`` took, seconds."""
    worker.start_load(KVTierMetadata(loads=loads or [], no_forward=no_forward))
    t0 = time.monotonic()
    finished = worker.finished_loads(set())
    return finished, time.monotonic() - t0


def _finish(worker: WorkerSide, server: RedisServer, pending: set[str]) -> None:
    server.resume()
    deadline = time.monotonic() + 10
    while pending and time.monotonic() < deadline:
        pending -= _step(worker, no_forward=True)[0]
    assert not pending
    worker.shutdown()


def test_an_idle_step_reports_a_load_the_moment_it_ends(tiny_model: Path, redis_factory: Callable[..., RedisServer],
                                                        key_prefix: str) -> None:
    server = redis_factory()
    worker = _worker(tiny_model, server.url, key_prefix, idle_step_wait_s=1.0)  # the config's largest bound
    job = _in_redis_only(worker)
    server.pause()
    threading.Timer(0.1, server.resume).start()  # the load's reads are answered 0.1 s from now
    finished, took = _step(worker, no_forward=True, loads=[job])
    assert finished == {"r"}  # ended during the wait: reported by this same step
    # it waited for the load (a step that does not wait returns in milliseconds), and was woken by
    # the load's end, not by the 1 s bound (0.85 s of slack for the three reads on a loaded machine)
    assert 0.08 < took < 0.95
    assert worker.take_errors() == set()
    _finish(worker, server, set())


def test_a_step_waits_the_bound_at_most_and_never_when_it_computes_or_nothing_loads(
        tiny_model: Path, redis_factory: Callable[..., RedisServer], key_prefix: str) -> None:
    server = redis_factory()
    worker = _worker(tiny_model, server.url, key_prefix, idle_step_wait_s=1.0)
    job = _in_redis_only(worker)
    server.pause()
    # "never waits" is judged against the 1 s bound: a call that waited would take all of it
    finished, took = _step(worker, no_forward=False, loads=[job])  # a step that computes tokens
    assert finished == set() and took < 0.5
    finished, took = _step(worker, no_forward=True)  # nothing to compute, the load still held up
    assert finished == set() and took >= 1.0  # the whole bound, and then an answer without the load
    _finish(worker, server, {"r"})
    finished, took = _step(worker, no_forward=True)  # nothing to compute, nothing in flight
    assert finished == set() and took < 0.5


def test_idle_step_wait_s_is_checked() -> None:
    assert KVTierConfig.from_dict({}).idle_step_wait_s == 0.005
    assert KVTierConfig.from_dict({"idle_step_wait_s": 0}).idle_step_wait_s == 0
    for bad in (-0.001, 1.5, "soon"):
        with pytest.raises(ConfigError, match="field 'idle_step_wait_s'"):
            KVTierConfig.from_dict({"idle_step_wait_s": bad})

