"""Built-in geometries of popular open models, so ``kvtier size`` works without a download.

Each preset holds the KV-relevant fields of the model's published ``config.json`` (the file at
``source``) and runs through the same parser as a local config, so a preset and the real file
give the same answer.  ``weights_gib`` is the checkpoint size used for the HBM budget: parameter
count from the model card × bytes per parameter of the published checkpoint dtype, unless the
model card states the checkpoint size itself (gpt-oss).  An alias is the base (or instruct) model
of the same family whose published config.json has the same KV geometry; a checkpoint of another
dtype (``-FP8``) has its own preset, since its weights differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.size.geometry import KVGeometry
from kvtier.size.hf_config import geometry_from_config

GIB = 1 << 30
_HF = "https://huggingface.co/{}/blob/main/config.json"


@dataclass(frozen=True)
class Preset:
    """A published model geometry.

    Attributes:
        name: Hugging Face repo id (what ``--model`` matches, case-insensitive).
        config: the KV-relevant fields of its config.json.
        weights_gib: checkpoint size in GiB; weights_note: how it was derived.
        aliases: other repo ids with the same geometry.
    """

    name: str
    config: dict[str, Any]
    weights_gib: float
    weights_note: str
    aliases: tuple[str, ...] = field(default=())

    @property
    def source(self) -> str:
        return _HF.format(self.name)

    def geometry(self, name: str | None = None) -> KVGeometry:
        """The geometry, named ``name`` (one of the preset's ids, as a user wrote it) or the preset's own."""
        return geometry_from_config(self.config, name or self.name, source=self.source)


def _params(billions: float, bytes_per_param: float, dtype: str) -> tuple[float, str]:
    return billions * 1e9 * bytes_per_param / GIB, f"{billions}B parameters (model card) × {dtype}"


def _dense(layers: int, heads: int, kv: int, hidden: int, **extra: Any) -> dict[str, Any]:
    return {"num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "hidden_size": hidden, **extra}


_GPT_OSS_TYPES = lambda n: ["sliding_attention", "full_attention"] * (n // 2)

PRESETS: tuple[Preset, ...] = (
    Preset("meta-llama/Llama-3.1-8B-Instruct", _dense(32, 32, 8, 4096, head_dim=128),
           *_params(8.03, 2, "bf16"), aliases=("meta-llama/Llama-3.1-8B",)),
    Preset("meta-llama/Llama-3.1-70B-Instruct", _dense(80, 64, 8, 8192, head_dim=128),
           *_params(70.6, 2, "bf16"), aliases=("meta-llama/Llama-3.3-70B-Instruct", "meta-llama/Llama-3.1-70B")),
    Preset("meta-llama/Llama-3.1-405B-Instruct", _dense(126, 128, 8, 16384, head_dim=128),
           *_params(405.0, 2, "bf16"), aliases=("meta-llama/Llama-3.1-405B",)),
    Preset("meta-llama/Llama-3.2-3B-Instruct", _dense(28, 24, 8, 3072, head_dim=128),
           *_params(3.21, 2, "bf16"), aliases=("meta-llama/Llama-3.2-3B",)),
    Preset("Qwen/Qwen2.5-7B-Instruct", _dense(28, 28, 4, 3584), *_params(7.62, 2, "bf16"), aliases=("Qwen/Qwen2.5-7B",)),
    Preset("Qwen/Qwen2.5-72B-Instruct", _dense(80, 64, 8, 8192), *_params(72.7, 2, "bf16"),
           aliases=("Qwen/Qwen2.5-72B",)),
    Preset("Qwen/Qwen3-4B", _dense(36, 32, 8, 2560, head_dim=128), *_params(4.02, 2, "bf16")),
    Preset("Qwen/Qwen3-8B", _dense(36, 32, 8, 4096, head_dim=128), *_params(8.19, 2, "bf16")),
    Preset("Qwen/Qwen3-8B-FP8", _dense(36, 32, 8, 4096, head_dim=128), *_params(8.19, 1, "fp8")),
    Preset("Qwen/Qwen3-32B", _dense(64, 64, 8, 5120, head_dim=128), *_params(32.8, 2, "bf16")),
    Preset("Qwen/Qwen3-30B-A3B", _dense(48, 32, 4, 2048, head_dim=128), *_params(30.5, 2, "bf16")),
    Preset("Qwen/Qwen3-235B-A22B", _dense(94, 64, 4, 4096, head_dim=128), *_params(235.0, 2, "bf16")),
    Preset("Qwen/Qwen3-Next-80B-A3B-Instruct",
           _dense(48, 16, 2, 2048, head_dim=256, full_attention_interval=4, linear_conv_kernel_dim=4,
                  linear_key_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32,
                  linear_value_head_dim=128),
           *_params(80.0, 2, "bf16")),
    Preset("mistralai/Mistral-7B-Instruct-v0.3", _dense(32, 32, 8, 4096, head_dim=128),
           *_params(7.25, 2, "bf16"), aliases=("mistralai/Mistral-7B-v0.3",)),
    Preset("mistralai/Mixtral-8x7B-Instruct-v0.1", _dense(32, 32, 8, 4096), *_params(46.7, 2, "bf16"),
           aliases=("mistralai/Mixtral-8x7B-v0.1",)),
    Preset("deepseek-ai/DeepSeek-V3",
           _dense(61, 128, 128, 7168, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                  v_head_dim=128),
           *_params(671.0, 1, "fp8"), aliases=("deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-V3-0324")),
    Preset("deepseek-ai/DeepSeek-V2-Lite-Chat",
           _dense(27, 16, 16, 2048, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                  v_head_dim=128),
           *_params(15.7, 2, "bf16")),
    Preset("google/gemma-2-9b-it", _dense(42, 16, 8, 3584, head_dim=256, sliding_window=4096,
                                          model_type="gemma2"), *_params(9.24, 2, "bf16")),
    Preset("google/gemma-3-27b-it",
           {"model_type": "gemma3", "text_config": _dense(62, 32, 16, 5376, head_dim=128, sliding_window=1024,
                                                          sliding_window_pattern=6)},
           *_params(27.4, 2, "bf16")),
    Preset("openai/gpt-oss-120b", _dense(36, 64, 8, 2880, head_dim=64, sliding_window=128,
                                         layer_types=_GPT_OSS_TYPES(36)),
           60.8, "checkpoint size 60.8 GiB (model card, MXFP4 experts)"),
    Preset("openai/gpt-oss-20b", _dense(24, 64, 8, 2880, head_dim=64, sliding_window=128,
                                        layer_types=_GPT_OSS_TYPES(24)),
           12.8, "checkpoint size 12.8 GiB (model card, MXFP4 experts)"),
    Preset("ai21labs/AI21-Jamba-1.5-Mini",
           _dense(32, 32, 8, 4096, attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16,
                  mamba_d_conv=4, mamba_expand=2),
           *_params(51.6, 2, "bf16")),
)


def find_preset(name: str) -> Preset | None:
    """The preset whose repo id or alias equals ``name`` (case-insensitive), or None."""
    wanted = name.strip().lower()
    for preset in PRESETS:
        if wanted in (n.lower() for n in (preset.name, *preset.aliases)):
            return preset
    return None
