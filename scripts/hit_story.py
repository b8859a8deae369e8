"""One disk-tier hit, profiled on every thread: which kvtier source files run, and how often
control moves from one of them to another (issue 33, "one hit reads like a short story").

Scenario: one vLLM engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler,
worker and kvtier's threads share it), the ``tiny`` test model (:mod:`kvtier.launch.testmodel`,
seeded random weights, float32, 128-token blocks), kvtier with 128-token chunks, a cpu tier of
``--cpu-chunks`` chunks (default 16) and a write-through disk tier in a fresh temporary directory
(``save_queue_depth`` 8: a prompt's chunks all queue; ``disk_io: buffered``: the same reads on every
filesystem, where ``auto`` picks by a timing probe), ``idle_step_wait_s: 1.0`` (the engine's
empty step waits for the load to end instead of returning after 5 ms, so the hit takes 2 engine
steps whatever the load on the machine, and the counts do not grow with empty steps), and
``disk_rescan_s: 0`` (no other engine writes the directory: without it the background rescan, every
2 s, ran inside the window now and then on a loaded host: 35 files, 399 moves).

A ``--prompt-tokens`` prompt (default 808: 6 whole chunks, 768 tokens, loadable) is computed
cold; once kvtier's dirty bytes are 0 (its chunks are on disk), other prompts of the same
length, twice the cpu tier's chunks in all (6 prompts, 36 chunks by default), push it out of
the cpu tier; once no chunk is pinned (no disk write in flight), ``reset_prefix_cache()`` makes
vLLM's own cache forget it.  The prompt is then sent again through ``LLMEngine.add_request`` and
``LLMEngine.step()``: a kvtier hit served from the disk tier (an asynchronous load: the request
waits in ``WAITING_FOR_REMOTE_KVS`` while the worker's loader threads read the chunks).  The hit
is checked from kvtier's counters in this process's Prometheus registry (what ``/metrics``
shows): ``kvtier_loaded_tokens_total{disk}`` and ``vllm:external_prefix_cache_hits_total`` rose
by every loadable token, ``kvtier_loaded_tokens_total{cpu}`` by none, and no chunk was rerouted
(read from another tier than planned), unfilled or failed; anything else exits 1 and says what
was seen.  What still varies from run to run, by a few moves: how often the loader polls (every
2 ms) for the chunks read ahead before they are all there.

What is profiled: from just before ``add_request`` of that request to the return of the
``step()`` that yields its first token (the window), every thread.  On Python ≥ 3.12 with
``threading.setprofile_all_threads``; on 3.11 (no such call) a profile function is installed
for every thread started after this script begins (``threading.setprofile``, before vLLM or any
other kvtier module is imported) and does nothing until the window opens, and the main thread
is added with ``sys.setprofile`` for the window.  Threads alive in the window that the profiler
cannot see (started before, or from C without ``threading``) are listed as
``threads_not_profiled``.

What is counted, per ``'call'`` profile event whose code object's file lies under the imported
``kvtier`` package's directory (a Python function, method, lambda or comprehension entered; a
generator or coroutine resumed also arrives as ``'call'``; C functions are not counted):

- ``files``: calls per kvtier source file (path relative to the package directory);
- ``kvtier_to_kvtier_calls``: calls whose caller frame (``frame.f_back``) is in a kvtier file
  too, the same file or another;
- ``moves``: the file-to-file moves, those of the above whose caller's file differs from the
  callee's (``moves_by_pair`` has them per ``caller -> callee``, ``moves_by_function`` per
  ``file:function -> file:function``);
- ``calls_by_function``: calls per ``file:function`` (where a file's calls come from);
- ``entry_calls``: calls into kvtier from a frame outside it (vLLM, threading, the standard
  library) or with no caller frame;
- ``threads``: kvtier calls per thread, for every thread that made at least one.

Usage::

    PYTHONPATH=src python scripts/hit_story.py [--json PATH] [--workdir DIR] [--prompt-tokens 808]
        [--cpu-chunks 16]

Prints the files (sorted, with their call counts), the moves, the threads and the hit's counters;
``--json`` writes all of them.  It measures whatever ``kvtier`` imports first on ``sys.path``: run
it from any worktree with that worktree's ``src`` on ``PYTHONPATH``.  Exit 0 on a measured disk
hit, 1 when the hit was not a disk hit, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

CHUNK_TOKENS = 128
BLOCK_TOKENS = 128
TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 64 * 4  # layers × K,V × KV heads × head size × fp32 (testmodel GEOMETRIES)
SAVE_QUEUE_DEPTH = 8  # disk writes queued at most (a prompt's 7 chunks fit); each pins a cpu page until written
METRICS_WAIT_S = 60.0


class ThreadCounts:
    """One thread's counts (each thread writes only its own: no lost updates between threads)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.files: Counter[str] = Counter()
        self.moves: Counter[tuple[str, str]] = Counter()
        self.functions: Counter[str] = Counter()  # "file:function" → calls
        self.function_moves: Counter[str] = Counter()  # "file:function -> file:function" → moves
        self.inner = 0  # kvtier → kvtier calls
        self.entries = 0  # calls into kvtier from outside it


class KvtierCallProfiler:
    """Counts ``'call'`` profile events in kvtier's source files on every thread while armed.

    Args:
        package_dir: the ``kvtier`` package's directory; files under it are kvtier's.
    """

    def __init__(self, package_dir: Path) -> None:
        self.prefix = str(package_dir.resolve()) + os.sep
        self.armed = False
        self.seen: set[int] = set()  # threads whose profile function ran at least once
        self.counts: dict[int, ThreadCounts] = {}
        self._rel: dict[str, str | None] = {}
        self.not_profiled: list[str] = []
        self.window_s = 0.0
        self._t0 = 0.0
        self._all_threads = hasattr(threading, "setprofile_all_threads")

    def _file(self, filename: str) -> str | None:
        rel = self._rel.get(filename, "")
        if rel == "":
            path = os.path.realpath(filename) if filename and not filename.startswith("<") else ""
            rel = Path(path[len(self.prefix):]).as_posix() if path.startswith(self.prefix) else None
            self._rel[filename] = rel
        return rel

    def _event(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.armed:
            self.seen.add(threading.get_ident())
            return
        if event != "call":
            return
        callee = self._file(frame.f_code.co_filename)
        if callee is None:
            return
        ident = threading.get_ident()
        counts = self.counts.get(ident)
        if counts is None:
            counts = self.counts[ident] = ThreadCounts(threading.current_thread().name)
        counts.files[callee] += 1
        code = frame.f_code
        counts.functions[f"{callee}:{code.co_name}"] += 1
        caller_frame = frame.f_back
        caller = self._file(caller_frame.f_code.co_filename) if caller_frame is not None else None
        if caller is None:
            counts.entries += 1
            return
        counts.inner += 1
        if caller != callee:
            counts.moves[(caller, callee)] += 1
            counts.function_moves[f"{caller}:{caller_frame.f_code.co_name} -> {callee}:{code.co_name}"] += 1

    def install(self) -> None:
        """Before any thread the engine starts (3.11: threads started later carry the profile function)."""
        if not self._all_threads:
            threading.setprofile(self._event)

    def arm(self) -> None:
        main = threading.get_ident()
        if self._all_threads:
            threading.setprofile_all_threads(self._event)  # type: ignore[attr-defined]
        else:
            names = {t.ident: t.name for t in threading.enumerate()}
            self.not_profiled = sorted(names.get(i, f"thread {i}") for i in sys._current_frames()
                                       if i != main and i not in self.seen)
        self._t0 = time.perf_counter()
        self.armed = True
        if not self._all_threads:
            sys.setprofile(self._event)

    def disarm(self) -> None:
        self.armed = False
        self.window_s = time.perf_counter() - self._t0
        if self._all_threads:
            threading.setprofile_all_threads(None)  # type: ignore[attr-defined]
        else:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]

    def report(self) -> dict[str, Any]:
        files: Counter[str] = Counter()
        moves: Counter[tuple[str, str]] = Counter()
        functions: Counter[str] = Counter()
        function_moves: Counter[str] = Counter()
        for c in self.counts.values():
            files.update(c.files)
            moves.update(c.moves)
            functions.update(c.functions)
            function_moves.update(c.function_moves)
        threads = {f"{c.name} ({ident})": sum(c.files.values()) for ident, c in self.counts.items()}
        return {"files": dict(sorted(files.items())), "num_files": len(files),
                "kvtier_calls": sum(files.values()),
                "kvtier_to_kvtier_calls": sum(c.inner for c in self.counts.values()),
                "moves": sum(moves.values()),
                "moves_by_pair": {f"{a} -> {b}": n for (a, b), n in sorted(moves.items())},
                "calls_by_function": dict(functions.most_common()),
                "moves_by_function": dict(function_moves.most_common()),
                "entry_calls": sum(c.entries for c in self.counts.values()),
                "threads": threads, "num_threads": len(threads), "threads_not_profiled": self.not_profiled,
                "window_s": self.window_s,
                "profiler": "threading.setprofile_all_threads" if self._all_threads
                else "threading.setprofile before the engine + sys.setprofile on the main thread"}


def metrics() -> dict[str, float]:
    """``kvtier_*`` and ``vllm:*prefix_cache*`` samples of this process's registry, ``name{label}``."""
    import prometheus_client

    out: dict[str, float] = {}
    for family in prometheus_client.REGISTRY.collect():
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            if sample.name.startswith("kvtier_") or "prefix_cache" in sample.name:
                label = sample.labels.get("tier") or sample.labels.get("source") or ""
                name = sample.name + (f"{{{label}}}" if label else "")
                out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def git_commit(package_dir: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(package_dir), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


def measure(args: argparse.Namespace, workdir: Path, profiler: KvtierCallProfiler) -> dict[str, Any]:
    """Build the engine, make the prompt a disk-only hit, profile it; the report and the hit's counters."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from kvtier.launch.testmodel import write_model

    model = write_model(workdir / "tiny", "tiny", weights="random", seed=0)
    chunk_bytes = CHUNK_TOKENS * TINY_KV_BYTES_PER_TOKEN
    disk = Path(tempfile.mkdtemp(prefix="kvtier-disk-", dir=workdir))
    kvtier = {"chunk_tokens": CHUNK_TOKENS, "cpu_gib": args.cpu_chunks * chunk_bytes / (1 << 30),
              "disk_path": str(disk), "disk_gib": 0.05, "write_mode": "write-through",
              "save_queue_depth": SAVE_QUEUE_DEPTH, "disk_io": "buffered", "idle_step_wait_s": 1.0,
              "disk_rescan_s": 0}  # one engine owns the directory: no rescan thread (every 2 s) lands in the window
    llm = LLM(model=str(model), dtype="float32", max_model_len=args.prompt_tokens + 64, enforce_eager=True,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20, block_size=BLOCK_TOKENS,
              num_gpu_blocks_override=32, enable_prefix_caching=True, disable_log_stats=False, seed=0,
              kv_transfer_config={"kv_connector": "KVTierConnector",
                                  "kv_connector_module_path": "kvtier.integrations.vllm",
                                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                                  "kv_connector_extra_config": kvtier})
    try:
        return profiled_hit(args, llm, model / "tokenizer.json", profiler) | {"connector_file": connector_file()}
    finally:
        llm.llm_engine.engine_core.shutdown()


def profiled_hit(args: argparse.Namespace, llm: Any, tokenizer: Path, profiler: KvtierCallProfiler) -> dict[str, Any]:
    """Make the prompt a disk-only hit, send it profiled; the hit's counters (deltas over the request)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from kvtier.launch.testmodel import random_prompt_ids

    engine = llm.llm_engine
    quiet = SamplingParams(max_tokens=1, temperature=0.0)
    target = random_prompt_ids(tokenizer, args.prompt_tokens, seed=1)
    loadable = (args.prompt_tokens - 1) // CHUNK_TOKENS * CHUNK_TOKENS  # vLLM computes at least the last token

    def run(ids: list[int]) -> None:
        llm.generate([{"prompt_token_ids": ids}], quiet, use_tqdm=False)

    def settle(what: str) -> None:
        """Step (tiny requests: below one chunk, they neither hit nor save) until no sample named
        ``what`` is above 0 (the gauges arrive with engine steps)."""
        deadline = time.monotonic() + METRICS_WAIT_S
        while True:
            run([5, 6, 7])
            busy = {k: v for k, v in metrics().items() if k.startswith(what) and v > 0}
            if not busy:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"hit_story.py: kvtier still showed {busy} after {METRICS_WAIT_S:.0f} s")
            time.sleep(0.1)

    run(target)
    settle("kvtier_dirty_bytes")  # the prompt's chunks are on disk
    for seed in range(2, 2 + other_prompts(args)):
        run(random_prompt_ids(tokenizer, args.prompt_tokens, seed=seed))
    settle("kvtier_pinned_chunks")  # no disk write in flight
    # vLLM frees a finished request's blocks only once the worker reports its save done (a step
    # later): until then reset_prefix_cache() refuses ("some blocks are not freed yet").
    deadline = time.monotonic() + METRICS_WAIT_S
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            raise SystemExit(f"hit_story.py: vLLM still refused reset_prefix_cache after {METRICS_WAIT_S:.0f} s "
                             "(blocks of a finished request not freed)")
        run([5, 6, 7])
        time.sleep(0.1)
    before = metrics()
    params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.DELTA)

    steps = 0
    profiler.arm()
    try:
        engine.add_request("story", {"prompt_token_ids": target}, params)
        first = False
        while not first:
            steps += 1
            for out in engine.step():
                if out.request_id == "story" and out.outputs and out.outputs[0].token_ids:
                    first = True
            if not first and not engine.has_unfinished_requests():
                break
    finally:
        profiler.disarm()
    if not first:
        raise SystemExit("hit_story.py: the profiled request ended without a token")
    while engine.has_unfinished_requests():
        engine.step()

    names = ("kvtier_dropped_saves_total", "kvtier_loaded_tokens_total{disk}", "kvtier_loaded_tokens_total{cpu}",
             "kvtier_unfilled_tokens_total{disk}", "kvtier_unfilled_tokens_total{cpu}",
             "kvtier_rerouted_chunks_total", "kvtier_load_failed_blocks_total",
             "vllm:external_prefix_cache_hits_total")
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:  # the workers' stats reach the registry with engine steps
        after = metrics()
        hit = {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}
        if hit["kvtier_loaded_tokens_total{disk}"] + hit["kvtier_loaded_tokens_total{cpu}"] >= loadable or \
                time.monotonic() > deadline:
            break
        time.sleep(0.1)
        run([5, 6, 7])
    hit["loadable_tokens"] = loadable
    hit["engine_steps"] = steps  # in the window: the one returning the first token included
    expected = {"kvtier_loaded_tokens_total{disk}": loadable, "kvtier_loaded_tokens_total{cpu}": 0,
                "kvtier_unfilled_tokens_total{disk}": 0, "kvtier_unfilled_tokens_total{cpu}": 0,
                "kvtier_rerouted_chunks_total": 0, "kvtier_load_failed_blocks_total": 0,
                "vllm:external_prefix_cache_hits_total": loadable}
    hit["disk_hit"] = all(hit[k] == v for k, v in expected.items())
    return hit


def connector_file() -> str:
    """The file of the class named by ``kv_connector`` (``KVTierConnector``), relative to the package."""
    import kvtier
    from kvtier.integrations.vllm import KVTierConnector

    source = inspect.getsourcefile(KVTierConnector) or ""
    return Path(source).resolve().relative_to(Path(kvtier.__file__).resolve().parent).as_posix()


def other_prompts(args: argparse.Namespace) -> int:
    """Prompts of the same length sent after the profiled one's: twice the cpu tier's chunks."""
    return -(-2 * args.cpu_chunks // (args.prompt_tokens // CHUNK_TOKENS))


def print_report(result: dict[str, Any]) -> None:
    print(f"kvtier {result['kvtier_dir']} (commit {result['commit']}), Python {result['python']}")
    hit = result["hit"]
    print(f"hit: {hit['kvtier_loaded_tokens_total{disk}']:.0f} tokens loaded from disk, "
          f"{hit['kvtier_loaded_tokens_total{cpu}']:.0f} from cpu, of {hit['loadable_tokens']} loadable; "
          f"window {result['window_s'] * 1e3:.0f} ms (profiled), {hit['engine_steps']} engine steps")
    print(f"\n{result['num_files']} kvtier source files ran ({result['kvtier_calls']} calls):")
    for name, calls in result["files"].items():
        print(f"  {calls:7d}  {name}")
    print(f"\nfile-to-file moves: {result['moves']} (kvtier → kvtier calls: {result['kvtier_to_kvtier_calls']}; "
          f"calls into kvtier from outside it: {result['entry_calls']})")
    print(f"threads that ran kvtier code: {result['num_threads']}")
    for name, calls in sorted(result["threads"].items(), key=lambda kv: -kv[1]):
        print(f"  {calls:7d}  {name}")
    if result["threads_not_profiled"]:
        print(f"threads alive but not profiled: {', '.join(result['threads_not_profiled'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the whole result here")
    parser.add_argument("--workdir", type=Path, help="model and disk tier directory (default: a temporary one)")
    parser.add_argument("--prompt-tokens", type=int, default=6 * CHUNK_TOKENS + 40)
    parser.add_argument("--cpu-chunks", type=int, default=16, help="cpu tier size in chunks")
    args = parser.parse_args()
    longest = -(-(args.prompt_tokens + 64) // CHUNK_TOKENS)  # max_model_len in chunks
    if not CHUNK_TOKENS + 1 <= args.prompt_tokens <= 3968 or not longest + SAVE_QUEUE_DEPTH <= args.cpu_chunks <= 256:
        print(f"hit_story.py: --prompt-tokens takes {CHUNK_TOKENS + 1} to 3968, and --cpu-chunks from "
              f"{longest + SAVE_QUEUE_DEPTH} (one longest prompt plus the {SAVE_QUEUE_DEPTH} queued disk writes) "
              "to 256", file=sys.stderr)
        return 2
    spec = importlib.util.find_spec("kvtier")
    if spec is None or not spec.submodule_search_locations:
        print("hit_story.py: kvtier is not importable; run with PYTHONPATH=<worktree>/src", file=sys.stderr)
        return 2
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    profiler = KvtierCallProfiler(package_dir)
    profiler.install()  # before vLLM and the engine start any thread
    with tempfile.TemporaryDirectory(prefix="hit-story-") as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        hit = measure(args, workdir, profiler)
    result = {"kvtier_dir": str(package_dir), "commit": git_commit(package_dir), "python": sys.version.split()[0],
              "prompt_tokens": args.prompt_tokens, "chunk_tokens": CHUNK_TOKENS, "cpu_chunks": args.cpu_chunks,
              "connector_file": hit.pop("connector_file"), **profiler.report(), "hit": hit}
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if not hit["disk_hit"]:
        print(f"hit_story.py: the profiled request was not a whole disk-tier hit: {hit}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
