"""What the audit reads (:class:`ServeConfig`) and what it reports (:class:`Finding`).

A ``ServeConfig`` is one vLLM server as configured: its ``vllm serve`` flags, its environment,
its image and the vLLM version in force.  Flags are normalised to their ``--dash-form``
(vLLM also accepts ``--under_score`` spellings) and kept in order, each with its value (None for
a bare switch).  Derived facts (TP size, connectors in use, whether KV offload is on) are
properties so each rule reads them the same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from packaging.version import Version

from kvtier.audit.dotted import merge_dotted
from kvtier.core.errors import UserError

TRANSFER_FLAG = "--kv-transfer-config"

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[Severity, ...] = ("error", "warning", "info")

HYBRID_MODEL_MARKERS = (
    "gemma-2", "gemma-3", "gemma-4", "gemma2", "gemma3", "gemma4", "qwen3.5", "qwen3.6", "qwen3-next",
    "qwen3_5", "deepseek-v4", "gpt-oss", "jamba", "mamba", "nemotron-h", "granite-4.0-h", "falcon-h1",
    "minimax-m", "glm-5", "kimi-linear",
)
"""Model-name fragments of hybrid-attention models (sliding window, Mamba or linear attention).

Hybrid architectures in vLLM's model registry (vllm/model_executor/models/: Gemma 2/3/4 sliding
windows, gpt-oss, Qwen3-Next/3.5 gated DeltaNet, GLM-5, MiniMax-M, Kimi-Linear) and well-known
Mamba hybrids (Jamba, Nemotron-H, Granite-4.0-H, Falcon-H1)."""

HMA_CONNECTORS = frozenset({
    "OffloadingConnector", "NixlConnector", "NixlPullConnector", "NixlPushConnector", "MooncakeConnector",
    "MooncakeStoreConnector", "LMCacheMPConnector", "HiSparseConnector", "MoRIIOConnector",
    "SimpleCPUOffloadConnector", "KVTierConnector",
})
"""Connectors that subclass ``SupportsHMA`` (vLLM 0.32.0: grep ``SupportsHMA`` in
vllm/distributed/kv_transfer/kv_connector/v1/; KVTierConnector: kvtier issue 10, docs/vllm.md).
MultiConnector counts only when every child does; LMCacheConnectorV1 does not (LMCache#3106)."""


@dataclass(frozen=True)
class MountFacts:
    """One ``volumeMounts`` entry of the container and the pod volume behind it.

    Attributes:
        path: ``mountPath``.
        read_only: ``readOnly: true`` on the mount.
        medium: the emptyDir's ``medium`` (``Memory``: a tmpfs in RAM), None otherwise.
        size_gib: what the volume may hold, GiB: an emptyDir's ``sizeLimit``, or the storage request of
            the PersistentVolumeClaim (a ``volumeClaimTemplates`` entry, an ephemeral volume's template or
            a PersistentVolumeClaim in the same file); None when unknown or unbounded.
        size_source: where ``size_gib`` came from, for messages (e.g. ``emptyDir sizeLimit 8Gi``).
        name: the mount's ``name``; bound: whether a ``volumes`` entry or a ``volumeClaimTemplates``
            entry of the pod has that name (Kubernetes refuses a mount of no volume).
    """

    path: str
    read_only: bool = False
    medium: str | None = None
    size_gib: float | None = None
    size_source: str = ""
    name: str = ""
    bound: bool = True


@dataclass(frozen=True)
class PodFacts:
    """What a Kubernetes manifest says about the pod a vLLM container runs in.

    Attributes:
        grace_period_s: ``terminationGracePeriodSeconds``, None when unset (Kubernetes then gives
            30 s: PodSpec API reference, kubernetes.io/docs/reference/kubernetes-api/workload-resources/pod-v1/).
        mount_paths: the container's ``volumeMounts[].mountPath``, in order.
        namespace: ``metadata.namespace`` of the workload, None when unset (the namespace it is
            applied to).
        services: names of the Services defined in the same file (hosts inside the namespace).
        mounts: the container's mounts with their volumes, in order (``mount_paths`` are their paths).
        memory_limit: the container's ``resources.limits.memory`` as written (a Kubernetes quantity such
            as ``64Gi``), None when unset.
    """

    grace_period_s: float | None = None
    mount_paths: tuple[str, ...] = ()
    namespace: str | None = None
    services: frozenset[str] = frozenset()
    mounts: tuple[MountFacts, ...] = ()
    memory_limit: str | None = None


@dataclass
class ServeConfig:
    """One configured vLLM server.

    Attributes:
        origin: where it came from (file name, and the container for manifests).
        flags: ``(flag, value)`` pairs in order; ``value`` None for a bare switch.
        positionals: non-flag words after ``serve`` (the model).
        env: environment variables.
        image: container image reference, if known.
        version: vLLM version in force, if known.
        text: the raw input text (for locating findings by line).
        launch: the words that start the server, joined (a container's ``command`` + ``args``, a
            shell line): install steps such as ``pip install kvtier`` are looked for in it.
        pod: the pod around the container, when read from a Kubernetes manifest; None otherwise.
        gpu: the GPU the server runs on (a ``kvtier size --gpu`` name, from ``kvtier audit --gpu``), if known.
        unresolved: variable references in the vLLM arguments whose value the input does not give, as
            written (``$NAME``, ``${NAME}``, a Kubernetes ``$(NAME)``).
        unexported: shell variables a script assigned without ``export`` (``NAME=value`` alone on a
            line, outside ``set -a``): the shell does not pass them to the server, so they are not in ``env``.
    """

    origin: str
    flags: list[tuple[str, str | None]] = field(default_factory=list)
    positionals: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    image: str | None = None
    version: Version | None = None
    text: str = ""
    launch: str = ""
    pod: PodFacts | None = None
    gpu: str | None = None
    unresolved: list[str] = field(default_factory=list)
    unexported: dict[str, str] = field(default_factory=dict)

    # --- flags -----------------------------------------------------------------------------
    def has(self, flag: str) -> bool:
        return any(name == flag for name, _ in self.flags)

    def value(self, flag: str) -> str | None:
        """The last value given to ``flag`` (vLLM's argparse keeps the last), None if absent/bare."""
        found = [v for name, v in self.flags if name == flag]
        return found[-1] if found else None

    def number(self, flag: str) -> float | None:
        raw = self.value(flag)
        try:
            return float(raw) if raw is not None else None
        except ValueError:
            return None

    def env_true(self, name: str) -> bool | None:
        raw = self.env.get(name)
        if raw is None:
            return None
        return raw.strip().lower() in ("1", "true", "yes", "on")

    # --- derived facts ----------------------------------------------------------------------
    @property
    def model(self) -> str:
        return self.value("--model") or (self.positionals[0] if self.positionals else "")

    def parallel_size(self, flag: str, short: str) -> tuple[str, str] | None:
        """The flag given (long or short form, the last one written wins as in vLLM's argparse) and
        its value, None when neither is given or it is bare."""
        found = [(name, v) for name, v in self.flags if name in (flag, short) and v is not None]
        return found[-1] if found else None

    def parallel_degree(self, flag: str, short: str) -> int:
        """The whole number ≥ 1 given to ``flag`` (or ``short``); 1 when absent or not such a number
        (vLLM refuses those: ``ParallelConfig`` ``int``, ``ge=1``, vllm/config/parallel.py; rule
        ``parallel-size-invalid`` reports them), so no rule computes with ``inf`` or ``nan``."""
        given = self.parallel_size(flag, short)
        if given is None:
            return 1
        try:
            value = int(given[1], 10)
        except ValueError:
            return 1
        return max(value, 1)

    @property
    def tp(self) -> int:
        return self.parallel_degree("--tensor-parallel-size", "-tp")

    @property
    def pp(self) -> int:
        return self.parallel_degree("--pipeline-parallel-size", "-pp")

    @property
    def kv_transfer_config(self) -> dict[str, Any] | None:
        """The transfer config vLLM runs with: the dotted ``--kv-transfer-config.KEY=VALUE`` flags
        merged when there are any (they replace the JSON, see :mod:`kvtier.audit.dotted`), else
        :attr:`kv_transfer_json`.

        Raises:
            UserError: a value is nested too deeply for Python's parser (RecursionError).
        """
        dotted = self.kv_transfer_dotted
        return dotted if dotted is not None else self.kv_transfer_json

    @property
    def kv_transfer_dotted_flags(self) -> list[str]:
        """The dotted ``--kv-transfer-config.KEY[=VALUE]`` flags, as written (normalised), in order."""
        return [name if value is None else f"{name}={value}" for name, value in self.flags
                if name.startswith(TRANSFER_FLAG + ".")]

    @property
    def kv_transfer_dotted(self) -> dict[str, Any] | None:
        """The dict vLLM builds from the dotted flags, None when there are none."""
        try:
            return merge_dotted(TRANSFER_FLAG, self.flags)
        except RecursionError:
            raise UserError(f"{self.origin}: a --kv-transfer-config.KEY value is nested too deeply to be a "
                            "connector config.") from None

    @property
    def kv_transfer_json(self) -> dict[str, Any] | None:
        """The plain ``--kv-transfer-config '{...}'`` JSON parsed, None when absent or not a JSON object.

        Raises:
            UserError: the JSON is nested too deeply for Python's parser (RecursionError).
        """
        raw = self.value(TRANSFER_FLAG)
        if raw is None:
            return None
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            return None
        except RecursionError:
            raise UserError(f"{self.origin}: --kv-transfer-config is nested too deeply to be a connector config.") from None
        return parsed if isinstance(parsed, dict) else None

    @property
    def offloading_backend(self) -> str | None:
        """``native`` / ``lmcache`` when ``--kv-offloading-size`` turns on vLLM's offload flags."""
        if not self.has("--kv-offloading-size"):
            return None
        return (self.value("--kv-offloading-backend") or "native").lower()

    @property
    def connectors(self) -> list[str]:
        """KV connectors in use, MultiConnector children included (vllm/config/vllm.py maps the
        offloading backend native → OffloadingConnector, lmcache → LMCacheConnectorV1)."""
        names: list[str] = []
        cfg = self.kv_transfer_config
        if cfg and isinstance(cfg.get("kv_connector"), str):
            names.append(cfg["kv_connector"])
            extra = cfg.get("kv_connector_extra_config") or {}
            for child in extra.get("connectors", []) if isinstance(extra, dict) else []:
                if isinstance(child, dict) and isinstance(child.get("kv_connector"), str):
                    names.append(child["kv_connector"])
        backend = self.offloading_backend
        if backend == "native":
            names.append("OffloadingConnector")
        elif backend == "lmcache":
            names.append("LMCacheConnectorV1")
        return names

    def uses(self, connector: str) -> bool:
        return connector in self.connectors

    @property
    def kv_offload_on(self) -> bool:
        """A KV offload / transfer connector is configured (any kind)."""
        return bool(self.connectors)

    @property
    def hybrid_model(self) -> bool:
        name = self.model.lower()
        return any(marker in name for marker in HYBRID_MODEL_MARKERS)

    @property
    def connector_extra(self) -> dict[str, Any]:
        cfg = self.kv_transfer_config or {}
        extra = cfg.get("kv_connector_extra_config")
        return extra if isinstance(extra, dict) else {}

    def at_least(self, version: str) -> bool | None:
        """True/False when the version is known, None when it is not."""
        return None if self.version is None else self.version >= Version(version)

    def line_of(self, needle: str) -> int | None:
        """1-based line of the first occurrence of ``needle`` in the input text, for SARIF."""
        for number, line in enumerate(self.text.splitlines(), start=1):
            if needle and needle in line:
                return number
        return None


@dataclass(frozen=True)
class Finding:
    """One problem found.  ``rule`` is the rule id; ``source`` the document section / release /
    issue the rule comes from; ``line`` where in the input (None when not locatable)."""

    rule: str
    severity: Severity
    message: str
    fix: str
    source: str
    origin: str = ""
    line: int | None = None

    def to_json(self) -> dict[str, str]:
        return {"rule": self.rule, "severity": self.severity, "message": self.message, "fix": self.fix,
                "source": self.source}
