"""vLLM versions from ``--vllm-version`` or an image tag (``vllm/vllm-openai:v0.32.0-cu129``).

Both go through :class:`packaging.version.Version` (PEP 440), so build strings such as
``0.22.1+cu129``, ``0.22.0.dev0`` or ``0.22.1rc2.dev123+gabcdef`` (what ``vllm --version`` prints)
are read the same way in both places.  A digest (``@sha256:…``) after a tag is ignored.
"""

from __future__ import annotations

import re

from packaging.version import InvalidVersion, Version

from kvtier.core.errors import UserError

_TAG_PREFIX = re.compile(r"^v?(\d+\.\d+[0-9A-Za-z.]*?)(?:[-_].*)?$")
"""A tag starts with X.Y[…] (PEP 440 once split at its first ``-``/``_``: ``0.32.0-cu129``)."""


def _pep440(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def parse_version(text: str) -> Version:
    """``"0.32.0"``, ``"v0.32.0"``, ``"0.22.1+cu129"``, ``"0.22.0.dev0"`` → Version (PEP 440).

    Raises:
        UserError: ``text`` is not a PEP 440 version.
    """
    version = _pep440(text.strip())  # PEP 440 admits a leading "v"
    if version is None:
        raise UserError(f"--vllm-version {text!r} is not a version; write it like 0.32.0 or 0.22.1+cu129.")
    return version


def version_from_image(image: str | None) -> Version | None:
    """The vLLM version an image tag names (``v0.26.0``, ``0.32.0-cu129``, ``v0.20.0@sha256:…``,
    ``kvtier-vllm:v0.32.0-kvtier0.1.0``), None for ``latest``, ``nightly``, a bare digest, model tags
    such as ``glm51-cu130``, and a kvtier image's tag without the ``-kvtier<version>`` part
    (:func:`kvtier_tag_without_vllm`: ``kvtier-vllm:0.1.0`` is kvtier's version, not vLLM 0.1.0)."""
    if not image:
        return None
    last = image.split("@", 1)[0].rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    repository, tag = last.split(":", 1)
    if kvtier_tag_without_vllm(repository, tag):
        return None
    version = _pep440(tag)
    if version is not None and "." in tag:
        return version
    match = _TAG_PREFIX.match(tag)
    return _pep440(match.group(1)) if match else None


def kvtier_tag_without_vllm(repository: str, tag: str) -> bool:
    """Whether ``repository:tag`` is a kvtier image whose tag does not say the vLLM version: the
    repository names kvtier and the tag lacks the ``-kvtier<version>`` part of the documented
    ``v<vLLM version>-kvtier<kvtier version>`` (docs/deploy.md; deploy/Dockerfile), so a number in it
    may be kvtier's own version (``kvtier-vllm:0.1.0``, read as vLLM 0.1.0 before: a fresh-user
    tester's image failed the supported-vLLM rule and the version gates)."""
    return "kvtier" in repository.lower() and "kvtier" not in tag.lower()
