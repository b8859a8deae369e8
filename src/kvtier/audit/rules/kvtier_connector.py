"""kvtier's own connector: the pre-flight of :mod:`kvtier.integrations.vllm.preflight` on the
serve line's ``--kv-transfer-config`` (the validator the connector runs at engine start-up)."""

from __future__ import annotations

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule
from kvtier.integrations.vllm.preflight import Problem, check_transfer_config

_DOCS = "kvtier docs/vllm.md § Configuration keys"


def _problems(c: ServeConfig) -> list[Problem]:
    transfer = c.kv_transfer_config
    if not transfer or not c.uses("KVTierConnector"):
        return []
    block = c.number("--block-size")
    # host_checks off: the audited config may run on another machine (a manifest, a script); its own
    # KVTIER_* environment (K=V on the line, docker -e, a manifest's env) applies, as the connector's would
    return check_transfer_config(transfer, int(block) if block and block >= 1 else None, host_checks=False,
                                 environ=c.env)


@rule("kvtier-config-invalid", "error", "KVTierConnector config that the connector refuses at start-up",
      "Fix each named key (`kvtier check '<the JSON>'` lists them all in under a second); with kvtier installed in "
      "vLLM's environment its kvtier_preflight plugin stops vllm serve with this error before the model loads.",
      'kvtier docs/vllm.md § Configuration keys; validator kvtier/core/config.py KVTierConfig', locate="KVTierConnector")
def kvtier_config_invalid(c: ServeConfig) -> str | None:
    errors = [p.message for p in _problems(c) if p.severity == "error"]
    return "; ".join(errors) + "." if errors else None


@rule("kvtier-config-warning", "warning", "KVTierConnector config that kvtier check warns about",
      "Fix each named key as the message says (`kvtier check '<the JSON>'` prints the same warnings; it also checks "
      "the serving host's disk_path, memory and shared tiers, which this static audit does not).",
      'kvtier docs/vllm.md § Configuration keys; validator kvtier/integrations/vllm/preflight.py', locate="KVTierConnector")
def kvtier_config_warning(c: ServeConfig) -> str | None:
    from kvtier.audit.rules.node_pool import kvtier_node_pool_below_working_set
    from kvtier.audit.rules.releases import kvtier_chunk_tokens_block_size
    from kvtier.audit.rules.tiers import kvtier_disk_tier_not_above_cpu_tier
    from kvtier.integrations.vllm.preflight import advice_problems

    transfer = c.kv_transfer_config
    if not transfer or not c.uses("KVTierConnector"):
        return None
    # reported by rules of their own: the load failure policy, the tiers' advice, v0.34's block size
    own = {p.message for p in advice_problems(transfer, environ=c.env)}
    node_rule = kvtier_node_pool_below_working_set(c)  # the node pool's size: a rule of its own too
    disk_rule = kvtier_disk_tier_not_above_cpu_tier(c)  # and the disk tier's size against the cpu tier's
    block_rule = kvtier_chunk_tokens_block_size(c) is not None
    warnings = [p.message for p in _problems(c) if p.severity == "warning" and p.message not in own
                and p.key != "kv_load_failure_policy" and not (block_rule and p.key.endswith("chunk_tokens"))
                and not (node_rule and p.message.startswith(node_rule.rstrip(".")))
                and not (disk_rule and p.message.startswith(disk_rule.rstrip(".")))]
    return "; ".join(warnings) + "." if warnings else None


@rule("kvtier-load-failure-policy", "warning", "KVTierConnector without kv_load_failure_policy recompute",
      'Add "kv_load_failure_policy":"recompute" to --kv-transfer-config.',
      'vLLM vllm/config/kv_transfer.py kv_load_failure_policy (default "fail"); kvtier '
      'docs/vllm.md', locate="KVTierConnector")
def kvtier_load_failure_policy(c: ServeConfig) -> str | None:
    warnings = [p.message for p in _problems(c) if p.key == "kv_load_failure_policy" and p.severity == "warning"]
    return warnings[0] + "." if warnings else None


@rule("kvtier-replaced-by-offloading-flags", "error",
      "--kv-offloading-size beside a KVTierConnector config: vLLM replaces kvtier's connector",
      "Drop --kv-offloading-size and --kv-offloading-backend (kvtier's own cpu tier is cpu_gib in "
      "--kv-transfer-config), or drop the KVTierConnector config to run vLLM's own offload.",
      "vLLM vllm/config/vllm.py VllmConfig._post_init_kv_transfer_config (v0.32.0: with kv_offloading_size set it "
      "overwrites kv_transfer_config.kv_connector)", locate="--kv-offloading-size")
def kvtier_replaced_by_offloading_flags(c: ServeConfig) -> str | None:
    backend = c.offloading_backend
    transfer = c.kv_transfer_config or {}
    if backend is None or transfer.get("kv_connector") != "KVTierConnector":
        return None
    replacement = {"native": "OffloadingConnector (or SimpleCPUOffloadConnector with VLLM_USE_SIMPLE_KV_OFFLOAD)",
                   "lmcache": "LMCacheMPConnector"}.get(backend, f"the {backend!r} backend's connector")
    return (f"--kv-offloading-size {c.value('--kv-offloading-size')} with backend {backend} makes vLLM set "
            f"kv_connector to {replacement}, so the KVTierConnector config is ignored and kvtier never runs.")
