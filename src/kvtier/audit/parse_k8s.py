"""Read vLLM containers out of Kubernetes manifests (multi-document YAML).

Workloads: Pod (``spec.containers``), Deployment / StatefulSet / DaemonSet / ReplicaSet / Job
(``spec.template.spec.containers``), CronJob (``spec.jobTemplate.spec.template.spec.containers``),
and ``List`` items.  A container is audited when its image or command mentions vLLM.  Its
``command`` + ``args`` (lists; a plain string is split like a shell would) are read as a shell line when they run ``sh -c "…"``, otherwise as the words
after ``vllm serve`` (the ``vllm/vllm-openai`` entrypoint).  ``env`` entries with a literal
``value`` are read; ``valueFrom`` / ``envFrom`` cannot be resolved offline and are skipped.
The pod around each container (grace period, the container's volume mounts, the namespace, the
Services of the same file) is kept as :class:`~kvtier.audit.model.PodFacts` for the deployment rules.
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from kvtier.audit.k8s_volumes import claim_requests, mounts
from kvtier.audit.model import PodFacts, ServeConfig
from kvtier.audit.parse_command import parse_commands, parse_vllm_args
from kvtier.audit.safe_yaml import load_all
from kvtier.core.errors import UserError

_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def _mapping(value: Any, where: str) -> dict[str, Any]:
    """``value`` when it is a mapping, {} when absent; UserError otherwise."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise UserError(f"{where} must be a mapping, got {type(value).__name__} {str(value)[:40]!r}.")
    return value


def _pod_specs(doc: dict[str, Any], origin: str) -> list[tuple[str, dict[str, Any], list[Any]]]:
    """``(workload, pod spec, volumeClaimTemplates)`` of each workload in ``doc``."""
    kind = doc.get("kind")
    name = _mapping(doc.get("metadata"), f"{origin}: metadata").get("name", "?")
    where = f"{origin}: {kind}/{name}"
    spec = _mapping(doc.get("spec"), f"{where} spec")
    if kind == "List":
        items = doc.get("items") or []
        if not isinstance(items, list):
            raise UserError(f"{where} items must be a list.")
        return [ps for item in items if isinstance(item, dict) for ps in _pod_specs(item, origin)]
    if kind == "Pod":
        return [(f"Pod/{name}", spec, [])]
    if kind in _TEMPLATE_KINDS:
        template = _mapping(spec.get("template"), f"{where} spec.template")
        claims = spec.get("volumeClaimTemplates") if kind == "StatefulSet" else None
        return [(f"{kind}/{name}", _mapping(template.get("spec"), f"{where} spec.template.spec"),
                 claims if isinstance(claims, list) else [])]
    if kind == "CronJob":
        job = _mapping(_mapping(spec.get("jobTemplate"), f"{where} spec.jobTemplate").get("spec"),
                       f"{where} spec.jobTemplate.spec")
        template = _mapping(job.get("template"), f"{where} spec.jobTemplate.spec.template")
        return [(f"CronJob/{name}", _mapping(template.get("spec"), f"{where} spec.jobTemplate.spec.template.spec"),
                 [])]
    return []


def _words(container: dict[str, Any], key: str, where: str) -> list[str]:
    """``command`` / ``args`` as words: a list as is, a string split like a shell; UserError otherwise."""
    value = container.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        try:
            return shlex.split(value)
        except ValueError as exc:
            raise UserError(f"{where} {key} is not a valid shell line ({exc}); write it as a list.") from None
    if not isinstance(value, list):
        raise UserError(f"{where} {key} must be a list of strings, got {type(value).__name__}.")
    bad = next((w for w in value if isinstance(w, (dict, list))), None)
    if bad is not None:
        raise UserError(f"{where} {key} must be a list of strings, but one item is a {type(bad).__name__}: {bad!r}.")
    return [str(w) for w in value]


def is_vllm(container: dict[str, Any], where: str) -> bool:
    """Whether the container runs a vLLM server: its image, command or first arguments name vLLM, and
    it does not run kvtier's own CLI (``kvtier node serve``, the node pool's owner, in the same image)."""
    command = _words(container, "command", where) + _words(container, "args", where)
    if command and command[0].rsplit("/", 1)[-1] == "kvtier":
        return False
    words = [str(container.get("image") or "")] + _words(container, "command", where)
    words += _words(container, "args", where)[:3]
    return any("vllm" in w.lower() for w in words)


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def _expand_references(words: list[str], env: dict[str, str], unresolved: list[str]) -> list[str]:
    """``words`` with each ``$(NAME)`` replaced by the container's env value, as Kubernetes does for
    ``command`` and ``args`` (``$$`` escapes a ``$``; a reference to no variable stays as written:
    Kubernetes API reference, Container v1 ``args``); the unresolved ones are added to ``unresolved``."""

    def value(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        if match.group(1) in env:
            return env[match.group(1)]
        if match.group(0) not in unresolved:
            unresolved.append(match.group(0))
        return match.group(0)

    return [_REFERENCE.sub(value, word) for word in words]


def _env(container: dict[str, Any], origin: str) -> dict[str, str]:
    """The container's ``env`` entries with a literal ``value``."""
    env = container.get("env") or []
    if not isinstance(env, list):
        raise UserError(f"{origin} env must be a list of name/value entries.")
    return {str(e["name"]): "" if e["value"] is None else str(e["value"]) for e in env
            if isinstance(e, dict) and "name" in e and "value" in e}


def container_configs(container: dict[str, Any], origin: str, text: str,
                      references: bool = True) -> list[ServeConfig]:
    """The servers a container runs: ``command`` + ``args`` with ``$(VAR)`` expanded from its env
    (``references``; a Compose service's words are taken as written).  One, unless it runs a
    ``sh -c`` script that starts several (each then named by its line of the script, as
    :func:`~kvtier.audit.parse_command.parse_commands` names them)."""
    env = _env(container, origin)
    unresolved: list[str] = []
    words = _words(container, "command", origin) + _words(container, "args", origin)
    if references:
        words = _expand_references(words, env, unresolved)
    launch = " ".join(words)
    image = container.get("image")
    if len(words) >= 2 and words[0].rsplit("/", 1)[-1] in ("sh", "bash") and "-c" in words:
        script = " ".join(words[words.index("-c") + 1:])
        configs = parse_commands(script, origin)
    else:
        config = ServeConfig(origin=origin)
        if "serve" in words:
            words = words[words.index("serve") + 1:]
        elif "vllm.entrypoints.openai.api_server" in words:
            words = words[words.index("vllm.entrypoints.openai.api_server") + 1:]
        parse_vllm_args(words, config)
        configs = [config]
    for number, config in enumerate(configs, start=1):
        config.text = text if len(configs) == 1 else _only_this_server(text, script, config.text)
        if len(configs) > 1:  # the script's line numbers are not the file's: name the server by its place
            config.origin = f"{origin} (server {number} of {len(configs)})"
        config.launch = launch
        config.image = str(image) if image else config.image
        config.env.update(env)
        config.unresolved[:0] = unresolved
    return configs


def _only_this_server(text: str, script: str, kept: str) -> str:
    """``text`` (the manifest) with the lines of the script's other servers blanked, so that a
    finding of one server never points at another's flag: ``kept`` is the script with those lines
    blanked (:func:`~kvtier.audit.parse_command.parse_commands`)."""
    others = {line.strip() for line, mine in zip(script.splitlines(), kept.splitlines())
              if line.strip() and not mine.strip()}
    return "\n".join("" if line.strip() in others else line for line in text.splitlines())


def _mount_paths(container: dict[str, Any]) -> tuple[str, ...]:
    mounts = container.get("volumeMounts") or []
    if not isinstance(mounts, list):
        return ()
    return tuple(str(m["mountPath"]) for m in mounts if isinstance(m, dict) and m.get("mountPath"))


def _grace_period(spec: dict[str, Any], where: str) -> float | None:
    """``terminationGracePeriodSeconds``, None when unset; UserError unless a whole number >= 0 (the
    PodSpec field is an int64 that Kubernetes refuses when negative)."""
    value = spec.get("terminationGracePeriodSeconds")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not float(value).is_integer() \
            or value < 0:
        raise UserError(f"{where} terminationGracePeriodSeconds must be a whole number of seconds >= 0 such as 90, "
                        f"got {type(value).__name__} {str(value)[:40]!r}.")
    return float(value)


def _memory_limit(container: dict[str, Any]) -> str | None:
    """``resources.limits.memory`` of the container as written, None when unset."""
    resources = container.get("resources")
    limits = resources.get("limits") if isinstance(resources, dict) else None
    value = limits.get("memory") if isinstance(limits, dict) else None
    return None if value is None or isinstance(value, bool) else str(value)


def _namespace(doc: dict[str, Any]) -> str | None:
    metadata = doc.get("metadata")
    value = metadata.get("namespace") if isinstance(metadata, dict) else None
    return str(value) if value else None


def parse_manifests(text: str, origin: str) -> list[ServeConfig]:
    """Every vLLM container in the YAML documents of ``text``.

    Raises:
        UserError: the YAML does not parse (or its aliases expand too far), a field has the wrong
            type, or it holds no vLLM container.
    """
    docs = load_all(text, origin)
    configs: list[ServeConfig] = []
    for doc in docs:
        if not isinstance(doc, dict):
            raise UserError(f"{origin} holds a YAML document that is not a mapping; is it a Kubernetes manifest?")
    services = frozenset(str(d["metadata"]["name"]) for d in docs if d.get("kind") == "Service"
                         and isinstance(d.get("metadata"), dict) and d["metadata"].get("name"))
    claims = claim_requests(docs)
    for doc in docs:
        for workload, spec, templates in _pod_specs(doc, origin):
            containers = spec.get("containers") or []
            if not isinstance(containers, list):
                raise UserError(f"{origin}: {workload} spec.containers must be a list.")
            for container in containers:
                name = container.get("name", "?") if isinstance(container, dict) else "?"
                if isinstance(container, dict) and is_vllm(container, f"{origin}:{workload}/{name}"):
                    pod = PodFacts(_grace_period(spec, f"{origin}: {workload}"), _mount_paths(container),
                                   _namespace(doc), services, mounts(container, spec, templates, claims),
                                   _memory_limit(container))
                    for config in container_configs(container, f"{origin}:{workload}/{name}", text):
                        config.pod = pod
                        configs.append(config)
    if not configs:
        raise UserError(f"{origin} has no container running vLLM (Pod, Deployment, StatefulSet, ...).")
    return configs
