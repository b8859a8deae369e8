"""vLLM versions from ``--vllm-version`` or an image tag (``vllm/vllm-openai:v0.32.0-cu129``)."""

from __future__ import annotations

import re

from packaging.version import InvalidVersion, Version

from kvtier.cli.errors import UserError

_TAG_VERSION = re.compile(r"^v?(\d+\.\d+(?:\.\d+)?)(?:[-+.].*)?$")


def parse_version(text: str) -> Version:
    """``"0.32.0"`` or ``"v0.32.0"`` → Version; UserError when it is not a release version."""
    raw = text.strip()
    match = re.fullmatch(r"v?(\d+\.\d+(?:\.\d+)?(?:(?:rc|\.post)\d+)?)", raw)
    if not match:
        raise UserError(f"--vllm-version {text!r} is not a version; write it like 0.32.0.")
    try:
        return Version(match.group(1))
    except InvalidVersion:  # pragma: no cover - the regex admits only valid forms
        raise UserError(f"--vllm-version {text!r} is not a version; write it like 0.32.0.") from None


def version_from_image(image: str | None) -> Version | None:
    """The vLLM version an image tag names (``v0.26.0``, ``0.32.0-cu129``), None for ``latest``,
    ``nightly``, digests or model tags such as ``glm51-cu130``."""
    if not image or "@" in image:
        return None
    last = image.rsplit("/", 1)[-1]
    if ":" not in last:
        return None
    match = _TAG_VERSION.match(last.split(":", 1)[1])
    return Version(match.group(1)) if match else None
