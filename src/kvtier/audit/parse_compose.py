"""Read vLLM services out of a Docker Compose file (``services:``).

A service is audited when its image, ``entrypoint`` or ``command`` mentions vLLM.  Compose runs
``entrypoint`` (when given, it replaces the image's) followed by ``command`` (the image's CMD
otherwise); each is a list or a string Compose splits like a shell (Compose file reference,
docs.docker.com/reference/compose-file/services/ ``command``, ``entrypoint``).  The
``vllm/vllm-openai`` image's entrypoint is ``vllm serve`` (vLLM's docker/Dockerfile ``ENTRYPOINT``),
so without an ``entrypoint`` the ``command`` words are the server's arguments; an entrypoint of
``sh -c`` runs its script.  ``environment`` is read in both forms (a ``KEY=VALUE`` list or a
mapping); a name with no value there takes the host's value, which cannot be known offline, and
is skipped, as is ``env_file``; ``${VAR}`` in the server's arguments (Compose fills it from the
host's environment or ``.env``) is named as unresolved (rule ``shell-variable-unresolved``).
"""

from __future__ import annotations

from typing import Any

from kvtier.audit.model import ServeConfig
from kvtier.audit.parse_command import VARIABLE as _VARIABLE
from kvtier.audit.parse_k8s import container_configs, is_vllm
from kvtier.core.errors import UserError


def is_compose(doc: Any) -> bool:
    """Whether a YAML document is a Compose file: a mapping with a ``services`` mapping and no
    Kubernetes ``apiVersion`` / ``kind``."""
    return isinstance(doc, dict) and isinstance(doc.get("services"), dict) and "apiVersion" not in doc \
        and "kind" not in doc


def _environment(value: Any, where: str) -> list[dict[str, str]]:
    """``environment`` as Kubernetes-style ``{name, value}`` entries (the names with a value)."""
    if value is None:
        return []
    if isinstance(value, dict):
        items = [(str(k), v) for k, v in value.items() if v is not None]
        return [{"name": k, "value": str(v).lower() if isinstance(v, bool) else str(v)} for k, v in items]
    if isinstance(value, list):
        pairs = [str(item).split("=", 1) for item in value if "=" in str(item)]
        return [{"name": k, "value": v} for k, v in pairs]
    raise UserError(f"{where} environment must be a list of KEY=VALUE strings or a mapping, got "
                    f"{type(value).__name__}.")


def parse_compose(doc: dict[str, Any], text: str, origin: str) -> list[ServeConfig]:
    """One config per vLLM service of a Compose file, its origin ``FILE:services/NAME``.

    Raises:
        UserError: a service or one of its fields has the wrong type, or no service runs vLLM.
    """
    configs: list[ServeConfig] = []
    for name, service in doc["services"].items():
        where = f"{origin}:services/{name}"
        if service is None:
            continue
        if not isinstance(service, dict):
            raise UserError(f"{where} must be a mapping (image, command, environment, ...).")
        container = {"image": service.get("image"), "command": service.get("entrypoint"),
                     "args": service.get("command"), "env": _environment(service.get("environment"), where)}
        if is_vllm(container, where):
            for config in container_configs(container, where, text, references=False):
                for _flag, value in config.flags:  # Compose fills ${VAR} from the host's env or .env: not in the file
                    for match in _VARIABLE.finditer((value or "").replace("$$", "")):
                        if match.group(0) not in config.unresolved:
                            config.unresolved.append(match.group(0))
                configs.append(config)
    if not configs:
        raise UserError(f"{origin} is a Compose file with no service running vLLM (an image, entrypoint or command "
                        "naming vllm); audit the file that starts the server.")
    return configs
