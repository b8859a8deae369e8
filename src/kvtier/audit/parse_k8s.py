"""Read vLLM containers out of Kubernetes manifests (multi-document YAML).

Workloads: Pod (``spec.containers``), Deployment / StatefulSet / DaemonSet / ReplicaSet / Job
(``spec.template.spec.containers``), CronJob (``spec.jobTemplate.spec.template.spec.containers``),
and ``List`` items.  A container is audited when its image or command mentions vLLM.  Its
``command`` + ``args`` are read as a shell line when they run ``sh -c "…"``, otherwise as the words
after ``vllm serve`` (the ``vllm/vllm-openai`` entrypoint).  ``env`` entries with a literal
``value`` are read; ``valueFrom`` / ``envFrom`` cannot be resolved offline and are skipped.
"""

from __future__ import annotations

from typing import Any

import yaml

from kvtier.audit.model import ServeConfig
from kvtier.audit.parse_command import parse_command, parse_vllm_args
from kvtier.cli.errors import UserError

_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def _pod_specs(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    kind = doc.get("kind")
    name = (doc.get("metadata") or {}).get("name", "?")
    spec = doc.get("spec") or {}
    if kind == "List":
        return [ps for item in doc.get("items") or [] if isinstance(item, dict) for ps in _pod_specs(item)]
    if kind == "Pod":
        return [(f"Pod/{name}", spec)]
    if kind in _TEMPLATE_KINDS:
        return [(f"{kind}/{name}", ((spec.get("template") or {}).get("spec") or {}))]
    if kind == "CronJob":
        job = ((spec.get("jobTemplate") or {}).get("spec") or {})
        return [(f"CronJob/{name}", ((job.get("template") or {}).get("spec") or {}))]
    return []


def _is_vllm(container: dict[str, Any]) -> bool:
    words = [str(container.get("image", ""))] + [str(w) for w in (container.get("command") or [])]
    words += [str(w) for w in (container.get("args") or [])][:3]
    return any("vllm" in w.lower() for w in words)


def _container_config(container: dict[str, Any], origin: str, text: str) -> ServeConfig:
    command = [str(w) for w in container.get("command") or []]
    args = [str(w) for w in container.get("args") or []]
    words = command + args
    image = container.get("image")
    if len(words) >= 2 and words[0].rsplit("/", 1)[-1] in ("sh", "bash") and "-c" in words:
        script = " ".join(words[words.index("-c") + 1:])
        config = parse_command(script, origin)
    else:
        config = ServeConfig(origin=origin)
        if "serve" in words:
            words = words[words.index("serve") + 1:]
        elif "vllm.entrypoints.openai.api_server" in words:
            words = words[words.index("vllm.entrypoints.openai.api_server") + 1:]
        parse_vllm_args(words, config)
    config.text = text
    config.image = str(image) if image else config.image
    for entry in container.get("env") or []:
        if isinstance(entry, dict) and "name" in entry and "value" in entry:
            config.env[str(entry["name"])] = "" if entry["value"] is None else str(entry["value"])
    return config


def parse_manifests(text: str, origin: str) -> list[ServeConfig]:
    """Every vLLM container in the YAML documents of ``text``.

    Raises:
        UserError: the YAML does not parse, or holds no vLLM container.
    """
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise UserError(f"{origin} is not valid YAML{where}; fix the manifest and retry.") from None
    configs: list[ServeConfig] = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise UserError(f"{origin} holds a YAML document that is not a mapping; is it a Kubernetes manifest?")
        for workload, spec in _pod_specs(doc):
            for container in spec.get("containers") or []:
                if isinstance(container, dict) and _is_vllm(container):
                    name = container.get("name", "?")
                    configs.append(_container_config(container, f"{origin}:{workload}/{name}", text))
    if not configs:
        raise UserError(f"{origin} has no container running vLLM (Pod, Deployment, StatefulSet, ...).")
    return configs
