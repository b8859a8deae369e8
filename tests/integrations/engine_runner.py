"""Run a real vLLM engine (``vllm.LLM``: scheduler and worker in separate processes) with
KVTierConnector through a scripted list of steps; used by the engine tests that need their own
process (restarts, several engines at once).

Processes: the engine core (scheduler and the scheduler-side connector) runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by tests/integrations/vllm_helpers.py) and the worker
(with the worker-side connector and its store) in its own, through vLLM's multiprocessing
executor (``distributed_executor_backend="mp"``, what vLLM's CPU platform uses under ``vllm
serve``), so the two connector halves meet only through vLLM's per-step messages, as under
``vllm serve``; an engine-core process of its own would only cost one more start-up.

Usage: ``python engine_runner.py SPEC.json OUT.json``.  SPEC keys:

- ``model``: model directory; ``kvtier``: the ``kv_connector_extra_config`` dict;
  ``role``: ``kv_both`` / ``kv_producer`` / ``kv_consumer``; ``engine``: extra ``LLM`` kwargs;
  ``beside``: another connector's ``kv_transfer_config``, run with kvtier under MultiConnector.
- ``steps``: list of ``{"op": "generate", "prompts": [...], "max_tokens": N, "salt": s}`` (a
  prompt is a text or a list of token ids; ``"cut_at_chunk": true`` cuts token-id prompts to
  their last chunk boundary plus one token, the chunk size read from ``kvtier_chunk_tokens``),
  ``{"op": "flush"}`` (step the engine until ``/metrics`` shows no dirty bytes),
  ``{"op": "reset_prefix_cache"}``, ``{"op": "touch", "path": p}``,
  ``{"op": "wait", "path": p, "timeout_s": t}``, ``{"op": "until", "metric": name, "at_least": x,
  "timeout_s": t}`` (step the engine with a one-token request until that ``/metrics`` sample
  reaches ``x``), ``{"op": "metrics"}`` (record a snapshot in OUT's ``snapshots``).

Metrics are read in this process: ``LLMEngine.step`` records each step's stats (the connector's
included) into the Prometheus registry before ``generate`` returns, so a snapshot taken after a
step holds that step's figures; nothing arrives while the engine is not stepped.

The worker (and its store) lives in vLLM's worker process; the runner sees it only through
vLLM's ``/metrics`` collectors in this process, as an operator would.  At the end the engine is
shut down gracefully (the connector's shutdown flush runs).

OUT holds ``results`` (per generate step: token ids, chosen-token logprobs, the prompt's length
and vLLM's ``num_cached_tokens`` per prompt),
``metrics`` (``vllm:*prefix_cache*`` and ``kvtier_*`` samples summed over labels, by name and
tier) taken after the last step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def _metrics() -> dict[str, float]:
    import prometheus_client

    out: dict[str, float] = {}
    for family in prometheus_client.REGISTRY.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if "prefix_cache" in sample.name or sample.name.startswith("kvtier_") or "preemptions" in sample.name:
                tier = sample.labels.get("tier") or sample.labels.get("direction") or sample.labels.get("source")
                name = sample.name + (f"{{{tier}}}" if tier else "")
                out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def _chunk_tokens(timeout_s: float = 60.0) -> int:
    """The engine's resolved chunk size, from ``kvtier_chunk_tokens`` (it arrives with the stats of
    an engine step: run one before asking)."""
    deadline = time.monotonic() + timeout_s
    while not (chunk := int(_metrics().get("kvtier_chunk_tokens", 0))):
        if time.monotonic() > deadline:
            raise TimeoutError("kvtier_chunk_tokens never reached the metrics")
        time.sleep(0.05)
    return chunk


def main(spec_path: str, out_path: str) -> int:
    from vllm import LLM, SamplingParams

    spec = json.loads(Path(spec_path).read_text())
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": spec.get("role", "kv_both"), "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": spec["kvtier"]}
    if spec.get("beside"):  # a MultiConnector: kvtier first, then this other connector's config
        transfer = {"kv_connector": "MultiConnector", "kv_role": transfer["kv_role"],
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"connectors": [transfer, spec["beside"]]}}
    engine = {"dtype": "float32", "max_model_len": 1024, "enforce_eager": True, "gpu_memory_utilization": 0.05,
              "kv_cache_memory_bytes": 64 << 20, "block_size": 32, "num_gpu_blocks_override": 64,
              "enable_prefix_caching": True, "disable_log_stats": False, "seed": 0, "distributed_executor_backend": "mp"}
    engine.update(spec.get("engine", {}))
    llm = LLM(model=spec["model"], kv_transfer_config=transfer, **engine)
    results = []
    snapshots = []
    quiet = SamplingParams(max_tokens=1, temperature=0.0)
    for step in spec["steps"]:
        op = step["op"]
        if op == "generate":
            params = SamplingParams(max_tokens=step.get("max_tokens", 8), temperature=0.0, logprobs=0)
            if step.get("cut_at_chunk"):  # token-id prompts cut to their last chunk boundary + 1 token
                chunk = _chunk_tokens()
                step = {**step, "prompts": [p[:(len(p) - 1) // chunk * chunk + 1] for p in step["prompts"]]}
            prompts = [{("prompt_token_ids" if isinstance(p, list) else "prompt"): p,
                        **({"cache_salt": step["salt"]} if step.get("salt") else {})} for p in step["prompts"]]
            outs = llm.generate(prompts, params, use_tqdm=False)
            results.append([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                             "prompt_tokens": len(o.prompt_token_ids or []),
                             "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                            for o in outs])
        elif op == "flush":  # gauges arrive with engine steps: step until no dirty bytes are left
            deadline = time.monotonic() + 60
            llm.generate(["flush"], quiet, use_tqdm=False)
            while _metrics().get("kvtier_dirty_bytes", 0.0) > 0 and time.monotonic() < deadline:
                time.sleep(0.2)
                llm.generate(["flush"], quiet, use_tqdm=False)
        elif op == "until":  # gauges arrive with engine steps: step until the sample reaches the value
            deadline = time.monotonic() + step.get("timeout_s", 60)
            while _metrics().get(step["metric"], 0.0) < step["at_least"]:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{step['metric']} stayed below {step['at_least']}: {_metrics()}")
                time.sleep(0.1)
                llm.generate(["flush"], quiet, use_tqdm=False)
        elif op == "metrics":
            snapshots.append(_metrics())
        elif op == "reset_prefix_cache":  # refused while a finished request's blocks wait for their save
            deadline = time.monotonic() + 60
            while not llm.reset_prefix_cache():
                if time.monotonic() > deadline:
                    raise TimeoutError("vLLM still refused reset_prefix_cache after 60 s")
                time.sleep(0.1)
                llm.generate(["flush"], quiet, use_tqdm=False)
        elif op == "touch":
            Path(step["path"]).write_text("done")
        elif op == "wait":
            deadline = time.monotonic() + step.get("timeout_s", 300)
            while not Path(step["path"]).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"waited too long for {step['path']}")
                time.sleep(0.1)
        else:
            raise ValueError(f"unknown op {op!r}")
    out = {"results": results, "metrics": _metrics(), "snapshots": snapshots,
           "block_size": llm.llm_engine.vllm_config.cache_config.block_size}  # as vLLM resolved it
    llm.llm_engine.engine_core.shutdown()  # graceful: the worker's connector flushes and closes
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
