"""Version gates, removals and security floors (each rule cites the vLLM release, PR or CVE)."""

from __future__ import annotations

from packaging.version import Version

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule
from kvtier.audit.versions import kvtier_tag_without_vllm

_BUNDLED_CONNECTORS = ("LMCacheConnectorV1", "LMCacheMPConnector", "NixlConnector", "MooncakeConnector",
                       "MooncakeStoreConnector")


def _between(c: ServeConfig, low: str, high: str) -> bool:
    return c.version is not None and Version(low) <= c.version < Version(high)


def _secondary_tiers(c: ServeConfig) -> list[str]:
    tiers = c.connector_extra.get("secondary_tiers")
    if not isinstance(tiers, list):
        return []
    return [str(t.get("type", "")) for t in tiers if isinstance(t, dict)]


@rule("version-unknown", "info", "vLLM version unknown",
      "Pass --vllm-version X.Y.Z or pin the image to a release tag (vllm/vllm-openai:v0.32.0).",
      'vLLM releases (github.com/vllm-project/vllm/releases): every gate below depends on the '
      'tag')
def version_unknown(c: ServeConfig) -> str | None:
    if c.version is None:
        last = (c.image or "").split("@", 1)[0].rsplit("/", 1)[-1]
        if ":" in last and kvtier_tag_without_vllm(*last.split(":", 1)):
            return (f"The vLLM version is unknown: the tag of the kvtier image {c.image} does not say it (tag it "
                    "v<vLLM version>-kvtier<kvtier version>, docs/deploy.md, or pass --vllm-version), so version "
                    "gates were skipped.")
        return "The vLLM version is unknown (no --vllm-version, image tag not a release), so version gates were skipped."
    return None


@rule("below-security-floor", "error", "below the v0.22.0 security floor",
      "Run vLLM ≥ v0.22.0.",
      'CVE-2026-48746 (--api-key bypass via the Host: header), fixed in vLLM v0.22.0 release '
      'notes (github.com/vllm-project/vllm/releases/tag/v0.22.0)')
def security_floor(c: ServeConfig) -> str | None:
    if c.version is not None and c.version < Version("0.22.0"):
        return f"vLLM {c.version} is below the v0.22.0 floor: CVE-2026-48746 lets a Host: header bypass --api-key."
    return None


@rule("pre-auth-rce-cve-2026-22778", "error", "pre-auth RCE CVE-2026-22778",
      "Run vLLM ≥ v0.22.0 (fixed in v0.14.1; the security floor is v0.22.0).",
      'CVE-2026-22778 (pre-auth RCE, video models), fixed in vLLM v0.14.1 release notes '
      '(github.com/vllm-project/vllm/releases/tag/v0.14.1)')
def rce_cve(c: ServeConfig) -> str | None:
    if c.version is not None and c.version < Version("0.14.1"):
        return f"vLLM {c.version} predates v0.14.1: CVE-2026-22778 is a pre-auth RCE on video models."
    return None


@rule("kv-offloading-flags-too-old", "error", "--kv-offloading-* flags need v0.11.1",
      "Upgrade to v0.11.1+ (better: ≥ v0.22.0) or configure OffloadingConnector via --kv-transfer-config.",
      'vLLM v0.11.1 release notes (github.com/vllm-project/vllm/releases/tag/v0.11.1): CLI '
      'flags --kv-offloading-size / --kv-offloading-backend',
      locate="--kv-offloading")
def offloading_flags_too_old(c: ServeConfig) -> str | None:
    used = c.has("--kv-offloading-size") or c.has("--kv-offloading-backend")
    if used and c.version is not None and c.version < Version("0.11.1"):
        return f"vLLM {c.version} has no --kv-offloading-size / --kv-offloading-backend (added in v0.11.1)."
    return None


@rule("native-offload-too-old", "error", "native KV offload needs v0.11.0",
      "Upgrade vLLM (native CPU offload landed in v0.11.0; the security floor is v0.22.0).",
      'vLLM v0.11.0 release notes (github.com/vllm-project/vllm/releases/tag/v0.11.0): native '
      'CPU KV offload (vllm/v1/kv_offload/)',
      locate="OffloadingConnector")
def native_offload_too_old(c: ServeConfig) -> str | None:
    if c.uses("OffloadingConnector") and c.version is not None and c.version < Version("0.11.0"):
        return f"OffloadingConnector does not exist in vLLM {c.version}; native offload arrived in v0.11.0."
    return None


@rule("secondary-tier-too-old", "error", "multi-tier offload tier not in this release",
      "Upgrade: TieringOffloadingSpec with fs tier from v0.22.0, obj from v0.23.0, kvcr from v0.30.0.",
      'vllm-project/vllm#40020 and #41735 (TieringOffloadingSpec, fs tier, v0.22.0), #41968 '
      '(obj tier, v0.23.0); kvcr tier: vLLM v0.30.0 release notes '
      '(github.com/vllm-project/vllm/releases/tag/v0.30.0)', locate="TieringOffloadingSpec")
def secondary_tier_too_old(c: ServeConfig) -> str | None:
    if c.version is None:
        return None
    spec = c.connector_extra.get("spec_name")
    gates = {"fs": "0.22.0", "p2p": "0.22.0", "obj": "0.23.0", "kvcr": "0.30.0"}
    late = [t for t in _secondary_tiers(c) if t in gates and c.version < Version(gates[t])]
    if spec == "TieringOffloadingSpec" and c.version < Version("0.22.0"):
        return f"TieringOffloadingSpec does not exist in vLLM {c.version} (added in v0.22.0)."
    if late:
        return f"Secondary tier type(s) {', '.join(late)} do not exist in vLLM {c.version}."
    return None


@rule("calculate-kv-scales-removed", "error", "--calculate-kv-scales removed in v0.28.0",
      "Delete --calculate-kv-scales; vLLM loads KV scales from the checkpoint.",
      'vllm-project/vllm#49389 (--calculate-kv-scales removed in v0.28.0)', locate="--calculate-kv-scales")
def calculate_kv_scales_removed(c: ServeConfig) -> str | None:
    if c.has("--calculate-kv-scales") and c.at_least("0.28.0"):
        return f"--calculate-kv-scales no longer exists in vLLM {c.version}; the server will not start."
    return None


@rule("calculate-kv-scales-no-effect", "warning", "--calculate-kv-scales has no effect",
      "Delete --calculate-kv-scales before upgrading to v0.28.0, where it is removed.",
      'vllm-project/vllm#49389 (deprecated, accepted with a warning through v0.27.1)',
      locate="--calculate-kv-scales")
def calculate_kv_scales_no_effect(c: ServeConfig) -> str | None:
    if c.has("--calculate-kv-scales") and not c.at_least("0.28.0"):
        return "--calculate-kv-scales only warns and has no effect; it is removed in v0.28.0."
    return None


@rule("mamba-cache-mode-all-removed", "error", "--mamba-cache-mode all removed in v0.32.0",
      "Delete --mamba-cache-mode all (vLLM sets align itself when prefix caching is on).",
      'vllm-project/vllm#58997 (--mamba-cache-mode all removed in v0.32.0; vllm/config/cache.py '
      'MambaCacheMode)', locate="--mamba-cache-mode")
def mamba_all_removed(c: ServeConfig) -> str | None:
    if (c.value("--mamba-cache-mode") or "").lower() == "all" and c.at_least("0.32.0"):
        return f"--mamba-cache-mode all fails config validation in vLLM {c.version} (accepted: align, none)."
    return None


@rule("mamba-cache-mode-all-deprecated", "warning", "--mamba-cache-mode all deprecated",
      "Delete --mamba-cache-mode all before upgrading to v0.32.0.",
      'vllm-project/vllm#55041 (deprecated on v0.30.0–v0.31.x: warns and forces MRV1)',
      locate="--mamba-cache-mode")
def mamba_all_deprecated(c: ServeConfig) -> str | None:
    if (c.value("--mamba-cache-mode") or "").lower() == "all" and _between(c, "0.30.0", "0.32.0"):
        return f"--mamba-cache-mode all is deprecated in vLLM {c.version}: it warns and forces Model Runner V1."
    return None


@rule("retention-interval-env-removed", "warning", "VLLM_PREFIX_CACHE_RETENTION_INTERVAL does nothing",
      "Use the CLI flag --prefix-cache-retention-interval N instead.",
      'vLLM v0.30.0 release notes (github.com/vllm-project/vllm/releases/tag/v0.30.0): '
      'VLLM_PREFIX_CACHE_RETENTION_INTERVAL removed (vllm/envs.py no longer reads it); use '
      '--prefix-cache-retention-interval (vllm/config/cache.py)',
      locate="VLLM_PREFIX_CACHE_RETENTION_INTERVAL")
def retention_env_removed(c: ServeConfig) -> str | None:
    if "VLLM_PREFIX_CACHE_RETENTION_INTERVAL" in c.env and c.at_least("0.30.0") is not False:
        return "VLLM_PREFIX_CACHE_RETENTION_INTERVAL is ignored from v0.30.0; the retention interval is not set."
    return None


@rule("p2p-nccl-connector-removed", "error", "P2pNcclConnector removed in v0.24.0",
      "Migrate to NixlConnector or the p2p secondary tier.",
      'vllm-project/vllm#44854 (P2pNcclConnector removed in v0.24.0)', locate="P2pNcclConnector")
def p2p_nccl_removed(c: ServeConfig) -> str | None:
    if c.uses("P2pNcclConnector") and c.at_least("0.24.0"):
        return f"P2pNcclConnector no longer exists in vLLM {c.version}."
    return None


@rule("p2p-tier-needs-pythonhashseed", "error", "p2p tier needs PYTHONHASHSEED on v0.26.x–v0.28.x",
      "Set PYTHONHASHSEED (same value on every instance) or upgrade to v0.29.0+ (#51875 fixed the seed).",
      'vllm-project/vllm#47636 (p2p tier: hard PYTHONHASHSEED check, v0.26.0), lifted by #51875 '
      '(v0.29.0)',
      locate="p2p")
def p2p_hashseed(c: ServeConfig) -> str | None:
    if "p2p" in _secondary_tiers(c) and "PYTHONHASHSEED" not in c.env and _between(c, "0.26.0", "0.29.0"):
        return f"The p2p secondary tier raises at start-up on vLLM {c.version} when PYTHONHASHSEED is unset."
    return None


@rule("mrv2-early-opt-in", "warning", "Model Runner V2 opted in before v0.29.0",
      "Upgrade to v0.29.0+ or unset VLLM_USE_V2_MODEL_RUNNER; suspect this before re-deriving sizing on OOM.",
      'vllm-project/vllm#53306 (MRV2 KV auto-sizing reserves CUDA graph memory from v0.29.0)',
      locate="VLLM_USE_V2_MODEL_RUNNER")
def mrv2_early(c: ServeConfig) -> str | None:
    if c.env_true("VLLM_USE_V2_MODEL_RUNNER") and _between(c, "0.27.0", "0.29.0"):
        return (f"VLLM_USE_V2_MODEL_RUNNER=1 on vLLM {c.version}: KV auto-sizing does not reserve CUDA graph "
                "memory, so the box can OOM after graph capture.")
    return None


@rule("lmcache-not-bundled", "warning", "LMCache not bundled in x86 images before v0.14.0",
      "Use a v0.14.0+ image (≥ v0.22.0 for security) or pip install LMCache at container start.",
      'vLLM v0.14.0 release notes (github.com/vllm-project/vllm/releases/tag/v0.14.0): LMCache '
      'bundled in the x86 vllm/vllm-openai image (docker/Dockerfile INSTALL_KV_CONNECTORS)',
      locate="LMCache")
def lmcache_not_bundled(c: ServeConfig) -> str | None:
    lm = c.uses("LMCacheConnectorV1") or c.uses("LMCacheMPConnector")
    if lm and c.image and c.version is not None and c.version < Version("0.14.0"):
        return (f"x86 vllm-openai images before v0.14.0 such as {c.image} may not ship LMCache (it was stripped "
                "from July 2025 to January 2026), so the connector fails to import unless installed at start.")
    return None


@rule("bundling-unverified", "info", "KV-connector bundling unverified on v0.28.x–v0.31.x images",
      "Run the two-step bundling check (build flag, then runtime import) on this exact tag before production.",
      'vLLM docker/Dockerfile build arg INSTALL_KV_CONNECTORS and '
      'requirements/kv_connectors.txt at the tag (github.com/vllm-project/vllm); '
      'v0.28.x–v0.31.x images not verified by kvtier')
def bundling_unverified(c: ServeConfig) -> str | None:
    uses = [n for n in _BUNDLED_CONNECTORS if c.uses(n)]
    if uses and c.image and _between(c, "0.28.0", "0.32.0"):
        return f"{', '.join(uses)} on {c.image}: bundling of LMCache/NIXL/Mooncake was not verified for this tag."
    return None


@rule("lmcache-mp-cu12-hybrid", "error", "LMCache MP on a hybrid model with a CUDA 12 image",
      "Use the CUDA 13 image tag (bundles lmcache ≥ 0.5.0).",
      'vLLM requirements/kv_connectors_cu12.txt from v0.31.0 (lmcache == 0.4.4); hybrid support '
      'in LMCache MP needs lmcache ≥ 0.5.0 (LMCache/LMCache#3106)',
      locate="LMCacheMPConnector")
def lmcache_mp_cu12(c: ServeConfig) -> str | None:
    if (c.uses("LMCacheMPConnector") and c.hybrid_model and c.image and "cu12" in c.image
            and c.at_least("0.31.0")):
        return f"{c.image} bundles lmcache 0.4.4, but LMCache MP on the hybrid model {c.model} needs lmcache ≥ 0.5.0."
    return None


@rule("nixl-cu13-dual-wheel", "warning", "NIXL import bug on v0.22.0",
      "Use v0.22.1 or later.",
      'vLLM v0.22.1 release notes (github.com/vllm-project/vllm/releases/tag/v0.22.1): nixl_ep '
      'dual-wheel build fix (ImportError: libcudart.so.12 on CUDA 13)', locate="NixlConnector")
def nixl_dual_wheel(c: ServeConfig) -> str | None:
    nixl = any(c.uses(n) for n in ("NixlConnector", "NixlPullConnector", "NixlPushConnector"))
    if nixl and c.version == Version("0.22.0"):
        return "NixlConnector on v0.22.0 can fail with ImportError: libcudart.so.12 (dual-wheel build bug)."
    return None
