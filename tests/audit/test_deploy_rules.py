"""The deployment rules (src/kvtier/audit/rules/deploy.py) on real manifests: the stock-image example
that shipped before issue 24 is flagged, and each rule's edges (image names, install steps, hosts
inside a namespace, the Kubernetes default grace period)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.rules.deploy import _repository
from kvtier.audit.versions import parse_version

DATA = Path(__file__).parent / "data"
V = parse_version("0.32.0")


def findings(text: str) -> dict[str, str]:
    return {f.rule: f.message for f in audit(load_configs(text, "t", V))}


def test_the_old_stock_image_manifest_is_flagged():
    """deploy/kubernetes/kvtier-shared-tier.yaml as it shipped: vllm/vllm-openai with KVTierConnector and no
    install step; audit said "No findings".  With a disk tier added it also lacks --shutdown-timeout, a grace
    period and a volume for disk_path."""
    text = (DATA / "stock-image-shared-tier.yaml").read_text()
    found = findings(text)
    assert found["kvtier-image-without-kvtier"].startswith("image vllm/vllm-openai:v0.32.0 is vLLM's own"), found
    with_disk = text.replace('"cpu_gib":32,', '"cpu_gib":32,"disk_path":"/var/lib/kvtier","disk_gib":400,')
    assert with_disk != text
    found = findings(with_disk)
    assert {"kvtier-image-without-kvtier", "kvtier-no-shutdown-timeout", "kvtier-disk-path-not-on-volume"} \
        <= set(found), found
    with_timeout = findings(with_disk.replace('- "8000"', '- "8000"\n            - --shutdown-timeout\n            - "30"'))
    assert with_timeout["kvtier-grace-period-too-short"].startswith(
        "terminationGracePeriodSeconds is unset (30 s by default), less than --shutdown-timeout 30 s + "
        "shutdown_flush_s 30 s = 60 s"), with_timeout
    # no --shutdown-timeout and the default 30 s grace: 30 >= 0 + 30 holds, so the grace rule is quiet and
    # the missing timeout is the finding; a shorter grace is then named with its arithmetic
    short = findings(with_disk.replace("    spec:\n      containers:\n        - name: vllm",
                                       "    spec:\n      terminationGracePeriodSeconds: 20\n      containers:\n"
                                       "        - name: vllm"))
    assert short["kvtier-grace-period-too-short"] == (
        "terminationGracePeriodSeconds is 20, less than --shutdown-timeout 0 s + shutdown_flush_s 30 s = 30 s, so "
        "the kubelet SIGKILLs the pod before kvtier has flushed its hot set to disk."), short


def test_image_repository_names():
    assert _repository("vllm/vllm-openai:v0.32.0") == "vllm/vllm-openai"
    assert _repository("docker.io/vllm/vllm-openai@sha256:abc") == "vllm/vllm-openai"
    assert _repository("localhost:5000/vllm/vllm-openai:v0.32.0") == "vllm/vllm-openai"
    assert _repository("ghcr.io/acme/kvtier-vllm:0.1.0") == "acme/kvtier-vllm"


def _manifest(redis_url: str, namespace: str | None = "inference", services: tuple[str, ...] = (),
              **settings: object) -> str:
    extra = {"cpu_gib": 8, "redis_url": redis_url, "tiers": ["cpu", "redis"], **settings}
    cfg = {"kv_connector": "KVTierConnector", "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
           "kv_connector_module_path": "kvtier.integrations.vllm", "kv_connector_extra_config": extra}
    metadata: dict[str, object] = {"name": "vllm", **({"namespace": namespace} if namespace else {})}
    docs = [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": s}, "spec": {}} for s in services]
    docs.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata, "spec": {"template": {"spec": {
        "containers": [{"name": "vllm", "image": "acme/kvtier-vllm:0.1.0",
                        "args": ["vllm", "serve", "m", "--kv-transfer-config", json.dumps(cfg)]}]}}}})
    return yaml.safe_dump_all(docs, width=10_000)


def test_cleartext_shared_tier_inside_and_outside_the_namespace():
    rule = "kvtier-shared-tier-cleartext-beyond-namespace"
    inside = ["redis://kvtier-redis:6379/0", "redis://kvtier-redis.inference:6379/0",
              "redis://kvtier-redis.inference.svc.cluster.local:6379/0", "redis://kvtier-redis.inference.svc:6379",
              "redis://127.0.0.1:6379/0"]
    for url in inside:
        assert rule not in findings(_manifest(url)), url
    # a pod of a headless Service of the same file: <pod>.<service>
    assert rule not in findings(_manifest("redis://kvtier-redis-0.kvtier-redis:6379/0", services=("kvtier-redis",)))
    outside = ["redis://kvtier-redis.shared.svc.cluster.local:6379/0", "redis://10.0.0.5:6379/0",
               "redis://cache.example.com:6379/0", "redis://kvtier-redis-0.kvtier-redis:6379/0"]
    for url in outside:
        assert rule in findings(_manifest(url)), url
        assert rule not in findings(_manifest(url.replace("redis://", "rediss://"))), url
    # no namespace in the manifest: only a bare Service name is known to be inside
    assert rule in findings(_manifest("redis://kvtier-redis.inference.svc.cluster.local:6379/0", namespace=None))
    assert rule not in findings(_manifest("redis://kvtier-redis:6379/0", namespace=None))


def test_a_tiers_list_that_leaves_a_tier_out_quiets_its_deployment_rules():
    """The rules find the tier a key asks for in the registry (its record's ``keys``), then read the raw
    ``tiers`` list: a tier left out of it is not deployed, so its rules say nothing."""
    outside = "redis://cache.example.com:6379/0"
    disk_rules = {"kvtier-no-shutdown-timeout", "kvtier-disk-path-not-on-volume", "kvtier-worker-shutdown-timeout-short"}
    both = findings(_manifest(outside, disk_path="/var/lib/kvtier", disk_gib=100, tiers=["cpu", "disk", "redis"]))
    assert disk_rules | {"kvtier-shared-tier-cleartext-beyond-namespace"} <= set(both), both
    no_disk = findings(_manifest(outside, disk_path="/var/lib/kvtier", disk_gib=100, tiers=["cpu", "redis"]))
    assert "kvtier-shared-tier-cleartext-beyond-namespace" in no_disk and not disk_rules & set(no_disk), no_disk
    no_redis = findings(_manifest(outside, disk_path="/var/lib/kvtier", disk_gib=100, tiers=["cpu", "disk"]))
    assert disk_rules <= set(no_redis) and "kvtier-shared-tier-cleartext-beyond-namespace" not in no_redis, no_redis


def test_audit_reads_a_kustomize_directory_and_refuses_what_it_cannot_render(tmp_path: Path):
    from tests.audit.test_rules import pod

    base = tmp_path / "base"
    base.mkdir()
    (base / "vllm.yaml").write_text(pod(grace=45))
    (base / "kustomization.yaml").write_text("resources:\n  - vllm.yaml\n")
    top = tmp_path / "top"
    top.mkdir()
    (top / "kustomization.yaml").write_text("resources:\n  - ../base\n")
    def run(target: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", str(target), "--format", "json"],
                              capture_output=True, text=True, check=False, timeout=60)

    found = run(top)
    assert found.returncode == 1, found.stderr
    assert "kvtier-grace-period-too-short" in {f["rule"] for f in json.loads(found.stdout)["findings"]}
    (top / "kustomization.yaml").write_text("resources:\n  - ../base\npatches:\n  - path: p.yaml\n")
    refused = run(top)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == (f"error: {top / 'kustomization.yaml'} uses patches, which kvtier audit does not "
                                      f"apply; render it first: kubectl kustomize {top} | kvtier audit -")
