"""The deployment rules (src/kvtier/audit/rules/deploy.py) on real manifests: the stock-image example
that shipped before issue 24 is flagged, and each rule's edges (image names, install steps, hosts
inside a namespace, the Kubernetes default grace period)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def _audit_cli(target: Path, render: bool) -> subprocess.CompletedProcess[str]:
    """``kvtier audit TARGET --format json``; without ``render`` no kustomize or kubectl is on PATH."""
    env = dict(os.environ)
    if not render:
        env["PATH"] = str(Path(sys.executable).parent)  # the venv's bin: python, no kubectl or kustomize
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "audit", str(target), "--format", "json"],
                          capture_output=True, text=True, check=False, timeout=120, env=env)


def _needs_renderer() -> None:
    from kvtier.audit.kustomize import renderer

    if renderer() is None:
        pytest.skip("neither kustomize nor kubectl is installed: kvtier audit's rendering path is not checked")


@pytest.mark.parametrize("render", [True, False], ids=["kubectl-kustomize", "unrendered"])
def test_audit_applies_a_kustomization_s_namespace_and_patches(tmp_path: Path, render: bool):
    """A base whose pod has a 45 s grace period and a cleartext Redis in namespace llm: both are findings
    until an overlay sets the namespace (`kustomize edit set namespace llm`) and patches the grace period,
    whether kubectl renders the overlay or kvtier reads it without rendering (issue 34)."""
    from tests.audit.test_rules import pod

    if render:
        _needs_renderer()
    base = tmp_path / "base"
    base.mkdir()
    (base / "vllm.yaml").write_text(pod(grace=45, redis_url="redis://kvtier-redis.llm:6379/0"))
    (base / "kustomization.yaml").write_text("resources:\n  - vllm.yaml\n")
    top = tmp_path / "top"
    top.mkdir()
    (top / "kustomization.yaml").write_text("resources:\n  - ../base\n")
    before = _audit_cli(top, render)
    assert before.returncode == 1, before.stderr
    assert {"kvtier-grace-period-too-short", "kvtier-shared-tier-cleartext-beyond-namespace"} <= \
        {f["rule"] for f in json.loads(before.stdout)["findings"]}
    (top / "grace.yaml").write_text("apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: vllm, namespace: inference}\n"
                                    "spec: {template: {spec: {terminationGracePeriodSeconds: 120}}}\n")
    (top / "kustomization.yaml").write_text("resources:\n  - ../base\nnamespace: llm\npatches:\n  - path: grace.yaml\n")
    after = _audit_cli(top, render)
    assert after.returncode == 0, after.stdout + after.stderr
    assert not {"kvtier-grace-period-too-short", "kvtier-shared-tier-cleartext-beyond-namespace"} & \
        {f["rule"] for f in json.loads(after.stdout)["findings"]}, after.stdout


def test_audit_refuses_what_it_cannot_read_without_rendering(tmp_path: Path):
    from tests.audit.test_rules import pod

    (tmp_path / "vllm.yaml").write_text(pod())
    (tmp_path / "kustomization.yaml").write_text(
        "resources:\n  - vllm.yaml\nconfigMapGenerator:\n  - name: c\n    literals: [a=b]\n")
    refused = _audit_cli(tmp_path, render=False)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip() == (
        f"error: {tmp_path / 'kustomization.yaml'} uses configMapGenerator, which kvtier audit does not apply "
        f"without kustomize or kubectl on PATH; render it first: kubectl kustomize {tmp_path} | kvtier audit -")
    (tmp_path / "kustomization.yaml").write_text(
        "resources:\n  - vllm.yaml\npatches:\n  - patch: '[{op: replace, path: /spec/replicas, value: 2}]'\n"
        "    target: {kind: Deployment}\n")
    json_patch = _audit_cli(tmp_path, render=False)
    assert json_patch.returncode == 2 and "JSON 6902 patch" in json_patch.stderr, json_patch.stderr


def test_audit_says_why_a_kustomization_does_not_render(tmp_path: Path):
    from tests.audit.test_rules import pod

    _needs_renderer()
    (tmp_path / "vllm.yaml").write_text(pod())
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - vllm.yaml\npatches:\n  - path: missing.yaml\n")
    failed = _audit_cli(tmp_path, render=True)
    assert failed.returncode == 2 and failed.stdout == "", failed.stdout
    (line,) = failed.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"kustomize {tmp_path} failed: " in line and "missing.yaml" in line, line
    assert line.endswith("; fix the kustomization so that it renders."), line


def test_a_kustomization_read_without_rendering_is_what_kubectl_renders(tmp_path: Path):
    """namespace, images, patches (a file, an inline patch with a target) and patchesStrategicMerge, read
    by kvtier without kustomize, give the documents `kubectl kustomize` renders."""
    from kvtier.audit.kustomize import read_kustomization
    from tests.audit.test_rules import pod

    _needs_renderer()
    base = tmp_path / "base"
    base.mkdir()
    (base / "vllm.yaml").write_text(pod(grace=45) + "---\napiVersion: v1\nkind: Service\nmetadata: {name: vllm}\n"
                                    "spec: {ports: [{port: 8000}]}\n")
    (base / "kustomization.yaml").write_text("resources:\n  - vllm.yaml\n")
    (tmp_path / "env.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: vllm, namespace: inference}\nspec: {template: {spec: {containers: "
        "[{name: vllm, env: [{name: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, value: '40'}, {name: X, value: y}]}]}}}\n")
    (tmp_path / "mount.yaml").write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: vllm, namespace: inference}\nspec: {template: {spec: {containers: "
        "[{name: vllm, volumeMounts: [{name: nvme, mountPath: /nvme, readOnly: true}]}]}}}\n")
    (tmp_path / "kustomization.yaml").write_text(
        "resources:\n  - base\nnamespace: llm\n"
        "images:\n  - {name: registry.example.com/kvtier-vllm, newName: r.example.org/kv, newTag: v0.32.0-kvtier0.1.1}\n"
        "patches:\n  - path: env.yaml\n"
        "  - target: {kind: Deployment, name: vllm}\n"
        "    patch: |\n      apiVersion: apps/v1\n      kind: Deployment\n      metadata: {name: ignored}\n"
        "      spec: {template: {spec: {terminationGracePeriodSeconds: 120}}}\n"
        "patchesStrategicMerge:\n  - mount.yaml\n")

    def documents(render: bool) -> list[str]:
        text = read_kustomization(tmp_path, 1 << 20, render=render)
        return sorted(json.dumps(d, sort_keys=True) for d in yaml.safe_load_all(text) if d)

    rendered = documents(True)
    assert any('"image": "r.example.org/kv:v0.32.0-kvtier0.1.1"' in d and '"terminationGracePeriodSeconds": 120' in d
               and '"value": "40"' in d and '"readOnly": true' in d and '"namespace": "llm"' in d for d in rendered)
    assert documents(False) == rendered
