"""``kvtier check`` applies the limits start-up applies to ``cpu_gib`` and ``chunk_tokens`` (fresh-operator
tester: cpu_gib 1e-7 and chunk_tokens 1e12 were reported ok)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.config import MAX_CHUNK_TOKENS, KVTierConfig
from kvtier.core.errors import ConfigError


def _check(extra: dict[str, object]) -> tuple[int, str]:
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    result = CliRunner().invoke(app, ["check", "--offline", json.dumps(transfer)])
    return result.exit_code, result.output


def test_a_cpu_tier_smaller_than_any_chunk_is_an_error() -> None:
    code, out = _check({"cpu_gib": 1e-7})
    assert code == 1, out
    assert "error: kv_connector_extra_config.cpu_gib: cpu_gib=1e-07 (107 bytes) cannot hold one 128-token chunk" in out


def test_a_cpu_tier_smaller_than_a_small_models_chunk_is_a_warning() -> None:
    code, out = _check({"cpu_gib": 1e-5, "chunk_tokens": 128})
    assert code == 0, out
    assert "warning: kv_connector_extra_config.cpu_gib: cpu_gib=1e-05" in out and "128-token chunk (1572864 bytes)" in out


def test_a_cpu_tier_of_a_few_chunks_passes() -> None:
    code, out = _check({"cpu_gib": 0.002})
    assert code == 0 and "warning" not in out, out


@pytest.mark.parametrize(("extra", "key"), [
    ({"disk_path": "DIR", "disk_gib": 1e-7}, "disk_gib"),
    ({"node_socket": "DIR/node.sock", "node_gib": 1e-7}, "node_gib"),
])
def test_a_disk_tier_or_node_pool_smaller_than_any_chunk_is_an_error_as_the_cpu_tier(tmp_path, extra, key) -> None:
    # the cpu tier's one-chunk floor holds for the other sizes (fresh-user tester: disk_gib 1e-7 passed)
    code, out = _check({"cpu_gib": 1, **{k: v.replace("DIR", str(tmp_path)) if isinstance(v, str) else v
                                        for k, v in extra.items()}})
    assert code == 1, out
    assert f"error: kv_connector_extra_config.{key}: {key}=1e-07 (107 bytes) cannot hold one 128-token chunk" in out
    ok_code, ok_out = _check({"cpu_gib": 1, key: 1, **{k: v.replace("DIR", str(tmp_path)) for k, v in extra.items()
                                                       if isinstance(v, str)}})
    assert ok_code == 0 and "cannot hold" not in ok_out, ok_out


def test_a_disk_path_without_disk_gib_is_an_error_naming_both_keys(tmp_path) -> None:
    # fresh-user tester: the engine ran with no disk tier, writing nothing and saying nothing
    code, out = _check({"cpu_gib": 1, "disk_path": str(tmp_path / "d")})
    assert code == 1, out
    assert ("error: kv_connector_extra_config.disk_gib: disk_path is set but disk_gib is not (or is 0), so the engine "
            "would run with no disk tier; set disk_gib to the disk tier's size in GiB") in out
    code, out = _check({"cpu_gib": 1, "disk_path": str(tmp_path / "d"), "disk_gib": 0})
    assert code == 1 and "disk_path is set but disk_gib is not (or is 0)" in out, out
    # the tier left out on purpose is only the existing warning
    code, out = _check({"cpu_gib": 1, "disk_path": str(tmp_path / "d"), "tiers": ["cpu"]})
    assert code == 0 and "disk_gib is not" not in out, out


@pytest.mark.parametrize("tokens", [1e12, MAX_CHUNK_TOKENS + 16])
def test_a_chunk_longer_than_any_context_is_refused(tokens: float) -> None:
    code, out = _check({"chunk_tokens": tokens})
    assert code == 1, out
    assert f"must be at most {MAX_CHUNK_TOKENS} tokens" in out
    with pytest.raises(ConfigError, match="longer than any model's context"):  # the connector's own validator
        KVTierConfig.from_dict({"chunk_tokens": tokens})
    assert KVTierConfig.from_dict({"chunk_tokens": MAX_CHUNK_TOKENS}).chunk_tokens == MAX_CHUNK_TOKENS


def test_a_chunk_tokens_the_default_block_sizes_do_not_divide_qualifies_the_verdict() -> None:
    """chunk_tokens 100 without --block-size: the warning said the connector refuses it unless the server's
    --block-size divides it, and the last line said "ok: vLLM would start" all the same (new user 5)."""
    code, out = _check({"cpu_gib": 2, "chunk_tokens": 100})
    assert code == 0, out  # check cannot know the server's block size: a warning, not an error
    assert "ok: vLLM would start" not in out
    assert out.splitlines()[-1] == ("conditional: vLLM would start with this KVTierConnector config only if the "
                                    "server's --block-size divides chunk_tokens=100 (1 warning(s)); pass --block-size "
                                    "to check against the server's.")
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"cpu_gib": 2, "chunk_tokens": 100}}
    known = CliRunner().invoke(app, ["check", "--offline", "--block-size", "16", json.dumps(transfer)])
    assert known.exit_code == 1 and "would start" not in known.output  # the server's own block size: an error
    fits = CliRunner().invoke(app, ["check", "--offline", "--block-size", "4", json.dumps(transfer)])
    assert fits.exit_code == 0 and fits.output.splitlines()[-1] == "ok: vLLM would start with this KVTierConnector config."
    as_json = json.loads(CliRunner().invoke(app, ["check", "--offline", "--json", json.dumps(transfer)]).output)
    assert [p.get("only_if") for p in as_json["problems"]] == ["the server's --block-size divides chunk_tokens=100"]
    # JSON carries the text's verdict: it marked the conditional result only inside the problem (note 21)
    assert as_json["ok"] is True and as_json["verdict"] == "conditional", as_json
    for args, verdict in ((["--block-size", "4"], "ok"), (["--block-size", "16"], "error")):
        said = CliRunner().invoke(app, ["check", "--offline", "--json", *args, json.dumps(transfer)])
        assert json.loads(said.output)["verdict"] == verdict, said.output


def test_the_size_a_floor_problem_suggests_holds_hundreds_of_the_chunks_it_names() -> None:
    """cpu_gib 4 with 1,048,576-token chunks (12 GiB of the small model's): the warning said "set cpu_gib
    to room for hundreds of chunks, e.g. 4", the value it warned about (tools tester: kvtier size
    --chunk-tokens 1048576 printed the same advice in its audit note)."""
    code, out = _check({"cpu_gib": 4, "chunk_tokens": 1048576})
    assert code == 0, out
    line = next(line for line in out.splitlines() if line.startswith("warning: kv_connector_extra_config.cpu_gib"))
    assert "chunk (12884901888 bytes)" in line
    assert line.endswith("e.g. 1200, or a shorter chunk_tokens (auto, the default)"), line
    suggested = 1200
    assert KVTierConfig.from_dict({"cpu_gib": suggested, "chunk_tokens": 1048576}).cpu_gib == suggested
    code, out = _check({"cpu_gib": suggested, "chunk_tokens": 1048576})
    assert "cannot hold" not in out, out  # (this host's memory may refuse 1,200 GiB: another check)
    # the default chunk keeps the short example, which holds thousands of them
    code, out = _check({"cpu_gib": 1e-5})
    assert "e.g. 4" in out and "shorter chunk_tokens" not in out, out
