"""``kvtier demo``'s restart demo on a real ``vllm serve``: the second engine is served from disk,
and one ``/metrics`` scrape shows vLLM's external-hit counter and kvtier's own side by side."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.engine


def test_restart_demo_hits_after_restart(tmp_path: Path) -> None:
    from kvtier.cli.demo import run_restart_demo

    result = run_restart_demo(tmp_path, prompt_words=400)
    assert result.first.external_hit_tokens == 0
    assert result.first.loaded_tokens_cpu + result.first.loaded_tokens_disk == 0
    hit = result.second.external_hit_tokens
    assert hit >= 256 and hit % 256 == 0
    assert result.second.loaded_tokens_disk == hit  # vllm:external_prefix_cache_hits == kvtier_loaded_tokens
    assert result.second.text == result.first.text
    assert result.first.ttft_s > 0 and result.second.ttft_s > 0
