"""The kvtier configuration: one typed model, loadable from a dict (vLLM's
``kv_connector_extra_config``), a YAML file, or ``KVTIER_*`` environment variables.

Sizes are GiB and mean the **total across all tensor-parallel ranks**, the same convention as
vLLM's ``--kv-offloading-size`` (vllm/config/cache.py documents it as the total buffer size
across TP ranks); each rank's store gets ``total / tp_size``.

Precedence: explicit values (dict or YAML) over ``KVTIER_*`` environment variables over defaults.
Every bad value fails at start-up with :class:`~kvtier.core.errors.ConfigError`, one sentence
naming the field and the fix.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import json
import os
import shutil
from collections.abc import Iterable
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from kvtier.core.errors import ConfigError
from kvtier.core.policies.admission import available_admissions
from kvtier.core.policies.registry import available_policies
from kvtier.core.tiers.registry import (
    available_tiers,
    import_tier_modules,
    lower_tiers,
    settings_keys,
    settings_model,
    spec,
    top_tier,
)

GiB = 1 << 30

_NUMBER_TYPES: tuple[Any, ...] = (int, float, int | None, float | None)
"""Annotations of the sizes, counts and durations that :meth:`KVTierConfig._no_bool_numbers` guards."""

HOST_CHECKS: ContextVar[bool] = ContextVar("kvtier_host_checks", default=True)
"""False while a configuration meant for another host is validated (``kvtier audit``): the disk
tier's directory is then neither looked at nor created, wherever ``disk_path`` came from."""


class KVTierConfig(BaseSettings):
    """kvtier settings.  See docs/vllm.md for the operator's table of keys."""

    model_config = SettingsConfigDict(env_prefix="KVTIER_", extra="forbid", frozen=True)

    chunk_tokens: int | Literal["auto"] = Field("auto", description=(
        "Tokens per chunk, a multiple of every KV cache group's block size; auto = the smallest such "
        "multiple that is at least 128, read from the engine's KV cache groups at start-up."))
    cpu_gib: float = Field(4.0, allow_inf_nan=False, description=(
        "CPU DRAM tier size in GiB, total across TP ranks; above 0: every chunk passes through the cpu tier."))
    disk_path: str | None = Field(None, description="Directory of the disk tier (local NVMe); unset = no disk tier.")
    disk_gib: float = Field(0.0, ge=0, allow_inf_nan=False, description="Disk tier size in GiB, total across TP ranks.")
    write_mode: Literal["write-back", "write-through"] = Field(
        "write-through", description="write-through: every saved chunk is queued for disk at once (a hard kill "
        "loses at most the queue); write-back: chunks go to disk when evicted from cpu or at a graceful stop.")
    policy: str = Field("default", description="Eviction policy name (kvtier.core.policies).")
    admission: dict[str, str] = Field(default_factory=dict, description=(
        "Admission policy per lower tier, e.g. {disk: reused}: all (default) or reused (only chunks served "
        "from the cpu tier at least once); kvtier.core.policies.admission."))
    save_queue_depth: int = Field(64, gt=0, description="Disk writes queued at most; more are dropped and counted.")
    io_threads: int = Field(2, gt=0, le=64, description="Worker threads for disk I/O.")
    load_wait_s: float = Field(10.0, gt=0, le=600, allow_inf_nan=False, description=(
        "Longest an engine load waits for chunks still being read from a lower tier (disk, shared); "
        "past it, the blocks from the first missing chunk on are recomputed by the engine."))
    disk_io: Literal["auto", "buffered", "direct"] = Field(
        "auto", description="Disk tier I/O: direct = O_DIRECT (bypasses the page cache), buffered, or auto = direct "
        "where supported unless a start-up probe finds it clearly slower.")
    disk_rescan_s: float | None = Field(None, ge=0, le=3600, allow_inf_nan=False, description=(
        "Seconds between rescans of disk_path for chunk files other engines wrote or removed (adopted into "
        "the index and the eviction policy, reported to the scheduler); lookups never touch the filesystem, so "
        "this is how engines sharing a directory see each other's chunks; 0 = never; unset = 2 in a vLLM engine, "
        "never for a store used on its own."))
    disk_fsync: bool = Field(False, description="fsync each chunk file before it becomes visible (durable across power loss).")
    shutdown_flush_s: float = Field(30.0, ge=0, allow_inf_nan=False,
                                    description="On a graceful stop, seconds allowed to write dirty DRAM chunks to disk.")
    spill_watermark: float = Field(0.1, ge=0, lt=1, allow_inf_nan=False, description="Free share of the cpu tier kept by spilling ahead.")
    tier_modules: tuple[str, ...] = Field((), description=(
        "Python modules imported before the rest is read, each registering tiers from outside kvtier "
        "(kvtier.core.tiers.registry.register; docs/store.md, 'Adding a tier'); e.g. [mycompany.kvtier_tiers]."))
    tier_settings: dict[str, dict[str, Any]] = Field(default_factory=dict, description=(
        "Settings of tiers from outside kvtier, by tier name, each checked by the tier's own settings model "
        "(kvtier.core.tiers.registry.TierSpec.settings), e.g. {mytier: {capacity_mib: 64}}."))
    tiers: tuple[str, ...] = Field(default_factory=lambda: tuple(available_tiers()), min_length=1, description=(
        "Tiers in order, top first (kvtier.core.tiers.registry); a tier whose settings are unset is skipped."))
    shared_deadline_s: float = Field(0.25, gt=0, le=60, allow_inf_nan=False, description=(
        "Deadline of one shared-tier lookup or read batch, seconds; past it the shared tier counts as a miss."))
    shared_transfer_deadline_s: float = Field(5.0, gt=0, le=600, allow_inf_nan=False, description=(
        "Deadline of one shared-tier read or write batch (chunk bytes on the wire), seconds; later is a miss."))
    shared_queue_depth: int = Field(64, gt=0, description=(
        "Shared-tier lookups in flight at most; more are answered from local tiers alone."))
    shared_secret: str | None = Field(None, repr=False, min_length=16, description=(
        "Secret shared by every engine of one cache: values carry a keyed BLAKE3 MAC (docs/shared-tier.md)."))
    shared_secret_file: str | None = Field(None, description="File holding shared_secret (e.g. a Kubernetes Secret).")
    redis_url: str | None = Field(None, repr=False, description=(
        "redis:// or rediss:// (TLS) URL of the shared tier (Redis or Valkey); unset = no redis tier."))
    redis_cluster: bool = Field(False, description="The URL names a seed node of a Redis/Valkey Cluster.")
    redis_password_env: str | None = Field(None, description="Environment variable holding the Redis password.")
    redis_password_file: str | None = Field(None, description="File holding the Redis password.")
    redis_tls_ca_file: str | None = Field(None, description="CA bundle for rediss:// (default: the system's).")
    redis_key_prefix: str = Field("kvtier:", max_length=128, description="Prefix of every key kvtier writes.")
    redis_ttl_s: int = Field(86400, gt=0, description="Seconds a value lives in Redis (SET ... EX).")
    redis_connect_timeout_s: float = Field(0.5, gt=0, le=60, allow_inf_nan=False,
                                           description="Connect timeout of one Redis connection, seconds.")
    redis_timeout_s: float = Field(1.0, gt=0, le=60, allow_inf_nan=False,
                                   description="Read/write timeout of one Redis call, seconds.")
    redis_breaker_failures: int = Field(3, gt=0, description="Failed calls in a row that open the circuit breaker.")
    redis_breaker_probe_s: float = Field(2.0, gt=0, le=3600, allow_inf_nan=False,
                                         description="Seconds between probes while the breaker is open.")

    @model_validator(mode="before")
    @classmethod
    def _register_tier_modules(cls, values: Any) -> Any:
        # before any field: ``tiers`` and ``admission`` are checked against the registry these fill
        modules = values.get("tier_modules") if isinstance(values, dict) else None
        if modules is None:
            modules = _env_list("KVTIER_TIER_MODULES")
        if isinstance(modules, str):
            modules = [modules]
        if isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules):
            try:
                import_tier_modules(tuple(modules))
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        return values

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads true as 1 for an int or float field: a size or count is never a boolean
        if isinstance(value, bool) and info.field_name is not None and \
                cls.model_fields[info.field_name].annotation in _NUMBER_TYPES:
            raise ValueError(f"must be a number, not the boolean {str(value).lower()}")
        return value

    @field_validator("chunk_tokens", mode="before")
    @classmethod
    def _chunk_tokens(cls, value: Any) -> int | str:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value.strip())
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError("must be auto or a positive whole number of tokens that every KV cache group's block "
                             "size divides, e.g. 128")
        return value

    @field_validator("cpu_gib")
    @classmethod
    def _cpu_tier_present(cls, value: float) -> float:
        # one rule, one sentence: 0 and a negative size are refused alike (no ge=0 on the field,
        # whose generic "greater than or equal to 0" would give -1 another sentence than 0)
        if value <= 0:
            raise ValueError("must be above 0: every chunk passes through the cpu tier, also on its way to disk or "
                             "Redis; give it room for hundreds of chunks, e.g. 4")
        return value

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, value: str) -> str:
        if value not in available_policies():
            raise ValueError(f"unknown policy {value!r}; choose one of {', '.join(available_policies())}")
        return value

    @field_validator("admission")
    @classmethod
    def _known_admission(cls, value: dict[str, str]) -> dict[str, str]:
        lower = lower_tiers()
        for tier, name in value.items():
            if tier not in lower:
                raise ValueError(f"admission is set for tier {tier!r}; set it for a lower tier: {', '.join(lower)} "
                                 f"(the {top_tier()} tier takes every chunk the engine computes)")
            if name not in available_admissions():
                raise ValueError(f"unknown admission policy {name!r} for tier {tier!r}; choose one of "
                                 f"{', '.join(available_admissions())}")
        return value

    @field_validator("tiers")
    @classmethod
    def _known_tiers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        known = available_tiers()
        for name in value:
            if name not in known:
                raise ValueError(f"unknown tier {name!r}; choose from {', '.join(known)}")
        if len(set(value)) != len(value):
            raise ValueError("a tier is listed twice; list each tier once")
        if value[0] != top_tier():
            raise ValueError(f"the first tier must be {top_tier()!r} (every chunk passes through it)")
        return value

    @field_validator("tier_settings")
    @classmethod
    def _known_tier_settings(cls, value: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        for name, settings in value.items():
            try:
                model = settings_model(name)
            except ConfigError as exc:
                raise ValueError(f"tier_settings names {name!r}: {exc}") from None
            if model is None:
                raise ValueError(f"tier_settings names tier {name!r}, which takes no settings there; remove it")
            try:
                model(**settings)  # a pydantic-settings model also reads its KVTIER_* variables
            except ValidationError as exc:
                err = exc.errors()[0]
                where = ".".join(str(p) for p in err["loc"])
                raise ValueError(f"tier_settings.{name}.{where}: {err['msg']}; fix that setting of the {name} "
                                 "tier") from None
        return value

    def settings_of(self, name: str) -> Any:
        """Tier ``name``'s settings (its model from :func:`~kvtier.core.tiers.registry.settings_model`,
        filled from ``tier_settings[name]``), or ``None`` if the tier declares no model.

        Raises:
            ConfigError: unknown tier.
        """
        model = settings_model(name)
        return None if model is None else model(**self.tier_settings.get(name, {}))

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str | None) -> str | None:
        if value is not None and urlsplit(value).scheme not in ("redis", "rediss"):
            raise ValueError("redis_url must start with redis:// or rediss:// (TLS), e.g. redis://10.0.0.5:6379/0")
        if value is not None:
            # redis-py parses the port the same way (urllib); a bad one raised in the worker after the model loaded
            try:
                port = urlsplit(value).port
            except ValueError:
                port = 0
            if port == 0:
                raise ValueError("redis_url's port must be a number from 1 to 65535, e.g. redis://10.0.0.5:6379/0")
            parts = urlsplit(value)
            if not parts.hostname:
                raise ValueError("redis_url names no host; give one, e.g. redis://10.0.0.5:6379/0")
            database = parts.path.strip("/")
            if database and not database.isdigit():  # redis-py reads the path as the database number
                raise ValueError(f"redis_url's database {database!r} must be a number, e.g. redis://10.0.0.5:6379/0")
        return value

    @field_validator("disk_path")
    @classmethod
    def _expand_disk_path(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if "\0" in value:
            raise ValueError("disk_path contains a NUL byte; give a plain directory path")
        return os.path.expanduser(os.path.expandvars(value))

    @model_validator(mode="after")
    def _disk_consistent(self) -> KVTierConfig:
        if self.disk_gib > 0 and not self.disk_path:
            raise ValueError("disk_gib is set but disk_path is not; set disk_path to a local directory or disk_gib to 0")
        if self.disk_path and self.disk_gib > 0 and HOST_CHECKS.get():
            _check_disk_path(Path(self.disk_path), self.disk_gib)
        for tier, name in self.admission.items():  # judged when a chunk leaves the cpu tier (write-back)
            if name != "all" and (spec(tier).shared or self.write_mode != "write-back"):
                raise ValueError(f"admission {name!r} for tier {tier!r} needs write_mode write-back and a local tier "
                                 "(a chunk is judged when it leaves the cpu tier); set write_mode: write-back "
                                 "or admission all")
        return self

    def public_dict(self) -> dict[str, Any]:
        """The settings with secrets hidden (a URL's password, ``shared_secret``), safe to log or export."""
        out = self.model_dump()
        if self.redis_url:
            out["redis_url"] = redact_url(self.redis_url)
        if self.shared_secret:
            out["shared_secret"] = "<set>"
        return out

    @classmethod
    def known_keys(cls, values: dict[str, Any] | None = None) -> list[str]:
        """Every key a configuration may hold: the fields of this model, then each registered
        tier's settings keys (after importing the ``tier_modules`` of ``values``, which register
        tiers), which may be given flat (``{"mytier_size_mib": 8}``) or under ``tier_settings``.

        Raises:
            ConfigError: a module in ``tier_modules`` cannot be imported, or two tiers declare one key.
        """
        modules = (values or {}).get("tier_modules")
        if isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules):
            import_tier_modules(tuple(modules))
        try:
            tier_keys = settings_keys()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return [*cls.model_fields, *(k for k in tier_keys if k not in cls.model_fields)]

    # ---- loaders -------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, values: dict[str, Any] | None = None) -> KVTierConfig:
        """Build from a dict (e.g. vLLM's ``kv_connector_extra_config``), env vars filling the rest.

        Raises:
            ConfigError: one sentence naming the bad field and the fix.
        """
        if values is not None and not isinstance(values, dict):
            raise ConfigError("kvtier config must be a mapping of keys to values, e.g. {\"cpu_gib\": 8}")
        values = dict(values or {})
        known = cls.known_keys(values)
        for key in values:
            if key not in known:
                # checked here: pydantic-settings would take keys such as "_env_file" as its own options
                raise ConfigError(f"unknown kvtier config key {key!r}{did_you_mean(key, known)}; "
                                  f"known keys are {', '.join(known)}")
        values = _route_tier_keys(values, known)
        _check_env(values)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(*_one_sentence(exc, explicit=set(values))) from None
        except SettingsError as exc:  # a KVTIER_* variable of a list or mapping field that is not JSON
            field = next((name for name in cls.model_fields if f'field "{name}"' in str(exc)), "")
            var = f"KVTIER_{field.upper()}"
            raise ConfigError(f"environment variable {var} must be JSON for {field}, e.g. "
                              f"{var}='{_JSON_EXAMPLES.get(field, '...')}'; fix or unset it", env_var=var) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KVTierConfig:
        """Build from a YAML mapping file.

        Raises:
            ConfigError: unreadable file, not a mapping, or a bad field.
        """
        try:
            data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text; save it as UTF-8") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {str(exc).splitlines()[0]}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
        return cls.from_dict(data)

    # ---- derived values ------------------------------------------------------------------
    def validate_block_size(self, block_size: int) -> None:
        """Check ``chunk_tokens`` against the engine's block size (tokens); ``auto`` always fits
        (the engine resolves it to a multiple of every block size).

        Raises:
            ConfigError: if ``chunk_tokens`` is not a positive multiple of ``block_size``.
        """
        if self.chunk_tokens == "auto":
            return
        if self.chunk_tokens % block_size:
            raise ConfigError(f"chunk_tokens={self.chunk_tokens} is not a multiple of the engine block size "
                              f"{block_size}; set chunk_tokens to a multiple of {block_size} "
                              f"(e.g. {max(block_size, self.chunk_tokens // block_size * block_size)})")

    def cpu_bytes_per_rank(self, tp_size: int = 1) -> int:
        """CPU tier bytes held by one tensor-parallel rank: ``cpu_gib`` × GiB / ``tp_size``."""
        return int(self.cpu_gib * GiB) // tp_size

    def disk_bytes_per_rank(self, tp_size: int = 1) -> int:
        """Disk tier bytes held by one tensor-parallel rank: ``disk_gib`` × GiB / ``tp_size``."""
        return int(self.disk_gib * GiB) // tp_size if self.disk_path else 0


def redact_url(url: str) -> str:
    """``url`` with its password (and user) replaced by ``***``, for logs and metrics."""
    parts = urlsplit(url)
    if parts.password is None and parts.username is None:
        return url
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def _check_disk_path(path: Path, disk_gib: float) -> None:
    """Writability and free space of the disk tier's directory, creating it only if both hold."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"disk_path {str(path)!r} is a file, not a directory; point it at a directory")
    existing = path
    while not existing.exists():
        existing = existing.parent
    pseudo = pseudo_filesystem(existing)
    if pseudo is not None:
        fstype, mount_point = pseudo
        raise ValueError(f"disk_path {str(path)!r} is on the {fstype} filesystem mounted at {mount_point}, a kernel "
                         "interface that cannot hold chunk files; point it at a directory on a local disk (e.g. NVMe)")
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"disk_path {str(path)!r} is not writable; point it at a writable directory")
    free = shutil.disk_usage(existing).free
    used = _dir_bytes(path) if path.exists() else 0  # what kvtier already holds there is available to it
    if disk_gib * GiB > free + used:
        if path.exists():
            raise ValueError(f"disk_gib={disk_gib} exceeds the {(free + used) / GiB:.1f} GiB free on "
                             f"{str(path)!r}; lower disk_gib or free space")
        # a path that does not exist is named as such: the free space is its nearest existing parent's,
        # typically the root disk because the volume meant for the tier is not mounted
        raise ValueError(f"disk_path {str(path)!r} does not exist, and disk_gib={disk_gib} exceeds the "
                         f"{free / GiB:.1f} GiB free on {str(existing)!r}, its nearest existing parent, where it "
                         "would be created; mount the disk meant for the tier there (e.g. the NVMe volume), or "
                         "lower disk_gib")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".kvtier-write-probe-{os.getpid()}"
        probe.write_bytes(b"x")
        probe.unlink()
    except OSError as exc:
        if exc.errno == errno.ENOSPC and used:  # full of kvtier's own chunk files, which the tier evicts to make room
            with contextlib.suppress(OSError):
                probe.unlink()
            return
        raise ValueError(f"disk_path {str(path)!r} is not writable ({exc.strerror}); "
                         "point it at a writable directory") from None


PSEUDO_FILESYSTEMS = frozenset({
    "proc", "sysfs", "devtmpfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs", "pstore",
    "bpf", "configfs", "fusectl", "mqueue", "binfmt_misc", "autofs", "efivarfs", "nsfs", "rpc_pipefs",
})
"""Kernel interfaces that look like directories but hold no files (proc(5), sysfs(5))."""


def mount_of(path: Path, mounts: str = "/proc/self/mounts") -> tuple[str, str] | None:
    """``(fstype, mount point)`` of the filesystem holding ``path`` (an existing path), or None.

    Reads the longest matching mount point of ``mounts`` (proc(5) ``/proc/self/mounts``); None on a
    host without that file (not Linux).
    """
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return None
    resolved = str(path.resolve())
    best: tuple[str, str] | None = None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[1])):
            best = (fields[2], point)
    return best


def pseudo_filesystem(path: Path) -> tuple[str, str] | None:
    """``(fstype, mount point)`` when ``path`` (an existing path) lies on a kernel pseudo filesystem."""
    mount = mount_of(path)
    return mount if mount is not None and mount[0] in PSEUDO_FILESYSTEMS else None


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_JSON_EXAMPLES = {"admission": '{"disk": "reused"}', "tiers": '["cpu", "disk"]',
                  "tier_modules": '["mycompany.kvtier_tiers"]', "tier_settings": '{"mytier": {"capacity_mib": 64}}'}


def _check_env(values: dict[str, Any]) -> None:
    """Reject ``KVTIER_*`` variables that name no field (a typo would otherwise be ignored).

    The variable that ``redis_password_env`` names (in ``values`` or ``KVTIER_REDIS_PASSWORD_ENV``)
    holds the password, not a setting, and is exempt: docs/shared-tier.md names it
    ``KVTIER_REDIS_PASSWORD``.
    """
    known = {f"KVTIER_{name.upper()}" for name in KVTierConfig.known_keys(values)}
    password_env = values.get("redis_password_env", os.environ.get("KVTIER_REDIS_PASSWORD_ENV"))
    for var in os.environ:
        if var.upper().startswith("KVTIER_") and var.upper() not in known and var != password_env:
            raise ConfigError(f"environment variable {var} is not a kvtier setting{did_you_mean(var.upper(), known)}; "
                              "rename or unset it (a Redis password variable must be the one named by "
                              f"redis_password_env); known ones are {', '.join(sorted(known))}", env_var=var)


def _route_tier_keys(values: dict[str, Any], known: list[str]) -> dict[str, Any]:
    """``values`` with each flat key of a tier's settings model moved under ``tier_settings[tier]``.

    Raises:
        ConfigError: a key given both flat and under ``tier_settings``.
    """
    owners = {k: t for k, t in settings_keys().items() if k not in KVTierConfig.model_fields}
    flat = [k for k in values if k in owners]
    if not flat:
        return values
    out = {k: v for k, v in values.items() if k not in owners}
    nested = {name: dict(v) for name, v in (values.get("tier_settings") or {}).items()} \
        if isinstance(values.get("tier_settings"), dict) else {}
    for key in flat:
        tier = owners[key]
        if key in nested.setdefault(tier, {}):
            raise ConfigError(f"{key!r} is given both at the top level and in tier_settings.{tier}; give it once")
        nested[tier][key] = values[key]
    out["tier_settings"] = nested
    return out


def _env_list(var: str) -> list[str] | None:
    """A ``KVTIER_*`` list variable's value: JSON, or one bare name; ``None`` when unset or not a list."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return [raw]
    return value if isinstance(value, list) else None


def _dir_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _one_sentence(exc: ValidationError, explicit: set[str] | None = None) -> tuple[str, str | None]:
    """The first error of ``exc`` as one sentence, and the ``KVTIER_*`` variable it comes from (or None)."""
    errors = exc.errors()
    # a value the caller gave explicitly first: an environment variable's error is the caller's only if no other
    err = next((e for e in errors if explicit and ".".join(map(str, e["loc"])) in explicit), errors[0])
    field = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not field:  # a check across fields: its message names the fields itself
        return f"kvtier config: {msg}", None
    env_var = None
    if explicit is not None and field not in explicit and f"KVTIER_{field.upper()}" in os.environ:
        env_var = f"KVTIER_{field.upper()}"
    source = f" (from environment variable {env_var})" if env_var else ""
    value = err.get("input")
    secret = field in ("redis_url", "shared_secret")  # never echo a password or a secret
    shown = f" (got {value!r})" if value is not None and not isinstance(value, dict) and not secret else ""
    return f"kvtier config field {field!r}{source}: {msg}{shown}; fix the value of {field!r}", env_var
