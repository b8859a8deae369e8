"""Inter-token gaps of running streams while a request whose long prefix sits only on disk is admitted.

Scenario (issue 9): three requests stream long outputs; a fourth, whose 6,000-token prefix is
held only by kvtier's disk tier (the page cache of its chunk files dropped with
``posix_fadvise(DONTNEED)``), is admitted meanwhile.  With loads off the scheduler's step the
streams' largest inter-token gap during that admission should stay within 3× their median gap.

How the gaps are measured: in one vLLM engine run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker and kvtier's loader threads in one
process, so a loader thread competes with the engine for the same interpreter and cores), driven
step by step with ``LLMEngine.step()``.  Every step gives each running stream exactly one token
(output kind DELTA), so a stream's per-token timestamps are the return times of the steps that
produced its tokens; nothing batches or coalesces them.  (Timing SSE events at an HTTP client
does not measure per-token gaps on this machine: the API server hands several tokens to the
client at once, median client-side gap 0.01 ms.)  The scheduler's output is recorded for every
step (tokens scheduled per request, the fourth request's status), so the table can say which
step was the longest and what it computed.

Steps: write the ``small8`` test model (8 layers, float32: 8 KiB of KV per token).  A first
engine (a child process) computes ``--repeats`` prefixes once (write-through: they reach the disk
tier) and stops gracefully; the chunk files' pages are dropped from the page cache.  A fresh
engine (this process: empty cpu tier, empty engine cache) is warmed up (a short prompt, a cold
unrelated long prompt, and that prompt again with a new tail: every kernel shape used below has
run once), then for each repeat:

- **disk**: three streams decode; after ``--settle-steps`` steps a fourth request = prefix +
  8 new tokens arrives; kvtier loads the 46 whole chunks (5,888 tokens) from disk while the
  streams keep decoding; vLLM then computes the 120-token tail.
- **reference** (same engine, next): three new streams; the same prefix + another 8 tokens, now a
  hit in vLLM's own prefix cache (no kvtier load at all; the same 120-token tail is computed).

A gap is "during the admission" when it ends between the fourth request's arrival and 5 steps
after its first token; the median gap is over the streams' other gaps (``--settle-steps``
before, up to ``--after-steps`` after; the first 3 decode gaps of each stream left out).
Both arms run in the same engine, so engine options (``--max-num-batched-tokens``,
``--long-prefill-token-threshold``, which bound the tail's prefill step) apply to both alike.

Usage::

    python scripts/itl_gap.py --workdir /tmp/itl [--prefix-tokens 6000] [--repeats 2]
        [--max-num-batched-tokens N] [--long-prefill-token-threshold 0,32]

Each ``--long-prefill-token-threshold`` value gets its own fresh engine (and its own prefixes,
on disk only).  Prints a table per value (WORKDIR/itl_gap.json has everything): per arm and
repeat, median and largest gap, their ratio, the fourth request's TTFT, the steps of the
admission, kvtier's loads; ``os.getloadavg()`` before and after.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.launch.testmodel import random_prompt_ids

STREAMS = 3
STREAM_PROMPT_TOKENS = 64
SUFFIX_TOKENS = 8
WINDOW_AFTER_STEPS = 5  # the admission's window ends this many stream tokens after the fourth's first token


def drop_page_cache(directory: Path) -> int:
    """``posix_fadvise(DONTNEED)`` every file under ``directory`` (after ``sync``); files touched."""
    os.sync()
    count = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            finally:
                os.close(fd)
    return count


def make_llm(args: argparse.Namespace, model: Path, disk: Path) -> Any:
    from vllm import LLM

    kvtier = {"cpu_gib": 0.25, "disk_path": str(disk), "disk_gib": 1.0, "write_mode": "write-through"}
    transfer = {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": kvtier}
    extra: dict[str, Any] = {}
    if args.max_num_batched_tokens:
        extra["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.threshold:
        extra["long_prefill_token_threshold"] = args.threshold
    return LLM(model=str(model), dtype="float32", max_model_len=8192, enforce_eager=True, gpu_memory_utilization=0.1,
               kv_cache_memory_bytes=512 << 20, enable_prefix_caching=True, seed=0, kv_transfer_config=transfer,
               **extra)


def prefixes(args: argparse.Namespace, tokenizer: Path, setting: int | None = None) -> list[list[int]]:
    """Every prefix (``setting`` None: for the first engine to compute) or one setting's ``repeats``
    (each measuring engine gets prefixes no other engine has loaded: on disk only)."""
    settings = range(len(args.thresholds)) if setting is None else [setting]
    return [random_prompt_ids(tokenizer, args.prefix_tokens, seed=7 + 100 * k + r) for k in settings for r in range(args.repeats)]


def compute_prefixes(args: argparse.Namespace, model: Path, disk: Path) -> None:
    """Child process: compute every prefix once (saved to cpu and, write-through, to disk), stop."""
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    llm = make_llm(args, model, disk)
    for prefix in prefixes(args, model / "tokenizer.json"):
        llm.generate([{"prompt_token_ids": prefix}], SamplingParams(max_tokens=1), use_tqdm=False)
    get_kv_transfer_group().worker_side.store.flush()
    llm.llm_engine.engine_core.shutdown()


class StepLog:
    """Wraps the scheduler's ``schedule``: per step, its start time and tokens scheduled per request."""

    def __init__(self, scheduler: Any) -> None:
        self.steps: list[dict[str, Any]] = []
        self._scheduler = scheduler
        self._schedule = scheduler.schedule
        scheduler.schedule = self._wrapped

    def _wrapped(self, *a: Any, **k: Any) -> Any:
        start = time.perf_counter()
        out = self._schedule(*a, **k)
        waiting = {rid: r.status.name for rid, r in self._scheduler.requests.items() if r.status.name.startswith("WAIT")}
        self.steps.append({"start": start, "scheduled": dict(out.num_scheduled_tokens), "waiting": waiting})
        return out


def admit_during_streams(args: argparse.Namespace, llm: Any, steps: StepLog, tokenizer: Path, prompt: list[int],
                         tag: str, seed: int) -> dict[str, Any]:
    """Three streams decode; ``prompt`` arrives after ``settle_steps`` steps; the streams' gaps around it."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    stream_params = SamplingParams(max_tokens=8192 - STREAM_PROMPT_TOKENS - 8, temperature=0.0, ignore_eos=True,
                                   output_kind=RequestOutputKind.DELTA)
    stream_ids = [f"{tag}-stream{i}" for i in range(STREAMS)]
    for i, rid in enumerate(stream_ids):
        engine.add_request(rid, {"prompt_token_ids": random_prompt_ids(tokenizer, STREAM_PROMPT_TOKENS, seed + i)},
                           stream_params)
    fourth = f"{tag}-fourth"
    times: dict[str, list[float]] = {rid: [] for rid in stream_ids}
    first_step = len(steps.steps)
    arrived = first_token = None
    step = after = 0
    while after < args.after_steps:
        if step == args.settle_steps:
            arrived = time.perf_counter()
            engine.add_request(fourth, {"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.DELTA))
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id in times and out.outputs and out.outputs[0].token_ids:
                times[out.request_id].extend([now] * len(out.outputs[0].token_ids))
            elif out.request_id == fourth and first_token is None:
                first_token = now
        step += 1
        if first_token is not None:
            after += 1
        if step > args.settle_steps + 20000:
            raise RuntimeError("the fourth request produced no token in 20,000 steps")
    engine.abort_request(stream_ids)
    while engine.has_unfinished_requests():
        engine.step()
    assert arrived is not None and first_token is not None
    gaps: list[tuple[float, float]] = []  # (end time, gap seconds) over every stream
    for ts in times.values():
        if any(b - a == 0 for a, b in itertools.pairwise(ts)):
            raise RuntimeError("a stream got two tokens in one step; per-token gaps would be wrong")
        gaps.extend((b, b - a) for a, b in list(itertools.pairwise(ts))[3:])  # skip the first decode steps
    after_first = sorted({end for end, _g in gaps if end > first_token})
    window_end = after_first[min(WINDOW_AFTER_STEPS, len(after_first)) - 1] if after_first else first_token
    during = [g for end, g in gaps if arrived < end <= window_end]
    other = [g for end, g in gaps if not arrived < end <= window_end]
    median, worst = statistics.median(other), max(during)
    # the steps of the admission: from the fourth request's arrival to its first token
    admission = [s for s in steps.steps[first_step:] if arrived <= s["start"] <= first_token]

    def of_fourth(ids: dict[str, Any]) -> Any:  # vLLM appends a suffix to the request id internally
        return next((v for k, v in ids.items() if k == fourth or k.startswith(fourth + "-")), None)

    nxt = steps.steps[first_step:]
    durations = {id(s): (b["start"] - s["start"]) for s, b in itertools.pairwise(nxt)}
    longest = max(admission, key=lambda s: durations.get(id(s), 0.0))
    return {
        "median_gap_ms": round(median * 1e3, 2),
        "max_gap_during_admission_ms": round(worst * 1e3, 2),
        "ratio": round(worst / median, 2),
        "fourth_ttft_s": round(first_token - arrived, 3),
        "admission_steps": len(admission),
        "steps_waiting_for_kvtier": sum(1 for s in admission if of_fourth(s["waiting"]) == "WAITING_FOR_REMOTE_KVS"),
        "fourth_tokens_per_step": [n for s in admission if (n := of_fourth(s["scheduled"])) is not None],
        "longest_step_ms": round(durations.get(id(longest), 0.0) * 1e3, 2),
        "longest_step_tokens": sum(longest["scheduled"].values()),
        "gaps_during_admission": len(during),
        "admission_steps_ms_tokens": [(round(durations.get(id(s), 0.0) * 1e3, 1), sum(s["scheduled"].values()))
                                      for s in admission],  # every step from arrival to first token
    }


def measure(args: argparse.Namespace, model: Path, disk: Path) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    tokenizer = model / "tokenizer.json"
    llm = make_llm(args, model, disk)
    store = get_kv_transfer_group().worker_side.store
    steps = StepLog(llm.llm_engine.engine_core.engine_core.scheduler)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    warm = random_prompt_ids(tokenizer, args.prefix_tokens, seed=1000)
    for prompt in (random_prompt_ids(tokenizer, 16, seed=99), warm, warm + random_prompt_ids(tokenizer, SUFFIX_TOKENS, seed=1001)):
        llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    results: list[dict[str, Any]] = []
    for r, prefix in enumerate(prefixes(args, tokenizer, args.setting)):
        for arm, suffix_seed in (("disk", 8), ("reference", 9)):
            before = store.stats()
            row = admit_during_streams(args, llm, steps, tokenizer,
                                       prefix + random_prompt_ids(tokenizer, SUFFIX_TOKENS, seed=suffix_seed + 100 * r),
                                       f"r{r}-{arm}", seed=20 + 10 * len(results))
            after = store.stats()
            row["kvtier_loaded_tokens"] = {t: n - before.loaded_tokens.get(t, 0) for t, n in after.loaded_tokens.items()
                                           if n != before.loaded_tokens.get(t, 0)}
            row["kvtier_disk_read_s"] = round(after.transfer_seconds.get("disk_to_cpu", 0.0)
                                              - before.transfer_seconds.get("disk_to_cpu", 0.0), 3)
            row["kvtier_load_s"] = round(after.transfer_seconds.get("cpu_to_engine", 0.0)
                                         - before.transfer_seconds.get("cpu_to_engine", 0.0), 3)
            results.append({"repeat": r, "arm": arm, **row})
    llm.llm_engine.engine_core.shutdown()
    return {"runs": results}


def table(out: dict[str, Any]) -> str:
    lines = [("| repeat | fourth request's prefix | kvtier loaded | median gap | max gap in admission | max / median "
              "| fourth TTFT | steps waiting for the load | tail tokens per step | longest step |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in out["runs"]:
        where = "on disk only" if row["arm"] == "disk" else "reference: in vLLM's prefix cache"
        loaded = ", ".join(f"{n:,} {t}" for t, n in row["kvtier_loaded_tokens"].items()) or "—"
        lines.append(f"| {row['repeat']} | {where} | {loaded} | {row['median_gap_ms']} ms "
                     f"| {row['max_gap_during_admission_ms']} ms | **{row['ratio']}×** | {row['fourth_ttft_s']} s "
                     f"| {row['steps_waiting_for_kvtier']} | {row['fourth_tokens_per_step']} "
                     f"| {row['longest_step_ms']} ms ({row['longest_step_tokens']} tokens) |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--prefix-tokens", type=int, default=6000)
    parser.add_argument("--repeats", type=int, default=2, help="disk/reference pairs, interleaved")
    parser.add_argument("--settle-steps", type=int, default=60, help="stream steps before the fourth request")
    parser.add_argument("--after-steps", type=int, default=60, help="stream steps after its first token")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="vLLM's tokens per step, for every engine (default: vLLM's)")
    parser.add_argument("--long-prefill-token-threshold", default="0",
                        help="comma-separated vLLM long_prefill_token_threshold values, one fresh engine each "
                             "(0 = vLLM's default, no limit), e.g. 0,32")
    parser.add_argument("--phase", choices=["all", "prefixes", "measure"], default="all", help=argparse.SUPPRESS)
    parser.add_argument("--setting", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    try:
        args.thresholds = [int(v) for v in args.long_prefill_token_threshold.split(",")]
    except ValueError:
        parser.error("--long-prefill-token-threshold takes comma-separated integers, e.g. 0,32")
    if args.prefix_tokens + SUFFIX_TOKENS >= 8192 or args.repeats < 1 or min(args.thresholds) < 0:
        parser.error("--prefix-tokens must be below 8184 (the model's context), --repeats at least 1, "
                     "thresholds 0 or more")
    args.threshold = args.thresholds[args.setting]

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the same cores with and without a connector
    from kvtier.launch.testmodel import write_model

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "small8", "small8", weights="random", seed=0)
    disk = work / "disk"
    if args.phase == "prefixes":
        compute_prefixes(args, model, disk)
        return 0
    if args.phase == "measure":
        out = measure(args, model, disk)
        (work / f"setting{args.setting}.json").write_text(json.dumps(out))
        return 0
    shutil.rmtree(disk, ignore_errors=True)

    def child(phase: str, setting: int = 0) -> None:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--phase", phase, "--setting", str(setting)]
        with open(work / f"{phase}{setting}.log", "wb") as log:
            rc = subprocess.run(cmd, check=False, stdout=log, stderr=subprocess.STDOUT, timeout=3600).returncode
        if rc != 0:
            raise SystemExit(f"the {phase} engine failed (exit {rc}); see {work / f'{phase}{setting}.log'}")

    child("prefixes")
    dropped = drop_page_cache(disk)
    results = []
    for k, threshold in enumerate(args.thresholds):  # a fresh engine each: its prefixes are on disk only
        load_before = os.getloadavg()
        child("measure", k)
        out = json.loads((work / f"setting{k}.json").read_text())
        out.update({"long_prefill_token_threshold": threshold, "max_num_batched_tokens": args.max_num_batched_tokens,
                    "load_average_before": load_before, "load_average_after": os.getloadavg()})
        results.append(out)
        print(f"\nlong_prefill_token_threshold={threshold or 'vLLM default (none)'}, "
              f"max_num_batched_tokens={args.max_num_batched_tokens or 'vLLM default'}; load average "
              f"{' / '.join(f'{v:.2f}' for v in load_before)} before, "
              f"{' / '.join(f'{v:.2f}' for v in out['load_average_after'])} after", flush=True)
        print(table(out), flush=True)
    summary = {"prefix_tokens": args.prefix_tokens, "page_cache_dropped_files": dropped, "settings": results}
    (work / "itl_gap.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
