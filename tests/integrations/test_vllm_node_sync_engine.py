"""A node-pool hit loaded synchronously in a real ``vllm serve`` (issue 38: a node load costs about
what a cpu-tier load does): one engine (the tiny test model, float32), a real pool owner
(``kvtier node serve``), kvtier's default deadlines (``shared_deadline_s`` 0.25 s).

- a prompt the engine computed, gone from its own prefix cache and cpu tier (an external reset,
  ``reset_scope: cpu``), is served from the pool in the step that schedules it (no step parked:
  ``waited_steps`` 0), with the tokens and logprobs of the engine's own prefix cache on that prefix;
- with the owner SIGSTOPped (its presence table still promises the hit), the same request's load
  gives up within the deadline, recomputes, and answers the same tokens.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.core.receipt import decode
from tests.integrations.openai_client import served_model
from tests.integrations.vllm_helpers import PROMPT_WORDS, live_spec
from tests.node_servers import NodeServer
from tests.redis_servers import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]

CHUNK = 128
DEADLINE_S = 0.25  # shared_deadline_s's default


def _complete(base_url: str, prompt: str) -> tuple[list[int], list[float], dict[str, Any], float]:
    """One greedy completion: its token ids, their logprobs, its kvtier receipt, its wall seconds."""
    body = {"model": served_model(base_url), "prompt": prompt, "max_tokens": 8, "temperature": 0.0, "logprobs": 0,
            "return_tokens_as_token_ids": True}
    t0 = time.perf_counter()
    r = httpx.post(base_url + "/v1/completions", json=body, timeout=300.0)
    seconds = time.perf_counter() - t0
    assert r.status_code == 200, r.text[:2000]
    answer = r.json()
    receipt = answer["kv_transfer_params"]["kvtier"]
    decode(receipt)
    lp = answer["choices"][0]["logprobs"]
    return lp["tokens"], lp["token_logprobs"], receipt, seconds


def _forget(base_url: str) -> None:
    """vLLM's prefix cache and kvtier's cpu tier emptied (the pool keeps its values)."""
    deadline = time.monotonic() + 60
    while httpx.post(base_url + "/reset_prefix_cache", params={"reset_external": "true"}, timeout=60).status_code != 200:
        assert time.monotonic() < deadline, "vLLM refused reset_prefix_cache for 60 s"
        time.sleep(0.5)


def test_a_node_hit_loads_synchronously_exactly_and_a_stalled_owner_costs_at_most_the_deadline(
        tiny_model: Path, tmp_path: Path) -> None:
    from kvtier.launch.serve import Server
    from kvtier.launch.testmodel import random_prompt

    p = random_prompt(3811, PROMPT_WORDS)
    owner = NodeServer(tmp_path, node_gib=0.25, page_kib=64, lease_s=5.0).start()
    kvtier = {"chunk_tokens": CHUNK, "cpu_gib": 0.01, "tiers": ["cpu", "node"], "node_socket": owner.socket,
              "reset_scope": "cpu", "node_breaker_probe_s": 1.0}
    engine = Server(live_spec(tiny_model, kvtier), tmp_path / "engine.log")
    try:
        engine.launch().wait_ready(900)
        url = engine.base_url
        _, _, cold, _ = _complete(url, p)  # computed, saved to the pool
        whole = cold["prompt_tokens"] // CHUNK
        loadable = (cold["prompt_tokens"] - 1) // CHUNK * CHUNK
        assert wait_until(lambda: owner.stats().num_values >= whole, timeout_s=60), owner.stats()
        own_tokens, own_logprobs, own, _ = _complete(url, p)  # the reference: the engine's own prefix cache
        assert own["tokens"].get("engine", 0) == loadable, own

        _forget(url)
        tokens, logprobs, got, _ = _complete(url, p)
        assert got["tokens"].get("node", 0) == loadable and got["waited_steps"] == 0, got
        assert (tokens, logprobs) == (own_tokens, own_logprobs)

        # stalled: the presence table (beaten < 2 s ago) still promises the hit; the pin gives up
        _forget(url)
        owner.pause()
        tokens, _, stalled, seconds = _complete(url, p)
        owner.resume()
        assert tokens == own_tokens
        assert stalled["tokens"].get("node", 0) == 0 and stalled["tokens"]["computed"] >= loadable, stalled
        assert stalled["waited_steps"] == 0, stalled  # never parked: the step paid the pin's deadline
        assert stalled["load_ms"].get("node", 0.0) < (DEADLINE_S + 0.25) * 1e3, stalled
        assert seconds < 30, seconds
        assert engine.exit_reason() is None
    finally:
        if owner.proc is not None and owner.proc.poll() is None:
            owner.resume()
        engine.stop(grace_s=20)
        owner.stop()
