"""Tiers by name: one :class:`TierSpec` record per tier, the only place outside a tier's own module
that knows it.  Building a tier from a configuration is :mod:`kvtier.core.tiers.factory`'s part;
this module reads no configuration, so :mod:`kvtier.core.config` can check names against it.

Everything that differs per tier is read from its record: the store's tier order, whether it is
shared (asked asynchronously, never evicted by the store), the vLLM hit source its loads report
(``prompt_tokens_cached_by_source``), metric labels, the scheduler's mirror ranking, the remote
lookups of a shared tier, the preflight and the audit.  Modules are imported lazily (so ``redis``
stays optional until a redis tier is configured) and a tier module never needs an edit elsewhere.

Adding a tier (docs/store.md, "Adding a tier"):

1. one module with the tier and its plug-in object, a
   :class:`~kvtier.core.tiers.plugin.TierPlugin` (``build(ctx) -> Tier | None``, ``configured``,
   its pydantic ``settings`` model, ``check``, ``advice``, ``state_dir`` and, for storage that
   outlives the engines, ``blobs(config)``: the blob store ``kvtier purge``, a reset and the probe
   run over; :class:`~kvtier.core.tiers.plugin.PluginDefaults` fills in the ones it does not need);
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

from pydantic import BaseModel

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
    """What kvtier knows of one tier without importing it; the rest is its plug-in object.

    Attributes:
        name: the tier's name in ``tiers``, metric labels and logs (lower case, ``[a-z0-9_]``).
        order: rank in the default tier order, fastest first (the top tier is the smallest);
            the scheduler reports a chunk held in several tiers as held in the slowest one.
        shared: other hosts write the tier and it evicts on its own (see
            :mod:`kvtier.core.tiers.base`): asked asynchronously, never evicted by the store.
        hit_source: the vLLM ``CacheHitSource`` value its loads report (:data:`HIT_SOURCES`).
        plugin: ``"module:attribute"`` of the tier's plug-in object, a
            :class:`~kvtier.core.tiers.plugin.TierPlugin` (build, configured, settings model,
            check, advice, state directory, blob store); imported on first use and checked against
            the protocol (:func:`plugin`), typed from there on.
        capabilities: names of the optional protocols of :mod:`kvtier.core.tiers.base` the tier
            implements (``rescannable``, ``generational``, ``exact_usage``, ``paged``,
            ``staging``, ``registers_memory``, ``answers_now``); the conformance suite checks the tier implements
            exactly these.
        top: the tier every chunk passes through (exactly one registered tier).
        keys: the configuration keys that ask for the tier (the preflight warns when they are set
            but ``tiers`` leaves the tier out; ``kvtier audit``'s deployment rules find a key's tier
            with :func:`asked_by`; ``kvtier purge`` runs over the tiers whose keys it was given).
        medium: the ``medium`` of the vLLM KV events announcing a chunk this tier holds
            (vllm/distributed/kv_events.py: ``"CPU"`` host memory, ``"STORAGE"`` a local disk;
            :mod:`kvtier.integrations.vllm.scheduler.events`); ``None``: the tier is never announced (a
            shared tier: the store's change feed does not report it, docs/vllm.md "KV events").
        model: the tier's default bandwidth and latency (:class:`TierModel`) for the sizing and
            simulation tools; ``None`` for a tier they do not model on its own (cpu, disk: their
            figures are the tools' own options).
        packages: the modules of the tier's client outside kvtier (``redis``, ``obstore``: the
            extra of the tier's name in pyproject.toml); the pre-flight reports one that does not
            import as an error (:func:`kvtier.core.tiers.factory.check`).
        codecs: the tier writes the codec chain ``codecs`` names for it (compression, encryption
            at rest: an :class:`~kvtier.core.tiers.envelopetier.EnvelopeTier` built with
            ``**envelope_args(config, name)``).  Opt-in: ``False`` (the default) means it stores
            values as the engine wrote them, and a ``codecs`` entry for it is refused at start-up
            rather than ignored (a chain asking for ``aes-256-gcm`` would otherwise leave them in
            the clear).
    """

    name: str
    order: int
    shared: bool
    hit_source: str
    plugin: str
    capabilities: frozenset[str] = field(default_factory=frozenset)
    top: bool = False
    keys: tuple[str, ...] = ()
    medium: str | None = None
    model: TierModel | None = None
    packages: tuple[str, ...] = ()
    codecs: bool = False


REDIS_MODEL = TierModel(1.25, 0.5, "one 10 Gb/s Ethernet link (10GBASE-T line rate, IEEE 802.3an) to the server, and "
                        "one network round trip in a data centre plus the server's work (about 0.5 ms)")
S3_MODEL = TierModel(1.25, 100.0, "parallel GETs (s3_concurrency) bounded by one 10 Gb/s Ethernet link, and a "
                     "first-byte latency of 100-200 ms per request (AWS S3 user guide, 'Performance guidelines "
                     "for Amazon S3'; a MinIO or Ceph RGW server near the engines answers in milliseconds)")


BUILTIN = (
    TierSpec("cpu", 0, False, "host", "kvtier.core.tiers.builtin:CPU", top=True,
             capabilities=frozenset({"staging", "paged", "registers_memory"}), medium="CPU"),
    TierSpec("disk", 10, False, "disk", "kvtier.core.tiers.builtin:DISK",
             capabilities=frozenset({"rescannable", "generational", "exact_usage"}), keys=("disk_path", "disk_gib"),
             medium="STORAGE", codecs=True),
    TierSpec("node", 15, True, "host", "kvtier.core.tiers.builtin:NODE", keys=("node_socket",),
             capabilities=frozenset({"registers_memory", "answers_now"})),
    TierSpec("redis", 20, True, "external_unspecified", "kvtier.core.tiers.builtin:REDIS", keys=("redis_url",),
             model=REDIS_MODEL, packages=("redis",), codecs=True),
    TierSpec("s3", 30, True, "external_unspecified", "kvtier.core.tiers.builtin:S3",
             keys=("s3_bucket", "s3_endpoint_url"), model=S3_MODEL, packages=("obstore",), codecs=True),
)
"""The tiers shipped with kvtier: one line each."""

CAPABILITIES = frozenset({"staging", "paged", "rescannable", "generational", "exact_usage", "registers_memory",
                          "answers_now"})
"""Every capability a record may declare: the names of :data:`kvtier.core.tiers.base.CAPABILITY_PROTOCOLS`
(spelled out, as ``base`` imports this module through ``core/stats.py``; a test holds them equal)."""

_lock = threading.Lock()
_specs: dict[str, TierSpec] = {s.name: s for s in BUILTIN}
_plugins: dict[str, object] = {}
generation = 0
"""Bumped by every :func:`register` / :func:`unregister` that changes the records: a caller that
keeps something derived from them (metric label tables, transfer directions) on a hot path reads
this attribute (no call) and derives again when it changed."""


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
            raise ValueError(f"a tier named {spec.name!r} is registered already ({old.plugin})")
        if spec.top:
            raise ValueError(f"tier {spec.name!r}: only the built-in top tier may be the top tier")
        _specs[spec.name] = spec
        _bump()


def unregister(name: str) -> None:
    """Remove a tier registered with :func:`register` (tests that register a tier for a while).

    Raises:
        ValueError: ``name`` is a built-in tier.
    """
    if any(s.name == name for s in BUILTIN):
        raise ValueError(f"tier {name!r} is built in and cannot be unregistered")
    with _lock:
        if _specs.pop(name, None) is not None:
            _bump()


def _bump() -> None:
    global generation
    generation += 1


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


def codec_tiers() -> list[str]:
    """Registered lower tiers that write a codec chain (:attr:`TierSpec.codecs`), in order."""
    return [s.name for s in specs() if not s.top and s.codecs]


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


def load_plugin(name: str) -> object:
    """Tier ``name``'s plug-in object (its record's :attr:`TierSpec.plugin`), imported on first use;
    :func:`kvtier.core.tiers.factory.plugin` checks it against
    :class:`~kvtier.core.tiers.plugin.TierPlugin` (that protocol names the configuration, which reads
    this module: so the check lives above it).

    Raises:
        ConfigError: unknown name, or the module needs a package that is not installed (named in
            the message), or it has no such attribute.
    """
    record = spec(name)
    with _lock:
        if record.plugin in _plugins:
            return _plugins[record.plugin]
    module_name, _, attr = record.plugin.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name and not exc.name.startswith("kvtier"):
            raise ConfigError(f"tier {name!r} needs the Python package {exc.name!r}; install it "
                              f"(pip install {exc.name}) or remove the tier from the config") from None
        raise
    if not hasattr(module, attr):
        raise ConfigError(f"tier {name!r}: {record.plugin} names nothing; name the tier's plug-in object "
                          "(kvtier.core.tiers.plugin.TierPlugin)")
    obj: object = getattr(module, attr)
    with _lock:
        _plugins[record.plugin] = obj
    return obj


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


def settings_model(name: str) -> type[BaseModel] | None:
    """The pydantic settings model of tier ``name`` (its plug-in's ``settings``), or ``None`` if it
    declares none.

    Raises:
        ConfigError: the plug-in's ``settings`` is not a pydantic model class.
    """
    model = getattr(load_plugin(name), "settings", None)
    if model is None:
        return None
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        raise ConfigError(f"tier {name!r}: its plug-in's settings is {model!r}, not a pydantic model class")
    return model


def settings_keys() -> dict[str, str]:
    """Flat configuration key -> tier name, for every field of every registered tier's settings
    model (a tier's keys are accepted at the top level of ``kv_connector_extra_config`` too).

    Raises:
        ValueError: two tiers' models declare the same key.
    """
    out: dict[str, str] = {}
    for record in specs():
        for key in getattr(settings_model(record.name), "model_fields", {}):
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
