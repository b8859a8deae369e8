"""Serve one prompt through vLLM's ``OffloadingConnector`` loaded via the benchmark-only CPU shim
(:mod:`kvtier.bench.native_cpu`): its whole-block prefix alone first (cold), then the prompt over
vLLM's own prefix cache, then the prompt again after that cache is reset, so the third run is served
from the native CPU tier.  Usage: ``python native_runner.py MODEL OUT.json``.

OUT holds the three runs' token ids, chosen-token logprobs and cached-token counts, and vLLM's
external prefix cache counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(model: str, out_path: str) -> int:
    import os

    # the engine core in this process, the worker in its own (vLLM's multiprocessing executor): one
    # process start-up fewer than vLLM's default, the connector's two halves still apart
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import prometheus_client
    from vllm import LLM, SamplingParams

    from kvtier.launch.testmodel import random_prompt

    transfer = {"kv_connector": "OffloadingConnector", "kv_connector_module_path": "kvtier.bench.native_cpu",
                "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": 64 << 20}}
    llm = LLM(model=model, kv_transfer_config=transfer, dtype="float32", max_model_len=1024, enforce_eager=True,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20, block_size=32,
              num_gpu_blocks_override=64, enable_prefix_caching=True, disable_log_stats=False, seed=0,
              distributed_executor_backend="mp")
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    ids = list(llm.get_tokenizer().encode(random_prompt(7, 300)))
    prefix = ids[:(len(ids) - 1) // 32 * 32]  # the whole blocks a full hit of ``ids`` can serve
    runs = []
    # 1. the prefix alone, cold: vLLM's own cache and the native CPU tier then hold the same bytes;
    # 2. the whole prompt over vLLM's own prefix cache (the exact reference); 3. the whole prompt
    # again after vLLM's cache is reset: the prefix comes back from the native CPU tier
    for step, prompt_ids in enumerate((prefix, ids, ids)):
        out = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)[0]
        runs.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens or 0,
                     "prompt_tokens": len(out.prompt_token_ids),
                     "logprobs": [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]})
        if step == 1:
            llm.generate([random_prompt(9, 5)], params, use_tqdm=False)  # one more step submits the deferred store
            llm.reset_prefix_cache()
    # LLMEngine.step recorded every step's stats before generate returned: nothing more arrives
    counters = {}
    for family in prometheus_client.REGISTRY.collect():
        for sample in family.samples:
            if sample.name.startswith("vllm:external_prefix_cache") and sample.name.endswith("_total"):
                counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
    Path(out_path).write_text(json.dumps({"runs": runs, "counters": counters}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
