"""Configuration: sources, per-rank sizing, and one-sentence errors for bad values."""

import re

import pytest

from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.core.tiers.disk import factory as disk
from kvtier.core.tiers.redis.settings import redis_settings


def disk_refusal(values: dict) -> str:
    """The one sentence the disk tier's start-up check (its factory and the preflight) gives for
    ``values``: the configuration itself looks at no filesystem (issue 20 item 4)."""
    config = KVTierConfig.from_dict(values)
    problems = disk.check(config)
    assert len(problems) == 1, problems
    return problems[0][1]


def test_defaults_and_dict():
    cfg = KVTierConfig.from_dict({"cpu_gib": 8})
    assert cfg.chunk_tokens == "auto" and cfg.cpu_gib == 8 and cfg.write_mode == "write-through"


@pytest.mark.parametrize("value,want", [("auto", "auto"), ("Auto", "auto"), (640, 640), ("640", 640), (128.0, 128)])
def test_chunk_tokens_is_auto_or_a_whole_number(value, want):
    assert KVTierConfig.from_dict({"chunk_tokens": value}).chunk_tokens == want


def test_chunk_tokens_auto_from_the_environment(monkeypatch):
    monkeypatch.setenv("KVTIER_CHUNK_TOKENS", "auto")
    assert KVTierConfig.from_dict({}).chunk_tokens == "auto"
    assert KVTierConfig.from_dict({"chunk_tokens": 256}).chunk_tokens == 256


def test_sizes_are_totals_across_tensor_parallel_ranks():
    cfg = KVTierConfig.from_dict({"cpu_gib": 8})
    assert cfg.cpu_bytes_per_rank(1) == 8 * GiB
    assert cfg.cpu_bytes_per_rank(4) == 2 * GiB


def test_env_variables(monkeypatch):
    monkeypatch.setenv("KVTIER_CPU_GIB", "3.5")
    monkeypatch.setenv("KVTIER_CHUNK_TOKENS", "512")
    cfg = KVTierConfig.from_dict({})
    assert cfg.cpu_gib == 3.5 and cfg.chunk_tokens == 512
    assert KVTierConfig.from_dict({"cpu_gib": 1}).cpu_gib == 1  # explicit beats env


def test_yaml(tmp_path):
    path = tmp_path / "kvtier.yaml"
    path.write_text(f"cpu_gib: 2\ndisk_path: {tmp_path / 'd'}\ndisk_gib: 0.01\nwrite_mode: write-through\n")
    cfg = KVTierConfig.from_yaml(path)
    assert cfg.disk_gib == 0.01 and cfg.write_mode == "write-through"
    assert not (tmp_path / "d").exists()  # validating looks at no filesystem
    assert disk.check(cfg) == [] and not (tmp_path / "d").exists()  # nor does the tier's check (the tier creates it)


@pytest.mark.parametrize("values,needle", [
    ({"cpu_gib": -1}, "cpu_gib"),
    ({"cpu_gib": 0}, "must be above 0: every chunk passes through the cpu tier"),
    # a size in bytes typed into a GiB key (new user 5): 32 GiB as bytes read as 32 EiB
    ({"cpu_gib": 34359738368}, ("'cpu_gib': looks like bytes; it is in GiB (32 means 32 GiB), at most 1048576 (1 PiB) "
                               "(got 34359738368)")),
    ({"disk_path": "/tmp/kv", "disk_gib": 1048577}, "'disk_gib': looks like bytes; it is in GiB"),
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"chunk_tokens": "big"}, "must be auto or a positive whole number of tokens"),
    ({"chunk_tokens": 1.5}, "must be auto or a positive whole number of tokens"),
    ({"chunk_tokens": True}, "must be auto or a positive whole number of tokens"),
    ({"policy": "nope"}, "policy"),
    ({"write_mode": "sometimes"}, "write_mode"),
    ({"cpu_gb": 4}, "unknown kvtier config key 'cpu_gb'"),
    ({"disk_gib": 1}, "disk_path"),
    ({"redis_url": "redis://127.0.0.1:notaport/0"}, "port must be a number"),
    ({"redis_url": "redis://:secretpw@127.0.0.1:99999/0"}, "port must be a number"),
    ({"redis_url": "rediss://127.0.0.1:0/0"}, "port must be a number"),
    ({"redis_url": "redis://127.0.0.1:6379/abc"}, "database 'abc' must be a number"),
    ({"redis_url": "redis://"}, "redis_url names no host"),
    # accepted before (tester4): a stop that could last 30,000 years, and grace periods sized from it
    ({"shutdown_flush_s": 1e12}, "'shutdown_flush_s': Input should be less than or equal to 3600 (got 1000000000000.0)"),
])
def test_bad_values_fail_with_one_sentence(values, needle):
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_dict(values)
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_one_rule_one_sentence_whatever_the_bad_cpu_gib():
    """Issue 24: cpu_gib -1 and 0 broke one rule but got two different sentences."""
    messages = []
    for bad in (-1, 0, -0.5):
        with pytest.raises(ConfigError) as info:
            KVTierConfig.from_dict({"cpu_gib": bad})
        messages.append(str(info.value).replace(f"(got {bad})", "(got X)"))
    assert messages[0] == messages[1] == messages[2], messages
    assert "must be above 0: every chunk passes through the cpu tier" in messages[0]


def test_a_disk_path_that_does_not_exist_is_named_as_such(tmp_path):
    """Issue 24: 'exceeds the 70.6 GiB free on /nvme/kvtier' for a path that did not exist: the free
    space was the root disk's.  The sentence says the path does not exist and whose free space it is."""
    missing = tmp_path / "nvme" / "kvtier"
    message = disk_refusal({"disk_path": str(missing), "disk_gib": 1e6})
    assert f"disk_path '{missing}' does not exist" in message, message
    assert f"free on '{tmp_path}', its nearest existing parent" in message, message
    assert not missing.exists()  # refused before anything was created
    missing.mkdir(parents=True)
    assert re.search(f"exceeds the .* GiB free on '{missing}'; lower disk_gib",
                     disk_refusal({"disk_path": str(missing), "disk_gib": 1e6}))


def test_a_disk_path_under_a_file_is_named_as_such(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    refusal = disk_refusal({"disk_path": str(blocker / "sub"), "disk_gib": 0.001})
    assert "which is a file" in refusal and str(blocker) in refusal


def test_disk_larger_than_free_space(tmp_path):
    assert "exceeds" in disk_refusal({"disk_path": str(tmp_path), "disk_gib": 1_000_000})


def test_the_disk_tier_refuses_to_start_with_the_checks_sentence(tmp_path):
    """Without a preflight (a store used on its own) the disk tier's factory refuses what the
    check refuses, in the same sentence, and builds nothing."""
    from prometheus_client import CollectorRegistry

    from kvtier.core.tiers.factory import TierContext

    (tmp_path / "f").write_text("x")
    config = KVTierConfig.from_dict({"disk_path": str(tmp_path / "f"), "disk_gib": 0.001})
    with pytest.raises(ConfigError) as info:
        disk.from_config(TierContext(config, b"n" * 16, 4096, 1, CollectorRegistry()))
    assert str(info.value) == disk.check(config)[0][1] == (
        f"kvtier config: disk_path '{tmp_path / 'f'}' is a file, not a directory; point it at a directory")


@pytest.mark.parametrize("path", ["/etc/hostname", "/proc/kvtier"])
def test_validating_a_config_looks_at_no_filesystem(path):
    """Issue 20 item 4: the checks of the directory belong to the disk tier and the preflight."""
    assert KVTierConfig.from_dict({"disk_path": path, "disk_gib": 0.001}).disk_path == path
    assert disk_refusal({"disk_path": path, "disk_gib": 0.001})


def test_chunk_tokens_must_be_multiple_of_block_size():
    cfg = KVTierConfig.from_dict({"chunk_tokens": 200})
    cfg.validate_block_size(8)
    with pytest.raises(ConfigError, match="multiple of the engine block size 16"):
        cfg.validate_block_size(16)
    KVTierConfig.from_dict({}).validate_block_size(640)  # auto: resolved from the block sizes, always fits


def test_yaml_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        KVTierConfig.from_yaml(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        KVTierConfig.from_yaml(tmp_path / "missing.yaml")
    bad.write_text("chunk_tokens: 128\ntiers: [cpu, disk\ncpu_gib: 1\n")  # an unclosed list
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_yaml(bad)
    assert "not valid YAML: expected ',' or ']', but got ':' at line 3, column 8; fix it there" in str(info.value)


@pytest.mark.parametrize("values,needle", [
    ({"_env_file": "/etc/hostname"}, "unknown kvtier config key '_env_file'"),
    ({"_cli_parse_args": True}, "unknown kvtier config key"),
    ({"cpu_gib": float("inf")}, "finite"),
    ({"disk_gib": float("nan"), "disk_path": "/tmp"}, "finite"),
    ({"disk_path": "/tmp/a\0b", "disk_gib": 0.001}, "NUL"),
])
def test_hostile_values_are_one_sentence_errors(values, needle):
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_dict(values)
    assert needle in str(info.value) and "'config'" not in str(info.value)


def test_env_typo_is_rejected_and_env_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("KVTIER_CPU_GB", "64")
    with pytest.raises(ConfigError, match="KVTIER_CPU_GB is not a kvtier setting"):
        KVTierConfig.from_dict({})
    monkeypatch.delenv("KVTIER_CPU_GB")
    monkeypatch.setenv("KVTIER_CPU_GIB", "lots")
    with pytest.raises(ConfigError, match="from environment variable KVTIER_CPU_GIB"):
        KVTierConfig.from_dict({})


@pytest.mark.parametrize("value", ["{disk:bogus}", "notjson"])
def test_a_mapping_variable_that_is_not_json_is_one_sentence(monkeypatch, tmp_path, value):
    monkeypatch.setenv("KVTIER_ADMISSION", value)
    with pytest.raises(ConfigError, match="KVTIER_ADMISSION must be JSON for admission") as info:
        KVTierConfig.from_dict({})
    assert info.value.env_var == "KVTIER_ADMISSION"
    monkeypatch.setenv("KVTIER_ADMISSION", '{"disk": "reused"}')
    assert KVTierConfig.from_dict({"disk_path": str(tmp_path / "d"), "disk_gib": 0.001,
                                   "write_mode": "write-back"}).admission == {"disk": "reused"}


def test_the_variable_named_by_redis_password_env_is_not_a_setting_typo(monkeypatch):
    # docs/shared-tier.md's own example keeps the password in KVTIER_REDIS_PASSWORD
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD", "hunter2")
    cfg = KVTierConfig.from_dict({"redis_url": "redis://127.0.0.1:6390/0", "redis_password_env": "KVTIER_REDIS_PASSWORD"})
    assert redis_settings(cfg).redis_password_env == "KVTIER_REDIS_PASSWORD"
    monkeypatch.setenv("KVTIER_REDIS_PASSWORD_ENV", "KVTIER_REDIS_PASSWORD")  # named from the environment too
    assert redis_settings(KVTierConfig.from_dict({})).redis_password_env == "KVTIER_REDIS_PASSWORD"
    monkeypatch.delenv("KVTIER_REDIS_PASSWORD_ENV")
    with pytest.raises(ConfigError, match="KVTIER_REDIS_PASSWORD is not a kvtier setting") as info:
        KVTierConfig.from_dict({"redis_password_env": "OTHER_VAR"})  # not the named one: still a typo guard
    assert info.value.env_var == "KVTIER_REDIS_PASSWORD"


def test_an_explicit_bad_value_is_named_before_a_bad_environment_variable(monkeypatch):
    monkeypatch.setenv("KVTIER_CPU_GIB", "lots")
    with pytest.raises(ConfigError, match="'write_mode'") as info:
        KVTierConfig.from_dict({"write_mode": "write-around"})
    assert info.value.env_var is None
    with pytest.raises(ConfigError, match="from environment variable KVTIER_CPU_GIB") as info:
        KVTierConfig.from_dict({"write_mode": "write-back"})
    assert info.value.env_var == "KVTIER_CPU_GIB"


def test_home_is_expanded_and_failed_checks_create_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = KVTierConfig.from_dict({"disk_path": "~/kv", "disk_gib": 0.001})
    assert cfg.disk_path == str(tmp_path / "kv") and disk.check(cfg) == [] and not (tmp_path / "kv").exists()
    assert "exceeds" in disk_refusal({"disk_path": str(tmp_path / "toolarge"), "disk_gib": 1_000_000})
    assert not (tmp_path / "toolarge").exists()


def test_non_utf8_yaml(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("# caf\xe9\ncpu_gib: 2\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="UTF-8"):
        KVTierConfig.from_yaml(path)


def test_a_redis_url_without_a_port_is_accepted():
    assert redis_settings(KVTierConfig.from_dict({"redis_url": "redis://10.0.0.5/0"})).redis_url == "redis://10.0.0.5/0"


def test_a_bad_redis_url_port_never_echoes_the_password():
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_dict({"redis_url": "redis://:hunter2@127.0.0.1:99999/0"})
    assert "hunter2" not in str(info.value)


@pytest.mark.parametrize("given", [{"redis_url": "redis://kv:hunter2@10.0.0.5:6379/0"},
                                   {"tier_settings": {"redis": {"redis_url": "redis://kv:hunter2@10.0.0.5:6379/0"}}}])
def test_the_redis_tiers_keys_live_in_its_settings_and_their_secrets_stay_hidden(given):
    """Issue 20 item 1: the redis keys are the redis tier's own settings model, given flat (as
    always) or nested; the URL's password never shows in the repr, the exported labels or an error."""
    cfg = KVTierConfig.from_dict({**given, "shared_secret": "0123456789abcdef0123"})
    assert redis_settings(cfg).redis_url == "redis://kv:hunter2@10.0.0.5:6379/0"
    public = cfg.public_dict()
    assert public["redis_url"] == "redis://***@10.0.0.5:6379/0" and public["shared_secret"] == "<set>"
    assert public["redis_ttl_s"] == 86400 and "tier_settings" not in public
    assert "hunter2" not in repr(cfg) and "0123456789abcdef" not in repr(cfg) and "redis_ttl_s=86400" in repr(cfg)
    assert cfg.flat_dict(exclude_unset=True) == {"redis_url": "redis://kv:hunter2@10.0.0.5:6379/0",
                                                 "shared_secret": "0123456789abcdef0123"}


def test_a_redis_key_from_the_environment_is_read_and_named_in_its_error(monkeypatch):
    monkeypatch.setenv("KVTIER_REDIS_TTL_S", "60")
    assert redis_settings(KVTierConfig.from_dict({})).redis_ttl_s == 60
    assert redis_settings(KVTierConfig.from_dict({"redis_ttl_s": 5})).redis_ttl_s == 5  # explicit beats env
    monkeypatch.setenv("KVTIER_REDIS_TTL_S", "soon")
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_dict({})
    assert str(info.value) == ("kvtier config field 'redis_ttl_s' (from environment variable KVTIER_REDIS_TTL_S): "
                               "Input should be a valid integer, unable to parse string as an integer (got 'soon'); "
                               "fix the value of 'redis_ttl_s'") and info.value.env_var == "KVTIER_REDIS_TTL_S"
    with pytest.raises(ConfigError, match="'write_mode'") as info:  # a value given is named before the variable
        KVTierConfig.from_dict({"write_mode": "write-around"})
    assert info.value.env_var is None
    with pytest.raises(ConfigError) as info:
        KVTierConfig.from_dict({"redis_ttl_s": 0})
    assert str(info.value) == ("kvtier config field 'redis_ttl_s': Input should be greater than 0 (got 0); "
                               "fix the value of 'redis_ttl_s'")


@pytest.mark.parametrize("key", ["cpu_gib", "disk_gib", "io_threads", "save_queue_depth", "shutdown_flush_s",
                                 "spill_watermark", "disk_rescan_s", "load_wait_s", "idle_step_wait_s",
                                 "shared_queue_depth"])
@pytest.mark.parametrize("value", [True, False])
def test_a_boolean_is_never_a_size_or_count(key, value):
    """pydantic's lax mode would read true as 1: every numeric field refuses a boolean in one sentence
    (issue 24); a numeric string stays accepted, as a KVTIER_* variable's value is one."""
    values = {key: value, **({"disk_path": "/nonexistent-kvtier"} if key == "disk_gib" else {})}
    with pytest.raises(ConfigError) as caught:
        KVTierConfig.from_dict(values)
    assert f"field {key!r}: must be a number, not the boolean {str(value).lower()}" in str(caught.value)
    assert KVTierConfig.from_dict({"cpu_gib": "4"}).cpu_gib == 4.0
