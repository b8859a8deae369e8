"""Decide what an input is (manifest, command line, env file) and read it into ServeConfigs."""

from __future__ import annotations

import re
from typing import Any

from packaging.version import Version

from kvtier.audit.model import ServeConfig
from kvtier.audit.parse_command import looks_like_env_file, parse_commands, parse_env_file
from kvtier.audit.parse_compose import is_compose, parse_compose
from kvtier.audit.parse_k8s import parse_manifests
from kvtier.audit.safe_yaml import load_all
from kvtier.audit.versions import version_from_image
from kvtier.core.errors import UserError

_MANIFEST = re.compile(r"^\s*(apiVersion|kind)\s*:", re.MULTILINE)
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*\s*:(\s|$)", re.MULTILINE)
_COMMAND = re.compile(r"\bvllm\b[\s\\]+serve\b|vllm\.entrypoints\.openai\.api_server|vllm-openai"
                      r"|\b(?:docker|podman)(?:[\s\\]+container)?[\s\\]+(?:run|create)\b")


def load_configs(text: str, origin: str, version: Version | None = None) -> list[ServeConfig]:
    """Read ``text`` into one ServeConfig per vLLM server; ``version`` overrides image tags.

    Raises:
        UserError: the input is empty, binary, unparseable (e.g. nested too deeply), or of no kind
            the audit reads.
    """
    if "\x00" in text:
        raise UserError(f"{origin} is not text (it holds NUL bytes); give a command line, env file or manifest.")
    if not text.strip():
        raise UserError(f"{origin} is empty; give a vllm serve command, an env file or a manifest.")
    document = _yaml_mapping(text, origin)
    if document is not None and is_compose(document):
        configs = parse_compose(document, text, origin)
    elif _MANIFEST.search(text):
        configs = parse_manifests(text, origin)
    elif document is not None:
        raise UserError(f"{origin} is YAML but neither a Kubernetes manifest (apiVersion, kind) nor a Compose file "
                        "(services:); audit the manifest, compose file or serve command that starts vLLM.")
    elif _COMMAND.search(text):
        configs = parse_commands(text, origin)
    elif looks_like_env_file(text):
        configs = [parse_env_file(text, origin)]
    else:
        raise UserError(
            f"{origin} is neither a vllm serve command line, an env file (KEY=VALUE lines) nor a Kubernetes manifest."
        )
    for config in configs:
        config.version = version if version is not None else version_from_image(config.image)
        config.kv_transfer_config  # noqa: B018 - parse now so a malformed one fails here, as bad input
    return configs


def _yaml_mapping(text: str, origin: str) -> dict[str, Any] | None:
    """The first YAML document of ``text`` when it is a mapping of plain keys (a manifest, a Compose
    file, a Helm values file), None for anything else (a shell script, an env file)."""
    if not _KEY.search(text):
        return None
    try:
        docs = load_all(text, origin)
    except UserError:
        return None
    first = next((d for d in docs if d is not None), None)
    if not isinstance(first, dict) or not first:
        return None
    if not all(isinstance(k, str) and _KEY.match(f"{k}:") for k in first):
        return None
    return first
