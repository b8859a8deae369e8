"""A registered tier's settings inside the kvtier configuration (:class:`kvtier.core.config.KVTierConfig`).

A tier declares its keys as a pydantic model (its plug-in's ``settings``, e.g. the redis tier's
:class:`~kvtier.core.tiers.redis.settings.RedisSettings`).  Its keys are accepted flat in
``kv_connector_extra_config`` (``{"redis_url": ...}``), nested under ``tier_settings.<tier>``, or
as ``KVTIER_<KEY>`` environment variables when the model is a pydantic-settings model; the
configuration routes flat keys under ``tier_settings`` (:func:`route_flat_keys`), checks each tier's
values with its model (:func:`check_tier_settings`) and keeps the built models.  A bad value reads
as any other key's: ``kvtier config field 'redis_ttl_s': ... (got 0); fix the value of 'redis_ttl_s'``.

Model fields may carry ``json_schema_extra={"names_env_var": "<what>"}`` when their value names an
environment variable that holds ``<what>`` (a password), so that variable is not taken for a
misspelt ``KVTIER_*`` setting; ``repr=False`` fields are secrets, never echoed or exported.
"""

from __future__ import annotations

import difflib
import os
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from kvtier.core.errors import ConfigError
from kvtier.core.tiers.registry import settings_keys, settings_model, specs

ERROR_TYPE = "kvtier_tier_setting"
"""Pydantic error type of a tier setting's error; its context holds ``sentence`` and ``env_var``."""


class RoutedSettings(dict[str, dict[str, Any]]):
    """``tier_settings`` after :func:`route_flat_keys`, remembering the keys that were given flat."""

    flat: frozenset[str] = frozenset()


def route_flat_keys(values: dict[str, Any], core_fields: set[str]) -> dict[str, Any]:
    """``values`` with each key of a tier's settings model (not a field of the configuration
    itself) moved under ``tier_settings[tier]`` (a :class:`RoutedSettings`).

    Raises:
        ValueError: a key given both flat and under ``tier_settings``.
    """
    owners = {k: t for k, t in settings_keys().items() if k not in core_fields}
    flat = [k for k in values if k in owners]
    if not flat:
        return values
    given = values.get("tier_settings")
    nested = RoutedSettings({n: dict(v) for n, v in given.items() if isinstance(v, dict)}
                            if isinstance(given, dict) else {})
    for key in flat:
        tier = owners[key]
        if key in nested.setdefault(tier, {}):
            raise ValueError(f"{key!r} is given both at the top level and in tier_settings.{tier}; give it once")
        nested[tier][key] = values[key]
    nested.flat = frozenset(flat)
    return {**{k: v for k, v in values.items() if k not in owners}, "tier_settings": nested}


def field_sentence(field: str, msg: str, value: Any, env_var: str | None, secret: bool) -> str:
    """One key's error: ``kvtier config field 'key' (from environment variable X): msg (got v); fix the value of 'key'``."""
    source = f" (from environment variable {env_var})" if env_var else ""
    shown = f" (got {value!r})" if value is not None and not isinstance(value, dict) and not secret \
        and f"got {value!r}" not in msg else ""  # a validator's own sentence may name it already
    return f"kvtier config field {field!r}{source}: {msg}{shown}; fix the value of {field!r}"


def _env_names() -> set[str]:
    return {k.upper() for k in os.environ}


def _env_given(model: type[BaseModel]) -> bool:
    """Whether a ``KVTIER_*`` variable sets a key of ``model`` (a pydantic-settings model reads them)."""
    env = _env_names()
    return any(f"KVTIER_{key.upper()}" in env for key in model.model_fields)


def check_tier_settings(value: Any) -> Any:
    """``tier_settings`` (raw, before the field's own type check) checked: every tier it names
    is registered and has a settings model, and every tier's values (given or from the
    environment) pass that model.  Returns the value as a plain dict; anything not a mapping of
    mappings is returned unchanged for the field's type check to refuse.

    Raises:
        ValueError: an unknown tier, or one without a settings model.
        PydanticCustomError: a bad value (type :data:`ERROR_TYPE`, the sentence in its context).
    """
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        return value
    flat = value.flat if isinstance(value, RoutedSettings) else frozenset()
    for name in value:
        try:
            model = settings_model(name)
        except ConfigError as exc:
            raise ValueError(f"tier_settings names {name!r}: {exc}") from None
        if model is None:
            raise ValueError(f"tier_settings names tier {name!r}, which takes no settings there; remove it")
    for record in specs():
        model = settings_model(record.name)
        given = value.get(record.name)
        if model is None or (given is None and not _env_given(model)):
            continue
        try:
            model(**(given or {}))
        except ValidationError as exc:
            raise _error(record.name, model, exc, given or {}, flat) from None
    return dict(value)


def build_tier_settings(tier_settings: dict[str, dict[str, Any]]) -> dict[str, BaseModel]:
    """Each registered tier's settings model, built from ``tier_settings`` and the environment;
    a tier whose model cannot be built from nothing (a required key) and is not given is left out."""
    out: dict[str, BaseModel] = {}
    for record in specs():
        model = settings_model(record.name)
        if model is None:
            continue
        try:
            out[record.name] = model(**tier_settings.get(record.name, {}))
        except ValidationError:
            if record.name in tier_settings:
                raise
    return out


def _error(tier: str, model: type[BaseModel], exc: ValidationError, given: dict[str, Any],
           flat: frozenset[str]) -> PydanticCustomError:
    errors = exc.errors()
    err = next((e for e in errors if e["loc"] and e["loc"][0] in given), errors[0])  # a value given first
    key = str(err["loc"][0]) if err["loc"] else ""
    msg = err["msg"].removeprefix("Value error, ")
    env_var = f"KVTIER_{key.upper()}" if key and key not in given and f"KVTIER_{key.upper()}" in _env_names() else None
    field = model.model_fields.get(key)
    secret = field is not None and field.repr is False
    where = ".".join(map(str, err["loc"]))
    if not key:  # a check across the tier's keys: its message names them
        sentence = f"kvtier config: {msg} (tier_settings.{tier})"
    elif err["type"] == "extra_forbidden":  # a misspelt key: the closest one, never the value (it may be a secret)
        close = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        sentence = (f"unknown key {f'tier_settings.{tier}.{where}'!r}{hint}; the {tier} tier's keys are "
                    f"{', '.join(model.model_fields)}")
    else:
        name = where if key in flat or env_var else f"tier_settings.{tier}.{where}"
        sentence = field_sentence(name, msg, err.get("input"), env_var, secret)
    return PydanticCustomError(ERROR_TYPE, "{sentence}", {"sentence": sentence, "env_var": env_var or ""})


def named_env_vars(values: dict[str, Any]) -> set[str]:
    """The environment variables that tier settings name (``names_env_var`` fields, given flat,
    nested under ``tier_settings`` or as ``KVTIER_<KEY>``): they hold secrets, not settings."""
    out: set[str] = set()
    given = values.get("tier_settings")
    nested: dict[str, Any] = given if isinstance(given, dict) else {}
    for tier, key, _what in _env_naming_fields():
        mine = nested[tier] if isinstance(nested.get(tier), dict) else {}
        name = values.get(key, mine.get(key, os.environ.get(f"KVTIER_{key.upper()}")))
        if isinstance(name, str):
            out.add(name)
    return out


def env_var_rules() -> list[str]:
    """``"<what> variable must be the one named by <key>"`` for every ``names_env_var`` field."""
    return [f"{what} variable must be the one named by {key}" for _tier, key, what in _env_naming_fields()]


def _env_naming_fields() -> list[tuple[str, str, str]]:
    """``(tier, key, what)`` of every registered tier's ``names_env_var`` settings field."""
    out = []
    for record in specs():
        model = settings_model(record.name)
        for key, field in (model.model_fields.items() if model is not None else ()):
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if isinstance(extra.get("names_env_var"), str):
                out.append((record.name, key, str(extra["names_env_var"])))
    return out
