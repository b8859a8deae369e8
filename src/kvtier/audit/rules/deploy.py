"""What breaks a kvtier deployment before or after it starts: an image without kvtier, a graceful
stop that cannot flush (no ``--shutdown-timeout``, a grace period shorter than the flush), a disk
tier on the container's own writable layer, and a shared tier reached across the cluster in clear.

The pod facts (grace period, volume mounts, namespace) come from Kubernetes manifests
(:class:`~kvtier.audit.model.PodFacts`); on a plain serve line only the image and the
``--shutdown-timeout`` rules can apply.
"""

from __future__ import annotations

import ipaddress
import math
import posixpath
import re
from typing import Any
from urllib.parse import urlsplit

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule
from kvtier.core.config import KVTierConfig

_DOCS = "kvtier docs/deploy.md"
K8S_DEFAULT_GRACE_S = 30.0
"""``terminationGracePeriodSeconds`` when a pod spec leaves it out (Kubernetes PodSpec reference,
kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1/)."""

STOCK_VLLM_IMAGES = ("vllm/vllm-openai", "vllm/vllm-openai-cpu", "vllm/vllm-cpu")
"""Repositories of vLLM's own images (hub.docker.com/u/vllm): they do not contain kvtier."""

_INSTALL = re.compile(r"\b(pip3?|uv\s+pip|python3?\s+-m\s+pip)\s+install\b[^;&|]*\bkvtier", re.IGNORECASE)


def _kvtier_extra(c: ServeConfig) -> dict[str, Any] | None:
    """The KVTierConnector's settings: ``kv_connector_extra_config`` over the ``KVTIER_*`` variables
    of the line or manifest (kvtier reads both, src/kvtier/core/config.py); None without kvtier."""
    if not c.uses("KVTierConnector"):
        return None
    settings: dict[str, Any] = {name[len("KVTIER_"):].lower(): value for name, value in c.env.items()
                                if name.upper().startswith("KVTIER_")}
    settings.update(c.connector_extra)
    return settings


def _number(value: Any, default: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if math.isfinite(number) else default


def _disk_tier(extra: dict[str, Any]) -> str | None:
    """``disk_path`` when the disk tier is on (a path, disk_gib > 0, "disk" in tiers if given)."""
    path = extra.get("disk_path")
    tiers = extra.get("tiers")
    if not isinstance(path, str) or not path or _number(extra.get("disk_gib"), 0.0) <= 0:
        return None
    if isinstance(tiers, list) and "disk" not in tiers:
        return None
    return path


def _repository(image: str) -> str:
    """``vllm/vllm-openai`` of ``docker.io/vllm/vllm-openai:v0.32.0`` (registry, tag and digest dropped)."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name[: len(name) - len(last[-1])] + last[-1].split(":", 1)[0]
    parts = name.split("/")
    if len(parts) > 2 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]
    if parts[:1] == ["library"]:
        parts = parts[1:]
    return "/".join(parts).lower()


@rule("kvtier-image-without-kvtier", "error", "KVTierConnector configured on a stock vLLM image with no kvtier",
      "Build the image of deploy/Dockerfile (vLLM's image plus the kvtier wheel, pinned) and run that; or install "
      "kvtier in the container's command before vLLM starts (pip install kvtier==X.Y.Z && vllm serve ...).",
      f"{_DOCS} § The image; deploy/Dockerfile", locate="vllm/vllm-openai")
def kvtier_image_without_kvtier(c: ServeConfig) -> str | None:
    if not c.uses("KVTierConnector") or not c.image:
        return None
    if _repository(c.image) not in STOCK_VLLM_IMAGES or _INSTALL.search(c.launch):
        return None
    return (f"image {c.image} is vLLM's own and nothing in the container's command installs kvtier, so vLLM "
            "cannot import kv_connector_module_path kvtier.integrations.vllm and the server dies at start-up.")


@rule("kvtier-no-shutdown-timeout", "warning", "disk tier configured but no --shutdown-timeout",
      "Add --shutdown-timeout 30 (seconds; kvtier size prints it in its recipe) and give the pod a grace period of "
      "at least shutdown_flush_s + that timeout.",
      "vLLM vllm/engine/arg_utils.py shutdown_timeout (default 0: abort on SIGTERM); kvtier docs/deploy.md § Grace "
      "periods", locate="KVTierConnector")
def kvtier_no_shutdown_timeout(c: ServeConfig) -> str | None:
    extra = _kvtier_extra(c)
    if extra is None or _disk_tier(extra) is None or c.has("--shutdown-timeout"):
        return None
    return ("a disk tier is configured but the serve line has no --shutdown-timeout, so on SIGTERM vLLM "
            "force-kills its engine core at once and kvtier's graceful-stop flush of the hot set to disk never runs.")


def _flush_s(extra: dict[str, Any]) -> float:
    default = float(KVTierConfig.model_fields["shutdown_flush_s"].default)
    return max(_number(extra.get("shutdown_flush_s"), default), 0.0)


@rule("kvtier-grace-period-too-short", "error",
      "pod grace period shorter than --shutdown-timeout + shutdown_flush_s",
      "Set terminationGracePeriodSeconds to at least --shutdown-timeout + shutdown_flush_s (plus a margin for "
      "the API server to exit), e.g. 90 for 30 + 30.",
      f"Kubernetes pod termination (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/); {_DOCS} § Grace "
      "periods", locate="terminationGracePeriodSeconds")
def kvtier_grace_period_too_short(c: ServeConfig) -> str | None:
    extra = _kvtier_extra(c)
    if extra is None or c.pod is None or _disk_tier(extra) is None:
        return None
    timeout = max(c.number("--shutdown-timeout") or 0.0, 0.0)
    flush = _flush_s(extra)
    grace = c.pod.grace_period_s
    given = K8S_DEFAULT_GRACE_S if grace is None else grace
    if given >= timeout + flush:
        return None
    said = (f"terminationGracePeriodSeconds is {given:g}" if grace is not None
            else f"terminationGracePeriodSeconds is unset ({K8S_DEFAULT_GRACE_S:g} s by default)")
    return (f"{said}, less than --shutdown-timeout {timeout:g} s + shutdown_flush_s {flush:g} s = "
            f"{timeout + flush:g} s, so the kubelet SIGKILLs the pod before kvtier has flushed its hot set to disk.")


def _under(path: str, mount: str) -> bool:
    path, mount = posixpath.normpath(path), posixpath.normpath(mount)
    return path == mount or path.startswith(mount.rstrip("/") + "/")


@rule("kvtier-disk-path-not-on-volume", "error", "disk_path not on a volume mounted in the container",
      "Mount a volume at disk_path (or a parent): a local NVMe PersistentVolume, a hostPath on the NVMe, or an "
      "emptyDir with a sizeLimit above disk_gib; see deploy/kubernetes/.",
      f"Kubernetes volumes (kubernetes.io/docs/concepts/storage/volumes/); {_DOCS} § NVMe volumes",
      locate="disk_path")
def kvtier_disk_path_not_on_volume(c: ServeConfig) -> str | None:
    extra = _kvtier_extra(c)
    if extra is None or c.pod is None:
        return None
    path = _disk_tier(extra)
    if path is None or any(_under(path, mount) for mount in c.pod.mount_paths):
        return None
    return (f"disk_path {path} is not under any volumeMount of the container, so the disk tier writes into the "
            "container's own writable layer: the root disk's space, counted as ephemeral storage (the kubelet "
            "evicts the pod when it fills) and lost at every restart.")


def _inside_namespace(host: str, c: ServeConfig) -> bool:
    """Whether ``host`` names a Service (or a pod of a headless Service) in the pod's own namespace."""
    assert c.pod is not None
    host = host.lower().rstrip(".")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "localhost":
        return True
    labels = host.split(".")
    if len(labels) == 1:
        return True  # a Service name resolves in the pod's namespace (DNS for Services and Pods)
    namespace = c.pod.namespace
    if len(labels) == 2:
        return labels[1] in c.pod.services or (namespace is not None and labels[1] == namespace)
    for suffix in (("svc",), ("svc", "cluster", "local")):
        if tuple(labels[-len(suffix):]) == suffix:
            ns = labels[-len(suffix) - 1]
            return namespace is not None and ns == namespace
    return False


@rule("kvtier-shared-tier-cleartext-beyond-namespace", "error",
      "shared tier reached outside the pod's namespace without TLS",
      "Use rediss:// with redis_tls_ca_file (deploy/kubernetes/ shows one), or run the Redis/Valkey tier as a "
      "Service in the same namespace.",
      "Kubernetes DNS for Services and Pods (kubernetes.io/docs/concepts/services-networking/dns-pod-service/); "
      "kvtier docs/shared-tier.md", locate="redis_url")
def kvtier_shared_tier_cleartext_beyond_namespace(c: ServeConfig) -> str | None:
    extra = _kvtier_extra(c)
    if extra is None or c.pod is None:
        return None
    url = extra.get("redis_url")
    tiers = extra.get("tiers")
    if not isinstance(url, str) or (isinstance(tiers, list) and "redis" not in tiers):
        return None
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return None  # kvtier-config-invalid names a malformed URL
    if parts.scheme == "rediss" or not host or _inside_namespace(host, c):
        return None
    return (f"redis_url is redis:// to {host}, a host outside the pod's namespace, so KV blocks and the Redis "
            "password cross the cluster network in clear.")
