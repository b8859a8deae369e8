"""A server that keeps streaming past ``max_tokens`` (one token every 0.05 s, forever, never
``[DONE]``) cannot hold ``kvtier bench run``: every token reset the stall deadline, so the run never
ended (``--stall-timeout 5`` still running at 150 s).  The client stops reading once the stream
passes its bound above ``--output-len`` and records the request as failed, with the reason."""

import json
import subprocess
import sys

import pytest


@pytest.mark.parametrize("server", [["--forever", "--gap", "0.05"]], indirect=True)
def test_a_stream_past_max_tokens_fails_the_request_and_the_run_ends(server, tmp_path):
    _, url = server
    out = tmp_path / "run"
    try:
        result = subprocess.run([sys.executable, "-m", "kvtier.cli.main", "bench", "run", "--url", url, "--workload",
                                 "prefix-repetition", "--num-requests", "2", "--prefix-len", "8", "--suffix-len", "4",
                                 "--num-prefixes", "1", "--output-len", "3", "--vocab-size", "500", "--no-progress",
                                 "--stall-timeout", "5", "--out", str(out)],
                                capture_output=True, text=True, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("bench run went on reading a stream that never ends")
    from kvtier.bench.client import max_stream_tokens

    reason = "the stream went past 22 completion tokens for max_tokens 3 without ending; the server ignores max_tokens"
    assert max_stream_tokens(3) == 22  # the bound the reason names: 2 x --output-len + 16
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip().endswith(reason), result.stderr
    failures = [r["error"] for r in json.loads((out / "requests.json").read_text())["requests"]]
    assert failures == [reason, reason]
