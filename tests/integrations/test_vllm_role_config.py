"""Role defaults of the connector's configuration: a kv_consumer rescans the shared disk directory."""

from kvtier.core.config import KVTierConfig
from kvtier.integrations.vllm.worker import CONSUMER_RESCAN_S, role_config


def test_a_consumer_rescans_by_default_and_an_explicit_value_wins(tmp_path):
    disk = {"disk_path": str(tmp_path), "disk_gib": 0.001}
    config = KVTierConfig.from_dict(disk)
    assert role_config(config, "kv_consumer").disk_rescan_s == CONSUMER_RESCAN_S
    assert role_config(config, "kv_both").disk_rescan_s is None
    assert role_config(config, "kv_producer").disk_rescan_s is None
    assert role_config(KVTierConfig.from_dict({}), "kv_consumer").disk_rescan_s is None  # no disk tier
    assert role_config(KVTierConfig.from_dict({**disk, "disk_rescan_s": 0}), "kv_consumer").disk_rescan_s == 0
    assert role_config(KVTierConfig.from_dict({**disk, "disk_rescan_s": 0.5}), "kv_both").disk_rescan_s == 0.5
