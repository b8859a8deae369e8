"""``kvtier demo``'s restart on a real ``vllm serve`` (tiny model with seeded weights, one prompt):
a server stopped with SIGTERM and a fresh one on the same disk tier serves the prompt from disk,
with the same generated text."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.shares_cpu]


def test_restart_after_sigterm_is_served_from_disk(tmp_path: Path, tiny_model: Path) -> None:
    from kvtier.bench.demo import restart_verdict, run_restart_demo

    result = run_restart_demo(tmp_path, num_prompts=1, prompt_tokens=600, model=tiny_model)
    assert result.first.external_hit_tokens == 0
    hit = result.second.external_hit_tokens
    assert 512 <= hit < 600 and hit % 128 == 0  # whole chunks of the 600-token prompt, from disk
    assert result.second.texts == result.first.texts
    assert "--shutdown-timeout" in result.command
    verdict = restart_verdict(result)
    assert f"{hit:.0f} of 600 prompt tokens loaded from kvtier" in verdict
    assert ("faster:" in verdict) == (max(result.second.ttfts_s) < min(result.first.ttfts_s))
