"""Hit attribution at scale: kvtier's per-tier loaded tokens against vLLM's per-source cached tokens.

Issue 20 item 6, "Done when": under 300 streamed requests with 20 % aborts, the tokens kvtier
reports per tier (``kvtier_loaded_tokens_total{tier}``) equal what vLLM counted per hit source
(``vllm:prompt_tokens_cached_by_source_total{source}``, counted at admission from the connector's
``get_external_cache_hit_sources``, vllm/v1/core/sched/scheduler.py and
vllm/v1/metrics/loggers.py, v0.32.0) exactly; at idle the pin gauges (``kvtier_pinned_chunks{tier}``)
read 0 within a few seconds.

vLLM counts a hit when it admits the request; a request aborted before its load starts gets no
load (kvtier counts those tokens in ``kvtier_unfilled_tokens_total{tier}``, by the same planned
tier), so the exact equality is ``loaded + unfilled`` per tier against the tier's source
(``kvtier.core.tiers.registry.hit_source``: tiers of one source are summed), and over all tiers
against ``vllm:external_prefix_cache_hits_total`` (docs/vllm.md, src/kvtier/integrations/vllm/stats.py).
``loaded`` alone is printed beside it.

What runs: one ``python -m vllm.entrypoints.openai.api_server`` (kvtier.launch.serve) with
KVTierConnector, the ``tiny`` test model (kvtier.launch.testmodel, seeded random weights), 32-token
blocks, 64-token chunks, a small engine cache (``--engine-tokens``) so vLLM's own prefix cache
forgets prompts quickly, a cpu tier of ``--cpu-chunks`` chunks (fewer than the pool's chunks: the
rest come back from the disk tier and are promoted into the cpu tier, while saves evict from it),
and a disk tier large enough for the whole pool.  Then ``--requests`` streamed completions
(httpx, ``--concurrency`` at a time), each a prefix drawn from a pool of ``--pool`` prefixes
(skewed: a few hot ones stay in the cpu tier, the cold ones come from disk) plus a fresh tail of
token ids; ``--abort-share`` of them (chosen at random, exactly that share) are aborted by
closing the connection, half after their first streamed chunk, half after a random delay of up to
``--abort-max-delay-s`` (while waiting, loading or decoding).  After the last request: the pin
gauges are polled until they read 0 (``--pin-deadline-s`` after the server went idle at most),
then the counters until two scrapes a second apart agree, and the numbers are compared.  The
server also writes every request's cache receipt to a receipt log (``receipt_log_path``, issue 35):
the receipts' tokens per tier and per miss reason must equal the deltas of
``kvtier_served_tokens_total{tier}`` and ``kvtier_missed_tokens_total{reason,tier}`` exactly, with
a receipt for every request that ended by itself, and at most one per request sent (a request the
client aborted before the engine got it has no receipt, and counts in no metric)
(:mod:`kvtier.bench.receipts`).

Usage::

    python scripts/attribution_check.py --workdir /tmp/attr [--requests 300] [--concurrency 8]
        [--abort-share 0.2] [--pool 16] [--cpu-chunks 24] [--seed 0]

Prints a table, writes WORKDIR/attribution.json (every number, the configuration, the load
average before and after); exit status 0 when every tier agrees, no block of a planned hit went
unfilled (``kvtier_load_failed_blocks_total`` 0: no tier fails here, so a planned page must be
there when its load pins it, issue 33) and the pins read 0 in time, 1 when not (or when the run
did not exercise both a cpu and a disk hit), 2 on bad arguments or a server that does not start.
A request aborted before its load began leaves its tokens unfilled without a failed block.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvtier.bench.meters import parse_metrics
from kvtier.bench.receipts import LogCursor, ReceiptTally, disagreements, metric_tally
from kvtier.core.config import KVTierConfig
from kvtier.core.errors import MetricsError, ServerStartError
from kvtier.core.tiers.factory import configured
from kvtier.core.tiers.registry import hit_source, top_tier
from kvtier.launch.serve import Server, ServerSpec, transfer_config
from kvtier.launch.testmodel import write_model
from kvtier.tools.scrape import fetch_metrics, metric_families

BLOCK_TOKENS = 32
CHUNK_TOKENS = 64
CHUNK_BYTES = 2 * 2 * 2 * 64 * 4 * CHUNK_TOKENS  # tiny: layers × (K, V) × KV heads × head size × fp32 × tokens
VOCAB_LOW, VOCAB_HIGH = 10, 2000  # token ids drawn for prompts (the tiny model's vocabulary is 2,048)

LOADED = "kvtier_loaded_tokens_total"
UNFILLED = "kvtier_unfilled_tokens_total"
BY_SOURCE = "vllm:prompt_tokens_cached_by_source_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
PINNED = "kvtier_pinned_chunks"


@dataclass
class Outcome:
    """What happened to the requests, as the client saw it."""

    completed: int = 0
    aborted_after_first_chunk: int = 0
    aborted_after_delay: int = 0
    finished_before_abort: int = 0  # meant to be aborted after a delay, but ended sooner
    errors: list[str] = field(default_factory=list)


def scrape(url: str) -> dict[str, dict[str, float]]:
    """``/metrics`` of ``url`` as {sample name: {label value that matters (tier/source/''): sum}}."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in metric_families(fetch_metrics(url, timeout_s=10.0), url):
        for sample in family.samples:
            label = sample.labels.get("tier", sample.labels.get("source", ""))
            out[sample.name][label] += sample.value
    return out


def value(m: dict[str, dict[str, float]], name: str, label: str = "") -> float:
    return m.get(name, {}).get(label, 0.0)


def make_pool(rng: random.Random, size: int) -> list[list[int]]:
    """``size`` prefixes of 4 to 8 whole chunks of random token ids (distinct with overwhelming odds)."""
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(4, 8) * CHUNK_TOKENS)]
            for _ in range(size)]


def plan_requests(rng: random.Random, pool: list[list[int]], count: int, abort_share: float,
                  max_delay_s: float) -> list[dict[str, Any]]:
    """Each request: a pool prefix (weight 1/(rank+1): hot prefixes stay in the cpu tier), a fresh
    tail of 8..40 tokens, 8..16 output tokens, and how it ends ("first", a delay, or None)."""
    weights = [1.0 / (i + 1) for i in range(len(pool))]
    aborts = set(rng.sample(range(count), round(count * abort_share)))
    plans = []
    for i in range(count):
        prefix = rng.choices(range(len(pool)), weights)[0]
        tail = [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(rng.randint(8, 40))]
        abort: str | float | None = None
        if i in aborts:
            abort = "first" if rng.random() < 0.5 else rng.uniform(0.0, max_delay_s)
        plans.append({"prefix": prefix, "prompt": pool[prefix] + tail, "max_tokens": rng.randint(8, 16),
                      "abort": abort})
    return plans


async def one_request(client: httpx.AsyncClient, url: str, model: str, plan: dict[str, Any],
                      outcome: Outcome) -> None:
    body = {"model": model, "prompt": plan["prompt"], "max_tokens": plan["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": True}

    async def stream() -> None:
        async with client.stream("POST", url + "/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                outcome.errors.append(f"HTTP {answer.status_code}: {(await answer.aread())[:200]!r}")
                return
            async for line in answer.aiter_lines():
                if line.startswith("data: ") and plan["abort"] == "first":
                    outcome.aborted_after_first_chunk += 1
                    return  # leaving the block closes the connection mid-stream: vLLM aborts the request
        outcome.completed += 1 if plan["abort"] is None else 0
        outcome.finished_before_abort += 1 if plan["abort"] is not None else 0

    if isinstance(plan["abort"], float):
        try:
            await asyncio.wait_for(stream(), timeout=plan["abort"])
        except TimeoutError:
            outcome.aborted_after_delay += 1  # the cancelled stream closed its connection
    else:
        await asyncio.wait_for(stream(), timeout=300.0)


async def drive(url: str, model: str, plans: list[dict[str, Any]], concurrency: int) -> Outcome:
    outcome = Outcome()
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=2 * concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as client:
        async def gated(plan: dict[str, Any]) -> None:
            async with gate:
                try:
                    await one_request(client, url, model, plan, outcome)
                except (httpx.HTTPError, TimeoutError) as exc:
                    outcome.errors.append(f"{exc.__class__.__name__}: {exc}")
        await asyncio.gather(*(gated(p) for p in plans))
    return outcome


def wait_idle(url: str, tiers: list[str], pin_deadline_s: float, settle_deadline_s: float) -> dict[str, Any]:
    """Poll until no request runs or waits, then until the pin gauges read 0 (``pin_deadline_s``
    from idle at most), then until the compared counters are unchanged over a second
    (``settle_deadline_s`` at most).  Returns the last scrape and the times."""
    start = time.monotonic()
    while True:
        m = scrape(url)
        if value(m, "vllm:num_requests_running") + value(m, "vllm:num_requests_waiting") == 0:
            break
        if time.monotonic() - start > settle_deadline_s:
            raise TimeoutError(f"the server still had requests {settle_deadline_s:g} s after the last one ended")
        time.sleep(0.2)
    idle_at = time.monotonic()
    pins_zero_s: float | None = None
    pins: dict[str, float] = {}
    while time.monotonic() - idle_at <= max(pin_deadline_s, 0.0) + 5.0:  # watch a little past the deadline
        m = scrape(url)
        pins = {t: value(m, PINNED, t) for t in tiers}
        if not any(pins.values()):
            pins_zero_s = time.monotonic() - idle_at
            break
        time.sleep(0.2)

    def compared(m: dict[str, dict[str, float]]) -> tuple[Any, ...]:
        return (tuple(sorted(m.get(LOADED, {}).items())), tuple(sorted(m.get(UNFILLED, {}).items())),
                tuple(sorted(m.get(BY_SOURCE, {}).items())), value(m, EXTERNAL_HITS))

    previous = compared(m)
    while time.monotonic() - idle_at <= settle_deadline_s:
        time.sleep(1.0)
        m = scrape(url)
        now = compared(m)
        if now == previous:
            break
        previous = now
    return {"metrics": m, "pins_at_idle": pins, "pins_zero_after_s": pins_zero_s}


def compare(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], tiers: list[str]) -> dict[str, Any]:
    def delta(name: str, label: str = "") -> int:
        return round(value(after, name, label) - value(before, name, label))

    per_tier = {t: {"source": hit_source(t), "loaded": delta(LOADED, t), "unfilled": delta(UNFILLED, t),
                    "evictions": delta("kvtier_evictions_total", t)} for t in tiers}
    sources = sorted({hit_source(t) for t in tiers})
    per_source = {}
    for s in sources:
        mine = [t for t in tiers if hit_source(t) == s]
        loaded = sum(per_tier[t]["loaded"] for t in mine)
        unfilled = sum(per_tier[t]["unfilled"] for t in mine)
        per_source[s] = {"tiers": mine, "kvtier_loaded": loaded, "kvtier_unfilled": unfilled,
                         "kvtier_loaded_plus_unfilled": loaded + unfilled, "vllm_cached": delta(BY_SOURCE, s)}
    total = sum(v["kvtier_loaded_plus_unfilled"] for v in per_source.values())
    return {"per_tier": per_tier, "per_source": per_source,
            "kvtier_loaded_plus_unfilled_total": total, "vllm_external_hits": delta(EXTERNAL_HITS),
            "vllm_device_hits": delta(BY_SOURCE, "device"),
            "rerouted_chunks": delta("kvtier_rerouted_chunks_total"),
            "reloaded_tokens": delta("kvtier_reloaded_tokens_total"),
            "load_failed_blocks": delta("kvtier_load_failed_blocks_total"),
            "saved_tokens": delta("kvtier_saved_tokens_total"),
            "dropped_saves": delta("kvtier_dropped_saves_total")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True, help="model, disk tier, server log and JSON go here")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--abort-share", type=float, default=0.2)
    parser.add_argument("--abort-max-delay-s", type=float, default=0.6)
    parser.add_argument("--pool", type=int, default=16, help="prefixes requests share (4..8 chunks each)")
    parser.add_argument("--cpu-chunks", type=int, default=24, help="cpu tier size, chunks")
    parser.add_argument("--engine-tokens", type=int, default=2048, help="vLLM's own KV cache, tokens")
    parser.add_argument("--write-mode", choices=("write-back", "write-through"), default="write-back")
    parser.add_argument("--pin-deadline-s", type=float, default=5.0, help="pins must read 0 this long after idle")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.abort_share <= 1 or args.pool < 1 \
            or args.cpu_chunks < 1 or args.engine_tokens < 1024:
        print("attribution_check: --requests, --concurrency, --pool and --cpu-chunks must be positive, "
              "--abort-share within 0..1 and --engine-tokens at least 1024; fix the arguments.", file=sys.stderr)
        return 2

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "model", "tiny", "random")
    disk = work / "disk"
    kvtier = {"chunk_tokens": CHUNK_TOKENS, "cpu_gib": args.cpu_chunks * CHUNK_BYTES / (1 << 30),
              "disk_path": str(disk), "disk_gib": max(0.05, 4 * args.pool * 8 * CHUNK_BYTES / (1 << 30)),
              "write_mode": args.write_mode, "receipt_log_path": str(work / "receipts.jsonl")}
    spec = ServerSpec(model=str(model), max_model_len=1024, cache_tokens=args.engine_tokens, block_size=BLOCK_TOKENS,
                      load_format=None, kv_transfer_config=transfer_config(kvtier), memory_fraction=0.1,
                      enforce_eager=True)
    tiers = [t for t in KVTierConfig(**kvtier).tiers if configured(t, KVTierConfig(**kvtier))]
    rng = random.Random(args.seed)
    pool = make_pool(rng, args.pool)
    plans = plan_requests(rng, pool, args.requests, args.abort_share, args.abort_max_delay_s)
    load_before = os.getloadavg()
    server = Server(spec, work / "server.log")
    try:
        server.start(timeout_s=600)
    except ServerStartError as exc:
        print(f"attribution_check: {exc}", file=sys.stderr)
        return 2
    with server:
        print(f"server up in {server.startup_s:.1f} s ({server.base_url}); log {server.log_path}")
        before = scrape(server.base_url)
        before_text = fetch_metrics(server.base_url, timeout_s=10.0)
        cursor = LogCursor(work / "receipts.jsonl")
        t0 = time.perf_counter()
        outcome = asyncio.run(drive(server.base_url, server.served_model, plans, args.concurrency))
        drive_s = time.perf_counter() - t0
        try:
            idle = wait_idle(server.base_url, tiers, args.pin_deadline_s, settle_deadline_s=60.0)
            after_text = fetch_metrics(server.base_url, timeout_s=10.0)
        except (TimeoutError, MetricsError) as exc:
            print(f"attribution_check: {exc}", file=sys.stderr)
            return 1
        receipts = cursor.read_new(expect=args.requests)
    mine = ReceiptTally.of(receipts)
    theirs = metric_tally(parse_metrics(before_text), parse_metrics(after_text))
    receipt_notes: list[str] = ["the server exported no kvtier_missed_tokens_total"] if theirs is None \
        else disagreements(mine, theirs)
    # every request that ended by itself has a receipt; an aborted one has one if the engine got it
    # before the abort (vLLM counts no client abort in vllm:request_success_total, so the number the
    # engine saw is known only from the receipts themselves)
    ended = outcome.completed + outcome.finished_before_abort
    if not ended <= len(receipts) <= args.requests:
        receipt_notes.append(f"{len(receipts)} receipts logged: fewer than the {ended} requests that ended by "
                             f"themselves, or more than the {args.requests} sent")
    load_after = os.getloadavg()
    result = compare(before, idle["metrics"], tiers)
    mismatches = [s for s, v in result["per_source"].items() if v["kvtier_loaded_plus_unfilled"] != v["vllm_cached"]]
    if result["kvtier_loaded_plus_unfilled_total"] != result["vllm_external_hits"]:
        mismatches.append("total")
    pins_ok = idle["pins_zero_after_s"] is not None and idle["pins_zero_after_s"] <= args.pin_deadline_s
    exercised = result["per_tier"][top_tier()]["loaded"] > 0 and all(
        result["per_tier"][t]["loaded"] > 0 for t in tiers if t != top_tier())
    report = {"command": " ".join([sys.executable, *sys.argv]), "args": {k: str(v) for k, v in vars(args).items()},
              "kvtier_config": kvtier, "engine_tokens": args.engine_tokens, "block_tokens": BLOCK_TOKENS,
              "outcome": vars(outcome) | {"errors": outcome.errors[:20], "num_errors": len(outcome.errors)},
              "drive_s": round(drive_s, 1), "server_startup_s": round(server.startup_s, 1),
              "loadavg_before": load_before, "loadavg_after": load_after,
              "pins_at_idle": idle["pins_at_idle"], "pins_zero_after_s": idle["pins_zero_after_s"],
              **result, "receipts": {"logged": len(receipts), "ended_by_themselves": ended, "receipts": mine.to_dict(),
                                     "metrics": theirs.to_dict() if theirs is not None else None,
                                     "disagreements": receipt_notes},
              "mismatches": mismatches, "pins_ok": pins_ok, "exercised_every_tier": exercised}
    (work / "attribution.json").write_text(json.dumps(report, indent=2))

    print(f"{args.requests} requests in {drive_s:.1f} s: {outcome.completed} completed, "
          f"{outcome.aborted_after_first_chunk} aborted after the first chunk, {outcome.aborted_after_delay} "
          f"after a delay, {outcome.finished_before_abort} ended before their abort, {len(outcome.errors)} errors")
    print(f"{'tier':8} {'source':22} {'loaded':>9} {'unfilled':>9} {'evictions':>10}")
    for t, v in result["per_tier"].items():
        print(f"{t:8} {v['source']:22} {v['loaded']:>9} {v['unfilled']:>9} {v['evictions']:>10}")
    print(f"{'source':22} {'kvtier loaded':>14} {'+ unfilled':>11} {'vLLM cached':>12}  agree")
    for s, v in result["per_source"].items():
        print(f"{s:22} {v['kvtier_loaded']:>14} {v['kvtier_loaded_plus_unfilled']:>11} {v['vllm_cached']:>12}  "
              f"{'yes' if v['kvtier_loaded_plus_unfilled'] == v['vllm_cached'] else 'NO'}")
    print(f"total: kvtier {result['kvtier_loaded_plus_unfilled_total']}, vLLM external hits "
          f"{result['vllm_external_hits']}; rerouted chunks {result['rerouted_chunks']}, reloaded tokens "
          f"{result['reloaded_tokens']}, vLLM device hits {result['vllm_device_hits']}")
    print(f"planned hits not filled: {result['load_failed_blocks']} blocks recomputed; saved tokens "
          f"{result['saved_tokens']}, dropped saves {result['dropped_saves']}")
    print(f"pins at idle: {idle['pins_at_idle']}, read 0 after {idle['pins_zero_after_s']} s "
          f"(deadline {args.pin_deadline_s:g} s); load average {load_before} -> {load_after}")
    print(f"receipts: {len(receipts)} logged ({ended} requests ended by themselves, {args.requests} sent); tokens {mine.tokens}; missed {mine.missed}")
    print(f"wrote {work / 'attribution.json'}")
    failed = []
    if mismatches:
        failed.append(f"kvtier and vLLM disagree for {', '.join(mismatches)}")
    if result["load_failed_blocks"]:  # no tier faults here: a planned page was gone when pinned
        failed.append(f"{result['load_failed_blocks']} blocks of planned hits were not filled (a page left "
                      "between the plan and the pin; docs/architecture.md, 'Plan and pin')")
    if not pins_ok:
        failed.append(f"the pin gauges did not read 0 within {args.pin_deadline_s:g} s of idle")
    if not exercised:
        failed.append("the run did not load from every tier; make --cpu-chunks smaller or --pool larger")
    failed.extend(f"receipts and metrics disagree: {note}" for note in receipt_notes)
    if outcome.errors:
        failed.append(f"{len(outcome.errors)} requests failed (first: {outcome.errors[0]})")
    for line in failed:
        print(f"FAIL: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
