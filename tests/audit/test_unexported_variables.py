"""Only exported variables reach the server's environment: a plain ``NAME=value`` line of a script
is the shell's own (a user's script set VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=35 without export and the
audit counted it as the server's)."""

from __future__ import annotations

import json

import pytest

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.versions import parse_version

NAME = "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"
SERVE = ("vllm serve m --shutdown-timeout 30 --kv-transfer-config '" + json.dumps({
    "kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
    "kv_connector_module_path": "kvtier.integrations.vllm",
    "kv_connector_extra_config": {"cpu_gib": 4, "disk_path": "/nvme/kv", "disk_gib": 100}}) + "'")


def rules(script: str) -> dict[str, str]:
    return {f.rule: f.message for f in audit(load_configs(script, "serve.sh", parse_version("0.32.0")))}


@pytest.mark.parametrize("script", [
    f"{NAME}=35\n{SERVE}",
    f"set -a\nset +a\n{NAME}=35\n{SERVE}",
    f"{NAME}=35 true\n{SERVE}",  # the prefix of another command is that command's
])
def test_an_unexported_variable_is_not_the_servers(script):
    found = rules(script)
    assert "kvtier-worker-shutdown-timeout-short" in found
    assert f"{NAME} is unset" in found["kvtier-worker-shutdown-timeout-short"]
    if script.startswith(f"{NAME}=35\n") or "set +a" in script:
        assert found["shell-variable-not-exported"].startswith(f"{NAME}=35 is assigned without export")


@pytest.mark.parametrize("script", [
    f"export {NAME}=35\n{SERVE}",
    f"{NAME}=35\nexport {NAME}\n{SERVE}",
    f"set -a\n{NAME}=35\n{SERVE}",
    f"set -o allexport\n{NAME}=35\n{SERVE}",
    f"declare -x {NAME}=35\n{SERVE}",
    f"{NAME}=35 {SERVE}",
    f"env {NAME}=35 {SERVE}",
])
def test_an_exported_variable_is_the_servers(script):
    found = rules(script)
    assert "kvtier-worker-shutdown-timeout-short" not in found and "shell-variable-not-exported" not in found


def test_an_unexported_variable_still_expands_in_the_script():
    config = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})
    (serve,) = load_configs(f"CONFIG='{config}'\nvllm serve m --kv-transfer-config \"$CONFIG\"", "s.sh",
                            parse_version("0.32.0"))
    assert serve.kv_transfer_config == json.loads(config) and "CONFIG" not in serve.env
    assert "shell-variable-not-exported" not in rules(f"CONFIG='{config}'\nvllm serve m --kv-transfer-config \"$CONFIG\"")
