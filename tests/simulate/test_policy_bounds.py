"""scripts/policy_bounds.py (docs/simulate.md, "What an online policy could reach"): its references
know more than an online policy and less than Belady, so none may beat Belady, and knowing the
true popularity must beat LRU on Zipf-popular documents."""

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "policy_bounds.py"


@pytest.fixture(scope="module")
def bounds():
    spec = importlib.util.spec_from_file_location("policy_bounds", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["policy_bounds"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("regime, sets", [("chat", {}), ("rag", {"zipf_s": "0.8", "documents": "300"}),
                                          ("batch", {"hot_share": "0.3"})])
def test_no_reference_beats_belady(bounds, regime, sets):
    trace, probability = bounds.synthetic(regime, 3, 600, sets)
    capacity = max(1, trace.num_unique_chunks // 20)
    rows = bounds.references(trace, capacity, 0, probability, set())
    assert {"lru", "default", "belady", "bit", "lhd", "lhd-known"} <= rows.keys()
    assert (probability != {}) == (regime != "chat") and ("a0" in rows) == (regime != "chat")
    for name, value in rows.items():
        assert 0 <= value <= rows["belady"] + 1e-9, name
    if regime == "rag":
        assert rows["a0"] > rows["lru"] + 1  # popularity known keeps the popular documents
    assert rows["bit"] >= rows["lru"] - 1e-9  # dropping never-reused chunks first never hurts here
