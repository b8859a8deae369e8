"""KV bytes per token, the prefill-time model and capacity recommendations."""

import json

import pytest

from kvtier.cli.simulate import _per_token as per_token
from kvtier.core.errors import UserError
from kvtier.simulate.cost import Throughputs, time_saved
from kvtier.simulate.recommend import advise, cpu_size, recommend
from kvtier.simulate.sweep import SweepSpec, run_sweep
from tests.simulate.helpers import make_trace

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "torch_dtype": "bfloat16"}


def _config(tmp_path, config: dict, name: str = "config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(config))
    return str(path)


def test_gqa_mha_explicit_head_dim_and_mla(tmp_path):
    """simulate --model reads a model through kvtier size's resolver (kvtier.size.models.resolve_model)."""
    assert per_token(_config(tmp_path, LLAMA_8B), 1, "auto") == 32 * 2 * 8 * 128 * 2 == 131_072
    mha = {"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768, "torch_dtype": "float32"}
    # vLLM's --dtype auto runs a float32 checkpoint in 16 bits (vllm/config/model.py, "Downcast for float32
    # models"), its KV cache too (tester3)
    assert per_token(_config(tmp_path, mha), 1, "auto") == 12 * 2 * 12 * 64 * 2
    assert per_token(_config(tmp_path, {**LLAMA_8B, "head_dim": 256}), 1, "auto") == 32 * 2 * 8 * 256 * 2
    assert per_token(_config(tmp_path, LLAMA_8B), 1, "fp8") == 65_536
    assert per_token(_config(tmp_path, LLAMA_8B), 4, "auto") == 131_072  # a total across ranks
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}
    assert per_token(_config(tmp_path, mla), 1, "auto") == 61 * (512 + 64) * 2
    assert per_token(_config(tmp_path, {"text_config": LLAMA_8B}), 1, "auto") == 131_072
    assert per_token("meta-llama/Llama-3.1-8B", 1, "auto") == 131_072  # a preset's alias, as kvtier size reads it


def test_geometry_errors(tmp_path):
    with pytest.raises(UserError, match="num_hidden_layers"):
        per_token(_config(tmp_path, {"num_attention_heads": 8}), 1, "auto")
    with pytest.raises(UserError, match="dtype"):
        per_token(_config(tmp_path, {**LLAMA_8B, "torch_dtype": "int3"}), 1, "auto")
    with pytest.raises(UserError, match="does not exist"):
        per_token(str(tmp_path / "missing.json"), 1, "auto")
    (tmp_path / "bad.json").write_text("{oops")
    with pytest.raises(UserError, match="not a readable JSON config"):
        per_token(str(tmp_path / "bad.json"), 1, "auto")
    with pytest.raises(UserError, match="--kv-dtype 'int4'"):
        per_token(_config(tmp_path, LLAMA_8B), 1, "int4")


def test_a_model_directory_is_read_through_its_config_json(tmp_path):
    """simulate --model DIR reads DIR/config.json, as kvtier size --model does (tester4)."""
    (tmp_path / "model").mkdir()
    with pytest.raises(UserError, match=r"model/config.json does not exist; pass a model directory or its "
                                        r"config.json"):
        per_token(str(tmp_path / "model"), 1, "auto")
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA_8B))
    assert per_token(str(tmp_path / "model"), 1, "auto") == 131_072


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 64}, "num_attention_heads 32 not divisible by num_key_value_heads 64"),
    ({"num_key_value_heads": 5}, "num_attention_heads 32 not divisible by num_key_value_heads 5"),
    ({"hidden_size": 100}, "hidden_size 100 not divisible by num_attention_heads 32"),
])
def test_heads_that_do_not_fit_are_refused_as_kvtier_size_refuses_them(tmp_path, change, message):
    """These were sized silently (hidden_size 100 over 32 heads: a floored head_dim of 3) (tester3)."""
    with pytest.raises(UserError, match=message):
        per_token(_config(tmp_path, {**LLAMA_8B, **change}), 1, "auto")


def test_every_preset_gets_the_bytes_per_token_kvtier_size_gives():
    """Hybrid models count their attention layers only: Jamba 1.5 Mini 4 of 32 (tester3)."""
    from kvtier.size.presets import PRESETS

    for preset in PRESETS:
        for tp in (1, 8):
            geometry = preset.geometry()
            if tp > 1 and (geometry.num_attention_heads or 1) % tp:
                continue
            assert per_token(preset.name, tp, "bf16") == geometry.kv_bytes_per_token(tp, 2), preset.name
    jamba = next(p.name for p in PRESETS if "Jamba" in p.name)
    assert per_token(jamba, 1, "bf16") == 4 * 2 * 8 * 128 * 2  # 4 attention layers of 32


def test_a_model_without_attention_layers_is_refused(tmp_path):
    with pytest.raises(UserError, match="no attention layers"):
        per_token(_config(tmp_path, {**LLAMA_8B, "layer_types": ["mamba"] * 32}), 1, "auto")


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
    # the same gain for every doubling is a straight line on the log2 axis: no knee, whatever the
    # rounding puts a hair above the chord (the bundled trace's 200/400/800 GiB rows, second tester)
    assert recommend([200, 400, 800], [0.2523, 0.2692, 0.2857]).knee_gib is None
    assert recommend([1, 2, 4], [0.3, 0.3, 0.3]).knee_gib is None
    assert recommend([4, 1, 2], [0.3, 0.1, 0.2]).enough_gib == 4  # unsorted input is fine
    with pytest.raises(ValueError):
        recommend([], [])


def test_cpu_size_says_when_the_curve_has_no_knee_inside_the_range():
    bent = cpu_size([(16, 0.10), (32, 0.30), (64, 0.50), (128, 0.58), (256, 0.60), (512, 0.61)], 4096)
    assert (bent.gib, bent.hit_ratio) == (64, 0.50) and bent.reason.startswith("knee of the curve; hits 50.0%")
    rising = cpu_size([(200, 0.20), (400, 0.30), (800, 0.45)], 20_000)  # convex: still climbing at the top
    assert rising.gib == 800 and rising.hit_ratio == 0.45
    assert "no knee inside 200–800 GiB" in rising.reason and "lower bound" in rising.reason
    assert "--cpu-gib 800,1600,3200,6400 " in rising.reason  # the range to sweep next, up to 8× the largest
    whole = cpu_size([(200, 0.20), (400, 0.30), (800, 0.45)], 700)  # the largest already holds everything
    assert "whole footprint" in whole.reason and whole.gib == 800
    capped = cpu_size([(200, 0.20), (400, 0.30), (800, 0.45)], 2000)
    assert "--cpu-gib 800,1600,2000 " in capped.reason  # never past the footprint
    flat = cpu_size([(64, 0.3000), (128, 0.3004), (256, 0.3005)], 4096)
    assert flat.gib == 64 and "flat" in flat.reason and "--cpu-gib 4,64,256,4096)" in flat.reason


def test_advise_reads_the_sweeps_own_rows_and_keeps_the_disk_given():
    """The sizes come from the very rows the table prints (every tier as configured): the cpu
    size is a swept row whose hit ratio is that row's, and a disk tier given is reported as
    given, never resized."""
    prompts = [[2 * i, 2 * i + 1] for i in range(8)]  # 8 two-chunk prompts, cycled
    trace = make_trace([(keys, 1) for _ in range(6) for keys in prompts])
    spec = SweepSpec(chunk_bytes=1 << 30, engine_gib=0, cpu_gibs=(1, 2, 4, 8, 16), disk_gib=6, policies=("lru",))
    result = run_sweep(trace, spec, workers=1)
    rows = result.curve("lru")
    ceiling, sizes = advise(trace, spec, rows, "lru", Throughputs(prefill_tokens_per_s=1.0))
    cpu, disk = sizes
    row = next(r for r in rows if r.cpu_gib == cpu.gib)
    assert cpu.hit_ratio == row.token_hit_ratio and f"hits {row.token_hit_ratio:.1%}" in cpu.reason
    assert disk.tier == "disk" and disk.gib == 6 and disk.reason.startswith("as given")
    assert f"serves {row.tier_token_hit_ratio('disk'):.1%}" in disk.reason
    assert 0 < ceiling <= 1


def test_advise_sizes_a_disk_tier_only_when_none_was_given():
    prompts = [[2 * i, 2 * i + 1] for i in range(8)]  # LRU on 2 chunks never hits this cycle
    trace = make_trace([(keys, 1) for _ in range(6) for keys in prompts])
    spec = SweepSpec(chunk_bytes=1 << 30, engine_gib=0, cpu_gibs=(1, 2), disk_gib=0, policies=("lru",))
    rows = run_sweep(trace, spec, workers=1).curve("lru")
    ceiling, (cpu, disk) = advise(trace, spec, rows, "lru", Throughputs(prefill_tokens_per_s=1.0))
    assert cpu.hit_ratio == 0.0 and "flat" in cpu.reason and cpu.gib == 1
    assert disk.gib is not None and disk.hit_ratio >= 0.95 * ceiling and "not in the table" in disk.reason


def test_advise_never_recommends_a_cpu_tier_smaller_than_one_chunk():
    """A cpu tier under one chunk fails at start-up as cpu_gib 0 is refused: its rows are measured
    but never recommended, and the line names them (second fresh-eyes pass: 0.001 GiB was
    recommended with 64 MiB chunks)."""
    prompts = [[2 * i, 2 * i + 1] for i in range(8)]
    trace = make_trace([(keys, 1) for _ in range(6) for keys in prompts])
    spec = SweepSpec(chunk_bytes=1 << 30, engine_gib=0, cpu_gibs=(0.25, 0.5, 1, 2), disk_gib=8, policies=("lru",))
    rows = run_sweep(trace, spec, workers=1).curve("lru")
    _, (cpu, _disk) = advise(trace, spec, rows, "lru", Throughputs(prefill_tokens_per_s=1.0))
    assert cpu.gib is not None and cpu.gib >= 1
    assert "the swept 0.25,0.5 GiB are left out: kvtier refuses a cpu tier smaller than one 1 GiB chunk" in cpu.reason
    tiny = SweepSpec(chunk_bytes=1 << 30, engine_gib=0, cpu_gibs=(0.25, 0.5), disk_gib=8, policies=("lru",))
    rows = run_sweep(trace, tiny, workers=1).curve("lru")
    _, sizes = advise(trace, tiny, rows, "lru", Throughputs(prefill_tokens_per_s=1.0))
    assert [s.gib for s in sizes] == [None] and "less than one 1 GiB chunk" in sizes[0].reason


def test_advise_never_recommends_a_cpu_tier_kvtier_refuses():
    """kvtier refuses cpu_gib 0: a swept 0 is left out (the line says so), even where it would be
    the flat curve's smallest, and a disk tier is then sized with a cpu tier that exists; with only
    0 swept there is no cpu size and no lower tier sized.  The extra replays are announced before
    they run."""
    prompts = [[2 * i, 2 * i + 1] for i in range(8)]  # LRU on 2 chunks never hits this cycle
    trace = make_trace([(keys, 1) for _ in range(6) for keys in prompts])
    spec = SweepSpec(chunk_bytes=1 << 30, engine_gib=0, cpu_gibs=(0, 1, 2), disk_gib=0, policies=("lru",))
    rows = run_sweep(trace, spec, workers=1).curve("lru")
    said: list[str] = []
    _, (cpu, disk) = advise(trace, spec, rows, "lru", Throughputs(prefill_tokens_per_s=1.0), say=said.append)
    assert cpu.gib == 1 and "the swept 0 GiB is left out" in cpu.reason
    assert disk.gib is not None and "with cpu 1 GiB" in disk.reason
    assert any(line.startswith("sizing a disk tier: up to ") for line in said), said
    only_zero = SweepSpec(chunk_bytes=1 << 30, engine_gib=0, cpu_gibs=(0,), disk_gib=8, policies=("lru",))
    rows = run_sweep(trace, only_zero, workers=1).curve("lru")
    _, sizes = advise(trace, only_zero, rows, "lru", Throughputs(prefill_tokens_per_s=1.0))
    assert [(s.tier, s.gib) for s in sizes] == [("cpu", None)] and "kvtier refuses" in sizes[0].reason


def test_advise_reads_the_ceiling_from_a_row_holding_the_whole_footprint():
    """A row whose cpu tier holds every distinct chunk never evicts: its hit ratio is the ceiling,
    with no extra replay (nothing announced)."""
    prompts = [[2 * i, 2 * i + 1] for i in range(8)]
    trace = make_trace([(keys, 1) for _ in range(6) for keys in prompts])
    spec = SweepSpec(chunk_bytes=1 << 30, engine_gib=0, cpu_gibs=(1, 16), disk_gib=0, policies=("lru",))
    rows = run_sweep(trace, spec, workers=1).curve("lru")
    said: list[str] = []
    ceiling, (cpu, disk) = advise(trace, spec, rows, "lru", Throughputs(prefill_tokens_per_s=1.0), say=said.append)
    assert ceiling == rows[-1].token_hit_ratio > 0 and said == []
    assert cpu.gib == 16 and disk.gib is None and disk.reason.startswith("not needed")
