"""``kvtier size``: KV bytes per token, HBM KV budget and the offload tier to configure."""

from __future__ import annotations

import inspect
import json
import math
import typing
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import typer

from kvtier.cli.errors import fail, flag_names
from kvtier.cli.size_audit import recipe_audit, refusal
from kvtier.cli.size_text import print_presets, print_report
from kvtier.cli.tierflags import build, given, option, refuse_stray, targets
from kvtier.core.errors import UserError
from kvtier.core.toolflags import ToolFlag, tool_flags

if TYPE_CHECKING:
    from kvtier.simulate.hierarchy import StackCurve
    from kvtier.size.compression import CompressionRatio
    from kvtier.size.plan import SizeReport

HELP = """Size the KV cache of a model and the offload tier it needs.

From a config.json (path), a built-in preset (--list-presets) or a hub id: KV bytes per token for the whole model and per tensor-parallel rank (GQA, MLA, sliding windows, Mamba/linear-attention state, fp8, TP > KV heads), the HBM KV budget, and the offload tiers, printed as kvtier, vLLM-native and LMCache configs. The warm set comes from a request trace (--trace: the capacity reaching 95% of its ceiling, as kvtier simulate measures it) or from --sessions × --context × 1.15. Tiers are inclusive (kvtier stores every chunk the engine computes), so a cpu tier is recommended only larger than the engine's KV cache, within host RAM less reserves, and a disk tier within --nvme-gib. Sizes are TOTALS across TP ranks, like vLLM's --kv-offloading-size.

Examples:

  kvtier size --model meta-llama/Llama-3.1-8B-Instruct

  kvtier size --model Qwen/Qwen3-32B --tp 2 --gpu H100 --context 32768 --sessions 200 --host-ram-gib 512

  kvtier size --model ./my-model/config.json --kv-dtype fp8 --gpu-memory-gib 80 --weights-gib 40 --json

  kvtier size --model meta-llama/Llama-3.1-70B --tp 8 --gpu H200 --trace bundled --host-ram-gib 2048 --nvme-gib 13970
"""


def _size(
    flags: list[ToolFlag],
    tiers: dict[str, Any],
    model: str | None = typer.Option(None, "--model", "-m", help="config.json path, model directory, preset or hub id."),
    tp: int = typer.Option(1, "--tp", help="Tensor-parallel size."),
    kv_dtype: str = typer.Option("auto", "--kv-dtype", help="KV cache dtype: auto (model dtype), bf16, fp16 or fp8."),
    gpu: str | None = typer.Option(None, "--gpu", help="GPU type: H100, H200, H20, B200, A100-80GB, A100-40GB, L40S, L4, MI300X."),
    gpu_memory_gib: float | None = typer.Option(None, "--gpu-memory-gib", help="Memory of one GPU in GiB (instead of --gpu)."),
    gpu_memory_utilization: float = typer.Option(0.9, "--gpu-memory-utilization", help="vLLM's --gpu-memory-utilization."),
    weights_gib: float | None = typer.Option(None, "--weights-gib", help="Whole-model weights in GiB (default: preset or local safetensors)."),
    overhead_gib: float = typer.Option(4.0, "--overhead-gib", help="Per-GPU activation/CUDA-graph overhead in GiB."),
    context: int | None = typer.Option(None, "--context", help="Tokens per session (typical context)."),
    sessions: int | None = typer.Option(None, "--sessions", help="Sessions to keep warm."),
    host_ram_gib: float | None = typer.Option(None, "--host-ram-gib", help="Host RAM of the node, GiB."),
    host_reserve_gib: float | None = typer.Option(None, "--host-reserve-gib", help="Host RAM kept from the cpu tier "
                                                  "for the node and vLLM, GiB (default: 16 + 16 per GPU of --tp)."),
    nvme_gib: float | None = typer.Option(None, "--nvme-gib", help="NVMe capacity for the disk tier, GiB (the tier "
                                          "takes at most 1/1.1 of it, the room kvtier audit asks of its volume)."),
    trace: str | None = typer.Option(None, "--trace", help="Request trace (.jsonl[.gz]; 'bundled': the Mooncake "
                                     "trace shipped with kvtier) to size the warm set from, instead of --sessions."),
    trace_format: str = typer.Option("auto", "--trace-format", help="--trace format: auto (from its first "
                                      "record), mooncake or kvtier-jsonl."),
    tokens_per_block: int | None = typer.Option(None, "--tokens-per-block",
                                                help="--trace's tokens per block (mooncake: 512)."),
    disk_gb_per_s: float = typer.Option(7.0, "--disk-gb-per-s", help="NVMe read bandwidth, GB/s, all drives together "
                                        "(as kvtier simulate; a disk tier slower than prefill is not recommended)."),
    prefill_tokens_per_s: float = typer.Option(20_000.0, "--prefill-tokens-per-s", help="Prefill throughput of the "
                                               "engine, tokens/s (as kvtier simulate, docs/simulate.md)."),
    offload_gib: float | None = typer.Option(None, "--offload-gib", help="Print recipes for this tier size (GiB, total) instead of the recommendation."),
    disk_path: str = typer.Option("/mnt/nvme/kvtier", "--disk-path", help="Disk tier directory used in recipes."),
    chunk_tokens: int | None = typer.Option(None, "--chunk-tokens", help="kvtier chunk size in tokens (default: "
                                            "128; auto for a model with Mamba/linear-attention state)."),
    compression_ratio: list[str] | None = typer.Option(None, "--compression-ratio", help="disk=CODEC[:R]: kvtier's "
                                                       "disk tier compresses with CODEC, R payload bytes per stored "
                                                       "byte (default: the ratio measured in docs/benchmarks.md)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of text."),
    list_presets: bool = typer.Option(False, "--list-presets", help="List the built-in model presets and exit."),
) -> None:
    from kvtier.core.config import MAX_CHUNK_TOKENS
    from kvtier.core.dtypes import DTYPE_BYTES, kv_cache_short_name
    from kvtier.core.tiers.node.settings import TIER as NODE
    from kvtier.simulate.cost import Throughputs
    from kvtier.simulate.hierarchy import usable_nvme_gib
    from kvtier.size import Deployment, build_recipe, plan, resolve_model
    from kvtier.size.compression import DISK, parse_ratios
    from kvtier.size.context import check_context
    from kvtier.size.hardware import GPUS, find_gpu
    from kvtier.size.plan import check_engine_starts, check_finite, split_tier
    from kvtier.size.recipe import (
        DEFAULT_CHUNK_TOKENS,
        chunk_notes,
        recipe_chunk_tokens,
        round_total,
        tier_recipes,
    )

    if list_presets:
        print_presets()
        return
    if model is None:
        fail("--model is required: a config.json path, a model directory, a preset (--list-presets) or a hub id.")
    dtype = "bf16" if kv_dtype.strip().lower() == "auto" else kv_cache_short_name(kv_dtype)
    if dtype is None:
        fail(f"--kv-dtype {kv_dtype!r} is not one of auto, bf16, fp16, fp8 (or vLLM's names: bfloat16, "
             "float16, fp8_e4m3, fp8_e5m2).")
    try:
        check_finite("--offload-gib", offload_gib)
        check_finite("--gpu-memory-gib", gpu_memory_gib)
        if gpu is not None and gpu_memory_gib is not None:  # one would be ignored
            raise UserError("give --gpu (a known GPU's memory) or --gpu-memory-gib (the memory of one GPU in GiB), "
                            "not both.")
        memory = gpu_memory_gib
        found_gpu = None
        if gpu is not None:
            found_gpu = find_gpu(gpu)
            if found_gpu is None:
                raise UserError(f"--gpu {gpu!r} is not known; use one of {', '.join(g.name for g in GPUS)}, "
                                "or pass --gpu-memory-gib with its memory in GiB.")
            memory = found_gpu.memory_gib
        if trace is None and (tokens_per_block is not None or trace_format != "auto"):
            raise UserError("--tokens-per-block and --trace-format describe --trace; give --trace FILE or drop them.")
        if trace is not None and sessions is not None:
            raise UserError("give --trace (the warm set measured on a trace) or --sessions (sessions × --context), "
                            "not both.")
        resolved = resolve_model(model)
        check_context(context, resolved.max_context, model)
        if resolved.weights_problem is not None and weights_gib is None and memory is not None:
            raise UserError(resolved.weights_problem)  # the HBM budget needs the weights
        curve = _curve(trace, trace_format, tokens_per_block) if trace is not None else None
        weights = weights_gib if weights_gib is not None else resolved.weights_gib
        note = "given" if weights_gib is not None else resolved.weights_note
        if kv_dtype.strip().lower() == "auto":  # vLLM's --dtype auto: the config's fp16 or bf16 (both 2 bytes)
            dtype = resolved.auto_dtype
        label = f"auto ({dtype})" if kv_dtype.strip().lower() == "auto" else dtype
        tier_values = _tier_values(flags, tiers)
        node_gib = tier_values.get(NODE, {}).get("node_gib") or None  # the pool comes out of the cpu tier's DRAM
        if node_gib is not None and host_ram_gib is not None and node_gib >= host_ram_gib:  # no pool can be made
            raise UserError(f"--node-gib {node_gib:g} is not less than --host-ram-gib {host_ram_gib:g}: the node pool "
                            "lives in the host's RAM (/dev/shm) beside the engines, so it cannot be that large; give "
                            "the pool's size as `kvtier node serve --node-gib` has it, or the host's real RAM.")
        dep = Deployment(tp=tp, kv_dtype=label, dtype_bytes=DTYPE_BYTES[dtype],
                         gpu_memory_gib=memory, gpu_memory_utilization=gpu_memory_utilization,
                         weights_gib=weights, overhead_gib=overhead_gib, context_tokens=context,
                         sessions=sessions, host_ram_gib=host_ram_gib, host_reserve_gib=host_reserve_gib,
                         nvme_gib=nvme_gib, node_gib=node_gib)
        try:
            rates = Throughputs(prefill_tokens_per_s=prefill_tokens_per_s, disk_gb_per_s=disk_gb_per_s)
        except ValueError as exc:
            raise UserError(f"{exc}.") from None
        ratios = parse_ratios(compression_ratio, (DISK,), codec_required=True)
        if DISK in ratios and nvme_gib is not None:  # the NVMe holds R× the payload bytes
            dep = replace(dep, nvme_gib=nvme_gib * ratios[DISK].ratio)
        report = plan(resolved.geometry, dep, curve, rates)
        check_engine_starts(report, dep, context)
        payload_disk_gib, codec = report.disk_gib or 0.0, None
        if DISK in ratios:
            codec = (ratios[DISK].codec or "", ratios[DISK].ratio)
            _compress_disk(report, ratios[DISK])
        given_gpu = (gpu or "").strip()  # an alias (A100: two memory sizes): say which part the budget assumes
        if found_gpu is not None and found_gpu.name.upper() != given_gpu.upper():
            parts = " or ".join(g.name for g in GPUS if g.name.upper().startswith(given_gpu.upper()))
            report.notes.append(f"--gpu {given_gpu} read as {found_gpu.name} ({found_gpu.memory_gib:g} GiB); give "
                                f"the exact part (--gpu {parts}) or --gpu-memory-gib if yours differs.")
        report.notes.extend([resolved.dtype_note] if resolved.dtype_note and kv_dtype == "auto" else [])
        report.notes.extend([resolved.weights_problem] if resolved.weights_problem and weights_gib is None else [])
        if chunk_tokens is not None and not 1 <= chunk_tokens <= MAX_CHUNK_TOKENS:  # the connector's bound
            raise UserError(f"--chunk-tokens must be from 1 to {MAX_CHUNK_TOKENS:,} (longer than any model's context), "
                            f"got {chunk_tokens:,}.")
        chunk, chunk_note = recipe_chunk_tokens(chunk_tokens, resolved.geometry.num_state_layers > 0)
        if offload_gib is not None and offload_gib < 0:
            raise UserError(f"--offload-gib must not be negative, got {offload_gib}.")
        redis_url, store, others, tier_notes = tier_recipes(tier_values, (
            chunk_tokens or DEFAULT_CHUNK_TOKENS) * report.kv_bytes_per_token)
        report.notes.extend(tier_notes)
        if not disk_path.startswith("/"):
            raise UserError(f"--disk-path must be an absolute directory on the serving host, got {disk_path!r}.")
    except UserError as exc:
        fail(str(exc))
    recipe, served, asked = None, _served_model(model), None
    said_rules: tuple[str, ...] = ()  # audit rules whose finding a note of size's own already states
    # the engine runs --kv-dtype fp8 only when told: without the flag its KV is the model's dtype, twice the bytes
    cache_dtype = (kv_dtype.strip().lower() if kv_dtype.strip().lower().startswith("fp8_") else "fp8") \
        if dtype == "fp8" else None
    nvme_usable = usable_nvme_gib(nvme_gib) if nvme_gib is not None else None  # LMCache's uncompressed disk
    if offload_gib is not None and offload_gib > 0:
        split = split_tier(offload_gib, host_ram_gib, dep.reserve_gib, tp, node_gib)
        # the NVMe the disk tier may take, in whole GiB a rank (×R with a codec): the connector refuses more
        disk_room = math.floor(usable_nvme_gib(dep.nvme_gib) / tp) * tp if dep.nvme_gib is not None else None
        if disk_room is not None and round_total(split.disk_gib, tp) > disk_room:
            zip_text = f", × the {ratios[DISK].ratio:g} compression ratio" if DISK in ratios else ""
            fail(f"--offload-gib {offload_gib:g} puts {round_total(split.disk_gib, tp):g} GiB on the disk tier (what "
                 f"the {split.cpu_gib:g} GiB cpu tier cannot hold), more than the {disk_room:g} GiB of chunks --nvme-gib "
                 f"{nvme_gib:g} may take (1/1.1 of it{zip_text}, whole GiB on each of {tp} rank(s)); give --offload-gib "
                 f"{split.cpu_gib + disk_room:g} or less, or a larger --nvme-gib.")
        if 0 < split.disk_gib <= split.cpu_gib:  # split's own note says so, with the cache's size: not twice
            said_rules = ("kvtier-disk-tier-not-above-cpu-tier",)
        _chosen_tier(report, offload_gib, split.cpu_gib, split.disk_gib)
        report.notes.extend(split.notes)
        asked = offload_gib
        recipe = build_recipe(served, tp, split.cpu_gib, split.disk_gib, disk_path, chunk, redis_url, store,
                              others, gpu_memory_utilization, hybrid=len(report.groups) > 1, disk_codec=codec,
                              nvme_usable_gib=nvme_usable, kv_cache_dtype=cache_dtype)
    elif report.offload_needed and report.offload_no_room is None:
        asked = (report.cpu_gib or 0.0) + (report.disk_gib or 0.0)
        recipe = build_recipe(served, tp, report.cpu_gib or 0.0, payload_disk_gib, disk_path, chunk, redis_url, store,
                              others, gpu_memory_utilization, report.cpu_staging, len(report.groups) > 1, codec,
                              nvme_usable, kv_cache_dtype=cache_dtype)
    if recipe is not None:
        if isinstance(chunk, int) and len(report.groups) <= 1:  # hybrid models: each group apart, not modelled
            # the audit's kvtier-cpu-tier-below-one-chunk in size's flags, also for a hub model (the audit
            # reads presets and local configs only); any other audit error is refused below
            _refuse_below_one_chunk(recipe.cpu_gib, tp, chunk * report.kv_bytes_per_token_per_rank, chunk, model,
                                    dep.dtype_bytes, offload_gib is not None)
        if served != model:
            report.notes.append(f"The configs serve {served}, the directory of --model {model}: vllm serve takes a "
                                "model's directory (or hub id), not its config.json.")
        total = recipe.cpu_gib + recipe.disk_gib
        if asked is not None and total > asked + 1e-9:  # the table's figures are exact, the configs' whole GiB
            per_rank = f" on each of {tp} ranks" if tp > 1 else ""
            report.notes.append(f"The configs give {recipe.cpu_gib:,} GiB (cpu tier) + {recipe.disk_gib:,} GiB (disk "
                                f"tier) = {total:,} GiB: the {asked:,.2f} GiB above rounded up to whole GiB{per_rank}.")
        report.notes.extend(chunk_notes(chunk) if isinstance(chunk, int) else [])
        report.notes.extend([chunk_note] if chunk_note else [])
        audited = recipe_audit(recipe, found_gpu.name if found_gpu is not None else None, said_rules)
        refused = refusal(audited)  # docs/size.md § Errors: no recipe the connector or audit would refuse
        if refused is not None:
            fail(refused)
        report.notes.extend(note.text for note in audited)
    elif offload_gib is not None:  # --offload-gib 0: the size chosen is no tier
        report.notes.append("--offload-gib 0 asks for no offload tier, so there is no config to print.")
    elif report.recommended_offload_gib is None:
        missing = [flag for flag, value in (("--context TOKENS (tokens per session)", context),
                                            ("--sessions N (sessions to keep warm)", sessions)) if value is None]
        missing = missing if trace is None else []
        if report.hbm_kv_budget_bytes is None:  # the flags that would give the HBM budget, as plan's note names them
            missing += [flag for flag, value in (("--gpu (or --gpu-memory-gib)", memory),
                                                 ("--weights-gib", weights)) if value is None]
        report.notes.append(f"No offload tier size: add {' and '.join(missing)} for the recommended tier and its "
                            "kvtier / vLLM / LMCache configs, or --offload-gib GIB for the configs of a size you chose.")
    if as_json:
        payload = report.to_json()
        payload["weights_note"] = note
        payload["weights_gib"] = weights
        payload["recipe"] = recipe.to_json() if recipe else None
        print(json.dumps(payload, indent=2))
    else:
        print_report(report, recipe, note, weights, chosen=offload_gib is not None and offload_gib > 0)


def _refuse_below_one_chunk(cpu_gib: float, tp: int, chunk_bytes: int, chunk_tokens: int, model: str,
                            dtype_bytes: int, chosen: bool) -> None:
    """Exit 2 (docs/size.md § Errors: no recipe for an engine that would not start) when the configs'
    cpu tier gives a rank less than one chunk (``chunk_bytes``, one rank's): the connector refuses it
    at start-up (``core/sizing.py`` ``cpu_capacity_bytes``), as the audit's
    ``kvtier-cpu-tier-below-one-chunk`` rule says."""
    from kvtier.core.config import GiB, KVTierConfig

    have = KVTierConfig.from_dict({"cpu_gib": cpu_gib}).cpu_bytes_per_rank(tp)
    if have >= chunk_bytes:
        return
    least = chunk_bytes * tp / GiB
    per_rank = f", {have:,} bytes a rank at TP {tp}" if tp > 1 else ""
    whose = "--offload-gib's" if chosen else "the recommended"
    fail(f"{whose} cpu tier (cpu_gib {cpu_gib:g}{per_rank}) is smaller than one {chunk_tokens:,}-token chunk of "
         f"{model} ({chunk_bytes:,} bytes a rank at {dtype_bytes}-byte KV), so the connector would refuse to start "
         f"(every chunk passes through the cpu tier); give --offload-gib of at least {math.ceil(least):,} (better room "
         "for hundreds of chunks) or a shorter --chunk-tokens (default 128).")


def _chosen_tier(report: SizeReport, offload_gib: float, cpu_gib: float, disk_gib: float) -> None:
    """``--offload-gib`` is the operator's choice: the report's tiers (table, JSON) become it, as the
    recipes do, and a note keeps the size the workload alone would need."""
    workload = report.recommended_offload_gib
    if workload is not None:
        needs = ("no offload tier" if not report.offload_needed else
                 "a tier, but the host leaves no room for one" if report.offload_no_room else f"{workload:,.2f} GiB")
        at = report.recommendation_notes_at
        report.notes.insert(len(report.notes) if at is None else at,
                            f"The tiers are the {offload_gib:,.2f} GiB --offload-gib chose; the workload alone "
                            f"would need {needs}" + (", recommended as the next notes say." if at is not None and
                                                     at < len(report.notes) else "."))
    report.recommended_offload_gib = round(offload_gib, 2)
    report.cpu_gib, report.disk_gib, report.cpu_staging = cpu_gib, disk_gib, False
    report.offload_no_room = None


def _compress_disk(report: SizeReport, ratio: CompressionRatio) -> None:
    """A compressing disk tier stores the planned disk payload in 1/R of its bytes: the disk tier
    (and the total) shrink by that, and a note says so with R's source."""
    from kvtier.size.compression import DISK

    note = ratio.describe(DISK)
    if report.disk_gib:
        stored = round(report.disk_gib / ratio.ratio, 2)
        note += f": the {report.disk_gib:,.2f} GiB of chunks take {stored:,.2f} GiB on disk"
        if report.recommended_offload_gib is not None:
            report.recommended_offload_gib = round(report.recommended_offload_gib - report.disk_gib + stored, 2)
        report.disk_gib = stored
    report.notes.append(note + f" (--nvme-gib holds R× its GiB of chunks): kvtier's recipe enables codecs "
                        f"{{disk: [{ratio.codec}]}}; LMCache's disk holds uncompressed chunks (no kvtier codec), at most what the NVMe holds.")


def _curve(trace: str, fmt: str, tokens_per_block: int | None) -> StackCurve:
    """The stack-distance curve of ``trace`` (``bundled``: the shipped Mooncake trace).

    Raises:
        TraceError: the trace cannot be read (a UserError: one sentence naming file and line).
    """
    from kvtier.simulate.hierarchy import stack_curve
    from kvtier.simulate.trace import read_trace, trace_path

    return stack_curve(read_trace(trace_path(trace), fmt, tokens_per_block))


def _served_model(model: str) -> str:
    """What ``vllm serve`` is given for ``model``: the directory of a config.json path (vLLM loads a
    model from its directory or hub id), else ``model`` itself."""
    import os

    if os.path.isfile(model):
        return os.path.dirname(model) or "."
    return model


def _tier_values(flags: list[ToolFlag], values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Tier -> the keys its flags gave, checked as the connector checks them (each tier's settings
    model); a tier's flags without its target are refused.

    Raises:
        UserError: a value the tier's settings refuse, one sentence naming the flag.
    """
    from kvtier.size.recipe import tier_problem

    refuse_stray(flags, values, "({target}) to add the {tier} tier to the recipe", "to size without it")
    out: dict[str, dict[str, Any]] = {}
    for tier, target in targets(flags).items():
        if not given(target, values.get(target.key)):
            continue
        mine = {f.key: values[f.key] for f in flags if f.tier == tier and given(f, values.get(f.key))}
        problem = tier_problem(tier, mine)
        if problem is not None:
            key, sentence = problem
            flag = "--" + key.replace("_", "-") if key in mine else target.flag
            message = flag_names(sentence, list(mine))
            raise UserError(f"{message}." if message.startswith(flag) else f"{flag}: {message}.")
        out[tier] = mine
    return out


def size_command(flags: list[ToolFlag]) -> Callable[..., None]:
    """The ``kvtier size`` command: its own options and, before ``--json``, one per tier flag in
    ``flags`` (the fields of the tiers' settings models marked for ``size``)."""

    def body(**values: Any) -> None:
        tiers = {f.key: values.pop(f.key) for f in flags}
        _size(flags, tiers, **values)

    options = {}
    hints = typing.get_type_hints(_size)
    for name, param in list(inspect.signature(_size).parameters.items())[2:]:
        if name == "as_json":
            options.update({f.key: option(f) for f in flags})
        options[name] = (hints[name], param.default)
    return build(body, options)


def register(app: typer.Typer) -> None:
    """Add ``kvtier size`` to the CLI."""
    app.command("size", help=HELP)(size_command(tool_flags("size")))
