"""`kvtier bench run` and `bench compare` against real local HTTP servers that fail (break test
F-bench-1, F-bench-2): every wait ends (a server that trickles its model list, its /metrics or its
completions), and a run where no request succeeded exits 2 with the first failure's reason."""

import os
import subprocess
import sys

import pytest

from kvtier.bench.arms import make_arm
from kvtier.bench.client import ClientOptions, run_workload
from kvtier.bench.compare import ArmFailure, ArmOutcome, CompareResult, judge_arms, run_failure
from kvtier.bench.meters import deltas, scrape
from kvtier.bench.prefix_repetition import prefix_repetition_workload
from kvtier.bench.report import compare_json, markdown, print_table
from kvtier.bench.verdict import Thresholds
from kvtier.bench.workload import TokenSpace
from kvtier.launch.serve import ServerSpec
from tests.engine_layout import WORKER_IN_ENGINE_CORE

TOKENS = TokenSpace(seed=0, low=10, high=500)
WORKLOAD = ["--workload", "prefix-repetition", "--num-requests", "4", "--prefix-len", "8", "--suffix-len", "4",
            "--num-prefixes", "2", "--output-len", "3", "--vocab-size", "500", "--no-progress"]


def bench_run(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    # generous bound: the command must end by itself well before it (the machine is noisy)
    return subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", url, *WORKLOAD, *args],
                          capture_output=True, text=True, timeout=90, check=False)


def error_line(out: subprocess.CompletedProcess[str]) -> str:
    """The one `error:` line of a failed command (and no traceback)."""
    assert out.returncode == 2, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


@pytest.mark.parametrize("server", [["--trickle", "/v1/models"]], indirect=True)
def test_a_trickling_model_list_ends_the_start_up_probe(server):
    _, url = server
    line = error_line(bench_run(url, "--stall-timeout", "3"))
    assert f"{url}/v1/models did not send its model list within 10 s" in line


@pytest.mark.parametrize("server", [["--trickle", "/metrics"]], indirect=True)
def test_a_trickling_metrics_page_ends_the_scrape(server):
    _, url = server
    line = error_line(bench_run(url, "--stall-timeout", "3"))
    assert f"{url}/metrics did not send its /metrics within 10 s" in line


@pytest.mark.parametrize("server", [["--trickle", "/v1/completions"]], indirect=True)
def test_trickling_completions_stall_and_no_success_exits_2(server):
    _, url = server
    line = error_line(bench_run(url, "--stall-timeout", "2"))
    assert "no request succeeded: 4 of 4 requests failed; the first, prefix-" in line
    assert line.endswith("stall: no new token for 2 s")


@pytest.mark.parametrize("server", [["--reject-first", "1000"]], indirect=True)
def test_every_request_rejected_exits_2_with_the_servers_reason(server, tmp_path):
    _, url = server
    out = bench_run(url, "--out", str(tmp_path / "run"))
    line = error_line(out)
    assert "no request succeeded: 4 of 4 requests failed; the first, prefix-" in line
    assert ": HTTP 400: Token id " in line and line.endswith("is out of vocabulary")
    assert "requests: 0 ok, 4 failed" in out.stdout  # the summary is still printed and written
    assert (tmp_path / "run" / "requests.json").is_file()


@pytest.mark.parametrize("server", [["--reject-first", "1"]], indirect=True)
def test_some_requests_rejected_warns_with_count_and_reason_and_exits_0(server):
    _, url = server
    out = bench_run(url, "--max-concurrency", "1")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "requests: 3 ok, 1 failed" in out.stdout
    assert "warning: 1 of 4 requests failed; the first, prefix-0: HTTP 400: Token id" in out.stdout
    assert "the figures are over the 3 that succeeded" in out.stdout


@pytest.mark.parametrize("value", ["0", "-3"])
def test_vocab_size_below_1_is_refused(value):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", "http://127.0.0.1:9",
                          "--vocab-size", value], capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 2 and "Invalid value for '--vocab-size'" in out.stderr, out.stderr


@pytest.mark.parametrize("args, said", [
    (["--workload", "foo"], "unknown workload 'foo'"),
    (["--workload", "prefix-repetition", "--request-rate", "nan"], "--request-rate nan must be from 0.001"),
    (["--workload", "multi-round", "--think-time", "inf"], "--think-time and --session-interval are seconds"),
    (["--workload", "trace", "--trace", "/nonexistent/t.jsonl"], "trace file /nonexistent/t.jsonl does not exist"),
    (["--workload", "trace", "--returning-only", "--limit", "1"], "no conversation of the trace window"),
    (["--vocab-size", "2"], "vocabulary size 2 is too small"),
    # the default workload is trace: these ran 200 trace requests and ignored both (tester4)
    (["--num-requests", "60", "--prefix-len", "512"], ("--num-requests, --prefix-len are options of the "
     "prefix-repetition workload, not of trace, and would be ignored; add --workload prefix-repetition or drop them")),
])
def test_a_bad_workload_option_is_refused_before_the_server_is_reached(args, said):
    """With no server on --url, a bad workload option was reported as "cannot reach" (clifix2): the
    options are checked before any request now, and the sentence is the option's."""
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", "http://127.0.0.1:9",
                          *args], capture_output=True, text=True, timeout=60, check=False)
    line = error_line(out)
    assert said in line and "cannot reach" not in line


def test_a_tiny_vocab_size_is_one_error_line(server):
    _, url = server
    line = error_line(subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", url,
                                      "--vocab-size", "2"], capture_output=True, text=True, timeout=60, check=False))
    assert "vocabulary size 2 is too small" in line and "--vocab-size" in line


@pytest.mark.parametrize("command", ["run", "compare"])
def test_a_negative_seed_is_one_error_line_before_any_server(command, tmp_path):
    """--seed -1 ended in TokenSpace's ValueError traceback (tester4); it is refused with the other
    workload knobs, before `run` probes --url and before `compare` starts a server."""
    target = ["--url", "http://127.0.0.1:9"] if command == "run" else ["--model", "Qwen/Qwen3-0.6B",
                                                                       "--out", str(tmp_path / "out")]
    line = error_line(subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", command, *target, *WORKLOAD,
                                      "--seed", "-1"], capture_output=True, text=True, timeout=60, check=False))
    assert line == "error: --seed -1 is negative; give a seed >= 0"
    assert not (tmp_path / "out").exists()  # compare made its report directory first, and left it empty


@pytest.mark.parametrize("server", [["--reject-first", "1000", "--reject-in-stream"]], indirect=True)
def test_an_error_chunk_in_the_stream_is_the_reason(server):
    _, url = server
    line = error_line(bench_run(url))
    assert ": server error 400: Token id " in line and line.endswith("is out of vocabulary")


@pytest.mark.parametrize("server", [["--trickle", "/v1/completions"]], indirect=True)
def test_client_stalls_on_bytes_without_tokens(server):
    _, url = server
    w = prefix_repetition_workload(TOKENS, num_requests=2, prefix_len=4, suffix_len=2, num_prefixes=1, output_len=2)
    run = run_workload(w, ClientOptions(url, "m", max_concurrency=2, stall_timeout_s=1.0, progress=False))
    assert [r.error for r in run.results] == ["stall: no new token for 1 s"] * 2


@pytest.mark.parametrize("server", [["--reject-first", "5"]], indirect=True)
def test_compare_gives_no_verdict_to_an_arm_whose_requests_all_failed(server, tmp_path, capsys):
    """Two arms on one real server: the first five requests are answered 400, so every request of
    the `kvtier` arm and the first of the baseline fail.  The kvtier arm is a failure with the
    server's reason and no verdict; the baseline keeps its verdict, and the report names its one
    failed request."""
    _, url = server
    w = prefix_repetition_workload(TOKENS, num_requests=4, prefix_len=8, suffix_len=4, num_prefixes=2, output_len=2)
    options = ClientOptions(url, "m", max_concurrency=1, progress=False)
    outcomes = []
    for name in ("kvtier", "baseline"):
        arm = make_arm(name, tmp_path)
        before = scrape(url)
        run = run_workload(w, options)
        meters = deltas(before, scrape(url))
        why = run_failure(run)
        failure = None if why is None else ArmFailure(why, run.failed_at, tmp_path / f"{name}.log")
        outcomes.append(ArmOutcome(arm, tmp_path / f"{name}.log", 0.0, run, None if failure else meters, failure))
    arms = [o.arm for o in outcomes]
    result = CompareResult(workload=w, engine=ServerSpec(model="m"), outcomes=tuple(outcomes),
                           arms=judge_arms(arms, outcomes, Thresholds()))
    kv, base = result.arm_result("kvtier"), result.arm_result("baseline")
    assert kv is not None and base is not None
    assert kv.verdict is None and not kv.ok
    assert kv.failure is not None and kv.failure.reason.startswith("no request succeeded: 4 of 4 requests failed")
    assert "HTTP 400: Token id" in kv.failure.reason
    assert base.ok and base.verdict is not None
    assert set(compare_json(result)["failed"]) == {"kvtier"}
    assert base.runs[0].summary().num_ok == 3
    print_table(result)
    printed = capsys.readouterr().out
    assert "no request succeeded: 4 of 4 requests failed" in printed
    assert "baseline: 1 of 4 requests failed; the first, prefix-0: HTTP 400: Token id" in printed
    report = markdown(result, None, None)
    assert "FAILED: no request succeeded" in report
    assert "partial failure: 1 of 4 requests failed; the first, prefix-0: HTTP 400" in report


@pytest.mark.engine
@pytest.mark.shares_cpu
def test_compare_where_every_arm_is_rejected_exits_2_with_the_reason(tmp_path):
    """A real vLLM (tiny test model) rejects token ids beyond its 2,048-token vocabulary: the one
    arm fails (no verdict) and the command ends with one error line naming the server's reason."""
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "compare", "--model", str(model),
                          "--arms", "baseline", "--max-model-len", "2048", "--engine-cache-tokens", "4096",
                          "--enforce-eager", "--workload", "prefix-repetition", "--num-requests", "2",
                          "--prefix-len", "32", "--suffix-len", "8", "--output-len", "2", "--max-concurrency", "1",
                          "--vocab-size", "99999999", "--no-progress", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=900, check=False,
                         env={**os.environ, **WORKER_IN_ENGINE_CORE})  # one start-up import less (tests/engine_layout.py)
    line = error_line(out)
    assert "every arm failed (the first, baseline: " in line
    assert "server error 400: Token id " in line and "is out of vocabulary" in line
    assert "FAILED" in out.stdout and "verdict: " not in out.stdout


@pytest.mark.parametrize("where, message", [
    ("file", "is an existing file, not a directory"),
    ("file/sub", "cannot be created (Not a directory)"),
])
def test_compare_refuses_an_unusable_out_before_any_server_starts(tmp_path, where, message):
    """Break test F-bench-3: `--out` an existing file or a path under one was a traceback from the launcher."""
    (tmp_path / "file").write_text("an old report")
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "compare", "--model",
                          str(tmp_path / "no-model"), "--arms", "baseline", *WORKLOAD, "--out", str(tmp_path / where)],
                         capture_output=True, text=True, timeout=90, check=False)
    line = error_line(out)
    assert f"--out {tmp_path / where} {message}" in line
    assert (tmp_path / "file").read_text() == "an old report" and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("model, message", [
    ("no-model", "does not exist; give the model's directory (the one holding config.json) or a hub id"),
    ("a-file", "is not a directory; give the model's directory"),
    ("empty-dir", "holds no config.json, so it is not a model directory"),
])
def test_compare_refuses_a_model_path_that_is_no_model_before_any_server_starts(tmp_path, model, message):
    """tester3: a mistyped --model path said "cannot tell the vocabulary size ...; pass --vocab-size",
    which sent the user to a flag that only let vLLM fail later, after a server start."""
    (tmp_path / "a-file").write_text("not a model")
    (tmp_path / "empty-dir").mkdir()
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "compare", "--model",
                          str(tmp_path / model), "--arms", "baseline", *WORKLOAD, "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=90, check=False)
    assert out.returncode == 2, out.stderr
    line = error_line(out)
    assert line.startswith(f"error: --model {tmp_path / model} ") and message in line, line
    assert "vocabulary" not in out.stderr


def test_compare_refuses_a_json_path_in_a_missing_directory_before_creating_out(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "compare", "--model",
                          str(tmp_path / "no-model"), "--arms", "baseline", *WORKLOAD, "--out", str(tmp_path / "r"),
                          "--json", str(tmp_path / "missing" / "x.json")], capture_output=True, text=True, timeout=90,
                         check=False)
    assert "directory" in error_line(out) and "does not exist" in error_line(out)
    assert not (tmp_path / "r").exists()


def test_run_refuses_an_out_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    line = error_line(bench_run("http://127.0.0.1:9", "--out", str(tmp_path / "file")))
    assert f"--out {tmp_path / 'file'} is an existing file, not a directory" in line


@pytest.mark.parametrize("server", [[], ["--trickle", "/v1/completions"]], indirect=True)
def test_server_complete_ends_within_its_timeout(server, tmp_path, request):
    """`Server.complete` (the launcher's test completion) has a total deadline: a trickle ends it."""
    from kvtier.core.errors import ServerAnswerError
    from kvtier.launch.serve import Server

    _, url = server
    launcher = Server(ServerSpec(model="m", max_model_len=4096), tmp_path / "log", port=int(url.rsplit(":", 1)[1]))
    if "--trickle" in request.node.callspec.params["server"]:
        with pytest.raises(ServerAnswerError, match="did not send a completion within 2 s"):
            launcher.complete([1, 2, 3], max_tokens=3, timeout_s=2)
    else:
        ttft, text = launcher.complete([1, 2, 3], max_tokens=3, timeout_s=30)
        assert text == " t1 t2 t3" and 0 < ttft < 30


@pytest.mark.parametrize("command", ["run", "compare"])
def test_the_old_tokens_per_block_spelling_names_the_new_flag(command, tmp_path):
    """bench's --tokens-per-block was a scale (token ids sent per 512-token trace block) where simulate, size
    and trace stats read the same flag as the trace's own block size (new user 5): bench's is
    --sent-tokens-per-block now, and the old spelling is refused with a sentence naming it."""
    target = ["--url", "http://127.0.0.1:9"] if command == "run" else ["--model", "Qwen/Qwen3-0.6B",
                                                                       "--out", str(tmp_path / "out")]
    line = error_line(subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", command, *target,
                                      "--tokens-per-block", "32"], capture_output=True, text=True, timeout=60,
                                     check=False))
    assert line == ("error: bench's --tokens-per-block is now --sent-tokens-per-block (token ids sent per 512-token "
                    "trace block; --tokens-per-block elsewhere is a trace's own block size): pass "
                    "--sent-tokens-per-block 32")
    assert not (tmp_path / "out").exists()
    line = error_line(subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", command, *target,
                                      "--sent-tokens-per-block", "32", "--seed", "-1"], capture_output=True,
                                     text=True, timeout=60, check=False))
    assert line == "error: --seed -1 is negative; give a seed >= 0"  # the new flag is taken


def test_a_model_the_server_does_not_serve_is_named_with_those_it_does(server, tmp_path):
    """``--model nosuch`` said "cannot tell the vocabulary size of model 'nosuch'" (fresh-user tester):
    the real mistake is a model the server does not serve; a missing --baseline said it was "not the
    summary.json of a bench run" rather than that it does not exist."""
    _, url = server
    line = error_line(bench_run(url, "--model", "nosuch"))
    assert line == (f"error: the server at {url} serves 'm' (its /v1/models), not 'nosuch'; pass one of those to "
                    "--model, or leave --model out")
    line = error_line(bench_run(url, "--baseline", str(tmp_path / "missing.json")))
    assert "missing.json does not exist; point it at the summary.json of an earlier" in line
