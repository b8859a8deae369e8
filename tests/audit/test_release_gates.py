"""The audit on vLLM 0.33 and 0.34 (issue 34 item 1): findings, not "unsupported", and the gates and
pitfalls read from those releases' source (src/kvtier/audit/rules/releases.py)."""

from __future__ import annotations

import json

import pytest

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.versions import parse_version


def kvtier(extra: dict[str, object] | None = None, flags: str = "", env: str = "") -> str:
    cfg = {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_module_path": "kvtier.integrations.vllm",
           "kv_connector_extra_config": extra or {"cpu_gib": 4}}
    return f"{env}vllm serve Qwen/Qwen3-8B --shutdown-timeout 30 {flags} --kv-transfer-config '{json.dumps(cfg)}'"


def findings(text: str, version: str | None) -> dict[str, str]:
    configs = load_configs(text, "serve.sh", parse_version(version) if version else None)
    return {f.rule: f.message for f in audit(configs)}


@pytest.mark.parametrize("version", ["0.33.0", "0.34.0", "0.34.0+cu129"])
def test_kvtier_on_033_and_034_is_supported_and_audited(version):
    found = findings(kvtier(flags="--enable-sleep-mode"), version)
    assert "kvtier-unsupported-vllm" not in found
    assert "kvtier-sleep-mode" in found  # the gates ran: findings, not a refusal


@pytest.mark.parametrize(("flag", "before", "from_"), [
    ("--max-num-inflight-kv-loads 8", "0.33.0", "0.34.0"),
    ("--enable-extensible-kv-cache", "0.33.2", "0.34.0"),
    ("--no-enable-extensible-kv-cache", "0.32.0", "0.34.0"),
    ("--cache-aware-admission-window 16", "0.33.0", "0.34.0"),
    ("--sleep-mode-backend cumem", "0.32.0", "0.33.0"),
    ("--watchdog-config '{}'", "0.32.0", "0.33.0"),
])
def test_a_flag_newer_than_the_release_is_an_error(flag, before, from_):
    line = f"vllm serve m {flag}"
    old = findings(line, before)
    assert "flag-newer-than-vllm" in old
    assert f"{flag.split()[0]} (added in {from_})" in old["flag-newer-than-vllm"]
    assert "flag-newer-than-vllm" not in findings(line, from_)
    assert "flag-newer-than-vllm" not in findings(line, None)  # version unknown: no gate


def test_v2_model_runner_variable_on_034():
    off = findings("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve m", "0.34.0")["v2-model-runner-env-removed"]
    assert "only Model Runner V2" in off
    on = findings("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve m", "0.34.0")["v2-model-runner-env-removed"]
    assert "ignored" in on
    assert "v2-model-runner-env-removed" not in findings("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve m", "0.33.0")


def test_sleep_mode_with_kvtier():
    refused = findings(kvtier(flags="--enable-sleep-mode"), "0.33.0")["kvtier-sleep-mode"]
    assert "KVTierConnector does not support sleep mode" in refused
    old = findings(kvtier(flags="--enable-sleep-mode"), "0.32.0")["kvtier-sleep-mode"]
    assert "kvtier does not support sleep mode" in old
    assert "kvtier-sleep-mode" not in findings("vllm serve m --enable-sleep-mode", "0.34.0")


@pytest.mark.parametrize(("flags", "warned"), [
    ("", True), ("--gpu-memory-utilization 0.9", False), ("--no-enable-extensible-kv-cache", False),
    ("--kv-cache-memory-bytes 40000000000", False),
])
def test_extensible_kv_cache_headroom(flags, warned):
    assert ("kvtier-extensible-kv-cache-headroom" in findings(kvtier(flags=flags), "0.34.0")) is warned
    assert "kvtier-extensible-kv-cache-headroom" not in findings(kvtier(flags=flags), "0.33.0")


@pytest.mark.parametrize(("extra", "flags", "env", "warned"), [
    ({"chunk_tokens": 96}, "", "", True),
    ({"chunk_tokens": 192}, "", "", False),
    ({"chunk_tokens": "auto"}, "", "", False),
    ({"chunk_tokens": 96}, "--block-size 16", "", False),
    ({"cpu_gib": 4}, "", "KVTIER_CHUNK_TOKENS=48 ", True),
])
def test_chunk_tokens_against_the_64_token_default_block(extra, flags, env, warned):
    found = findings(kvtier(extra, flags, env), "0.34.0")
    assert ("kvtier-chunk-tokens-block-size-64" in found) is warned, found
    assert "kvtier-chunk-tokens-block-size-64" not in findings(kvtier(extra, flags, env), "0.33.0")


def test_inflight_kv_loads_with_kvtier_is_explained():
    found = findings(kvtier(flags="--max-num-inflight-kv-loads 4"), "0.34.0")
    assert "does not start them while the running batch is full" in found["kvtier-inflight-kv-loads-cap-only"]


def test_a_kvtier_image_tagged_with_kvtiers_own_version_is_not_read_as_vllm():
    """``kvtier-vllm:0.1.0`` (the installed kvtier's version as the tag) was read as vLLM 0.1.0: three errors
    (unsupported vLLM, below the security floor, ...) on a release kvtier runs on (fresh-user tester).  Such a
    tag says nothing of vLLM: the gates are skipped and the info line says how to tag the image; the
    documented v<vLLM>-kvtier<kvtier> tag is read as before."""
    from kvtier import __version__

    def manifest(image: str) -> str:
        return ("apiVersion: v1\nkind: Pod\nmetadata: {name: vllm}\nspec:\n  containers:\n  - name: vllm\n"
                f"    image: {image}\n    command: [sh, -c, {json.dumps(kvtier())}]\n")

    def run(image: str) -> dict[str, str]:
        return {f.rule: f.message for f in audit(load_configs(manifest(image), "vllm.yaml"))}

    own = run(f"registry.example.com/kvtier-vllm:{__version__}")
    assert "kvtier-unsupported-vllm" not in own and "below-security-floor" not in own, own
    assert own["version-unknown"] == (
        f"The vLLM version is unknown: the tag of the kvtier image registry.example.com/kvtier-vllm:{__version__} does "
        "not say it (tag it v<vLLM version>-kvtier<kvtier version>, docs/deploy.md, or pass --vllm-version), so "
        "version gates were skipped.")
    documented = run(f"registry.example.com/kvtier-vllm:v0.31.0-kvtier{__version__}")
    assert "kvtier-unsupported-vllm" in documented and "version-unknown" not in documented
