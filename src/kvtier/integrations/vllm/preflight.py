"""Pre-flight check of a ``--kv-transfer-config`` that names KVTierConnector, in well under a second.

The connector validates its configuration only when vLLM constructs it, after the model has
loaded (a minute or more); a typo then surfaces inside several tracebacks.  This module runs the
same validator (:class:`kvtier.core.config.KVTierConfig`) plus the transfer-config facts vLLM
checks, without importing vLLM or torch.  It serves three callers:

* ``kvtier check`` and ``kvtier audit`` (before deploying);
* :mod:`kvtier.integrations.vllm.plugin`, a vLLM general plugin that runs it inside ``vllm serve``
  while the command line is parsed, i.e. before the model loads.

What is checked (each problem is one sentence naming the key and the fix):

* the JSON itself, and its top-level keys against vLLM's ``KVTransferConfig`` fields
  (vllm/config/kv_transfer.py, which forbids unknown keys), with the closest known key suggested;
* ``kv_connector_module_path`` (vLLM's connector registry does not know KVTierConnector, so
  without the module path vLLM cannot load it) and ``kv_role`` (required with a connector);
* ``kv_load_failure_policy``: vLLM's default ``"fail"`` fails a request whose KV could not be
  loaded; with ``"recompute"`` a kvtier chunk that fails verification is recomputed (warning);
* ``kv_connector_extra_config`` with :meth:`KVTierConfig.from_dict`: unknown keys (closest key
  suggested), bad values, disk path checks (missing, not writable, not enough free space, a kernel
  pseudo filesystem such as ``/proc``), plus an explicit ``chunk_tokens`` against ``--block-size``
  when known (else a warning when it is not a multiple of vLLM's default block sizes, 16 and 128
  on CPU); ``auto`` (the default) always fits, the engine resolves it from its block sizes
  and ``cpu_gib`` against the memory this host has available (the connector refuses both), and
  with ``redis_url`` the password (``redis_password_env``/``_file``) and ``shared_secret_file``,
  read as the redis tier reads them at start-up;
* MultiConnector children that name KVTierConnector are checked the same way.

:func:`probe_shared_tiers` then tries the shared tier itself (connect + ``PING`` within a short
deadline, never a write): ``kvtier check`` (unless ``--offline``) and the vLLM plugin call it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.core import purge
from kvtier.core.config import GiB, KVTierConfig
from kvtier.core.configload import did_you_mean, unknown_key
from kvtier.core.errors import ConfigError
from kvtier.core.sizing import available_memory
from kvtier.core.tiers import registry
from kvtier.core.tiers.probe import PROBE_DEADLINE_S, ProbeResult
from kvtier.integrations.vllm.engine_config import DEFAULT_BLOCK_SIZES
from kvtier.integrations.vllm.preflight_env import fine_alone, kvtier_environ, shadowed_variables
from kvtier.integrations.vllm.preflight_tiers import (
    CREDENTIALS_FIX,
    Problem,
    config_advice_problems,
    disk_tier_not_above_cpu_tier,
    idle_codec_problems,
    looks_like_credential,
    node_pool_problems,
    on_tmpfs,
    static_tier_problems,
    tier_order_problems,
    tier_problems,
    unconfigured_tier_problems,
    unused_tier_problems,
)

CONNECTOR = "KVTierConnector"
MODULE_PATH = "kvtier.integrations.vllm"

KV_TRANSFER_FIELDS = (
    "kv_connector", "engine_id", "kv_buffer_device", "kv_role", "kv_port", "kv_connector_extra_config",
    "kv_connector_module_path", "enable_permute_local_kv", "kv_load_failure_policy",
)
"""Fields of vLLM 0.32's ``KVTransferConfig`` (vllm/config/kv_transfer.py); vLLM refuses others."""

KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
LOAD_FAILURE_POLICIES = ("recompute", "fail")

_DISK_KEYS = ("disk_path", "disk_gib")
_CODEC_KEYS = ("codecs", "encryption")  # a chain that encrypts needs the keys: checked together


def parse_transfer_config(text: str) -> dict[str, Any]:
    """The ``--kv-transfer-config`` JSON as a dict.

    Raises:
        ConfigError: not JSON, or not a JSON object.
    """
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        where = f" at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(f"--kv-transfer-config is not valid JSON{where}; quote it in single quotes on the "
                          "shell line and check its braces and commas") from None
    if not isinstance(value, dict):
        raise ConfigError("--kv-transfer-config must be a JSON object like "
                          '{"kv_connector":"KVTierConnector", ...}')
    return value


def uses_kvtier(transfer: dict[str, Any]) -> bool:
    """Whether ``transfer`` names KVTierConnector, directly or as a MultiConnector child."""
    return bool(kvtier_entries(transfer))


def check_transfer_config(transfer: dict[str, Any] | str, block_size: int | None = None,
                          host_checks: bool = True, block_divisor: int | None = None,
                          environ: Mapping[str, str] | None = None) -> list[Problem]:
    """Every problem of a ``--kv-transfer-config`` for KVTierConnector, errors first.

    Args:
        transfer: the JSON text or its parsed dict.
        block_size: the engine's ``--block-size`` in tokens when known (``chunk_tokens`` must be a
            multiple of it); None skips that check.
        host_checks: also check what depends on the host this runs on: the disk tier directory
            (exists or can be created, writable, free space, not a kernel filesystem; it is created
            when it can be, as the connector would) and ``cpu_gib`` against available memory.  True
            on the serving host (``kvtier check``, the vLLM plugin); False for a config that will run
            elsewhere (``kvtier audit`` of a manifest).
        block_divisor: when ``block_size`` is not known, a number of tokens every block size the
            engine may choose is a multiple of
            (:func:`~kvtier.integrations.vllm.engine_config.cpu_block_divisor`): ``chunk_tokens`` not a
            multiple of it is an error.
        environ: the environment the server will run with (``kvtier audit``: the ``K=V`` of a
            serve line, ``docker run -e``, a manifest's ``env``): its ``KVTIER_*`` variables are
            applied as the connector applies its own (:meth:`KVTierConfig.from_dict`: an unknown
            name or a bad value is an error) instead of this process's.  None: this process's
            environment (``kvtier check`` and the vLLM plugin run where the server runs).

    Returns:
        Problems, errors before warnings; empty when the config is fine or does not use kvtier.
        Never raises on bad input: a JSON error is returned as a problem.
    """
    if isinstance(transfer, str):
        try:
            transfer = parse_transfer_config(transfer)
        except ConfigError as exc:
            return [Problem("error", "", str(exc))]
    if environ is not None:
        with kvtier_environ(environ):
            return check_transfer_config(transfer, block_size, host_checks, block_divisor)
    unknown = [key for key in transfer if key not in KV_TRANSFER_FIELDS]
    if transfer and len(unknown) == len(transfer) and set(unknown) <= set(KVTierConfig.known_keys(transfer)):
        # every key is kvtier's: the connector's own settings without the transfer config around them
        return [Problem("error", "", f"this is kvtier's kv_connector_extra_config ({', '.join(unknown)}) without "
                        "the --kv-transfer-config around it; wrap it: {\"kv_connector\":\"KVTierConnector\","
                        "\"kv_connector_module_path\":\"kvtier.integrations.vllm\",\"kv_role\":\"kv_both\","
                        "\"kv_load_failure_policy\":\"recompute\",\"kv_connector_extra_config\":{...}}")]
    if unknown and {"architectures", "model_type"} & set(unknown) and not set(transfer) & set(KV_TRANSFER_FIELDS):
        return [Problem("error", "", "this is a model's config.json (it has "
                        f"{' and '.join(repr(k) for k in ('architectures', 'model_type') if k in transfer)}), not a "
                        "--kv-transfer-config; give the connector's JSON ({\"kv_connector\":\"KVTierConnector\",...}: "
                        "docs/vllm.md), and size the model with kvtier size --model DIR")]
    problems = [Problem("error", key, f"--kv-transfer-config has an unknown key {key!r}"
                        f"{did_you_mean(key, KV_TRANSFER_FIELDS)}; vLLM refuses it (known keys: "
                        f"{', '.join(KV_TRANSFER_FIELDS)})")
                for key in unknown]
    entries = kvtier_entries(transfer)
    if not entries:
        return problems
    role = transfer.get("kv_role")
    if role is None:
        problems.append(Problem("error", "kv_role", 'kv_role is missing; vLLM requires it with kv_connector: add '
                                '"kv_role":"kv_both" (kvtier loads and saves)'))
    elif role not in KV_ROLES:
        problems.append(Problem("error", "kv_role", f"kv_role {role!r} is not one of {', '.join(KV_ROLES)}; "
                                'use "kv_both"'))
    policy = transfer.get("kv_load_failure_policy", "fail")
    if policy not in LOAD_FAILURE_POLICIES:
        problems.append(Problem("error", "kv_load_failure_policy", f"kv_load_failure_policy {policy!r} is not one of "
                                'recompute, fail; use "recompute"'))
    elif policy != "recompute":
        problems.append(Problem("warning", "kv_load_failure_policy",
                                'kv_load_failure_policy is "fail" (vLLM\'s default): a request whose kvtier load '
                                'fails (a chunk that fails verification, a disk error) fails too; add '
                                '"kv_load_failure_policy":"recompute" so vLLM recomputes those tokens instead'))
    for prefix, entry in entries:
        problems.extend(_check_entry(prefix, entry, block_size, host_checks, block_divisor))
    return sorted(problems, key=lambda p: p.severity != "error")


def kvtier_entries(transfer: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """``(key prefix, connector dict)`` of every KVTierConnector named in ``transfer``."""
    if transfer.get("kv_connector") == CONNECTOR:
        return [("", transfer)]
    found: list[tuple[str, dict[str, Any]]] = []
    extra = transfer.get("kv_connector_extra_config")
    if transfer.get("kv_connector") == "MultiConnector" and isinstance(extra, dict):
        children = extra.get("connectors")
        for i, child in enumerate(children if isinstance(children, list) else []):
            if isinstance(child, dict) and child.get("kv_connector") == CONNECTOR:
                found.append((f"kv_connector_extra_config.connectors[{i}].", child))
    return found


def _check_entry(prefix: str, entry: dict[str, Any], block_size: int | None, host_checks: bool,
                 block_divisor: int | None = None) -> list[Problem]:
    problems: list[Problem] = []
    module = entry.get("kv_connector_module_path")
    if module != MODULE_PATH:
        got = "is missing" if module is None else f"is {module!r}"
        problems.append(Problem("error", f"{prefix}kv_connector_module_path",
                                f"{prefix}kv_connector_module_path {got}; vLLM finds KVTierConnector only through "
                                f'"kv_connector_module_path":"{MODULE_PATH}"'))
    extra = entry.get("kv_connector_extra_config", {})
    key = f"{prefix}kv_connector_extra_config"
    if not isinstance(extra, dict):
        return [*problems, Problem("error", key, f"{key} must be a JSON object of kvtier keys, e.g. "
                                   '{"cpu_gib": 8}')]
    try:
        fields = KVTierConfig.known_keys(extra)  # with the keys of tiers that tier_modules registers
    except ConfigError as exc:
        return [*problems, Problem("error", f"{key}.tier_modules", str(exc))]
    for name in extra:
        if name not in fields and looks_like_credential(name):
            problems.append(Problem("error", f"{key}.{name}", f"{key} carries a credential under {name!r} (not "
                                    f"shown here); {CREDENTIALS_FIX}"))
        elif name not in fields:
            problems.append(Problem("error", f"{key}.{name}", unknown_key(name, fields)))
    nested = extra.get("tier_settings")
    for tier, values in (nested.items() if isinstance(nested, dict) else ()):
        for name in (values if isinstance(values, dict) else ()):
            if name not in fields and looks_like_credential(str(name)):
                where = f"{key}.tier_settings.{tier}.{name}"
                problems.append(Problem("error", where, f"{where} is a credential (not shown here); {CREDENTIALS_FIX}"))
    problems.extend(shadowed_variables(key, extra, fields))
    known = {k: v for k, v in extra.items() if k in fields}  # the configuration looks at no filesystem
    # each value alone (the disk pair together), so that every bad value is named, not just the first
    groups = [[k] for k in known if k not in _DISK_KEYS + _CODEC_KEYS] + [[k for k in known if k in _DISK_KEYS],
                                                                          [k for k in known if k in _CODEC_KEYS]]
    good: dict[str, Any] = {}
    refused: set[str] = set()  # keys whose own value failed: no derived problem about their absence below
    # a tier's own key needs the module that registers the tier; a tier_modules that fails on its own is
    # named once, under its own key, not again under every key checked beside it
    plugins = {"tier_modules": known["tier_modules"]} if "tier_modules" in known else {}
    if plugins and not fine_alone(plugins):
        plugins = {}
    for group in filter(None, groups):
        try:
            KVTierConfig.from_dict({**plugins, **{k: known[k] for k in group}})
            good.update({k: known[k] for k in group})
        except ConfigError as exc:
            # not this group's fault (a KVTIER_* variable's value, or a check across it and the
            # environment's values): the check of all values below reports it, once
            if exc.env_var is not None or fine_alone({**plugins, **{k: known[k] for k in group}}):
                good.update({k: known[k] for k in group})
                continue
            problems.append(Problem("error", f"{key}.{group[0]}" if len(group) == 1 else key, str(exc)))
            refused.update(f"{key}.{k}" for k in group)
    derived = len(problems)
    try:
        config = KVTierConfig.from_dict(good)  # the valid values, defaults for the rest
    except ConfigError as exc:  # a check across groups, or a KVTIER_* variable of this environment
        return [*problems, Problem("error", key, str(exc))]
    if config.chunk_tokens == "auto":
        pass  # the engine resolves it from its KV cache groups' block sizes: it always fits
    elif block_size is not None:
        try:
            config.validate_block_size(block_size)
        except ConfigError as exc:
            problems.append(Problem("error", f"{key}.chunk_tokens", str(exc)))
    elif block_divisor and config.chunk_tokens % block_divisor:
        default = DEFAULT_BLOCK_SIZES["CPU"]
        problems.append(Problem("error", f"{key}.chunk_tokens",
                                f"chunk_tokens={config.chunk_tokens} is not a multiple of {block_divisor}, so not of "
                                f"any block size this CPU server can choose (--block-size, else {default}; 16 for "
                                "MLA models, 256 for DeepSeek-V4, a multiple of these for hybrid models) and the "
                                f"connector would refuse it after the model loaded; set chunk_tokens to auto (the "
                                f"default) or to a multiple of the block size (e.g. {default})"))
    else:
        problems.extend(_default_block_problem(key, config.chunk_tokens))
    if "tiers" in good or "tiers" not in extra:  # a refused tiers leaves config.tiers at its default: no
        problems.extend(unused_tier_problems(key, extra, config))  # advice about a list never given
        problems.extend(unconfigured_tier_problems(key, extra, config))
        problems.extend(tier_order_problems(key, extra, config, reads=entry.get("kv_role") != "kv_producer"))
    problems.extend(idle_codec_problems(key, config))
    problems.extend(node_pool_problems(key, config))
    if not refused & {f"{key}.write_mode", f"{key}.cpu_gib"}:  # not about a default standing in for a refused value
        problems.extend(disk_tier_not_above_cpu_tier(key, config))
    problems.extend(config_advice_problems(key, config))
    problems.extend(static_tier_problems(key, config, host_checks))
    if config.tenant_quotas is not None and config.tenant_quotas.turns_nothing_on():
        problems.append(Problem("warning", f"{key}.tenant_quotas",
                                "tenant_quotas gives no tenant a share (no default_share, no_salt_share or salts), "
                                "so it turns nothing on; set default_share (e.g. 0.2) or list salts, or remove it"))
    if not host_checks:
        return problems[:derived] + [p for p in problems[derived:] if p.key not in refused]
    available = available_memory()
    if available and config.cpu_gib * GiB > available:
        problems.append(Problem("error", f"{key}.cpu_gib",
                                f"cpu_gib={config.cpu_gib:g} is more than the {available / GiB:.1f} GiB of memory "
                                "this host has available (the connector refuses it); lower cpu_gib, the total "
                                "across tensor-parallel ranks"))
    problems.extend(tier_problems(key, config))
    if config.disk_path and config.disk_gib > 0 and on_tmpfs(Path(config.disk_path)):
        problems.append(Problem("warning", f"{key}.disk_path",
                                f"disk_path {config.disk_path!r} is on tmpfs, i.e. in memory: the disk tier then "
                                "competes with the cpu tier for RAM and is lost on reboot; use a local disk"))
    return problems[:derived] + [p for p in problems[derived:] if p.key not in refused]


@dataclass(frozen=True)
class SharedTierProbe:
    """A probe of one KVTierConnector's shared tier (:func:`probe_shared_tiers`).

    Attributes:
        key: the dotted key of its ``redis_url`` (``kv_connector_extra_config.redis_url``).
        result: what the probe found (:class:`kvtier.core.tiers.probe.ProbeResult`).
    """

    key: str
    result: ProbeResult

    @property
    def problem(self) -> Problem | None:
        """A warning when the tier is unreachable or refused the password; None when reachable."""
        if self.result.state == "reachable":
            return None
        return Problem("warning", self.key, self.result.message)


def probe_shared_tiers(transfer: dict[str, Any], deadline_s: float = PROBE_DEADLINE_S) -> list[SharedTierProbe]:
    """Probe every configured tier that has a probe (:func:`kvtier.core.purge.probe_tier` over its blob store:
    a shared tier's connect + harmless request, e.g. Redis ``PING``) for every KVTierConnector in
    ``transfer``, each within ``deadline_s`` seconds; never writes.

    An entry whose config is invalid, or whose credentials cannot be read, is skipped: those are
    errors of :func:`check_transfer_config`, reported there.  ``kvtier check`` prints each result
    in one line (``--offline`` skips this); the vLLM plugin prints a warning for a tier that is
    unreachable or refuses the credentials, and starts anyway (the tier may come up later).

    Returns:
        One :class:`SharedTierProbe` per tier probed, in the order of the entries and of ``tiers``;
        its key names the tier's first configuration key (e.g. ``...kv_connector_extra_config.redis_url``).
    """
    probes: list[SharedTierProbe] = []
    for prefix, entry in kvtier_entries(transfer):
        extra = entry.get("kv_connector_extra_config")
        if not isinstance(extra, dict):
            continue
        try:
            config = KVTierConfig.from_dict(extra)
        except ConfigError:
            continue
        for name in config.tiers:
            try:
                result = purge.probe_tier(name, config, deadline_s) if registry.spec(name).shared else None
            except ConfigError:
                continue
            if result is not None:
                key = registry.spec(name).keys[0] if registry.spec(name).keys else name
                probes.append(SharedTierProbe(f"{prefix}kv_connector_extra_config.{key}", result))
    return probes


def advice_problems(transfer: dict[str, Any], environ: Mapping[str, str] | None = None) -> list[Problem]:
    """The tiers' advice (warnings, :meth:`~kvtier.core.tiers.plugin.TierPlugin.advice`) for every
    KVTierConnector of ``transfer`` whose ``kv_connector_extra_config`` is valid (an invalid one is
    :func:`check_transfer_config`'s error), with ``environ``'s ``KVTIER_*`` variables applied as in
    :func:`check_transfer_config`; ``kvtier audit`` reports them as a rule of their own."""
    if environ is not None:
        with kvtier_environ(environ):
            return advice_problems(transfer)
    out: list[Problem] = []
    for prefix, entry in kvtier_entries(transfer):
        extra = entry.get("kv_connector_extra_config")
        if not isinstance(extra, dict):
            continue
        try:
            config = KVTierConfig.from_dict(extra)
        except ConfigError:
            continue
        out.extend(config_advice_problems(f"{prefix}kv_connector_extra_config", config))
    return out


def _default_block_problem(key: str, chunk_tokens: int) -> list[Problem]:
    """A warning when ``chunk_tokens`` is not a multiple of a default block size (the server's is unknown)."""
    misses = [f"{size} ({platform})" for platform, size in DEFAULT_BLOCK_SIZES.items() if chunk_tokens % size]
    if not misses:
        return []
    return [Problem("warning", f"{key}.chunk_tokens",
                    f"chunk_tokens={chunk_tokens} is not a multiple of vLLM's default block size "
                    f"{' or '.join(misses)}, so the connector refuses it on a server without a --block-size that "
                    f"divides it; set chunk_tokens to auto (the default) or a multiple of "
                    f"{max(DEFAULT_BLOCK_SIZES.values())}, or pass --block-size to check against the server's",
                    only_if=f"the server's --block-size divides chunk_tokens={chunk_tokens}")]


