"""Engine defaults of the connector's configuration: every engine with a disk tier rescans its
directory (its lookups never touch the filesystem, so this is how engines sharing one learn of
each other's chunk files)."""

from kvtier.core.config import KVTierConfig
from kvtier.integrations.vllm.engine_config import ENGINE_RESCAN_S, role_config


def test_every_role_rescans_by_default_and_an_explicit_value_wins(tmp_path):
    disk = {"disk_path": str(tmp_path), "disk_gib": 0.001}
    config = KVTierConfig.from_dict(disk)
    for role in ("kv_consumer", "kv_both", "kv_producer"):
        assert role_config(config, role).disk_rescan_s == ENGINE_RESCAN_S
    assert role_config(KVTierConfig.from_dict({}), "kv_both").disk_rescan_s is None  # no disk tier
    assert role_config(KVTierConfig.from_dict({**disk, "disk_rescan_s": 0}), "kv_consumer").disk_rescan_s == 0
    assert role_config(KVTierConfig.from_dict({**disk, "disk_rescan_s": 0.5}), "kv_both").disk_rescan_s == 0.5
