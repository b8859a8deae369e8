"""A disk_path that is one namespace directory of a disk tier (user41's review): the path an operator
sees in ``ls`` of a disk tier, copied into disk_path.  ``kvtier check`` said ok and the engine started,
made its own namespace directory inside it and never saw the chunks there (a hit rate of 0 after the
restart, and files the tier neither counts nor evicts); ``kvtier purge`` already refused that path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.config import GiB
from kvtier.core.errors import ConfigError
from tests.core.helpers import chain_of, make_store
from tests.core.test_store import put_chain


def _check(extra: dict[str, object]):
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return CliRunner().invoke(app, ["check", "--offline", json.dumps(transfer)], env={"COLUMNS": "400"})


def test_a_namespace_directory_as_disk_path_is_refused_by_check_and_at_start_up(tmp_path: Path):
    store = make_store(tmp_path, cpu_chunks=4, disk_chunks=32, write_mode="write-through")
    chain = chain_of(1, 4)
    put_chain(store, chain)
    store.flush()
    store.close()
    disk_path = tmp_path / "disk"
    (namespace,) = [p for p in disk_path.iterdir() if p.is_dir()]
    result = _check({"cpu_gib": 1, "disk_path": str(namespace), "disk_gib": 1})
    assert result.exit_code == 1, result.output
    line = " ".join(result.output.split())
    assert f"disk_path {str(namespace)!r} is one namespace directory of a disk tier" in line, line
    assert f"point disk_path at {str(disk_path)!r}" in line and "ok: vLLM would start" not in line
    with pytest.raises(ConfigError, match="one namespace directory of a disk tier"):  # the worker's start-up
        make_store(None, cpu_chunks=4, disk_path=str(namespace), disk_gib=32 * 1100 / GiB)
    assert sorted(p.name for p in namespace.iterdir() if len(p.name) == 32) == []  # nothing nested in it
    again = make_store(None, cpu_chunks=4, disk_path=str(disk_path), disk_gib=32 * 1100 / GiB)
    assert again.lookup(chain) == 4  # the directory it names instead serves the chunks
    again.close()
    assert _check({"cpu_gib": 1, "disk_path": str(disk_path), "disk_gib": 1}).exit_code == 0
