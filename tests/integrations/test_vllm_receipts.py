"""Cache receipts on a real ``python -m vllm.entrypoints.openai.api_server`` (issue 35, "Done when").

One server with kvtier (a 6-chunk cpu tier, a 12-chunk write-through disk tier, a 0.5 s disk
rescan), vLLM's prefix caching on and ``--enable-prompt-tokens-details``.  Every non-streaming
completion and chat completion returns ``kv_transfer_params["kvtier"]``: its ``tokens`` sum to the
prompt's tokens and ``engine`` + the tiers equal ``usage.prompt_tokens_details.cached_tokens``
exactly.  One prompt walks through every state an operator meets:

1. ``new``: never seen, computed whole;
2. served by the cpu tier (vLLM's own cache reset), its tail a ``partial_chunk``;
3. a second tenant's identical prompt (another ``cache_salt``) while the first's is cached: ``new``;
4. evicted from the cpu tier by other prompts and served by the disk tier: ``top_miss`` says the
   cpu tier evicted it, and ``load_ms`` names the disk tier;
5. ``kvtier purge --all`` of the disk tier once the cpu tier evicted it again: ``purged``, from disk;
6. pushed out of both tiers and out of their ghost lists by other prompts: ``new`` again.

Over the run, ``kvtier_served_tokens_total{tier}`` and ``kvtier_missed_tokens_total{reason,tier}``
grew by exactly the receipts' sums.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvtier.core.receipt import decode
from tests.engine_layout import WORKER_IN_ENGINE_CORE
from tests.integrations.vllm_helpers import live_spec

# exact counts only (receipts, usage, metric sums), no deadline under a minute: it may run beside
# another engine test (make test's second phase)
pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]

CHUNK = 128  # tokens per chunk (chunk_tokens auto with 128-token blocks)
CHUNK_BYTES = CHUNK * 2 * 2 * 64 * 2 * 4  # tokens × layers × kv heads × head size × K,V × fp32
PROMPT_TOKENS = 3 * CHUNK + 50  # three full chunks and a tail


def _post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(base_url + path, json=body, timeout=600.0)
    assert r.status_code == 200, (path, r.status_code, r.text[:2000])
    return dict(r.json())


class Walk:
    """The server, and every receipt it returned (checked against the response's usage as it comes)."""

    def __init__(self, base_url: str, model: str, log: Path) -> None:
        self.base_url, self.model = base_url, model
        self.receipts: list[dict[str, Any]] = []
        self.log = log  # every answer's receipt and usage, one JSON line each (docs/receipts.md shows one)

    def _check(self, answer: dict[str, Any]) -> dict[str, Any]:
        usage = answer["usage"]
        with self.log.open("a") as f:
            f.write(json.dumps({"usage": usage, "kv_transfer_params": answer.get("kv_transfer_params")}) + "\n")
        receipt = answer["kv_transfer_params"]["kvtier"]
        decode(receipt)  # the receipt's shape, strictly
        tokens = receipt["tokens"]
        assert sum(tokens.values()) == usage["prompt_tokens"] == receipt["prompt_tokens"], (receipt, usage)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert sum(n for k, n in tokens.items() if k != "computed") == cached, (receipt, usage)
        self.receipts.append(receipt)
        return dict(receipt)

    def complete(self, prompt: list[int], salt: str | None = None, max_tokens: int = 4) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                **({"cache_salt": salt} if salt is not None else {})}
        return self._check(_post(self.base_url, "/v1/completions", body))

    def chat(self, text: str) -> dict[str, Any]:
        body = {"model": self.model, "messages": [{"role": "user", "content": text}], "max_tokens": 4,
                "temperature": 0.0}
        return self._check(_post(self.base_url, "/v1/chat/completions", body))

    def forget_engine_cache(self) -> None:
        """vLLM's own prefix cache forgets (kvtier's tiers keep what they hold)."""
        r = httpx.post(self.base_url + "/reset_prefix_cache", timeout=60.0)
        r.raise_for_status()

    def tokens(self, seed: int) -> list[int]:
        from kvtier.launch.testmodel import random_prompt

        got = _post(self.base_url, "/tokenize", {"model": self.model, "prompt": random_prompt(seed, 300)})["tokens"]
        assert len(got) >= PROMPT_TOKENS
        return [int(t) for t in got[:PROMPT_TOKENS]]

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        from kvtier.tools.scrape import fetch_metrics, metric_families

        out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in metric_families(fetch_metrics(self.base_url), self.base_url):
            for s in family.samples:
                if s.name.startswith(("kvtier_served_tokens_total", "kvtier_missed_tokens_total",
                                      "kvtier_usage_bytes", "kvtier_ghost_hit_distance_bytes_count")):
                    key = (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in ("tier", "reason"))))
                    out[key] = out.get(key, 0.0) + float(s.value)
        return out


def _purge_all(disk: Path) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "purge", "--disk-path", str(disk), "--all",
                           "--json"], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout))


def test_receipts_walk_one_prompt_through_every_state_and_sum_to_the_metrics(tiny_model: Path, tmp_path: Path) -> None:
    from kvtier.core.tiers.disk.chunkfile import HEADER_BYTES
    from kvtier.launch.serve import Server

    disk = tmp_path / "disk"
    kvtier = {"cpu_gib": 6 * CHUNK_BYTES / 2**30, "disk_path": str(disk),
              "disk_gib": 12 * (CHUNK_BYTES + HEADER_BYTES) / 2**30, "write_mode": "write-through",
              "disk_rescan_s": 0.5, "policy": "lru"}  # LRU in both tiers: the walk's evictions are predictable
    spec = live_spec(tiny_model, kvtier, env=WORKER_IN_ENGINE_CORE)  # one start-up import less (tests/engine_layout.py)
    template = tmp_path / "chat.jinja"  # the tiny test model has no chat template of its own
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    spec = dataclasses.replace(spec, extra_args=(*spec.extra_args, "--enable-prompt-tokens-details",
                                                 "--chat-template", str(template)))
    with Server(spec, tmp_path / "server.log").start(900) as server:
        walk = Walk(server.base_url, server.served_model, tmp_path / "receipts.jsonl")
        before = walk.metrics()
        prompt = walk.tokens(1)
        fillers = iter(walk.tokens(100 + i) for i in range(40))

        first = walk.complete(prompt)  # 1. never seen
        assert first["tokens"] == {"engine": 0, "computed": PROMPT_TOKENS}
        assert first["miss"] == {"token": 0, "reason": "new", "tier": ""}
        assert first["saved"]["chunks"] == {"cpu": 3}

        walk.forget_engine_cache()
        cpu = walk.complete(prompt)  # 2. from the cpu tier
        assert cpu["tokens"] == {"engine": 0, "cpu": 3 * CHUNK, "computed": 50}
        assert cpu["miss"] == {"token": 3 * CHUNK, "reason": "partial_chunk", "tier": ""}
        assert cpu["top_miss"] is None and cpu["saved"]["chunks"] == {}  # nothing new to store

        other = walk.complete(prompt, salt="tenant-b")  # 3. the same tokens, another tenant
        assert other["tokens"] == {"engine": 0, "computed": PROMPT_TOKENS}
        assert other["miss"] == {"token": 0, "reason": "new", "tier": ""}
        engine = walk.complete(prompt)  # ... while the first tenant's is cached (by vLLM itself now)
        assert engine["tokens"] == {"engine": 3 * CHUNK, "computed": 50}

        for _ in range(2):  # 4. six other chunks through the 6-chunk cpu tier: the prompt's leave it
            walk.complete(next(fillers), max_tokens=1)
        walk.forget_engine_cache()
        from_disk = walk.complete(prompt)
        assert from_disk["tokens"] == {"engine": 0, "disk": 3 * CHUNK, "computed": 50}
        assert from_disk["top_miss"] == {"token": 0, "reason": "evicted", "tier": "cpu"}
        assert from_disk["load_ms"].get("disk", 0) > 0 and from_disk["waited_steps"] >= 1

        for _ in range(2):  # 5. out of the cpu tier again, then the disk tier purged
            walk.complete(next(fillers), max_tokens=1)
        usage = walk.metrics()[("kvtier_usage_bytes", (("tier", "disk"),))]
        assert _purge_all(disk)["total"]["chunks"] >= 3 and usage > 0
        deadline = time.monotonic() + 60.0  # the worker's rescan (0.5 s) and one step bring the news
        while walk.metrics()[("kvtier_usage_bytes", (("tier", "disk"),))] > 0:
            assert time.monotonic() < deadline, "the server never noticed the purge"
            _post(server.base_url, "/v1/completions", {"model": walk.model, "prompt": "a step", "max_tokens": 1})
            time.sleep(0.2)
        walk.forget_engine_cache()
        purged = walk.complete(prompt)
        assert purged["tokens"] == {"engine": 0, "computed": PROMPT_TOKENS}
        assert purged["miss"] == {"token": 0, "reason": "purged", "tier": "disk"}

        for _ in range(10):  # 6. 30 chunks: out of the 12-chunk disk tier and out of its ghost list
            walk.complete(next(fillers), max_tokens=1)
        walk.forget_engine_cache()
        again = walk.complete(prompt)
        assert again["tokens"] == {"engine": 0, "computed": PROMPT_TOKENS}
        assert again["miss"] == {"token": 0, "reason": "new", "tier": ""}

        from kvtier.launch.testmodel import random_prompt

        text = random_prompt(7, 250)  # chat completions: the same receipt and the same sums
        cold = walk.chat(text)
        assert cold["tokens"]["computed"] == cold["prompt_tokens"] and cold["miss"]["reason"] == "new"
        walk.forget_engine_cache()
        warm = walk.chat(text)
        assert warm["tokens"].get("cpu", 0) >= CHUNK and warm["tokens"]["engine"] == 0

        served: dict[str, float] = {}
        missed: dict[tuple[str, str], float] = {}
        for r in walk.receipts:
            for tier, n in r["tokens"].items():
                if tier != "computed" and n:
                    served[tier] = served.get(tier, 0) + n
            if r["tokens"]["computed"]:
                miss = r["miss"] or {"reason": "partial_chunk", "tier": ""}
                key = (miss["reason"], miss["tier"] or "none")
                missed[key] = missed.get(key, 0) + r["tokens"]["computed"]
        steps_missed = missed.pop(("partial_chunk", "none"), 0.0)

        def grew() -> tuple[dict[str, float], dict[tuple[str, str], float], float]:
            after = walk.metrics()
            grew_served = {dict(k[1])["tier"]: v - before.get(k, 0.0) for k, v in after.items()
                           if k[0] == "kvtier_served_tokens_total" and v - before.get(k, 0.0)}
            grew_missed = {(dict(k[1])["reason"], dict(k[1])["tier"]): v - before.get(k, 0.0) for k, v in after.items()
                           if k[0] == "kvtier_missed_tokens_total" and v - before.get(k, 0.0)}
            hits = after.get(("kvtier_ghost_hit_distance_bytes_count", (("tier", "cpu"),)), 0.0)
            return grew_served, grew_missed, hits

        # nothing else ran: the server's counters grew by the receipts' sums, exactly (the one-token
        # "a step" prompts have no receipt here: their computed tokens are partial_chunk's surplus)
        deadline = time.monotonic() + 60.0  # the front end records a step's stats after its outputs
        while True:
            grew_served, grew_missed, ghost_hits = grew()
            steps = grew_missed.pop(("partial_chunk", "none"), 0.0) - steps_missed
            if (grew_served == served and grew_missed == missed) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert grew_served == served
        assert grew_missed == missed
        assert steps >= 0  # partial_chunk: the receipts' and the "a step" prompts' (no receipt here), computed whole
        # ghost hits were measured: the disk hit's promotion found the cpu tier's ghosts
        assert ghost_hits >= 3
