"""The pre-flight's view of the ``KVTIER_*`` environment: a serve line's own variables applied in place of
this process's (``kvtier audit``), a value checked with none of them, and the variables whose key the
JSON also gives, which are never read (the JSON overrides them)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError
from kvtier.integrations.vllm.preflight_tiers import Problem


def shadowed_variables(key: str, extra: dict[str, Any], fields: list[str]) -> list[Problem]:
    """A warning per ``KVTIER_<KEY>`` variable of this environment whose key the JSON gives too (flat or
    under ``tier_settings``): the JSON overrides it, so it is never read, its value not even checked."""
    nested = extra.get("tier_settings")
    given = [*extra, *(k for v in (nested.values() if isinstance(nested, dict) else ()) if isinstance(v, dict)
                       for k in v)]
    env = {name.upper() for name in os.environ}
    return [Problem("warning", f"{key}.{name}",
                    f"environment variable KVTIER_{name.upper()} is set, but the JSON gives {name} too and "
                    f"overrides it, so the variable is never read; remove one of them so that one place sets {name}")
            for name in dict.fromkeys(given) if name in fields and f"KVTIER_{name.upper()}" in env]


def fine_alone(values: dict[str, Any]) -> bool:
    """Whether ``values`` pass with no ``KVTIER_*`` variable at all."""
    with kvtier_environ({}):
        try:
            KVTierConfig.from_dict(values)
        except ConfigError:
            return False
    return True


@contextmanager
def kvtier_environ(environ: Mapping[str, str]) -> Iterator[None]:
    """This process's ``KVTIER_*`` variables replaced by those of ``environ`` for the duration
    (:class:`KVTierConfig` reads ``os.environ``, as pydantic-settings does); restored after.
    Not thread-safe: for the single-threaded ``kvtier audit``."""
    saved = {k: v for k, v in os.environ.items() if k.upper().startswith("KVTIER_")}
    try:
        for name in saved:
            del os.environ[name]
        os.environ.update({k: v for k, v in environ.items() if k.upper().startswith("KVTIER_")})
        yield
    finally:
        for name in [k for k in os.environ if k.upper().startswith("KVTIER_")]:
            del os.environ[name]
        os.environ.update(saved)
