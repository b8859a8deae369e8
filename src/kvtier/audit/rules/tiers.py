"""Offload tiers that serve nothing: a cpu tier not larger than the engine's own KV cache, and chunks no
prompt this server takes can fill (``chunk_tokens`` not below ``--max-model-len``).

kvtier, vLLM's native offload and LMCache store every chunk the engine computes, so their cpu tier is
inclusive of the engine's KV cache: one no larger than it holds only what the engine already holds
(:mod:`kvtier.simulate.hierarchy`, the model ``kvtier size`` and ``kvtier simulate`` share).  Measured:
``kvtier simulate`` on the bundled Mooncake trace, Llama-3.1-70B at TP 8 on 8× H200 (847 GiB of HBM
KV): a 414 GiB cpu tier serves 0.0 % of prompt tokens under ``--policy lru`` and 2.5 % under kvtier's
default (adaptive) policy, which keeps often-reused chunks longer than the engine does (docs/size.md §
Worked example).

The engine's KV cache is computed as ``kvtier size`` computes it: ``--kv-cache-memory-bytes`` × GPUs
when the line gives it (vLLM then ignores the utilization; vllm/config/cache.py), else from the model
(a ``kvtier size`` preset or a local config.json, never the network), TP × PP, the GPU
(``kvtier audit --gpu``) and ``--gpu-memory-utilization``.  Without ``--gpu`` the second rule names
the GPUs on which the tier would serve nothing.  A disk tier or a node pool (``node_gib``, docs/node.md)
larger than the engine's cache, or a shared tier whose size the line does not give, makes a small cpu
tier a staging area: then no finding.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule
from kvtier.audit.rules.settings import disk_tier, kvtier_setting, kvtier_settings, left_out, number, refused
from kvtier.core.config import KVTierConfig
from kvtier.core.errors import ConfigError, UserError
from kvtier.size.hardware import DEFAULT_GPU_MEMORY_UTILIZATION, GPUS, find_gpu
from kvtier.size.models import ResolvedModel, resolve_model
from kvtier.size.plan import GIB, Deployment, hbm_kv_budget_bytes

_SOURCE = ("kvtier docs/size.md § Inclusive tiers and § Worked example (kvtier simulate, bundled Mooncake trace, "
           "Llama-3.1-70B TP 8 on H200: a 414 GiB cpu tier serves 0.0 % under LRU); vLLM vllm/config/cache.py "
           "kv_offloading_size, kv_cache_memory_bytes")
_FIX = ("Size the cpu tier with `kvtier size --model M --tp N --gpu G --trace T --host-ram-gib R --nvme-gib D`: "
        "larger than the engine's KV cache, or only a small staging tier in front of a disk tier or a node pool "
        "(node_gib) that is.")
_SHARED_KEYS = ("redis_url", "s3_bucket")


@dataclass(frozen=True)
class _Tiers:
    """The offload tiers of a line, GiB totals across ranks: the cpu tier, its flag or key, the largest
    tier below the engine (cpu, disk or the host's node pool), and whether a shared tier of a size the
    line does not give follows (redis, s3, or a node pool without ``node_gib``)."""

    cpu_gib: float
    what: str
    largest_gib: float
    shared: bool


def _tiers(c: ServeConfig) -> _Tiers | None:
    extra = kvtier_settings(c)
    if extra is not None:
        if refused(extra, "cpu_gib") or refused(extra, "disk_path", "disk_gib") \
                or refused(extra, "node_socket", "node_gib"):
            return None  # kvtier-config-invalid refuses a size judged here: not judged as 0 or its default
        default = float(KVTierConfig.model_fields["cpu_gib"].default)
        cpu = number(extra.get("cpu_gib"), default)
        disk = number(extra.get("disk_gib"), 0.0) if disk_tier(extra) else 0.0
        node_on = bool(extra.get("node_socket")) and not left_out(extra, "node_socket")
        node = number(extra.get("node_gib"), 0.0) if node_on else 0.0
        shared = any(extra.get(k) for k in _SHARED_KEYS) or (node_on and not node > 0)
        return _Tiers(cpu, f"kvtier's cpu_gib {cpu:g}", max(cpu, disk, node), shared)
    size = c.number("--kv-offloading-size")
    if size is None and c.uses("LMCacheConnectorV1"):
        return _lmcache_tiers(c)
    if size is None or not size > 0 or size == float("inf"):
        return None  # absent, or refused by rule kv-offloading-size-invalid
    return _Tiers(size, f"--kv-offloading-size {size:g}", size, False)


def _lmcache_tiers(c: ServeConfig) -> _Tiers | None:
    """LMCacheConnectorV1's tiers from its environment, GiB per rank × TP × PP (vLLM divides a total by
    them when it configures LMCache, vllm/config/vllm.py): the tier kvtier size's LMCache recipe gives
    (before, the rule judged that recipe's kvtier and vLLM-native twins and never the LMCache one)."""
    ranks = _gpus(c)
    cpu = number(c.env.get("LMCACHE_MAX_LOCAL_CPU_SIZE"), 0.0) * ranks
    if not cpu > 0:
        return None  # unset (LMCache's default) or not a size: lmcache-size-unset / lmcache-env-invalid
    disk = number(c.env.get("LMCACHE_MAX_LOCAL_DISK_SIZE"), 0.0) * ranks if c.env.get("LMCACHE_LOCAL_DISK") else 0.0
    what = f"LMCache's LMCACHE_MAX_LOCAL_CPU_SIZE {cpu / ranks:g} × {ranks} rank(s) = {cpu:g}"
    return _Tiers(cpu, what, max(cpu, disk), bool(c.env.get("LMCACHE_REMOTE_URL")))


def _model(c: ServeConfig) -> ResolvedModel | None:
    try:
        resolved = resolve_model(c.model, hub=False) if c.model else None
    except UserError:
        return None
    return resolved if resolved is not None and resolved.weights_gib is not None else None


def _gpus(c: ServeConfig) -> int:
    return c.tp * c.pp


def _engine_gib(c: ServeConfig, model: ResolvedModel | None, memory_gib: float) -> float | None:
    """The engine's KV cache on GPUs of ``memory_gib``, GiB across all of them; None when it cannot be computed."""
    if model is None or _tp_problem(c, model) is not None:  # kvtier size refuses it: no figure to claim
        return None
    util = c.number("--gpu-memory-utilization")
    util = util if util is not None and 0 < util <= 1 else DEFAULT_GPU_MEMORY_UTILIZATION
    budget = hbm_kv_budget_bytes(Deployment(tp=_gpus(c), gpu_memory_gib=memory_gib, gpu_memory_utilization=util,
                                            weights_gib=model.weights_gib))
    return None if budget is None else budget / GIB


def _tp_problem(c: ServeConfig, model: ResolvedModel) -> str | None:
    """Why vLLM (and kvtier size) refuse ``c``'s TP size for ``model``, one sentence; None when they do not."""
    try:
        model.geometry.check_tp(c.tp)
    except UserError as exc:
        return str(exc)
    return None


def _pinned_gib(c: ServeConfig) -> float | None:
    """``--kv-cache-memory-bytes`` (per GPU) × GPUs, GiB; None when not given or not a positive number."""
    per_gpu = c.number("--kv-cache-memory-bytes")
    return per_gpu * _gpus(c) / GIB if per_gpu is not None and 0 < per_gpu < float("inf") else None


def _says(tiers: _Tiers, engine: str) -> str:
    return (f"{tiers.what} GiB is not larger than {engine}, and the tiers are inclusive (every chunk the engine "
            "computes is stored), so this cpu tier holds little or nothing the engine does not already hold (kvtier "
            "simulate: a cpu tier half the engine's cache serves 0.0 % of prompt tokens under LRU, 2.5 % under "
            "kvtier's default policy)")


@rule("cpu-tier-not-above-engine-cache", "warning", "cpu offload tier no larger than the engine's own KV cache",
      _FIX, _SOURCE, locate="--kv-")
def cpu_tier_not_above_engine_cache(c: ServeConfig) -> str | None:
    tiers = _tiers(c)
    if tiers is None or tiers.shared:
        return None
    pinned = _pinned_gib(c)
    if pinned is not None:
        engine = pinned
        how = f"{engine:,.0f} GiB (--kv-cache-memory-bytes × {_gpus(c)} GPUs)"
    else:
        gpu = find_gpu(c.gpu) if c.gpu else None
        engine_or_none = _engine_gib(c, _model(c), gpu.memory_gib) if gpu is not None else None
        if gpu is None or engine_or_none is None:
            return None
        engine = engine_or_none
        how = (f"{engine:,.0f} GiB ({c.model} at TP {c.tp}"
               + (f" × PP {c.pp}" if c.pp > 1 else "") + f" on {gpu.name}, as kvtier size computes it)")
    if tiers.largest_gib > engine:
        return None
    return _says(tiers, "the engine's KV cache of " + how) + "."


@rule("cpu-tier-vs-engine-cache-unknown", "info", "cannot tell whether the cpu offload tier is larger than the "
      "engine's KV cache", "Pass `kvtier audit --gpu G` (and a model kvtier size knows: a preset or a local "
      "config.json) so the audit can compute the engine's KV cache; " + _FIX[0].lower() + _FIX[1:], _SOURCE,
      locate="--kv-")
def cpu_tier_vs_engine_cache_unknown(c: ServeConfig) -> str | None:
    tiers = _tiers(c)
    if tiers is None or tiers.shared or _pinned_gib(c) is not None:
        return None
    model = _model(c)
    problem = _tp_problem(c, model) if model is not None else None
    if problem is not None:
        return f"cannot tell whether {tiers.what} GiB is larger than the engine's KV cache: {problem}"
    if c.gpu:
        if model is not None:
            return None  # computed: the warning rule speaks
        return (f"cannot tell whether {tiers.what} GiB is larger than the engine's KV cache: {c.model or 'the model'!r} "
                "is neither a kvtier size preset nor a local config.json, so its weights are not known.")
    engines = [(g.name, e) for g in GPUS if (e := _engine_gib(c, model, g.memory_gib))]
    nothing = [f"{name} ({engine:,.0f} GiB)" for name, engine in engines if tiers.largest_gib <= engine]
    if not nothing:
        return None
    return f"the GPU is not known (pass --gpu): on {', '.join(nothing)} " + _says(tiers, "the engine's KV cache") + "."


AUTO_CHUNK_TOKENS_MIN = 128
"""The least ``chunk_tokens: auto`` resolves to (docs/vllm.md: at least 128, a multiple of every block size)."""


@rule("kvtier-chunk-tokens-not-below-max-model-len", "warning",
      "kvtier chunk_tokens not below --max-model-len: no request can load a chunk",
      "Lower chunk_tokens below --max-model-len (auto, the default, is 128 on attention-only models), or raise "
      "--max-model-len.",
      "kvtier docs/vllm.md § Configuration keys (chunk_tokens: only whole chunks are stored and loaded, and a load "
      "leaves at least the prompt's last token to compute); vLLM vllm/config/model.py max_model_len",
      locate="--max-model-len")
def kvtier_chunk_tokens_not_below_max_model_len(c: ServeConfig) -> str | None:
    length = c.number("--max-model-len")
    if not c.uses("KVTierConnector") or length is None or length <= 0:
        return None
    raw = kvtier_setting(c, "chunk_tokens")
    auto = raw is None or str(raw).strip().lower() == "auto"
    try:
        tokens = AUTO_CHUNK_TOKENS_MIN if auto else int(str(raw).strip())
    except ValueError:
        return None  # not a number: kvtier's own config rule reports it
    if tokens <= 0 or tokens < length:
        return None
    said = f"chunk_tokens auto (at least {tokens})" if auto else f"chunk_tokens {tokens}"
    return (f"{said} is not below --max-model-len {length:g}: a hit needs a prompt longer than one chunk (the last "
            "prompt token is always computed), which this server never takes, so kvtier serves no hit.")


@rule("kvtier-cpu-tier-below-one-chunk", "error", "kvtier cpu tier smaller than one chunk of the served model",
      "Raise cpu_gib to room for hundreds of chunks (`kvtier size --model M --tp N` prints the bytes per token), "
      "or lower chunk_tokens (auto, the default).",
      "kvtier src/kvtier/core/sizing.py cpu_capacity_bytes (the connector refuses a cpu tier smaller than one chunk "
      "at start-up); docs/vllm.md § Sizes and tensor parallelism", locate="--kv-transfer-config")
def kvtier_cpu_tier_below_one_chunk(c: ServeConfig) -> str | None:
    """``cpu_gib`` / TP against one rank's chunk of a plain attention model kvtier size knows (a preset or a
    local config.json): the least bytes the connector's chunk can take there (``chunk_tokens``, ``auto``
    counted as 128; 2-byte KV, 1 with an fp8 ``--kv-cache-dtype``).  ``check`` knows no model and only
    warns below a small model's chunk; here the model is known, so the refusal is certain."""
    extra = kvtier_settings(c)
    if extra is None or not c.model:
        return None
    try:
        geometry = resolve_model(c.model, hub=False).geometry
        config = KVTierConfig.from_dict({k: extra[k] for k in ("cpu_gib", "chunk_tokens") if k in extra})
    except (UserError, ConfigError):
        return None  # not a model size knows, or a bad value kvtier's own config rule reports
    if geometry.num_swa_layers or geometry.num_state_layers or c.tp < 1:
        return None  # hybrid models store each KV cache group apart: not modelled here
    tokens = AUTO_CHUNK_TOKENS_MIN if config.chunk_tokens == "auto" else config.chunk_tokens
    dtype_bytes = 1 if (c.value("--kv-cache-dtype") or "").lower().startswith("fp8") else 2
    chunk = tokens * geometry.kv_bytes_per_token_per_rank(c.tp, dtype_bytes)
    capacity = config.cpu_bytes_per_rank(c.tp)
    if capacity >= chunk:
        return None
    return (f"cpu_gib {config.cpu_gib:g} gives each of {c.tp} rank(s) {capacity:,} bytes, less than one {tokens}-token "
            f"chunk of {c.model} ({chunk:,} bytes a rank at {dtype_bytes}-byte KV), so the connector refuses to "
            f"start (every chunk passes through the cpu tier); at least {chunk * c.tp / GIB:.4g} GiB, better hundreds "
            "of chunks.")


@rule("kvtier-disk-tier-not-above-cpu-tier", "warning", "write-through kvtier disk tier no larger than its cpu tier",
      "Make disk_gib several times cpu_gib, or set write_mode to write-back (the disk tier then takes what the cpu "
      "tier evicts).", "kvtier docs/size.md § Inclusive tiers", locate="disk_gib")
def kvtier_disk_tier_not_above_cpu_tier(c: ServeConfig) -> str | None:
    """:func:`~kvtier.integrations.vllm.preflight_tiers.disk_not_above_cpu` of the serve line's kvtier
    settings (``kvtier check`` warns with the same sentence); a config kvtier refuses says nothing here."""
    from kvtier.integrations.vllm.preflight_tiers import disk_not_above_cpu

    extra = kvtier_settings(c)
    if extra is None:
        return None
    try:
        config = KVTierConfig.from_dict(dict(extra))
    except (ConfigError, ValueError, TypeError):
        return None  # a bad value: kvtier's own config rule reports it
    said = disk_not_above_cpu(config)
    return f"{said}." if said else None
