"""Pre-flight of a KVTierConnector ``--kv-transfer-config``: the checks themselves (real config
validator, real directories), ``kvtier check`` through the real CLI, and the vLLM plugin inside a
real ``python -m vllm.entrypoints.openai.api_server``: a bad config stops it before the model loads,
with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.integrations.vllm.preflight import check_transfer_config, uses_kvtier

GOOD: dict[str, object] = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                           "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"cpu_gib": 0.5}}


def transfer(**changes: object) -> dict[str, object]:
    """GOOD with top-level ``changes``; ``extra=`` replaces kv_connector_extra_config; None deletes a key."""
    out = dict(GOOD)
    if "extra" in changes:
        out["kv_connector_extra_config"] = changes.pop("extra")
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def errors(cfg: dict[str, object] | str, block_size: int | None = None, block_divisor: int | None = None) -> list[str]:
    return [p.message for p in check_transfer_config(cfg, block_size, block_divisor=block_divisor)
            if p.severity == "error"]


def test_a_good_config_has_no_problem(tmp_path):
    cfg = transfer(extra={"cpu_gib": 0.01, "disk_path": str(tmp_path / "disk"), "disk_gib": 0.05})
    assert check_transfer_config(cfg, block_size=16) == []


@pytest.mark.parametrize("extra, words", [
    ({"cpu_gb": 4}, "unknown kvtier config key 'cpu_gb' (did you mean 'cpu_gib'?)"),
    ({"cpu_gib": -4}, "'cpu_gib'"),
    ({"chunk_tokens": 0}, "'chunk_tokens'"),
    ({"write_mode": "write-around"}, "'write_mode'"),
    ({"reset_scope": "everything"}, "'reset_scope': must be one of cpu, local, all (got 'everything')"),
    ({"disk_gib": 10}, "disk_gib is set but disk_path is not"),
    ({"disk_path": "/proc/kvtier", "disk_gib": 1}, "proc filesystem mounted at /proc"),
    ({"disk_path": "/sys/kvtier", "disk_gib": 1}, "sysfs filesystem"),
    ({"cpu_gib": 1 << 20}, "GiB of memory this host has available"),
])
def test_bad_extra_config_names_the_key(extra, words):
    found = errors(transfer(extra=extra))
    assert len(found) == 1 and words in found[0], found


def test_every_bad_value_is_named_not_just_the_first():
    found = errors(transfer(extra={"cpu_gb": 4, "cpu_gib": -1, "disk_path": "/proc/x", "disk_gib": 1}))
    assert len(found) == 3
    assert "cpu_gb" in found[0] and "cpu_gib" in found[1] and "/proc" in found[2]


def test_disk_path_that_is_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    found = errors(transfer(extra={"disk_path": str(tmp_path / "f"), "disk_gib": 0.01}))
    assert len(found) == 1 and "is a file, not a directory" in found[0]


def test_disk_path_under_a_file_says_so(tmp_path):
    """``/etc/hostname/kv`` read "not writable"; the problem is the file it lies under."""
    (tmp_path / "f").write_text("x")
    found = errors(transfer(extra={"disk_path": str(tmp_path / "f" / "kv"), "disk_gib": 0.01}))
    assert len(found) == 1 and f"lies under {str(tmp_path / 'f')!r}, which is a file" in found[0]
    assert "not writable" not in found[0]


def test_chunk_tokens_against_the_block_size():
    cfg = transfer(extra={"chunk_tokens": 100})
    assert errors(cfg) == []  # block size unknown: a --block-size 4 server takes it, so only a warning
    (warned,) = check_transfer_config(cfg)
    assert (warned.severity, warned.key) == ("warning", "kv_connector_extra_config.chunk_tokens")
    assert "16 (CUDA) or 128 (CPU)" in warned.message
    (warned,) = check_transfer_config(transfer(extra={"chunk_tokens": 64}))  # fine on CUDA, refused on CPU
    assert "block size 128 (CPU)" in warned.message and "16" not in warned.message
    assert check_transfer_config(transfer(extra={"chunk_tokens": 256})) == []
    (found,) = errors(cfg, block_size=16)
    assert "multiple of the engine block size 16" in found
    assert check_transfer_config(transfer(extra={"chunk_tokens": 64}), block_size=16) == []
    for where in ({}, {"block_size": 16}, {"block_size": 640}, {"block_divisor": 16}):  # auto fits any block size
        assert check_transfer_config(transfer(extra={"chunk_tokens": "auto"}), **where) == []
    (found,) = errors(transfer(extra={"chunk_tokens": "automatic"}))
    assert "must be auto or a positive whole number of tokens" in found


@pytest.mark.parametrize("changes, words", [
    ({"kv_connector_module_path": None}, "kv_connector_module_path is missing"),
    ({"kv_connector_module_path": "kvtier"}, "kv_connector_module_path is 'kvtier'"),
    ({"kv_role": None}, "kv_role is missing"),
    ({"kv_role": "both"}, "kv_role 'both' is not one of"),
    ({"kv_load_failure_policy": "retry"}, "kv_load_failure_policy 'retry' is not one of"),
    ({"kv_conector_extra_config": {}}, ("unknown key 'kv_conector_extra_config' (did you mean "
                                       "'kv_connector_extra_config'?)")),
])
def test_transfer_config_keys(changes, words):
    found = errors(transfer(**changes))
    assert len(found) == 1 and words in found[0], found


def test_load_failure_policy_fail_is_a_warning():
    problems = check_transfer_config(transfer(kv_load_failure_policy=None))
    assert [(p.severity, p.key) for p in problems] == [("warning", "kv_load_failure_policy")]
    assert '"kv_load_failure_policy":"recompute"' in problems[0].message


def test_extra_config_alone_is_named_as_such():
    """Only kvtier's own keys, without the transfer config around them: one sentence saying how to
    wrap them, not one "unknown key" per setting."""
    (found,) = errors({"cpu_gib": 1, "disk_path": "/tmp/x", "disk_gib": 2})
    assert "kv_connector_extra_config (cpu_gib, disk_path, disk_gib) without the --kv-transfer-config" in found
    assert '"kv_connector":"KVTierConnector"' in found
    # a key that is neither vLLM's nor kvtier's is still the unknown-key error
    (typo,) = errors({"cpu_gb": 1})
    assert "unknown key 'cpu_gb'" in typo


def test_a_models_config_json_is_named_as_such():
    """A model's config.json given to ``kvtier check`` (a model-probe tester: 23 lines of "unknown
    key 'architectures'" ...): one sentence saying what it is and where each belongs."""
    (found,) = errors({"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "num_hidden_layers": 2})
    assert "this is a model's config.json (it has 'architectures' and 'model_type')" in found
    assert "kvtier size --model DIR" in found
    # a transfer config with a stray model_type is still checked key by key
    assert any("unknown key 'model_type'" in e for e in errors(transfer(model_type="llama")))


def test_not_json_and_other_connectors():
    (found,) = errors('{"kv_connector": "KVTierConnector",')
    assert "not valid JSON at line 1" in found
    other = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}
    assert not uses_kvtier(other) and check_transfer_config(other) == []


def test_multiconnector_child_is_checked():
    child = {k: v for k, v in transfer(extra={"cpu_gb": 1}).items() if k != "kv_load_failure_policy"}
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
             "kv_connector_extra_config": {"connectors": [{"kv_connector": "OffloadingConnector"}, child]}}
    assert uses_kvtier(multi)
    (found,) = errors(multi)
    assert "cpu_gb" in found


def kvtier_check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", *args], capture_output=True, text=True,
                          check=False, timeout=120, env={**os.environ, "COLUMNS": "200"})


def verdicts(stdout: str) -> list[str]:
    """``kvtier check``'s lines less the supported-versions statement it always prints."""
    return [ln for ln in stdout.splitlines() if not ln.startswith("info: kvtier supports vLLM")]


def test_cli_check_good_bad_and_unreadable(tmp_path):
    good = kvtier_check(json.dumps(GOOD), "--block-size", "16")
    assert good.returncode == 0 and verdicts(good.stdout)[0].startswith("ok:"), good.stderr
    bad = kvtier_check(json.dumps(transfer(extra={"cpu_gb": 4, "cpu_gib": -4})))
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert [ln.split(":")[0] for ln in verdicts(bad.stdout)] == ["error", "error"]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(transfer(kv_load_failure_policy=None)))
    warned = kvtier_check(str(path), "--json")
    data = json.loads(warned.stdout)
    assert warned.returncode == 0 and data["ok"] and data["problems"][0]["key"] == "kv_load_failure_policy"
    auto = kvtier_check(json.dumps(transfer(extra={"chunk_tokens": "auto"})), "--block-size", "640")
    assert auto.returncode == 0 and verdicts(auto.stdout)[0].startswith("ok:"), auto.stdout + auto.stderr
    odd = kvtier_check(json.dumps(transfer(extra={"chunk_tokens": 100})))  # no --block-size: warned, not a bare ok
    assert odd.returncode == 0 and verdicts(odd.stdout)[0].startswith("warning: kv_connector_extra_config.chunk_tokens:")
    missing = kvtier_check(str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1
    for unreadable in ("{", '{"kv_connector": "KVTierConnector",'):  # not JSON: unreadable input, like a bad path
        broken = kvtier_check(unreadable)
        assert broken.returncode == 2 and broken.stdout == "", broken
        assert broken.stderr.startswith("error: --kv-transfer-config is not valid JSON at line 1")
    (tmp_path / "list.json").write_text("[1, 2]")
    listed = kvtier_check(str(tmp_path / "list.json"))
    assert listed.returncode == 2 and "must be a JSON object" in listed.stderr


def test_environment_problems_are_reported_once_and_the_password_variable_is_accepted(monkeypatch):
    shared = {"redis_url": "redis://127.0.0.1:6390/0", "redis_password_env": "KVTIER_REDIS_PASSWORD"}
    env = {**os.environ, "KVTIER_REDIS_PASSWORD": "hunter2"}
    run = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "check", "--offline",  # no server on 6390
                          json.dumps(transfer(extra=shared))],
                         capture_output=True, text=True, check=False, timeout=120, env=env)
    assert run.returncode == 0 and verdicts(run.stdout)[0].startswith("ok:"), run.stdout + run.stderr
    monkeypatch.setenv("KVTIER_CPU_GIB", "lots")  # one bad variable, several explicit keys: one error, about it
    problems = check_transfer_config(transfer(extra={"chunk_tokens": 128, "write_mode": "write-back"}))
    assert [(p.severity, p.key) for p in problems] == [("error", "kv_connector_extra_config")], problems
    assert "KVTIER_CPU_GIB" in problems[0].message
    # explicit wins: no error, only the warning that the variable is never read (check and audit say so)
    problems = check_transfer_config(transfer(extra={"chunk_tokens": 128, "cpu_gib": 0.5}))
    assert [(p.severity, p.key) for p in problems] == [("warning", "kv_connector_extra_config.cpu_gib")], problems
    assert "KVTIER_CPU_GIB" in problems[0].message and "never read" in problems[0].message


def test_shared_tier_password_and_secret_are_read_as_the_tier_reads_them(tmp_path, monkeypatch):
    shared = {"cpu_gib": 0.5, "redis_url": "redis://127.0.0.1:6390/0"}
    cases = [({"shared_secret_file": str(tmp_path / "none")}, "shared_secret_file", "cannot read shared_secret_file"),
             ({"redis_password_file": str(tmp_path / "none")}, "redis_password_file", "cannot read redis_password_file"),
             ({"redis_password_env": "KVTIER_TEST_UNSET_PW"}, "redis_password_env", "variable is not set")]
    (tmp_path / "short").write_text("too short\n")
    cases.append(({"shared_secret_file": str(tmp_path / "short")}, "shared_secret_file", "fewer than 16 characters"))
    for extra, key, words in cases:
        problems = check_transfer_config(transfer(extra={**shared, **extra}))
        assert [(p.severity, p.key) for p in problems] == [("error", f"kv_connector_extra_config.{key}")], extra
        assert words in problems[0].message
    (tmp_path / "secret").write_text("0123456789abcdef0123\n")
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "hunter2")
    good = {**shared, "shared_secret_file": str(tmp_path / "secret"), "redis_password_env": "KVTIER_REDIS_PASSWORD"}
    assert check_transfer_config(transfer(extra=good)) == []
    monkeypatch.delenv("KVTIER_REDIS_PASSWORD")
    # without redis_url the tier is off and nothing is read; a config for another host is not read here
    assert check_transfer_config(transfer(extra={"shared_secret_file": str(tmp_path / "none")})) == []
    assert check_transfer_config(transfer(extra={**shared, **cases[0][0]}), host_checks=False) == []


def test_chunk_tokens_against_every_block_size_the_cpu_backend_may_choose():
    """Without the model the CPU block size is 128 or --block-size, 16 (MLA), 256 (DeepSeek-V4), or a
    multiple for hybrid models: only a chunk_tokens no such size divides is refused (breaker F14)."""
    from kvtier.integrations.vllm.engine_config import cpu_block_divisor
    from kvtier.integrations.vllm.plugin import _block_divisor

    assert cpu_block_divisor(None) == 16 and cpu_block_divisor(64) == 16 and cpu_block_divisor(8) == 8
    refused = errors(transfer(extra={"chunk_tokens": 100}), block_divisor=16)
    assert len(refused) == 1 and "chunk_tokens=100 is not a multiple of 16" in refused[0]
    assert errors(transfer(extra={"chunk_tokens": 64}), block_divisor=16) == []  # fine with MLA's 16: left to the worker
    assert errors(transfer(extra={"chunk_tokens": 640}), block_divisor=16) == []
    serve = ["api_server", "--model", "m"]
    assert _block_divisor(serve) == 16  # this venv's vLLM is the CPU backend
    assert _block_divisor([*serve, "--block-size", "8"]) == 8
    assert _block_divisor([*serve, "--block_size=24"]) == 8
    assert _block_divisor([*serve, "--config", "c.yaml"]) is None  # the file may set it
    assert _block_divisor([*serve, "--block-size", "x"]) is None  # vLLM's argparse says what is wrong


def _serve_refused(model: Path, extra: dict) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """Start a real api_server with ``extra`` as kvtier's config; it must exit 2. Returns the run
    and its stderr lines that name kvtier."""
    cfg = json.dumps(transfer(extra=extra))
    proc = subprocess.run([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
                           "--port", "0", "--kv-transfer-config", cfg],
                          capture_output=True, text=True, check=False, timeout=300,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 2, proc.stderr[-3000:]
    return proc, [ln for ln in proc.stderr.splitlines() if "kvtier" in ln]


@pytest.mark.engine
@pytest.mark.shares_cpu
def test_vllm_server_with_chunk_tokens_no_cpu_block_size_divides_stops_before_the_model_loads(tiny_model: Path):
    proc, ours = _serve_refused(tiny_model, {"chunk_tokens": 100})
    assert len(ours) == 1 and ours[0].startswith("ERROR kvtier: invalid --kv-transfer-config: chunk_tokens=100 is "
                                                 "not a multiple of 16"), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Loading weights" not in proc.stderr + proc.stdout


@pytest.mark.engine
@pytest.mark.shares_cpu
def test_vllm_server_with_a_bad_kvtier_config_stops_before_the_model_loads(tiny_model: Path):
    """The plugin is registered through pyproject's vllm.general_plugins entry point (as installed by make)."""
    proc, ours = _serve_refused(tiny_model, {"cpu_gb": 4})
    assert ours == [("ERROR kvtier: invalid --kv-transfer-config: unknown kvtier config key 'cpu_gb' (did you mean "
                     "'cpu_gib'?); every key is in docs/vllm.md, 'Configuration keys'")], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "Loading weights" not in proc.stderr + proc.stdout  # stopped before any engine or weight work


@pytest.mark.engine
def test_kv_transfer_config_built_in_python_raises_instead_of_exiting(monkeypatch: pytest.MonkeyPatch):
    """``LLM(kv_transfer_config=KVTransferConfig(...))`` gets an exception naming the key, not an exit.
    (The pre-flight installed here is taken out again after the test: later tests in this process
    build configs of their own.)"""
    from pydantic import ValidationError
    from vllm.config.kv_transfer import KVTransferConfig

    from kvtier.integrations.vllm.plugin import _MARK, register

    monkeypatch.setattr(KVTransferConfig, "__post_init__", KVTransferConfig.__post_init__)
    monkeypatch.setattr(KVTransferConfig, _MARK, getattr(KVTransferConfig, _MARK, False), raising=False)
    register()

    with pytest.raises(ValidationError, match="did you mean 'cpu_gib'"):
        KVTransferConfig(kv_connector="KVTierConnector", kv_role="kv_both",
                         kv_connector_module_path="kvtier.integrations.vllm",
                         kv_connector_extra_config={"cpu_gb": 4})
    ok = KVTransferConfig(**{k: v for k, v in GOOD.items()})  # type: ignore[arg-type]
    assert ok.kv_connector_extra_config == {"cpu_gib": 0.5}


@pytest.mark.parametrize("tiers", [["cpu", "foo"], 5, [], ["disk", "cpu"]])
def test_a_refused_tiers_list_gets_no_advice_about_the_default_list(tiers):
    """A refused ``tiers`` left the default list in place, and check warned "tiers lists 'disk' / 'redis' /
    's3' but its settings do not ask for it" about tiers the user never listed (tester3)."""
    run = kvtier_check(json.dumps(transfer(extra={"cpu_gib": 0.5, "tiers": tiers})))
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: kv_connector_extra_config.tiers: "), lines


def test_inline_json_that_is_not_an_object_and_tiers_left_out(tmp_path):
    """Breaker F13: '["a"]' was taken for a file name; a configured tier left out of tiers was silent."""
    run = kvtier_check('["a"]')
    assert run.returncode == 2 and "must be a JSON object" in run.stderr, run.stderr
    extra = {"redis_url": "redis://127.0.0.1:6379", "tiers": ["cpu"], "disk_path": str(tmp_path / "d"), "disk_gib": 1}
    warnings = [p.message for p in check_transfer_config(transfer(extra=extra)) if p.severity == "warning"]
    assert any("redis_url is set but tiers ['cpu'] leaves out 'redis'" in w for w in warnings), warnings
    assert any("disk_path and disk_gib are set but tiers ['cpu'] leaves out 'disk'" in w for w in warnings), warnings
    used = {**extra, "tiers": ["cpu", "disk", "redis"], "redis_url": None}
    assert not [p for p in check_transfer_config(transfer(extra=used)) if "leaves out" in p.message]
    # the other way round: tiers names a tier whose settings do not ask for it (it would be skipped)
    skipped = [p.message for p in check_transfer_config(transfer(extra=used)) if p.severity == "warning"]
    assert any("tiers lists 'redis' but its settings do not ask for it (redis_url)" in w for w in skipped), skipped
    assert not any("tiers lists 'disk'" in w for w in skipped), skipped
