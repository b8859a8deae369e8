"""The trace workload: Mooncake hash ids become token prefixes on the wire, exactly."""

import gzip
import itertools
import json

import pytest

from kvtier.bench.trace import (
    MOONCAKE_BLOCK_TOKENS,
    TraceRecord,
    bundled_trace_path,
    load_trace,
    scaled_prompt_len,
    trace_workload,
)
from kvtier.bench.workload import TokenSpace, WorkloadError

TOKENS = TokenSpace(seed=11, low=100, high=32000)


@pytest.fixture(scope="module")
def window():
    return load_trace(bundled_trace_path(), start=0, limit=300)


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def common_ids(a, b):
    return common_prefix(a.hash_ids, b.hash_ids)


def test_bundled_trace_is_the_mooncake_conversation_trace():
    records = load_trace(bundled_trace_path())
    assert len(records) == 12031
    first = records[0]
    assert (first.timestamp_ms, first.input_length, first.output_length) == (0, 6758, 500)
    assert first.hash_ids == tuple(range(14))
    assert all(len(r.hash_ids) == -(-r.input_length // MOONCAKE_BLOCK_TOKENS) for r in records)


@pytest.mark.parametrize("tpb", [16, 64, 512])
def test_equal_hash_id_prefixes_give_equal_token_prefixes_and_different_ones_differ(window, tpb):
    workload = trace_workload(window, TOKENS, tokens_per_block=tpb)
    prompts = [r.prompt_token_ids for r in workload.requests]
    num_sharing = 0
    for i, j in itertools.combinations(range(len(window)), 2):
        a, b = window[i], window[j]
        k = common_ids(a, b)
        shared = common_prefix(prompts[i], prompts[j])
        expected = min(k * tpb, len(prompts[i]), len(prompts[j]))
        assert shared >= expected, (i, j)
        if k < min(len(a.hash_ids), len(b.hash_ids)):
            # block k differs in its ids, so the tokens differ inside block k
            assert shared < k * tpb + min(tpb, len(prompts[i]) - k * tpb, len(prompts[j]) - k * tpb), (i, j)
        if k >= 2:
            num_sharing += 1
    assert num_sharing >= 20  # the window really has conversations sharing more than the system prompt


def test_512_tokens_per_block_reproduces_the_trace_lengths(window):
    workload = trace_workload(window, TOKENS, tokens_per_block=512)
    assert [r.prompt_len for r in workload.requests] == [rec.input_length for rec in window]


def test_scaled_lengths_keep_every_block():
    record = TraceRecord(index=0, timestamp_ms=0, input_length=2 * 512 + 5, output_length=3, hash_ids=(1, 2, 3))
    assert scaled_prompt_len(record, 64) == 2 * 64 + 1  # a 5-token tail still gets one token
    assert scaled_prompt_len(record, 512) == 2 * 512 + 5


def test_same_seed_same_requests_other_seed_other_tokens(window):
    a = trace_workload(window[:50], TOKENS, tokens_per_block=64)
    b = trace_workload(window[:50], TokenSpace(seed=11, low=100, high=32000), tokens_per_block=64)
    c = trace_workload(window[:50], TokenSpace(seed=12, low=100, high=32000), tokens_per_block=64)
    assert a == b
    assert [r.prompt_token_ids for r in a.requests] != [r.prompt_token_ids for r in c.requests]
    assert [r.prompt_len for r in a.requests] == [r.prompt_len for r in c.requests]


def test_arrivals_follow_the_timestamps_scaled(window):
    part = window[100:140]
    w = trace_workload(part, TOKENS, time_scale=0.5)
    t0 = part[0].timestamp_ms
    assert [r.arrival_s for r in w.requests] == [(rec.timestamp_ms - t0) / 1000 * 0.5 for rec in part]
    assert all(r.arrival_s == 0 for r in trace_workload(part, TOKENS, time_scale=0).requests)
    assert [r.request_id for r in w.requests] == [f"trace-{rec.index}" for rec in part]


def test_shared_prefix_annotation_counts_blocks_seen_earlier_in_the_window(window):
    w = trace_workload(window, TOKENS, tokens_per_block=64)
    seen: set[int] = set()
    for rec, req in zip(window, w.requests):
        k = 0
        while k < len(rec.hash_ids) and rec.hash_ids[k] in seen:
            k += 1
        assert req.shared_prefix_tokens == min(k * 64, req.prompt_len)
        seen.update(rec.hash_ids)


def test_cuts_and_caps(window):
    w = trace_workload(window[:30], TOKENS, tokens_per_block=64, max_prompt_tokens=300, max_output_tokens=7)
    full = trace_workload(window[:30], TOKENS, tokens_per_block=64)
    assert all(r.prompt_len <= 300 for r in w.requests)
    assert all(r.max_tokens == min(7, rec.output_length) for r, rec in zip(w.requests, window))
    for cut, whole in zip(w.requests, full.requests):
        assert whole.prompt_token_ids[:cut.prompt_len] == cut.prompt_token_ids
    assert any("cut to 300" in n for n in w.notes)


def test_plain_and_gzip_files_load_alike(tmp_path):
    lines = [json.dumps({"timestamp": 5 * i, "input_length": 600, "output_length": 2, "hash_ids": [0, i + 1]})
             for i in range(4)]
    plain = tmp_path / "t.jsonl"
    plain.write_text("\n".join(lines) + "\n")
    packed = tmp_path / "t.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write("\n".join(lines) + "\n")
    assert load_trace(plain, start=1, limit=2) == load_trace(packed, start=1, limit=2)
    assert [r.index for r in load_trace(plain, start=1, limit=2)] == [1, 2]


@pytest.mark.parametrize("content,match", [
    ('{"timestamp": 0}\n', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}\n', "hash_ids"),
    ("not json\n", "bad.jsonl line 1 is not JSON .* a trace is JSONL"),
    ('{"timestamp": 0, "input_length": 5, "hash_ids": [0]}\nnot json\n', "line 2 is not valid JSON"),
])
def test_bad_lines_are_named(tmp_path, content, match):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(WorkloadError, match=match):
        load_trace(path)


def test_missing_file_and_empty_window(tmp_path):
    with pytest.raises(WorkloadError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")
    with pytest.raises(WorkloadError, match="holds no requests"):
        load_trace(bundled_trace_path(), start=20000)


def test_returning_only_keeps_conversations_that_come_back(window):
    from kvtier.bench.trace import returning_only

    kept = returning_only(window)
    assert 0 < len(kept) < len(window)
    assert [r.index for r in kept] == sorted(r.index for r in kept)  # trace order
    for r in kept:  # every kept request shares its first two blocks with another kept one
        assert sum(1 for o in kept if o.hash_ids[:2] == r.hash_ids[:2]) >= 2
    dropped = [r for r in window if r not in kept]
    for r in dropped:
        assert sum(1 for o in window if o.hash_ids[:2] == r.hash_ids[:2]) == 1 or len(r.hash_ids) < 2
    # the selection raises the share of tokens an unlimited cache could serve
    def shared_share(records):
        w = trace_workload(records, TOKENS, tokens_per_block=64)
        return sum(q.shared_prefix_tokens for q in w.requests) / w.num_prompt_tokens
    assert shared_share(kept) > 2 * shared_share(window)


def test_an_empty_trace_file_says_the_file_holds_no_requests(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(WorkloadError, match="holds no requests") as raised:
        load_trace(empty)
    assert "lower --start" not in str(raised.value) and "trace file" in str(raised.value)
    from typer.testing import CliRunner

    from kvtier.cli.main import app

    result = CliRunner().invoke(app, ["bench", "run", "--url", "http://127.0.0.1:9", "--workload", "trace",
                                      "--trace", str(empty)])
    assert result.exit_code == 2, result.output
    assert "holds no requests" in result.output and "lower --start" not in result.output
