"""The kvtier configuration: one typed model, loadable from a dict (vLLM's
``kv_connector_extra_config``), a YAML file, or ``KVTIER_*`` environment variables.

Sizes are GiB and mean the **total across all tensor-parallel ranks**, the same convention as
vLLM's ``--kv-offloading-size`` (vllm/config/cache.py documents it as the total buffer size
across TP ranks); each rank's store gets ``total / tp_size``.

Precedence: explicit values (dict or YAML) over ``KVTIER_*`` environment variables over defaults.
Every bad value fails at start-up with :class:`~kvtier.core.errors.ConfigError`, one sentence
naming the field and the fix.  Validating is pure: it reads the values and the ``KVTIER_*``
environment, never a filesystem; what a tier needs of the host (the disk tier's directory, a
password file) is checked by the tier's factory and by its preflight check
(:func:`kvtier.core.tiers.factory.check`: ``kvtier check``, the vLLM plugin before the model loads).
"""

from __future__ import annotations

import os
from typing import Any, Literal

from pydantic import (
    BaseModel,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import SettingsConfigDict, SettingsError

from kvtier.core import configload
from kvtier.core.codecsettings import EncryptionSettings, check_codecs, needs_keys
from kvtier.core.configload import JSON_EXAMPLES, check_env, env_list, one_sentence, read_yaml, unknown_key
from kvtier.core.configload import redact_url as redact_url  # noqa: PLC0414 - re-exported: its home was here
from kvtier.core.errors import ConfigError
from kvtier.core.policies.admission import available_admissions
from kvtier.core.policies.registry import available_policies
from kvtier.core.quota import QuotaSettings
from kvtier.core.receiptsettings import ReceiptSettings, receipt_keys_last
from kvtier.core.tiers.registry import (
    RESET_SCOPES,
    available_tiers,
    import_tier_modules,
    lower_tiers,
    settings_keys,
    settings_model,
    spec,
    top_tier,
)
from kvtier.core.tiersettings import build_tier_settings, check_tier_settings, route_flat_keys

GiB = 1 << 30

MAX_CHUNK_TOKENS = 1 << 24
"""Longest ``chunk_tokens`` accepted, tokens (16,777,216): longer than the context of any model
vLLM serves (the longest, Llama 4 Scout's, is 10M tokens), so a longer chunk would never fill and
kvtier would store nothing; it also keeps a chunk's bytes from overflowing the cpu tier's pages."""

_NUMBER_TYPES: tuple[Any, ...] = (int, float, int | None, float | None)
"""Annotations of the sizes, counts and durations that :meth:`KVTierConfig._no_bool_numbers` guards."""


class KVTierConfig(ReceiptSettings):
    """kvtier settings.  See docs/vllm.md for the operator's table of keys.

    Each registered tier's own keys (:meth:`settings_of`; e.g. the redis tier's) are accepted flat
    as well as under ``tier_settings`` (:mod:`kvtier.core.tiersettings`); the receipts' keys are
    declared in the base class (:mod:`kvtier.core.receiptsettings`)."""

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
    sync_load_max_bytes: int = Field(128 << 20, ge=0, le=1 << 40, description=(
        "Bytes per rank per engine step a request may load synchronously (copied before the forward of the step "
        "that schedules it, not parked in WAITING_FOR_REMOTE_KVS) when its hit is all in the cpu tier or the node "
        "pool (sync_shared_loads); disk, redis and s3 hits and hybrid models load asynchronously. 0: none."))
    sync_shared_loads: bool = Field(True, description="Node-pool hits load synchronously too (pinned on the engine's thread within shared_deadline_s).")
    idle_step_wait_s: float = Field(0.005, ge=0, le=1.0, allow_inf_nan=False, description=(
        "Longest an engine step that computes no tokens (every request parked for an asynchronous load) waits "
        "on each rank for a load in flight to end, so that the engine does not spin empty steps while the "
        "loader threads work; a load that ends during the wait is reported in that step. Also the most a "
        "request arriving meanwhile waits to be scheduled. Steps that compute tokens never wait. 0: no wait."))
    async_saves: bool = Field(True, description="Saves copy off the engine's thread; blocks held till done (docs/vllm.md).")
    layerwise_loads: bool = Field(False, description="Synchronous loads layer by layer (docs/vllm.md, GPU); off: whole.")
    disk_io: Literal["auto", "buffered", "direct"] = Field(
        "auto", description="Disk tier I/O: direct = O_DIRECT (bypasses the page cache), buffered, or auto = direct "
        "where supported unless a start-up probe finds it clearly slower.")
    disk_rescan_s: float | None = Field(None, ge=0, le=3600, allow_inf_nan=False, description=(
        "Seconds between rescans of disk_path for chunk files other engines wrote or removed (adopted into "
        "the index and the eviction policy, reported to the scheduler); lookups never touch the filesystem, so "
        "this is how engines sharing a directory see each other's chunks; 0 = never; unset = 2 in a vLLM engine, "
        "never for a store used on its own."))
    disk_fsync: bool = Field(False, description="fsync each chunk file before it becomes visible (durable across power loss).")
    shutdown_flush_s: float = Field(30.0, ge=0, le=3600, allow_inf_nan=False, description=(
        "On a graceful stop, seconds allowed to write dirty DRAM chunks to disk; at most an hour (a stop "
        "must end: the grace periods of docs/deploy.md are sized from it)."))
    pin_max_share: float = Field(0.25, ge=0, le=0.9, allow_inf_nan=False, description=(
        "Largest share of the cpu tier's pages that requests may pin with a TTL (kv_transfer_params "
        "kvtier_pin_s); a pin past it is refused and counted; 0 turns pins off."))
    pin_max_s: float = Field(3600.0, gt=0, allow_inf_nan=False, description=(
        "Longest TTL a request may ask for its pinned prefix, seconds (a longer one is cut to this)."))
    tenant_quotas: QuotaSettings | None = Field(None, description=(
        "Tenant quotas: each cache_salt's guaranteed share of every local tier (cpu, disk), e.g. "
        "{default_share: 0.2, salts: {tenant-a: 0.5}}; a tenant at its share evicts its own chunks first, and no "
        "tenant's saves evict another below its share (kvtier.core.quota); unset = no quotas."))
    reset_scope: str = Field("local", description=(
        "Tiers cleared when vLLM asks for an external reset (POST /reset_prefix_cache?reset_external=true): "
        "cpu = the cpu tier; local = cpu and disk; all = also the shared tier (only this engine's namespace keys)."))
    spill_watermark: float = Field(0.1, ge=0, lt=1, allow_inf_nan=False, description="Free share of the cpu tier kept by spilling ahead.")
    tier_modules: tuple[str, ...] = Field((), description=(
        "Python modules imported before the rest is read, each registering tiers from outside kvtier "
        "(kvtier.core.tiers.registry.register; docs/store.md, 'Adding a tier'); e.g. [mycompany.kvtier_tiers]."))
    tier_settings: dict[str, dict[str, Any]] = Field(default_factory=dict, validate_default=True, repr=False, description=(
        "Settings of tiers by tier name, each checked by the tier's own settings model "
        "(kvtier.core.tiers.plugin.TierPlugin.settings), e.g. {mytier: {capacity_mib: 64}}; a tier's keys "
        "may also be given at the top level, as the built-in tiers' are."))
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
    codecs: dict[str, tuple[str, ...]] = Field(default_factory=dict, description=(
        "Codec chain per lower tier, applied in order on write, e.g. {disk: [aes-256-gcm]}; a tier not named "
        "stores payloads as they are (identity); the header records the chain, so any chain is read (docs/security.md)."))
    encryption: EncryptionSettings | None = Field(None, description=(
        "Master keys of the aes-256-gcm codec: {master_key_file: path} or {master_key_env: VAR}, plus "
        "previous_key_files / previous_key_envs that still decrypt (rotation); never the key itself."))
    _tier_models: dict[str, BaseModel] = PrivateAttr(default_factory=dict)  # settings_of's, built once

    @model_validator(mode="before")
    @classmethod
    def _register_tier_modules(cls, values: Any) -> Any:
        # before any field: ``tiers`` and ``admission`` are checked against the registry these fill
        modules = values.get("tier_modules") if isinstance(values, dict) else None
        if modules is None:
            modules = env_list("KVTIER_TIER_MODULES")
        if isinstance(modules, str):
            modules = [modules]
        if isinstance(modules, (list, tuple)) and all(isinstance(m, str) for m in modules):
            try:
                import_tier_modules(tuple(modules))
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
        # a tier's keys given at the top level go under tier_settings, checked by the tier's model there
        return route_flat_keys(values, set(cls.model_fields)) if isinstance(values, dict) else values

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
        if value > MAX_CHUNK_TOKENS:
            raise ValueError(f"must be at most {MAX_CHUNK_TOKENS} tokens: a longer chunk is longer than any model's "
                             "context (the longest, Llama 4 Scout's, is 10M tokens) and would never fill; set it to "
                             "auto (the default) or e.g. 128")
        return value

    @field_validator("reset_scope")
    @classmethod
    def _known_reset_scope(cls, value: str) -> str:
        if value not in RESET_SCOPES:  # the scopes' names come from the tier registry
            raise ValueError(f"must be one of {', '.join(RESET_SCOPES)}")
        return value

    @field_validator("cpu_gib", "disk_gib")
    @classmethod
    def _tier_sizes(cls, value: float, info: ValidationInfo) -> float:
        if info.field_name == "cpu_gib" and value <= 0:  # one sentence for 0 and -1 (ge=0's would differ)
            raise ValueError("must be above 0: every chunk passes through the cpu tier, also on its way to disk or "
                             "Redis; give it room for hundreds of chunks, e.g. 4")
        return configload.check_gib(value)

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

    @field_validator("codecs")
    @classmethod
    def _known_codecs(cls, value: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        return check_codecs(value)

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

    @field_validator("tier_settings", mode="before")
    @classmethod
    def _known_tier_settings(cls, value: Any) -> Any:
        return check_tier_settings(value)

    def settings_of(self, name: str) -> Any:
        """Tier ``name``'s settings: its model (:func:`~kvtier.core.tiers.registry.settings_model`)
        filled from ``tier_settings[name]`` (flat keys land there) and the environment when this
        configuration was built, or ``None`` if the tier declares no model.

        Raises:
            ConfigError: unknown tier.
            pydantic.ValidationError: the tier's model needs a key that is not given.
        """
        model = settings_model(name)
        if model is None:
            return None
        if name not in self._tier_models:
            self._tier_models[name] = model(**self.tier_settings.get(name, {}))
        return self._tier_models[name]

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
        if self.shared_secret and self.shared_secret_file:  # the secret given inline wins: the file is never read
            raise ValueError("give one of shared_secret or shared_secret_file, not both (the file would never be read)")
        for tier, name in self.admission.items():  # judged when a chunk leaves the cpu tier (write-back)
            if name != "all" and (spec(tier).shared or self.write_mode != "write-back"):
                raise ValueError(f"admission {name!r} for tier {tier!r} needs write_mode write-back and a local tier "
                                 "(a chunk is judged when it leaves the cpu tier); set write_mode: write-back "
                                 "or admission all")
        needs_keys(self.codecs, self.encryption)
        self._tier_models.update(build_tier_settings(self.tier_settings))
        return self

    def __repr_args__(self) -> Any:
        # each tier's settings by its own model's repr, which leaves out its secrets (repr=False)
        yield from super().__repr_args__()
        for model in self._tier_models.values():
            yield from model.__repr_args__()

    def flat_dict(self, exclude_unset: bool = False) -> dict[str, Any]:
        """The settings as ``kv_connector_extra_config`` takes them: this model's fields and every
        tier's settings at the top level (``tier_settings`` itself left out); with
        ``exclude_unset`` only what was given (explicitly or by a ``KVTIER_*`` variable)."""
        out = self.model_dump(exclude_unset=exclude_unset, exclude={"tier_settings"})
        for name in self._tier_models:
            out.update(self.settings_of(name).model_dump(exclude_unset=exclude_unset))
        return out

    def public_dict(self) -> dict[str, Any]:
        """:meth:`flat_dict` with secrets hidden (``repr=False`` fields: a URL's password and user,
        anything else as ``<set>``), safe to log or export."""
        secret = {k for k, f in type(self).model_fields.items() if f.repr is False}
        for name in self._tier_models:
            secret.update(k for k, f in type(self.settings_of(name)).model_fields.items() if f.repr is False)
        out = self.flat_dict()
        if self.tenant_quotas is not None:  # salts only as digests (kvtier.core.quota.tenant_label)
            out["tenant_quotas"] = self.tenant_quotas.public()
        for key in secret:
            value = out.get(key)
            if value:
                out[key] = redact_url(value) if isinstance(value, str) and "://" in value else "<set>"
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
        return [*receipt_keys_last(cls.model_fields), *(k for k in tier_keys if k not in cls.model_fields)]

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
                raise ConfigError(unknown_key(key, known))
        check_env(values, known)
        try:
            return cls(**values)
        except ValidationError as exc:
            raise ConfigError(*one_sentence(exc, cls.model_fields, explicit=set(values))) from None
        except SettingsError as exc:  # a KVTIER_* variable of a list or mapping field that is not JSON
            field = next((name for name in cls.model_fields if f'field "{name}"' in str(exc)), "")
            var = f"KVTIER_{field.upper()}"
            raise ConfigError(f"environment variable {var} must be JSON for {field}, e.g. "
                              f"{var}='{JSON_EXAMPLES.get(field, '...')}'; fix or unset it", env_var=var) from None

    @classmethod
    def from_yaml(cls, path: str | os.PathLike[str]) -> KVTierConfig:
        """Build from a YAML mapping file.

        Raises:
            ConfigError: unreadable file, not a mapping, or a bad field.
        """
        return cls.from_dict(read_yaml(path))

    def validate_block_size(self, block_size: int) -> None:
        """Check ``chunk_tokens`` against the engine's block size (tokens); ``auto`` always fits
        (the engine resolves it to a multiple of every block size).

        Raises:
            ConfigError: if ``chunk_tokens`` is not a positive multiple of ``block_size``.
        """
        if self.chunk_tokens != "auto" and self.chunk_tokens % block_size:
            raise ConfigError(f"chunk_tokens={self.chunk_tokens} is not a multiple of the engine block size "
                              f"{block_size}; set chunk_tokens to a multiple of {block_size} "
                              f"(e.g. {max(block_size, self.chunk_tokens // block_size * block_size)})")

    def cpu_bytes_per_rank(self, tp_size: int = 1) -> int:
        """CPU tier bytes held by one tensor-parallel rank: ``cpu_gib`` × GiB / ``tp_size``."""
        return int(self.cpu_gib * GiB) // tp_size

    def disk_bytes_per_rank(self, tp_size: int = 1) -> int:
        """Disk tier bytes held by one tensor-parallel rank: ``disk_gib`` × GiB / ``tp_size``."""
        return int(self.disk_gib * GiB) // tp_size if self.disk_path else 0
