"""Full-hit TTFT, end to end and broken down: kvtier (synchronous and asynchronous loads) vs vLLM's native offload.

Scenario (issue 23 item 1): a ``--prompt-tokens`` prompt (default 4,000) on the 24-layer ``mid``
geometry (dummy weights, bf16: 12 KiB of KV per token) is computed once, then resent
``--warmup + --repeats`` times, each after ``reset_prefix_cache()`` (vLLM's own cache forgets;
the connector's CPU tier keeps it; the reset is retried, stepping a 3-token request, while a
deferred save still holds blocks): every resend is a full hit of the connector (all whole
128-token blocks/chunks; vLLM computes the rest, at least the last token).

How it is timed: each arm is one vLLM engine run in a child process with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (scheduler, worker and the connector's threads in one
process, one clock: ``time.perf_counter``), driven step by step with ``LLMEngine.step()``.  The
script wraps, on the live objects, without changing them:

- the scheduler's ``schedule`` (each step's start and end, tokens scheduled for the request, its
  status: ``WAITING_FOR_REMOTE_KVS`` means parked for an asynchronous load);
- the scheduler-side connector's ``get_num_new_matched_tokens`` (the lookup);
- the worker-side connector's ``start_load_kv`` and ``get_finished`` (load shipped / reported);
- the executor's ``execute_model`` + ``sample_tokens`` (the forward of each step);
- the copy into the engine's blocks: kvtier's ``loader.load_pages`` and its store's
  ``prepare_load`` (pins; reads and verifies only what is below the cpu tier), the native shim's
  ``host_swap_blocks_batch`` (:mod:`kvtier.bench.native_cpu`).

A third table splits the loads (:func:`detail`, perf_counter only: the process CPU clock sums every
thread's time and costs more than the spans): the loader thread's start after shipping and the report
after its end, and the spans inside a load (the loader's job, the index's plan with a node tier's
scatters, the guard's call and the pin, the scatters' runs and the early copies made while the pin
is in flight, each chunk's copy-and-digest, the generation check); with
``FULL_HIT_PROFILE=PATH`` each loader thread's job also runs under cProfile (``PATH.<pid>``), and so do
the engine thread's ``start_load_kv`` (a synchronous load: ``PATH.start_load_kv.<pid>``) and the lookup
(``PATH.lookup.<pid>``), each summed over every call, warm-up included.  With ``FULL_HIT_THREADS=1`` a
fourth table says what ran on the CPUs during each tail forward (:class:`ThreadProbe`): the forward's
own threads, the process's other threads (kvtier's among them), the other arms' engines, the rest
(its reads of ``/proc`` run between the timed spans but inside TTFT: compare TTFTs with it off).

kvtier's own time (issue 33's "the hit path costs what its copy costs") is the lookup plus the
load beyond its copy (``load shipped → done`` − ``copy``), per hit and per chunk, in a second
table, with the scheduler's ``update_state_after_alloc`` + ``build_connector_meta`` and the tail
step's save beside it.  ``prepare_load`` runs inside the load's span (in ``start_load_kv`` for a
synchronous load, on a loader thread for an asynchronous one), so it is not added again (the
tables in docs/benchmarks.md before 2026-12-05 13:00 UTC added it: 0.07–0.14 ms per hit too much).

Per full hit it reports: TTFT (``add_request`` → the step that returns the first token), the
engine steps from admission to the tail's forward, the lookup, the load (shipped → reported
finished, or the synchronous copy), the copy itself, the tail's forward, and the rest (TTFT
minus copy minus tail forward: what is neither); for an asynchronous load also the engine steps
that scheduled nothing while it ran and the process CPU seconds over it (``time.process_time``:
every thread; counts that do not depend on how loaded the machine is).

Arms: ``kvtier`` (default ``sync_load_max_bytes``: cpu-tier hits copied before the forward of
the step that schedules them), ``kvtier-async`` (``sync_load_max_bytes: 0``: the asynchronous
path), ``kvtier-async-spin`` (the same with ``idle_step_wait_s: 0``: the engine steps empty as fast
as it can while the load runs, as before that field), ``native`` (vLLM's ``OffloadingConnector``
via kvtier's benchmark-only CPU shim), ``kvtier-node`` (the ``kvtier`` arm plus the ``node`` tier on
a ``kvtier node serve`` owner this script starts, with ``reset_scope: cpu``: before each hit the
connector's cpu tier is cleared as well, ``reset_prefix_cache(reset_connector=True)``, so the hit
is loaded from the node pool, synchronously as a cpu-tier hit is; its load against the ``kvtier``
arm's, paired per repeat, is issue 38's "a load from the node tier against one from the engine's own
cpu tier"), ``kvtier-node-async`` (the same with ``sync_shared_loads: false``: node-tier hits load
asynchronously; against ``kvtier-async``).  Every
arm's engine stays up in its own child process (started one after another, each computing the
prompt cold and running ``--warmup`` untimed hits); then the timed hits run interleaved, one
request at a time, arm order rotated each repeat, so a load change on the shared machine hits
every arm alike; ratios are medians within the run.  ``--start-order both`` (the default) runs the
first half of the repeats (rounded up) with the engines started in ``--arms`` order, then stops them and
starts them again in reverse order for the rest: on the EPYC-2 host the engine started first computed
the same tail forward 1-9 % slower and copied 0-21 % slower whichever arm it was (docs/benchmarks.md,
"Full hits of 1,000, 4,000 and 8,000 tokens"), so one order alone biases every arm-to-arm ratio.  Each
hit records its engine's start position (``started``: 0 = first) in ``full_hit.json``.

Usage::

    python scripts/full_hit.py --workdir /tmp/fullhit [--prompt-tokens 4000] [--repeats 5] [--warmup 2]
        [--arms kvtier,native,kvtier-async,kvtier-async-spin]

Prints one table (WORKDIR/full_hit.json has every request's timings) and the load average
before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.launch.testmodel import random_prompt_ids

ARMS = ("kvtier", "kvtier-async", "kvtier-async-spin", "kvtier-node", "kvtier-node-async", "native")
CPU_GIB = 0.25
CHUNK_TOKENS = 128  # kvtier's default chunk_tokens with vLLM's CPU block size: per-chunk figures


def transfer_config(arm: str, node_socket: str | None = None) -> dict[str, Any]:
    if arm == "native":
        from kvtier.bench.arms import native_arm

        config = dict(native_arm(CPU_GIB).kv_transfer_config or {})
        config["kv_load_failure_policy"] = "recompute"
        return config
    extra: dict[str, Any] = {"cpu_gib": CPU_GIB}
    if arm.startswith("kvtier-async"):
        extra["sync_load_max_bytes"] = 0
    if arm == "kvtier-async-spin":
        extra["idle_step_wait_s"] = 0
    if arm.startswith("kvtier-node"):  # the host's pool; an external reset clears the cpu tier alone (forget)
        extra |= {"node_socket": node_socket, "reset_scope": "cpu"}
    if arm == "kvtier-node-async":
        extra["sync_shared_loads"] = False
    return {"kv_connector": "KVTierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


class Timeline:
    """Timestamped calls of the wrapped methods: ``(name, start, end, detail, process CPU s at start, at end)``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float, float, Any]] = []

    def wrap(self, obj: Any, attr: str, name: str, detail: Any = None) -> None:
        real = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            c0, t0 = time.process_time(), time.perf_counter()
            out = real(*a, **k)
            t1, c1 = time.perf_counter(), time.process_time()
            self.calls.append((name, t0, t1, detail(out, a) if detail is not None else None, c0, c1))
            return out

        setattr(obj, attr, timed)

    def wrap_light(self, obj: Any, attr: str, name: str) -> None:
        """:meth:`wrap` without the process CPU clock (a system call that sums every thread's time,
        far costlier than the calls it would time here): for the spans called per chunk."""
        real = getattr(obj, attr)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            out = real(*a, **k)
            self.calls.append((name, t0, time.perf_counter(), None, 0.0, 0.0))
            return out

        setattr(obj, attr, timed)

    def between(self, t0: float, t1: float, name: str) -> list[tuple[str, float, float, Any]]:
        return [c for c in self.calls if c[0] == name and t0 <= c[1] <= t1]


def child(args: argparse.Namespace) -> None:
    """One arm, one engine: the cold prefill and ``warmup`` untimed full hits, then one timed full
    hit per ``hit`` line on stdin, its breakdown printed as one ``FULLHIT {json}`` line."""
    swaps: list[tuple[float, float, int]] = []
    if args.arm == "native":  # before the engine builds its handlers: they pick the copy function up by name
        import kvtier.bench.native_cpu as shim

        shim.install()  # idempotent (done on import without CUDA)
        real_swap = shim.host_swap_blocks_batch

        def timed_swap(src: Any, dst: Any, sizes: Any, **k: Any) -> None:
            t0 = time.perf_counter()
            real_swap(src, dst, sizes, **k)
            swaps.append((t0, time.perf_counter(), int(sizes.sum())))

        shim.host_swap_blocks_batch = timed_swap  # type: ignore[assignment]
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.sampling_params import RequestOutputKind

    from kvtier.launch.testmodel import write_model

    model = write_model(args.workdir / "mid", "mid", weights="none")
    llm = LLM(model=str(model), load_format="dummy", max_model_len=args.prompt_tokens + 96, enforce_eager=True,
              gpu_memory_utilization=0.1, kv_cache_memory_bytes=(args.prompt_tokens + 256) * 12288 * 2,
              enable_prefix_caching=True, seed=0, kv_transfer_config=transfer_config(args.arm, args.node_socket))
    core = llm.llm_engine.engine_core.engine_core
    engine = llm.llm_engine
    tl = Timeline()
    tl.wrap(core.scheduler, "schedule", "schedule",
            lambda out, a: ({k: v for k, v in out.num_scheduled_tokens.items()},
                            {rid: r.status.name for rid, r in core.scheduler.requests.items()}))
    tl.wrap(core.scheduler.connector, "get_num_new_matched_tokens", "lookup", lambda out, a: out)
    tl.wrap(core.scheduler.connector, "update_state_after_alloc", "alloc")
    tl.wrap(core.scheduler.connector, "build_connector_meta", "meta")
    worker = get_kv_transfer_group()
    tl.wrap(worker, "start_load_kv", "start_load_kv")
    tl.wrap(worker, "get_finished", "get_finished", lambda out, a: set(out[1] or ()))
    tl.wrap(worker, "wait_for_save", "save")
    tl.wrap(core.model_executor, "execute_model", "forward")
    tl.wrap(core.model_executor, "sample_tokens", "sample")
    threads = ThreadProbe(core.model_executor) if os.environ.get("FULL_HIT_THREADS") else None
    if args.arm != "native" and os.environ.get("FULL_HIT_PROFILE"):  # the hit path on the engine's thread too
        profile_calls(core.scheduler.connector, "get_num_new_matched_tokens", os.environ["FULL_HIT_PROFILE"] + ".lookup")
        profile_calls(worker, "start_load_kv", os.environ["FULL_HIT_PROFILE"] + ".start_load_kv")
    if args.arm != "native":
        side = worker.worker_side
        # (light wraps: these run inside the load's span, so a process-CPU clock read here would be counted
        # in kvtier's own time; 4 such system calls cost ~9 us with the caches cold)
        tl.wrap_light(side.store, "prepare_load", "prepare_load")
        from kvtier.integrations.vllm.worker import loader, syncload  # the copy into the engine's blocks

        tl.wrap_light(loader, "load_pages", "copy")  # the loader thread's path and the synchronous load call it
        syncload.load_pages = loader.load_pages  # type: ignore[attr-defined]  (its own import of the name)
        detail(tl, side)
    ids = random_prompt_ids(model / "tokenizer.json", args.prompt_tokens, seed=args.seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.DELTA)
    quiet = SamplingParams(max_tokens=1, temperature=0.0)

    def request(rid: str) -> tuple[float, float, list[int]]:
        t_add = time.perf_counter()
        engine.add_request(rid, {"prompt_token_ids": ids}, params)
        first = None
        while first is None:
            for out in engine.step():
                if out.request_id == rid and out.outputs and out.outputs[0].token_ids:
                    first = (time.perf_counter(), list(out.outputs[0].token_ids))
            if not engine.has_unfinished_requests() and first is None:
                raise RuntimeError(f"request {rid} ended without a token")
        while engine.has_unfinished_requests():
            engine.step()
        return t_add, first[0], first[1]

    t_cold0, t_cold1, cold_token = request("cold")
    count = 0

    def forget() -> None:
        """vLLM's own cache forgets the prompt (the connector's CPU tier keeps it).  vLLM refuses
        ``reset_prefix_cache`` while a finished request's blocks wait for its save (kvtier's deferred
        saves, issue 37), and the connector reports the save's end only in an engine step: step a
        3-token request (below one block: nothing cached, looked up or saved) until it succeeds, then
        once more so that the scheduler's view of the tier has the saved chunks too."""
        deadline = time.monotonic() + 120
        for again in (True, False):
            while not llm.reset_prefix_cache():
                if time.monotonic() > deadline:
                    raise RuntimeError("vLLM still refused reset_prefix_cache after 120 s")
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], quiet, use_tqdm=False)
            if again:
                llm.generate([{"prompt_token_ids": [5, 6, 7]}], quiet, use_tqdm=False)
        if args.arm.startswith("kvtier-node"):  # the engine's own cpu tier forgets too (reset_scope cpu): a node-tier hit
            if not llm.reset_prefix_cache(reset_connector=True):
                raise RuntimeError("the connector did not clear its cpu tier")
            llm.generate([{"prompt_token_ids": [5, 6, 7]}], quiet, use_tqdm=False)  # the workers get the order

    def hit() -> dict[str, Any]:
        nonlocal count
        forget()
        rid = f"hit{count}"
        count += 1
        t_add, t_first, token = request(rid)
        tl.calls = [c for c in tl.calls if c[1] >= t_add]  # this request's calls only, from here on
        swaps[:] = [s for s in swaps if s[0] >= t_add]
        out = breakdown(tl, rid, t_add, t_first, swaps if args.arm == "native" else None) | {
            "same_token_as_cold": token == cold_token, "cold_ttft_s": t_cold1 - t_cold0}
        return out | ({"tail_threads": threads.tail(t_add, t_first)} if threads is not None else {})

    for _ in range(args.warmup):
        hit()
    print("FULLHIT ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "hit":
            break
        print("FULLHIT " + json.dumps(hit()), flush=True)
    llm.llm_engine.engine_core.shutdown()


class ThreadProbe:
    """``FULL_HIT_THREADS=1``: who ran on the CPUs during each forward (``execute_model`` start to
    ``sample_tokens`` end), from the scheduler's per-task accounting (``/proc/.../task/TID/schedstat``:
    run ns, time slices), read before and after, outside the timed spans: this process's threads by
    name (the engine thread, the OpenMP workers, vLLM's gloo loops, kvtier's threads), the other arms'
    engines and the rest of the machine; and the garbage collections that started in it.  Issue 33:
    is the tail forward slower in one arm because something else runs during it?"""

    def __init__(self, executor: Any) -> None:
        import gc
        import threading

        self.threading = threading
        self.spans: list[tuple[float, float, dict[str, Any]]] = []
        self.start: tuple[float, dict[tuple[str, str], tuple[int, int, str]]] | None = None
        self.gcs: list[tuple[str, float]] = []
        self.whose: dict[str, str | None] = {}  # pid: "" (this one), "arm NAME", None (elsewhere)
        gc.callbacks.append(lambda phase, info: self.gcs.append((phase, time.perf_counter())))
        real_execute, real_sample = executor.execute_model, executor.sample_tokens

        def execute_model(*a: Any, **k: Any) -> Any:
            self.start = (time.perf_counter(), self.tasks())
            return real_execute(*a, **k)

        def sample_tokens(*a: Any, **k: Any) -> Any:
            out = real_sample(*a, **k)
            if self.start is not None:
                t1, after = time.perf_counter(), self.tasks()
                t0, before = self.start
                ran: dict[str, list[int]] = {}
                for task, (run, slices, who) in after.items():
                    run0, slices0, _ = before.get(task, (0, 0, who))
                    if run > run0:
                        ran.setdefault(who, [0, 0])
                        ran[who][0] += run - run0
                        ran[who][1] += slices - slices0
                self.spans.append((t0, t1, ran))
                self.start = None
            return out

        executor.execute_model, executor.sample_tokens = execute_model, sample_tokens

    def tasks(self) -> dict[tuple[str, str], tuple[int, int, str]]:
        """Every task's ``(run ns, time slices, whose)``: this process's by thread name (Python's, else
        the kernel's; ``python``, the OpenMP workers': ``openmp/other``), the other arms' engines as
        ``arm NAME``, and the rest of the machine as one ``elsewhere`` entry (CPU time from
        ``/proc/stat``, 10 ms ticks, less the tasks above; its slices not counted)."""
        me, names = str(os.getpid()), {t.native_id: t.name for t in self.threading.enumerate()}
        out: dict[tuple[str, str], tuple[int, int, str]] = {}
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            if pid not in self.whose:  # (each process's command line read once)
                try:
                    words = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                self.whose[pid] = "" if pid == me else \
                    f"arm {words[words.index(b'--arm') + 1].decode()}" if b"--arm" in words[:-1] else None
            whose = self.whose[pid]
            if whose is None:
                continue
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    run, _wait, slices = Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()
                    who = whose or names.get(int(tid)) or Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                    who = "openmp/other" if who == "python" else who.rstrip("0123456789_-")
                    out[(pid, tid)] = (int(run), int(slices), who)
            except (OSError, ValueError):
                continue  # a task that ended in between
        busy = sum(int(v) for i, v in enumerate(Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:])
                   if i not in (3, 4))  # every CPU's ticks but idle and iowait
        out[("", "")] = (busy * 10**9 // os.sysconf("SC_CLK_TCK") - sum(v[0] for v in out.values()), 0, "elsewhere")
        return out

    def tail(self, t_add: float, t_first: float) -> dict[str, Any]:
        """The longest forward of the request (its tail's): ``{whose: [run s, slices]}`` plus
        ``gc``: ``[collections, seconds]`` started in it."""
        spans = [s for s in self.spans if t_add <= s[0] <= t_first]
        gcs, self.spans, self.gcs = self.gcs, [], []
        if not spans:
            return {}
        t0, t1, ran = max(spans, key=lambda s: s[1] - s[0])
        starts = [t for phase, t in gcs if phase == "start"]
        stops = [t for phase, t in gcs if phase == "stop"]
        inside = [(a, b) for a, b in zip(starts, stops) if t0 <= a <= t1]
        return {who: [v[0] / 1e9, v[1]] for who, v in ran.items()} | {
            "gc": [len(inside), sum(b - a for a, b in inside)]}


def profile_calls(obj: Any, attr: str, out: str) -> None:
    """Run every call of ``obj.attr`` under one cProfile, summed over the calls (``out.<pid>``)."""
    import cProfile

    profile, real = cProfile.Profile(), getattr(obj, attr)

    def profiled(*a: Any, **k: Any) -> Any:
        profile.enable()
        try:
            return real(*a, **k)
        finally:
            profile.disable()
            profile.dump_stats(f"{out}.{os.getpid()}")

    setattr(obj, attr, profiled)


DETAIL = ("run", "finish", "plan_load", "plan_shared", "mover_run", "mover_read", "complete_reads", "guard_get", "guard_call", "fetch_many", "finish_get",
          "while_fetching", "copy_early", "verify_copy", "scatter_hashed", "scatter", "same_generations", "handoff")
"""The finer spans of a load (:func:`detail`), summed per full hit into ``detail_s``."""


def detail(tl: Timeline, side: Any) -> None:
    """Wrap the pieces of a load inside ``prepare_load`` and around it (issue 38's "where does a
    node-tier load's time go"): the loader thread's job (``run``) and its report (``finish``), and
    for a node tier its plan, the guard's thread hop, the pin with what runs while it is in flight
    (the scatters' runs, the early copies), the read (copy + digest per chunk, the scatter's
    construction) and the generation check."""
    from kvtier.core.tiers.guarded import GuardedTier
    from kvtier.core.tiers.node import pool as node_pool
    from kvtier.core.tiers.node import readcopy
    from kvtier.core.tiers.node import tier as node_tier

    loader = side.loader.path if side.loader is not None else None  # (each load runs loader.run)
    if loader is not None and os.environ.get("FULL_HIT_PROFILE"):  # each load's thread under cProfile, summed
        import cProfile

        profile, real_run, out = cProfile.Profile(), loader.run, os.environ["FULL_HIT_PROFILE"]

        def profiled(job: Any) -> None:
            profile.enable()
            try:
                real_run(job)
            finally:
                profile.disable()
                profile.dump_stats(f"{out}.{os.getpid()}")

        loader.run = profiled
    if loader is not None:
        tl.wrap_light(loader, "run", "run")
        tl.wrap_light(loader, "finish", "finish")
        if loader.direct is not None:
            tl.wrap_light(loader.direct, "scatter", "scatter")
    if hasattr(side, "finisher"):  # a synchronous load's bookkeeping handed off (worker/finisher.py)
        tl.wrap_light(side.finisher, "submit", "handoff")
    store = side.store
    tl.wrap_light(store.index, "plan_load", "plan_load")
    tl.wrap_light(store.index, "plan_shared", "plan_shared")
    tl.wrap_light(store.index, "complete_reads", "complete_reads")
    tl.wrap_light(store.mover, "run", "mover_run")
    tl.wrap_light(store.mover, "read", "mover_read")
    if not store.index.shared:
        return
    tier = store.index.shared[0].tier
    if isinstance(tier, GuardedTier):
        tl.wrap_light(tier, "get_many", "guard_get")
        tl.wrap_light(tier, "_call", "guard_call")
        tl.wrap_light(tier, "_call_here", "guard_call")  # a tier that bounds itself: no thread hop
        tier = tier.inner
    tl.wrap_light(tier, "fetch_many", "fetch_many")
    tl.wrap_light(tier, "fetch_many_by", "fetch_many")
    tl.wrap_light(tier, "finish_get", "finish_get")
    tl.wrap_light(tier, "while_fetching", "while_fetching")  # the scatters' runs, built while the pin is in flight
    if hasattr(node_tier, "copy_early"):  # the values copied before the pin's answer is read (since node40)
        tl.wrap_light(node_tier, "copy_early", "copy_early")
    tl.wrap_light(tier.verifier, "copy", "verify_copy")
    tl.wrap_light(readcopy, "scatter_hashed", "scatter_hashed")
    tl.wrap_light(node_pool.Pool, "same_generations", "same_generations")


def breakdown(tl: Timeline, rid: str, t_add: float, t_first: float,
              swaps: list[tuple[float, float, int]] | None) -> dict[str, Any]:
    def of(ids: Any) -> Any:  # vLLM appends a suffix to the request id internally
        return next((v for k, v in ids.items() if k == rid or k.startswith(rid + "-")), None)

    steps = tl.between(t_add, t_first, "schedule")
    forwards = tl.between(t_add, t_first, "forward")
    samples = tl.between(t_add, t_first, "sample")
    admitted = next(i for i, s in enumerate(steps) if of(s[3][1]) not in (None, "WAITING") or of(s[3][0]))
    tail = next(i for i, s in enumerate(steps) if of(s[3][0]))
    tail_fwd = [f for f in forwards if f[1] >= steps[tail][2]][:1]
    tail_smp = [s for s in samples if s[1] >= steps[tail][2]][:1]
    tail_forward_s = sum(c[2] - c[1] for c in tail_fwd + tail_smp)
    # inside the tail step's execute_model: the connector's synchronous load and its saves
    in_tail = [c for c in tl.calls if tail_fwd and tail_fwd[0][1] <= c[1] <= tail_fwd[0][2]]
    tail_save_s = sum(c[2] - c[1] for c in in_tail if c[0] == "save")
    tail_start_load_s = sum(c[2] - c[1] for c in in_tail if c[0] == "start_load_kv")
    lookups = [c for c in tl.between(t_add, t_first, "lookup") if c[3] and c[3][0]]
    starts = tl.between(steps[admitted][1], t_first, "start_load_kv")
    done = [c for c in tl.between(t_add, t_first, "get_finished") if any(r == rid or r.startswith(rid + "-")
                                                                         for r in c[3])]
    if swaps is not None:
        copies = [(t0, t1) for t0, t1, _n in swaps if t_add <= t0 <= t_first]
        prepare = 0.0
    else:
        copies = [(c[1], c[2]) for c in tl.between(t_add, t_first, "copy")]
        prepare = sum(c[2] - c[1] for c in tl.between(t_add, t_first, "prepare_load"))
    copy_s = sum(t1 - t0 for t0, t1 in copies)
    ttft = t_first - t_add
    alloc_meta_s = sum(c[2] - c[1] for name in ("alloc", "meta") for c in tl.between(t_add, t_first, name))
    load_start = starts[0][1] if starts else None
    load_end = done[0][2] if done else (starts[0][2] if starts else None)
    # an asynchronous load: the steps that scheduled nothing from its shipping to its report, and
    # the process's CPU seconds (every thread) over that span
    empty_steps = [s for s in steps if load_start is not None and done and load_start <= s[1] <= load_end
                   and not s[3][0]]
    load_cpu_s = done[0][5] - starts[0][4] if done and starts else 0.0
    lookups_s = sum(c[2] - c[1] for c in lookups)
    load_s = (load_end - load_start) if load_start is not None and load_end is not None else 0.0
    spans = {name: tl.between(t_add, t_first, name) for name in DETAIL}
    runs = spans["run"]
    return {
        "detail_s": {name: sum(c[2] - c[1] for c in calls) for name, calls in spans.items() if calls},
        "detail_n": {name: len(calls) for name, calls in spans.items() if calls},
        # the loader thread: from shipping to its start, and from its end to the report (get_finished)
        "thread_start_s": runs[0][1] - load_start if runs and load_start is not None else None,
        "report_after_s": load_end - runs[0][2] if runs and load_end is not None and done else None,
        "ttft_s": ttft,
        "hit_tokens": lookups[-1][3][0] if lookups else 0,
        "async": bool(lookups[-1][3][1]) if lookups else None,
        "steps_to_tail": tail - admitted,  # engine steps between admission and the tail's forward
        "queue_s": steps[admitted][1] - t_add,
        "lookup_s": lookups_s,
        "load_s": load_s,
        "empty_steps_during_load": len(empty_steps),
        "load_cpu_s": load_cpu_s,
        "prepare_s": prepare,
        "copy_s": copy_s,
        # kvtier's own time as issue 33 counts it: lookup + load beyond the copy.  prepare_load runs
        # inside the load's span (in start_load_kv for a synchronous load, on a loader thread
        # between shipping and the report for an asynchronous one): it is not added again
        "own_s": lookups_s + load_s - copy_s,
        "alloc_meta_s": alloc_meta_s,  # update_state_after_alloc + build_connector_meta (scheduler)
        "tail_forward_s": tail_forward_s,
        "tail_save_s": tail_save_s,
        "tail_start_load_s": tail_start_load_s,
        "tail_tokens": of(steps[tail][3][0]),
        # the model's own forward of the tail: the tail step minus the connector's calls inside it
        # (a synchronous load's copy runs in start_load_kv, inside that step's execute_model)
        "tail_model_s": tail_forward_s - tail_save_s - tail_start_load_s,
        "other_s": ttft - copy_s - (tail_forward_s - tail_save_s - tail_start_load_s),
        "first_step_to_tail_s": steps[tail][1] - steps[admitted][1],
    }


def summary(runs_by_arm: dict[str, list[dict[str, Any]]]) -> str:
    def ms(v: float) -> str:
        return f"{v * 1e3:.1f}"

    def span(runs: list[dict[str, Any]], k: str) -> str:
        return f"{ms(min(r[k] for r in runs))}–{ms(max(r[k] for r in runs))}"

    header = ("| arm | n | TTFT median (range), ms | TTFT − tail forward median (range), ms | engine steps "
              "admission→tail | lookup | load shipped→done | prepare (pin/read) | copy | tail forward + sample "
              "| TTFT − copy − tail forward | hit tokens | same token as cold | empty steps during the load "
              "| process CPU during the load median (range), ms |")
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    med: dict[str, tuple[float, float]] = {}
    for arm, runs in runs_by_arm.items():
        for r in runs:
            r["path_s"] = r["ttft_s"] - r["tail_model_s"]  # what is not the model's forward of the tail
        m = {k: statistics.median(r[k] for r in runs) for k in ("ttft_s", "path_s", "lookup_s", "load_s",
                                                                 "prepare_s", "copy_s", "tail_model_s", "other_s",
                                                                 "load_cpu_s")}
        med[arm] = (m["ttft_s"], m["path_s"])
        steps = sorted(r["steps_to_tail"] for r in runs)
        empty = sorted(r["empty_steps_during_load"] for r in runs)
        lines.append(f"| {arm} | {len(runs)} | **{ms(m['ttft_s'])}** ({span(runs, 'ttft_s')}) | **{ms(m['path_s'])}** "
                     f"({span(runs, 'path_s')}) | {steps[0]}–{steps[-1]} | {ms(m['lookup_s'])} | {ms(m['load_s'])} "
                     f"| {ms(m['prepare_s'])} | {ms(m['copy_s'])} | {ms(m['tail_model_s'])} | {ms(m['other_s'])} "
                     f"| {sorted({r['hit_tokens'] for r in runs})} | {all(r['same_token_as_cold'] for r in runs)} "
                     f"| {empty[0]}–{empty[-1]} | {ms(m['load_cpu_s'])} ({span(runs, 'load_cpu_s')}) |")
    lines += ["", ("| arm | own time: lookup + load − copy, median (range), ms | per chunk, µs "
                   "| update_state_after_alloc + build_connector_meta, ms | save in the tail step, ms |"),
              "|---|---|---|---|---|"]
    for arm, runs in runs_by_arm.items():
        own = statistics.median(r["own_s"] for r in runs)
        chunks = max(statistics.median(r["hit_tokens"] for r in runs) // CHUNK_TOKENS, 1)
        lines.append(f"| {arm} | **{ms(own)}** ({span(runs, 'own_s')}) | {own * 1e6 / chunks:.0f} "
                     f"| {ms(statistics.median(r['alloc_meta_s'] for r in runs))} "
                     f"| {ms(statistics.median(r['tail_save_s'] for r in runs))} |")
    lines += ["", ("| arm | loader thread start after shipping, ms | report after the loader's end, ms | "
                   "spans inside the load, median ms (calls per hit) |"), "|---|---|---|---|"]
    for arm, runs in runs_by_arm.items():
        names = sorted({n for r in runs for n in r.get("detail_s", {})}, key=DETAIL.index)

        def med_ms(k: str, runs: list[dict[str, Any]] = runs) -> str:
            vals = [r[k] for r in runs if r.get(k) is not None]
            return ms(statistics.median(vals)) if vals else "–"
        spans = ", ".join(f"{n} {statistics.median(r['detail_s'].get(n, 0.0) for r in runs) * 1e3:.2f} "
                          f"({statistics.median(r['detail_n'].get(n, 0) for r in runs):g})" for n in names)
        lines.append(f"| {arm} | {med_ms('thread_start_s')} | {med_ms('report_after_s')} | {spans or '–'} |")
    # a node-tier hit loads synchronously (kvtier-node) as a cpu-tier hit does (kvtier), or asynchronously
    # (kvtier-node-async, sync_shared_loads: false) as kvtier-async's do
    for node, ref in (("kvtier-node", "kvtier"), ("kvtier-node", "kvtier-async"), ("kvtier-node-async", "kvtier-async"),
                      ("kvtier-node-async", "kvtier")):
        if node not in runs_by_arm or ref not in runs_by_arm:
            continue
        pairs = [(n, c) for n in runs_by_arm[node] for c in runs_by_arm[ref] if n["repeat"] == c["repeat"]]
        for k, what in (("load_s", "load shipped→done"), ("ttft_s", "TTFT")):
            per = sorted(n[k] / c[k] for n, c in pairs if c[k] > 0)
            if per:
                lines += ["", (f"{node} / {ref}, {what} per repeat: median **{statistics.median(per):.2f}×**, "
                              f"range {per[0]:.2f}–{per[-1]:.2f} ({len(per)} repeats)")]
    if any("tail_threads" in r for runs in runs_by_arm.values() for r in runs):
        lines += ["", threads_table(runs_by_arm)]
    if "native" in med:
        lines.append("")
        lines.extend(f"{arm} / native: median TTFT **{v[0] / med['native'][0]:.2f}×**, median TTFT − tail forward "
                     f"**{v[1] / med['native'][1]:.2f}×**" for arm, v in med.items() if arm != "native")
    return "\n".join(lines)


def threads_table(runs_by_arm: dict[str, list[dict[str, Any]]]) -> str:
    """``FULL_HIT_THREADS=1``'s table: median CPU ms (time slices) each one ran during the tail
    forward, per arm; ``MainThread`` and ``openmp/other`` are the forward's own."""
    lines = [("| arm | CPU during the tail forward, median ms (time slices), per thread or process | "
              "garbage collections in it |"), "|---|---|---|"]
    for arm, runs in runs_by_arm.items():
        rows = [r.get("tail_threads", {}) for r in runs]
        whose = sorted({w for row in rows for w in row if w != "gc"},
                       key=lambda w: -statistics.median(row.get(w, [0.0])[0] for row in rows))
        cells = ", ".join(f"{w} {statistics.median(row.get(w, [0.0])[0] for row in rows) * 1e3:.1f} "
                          f"({statistics.median(row.get(w, [0, 0])[1] for row in rows):g})" for w in whose)
        gc_n = sum(row.get("gc", [0, 0.0])[0] for row in rows)
        gc_s = sum(row.get("gc", [0, 0.0])[1] for row in rows)
        lines.append(f"| {arm} | {cells} | {gc_n} in {len(rows)} forwards, {gc_s * 1e3:.1f} ms |")
    return "\n".join(lines)


class Arm:
    """A child process holding one arm's engine, answering ``hit`` lines."""

    def __init__(self, args: argparse.Namespace, arm: str, log_name: str) -> None:
        self.name = arm
        self.log = open(args.workdir / log_name, "wb")  # noqa: SIM115 - closed in close()
        cmd = [sys.executable, __file__, *sys.argv[1:], "--arm", arm]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.read()  # "ready": engine up, cold prefill and warm-up hits done

    def read(self) -> Any:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("FULLHIT "):
                body = line[len("FULLHIT "):].strip()
                return None if body == "ready" else json.loads(body)
        raise SystemExit(f"the {self.name} engine stopped (exit {self.proc.wait()}); see {self.log.name}")

    def hit(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("hit\n")
        self.proc.stdin.flush()
        out = self.read()
        assert isinstance(out, dict)
        return out

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--repeats", type=int, default=5, help="timed full hits per arm, interleaved")
    parser.add_argument("--warmup", type=int, default=2, help="untimed full hits per engine first (kernel shapes)")
    parser.add_argument("--arms", default="kvtier,native,kvtier-async")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--start-order", choices=("both", "given"), default="both",
                        help="both: the first half of the repeats with the engines started in --arms order, the "
                             "rest restarted in reverse order (the engine started first runs slower on some "
                             "hosts); given: --arms order only")
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--node-socket", help=argparse.SUPPRESS)  # the kvtier-node arm's owner (started here)
    args = parser.parse_args()
    arms = args.arms.split(",")
    if any(a not in ARMS for a in arms) or args.repeats < 1 or args.warmup < 0 or \
            not 256 <= args.prompt_tokens <= 32000:
        print(f"full_hit.py: --arms takes {', '.join(ARMS)}; --repeats at least 1; --warmup 0 or more; "
              "--prompt-tokens from 256 to 32000", file=sys.stderr)
        return 2
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")  # the same cores for every arm
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.arm:
        child(args)
        return 0
    load_before = os.getloadavg()
    children = []
    owner = None
    if any(a.startswith("kvtier-node") for a in arms):  # one pool owner for the run (kvtier node serve), as on a GPU node
        from kvtier.bench.shared_node import LocalNode, NodePool

        owner = LocalNode(NodePool.make(1.0), args.workdir / "node.log").start()
        sys.argv += ["--node-socket", owner.pool.socket]
    orders = [arms, arms[::-1]] if args.start_order == "both" and len(arms) > 1 else [arms]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    load_start: tuple[float, float, float] | None = None
    r = 0
    try:
        for generation, order in enumerate(orders):  # engines started afresh per order: start position per hit
            count = (args.repeats + len(orders) - 1 - generation) // len(orders)
            if not count:
                continue
            try:
                for arm in order:  # one at a time: the cold prefills do not share the cores
                    children.append(Arm(args, arm, f"{arm}.log" if generation == 0 else f"{arm}.{generation}.log"))
                if load_start is None:
                    load_start = os.getloadavg()
                for _ in range(count):  # interleaved, the order rotated each repeat
                    for child_arm in children[r % len(children):] + children[:r % len(children)]:
                        runs[child_arm.name].append(child_arm.hit() | {
                            "repeat": r, "started": order.index(child_arm.name), "load_average": os.getloadavg()})
                    r += 1
            finally:
                for c in children:
                    c.close()
                children = []
    finally:
        if owner is not None:
            owner.stop()
            owner.pool.remove()
    out = {"prompt_tokens": args.prompt_tokens, "load_average_before": load_before,
           "load_average_at_first_hit": load_start, "load_average_after": os.getloadavg(), "runs": runs}
    (args.workdir / "full_hit.json").write_text(json.dumps(out, indent=1))
    def fmt(v: Any) -> str:
        return " / ".join(f"{x:.2f}" for x in v)

    counts = [(args.repeats + len(orders) - 1 - g) // len(orders) for g in range(len(orders))]
    started = "; then ".join(f"{', '.join(o)} for {n} repeat{'s' if n != 1 else ''}"
                             for o, n in zip(orders, counts, strict=True) if n)
    print(f"{args.prompt_tokens}-token prompt, mid geometry, {args.repeats} full hits per arm interleaved; load "
          f"average {fmt(load_start or load_before)} at the first timed hit, {fmt(out['load_average_after'])} "
          f"after; engines started in the order {started}\n")
    print(summary(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
