"""The kustomize transformations :mod:`kvtier.audit.kustomize` applies when no ``kustomize`` or
``kubectl`` is on ``PATH``: ``namespace``, ``images`` and strategic-merge patches, as kustomize
documents them (kubectl.docs.kubernetes.io/references/kustomize/kustomization/namespace/, .../images/,
.../patches/, .../patchesstrategicmerge/).

A strategic-merge patch merges mappings key by key (a ``null`` value deletes the key), replaces lists
except the lists Kubernetes merges by a key (``containers``, ``initContainers``, ``volumes``, ``env``
by ``name``; ``volumeMounts`` by ``mountPath``; ``ports`` by ``containerPort``: the
``patchMergeKey`` tags of k8s.io/api/core/v1/types.go).  Patch directives (``$patch``,
``$setElementOrder``, ``$retainKeys``, ``$deleteFromPrimitiveList``), JSON 6902 patches and targets
chosen by label or annotation selectors are refused: those need kustomize itself.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvtier.audit.safe_yaml import load_all
from kvtier.core.errors import UserError

MERGE_KEYS = {"containers": "name", "initContainers": "name", "ephemeralContainers": "name", "volumes": "name",
              "env": "name", "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}
"""Lists a strategic-merge patch merges element by element, and the key that matches elements."""

CLUSTER_SCOPED = frozenset({"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                            "PersistentVolume", "StorageClass", "PriorityClass", "RuntimeClass", "CSIDriver",
                            "IngressClass", "APIService", "MutatingWebhookConfiguration",
                            "ValidatingWebhookConfiguration"})
"""Kinds without a namespace, which kustomize's ``namespace`` leaves alone."""

Patch = tuple[dict[str, Any], dict[str, Any] | None, str]
"""A strategic-merge patch, its ``target`` (None: the resource of the patch's own kind and name), where it came from."""


def _render_hint(where: str) -> str:
    return f"render it first: kubectl kustomize {Path(where).parent} | kvtier audit -"


def patch_documents(kustomization: dict[str, Any], found: Path, read: Callable[[Path], str]) -> list[Patch]:
    """The strategic-merge patches of ``patches`` and ``patchesStrategicMerge``, in that order.

    Raises:
        UserError: an entry that is not a path or inline patch, a JSON 6902 patch, or a target chosen
            by anything but kind and name.
    """
    where = str(found)
    patches: list[Patch] = []
    for entry in _list(kustomization.get("patchesStrategicMerge"), where, "patchesStrategicMerge"):
        if not isinstance(entry, str):
            raise UserError(f"{where} patchesStrategicMerge entries must be file paths or inline YAML.")
        text = entry if "\n" in entry else read(found.parent / entry)
        patches += [(doc, None, entry if "\n" not in entry else where) for doc in _patch_docs(text, where)]
    for entry in _list(kustomization.get("patches"), where, "patches"):
        if not isinstance(entry, dict) or not (isinstance(entry.get("path"), str) or isinstance(entry.get("patch"), str)):
            raise UserError(f"{where} patches entries must be mappings with a path or an inline patch.")
        target = entry.get("target")
        if target is not None and (not isinstance(target, dict)
                                   or set(target) - {"group", "version", "kind", "name", "namespace"}):
            raise UserError(f"{where} has a patch target chosen by selector, which kvtier audit does not apply "
                            f"without kustomize or kubectl on PATH; {_render_hint(where)}")
        text = entry["patch"] if isinstance(entry.get("patch"), str) else read(found.parent / entry["path"])
        patches += [(doc, target, entry.get("path") or where) for doc in _patch_docs(text, where)]
    return patches


def _list(value: Any, where: str, key: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise UserError(f"{where} {key} must be a list.")
    return value


def _patch_docs(text: str, where: str) -> list[dict[str, Any]]:
    docs = [d for d in load_all(text, where) if d is not None]
    for doc in docs:
        if not isinstance(doc, dict):
            raise UserError(f"{where} has a JSON 6902 patch (a list of operations), which kvtier audit does not "
                            f"apply without kustomize or kubectl on PATH; {_render_hint(where)}")
    return docs


def apply_patches(docs: list[dict[str, Any]], patches: list[Patch], where: str) -> None:
    """Merge each patch into the documents it targets, in place.

    Raises:
        UserError: a patch that targets no document, or uses a patch directive.
    """
    for patch, target, origin in patches:
        if target:  # a target matches what it names; a namespace left out matches any
            kind, name, namespace = target.get("kind"), target.get("name"), target.get("namespace", _ANY)
        else:  # the patch's own kind, name and namespace (none matches only a resource without one)
            metadata = _metadata(patch)
            kind, name, namespace = patch.get("kind"), metadata.get("name"), metadata.get("namespace")
        matched = [d for d in docs if (kind is None or d.get("kind") == kind)
                   and (name is None or _metadata(d).get("name") == name)
                   and (namespace is _ANY or _metadata(d).get("namespace") == namespace)]
        if not matched:
            raise UserError(f"{where}: the patch {origin} fits no resource ({kind or 'any kind'} "
                            f"{name or 'of any name'} in {namespace or 'no namespace'}); check its kind, "
                            "metadata.name and metadata.namespace.")
        body = patch
        if target:  # the target chooses the resources: the patch's own kind and name are not merged in
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind")}
            if isinstance(body.get("metadata"), dict):
                body["metadata"] = {k: v for k, v in body["metadata"].items() if k != "name"}
        for doc in matched:
            merged = _merge(doc, body, where)
            doc.clear()
            doc.update(merged)


_ANY = object()


def _metadata(doc: dict[str, Any]) -> dict[str, Any]:
    metadata = doc.get("metadata")
    return metadata if isinstance(metadata, dict) else {}


def _merge(base: Any, patch: Any, where: str, field: str = "") -> Any:
    if isinstance(patch, dict):
        if any(isinstance(k, str) and k.startswith("$") for k in patch):
            raise UserError(f"{where} has a patch directive ({', '.join(k for k in patch if str(k).startswith('$'))}) "
                            f"that kvtier audit does not apply without kustomize or kubectl on PATH; "
                            f"{_render_hint(where)}")
        out = copy.deepcopy(base) if isinstance(base, dict) else {}
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            else:
                out[key] = _merge(out.get(key), value, where, str(key))
        return out
    if isinstance(patch, list) and field in MERGE_KEYS and isinstance(base, list):
        key = MERGE_KEYS[field]
        out_list = copy.deepcopy(base)
        for item in patch:
            index = next((i for i, b in enumerate(out_list) if isinstance(b, dict) and isinstance(item, dict)
                          and b.get(key) == item.get(key)), None)
            if index is None:
                out_list.append(copy.deepcopy(item))
            else:
                out_list[index] = _merge(out_list[index], item, where)
        return out_list
    return copy.deepcopy(patch)


def apply_namespace(docs: list[dict[str, Any]], namespace: Any, where: str) -> None:
    """Set ``metadata.namespace`` of every namespaced document to ``namespace`` (None: leave them), in place.

    Raises:
        UserError: ``namespace`` is not a string.
    """
    if namespace is None:
        return
    if not isinstance(namespace, str) or not namespace:
        raise UserError(f"{where} namespace must be a name such as kvtier, got {namespace!r}.")
    for doc in docs:
        if doc.get("kind") not in CLUSTER_SCOPED:
            metadata = doc.setdefault("metadata", {})
            if isinstance(metadata, dict):
                metadata["namespace"] = namespace


def split_image(image: str) -> tuple[str, str | None, str | None]:
    """``image`` as (name, tag, digest): ``registry:5000/x/vllm:v1@sha256:ab`` is
    (``registry:5000/x/vllm``, ``v1``, ``sha256:ab``)."""
    rest, _, digest = image.partition("@")
    slash = rest.rfind("/")
    colon = rest.rfind(":")
    if colon > slash:
        return rest[:colon], rest[colon + 1:], digest or None
    return rest, None, digest or None


def apply_images(docs: list[dict[str, Any]], images: Any, where: str) -> None:
    """Rewrite the containers' images as the ``images`` entries say (``name`` matched against the image
    without tag and digest; ``newName``, ``newTag``, ``digest``), in place.

    Raises:
        UserError: ``images`` is not a list of mappings with a ``name``.
    """
    if images is None:
        return
    if not isinstance(images, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str)
                                               for i in images):
        raise UserError(f"{where} images must be a list of mappings, each with a name.")
    for doc in docs:
        for container in _containers(doc):
            image = container.get("image")
            if not isinstance(image, str):
                continue
            name, tag, digest = split_image(image)
            entry = next((i for i in images if i["name"] == name), None)
            if entry is None:
                continue
            name = str(entry.get("newName") or name)
            if entry.get("digest"):
                container["image"] = f"{name}@{entry['digest']}"
            else:
                tag = str(entry["newTag"]) if entry.get("newTag") is not None else tag
                container["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def _containers(node: Any) -> list[dict[str, Any]]:
    """Every container mapping under ``node`` (``containers`` and ``initContainers`` at any depth)."""
    found: list[dict[str, Any]] = []
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, dict):
            for key, value in current.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    found += [c for c in value if isinstance(c, dict)]
                else:
                    stack.append(value)
        elif isinstance(current, list):
            stack.extend(current)
    return found
