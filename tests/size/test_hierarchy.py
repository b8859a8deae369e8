"""One model of the hierarchy (kvtier.simulate.hierarchy): ``kvtier size`` and ``kvtier simulate`` give the
same tiers for the same trace and geometry, and the replay measures what the model predicts; tiers are
inclusive (a cpu tier no larger than the engine's KV cache serves nothing under LRU); host RAM and NVMe
bound the tiers after their reserves; model ids resolve the same way in both commands."""

from __future__ import annotations

import gzip
import itertools
import json
import re

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.policies import make_policy
from kvtier.simulate.hierarchy import (
    GIB,
    host_reserve_gib,
    plan_tiers,
    replay_plan,
    stack_curve,
    usable_dram_gib,
    warm_set_from_trace,
)
from kvtier.simulate.replay import engine_prefix_hits, replay
from kvtier.simulate.trace import read_trace
from kvtier.tools.mooncake import bundled_trace_path

runner = CliRunner()
MODEL = "meta-llama/Llama-3.1-8B"  # a base id: the preset is the -Instruct one (same geometry)
CHUNK_BYTES = 131_072 * 512  # Llama-3.1-8B, bf16, 512-token Mooncake blocks: 64 MiB


@pytest.fixture(scope="module")
def trace_file(tmp_path_factory):
    """The first 3,000 requests of the bundled Mooncake trace (real traffic; replays in about a second)."""
    path = tmp_path_factory.mktemp("trace") / "mooncake-3000.jsonl"
    with gzip.open(bundled_trace_path(), "rt", encoding="utf-8") as source:
        path.write_text("".join(itertools.islice(source, 3000)), encoding="utf-8")
    return path


def invoke(*args: str):
    result = runner.invoke(app, list(args), env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result


def test_size_and_simulate_give_the_same_tiers_and_the_replay_measures_the_prediction(trace_file):
    # engine: 80 × 0.9 − 8 weights − 4 overhead = 60 GiB; DRAM: 264 − (16 + 16 × 1) = 232 GiB usable
    size = json.loads(invoke("size", "--model", MODEL, "--gpu-memory-gib", "80", "--weights-gib", "8",
                             "--trace", str(trace_file), "--host-ram-gib", "264", "--nvme-gib", "4000",
                             "--json").stdout)
    assert size["hbm_kv_budget_bytes"] == 60 * GIB and size["host_reserve_gib"] == 32
    assert size["cpu_gib"] == 232 and size["cpu_gib"] * GIB > size["hbm_kv_budget_bytes"]
    assert size["disk_gib"] > size["cpu_gib"]
    out = invoke("simulate", "--trace", str(trace_file), "--model", MODEL, "--engine-gib", "60", "--cpu-gib",
                 "30,232", "--policy", "lru", "--recommend", "--host-ram-gib", "264", "--nvme-gib", "4000",
                 "--workers", "1").stdout
    # the sweep's own disk reading gives way to the one model: no second, different disk size
    assert re.search(r"^\s+disk\s+none\s+sized below, as kvtier size sizes it", out, re.MULTILINE), out
    tiers = re.search(r"^\s+cpu ([\d,.]+) GiB, disk ([\d,.]+) GiB$", out, re.MULTILINE)
    assert tiers is not None, out
    cpu, disk = (float(g.replace(",", "")) for g in tiers.groups())
    assert cpu == pytest.approx(size["cpu_gib"], rel=0.10) and disk == pytest.approx(size["disk_gib"], rel=0.10)
    replayed = re.search(r"replayed\s+([\d.]+)% = engine ([\d.]+)% \+ cpu ([\d.]+)% \+ disk ([\d.]+)%", out)
    assert replayed is not None, out
    total, engine, cpu_hit, disk_hit = (float(g) / 100 for g in replayed.groups())
    predicted = size["predicted_hits"]
    assert total == pytest.approx(predicted["total"], rel=0.10)
    assert engine == pytest.approx(predicted["engine"], rel=0.10)
    assert cpu_hit == pytest.approx(predicted["cpu"], rel=0.10) and cpu_hit > 0
    assert disk_hit == pytest.approx(predicted["disk"], rel=0.10)
    # and the sweep's own row at 30 GiB (half the engine's cache): the cpu tier serves nothing
    row = re.search(r"^\s+30\s+lru\s+[\d.]+%\s+([\d.]+)%", out, re.MULTILINE)
    assert row is not None and float(row.group(1)) == 0.0, out


def test_a_cpu_tier_no_larger_than_the_engine_serves_nothing_and_a_larger_one_does(trace_file):
    """The fact the model rests on, measured by the replay kvtier simulate runs (LRU in every tier)."""
    trace = read_trace(trace_file)
    engine_chunks = 60 * GIB // CHUNK_BYTES
    engine = engine_prefix_hits(trace, engine_chunks)
    half = replay(trace, engine, engine_chunks // 2, 0, lambda: make_policy("lru"))
    same = replay(trace, engine, engine_chunks, 0, lambda: make_policy("lru"))
    double = replay(trace, engine, engine_chunks * 4, 0, lambda: make_policy("lru"))
    assert half.cpu_hits == 0 and same.cpu_hits == 0
    assert double.cpu_hits > 0


def test_size_recommends_a_cpu_tier_larger_than_the_engine_or_only_staging(trace_file):
    curve = stack_curve(read_trace(trace_file))
    warm = warm_set_from_trace(curve, CHUNK_BYTES)
    assert warm > 100
    plan = plan_tiers(warm, 100, usable_dram_gib(120, host_reserve_gib(1)), 4000, curve, CHUNK_BYTES)
    assert plan.staging and plan.cpu_gib == 4 and plan.disk_gib == pytest.approx(warm, abs=0.01)
    assert plan.hits is not None and plan.hits.cpu == 0
    assert any("holds nothing the engine does not" in note for note in plan.notes)
    no_disk = plan_tiers(warm, 100, 88, None, curve, CHUNK_BYTES)
    assert no_disk.cpu_gib == 0 and no_disk.disk_gib == 0 and any("--nvme-gib" in n for n in no_disk.notes)
    fits = plan_tiers(warm, warm + 1, 88, 4000, curve, CHUNK_BYTES)
    assert fits.offload_gib == 0 and "Offload not needed" in fits.notes[0]


SCENARIO = ("--model", "meta-llama/Llama-3.1-70B", "--tp", "8", "--gpu", "H200", "--trace", "bundled",
            "--host-ram-gib", "2048", "--nvme-gib", "13970")


def test_the_70b_question_never_recommends_more_dram_than_the_host_minus_its_reserves():
    """Llama-3.1-70B, TP 8, 8× H200, 2,048 GiB of host RAM, a 15 TB drive reading 14 GB/s, the bundled trace."""
    data = json.loads(invoke("size", *SCENARIO, "--context", "32768", "--disk-gb-per-s", "14", "--json").stdout)
    engine_gib = data["hbm_kv_budget_bytes"] / GIB
    assert data["model"] == "meta-llama/Llama-3.1-70B"
    assert data["host_reserve_gib"] == 16 + 16 * 8
    assert engine_gib < data["cpu_gib"] <= 2048 - data["host_reserve_gib"]
    assert data["cpu_gib"] < data["disk_gib"] <= 13970 / 1.1
    assert data["recipe"]["cpu_gib"] <= 2048 - data["host_reserve_gib"]
    assert data["predicted_hits"]["cpu"] > 0.05 and data["predicted_hits"]["disk"] > 0.05


def test_the_model_asked_for_is_named_and_simulate_resolves_ids_as_size_does(trace_file):
    data = json.loads(invoke("size", "--model", MODEL, "--json").stdout)
    assert data["model"] == MODEL and "Instruct" not in data["model"]
    assert "meta-llama/Llama-3.1-8B-Instruct" in data["source"]  # where the shared geometry comes from
    out = invoke("simulate", "--trace", str(trace_file), "--model", "meta-llama/Llama-3.1-70B", "--tp", "8",
                 "--engine-gib", "100", "--cpu-gib", "200", "--policy", "lru", "--workers", "1").stdout
    assert "327,680 B" in out  # kvtier size's figure for Llama-3.1-70B at TP 8
    result = runner.invoke(app, ["simulate", "--trace", str(trace_file), "--model", "meta-llama/Llama-3.1-70B",
                                 "--tp", "3", "--engine-gib", "1", "--cpu-gib", "1"])
    assert result.exit_code == 2 and "TP 3 does not divide the 64 attention heads" in result.output


def test_host_and_nvme_inputs_are_refused_without_recommend_and_when_not_finite(trace_file):
    result = runner.invoke(app, ["simulate", "--trace", str(trace_file), "--kv-bytes-per-token", "1024",
                                 "--engine-gib", "1", "--cpu-gib", "1", "--host-ram-gib", "64"])
    assert result.exit_code == 2 and "add --recommend" in result.output
    result = runner.invoke(app, ["size", "--model", MODEL, "--nvme-gib", "inf"])
    assert result.exit_code == 2 and "--nvme-gib must be a finite number" in result.output
    result = runner.invoke(app, ["size", "--model", MODEL, "--trace", str(trace_file), "--sessions", "4",
                                 "--context", "100"])
    assert result.exit_code == 2 and "not both" in result.output


def test_the_audit_agrees_with_size_on_the_70b_question():
    """kvtier size's recipe for the 70B question audits clean on H200; the rule of thumb's 408 GiB tier does not."""
    recipe = json.loads(invoke("size", *SCENARIO, "--disk-gb-per-s", "14", "--json").stdout)["recipe"]
    for line in (recipe["kvtier"], recipe["vllm_native"].split("\n#")[0]):
        result = runner.invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--gpu", "H200", "--format", "json"],
                               input=line)
        assert result.exit_code == 0, result.output
        assert not [f for f in json.loads(result.stdout)["findings"] if f["rule"].startswith("cpu-tier")], result.stdout
    old = "vllm serve meta-llama/Llama-3.1-70B --tensor-parallel-size 8 --kv-offloading-size 408"
    result = runner.invoke(app, ["audit", "-", "--vllm-version", "0.32.0", "--gpu", "H200", "--format", "json"],
                           input=old)
    assert [f["severity"] for f in json.loads(result.stdout)["findings"] if f["rule"] == "cpu-tier-not-above-engine-cache"] == \
        ["warning"], result.stdout
    result = runner.invoke(app, ["audit", "-", "--gpu", "H900"], input=old)
    assert result.exit_code == 2 and "--gpu 'H900' is not known" in result.output


def test_a_disk_slower_than_prefill_gets_no_tier_in_size_as_in_simulate(trace_file):
    """At simulate's default 7 GB/s and 20,000 tok/s a 320 KiB token loads slower than it recomputes:
    simulate --recommend says so, and size (the same test, kvtier.simulate.hierarchy) sizes no disk tier."""
    data = json.loads(invoke("size", *SCENARIO, "--json").stdout)
    assert data["disk_gib"] == 0 and data["cpu_gib"] == 1904
    assert any("No disk tier: loading a chunk from it is slower than prefill (7 GB/s" in n for n in data["notes"])
    out = invoke("simulate", "--trace", str(trace_file), "--model", "meta-llama/Llama-3.1-70B", "--tp", "8",
                 "--engine-gib", "300", "--cpu-gib", "600", "--policy", "lru", "--recommend", "--workers", "1",
                 "--host-ram-gib", "2048", "--nvme-gib", "13970").stdout
    assert "No disk tier: loading a chunk from it is slower than prefill (7 GB/s" in out, out
    assert re.search(r"^\s+cpu [\d,]+ GiB, disk 0 GiB$", out, re.MULTILINE), out


def test_the_write_through_replay_measures_the_inclusive_prediction_and_write_back_holds_more(trace_file):
    """kvtier's default disk tier is write-through: the replay that checks a plan stores every chunk in the
    disk tier when the cpu tier stores it, and then measures the model's prediction; the write-back replay
    (a cpu victim spills to disk) holds cpu + disk distinct chunks and measures more."""
    trace = read_trace(trace_file)
    curve = stack_curve(trace)
    plan = plan_tiers(warm_set_from_trace(curve, CHUNK_BYTES), 60, 232, 4000 / 1.1, curve, CHUNK_BYTES)
    assert plan.hits is not None and plan.disk_gib > plan.cpu_gib > 60
    measured = replay_plan(trace, plan, CHUNK_BYTES, "lru")
    assert measured.total == pytest.approx(plan.hits.total, rel=0.01)
    chunks = [int(g * GIB // CHUNK_BYTES) for g in (plan.engine_gib, plan.cpu_gib, plan.disk_gib)]
    engine = engine_prefix_hits(trace, chunks[0])
    through = replay(trace, engine, chunks[1], chunks[2], lambda: make_policy("lru"), write_through=True)
    back = replay(trace, engine, chunks[1], chunks[2], lambda: make_policy("lru"))
    assert through.disk_stores > back.disk_stores and through.cpu_evictions == back.cpu_evictions
    assert back.disk_hits > through.disk_hits
