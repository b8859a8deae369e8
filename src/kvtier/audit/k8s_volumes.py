"""The volumes behind a container's mounts, read from a pod spec and its workload.

What a disk tier needs to know about the volume under ``disk_path``: whether the mount is
read-only, whether it is RAM (an emptyDir with ``medium: Memory``), and how much it may hold (an
emptyDir's ``sizeLimit``; the storage request of a StatefulSet's ``volumeClaimTemplates`` entry,
of an ephemeral volume's claim template, or of a PersistentVolumeClaim defined in the same
file).  Quantities follow Kubernetes' resource quantity format (``880Gi``, ``1Ti``, ``900G``,
``1e12``; kubernetes.io/docs/reference/kubernetes-api/common-definitions/quantity/).
"""

from __future__ import annotations

import re
from typing import Any

from kvtier.audit.model import MountFacts

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?(Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?$")
_SUFFIX = {None: 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2.0**10, "Mi": 2.0**20, "Gi": 2.0**30, "Ti": 2.0**40, "Pi": 2.0**50, "Ei": 2.0**60}


def quantity_gib(value: Any) -> float | None:
    """A Kubernetes quantity (``"880Gi"``, ``"1Ti"``, ``900000000000``) in GiB; None when it is not one."""
    if isinstance(value, bool):
        return None
    match = _QUANTITY.match(str(value).strip())
    if match is None:
        return None
    number, exponent, suffix = match.groups()
    return float(number) * 10.0 ** int(exponent or 0) * _SUFFIX[suffix] / 2**30


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _claim_storage(claim: Any) -> Any:
    """``spec.resources.requests.storage`` of a PersistentVolumeClaim (or its template)."""
    return _dict(_dict(_dict(_dict(claim).get("spec")).get("resources")).get("requests")).get("storage")


def claim_requests(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """Storage requests of the PersistentVolumeClaims defined in ``docs``, by claim name."""
    return {str(d["metadata"]["name"]): _claim_storage(d) for d in docs if d.get("kind") == "PersistentVolumeClaim"
            and isinstance(d.get("metadata"), dict) and d["metadata"].get("name")}


def mounts(container: dict[str, Any], pod_spec: dict[str, Any], templates: list[Any],
           claims: dict[str, Any]) -> tuple[MountFacts, ...]:
    """The container's ``volumeMounts``, each with the volume behind it.

    Args:
        container: the container mapping.
        pod_spec: the pod spec (its ``volumes``).
        templates: the workload's ``volumeClaimTemplates`` (a StatefulSet), else [].
        claims: :func:`claim_requests` of the file.
    """
    volumes = {str(v["name"]): v for v in pod_spec.get("volumes") or [] if isinstance(v, dict) and "name" in v}
    claim_templates = {str(_dict(t.get("metadata")).get("name")): t for t in templates if isinstance(t, dict)}
    found = []
    for mount in container.get("volumeMounts") or []:
        if not isinstance(mount, dict) or not mount.get("mountPath"):
            continue
        name = str(mount.get("name", ""))
        volume = _dict(volumes.get(name))
        medium, size, source = None, None, ""
        if "emptyDir" in volume:
            empty = _dict(volume["emptyDir"])
            medium = str(empty["medium"]) if empty.get("medium") else None
            if "sizeLimit" in empty:
                size, source = quantity_gib(empty["sizeLimit"]), f"emptyDir sizeLimit {empty['sizeLimit']}"
        elif "persistentVolumeClaim" in volume:
            claim = str(_dict(volume["persistentVolumeClaim"]).get("claimName", ""))
            if claims.get(claim) is not None:
                size, source = quantity_gib(claims[claim]), f"PersistentVolumeClaim {claim} request {claims[claim]}"
        elif "ephemeral" in volume:
            storage = _claim_storage(_dict(volume["ephemeral"]).get("volumeClaimTemplate"))
            if storage is not None:
                size, source = quantity_gib(storage), f"ephemeral volume request {storage}"
        elif not volume and name in claim_templates:
            storage = _claim_storage(claim_templates[name])
            if storage is not None:
                size, source = quantity_gib(storage), f"volumeClaimTemplates {name} request {storage}"
        bound = name in volumes or name in claim_templates
        found.append(MountFacts(str(mount["mountPath"]), mount.get("readOnly") is True, medium, size, source, name,
                                bound))
    return tuple(found)
