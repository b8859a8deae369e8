"""KV bytes per token, the prefill-time model and capacity recommendations."""

import json

import pytest

from kvtier.simulate.cost import Throughputs, time_saved
from kvtier.simulate.geometry import GeometryError, kv_bytes_per_token, kv_bytes_per_token_from_file
from kvtier.simulate.recommend import recommend, size_tiers
from kvtier.simulate.sweep import SweepSpec
from tests.simulate.helpers import make_trace

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "torch_dtype": "bfloat16"}


def test_gqa_mha_explicit_head_dim_and_mla():
    assert kv_bytes_per_token(LLAMA_8B) == 32 * 2 * 8 * 128 * 2 == 131_072
    mha = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768, "torch_dtype": "float32"}
    assert kv_bytes_per_token(mha) == 12 * 2 * 12 * 64 * 4
    assert kv_bytes_per_token({**LLAMA_8B, "head_dim": 256}) == 32 * 2 * 8 * 256 * 2
    assert kv_bytes_per_token(LLAMA_8B, kv_dtype="fp8") == 65_536
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
    assert kv_bytes_per_token(mla) == 61 * (512 + 64) * 2
    assert kv_bytes_per_token({"text_config": LLAMA_8B}) == 131_072


def test_geometry_errors(tmp_path):
    with pytest.raises(GeometryError, match="num_hidden_layers"):
        kv_bytes_per_token({"num_attention_heads": 8})
    with pytest.raises(GeometryError, match="dtype"):
        kv_bytes_per_token({**LLAMA_8B, "torch_dtype": "int3"})
    with pytest.raises(GeometryError, match="does not exist"):
        kv_bytes_per_token_from_file(tmp_path / "config.json")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(GeometryError, match="not valid JSON"):
        kv_bytes_per_token_from_file(tmp_path / "bad.json")
    (tmp_path / "good.json").write_text(json.dumps(LLAMA_8B))
    assert kv_bytes_per_token_from_file(tmp_path / "good.json") == 131_072


def test_time_saved_per_tier():
    rates = Throughputs(prefill_tokens_per_s=10_000, cpu_gb_per_s=50, disk_gb_per_s=5)
    per_token = 100_000  # bytes: 2 µs over "PCIe", 20 µs from "disk"
    saved = time_saved(10_000, 10_000, 10_000, per_token, rates)
    assert saved.engine_s == pytest.approx(1.0)
    assert saved.cpu_s == pytest.approx(1.0 - 10_000 * 2e-6)
    assert saved.disk_s == pytest.approx(1.0 - 10_000 * 22e-6)
    assert saved.total_s == pytest.approx(saved.engine_s + saved.offload_s)
    slow = time_saved(0, 0, 1000, per_token, Throughputs(1e9, 64, 0.001))
    assert slow.disk_s < 0  # loading slower than recomputing shows as a loss
    with pytest.raises(ValueError, match="cpu-gb-per-s"):
        Throughputs(cpu_gb_per_s=0)


def test_recommend_enough_and_knee():
    gibs = [16, 32, 64, 128, 256, 512]
    hits = [0.10, 0.30, 0.50, 0.58, 0.60, 0.61]
    rec = recommend(gibs, hits)
    assert rec.largest_hit_ratio == 0.61
    assert rec.enough_gib == 128 and rec.enough_hit_ratio == 0.58  # 0.58 >= 0.95 * 0.61
    assert rec.knee_gib == 64  # the bend from steep to flat
    assert recommend([64], [0.2]).knee_gib is None
    assert recommend([1, 2, 4], [0.3, 0.3, 0.3]).knee_gib is None
    assert recommend([4, 1, 2], [0.3, 0.1, 0.2]).enough_gib == 4  # unsorted input is fine
    with pytest.raises(ValueError):
        recommend([], [])


def test_size_tiers_judges_the_cpu_tier_alone_when_lower_tiers_were_swept():
    """A sweep with --disk-gib reports the whole stack's hit ratio per cpu size; the recommendation
    must not read it as the cpu tier's, or the disk tier that earns the hits is called "not needed"."""
    prompts = [[2 * i, 2 * i + 1] for i in range(8)]  # 8 two-chunk prompts, cycled: LRU on 2 chunks never hits
    trace = make_trace([(keys, 1) for _ in range(6) for keys in prompts])
    spec = SweepSpec(chunk_bytes=1 << 30, engine_gib=0, cpu_gibs=(1, 2), disk_gib=64, policies=("lru",))
    fast = Throughputs(prefill_tokens_per_s=1.0)  # loading always beats recomputing here
    stack_curve = [(1.0, 0.8), (2.0, 0.8)]  # what the sweep reports with the 64-GiB disk tier below
    ceiling, sizes = size_tiers(trace, spec, stack_curve, "lru", fast, ["disk"])
    cpu, disk = sizes
    assert ceiling > 0.5 and cpu.hit_ratio == 0.0
    assert disk.gib is not None and disk.hit_ratio >= 0.95 * ceiling, disk.reason
