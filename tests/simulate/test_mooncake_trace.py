"""On the bundled Mooncake trace (the report in docs/simulate.md): Belady bounds every policy and
the default never falls below the stronger LRU, at a small, the widest-gap and a large capacity."""

from importlib import resources

from kvtier.simulate.report import belady_gaps
from kvtier.simulate.sweep import SweepSpec, run_sweep
from kvtier.simulate.trace import read_trace

CHUNK_BYTES = 131_072 * 512  # Llama-3.1-8B bf16, 512-token chunks


def test_default_never_below_lru_and_belady_on_top():
    trace = read_trace(str(resources.files("kvtier") / "data" / "mooncake_conversation_trace.jsonl.gz"))
    spec = SweepSpec(CHUNK_BYTES, 40.0, (64.0, 256.0, 2048.0), 0.0, ("lru", "lru-tail", "default", "belady"))
    result = run_sweep(trace, spec, workers=2)
    for gap in belady_gaps(result, "default"):
        assert gap.lru <= gap.policy <= gap.belady, gap
    hits = {(r.policy, r.cpu_gib): r.token_hit_ratio for r in result.rows}
    # quarantine pays where LRU thrashes (1.49x with the LRU guard, which admits only what the
    # ordering has earned; 1.6x without it: docs/simulate.md, "The guard")
    assert hits["default", 256.0] > 1.4 * hits["lru", 256.0]
    assert all(hits["belady", gib] >= hits[name, gib] for name, gib in hits)
