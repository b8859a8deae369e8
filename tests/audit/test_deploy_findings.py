"""The deployment rules on variants of the shipped local-tiers manifest, one fact changed each
(issue 24: a fresh-eyes tester's findings 1, 2, 6, 7, 9 and 11, each "No findings" before)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.audit.engine import audit
from kvtier.audit.loader import load_configs
from kvtier.audit.rules.deploy import _installs_kvtier
from kvtier.core.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = (ROOT / "deploy" / "kubernetes" / "local-tiers" / "vllm.yaml").read_text()


def found(text: str) -> dict[str, str]:
    return {f.rule: f.message for f in audit(load_configs(text, "t"))}


def variant(old: str, new: str) -> dict[str, str]:
    assert old in SHIPPED, old
    return found(SHIPPED.replace(old, new))


def test_the_shipped_manifest_is_clean():
    assert found(SHIPPED) == {}


@pytest.mark.parametrize("value", ['"0"', '"-5"', "abc", '"0.0"'])
def test_a_shutdown_timeout_that_is_not_positive_is_a_missing_one(value):
    """vLLM's default 0 force-kills the engine core: 0, negatives and non-numbers run no flush."""
    message = variant('- --shutdown-timeout\n            - "30"', f"- --shutdown-timeout\n            - {value}")[
        "kvtier-no-shutdown-timeout"]
    assert f"--shutdown-timeout is {value.strip(chr(34))}, not a positive number of seconds" in message


def test_a_shutdown_timeout_flag_without_value_is_flagged():
    text = SHIPPED.replace('            - --shutdown-timeout\n            - "30"\n', "") \
        .replace("            - Qwen/Qwen3-8B\n", "            - Qwen/Qwen3-8B\n            - --shutdown-timeout\n")
    messages = found(text)
    assert "kvtier-no-shutdown-timeout" in messages, messages


def test_worker_shutdown_timeout_must_cover_the_flush():
    entry = '- {name: VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, value: "35"}'
    unset = variant(entry, "- {name: OTHER, value: x}")["kvtier-worker-shutdown-timeout-short"]
    assert unset.startswith("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS is unset (5 s by default), less than "
                            "shutdown_flush_s 30 s + 5 s = 35 s"), unset
    assert "kvtier-worker-shutdown-timeout-short" in variant(entry, entry.replace('"35"', '"5"'))
    assert "int()" in variant(entry, entry.replace('"35"', '"35.5"'))["kvtier-worker-shutdown-timeout-short"]
    # shutdown_flush_s 120 with grace 200: the grace period is enough, the workers' 35 s is not
    flush120 = SHIPPED.replace('"shutdown_flush_s":30', '"shutdown_flush_s":120').replace(
        "terminationGracePeriodSeconds: 90", "terminationGracePeriodSeconds: 200")
    assert set(found(flush120)) == {"kvtier-worker-shutdown-timeout-short"}


@pytest.mark.parametrize("grace", ['"90"', "abc", "1e9", "-5", "60.5", "true"])
def test_a_grace_period_of_the_wrong_type_is_refused(grace):
    """A string (YAML 1e9 is one), a negative or a fractional grace period is not "unset": Kubernetes
    refuses it, and the audit exits 2 with a type message, as audit.md says."""
    with pytest.raises(UserError, match="terminationGracePeriodSeconds must be a whole number of seconds >= 0"):
        load_configs(SHIPPED.replace("terminationGracePeriodSeconds: 90", f"terminationGracePeriodSeconds: {grace}"),
                     "t")


def test_the_volume_under_disk_path_must_be_writable_nvme_of_disk_gib_plus_ten_percent():
    mount = "- {name: kvtier-disk, mountPath: /var/lib/kvtier}"
    ro = variant(mount, "- {name: kvtier-disk, mountPath: /var/lib/kvtier, readOnly: true}")
    assert "is mounted readOnly" in ro["kvtier-disk-volume-unfit"], ro
    shm = variant('"disk_path":"/var/lib/kvtier/disk"', '"disk_path":"/dev/shm/kvtier"')
    assert "medium Memory" in shm["kvtier-disk-volume-unfit"], shm
    small = variant("requests: {storage: 900Gi}", "requests: {storage: 10Gi}")["kvtier-disk-volume-unfit"]
    assert "holds 10 GiB (volumeClaimTemplates kvtier-disk request 10Gi), less than disk_gib 800 + 10 % = 880 GiB" \
        in small, small
    assert "kvtier-disk-volume-unfit" not in variant("requests: {storage: 900Gi}", "requests: {storage: 880Gi}")
    empty = SHIPPED.replace("        - name: dshm\n", "        - name: kvtier-disk\n          emptyDir: {sizeLimit: 1Gi}\n"
                            "        - name: dshm\n")
    assert "emptyDir sizeLimit 1Gi" in found(empty)["kvtier-disk-volume-unfit"]
    pvc = SHIPPED.replace("        - name: dshm\n", "        - name: kvtier-disk\n          persistentVolumeClaim: "
                          "{claimName: nvme}\n        - name: dshm\n") + (
        "---\napiVersion: v1\nkind: PersistentVolumeClaim\nmetadata: {name: nvme}\n"
        "spec: {resources: {requests: {storage: 0.5Ti}}}\n")
    assert "PersistentVolumeClaim nvme request 0.5Ti" in found(pvc)["kvtier-disk-volume-unfit"]


@pytest.mark.parametrize(("launch", "installs"), [
    ("pip install kvtier && exec vllm serve M", True),
    ("pip install kvtier==0.1.0 && vllm serve M", True),
    ("pip3 install 'kvtier[redis]>=0.1' && vllm serve M", True),
    ("python -m pip install --no-deps /wheels/kvtier-0.1.0-py3-none-any.whl; vllm serve M", True),
    ("pip install kvtier-utils && exec vllm serve M", False),
    ("pip install kvtierx==1.0 && vllm serve M", False),
    ("pip install --dry-run kvtier && vllm serve M", False),
    ("pip install numpy && echo kvtier && vllm serve M", False),
])
def test_only_the_kvtier_package_counts_as_installing_kvtier(launch, installs):
    assert _installs_kvtier(launch) is installs


@pytest.mark.parametrize(("image", "flagged"), [
    ("registry.example.com/kvtier-vllm:v0.31.0-kvtier0.1.0", True),
    ("registry.example.com/kvtier-vllm:v0.35.0-kvtier0.1.0", True),
    ("registry.example.com/kvtier-vllm:v0.35.0rc1-kvtier0.1.0", True),  # <0.35 admits no 0.35 pre-release
    ("registry.example.com/kvtier-vllm:v0.22.0-kvtier0.1.0", True),
    ("registry.example.com/kvtier-vllm:v0.32.0-kvtier0.2.0", False),
    ("registry.example.com/kvtier-vllm:v0.33.0-kvtier0.1.0", False),  # API-checked (scripts/vllm_compat.py)
    ("registry.example.com/kvtier-vllm:v0.34.1-kvtier0.1.0", False),
    ("registry.example.com/acme-inference:1.4", False),  # not clearly a vLLM version
    ("registry.example.com/kvtier-vllm:v0.32-kvtier0.1.0", False),  # 0.32 is 0.32.0 (PEP 440)
    ("registry.example.com/kvtier-vllm:v0.32.0rc1-kvtier0.1.0", True),  # an rc comes before its release
])
def test_kvtier_on_another_vllm_is_an_error(image, flagged):
    messages = variant("image: registry.example.com/kvtier-vllm:v0.32.0-kvtier0.1.0", f"image: {image}")
    assert ("kvtier-unsupported-vllm" in messages) is flagged, messages
    if flagged:
        assert "kvtier supports vLLM 0.32.x, 0.33.x and 0.34.x" in messages["kvtier-unsupported-vllm"]


@pytest.mark.parametrize(("limit", "cpu_gib", "flagged"), [
    ("64Gi", 128, True), ("64Gi", 56, False), ("64Gi", 57, True), ("68719476736", 60, True), ("100G", 84, False),
    ("100G", 86, True), ("65536Mi", 56, False), ("70000M", 60, True)])
def test_a_cpu_tier_larger_than_the_memory_limit_is_an_error(limit, cpu_gib, flagged):
    """The cpu tier's pool is faulted in at start-up and counts against the container's memory limit
    (docs/deploy.md): cpu_gib plus 8 GiB for vLLM over the limit is an OOM kill at start-up (fresh-user
    tester: cpu_gib 128 in a 64Gi pod said "No findings"). Quantities in Gi, G, Mi, M and plain bytes."""
    text = SHIPPED.replace('"cpu_gib":32', f'"cpu_gib":{cpu_gib}').replace(
        "memory: 64Gi, ephemeral", f"memory: {limit!r}, ephemeral")
    message = found(text).get("kvtier-cpu-tier-over-memory-limit")
    assert (message is not None) is flagged, message
    if flagged:
        assert f"cpu_gib {cpu_gib} GiB" in message and f"memory limit {limit}" in message, message


def test_a_cpu_tier_spread_over_nodes_counts_its_share():
    text = SHIPPED.replace('"cpu_gib":32', '"cpu_gib":128')
    assert "kvtier-cpu-tier-over-memory-limit" in found(text)
    assert "- --shutdown-timeout" in text
    spread = found(text.replace("- --shutdown-timeout", "- --nnodes\n            - \"4\"\n            - --shutdown-timeout", 1))
    assert "kvtier-cpu-tier-over-memory-limit" not in spread, spread
