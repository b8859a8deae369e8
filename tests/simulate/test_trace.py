"""Trace readers: both formats, gzip, and one clear error per kind of bad input."""

import gzip
import json
from importlib import resources

import pytest

from kvtier.core.keys import chunk_keys, request_root
from kvtier.simulate.trace import TraceError, format_kvtier_record, read_trace


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def mooncake(ts, tokens, ids):
    return json.dumps({"timestamp": ts, "input_length": tokens, "output_length": 10, "hash_ids": ids})


def test_mooncake_keeps_full_blocks_only_and_shares_ids(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [
        mooncake(1000, 1100, [7, 8, 9]),  # 2 full blocks of 512 + a partial one
        mooncake(2500, 1024, [7, 8]),  # exactly 2 full blocks
        "",  # blank lines are skipped
        mooncake(4000, 100, [11]),  # no full block
    ])
    trace = read_trace(path)
    assert trace.num_requests == 3 and trace.block_tokens == 512
    assert trace.times_s == [0.0, 1.5, 3.0]
    assert trace.num_tokens == [1100, 1024, 100]
    assert trace.chunk_keys[0] == trace.chunk_keys[1]  # same hash ids, same dense ids
    assert len(trace.chunk_keys[0]) == 2 and trace.chunk_keys[2] == []
    assert trace.num_chunks == 4 and trace.num_unique_chunks == 2


def test_gzip_and_the_bundled_mooncake_trace():
    path = resources.files("kvtier") / "data" / "mooncake_conversation_trace.jsonl.gz"
    trace = read_trace(str(path))
    assert trace.num_requests == 12_031
    assert all(len(keys) == tokens // 512 for keys, tokens in zip(trace.chunk_keys, trace.num_tokens))
    assert trace.chunk_keys[0][0] == trace.chunk_keys[1][0]  # every prompt starts with block 0


def test_kvtier_jsonl_round_trip_from_real_chunk_keys(tmp_path):
    root = request_root(b"\x01" * 16)
    shared = list(range(600))
    a = chunk_keys(root, shared + [1] * 100, 256)  # 2 full chunks
    b = chunk_keys(root, shared + [2] * 300, 256)  # 3 full chunks, first 2 shared with a
    path = write_lines(tmp_path / "k.jsonl", [format_kvtier_record(10.0, 700, 256, a),
                                              format_kvtier_record(10.25, 900, 256, b)])
    trace = read_trace(gzip_copy(path), "kvtier-jsonl")
    assert trace.block_tokens == 256 and trace.times_s == [0.0, 0.25]
    assert trace.chunk_keys[1][:2] == trace.chunk_keys[0] and len(trace.chunk_keys[1]) == 3
    assert len(set(trace.chunk_keys[1])) == 3


def gzip_copy(path):
    out = path.with_suffix(".jsonl.gz")
    out.write_bytes(gzip.compress(path.read_bytes()))
    return out


def test_format_kvtier_record_rejects_wrong_key_count():
    with pytest.raises(ValueError):
        format_kvtier_record(0.0, 700, 256, [b"x" * 16])


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "not a JSON object"),
    ("[" * 100_000, "nested too deeply"),
    (json.dumps({"input_length": 600, "hash_ids": [1, 2]}), "'timestamp'"),
    (json.dumps({"timestamp": 0, "input_length": -5, "hash_ids": []}), "'input_length'"),
    (json.dumps({"timestamp": 0, "input_length": 600, "hash_ids": "12"}), "'hash_ids'"),
    (json.dumps({"timestamp": 0, "input_length": 600, "hash_ids": [1]}), "--tokens-per-block"),
    (json.dumps({"timestamp": "x", "input_length": 600, "hash_ids": [1, 2]}), "'timestamp'"),
])
def test_malformed_mooncake_line_names_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path / "bad.jsonl", [mooncake(0, 600, [1, 2]), line])
    with pytest.raises(TraceError, match="bad.jsonl line 2") as err:
        read_trace(path)
    assert message in str(err.value)


@pytest.mark.parametrize("record, message", [
    ({"time_s": 0, "num_tokens": 600, "chunk_tokens": 256, "chunk_keys": ["aa"]}, "expected 2"),
    ({"time_s": 0, "num_tokens": 600, "chunk_tokens": 128, "chunk_keys": ["a"] * 4}, "one chunk size"),
    ({"time_s": 0, "num_tokens": 600, "chunk_tokens": 256, "chunk_keys": [1, 2]}, "hex strings"),
])
def test_malformed_kvtier_line(tmp_path, record, message):
    good = {"time_s": 0, "num_tokens": 600, "chunk_tokens": 256, "chunk_keys": ["aa", "bb"]}
    path = write_lines(tmp_path / "bad.jsonl", [json.dumps(good), json.dumps(record)])
    with pytest.raises(TraceError, match=message):
        read_trace(path, "kvtier-jsonl")


def test_kvtier_block_size_must_match_the_option(tmp_path):
    good = {"time_s": 0, "num_tokens": 600, "chunk_tokens": 256, "chunk_keys": ["aa", "bb"]}
    path = write_lines(tmp_path / "k.jsonl", [json.dumps(good)])
    with pytest.raises(TraceError, match="--tokens-per-block"):
        read_trace(path, "kvtier-jsonl", block_tokens=512)


def test_missing_empty_directory_and_unknown_format(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        read_trace(tmp_path / "nope.jsonl")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(write_lines(tmp_path / "empty.jsonl", []))
    with pytest.raises(TraceError, match="directory"):
        read_trace(tmp_path)
    with pytest.raises(TraceError, match="unknown trace format"):
        read_trace(tmp_path / "x.jsonl", "csv")
    (tmp_path / "fake.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "fake.jsonl.gz")


def test_a_trace_of_the_other_format_names_the_format_flag(tmp_path):
    """A Mooncake file read as kvtier-jsonl said "field 'time_s' must be a number >= 0, got None", and the
    other way round "field 'timestamp' ... got None": true, but not that --format was wrong (tester3)."""
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(json.dumps({"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [1, 2]})
                        + "\n")
    kvtier = tmp_path / "k.jsonl"
    kvtier.write_text(json.dumps({"time_s": 0, "num_tokens": 256, "chunk_tokens": 128, "chunk_keys": ["aa", "bb"]})
                      + "\n")
    with pytest.raises(TraceError) as as_kvtier:
        read_trace(mooncake, "kvtier-jsonl")
    assert str(as_kvtier.value) == ("m.jsonl line 1 is a Mooncake record (hash_ids), not a kvtier-jsonl one; read it "
                                    "as mooncake (the format auto, the default, does)")
    with pytest.raises(TraceError) as as_mooncake:
        read_trace(kvtier, "mooncake")
    assert str(as_mooncake.value) == ("k.jsonl line 1 is a kvtier-jsonl record (chunk_keys), not a Mooncake one; "
                                      "read it as kvtier-jsonl (the format auto, the default, does)")
    assert read_trace(mooncake, "mooncake").num_requests == 1 and read_trace(kvtier, "kvtier-jsonl").num_requests == 1
    # the default reads each as what its first record is
    assert (read_trace(mooncake).block_tokens, read_trace(kvtier).block_tokens) == (512, 128)


def test_the_trace_commands_read_either_format_by_default_and_take_one_flag_name(tmp_path):
    """``simulate``, ``size --trace`` and ``trace stats`` read a kvtier-jsonl trace (what ``trace record``
    writes) without a format flag, and each takes ``--trace-format`` (``size`` took only that name, the
    other two only ``--format``, while the readers' errors named ``--format``)."""
    from typer.testing import CliRunner

    from kvtier.cli.main import app

    keys = [f"{i:02x}" for i in range(6)]
    trace = tmp_path / "recorded.jsonl"
    trace.write_text("".join(json.dumps({"time_s": float(t), "num_tokens": 6 * 128 + 5, "chunk_tokens": 128,
                                         "chunk_keys": keys}) + "\n" for t in range(4)))
    runner = CliRunner()
    for flags in ((), ("--trace-format", "kvtier-jsonl")):
        stats = runner.invoke(app, ["trace", "stats", "--trace", str(trace), *flags])
        assert stats.exit_code == 0, stats.output
        assert "4 requests over 3 s, 24 full chunks (6 distinct) of 128 tokens" in stats.output
        sim = runner.invoke(app, ["simulate", "--trace", str(trace), "--kv-bytes-per-token", "1024",
                                  "--engine-gib", "0", "--cpu-gib", "1", "--policy", "lru", "--json",
                                  str(tmp_path / f"sim{len(flags)}.json"), *flags])
        assert sim.exit_code == 0, sim.output
        (row,) = json.loads((tmp_path / f"sim{len(flags)}.json").read_text())["rows"]
        assert row["chunk_hit_ratio"] == 18 / 24  # every request after the first finds its 6 chunks
        size = runner.invoke(app, ["size", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "H100", "--context", "8192",
                                   "--trace", str(trace), *flags])
        assert size.exit_code == 0, size.output
    forced = runner.invoke(app, ["trace", "stats", "--trace", str(trace), "--format", "mooncake"])
    assert forced.exit_code != 0 and "read it as kvtier-jsonl" in forced.output


def test_a_file_of_another_shape_says_what_a_trace_is_not_which_field_is_none(tmp_path):
    """A JSONL of other field names said "field 'timestamp' must be a number >= 0 (ms), got None", and a
    CSV "line 1 is not valid JSON ...; fix or remove that line" (fresh-user tester): the first names the
    fields it has and those a Mooncake line needs, the second says a trace is JSONL."""
    other = write_lines(tmp_path / "other.jsonl", [json.dumps({"ts": 1, "tokens": 100, "prompt": "x"})])
    with pytest.raises(TraceError) as err:
        read_trace(other)
    assert str(err.value).startswith("other.jsonl line 1 has no field 'timestamp' nor 'input_length' nor 'hash_ids' "
                                     "(its fields: 'ts', 'tokens', 'prompt'); a Mooncake trace line has timestamp")
    (tmp_path / "t.csv").write_text("t,tokens\n1,100\n")
    with pytest.raises(TraceError) as err:
        read_trace(tmp_path / "t.csv")
    assert "t.csv line 1 is not JSON" in str(err.value) and "a trace is JSONL" in str(err.value)
    assert "remove that line" not in str(err.value)
    broken = write_lines(tmp_path / "b.jsonl", [json.dumps({"timestamp": 0, "input_length": 3, "hash_ids": [0]}),
                                                '{"timestamp": 1, "inp'])
    with pytest.raises(TraceError, match="b.jsonl line 2 is not valid JSON .*; fix or remove that line"):
        read_trace(broken)
