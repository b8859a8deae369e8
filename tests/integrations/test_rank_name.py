"""The workers' log lines name their engine (note21: with ``--data-parallel-size 2`` both engines'
shutdown flush lines read "kvtier: rank 0 ...").  :func:`rank_name` over vLLM's own
``ParallelConfig``, as each engine process holds it: one engine is ``rank R``; a data-parallel engine
adds its data-parallel rank, for MoE engines (DP kept) and for dense ones (vLLM reconfigures each to
DP 1 and keeps the place in ``data_parallel_index``); and the flush line carries the name."""

from __future__ import annotations

import pytest
from vllm.config import ParallelConfig

from kvtier.integrations.vllm.worker.registration import rank_name
from kvtier.integrations.vllm.worker.shutdownflush import FlushReport, flush_line


def _engine(dp_size: int, dp_rank: int, dense: bool) -> ParallelConfig:
    """A ParallelConfig as vLLM's engine process ``dp_rank`` leaves it (vllm/v1/engine/core.py run_engine_core)."""
    config = ParallelConfig(data_parallel_size=dp_size)
    config.data_parallel_index = dp_rank
    if dp_size > 1 and dense:
        config.reconfigure_for_independent_dp_rank()
    elif dp_size > 1:
        config.data_parallel_rank = dp_rank
    return config


@pytest.mark.parametrize(("dp_size", "dp_rank", "dense", "tp_rank", "name"), [
    (1, 0, True, 0, "rank 0"),
    (1, 0, True, 3, "rank 3"),
    (2, 1, True, 0, "rank 0 (data-parallel rank 1)"),
    (2, 0, True, 0, "rank 0"),                            # dense engine 0: vLLM leaves no trace of DP 2
    (2, 0, False, 1, "rank 1 (data-parallel rank 0)"),    # MoE: DP kept
    (4, 3, False, 0, "rank 0 (data-parallel rank 3)"),
])
def test_each_engines_workers_are_named_apart(dp_size, dp_rank, dense, tp_rank, name):
    assert rank_name(_engine(dp_size, dp_rank, dense), tp_rank) == name
    _level, line = flush_line(FlushReport(2, 0, 0, "", 0.1), name, 1 << 20, 10)
    assert line.startswith(f"kvtier: {name} shutdown flush wrote 2 dirty chunks"), line
