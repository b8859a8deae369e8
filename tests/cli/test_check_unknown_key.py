"""An unknown kvtier config key is one sentence: with a close known key, that key and where every key
is described (the ~80 known keys on one line buried the hint, a new user's probe found); with none
close, the known keys themselves.  Through the real CLI (``kvtier check --offline``) and the audit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvtier.core.config import KVTierConfig

DOCS = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def _check(extra: dict[str, object]) -> subprocess.CompletedProcess[str]:
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", "--offline", json.dumps(transfer)],
                          check=False, capture_output=True, text=True, timeout=120)


def test_a_near_miss_names_the_key_and_the_docs_not_every_key() -> None:
    out = _check({"cpu_gb": 4})
    errors = [line for line in out.stdout.splitlines() + out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1, out.stdout + out.stderr
    assert errors[0] == ("error: kv_connector_extra_config.cpu_gb: unknown kvtier config key 'cpu_gb' (did you mean "
                         "'cpu_gib'?); every key is in docs/vllm.md, 'Configuration keys'"), errors[0]
    assert "## Configuration keys" in DOCS.read_text()  # where the sentence sends the reader exists


def test_a_key_like_none_lists_the_known_keys() -> None:
    out = _check({"zzqq": 4})
    errors = [line for line in out.stdout.splitlines() + out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1 and len(errors) == 1, out.stdout + out.stderr
    assert errors[0] == ("error: kv_connector_extra_config.zzqq: unknown kvtier config key 'zzqq'; known keys are "
                         + ", ".join(KVTierConfig.known_keys())), errors[0]
