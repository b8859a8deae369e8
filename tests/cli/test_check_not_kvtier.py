"""``kvtier check`` on a config that names no KVTierConnector: a usage error (docs/vllm.md: exit 2, one
line, nothing on stdout).  It exited 1, the code of a KVTierConnector config with errors, and with
``--json`` printed a verdict object for a config it never checked; a ``kv_connector`` given twice whose
last value is another connector passed as "ok: vLLM would start with this KVTierConnector config"."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app

_SUFFIX = ("so kvtier check has nothing to check; give a config with \"kv_connector\":\"KVTierConnector\" (directly "
           "or among a MultiConnector's connectors), or check another connector's serve line with kvtier audit.")


@pytest.mark.parametrize(("config", "what"), [
    ('{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}',
     'names kv_connector "LMCacheConnectorV1", not KVTierConnector'),
    ('{"kv_role":"kv_both"}', "names no kv_connector"),
    ('{"kv_connector":"KVTierConnector","kv_connector":"OffloadingConnector","kv_role":"kv_both"}',
     'names kv_connector "OffloadingConnector" (it is given twice and vLLM keeps the last), not KVTierConnector'),
    (('{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":{"connectors":'
     '[{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}]}}'),
     'names kv_connector "MultiConnector" with no KVTierConnector among its connectors'),
])
@pytest.mark.parametrize("flags", [[], ["--json"], ["--offline"]], ids=["text", "json", "offline"])
def test_a_config_for_another_connector_is_a_usage_error(config: str, what: str, flags: list[str]) -> None:
    result = CliRunner().invoke(app, ["check", *flags, config], prog_name="kvtier")
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr == f"error: the config {what}, {_SUFFIX}\n", result.stderr
