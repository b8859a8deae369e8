"""Start one vLLM engine (in this process) on a hybrid test model with the HMA recorder connector
(hma_recorder.py) and report its KV cache groups and two rounds of greedy generation; used by
test_vllm_hybrid_models.py.

Usage: ``HMA_RECORD=rec.jsonl python hybrid_probe.py MODEL_DIR GEOMETRY OUT.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(model: str, geometry: str, out_path: str) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(Path(__file__).parent))  # hma_recorder, by kv_connector_module_path
    from vllm import LLM, SamplingParams

    from kvtier.launch.testmodel import engine_kwargs, random_prompt

    transfer = {"kv_connector": "HMARecorder", "kv_connector_module_path": "hma_recorder", "kv_role": "kv_both"}
    llm = LLM(model=model, dtype="float32", max_model_len=1024, enforce_eager=True, block_size=32,
              num_gpu_blocks_override=128, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True, seed=0,
              kv_transfer_config=transfer, **engine_kwargs(geometry))
    kv_cache_config = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    groups = [{"spec": type(g.kv_cache_spec).__name__, "block_size": g.kv_cache_spec.block_size,
               "layers": list(g.layer_names), "sliding_window": getattr(g.kv_cache_spec, "sliding_window", None),
               "mamba_cache_mode": getattr(g.kv_cache_spec, "mamba_cache_mode", None)}
              for g in kv_cache_config.kv_cache_groups]
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
    prompts = [random_prompt(seed, 200) for seed in range(2)]
    rounds = []
    for _ in range(2):
        outs = llm.generate(prompts, params, use_tqdm=False)
        rounds.append([{"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                        "prompt_tokens": len(o.prompt_token_ids),
                        "logprobs": [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]}
                       for o in outs])
    Path(out_path).write_text(json.dumps({"groups": groups, "rounds": rounds,
                                          "retention": kv_cache_config.prefix_cache_retention_interval}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
