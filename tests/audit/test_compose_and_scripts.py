"""``kvtier audit`` of inputs a new user gave it (through the real CLI): Compose files, scripts that
start several servers, Kubernetes ``$(VAR)`` references in a container's args."""

from __future__ import annotations

import json
from pathlib import Path

from tests.audit.test_cli_audit import kvtier

KVTIER = ('{"kv_connector":"KVTierConnector","kv_connector_module_path":"kvtier.integrations.vllm",'
          '"kv_role":"kv_both","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"cpu_gib":-1}}')


def _rules(proc) -> set[str]:
    return {f["rule"] for f in json.loads(proc.stdout)["findings"]}


def test_compose_list_command_is_the_vllm_openai_entrypoints_arguments(tmp_path: Path):
    compose = tmp_path / "compose.yaml"
    compose.write_text('services:\n  vllm:\n    image: vllm/vllm-openai:v0.32.0\n'
                       '    command: ["--model","meta-llama/Llama-3.1-8B","--cpu-offload-gb","40"]\n'
                       '  cache:\n    image: redis:7\n')
    proc = kvtier(str(compose))
    assert proc.returncode == 0, proc.stderr
    assert "cpu-offload-gb-is-weights" in proc.stdout and "services/vllm" in proc.stdout
    assert "No findings" not in proc.stdout


def test_compose_entrypoint_string_command_and_environment_forms(tmp_path: Path):
    compose = tmp_path / "compose.yaml"
    compose.write_text(
        "services:\n"
        "  a:\n    image: example/custom:1\n    entrypoint: [\"vllm\", \"serve\"]\n"
        f"    command: m --kv-transfer-config '{KVTIER}'\n"
        "  b:\n    image: vllm/vllm-openai:v0.32.0\n    entrypoint: [\"sh\", \"-c\"]\n"
        "    command: [\"vllm serve m --kv-offloading-size 10 --kv-offloading-backend lmcache\"]\n"
        "    environment:\n      - LMCACHE_CHUNK_SIZE=-5\n      - HOST_ONLY\n"
        "  c:\n    image: vllm/vllm-openai:v0.32.0\n    command: m --kv-offloading-size 10 --kv-offloading-backend lmcache\n"
        "    environment:\n      LMCACHE_MAX_LOCAL_CPU_SIZE: abc\n")
    proc = kvtier(str(compose), "--vllm-version", "0.32.0")
    assert proc.returncode == 1
    for service, rule in (("a", "kvtier-config-invalid"), ("b", "lmcache-env-invalid"),
                          ("c", "lmcache-env-invalid")):
        assert any(f"services/{service}:" in line and rule in line for line in proc.stdout.splitlines()), proc.stdout


def test_yaml_that_is_neither_manifest_nor_compose_is_refused(tmp_path: Path):
    values = tmp_path / "values.yaml"
    values.write_text("image:\n  repository: vllm/vllm-openai\n  tag: v0.32.0\nargs: [\"--cpu-offload-gb\", \"40\"]\n")
    proc = kvtier(str(values))
    assert proc.returncode == 2 and "neither a Kubernetes manifest" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    none = tmp_path / "compose.yaml"
    none.write_text("services:\n  cache:\n    image: redis:7\n")
    proc = kvtier(str(none))
    assert proc.returncode == 2 and "no service running vLLM" in proc.stderr


def test_every_serve_line_of_a_script_is_audited_and_named_by_its_line(tmp_path: Path):
    script = tmp_path / "two.sh"
    script.write_text("export MODEL_DIR=/models\n"
                      "vllm serve a --port 8000 &\n"
                      f"vllm serve b --port 8001 --kv-transfer-config '{KVTIER}' &\n"
                      "CUDA_VISIBLE_DEVICES=2 vllm serve c \\\n  --cpu-offload-gb 4 > c.log 2>&1; vllm serve d --port 8003\n"
                      "wait\n")
    proc = kvtier(str(script), "--vllm-version", "0.32.0")
    assert proc.returncode == 1, proc.stdout
    lines = proc.stdout.splitlines()
    assert any("kvtier-config-invalid" in ln and "two.sh line 3:" in ln for ln in lines), proc.stdout
    assert any("cpu-offload-gb-is-weights" in ln and "two.sh line 4" in ln for ln in lines), proc.stdout
    assert not any("two.sh line 2" in ln for ln in lines)  # server a is fine
    assert _rules(kvtier(str(script), "--vllm-version", "0.32.0", "--format", "json")) >= {
        "kvtier-config-invalid", "cpu-offload-gb-is-weights"}


def test_kubernetes_var_references_are_expanded_from_the_container_env(tmp_path: Path):
    pod = tmp_path / "pod.yaml"
    pod.write_text("apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - name: vllm\n"
                   "    image: vllm/vllm-openai:v0.32.0\n"
                   '    args: ["--model", "m", "--kv-transfer-config", "$(KVCFG)", "--served-model-name", "$(NAME)"]\n'
                   f"    env:\n    - name: KVCFG\n      value: '{KVTIER.replace('-1', '-4')}'\n")
    proc = kvtier(str(pod), "--format", "json")
    findings = json.loads(proc.stdout)["findings"]
    rules = {f["rule"] for f in findings}
    assert "kv-transfer-config-invalid" not in rules
    assert any(f["rule"] == "kvtier-config-invalid" and "-4" in f["message"] for f in findings)
    unresolved = next(f for f in findings if f["rule"] == "shell-variable-unresolved")
    assert "$(NAME)" in unresolved["message"]


def test_values_vllm_and_lmcache_refuse_are_errors_whatever_their_form(tmp_path: Path):
    for flag, value in (("--gpu-memory-utilization", v) for v in ("1.5", "-1", "0", "abc", "nan")):
        proc = kvtier("-", "--vllm-version", "0.32.0", "--format", "json", stdin=f"vllm serve m {flag} {value}\n")
        assert proc.returncode == 1 and "gpu-memory-utilization-invalid" in _rules(proc), value
    for value in ("-5", "1.5", "abc"):
        proc = kvtier("-", "--format", "json", stdin=f"vllm serve m --shutdown-timeout={value}\n")
        assert proc.returncode == 1 and "shutdown-timeout-invalid" in _rules(proc), value
    for env in ("LMCACHE_MAX_LOCAL_CPU_SIZE=abc", "LMCACHE_CHUNK_SIZE=-5", "LMCACHE_CHUNK_SIZE=2.5",
                "LMCACHE_MAX_LOCAL_DISK_SIZE=inf"):
        proc = kvtier("-", "--format", "json",
                      stdin=f"export {env}\nvllm serve m --kv-transfer-config "
                            "'{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_role\":\"kv_both\"}'\n")
        assert proc.returncode == 1 and "lmcache-env-invalid" in _rules(proc), env
    ok = kvtier("-", "--format", "json", stdin="vllm serve m --gpu-memory-utilization 0.95 --shutdown-timeout 30\n")
    assert not {"gpu-memory-utilization-invalid", "shutdown-timeout-invalid"} & _rules(ok)


def test_a_variable_holding_a_commands_output_is_unresolved_not_a_parse_error():
    for assign in ("CONFIG=$(cat /etc/kvtier.json)", 'CONFIG="$(cat /etc/kvtier.json)"', "CONFIG=`cat f`"):
        proc = kvtier("-", "--vllm-version", "0.32.0", "--format", "json",
                      stdin=f'{assign}\nvllm serve m --kv-transfer-config "$CONFIG"\n')
        rules = _rules(proc)
        assert "shell-variable-unresolved" in rules and "kv-transfer-config-invalid" not in rules, (assign, rules)


def test_compose_interpolation_is_named_unresolved_not_a_parse_error():
    proc = kvtier("-", "--format", "json", stdin='services:\n  vllm:\n    image: vllm/vllm-openai:v0.32.0\n'
                                                 '    command: ["m", "--kv-transfer-config", "${KVCFG}"]\n')
    rules = _rules(proc)
    assert "shell-variable-unresolved" in rules and "kv-transfer-config-invalid" not in rules


def test_every_server_of_a_containers_sh_c_script_is_audited_at_its_own_line(tmp_path: Path):
    """A container whose ``sh -c`` script starts two servers: only the first was audited."""
    manifest = tmp_path / "two.yaml"
    manifest.write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: two}\nspec:\n  template:\n    spec:\n"
        "      containers:\n      - name: vllm\n        image: vllm/vllm-openai:v0.32.0\n"
        "        command: [\"sh\", \"-c\"]\n        args:\n        - |\n"
        "          vllm serve a --port 8000 --gpu-memory-utilization 0.9 &\n"
        "          vllm serve b --port 8001 --gpu-memory-utilization 1.7\n")
    proc = kvtier(str(manifest))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    errors = [line.split() for line in proc.stdout.splitlines() if line.startswith("error ")]
    assert errors == [["error", "gpu-memory-utilization-invalid",
                       f"{manifest}:Deployment/two/vllm", "(server", "2", "of", "2):14"]], proc.stdout
