"""What breaks a kvtier deployment before or after it starts: an image without kvtier, a graceful
stop that cannot flush (no ``--shutdown-timeout``, a grace period shorter than the flush), a disk
tier on the container's own writable layer, and a shared tier reached across the cluster in clear.

The pod facts (grace period, volume mounts, namespace) come from Kubernetes manifests
(:class:`~kvtier.audit.model.PodFacts`); on a plain serve line only the image and the
``--shutdown-timeout`` rules can apply.
"""

from __future__ import annotations

import math
import posixpath
import re
from typing import Any
from urllib.parse import urlsplit

from kvtier.audit.k8s_volumes import quantity_gib
from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule
from kvtier.audit.rules.settings import disk_tier, kvtier_settings, left_out, number, refused, under
from kvtier.audit.versions import version_from_image
from kvtier.core.config import KVTierConfig
from kvtier.core.hosts import is_loopback_host
from kvtier.integrations.vllm.compat import ENGINE_TESTED, SUPPORTED_RANGE, SUPPORTED_TEXT, is_supported

_DOCS = "kvtier docs/deploy.md"
K8S_DEFAULT_GRACE_S = 30.0
"""``terminationGracePeriodSeconds`` when a pod spec leaves it out (Kubernetes PodSpec reference,
kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1/)."""

STOCK_VLLM_IMAGES = ("vllm/vllm-openai", "vllm/vllm-openai-cpu", "vllm/vllm-cpu")
"""Repositories of vLLM's own images (hub.docker.com/u/vllm): they do not contain kvtier."""

_INSTALL = re.compile(r"\b(?:pip3?|uv\s+pip|python3?\s+-m\s+pip)\s+install\b([^;&|]*)", re.IGNORECASE)
_KVTIER_REQUIREMENT = re.compile(
    r"^(?:kvtier(?:\[[^\]]*\])?(?:(?:===|==|>=|<=|~=|!=|>|<)\S+)?|(?:\S*/)?kvtier-[^/]*\.whl)$", re.IGNORECASE)
"""The kvtier package itself as a pip requirement: ``kvtier``, ``kvtier==0.1.0``, ``kvtier[extra]``, a path to
a kvtier wheel; not ``kvtier-utils`` or ``kvtierx`` (PEP 508 names; wheel file names are ``name-version-...``)."""


def _installs_kvtier(launch: str) -> bool:
    """Whether a ``pip install`` in ``launch`` installs the kvtier package (not a dry run)."""
    for match in _INSTALL.finditer(launch):
        words = [w.strip("'\"") for w in match.group(1).split()]
        if "--dry-run" in words:
            continue
        if any(_KVTIER_REQUIREMENT.match(w) for w in words if not w.startswith("-")):
            return True
    return False










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
    if _repository(c.image) not in STOCK_VLLM_IMAGES or _installs_kvtier(c.launch):
        return None
    return (f"image {c.image} is vLLM's own and nothing in the container's command installs kvtier, so vLLM "
            "cannot import kv_connector_module_path kvtier.integrations.vllm and the server dies at start-up.")


@rule("kvtier-no-shutdown-timeout", "warning", "disk tier configured but no positive --shutdown-timeout",
      "Add --shutdown-timeout 30 (seconds; kvtier size prints it in its recipe) and give the pod a grace period of "
      "at least shutdown_flush_s + that timeout.",
      "vLLM vllm/engine/arg_utils.py shutdown_timeout (default 0: abort on SIGTERM); kvtier docs/deploy.md § Grace "
      "periods", locate="KVTierConnector")
def kvtier_no_shutdown_timeout(c: ServeConfig) -> str | None:
    extra = kvtier_settings(c)
    if extra is None or disk_tier(extra) is None:
        return None
    if not c.has("--shutdown-timeout"):
        said = "the serve line has no --shutdown-timeout"
    else:
        raw = c.value("--shutdown-timeout")
        timeout_s = number(raw, math.nan)
        if timeout_s > 0:
            return None
        said = ("--shutdown-timeout has no value" if raw is None
                else f"--shutdown-timeout is {raw}, not a positive number of seconds")
    return (f"a disk tier is configured but {said}, so on SIGTERM vLLM force-kills its engine core at once "
            "(0, its default, aborts) and kvtier's graceful-stop flush of the hot set to disk never runs.")


WORKER_EXIT_MARGIN_S = 5.0
"""Seconds a worker needs after its flush to exit (the shipped manifests: 35 for shutdown_flush_s 30)."""
VLLM_WORKER_SHUTDOWN_DEFAULT_S = 5


@rule("kvtier-worker-shutdown-timeout-short", "warning",
      "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS shorter than shutdown_flush_s + 5 s with a disk tier",
      "Set VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS to a whole number of at least shutdown_flush_s + 5 (35 for the "
      "default 30) in the container's environment.",
      "vLLM 0.32 vllm/v1/executor/multiproc_executor.py _ensure_worker_termination (waits "
      "int(VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS), default 5 in vllm/envs.py, for workers to exit, then SIGTERM, "
      "SIGKILL 4 s later) and vllm/v1/engine/core_client.py (the same wait for the engine core); "
      f"{_DOCS} § Grace periods", locate="KVTierConnector")
def kvtier_worker_shutdown_timeout_short(c: ServeConfig) -> str | None:
    extra = kvtier_settings(c)
    if extra is None or disk_tier(extra) is None:
        return None
    need = _flush_s(extra) + WORKER_EXIT_MARGIN_S
    raw = c.env.get("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS")
    if raw is None:
        said = f"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS is unset ({VLLM_WORKER_SHUTDOWN_DEFAULT_S} s by default)"
    else:
        try:
            value = int(raw.strip())
        except ValueError:
            return (f"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS is {raw!r}, which vLLM reads with int() and so fails on "
                    "at shutdown; give a whole number of seconds such as 35.")
        if value >= need:
            return None
        said = f"VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS is {value}"
    return (f"{said}, less than shutdown_flush_s {_flush_s(extra):g} s + {WORKER_EXIT_MARGIN_S:g} s = {need:g} s, "
            "so vLLM SIGTERMs its workers while kvtier is still flushing the hot set to disk.")


@rule("kvtier-unsupported-vllm", "error", "KVTierConnector on a vLLM release kvtier does not support",
      f"Run kvtier on vLLM {SUPPORTED_TEXT} (deploy/Dockerfile builds on the engine-tested "
      f"v{ENGINE_TESTED}), or a kvtier release that supports this vLLM.",
      "kvtier docs/vllm.md § Supported vLLM versions (kvtier.integrations.vllm.compat SUPPORTED_VLLM)",
      locate="KVTierConnector")
def kvtier_unsupported_vllm(c: ServeConfig) -> str | None:
    if not c.uses("KVTierConnector") or c.version is None or is_supported(c.version):
        return None  # 0.32 is 0.32.0 (PEP 440); an rc or dev build of 0.32.0 comes before it (audit.md)
    from_tag = c.image is not None and version_from_image(c.image) == c.version
    if from_tag and "vllm" not in _repository(c.image or "").rsplit("/", 1)[-1]:
        return None  # a tag of some other image that happens to start with a number: not clearly vLLM's
    where = f"the image tag of {c.image}" if from_tag else "--vllm-version"
    return (f"{where} names vLLM {c.version}, but kvtier supports vLLM {SUPPORTED_TEXT} ({SUPPORTED_RANGE}): its "
            "connector hooks change between vLLM minor releases, and the connector refuses this one at start-up.")


def _flush_s(extra: dict[str, Any]) -> float:
    default = float(KVTierConfig.model_fields["shutdown_flush_s"].default)
    return max(number(extra.get("shutdown_flush_s"), default), 0.0)


@rule("kvtier-grace-period-too-short", "error",
      "pod grace period shorter than --shutdown-timeout + shutdown_flush_s",
      "Set terminationGracePeriodSeconds to at least --shutdown-timeout + shutdown_flush_s (plus a margin for "
      "the API server to exit), e.g. 90 for 30 + 30.",
      f"Kubernetes pod termination (kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/); {_DOCS} § Grace "
      "periods", locate="terminationGracePeriodSeconds")
def kvtier_grace_period_too_short(c: ServeConfig) -> str | None:
    extra = kvtier_settings(c)
    if extra is None or c.pod is None or disk_tier(extra) is None:
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




@rule("kvtier-disk-path-not-on-volume", "error", "disk_path not on a volume mounted in the container",
      "Mount a volume at disk_path (or a parent): a local NVMe PersistentVolume, a hostPath on the NVMe, or an "
      "emptyDir with a sizeLimit above disk_gib; see deploy/kubernetes/.",
      f"Kubernetes volumes (kubernetes.io/docs/concepts/storage/volumes/); {_DOCS} § NVMe volumes",
      locate="disk_path")
def kvtier_disk_path_not_on_volume(c: ServeConfig) -> str | None:
    extra = kvtier_settings(c)
    if extra is None or c.pod is None:
        return None
    path = disk_tier(extra)
    if path is None or any(under(path, mount) for mount in c.pod.mount_paths):
        return None
    return (f"disk_path {path} is not under any volumeMount of the container, so the disk tier writes into the "
            "container's own writable layer: the root disk's space, counted as ephemeral storage (the kubelet "
            "evicts the pod when it fills) and lost at every restart.")


@rule("volume-mount-without-volume", "error", "a volumeMount whose name matches no volume of the pod",
      "Give the pod a volume (spec.volumes) or, in a StatefulSet, a volumeClaimTemplates entry (spelled so) "
      "named as the mount, or fix the mount's name.",
      "Kubernetes API validation of volumeMounts (k8s.io/kubernetes pkg/apis/core/validation: a mount's name "
      "must name a volume of the pod, else 'Not found'); Kubernetes StatefulSet spec.volumeClaimTemplates",
      locate="volumeMounts")
def volume_mount_without_volume(c: ServeConfig) -> str | None:
    if c.pod is None:
        return None
    unbound = [m for m in c.pod.mounts if not m.bound]
    if not unbound:
        return None
    names = ", ".join(f"{m.name!r} at {m.path}" for m in unbound)
    return (f"the volumeMount {names} names no volume and no volumeClaimTemplates entry of the pod, so Kubernetes "
            "refuses the pod (a misspelled volumeClaimTemplates leaves the disk tier's mount pointing at nothing).")


VOLUME_HEADROOM = 1.10
"""A disk tier's volume holds ``disk_gib`` + 10 % (file system, chunk-file headers; docs/deploy.md)."""


@rule("kvtier-disk-volume-unfit", "error", "the volume under disk_path is read-only, RAM, or smaller than disk_gib + 10 %",
      "Mount a writable volume on the NVMe at disk_path: not readOnly, not an emptyDir with medium Memory, and with a "
      "sizeLimit or storage request of at least disk_gib + 10 % (e.g. 880Gi for disk_gib 800).",
      f"Kubernetes volumes (kubernetes.io/docs/concepts/storage/volumes/#emptydir); {_DOCS} § NVMe volumes",
      locate="disk_path")
def kvtier_disk_volume_unfit(c: ServeConfig) -> str | None:
    extra = kvtier_settings(c)
    if extra is None or c.pod is None:
        return None
    path = disk_tier(extra)
    holding = [m for m in c.pod.mounts if path is not None and under(path, m.path)]
    if path is None or not holding:
        return None  # kvtier-disk-path-not-on-volume speaks for a path under no mount
    mount = max(holding, key=lambda m: len(posixpath.normpath(m.path)))
    disk_gib = number(extra.get("disk_gib"), 0.0)
    if mount.read_only:
        problem = "is mounted readOnly, so every chunk write fails and the disk tier never holds anything"
    elif (mount.medium or "").lower() == "memory":
        problem = ("is an emptyDir with medium Memory, a tmpfs in RAM: the \"disk\" tier takes host memory counted "
                   "against the container's limit, not NVMe")
    elif mount.size_gib is not None and mount.size_gib < disk_gib * VOLUME_HEADROOM - 1e-6:
        problem = (f"holds {mount.size_gib:,.4g} GiB ({mount.size_source}), less than disk_gib {disk_gib:g} + 10 % = "
                   f"{disk_gib * VOLUME_HEADROOM:,.4g} GiB, so the tier fills the volume (an emptyDir past its "
                   "sizeLimit gets the pod evicted; a full claim fails the writes)")
    else:
        return None
    return f"the volume mounted at {mount.path}, which holds disk_path {path}, {problem}."


VLLM_HOST_MEMORY_GIB = 8.0
"""Host memory vLLM itself holds beside kvtier's cpu tier, a floor (API server, engine core, one process per
GPU with its CUDA context and staging buffers; the shipped manifests budget ~16 GiB: deploy/kubernetes/)."""


@rule("kvtier-cpu-tier-over-memory-limit", "error",
      "the cpu tier's pool plus vLLM's own memory exceeds the container's memory limit",
      f"Raise resources.limits.memory to at least cpu_gib + {VLLM_HOST_MEMORY_GIB:g} GiB (the shipped manifests give "
      "cpu_gib + 32Gi, e.g. 64Gi for cpu_gib 32), or lower cpu_gib; kvtier size prints both.",
      f"{_DOCS} § Pinned host memory and memlock (the pool is faulted in at start-up and counts against the container's memory "
      "limit); Kubernetes resource quantities (kubernetes.io/docs/reference/kubernetes-api/common-definitions/"
      "quantity/)", locate="limits:")
def kvtier_cpu_tier_over_memory_limit(c: ServeConfig) -> str | None:
    """The pod holds every tensor-parallel rank's share of ``cpu_gib`` (the total across ranks,
    src/kvtier/core/config.py ``cpu_bytes_per_rank``), or ``cpu_gib / --nnodes`` when vLLM spans nodes."""
    extra = kvtier_settings(c)
    if extra is None or c.pod is None or c.pod.memory_limit is None or refused(extra, "cpu_gib"):
        return None  # a refused cpu_gib (kvtier-config-invalid) is not judged as its default
    limit_gib = quantity_gib(c.pod.memory_limit)
    default = float(KVTierConfig.model_fields["cpu_gib"].default)
    cpu_gib = max(number(extra.get("cpu_gib"), default), 0.0)
    nodes = max(int(number(c.value("--nnodes"), 1.0)), 1)
    pod_gib = cpu_gib / nodes
    if limit_gib is None or pod_gib + VLLM_HOST_MEMORY_GIB <= limit_gib:
        return None
    share = f"cpu_gib {cpu_gib:g} / --nnodes {nodes} = {pod_gib:g} GiB" if nodes > 1 else f"cpu_gib {pod_gib:g} GiB"
    return (f"the cpu tier's pool ({share}, allocated and faulted in at start-up) plus at least "
            f"{VLLM_HOST_MEMORY_GIB:g} GiB for vLLM itself exceeds the container's memory limit "
            f"{c.pod.memory_limit} ({limit_gib:,.4g} GiB), so the kernel OOM-kills the container as it starts.")


def _inside_namespace(host: str, c: ServeConfig) -> bool:
    """Whether ``host`` names a Service (or a pod of a headless Service) in the pod's own namespace."""
    assert c.pod is not None
    host = host.lower().rstrip(".")
    if is_loopback_host(host):
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
    extra = kvtier_settings(c)
    if extra is None or c.pod is None:
        return None
    url = extra.get("redis_url")
    if not isinstance(url, str) or left_out(extra, "redis_url"):
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
