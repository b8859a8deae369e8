"""Read a kustomization (a directory holding ``kustomization.yaml``, or that file) as the manifests it
lists, so ``kvtier audit deploy/kubernetes/shared-tier`` audits the pods together with the Services
beside them.

Only plain ``resources`` are read (files, and directories holding a kustomization of their own),
concatenated as YAML documents: that is what ``kustomize build`` renders for a kustomization that
has nothing else (kubectl.docs.kubernetes.io/references/kustomize/kustomization/resource/).  A
kustomization that patches, generates or transforms is refused with one sentence naming the key:
render it first (``kubectl kustomize DIR | kvtier audit -``), since auditing its unpatched inputs
would audit something that never runs.
"""

from __future__ import annotations

from pathlib import Path

from kvtier.audit.safe_yaml import load_all
from kvtier.core.errors import UserError

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
"""The file names kustomize looks for in a directory (sigs.k8s.io/kustomize konfig.RecognizedKustomizationFileNames)."""

_PLAIN_KEYS = frozenset({"apiVersion", "kind", "resources"})
MAX_DEPTH = 8
"""Nested kustomizations followed at most (a cycle is refused well before)."""


def kustomization_file(path: Path) -> Path | None:
    """The kustomization file ``path`` names (itself, or the one in the directory), None when it is neither."""
    if path.is_dir():
        return next((path / name for name in KUSTOMIZATION_FILES if (path / name).is_file()), None)
    return path if path.name in KUSTOMIZATION_FILES and path.is_file() else None


def read_kustomization(path: Path, max_bytes: int, depth: int = 0) -> str:
    """The YAML documents of every resource ``path`` (a directory or a kustomization file) lists, joined.

    Raises:
        UserError: no kustomization there, it is not a mapping, it uses anything but ``resources``,
            a resource is a URL or cannot be read, or the total passes ``max_bytes``.
    """
    found = kustomization_file(path)
    if found is None:
        raise UserError(f"{path} is a directory without a kustomization.yaml; give a file or a kustomize directory.")
    if depth > MAX_DEPTH:
        raise UserError(f"{found} nests kustomizations more than {MAX_DEPTH} deep; render it with kubectl kustomize.")
    docs = load_all(_read(found, max_bytes), str(found))
    if len(docs) != 1 or not isinstance(docs[0], dict):
        raise UserError(f"{found} must be one YAML mapping (a Kustomization).")
    other = sorted(set(docs[0]) - _PLAIN_KEYS)
    if other:
        raise UserError(f"{found} uses {', '.join(other)}, which kvtier audit does not apply; render it first: "
                        f"kubectl kustomize {found.parent} | kvtier audit -")
    resources = docs[0].get("resources") or []
    if not isinstance(resources, list) or not all(isinstance(r, str) for r in resources):
        raise UserError(f"{found} resources must be a list of paths.")
    parts: list[str] = []
    for resource in resources:
        if "://" in resource or resource.startswith(("github.com/", "git@")):
            raise UserError(f"{found} lists the remote resource {resource!r}; kvtier audit reads local files only: "
                            "render it first with kubectl kustomize.")
        target = found.parent / resource
        text = (read_kustomization(target, max_bytes, depth + 1) if target.is_dir()
                else _read(target, max_bytes))
        parts.append(text)
        if sum(len(p) for p in parts) > max_bytes:
            raise UserError(f"{found} lists more than {max_bytes >> 20} MiB of manifests.")
    return "\n---\n".join(parts)


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
