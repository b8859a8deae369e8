"""``kvtier trace synth`` / ``stats``: seeded Mooncake-format traces of each regime, readable by the
one Mooncake reader, with the structure their regime promises."""

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.simulate.reuse import regime, reuse_histogram
from kvtier.simulate.synth import REGIMES, SynthError, generate, make_params
from kvtier.simulate.trace import read_trace
from kvtier.tools.mooncake import iter_records


def synth_file(tmp_path, name, requests=600, seed=3, *sets):
    path = tmp_path / f"{name}-{seed}.jsonl.gz"
    args = ["trace", "synth", "--regime", name, "--out", str(path), "--requests", str(requests), "--seed", str(seed)]
    for s in sets:
        args += ["--set", s]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return path


@pytest.mark.parametrize("name", list(REGIMES))
def test_each_regime_is_seeded_valid_mooncake(tmp_path, name):
    a = synth_file(tmp_path, name, 400, 1)
    records = list(iter_records(a, block_tokens=512))  # raises on any malformed record
    assert len(records) == 400
    assert [r.timestamp_ms for r in records] == sorted(r.timestamp_ms for r in records)
    again = generate(name, make_params(name, {}), 400, 1)
    assert [r.hash_ids for r in again] == [r.hash_ids for r in records]
    other = generate(name, make_params(name, {}), 400, 2)
    assert [r.hash_ids for r in other] != [r.hash_ids for r in records]


def test_chat_turns_extend_the_previous_prompt():
    records = generate("chat", make_params("chat", {"single_turn_share": "0", "think_median_s": "5"}), 300, 5)
    full = [r.hash_ids[: r.input_length // 512] for r in records]
    prefixes = {ids for ids in full}
    extended = sum(1 for ids in full if any(ids[:k] in prefixes for k in range(len(ids) - 1, 2, -1)))
    assert extended > 100  # later turns start with a whole earlier prompt


@pytest.mark.parametrize("name, expected", [("cycle", "cycling"), ("batch", "scan")])
def test_regime_is_recognised_from_the_histogram(tmp_path, name, expected):
    trace = read_trace(synth_file(tmp_path, name, 1500, 0))
    hist = reuse_histogram(trace)
    assert hist.uses == trace.num_chunks and hist.footprint == trace.num_unique_chunks
    assert regime(hist) == expected


def test_reuse_distances_are_exact_on_a_hand_trace():
    from tests.simulate.helpers import make_trace

    # a b c a: a's reuse distance is 2 (b, c) of 3 distinct: bucket 50-100 %.
    hist = reuse_histogram(make_trace([([0], 1), ([1], 1), ([2], 1), ([0], 1)]))
    assert hist.first_uses == 3 and hist.buckets[-1] == 1 and sum(hist.buckets) == 1


def test_stats_command_and_bad_parameters(tmp_path):
    path = synth_file(tmp_path, "cycle", 300, 0, "prompts=20")
    result = CliRunner().invoke(app, ["trace", "stats", "--trace", str(path)])
    assert result.exit_code == 0 and "regime: cycling" in result.output
    for sets, message in ((["think_median_s=abc"], "must be float"), (["bogus=1"], "no parameter 'bogus'"),
                          (["single_turn_share=2"], "between 0 and 1"), (["mean_turns=1"], "at least 2"),
                          (["novalue"], "NAME=VALUE"), (["think_sigma=1e308"], "at most 4, got 1e+308"),
                          (["mean_turns=inf"], "at most 1,000, got inf"), (["think_median_s=nan"], "got nan"),
                          (["user_median_tokens=1e12"], "chat must be positive and at most 1,000,000")):
        args = ["trace", "synth", "--regime", "chat", "--out", str(tmp_path / "x.jsonl")]
        result = CliRunner().invoke(app, args + [a for s in sets for a in ("--set", s)])
        assert result.exit_code == 2 and message in result.output, result.output
    with pytest.raises(SynthError, match="unknown regime"):
        make_params("video", {})
    with pytest.raises(SynthError, match="1,000,000 tokens .125,000 blocks of 8.* bound of 65,536 blocks per prompt"):
        generate("chat", make_params("chat", {"system_tokens": "1000000"}), 10, 0, 8)
    with pytest.raises(SynthError, match="more than 20,000,000 block ids"):  # bounded memory, not an OOM
        generate("cycle", make_params("cycle", {"prompt_tokens": "1000000", "prompts": "10"}), 10_000, 0, 16)
    result = CliRunner().invoke(app, ["trace", "stats", "--trace", str(path), "--tokens-per-block", "0"])
    assert result.exit_code == 2 and "--tokens-per-block must be a positive integer, got 0" in result.output


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_rate_per_s_below_one_per_30_days_is_refused(regime):
    """--set rate_per_s=1e-300 was accepted and wrote timestamps of about 300 digits (tester4); the
    slowest rate accepted, one per 30 days, still generates."""
    with pytest.raises(SynthError, match=f"rate_per_s of regime {regime} must be at least 3.9e-07 "
                                         r"\(one per 30 days\) and at most 100,000, got 1e-300"):
        make_params(regime, {"rate_per_s": "1e-300"})
    slowest = make_params(regime, {"rate_per_s": str(1 / (30 * 86_400))})
    assert len(generate(regime, slowest, 3, 0, 512)) == 3


def test_synth_and_stats_count_the_same_distinct_blocks(tmp_path):
    """One file, one count: synth counted every hash id (a request's last, partial block too) and
    stats only full blocks (33,840 vs 21,869 in one file); both now count the full blocks."""
    import re

    path = tmp_path / "chat.jsonl"
    made = CliRunner().invoke(app, ["trace", "synth", "--regime", "chat", "--out", str(path), "--requests", "400"])
    stats = CliRunner().invoke(app, ["trace", "stats", "--trace", str(path)])
    assert made.exit_code == 0 and stats.exit_code == 0, made.output + stats.output
    synth_count = int(re.search(r"([\d,]+) distinct full blocks", made.output)[1].replace(",", ""))
    stats_count = int(re.search(r"\(([\d,]+) distinct\)", stats.output)[1].replace(",", ""))
    every_id = len({b for r in iter_records(path, block_tokens=512) for b in r.hash_ids})
    assert synth_count == stats_count == read_trace(path).num_unique_chunks < every_id


def test_stats_of_a_trace_with_no_full_chunk_says_there_is_nothing_to_classify(tmp_path):
    """It printed a histogram of 0 % rows and "regime: scan" (a new user's report)."""
    path = tmp_path / "short.jsonl"
    path.write_text('{"timestamp":0,"input_length":10,"output_length":1,"hash_ids":[1]}\n'
                    '{"timestamp":1,"input_length":10,"output_length":1,"hash_ids":[1]}\n')
    result = CliRunner().invoke(app, ["trace", "stats", "--trace", str(path)])
    assert result.exit_code == 0 and "0 full chunks" in result.output
    assert "no reuse to classify" in result.output and "regime:" not in result.output and "%" not in result.output


def test_a_synth_of_another_block_size_says_the_flag_its_readers_need(tmp_path):
    """synth --block-tokens 16 wrote a file that trace stats and simulate refused without
    --tokens-per-block 16, and nothing said so (new user 5): a Mooncake line has no field for it, so
    the success line names the flag, and the file read with it is accepted."""
    path = tmp_path / "syn.jsonl"
    result = CliRunner().invoke(app, ["trace", "synth", "--regime", "chat", "--block-tokens", "16", "--requests", "50",
                                      "--out", str(path)])
    assert result.exit_code == 0 and result.output.rstrip().endswith(
        "; read it with --tokens-per-block 16 (trace stats, simulate, size), which otherwise assume Mooncake's 512")
    assert CliRunner().invoke(app, ["trace", "stats", "--trace", str(path)]).exit_code == 2
    read = CliRunner().invoke(app, ["trace", "stats", "--trace", str(path), "--tokens-per-block", "16"])
    assert read.exit_code == 0 and "of 16 tokens" in read.output
    default = CliRunner().invoke(app, ["trace", "synth", "--regime", "chat", "--requests", "50",
                                       "--out", str(tmp_path / "512.jsonl")])
    assert default.exit_code == 0 and "--tokens-per-block" not in default.output  # 512 is what readers assume
