"""Tiers by name: one :class:`TierSpec` record per tier, the only place outside a tier's own module
that knows it.  Building a tier from a configuration is :mod:`kvtier.core.tiers.factory`'s part;
this module reads no configuration, so :mod:`kvtier.core.config` can check names against it.

Everything that differs per tier is read from its record: the store's tier order, whether it is
shared (asked asynchronously, never evicted by the store), the vLLM hit source its loads report
(``prompt_tokens_cached_by_source``), metric labels, the scheduler's mirror ranking, the remote
lookups of a shared tier, the preflight and the audit.  Modules are imported lazily (so ``redis``
stays optional until a redis tier is configured) and a tier module never needs an edit elsewhere.

Adding a tier (docs/store.md, "Adding a tier"):

1. one module with ``from_config(ctx: TierContext) -> Tier | None`` (``None`` when the
   configuration does not ask for the tier) and, optionally, ``configured(config) -> bool``
   (whether the configuration asks for it, without building it) and a pydantic settings model
   of the keys it reads;
2. one :func:`register` call: a line in :data:`BUILTIN` for a tier shipped with kvtier, or, for a
   tier outside kvtier, a call in a module that ``kv_connector_extra_config``'s ``tier_modules``
   names (kvtier imports those modules in every process that reads the configuration, before the
   configuration is validated: the scheduler, every worker, the tools);
3. one fixture in ``tests/core/tier_harness.py`` (the conformance suite refuses a registered
   tier without one).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, field
from typing import Any

from kvtier.core.errors import ConfigError

HIT_SOURCES = ("host", "disk", "p2p", "external_unspecified")
"""vLLM 0.32's ``CacheHitSource`` values a tier may report (vllm/v1/metrics/cache_hit_source.py);
``external_unspecified`` is vLLM's documented fallback for a remote store."""


@dataclass(frozen=True)
class TierModel:
    """A tier's first-order cost figures for ``kvtier simulate`` and ``kvtier size`` (pass your own
    measured ones where you have them: ``kvtier bench-store``).

    Attributes:
        gb_per_s: payload bandwidth from the tier into host memory, GB/s (10^9 bytes/s).
        latency_ms: paid once per request the tier serves (a load's parallel reads overlap), ms.
        source: where the figures come from, one sentence a user can check.
    """

    gb_per_s: float
    latency_ms: float
    source: str


@dataclass(frozen=True)
class TierSpec:
    """What kvtier knows of one tier, apart from its module.

    Attributes:
        name: the tier's name in ``tiers``, metric labels and logs (lower case, ``[a-z0-9_]``).
        order: rank in the default tier order, fastest first (the top tier is the smallest);
            the scheduler reports a chunk held in several tiers as held in the slowest one.
        shared: other hosts write the tier and it evicts on its own (see
            :mod:`kvtier.core.tiers.base`): asked asynchronously, never evicted by the store.
        hit_source: the vLLM ``CacheHitSource`` value its loads report (:data:`HIT_SOURCES`).
        factory: ``"module:function"`` building the tier from a
            :class:`~kvtier.core.tiers.factory.TierContext`.
        configured: ``"module:function"`` telling from a configuration whether it asks for the
            tier (without building it); ``None``: whenever the tier is in ``tiers``.
        settings: ``"module:Class"`` of the pydantic model of the tier's configuration keys
            (documentation and the audit's per-tier key list); ``None`` if it has none.
        capabilities: names of the optional protocols of :mod:`kvtier.core.tiers.base` the tier
            implements (``rescannable``, ``generational``, ``exact_usage``, ``paged``,
            ``staging``); the conformance suite checks the tier implements exactly these.
        top: the tier every chunk passes through (exactly one registered tier).
        keys: the configuration keys that ask for the tier (the preflight warns when they are set
            but ``tiers`` leaves the tier out; ``kvtier audit``'s deployment rules find a key's tier
            with :func:`asked_by`).
        check: ``"module:function"`` of the tier's preflight, ``check(config) -> [(key, message)]``:
            what its start-up would refuse, read the way start-up reads it (files, environment);
            ``None`` if it has none.
        reset: ``"module:function"`` dropping a namespace's chunks from outside the stores that
            hold them, ``reset(config, namespace) -> ClearResult``; what must not survive a restart
            once a reset is acknowledged (vLLM's scheduler calls it,
            :mod:`kvtier.integrations.vllm.scheduler`); ``None`` for a tier that lives only in the
            stores' processes (the cpu tier).
        medium: the ``medium`` of the vLLM KV events announcing a chunk this tier holds
            (vllm/distributed/kv_events.py: ``"CPU"`` host memory, ``"STORAGE"`` a local disk;
            :mod:`kvtier.integrations.vllm.scheduler.events`); ``None``: the tier is never announced (a
            shared tier: the store's change feed does not report it, docs/vllm.md "KV events").
        state_dir: ``"module:function"``, ``state_dir(config) -> Path | None``: a directory that
            outlives the process as the tier's chunks do, where the scheduler may keep small files
            about them (the KV events' chunk -> block hash journal); ``None`` if it has none.
        probe: ``"module:function"`` of a shared tier's reachability probe,
            ``probe(config, deadline_s) -> ProbeResult`` (:mod:`kvtier.core.tiers.probe`; never
            writes), run by ``kvtier check`` and the serve-line pre-flight; ``None`` if it has none.
        purge: ``"module:function"`` for ``kvtier purge``: lists and (unless a dry run) removes the
            chunks a :class:`~kvtier.core.purge.PurgeSelector` matches, across every namespace the
            tier's storage holds, ``purge(config, selector, dry_run) -> list[NamespacePurge] | None``
            (``None``: the configuration names no storage of this tier); ``None`` for a tier that
            lives only in an engine's processes (the cpu tier).
        advice: ``"module:function"``, ``advice(config) -> [(key, message)]``: what a configuration
            the tier starts with leaves exposed (e.g. plain HTTP beyond this host without a shared
            secret), read from the configuration alone (no file, no network); the pre-flight
            (``kvtier check``, ``kvtier audit``, the vLLM plugin) reports each as a warning.
            ``None`` if it has none.
        model: the tier's default bandwidth and latency (:class:`TierModel`) for the sizing and
            simulation tools; ``None`` for a tier they do not model on its own (cpu, disk: their
            figures are the tools' own options).
    """

    name: str
    order: int
    shared: bool
    hit_source: str
    factory: str
    configured: str | None = None
    settings: str | None = None
    capabilities: frozenset[str] = field(default_factory=frozenset)
    top: bool = False
    keys: tuple[str, ...] = ()
    check: str | None = None
    reset: str | None = None
    medium: str | None = None
    state_dir: str | None = None
    probe: str | None = None
    purge: str | None = None
    advice: str | None = None
    model: TierModel | None = None


REDIS_MODEL = TierModel(1.25, 0.5, "one 10 Gb/s Ethernet link (10GBASE-T line rate, IEEE 802.3an) to the server, and "
                        "one network round trip in a data centre plus the server's work (about 0.5 ms)")
S3_MODEL = TierModel(1.25, 100.0, "parallel GETs (s3_concurrency) bounded by one 10 Gb/s Ethernet link, and a "
                     "first-byte latency of 100-200 ms per request (AWS S3 user guide, 'Performance guidelines "
                     "for Amazon S3'; a MinIO or Ceph RGW server near the engines answers in milliseconds)")


BUILTIN = (
    TierSpec("cpu", 0, False, "host", "kvtier.core.tiers.cpu:from_config", top=True,
             capabilities=frozenset({"staging", "paged"}), medium="CPU"),
    TierSpec("disk", 10, False, "disk", "kvtier.core.tiers.disk:from_config", "kvtier.core.tiers.disk:configured",
             capabilities=frozenset({"rescannable", "generational", "exact_usage"}), keys=("disk_path", "disk_gib"),
             check="kvtier.core.tiers.disk:check", reset="kvtier.core.tiers.diskreset:reset",
             purge="kvtier.core.tiers.diskpurge:purge", medium="STORAGE", state_dir="kvtier.core.tiers.disk:state_dir"),
    TierSpec("redis", 20, True, "external_unspecified", "kvtier.core.tiers.redis:from_config",
             "kvtier.core.tiers.redis:configured", settings="kvtier.core.tiers.redissettings:RedisSettings",
             keys=("redis_url",), check="kvtier.core.tiers.redis:check",
             reset="kvtier.core.tiers.redis:reset", probe="kvtier.core.tiers.redisprobe:probe_redis",
             purge="kvtier.core.tiers.redispurge:purge", model=REDIS_MODEL),
    TierSpec("s3", 30, True, "external_unspecified", "kvtier.core.tiers.s3:from_config",
             "kvtier.core.tiers.s3:configured", settings="kvtier.core.tiers.s3settings:S3Settings",
             keys=("s3_bucket", "s3_endpoint_url"), check="kvtier.core.tiers.s3:check", reset="kvtier.core.tiers.s3:reset",
             purge="kvtier.core.tiers.s3purge:purge",
             probe="kvtier.core.tiers.s3probe:probe_s3", advice="kvtier.core.tiers.s3:advice", model=S3_MODEL),
)
"""The tiers shipped with kvtier: one line each."""

CAPABILITIES = frozenset({"staging", "paged", "rescannable", "generational", "exact_usage"})

_lock = threading.Lock()
_specs: dict[str, TierSpec] = {s.name: s for s in BUILTIN}


def register(spec: TierSpec) -> None:
    """Add ``spec`` (a tier outside kvtier; see the module docstring).  Registering the same
    record twice is a no-op (a module imported again).

    Raises:
        ValueError: another record already has the name, the name is not ``[a-z0-9_]+``, the
            hit source or a capability is unknown, or a second top tier.
    """
    if not spec.name or not all(c.isascii() and (c.isalnum() or c == "_") for c in spec.name) \
            or spec.name != spec.name.lower():
        raise ValueError(f"tier name {spec.name!r} must be lower-case letters, digits and '_'")
    if spec.hit_source not in HIT_SOURCES:
        raise ValueError(f"tier {spec.name!r}: unknown hit source {spec.hit_source!r}; use one of "
                         f"{', '.join(HIT_SOURCES)}")
    if unknown := spec.capabilities - CAPABILITIES:
        raise ValueError(f"tier {spec.name!r}: unknown capabilities {sorted(unknown)}; use {sorted(CAPABILITIES)}")
    with _lock:
        old = _specs.get(spec.name)
        if old == spec:
            return
        if old is not None:
            raise ValueError(f"a tier named {spec.name!r} is registered already ({old.factory})")
        if spec.top:
            raise ValueError(f"tier {spec.name!r}: only the built-in top tier may be the top tier")
        _specs[spec.name] = spec


def unregister(name: str) -> None:
    """Remove a tier registered with :func:`register` (tests that register a tier for a while).

    Raises:
        ValueError: ``name`` is a built-in tier.
    """
    if any(s.name == name for s in BUILTIN):
        raise ValueError(f"tier {name!r} is built in and cannot be unregistered")
    with _lock:
        _specs.pop(name, None)


def specs() -> list[TierSpec]:
    """Every registered tier's record, in the default order (fastest first)."""
    with _lock:
        return sorted(_specs.values(), key=lambda s: (s.order, s.name))


def spec(name: str) -> TierSpec:
    """The record of tier ``name``.

    Raises:
        ConfigError: no tier of that name is registered.
    """
    with _lock:
        found = _specs.get(name)
    if found is None:
        raise ConfigError(f"unknown tier {name!r}; choose from {', '.join(available_tiers())} "
                          "(a tier outside kvtier is registered by a module named in tier_modules)")
    return found


def modeled_tiers() -> list[TierSpec]:
    """Records of the shared tiers with a :class:`TierModel`, in order (the tools' ``--shared-tier``)."""
    return [s for s in specs() if s.shared and s.model is not None]


def available_tiers() -> list[str]:
    """Registered tier names, in the default order."""
    return [s.name for s in specs()]


def top_tier() -> str:
    """Name of the tier every chunk passes through (``tiers`` must start with it)."""
    return next(s.name for s in specs() if s.top)


def lower_tiers() -> list[str]:
    """Registered tiers below the top tier, in order."""
    return [s.name for s in specs() if not s.top]


def local_tiers() -> list[str]:
    """Registered tiers that are not shared, in order."""
    return [s.name for s in specs() if not s.shared]


def asked_by(key: str) -> str | None:
    """The registered tier whose record lists configuration key ``key`` among its ``keys`` (the
    keys that ask for it; e.g. a directory or server URL key), or ``None`` if no record does.
    Rules that read raw settings before a configuration is built (``kvtier audit``) ask this,
    never a tier name."""
    return next((s.name for s in specs() if key in s.keys), None)


def tier_rank(name: str | None) -> int:
    """Order of tier ``name`` for ranking (the slowest of several is the largest); an unknown
    name or ``None`` ranks first (a report of a tier this process has no record of)."""
    with _lock:
        found = _specs.get(name or "")
    return found.order if found is not None else -1


def slowest(names: list[str] | tuple[str, ...]) -> str:
    """The slowest (largest :func:`tier_rank`) of ``names``; the top tier if there are none."""
    return max(names, key=tier_rank, default=top_tier())


def hit_source(name: str) -> str:
    """vLLM ``CacheHitSource`` value for loads from tier ``name``; an unknown tier reports vLLM's
    fallback ``external_unspecified``."""
    with _lock:
        found = _specs.get(name)
    return found.hit_source if found is not None else "external_unspecified"


def event_medium(name: str | None) -> str | None:
    """The vLLM KV event ``medium`` of tier ``name`` (its record's), ``None`` for a tier never
    announced or an unknown name."""
    with _lock:
        found = _specs.get(name or "")
    return found.medium if found is not None else None


def load(target: str, name: str) -> Any:
    """The object ``target`` (``"module:attribute"``) names, for tier ``name``'s record.

    Raises:
        ConfigError: the module needs a package that is not installed (named in the message).
    """
    module_name, attr = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name and not exc.name.startswith("kvtier"):
            raise ConfigError(f"tier {name!r} needs the Python package {exc.name!r}; install it "
                              f"(pip install {exc.name}) or remove the tier from the config") from None
        raise
    return getattr(module, attr)


RESET_SCOPES = ("cpu", "local", "all")
"""Values of ``reset_scope``: the top tier; every tier that is not shared; every tier."""


def reset_tiers(scope: str) -> list[str]:
    """Registered tiers a reset of ``scope`` (:data:`RESET_SCOPES`) clears, in order.

    Raises:
        ValueError: unknown scope.
    """
    if scope not in RESET_SCOPES:
        raise ValueError(f"unknown reset scope {scope!r}; use one of {', '.join(RESET_SCOPES)}")
    return [s.name for s in specs() if s.top or scope == "all" or (scope == "local" and not s.shared)]


def settings_model(name: str) -> type[Any] | None:
    """The pydantic settings model of tier ``name``, or ``None`` if it declares none."""
    record = spec(name)
    return load(record.settings, name) if record.settings else None


def settings_keys() -> dict[str, str]:
    """Flat configuration key -> tier name, for every field of every registered tier's settings
    model (a tier's keys are accepted at the top level of ``kv_connector_extra_config`` too).

    Raises:
        ValueError: two tiers' models declare the same key.
    """
    out: dict[str, str] = {}
    for record in specs():
        model = settings_model(record.name) if record.settings else None
        for key in getattr(model, "model_fields", {}):
            if key in out:
                raise ValueError(f"tiers {out[key]!r} and {record.name!r} both declare the setting {key!r}")
            out[key] = record.name
    return out


def import_tier_modules(modules: tuple[str, ...] | list[str]) -> None:
    """Import ``modules`` (``tier_modules``), each of which registers tiers with :func:`register`.

    Raises:
        ConfigError: a module cannot be imported, or registers a bad record.
    """
    for module_name in modules:
        try:
            importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError(f"tier_modules names {module_name!r}, which cannot be imported ({exc}); "
                              "install the package that provides it or remove it from tier_modules") from None
        except ValueError as exc:
            raise ConfigError(f"tier module {module_name!r} registers a bad tier: {exc}") from None
