"""A tier that refuses to start at KV cache registration (the worker builds its tiers only then) is
said as the connector's constructor says its refusals: one ``kvtier configuration error`` line in the
log, then a ``ConfigError`` without kvtier's traceback chained to it.  The refusal here is a real
one: ``disk_gib`` that fits the directory's free space only by counting another namespace's chunk
files, which this engine never evicts (docs/vllm.md, ``disk_gib``).  Before, such a refusal reached
the log only at the end of vLLM's worker traceback, with no line of kvtier's own."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from tests.integrations.vllm_helpers import one_layer_config


def test_a_tier_refused_at_registration_is_one_configuration_error_line(
        tiny_model: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.core.errors import ConfigError
    from kvtier.integrations.vllm.connector import KVTierConnector

    disk = tmp_path / "disk"
    foreign = disk / ("ab" * 16) / "00"  # another namespace's chunk files: a model run here before
    foreign.mkdir(parents=True)
    big = foreign / "0123.kvc"
    with open(big, "wb") as f:  # sparse: 1 TiB by its size, no blocks written
        f.truncate(1 << 40)
    # fits only with the foreign file's bytes counted as room
    disk_gib = (shutil.disk_usage(tmp_path).free + (1 << 39)) / (1 << 30)
    layer = "model.layers.0.self_attn.attn"
    config, kv_cache_config = one_layer_config(tiny_model, layer=layer, kvtier={
        "chunk_tokens": 16, "cpu_gib": 0.01, "disk_path": str(disk), "disk_gib": disk_gib})
    connector = KVTierConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    cache = torch.zeros(32, 2, 16, 2, 16)
    with caplog.at_level(logging.ERROR, logger="kvtier"), pytest.raises(ConfigError) as refused:
        connector.register_kv_caches({layer: cache})
    assert refused.value.__cause__ is None and refused.value.__suppress_context__
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("kvtier")]
    assert lines == [f"kvtier configuration error: {refused.value}"], lines
    assert "kvtier purge" in str(refused.value)
    assert os.path.getsize(big) == 1 << 40  # nothing of another namespace was touched
