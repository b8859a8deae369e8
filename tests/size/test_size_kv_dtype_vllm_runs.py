"""``--kv-dtype`` names only a KV cache dtype vLLM runs (auto, bf16/fp16, fp8), in size and simulate alike.

Seen: ``kvtier size --model Qwen/Qwen3-8B --kv-dtype int8 --offload-gib 10`` sized the KV at one byte
an element (72 KiB a token) and printed serve lines without ``--kv-cache-dtype``, so vLLM would keep
it at the model's bf16, twice the bytes; ``fp32`` the other way (vLLM has neither as a KV cache dtype:
``CacheDType`` in vllm/config/cache.py). ``int8``/``fp32`` stay known as checkpoint dtypes."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvtier.cli.main import app
from kvtier.core.dtypes import DTYPE_BYTES, short_name

runner = CliRunner()


@pytest.mark.parametrize("dtype", ["int8", "uint8", "fp32", "float32"])
def test_a_dtype_vllm_keeps_no_kv_cache_in_is_refused(dtype):
    assert short_name(dtype) is not None and DTYPE_BYTES[dtype] in (1, 4)  # known, as a checkpoint's dtype
    size = runner.invoke(app, ["size", "--model", "Qwen/Qwen3-8B", "--kv-dtype", dtype, "--offload-gib", "10"])
    assert size.exit_code == 2 and "Traceback" not in size.output, size.output
    assert f"--kv-dtype {dtype!r} is not one of auto, bf16, fp16, fp8" in size.output, size.output
    simulate = runner.invoke(app, ["simulate", "--trace", "bundled", "--model", "Qwen/Qwen3-8B", "--kv-dtype", dtype,
                                   "--engine-gib", "50", "--cpu-gib", "100"])
    assert simulate.exit_code == 2 and f"--kv-dtype {dtype!r} is not one of" in simulate.output, simulate.output


@pytest.mark.parametrize(("dtype", "per_token"), [("bf16", 147456), ("FP16", 147456), ("fp8_e5m2", 73728)])
def test_the_kv_cache_dtypes_vllm_runs_are_sized(dtype, per_token):
    size = runner.invoke(app, ["size", "--model", "Qwen/Qwen3-8B", "--kv-dtype", dtype, "--json"])
    assert size.exit_code == 0, size.output
    assert f'"kv_bytes_per_token": {per_token}' in size.output
