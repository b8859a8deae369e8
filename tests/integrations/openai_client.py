"""A small client of a vLLM OpenAI server for the live engine tests, callable in-process or as a
process inside a network namespace (the test's own process cannot reach a namespace's loopback):

    python -m tests.integrations.openai_client BASE_URL OPS.json

OPS is a JSON list of ``{"op": "ready", "timeout_s": t}``, ``{"op": "complete", "prompt": p,
"max_tokens": n}``, ``{"op": "metrics"}``, ``{"op": "reset_prefix_cache"}`` (needs the server's
``VLLM_SERVER_DEV_MODE=1``); prints one JSON line: the list of their results.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx


def complete(base_url: str, prompt: str, max_tokens: int = 8, timeout_s: float = 300.0) -> dict[str, Any]:
    """One streamed greedy completion: ``tokens`` (strings), chosen-token ``logprobs``,
    ``prompt_tokens``, ``ttft_s`` (seconds to the first generated token), ``seconds``."""
    body = {"model": served_model(base_url), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "logprobs": 0, "stream": True, "stream_options": {"include_usage": True}}
    tokens: list[str] = []
    logprobs: list[float] = []
    prompt_tokens = 0
    ttft = None
    start = time.perf_counter()
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=timeout_s) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
            for choice in chunk.get("choices", []):
                got = choice.get("logprobs") or {}
                if got.get("tokens"):
                    if ttft is None:
                        ttft = time.perf_counter() - start
                    tokens += got["tokens"]
                    logprobs += got["token_logprobs"]
    seconds = time.perf_counter() - start
    return {"tokens": tokens, "logprobs": logprobs, "prompt_tokens": prompt_tokens,
            "ttft_s": seconds if ttft is None else ttft, "seconds": seconds}


_MODELS: dict[str, str] = {}


def served_model(base_url: str) -> str:
    if base_url not in _MODELS:
        r = httpx.get(base_url + "/v1/models", timeout=10.0)
        r.raise_for_status()
        _MODELS[base_url] = str(r.json()["data"][0]["id"])
    return _MODELS[base_url]


def metrics(base_url: str) -> dict[str, float]:
    """``/metrics`` samples summed over labels except ``tier`` (kept as ``name{tier}``)."""
    from kvtier.tools.scrape import fetch_metrics, metric_families

    out: dict[str, float] = {}
    for family in metric_families(fetch_metrics(base_url), base_url):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                name = sample.name + (f"{{{sample.labels['tier']}}}" if "tier" in sample.labels else "")
                out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def ready(base_url: str, timeout_s: float) -> bool:
    """Whether ``/v1/models`` answered within ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            served_model(base_url)
            return True
        except (httpx.HTTPError, ValueError, KeyError, IndexError):
            time.sleep(0.5)
    return False


def reset_prefix_cache(base_url: str) -> bool:
    return httpx.post(base_url + "/reset_prefix_cache", timeout=60.0).status_code == 200


def run(base_url: str, ops: list[dict[str, Any]]) -> list[Any]:
    out: list[Any] = []
    for op in ops:
        kind = op["op"]
        if kind == "ready":
            out.append(ready(base_url, op.get("timeout_s", 600.0)))
        elif kind == "complete":
            out.append(complete(base_url, op["prompt"], op.get("max_tokens", 8)))
        elif kind == "metrics":
            out.append(metrics(base_url))
        elif kind == "reset_prefix_cache":
            out.append(reset_prefix_cache(base_url))
        else:
            raise ValueError(f"unknown op {kind!r}")
    return out


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], json.loads(Path(sys.argv[2]).read_text()))))
