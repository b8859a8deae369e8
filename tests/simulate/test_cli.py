"""``kvtier simulate`` end to end: real trace files in, the documented JSON and a PNG out,
and one-line errors for bad input."""

import json
import re

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.simulate.sweep import SweepSpec, run_sweep
from kvtier.simulate.trace import read_trace

KV_PER_TOKEN = 262_144  # 512-token chunks of 128 MiB: 1 GiB holds 8 chunks


@pytest.fixture
def trace_file(tmp_path):
    """Six conversations of up to five turns, interleaved, plus one-off prompts (Mooncake format)."""
    lines, next_id, t = [], 1, 0
    convs = {c: [0] for c in range(6)}  # every prompt starts with the shared block 0
    for turn in range(5):
        for c in range(6):
            if turn > c:  # conversation c has c + 1 turns
                continue
            convs[c] = convs[c] + [next_id, next_id + 1]
            next_id += 2
            tokens = 512 * len(convs[c]) - 100  # last block partial
            lines.append({"timestamp": t, "input_length": tokens, "output_length": 50, "hash_ids": convs[c]})
            t += 1000
            lines.append({"timestamp": t, "input_length": 1500, "output_length": 5,
                          "hash_ids": [0, next_id, next_id + 1]})
            next_id += 2
            t += 500
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def run(*args):
    return CliRunner().invoke(app, ["simulate", *args])


def test_json_plot_and_recommend(tmp_path, trace_file):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0.25",
                 "--cpu-gib", "0.5,1,2", "--policy", "lru,default,s3fifo,belady", "--json", str(out),
                 "--plot", str(png), "--recommend", "--workers", "2")
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert set(doc) == {"elapsed_s", "rows"} and doc["elapsed_s"] > 0
    assert len(doc["rows"]) == 12
    for row in doc["rows"]:
        assert set(row) == {"policy", "cpu_gib", "token_hit_ratio", "chunk_hit_ratio", "bytes_loaded",
                            "tier_hit_ratio", "saved_s"}
        assert abs(sum(row["tier_hit_ratio"].values()) - row["token_hit_ratio"]) < 1e-9
        assert isinstance(row["bytes_loaded"], int) and row["bytes_loaded"] % (512 * KV_PER_TOKEN) == 0
        assert 0 <= row["token_hit_ratio"] <= row["chunk_hit_ratio"] <= 1
    for gib in (0.5, 1, 2):
        hits = {r["policy"]: r["token_hit_ratio"] for r in doc["rows"] if r["cpu_gib"] == gib}
        assert hits["belady"] >= max(hits.values()) - 1e-12
    # The CLI reports what the library computes.
    spec = SweepSpec(512 * KV_PER_TOKEN, 0.25, (0.5, 1.0, 2.0), 0.0, ("lru", "default", "s3fifo", "belady"))
    direct = run_sweep(read_trace(trace_file), spec, workers=1)
    assert [r["token_hit_ratio"] for r in doc["rows"]] == [r.token_hit_ratio for r in direct.rows]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "sizes for default" in result.output and "LRU–Belady gap closed" in result.output
    cpu_line = next(line for line in result.output.splitlines() if line.strip().startswith("cpu "))
    assert "GiB" in cpu_line  # a concrete size, not a restated sweep
    disk_line = next(line for line in result.output.splitlines() if line.strip().startswith("disk "))
    assert "GiB" in disk_line or "none" in disk_line or "not needed" in disk_line
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_model_config_and_disk_tier(tmp_path, trace_file):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                                  "hidden_size": 4096, "torch_dtype": "bfloat16"}))
    out = tmp_path / "r.json"
    result = run("--trace", str(trace_file), "--model", str(config), "--engine-gib", "0", "--cpu-gib", "0.125",
                 "--disk-gib", "1", "--policy", "lru", "--json", str(out))
    assert result.exit_code == 0, result.output
    assert "131,072 B" in result.output and "disk" in result.output
    assert json.loads(out.read_text())["rows"][0]["bytes_loaded"] > 0


@pytest.mark.parametrize("args, fragment", [
    (["--trace", "missing.jsonl"], "does not exist"),
    (["--cpu-gib", "64,lots"], "--cpu-gib"),
    (["--cpu-gib", "64,-1"], "--cpu-gib"),
    (["--policy", "lru,mru"], "unknown eviction policy 'mru'"),
    (["--format", "csv"], "unknown trace format"),
    (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
    (["--model", "nope/config.json"], "exactly one of --model"),
    (["--engine-gib", "-1"], "--engine-gib"),
    (["--cpu-gb-per-s", "0"], "cpu-gb-per-s"),
    # finite but past any real capacity: these used to end in an OverflowError traceback (tester3)
    (["--cpu-gib", "1,1e300"], "--cpu-gib values must be at most 1,048,576 GiB"),
    (["--engine-gib", "1e300"], "--engine-gib must be at most 1,048,576 GiB"),
    (["--disk-gib", "1e300"], "--disk-gib must be at most 1,048,576 GiB"),
    (["--shared-gib", "1e300"], "--shared-gib must be at most 1,048,576 GiB"),
    # an infinite or absurd speed made that cost free and the report silently wrong (fresh-operator tester)
    (["--prefill-tokens-per-s", "inf"], "--prefill-tokens-per-s must be positive and at most 1,000,000,000"),
    (["--cpu-gb-per-s", "1e300"], "--cpu-gb-per-s must be positive and at most 100,000"),
    (["--disk-gb-per-s", "nan"], "--disk-gb-per-s must be positive and at most 100,000"),
    (["--shared-latency-ms", "1e300"], "--shared-latency-ms must be finite, >= 0 and at most 3,600,000"),
    # a flag that does nothing here was silently ignored (a new user): --tp/--kv-dtype only derive --model's
    # bytes per token; a ratio for a tier the run does not have printed "disk tier compressed"
    (["--tp", "2"], "--tp and --kv-dtype apply with --model"),
    (["--kv-dtype", "fp8"], "--tp and --kv-dtype apply with --model"),
    (["--compression-ratio", "disk=2"], "compresses the disk tier, which this run does not have; give --disk-gib"),
])
def test_bad_input_is_one_line(tmp_path, trace_file, args, fragment):
    base = {"--trace": str(trace_file), "--kv-bytes-per-token": str(KV_PER_TOKEN), "--engine-gib": "1",
            "--cpu-gib": "1,2"}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = [part for flag, value in base.items() for part in (flag, value)]
    result = run(*argv)
    assert result.exit_code == 2
    assert fragment in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("value, message", [
    ("-1", "--cpu-pct values must be finite and >= 0 %; got -1"),
    ("150", "--cpu-pct values must be at most 100 % (a cpu tier holding every distinct chunk of the trace); got 150"),
    ("1e300", "--cpu-pct values must be at most 100 %"),
    ("5%", "--cpu-pct must be comma-separated percentages such as 1,5,10,100; '5%' is not a number"),
])
def test_bad_cpu_pct_speaks_percent(trace_file, value, message):
    """--cpu-pct errors named GiB, and 1e300 % ended in an OverflowError traceback (tester3)."""
    result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "1",
                 "--cpu-pct", value)
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {message}" or result.output.startswith(f"error: {message}")
    assert "GiB" not in result.output and len(result.output.strip().splitlines()) == 1


@pytest.mark.parametrize("option, message", [
    ("--cpu-gib", "--cpu-gib must be comma-separated GiB numbers such as 64,128,256; '' is not a number"),
    ("--cpu-pct", "--cpu-pct must be comma-separated percentages such as 1,5,10,100; '' is not a number"),
])
def test_empty_capacity_list_names_its_own_option(trace_file, option, message):
    """An empty --cpu-gib '' was reported as a bad --cpu-pct, an option the user never gave (tester4)."""
    result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "1",
                 option, "")
    assert result.exit_code == 2
    assert result.output.strip() == f"error: {message}"


def test_malformed_trace_line_and_missing_model(tmp_path, trace_file):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(trace_file.read_text() + "{broken\n")
    result = run("--trace", str(bad), "--kv-bytes-per-token", "1024", "--engine-gib", "1", "--cpu-gib", "1")
    assert result.exit_code == 2 and "bad.jsonl line" in result.output and "Traceback" not in result.output
    result = run("--trace", str(trace_file), "--model", str(tmp_path / "config.json"), "--engine-gib", "1",
                 "--cpu-gib", "1")
    assert result.exit_code == 2 and "does not exist" in result.output


def test_three_tiers_admission_and_latency(tmp_path, trace_file):
    out = tmp_path / "t.json"
    args = ("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0",
            "--cpu-gib", "0.25", "--disk-gib", "0.5", "--shared-gib", "1", "--policy", "lru", "--workers", "1")
    result = run(*args, "--json", str(out))
    assert result.exit_code == 0, result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80
    row = json.loads(out.read_text())["rows"][0]
    # the shared tier serves what fell out of cpu and disk; every hit is counted in exactly one tier
    assert row["tier_hit_ratio"]["disk"] > 0 and row["tier_hit_ratio"]["shared"] > 0
    assert sum(row["tier_hit_ratio"].values()) == pytest.approx(row["token_hit_ratio"])
    strict = run(*args, "--disk-admission", "reused", "--shared-admission", "reused", "--json", str(out), "--force")
    assert strict.exit_code == 0, strict.output
    assert "--shared-admission reused models a policy kvtier does not run" in strict.output  # check refuses it
    reused = json.loads(out.read_text())["rows"][0]
    assert "models a policy" not in run(*args, "--json", str(out.with_name("all.json"))).output
    assert reused["tier_hit_ratio"] != row["tier_hit_ratio"]
    from kvtier.core.policies import make_policy
    from kvtier.simulate.replay import replay

    trace = read_trace(trace_file)
    counts = {a: replay(trace, [0] * trace.num_requests, 2, 4, lambda: make_policy("lru"), shared_chunks=8,
                        admission=(a, a)) for a in ("all", "reused")}
    assert counts["reused"].rejected > 0 and counts["all"].rejected == 0  # one-off chunks never reach disk
    assert counts["reused"].disk_stores < counts["all"].disk_stores
    slow = run(*args, "--disk-latency-ms", "100000", "--json", str(out), "--force")
    assert json.loads(out.read_text())["rows"][0]["saved_s"] < row["saved_s"] and slow.exit_code == 0
    bad = run(*args, "--disk-admission", "sometimes")
    assert bad.exit_code == 2 and "--disk-admission must be one of all, reused" in bad.output


def test_cpu_pct_zero_is_a_true_zero_row_like_cpu_gib_zero(tmp_path, trace_file):
    """--cpu-pct 0 used to be rounded up to a 1-chunk tier (breaker F1)."""
    rows = {}
    for option in ("--cpu-gib", "--cpu-pct"):
        out = tmp_path / f"{option[2:]}.json"
        result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0.25",
                     option, "0", "--policy", "lru,default,belady", "--json", str(out), "--workers", "1")
        assert result.exit_code == 0, result.output
        rows[option] = json.loads(out.read_text())["rows"]
    assert [r["cpu_gib"] for r in rows["--cpu-pct"]] == [0, 0, 0]
    assert [r["token_hit_ratio"] for r in rows["--cpu-pct"]] == [r["token_hit_ratio"] for r in rows["--cpu-gib"]]
    assert all(r["tier_hit_ratio"].get("cpu", 0) == 0 for r in rows["--cpu-pct"])


def test_gap_closed_is_blank_where_it_means_nothing():
    from kvtier.simulate.report import GapRow

    assert GapRow(0.0625, lru=0.1483, belady=0.1483 + 0.0115, policy=0.0936).closed is None  # was -375 %
    assert GapRow(1, lru=0.2, belady=0.2, policy=0.2).closed is None
    assert GapRow(1, lru=0.2, belady=0.4, policy=0.3).closed == pytest.approx(0.5)


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_unwritable_output_is_refused_before_the_trace_is_read(tmp_path, option):
    bad_trace = tmp_path / "bad.jsonl"
    bad_trace.write_text("not json\n")
    result = run("--trace", str(bad_trace), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "1",
                 "--cpu-gib", "1", option, str(tmp_path / "no" / "out"))
    assert result.exit_code == 2
    assert result.output.startswith(f"error: {option} ") and "does not exist" in result.output, result.output
    (tmp_path / "d").mkdir()
    result = run("--trace", str(bad_trace), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "1",
                 "--cpu-gib", "1", option, str(tmp_path / "d"))
    assert result.exit_code == 2 and "is a directory" in result.output, result.output


def _table_hits(output: str, policy: str) -> dict[float, str]:
    """``{cpu GiB: hit cell}`` of one policy's rows in the printed table."""
    hits, gib = {}, None
    for line in output.splitlines():
        cells = line.split()
        if len(cells) >= 3 and cells[-1].replace(",", "").isdigit():
            if cells[0].replace(".", "", 1).isdigit():
                gib, cells = float(cells[0]), cells[1:]
            if cells[0] == policy:
                hits[gib] = cells[1]
    return hits


def test_recommend_agrees_with_its_table(tmp_path, trace_file):
    """The recommended cpu size is a row of the table and its hit ratio is that row's, for the
    whole stack as configured; the disk tier given is kept, not resized."""
    result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0.25",
                 "--cpu-gib", "0.25,0.5,1,2", "--disk-gib", "1.5", "--policy", "lru,default", "--recommend",
                 "--workers", "1")
    assert result.exit_code == 0, result.output
    hits = _table_hits(result.output, "default=adaptive")
    assert set(hits) == {0.25, 0.5, 1.0, 2.0}, result.output
    lines: list[str] = []
    for line in result.output.splitlines():  # a size's reason wraps at 80 columns, indented
        if line.startswith(" " * 21) and lines:
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    cpu_line = next(line for line in lines if re.match(r"  cpu +[0-9.]+ GiB ", line))
    gib = float(cpu_line.split()[1])
    assert gib in hits and f"hits {hits[gib]}" in cpu_line, (cpu_line, hits)
    disk_line = next(line for line in lines if line.strip().startswith("disk "))
    assert disk_line.split()[1:3] == ["1.5", "GiB"] and "as given" in disk_line


def test_recommend_skips_a_swept_0_and_announces_its_extra_replays(trace_file):
    """kvtier refuses cpu_gib 0, so the cpu size is never the swept 0 (the line says it was left out);
    with no lower tier given, the extra replays that size a disk tier are announced before they run."""
    result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0.25",
                 "--cpu-gib", "0,0.25", "--policy", "lru", "--recommend", "--workers", "1")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    cpu = re.search(r" cpu +([0-9.]+) GiB ", text)
    assert cpu is not None and float(cpu.group(1)) == 0.25, result.output
    assert "the swept 0 GiB is left out: kvtier refuses cpu_gib 0" in text, result.output
    assert "extra replay with cpu 0.25 GiB" in text or "(extra replays)" in text, result.output
    announced = text.index("sizing a disk tier: up to ")
    assert announced < text.index(" disk ", announced), result.output


def test_the_shared_tier_is_modeled_from_its_registry_record(tmp_path, trace_file):
    """--shared-tier picks the bandwidth and latency defaults of a registered shared tier (TierSpec.model):
    the s3 tier's first-byte latency (100 ms per request served) saves less than Redis's 0.5 ms."""
    from kvtier.core.tiers.registry import spec

    args = ("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0",
            "--cpu-gib", "0.25", "--shared-gib", "1", "--policy", "lru", "--workers", "1")
    saved = {}
    for tier in ("redis", "s3"):
        out = tmp_path / f"{tier}.json"
        result = run(*args, "--shared-tier", tier, "--json", str(out))
        assert result.exit_code == 0, result.output
        model = spec(tier).model
        assert model is not None
        assert f"shared tier modeled as {tier}: {model.gb_per_s:g} GB/s, {model.latency_ms:g} ms" in \
            " ".join(result.output.split())
        row = json.loads(out.read_text())["rows"][0]
        assert row["tier_hit_ratio"]["shared"] > 0
        saved[tier] = row["saved_s"]
    assert saved["s3"] < saved["redis"]
    same = tmp_path / "same.json"
    given = run(*args, "--shared-tier", "s3", "--shared-latency-ms", "0.5", "--json", str(same))
    assert given.exit_code == 0 and "as given" in given.output
    assert json.loads(same.read_text())["rows"][0]["saved_s"] == pytest.approx(saved["redis"])
    bad = run(*args, "--shared-tier", "s4")
    assert bad.exit_code == 2 and "--shared-tier must be one of redis, s3, got 's4'" in bad.output


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_on_a_full_device_names_the_option_and_file(trace_file, option):
    """A write that failed late said "cannot write output (No space left on device: None)" (tester3)."""
    result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "1",
                 "--cpu-gib", "1", "--policy", "lru", "--workers", "1", option, "/dev/full")
    assert result.exit_code == 2, result.output
    assert (f"error: cannot write {option} /dev/full (No space left on device); free space or pass a path in a "
            "writable directory") in result.output
    assert "None" not in result.output


def test_workers_never_exceed_the_runs():
    """--workers 30 for one run forked 30 processes (a pool starts them all at once); a typo such as
    --workers 100000 would fork that many (tester3)."""
    from kvtier.simulate.sweep import pool_size

    assert pool_size(30, 1) == 1 and pool_size(100_000, 12) == 12 and pool_size(2, 12) == 2
    assert 1 <= pool_size(0, 3) <= 3 and pool_size(0, 0) == 1


def test_many_workers_for_few_runs_give_the_rows_of_one_worker(tmp_path, trace_file):
    out1, out2 = tmp_path / "one.json", tmp_path / "many.json"
    base = ["--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0.25",
            "--cpu-gib", "0.5,1", "--policy", "lru"]
    assert run(*base, "--workers", "1", "--json", str(out1)).exit_code == 0
    assert run(*base, "--workers", "64", "--json", str(out2)).exit_code == 0  # not 100000: a regression would fork them
    assert json.loads(out1.read_text())["rows"] == json.loads(out2.read_text())["rows"]


def test_capacities_print_with_thousands_separators_as_the_other_tools(trace_file):
    """The table printed 2048 and 1.04858e+06 GiB where kvtier size and the rest print 2,048 and 1,048,576
    (fresh-user tester)."""
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [
        "simulate", "--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "1500",
        "--cpu-gib", "2048,1048576", "--disk-gib", "12000.5", "--policy", "lru,default", "--workers", "1"])
    assert result.exit_code == 0, result.output
    assert "engine 1,500 GiB, disk 12,000.5 GiB" in result.output
    rows = [line.split()[0] for line in result.output.splitlines() if line.split()[1:2] == ["lru"]]
    assert rows[:2] == ["2,048", "1,048,576"], result.output
    assert "e+0" not in result.output and not re.search(r"\b\d{4,}\b", result.output.split("\n", 2)[2]), \
        result.output


def test_a_compressing_disk_tier_holds_r_times_the_chunks(tmp_path, trace_file):
    """Issue 36 item 5: --compression-ratio disk=2 on 0.5 GiB replays as 1 GiB of uncompressed
    chunks (the same hits, to the byte), more than 0.5 GiB without it; a codec name takes its
    ratio measured in docs/benchmarks.md, and says so."""
    def rows(*extra):
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}.json"
        result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0",
                     "--cpu-gib", "0.125", "--policy", "lru", "--workers", "1", "--json", str(out), *extra)
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())["rows"], result.output

    def disk(found):
        return [(r["tier_hit_ratio"].get("disk", 0), r["bytes_loaded"]) for r in found]

    plain, _ = rows("--disk-gib", "0.5")
    bigger, _ = rows("--disk-gib", "1")
    compressed, said = rows("--disk-gib", "0.5", "--compression-ratio", "disk=2")
    assert disk(compressed) == disk(bigger) and disk(bigger) != disk(plain)
    assert "disk tier compressed: 2× the chunks" in said and "as given" in said
    _, named = rows("--disk-gib", "0.5", "--compression-ratio", "disk=blosc2-zstd-shuffle2")
    assert "1.451×" in named and "docs/benchmarks.md" in named


@pytest.mark.parametrize("value, fragment", [
    ("disk=0.5", "R must be a number >= 1"), ("disk=nan", "R must be a number >= 1"),
    ("disk=zstd", "R must be a number >= 1"), ("cpu=2", "TIER one of disk"), ("disk", "must be TIER=R"),
])
def test_a_bad_compression_ratio_is_one_sentence(trace_file, value, fragment):
    result = run("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0",
                 "--cpu-gib", "0.125", "--disk-gib", "0.5", "--compression-ratio", value)
    assert result.exit_code == 2 and fragment in result.output, result.output
    assert "Traceback" not in result.output


def test_a_trace_and_outputs_named_with_brackets_print_as_named(tmp_path, trace_file):
    """rich read '[prod]' in a file name as markup and printed the name without it."""
    named = tmp_path / "chat[prod].jsonl"
    named.write_text(trace_file.read_text())
    out = tmp_path / "r[prod].json"
    result = run("--trace", str(named), "--kv-bytes-per-token", "2048", "--engine-gib", "0.001", "--cpu-gib", "0.01", "--workers", "1",
                 "--json", str(out))
    assert result.exit_code == 0, result.output
    text = "".join(result.output.split())  # rich wraps a long path anywhere
    assert "chat[prod].jsonl" in text and f"JSON:{out}" in text, result.output


def test_a_swept_cpu_0_is_the_engine_alone_said_so_and_refused_under_a_lower_tier(trace_file):
    """simulate --cpu-gib 0 was accepted silently while check refuses cpu_gib 0 (new user 5). Simulate
    keeps 0 as the engine-alone baseline row and says so; under a disk or shared tier, which kvtier cannot
    run without a cpu tier, it is refused with check's reason."""
    base = ("--trace", str(trace_file), "--kv-bytes-per-token", str(KV_PER_TOKEN), "--engine-gib", "0.25",
            "--policy", "lru", "--workers", "1")
    alone = run(*base, "--cpu-gib", "0,0.25")
    assert alone.exit_code == 0, alone.output
    assert ("note: --cpu-gib 0 is the engine alone (no kvtier), a baseline row; kvtier itself refuses cpu_gib 0 "
            "(every chunk passes through the cpu tier)") in alone.output
    for extra in (("--cpu-gib", "0,0.25", "--disk-gib", "0.5"), ("--cpu-pct", "0,10", "--shared-gib", "1")):
        refused = run(*base, *extra)
        assert refused.exit_code == 2, refused.output
        assert (f"{extra[0]} 0 with --disk-gib or --shared-gib models a lower tier without a cpu tier, which kvtier "
                "refuses (cpu_gib must be above 0: every chunk passes through the cpu tier") in " ".join(
                    refused.output.split())
    assert "note:" not in run(*base, "--cpu-gib", "0.25").output


def test_neither_model_nor_bytes_names_every_form_model_takes(trace_file):
    """"pass exactly one of --model CONFIG_JSON or --kv-bytes-per-token N" (fresh-user tester): --model also
    takes a model directory, a preset or a hub id (read as kvtier size reads it); the line says so."""
    result = run("--trace", str(trace_file), "--engine-gib", "1", "--cpu-gib", "1")
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert "CONFIG_JSON" not in result.output and "preset" in result.output and "hub id" in result.output, \
        result.output
