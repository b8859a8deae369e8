"""Every audit rule fires on a config that has its problem and stays quiet on a near-identical one
that does not.  The table below has exactly one entry per rule (checked by the last test)."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
import yaml

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.rules import RULES
from kvtier.audit.versions import parse_version


def ktc(connector: str, **extra: object) -> str:
    cfg: dict[str, object] = {"kv_connector": connector, "kv_role": "kv_both"}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return "--kv-transfer-config '" + json.dumps(cfg) + "'"


def pod(image: str = "registry.example.com/kvtier-vllm:v0.32.0-kvtier0.1.0", install: bool = False,
        timeout: int | None = 30, grace: int | None = 90, mount: str = "/nvme", redis_url: str | None = None,
        worker_s: str | None = "35", read_only: bool = False, volume: dict[str, object] | None = None,
        memory: str | None = None, node_gib: float | None = None, node_volume: dict[str, object] | None = None) -> str:
    """A Deployment running vLLM + kvtier with a disk tier at /nvme/kvtier in namespace ``inference``;
    each argument changes one fact (the defaults are a correct pod)."""
    extra: dict[str, object] = {"cpu_gib": 16, "disk_path": "/nvme/kvtier", "disk_gib": 500}
    if redis_url:
        extra.update(redis_url=redis_url, tiers=["cpu", "disk", "redis"])
    if node_gib is not None:  # the node pool beside its owner's socket, in /kvtier-node
        extra.update(node_socket="/kvtier-node/node.sock", node_gib=node_gib, tiers=["cpu", "disk", "node"])
    cfg = {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_module_path": "kvtier.integrations.vllm", "kv_connector_extra_config": extra}
    serve = ["vllm", "serve", "Qwen/Qwen3-8B", *(["--shutdown-timeout", str(timeout)] if timeout else []),
             "--kv-transfer-config", json.dumps(cfg)]
    command = ["sh", "-c", "pip install kvtier==0.1.0 && " + " ".join(
        w if w.startswith(("v", "Q", "-")) else f"'{w}'" for w in serve)] if install else serve
    env = [{"name": "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "value": worker_s}] if worker_s is not None else []
    spec: dict[str, object] = {"containers": [{"name": "vllm", "image": image, "command": command, "env": env,
                                                "volumeMounts": [{"name": "nvme", "mountPath": mount,
                                                                  "readOnly": read_only}],
                                                **({"resources": {"limits": {"memory": memory}}} if memory else {})}],
                               "volumes": [{"name": "nvme", **(volume or {"emptyDir": {"sizeLimit": "550Gi"}})}]}
    if node_volume is not None:
        spec["containers"][0]["volumeMounts"].append({"name": "node", "mountPath": "/kvtier-node"})  # type: ignore[index]
        spec["volumes"].append({"name": "node", **node_volume})  # type: ignore[attr-defined]
    if grace is not None:
        spec["terminationGracePeriodSeconds"] = grace
    return yaml.safe_dump({"apiVersion": "apps/v1", "kind": "Deployment",
                           "metadata": {"name": "vllm", "namespace": "inference"},
                           "spec": {"template": {"spec": spec}}}, width=10_000)


TIERED = ktc("OffloadingConnector", spec_name="TieringOffloadingSpec", secondary_tiers=[{"type": "obj"}])
P2P = ktc("OffloadingConnector", spec_name="TieringOffloadingSpec", secondary_tiers=[{"type": "p2p"}])
MULTI_BAD = ktc("MultiConnector", connectors=[{"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                                              {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}])
MULTI_OK = ktc("MultiConnector", connectors=[{"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                                             {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"}])
LM = ktc("LMCacheConnectorV1")


def kvtier_line(policy: str | None = "recompute", **extra: object) -> str:
    """A serve line with a complete KVTierConnector config (module path, role, policy, ``extra``)."""
    cfg: dict[str, object] = {"kv_connector": "KVTierConnector", "kv_role": "kv_both",
                              "kv_connector_module_path": "kvtier.integrations.vllm", "kv_connector_extra_config": extra}
    if policy is not None:
        cfg["kv_load_failure_policy"] = policy
    return "vllm serve m --block-size 16 --kv-transfer-config '" + json.dumps(cfg) + "'"


WINDOW_MODEL = Path(tempfile.mkdtemp(prefix="kvtier-audit-window-")) / "m"
"""A local model of 4,096 positions (the tiny test model's config fields): rule max-model-len-beyond-model-window
reads a local config.json only."""
WINDOW_MODEL.mkdir()
(WINDOW_MODEL / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "hidden_size": 256, "max_position_embeddings": 4096, "torch_dtype": "float32"}))

GEMMA = "vllm serve google/gemma-3-27b-it"
KV_PINNED = f"vllm serve m -tp 2 --kv-cache-memory-bytes {100 << 30}"
LLAMA70 = "vllm serve meta-llama/Llama-3.1-70B --tensor-parallel-size 8"
V = "0.32.0"
_LOCAL_TIERS = (Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "local-tiers" / "vllm.yaml").read_text()
"""The local-tiers StatefulSet as shipped (its disk volume from volumeClaimTemplates)."""

# rule id: ((firing text, version), (quiet text, version)); version None means unknown.
CASES: dict[str, tuple[tuple[str, str | None], tuple[str, str | None]]] = {
    "flag-newer-than-vllm": (("vllm serve m --max-num-inflight-kv-loads 8", "0.33.0"),
                             ("vllm serve m --max-num-inflight-kv-loads 8", "0.34.0")),
    "v2-model-runner-env-removed": (("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve m", "0.34.0"),
                                    ("VLLM_USE_V2_MODEL_RUNNER=0 vllm serve m", "0.33.0")),
    "kvtier-sleep-mode": ((kvtier_line() + " --enable-sleep-mode", "0.33.0"), (kvtier_line(), "0.33.0")),
    "kvtier-extensible-kv-cache-headroom": ((kvtier_line(), "0.34.0"),
                                            (kvtier_line() + " --gpu-memory-utilization 0.9", "0.34.0")),
    "kvtier-chunk-tokens-block-size-64": ((kvtier_line(chunk_tokens=96).replace(" --block-size 16", ""), "0.34.0"),
                                          (kvtier_line(chunk_tokens=96).replace(" --block-size 16", ""), "0.33.0")),
    # user41: vLLM refuses a --max-model-len past the config's window (the test model at 8192 died at start-up)
    "max-model-len-beyond-model-window": ((f"vllm serve {WINDOW_MODEL} --max-model-len 4097", V),
                                          (f"vllm serve {WINDOW_MODEL} --max-model-len 4096", V)),
    # user41: a chunk no prompt this server takes can fill serves no hit (chunk_tokens 96 measured on the
    # tiny model: prompts of 96 tokens loaded nothing, of 97 loaded one chunk)
    "kvtier-chunk-tokens-not-below-max-model-len": ((kvtier_line(chunk_tokens=2048) + " --max-model-len 2048", V),
                                                    (kvtier_line(chunk_tokens=2048) + " --max-model-len 2049", V)),
    # tools tester: a cpu tier below one chunk of a model the audit knows (Llama-3.1-8B: 128 KiB a token)
    "kvtier-cpu-tier-below-one-chunk": (
        (kvtier_line(cpu_gib=10, chunk_tokens=1048576).replace("serve m ", "serve meta-llama/Llama-3.1-8B "), V),
        (kvtier_line(cpu_gib=128, chunk_tokens=1048576).replace("serve m ", "serve meta-llama/Llama-3.1-8B "), V)),
    "kvtier-inflight-kv-loads-cap-only": ((kvtier_line() + " --max-num-inflight-kv-loads 4", "0.34.0"),
                                          ("vllm serve m --max-num-inflight-kv-loads 4", "0.34.0")),
    "cpu-offload-gb-is-weights": (("vllm serve m --cpu-offload-gb 40", V),
                                  ("vllm serve m --cpu-offload-gb 40 --kv-offloading-size 64", V)),
    "cpu-offload-gb-invalid": (("vllm serve m --cpu-offload-gb nan", V), ("vllm serve m --cpu-offload-gb 0", V)),
    "cpu-offload-gb-beside-kv-offload": (("vllm serve m --cpu-offload-gb 40 --kv-offloading-size 64", V),
                                         ("vllm serve m --kv-offloading-size 64", V)),
    "kv-offloading-size-is-total": (("vllm serve m --tensor-parallel-size 8 --kv-offloading-size 200", V),
                                    ("vllm serve m --kv-offloading-size 200", V)),
    "sglang-flag": (("vllm serve m --hicache-size 200", V), ("vllm serve m --kv-offloading-size 200", V)),
    "kv-offloading-backend-without-size": (("vllm serve m --kv-offloading-backend native", V),
                                           ("vllm serve m --kv-offloading-backend native --kv-offloading-size 8", V)),
    "kv-offloading-size-invalid": (("vllm serve m --kv-offloading-size 0", V), ("vllm serve m --kv-offloading-size 8", V)),
    "parallel-size-invalid": (("vllm serve m --tensor-parallel-size inf --kv-offloading-size 8", V),
                              ("vllm serve m -tp 2 -pp 2 --kv-offloading-size 8", V)),
    "serve-flag-unknown": (("vllm serve m --kv-transfer-confg '{}' --frobnicate 3", V),
                           ("vllm serve m --max_model_len 4096 -tp 2 -O3 --kv-transfer-config.kv_role kv_both", V)),
    "serve-flag-value": (("vllm serve m --tensor-parallel-size --max-model-len abc --dtype fp7", V),
                         ("vllm serve m --max-model-len 32k --max-num-batched-tokens 8K --dtype bfloat16 --port $PORT",
                          V)),
    "prefix-caching-off-with-offload": (("vllm serve m --no-enable-prefix-caching --kv-offloading-size 8", V),
                                        ("vllm serve m --no-enable-prefix-caching", V)),
    "kv-transfer-config-invalid": (("vllm serve m --kv-transfer-config '{bad'", V),
                                   (f"vllm serve m {ktc('NixlConnector')}", V)),
    "shell-variable-unresolved": (('vllm serve m --kv-transfer-config "$CONFIG"', V),
                                  (("CONFIG='{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_both\"}'\n"
                                   'vllm serve m --kv-transfer-config "$CONFIG"'), V)),
    "kv-transfer-config-dotted": ((kvtier_line() + " --kv-transfer-config.kv_connector_extra_config.cpu_gib=2", V),
                                  (kvtier_line(cpu_gib=2), V)),
    "kv-role-missing": (("""vllm serve m --kv-transfer-config '{"kv_connector":"NixlConnector"}'""", V),
                        (f"vllm serve m {ktc('NixlConnector')}", V)),
    "fp8-kv-without-scales": (("vllm serve m --kv-cache-dtype fp8", V), ("vllm serve m --kv-cache-dtype auto", V)),
    "version-unknown": (("vllm serve m", None), ("vllm serve m", V)),
    "below-security-floor": (("vllm serve m", "0.21.0"), ("vllm serve m", "0.22.0")),
    "pre-auth-rce-cve-2026-22778": (("vllm serve m", "0.14.0"), ("vllm serve m", "0.14.1")),
    "kv-offloading-flags-too-old": (("vllm serve m --kv-offloading-size 8", "0.11.0"),
                                    ("vllm serve m --kv-offloading-size 8", "0.11.1")),
    "native-offload-too-old": ((f"vllm serve m {ktc('OffloadingConnector')}", "0.10.2"),
                               (f"vllm serve m {ktc('OffloadingConnector')}", "0.11.0")),
    "secondary-tier-too-old": ((f"vllm serve m {TIERED}", "0.22.0"), (f"vllm serve m {TIERED}", "0.23.0")),
    "calculate-kv-scales-removed": (("vllm serve m --calculate-kv-scales", "0.28.0"),
                                    ("vllm serve m --calculate-kv-scales", "0.27.1")),
    "calculate-kv-scales-no-effect": (("vllm serve m --calculate-kv-scales", "0.27.1"),
                                      ("vllm serve m --calculate-kv-scales", "0.28.0")),
    "mamba-cache-mode-all-removed": (("vllm serve m --mamba-cache-mode all", "0.32.0"),
                                     ("vllm serve m --mamba-cache-mode all", "0.31.0")),
    "mamba-cache-mode-all-deprecated": (("vllm serve m --mamba-cache-mode all", "0.31.0"),
                                        ("vllm serve m --mamba-cache-mode align", "0.31.0")),
    "retention-interval-env-removed": (("VLLM_PREFIX_CACHE_RETENTION_INTERVAL=64 vllm serve m", "0.30.0"),
                                       ("VLLM_PREFIX_CACHE_RETENTION_INTERVAL=64 vllm serve m", "0.29.0")),
    "p2p-nccl-connector-removed": ((f"vllm serve m {ktc('P2pNcclConnector')}", "0.24.0"),
                                   (f"vllm serve m {ktc('P2pNcclConnector')}", "0.23.0")),
    "p2p-tier-needs-pythonhashseed": ((f"vllm serve m {P2P}", "0.26.0"),
                                      (f"PYTHONHASHSEED=0 vllm serve m {P2P}", "0.26.0")),
    "mrv2-early-opt-in": (("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve m", "0.28.0"),
                          ("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve m", "0.29.0")),
    "lmcache-not-bundled": ((f"docker run --gpus all vllm/vllm-openai:v0.13.0 --model m {LM}", None),
                            (f"docker run --gpus all vllm/vllm-openai:v0.14.0 --model m {LM}", None)),
    "bundling-unverified": ((f"docker run vllm/vllm-openai:v0.29.0 --model m {ktc('NixlConnector')}", None),
                            (f"docker run vllm/vllm-openai:v0.32.0 --model m {ktc('NixlConnector')}", None)),
    "lmcache-mp-cu12-hybrid": (
        (f"docker run vllm/vllm-openai:v0.32.0-cu129 --model google/gemma-3-27b-it {ktc('LMCacheMPConnector')}", None),
        (f"docker run vllm/vllm-openai:v0.32.0 --model google/gemma-3-27b-it {ktc('LMCacheMPConnector')}", None)),
    "nixl-cu13-dual-wheel": ((f"vllm serve m {ktc('NixlConnector')}", "0.22.0"),
                             (f"vllm serve m {ktc('NixlConnector')}", "0.22.1")),
    "disable-hma-by-reflex": (("vllm serve m --kv-offloading-size 8 --disable-hybrid-kv-cache-manager", "0.23.0"),
                              ("vllm serve m --kv-offloading-size 8 --disable-hybrid-kv-cache-manager", "0.22.0")),
    "hma-flag-required-before-0.23": (
        ("vllm serve m --kv-offloading-size 8", "0.22.0"),
        ("vllm serve m --kv-offloading-size 8 --disable-hybrid-kv-cache-manager", "0.22.0")),
    "lmcache-inprocess-on-hybrid": ((f"{GEMMA} {LM}", V), (f"vllm serve Qwen/Qwen3-8B {LM}", V)),
    "multiconnector-non-hma-child": ((f"vllm serve m {MULTI_BAD}", V), (f"vllm serve m {MULTI_OK}", V)),
    "moriio-write-on-hybrid": ((f"{GEMMA} {ktc('MoRIIOConnector')}", V),
                               (f"{GEMMA} {ktc('MoRIIOConnector', read_mode=True)}", V)),
    "hybrid-retention-interval-default": (("vllm serve openai/gpt-oss-120b", "0.29.0"),
                                          ("vllm serve openai/gpt-oss-120b --prefix-cache-retention-interval 256",
                                           "0.29.0")),
    "lmcache-size-mismatch": (
        ("LMCACHE_MAX_LOCAL_CPU_SIZE=200 vllm serve m -tp 8 --kv-offloading-backend lmcache --kv-offloading-size 200", V),
        ("LMCACHE_MAX_LOCAL_CPU_SIZE=25 vllm serve m -tp 8 --kv-offloading-backend lmcache --kv-offloading-size 200", V)),
    "lmcache-env-without-connector": (("LMCACHE_LOCAL_CPU=True vllm serve m", V),
                                      (f"LMCACHE_LOCAL_CPU=True LMCACHE_MAX_LOCAL_CPU_SIZE=8 vllm serve m {LM}", V)),
    "lmcache-size-unset": ((f"vllm serve m {LM}", V), (f"LMCACHE_MAX_LOCAL_CPU_SIZE=20 vllm serve m {LM}", V)),
    "lmcache-local-cpu-off": (("LMCACHE_LOCAL_CPU=False\n", V), ("LMCACHE_LOCAL_CPU=True\n", V)),
    "lmcache-disk-async-loading": (
        ("LMCACHE_LOCAL_DISK=file:///nvme/\nLMCACHE_ENABLE_ASYNC_LOADING=True\n", V),
        ("LMCACHE_LOCAL_DISK=file:///nvme/\nLMCACHE_ENABLE_ASYNC_LOADING=False\n", V)),
    "dcp-offload-segfault": (("vllm serve m --decode-context-parallel-size 2 --kv-offloading-size 8", "0.20.0"),
                             ("vllm serve m --decode-context-parallel-size 2 --kv-offloading-size 8", "0.21.0")),
    "qwen35-native-offload-start-failure": (("vllm serve Qwen/Qwen3.5-9B --kv-offloading-size 8", "0.20.0"),
                                            ("vllm serve Qwen/Qwen3.5-9B --kv-offloading-size 8", "0.21.0")),
    "simple-cpu-offload-toctou": ((f"vllm serve m {ktc('SimpleCPUOffloadConnector')}", "0.21.0"),
                                  (f"vllm serve m {ktc('SimpleCPUOffloadConnector')}", "0.22.0")),
    "fastsafetensor-env-does-not-exist": (("VLLM_USE_FASTSAFETENSOR=1 vllm serve m", V),
                                          ("vllm serve m --load-format fastsafetensors", V)),
    "enforce-eager-on-transformer": (("vllm serve Qwen/Qwen3-8B --enforce-eager", V),
                                     ("vllm serve Qwen/Qwen3.5-9B --enforce-eager", V)),
    "long-context-block-size": (("vllm serve m --max-model-len 200000", V),
                                ("vllm serve m --max-model-len 200000 --block-size 32", V)),
    "long-context-no-batched-token-cap": (
        ("vllm serve m --max-model-len 65536 --kv-offloading-size 8", V),
        ("vllm serve m --max-model-len 65536 --kv-offloading-size 8 --max-num-batched-tokens 8192", V)),
    "kvtier-config-invalid": ((kvtier_line(chunk_tokens=100), V), (kvtier_line(chunk_tokens=256), V)),
    "shell-variable-not-exported": (("VLLM_LOGGING_LEVEL=DEBUG\nvllm serve m", V),
                                    ("export VLLM_LOGGING_LEVEL=DEBUG\nvllm serve m", V)),
    "kvtier-config-warning": ((kvtier_line(cpu_gib=0.0001), V), (kvtier_line(cpu_gib=4), V)),
    "kvtier-load-failure-policy": ((kvtier_line(policy=None), V), (kvtier_line(), V)),
    "kvtier-replaced-by-offloading-flags": ((kvtier_line(cpu_gib=8) + " --kv-offloading-size 8", V),
                                            (kvtier_line(cpu_gib=8), V)),
    "kvtier-shared-tier-unprotected": ((kvtier_line(redis_url="redis://10.0.0.5:6379/0"), V),
                                       (kvtier_line(redis_url="rediss://10.0.0.5:6380/0",
                                                    shared_secret_file="/etc/kvtier/secret"), V)),
    "kvtier-shared-tier-tenants-unprotected": (
        (kvtier_line(redis_url="rediss://10.0.0.5:6380/0", tenant_quotas={"default_share": 0.2}), V),
        (kvtier_line(redis_url="rediss://10.0.0.5:6380/0", tenant_quotas={"default_share": 0.2},
                     codecs={"redis": ["aes-256-gcm"]}, encryption={"master_key_file": "/etc/kvtier/key"}), V)),
    "kvtier-redis-password-in-url": ((kvtier_line(redis_url="redis://:s3cr3t-pw@127.0.0.1:6379/0"), V),
                                     (kvtier_line(redis_url="redis://127.0.0.1:6379/0",
                                                  redis_password_env="REDIS_PW"), V)),
    "kvtier-tier-exposed": ((kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache", s3_allow_http=True,
                                         s3_endpoint_url="http://10.0.0.5:9000"), V),
                            (kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache", s3_allow_http=True,
                                         s3_endpoint_url="http://10.0.0.5:9000",
                                         shared_secret_file="/etc/kvtier/secret"), V)),
    "kvtier-credentials-in-serve-line": ((kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache",
                                                      aws_secret_access_key="wJalrXUtnFEMI-example"), V),
                                         (kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache",
                                                      s3_credentials_file="/etc/kvtier/aws"), V)),
    "kvtier-image-without-kvtier": ((pod(image="vllm/vllm-openai:v0.32.0"), V),
                                    (pod(image="vllm/vllm-openai:v0.32.0", install=True), V)),
    "kvtier-no-shutdown-timeout": ((pod(timeout=None), V), (pod(), V)),
    "kvtier-grace-period-too-short": ((pod(grace=45), V), (pod(grace=60), V)),
    "kvtier-disk-path-not-on-volume": ((pod(mount="/var/cache/kvtier"), V), (pod(), V)),
    "volume-mount-without-volume": ((_LOCAL_TIERS.replace("volumeClaimTemplates:", "volumeClaimTemplate:"), V),
                                    (_LOCAL_TIERS, V)),
    "kvtier-worker-shutdown-timeout-short": ((pod(worker_s="5"), V), (pod(), V)),
    "kvtier-unsupported-vllm": ((pod(image="registry.example.com/kvtier-vllm:v0.35.0-kvtier0.1.0"), None),
                                (pod(), None)),
    "kvtier-disk-volume-unfit": ((pod(read_only=True), V), (pod(), V)),
    "kvtier-cpu-tier-over-memory-limit": ((pod(memory="20Gi"), V), (pod(memory="24Gi"), V)),
    # a write-through disk tier no larger than the cpu tier (the default write_mode): it adds almost no hits
    "kvtier-disk-tier-not-above-cpu-tier": (
        (kvtier_line(cpu_gib=16, disk_path="/nvme/kv", disk_gib=16), V),
        (kvtier_line(cpu_gib=16, disk_path="/nvme/kv", disk_gib=16, write_mode="write-back"), V)),
    # the shared pool below one engine's own cpu tier (cpu_gib 16)
    "kvtier-node-pool-below-working-set": ((pod(node_gib=8), V), (pod(node_gib=16), V)),
    # the pool's memory volume (beside node_socket) below node_gib; the host's /dev/shm (a hostPath) says no size
    "kvtier-node-shm-below-pool": (
        (pod(node_gib=64, node_volume={"emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}}), V),
        (pod(node_gib=64, node_volume={"emptyDir": {"medium": "Memory", "sizeLimit": "64Gi"}}), V)),
    "kvtier-shared-tier-cleartext-beyond-namespace": (
        (pod(redis_url="redis://redis.other-team.svc.cluster.local:6379/0"), V),
        (pod(redis_url="redis://redis.inference.svc.cluster.local:6379/0"), V)),
    # 100 GiB of engine KV per GPU × TP 2 = 200 GiB: a 128 GiB cpu tier holds nothing the engine does not
    "cpu-tier-not-above-engine-cache": ((f"{KV_PINNED} --kv-offloading-size 128", V),
                                        (f"{KV_PINNED} --kv-offloading-size 256", V)),
    # vLLM refuses these at startup (CacheConfig gt=0 le=1; VllmConfig int ge=0); LMCache reads numbers
    "gpu-memory-utilization-invalid": (("vllm serve m --gpu-memory-utilization 1.5", V),
                                       ("vllm serve m --gpu-memory-utilization 1", V)),
    "shutdown-timeout-invalid": (("vllm serve m --shutdown-timeout -5", V), ("vllm serve m --shutdown-timeout 0", V)),
    "lmcache-env-invalid": (("LMCACHE_CHUNK_SIZE=-5 vllm serve m --kv-offloading-size 8 --kv-offloading-backend lmcache", V),
                            ("LMCACHE_CHUNK_SIZE=256 vllm serve m --kv-offloading-size 8 --kv-offloading-backend lmcache", V)),
    # Qwen3-Next's state page over its attention bytes per token: a state block of at least 536 tokens at TP 1
    "kvtier-chunk-tokens-below-state-block": (
        (f"vllm serve Qwen/Qwen3-Next-80B-A3B-Instruct {ktc('KVTierConnector', chunk_tokens=128)}", V),
        (f"vllm serve Qwen/Qwen3-Next-80B-A3B-Instruct {ktc('KVTierConnector', chunk_tokens='auto')}", V)),
    # Llama-3.1-70B at TP 8: 410 GiB of engine KV on H100, 847 on H200, 1,219 on MI300X
    "cpu-tier-vs-engine-cache-unknown": ((f"{LLAMA70} --kv-offloading-size 408", V),
                                         (f"{LLAMA70} --kv-offloading-size 1904", V)),
}


def rule_ids(text: str, version: str | None) -> set[str]:
    configs = load_configs(text, "test", parse_version(version) if version else None)
    return {f.rule for f in audit(configs)}


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_fires(rule_id):
    (text, version), _ = CASES[rule_id]
    assert rule_id in rule_ids(text, version)


@pytest.mark.parametrize("rule_id", sorted(CASES))
def test_rule_stays_quiet(rule_id):
    _, (text, version) = CASES[rule_id]
    assert rule_id not in rule_ids(text, version)


def test_every_rule_has_cases_and_there_are_at_least_25():
    ids = [r.id for r in RULES]
    assert len(ids) >= 25
    assert set(ids) == set(CASES)


def test_every_rule_cites_a_source_and_a_fix():
    for r in RULES:
        assert r.source and r.fix and r.title
        assert r.severity in ("error", "warning", "info")


# What a user can open: a PR/issue number, a release note, a CVE, a URL, or a file path.
_OPENABLE = re.compile(r"#\d{3,}|release notes|CVE-\d{4}-\d+|\w\.\w+/|\b[\w./-]+\.(py|md|txt)\b|Dockerfile")
_PRIVATE = re.compile(r"issue \d+ §|operator's guide|how-to:", re.IGNORECASE)


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.id)
def test_every_source_is_public(rule):
    """A source names something a user can open; never a private document or an internal issue."""
    assert _OPENABLE.search(rule.source), rule.source
    assert not _PRIVATE.search(rule.source), rule.source


def test_a_clean_modern_native_offload_config_has_no_error_or_warning():
    text = "vllm serve Qwen/Qwen3-8B --tensor-parallel-size 2 --kv-offloading-backend native --kv-offloading-size 128"
    configs = load_configs(text, "ok", parse_version("0.32.0"))
    assert {f.severity for f in audit(configs)} <= {"info"}


@pytest.mark.parametrize("extra, words", [
    ({"cpu_gb": 4}, "did you mean 'cpu_gib'"),
    ({"cpu_gib": -4}, "'cpu_gib'"),
    ({"disk_gib": -1, "disk_path": "/nvme/kv"}, "'disk_gib'"),
    ({"chunk_tokens": 100}, "multiple of the engine block size 16"),
])
def test_kvtier_config_findings_name_the_key(extra, words):
    configs = load_configs(kvtier_line(**extra), "test", parse_version(V))
    messages = [f.message for f in audit(configs) if f.rule == "kvtier-config-invalid"]
    assert len(messages) == 1 and words in messages[0]


def test_kvtier_with_the_hma_flag_is_told_it_does_not_need_it():
    """KVTierConnector supports HMA (issue 10): the flag is never required for it."""
    text = kvtier_line().replace("--block-size 16", "--block-size 16 --disable-hybrid-kv-cache-manager")
    configs = load_configs(text.replace("vllm serve m", "vllm serve google/gemma-3-27b-it"), "t", parse_version(V))
    assert "disable-hma-by-reflex" in {f.rule for f in audit(configs)}
    assert not [f for f in audit(load_configs(kvtier_line(), "t", parse_version(V))) if f.severity == "error"]


def test_audit_does_not_judge_or_touch_the_disk_path_of_another_host(tmp_path):
    target = tmp_path / "not-created"
    configs = load_configs(kvtier_line(disk_path=str(target), disk_gib=100000), "t", parse_version(V))
    assert not [f for f in audit(configs) if f.rule == "kvtier-config-invalid"]
    assert not target.exists()


@pytest.mark.parametrize("source", ["env", "mixed"])
def test_audit_does_not_touch_a_disk_path_from_the_environment(tmp_path, source):
    """KVTIER_DISK_PATH / KVTIER_DISK_GIB on the line (or disk_gib in the JSON, the path in the
    environment) are another host's too: no host finding, nothing created here (issue 24)."""
    target = tmp_path / "not-created" / "disk"
    if source == "env":
        text = f"export KVTIER_DISK_PATH={target}\nexport KVTIER_DISK_GIB=100000\n" + kvtier_line(cpu_gib=32)
    else:
        text = "export KVTIER_DISK_GIB=100000\n" + kvtier_line(cpu_gib=32, disk_path=str(target))
    findings = audit(load_configs(text, "t", parse_version(V)))
    assert not [f.message for f in findings if f.rule == "kvtier-config-invalid"]
    assert not target.parent.exists()
    bad = audit(load_configs("export KVTIER_DISK_GIB=abc\n" + kvtier_line(cpu_gib=32), "t", parse_version(V)))
    (message,) = [f.message for f in bad if f.rule == "kvtier-config-invalid"]
    assert message.count("KVTIER_DISK_GIB") == 1, message


@pytest.mark.parametrize("url, extra, missing", [
    ("redis://kv.internal:6379/0", {"shared_secret_file": "/s"}, ["TLS"]),
    ("rediss://kv.internal:6380/0", {}, ["shared_secret"]),
    ("redis://10.1.2.3:6379/0", {}, ["TLS", "shared_secret"]),
])
def test_shared_tier_warning_names_what_is_missing(url, extra, missing):
    configs = load_configs(kvtier_line(redis_url=url, **extra), "test", parse_version(V))
    messages = [f.message for f in audit(configs) if f.rule == "kvtier-shared-tier-unprotected"]
    assert len(messages) == 1 and all(word in messages[0] for word in missing)


def test_loopback_shared_tier_is_not_warned_and_a_password_is_never_echoed():
    configs = load_configs(kvtier_line(redis_url="redis://user:hunter2-pw@localhost:6379/0"), "t", parse_version(V))
    findings = audit(configs)
    assert "kvtier-shared-tier-unprotected" not in {f.rule for f in findings}
    assert "kvtier-redis-password-in-url" in {f.rule for f in findings}
    assert not any("hunter2-pw" in f.message for f in findings)


def _shared_findings(text: str) -> dict[str, str]:
    return {f.rule: f.message for f in audit(load_configs(text, "t", parse_version(V)))
            if f.rule in ("kvtier-shared-tier-unprotected", "kvtier-redis-password-in-url")}


def test_shared_tier_settings_from_kvtier_environment_variables_count():
    # kvtier reads KVTIER_* variables as settings (core/config.py): a URL or secret set there is audited too
    line = "KVTIER_REDIS_URL=redis://:env-pw@kv.internal:6379/0 " + kvtier_line()
    found = _shared_findings(line)
    assert "TLS" in found["kvtier-shared-tier-unprotected"] and "env-pw" not in found["kvtier-redis-password-in-url"]
    quiet = ("KVTIER_REDIS_URL=rediss://kv.internal:6380/0 KVTIER_SHARED_SECRET_FILE=/etc/kvtier/secret "
             + kvtier_line())
    assert _shared_findings(quiet) == {}
    # the serve line's own value wins over the environment, as in kvtier
    assert _shared_findings("KVTIER_REDIS_URL=redis://kv.internal:6379/0 "
                            + kvtier_line(redis_url="redis://127.0.0.1:6379/0")) == {}


def test_all_of_127_8_is_this_host_and_other_password_and_secret_spellings_warn():
    assert _shared_findings(kvtier_line(redis_url="redis://127.0.0.2:6379/0")) == {}
    query = _shared_findings(kvtier_line(redis_url="redis://127.0.0.1:6379/0?password=q-pw-1"))
    assert "password" in query["kvtier-redis-password-in-url"] and "q-pw-1" not in query["kvtier-redis-password-in-url"]
    inline = _shared_findings(kvtier_line(redis_url="rediss://kv.internal:6380/0",
                                          shared_secret="0123456789abcdef-inline"))
    assert "kvtier-shared-tier-unprotected" not in inline  # protected: TLS and a secret
    assert "shared_secret" in inline["kvtier-redis-password-in-url"]
    assert "0123456789abcdef-inline" not in inline["kvtier-redis-password-in-url"]


def _manifest(line: str, env: list[dict[str, str]]) -> str:
    import shlex

    import yaml

    argv = shlex.split(line)
    return yaml.safe_dump({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d"},
                           "spec": {"template": {"spec": {"containers": [
                               {"name": "vllm", "image": "vllm/vllm-openai:v0.32.0", "command": argv[:2],
                                "args": argv[2:], "env": env}]}}}})


def test_kvtier_environment_of_the_audited_line_or_manifest_applies_as_the_connector_does(monkeypatch):
    """Breaker F3: KVTIER_* of the line or manifest were ignored; the connector refuses them."""
    def invalid(text: str) -> list[str]:
        return [f.message for f in audit(load_configs(text, "t", parse_version(V))) if f.rule == "kvtier-config-invalid"]

    typo = invalid("KVTIER_CPU_GB=3 " + kvtier_line(cpu_gib=1))
    assert len(typo) == 1 and "KVTIER_CPU_GB is not a kvtier setting (did you mean 'KVTIER_CPU_GIB'?)" in typo[0]
    bad = invalid(_manifest(kvtier_line(cpu_gib=1), [{"name": "KVTIER_DISK_GIB", "value": "lots"}]))
    assert len(bad) == 1 and "(from environment variable KVTIER_DISK_GIB)" in bad[0] and "'lots'" in bad[0]
    assert invalid(_manifest(kvtier_line(cpu_gib=1), [{"name": "KVTIER_CPU_GIB", "value": "2"}])) == []
    # the auditor's own shell does not count for the audited server, and is left as it was
    monkeypatch.setenv("KVTIER_CPU_GB", "3")
    assert invalid(kvtier_line(cpu_gib=1)) == []
    assert os.environ["KVTIER_CPU_GB"] == "3" and "KVTIER_DISK_GIB" not in os.environ


S3_HTTP = {"tiers": ["cpu", "s3"], "s3_bucket": "kv-cache", "s3_allow_http": True}


def _s3_findings(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for f in audit(load_configs(text, "t", parse_version(V))):
        out.setdefault(f.rule, []).append(f.message)
    return out


@pytest.mark.parametrize("endpoint, extra, warned", [
    ("http://10.0.0.5:9000", {}, True),
    ("http://minio.storage.svc:9000", {}, True),
    ("http://minio.storage.svc:9000", {"shared_secret": "0123456789abcdef-inline"}, False),
    ("https://minio.storage.svc:9000", {}, False),
    ("http://127.0.0.1:9000", {}, False),
    ("http://127.9.9.9:9000", {}, False),
    ("http://localhost:9000", {}, False),
    ("http://[::1]:9000", {}, False),
])
def test_s3_plain_http_beyond_this_host_without_a_secret_is_a_warning(endpoint, extra, warned):
    found = _s3_findings(kvtier_line(**S3_HTTP, s3_endpoint_url=endpoint, **extra))
    assert ("kvtier-tier-exposed" in found) is warned, found
    if warned:
        (message,) = found["kvtier-tier-exposed"]
        assert "plain HTTP" in message and "shared_secret" in message
    assert "kvtier-config-invalid" not in found


def test_s3_endpoint_from_the_line_environment_and_tier_settings_is_audited_too():
    env_line = "KVTIER_S3_ENDPOINT_URL=http://10.0.0.5:9000 " + kvtier_line(**S3_HTTP)
    assert "kvtier-tier-exposed" in _s3_findings(env_line)
    nested = kvtier_line(tiers=["cpu", "s3"], tier_settings={"s3": {
        "s3_bucket": "kv-cache", "s3_allow_http": True, "s3_endpoint_url": "http://10.0.0.5:9000"}})
    assert "kvtier-tier-exposed" in _s3_findings(nested)


@pytest.mark.parametrize("text, where", [
    (kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache", s3_access_key_id="AKIAEXAMPLEKEY01",
                 s3_secret_access_key="wJalrXUtnFEMI-example"), "s3_secret_access_key"),
    (kvtier_line(tiers=["cpu", "s3"], tier_settings={"s3": {"s3_bucket": "kv-cache",
                                                            "aws_secret_access_key": "wJalrXUtnFEMI-example"}}),
     "tier_settings.s3.aws_secret_access_key"),
    (kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache",
                 s3_endpoint_url="https://AKIAEXAMPLEKEY01:wJalrXUtnFEMI-example@minio.example:9000"),
     "s3_endpoint_url"),
    ("AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI-example " + kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache"),
     "AWS_SECRET_ACCESS_KEY"),
])
def test_s3_credentials_in_the_serve_line_are_an_error_and_never_echoed(text, where):
    findings = audit(load_configs(text, "t", parse_version(V)))
    (found,) = [f for f in findings if f.rule == "kvtier-credentials-in-serve-line"]
    assert found.severity == "error" and where in found.message
    assert not any("wJalrXUtnFEMI-example" in f.message or "AKIAEXAMPLEKEY01" in f.message for f in findings)


def test_s3_credentials_from_a_variable_or_a_secret_reference_are_not_flagged():
    line = 'AWS_SECRET_ACCESS_KEY="$AWS_SECRET" ' + kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache")
    assert "kvtier-credentials-in-serve-line" not in _s3_findings(line)
    manifest = _manifest(kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache"),
                         [{"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "k"}}}])
    assert "kvtier-credentials-in-serve-line" not in _s3_findings(manifest)
    literal = _manifest(kvtier_line(tiers=["cpu", "s3"], s3_bucket="kv-cache"),
                        [{"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI-example"}])
    assert "kvtier-credentials-in-serve-line" in _s3_findings(literal)


def _check(**extra: object) -> list[tuple[str, str, str]]:
    from kvtier.integrations.vllm.preflight import check_transfer_config

    cfg = {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_module_path": "kvtier.integrations.vllm", "kv_connector_extra_config": extra}
    return [(p.severity, p.key, p.message) for p in check_transfer_config(cfg, host_checks=False)]


def test_kvtier_check_warns_on_plain_http_beyond_this_host_and_refuses_credential_keys():
    """kvtier check runs the same pre-flight: the tier's advice is a warning, a credential key an error."""
    (warning,) = _check(**S3_HTTP, s3_endpoint_url="http://10.0.0.5:9000")
    assert warning[0] == "warning" and warning[1].endswith("s3_endpoint_url") and "plain HTTP" in warning[2]
    assert _check(**S3_HTTP, s3_endpoint_url="http://127.0.0.1:9000") == []
    leaked = _check(**S3_HTTP, aws_secret_access_key="wJalrXUtnFEMI-example")
    assert [p[0] for p in leaked] == ["error"] and "credential" in leaked[0][2]
    assert "AWS_SECRET_ACCESS_KEY" in leaked[0][2] and "wJalrXUtnFEMI-example" not in leaked[0][2]
    nested = _check(tiers=["cpu", "s3"], tier_settings={"s3": {"s3_bucket": "kv-cache",
                                                               "aws_secret_access_key": "wJalrXUtnFEMI-example"}})
    assert any(p[0] == "error" and "credential" in p[2] for p in nested)
    assert not any("wJalrXUtnFEMI-example" in p[2] for p in nested)


def test_a_misspelt_tier_settings_key_gets_the_closest_one():
    found = _check(tiers=["cpu", "s3"], tier_settings={"s3": {"s3_bucket": "kv-cache", "s3_bukcet": "x"}})
    (error,) = [p for p in found if p[0] == "error"]
    assert "did you mean 's3_bucket'?" in error[2] and "tier_settings.s3.s3_bukcet" in error[2]


def _findings_on(text: str, gpu: str | None) -> dict[str, str]:
    configs = load_configs(text, "test", parse_version(V))
    for config in configs:
        config.gpu = gpu
    return {f.rule: f.message for f in audit(configs)}


@pytest.mark.parametrize("cpu_gib, fires", [(408, True), (847, True), (1904, False)])
def test_a_cpu_tier_is_judged_against_the_engine_cache_of_the_gpu_given(cpu_gib, fires):
    """Llama-3.1-70B at TP 8 on 8× H200 holds 847 GiB of KV (kvtier size); kvtier size's 1,904 GiB tier passes."""
    found = _findings_on(f"{LLAMA70} --kv-offloading-size {cpu_gib}", "H200")
    assert ("cpu-tier-not-above-engine-cache" in found) is fires
    assert "cpu-tier-vs-engine-cache-unknown" not in found
    if fires:
        assert "847 GiB (meta-llama/Llama-3.1-70B at TP 8 on H200" in found["cpu-tier-not-above-engine-cache"]


def test_a_kvtier_cpu_tier_counts_its_disk_tier_and_a_shared_tier_makes_it_staging():
    line = LLAMA70 + " --kv-transfer-config '{}'"
    small = {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_connector_extra_config": {"cpu_gib": 400}}
    assert "cpu-tier-not-above-engine-cache" in _findings_on(line.replace("{}", json.dumps(small)), "H200")
    small["kv_connector_extra_config"] = {"cpu_gib": 4, "disk_path": "/nvme/kv", "disk_gib": 5000}
    assert "cpu-tier-not-above-engine-cache" not in _findings_on(line.replace("{}", json.dumps(small)), "H200")
    small["kv_connector_extra_config"] = {"cpu_gib": 4, "disk_path": "/nvme/kv", "disk_gib": 500}
    assert "cpu-tier-not-above-engine-cache" in _findings_on(line.replace("{}", json.dumps(small)), "H200")
    small["kv_connector_extra_config"] = {"cpu_gib": 4, "redis_url": "redis://127.0.0.1:6379/0"}
    assert "cpu-tier-not-above-engine-cache" not in _findings_on(line.replace("{}", json.dumps(small)), "H200")


@pytest.mark.parametrize("node, fires", [({"node_gib": 1000}, False), ({"node_gib": 500}, True), ({}, False),
                                         ({"node_gib": 1000, "tiers": ["cpu", "disk"]}, True)])
def test_a_node_pool_counts_like_a_disk_tier(node, fires):
    """A cpu tier in front of a node pool larger than the engine's KV cache (847 GiB: Llama-3.1-70B at TP 8 on
    H200) is a staging tier (docs/node.md's example); a pool of unsaid size is a shared tier of unknown size; a
    pool the tiers list leaves out counts nothing."""
    extra = {"cpu_gib": 32, "node_socket": "/dev/shm/kvtier-node/node.sock", **node}
    config = {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}
    line = LLAMA70 + f" --kv-transfer-config '{json.dumps(config)}'"
    assert ("cpu-tier-not-above-engine-cache" in _findings_on(line, "H200")) is fires


def test_an_unknown_model_on_a_given_gpu_is_said_to_be_beyond_the_audit():
    found = _findings_on("vllm serve my-org/my-finetune --kv-offloading-size 64", "H200")
    assert "cannot tell" in found["cpu-tier-vs-engine-cache-unknown"]
    assert "cpu-tier-not-above-engine-cache" not in found
