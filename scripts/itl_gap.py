"""Inter-token gaps of running streams while a request whose long prefix sits only on disk is admitted.

Scenario (issue 9): three requests stream long outputs; a fourth, whose 6,000-token prefix is
held only by kvtier's disk tier (the page cache of its chunk files dropped with
``posix_fadvise(DONTNEED)``), is admitted meanwhile.  With loads off the scheduler's step the
streams' largest inter-token gap during that admission should stay within 3× their median gap
(it was ~18× when admission pinned and read the prefix synchronously).

Steps: write the ``small8`` test model (8 layers, float32: 8 KiB of KV per token); server A
prefills the prefix once (write-through: it reaches the disk tier) and stops gracefully; the chunk
files' pages are dropped from the page cache; server B (fresh process: empty cpu tier, empty
engine cache, so the prefix is on disk only) runs the three streams and admits the fourth request
(prefix + 8 new tokens, as token ids) after ``--settle-s`` seconds.  Then, on the same server, the
reference: three new streams and a fourth request with the same prefix (now in vLLM's own prefix
cache, so only its tail is computed) and another 8-token suffix.  A gap is "during the admission"
when it ends between the fourth request's submission and ``--window-s`` seconds after its first
token.

Usage::

    python scripts/itl_gap.py --workdir /tmp/itl [--prefix-tokens 6000] [--stream-tokens 300]

Prints one JSON object (and writes it to WORKDIR/itl_gap.json): for the disk admission and for
the engine-cache reference, per-stream median gap, largest gap during the admission and their
ratio, and the fourth request's TTFT; kvtier's disk hit tokens; ``uptime``'s load average.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import httpx


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


def token_ids(tokenizer_path: Path, num_tokens: int, seed: int) -> list[int]:
    """Exactly ``num_tokens`` token ids of a made-up-words text (the model's own tokenizer)."""
    from tokenizers import Tokenizer

    from kvtier.integrations.vllm.testmodel import random_prompt

    tok = Tokenizer.from_file(str(tokenizer_path))
    words = num_tokens
    ids = tok.encode(random_prompt(seed, words)).ids
    while len(ids) < num_tokens:
        words *= 2
        ids = tok.encode(random_prompt(seed, words)).ids
    return list(ids[:num_tokens])


def stream(base_url: str, model: str, prompt: list[int], max_tokens: int, times: list[float]) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=900.0) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.perf_counter())


def metrics_of(base_url: str) -> dict[str, float]:
    """``/metrics`` samples summed over labels except ``tier`` (kept as ``name{tier}``)."""
    from kvtier.core.scrape import fetch_metrics, metric_families

    out: dict[str, float] = {}
    for family in metric_families(fetch_metrics(base_url), base_url):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                name = sample.name + (f"{{{sample.labels['tier']}}}" if "tier" in sample.labels else "")
                out[name] = out.get(name, 0.0) + float(sample.value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--prefix-tokens", type=int, default=6000)
    parser.add_argument("--stream-tokens", type=int, default=300)
    parser.add_argument("--settle-s", type=float, default=4.0)
    parser.add_argument("--window-s", type=float, default=0.5)
    args = parser.parse_args()

    from kvtier.integrations.vllm.serve import Server, ServerSpec, transfer_config
    from kvtier.integrations.vllm.testmodel import write_model

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model = write_model(work / "small8", "small8", weights="random", seed=0)
    disk = work / "disk"
    shutil.rmtree(disk, ignore_errors=True)
    kvtier = {"cpu_gib": 0.25, "disk_path": str(disk), "disk_gib": 1.0, "write_mode": "write-through"}
    spec = ServerSpec(model=str(model), max_model_len=8192, kv_cache_bytes=512 << 20, load_format=None,
                      kv_transfer_config=transfer_config(kvtier), memory_fraction=0.1, enforce_eager=True,
                      shutdown_timeout_s=30, extra_args=("--dtype", "float32"))  # 8 KiB of KV per token
    tokenizer = model / "tokenizer.json"
    prefix = token_ids(tokenizer, args.prefix_tokens, seed=7)

    with Server(spec, work / "server-a.log").start(900) as a:
        a.complete(prefix, max_tokens=1)  # computed once: saved to the cpu tier and written to disk
    dropped = drop_page_cache(disk)  # server A stopped gracefully: its files are complete

    def admit_during_streams(server: Server, prompt: list[int], seed: int) -> dict[str, object]:
        """Three streams; ``prompt`` admitted after ``settle_s``; the streams' gaps around it."""
        times: list[list[float]] = [[], [], []]
        threads = [threading.Thread(target=stream, args=(server.base_url, server.served_model,
                                                           token_ids(tokenizer, 64, seed=seed + i),
                                                           args.stream_tokens, times[i]))
                   for i in range(3)]
        for t in threads:
            t.start()
        time.sleep(args.settle_s)
        submitted = time.perf_counter()
        ttft, _text = server.complete(prompt, max_tokens=1)
        first_token = submitted + ttft
        for t in threads:
            t.join()
        streams = []
        for ts in times:
            gaps = [(t1, t1 - t0) for t0, t1 in itertools.pairwise(ts)]
            during = [g for end, g in gaps if submitted <= end <= first_token + args.window_s]
            median = statistics.median(g for _e, g in gaps)
            worst = max(during) if during else float("nan")
            streams.append({"tokens": len(ts), "median_gap_ms": round(median * 1e3, 2),
                            "max_gap_during_admission_ms": round(worst * 1e3, 2), "ratio": round(worst / median, 2)})
        return {"fourth_ttft_s": round(ttft, 3), "streams": streams,
                "worst_ratio": max(float(str(s["ratio"])) for s in streams)}

    with Server(spec, work / "server-b.log").start(900) as b:
        b.complete("warm up the engine", max_tokens=4)
        # the prefix is on disk only (fresh process, page cache dropped): kvtier loads it
        from_disk = admit_during_streams(b, prefix + token_ids(tokenizer, 8, seed=8), seed=20)
        after_disk = metrics_of(b.base_url)
        # reference, same server: the prefix is now in vLLM's own prefix cache; only the tail is computed
        engine_cache = admit_during_streams(b, prefix + token_ids(tokenizer, 8, seed=9), seed=30)
        after_ref = metrics_of(b.base_url)

    out = {"prefix_tokens": args.prefix_tokens, "page_cache_dropped_files": dropped,
           "disk_hit_tokens": after_disk.get("kvtier_loaded_tokens_total{disk}", 0.0),
           "load_seconds": after_disk.get("kvtier_transfer_seconds_total", 0.0),
           "reference_external_hit_tokens": after_ref.get("vllm:external_prefix_cache_hits_total", 0.0)
           - after_disk.get("vllm:external_prefix_cache_hits_total", 0.0),
           "from_disk": from_disk, "reference_engine_cache_hit": engine_cache, "load_average": os.getloadavg()}
    (work / "itl_gap.json").write_text(json.dumps(out, indent=2))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
