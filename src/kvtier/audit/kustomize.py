"""Read a kustomization (a directory holding ``kustomization.yaml``, or that file) as the manifests it
renders, so ``kvtier audit deploy/kubernetes/shared-tier`` audits the pods together with the Services
beside them, after the operator's own edits (``kustomize edit set namespace``, an image tag, a patch).

Two ways, the first that applies:

1. **Rendered** by ``kustomize build DIR`` or ``kubectl kustomize DIR`` when either is on ``PATH``
   (kubectl has embedded kustomize since 1.14: kubernetes.io/docs/tasks/manage-kubernetes-objects/kustomization/):
   exactly what ``kubectl apply -k`` would send, whatever the kustomization uses.
2. **Read without rendering** otherwise: the ``resources`` (files, and directories holding a
   kustomization of their own), then the transformations that change what the audit reads, applied
   as kustomize applies them (kubectl.docs.kubernetes.io/references/kustomize/kustomization/):
   ``namespace`` (set on every namespaced object), ``images`` (``newName``/``newTag``/``digest`` of
   the containers' images: the audit reads the vLLM version from the tag), and strategic-merge
   patches (``patches`` entries with ``path`` or ``patch``, optionally a ``target`` kind and name;
   ``patchesStrategicMerge``; :mod:`kvtier.audit.kustomize_patch`).  ``commonLabels``, ``labels`` and
   ``commonAnnotations`` change only labels and annotations, which no rule reads, and are passed
   over.  Anything else (generators, name prefixes that rename references, JSON 6902 patches,
   components, replacements, remote resources) is refused with one sentence naming the key: render
   it first (``kubectl kustomize DIR | kvtier audit -``), since auditing its unrendered inputs would
   audit something that never runs.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

from kvtier.audit.kustomize_patch import apply_images, apply_namespace, apply_patches, patch_documents
from kvtier.audit.safe_yaml import load_all
from kvtier.core.errors import UserError

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
"""The file names kustomize looks for in a directory (sigs.k8s.io/kustomize konfig.RecognizedKustomizationFileNames)."""

_READ_KEYS = frozenset({"apiVersion", "kind", "resources", "namespace", "images", "patches",
                        "patchesStrategicMerge"})
_PASSED_OVER = frozenset({"commonLabels", "labels", "commonAnnotations"})
MAX_DEPTH = 8
"""Nested kustomizations followed at most (a cycle is refused well before)."""
RENDER_TIMEOUT_S = 60.0
"""Longest a ``kustomize build`` may run (a local build takes well under a second; a remote resource
fetched over a network that never answers would otherwise hang the audit)."""


def kustomization_file(path: Path) -> Path | None:
    """The kustomization file ``path`` names (itself, or the one in the directory), None when it is neither."""
    if path.is_dir():
        return next((path / name for name in KUSTOMIZATION_FILES if (path / name).is_file()), None)
    return path if path.name in KUSTOMIZATION_FILES and path.is_file() else None


def renderer() -> list[str] | None:
    """The command that renders a kustomization on this machine (``kustomize build`` or
    ``kubectl kustomize``, the directory to be appended), None when neither is on ``PATH``."""
    if found := shutil.which("kustomize"):
        return [found, "build"]
    if found := shutil.which("kubectl"):
        return [found, "kustomize"]
    return None


def read_kustomization(path: Path, max_bytes: int, render: bool = True) -> str:
    """The YAML documents ``path`` (a directory or a kustomization file) renders to, joined.

    Args:
        path: a kustomize directory or its kustomization file.
        max_bytes: the most bytes of manifests read or rendered.
        render: run :func:`renderer`'s command when there is one (else, or when False, read without rendering).

    Raises:
        UserError: no kustomization there; the renderer fails (its first line of error said) or
            passes ``max_bytes`` or :data:`RENDER_TIMEOUT_S`; without a renderer, the kustomization
            is not a mapping, uses a key not read without rendering, names a remote or unreadable
            resource or a patch that fits no resource, or its manifests pass ``max_bytes``.
    """
    found = kustomization_file(path)
    if found is None:
        raise UserError(f"{path} is a directory without a kustomization.yaml; give a file or a kustomize directory.")
    command = renderer() if render else None
    if command is not None:
        return _render(command, found.parent, max_bytes)
    docs = _read_unrendered(found, max_bytes, 0)
    return "\n---\n".join(yaml.safe_dump(d, sort_keys=False) for d in docs)


def _render(command: list[str], directory: Path, max_bytes: int) -> str:
    shown = f"{Path(command[0]).name} {command[1]} {directory}"
    try:
        run = subprocess.run([*command, str(directory)], capture_output=True, check=False,
                             timeout=RENDER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"{shown} ran past {RENDER_TIMEOUT_S:.0f} s (a remote resource that does not answer?); "
                        f"render it yourself and pipe it: kubectl kustomize {directory} | kvtier audit -") from None
    except OSError as exc:
        raise UserError(f"cannot run {shown} ({exc.__class__.__name__}); render it yourself and pipe it: "
                        f"kubectl kustomize {directory} | kvtier audit -") from None
    if run.returncode != 0:
        reason = _render_error(run.stderr.decode("utf-8", "replace")) or f"exit code {run.returncode}"
        raise UserError(f"{shown} failed: {reason}; fix the kustomization so that it renders.")
    if len(run.stdout) > max_bytes:
        raise UserError(f"{shown} renders more than {max_bytes >> 20} MiB of manifests.")
    return run.stdout.decode("utf-8", "replace")


def _render_error(stderr: str) -> str:
    """The words of a failed render's error output that say why, at most 300 characters: kubectl logs
    ``E1204 20:36:27.929757 11440 run.go:72] "command failed" err="..."`` (the reason in ``err``, or on
    the lines after ``err=<``), kustomize prints ``Error: ...``; ``# Warning`` lines are left out."""
    lines: list[str] = []
    for raw in stderr.splitlines():
        line = raw.strip()
        header = re.match(r"[EWIF]\d{4} .*?\] (.*)$", line)
        if header:
            line = header.group(1).partition("err=")[2].strip().strip('"').replace('\\"', '"')
        if line and line not in ("<", ">", "`") and not line.startswith("# Warning"):
            lines.append(line)
    return lines[-1].removeprefix("Error: ").strip("`").strip()[:300] if lines else ""


def _read_unrendered(found: Path, max_bytes: int, depth: int) -> list[dict[str, Any]]:
    if depth > MAX_DEPTH:
        raise UserError(f"{found} nests kustomizations more than {MAX_DEPTH} deep; render it with kubectl kustomize.")
    loaded = load_all(_read(found, max_bytes), str(found))
    if len(loaded) != 1 or not isinstance(loaded[0], dict):
        raise UserError(f"{found} must be one YAML mapping (a Kustomization).")
    kustomization: dict[str, Any] = loaded[0]
    other = sorted(set(kustomization) - _READ_KEYS - _PASSED_OVER)
    if other:
        raise UserError(f"{found} uses {', '.join(other)}, which kvtier audit does not apply without kustomize or "
                        f"kubectl on PATH; render it first: kubectl kustomize {found.parent} | kvtier audit -")
    resources = kustomization.get("resources") or []
    if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
        raise UserError(f"{found} resources must be a list of paths.")
    docs: list[dict[str, Any]] = []
    size = 0
    for resource in resources:
        if "://" in resource or resource.startswith(("github.com/", "git@")):
            raise UserError(f"{found} lists the remote resource {resource!r}; kvtier audit reads local files only: "
                            "render it first with kubectl kustomize.")
        target = found.parent / resource
        if target.is_dir():
            nested = kustomization_file(target)
            if nested is None:
                raise UserError(f"{found} lists the directory {resource!r}, which holds no kustomization.yaml.")
            docs += _read_unrendered(nested, max_bytes, depth + 1)
            continue
        text = _read(target, max_bytes)
        size += len(text)
        if size > max_bytes:
            raise UserError(f"{found} lists more than {max_bytes >> 20} MiB of manifests.")
        for doc in load_all(text, str(target)):
            if doc is None:
                continue
            if not isinstance(doc, dict):
                raise UserError(f"{target} holds a YAML document that is not a mapping; is it a Kubernetes manifest?")
            docs.append(doc)
    patches = patch_documents(kustomization, found, lambda p: _read(p, max_bytes))
    apply_patches(docs, patches, str(found))
    apply_namespace(docs, kustomization.get("namespace"), str(found))
    apply_images(docs, kustomization.get("images"), str(found))
    return docs


def _read(path: Path, max_bytes: int) -> str:
    try:
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.__class__.__name__}); check the path.") from None
    if len(data) > max_bytes:
        raise UserError(f"{path} is larger than {max_bytes >> 20} MiB.")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UserError(f"{path} is not text (not UTF-8).") from None
