"""Shared-tier faults at engine level, measured while a workload runs.

A real ``vllm serve`` (api_server) with KVTierConnector (``kv_both``) reaches its private
redis-server through :class:`tests.redis_servers.DelayProxy` (a TCP proxy on 127.0.0.1; there
is no ``tc netem`` here).  A client thread sends a stream of greedy requests, one at a time:
eight prompts in turn (the engine cache and the cpu tier are too small to hold the cycle, so
every repeat is a redis hit while the server is healthy) and every third request a prompt never
seen before (always computed: the recompute TTFT, measured under the same load).  Faults, one
after the other, 3 s apart: ``kill -9`` of the server (down 4 s, then started again, empty), a
quick restart with an empty dataset (SIGTERM, start), ``SIGSTOP`` for 10 s then ``SIGCONT``, and
a proxy delaying every segment by 3 s each way for 6 s.  For each:

- the engine stays up and every request succeeds;
- every repeated prompt's tokens and logprobs equal, bit for bit, its cold answer (recomputed) or
  its answer over vLLM's own prefix cache (a cached prefix continued) on the same engine (float32,
  one reserved core);
- the TTFT p99 of the requests waiting for their first token at some time during the fault (from
  its start until hits resume; one sent just before it counts) is at most the recompute TTFT
  p99 (fresh prompts outside the faults) + the configured deadlines (``shared_deadline_s`` +
  ``shared_transfer_deadline_s``) + ``MARGIN_S`` for a shared 2-core machine.  A request that
  waited on the fault would exceed it (10 s pause; 6 s round trip through the proxy); a run with
  15 s deadlines showed a 10.7 s TTFT during the pause;
- the fault reached the engine (redis errors or skipped calls counted) and hits resume once the
  server is back, with the workers' breaker closed.
"""

from __future__ import annotations

import json
import math
import threading
import time
from pathlib import Path
from typing import Any, Self

import pytest

from tests.engine_layout import WORKER_IN_ENGINE_CORE
from tests.redis_servers import DelayProxy, wait_until

from .openai_client import complete, metrics
from .vllm_helpers import live_spec

pytestmark = pytest.mark.engine

NUM_PROMPTS = 8
FRESH_EVERY = 3  # every third request is a prompt never seen before: always computed
LOOKUP_DEADLINE_S = 0.3
TRANSFER_DEADLINE_S = 0.5
PROXY_DELAY_S = 3.0  # per segment each way: a request that waited on it would take > 6 s
MARGIN_S = 1.5  # scheduling noise of two shared, loaded cores (other engines and helpers run beside)
GAP_S = 3.0  # healthy time between faults (fresh prompts there measure the recompute TTFT)
FAULT_SETTINGS = {"shared_deadline_s": LOOKUP_DEADLINE_S, "shared_transfer_deadline_s": TRANSFER_DEADLINE_S,
                  "redis_timeout_s": 0.5, "redis_connect_timeout_s": 0.3, "redis_breaker_failures": 2,
                  "redis_breaker_probe_s": 0.5}
LOADED = "kvtier_loaded_tokens_total{redis}"


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.99 * len(ordered)) - 1]


class Workload:
    """A client thread sending one request at a time: the repeated prompts in turn, and every
    ``FRESH_EVERY``-th request a fresh prompt (``prompt`` -1 in its record)."""

    def __init__(self, base_url: str, prompts: list[str]) -> None:
        from kvtier.launch.testmodel import random_prompt

        self.base_url, self.prompts, self.fresh = base_url, prompts, random_prompt
        self.records: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            which = -1 if i % FRESH_EVERY == FRESH_EVERY - 1 else i % len(self.prompts)
            prompt = self.fresh(50_000 + i, 200) if which < 0 else self.prompts[which]
            start = time.monotonic()
            try:
                out = complete(self.base_url, prompt, max_tokens=4, timeout_s=120)
            except Exception as exc:  # noqa: BLE001 - recorded: any failed request fails the test
                self.errors.append(f"{type(exc).__name__}: {exc}")
                time.sleep(0.5)
            else:
                self.records.append({"prompt": which, "start": start, **out})
            i += 1

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=150)

    def waiting_in(self, start: float, end: float) -> list[dict[str, Any]]:
        """Requests that waited for their first token at some time in ``[start, end)`` (one sent
        before a fault and stuck in it counts)."""
        return [r for r in self.records if r["start"] < end and r["start"] + r["ttft_s"] >= start]


LOGPROB_TOLERANCE = 1e-4
"""Between answers over prefixes cached to different lengths (a cold prefill, a partial load)."""


def close_to(r: dict[str, Any], cold: tuple[list[Any], list[float]]) -> bool:
    tokens, logprobs = cold
    return r["tokens"] == tokens and max(abs(a - b) for a, b in zip(r["logprobs"], logprobs, strict=True)) < LOGPROB_TOLERANCE


def test_faults_while_a_workload_runs(tiny_model: Path, tmp_path: Path, redis_factory, key_prefix) -> None:
    from kvtier.launch.serve import Server
    from kvtier.launch.testmodel import random_prompt

    server = redis_factory()
    proxy = DelayProxy(server.port)
    prompts = [random_prompt(900 + i, 200) for i in range(NUM_PROMPTS)]  # ~400 tokens: 3 whole chunks each
    kvtier = {"chunk_tokens": 128, "cpu_gib": 0.002, "redis_url": proxy.url, "redis_key_prefix": key_prefix,
              **FAULT_SETTINGS}
    # engine cache 1,024 tokens (two prompts), cpu tier 2 MiB (8 chunks of 256 KiB, under three prompts)
    spec = live_spec(tiny_model, kvtier, "kv_both", cache_tokens=1024,
                     env=WORKER_IN_ENGINE_CORE)  # one start-up import less (tests/engine_layout.py)
    try:
        with Server(spec, tmp_path / "engine.log").start(600) as engine:
            url = engine.base_url
            complete(url, random_prompt(899, 200), max_tokens=4)  # warm-up, not measured
            cold, own = [], []
            for p in prompts:
                cold.append(complete(url, p, max_tokens=4))  # nothing anywhere: computed
                own.append(complete(url, p, max_tokens=4))  # over vLLM's own prefix cache: the exact reference
            # a repeat is either recomputed (equal to the cold answer) or continues a cached prefix (equal
            # to vLLM's own prefix cache holding it: 128-token blocks, as the chunks); a cold prefill is no
            # exact reference for a load (on an AMD EPYC host the last bits differ)
            reference = {i: ((c["tokens"], c["logprobs"]), (o["tokens"], o["logprobs"]))
                         for i, (c, o) in enumerate(zip(cold, own, strict=True))}
            assert metrics(url).get(LOADED, 0) == 0
            client = server.client()
            assert wait_until(lambda: len(list(client.scan_iter(match=f"{key_prefix}*".encode()))) >= 3 * NUM_PROMPTS,
                              timeout_s=30)

            def hits_resumed(since: float) -> bool:
                m = metrics(url)
                return m.get(LOADED, 0) > since and m.get("kvtier_redis_breaker_state", 0) == 0

            def faults() -> float:
                m = metrics(url)
                return m.get("kvtier_redis_errors_total", 0) + m.get("kvtier_redis_skipped_calls_total", 0)

            windows: dict[str, tuple[float, float]] = {}
            reached: dict[str, float] = {}
            with Workload(url, prompts) as work:
                assert wait_until(lambda: metrics(url).get(LOADED, 0) >= 3 * 128 * 4, timeout_s=120), \
                    "no redis hits before any fault"
                time.sleep(GAP_S)

                def fault(name: str, inject, heal, hold_s: float) -> None:
                    before = faults()
                    start = time.monotonic()
                    inject()
                    time.sleep(hold_s)
                    heal()
                    reached[name] = faults() - before
                    loaded = metrics(url).get(LOADED, 0)
                    assert wait_until(lambda: hits_resumed(loaded), timeout_s=90, interval_s=0.5), \
                        f"hits did not resume after {name}"
                    windows[name] = (start, time.monotonic())
                    time.sleep(GAP_S)

                fault("kill -9", server.kill9, server.start, 4.0)  # down 4 s, back empty
                fault("restart empty", lambda: (server.stop(), server.start()), lambda: None, 0.0)
                fault("SIGSTOP 10 s", server.pause, server.resume, 10.0)
                fault("proxy delay", lambda: setattr(proxy, "delay_s", PROXY_DELAY_S),
                      lambda: setattr(proxy, "delay_s", 0.0), 6.0)
            assert engine.exit_reason() is None
            end = metrics(url)
    finally:
        proxy.close()

    assert not work.errors, work.errors[:3]
    repeated = [r for r in work.records if r["prompt"] >= 0]
    # a repeat under faults may also continue a partly loaded prefix (some chunks loaded, the rest
    # recomputed), for which neither reference is exact on every CPU: tokens equal, logprobs within
    # LOGPROB_TOLERANCE of the cold answer unless equal to one of the two references bit for bit
    wrong = [r for r in repeated if (r["tokens"], r["logprobs"]) not in reference[r["prompt"]]
             and not close_to(r, reference[r["prompt"]][0])]
    assert not wrong, f"{len(wrong)} of {len(repeated)} responses differ from recompute, first: {wrong[0]}"

    def healthy(r: dict[str, Any]) -> bool:
        return not any(r["start"] < stop and r["start"] + r["ttft_s"] >= start for start, stop in windows.values())
    # Recompute TTFT, measured in this run under the same load: the cold answers and the fresh
    # prompts sent while no fault was on (a fault adds its deadline to a fresh prompt's lookup).
    fresh = [c["ttft_s"] for c in cold] + [r["ttft_s"] for r in work.records if r["prompt"] < 0 and healthy(r)]
    recompute_p99 = p99(fresh)
    bound_s = recompute_p99 + LOOKUP_DEADLINE_S + TRANSFER_DEADLINE_S + MARGIN_S
    figures: dict[str, Any] = {"recompute_ttft_p99_s": recompute_p99, "recompute_samples": len(fresh),
                               "bound_s": bound_s, "requests": len(work.records),
                               "redis_loaded_tokens": end.get(LOADED, 0),
                               "healthy_hit_ttft_p99_s": p99([r["ttft_s"] for r in repeated if healthy(r)])}
    for name, (start, stop) in windows.items():
        during = work.waiting_in(start, stop)
        assert during, f"no request ran during {name}"
        figures[name] = {"requests": len(during), "ttft_p99_s": p99([r["ttft_s"] for r in during]),
                         "window_s": stop - start, "faults_counted": reached[name]}
    (tmp_path / "figures.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))
    for name in windows:
        assert figures[name]["ttft_p99_s"] <= bound_s, f"{name}: TTFT p99 {figures[name]} > bound {bound_s:.3f} s"
    for name in ("kill -9", "SIGSTOP 10 s", "proxy delay"):
        assert reached[name] > 0, f"{name} never reached the engine's redis tier"
