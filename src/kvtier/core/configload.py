"""Reading a kvtier configuration's sources and saying what is wrong with one in one sentence:
the YAML file, the ``KVTIER_*`` environment (a variable that names no key is refused), and a
validation error of :class:`~kvtier.core.config.KVTierConfig` turned into the sentence a user
reads (:class:`~kvtier.core.errors.ConfigError`).
"""

from __future__ import annotations

import difflib
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo

from kvtier.core.errors import ConfigError
from kvtier.core.tiersettings import ERROR_TYPE, env_var_rules, field_sentence, named_env_vars


def read_yaml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The mapping a YAML configuration file holds (``{}`` for an empty file).

    Raises:
        ConfigError: unreadable file, not UTF-8, not YAML, or not a mapping.
    """
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"config file {str(path)!r} is not UTF-8 text; save it as UTF-8") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {yaml_problem(exc)}; fix it there") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of keys to values")
    return data


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What the parser found and where (``expected ',' or ']', but got ':' at line 3, column 8``), one line."""
    problem = getattr(exc, "problem", None)
    mark = getattr(exc, "problem_mark", None)
    if problem is None:
        return str(exc).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(problem)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or ``""`` when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key(name: str, known: Iterable[str]) -> str:
    """The sentence for an unknown kvtier config key: the closest known key and where every key is
    described when one is close (the ~80 keys on one line buried that hint), else the known keys."""
    known = list(known)
    hint = did_you_mean(name, known)
    return (f"unknown kvtier config key {name!r}{hint}; " + (
        "every key is in docs/vllm.md, 'Configuration keys'" if hint else f"known keys are {', '.join(known)}"))


JSON_EXAMPLES = {"admission": '{"disk": "reused"}', "tenant_quotas": '{"default_share": 0.2}', "tiers": '["cpu", "disk"]',
                 "tier_modules": '["mycompany.kvtier_tiers"]', "tier_settings": '{"mytier": {"capacity_mib": 64}}'}
"""An example value of each list or mapping key, for the sentence refusing a ``KVTIER_*`` variable that is not JSON."""


def check_env(values: dict[str, Any], known_keys: Iterable[str]) -> None:
    """Reject ``KVTIER_*`` variables that name no key of ``known_keys`` (every key a configuration
    with ``values`` may hold: :meth:`KVTierConfig.known_keys <kvtier.core.config.KVTierConfig.known_keys>`;
    a typo would otherwise be ignored).

    A variable that a tier setting names (``names_env_var``, :mod:`kvtier.core.tiersettings`)
    holds a secret, not a setting, and is exempt, even when its name starts with ``KVTIER_``.

    Raises:
        ConfigError: one sentence naming the variable, with ``env_var`` set.
    """
    known = {f"KVTIER_{name.upper()}" for name in known_keys}
    exempt = named_env_vars(values)
    rules = env_var_rules()
    why = f" ({'; '.join(rules)})" if rules else ""
    for var in os.environ:
        if var.upper().startswith("KVTIER_") and var.upper() not in known and var not in exempt:
            raise ConfigError(f"environment variable {var} is not a kvtier setting{did_you_mean(var.upper(), known)}; "
                              f"rename or unset it{why}; known ones are {', '.join(sorted(known))}", env_var=var)


def env_list(var: str) -> list[str] | None:
    """A ``KVTIER_*`` list variable's value: JSON, or one bare name; ``None`` when unset or not a list."""
    raw = os.environ.get(var)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return [raw]
    return value if isinstance(value, list) else None


MAX_GIB = float(1 << 20)
"""Largest size a ``*_gib`` key takes, GiB: 1 PiB, beyond any one host's memory or disks (and the
bound of ``s3_capacity_gib``), so a larger value is a size in bytes typed into a GiB key: 32 GiB
as bytes is 34359738368, which read as GiB is 32 EiB."""


def check_gib(value: float) -> float:
    """``value`` of a ``*_gib`` key, refused when it cannot be GiB (over :data:`MAX_GIB`).

    Raises:
        ValueError: one sentence (the caller's validator names the key and the value).
    """
    if value > MAX_GIB:
        raise ValueError("looks like bytes; it is in GiB (32 means 32 GiB), at most 1048576 (1 PiB)")
    return value


JSON_TYPES = {"dict_type": "a JSON object", "model_type": "a JSON object", "tuple_type": "a JSON list",
              "list_type": "a JSON list"}
"""pydantic's type errors of a top-level key, said as the JSON type the key takes."""

JSON_EXAMPLES = {
    "admission": '{"disk": "reused"}',
    "codecs": '{"disk": ["blosc2-zstd-shuffle2"]}',
    "tier_settings": '{"redis": {"redis_ttl_s": 3600}}',
    "encryption": '{"master_key_file": "/etc/kvtier/master-key"}',
    "tiers": '["cpu", "disk"]',
    "tier_modules": '["mycompany.kvtier_tiers"]',
}
"""One value of each key that takes a JSON object or list, for the sentence that refuses another type."""


def one_sentence(exc: ValidationError, fields: Mapping[str, FieldInfo],
                 explicit: set[str] | None = None) -> tuple[str, str | None]:
    """The first error of ``exc`` (validating a model of ``fields``, the values given ``explicit``)
    as one sentence, and the ``KVTIER_*`` variable it comes from (or None).

    A value the caller gave is named before one from the environment; a tier setting's error
    (:data:`~kvtier.core.tiersettings.ERROR_TYPE`) carries its sentence already."""
    def given(e: Any) -> bool:
        if e["type"] == ERROR_TYPE:
            return not e["ctx"]["env_var"]
        return bool(explicit) and bool(e["loc"]) and str(e["loc"][0]) in (explicit or ())

    errors = exc.errors()
    err = next((e for e in errors if given(e)), errors[0])
    if err["type"] == ERROR_TYPE:
        return err["ctx"]["sentence"], err["ctx"]["env_var"] or None
    field = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not field:  # a check across fields: its message names the fields itself
        return f"kvtier config: {msg}", None
    env_var = None
    top = str(err["loc"][0])  # a nested key (tenant_quotas.default_share) comes from its top key's variable
    if explicit is not None and top not in explicit and f"KVTIER_{top.upper()}" in os.environ:
        env_var = f"KVTIER_{top.upper()}"
    model_field = fields.get(str(err["loc"][0]))
    secret = model_field is not None and model_field.repr is False  # never echo a password or a secret
    if len(err["loc"]) == 1 and err["type"] in JSON_TYPES:  # pydantic's words name Python types and classes
        msg = f"must be {JSON_TYPES[err['type']]}" + (f" (e.g. {JSON_EXAMPLES[field]})" if field in JSON_EXAMPLES else "")
    return field_sentence(field, msg, err.get("input"), env_var, secret), env_var


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
