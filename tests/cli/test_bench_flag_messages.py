"""bench's refusals of a flag name the flag and the fix in one sentence (fresh-user tester, user62):
``bench compare --arms baseline --kvtier-config cpu.yaml`` started the baseline's vLLM with the file
unused, where ``--redis`` and ``--node-gib`` without their arm are refused; ``bench run
--request-rate -1`` explained itself with a note about nan."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app


@pytest.mark.parametrize("arms", ["baseline", "baseline,example"])
def test_compare_refuses_a_kvtier_config_no_arm_reads(tmp_path: Path, arms: str) -> None:
    from kvtier.launch.testmodel import write_model

    model = write_model(tmp_path / "tiny", "tiny", weights="none")
    (tmp_path / "cpu.yaml").write_text("cpu_gib: 0.5\n")
    result = CliRunner().invoke(app, ["bench", "compare", "--model", str(model), "--arms", arms, "--max-model-len",
                                      "2048", "--out", str(tmp_path / "out"), "--kvtier-config",
                                      str(tmp_path / "cpu.yaml")], prog_name="kvtier")
    assert result.exit_code == 2, result.output
    assert result.stderr == ("error: --kvtier-config configures the kvtier arms (and the native arm's cpu_gib) only; "
                             "add kvtier, kvtier-redis, kvtier-s3, kvtier-node or native to --arms, or drop it\n")
    assert not (tmp_path / "out").exists()  # refused before any server or report directory


@pytest.mark.parametrize("rate", ["-1", "0", "nan", "2000000"])
def test_run_refuses_a_request_rate_out_of_range_in_one_plain_sentence(rate: str) -> None:
    result = CliRunner().invoke(app, ["bench", "run", "--url", "http://127.0.0.1:9", "--workload",
                                      "prefix-repetition", "--request-rate", rate], prog_name="kvtier")
    assert result.exit_code == 2, result.output
    assert result.stderr == (f"error: --request-rate {float(rate)} must be from 0.001 to 1,000,000 requests per "
                             "second; omit it for a closed loop\n"), result.stderr
