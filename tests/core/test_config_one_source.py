"""A setting given two ways is refused, not half-read: shared_secret beside shared_secret_file (the
file was never read), a password in redis_url beside redis_password_file or redis_password_env."""

from __future__ import annotations

import pytest

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.integrations.vllm.preflight import check_transfer_config

SECRET = "s" * 24


@pytest.mark.parametrize("extra, words", [
    ({"shared_secret": SECRET, "shared_secret_file": "/etc/kvtier/secret"},
     "give one of shared_secret or shared_secret_file, not both"),
    ({"redis_url": "redis://:pw@10.0.0.5:6379/0", "redis_password_file": "/etc/kvtier/redis"},
     "give one of a password in redis_url or redis_password_file, not both"),
    ({"redis_url": "redis://:pw@10.0.0.5:6379/0", "redis_password_env": "REDIS_PASSWORD"},
     "give one of a password in redis_url or redis_password_env, not both"),
    ({"redis_url": "redis://10.0.0.5:6379/0", "redis_password_env": "REDIS_PASSWORD",
      "redis_password_file": "/etc/kvtier/redis"}, "give one of redis_password_env or redis_password_file"),
])
def test_two_sources_of_one_secret_are_refused(extra, words):
    with pytest.raises(ConfigError, match=words):
        KVTierConfig.from_dict({"cpu_gib": 1, **extra})
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    assert any(p.severity == "error" and words in p.message
               for p in check_transfer_config(transfer, host_checks=False))  # kvtier check and audit say it too


@pytest.mark.parametrize("extra", [
    {"shared_secret": SECRET}, {"shared_secret_file": "/etc/kvtier/secret"},
    {"redis_url": "redis://:pw@10.0.0.5:6379/0"},
    {"redis_url": "redis://10.0.0.5:6379/0", "redis_password_file": "/etc/kvtier/redis"},
    {"redis_url": "redis://user@10.0.0.5:6379/0", "redis_password_file": "/etc/kvtier/redis"},  # a user, no password
])
def test_one_source_is_accepted(extra):
    KVTierConfig.from_dict({"cpu_gib": 1, **extra})
