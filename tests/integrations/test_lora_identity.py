"""A LoRA adapter's chunk keys follow its files, not only its name and path (the model's identity
fence, :mod:`kvtier.integrations.vllm.worker.identity`, applied to adapters).

Before, the keys' root held ``name@path`` alone: an adapter retrained and copied over the same
directory (or reloaded with vLLM's ``load_inplace``) kept its keys, so a restarted engine, or another
engine on the same disk directory, Redis or bucket, was served KV its old weights computed.  Real
vLLM ``Request`` objects with real ``LoRARequest``\\ s over adapter directories written here
(``adapter_config.json`` and a real safetensors file).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.v1.request import Request

from kvtier.integrations.vllm.scheduler.requests import RequestChain

CHUNK = 128
ROOT = bytes(range(16))
PROMPT = list(range(1, 300))  # 2 full chunks


def write_adapter(directory: Path, seed: int) -> None:
    """A LoRA adapter's files: rank-8 A and B of one projection, the same shapes for every seed."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16,
                                                               "target_modules": ["q_proj"]}))
    rng = np.random.default_rng(seed)
    save_file({"base_model.model.layers.0.self_attn.q_proj.lora_A.weight": rng.standard_normal((8, 64), np.float32),
               "base_model.model.layers.0.self_attn.q_proj.lora_B.weight": rng.standard_normal((64, 8), np.float32)},
              str(directory / "adapter_model.safetensors"))


def keys(lora: LoRARequest | None) -> list[bytes]:
    params = SamplingParams(max_tokens=1)
    params.update_from_generation_config({}, 0)
    request = Request(request_id="r", prompt_token_ids=list(PROMPT), sampling_params=params, pooling_params=None,
                      lora_request=lora)
    return RequestChain(request, ROOT, CHUNK).upto(request.all_token_ids, 2)


def test_an_adapter_replaced_at_the_same_path_gets_new_keys(tmp_path: Path) -> None:
    adapter = tmp_path / "sql-adapter"
    write_adapter(adapter, seed=1)
    first = keys(LoRARequest("sql", 1, str(adapter)))
    assert keys(LoRARequest("sql", 1, str(adapter))) == first  # stable while the files are
    assert keys(LoRARequest("sql", 7, str(adapter))) == first  # vLLM's int id is per engine: not in the key
    size = (adapter / "adapter_model.safetensors").stat().st_size
    write_adapter(adapter, seed=2)  # retrained, copied over the old files: same names, same sizes
    assert (adapter / "adapter_model.safetensors").stat().st_size == size
    retrained = keys(LoRARequest("sql", 1, str(adapter)))
    assert retrained[0] != first[0] and retrained[1] != first[1]
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 32, "target_modules": ["q_proj"]}))
    assert keys(LoRARequest("sql", 1, str(adapter)))[0] not in (first[0], retrained[0])  # the scaling changes KV too


def test_adapters_and_the_base_model_never_share_keys(tmp_path: Path) -> None:
    write_adapter(tmp_path / "a", seed=1)
    write_adapter(tmp_path / "b", seed=1)  # the same files at another path: another adapter as before
    base, a, b = keys(None), keys(LoRARequest("sql", 1, str(tmp_path / "a"))), keys(LoRARequest("sql", 1, str(tmp_path / "b")))
    assert len({base[0], a[0], b[0]}) == 3
    # a path that is not a local directory keeps its name@path identity (nothing to fingerprint)
    remote = keys(LoRARequest("sql", 1, "org/some-adapter"))
    assert remote == keys(LoRARequest("sql", 1, "org/some-adapter")) and remote[0] not in (base[0], a[0])
