"""``kvtier check`` and ``kvtier audit`` on the tenant quota settings (issue 22 item 6): each bad
value is one sentence naming it and the fix, exit non-zero, no traceback; a good one passes and
lists salts only as digests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtier.core.quota import salt_digest, tenant_label


def kvtier(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", *args], input=stdin, capture_output=True,
                          text=True, check=False, timeout=120,
                          env={"COLUMNS": "200", "PATH": "/usr/bin",
                               **({"PYTHONPATH": os.environ["PYTHONPATH"]} if "PYTHONPATH" in os.environ else {})})


def _transfer_config(quotas: object) -> str:
    return json.dumps({"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                       "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_gib": 1, "tenant_quotas": quotas}})


BAD = [
    ({"default_share": 1.5}, ["tenant_quotas.default_share", "out of range", "at most 1"]),
    ({"default_share": 0}, ["tenant_quotas.default_share", "out of range"]),
    ({"salts": {"tenant-a": 0.7, "tenant-b": 0.5}}, ["tenant_quotas", "sum to 1.2, over 1"]),
    ({"salts": {"tenant-a": -0.1}}, ["tenant_quotas.salts", "out of range"]),
    ({"default_shares": 0.2}, ["unknown key 'default_shares'", "did you mean 'default_share'"]),
]


@pytest.mark.parametrize(("quotas", "words"), BAD)
def test_check_names_each_bad_quota_value_in_one_sentence(quotas: object, words: list[str]) -> None:
    proc = kvtier("check", _transfer_config(quotas))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "Traceback" not in out
    assert all(w in out for w in words), out


def test_audit_flags_a_bad_quota_in_a_serve_line() -> None:
    line = f"vllm serve Qwen/Qwen3-8B --kv-transfer-config '{_transfer_config({'salts': {'a': 0.9, 'b': 0.9}})}'\n"
    proc = kvtier("audit", "-", "--vllm-version", "0.32.0", "--format", "json", stdin=line)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert any("sum to 1.8, over 1" in f["message"] for f in json.loads(proc.stdout)["findings"])


def test_check_passes_good_quotas_and_never_prints_a_salt() -> None:
    proc = kvtier("check", _transfer_config({"default_share": 0.2, "salts": {"acme-secret": 0.5}}))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "acme-secret" not in out
    assert tenant_label(salt_digest("acme-secret")) == salt_digest("acme-secret").hex()[:12]


@pytest.mark.parametrize(("quotas", "words"), [
    ({"default_share": 0.1, "salts": {"tenant-a": 0.95}},
     ["sum to 1.05, over 1", "salts 0.95", "no_salt_share 0.1 inherited from default_share"]),
    ({"salts": {" ": 0.1}}, ["tenant_quotas.salts", "blank"]),
    ({"top_tenants": 1e30}, ["tenant_quotas.top_tenants", "from 1 to 64"]),
    ({"top_tenants": 65}, ["tenant_quotas.top_tenants", "from 1 to 64"]),
    ([], ["'tenant_quotas'", "must be a mapping"]),
])
def test_check_counts_the_inherited_no_salt_share_and_refuses_odd_values(quotas: object, words: list[str]) -> None:
    """Fixes items 2 and 7: an unset no_salt_share inherits default_share, so it counts in the sum;
    blank salts, top_tenants past 64 and a non-mapping are one sentence in kvtier's words."""
    proc = kvtier("check", "--offline", _transfer_config(quotas))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "Traceback" not in out and "QuotaSettings" not in out and "Input should" not in out, out
    assert all(w in out for w in words), out


@pytest.mark.parametrize("quotas", [{}, {"salts": {}}])
def test_check_warns_that_empty_quotas_turn_nothing_on(quotas: object) -> None:
    proc = kvtier("check", "--offline", _transfer_config(quotas))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "warning: kv_connector_extra_config.tenant_quotas: tenant_quotas gives no tenant a share" in out, out
    assert "vLLM would start" in out, out


def test_a_bad_quota_from_the_environment_names_the_variable() -> None:
    """Fixes item 6: a bad nested value of KVTIER_TENANT_QUOTAS names the variable, not only non-JSON."""
    from kvtier.core.config import KVTierConfig
    from kvtier.core.errors import ConfigError

    os.environ["KVTIER_TENANT_QUOTAS"] = '{"default_share": 7}'
    try:
        with pytest.raises(ConfigError, match=r"from environment variable KVTIER_TENANT_QUOTAS\).*out of range"):
            KVTierConfig.from_dict({})
    finally:
        del os.environ["KVTIER_TENANT_QUOTAS"]
