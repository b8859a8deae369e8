"""Two vLLM engines on one host sharing the node tier (issue 38, Done when): real ``vllm serve``
processes (api_server, the tiny test model, float32, one reserved core each: equal compute
threads) and a real pool owner (``kvtier node serve``).

- a prompt engine A computed is served to engine B from the pool on B's first request, with the
  tokens and logprobs of A's own prefix cache on that prefix, exactly, and counted by kvtier and
  vLLM as a hit;
- the pool's bytes are counted once: the engines' ``kvtier_usage_bytes{node}`` sum to the owner's;
- the owner SIGKILLed while B serves costs no failed request (they recompute), and once it is
  restarted on the same pool it is warm and serves again (a prompt A computes afterwards loads on B);
- B SIGKILLed during a load leaves no lease in the pool.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.openai_client import run
from tests.integrations.vllm_helpers import PROMPT_WORDS, live_spec
from tests.node_servers import NodeServer
from tests.redis_servers import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]

CHUNK = 128
LOADED = "kvtier_loaded_tokens_total{node}"


def test_two_engines_share_one_node_pool_exactly_and_survive_its_owner_and_an_engine_dying(
        tiny_model: Path, tmp_path: Path) -> None:
    from kvtier.launch.serve import Server
    from kvtier.launch.testmodel import random_prompt

    p, q, r, s, warm_up = (random_prompt(seed, PROMPT_WORDS) for seed in (3801, 3802, 3803, 3804, 3805))
    owner = NodeServer(tmp_path, node_gib=0.25, page_kib=64, lease_s=5.0).start()
    kvtier = {"chunk_tokens": CHUNK, "cpu_gib": 0.01, "tiers": ["cpu", "node"], "node_socket": owner.socket,
              "shared_deadline_s": 5.0, "shared_transfer_deadline_s": 5.0, "node_timeout_s": 2.0,
              "node_breaker_probe_s": 1.0}
    a = Server(live_spec(tiny_model, kvtier), tmp_path / "a.log")
    b = Server(live_spec(tiny_model, kvtier), tmp_path / "b.log")
    failures: list[str] = []
    try:
        for server in (a.launch(), b.launch()):
            server.wait_ready(900)

        def on(server: Server, *ops: dict[str, Any]) -> list[Any]:
            return run(server.base_url, list(ops))

        # A computes P (and saves it to the pool); B's first request of P loads it from the pool
        (made_p,) = on(a, {"op": "complete", "prompt": p})
        whole = made_p["prompt_tokens"] // CHUNK
        assert wait_until(lambda: owner.stats().num_values >= whole, timeout_s=60), owner.stats()
        b_before, got_p, b_after = on(b, {"op": "metrics"}, {"op": "complete", "prompt": p}, {"op": "metrics"})
        a_before, own_p, a_after = on(a, {"op": "metrics"}, {"op": "complete", "prompt": p}, {"op": "metrics"})
        loaded = b_after.get(LOADED, 0) - b_before.get(LOADED, 0)
        assert loaded == (made_p["prompt_tokens"] - 1) // CHUNK * CHUNK
        assert b_after["vllm:external_prefix_cache_hits_total"] - b_before.get(
            "vllm:external_prefix_cache_hits_total", 0) == loaded
        hits = "vllm:prefix_cache_hits_total"
        assert a_after.get(hits, 0) - a_before.get(hits, 0) == loaded  # A's reference: its own prefix cache
        assert (got_p["tokens"], got_p["logprobs"]) == (own_p["tokens"], own_p["logprobs"])

        # counted once: what each engine reports for the pool sums to the owner's count
        def summed() -> tuple[float, int]:
            return (sum(on(e, {"op": "metrics"})[0].get("kvtier_usage_bytes{node}", 0) for e in (a, b)),
                    owner.stats().used_bytes)
        assert wait_until(lambda: summed()[0] == summed()[1] > 0, timeout_s=60), summed()

        # the owner SIGKILLed while B serves: no failed request, B recomputes
        def serve_q() -> None:
            try:
                (got,) = on(b, {"op": "complete", "prompt": q})
                assert got["tokens"], got
            except Exception as exc:  # noqa: BLE001 - recorded, asserted below
                failures.append(repr(exc))
        serving = threading.Thread(target=serve_q)
        serving.start()
        time.sleep(0.2)
        warm = owner.stats().num_values
        owner.kill()
        serving.join(timeout=300)
        assert not serving.is_alive() and failures == []
        (own_q,) = on(a, {"op": "complete", "prompt": q})
        assert own_q["tokens"]

        # restarted on the same pool: warm, and serving again once the engines' breakers probe it
        owner.start()
        assert owner.stats().num_values >= warm >= whole
        # the engines' breakers, open since the kill, let one probe through per node_breaker_probe_s: a
        # warm-up prompt's saves (on A) and loads (on B) close them (what they move is not counted here)
        time.sleep(2.0)
        on(a, {"op": "complete", "prompt": warm_up})
        time.sleep(2.0)
        on(b, {"op": "complete", "prompt": warm_up})
        time.sleep(2.0)
        before = owner.stats().num_values
        made = on(a, {"op": "complete", "prompt": r}, {"op": "complete", "prompt": s})
        want = before + sum(m["prompt_tokens"] // CHUNK for m in made)
        assert wait_until(lambda: owner.stats().num_values >= want, timeout_s=60), \
            (owner.stats(), want, a.log_tail(30), owner.log.read_text()[-3000:])
        r_before, _got_r, r_after = on(b, {"op": "metrics"}, {"op": "complete", "prompt": r}, {"op": "metrics"})
        assert r_after.get(LOADED, 0) - r_before.get(LOADED, 0) == (made[0]["prompt_tokens"] - 1) // CHUNK * CHUNK

        # B SIGKILLed during a load (of S, in the pool): the owner ends its leases with its connections
        loading = threading.Thread(target=_quietly, args=(b, s))
        loading.start()
        time.sleep(0.3)
        assert b._proc is not None
        os.killpg(b._proc.pid, signal.SIGKILL)
        loading.join(timeout=60)
        assert wait_until(lambda: owner.stats().leases == 0, timeout_s=15), owner.stats()
        assert owner.stats().problem == ""
        assert a.exit_reason() is None
    finally:
        for server in (a, b):
            server.stop(grace_s=20)
        owner.stop()


def _quietly(server: Any, prompt: str) -> None:
    """A request whose server is killed under it (its error is the point, not a failure)."""
    try:
        run(server.base_url, [{"op": "complete", "prompt": prompt}])
    except Exception:  # noqa: BLE001, S110 - the server was killed on purpose
        pass
