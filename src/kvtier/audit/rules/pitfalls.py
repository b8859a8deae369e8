"""Flag pitfalls: weights vs KV offload, TP-total sizing, SGLang habits, prefix caching, FP8 KV."""

from __future__ import annotations

import math

from kvtier.audit.model import ServeConfig
from kvtier.audit.rules.base import rule

SGLANG_FLAGS = ("--hicache-size", "--hicache-ratio", "--enable-hierarchical-cache", "--mem-fraction-static",
                 "--tp-size")


@rule("cpu-offload-gb-is-weights", "warning", "--cpu-offload-gb offloads weights, not KV",
      "For KV offload set --kv-offloading-size GiB (total across TP) or a KV connector in --kv-transfer-config; "
      "keep --cpu-offload-gb only to fit weights that do not fit in HBM.",
      'vLLM vllm/config/offload.py cpu_offload_gb (model weights, GiB per GPU) vs '
      'vllm/config/cache.py kv_offloading_size (KV cache, GiB total across TP)', locate="--cpu-offload-gb")
def cpu_offload_gb_is_weights(c: ServeConfig) -> str | None:
    gb = c.number("--cpu-offload-gb")
    if gb and 0 < gb < math.inf and not c.kv_offload_on:  # a non-finite size is cpu-offload-gb-invalid's
        return (f"--cpu-offload-gb {gb:g} streams model weights from CPU on every forward pass and does nothing "
                "for the KV cache; no KV offload is configured.")
    return None


@rule("cpu-offload-gb-beside-kv-offload", "info", "weights offload set next to KV offload",
      "Drop --cpu-offload-gb unless the weights really do not fit in HBM; it costs prefill throughput.",
      'vLLM vllm/config/offload.py cpu_offload_gb (weights offload, per GPU; weights stream '
      'over PCIe every forward pass)',
      locate="--cpu-offload-gb")
def cpu_offload_gb_beside_kv(c: ServeConfig) -> str | None:
    gb = c.number("--cpu-offload-gb")
    if gb and 0 < gb < math.inf and c.kv_offload_on:
        return f"--cpu-offload-gb {gb:g} offloads weights (per GPU) next to KV offload; check it is meant."
    return None


@rule("cpu-offload-gb-invalid", "error", "--cpu-offload-gb is not a finite number of at least 0",
      "Give the weights to offload in GiB per GPU, e.g. --cpu-offload-gb 10, or drop the flag (0, the default, "
      "offloads nothing).",
      "vLLM vllm/config/offload.py UVAOffloadConfig.cpu_offload_gb (float, ge=0: refuses negatives and nan) and "
      "vllm/model_executor/offloader/base.py int(cpu_offload_gb * 1024**3) (inf: OverflowError at model load)",
      locate="--cpu-offload-gb")
def cpu_offload_gb_invalid(c: ServeConfig) -> str | None:
    if not c.has("--cpu-offload-gb"):
        return None
    gb = c.number("--cpu-offload-gb")
    if gb is None or not 0 <= gb < math.inf:  # nan compares false to every bound
        raw = c.value("--cpu-offload-gb")
        return f"--cpu-offload-gb {'has no value' if raw is None else repr(raw) + ' is not a finite size in GiB of at least 0'}."
    return None


@rule("kv-offloading-size-is-total", "info", "--kv-offloading-size is the total across TP ranks",
      "If the number was sized per GPU (SGLang's convention), multiply it by the TP size.",
      'vLLM vllm/config/cache.py kv_offloading_size docstring: "When TP > 1, this is the total '
      'buffer size summed across all TP ranks"',
      locate="--kv-offloading-size")
def kv_offloading_size_is_total(c: ServeConfig) -> str | None:
    size, ranks = c.number("--kv-offloading-size"), c.tp * c.pp
    if size and math.isfinite(size) and ranks > 1:  # a non-finite size is kv-offloading-size-invalid's
        return (f"--kv-offloading-size {size:g} is {size:g} GiB in total, {size / ranks:g} GiB per rank over "
                f"{ranks} ranks; a per-GPU figure would need {size * ranks:g}.")
    return None


@rule("sglang-flag", "error", "SGLang flag in a vLLM command",
      "Remove it; for a host KV tier use --kv-offloading-size = SGLang's per-GPU host size × TP (vLLM counts the total).",
      'vLLM vllm/engine/arg_utils.py (no such flag) and vllm/config/cache.py kv_offloading_size '
      "(total across TP ranks, unlike SGLang's per-rank host size)")
def sglang_flag(c: ServeConfig) -> str | None:
    found = [f for f in SGLANG_FLAGS if c.has(f)]
    if found:
        return f"{', '.join(found)} is SGLang's, not vLLM's; vLLM will refuse to start."
    return None


@rule("kv-offloading-backend-without-size", "error", "--kv-offloading-backend without --kv-offloading-size",
      "Add --kv-offloading-size GiB (total across TP).",
      'vLLM vllm/config/cache.py kv_offloading_backend ("KV offloading is only activated when '
      'kv_offloading_size is set") and vllm/config/vllm.py', locate="--kv-offloading-backend")
def backend_without_size(c: ServeConfig) -> str | None:
    if c.has("--kv-offloading-backend") and not c.has("--kv-offloading-size"):
        return "--kv-offloading-backend is set but --kv-offloading-size is not, so no KV offload is enabled."
    return None


@rule("kv-offloading-size-invalid", "error", "--kv-offloading-size is not a positive number",
      "Give the tier size in GiB, total across TP ranks, e.g. --kv-offloading-size 64.",
      'vLLM vllm/config/cache.py CacheConfig.kv_offloading_size (GiB, total across TP ranks)', locate="--kv-offloading-size")
def offloading_size_invalid(c: ServeConfig) -> str | None:
    if not c.has("--kv-offloading-size"):
        return None
    size = c.number("--kv-offloading-size")
    if size is None or not 0 < size < math.inf:  # nan and inf too: vLLM would size a buffer from them
        return f"--kv-offloading-size {c.value('--kv-offloading-size')!r} is not a positive, finite size in GiB."
    return None


@rule("parallel-size-invalid", "error", "a parallel size that is not a whole number of at least 1",
      "Give --tensor-parallel-size / --pipeline-parallel-size as a whole number of GPUs, at least 1, e.g. "
      "--tensor-parallel-size 2.",
      "vLLM vllm/config/parallel.py ParallelConfig.tensor_parallel_size and pipeline_parallel_size "
      "(int, ge=1), read by vllm/engine/arg_utils.py")
def parallel_size_invalid(c: ServeConfig) -> str | None:
    bad = []
    for flag, short in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        given = c.parallel_size(flag, short)
        if given is None:
            continue
        try:
            ok = int(given[1], 10) >= 1
        except ValueError:
            ok = False
        if not ok:
            bad.append(f"{given[0]} {given[1]!r}")
    if bad:
        return (f"{' and '.join(bad)} is not a whole number of at least 1; vLLM refuses to start, and the audit "
                "reads it as 1 for its sizing rules.")
    return None


@rule("prefix-caching-off-with-offload", "error", "KV offload with prefix caching off",
      "Remove --no-enable-prefix-caching (prefix caching is on by default).",
      'vLLM vllm/config/cache.py enable_prefix_caching (default True): offloaded KV is found '
      'through prefix-cache block hashes',
      locate="--no-enable-prefix-caching")
def prefix_caching_off(c: ServeConfig) -> str | None:
    if c.has("--no-enable-prefix-caching") and c.kv_offload_on:
        return ("Prefix caching is off, so offloaded KV has nothing to hit against (vLLM's offload finds it "
                "through prefix-cache block hashes; kvtier loads nothing into such an engine, since it cannot "
                "compute over a loaded prefix); the copies are pure cost.")
    return None


@rule("kv-transfer-config-invalid", "error", "--kv-transfer-config is not a JSON object",
      "Quote the JSON in single quotes: --kv-transfer-config '{\"kv_connector\":...,\"kv_role\":\"kv_both\"}'.",
      'vLLM vllm/config/kv_transfer.py KVTransferConfig, parsed from JSON by '
      'vllm/engine/arg_utils.py', locate="--kv-transfer-config")
def transfer_config_invalid(c: ServeConfig) -> str | None:
    if c.has("--kv-transfer-config") and c.kv_transfer_json is None:
        raw = c.value("--kv-transfer-config") or ""
        if any(reference in raw for reference in c.unresolved):
            return None  # its value is not in the input: rule shell-variable-unresolved says so
        return f"--kv-transfer-config {raw!r} does not parse as a JSON object."
    return None


@rule("shell-variable-unresolved", "info", "a shell variable (or a Kubernetes $(VAR) reference) in the serve line "
      "whose value the input does not give",
      "Audit the expanded line (e.g. `echo vllm serve ... \"$CONFIG\" | kvtier audit -`), or assign the variable "
      "earlier in the same script (NAME='...'); for $(VAR) in a container's args, define VAR with a literal value "
      "in the container's env.",
      "kvtier src/kvtier/audit/parse_command.py (simple NAME=... assignments of the same script are expanded); "
      "$(VAR) in command/args: Kubernetes API reference, Container v1 args (expanded from the container's env)",
      locate="$")
def shell_variable_unresolved(c: ServeConfig) -> str | None:
    if not c.unresolved:
        return None
    names = ", ".join(c.unresolved)
    return f"cannot see the value of {names}; audit the expanded line to check what it holds."


_ENV_PREFIXES = ("VLLM_", "KVTIER_", "CUDA_", "HF_", "NCCL_", "PYTORCH_", "TORCH_", "OMP_", "LMCACHE_", "AWS_")
"""Names the server's process reads from its environment (vLLM, kvtier, CUDA, Hugging Face, ...)."""


@rule("shell-variable-not-exported", "warning", "a variable the server reads is set in the script but not exported",
      "Write `export NAME=value` (or `set -a` before the assignments, or NAME=value on the vllm serve line itself).",
      "POSIX Shell Command Language § 2.9.1 Simple Commands (only exported variables reach a command's "
      "environment); kvtier src/kvtier/audit/parse_command.py", locate="=")
def shell_variable_not_exported(c: ServeConfig) -> str | None:
    names = [n for n in c.unexported if n.startswith(_ENV_PREFIXES) and n not in c.env]
    if not names:
        return None
    verb = "is" if len(names) == 1 else "are"
    return (f"{', '.join(f'{n}={c.unexported[n]}' for n in names)} {verb} assigned without export, so the shell does "
            "not pass it to vllm and the server runs without it.")


@rule("kv-transfer-config-dotted", "error", "dotted --kv-transfer-config.KEY flags leave the server without "
      "its KV connector",
      "Put every key in the one --kv-transfer-config JSON (or give them all as dotted flags, kv_connector, "
      "kv_role and kv_connector_module_path included); vLLM never merges the two forms.",
      'vLLM vllm/utils/argparse_utils.py FlexibleArgumentParser.parse_args (dotted keys become one '
      '--kv-transfer-config JSON appended after every other argument; argparse keeps the last)',
      locate="--kv-transfer-config.")
def transfer_config_dotted(c: ServeConfig) -> str | None:
    dotted = c.kv_transfer_dotted
    if dotted is None:
        return None
    flags = " ".join(c.kv_transfer_dotted_flags)
    plain = c.kv_transfer_json
    lost = plain.get("kv_connector") if plain else None
    if lost and dotted.get("kv_connector") != lost:
        now = dotted.get("kv_connector")
        return (f"{flags} replaces the whole --kv-transfer-config JSON (vLLM builds a new config from the dotted "
                f"keys), so the server runs {'with ' + str(now) if now else 'with no KV connector'} instead of "
                f"{lost}: {'without kvtier, ' if lost == 'KVTierConnector' else ''}nothing is offloaded or loaded.")
    if not dotted.get("kv_connector"):
        return (f"{flags} sets no kv_connector, so vLLM runs with no KV connector and ignores these keys"
                f"{' (the --kv-transfer-config JSON is replaced by them)' if c.has('--kv-transfer-config') else ''}.")
    return None


@rule("kv-role-missing", "error", "kv_connector set without kv_role",
      "Add \"kv_role\":\"kv_both\" (or kv_producer / kv_consumer for disaggregated prefill).",
      'vLLM vllm/config/kv_transfer.py KVTransferConfig.__post_init__ ("Please specify kv_role '
      'when kv_connector is set")',
      locate="--kv-transfer-config")
def kv_role_missing(c: ServeConfig) -> str | None:
    cfg = c.kv_transfer_config
    if cfg and cfg.get("kv_connector") and not cfg.get("kv_role"):
        return f"kv_connector {cfg['kv_connector']} has no kv_role, which vLLM rejects at start-up."
    return None


@rule("fp8-kv-without-scales", "warning", "FP8 KV cache may run with scale 1.0",
      "Stay on BF16 KV (--kv-cache-dtype auto) and use offload to claw back memory, or confirm the checkpoint "
      "ships calibrated k_scale/v_scale.",
      'vLLM vllm/model_executor/layers/quantization/kv_cache.py (k_scale/v_scale fall back to '
      '1.0 when the checkpoint ships none); #49389 removed --calculate-kv-scales', locate="--kv-cache-dtype")
def fp8_kv(c: ServeConfig) -> str | None:
    dtype = (c.value("--kv-cache-dtype") or "").lower()
    if dtype.startswith("fp8"):
        return (f"--kv-cache-dtype {dtype}: without calibrated scales in the checkpoint vLLM uses 1.0, which can "
                "clip large activations (subtle quality loss, often past 128k context).")
    return None
